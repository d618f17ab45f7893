// 4-bit affine matrix-vector product, the decode shape: y[rows] = W[rows, cols] · x[cols].
// W in MLX's layout: codes uint32 [rows, cols/8] (element 8k+j in nibble j of word k, low nibble first),
// scales and biases [rows, cols/group] in bf16 (qmv4_bf16) or f16 (qmv4_f16); value = scale · code + bias.
// x and y are float32; x must be 16-byte aligned. The group size is function constant 0 (32, 64 or 128).
// Threadgroup: 2 simdgroups of 32 lanes, 4 rows per simdgroup; lane l reads words l, l+32, ... of its rows,
// and one simd_sum per row finishes the dot product.
// Floor: streams rows·cols/2 bytes of codes plus rows·cols/group·2·2 bytes of scales and biases
// (x stays in cache); 2·rows·cols FLOPs. Bandwidth-bound.
#include <metal_stdlib>
using namespace metal;

constant uint qmv4_group [[function_constant(0)]];

// Shared with csrc/metal/matmul.cpp (same field order and sizes).
struct Qmv4Shape {
  uint rows;
  uint cols;
};

template <typename S>
[[kernel]] void qmv4(device const uint* codes [[buffer(0)]],
                     device const S* scales [[buffer(1)]],
                     device const S* biases [[buffer(2)]],
                     device const float* x [[buffer(3)]],
                     device float* y [[buffer(4)]],
                     constant Qmv4Shape& shape [[buffer(5)]],
                     uint group_id [[threadgroup_position_in_grid]],
                     uint simdgroup [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]],
                     uint width [[threads_per_simdgroup]]) {
  constexpr uint rows_per_simdgroup = 4;
  constexpr uint simdgroups = 2;
  const uint words = shape.cols / 8;
  const uint groups = shape.cols / qmv4_group;
  const uint words_per_group = qmv4_group / 8;
  const uint row0 = (group_id * simdgroups + simdgroup) * rows_per_simdgroup;

  float acc[rows_per_simdgroup] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (uint w = lane; w < words; w += width) {
    const device float4* xv = (const device float4*)(x + 8 * w);
    const float4 x_lo = xv[0];
    const float4 x_hi = xv[1];
    // Σ (s·q + b)·x over the word's 8 elements = s·Σ q·x + b·Σ x: one multiply per element.
    const float x_sum = (x_lo.x + x_lo.y) + (x_lo.z + x_lo.w) + (x_hi.x + x_hi.y) + (x_hi.z + x_hi.w);
    const uint g = w / words_per_group;
    for (uint r = 0; r < rows_per_simdgroup; ++r) {
      // Rows past the end repeat the last row (kept uniform for simd_sum) and are never written.
      const uint row = min(row0 + r, shape.rows - 1);
      const uint q = codes[row * words + w];
      const float4 q_lo = float4((uint4(q) >> uint4(0, 4, 8, 12)) & 0xfu);
      const float4 q_hi = float4((uint4(q) >> uint4(16, 20, 24, 28)) & 0xfu);
      const float qx = dot(q_lo, x_lo) + dot(q_hi, x_hi);
      const float scale = float(scales[row * groups + g]);
      const float bias = float(biases[row * groups + g]);
      acc[r] += scale * qx + bias * x_sum;
    }
  }
  for (uint r = 0; r < rows_per_simdgroup; ++r) {
    const float total = simd_sum(acc[r]);
    if (lane == 0 && row0 + r < shape.rows) y[row0 + r] = total;
  }
}

template [[host_name("qmv4_bf16")]] [[kernel]] decltype(qmv4<bfloat>) qmv4<bfloat>;
template [[host_name("qmv4_f16")]] [[kernel]] decltype(qmv4<half>) qmv4<half>;
