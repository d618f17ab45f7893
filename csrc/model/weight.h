// Weights as the checkpoint stores them, never copied: dense rows [rows, cols] row-major in f32/f16/bf16,
// or MLX affine group quantization (uint32-packed codes, bits 4 or 8, LSB first, one scale and bias per
// `group` inputs; MODEL.md section 9).
//
// Weight (what the graph and every backend see): a place in a checkpoint mapping registered once with
// the backend (mapping id + byte offsets), a format and a shape. Routed experts are stacked: one base
// plus a byte stride per expert, the layout of fused HF tensors and of MLX switch_mlp.
// WeightView (what the CPU kernels see): the same weight resolved to host pointers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace lily {

enum class DType : uint8_t { F32, F16, BF16, I32 };

inline size_t dtype_size(DType t) { return t == DType::F16 || t == DType::BF16 ? 2 : 4; }
const char* dtype_name(DType t);

// Format and shape, shared by both views.
struct WeightFormat {
  enum class Kind : uint8_t { Dense, Affine };
  Kind kind = Kind::Dense;
  DType dtype = DType::F32;        // Dense: element type
  int64_t rows = 0, cols = 0;      // logical shape [out, in] (of one expert when stacked)
  int bits = 0, group = 0;         // Affine only
  DType scale_dtype = DType::BF16;

  bool quantized() const { return kind == Kind::Affine; }
  // Bytes of one stored row (codes only for Affine).
  size_t row_bytes() const {
    return quantized() ? size_t(cols) * size_t(bits) / 8 : size_t(cols) * dtype_size(dtype);
  }
  size_t scale_bytes() const {  // of the scales (and again of the biases) of one matrix
    return quantized() ? size_t(rows) * size_t(cols / group) * dtype_size(scale_dtype) : 0;
  }
  size_t bytes() const { return row_bytes() * size_t(rows) + 2 * scale_bytes(); }
  std::string describe() const;  // "q4g64" / "bf16" ...
};

struct Weight : WeightFormat {
  // Codes (or elements), scales and biases each name their mapping: a sharded checkpoint may split them.
  int32_t mapping = -1, scale_mapping = -1, bias_mapping = -1;
  uint64_t data = 0, scales = 0, biases = 0;  // byte offsets into those mappings
  int64_t experts = 0;                        // 0: one matrix; E: stacked, expert e at offset + e * stride
  uint64_t data_stride = 0, scale_stride = 0, bias_stride = 0;

  bool valid() const { return mapping >= 0; }
  Weight expert(int64_t e) const {  // one expert of a stacked weight, as a plain matrix
    Weight w = *this;
    w.experts = 0;
    w.data += uint64_t(e) * data_stride;
    w.scales += uint64_t(e) * scale_stride;
    w.biases += uint64_t(e) * bias_stride;
    return w;
  }
  size_t total_bytes() const { return bytes() * size_t(experts ? experts : 1); }
};

struct WeightView : WeightFormat {
  const void* data = nullptr;    // Dense: elements; Affine: uint32 codes
  const void* scales = nullptr;  // Affine only: [rows, cols/group]
  const void* biases = nullptr;
};

// bf16 / fp16 <-> fp32 scalars (the CPU kernels use vector forms of the same conversions).
inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
float f16_to_f32(uint16_t h);

// Element i of an array that may sit at any address: MLX's safetensors writer does not pad its header, so
// mapped tensors can start at odd offsets. Typed loads through a misaligned pointer are undefined
// behaviour (UBSan reports them); memcpy is the defined form and compiles to the same single load.
template <class T>
inline T load_unaligned(const void* p, int64_t i) {
  T v;
  __builtin_memcpy(&v, static_cast<const char*>(p) + size_t(i) * sizeof(T), sizeof(T));
  return v;
}

// Element `i` of a scale/bias (or dense weight) array of the given dtype (f32, f16 or bf16).
inline float load_scalar(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::BF16: return bf16_to_f32(load_unaligned<uint16_t>(p, i));
    case DType::F16: return f16_to_f32(load_unaligned<uint16_t>(p, i));
    default: return load_unaligned<float>(p, i);
  }
}

}  // namespace lily
