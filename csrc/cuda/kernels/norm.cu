// RMSNorm family (oracle: csrc/cpu/norm.cpp).
//   rms_norm:       x [T, nseg·SEG] -> out, each SEG-element segment normalised with w [SEG]
//   add_rms_norm:   sum = a + b (sum may alias a), normed = rms_norm(sum)
//   gated_rms_norm: per value head of SEG: out = (w · rmsnorm(o)) · silu(z)
//   mtp_input:      out [T, 2·SEG] = [rms_norm(table[ids[t]]) · w_e | rms_norm(h[t]) · w_h] (the MTP block's fc
//                   input; oracle: Ops::mtp_input_impl, embed then rms_norm): two segments a row, the first
//                   dequantising its embedding row as embed_rows does (kernels/backend.cu). Floor: the rows read
//                   and written once (T = 1, SEG = 2048: ~20 KB); the launches it replaces are its cost.
// Geometry: NT threads cooperate on one segment (NT = 32: one warp; NT > 32: the whole block, SPB = 1),
// SPB segments per block along threadIdx.y; grid (ceil(nseg / SPB), T). VEC = 4 uses 16-byte loads (the
// host checks every pointer, stride and SEG for 16-byte alignment), else VEC = 1.
// Statistics in fp32 (another summation order than the CPU's 16-lane tree: agreement ~1e-6 relative), the
// formula r = 1 / sqrt(ss / SEG + eps) and out = (x·r)·w as the CPU writes it, IEEE div/sqrt (no fast math).
// Floor: bytes, not FLOPs: rms_norm reads 4·T·C and writes 4·T·C bytes (T = 1, C = 2048: 16 KB, far below
// a launch's ~2-3 µs, so the cost is the launch: one kernel per op, few registers).
#include "common.cuh"

#ifndef NT
#define NT 256
#endif
#ifndef SPB
#define SPB 1
#endif
#ifndef VEC
#define VEC 1
#endif

__device__ __forceinline__ float group_sum(float v, float* scratch) {
#if NT == 32
  return warp_sum(v);
#else
  return block_sum(v, scratch);  // SPB == 1: the block is the group
#endif
}

__device__ __forceinline__ float inv_rms(float ss, float eps) {
  return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, float(SEG)), eps)));
}

struct V4 {
  float v[VEC];
};
__device__ __forceinline__ V4 ld(const float* p) {
  V4 r;
#if VEC == 4
  float4 f = *reinterpret_cast<const float4*>(p);
  r.v[0] = f.x, r.v[1] = f.y, r.v[2] = f.z, r.v[3] = f.w;
#else
  r.v[0] = *p;
#endif
  return r;
}
__device__ __forceinline__ void st(float* p, const V4& r) {
#if VEC == 4
  *reinterpret_cast<float4*>(p) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
#else
  *p = r.v[0];
#endif
}

// Segment index of this group, or -1 past the end.
__device__ __forceinline__ int segment(int nseg) {
  const int s = blockIdx.x * SPB + threadIdx.y;
  return s < nseg ? s : -1;
}

extern "C" __global__ void rms_norm(const float* __restrict__ x, i64 sx, const float* __restrict__ w,
                                    float* __restrict__ out, i64 so, int nseg, float eps) {
  LILY_PDL_PROLOGUE();
  __shared__ float scratch[32];
  const int s = segment(nseg);
  if (s < 0) return;  // SPB > 1 only with NT == 32 (no block-wide barrier), so an early exit is safe
  const i64 t = blockIdx.y;
  const float* xs = x + t * sx + i64(s) * SEG;
  float* os = out + t * so + i64(s) * SEG;
  float ss = 0.f;
  for (int i = threadIdx.x * VEC; i < SEG; i += NT * VEC) {
    V4 a = ld(xs + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) ss = fmaf(a.v[j], a.v[j], ss);
  }
  const float r = inv_rms(group_sum(ss, scratch), eps);
  for (int i = threadIdx.x * VEC; i < SEG; i += NT * VEC) {
    V4 a = ld(xs + i), g = ld(w + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) a.v[j] = __fmul_rn(__fmul_rn(a.v[j], r), g.v[j]);
    st(os + i, a);
  }
}

// The whole row is this block's (and SEG divides it): every element of sum is written by the thread that
// read a and b there, so sum aliasing a is safe; the second loop reads back this thread's own writes.
extern "C" __global__ void add_rms_norm(const float* a, i64 sa, const float* __restrict__ b, i64 sb,
                                        const float* __restrict__ w, float* sum, i64 ss_, float* __restrict__ normed,
                                        i64 sn, int nseg, float eps) {
  LILY_PDL_PROLOGUE();
  __shared__ float scratch[32];
  const int s = segment(nseg);
  if (s < 0) return;
  const i64 t = blockIdx.y, base = i64(s) * SEG;
  const float* as = a + t * sa + base;
  const float* bs = b + t * sb + base;
  float* su = sum + t * ss_ + base;
  float* ns = normed + t * sn + base;
  float ss = 0.f;
  for (int i = threadIdx.x * VEC; i < SEG; i += NT * VEC) {
    V4 x = ld(as + i), y = ld(bs + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      x.v[j] = __fadd_rn(x.v[j], y.v[j]);
      ss = fmaf(x.v[j], x.v[j], ss);
    }
    st(su + i, x);
  }
  const float r = inv_rms(group_sum(ss, scratch), eps);
  for (int i = threadIdx.x * VEC; i < SEG; i += NT * VEC) {
    V4 x = ld(su + i), g = ld(w + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) x.v[j] = __fmul_rn(__fmul_rn(x.v[j], r), g.v[j]);
    st(ns + i, x);
  }
}

extern "C" __global__ void gated_rms_norm(const float* __restrict__ o, i64 so, const float* __restrict__ z, i64 sz,
                                          const float* __restrict__ w, float* __restrict__ out, i64 sout, int nseg,
                                          float eps) {
  LILY_PDL_PROLOGUE();
  __shared__ float scratch[32];
  const int s = segment(nseg);
  if (s < 0) return;
  const i64 t = blockIdx.y, base = i64(s) * SEG;
  const float* os = o + t * so + base;
  const float* zs = z + t * sz + base;
  float* ys = out + t * sout + base;
  float ss = 0.f;
  for (int i = threadIdx.x * VEC; i < SEG; i += NT * VEC) {
    V4 x = ld(os + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) ss = fmaf(x.v[j], x.v[j], ss);
  }
  const float r = inv_rms(group_sum(ss, scratch), eps);
  for (int i = threadIdx.x * VEC; i < SEG; i += NT * VEC) {
    V4 x = ld(os + i), g = ld(zs + i), m = ld(w + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float sg = __fdiv_rn(g.v[j], __fadd_rn(1.f, expf(-g.v[j])));  // silu, the CPU's formula
      x.v[j] = __fmul_rn(__fmul_rn(m.v[j], __fmul_rn(x.v[j], r)), sg);
    }
    st(ys + i, x);
  }
}

// Element c of embedding row id, exactly as embed_rows computes it (dense dtype, or bits-bit affine codes).
__device__ __forceinline__ float embed_at(const void* data, const void* scales, const void* biases, i64 rows,
                                          int dtype, int bits, int group, int scale_dtype, int id, i64 c) {
  if (id < 0 || id >= rows) return __uint_as_float(0x7fc00000u);  // an id outside the table: NaN, as embed_rows
  if (bits == 0) return load_as_f32(data, dtype, i64(id) * SEG + c);
  const int per = 32 / bits;
  const u32 word = static_cast<const u32*>(data)[i64(id) * (SEG / per) + c / per];
  const float q = float((word >> ((c % per) * bits)) & ((1u << bits) - 1u));
  const i64 g = i64(id) * (SEG / group) + c / group;
  return fmaf(q, load_as_f32(scales, scale_dtype, g), load_as_f32(biases, scale_dtype, g));
}

// Segment 0 of row t: the embedding row (computed again in the second pass rather than held); segment 1: h[t].
// The sum of squares and the scaling are rms_norm's, element for element, so the bits are embed_rows + rms_norm's.
extern "C" __global__ void mtp_input(const int* __restrict__ ids, i64 ids_stride, const void* data,
                                     const void* scales, const void* biases, i64 rows, int dtype, int bits, int group,
                                     int scale_dtype, const float* __restrict__ h, i64 sh,
                                     const float* __restrict__ w_e, const float* __restrict__ w_h,
                                     float* __restrict__ out, i64 so, float eps) {
  LILY_PDL_PROLOGUE();
  __shared__ float scratch[32];
  const int s = segment(2);
  if (s < 0) return;
  const i64 t = blockIdx.y;
  float* os = out + t * so + i64(s) * SEG;
  const float* w = s == 0 ? w_e : w_h;
  const float* hs = h + t * sh;
  const int id = s == 0 ? ids[t * ids_stride] : 0;
  auto load = [&](int i) {
    if (s != 0) return ld(hs + i);
    V4 r;
#pragma unroll
    for (int j = 0; j < VEC; ++j) r.v[j] = embed_at(data, scales, biases, rows, dtype, bits, group, scale_dtype, id, i + j);
    return r;
  };
  float ss = 0.f;
  for (int i = threadIdx.x * VEC; i < SEG; i += NT * VEC) {
    const V4 a = load(i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) ss = fmaf(a.v[j], a.v[j], ss);
  }
  const float r = inv_rms(group_sum(ss, scratch), eps);
  for (int i = threadIdx.x * VEC; i < SEG; i += NT * VEC) {
    V4 a = load(i), g = ld(w + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) a.v[j] = __fmul_rn(__fmul_rn(a.v[j], r), g.v[j]);
    st(os + i, a);
  }
}
