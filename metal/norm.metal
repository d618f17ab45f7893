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

// The fused norms of the Metal backend (csrc/metal/norm.cpp; oracle csrc/cpu/norm.cpp), one threadgroup per
// normalised segment as rms_norm above, with row strides:
//   add_rms_norm:   sum = a + b (sum may alias a), normed = rms_norm(sum) · w, per segment of w's length
//   gated_rms_norm: out = w · rmsnorm(o) · silu(z) per value head (segment = Dv)      (decode fusion d, its norm)
// Floor: reads a, b (o, z) once and writes once: 12 (resp. 12) bytes per element.

// Shared with csrc/metal/norm.cpp.
struct NormRowsShape {
  uint cols;
  uint segment;
  uint lda;  // a (o) row stride
  uint ldb;  // b (z) row stride
  uint lds;  // sum row stride
  uint ldo;  // normed (out) row stride
  float eps;
};

inline float norm_block_sum(float v, threadgroup float* partials, uint simdgroup, uint simdgroups, uint lane) {
  v = simd_sum(v);
  if (lane == 0) partials[simdgroup] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return simd_sum(lane < simdgroups ? partials[lane] : 0.0f);
}

[[kernel]] void add_rms_norm(device const float* a [[buffer(0)]],
                             device const float* b [[buffer(1)]],
                             device const float* w [[buffer(2)]],
                             device float* sum [[buffer(3)]],
                             device float* normed [[buffer(4)]],
                             constant NormRowsShape& s [[buffer(5)]],
                             threadgroup float* partials [[threadgroup(0)]],
                             uint segment_id [[threadgroup_position_in_grid]],
                             uint tid [[thread_position_in_threadgroup]],
                             uint threads [[threads_per_threadgroup]],
                             uint simdgroup [[simdgroup_index_in_threadgroup]],
                             uint simdgroups [[simdgroups_per_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  const uint n = s.segment, per_row = s.cols / n;
  const uint t = segment_id / per_row, c0 = (segment_id % per_row) * n;
  float sq = 0.0f;
  for (uint i = tid; i < n; i += threads) {
    const float v = a[ulong(t) * s.lda + c0 + i] + b[ulong(t) * s.ldb + c0 + i];
    sum[ulong(t) * s.lds + c0 + i] = v;
    sq += v * v;
  }
  const float total = norm_block_sum(sq, partials, simdgroup, simdgroups, lane);
  const float r = 1.0f / sqrt(total / float(n) + s.eps);
  // Each thread reads back only the sums it wrote itself.
  for (uint i = tid; i < n; i += threads)
    normed[ulong(t) * s.ldo + c0 + i] = sum[ulong(t) * s.lds + c0 + i] * r * w[i];
}

[[kernel]] void gated_rms_norm(device const float* o [[buffer(0)]],
                               device const float* z [[buffer(1)]],
                               device const float* w [[buffer(2)]],
                               device float* out [[buffer(3)]],
                               constant NormRowsShape& s [[buffer(4)]],
                               threadgroup float* partials [[threadgroup(0)]],
                               uint segment_id [[threadgroup_position_in_grid]],
                               uint tid [[thread_position_in_threadgroup]],
                               uint threads [[threads_per_threadgroup]],
                               uint simdgroup [[simdgroup_index_in_threadgroup]],
                               uint simdgroups [[simdgroups_per_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  const uint n = s.segment, per_row = s.cols / n;
  const uint t = segment_id / per_row, c0 = (segment_id % per_row) * n;
  device const float* os = o + ulong(t) * s.lda + c0;
  device const float* zs = z + ulong(t) * s.ldb + c0;
  float sq = 0.0f;
  for (uint i = tid; i < n; i += threads) sq += os[i] * os[i];
  const float total = norm_block_sum(sq, partials, simdgroup, simdgroups, lane);
  const float r = 1.0f / sqrt(total / float(n) + s.eps);
  for (uint i = tid; i < n; i += threads) {
    const float g = zs[i] / (1.0f + exp(-zs[i]));
    out[ulong(t) * s.ldo + c0 + i] = w[i] * (os[i] * r) * g;
  }
}
