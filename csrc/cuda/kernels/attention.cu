// Gated full attention (MODEL.md section 4): q/k preparation, KV append, causal GQA attention with the
// output gate. The CPU oracle is csrc/cpu/attention.cpp; every kernel computes its function in fp32.
//
// Defines: HEAD_DIM (D: 32, 64, 128 or 256), GROUP (query heads per kv head, G <= 16),
// KV_BF16 (1: caches hold bf16 rows, 0: f32 rows). Caches are [kv_heads * max_ctx, D], head-major.
//
// attn_qk_prep   qg [T, heads*2D] (per head [query D | gate D]), k [T, kv*D], q_norm/k_norm [D]
//                -> q_out, gate_out [T, heads*D], k_out [T, kv*D]. RMSNorm per head, then rotate-half
//                RoPE on the first rotary_dim dims at position pos[0] + t (angles in double, like the CPU; their
//                cos / sin before the wait under programmatic launch). Grid (T, ceil((heads + kv) / 4)), block 128:
//                one warp per (token, head).
//                Floor: reads 4·T·(2·heads + kv)·D bytes, writes the same less nothing: memory bound, tiny.
// kv_append      k, v [T, kv*D] -> rows pos[0] + t of each kv head's cache. Grid (T, kv), block 64.
//                Floor: reads 8·T·kv·D bytes, writes 2·ES·T·kv·D.
// attn_qk_prep_append  the two above in one launch (v [T, kv*D] and the caches besides qk_prep's arguments): grid
//                (T, ceil((heads + 2·kv) / 4)), block 128, one warp per (token, q, k or v head); a k warp writes its
//                prepared row to k_out and to the cache, a v warp copies its row. The same values as the two
//                kernels; one dependent launch fewer per attention layer. Floor: the two kernels' less k's re-read.
// attn_decode_split + attn_decode_reduce (T = 1): split-KV ("flash decoding"), the fp32 form (f32
//                caches). Grid (NS, kv) blocks of DEC_NW warps; the live length len = pos[0] + 1 is read on
//                the device and cut into a = min(NS, ceil(len / MIN_CHUNK)) contiguous chunks, block s < a
//                takes chunk s, blocks s >= a exit. Inside a block each warp holds the G queries of its kv
//                head (lane l: D/32 elements of each) and streams rows DEC_U at a time with 16-byte loads
//                (a warp covers a bf16 row of 256 in one load instruction, an f32 row in two; each row is
//                read once for all G heads); scores are reduced over the warp with a butterfly that leaves
//                head g's score in lanes g·(32/GP)...; online softmax in fp32; the warps of a block merge
//                through shared memory and write one partial (m, l, o[G][D]) per (split, kv head) to ws.
//                The reduce (grid heads × column blocks, block 256) merges the a partials of its head's
//                columns (splits spread over the block's threads) and applies sigmoid(gate). ~210 fp32-pipe
//                instructions per (row, warp) at G = 8: about the byte floor's time for bf16 rows, under it
//                for f32 rows.
// attn_decode_mma (T = 1, bf16 caches): the same chunks and partials, computed on tensor cores (see its
//                section); then the same reduce.
//                Floor: 2·kv·len·D·ES bytes of cache; real shape, bf16, len 128K: 2·2·131072·256·2 =
//                268 MB, ~60 µs at 4.5 TB/s; FLOPs 4·heads·len·D = 2.1 GFLOP.
// attn_prefill   (any T; f32 caches): grid (ceil(T / PF_QT), kv), block PF_QT warps, warp w = token
//                blockIdx.x·PF_QT + w with all G heads of the kv head; K/V tiles of PF_R rows are
//                staged in shared memory by cp.async (double buffered) and shared by the block's warps;
//                causal mask per warp (row j <= pos[0] + t). Same per-row math as decode. FLOPs
//                4·heads·T·(pos0 + T/2)·D; cache bytes read 2·kv·ES·D·(len) per block row.
// attn_prefill_mma (any T; bf16 caches, G dividing 64): flash attention on tensor cores, 64 query rows
//                (64/G tokens × G heads) per block of 4 warps (see its section).
// PF_SPLIT = 1 (either prefill kernel, few rows over a long context): grid (., kv, ns); block z takes the keys
//                [z·per, (z+1)·per) of its rows' range, per = ceil(ceil((pos[0] + T) / ns) / tile) tiles (blocks
//                past the live length write empty partials), and writes unnormalised partials (o, m, l) per
//                (token, head, split) to ws: part_o [T][heads][ns][D], part_ml [T][heads][ns][2]. attn_prefill_reduce
//                (grid (T, heads), block 128) merges them and applies sigmoid(gate). A 16-token prefill after an 8K
//                context is 6 blocks of 8K keys each without the split (1.6 ms a layer at f32 on an H200), ns × 6
//                blocks of 8K / ns keys with it.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 256
#endif
#ifndef GROUP
#define GROUP 1
#endif
#ifndef KV_BF16
#define KV_BF16 1
#endif
#ifndef PF_SPLIT
#define PF_SPLIT 0
#endif

#define FULL_MASK 0xffffffffu
#define NEG_INF (-__int_as_float(0x7f800000))

constexpr int D = HEAD_DIM;
constexpr int G = GROUP;
constexpr int GP = G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : G <= 8 ? 8 : G <= 16 ? 16 : 32;  // padded group
constexpr int LPH = 32 / GP;              // lanes per head after the butterfly
constexpr int ES = KV_BF16 ? 2 : 4;       // cache element bytes
constexpr int VEC0 = 16 / ES;
constexpr int VEC = VEC0 < D / 32 ? VEC0 : D / 32;  // elements per lane per load
constexpr int NCH = D / (32 * VEC);                  // loads per lane per row
constexpr int EPL = D / 32;                          // elements per lane
constexpr int RW = VEC * ES >= 4 ? VEC * ES / 4 : 1;  // 32-bit words per load (D 32, bf16: half of one)
static_assert(D == 32 || D == 64 || D == 128 || D == 256, "HEAD_DIM must be 32, 64, 128 or 256");
static_assert(G >= 1 && G <= 16, "GROUP must be 1..16");
static_assert(RW == 1 || RW == 2 || RW == 4, "load width");

// Decode geometry: DEC_NW warps per block, DEC_U rows in flight per warp; MIN_CHUNK rows per split at least.
#define DEC_NW 4
#define DEC_U (KV_BF16 ? 4 : 2)
#define MIN_CHUNK 64
// Prefill geometry: PF_QT warps (tokens) per block, tiles of PF_R rows, PF_U rows per step.
#define PF_QT 8
#define PF_U 4
constexpr int PF_R0 = 16384 / (D * ES);
constexpr int PF_R = (PF_R0 > 64 ? 64 : PF_R0) / PF_U * PF_U;  // 32 (bf16, D 256), 16 (f32, D 256), 64 (D 64)
constexpr int PF_STAGE_BYTES = 2 * PF_R * D * ES;  // K tile then V tile

// Element index of lane `lane`, load c, component i (the same mapping for q, k, v, o and the gate).
__device__ __forceinline__ int elem(int lane, int c, int i) { return VEC * (lane + 32 * c) + i; }

__device__ __forceinline__ void ld_raw(const void* p, u32 (&r)[RW]) {
  if constexpr (RW == 4) {
    const uint4 v = *static_cast<const uint4*>(p);
    r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
  } else if constexpr (RW == 2) {
    const uint2 v = *static_cast<const uint2*>(p);
    r[0] = v.x; r[1] = v.y;
  } else if constexpr (VEC * ES == 2) {
    r[0] = u32(*static_cast<const u16*>(p));
  } else {
    r[0] = *static_cast<const u32*>(p);
  }
}
__device__ __forceinline__ void zero_raw(u32 (&r)[RW]) {
#pragma unroll
  for (int w = 0; w < RW; ++w) r[w] = 0u;
}
__device__ __forceinline__ void cvt_raw(const u32 (&r)[RW], float (&f)[VEC]) {
#pragma unroll
  for (int w = 0; w < RW; ++w) {
    if constexpr (ES == 2) {
      f[2 * w] = __uint_as_float(r[w] << 16);
      if constexpr (VEC > 1) f[2 * w + 1] = __uint_as_float(r[w] & 0xffff0000u);
    } else {
      f[w] = __uint_as_float(r[w]);
    }
  }
}

// Sums v[0..GP) over the warp; afterwards every lane holds the total of head lane / LPH.
__device__ __forceinline__ float head_reduce(float (&v)[GP], int lane) {
#pragma unroll
  for (int n = GP, off = 16; n > 1; n >>= 1, off >>= 1) {
    const bool up = (lane & off) != 0;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float send = up ? v[i] : v[i + n / 2];
      const float keep = up ? v[i + n / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(FULL_MASK, send, off);
    }
  }
  float s = v[0];
#pragma unroll
  for (int off = LPH / 2; off >= 1; off >>= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
  return s;
}

// One warp's attention state for the G query heads of a kv head: queries and accumulators (this lane's
// EPL elements of each head), running max m and sum l of head lane / LPH.
struct WarpAttn {
  float q[G][EPL];
  float o[G][EPL];
  float m, l;
};

__device__ __forceinline__ void warp_init(WarpAttn& A, const float* q, int lane) {
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        A.q[g][c * VEC + i] = q[g * D + elem(lane, c, i)];
        A.o[g][c * VEC + i] = 0.f;
      }
  A.m = NEG_INF;
  A.l = 0.f;
}

// U rows (raw K and V, zeros where invalid): scores, online softmax update, accumulate P·V.
template <int U>
__device__ __forceinline__ void warp_rows(WarpAttn& A, const u32 (&kr)[U][NCH][RW], const u32 (&vr)[U][NCH][RW],
                                          const bool (&valid)[U], float scale, int lane) {
  float s[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float d[GP];
#pragma unroll
    for (int g = 0; g < GP; ++g) d[g] = 0.f;
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      float kf[VEC];
      cvt_raw(kr[u][c], kf);
#pragma unroll
      for (int i = 0; i < VEC; ++i)
#pragma unroll
        for (int g = 0; g < G; ++g) d[g] = fmaf(A.q[g][c * VEC + i], kf[i], d[g]);
    }
    const float sc = head_reduce(d, lane) * scale;
    s[u] = valid[u] ? sc : NEG_INF;
  }
  float mx = A.m;
#pragma unroll
  for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u]);
  float corr = 1.f, p[U];
#pragma unroll
  for (int u = 0; u < U; ++u) p[u] = 0.f;
  if (mx != NEG_INF) {
    corr = expf(A.m - mx);  // 0 when A.m is -inf
#pragma unroll
    for (int u = 0; u < U; ++u) p[u] = expf(s[u] - mx);
  }
  float ps = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u) ps += p[u];
  A.l = A.l * corr + ps;
  A.m = mx;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float cg = __shfl_sync(FULL_MASK, corr, g * LPH);
#pragma unroll
    for (int e = 0; e < EPL; ++e) A.o[g][e] *= cg;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float vf[EPL];
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      float t[VEC];
      cvt_raw(vr[u][c], t);
#pragma unroll
      for (int i = 0; i < VEC; ++i) vf[c * VEC + i] = t[i];
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float pg = __shfl_sync(FULL_MASK, p[u], g * LPH);
#pragma unroll
      for (int e = 0; e < EPL; ++e) A.o[g][e] = fmaf(pg, vf[e], A.o[g][e]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// qk_prep
// ---------------------------------------------------------------------------------------------------
// One warp per (token, head): q heads, then k heads, then (APPEND) v heads. APPEND also writes each prepared k row
// and each v row at cache row pos[0] + t (what attn_kv_append would write, from the same fp32 values), or nothing
// there for a position outside [0, max_ctx) as attn_kv_append does.
template <bool APPEND>
__device__ __forceinline__ void qk_prep_body(
    const float* __restrict__ qg, i64 qg_stride, const float* __restrict__ k, i64 k_stride,
    const float* __restrict__ v, i64 v_stride, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
    const int* __restrict__ pos, float* __restrict__ q_out, i64 q_stride, float* __restrict__ gate_out,
    i64 g_stride, float* __restrict__ k_out, i64 ko_stride, void* __restrict__ k_cache, void* __restrict__ v_cache,
    i64 max_ctx, int cache_dtype, int heads, int kv_heads, int rotary_dim, double theta, float eps) {
  __shared__ float row[4][D];
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hh = blockIdx.y * 4 + warp;
  if (hh >= heads + (APPEND ? 2 : 1) * kv_heads) return;
  // The rotation's cos / sin before the wait: the double-precision pow, cos and sin are most of this kernel's
  // latency, and they need only the position, which the step's upload or the previous step's advance_position
  // wrote (two or more kernels back: read through the L2, common.cuh).
  constexpr int NI = (D / 2 + 31) / 32;  // rotary pairs per lane (rotary_dim <= D)
  const int half = rotary_dim / 2;
  const int p0 = ld_cg_i32(pos);
  const i64 p = i64(p0) + t;
  float rc[NI], rs[NI];
#pragma unroll
  for (int it = 0; it < NI; ++it) {
    const int i = lane + 32 * it;
    rc[it] = rs[it] = 0.f;
    if (i < half) {
      const float inv_freq = float(1.0 / pow(theta, double(2 * i) / double(rotary_dim)));
      const double ang = double(p) * double(inv_freq);
      rc[it] = float(cos(ang));
      rs[it] = float(sin(ang));
    }
  }
  LILY_PDL_PROLOGUE();
  const bool in_cache = APPEND && p0 >= 0 && p < max_ctx;
  if (APPEND && hh >= heads + kv_heads) {  // a v head: its row into the cache
    const int h = hh - heads - kv_heads;
    if (!in_cache) return;
    const float* vs = v + t * v_stride + i64(h) * D;
    const i64 crow = (i64(h) * max_ctx + p) * D;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) store_from_f32(v_cache, cache_dtype, crow + lane + 32 * i, vs[lane + 32 * i]);
    return;
  }
  const bool is_q = hh < heads;
  const float* src = is_q ? qg + t * qg_stride + i64(hh) * 2 * D : k + t * k_stride + i64(hh - heads) * D;
  const float* w = is_q ? q_norm : k_norm;
  float* dst = is_q ? q_out + t * q_stride + i64(hh) * D : k_out + t * ko_stride + i64(hh - heads) * D;
  // APPEND, a k head in the cache: its cache row, written with the same values as dst.
  const bool to_cache = in_cache && !is_q;
  const i64 crow = to_cache ? (i64(hh - heads) * max_ctx + p) * D : 0;
  float x[D / 32];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    x[i] = src[lane + 32 * i];
    ss = fmaf(x[i], x[i], ss);
  }
  ss = warp_sum(ss);
  const float r = 1.f / sqrtf(ss / float(D) + eps);
#pragma unroll
  for (int i = 0; i < D / 32; ++i) row[warp][lane + 32 * i] = __fmul_rn(__fmul_rn(x[i], r), w[lane + 32 * i]);
  __syncwarp();
#pragma unroll
  for (int it = 0; it < NI; ++it) {
    const int i = lane + 32 * it;
    if (i < half) {
      const float c = rc[it], s = rs[it];
      const float x0 = row[warp][i], x1 = row[warp][i + half];
      const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
      const float y1 = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
      dst[i] = y0;
      dst[i + half] = y1;
      if (to_cache) {
        store_from_f32(k_cache, cache_dtype, crow + i, y0);
        store_from_f32(k_cache, cache_dtype, crow + i + half, y1);
      }
    }
  }
  for (int e = rotary_dim + lane; e < D; e += 32) {
    dst[e] = row[warp][e];
    if (to_cache) store_from_f32(k_cache, cache_dtype, crow + e, row[warp][e]);
  }
  if (is_q) {
    float* gd = gate_out + t * g_stride + i64(hh) * D;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) gd[lane + 32 * i] = src[D + lane + 32 * i];
  }
}

extern "C" __global__ void __launch_bounds__(128) attn_qk_prep(
    const float* __restrict__ qg, i64 qg_stride, const float* __restrict__ k, i64 k_stride,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm, const int* __restrict__ pos,
    float* __restrict__ q_out, i64 q_stride, float* __restrict__ gate_out, i64 g_stride,
    float* __restrict__ k_out, i64 ko_stride, int heads, int kv_heads, int rotary_dim, double theta,
    float eps) {
  qk_prep_body<false>(qg, qg_stride, k, k_stride, nullptr, 0, q_norm, k_norm, pos, q_out, q_stride, gate_out, g_stride,
                      k_out, ko_stride, nullptr, nullptr, 0, 0, heads, kv_heads, rotary_dim, theta, eps);
}

// attn_qk_prep and attn_kv_append in one launch (Ops::attn_qk_prep_append): grid (T, ceil((heads + 2 kv) / 4)).
extern "C" __global__ void __launch_bounds__(128) attn_qk_prep_append(
    const float* __restrict__ qg, i64 qg_stride, const float* __restrict__ k, i64 k_stride,
    const float* __restrict__ v, i64 v_stride, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
    const int* __restrict__ pos, float* __restrict__ q_out, i64 q_stride, float* __restrict__ gate_out,
    i64 g_stride, float* __restrict__ k_out, i64 ko_stride, void* __restrict__ k_cache, void* __restrict__ v_cache,
    i64 max_ctx, int cache_dtype, int heads, int kv_heads, int rotary_dim, double theta, float eps) {
  qk_prep_body<true>(qg, qg_stride, k, k_stride, v, v_stride, q_norm, k_norm, pos, q_out, q_stride, gate_out,
                     g_stride, k_out, ko_stride, k_cache, v_cache, max_ctx, cache_dtype, heads, kv_heads, rotary_dim,
                     theta, eps);
}

// ---------------------------------------------------------------------------------------------------
// kv_append
// ---------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(64) attn_kv_append(
    const float* __restrict__ k, i64 k_stride, const float* __restrict__ v, i64 v_stride,
    const int* __restrict__ pos, void* __restrict__ k_cache, void* __restrict__ v_cache, i64 max_ctx,
    int cache_dtype) {
  LILY_PDL_PROLOGUE();
  const int t = blockIdx.x, h = blockIdx.y;
  const i64 p = i64(pos[0]) + t;
  if (pos[0] < 0 || p >= max_ctx) return;  // a corrupted position: write nothing (the CPU throws)
  const i64 row = (i64(h) * max_ctx + p) * D;
  const float* ks = k + t * k_stride + i64(h) * D;
  const float* vs = v + t * v_stride + i64(h) * D;
  for (int e = threadIdx.x; e < D; e += blockDim.x) {
    store_from_f32(k_cache, cache_dtype, row + e, ks[e]);
    store_from_f32(v_cache, cache_dtype, row + e, vs[e]);
  }
}

// ---------------------------------------------------------------------------------------------------
// decode: split-KV partials, then the reduce
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ int active_splits(int len, int ns) {
  const int a = (len + MIN_CHUNK - 1) / MIN_CHUNK;
  return a < ns ? a : ns;
}

// part_o [kv][ns][G][D] and part_ml [kv][ns][G][2] (max, sum) in ws.
extern "C" __global__ void __launch_bounds__(DEC_NW * 32) attn_decode_split(
    const float* __restrict__ q, const unsigned char* __restrict__ k_cache,
    const unsigned char* __restrict__ v_cache, const int* __restrict__ pos, i64 max_ctx, int ns, float scale,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
  LILY_PDL_PROLOGUE();
  extern __shared__ float dec_so[];  // [DEC_NW][G][D], dynamic (64 KB at G 16, D 256)
  __shared__ float sml[DEC_NW][G][2];
  const int split = blockIdx.x, kvh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int len = pos[0] + 1;
  const int a = active_splits(len, ns);
  if (split >= a) return;
  const int chunk = (len + a - 1) / a;
  const int j0 = split * chunk, j1 = min(len, j0 + chunk);

  WarpAttn A;
  warp_init(A, q + i64(kvh) * G * D, lane);
  const unsigned char* kb = k_cache + i64(kvh) * max_ctx * D * ES;
  const unsigned char* vb = v_cache + i64(kvh) * max_ctx * D * ES;
  constexpr int U = DEC_U;
  for (int j = j0 + warp * U; j < j1; j += DEC_NW * U) {
    u32 kr[U][NCH][RW], vr[U][NCH][RW];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      valid[u] = j + u < j1;
#pragma unroll
      for (int c = 0; c < NCH; ++c) {
        const i64 off = i64(j + u) * D * ES + i64(elem(lane, c, 0)) * ES;
        if (valid[u]) {
          ld_raw(kb + off, kr[u][c]);
          ld_raw(vb + off, vr[u][c]);
        } else {
          zero_raw(kr[u][c]);
          zero_raw(vr[u][c]);
        }
      }
    }
    warp_rows<U>(A, kr, vr, valid, scale, lane);
  }

  // Merge the block's warps.
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
      for (int i = 0; i < VEC; ++i) dec_so[(warp * G + g) * D + elem(lane, c, i)] = A.o[g][c * VEC + i];
  const int hl = lane / LPH;
  if (lane % LPH == 0 && hl < G) {
    sml[warp][hl][0] = A.m;
    sml[warp][hl][1] = A.l;
  }
  __syncthreads();
  const i64 base = i64(kvh) * ns + split;
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, e = idx % D;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < DEC_NW; ++w) M = fmaxf(M, sml[w][g][0]);
    float acc = 0.f, L = 0.f;
    if (M != NEG_INF) {
#pragma unroll
      for (int w = 0; w < DEC_NW; ++w) {
        const float f = expf(sml[w][g][0] - M);
        acc = fmaf(f, dec_so[(w * G + g) * D + e], acc);
        L = fmaf(f, sml[w][g][1], L);
      }
    }
    part_o[(base * G + g) * D + e] = acc;
    if (e == 0) {
      part_ml[(base * G + g) * 2] = M;
      part_ml[(base * G + g) * 2 + 1] = L;
    }
  }
}

// Grid (heads, D / RED_RC), block 256: merges the active partials of head h for RED_RC of its columns,
// out = o / l · sigmoid(gate). Thread (sg, f) sums splits sg, sg + RED_SG, ... of float4 column f (up to RED_NPT
// of them loaded before the weights are known, so the partials' L2 round trip overlaps the max and sum), the
// RED_SG partial sums meet in shared memory in sg order. The one-block-per-head form walked all splits in one
// thread per column: ~64 dependent L2 loads, 11 µs on the critical path of every attention layer (H100 trace).
constexpr int RED_RC = D < 64 ? D : 64;  // columns per block
constexpr int RED_RF = RED_RC / 4;       // float4 columns per block
constexpr int RED_SG = 256 / RED_RF;     // split groups
#define RED_NPT 8                        // partials per thread loaded ahead of the weights
extern "C" __global__ void __launch_bounds__(256) attn_decode_reduce(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, const int* __restrict__ pos, int ns,
    const float* __restrict__ gate, float* __restrict__ out) {
  LILY_PDL_PROLOGUE();
  extern __shared__ float wsplit[];  // [ns]
  __shared__ float scratch[32];
  __shared__ __align__(16) float red[RED_SG * RED_RC];
  const int h = blockIdx.x, kvh = h / G, g = h % G, tid = threadIdx.x;
  const int f = tid % RED_RF, sg = tid / RED_RF, col = blockIdx.y * RED_RC + 4 * f;
  const int a = active_splits(pos[0] + 1, ns);
  const i64 base = i64(kvh) * ns;
  auto po = [&](int s) { return reinterpret_cast<const float4*>(part_o + ((base + s) * G + g) * D + col); };
  float4 ahead[RED_NPT];
#pragma unroll
  for (int i = 0; i < RED_NPT; ++i) {
    const int s = sg + i * RED_SG;
    ahead[i] = s < a ? *po(s) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const float gt = tid < RED_RC ? gate[i64(h) * D + blockIdx.y * RED_RC + tid] : 0.f;
  float mx = NEG_INF;
  for (int s = tid; s < a; s += blockDim.x) mx = fmaxf(mx, part_ml[((base + s) * G + g) * 2]);
  const float M = block_max(mx, scratch);
  float lsum = 0.f;
  for (int s = tid; s < a; s += blockDim.x) {
    const float m = part_ml[((base + s) * G + g) * 2];
    const float w = m == NEG_INF ? 0.f : expf(m - M);
    wsplit[s] = w;
    lsum = fmaf(w, part_ml[((base + s) * G + g) * 2 + 1], lsum);
  }
  const float L = block_sum(lsum, scratch);  // its barriers also publish wsplit
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  auto add = [&](int s, const float4& v) {
    const float w = wsplit[s];
    acc.x = fmaf(w, v.x, acc.x), acc.y = fmaf(w, v.y, acc.y), acc.z = fmaf(w, v.z, acc.z), acc.w = fmaf(w, v.w, acc.w);
  };
#pragma unroll
  for (int i = 0; i < RED_NPT; ++i)
    if (sg + i * RED_SG < a) add(sg + i * RED_SG, ahead[i]);
  for (int s = sg + RED_NPT * RED_SG; s < a; s += RED_SG) add(s, *po(s));
  *reinterpret_cast<float4*>(&red[sg * RED_RC + 4 * f]) = acc;
  __syncthreads();
  if (tid < RED_RC) {
    float o = 0.f;
#pragma unroll 8
    for (int j = 0; j < RED_SG; ++j) o += red[j * RED_RC + tid];
    out[i64(h) * D + blockIdx.y * RED_RC + tid] = o / L / (1.f + expf(-gt));
  }
}

// ---------------------------------------------------------------------------------------------------
// prefill
// ---------------------------------------------------------------------------------------------------

// Keys per split of a split prefill over `total` keys: whole tiles, ns splits at most (the ones past total never
// run: the prefill kernels return at once and the reduce reads only the others).
__device__ __forceinline__ int split_keys(int total, int ns, int tile) {
  return ((total + ns - 1) / ns + tile - 1) / tile * tile;
}

__device__ __forceinline__ u32 pack_bf16(u16 lo, u16 hi) { return u32(lo) | (u32(hi) << 16); }
// p = hi + lo in bf16 (hi = round(p), lo = round(p - hi)); returns the two packed pairs for (x0, x1).
__device__ __forceinline__ void split2(float x0, float x1, u32& hi, u32& lo) {
  const u16 h0 = f32_to_bf16(x0), h1 = f32_to_bf16(x1);
  hi = pack_bf16(h0, h1);
  lo = pack_bf16(f32_to_bf16(x0 - bf16_to_f32(h0)), f32_to_bf16(x1 - bf16_to_f32(h1)));
}
// x = hi + lo + lo2 + O(2^-24 |x|): each part the nearest bf16 of what the previous parts leave (the
// differences are exact in fp32).
__device__ __forceinline__ void split3(float x0, float x1, u32& hi, u32& lo, u32& lo2) {
  const u16 h0 = f32_to_bf16(x0), h1 = f32_to_bf16(x1);
  const float r0 = x0 - bf16_to_f32(h0), r1 = x1 - bf16_to_f32(h1);
  const u16 l0 = f32_to_bf16(r0), l1 = f32_to_bf16(r1);
  hi = pack_bf16(h0, h1);
  lo = pack_bf16(l0, l1);
  lo2 = pack_bf16(f32_to_bf16(r0 - bf16_to_f32(l0)), f32_to_bf16(r1 - bf16_to_f32(l1)));
}


// Stages rows [j0, j0 + PF_R) of K and V (rows >= len zero filled) into `stage`.
__device__ __forceinline__ void pf_load(unsigned char* stage, const unsigned char* kb, const unsigned char* vb,
                                        int j0, int len) {
  constexpr int ROW16 = D * ES / 16, N16 = PF_R * ROW16;
  const u32 s0 = smem_addr(stage);
  for (int ci = threadIdx.x; ci < 2 * N16; ci += blockDim.x) {
    const int which = ci / N16, cj = ci % N16, r = cj / ROW16;
    const bool ok = j0 + r < len;
    const unsigned char* src = (which ? vb : kb) + (ok ? (i64(j0) * ROW16 + cj) * 16 : 0);
    cp_async16(s0 + u32(ci) * 16u, src, ok ? 16 : 0);
  }
}

extern "C" __global__ void __launch_bounds__(PF_QT * 32) attn_prefill(
    const float* __restrict__ q, i64 q_stride, const float* __restrict__ gate, i64 g_stride,
    const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
    const int* __restrict__ pos, i64 max_ctx, int T, float scale, float* __restrict__ out, i64 o_stride, int ns,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
  LILY_PDL_PROLOGUE();
  extern __shared__ __align__(16) unsigned char pf_smem[];  // 2 stages of [K tile | V tile]
  const int kvh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * PF_QT + warp;
  const int t_last = min(T - 1, blockIdx.x * PF_QT + PF_QT - 1);
  const int pos0 = pos[0];
  const int len_block = pos0 + t_last + 1;
  const bool active = t < T;
  const unsigned char* kb = k_cache + i64(kvh) * max_ctx * D * ES;
  const unsigned char* vb = v_cache + i64(kvh) * max_ctx * D * ES;
#if PF_SPLIT
  // This split's keys [j0, jend): whole tiles, the last split's end the block's own. A split that starts past the
  // chunk's keys is not read by the reduce; one that starts past this block's (an early token tile in the last
  // split) writes empty partials.
  const int per = split_keys(pos0 + T, ns, PF_R);
  const int j0 = blockIdx.z * per, jend = min(len_block, j0 + per);
  if (j0 >= pos0 + T) return;
  const int it0 = j0 / PF_R, ntile = jend > j0 ? (jend + PF_R - 1) / PF_R : it0;
#else
  const int jend = len_block, it0 = 0, ntile = (len_block + PF_R - 1) / PF_R;
#endif
  const int len_t = min(pos0 + t + 1, jend);  // keys this warp's token sees here

  WarpAttn A;
  warp_init(A, q + i64(active ? t : 0) * q_stride + i64(kvh) * G * D, lane);
  if (it0 < ntile) {
    pf_load(pf_smem, kb, vb, it0 * PF_R, jend);
    cp_async_commit();
  }
  for (int it = it0; it < ntile; ++it) {
    if (it + 1 < ntile) {
      pf_load(pf_smem + ((it + 1 - it0) & 1) * PF_STAGE_BYTES, kb, vb, (it + 1) * PF_R, jend);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const unsigned char* ks = pf_smem + ((it - it0) & 1) * PF_STAGE_BYTES;
    const unsigned char* vs = ks + PF_R * D * ES;
    const int jt = it * PF_R;
    if (active) {
      for (int r = 0; r < PF_R && jt + r < len_t; r += PF_U) {
        u32 kr[PF_U][NCH][RW], vr[PF_U][NCH][RW];
        bool valid[PF_U];
#pragma unroll
        for (int u = 0; u < PF_U; ++u) {
          valid[u] = jt + r + u < len_t;
#pragma unroll
          for (int c = 0; c < NCH; ++c) {
            const int off = (r + u) * D * ES + elem(lane, c, 0) * ES;
            ld_raw(ks + off, kr[u][c]);
            ld_raw(vs + off, vr[u][c]);
          }
        }
        warp_rows<PF_U>(A, kr, vr, valid, scale, lane);
      }
    }
    __syncthreads();
  }
  if (!active) return;
#if PF_SPLIT
  // Unnormalised partials of the G heads (a split with no key for this token: m = -inf, l = 0, o = 0).
  const int heads = gridDim.y * G;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const i64 at = (i64(t) * heads + kvh * G + g) * ns + blockIdx.z;
    const float m = __shfl_sync(FULL_MASK, A.m, g * LPH), l = __shfl_sync(FULL_MASK, A.l, g * LPH);
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
      for (int i = 0; i < VEC; ++i) part_o[at * D + elem(lane, c, i)] = A.o[g][c * VEC + i];
    if (lane == 0) {
      part_ml[at * 2] = m;
      part_ml[at * 2 + 1] = l;
    }
  }
#else
  const float* gt = gate + i64(t) * g_stride + i64(kvh) * G * D;
  float* o = out + i64(t) * o_stride + i64(kvh) * G * D;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float l = __shfl_sync(FULL_MASK, A.l, g * LPH);
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int e = elem(lane, c, i);
        o[g * D + e] = A.o[g][c * VEC + i] / l / (1.f + expf(-gt[g * D + e]));
      }
  }
#endif
}

// Grid (T, heads), block 128: merges the partials of (token, head) of a split prefill (PF_SPLIT) and applies
// sigmoid(gate). Only the splits that start inside the chunk's keys ran (split_keys); every token sees key 0 in
// split 0, so at least one partial is not empty.
extern "C" __global__ void __launch_bounds__(128) attn_prefill_reduce(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, const int* __restrict__ pos, int T, int ns,
    int tile, const float* __restrict__ gate, i64 g_stride, float* __restrict__ out, i64 o_stride) {
  LILY_PDL_PROLOGUE();
  extern __shared__ float wsplit[];  // [ns]
  __shared__ float scratch[32];
  const int t = blockIdx.x, h = blockIdx.y;
  const int total = pos[0] + T, per = split_keys(total, ns, tile), a = (total + per - 1) / per;
  const i64 base = (i64(t) * gridDim.y + h) * ns;
  float mx = NEG_INF;
  for (int s = threadIdx.x; s < a; s += blockDim.x) mx = fmaxf(mx, part_ml[(base + s) * 2]);
  const float M = block_max(mx, scratch);
  float lsum = 0.f;
  for (int s = threadIdx.x; s < a; s += blockDim.x) {
    const float m = part_ml[(base + s) * 2];
    const float f = m == NEG_INF ? 0.f : expf(m - M);
    wsplit[s] = f;
    lsum = fmaf(f, part_ml[(base + s) * 2 + 1], lsum);
  }
  const float L = block_sum(lsum, scratch);  // its barriers also publish wsplit
  const float* gt = gate + i64(t) * g_stride + i64(h) * D;
  float* o = out + i64(t) * o_stride + i64(h) * D;
  for (int e = threadIdx.x; e < D; e += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < a; ++s) acc = fmaf(wsplit[s], part_o[(base + s) * D + e], acc);
    o[e] = acc / L / (1.f + expf(-gt[e]));
  }
}

// ---------------------------------------------------------------------------------------------------
// prefill on tensor cores (bf16 caches, G dividing 64)
// ---------------------------------------------------------------------------------------------------
// Block: 4 warps, MM_BM = 64 query rows = MM_QT tokens × G heads of one kv head (row r: token
// r / G, head r % G), warp w owns rows 16w..16w+15. Q is staged once in shared memory as two bf16 halves
// (q = hi + lo, both rounded to nearest), K/V tiles of MM_BN rows by cp.async (double buffered); per tile
// S = Q_hi·Kᵀ + Q_lo·Kᵀ and O += P_hi·V + P_lo·V with mma.sync m16n8k16 (fp32 accumulation), so
// the products carry about 16 mantissa bits of q and p and the result stays within ~1e-6 of the fp32
// kernel. Online softmax in fp32 on the S fragments (each lane: 2 rows × 2 columns per 8-key tile).
// Shared memory: (2·MM_BM + 4·MM_BN) rows of D·2 + 16 bytes (the pad keeps ldmatrix conflict free):
// 135 KB at D = 256 with 32-key tiles (one block per SM: 4 warps), 101 KB with 16-key tiles (two blocks per SM at
// 241 registers: twice the warps to hide the MMA and shared-load latencies; the backend option attn_prefill_keys). FLOPs 4× those of plain bf16 attention (the two halves of both products).
#if KV_BF16 && (64 % GROUP == 0)
#define MM_BM 64
#ifndef MM_BN
#define MM_BN 32  // keys per K/V tile (the host's attn_prefill_keys: 16 or 32)
#endif
static_assert(MM_BN == 16 || MM_BN == 32, "attn_prefill_mma: K/V tiles of 16 or 32 keys");
constexpr int MM_QT = MM_BM / G;
constexpr int MM_PITCH = D * 2 + 16;  // bytes per staged row
constexpr int MM_NT = D / 8;          // n-tiles of the output
constexpr int MM_SMEM = (2 * MM_BM + 4 * MM_BN) * MM_PITCH;

extern "C" __global__ void __launch_bounds__(128) attn_prefill_mma(
    const float* __restrict__ q, i64 q_stride, const float* __restrict__ gate, i64 g_stride,
    const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
    const int* __restrict__ pos, i64 max_ctx, int T, float scale, float* __restrict__ out, i64 o_stride, int ns,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
  LILY_PDL_PROLOGUE();
  extern __shared__ __align__(16) unsigned char mm_smem[];
  unsigned char* qhi = mm_smem;
  unsigned char* qlo = qhi + MM_BM * MM_PITCH;
  unsigned char* kv0 = qlo + MM_BM * MM_PITCH;  // stage s: K at kv0 + s·2·BN·PITCH, V after it
  const int kvh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t0 = blockIdx.x * MM_QT;
  const int t_last = min(T - 1, t0 + MM_QT - 1);
  const int pos0 = pos[0];
  const int len_block = pos0 + t_last + 1;
  const unsigned char* kb = k_cache + i64(kvh) * max_ctx * D * 2;
  const unsigned char* vb = v_cache + i64(kvh) * max_ctx * D * 2;
#if PF_SPLIT
  // This split's keys [j0, jend), as in attn_prefill.
  const int per = split_keys(pos0 + T, ns, MM_BN);
  const int j0 = blockIdx.z * per, jend = min(len_block, j0 + per);
  if (j0 >= pos0 + T) return;
  const int it0 = j0 / MM_BN, ntile = jend > j0 ? (jend + MM_BN - 1) / MM_BN : it0;
#else
  const int jend = len_block, it0 = 0, ntile = (len_block + MM_BN - 1) / MM_BN;
#endif

  // K/V tile loader: rows [j0, j0 + BN), zero from jend.
  auto load_tile = [&](int stage, int j0) {
    constexpr int ROW16 = D * 2 / 16;
    const u32 base = smem_addr(kv0 + stage * 2 * MM_BN * MM_PITCH);
    for (int ci = threadIdx.x; ci < 2 * MM_BN * ROW16; ci += blockDim.x) {
      const int which = ci / (MM_BN * ROW16), cj = ci % (MM_BN * ROW16), r = cj / ROW16, c16 = cj % ROW16;
      const bool ok = j0 + r < jend;
      const unsigned char* src = (which ? vb : kb) + (ok ? (i64(j0 + r) * ROW16 + c16) * 16 : 0);
      cp_async16(base + u32((which * MM_BN + r) * MM_PITCH + c16 * 16), src, ok ? 16 : 0);
    }
  };
  if (it0 < ntile) {
    load_tile(0, it0 * MM_BN);
    cp_async_commit();
  }

  // Q (pairs of elements), split into bf16 halves; rows of tokens past T are zero.
  for (int idx = threadIdx.x; idx < MM_BM * D / 2; idx += blockDim.x) {
    const int r = idx / (D / 2), e = (idx % (D / 2)) * 2;
    const int t = t0 + r / G, h = kvh * G + r % G;
    float x0 = 0.f, x1 = 0.f;
    if (t < T) {
      x0 = q[i64(t) * q_stride + i64(h) * D + e];
      x1 = q[i64(t) * q_stride + i64(h) * D + e + 1];
    }
    u32 hi, lo;
    split2(x0, x1, hi, lo);
    *reinterpret_cast<u32*>(qhi + r * MM_PITCH + e * 2) = hi;
    *reinterpret_cast<u32*>(qlo + r * MM_PITCH + e * 2) = lo;
  }

  // This lane's two rows (A: lane / 4, B: lane / 4 + 8 of the warp's 16) and their last visible key.
  const int rA = warp * 16 + (lane >> 2), rB = rA + 8;
  const int tA = t0 + rA / G, tB = t0 + rB / G;
  const int limA = pos0 + min(tA, t_last), limB = pos0 + min(tB, t_last);  // padding rows: harmless
  const int lim_warp = pos0 + min(t0 + (warp * 16 + 15) / G, t_last);
  float o[MM_NT][4];
#pragma unroll
  for (int n = 0; n < MM_NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float mA = NEG_INF, mB = NEG_INF, lA = 0.f, lB = 0.f;  // l: this lane's columns only

  for (int it = it0; it < ntile; ++it) {
    if (it + 1 < ntile) {
      load_tile((it + 1 - it0) & 1, (it + 1) * MM_BN);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int jt = it * MM_BN;
    if (jt <= lim_warp) {
      const unsigned char* ks = kv0 + ((it - it0) & 1) * 2 * MM_BN * MM_PITCH;
      const unsigned char* vs = ks + MM_BN * MM_PITCH;
      // S = Q·Kᵀ over the tile: 4 n-tiles of 8 keys, hi and lo accumulated apart.
      float sh[MM_BN / 8][4], sl[MM_BN / 8][4];
#pragma unroll
      for (int n = 0; n < MM_BN / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) sh[n][c] = sl[n][c] = 0.f;
      const int arow = warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), acol = (lane >> 4) * 8;
      const int brow = (lane >> 4) * 8 + (lane & 7), bcol = ((lane >> 3) & 1) * 8;
#pragma unroll 4
      for (int kk = 0; kk < D / 16; ++kk) {
        u32 ah[4], al[4];
        ldsm_x4(ah, smem_addr(qhi + arow * MM_PITCH + (kk * 16 + acol) * 2));
        ldsm_x4(al, smem_addr(qlo + arow * MM_PITCH + (kk * 16 + acol) * 2));
#pragma unroll
        for (int np = 0; np < MM_BN / 16; ++np) {
          u32 b[4];
          ldsm_x4(b, smem_addr(ks + (np * 16 + brow) * MM_PITCH + (kk * 16 + bcol) * 2));
          mma_m16n8k16(sh[2 * np], ah, b[0], b[1]);
          mma_m16n8k16(sh[2 * np + 1], ah, b[2], b[3]);
          mma_m16n8k16(sl[2 * np], al, b[0], b[1]);
          mma_m16n8k16(sl[2 * np + 1], al, b[2], b[3]);
        }
      }
      // Scale, mask, online softmax (rows A: c0 c1, B: c2 c3).
      float mxA = NEG_INF, mxB = NEG_INF;
#pragma unroll
      for (int n = 0; n < MM_BN / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int j = jt + n * 8 + (lane & 3) * 2 + (c & 1);
          const float v = (sh[n][c] + sl[n][c]) * scale;
          const bool ok = j <= (c < 2 ? limA : limB) && (!PF_SPLIT || j < jend);  // a split's next keys are not its
          sh[n][c] = ok ? v : NEG_INF;
          if (c < 2) mxA = fmaxf(mxA, sh[n][c]); else mxB = fmaxf(mxB, sh[n][c]);
        }
      mxA = fmaxf(mxA, __shfl_xor_sync(FULL_MASK, mxA, 1));
      mxA = fmaxf(mxA, __shfl_xor_sync(FULL_MASK, mxA, 2));
      mxB = fmaxf(mxB, __shfl_xor_sync(FULL_MASK, mxB, 1));
      mxB = fmaxf(mxB, __shfl_xor_sync(FULL_MASK, mxB, 2));
      // Finite without splits (key 0 is in every row's first tile); a split's row may see no key yet: -inf.
      const float nA = fmaxf(mA, mxA), nB = fmaxf(mB, mxB);
      const float cA = PF_SPLIT && nA == NEG_INF ? 1.f : expf(mA - nA);
      const float cB = PF_SPLIT && nB == NEG_INF ? 1.f : expf(mB - nB);
      mA = nA;
      mB = nB;
      float psA = 0.f, psB = 0.f;
#pragma unroll
      for (int n = 0; n < MM_BN / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float nm = c < 2 ? nA : nB;
          const float p = PF_SPLIT && nm == NEG_INF ? 0.f : expf(sh[n][c] - nm);
          sh[n][c] = p;
          if (c < 2) psA += p; else psB += p;
        }
      lA = lA * cA + psA;
      lB = lB * cB + psB;
#pragma unroll
      for (int n = 0; n < MM_NT; ++n) {
        o[n][0] *= cA;
        o[n][1] *= cA;
        o[n][2] *= cB;
        o[n][3] *= cB;
      }
      // O += P·V: k-steps of 16 keys; A fragments straight from the S fragments.
      const int vrow = ((lane >> 3) & 1) * 8 + (lane & 7), vcol = (lane >> 4) * 8;
#pragma unroll
      for (int kk = 0; kk < MM_BN / 16; ++kk) {
        u32 ph[4], pl[4];
        split2(sh[2 * kk][0], sh[2 * kk][1], ph[0], pl[0]);
        split2(sh[2 * kk][2], sh[2 * kk][3], ph[1], pl[1]);
        split2(sh[2 * kk + 1][0], sh[2 * kk + 1][1], ph[2], pl[2]);
        split2(sh[2 * kk + 1][2], sh[2 * kk + 1][3], ph[3], pl[3]);
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
          u32 b[4];
          ldsm_x4_t(b, smem_addr(vs + (kk * 16 + vrow) * MM_PITCH + (np * 16 + vcol) * 2));
          mma_m16n8k16(o[2 * np], ph, b[0], b[1]);
          mma_m16n8k16(o[2 * np + 1], ph, b[2], b[3]);
          mma_m16n8k16(o[2 * np], pl, b[0], b[1]);
          mma_m16n8k16(o[2 * np + 1], pl, b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }
  lA += __shfl_xor_sync(FULL_MASK, lA, 1);
  lA += __shfl_xor_sync(FULL_MASK, lA, 2);
  lB += __shfl_xor_sync(FULL_MASK, lB, 1);
  lB += __shfl_xor_sync(FULL_MASK, lB, 2);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half ? rB : rA, t = t0 + r / G, h = kvh * G + r % G;
    const float l = half ? lB : lA;
    if (t >= T) continue;
#if PF_SPLIT
    // Unnormalised partials (a row with no key in this split: m = -inf, l = 0, o = 0).
    const i64 at = (i64(t) * gridDim.y * G + h) * ns + blockIdx.z;
#pragma unroll
    for (int n = 0; n < MM_NT; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) part_o[at * D + n * 8 + (lane & 3) * 2 + c] = o[n][half * 2 + c];
    if ((lane & 3) == 0) {
      part_ml[at * 2] = half ? mB : mA;
      part_ml[at * 2 + 1] = l;
    }
    continue;
#endif
    const float* gt = gate + i64(t) * g_stride + i64(h) * D;
    float* po = out + i64(t) * o_stride + i64(h) * D;
#pragma unroll
    for (int n = 0; n < MM_NT; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int e = n * 8 + (lane & 3) * 2 + c;
        po[e] = o[n][half * 2 + c] / l / (1.f + expf(-gt[e]));
      }
  }
}
#endif

// ---------------------------------------------------------------------------------------------------
// decode on tensor cores (bf16 caches): the split-KV partials of attn_decode_split, computed by mma.sync
// ---------------------------------------------------------------------------------------------------
// Same grid, chunking and partial format as attn_decode_split (the same attn_decode_reduce follows). The
// G query heads of the kv head are the 16 rows of the mma A operand (rows >= G are zero, or for G <= 8
// rows 8..15 carry q's third bf16 part); each warp takes 16-key tiles of the block's chunk (tile warp,
// warp + 4, ...), staged by cp.async in its own two-stage shared buffer (Q's parts are staged once per
// block), and computes S = Q_hi·Kᵀ + Q_lo·Kᵀ (+ lo2·Kᵀ) and O += P_hi·V + P_lo·V like attn_prefill_mma.
// Error: q carried to ~2^-24 (G <= 8; 2^-16 per element otherwise), p to 2^-16 per key (rms ~2^-18),
// products exact, fp32 sums over <= chunk/4 keys per warp: 1.7e-6 of the exact result at 32K keys on a
// host emulation with round-to-nearest sums (the tensor cores' truncating accumulation not modelled; see
// test_attention_decode_32k). Per 16
// keys a warp issues 128 mma + 64 ldmatrix instead of ~3400 fp32 instructions, so the kernel streams the
// cache at the memory's pace. Shared memory: Q (2 × 16 rows) + 4 warps × 2 stages × 32 rows, each of
// D·2 + 16 bytes (152 KB at D = 256), the start reused for the block merge. One block (4 warps) per SM.
// DM_EARLY (host option attn_decode_early): each warp's first tile, less the step's new row, is loaded before the
// programmatic-launch wait (the rows are older steps'), the new row and q after it: at a short context that is
// every row of the chunk but one, so the kernel's critical path keeps q's staging and an L2 read instead of the
// cache's DRAM round trip.
#if KV_BF16
#ifndef DM_EARLY
#define DM_EARLY 0
#endif
#define DM_BN 16
constexpr int DM_PITCH = D * 2 + 16;
constexpr int DM_WARP_BYTES = 2 * 2 * DM_BN * DM_PITCH;  // 2 stages of [K tile | V tile]
constexpr int DM_NT = D / 8;
constexpr bool DM_Q3 = G <= 8;  // the padding rows 8..15 carry q's third bf16 part

extern "C" __global__ void __launch_bounds__(128) attn_decode_mma(
    const float* __restrict__ q, const unsigned char* __restrict__ k_cache,
    const unsigned char* __restrict__ v_cache, const int* __restrict__ pos, i64 max_ctx, int ns, float scale,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
#if !DM_EARLY
  LILY_PDL_PROLOGUE();
#endif
  extern __shared__ __align__(16) unsigned char dm_smem[];
  __shared__ float sml[4][G][2];
  const int split = blockIdx.x, kvh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // DM_EARLY: the position through the L2 before the wait (the step's upload or the previous step's
  // advance_position wrote it, two or more kernels back: common.cuh's contract).
  const int len = (DM_EARLY ? ld_cg_i32(pos) : pos[0]) + 1;
  const int a = active_splits(len, ns);
  if (split >= a) return;
  const int chunk = (len + a - 1) / a;
  const int j0 = split * chunk, j1 = min(len, j0 + chunk);
  const unsigned char* kb = k_cache + i64(kvh) * max_ctx * D * 2;
  const unsigned char* vb = v_cache + i64(kvh) * max_ctx * D * 2;
  unsigned char* dm_qhi = dm_smem;                 // [16][DM_PITCH]
  unsigned char* dm_qlo = dm_qhi + 16 * DM_PITCH;  // [16][DM_PITCH]
  unsigned char* wbuf = dm_qlo + 16 * DM_PITCH + warp * DM_WARP_BYTES;

  // This warp's tiles: starts j0 + 16·(warp + 4·i) below j1.
  const int ntiles = (j1 - j0 + DM_BN - 1) / DM_BN;
  const int my_tiles = ntiles > warp ? (ntiles - warp + 3) / 4 : 0;
  // Tile rows js.. of K and V into the stage (rows past j1 zero-filled); rows == skip are left alone, rows other
  // than `only` too when only >= 0.
  auto load_tile = [&](int stage, int js, int skip, int only) {
    constexpr int ROW16 = D * 2 / 16;
    const u32 base = smem_addr(wbuf + stage * 2 * DM_BN * DM_PITCH);
    for (int ci = lane; ci < 2 * DM_BN * ROW16; ci += 32) {
      const int which = ci / (DM_BN * ROW16), cj = ci % (DM_BN * ROW16), r = cj / ROW16, c16 = cj % ROW16;
      if (js + r == skip || (only >= 0 && js + r != only)) continue;
      const bool ok = js + r < j1;
      const unsigned char* src = (which ? vb : kb) + (ok ? (i64(js + r) * ROW16 + c16) * 16 : 0);
      cp_async16(base + u32((which * DM_BN + r) * DM_PITCH + c16 * 16), src, ok ? 16 : 0);
    }
  };
#if DM_EARLY
  // The first tile's rows written by earlier steps go out before the wait, so they stream while the kernel before
  // (the step's q/k prep and KV append) runs; the step's new row, len - 1, which that kernel writes, after it.
  const int js_first = j0 + DM_BN * warp;
  if (my_tiles > 0) load_tile(0, js_first, len - 1, -1);
  cp_async_commit();
  LILY_PDL_PROLOGUE();
  if (my_tiles > 0 && len - 1 >= js_first && len - 1 < js_first + DM_BN) load_tile(0, js_first, -1, len - 1);
  cp_async_commit();  // tile 0 is both groups: the loop's first wait leaves at most the group after them pending
#else
  if (my_tiles > 0) load_tile(0, j0 + DM_BN * warp, -1, -1);
  cp_async_commit();
#endif

  // Q (rows = heads, rows >= G zero) as bf16 parts in shared memory, read by ldmatrix as A fragments:
  // Q_hi rows 0..G-1 hold hi, Q_lo rows 0..G-1 hold lo. For G <= 8 the padding rows 8..8+G-1 of Q_lo hold
  // the third part lo2 = bf16(q - hi - lo) of head row - 8 (Q_hi zero there), so S row r + 8 of the lo
  // product is lo2·Kᵀ for head r, added to row r's score below: q is then carried to ~2^-24 (the two-part
  // form leaves up to 2^-16 |q| per element, an absolute score error ∝ |q|·|k|·scale that dominated the
  // 32K test's error), for no extra mma.
  // One round of independent float4 loads (q is 16-byte aligned: attention.cpp checks), then the splits:
  // a loop of dependent scalar loads here cost ~16 L2 round trips per block before the first tile.
  const int r0 = lane >> 2, r1 = r0 + 8, c2 = (lane & 3) * 2;
  const float4* qh4 = reinterpret_cast<const float4*>(q + i64(kvh) * G * D);
  constexpr int Q4 = G * D / 4, Q4_PER_THREAD = (Q4 + 127) / 128;
  float4 qv[Q4_PER_THREAD];
#pragma unroll
  for (int i = 0; i < Q4_PER_THREAD; ++i) {
    const int idx = threadIdx.x + 128 * i;
    qv[i] = idx < Q4 ? qh4[idx] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int i = 0; i < Q4_PER_THREAD; ++i) {
    const int idx = threadIdx.x + 128 * i;
    if (idx >= Q4) continue;
    const int g = idx / (D / 4), e = (idx % (D / 4)) * 4;
    uint2 hi, lo, lo2;
    split3(qv[i].x, qv[i].y, hi.x, lo.x, lo2.x);
    split3(qv[i].z, qv[i].w, hi.y, lo.y, lo2.y);
    *reinterpret_cast<uint2*>(dm_qhi + g * DM_PITCH + e * 2) = hi;
    *reinterpret_cast<uint2*>(dm_qlo + g * DM_PITCH + e * 2) = lo;
    if (DM_Q3) {  // row g + 8 carries head g's third part (its hi row zero)
      *reinterpret_cast<uint2*>(dm_qhi + (g + 8) * DM_PITCH + e * 2) = make_uint2(0u, 0u);
      *reinterpret_cast<uint2*>(dm_qlo + (g + 8) * DM_PITCH + e * 2) = lo2;
    }
  }
  // Rows that carry no head (G < 8, or G < 16 without the third part): zero.
  constexpr int FIRST_EMPTY = G, EMPTY_ROWS = DM_Q3 ? 2 * (8 - G) : 16 - G;
  for (int idx = threadIdx.x; idx < EMPTY_ROWS * D / 2; idx += 128) {
    const int k = idx / (D / 2), e = (idx % (D / 2)) * 2;
    const int r = DM_Q3 && k >= 8 - G ? k - (8 - G) + 8 + G : FIRST_EMPTY + k;
    *reinterpret_cast<u32*>(dm_qhi + r * DM_PITCH + e * 2) = 0u;
    *reinterpret_cast<u32*>(dm_qlo + r * DM_PITCH + e * 2) = 0u;
  }
  __syncthreads();
  const int arow = ((lane >> 3) & 1) * 8 + (lane & 7), acol = (lane >> 4) * 8;

  float o[DM_NT][4];
#pragma unroll
  for (int n = 0; n < DM_NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float mA = NEG_INF, mB = NEG_INF, lA = 0.f, lB = 0.f;
  const int brow = (lane >> 4) * 8 + (lane & 7), bcol = ((lane >> 3) & 1) * 8;
  const int vrow = ((lane >> 3) & 1) * 8 + (lane & 7), vcol = (lane >> 4) * 8;
  for (int i = 0; i < my_tiles; ++i) {
    const int js = j0 + DM_BN * (warp + 4 * i);
    if (i + 1 < my_tiles) {
      load_tile((i + 1) & 1, js + 4 * DM_BN, -1, -1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();
    const unsigned char* ks = wbuf + (i & 1) * 2 * DM_BN * DM_PITCH;
    const unsigned char* vs = ks + DM_BN * DM_PITCH;
    float sh[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}}, sl[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      u32 ah[4], al[4], b[4];
      ldsm_x4(ah, smem_addr(dm_qhi + arow * DM_PITCH + (kk * 16 + acol) * 2));
      ldsm_x4(al, smem_addr(dm_qlo + arow * DM_PITCH + (kk * 16 + acol) * 2));
      ldsm_x4(b, smem_addr(ks + brow * DM_PITCH + (kk * 16 + bcol) * 2));
      mma_m16n8k16(sh[0], ah, b[0], b[1]);
      mma_m16n8k16(sh[1], ah, b[2], b[3]);
      mma_m16n8k16(sl[0], al, b[0], b[1]);
      mma_m16n8k16(sl[1], al, b[2], b[3]);
    }
    float mxA = NEG_INF, mxB = NEG_INF;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = js + n * 8 + c2 + (c & 1);
        float t = sl[n][c];
        if (DM_Q3 && c < 2) t += sl[n][c + 2];  // lo2·Kᵀ from padding row B (row B's own score: unused)
        const float v = j < j1 ? (sh[n][c] + t) * scale : NEG_INF;
        sh[n][c] = v;
        if (c < 2) mxA = fmaxf(mxA, v); else mxB = fmaxf(mxB, v);
      }
    mxA = fmaxf(mxA, __shfl_xor_sync(FULL_MASK, mxA, 1));
    mxA = fmaxf(mxA, __shfl_xor_sync(FULL_MASK, mxA, 2));
    mxB = fmaxf(mxB, __shfl_xor_sync(FULL_MASK, mxB, 1));
    mxB = fmaxf(mxB, __shfl_xor_sync(FULL_MASK, mxB, 2));
    const float nA = fmaxf(mA, mxA), nB = fmaxf(mB, mxB);  // finite: key js < j1 is in every tile
    const float cA = expf(mA - nA), cB = expf(mB - nB);
    mA = nA;
    mB = nB;
    float psA = 0.f, psB = 0.f;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float p = expf(sh[n][c] - (c < 2 ? nA : nB));
        sh[n][c] = p;
        if (c < 2) psA += p; else psB += p;
      }
    lA = lA * cA + psA;
    lB = lB * cB + psB;
#pragma unroll
    for (int n = 0; n < DM_NT; ++n) {
      o[n][0] *= cA;
      o[n][1] *= cA;
      o[n][2] *= cB;
      o[n][3] *= cB;
    }
    u32 ph[4], pl[4];
    split2(sh[0][0], sh[0][1], ph[0], pl[0]);
    split2(sh[0][2], sh[0][3], ph[1], pl[1]);
    split2(sh[1][0], sh[1][1], ph[2], pl[2]);
    split2(sh[1][2], sh[1][3], ph[3], pl[3]);
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      u32 b[4];
      ldsm_x4_t(b, smem_addr(vs + vrow * DM_PITCH + (np * 16 + vcol) * 2));
      mma_m16n8k16(o[2 * np], ph, b[0], b[1]);
      mma_m16n8k16(o[2 * np + 1], ph, b[2], b[3]);
      mma_m16n8k16(o[2 * np], pl, b[0], b[1]);
      mma_m16n8k16(o[2 * np + 1], pl, b[2], b[3]);
    }
    __syncwarp();  // the stage is refilled by the next iteration's load
  }
  lA += __shfl_xor_sync(FULL_MASK, lA, 1);
  lA += __shfl_xor_sync(FULL_MASK, lA, 2);
  lB += __shfl_xor_sync(FULL_MASK, lB, 1);
  lB += __shfl_xor_sync(FULL_MASK, lB, 2);

  // Merge the block's warps (the stage buffers are reused for the accumulators).
  __syncthreads();
  float* so = reinterpret_cast<float*>(dm_smem);  // [4][G][D]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half ? r1 : r0;
    if (r < G) {
#pragma unroll
      for (int n = 0; n < DM_NT; ++n) {
        so[(warp * G + r) * D + n * 8 + c2] = o[n][half * 2];
        so[(warp * G + r) * D + n * 8 + c2 + 1] = o[n][half * 2 + 1];
      }
      if ((lane & 3) == 0) {
        sml[warp][r][0] = half ? mB : mA;
        sml[warp][r][1] = half ? lB : lA;
      }
    }
  }
  __syncthreads();
  // Each head's warp factors exp(m_w - M) once (not once per column), and its partial's (M, L).
  const i64 base = i64(kvh) * ns + split;
  __shared__ float sfac[G][4];
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < 4; ++w) M = fmaxf(M, sml[w][g][0]);
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float f = M != NEG_INF ? expf(sml[w][g][0] - M) : 0.f;
      sfac[g][w] = f;
      L = fmaf(f, sml[w][g][1], L);
    }
    part_ml[(base * G + g) * 2] = M;
    part_ml[(base * G + g) * 2 + 1] = L;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, e = idx % D;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) acc = fmaf(sfac[g][w], so[(w * G + g) * D + e], acc);
    part_o[(base * G + g) * D + e] = acc;
  }
}
#endif
