// Shared device helpers for every kernel family (compiled by NVRTC; no CUDA headers are used, so the
// extension needs no toolkit): element conversions, warp and block reductions, and the dtype codes of
// lily::DType. Included by kernels/<family>.cu as #include "common.cuh".
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

// lily::DType codes (model/weight.h).
#define LILY_F32 0
#define LILY_F16 1
#define LILY_BF16 2
#define LILY_I32 3

// Programmatic dependent launch (sm_90+, when the backend's pdl option launches a kernel with it): the next
// kernel in the stream may be scheduled before this one ends; LILY_PDL_WAIT blocks until the kernel before it has
// finished and its writes are visible, LILY_PDL_TRIGGER lets the next one be scheduled. Every extern "C" kernel
// runs LILY_PDL_PROLOGUE (wait, then trigger) before it touches memory an earlier kernel wrote. Triggering only
// after the wait keeps at most two grids in flight (the next one cannot take the SMs its predecessor still needs).
// Before the wait a kernel may read only what no kernel of the step writes (the weights), and what the kernel
// two back wrote (it completed before this kernel's predecessor passed its own wait), through the L2
// (ld.global.cg: no stale L1 line). Without the launch attribute (pdl off) both instructions are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LILY_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define LILY_PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" :::)
#else
#define LILY_PDL_WAIT() \
  do {                  \
  } while (0)
#define LILY_PDL_TRIGGER() \
  do {                     \
  } while (0)
#endif
#define LILY_PDL_PROLOGUE() \
  do {                      \
    LILY_PDL_WAIT();        \
    LILY_PDL_TRIGGER();     \
  } while (0)

// Global loads through the L2 only (ld.global.cg), for reads before LILY_PDL_WAIT.
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int ld_cg_i32(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float4 ld_cg4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

// cp.async (sm_80+): global -> shared without registers. The first `bytes` of src are copied (at most 16 / 4) and
// the rest of the 16 / 4 zero-filled; 0 reads nothing. A bool would silently mean 1 byte, so it does not compile.
__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ void cp_async16(u32, const void*, bool) = delete;
__device__ void cp_async4(u32, const void*, bool) = delete;
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix (sm_80+): four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix
// l / 8, and lane t receives (row t / 4, columns 2·(t % 4), +1) of each (_t: of each transposed).
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(u32(v) << 16); }
// Round to nearest even; NaN stays a quiet NaN (the CPU's f32_to_bf16).
__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return u16((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return u16(u >> 16);
}
__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
  return f;
}
// Element i of an f32 / f16 / bf16 array.
__device__ __forceinline__ float load_as_f32(const void* p, int dtype, i64 i) {
  if (dtype == LILY_BF16) return bf16_to_f32(static_cast<const u16*>(p)[i]);
  if (dtype == LILY_F16) return f16_to_f32(static_cast<const u16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void store_from_f32(void* p, int dtype, i64 i, float v) {
  if (dtype == LILY_BF16)
    static_cast<u16*>(p)[i] = f32_to_bf16(v);
  else
    static_cast<float*>(p)[i] = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats of shared memory; the block must reach this call together.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -3.402823466e38f;
  return warp_max(v);
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// c[16x8] += a[16x16] (row) · b[16x8] (col) on the tensor cores, fp32 accumulation (sm_80+): a (4 registers) and b
// (b0, b1) hold bf16 pairs, or f16 pairs when F16.
template <bool F16 = false>
__device__ __forceinline__ void mma_m16n8k16(float* c, const u32* a, u32 b0, u32 b1) {
  if constexpr (F16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- fp32 products on the tensor cores: 3xTF32 (mma.sync m16n8k8, sm_80+) ----
// x = hi + lo with hi, lo tf32 (10-bit mantissas): hi·hi' + hi·lo' + lo·hi' misses only lo·lo' and lo's own
// rounding (~2^-21 relative), so a product accumulated in fp32 this way sits near fp32's error level, not tf32's
// (~2^-11). hi is x rounded to nearest (half an ulp added, the low 13 bits cleared; finite x), lo = x − hi exactly,
// passed as fp32 bits: the tensor core reads a tf32 operand's top 19 bits and ignores the rest (ptxas lowers
// cvt.rna.tf32.f32 itself to an add of half an ulp without the mask, plus an Inf test: 4 instructions where these
// are 3 for both halves; the split's instructions bounded the chunked DeltaNet kernels, ncu).
__device__ __forceinline__ void tf32_split(float x, u32& hi, u32& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}
// c[16x8] += a[16x8] (row) · b[8x8] (col), tf32 in, fp32 accumulation. Fragments (g = lane / 4, t = lane % 4):
// a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); b0 (k t, n g), b1 (k t + 4, n g);
// c0, c1 (g, 2t and 2t + 1), c2, c3 (g + 8, 2t and 2t + 1).
__device__ __forceinline__ void mma_m16n8k8_tf32(float* c, const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// One operand's split fragments: A (16 x 8) or B (8 x 8, then only [0] and [1] are used).
struct Tf32Frag {
  u32 hi[4], lo[4];
};
// c += a · b in 3xTF32: hi·hi' into c, the two small terms into corr, a second dependency chain beside c's (each MMA
// waits for the one before it on the same accumulator); the caller adds corr into c once, after its last product.
__device__ __forceinline__ void mma_3xtf32(float* c, float* corr, const Tf32Frag& a, const Tf32Frag& b) {
  mma_m16n8k8_tf32(corr, a.lo, b.hi[0], b.hi[1]);
  mma_m16n8k8_tf32(c, a.hi, b.hi[0], b.hi[1]);
  mma_m16n8k8_tf32(corr, a.hi, b.lo[0], b.lo[1]);
}
// Fragments from fp32 shared memory, split as they are loaded; p is the tile's first element. Conflict-free layouts
// (32 banks): an operand whose lanes step 1 along t (its rows read along k, g·ld + t) wants ld % 32 == 4, one whose
// lanes step 1 along g (t·ld + g) ld % 32 == 8 (or 24).
// A (16 x 8): element (r, k) at p[r·rs + k·ks] (row-major: rs = ld, ks = 1; stored transposed: rs = 1, ks = ld).
__device__ __forceinline__ Tf32Frag frag_a(const float* p, int rs, int ks, int lane) {
  const int g = lane >> 2, t = lane & 3;
  Tf32Frag f;
  tf32_split(p[g * rs + t * ks], f.hi[0], f.lo[0]);
  tf32_split(p[(g + 8) * rs + t * ks], f.hi[1], f.lo[1]);
  tf32_split(p[g * rs + (t + 4) * ks], f.hi[2], f.lo[2]);
  tf32_split(p[(g + 8) * rs + (t + 4) * ks], f.hi[3], f.lo[3]);
  return f;
}
// B (8 x 8): element (k, n) at p[k·ks + n·ns] (k-major: ks = ld, ns = 1; n-major: ks = 1, ns = ld).
__device__ __forceinline__ Tf32Frag frag_b(const float* p, int ks, int ns, int lane) {
  const int g = lane >> 2, t = lane & 3;
  Tf32Frag f;
  tf32_split(p[t * ks + g * ns], f.hi[0], f.lo[0]);
  tf32_split(p[(t + 4) * ks + g * ns], f.hi[1], f.lo[1]);
  return f;
}
