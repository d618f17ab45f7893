// Encoders for Lily's Metal kernels (MSL in metal/*.metal). Each appends its dispatches to a Pass; the caller
// places barriers between dependent encodes. Buffers are bound as Arg (buffer + byte offset). Files parallel
// the CPU backend: matmul.cpp (quantized GEMV), norm.cpp (RMSNorm), reduce.cpp (row reductions).
#pragma once
#include <cstdint>

#include "metal/device.h"

namespace lily::metal {

// Every metal/*.metal file, concatenated in name order: the source of the device library. Generated into the
// extension at build time (CMake embeds the files); hosts without the generated file read metal/ themselves.
const char* msl_source();

// A 4-bit affine matrix in MLX's layout: codes uint32 [rows, cols/8] (element 8k+j in nibble j of word k,
// low nibble first), scales and biases [rows, cols/group]; value = scale * code + bias.
struct QuantMatrix {
  enum class ScaleType : uint8_t { BF16, F16 };
  Arg codes, scales, biases;
  int64_t rows = 0, cols = 0;
  int group = 64;  // 32, 64 or 128
  ScaleType scale_type = ScaleType::BF16;
};

// y[rows] (f32) = W · x, x f32 [cols]. The decode-shape matrix-vector product.
void encode_qmv4(Pass& pass, const QuantMatrix& w, Arg x, Arg y);

// out = x · w / rms(x) per segment: x, out f32 [rows, cols]; w f32 [segment] (the effective multiplier);
// cols a multiple of segment (segment = cols for residual norms, head_dim for q/k norms).
void encode_rms_norm(Pass& pass, Arg x, Arg w, Arg out, int64_t rows, int64_t cols, int64_t segment, float eps);

// out[r] = sum_i a[r, i] * b[r, i]: f32 [rows, cols] -> f32 [rows]. The reduction behind norms and scores.
void encode_row_dot(Pass& pass, Arg a, Arg b, Arg out, int64_t rows, int64_t cols);

}  // namespace lily::metal
