// A weight matrix as the checkpoint stores it, viewed in place (memory-mapped, never copied).
// Dense rows are [rows, cols] row-major in f32/f16/bf16. Affine rows are MLX group quantization:
// uint32-packed codes (bits 4 or 8, LSB first), one scale and bias per `group` inputs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace lily {

enum class DType : uint8_t { F32, F16, BF16, I32 };

inline size_t dtype_size(DType t) { return t == DType::F16 || t == DType::BF16 ? 2 : 4; }
const char* dtype_name(DType t);

// A weight as the CPU kernels see it: host pointers into the mapped checkpoint.
struct WeightView {
  enum class Kind : uint8_t { Dense, Affine };
  Kind kind = Kind::Dense;
  DType dtype = DType::F32;        // Dense: element type
  const void* data = nullptr;      // Dense: elements; Affine: uint32 codes
  int64_t rows = 0, cols = 0;      // logical shape [out, in]
  int bits = 0, group = 0;         // Affine only
  const void* scales = nullptr;    // Affine only: [rows, cols/group]
  const void* biases = nullptr;
  DType scale_dtype = DType::BF16;

  bool quantized() const { return kind == Kind::Affine; }
  // Bytes of one stored row (codes only for Affine).
  size_t row_bytes() const {
    return quantized() ? size_t(cols) * bits / 8 : size_t(cols) * dtype_size(dtype);
  }
  size_t bytes() const {
    size_t b = row_bytes() * rows;
    if (quantized()) b += 2 * size_t(rows) * (cols / group) * dtype_size(scale_dtype);
    return b;
  }
  std::string describe() const;  // "q4g64" / "bf16" ...
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

using Weight = WeightView;  // replaced by the mapping-relative Weight (issue: device-resident step)

// Element `i` of a scale/bias array of the given dtype.
inline float load_scalar(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return 0.f;
  }
}

}  // namespace lily
