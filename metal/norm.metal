// RMSNorm per segment: out[r, s·n + i] = x[r, s·n + i] · w[i] / sqrt(mean_i(x[r, s·n + i]²) + eps), n = segment.
// x, out float32 [rows, cols]; w float32 [segment] (the effective multiplier: checkpoint loaders fold the 1 + w
// form); cols a multiple of segment (segment = cols for residual norms, head_dim for q/k norms).
// One threadgroup per segment, any multiple of 32 threads up to 1024; fp32 statistics: per-thread strided sums,
// simd_sum, one partial per simdgroup in threadgroup memory, one barrier, simd_sum of the partials.
// Floor: reads 4·rows·cols bytes twice (the second read from cache), writes 4·rows·cols; ~4 FLOPs per element.
#include <metal_stdlib>
using namespace metal;

// Shared with csrc/metal/norm.cpp.
struct RmsNormShape {
  uint cols;
  uint segment;
  float eps;
};

[[kernel]] void rms_norm(device const float* x [[buffer(0)]],
                         device const float* w [[buffer(1)]],
                         device float* out [[buffer(2)]],
                         constant RmsNormShape& shape [[buffer(3)]],
                         threadgroup float* partials [[threadgroup(0)]],
                         uint segment_id [[threadgroup_position_in_grid]],
                         uint tid [[thread_position_in_threadgroup]],
                         uint threads [[threads_per_threadgroup]],
                         uint simdgroup [[simdgroup_index_in_threadgroup]],
                         uint simdgroups [[simdgroups_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  const uint n = shape.segment;
  const uint per_row = shape.cols / n;
  const ulong base = ulong(segment_id / per_row) * shape.cols + (segment_id % per_row) * n;
  device const float* xs = x + base;
  device float* os = out + base;

  float sum_sq = 0.0f;
  for (uint i = tid; i < n; i += threads) sum_sq += xs[i] * xs[i];
  sum_sq = simd_sum(sum_sq);
  if (lane == 0) partials[simdgroup] = sum_sq;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Every simdgroup adds the partials itself: no second barrier to broadcast the total.
  const float total = simd_sum(lane < simdgroups ? partials[lane] : 0.0f);

  const float inv_rms = rsqrt(total / float(n) + shape.eps);
  for (uint i = tid; i < n; i += threads) os[i] = xs[i] * inv_rms * w[i];
}
