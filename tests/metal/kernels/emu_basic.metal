// Kernels for the emulator's semantic tests (tests/metal/test_emulator.py): each exercises one piece of
// MSL behaviour that the emulator must reproduce.
#include <metal_stdlib>
#include "emu_helpers.metal"
using namespace metal;

struct Sizes {
  uint n;
  uint pad;
};

// Tree reduction in threadgroup memory with barriers; any thread count (not only multiples of 32) and
// a ragged tail. out[tg] = sum of this threadgroup's block of `n` elements.
kernel void tg_tree_reduce(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                           constant Sizes& sz [[buffer(2)]], threadgroup float* scratch [[threadgroup(0)]],
                           uint tid [[thread_position_in_threadgroup]], uint tg [[threadgroup_position_in_grid]],
                           uint threads [[threads_per_threadgroup]]) {
  float v = 0.0f;
  for (uint i = tid; i < sz.n; i += threads) v += x[tg * sz.n + i];
  scratch[tid] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint width = threads; width > 1;) {
    uint half_width = (width + 1) / 2;
    if (tid + half_width < width) scratch[tid] += scratch[tid + half_width];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    width = half_width;
  }
  if (tid == 0) out[tg] = scratch[0];
}

// The same through simd_sum and a threadgroup array in an included helper.
kernel void simd_reduce(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                        constant Sizes& sz [[buffer(2)]], uint tid [[thread_index_in_threadgroup]],
                        uint tg [[threadgroup_position_in_grid]], uint threads [[threads_per_threadgroup]]) {
  float v = 0.0f;
  for (uint i = tid; i < sz.n; i += threads) v += x[tg * sz.n + i];
  float total = threadgroup_sum(v, tid, threads);
  if (tid == 0) out[tg] = total;
}

// Every simd_* result of every lane: out[k * 32 + lane] for result k.
kernel void simd_ops(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     device uint* bits [[buffer(2)]], ushort lane [[thread_index_in_simdgroup]],
                     uint gid [[thread_position_in_grid]]) {
  float v = x[gid];
  out[0 * 32 + lane] = simd_sum(v);
  out[1 * 32 + lane] = simd_prefix_inclusive_sum(v);
  out[2 * 32 + lane] = simd_prefix_exclusive_sum(v);
  out[3 * 32 + lane] = simd_shuffle(v, (lane * 7 + 3) % 32);
  out[4 * 32 + lane] = simd_shuffle_up(v, 3);
  out[5 * 32 + lane] = simd_shuffle_down(v, 5);
  out[6 * 32 + lane] = simd_shuffle_xor(v, 6);
  out[7 * 32 + lane] = simd_broadcast(v, 9);
  out[8 * 32 + lane] = simd_max(v);
  out[9 * 32 + lane] = simd_min(v);
  out[10 * 32 + lane] = simd_product(v > 0 ? 1.0f : -1.0f);
  out[11 * 32 + lane] = simd_broadcast_first(v);
  out[12 * 32 + lane] = quad_sum(v);
  out[13 * 32 + lane] = quad_shuffle(v, 2);
  out[14 * 32 + lane] = float(simd_sum(int(lane)));
  out[15 * 32 + lane] = simd_sum(float2(v, 1.0f)).y;
  bits[0 * 32 + lane] = uint(static_cast<simd_vote::vote_t>(simd_ballot(v > 0.5f)));
  bits[1 * 32 + lane] = simd_any(v > 0.99f) ? 1u : 0u;
  bits[2 * 32 + lane] = simd_all(v >= 0.0f) ? 1u : 0u;
  bits[3 * 32 + lane] = simd_is_first() ? 1u : 0u;
  simdgroup_barrier(mem_flags::mem_none);
  bits[4 * 32 + lane] = simd_or(1u << lane);
  bits[5 * 32 + lane] = simd_max(uint(lane) * 3u);
}

// Early return before simd_* is valid MSL: the remaining lanes reduce among themselves.
kernel void simd_after_return(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                              constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]],
                              ushort lane [[thread_index_in_simdgroup]]) {
  if (gid >= n) return;
  float s = simd_sum(x[gid]);
  uint first = simd_broadcast_first(uint(lane));
  if (lane == first) out[gid / 32] = s;
}

// Planted bug: a cross-lane read of threadgroup memory without the barrier between write and read.
kernel void rotate_no_barrier(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                              uint tid [[thread_index_in_threadgroup]], uint threads [[threads_per_threadgroup]],
                              uint gid [[thread_position_in_grid]]) {
  threadgroup float buf[256];
  buf[tid] = x[gid];
  out[gid] = buf[(tid + 1) % threads];
}

// The correct version.
kernel void rotate_barrier(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                           uint tid [[thread_index_in_threadgroup]], uint threads [[threads_per_threadgroup]],
                           uint gid [[thread_position_in_grid]]) {
  threadgroup float buf[256];
  buf[tid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = buf[(tid + 1) % threads];
}

// Planted bug: threads past the end return before a barrier the others wait at.
kernel void early_exit_barrier(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                               constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  if (gid >= n) return;
  buf[tid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = buf[0];
}

// Planted bug: lanes of one simdgroup call simd_sum from two different places.
kernel void divergent_simd(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                           ushort lane [[thread_index_in_simdgroup]], uint gid [[thread_position_in_grid]]) {
  float s;
  if (lane < 16) {
    s = simd_sum(x[gid]);
  } else {
    s = simd_sum(2.0f * x[gid]);
  }
  out[gid] = s;
}

// Planted bug: reads one element past the end of x.
kernel void read_past_end(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                          uint gid [[thread_position_in_grid]]) {
  out[gid] = x[gid + 1];
}

// half arithmetic rounds after every operation: 2048 + 1 + 1 stays 2048 (ties to even), while one
// rounding at the end would give 2050.
kernel void half_steps(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                       device half* out [[buffer(2)]], device bfloat* bout [[buffer(3)]],
                       uint gid [[thread_position_in_grid]]) {
  half s = a[gid] + b[gid] + b[gid];
  out[gid] = s;
  bfloat c = bfloat(float(a[gid]) / 8.0f);
  bout[gid] = c + bfloat(1.0bf) + 1.0bf;
  out[gid + 4] = a[gid] * 0.5h + 1.0h;
}

// dispatchThreads: the grid's edge threadgroups are partial.
kernel void grid_ids(device uint* pos [[buffer(0)]], device uint* sizes [[buffer(1)]],
                     constant uint2& dims [[buffer(2)]], uint2 gid [[thread_position_in_grid]],
                     ushort2 tptg [[threads_per_threadgroup]], uint2 grid [[threads_per_grid]],
                     uint2 dtptg [[dispatch_threads_per_threadgroup]], uint simd_count [[simdgroups_per_threadgroup]]) {
  uint i = gid.y * dims.x + gid.x;
  pos[i] = gid.x | (gid.y << 16);
  sizes[4 * i + 0] = uint(tptg.x) | (uint(tptg.y) << 16);
  sizes[4 * i + 1] = grid.x | (grid.y << 16);
  sizes[4 * i + 2] = dtptg.x | (dtptg.y << 16);
  sizes[4 * i + 3] = simd_count;
}

// Device atomics across threadgroups on several workers.
kernel void atomic_count(device atomic_uint* counter [[buffer(0)]], device atomic_float* total [[buffer(1)]],
                         device const float* x [[buffer(2)]], uint gid [[thread_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]]) {
  threadgroup atomic_uint local;
  if (tid == 0) atomic_store_explicit(&local, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&local, 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) atomic_fetch_add_explicit(counter, atomic_load_explicit(&local, memory_order_relaxed), memory_order_relaxed);
  atomic_fetch_max_explicit(counter + 1, gid, memory_order_relaxed);
  atomic_fetch_add_explicit(total, x[gid], memory_order_relaxed);
}

// Function constants: two values give two results; is_function_constant_defined reflects the pipeline.
constant bool use_scale [[function_constant(0)]];
constant float scale [[function_constant(1)]];
constant bool has_scale = is_function_constant_defined(scale);
constant int offset_fc [[function_constant(2)]];

kernel void fc_apply(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                     device const float* bias [[buffer(2), function_constant(use_scale)]],
                     uint gid [[thread_position_in_grid]]) {
  float v = x[gid];
  if (use_scale) v = v * scale + bias[gid];
  y[gid] = v + (has_scale ? 1000.0f : 0.0f) + float(offset_fc);
}

// MLX-style templated kernels instantiated under host names through a macro.
template <typename T>
[[kernel]] void axpby(device const T* x [[buffer(0)]], device T* y [[buffer(1)]], constant float& a [[buffer(2)]],
                      constant float& b [[buffer(3)]], uint gid [[thread_position_in_grid]]) {
  y[gid] = static_cast<T>(a * static_cast<float>(x[gid]) + b * static_cast<float>(y[gid]));
}
#define instantiate_axpby(name, type) \
  template [[host_name("axpby_" #name)]] [[kernel]] decltype(axpby<type>) axpby<type>;
instantiate_axpby(f32, float)
instantiate_axpby(f16, half)
instantiate_axpby(bf16, bfloat)

// simdgroup_matrix: D = A * B + C for 8x8 tiles of a 16x16 problem (one simdgroup per output tile).
kernel void mma_16(device const float* a [[buffer(0)]], device const half* b [[buffer(1)]],
                   device const float* c [[buffer(2)]], device float* d [[buffer(3)]],
                   uint2 tg [[threadgroup_position_in_grid]]) {
  simdgroup_float8x8 acc;
  simdgroup_load(acc, c, 16, ulong2(tg.x * 8, tg.y * 8));
  for (uint k = 0; k < 16; k += 8) {
    simdgroup_float8x8 ma;
    simdgroup_half8x8 mb;
    simdgroup_load(ma, a + tg.y * 8 * 16 + k, 16);
    simdgroup_load(mb, b, 16, ulong2(tg.x * 8, k));
    simdgroup_multiply_accumulate(acc, ma, mb, acc);
  }
  simdgroup_store(acc, d, 16, ulong2(tg.x * 8, tg.y * 8));
}

// thread_elements(): every lane writes its lane id into its two elements. out[0:64] is the stored matrix,
// out[64:128] the matrix times a diagonal (3 * identity) computed by the collective multiply, which
// must see the per-lane edits; out[128:192] a transposed store.
kernel void lane_map(device float* out [[buffer(0)]], ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(-1.0f);
  m.thread_elements()[0] = float(lane);
  m.thread_elements()[1] = float(lane) + 0.5f;
  simdgroup_store(m, out, 8);
  simdgroup_float8x8 three = simdgroup_float8x8(3.0f);
  simdgroup_float8x8 p;
  simdgroup_multiply(p, m, three);
  simdgroup_store(p, out + 64, 8);
  simdgroup_store(m, out + 128, 8, ulong2(0, 0), true);
}

// Vector constructors, swizzles, conversions, as_type and a few math functions.
kernel void misc_ops(device const float4* x [[buffer(0)]], device float* out [[buffer(1)]],
                     device uint* iout [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  float4 v = x[gid];
  half4 h = half4(v);
  float4 back = float4(h);
  float4 cat = float4(v.xy, float2(7.0f));
  float3 v3 = v.xyz;
  float4 splat = float4(2.0f);
  device float* o = out + gid * 16;
  o[0] = back.x;
  o[1] = cat.w + cat.x;
  o[2] = dot(v, splat);
  o[3] = length(v3);
  o[4] = clamp(v.x, 0.25f, 0.75f);
  o[5] = mix(v.x, v.y, 0.25f);
  o[6] = fast::exp(v.z) + precise::sqrt(v.w);
  o[7] = select(v.x, v.y, v.x > v.y);
  o[8] = max(v, float4(0.5f)).x;
  o[9] = float(sizeof(float3));
  o[10] = static_cast<float4>(int4(v * 10.0f)).y;
  o[11] = rsqrt(v.w + 1.0f);
  o[12] = numeric_limits<half>::max();
  o[13] = isnan(as_type<float>(0x7fc00000u)) ? 1.0f : 0.0f;
  o[14] = float(uint2(3u, 4u).yx.x);
  o[15] = fma(v.x, v.y, v.z);
  device uint* u = iout + gid * 4;
  u[0] = as_type<uint>(v.x);
  u[1] = popcount(u[0]) | (clz(1u) << 8) | (ctz(8u) << 16);
  u[2] = extract_bits(0xABCD1234u, 8u, 12u);
  u[3] = mulhi(0x80000000u, 6u);
}

// Reads [[threadgroup(0)]] memory before writing it: must be poison (0xFF bytes) in every threadgroup.
kernel void tg_param_peek(device float* as_float [[buffer(0)]], device int* as_int [[buffer(1)]],
                          threadgroup float* scratch [[threadgroup(0)]], uint tid [[thread_index_in_threadgroup]],
                          uint gid [[thread_position_in_grid]]) {
  as_float[gid] = scratch[tid];
  as_int[gid] = as_type<int>(scratch[tid]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  scratch[tid] = 1.0f;
}
