// Gated DeltaNet kernels (MODEL.md section 5): the causal depthwise conv + silu on [q|k|v] (§5.2) and the
// gated delta rule (§5.3-5.4). Each part is compiled only when its -D constants are given (a module built
// for the conv holds just conv1d_silu; one built with DK, DV the three gated_delta kernels).
//
// ---- conv1d_silu (-D KTAPS = K, 4 in the real model) ----
//   out[t, c] = silu(Σ_{j<K} w[c, j] · x[t-K+1+j, c]),  x[<0] taken from the carried state (oldest first),
//   then the state keeps the last K-1 pre-conv rows of [state; mixed].
//   mixed f32 [T, C] (row stride), conv_w f32 [C, K] (row stride; tap K-1 = current token),
//   state_in f32 [K-1, C] read, state_out f32 [K-1, C] written (may be state_in), out f32 [T, C] written;
//   cap f32 [cap_count·(K-1), C] written when cap_count > 0 (ops.h StateCapture): slice i = the state after row
//   cap_first + i, i.e. pre-conv rows cap_first + i - K + 2 .. cap_first + i of [state; mixed] (a copy: exact).
//   Grid (⌈C/128⌉, ⌈T/tpb⌉), block 128: thread c owns channel c for tokens [y·tpb, y·tpb + tpb); its K taps
//   and a window of the last K-1 inputs stay in registers, so every row of mixed is read once (plus K-1
//   rows of overlap per token block); loads and stores are coalesced over channels. The host gives
//   tpb >= K-1, so only block row y = 0 reads state_in; that same thread writes channel c of state_out
//   after its reads, which makes the in-place update race-free (no other thread touches channel c); the same
//   thread writes channel c of every capture slice first, reading mixed and state_in before state_out changes.
//   Floor: T·C·4 B read + T·C·4 B written (+ 2·(K-1)·C·4 B of state, + (K-1)·C·4 B per capture): 64 KiB per
//   decode token at C = 8192.
//   Sum order: taps j = 0..K-1 ascending from 0, as the CPU (FMA contraction may differ: fp32 rounding).
//
// ---- gated_delta (-D DK, DV = key / value head dim, 128 and 128 in the real model) ----
//   Per value head j, key head kh = j / (Hv/Hk) (repeat-interleave, §5.3), for t = 0..T-1:
//     q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK),  k̂ = k / sqrt(Σk² + 1e-6),  β = σ(b),
//     α = exp(−exp(A_log_j) · softplus(a + dt_bias_j))      (softplus(x) = x above 20, as torch)
//     S ← α·S;  m = Sᵀk̂;  δ = β·(v − m);  S ← S + k̂ ⊗ δ;  o = Sᵀq̂          (the order of §5.4)
//   qkv f32 [T, 2·Hk·DK + Hv·DV] (the conv output: q head i at i·DK, k at Hk·DK + i·DK, v head j at
//   2·Hk·DK + j·DV), b, a f32 [T, Hv], A_log, dt_bias f32 [1, Hv]: read.
//   S_in f32 [Hv·DK, DV] read (row j·DK + i = row i of head j), S_out written (may be S_in), o f32
//   [T, Hv·DV] written. cap f32 [cap_count·Hv·DK, DV] written when cap_count > 0 (ops.h StateCapture):
//   slice i (rows i·Hv·DK ..) = S after token cap_first + i, stored from the registers right after that token's
//   update, so it equals the S_out of a call over tokens 0 .. cap_first + i bit for bit. Rows of S and of cap
//   need 16-byte alignment (the host checks).
//   Grid (Hv, ⌈DV/16⌉), block 64 = 2 warps; warp w of block y owns columns [c0, c0 + 8), c0 = (2y + w)·8,
//   of head j. Lane l holds column quad (l & 1) (4 columns, one float4) of rows i = 16·r + (l >> 1),
//   r < ⌈DK/16⌉: 32 floats of S per lane at DK = 128, in registers for all T tokens; a warp's float4 load
//   of one pass reads 16 rows × 32 B, whole sectors. S is read once and written once per call (in-place
//   safe: a warp writes only the slice it read). No shared memory and no __syncthreads: m and o are
//   reduced over the 16 lanes of a quad, transposed (quad_sum_t: 5 shuffles for 4 columns, each lane ends
//   with one column's total; m is then gathered back with 4 more, o is stored by 8 lanes in one 32 B
//   store); in the decode entry Σq², Σk² take 4 xor shuffles each (offsets 2, 4, 8, 16).
//   The inputs of token t+2 are loaded and those of t+1 normalised while token t updates the state.
//   Two entry points share that body: gated_delta (T = 1, decode) normalises q, k and computes α, β in
//   every warp; gated_delta_prepped (T > 1) reads q̂, k̂ [T, Hk·DK] and α, β [T, Hv] that gated_delta_prep
//   wrote to the workspace (grid (T, ⌈Hk/4⌉) × 128: a warp per (token, key head)), which takes the norms,
//   sqrt, exp and log1p off the scan's per-token path.
//   Real model: 32 × 8 = 256 blocks (512 warps) for decode and prefill alike (the sequential scan).
//   Floor: the state crosses memory once per call, 2 · 32·128·128·4 B = 4 MiB per layer (~1 µs at 4 TB/s),
//   plus 2 MiB written per captured token;
//   T·Hv·DK·DV·8 FLOPs (4 fp32 instructions per state element per token). Prefill is bound by issue and by
//   the per-token dependency chain (decay, m, 9 shuffles, update); from delta_chunk_rows rows the host takes the
//   chunked form below instead.
//   Sum order: per lane rows ascending in r (two partial sums for m: even and odd r), then the shuffle
//   tree; fixed by DK, never by T.
//
// Oracle: CpuOps::conv1d_silu_impl / gated_delta_impl (csrc/cpu/gated_delta.cpp); tests/cuda/test_gated_delta.py.
#include "common.cuh"

#if defined(KTAPS)
// Σ_j w[j]·x[t-K+1+j] with the window hist = the K-1 inputs before x, taps ascending (shared with the fused
// decode kernel below, so both contract to the same FMAs).
__device__ __forceinline__ float conv_taps(const float (&wk)[KTAPS], const float (&hist)[KTAPS > 1 ? KTAPS - 1 : 1],
                                           float x) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < KTAPS - 1; ++j) acc += wk[j] * hist[j];
  acc += wk[KTAPS - 1] * x;
  return acc;
}

extern "C" __global__ void __launch_bounds__(128)
    conv1d_silu(const float* __restrict__ mixed, i64 mixed_stride, const float* __restrict__ w, i64 w_stride,
                const float* state_in, i64 in_stride, float* state_out, i64 st_stride, float* __restrict__ out,
                i64 out_stride, float* __restrict__ cap, i64 cap_stride, int cap_first, int cap_count, int T, int C,
                int tpb) {
  constexpr int S = KTAPS - 1;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int t0 = blockIdx.y * tpb, t1 = min(T, t0 + tpb);
  // The taps (weights) and the carried state (the previous call's output, never the kernel just before this
  // one) before the wait (common.cuh); mixed is the projection's output, after it.
  float wk[KTAPS], hist[S > 0 ? S : 1];
  if (c < C) {
#pragma unroll
    for (int j = 0; j < KTAPS; ++j) wk[j] = w[i64(c) * w_stride + j];
#pragma unroll
    for (int j = 0; j < S; ++j) {
      const int src = t0 - S + j;  // token index; negative = row S + src of the carried state
      if (src < 0) hist[j] = ld_cg(state_in + i64(S + src) * in_stride + c);
    }
  }
  LILY_PDL_PROLOGUE();
  if (c >= C) return;
#pragma unroll
  for (int j = 0; j < S; ++j) {
    const int src = t0 - S + j;
    if (src >= 0) hist[j] = mixed[i64(src) * mixed_stride + c];
  }
  for (int t = t0; t < t1; ++t) {
    const float x = mixed[i64(t) * mixed_stride + c];
    out[i64(t) * out_stride + c] = silu(conv_taps(wk, hist, x));
#pragma unroll
    for (int j = 0; j + 1 < S; ++j) hist[j] = hist[j + 1];
    if (S > 0) hist[S > 0 ? S - 1 : 0] = x;
  }
  if (blockIdx.y != 0) return;
  // Captures: the state after row cap_first + i, read from mixed and state_in before state_out (which may be
  // state_in) is written below.
  for (int i = 0; i < cap_count; ++i)
#pragma unroll
    for (int r = 0; r < S; ++r) {
      const int src = cap_first + i - S + 1 + r;
      cap[(i64(i) * S + r) * cap_stride + c] =
          src >= 0 ? mixed[i64(src) * mixed_stride + c] : state_in[i64(S + src) * in_stride + c];
    }
  // New state: the last S rows of [old state; mixed]. When this block covered every token, that is the
  // window itself (it began as the old state); otherwise T > tpb >= S and they are all input rows.
#pragma unroll
  for (int r = 0; r < S; ++r)
    state_out[i64(r) * st_stride + c] = T <= tpb ? hist[r] : mixed[i64(T - S + r) * mixed_stride + c];
}
#endif  // KTAPS

#if defined(DK) && defined(DV)
#define GD_QUADS 2                         // float4 column quads per warp
#define GD_WCOLS (4 * GD_QUADS)            // columns per warp
#define GD_WARPS 2                         // warps per block
#define GD_RPP (32 / GD_QUADS)             // rows per pass
#define GD_R ((DK + GD_RPP - 1) / GD_RPP)  // passes: rows of S per lane
static_assert(GD_QUADS == 2, "quad_sum_t assumes lane bit 0 = quad, bits 1-4 = row lane");

// Sum over the lanes holding the same column quad (all rows of the warp's slice); GD_QUADS = 2 here.
__device__ __forceinline__ float quad_sum(float v) {
#pragma unroll
  for (int o = GD_QUADS; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// m[0..3] (the 4 columns of this lane's quad, partial over its rows) summed over the 16 lanes of the quad,
// transposed: halving the set of columns a lane keeps at offsets 16 and 8 (3 shuffles instead of 8), then
// offsets 4 and 2. Returns the total of column e = 2·bit4 + bit3 of the lane; lanes differing in bits 1, 2
// hold the same value.
__device__ __forceinline__ float quad_sum_t(float m0, float m1, float m2, float m3, int lane) {
  const bool hi16 = lane & 16, hi8 = lane & 8;
  const float r0 = (hi16 ? m2 : m0) + __shfl_xor_sync(0xffffffffu, hi16 ? m0 : m2, 16);
  const float r1 = (hi16 ? m3 : m1) + __shfl_xor_sync(0xffffffffu, hi16 ? m1 : m3, 16);
  float v = (hi8 ? r1 : r0) + __shfl_xor_sync(0xffffffffu, hi8 ? r0 : r1, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}
// The lane that holds column e of quad q after quad_sum_t.
__device__ __forceinline__ int quad_sum_t_lane(int q, int e) { return q | (e & 1) << 3 | (e >> 1) << 4; }

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

struct GdRaw {  // one token's inputs as read
  float q[GD_R], k[GD_R], v[4], a, b;
};
struct GdPrep {  // normalised
  float q[GD_R], k[GD_R], v[4], alpha, beta;
};

// A warp's 8-column slice of value head j's state in registers (lane: the column quad at col, rows
// 16·r + (lane >> 1)), loaded through the L2 (it may be read before the wait: common.cuh) and stored back.
__device__ __forceinline__ void delta_state_load(float4 (&S)[GD_R], const float* src, i64 stride, int j, int col,
                                                 int rl) {
#pragma unroll
  for (int r = 0; r < GD_R; ++r) {
    const int i = r * GD_RPP + rl;
    S[r] = i < DK ? ld_cg4(src + (i64(j) * DK + i) * stride + col) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}
__device__ __forceinline__ void delta_state_store(const float4 (&S)[GD_R], float* dst, i64 stride, int j, int col,
                                                  int rl) {
#pragma unroll
  for (int r = 0; r < GD_R; ++r) {
    const int i = r * GD_RPP + rl;
    if (i < DK) *reinterpret_cast<float4*>(dst + (i64(j) * DK + i) * stride + col) = S[r];
  }
}

// Per-token quantities of the prefill path, computed once instead of in every warp of the scan:
// qn, kn [T, Hk·DK] (q̂ with its 1/sqrt(DK) scale, k̂), alpha, beta [T, Hv]. Grid (T, ⌈Hk/4⌉), block 128:
// warp w normalises key head 4y + w of token t; block y = 0 also computes alpha, beta of every value head.
// Σq², Σk² are summed exactly as the decode entry's warps sum them (lane l: rows 16·r + (l >> 1), r
// ascending, then quad_sum), and the formulas are the same, so a token gives the same bits whether it
// comes in a prefill of T > 1 or in a decode step.
extern "C" __global__ void __launch_bounds__(128)
    gated_delta_prep(const float* __restrict__ qkv, i64 qkv_stride, const float* __restrict__ b, i64 b_stride,
                     const float* __restrict__ a, i64 a_stride, const float* __restrict__ A_log,
                     const float* __restrict__ dt_bias, float* __restrict__ qn, float* __restrict__ kn,
                     float* __restrict__ alpha, float* __restrict__ beta, int Hk, int Hv) {
  LILY_PDL_PROLOGUE();
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kh = blockIdx.y * 4 + warp;
  const i64 key_dim = i64(Hk) * DK;
  const float* row = qkv + i64(t) * qkv_stride;
  if (kh < Hk) {  // the whole warp
    const float* q = row + i64(kh) * DK;
    const float* k = row + key_dim + i64(kh) * DK;
    const int rl = lane / GD_QUADS;
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int r = 0; r < GD_R; ++r) {
      const int i = r * GD_RPP + rl;
      const float x = i < DK ? q[i] : 0.f, y = i < DK ? k[i] : 0.f;
      sq += x * x;
      sk += y * y;
    }
    sq = quad_sum(sq);
    sk = quad_sum(sk);
    const float q_scale = 1.f / sqrtf(float(DK));
    const float rq = q_scale / sqrtf(sq + 1e-6f), rk = 1.f / sqrtf(sk + 1e-6f);
    for (int i = lane; i < DK; i += 32) {
      qn[i64(t) * key_dim + i64(kh) * DK + i] = q[i] * rq;
      kn[i64(t) * key_dim + i64(kh) * DK + i] = k[i] * rk;
    }
  }
  if (blockIdx.y == 0)
    for (int j = threadIdx.x; j < Hv; j += blockDim.x) {
      const float neg_A = -expf(A_log[j]);
      beta[i64(t) * Hv + j] = sigmoid(b[i64(t) * b_stride + j]);
      alpha[i64(t) * Hv + j] = expf(neg_A * softplus(a[i64(t) * a_stride + j] + dt_bias[j]));
    }
}

// PREPPED = false (decode, T = 1): each warp normalises q, k and computes alpha, beta itself.
// PREPPED = true (prefill): it reads them from gated_delta_prep's output.
template <bool PREPPED>
__device__ __forceinline__ void gated_delta_scan(const float* __restrict__ qkv, i64 qkv_stride,
                                                 const float* __restrict__ b, i64 b_stride,
                                                 const float* __restrict__ a, i64 a_stride,
                                                 const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                                 const float* __restrict__ qn, const float* __restrict__ kn,
                                                 const float* __restrict__ alpha, const float* __restrict__ beta,
                                                 const float* S_in, i64 in_stride, float* S_out, i64 st_stride,
                                                 float* __restrict__ out, i64 out_stride, float* __restrict__ cap,
                                                 i64 cap_stride, int cap_first, int cap_count, int T, int Hk,
                                                 int Hv, float* o_shared = nullptr) {
  const int j = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c0 = (blockIdx.y * GD_WARPS + warp) * GD_WCOLS;
  if (c0 >= DV) return;  // the whole warp: no shuffle is left waiting
  const int quad = lane & (GD_QUADS - 1), rl = lane / GD_QUADS;
  const int col = c0 + 4 * quad;
  const int kh = j / (Hv / Hk);
  const i64 key_dim = i64(Hk) * DK;

  // The state (the previous call's output, never the kernel just before this one) and the head's constants
  // (weights) before the wait (common.cuh); q, k, v, a, b are this step's, after it.
  float4 S[GD_R];
  delta_state_load(S, S_in, in_stride, j, col, rl);
  const float neg_A = -expf(A_log[j]), dtb = dt_bias[j];
  LILY_PDL_PROLOGUE();
  const float q_scale = 1.f / sqrtf(float(DK));

  auto load = [&](int t) {  // raw inputs (PREPPED = false) or the prepared ones (true)
    GdRaw x;
    const float* row = qkv + i64(t) * qkv_stride;
    const float* qsrc = PREPPED ? qn + i64(t) * key_dim : row;
    const float* ksrc = PREPPED ? kn + i64(t) * key_dim : row + key_dim;
#pragma unroll
    for (int r = 0; r < GD_R; ++r) {
      const int i = r * GD_RPP + rl;
      x.q[r] = i < DK ? qsrc[i64(kh) * DK + i] : 0.f;
      x.k[r] = i < DK ? ksrc[i64(kh) * DK + i] : 0.f;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) x.v[e] = row[2 * key_dim + i64(j) * DV + col + e];
    x.a = PREPPED ? alpha[i64(t) * Hv + j] : a[i64(t) * a_stride + j];
    x.b = PREPPED ? beta[i64(t) * Hv + j] : b[i64(t) * b_stride + j];
    return x;
  };
  auto prep = [&](const GdRaw& x) {
    GdPrep p;
#pragma unroll
    for (int e = 0; e < 4; ++e) p.v[e] = x.v[e];
    if (PREPPED) {
#pragma unroll
      for (int r = 0; r < GD_R; ++r) {
        p.q[r] = x.q[r];
        p.k[r] = x.k[r];
      }
      p.alpha = x.a;
      p.beta = x.b;
      return p;
    }
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int r = 0; r < GD_R; ++r) {
      sq += x.q[r] * x.q[r];
      sk += x.k[r] * x.k[r];
    }
    sq = quad_sum(sq);
    sk = quad_sum(sk);
    const float rq = q_scale / sqrtf(sq + 1e-6f), rk = 1.f / sqrtf(sk + 1e-6f);
#pragma unroll
    for (int r = 0; r < GD_R; ++r) {
      p.q[r] = x.q[r] * rq;
      p.k[r] = x.k[r] * rk;
    }
    p.beta = sigmoid(x.b);
    p.alpha = expf(neg_A * softplus(x.a + dtb));
    return p;
  };

  GdPrep p = prep(load(0));
  GdRaw nxt = load(min(1, T - 1));
  for (int t = 0; t < T; ++t) {
    const GdRaw nn = load(min(t + 2, T - 1));  // in flight while token t runs
    const GdPrep pn = prep(nxt);                // independent of S: overlaps the chain below
    // 1-2: decay, then read with the decayed state
    float4 m0 = make_float4(0.f, 0.f, 0.f, 0.f), m1 = m0;
#pragma unroll
    for (int r = 0; r < GD_R; ++r) {
      float4& s = S[r];
      s.x *= p.alpha;
      s.y *= p.alpha;
      s.z *= p.alpha;
      s.w *= p.alpha;
      float4& m = (r & 1) ? m1 : m0;
      m.x += p.k[r] * s.x;
      m.y += p.k[r] * s.y;
      m.z += p.k[r] * s.z;
      m.w += p.k[r] * s.w;
    }
    // 3: delta (every lane of the quad gets the full m)
    const float ms = quad_sum_t(m0.x + m1.x, m0.y + m1.y, m0.z + m1.z, m0.w + m1.w, lane);
    const float d0 = p.beta * (p.v[0] - __shfl_sync(0xffffffffu, ms, quad_sum_t_lane(quad, 0)));
    const float d1 = p.beta * (p.v[1] - __shfl_sync(0xffffffffu, ms, quad_sum_t_lane(quad, 1)));
    const float d2 = p.beta * (p.v[2] - __shfl_sync(0xffffffffu, ms, quad_sum_t_lane(quad, 2)));
    const float d3 = p.beta * (p.v[3] - __shfl_sync(0xffffffffu, ms, quad_sum_t_lane(quad, 3)));
    // 4-5: rank-1 write, then the output reads the updated state
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < GD_R; ++r) {
      float4& s = S[r];
      s.x += p.k[r] * d0;
      s.y += p.k[r] * d1;
      s.z += p.k[r] * d2;
      s.w += p.k[r] * d3;
      o.x += p.q[r] * s.x;
      o.y += p.q[r] * s.y;
      o.z += p.q[r] * s.z;
      o.w += p.q[r] * s.w;
    }
    const float os = quad_sum_t(o.x, o.y, o.z, o.w, lane);
    if ((lane & 6) == 0) {  // lanes 0,1, 8,9, 16,17, 24,25: the 8 columns of the slice, one store
      const int oc = col + ((lane >> 3) & 1) + 2 * (lane >> 4);
      if (o_shared) o_shared[oc - int(blockIdx.y) * GD_WARPS * GD_WCOLS] = os;  // gated_delta_norm: T = 1
      else out[i64(t) * out_stride + i64(j) * DV + oc] = os;
    }
    if (unsigned(t - cap_first) < unsigned(cap_count)) {  // the state after token t is captured (warp-uniform)
      const i64 slice = i64(t - cap_first) * Hv;
#pragma unroll
      for (int r = 0; r < GD_R; ++r) {
        const int i = r * GD_RPP + rl;
        if (i < DK) *reinterpret_cast<float4*>(cap + ((slice + j) * DK + i) * cap_stride + col) = S[r];
      }
    }
    p = pn;
    nxt = nn;
  }
  delta_state_store(S, S_out, st_stride, j, col, rl);
}

#define GD_PARAMS                                                                                            \
  const float *__restrict__ qkv, i64 qkv_stride, const float *__restrict__ b, i64 b_stride,                \
      const float *__restrict__ a, i64 a_stride, const float *__restrict__ A_log,                           \
      const float *__restrict__ dt_bias
#define GD_STATE_PARAMS \
  const float *S_in, i64 in_stride, float *S_out, i64 st_stride, float *__restrict__ out, i64 out_stride, \
      float *__restrict__ cap, i64 cap_stride, int cap_first, int cap_count, int T, int Hk, int Hv

extern "C" __global__ void __launch_bounds__(64) gated_delta(GD_PARAMS, GD_STATE_PARAMS) {
  gated_delta_scan<false>(qkv, qkv_stride, b, b_stride, a, a_stride, A_log, dt_bias, nullptr, nullptr, nullptr,
                          nullptr, S_in, in_stride, S_out, st_stride, out, out_stride, cap, cap_stride, cap_first,
                          cap_count, T, Hk, Hv);
}
extern "C" __global__ void __launch_bounds__(64)
    gated_delta_prepped(GD_PARAMS, const float* __restrict__ qn, const float* __restrict__ kn,
                        const float* __restrict__ alpha, const float* __restrict__ beta, GD_STATE_PARAMS) {
  // the wait is inside the scan, after the state loads
  gated_delta_scan<true>(qkv, qkv_stride, b, b_stride, a, a_stride, A_log, dt_bias, qn, kn, alpha, beta, S_in,
                         in_stride, S_out, st_stride, out, out_stride, cap, cap_stride, cap_first, cap_count, T, Hk,
                         Hv);
}

// ---- gated_delta_norm (sm_90, DV % 16 == 0, DV <= 128): a decode row's recurrent update and gated RMSNorm ----
//   gated_delta (T = 1) followed by norm.cu gated_rms_norm over value head j (SEG = DV, NT = 32, VEC = 4:
//   lane m of the norm's warp sums the squares of columns 4m .. 4m+3 in order, then warp_sum), in one launch on
//   gated_delta's grid (Hv, DV/16) × 64 threads, where the DV/16 blocks of a value head form a thread-block
//   cluster (rank = blockIdx.y). Each block keeps its 16 o columns in shared memory and forms the norm lanes'
//   partial sums of its columns (lanes 4y .. 4y+3); after a cluster barrier warp 0 of every block reads the
//   head's DV/4 partials through distributed shared memory into the lanes that held them and sums them with the
//   same warp_sum, so every block has the composed kernels' r, and lanes 0-15 scale the block's own columns.
//   A second barrier (arrive after the reads, wait before exit) keeps each block's partials alive until the
//   other blocks of its cluster have read them.
//   Reads: gated_delta's, plus z [1, Hv·DV] (the projection's output, two kernels back: loaded before the wait
//   through the L2, common.cuh) and norm_w [DV]. Writes: S_out and out [1, Hv·DV]; o (delta_o) is not written
//   (ops.h allows it). Floor: gated_delta's (the state, 4 MiB per layer across memory); the norm adds 16 floats
//   a block each way. It replaces gated_rms_norm's launch (~2.5 µs on the decode critical path).
//   Bits: equal to gated_delta + gated_rms_norm (tests/cuda/test_conv_delta_norm.py).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && DV % 16 == 0 && DV <= 128
// The float at `p` (a shared array of this block) in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
  const unsigned local = unsigned(__cvta_generic_to_shared(p));
  unsigned remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The gated RMSNorm of one value head from its DV/16 blocks' 16-column slices of o (o_cols, in each block's shared
// memory), as above: the block's 4 norm-lane partials into `part`, a cluster barrier, warp 0 gathers the head's
// DV/4 partials (the head's block y' is cluster rank rank0 + rank_step·y') and sums them with warp_sum; then
// after_barrier() (other work the first barrier allowed), lanes 0-15 scale the block's columns into out16 (zv, wv:
// thread tid's z and norm weight), and the final wait keeps `part` alive until the cluster has read it.
template <class AfterBarrier>
__device__ __forceinline__ void cluster_gated_norm(const float* o_cols, float* part, float zv, float wv, float eps,
                                                   float* __restrict__ out16, unsigned rank0, unsigned rank_step,
                                                   AfterBarrier&& after_barrier) {
  const int tid = threadIdx.x;
  __syncthreads();  // o_cols written
  if (tid < 4) {  // norm lane 4y + tid: columns 4·tid .. 4·tid+3 of the block, squares summed in order
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) ss = fmaf(o_cols[4 * tid + e], o_cols[4 * tid + e], ss);
    part[tid] = ss;
  }
  cluster_arrive();  // every block's partials written (release) ...
  cluster_wait();    // ... and visible here (acquire)
  float ss = 0.f;
  if (tid < 32) {  // warp 0 is the norm's warp: lane m takes block m / 4's partial m % 4 (0 past DV)
    ss = tid < DV / 4 ? ld_cluster(part + (tid & 3), rank0 + rank_step * unsigned(tid >> 2)) : 0.f;
    ss = warp_sum(ss);
  }
  cluster_arrive();  // this block's reads of the others' partials are done
  after_barrier();
  if (tid < 16) {
    const float r = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, float(DV)), eps)));
    const float sg = __fdiv_rn(zv, __fadd_rn(1.f, expf(-zv)));  // silu, the CPU's formula
    out16[tid] = __fmul_rn(__fmul_rn(wv, __fmul_rn(o_cols[tid], r)), sg);
  }
  cluster_wait();  // the others' reads of this block's partials are done before it exits
}

extern "C" __global__ void __launch_bounds__(64) __cluster_dims__(1, DV / 16, 1)
    gated_delta_norm(GD_PARAMS, const float* __restrict__ z, const float* __restrict__ norm_w, float eps,
                     const float* S_in, i64 in_stride, float* S_out, i64 st_stride, float* __restrict__ out, int Hk,
                     int Hv) {
  static_assert(GD_WARPS * GD_WCOLS == 16, "a block holds 16 columns: 4 lanes of the norm's warp");
  __shared__ float o_cols[16], part[4];
  const int tid = threadIdx.x;
  const i64 base = i64(blockIdx.x) * DV + 16 * blockIdx.y;  // this block's 16 columns of the output row
  float zv = 0.f, wv = 0.f;
  if (tid < 16) {  // before the scan's wait: weights, and z from two kernels back
    zv = ld_cg(z + base + tid);
    wv = norm_w[16 * blockIdx.y + tid];
  }
  gated_delta_scan<false>(qkv, qkv_stride, b, b_stride, a, a_stride, A_log, dt_bias, nullptr, nullptr, nullptr,
                          nullptr, S_in, in_stride, S_out, st_stride, nullptr, 0, nullptr, 0, 0, 0, 1, Hk, Hv, o_cols);
  cluster_gated_norm(o_cols, part, zv, wv, eps, out + base, 0u, 1u, [] {});
}
#endif  // sm_90, DV % 16 == 0, DV <= 128

// ---- The chunked (WY / UT-transform) form: calls of T >= delta_chunk_rows without a capture ----
// Over a chunk of C = 64 tokens with chunk-local cumulative log decays L_i = Σ_{t<=i} gate_t (Γ_i = exp L_i) and
// S0 the state before it, the recurrence above is, exactly (benchmarks/NOTES.md derives it):
//   A_ij = β_i (Γ_i/Γ_j) k̂_i·k̂_j (j < i),  (I + A) [U | W] = [diag(β) V | diag(βΓ) K̂]   (forward substitution)
//   Δ = U − W S0,  o_i = Γ_i q̂_iᵀS0 + Σ_{j<=i} P_ij Δ_j with P_ij = (Γ_i/Γ_j) q̂_i·k̂_j,
//   S = Γ_last S0 + Σ_j (Γ_last/Γ_j) k̂_j Δ_jᵀ.
// gated_delta_chunk_prep builds U, W, P and the decay factors of every (chunk, value head) at once (parallel over
// chunks); gated_delta_chunk_scan walks the chunks in order with a slice of S in shared memory, three small
// products per chunk instead of 64 dependent token steps. L is summed in fp64 and only differences
// L_i − L_j (<= 0) are exponentiated, so no factor overflows and a strongly decayed chunk keeps its relative
// precision. fp32 elsewhere: ~3e-7 from an fp64 scan at the test shapes (numpy model of these kernels), the
// sequential scan's order of error; the bits differ from it (another summation order).
#define GD_CHUNK 64
#define GD_XC (DV + DK)  // columns of the solve's right-hand side [βV | βΓK̂]
#define GD_QS (DK + 4)   // row pitch of the q̂, k̂ tiles in shared memory (float4 rows)
#define GD_AS 68         // row pitch of A in shared memory (float4 rows)
// One (chunk, value head) record in the workspace, in floats: U [64, DV], W [64, DK], P [64, 64] (zero above the
// diagonal and past the chunk's rows), gam [64] = Γ_i, ksc [64] = Γ_last/Γ_i (zero past the rows).
#define GD_REC_W (GD_CHUNK * DV)
#define GD_REC_P (GD_REC_W + GD_CHUNK * DK)
#define GD_REC_G (GD_REC_P + GD_CHUNK * GD_CHUNK)
#define GD_REC_K (GD_REC_G + GD_CHUNK)
#define GD_REC (GD_REC_K + GD_CHUNK)
#define GD_PREP_TILE_FLOATS (2 * GD_CHUNK * GD_QS > GD_CHUNK * GD_XC ? 2 * GD_CHUNK * GD_QS : GD_CHUNK * GD_XC)
#if DK % 4 == 0 && DV % 16 == 0  // the chunked form's shapes (the host checks them before asking for its kernels)

// Chunk c's record of value head j (all four chunked kernels), and its rows (the last chunk may be partial).
template <class F>
__device__ __forceinline__ F* gd_record(F* rec, int c, int Hv, int j) {
  return rec + (i64(c) * Hv + j) * GD_REC;
}
__device__ __forceinline__ int gd_rows(int T, int c) { return min(GD_CHUNK, T - c * GD_CHUNK); }

// A chunk prep block's place (both forms; grid (chunks, Hv)): chunk c of value head j, its first token and rows, the
// key head, and the head's decay constants (weights: read before the wait).
struct GdPrepBlock {
  int c, j, t0, n, kh;
  i64 key_dim;
  float neg_A, dtb;
  __device__ GdPrepBlock(int T, int Hk, int Hv, const float* __restrict__ A_log, const float* __restrict__ dt_bias)
      : c(blockIdx.x), j(blockIdx.y), t0(blockIdx.x * GD_CHUNK), n(gd_rows(T, blockIdx.x)),
        kh(blockIdx.y / (Hv / Hk)), key_dim(i64(Hk) * DK), neg_A(-expf(A_log[blockIdx.y])), dtb(dt_bias[blockIdx.y]) {}
};

// The prep's first stage, both forms: the chunk's q̂ and k̂ rows into [64, GD_QS] tiles (zero past the rows; ASYNC:
// by cp.async, the caller commits and waits), the cumulative log decay L in fp64 (from the gate itself: log(alpha)
// would be -inf where the decay underflowed to 0) and β. Warp 0 forms the 64 gates at once (two rows a lane) and sums
// them by a shuffle scan: one thread walking the rows waited for 64 loads in turn. The caller synchronises.
template <bool ASYNC>
__device__ __forceinline__ void gd_prep_stage(float* sQ, float* sK, double* sL, float* sB, const float* qn,
                                              const float* kn, const float* a, i64 a_stride, const float* beta,
                                              float neg_A, float dtb, int t0, int n, int kh, int j, i64 key_dim,
                                              int Hv, int tid) {
  for (int e = tid; e < GD_CHUNK * (DK / 4); e += blockDim.x) {  // float4 columns fastest: coalesced rows
    const int i = e / (DK / 4), d = (e % (DK / 4)) * 4;
    const i64 src = i64(t0 + min(i, n - 1)) * key_dim + i64(kh) * DK + d;
    if constexpr (ASYNC) {
      cp_async16(smem_addr(sQ + i * GD_QS + d), qn + src, i < n ? 16 : 0);
      cp_async16(smem_addr(sK + i * GD_QS + d), kn + src, i < n ? 16 : 0);
    } else {
      float4 q4 = make_float4(0.f, 0.f, 0.f, 0.f), k4 = q4;
      if (i < n) {
        q4 = *reinterpret_cast<const float4*>(qn + src);
        k4 = *reinterpret_cast<const float4*>(kn + src);
      }
      *reinterpret_cast<float4*>(sQ + i * GD_QS + d) = q4;
      *reinterpret_cast<float4*>(sK + i * GD_QS + d) = k4;
    }
  }
  if (tid < 32) {
    const int i0 = 2 * tid;
    const double g0 = i0 < n ? double(neg_A * softplus(a[i64(t0 + i0) * a_stride + j] + dtb)) : 0.0;
    const double g1 = i0 + 1 < n ? double(neg_A * softplus(a[i64(t0 + i0 + 1) * a_stride + j] + dtb)) : 0.0;
    double incl = g0 + g1;  // rows past n add 0: L stays L_{n-1}
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const double v = __shfl_up_sync(0xffffffffu, incl, o);
      if (tid >= o) incl += v;
    }
    const double excl = __shfl_up_sync(0xffffffffu, incl, 1);
    sL[i0] = (tid > 0 ? excl : 0.0) + g0;
    sL[i0 + 1] = incl;
  }
  if (tid < GD_CHUNK) sB[tid] = tid < n ? beta[i64(t0 + tid) * Hv + j] : 0.f;
}

// The record's decay factors (gam = Γ_i, ksc = Γ_last/Γ_i, zero past the rows) and the K̂ part's row factor βΓ
// (one fp64 exp per row, not per element), both forms. After the stage's barrier.
__device__ __forceinline__ void gd_prep_factors(float* R, const double* sL, const float* sB, float* sBG, int n,
                                                int tid) {
  if (tid < GD_CHUNK) {
    const bool live = tid < n;
    const float gam = live ? float(exp(sL[tid])) : 0.f;
    R[GD_REC_G + tid] = gam;
    R[GD_REC_K + tid] = live ? float(exp(sL[n - 1] - sL[tid])) : 0.f;
    sBG[tid] = sB[tid] * gam;
  }
}

// The solve's right-hand side [βV | βΓK̂] into sX [64, pitch] (zero past the rows; the SIMT prep). After the barrier
// that follows gd_prep_factors (it reads βΓ) and the last read of the q̂, k̂ tiles (sX overlays them).
__device__ __forceinline__ void gd_prep_rhs(float* sX, int pitch, const float* qkv, i64 qkv_stride, const float* kn,
                                            const float* sB, const float* sBG, int t0, int n, int j, int kh,
                                            i64 key_dim, int tid) {
  for (int e = tid; e < GD_CHUNK * GD_XC; e += blockDim.x) {
    const int i = e / GD_XC, col = e % GD_XC;
    float x = 0.f;
    if (i < n)
      x = col < DV ? sB[i] * qkv[i64(t0 + i) * qkv_stride + 2 * key_dim + i64(j) * DV + col]
                   : sBG[i] * kn[i64(t0 + i) * key_dim + i64(kh) * DK + (col - DV)];
    sX[i * pitch + col] = x;
  }
}

// Grid (⌈T/64⌉, Hv), block 256. Shared: the chunk's q̂ and k̂ rows (later overlaid by the solve's [64, DV + DK]
// right-hand side), Aᵀ [64, 68], L (fp64), β and βΓ. Thread (ti, tj) = (tid / 16, tid % 16) computes the 4 × 4 tile of
// q̂·k̂ and k̂·k̂ at rows 4ti.., columns 4tj.. (tiles above the diagonal write zeros); then each thread solves whole
// columns of the right-hand side by forward substitution in blocks of 16 rows (below). Reads: q̂, k̂, v of the chunk, a,
// β; writes the record. Floor: ~1 MFLOP per (chunk, head) (two 64 × 64 × DK products, halved by the triangle,
// and the 64 × 64 × (DV + DK) / 2 solve): ~4 GFLOP per layer at T = 4096; bytes ~80 KB per record written.
extern "C" __global__ void __launch_bounds__(256)
    gated_delta_chunk_prep(const float* __restrict__ qkv, i64 qkv_stride, const float* __restrict__ a, i64 a_stride,
                           const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                           const float* __restrict__ qn, const float* __restrict__ kn,
                           const float* __restrict__ beta, float* __restrict__ rec, int T, int Hk, int Hv) {
  extern __shared__ float4 gd_smem4[];
  float* sm = reinterpret_cast<float*>(gd_smem4);
  float* sQ = sm;                             // [64, GD_QS]
  float* sK = sm + GD_CHUNK * GD_QS;          // [64, GD_QS]
  float* sX = sm;                             // [64, GD_XC], after the tiles
  float* sA = sm + GD_PREP_TILE_FLOATS;       // A transposed: sA[j·GD_AS + i] = A_ij
  double* sL = reinterpret_cast<double*>(sA + GD_CHUNK * GD_AS);  // 8-byte aligned: both offsets are even
  float* sB = reinterpret_cast<float*>(sL + GD_CHUNK);
  float* sBG = sB + GD_CHUNK;
  const GdPrepBlock B(T, Hk, Hv, A_log, dt_bias);
  const int c = B.c, j = B.j, t0 = B.t0, n = B.n, kh = B.kh, tid = threadIdx.x;
  const i64 key_dim = B.key_dim;
  const float neg_A = B.neg_A, dtb = B.dtb;
  LILY_PDL_PROLOGUE();
  gd_prep_stage<false>(sQ, sK, sL, sB, qn, kn, a, a_stride, beta, neg_A, dtb, t0, n, kh, j, key_dim, Hv, tid);
  __syncthreads();
  float* R = gd_record(rec, c, Hv, j);
  {
    const int ti = tid / 16, tj = tid % 16;
    float qk[4][4] = {}, kk[4][4] = {};
    if (tj <= ti) {
      for (int d = 0; d < DK; d += 4) {
        float4 qi[4], ki[4], kj[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          qi[u] = *reinterpret_cast<const float4*>(sQ + (4 * ti + u) * GD_QS + d);
          ki[u] = *reinterpret_cast<const float4*>(sK + (4 * ti + u) * GD_QS + d);
          kj[u] = *reinterpret_cast<const float4*>(sK + (4 * tj + u) * GD_QS + d);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            qk[u][v] += qi[u].x * kj[v].x + qi[u].y * kj[v].y + qi[u].z * kj[v].z + qi[u].w * kj[v].w;
            kk[u][v] += ki[u].x * kj[v].x + ki[u].y * kj[v].y + ki[u].z * kj[v].z + ki[u].w * kj[v].w;
          }
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = 4 * ti + u;
      float p4[4];
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int jj = 4 * tj + v;
        const bool live = i < n && jj <= i;
        const float dec = live ? float(exp(sL[i] - sL[jj])) : 0.f;
        p4[v] = live ? dec * qk[u][v] : 0.f;
        sA[jj * GD_AS + i] = live && jj < i ? sB[i] * dec * kk[u][v] : 0.f;
      }
      *reinterpret_cast<float4*>(R + GD_REC_P + i * GD_CHUNK + 4 * tj) = make_float4(p4[0], p4[1], p4[2], p4[3]);
    }
  }
  gd_prep_factors(R, sL, sB, sBG, n, tid);
  __syncthreads();  // the q̂, k̂ tiles are read: the right-hand side takes their place
  gd_prep_rhs(sX, GD_XC, qkv, qkv_stride, kn, sB, sBG, t0, n, j, kh, key_dim, tid);
  __syncthreads();
  // A thread per column, in blocks of 16 rows: the block's unknowns in registers (its loops unroll fully, so their
  // indices are constants), first less the earlier blocks' solved unknowns (read back once each from the thread's own
  // column, A transposed so 16 rows' factors are 4 float4 broadcasts), then solved among themselves. Rows past n have
  // a zero right-hand side and zero A rows, so they solve to 0.
  for (int col = tid; col < GD_XC; col += blockDim.x) {
    float* xc = sX + col;
    float* dst = col < DV ? R + col : R + GD_REC_W + (col - DV);
    const int pitch = col < DV ? DV : DK;
#pragma unroll 1
    for (int r0 = 0; r0 < GD_CHUNK; r0 += 16) {
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = xc[(r0 + i) * GD_XC];
#pragma unroll 1
      for (int jj = 0; jj < r0; ++jj) {
        const float xj = xc[jj * GD_XC];
        const float* at = sA + jj * GD_AS + r0;  // A[r0 .. r0 + 15][jj]
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float4 a4 = *reinterpret_cast<const float4*>(at + 4 * u);
          x[4 * u] -= a4.x * xj;
          x[4 * u + 1] -= a4.y * xj;
          x[4 * u + 2] -= a4.z * xj;
          x[4 * u + 3] -= a4.w * xj;
        }
      }
#pragma unroll
      for (int i = 1; i < 16; ++i)
#pragma unroll
        for (int jj = 0; jj < i; ++jj) x[i] -= sA[(r0 + jj) * GD_AS + r0 + i] * x[jj];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        xc[(r0 + i) * GD_XC] = x[i];
        dst[(r0 + i) * pitch] = x[i];
      }
    }
  }
}

// acc += a · x, lane by lane (the chunked scan's products of a scalar factor and four state or Δ columns).
__device__ __forceinline__ void axpy4(float4& acc, float a, const float4& x) {
  acc.x += a * x.x;
  acc.y += a * x.y;
  acc.z += a * x.z;
  acc.w += a * x.w;
}

#define GD_SCW (DV % 32 == 0 ? 32 : 16)  // state columns per scan block
// A chunked scan block's place (both forms; grid (Hv, DV/SCW)): value head j and its key head, its first state
// column, the call's chunks, and each chunk's record and rows.
struct GdScanBlock {
  const float* rec;
  int T, Hv, j, c0, kh, chunks;
  i64 key_dim;
  __device__ GdScanBlock(const float* rec_, int T_, int Hk, int Hv_)
      : rec(rec_), T(T_), Hv(Hv_), j(blockIdx.x), c0(blockIdx.y * GD_SCW), kh(blockIdx.x / (Hv_ / Hk)),
        chunks((T_ + GD_CHUNK - 1) / GD_CHUNK), key_dim(i64(Hk) * DK) {}
  __device__ const float* record(int c) const { return gd_record(rec, c, Hv, j); }
  __device__ int rows(int c) const { return gd_rows(T, c); }
};
#define GD_SSP (GD_SCW + 4)              // row pitch of the state slice in shared memory (4-way, not 32-way, in (3))
#define GD_SPP (GD_CHUNK + 4)            // row pitch of P in shared memory
// Both scan forms' shared tiles, carved from the dynamic shared memory in this order: the state slice [DK, SP], W and
// q̂ [64, GD_QS] each, k̂ [64, KP], P [64, GD_SPP], Δ and ksc_j Δ_j [64, DP] each (pitches per form: the host's
// chunk_scan_smem / chunk_scan_mma_smem). Returns what follows them.
template <int SP, int KP, int DP>
__device__ __forceinline__ float* gd_scan_tiles(float4* smem, float*& sS, float*& sW, float*& sQ, float*& sK,
                                                float*& sP, float*& sD, float*& sDk) {
  sS = reinterpret_cast<float*>(smem);
  sW = sS + DK * SP;
  sQ = sW + GD_CHUNK * GD_QS;
  sK = sQ + GD_CHUNK * GD_QS;
  sP = sK + GD_CHUNK * KP;
  sD = sP + GD_CHUNK * GD_SPP;
  sDk = sD + GD_CHUNK * DP;
  return sDk + GD_CHUNK * DP;
}

// The scan's per-chunk staging by cp.async, both forms: W (the record's, contiguous) and q̂ into [64, GD_QS] tiles;
// k̂ into [64, kp] and P into [64, GD_SPP]. q̂ and k̂ rows past the chunk are zero-filled (0 · garbage could be NaN).
__device__ __forceinline__ void gd_stage_wq(float* sW, float* sQ, const float* R, const float* qn, int t0, int n,
                                            int kh, i64 key_dim, int tid) {
  for (int e = tid; e < GD_CHUNK * (DK / 4); e += blockDim.x) {
    const int r = e / (DK / 4), f = e % (DK / 4);
    cp_async16(smem_addr(sW + r * GD_QS + 4 * f), R + GD_REC_W + r * DK + 4 * f, 16);
    cp_async16(smem_addr(sQ + r * GD_QS + 4 * f), qn + i64(t0 + min(r, n - 1)) * key_dim + i64(kh) * DK + 4 * f,
               r < n ? 16 : 0);
  }
}
__device__ __forceinline__ void gd_stage_kp(float* sK, int kp, float* sP, const float* R, const float* kn, int t0,
                                            int n, int kh, i64 key_dim, int tid) {
  for (int e = tid; e < GD_CHUNK * (DK / 4); e += blockDim.x) {
    const int r = e / (DK / 4), f = e % (DK / 4);
    cp_async16(smem_addr(sK + r * kp + 4 * f), kn + i64(t0 + min(r, n - 1)) * key_dim + i64(kh) * DK + 4 * f,
               r < n ? 16 : 0);
  }
  for (int e = tid; e < GD_CHUNK * (GD_CHUNK / 4); e += blockDim.x) {
    const int r = e / (GD_CHUNK / 4), f = e % (GD_CHUNK / 4);
    cp_async16(smem_addr(sP + r * GD_SPP + 4 * f), R + GD_REC_P + r * GD_CHUNK + 4 * f, 16);
  }
}
// Head j's state columns [c0, c0 + GD_SCW) into / out of shared memory rows of pitch sp, both forms. The load reads
// the previous call's output (never the kernel just before this one) through the L2, so it may run before the wait.
__device__ __forceinline__ void gd_load_slice(float* sS, int sp, const float* S_in, i64 in_stride, int j, int c0,
                                              int tid) {
  for (int e = tid; e < DK * (GD_SCW / 4); e += blockDim.x) {
    const int d = e / (GD_SCW / 4), f = e % (GD_SCW / 4);
    *reinterpret_cast<float4*>(sS + d * sp + 4 * f) = ld_cg4(S_in + (i64(j) * DK + d) * in_stride + c0 + 4 * f);
  }
}
__device__ __forceinline__ void gd_store_slice(const float* sS, int sp, float* S_out, i64 st_stride, int j, int c0,
                                               int tid) {
  for (int e = tid; e < DK * (GD_SCW / 4); e += blockDim.x) {
    const int d = e / (GD_SCW / 4), f = e % (GD_SCW / 4);
    *reinterpret_cast<float4*>(S_out + (i64(j) * DK + d) * st_stride + c0 + 4 * f) =
        *reinterpret_cast<const float4*>(sS + d * sp + 4 * f);
  }
}

// Grid (Hv, DV/SCW), block 256, one block per SM (SCW = 32 state columns: 128 blocks at the real shape). Block (j, y)
// keeps columns [SCW·y, SCW·y + SCW) of value head j's state in shared memory for the whole call. Per chunk the
// block stages the chunk's W, q̂, k̂ and P tiles in shared memory by cp.async (W and q̂ of the next chunk are in
// flight during (2) and (3), k̂ and P are issued after (3)), then: (1) thread (i, g) = (tid % 64, tid / 64) takes
// row i, columns 8g..8g+7: Δ_i = U_i − W_i S0 and Γ_i q̂_iᵀS0; (2) o_i adds Σ_j P_ij Δ_j and is stored;
// (3) thread (d, h) updates row d, 16 columns: S = Γ_last S0 + Σ_j k̂_j[d] ksc_j Δ_j. Two barriers per chunk; every
// operand of the products comes from shared memory (conflict-free row pitches; Δ by broadcast). S is read once and
// written once (in place safe: a block writes only the slice it read). Floor per chunk and block: 64·DK·2·SCW +
// 64·64/2·SCW + DK·64·SCW FMAs (~0.9 M at the real shape) on ~112 KB staged from L2 (each record is read by
// DV/SCW blocks).
extern "C" __global__ void __launch_bounds__(256, 1)
    gated_delta_chunk_scan(const float* __restrict__ rec, const float* __restrict__ qn, const float* __restrict__ kn,
                           const float* S_in, i64 in_stride, float* S_out, i64 st_stride, float* __restrict__ out,
                           i64 out_stride, int T, int Hk, int Hv) {
  constexpr int CW = GD_SCW, G = CW / 8;
  extern __shared__ float4 gd_smem4[];
  float *sS, *sW, *sQ, *sK, *sP, *sD, *sDk;  // k̂ rows of DK, Δ rows of CW
  gd_scan_tiles<GD_SSP, DK, CW>(gd_smem4, sS, sW, sQ, sK, sP, sD, sDk);
  const GdScanBlock B(rec, T, Hk, Hv);
  const int j = B.j, c0 = B.c0, tid = threadIdx.x, kh = B.kh, chunks = B.chunks;
  const i64 key_dim = B.key_dim;
  gd_load_slice(sS, GD_SSP, S_in, in_stride, j, c0, tid);
  LILY_PDL_PROLOGUE();
  gd_stage_wq(sW, sQ, B.record(0), qn, 0, B.rows(0), kh, key_dim, tid);
  gd_stage_kp(sK, DK, sP, B.record(0), kn, 0, B.rows(0), kh, key_dim, tid);
  cp_async_commit();
  // (1), (2): row i, columns 8g .. 8g + 7; a warp holds 32 rows of one column group, so its state and Δ reads are
  // one address (a broadcast, one wavefront for the warp; with 4 column groups per warp they were 4 wavefronts).
  const int i = tid % GD_CHUNK, g = tid / GD_CHUNK;
  const bool row_thread = g < G;  // threads past the column groups idle (SCW = 16: half the block)
  for (int c = 0; c < chunks; ++c) {
    const int t0 = c * GD_CHUNK, n = B.rows(c);
    const float* R = B.record(c);
    cp_async_wait<0>();
    __syncthreads();
    float4 o0 = make_float4(0.f, 0.f, 0.f, 0.f), o1 = o0;
    if (row_thread) {  // (1)
      float4 w0 = o0, w1 = o0;
#pragma unroll 4
      for (int d = 0; d < DK; d += 4) {
        const float4 w4 = *reinterpret_cast<const float4*>(sW + i * GD_QS + d);
        const float4 q4 = *reinterpret_cast<const float4*>(sQ + i * GD_QS + d);
        const float wv[4] = {w4.x, w4.y, w4.z, w4.w}, qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float4 s0 = *reinterpret_cast<const float4*>(sS + (d + u) * GD_SSP + 8 * g);
          const float4 s1 = *reinterpret_cast<const float4*>(sS + (d + u) * GD_SSP + 8 * g + 4);
          axpy4(w0, wv[u], s0);
          axpy4(w1, wv[u], s1);
          axpy4(o0, qv[u], s0);
          axpy4(o1, qv[u], s1);
        }
      }
      const float4 u0 = *reinterpret_cast<const float4*>(R + i * DV + c0 + 8 * g);
      const float4 u1 = *reinterpret_cast<const float4*>(R + i * DV + c0 + 8 * g + 4);
      const float gm = R[GD_REC_G + i], ks = R[GD_REC_K + i];
      const float4 d0 = make_float4(u0.x - w0.x, u0.y - w0.y, u0.z - w0.z, u0.w - w0.w);  // zero past the rows
      const float4 d1 = make_float4(u1.x - w1.x, u1.y - w1.y, u1.z - w1.z, u1.w - w1.w);
      *reinterpret_cast<float4*>(sD + i * CW + 8 * g) = d0;
      *reinterpret_cast<float4*>(sD + i * CW + 8 * g + 4) = d1;
      *reinterpret_cast<float4*>(sDk + i * CW + 8 * g) = make_float4(ks * d0.x, ks * d0.y, ks * d0.z, ks * d0.w);
      *reinterpret_cast<float4*>(sDk + i * CW + 8 * g + 4) = make_float4(ks * d1.x, ks * d1.y, ks * d1.z, ks * d1.w);
      o0 = make_float4(gm * o0.x, gm * o0.y, gm * o0.z, gm * o0.w);
      o1 = make_float4(gm * o1.x, gm * o1.y, gm * o1.z, gm * o1.w);
    }
    __syncthreads();
    if (c + 1 < chunks) {  // W and q̂ are read: the next chunk's come in during (2) and (3)
      gd_stage_wq(sW, sQ, B.record(c + 1), qn, t0 + GD_CHUNK, B.rows(c + 1), kh, key_dim, tid);
      cp_async_commit();
    }
    if (row_thread && i < n) {  // (2) P is zero above the diagonal: columns up to i's group of 4
      for (int jj = 0; jj <= i; jj += 4) {
        const float4 p4 = *reinterpret_cast<const float4*>(sP + i * GD_SPP + jj);
        const float pv[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float4 e0 = *reinterpret_cast<const float4*>(sD + (jj + u) * CW + 8 * g);
          const float4 e1 = *reinterpret_cast<const float4*>(sD + (jj + u) * CW + 8 * g + 4);
          axpy4(o0, pv[u], e0);
          axpy4(o1, pv[u], e1);
        }
      }
      float* orow = out + i64(t0 + i) * out_stride + i64(j) * DV + c0 + 8 * g;
      *reinterpret_cast<float4*>(orow) = o0;
      *reinterpret_cast<float4*>(orow + 4) = o1;
    }
    const float gl = R[GD_REC_G + n - 1];
    for (int e = tid; e < DK * (CW / 16); e += blockDim.x) {  // (3)
      const int d = e % DK, h = e / DK;
      float* srow = sS + d * GD_SSP + 16 * h;
      float4 s[4];
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const float4 v = *reinterpret_cast<const float4*>(srow + 4 * f);
        s[f] = make_float4(gl * v.x, gl * v.y, gl * v.z, gl * v.w);
      }
#pragma unroll 4
      for (int jj = 0; jj < n; ++jj) {
        const float kv = sK[jj * DK + d];
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          const float4 a4 = *reinterpret_cast<const float4*>(sDk + jj * CW + 16 * h + 4 * f);
          axpy4(s[f], kv, a4);
        }
      }
#pragma unroll
      for (int f = 0; f < 4; ++f) *reinterpret_cast<float4*>(srow + 4 * f) = s[f];
    }
    __syncthreads();
    if (c + 1 < chunks) {  // k̂ and P are read
      gd_stage_kp(sK, DK, sP, B.record(c + 1), kn, t0 + GD_CHUNK, B.rows(c + 1), kh, key_dim, tid);
      cp_async_commit();
    }
  }
  gd_store_slice(sS, GD_SSP, S_out, st_stride, j, c0, tid);
}

#if DK % 16 == 0  // ---- the chunked form on the tensor cores (delta_chunk_mma): every product in 3xTF32 ----
// The same record and the same algebra as the two kernels above; each small dense product runs as mma.sync m16n8k8
// tf32 tiles, three per tile (common.cuh mma_3xtf32: near fp32's error level, not tf32's ~1e-3; the tests hold both
// forms to the CPU at the same 1e-5). Shared-memory pitches are chosen for conflict-free fragment loads (common.cuh).
#define GD_MXP (DV + DK + 8)  // row pitch of the solve's right-hand side (B operand)
#define GD_MPREP_TILE_FLOATS (2 * GD_CHUNK * GD_QS > GD_CHUNK * GD_MXP ? 2 * GD_CHUNK * GD_QS : GD_CHUNK * GD_MXP)

// Grid (⌈T/64⌉, Hv), block 256 = 8 warps. Shared: the q̂, k̂ tiles [64, GD_QS] (later overlaid by the right-hand side
// X [64, GD_MXP]), A [64, 68] (row-major: A_ij at i·68 + j), the block inverse B [64, 68], L (fp64), β, βΓ. The
// tiles and the right-hand side's raw rows come by cp.async (all of a thread's copies in flight at once; plain loads
// in a loop waited for each batch in turn), the right-hand side scaled by β and βΓ in place.
// (a) q̂k̂ᵀ and k̂k̂ᵀ: the 20 16 × 8 tiles of each on or below the 16-row block diagonal, 5 per warp, 16 k-steps each;
//     epilogue P (to the record, zero above the diagonal and past the rows) and A (strictly lower, β and decay).
// (b) T_b = (I + A_bb)^-1 of the four 16 × 16 diagonal blocks: a thread per (block, column), forward substitution.
// (c) B_bj = −T_b A_bj below the diagonal blocks (fp32, 16 FMAs per element), B_bb = T_b, so that block row b of the
//     solution is X_b = Σ_{j<b} B_bj X_j + B_bb R_b.
// (d) [U | W] = X by those four block steps on the tensor cores, warp w on the 8-column tiles w, w + 8, .. of X side
//     by side, in place in sX (a warp reads only its own columns), each block row written to the record as solved.
// Rows past n: zero q̂, k̂, β, A rows and right-hand side, so B's rows there are the identity's and X's zero (exactly).
// Floor: as gated_delta_chunk_prep (~1 MFLOP per (chunk, head)), here ~3 MFLOP of tf32 MMAs.
extern "C" __global__ void __launch_bounds__(256)
    gated_delta_chunk_prep_mma(const float* __restrict__ qkv, i64 qkv_stride, const float* __restrict__ a,
                               i64 a_stride, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                               const float* __restrict__ qn, const float* __restrict__ kn,
                               const float* __restrict__ beta, float* __restrict__ rec, int T, int Hk, int Hv) {
  extern __shared__ float4 gd_smem4[];
  float* sm = reinterpret_cast<float*>(gd_smem4);
  float* sQ = sm;                           // [64, GD_QS]
  float* sK = sm + GD_CHUNK * GD_QS;        // [64, GD_QS]
  float* sX = sm;                           // [64, GD_MXP], after (a)
  float* sA = sm + GD_MPREP_TILE_FLOATS;    // [64, GD_AS]
  float* sBi = sA + GD_CHUNK * GD_AS;       // [64, GD_AS]
  double* sL = reinterpret_cast<double*>(sBi + GD_CHUNK * GD_AS);  // 8-byte aligned: every offset is even
  float* sB = reinterpret_cast<float*>(sL + GD_CHUNK);
  float* sBG = sB + GD_CHUNK;
  const GdPrepBlock B(T, Hk, Hv, A_log, dt_bias);
  const int c = B.c, j = B.j, t0 = B.t0, n = B.n, kh = B.kh, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const i64 key_dim = B.key_dim;
  const float neg_A = B.neg_A, dtb = B.dtb;
  LILY_PDL_PROLOGUE();
  gd_prep_stage<true>(sQ, sK, sL, sB, qn, kn, a, a_stride, beta, neg_A, dtb, t0, n, kh, j, key_dim, Hv, tid);
  cp_async_commit();
  float* R = gd_record(rec, c, Hv, j);
  for (int e = tid; e < GD_CHUNK * (GD_CHUNK / 4); e += blockDim.x) {  // P above the 16-row block diagonal: zeros
    const int i = e / (GD_CHUNK / 4), c4 = 4 * (e % (GD_CHUNK / 4));
    if (c4 >= 16 * (i / 16 + 1))
      *reinterpret_cast<float4*>(R + GD_REC_P + i * GD_CHUNK + c4) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  cp_async_wait<0>();
  __syncthreads();
  // (a) unit u = warp + 8v (v < 5, side by side: five independent accumulators): matrix u / 20 (0: q̂k̂ᵀ, 1: k̂k̂ᵀ),
  // then row tile m and column tile nt <= 2m + 1.
  constexpr int UNITS = 5;
  int mat[UNITS], m[UNITS], nt[UNITS];
  float acc[UNITS][4] = {}, corr[UNITS][4] = {};
#pragma unroll
  for (int v = 0; v < UNITS; ++v) {
    const int u = warp + 8 * v, rem = u % 20;
    mat[v] = u / 20;
    m[v] = rem < 2 ? 0 : rem < 6 ? 1 : rem < 12 ? 2 : 3;
    nt[v] = rem - m[v] * (m[v] + 1);
  }
#pragma unroll 2
  for (int k0 = 0; k0 < DK; k0 += 8)
#pragma unroll
    for (int v = 0; v < UNITS; ++v)
      mma_3xtf32(acc[v], corr[v], frag_a((mat[v] ? sK : sQ) + 16 * m[v] * GD_QS + k0, GD_QS, 1, lane),
                 frag_b(sK + 8 * nt[v] * GD_QS + k0, 1, GD_QS, lane));
#pragma unroll
  for (int v = 0; v < UNITS; ++v) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[v][e] += corr[v][e];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 16 * m[v] + g + 8 * h, jj = 8 * nt[v] + 2 * t;
      float x[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool live = i < n && jj + e <= i;
        const float dec = live ? float(exp(sL[i] - sL[jj + e])) : 0.f;
        x[e] = mat[v] == 0 ? (live ? dec * acc[v][2 * h + e] : 0.f)
                           : (live && jj + e < i ? sB[i] * dec * acc[v][2 * h + e] : 0.f);
      }
      float* dst = mat[v] == 0 ? R + GD_REC_P + i * GD_CHUNK + jj : sA + i * GD_AS + jj;
      *reinterpret_cast<float2*>(dst) = make_float2(x[0], x[1]);
    }
  }
  gd_prep_factors(R, sL, sB, sBG, n, tid);
  __syncthreads();  // A is complete and the q̂, k̂ tiles are read: the right-hand side takes their place
  if (tid < GD_CHUNK) {  // (b)
    const int b = tid / 16, col = tid % 16;
    const float* arow = sA + 16 * b * GD_AS + 16 * b;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float v = r == col ? 1.f : 0.f;
#pragma unroll
      for (int s = 0; s < r; ++s) v -= arow[r * GD_AS + s] * x[s];
      x[r] = v;
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) sBi[(16 * b + r) * GD_AS + 16 * b + col] = x[r];
  }
  // The right-hand side's raw rows (v of head j, k̂ of its key head; zero past the rows) by cp.async, scaled below.
  for (int e = tid; e < GD_CHUNK * (GD_XC / 4); e += blockDim.x) {
    const int i = e / (GD_XC / 4), col = 4 * (e % (GD_XC / 4)), row = t0 + min(i, n - 1);
    const float* src = col < DV ? qkv + i64(row) * qkv_stride + 2 * key_dim + i64(j) * DV + col
                                : kn + i64(row) * key_dim + i64(kh) * DK + (col - DV);
    cp_async16(smem_addr(sX + i * GD_MXP + col), src, i < n ? 16 : 0);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  for (int e = tid; e < GD_CHUNK * GD_XC; e += blockDim.x) {  // [βV | βΓK̂]
    const int i = e / GD_XC, col = e % GD_XC;
    sX[i * GD_MXP + col] *= col < DV ? sB[i] : sBG[i];
  }
  // (c) the six blocks (b, jb), jb < b, 256 elements each: element (r, col) = −Σ_{s<=r} T_b[r][s] A[16b + s][16jb + col]
  // (beside the scaling above: neither reads what the other writes).
  for (int e = tid; e < 6 * 256; e += blockDim.x) {
    const int blk = e / 256, b = blk < 1 ? 1 : blk < 3 ? 2 : 3, jb = blk - b * (b - 1) / 2;
    const int r = (e / 16) % 16, col = e % 16;
    const float* trow = sBi + (16 * b + r) * GD_AS + 16 * b;
    const float* acol = sA + 16 * b * GD_AS + 16 * jb + col;
    float s = 0.f;
    for (int q = 0; q <= r; ++q) s += trow[q] * acol[q * GD_AS];
    sBi[(16 * b + r) * GD_AS + 16 * jb + col] = -s;
  }
  __syncthreads();
  // (d) X_b = Σ_{j<=b} B_bj Y_j over k = 16(b + 1) rows (Y_j = X_j solved, Y_b = R_b), for the warp's 8-column
  // tiles nt = warp + 8v side by side (independent accumulators).
  constexpr int NTX = GD_XC / 8, NTW = (NTX + 7) / 8;
#pragma unroll 1
  for (int b = 0; b < 4; ++b) {
    float acc[NTW][4] = {}, corr[NTW][4] = {};
#pragma unroll 2
    for (int k0 = 0; k0 < 16 * (b + 1); k0 += 8) {
      const Tf32Frag fa = frag_a(sBi + 16 * b * GD_AS + k0, GD_AS, 1, lane);
#pragma unroll
      for (int v = 0; v < NTW; ++v)
        if (warp + 8 * v < NTX)
          mma_3xtf32(acc[v], corr[v], fa, frag_b(sX + k0 * GD_MXP + 8 * (warp + 8 * v), GD_MXP, 1, lane));
    }
    __syncwarp();  // every lane's reads of R_b are done
#pragma unroll
    for (int v = 0; v < NTW; ++v) {
      const int col = 8 * (warp + 8 * v);
      if (col >= GD_XC) continue;
      float* dst = col < DV ? R + col : R + GD_REC_W + (col - DV);
      const int pitch = col < DV ? DV : DK;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 16 * b + g + 8 * h;
        const float2 x = make_float2(acc[v][2 * h] + corr[v][2 * h], acc[v][2 * h + 1] + corr[v][2 * h + 1]);
        *reinterpret_cast<float2*>(sX + i * GD_MXP + col + 2 * t) = x;
        *reinterpret_cast<float2*>(dst + i * pitch + 2 * t) = x;
      }
    }
    __syncwarp();  // X_b is in place before the next block row reads it
  }
}

#define GD_MSP (GD_SCW + 8)  // row pitch of the state slice, Δ, ksc·Δ and U (B operands, C tiles) in the mma scan
#define GD_MKP (DK + 8)      // row pitch of k̂ (the Aᵀ operand of (3)) in the mma scan

// Grid (Hv, DV/SCW), block 256 = 8 warps, one block per SM: gated_delta_chunk_scan's geometry and barriers, its three
// products on the tensor cores. Per chunk: (1) warp w: rows 16(w % 4).. of W (w < 4) or of q̂ (w >= 4) times the
// state slice (128 × SCW outputs, DK/8 k-steps); warps 0-3 store Δ = U − W S0 and ksc·Δ, warps 4-7 keep Γ q̂ S0;
// (2) warp 4 + m adds P[16m.., 0..16m + 15] Δ and stores o; (3) warp w takes state rows 16w.. (16-row tiles over the
// warps): S = Γ_last S0 + k̂ᵀ (ksc·Δ) over ⌈n/8⌉ k-steps, written back in place.
// Staging (cp.async, two groups per chunk): W, q̂, the U slice and the factors Γ, ksc (double-buffered: chunk c's are
// read in (2) and (3) while chunk c + 1's arrive) are issued after (1) of the chunk before, for (1); k̂ and P after
// (3) of the chunk before, and waited for only after (1), so they arrive while (1) runs. Nothing in the chunk loop
// reads global memory. Floor per chunk and block: as the SIMT scan's ~0.9 M MACs, here ~2,500 tf32 MMAs (3 per tile).
extern "C" __global__ void __launch_bounds__(256, 1)
    gated_delta_chunk_scan_mma(const float* __restrict__ rec, const float* __restrict__ qn,
                               const float* __restrict__ kn, const float* S_in, i64 in_stride, float* S_out,
                               i64 st_stride, float* __restrict__ out, i64 out_stride, int T, int Hk, int Hv) {
  constexpr int CW = GD_SCW, NT = CW / 8;
  extern __shared__ float4 gd_smem4[];
  float *sS, *sW, *sQ, *sK, *sP, *sD, *sDk;  // padded pitches for conflict-free fragment loads
  float* sU = gd_scan_tiles<GD_MSP, GD_MKP, GD_MSP>(gd_smem4, sS, sW, sQ, sK, sP, sD, sDk);  // [64, GD_MSP]: U slice
  float* sF = sU + GD_CHUNK * GD_MSP;               // [2][128]: Γ [64] then ksc [64], per chunk parity
  const GdScanBlock B(rec, T, Hk, Hv);
  const int j = B.j, c0 = B.c0, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, kh = B.kh, chunks = B.chunks;
  const int g = lane >> 2, t = lane & 3;
  const i64 key_dim = B.key_dim;
  gd_load_slice(sS, GD_MSP, S_in, in_stride, j, c0, tid);
  LILY_PDL_PROLOGUE();
  auto stage_for_1 = [&](int c) {  // W, q̂, U slice, factors
    const float* R = B.record(c);
    gd_stage_wq(sW, sQ, R, qn, c * GD_CHUNK, B.rows(c), kh, key_dim, tid);
    for (int e = tid; e < GD_CHUNK * (CW / 4); e += blockDim.x) {
      const int r = e / (CW / 4), f = e % (CW / 4);
      cp_async16(smem_addr(sU + r * GD_MSP + 4 * f), R + r * DV + c0 + 4 * f, 16);
    }
    if (tid < 2 * GD_CHUNK / 4)  // Γ and ksc are adjacent in the record (GD_REC_G, GD_REC_K)
      cp_async16(smem_addr(sF + (c & 1) * 2 * GD_CHUNK + 4 * tid), R + GD_REC_G + 4 * tid, 16);
    cp_async_commit();
  };
  auto stage_for_23 = [&](int c) {  // k̂, P
    gd_stage_kp(sK, GD_MKP, sP, B.record(c), kn, c * GD_CHUNK, B.rows(c), kh, key_dim, tid);
    cp_async_commit();
  };
  stage_for_1(0);
  stage_for_23(0);
  const int m = warp & 3, r0 = 16 * m + g;  // (1), (2): this lane's rows r0 and r0 + 8 of the warp's 16
  for (int c = 0; c < chunks; ++c) {
    const int t0 = c * GD_CHUNK, n = B.rows(c);
    const float* sGam = sF + (c & 1) * 2 * GD_CHUNK;
    const float* sKsc = sGam + GD_CHUNK;
    cp_async_wait<1>();  // this chunk's (1) group; its k̂ and P may still be in flight
    __syncthreads();
    float acc[NT][4] = {}, corr[NT][4] = {};
    {  // (1)
      const float* arows = (warp < 4 ? sW : sQ) + 16 * m * GD_QS;
#pragma unroll 2
      for (int k0 = 0; k0 < DK; k0 += 8) {
        const Tf32Frag fa = frag_a(arows + k0, GD_QS, 1, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma_3xtf32(acc[nt], corr[nt], fa, frag_b(sS + k0 * GD_MSP + 8 * nt, GD_MSP, 1, lane));
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[nt][e] += corr[nt][e];
          corr[nt][e] = 0.f;
        }
    }
    if (warp < 4) {  // Δ = U − W S0 (zero past the rows: U and W are) and ksc·Δ
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = r0 + 8 * h;
        const float ks = sKsc[i];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int col = 8 * nt + 2 * t;
          const float2 u = *reinterpret_cast<const float2*>(sU + i * GD_MSP + col);
          const float2 d = make_float2(u.x - acc[nt][2 * h], u.y - acc[nt][2 * h + 1]);
          *reinterpret_cast<float2*>(sD + i * GD_MSP + col) = d;
          *reinterpret_cast<float2*>(sDk + i * GD_MSP + col) = make_float2(ks * d.x, ks * d.y);
        }
      }
    }
    cp_async_wait<0>();  // k̂ and P
    __syncthreads();
    if (c + 1 < chunks) stage_for_1(c + 1);  // W, q̂, U are read; the factors go to the other buffer
    if (warp >= 4) {  // (2) o = Γ q̂ S0 + P Δ, P zero right of the row tile's diagonal block
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float gm = sGam[r0 + 8 * h];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          acc[nt][2 * h] *= gm;
          acc[nt][2 * h + 1] *= gm;
        }
      }
      for (int k0 = 0; k0 < 16 * (m + 1); k0 += 8) {
        const Tf32Frag fa = frag_a(sP + 16 * m * GD_SPP + k0, GD_SPP, 1, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma_3xtf32(acc[nt], corr[nt], fa, frag_b(sD + k0 * GD_MSP + 8 * nt, GD_MSP, 1, lane));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = r0 + 8 * h;
        if (i < n) {
          float* orow = out + i64(t0 + i) * out_stride + i64(j) * DV + c0 + 2 * t;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            *reinterpret_cast<float2*>(orow + 8 * nt) =
                make_float2(acc[nt][2 * h] + corr[nt][2 * h], acc[nt][2 * h + 1] + corr[nt][2 * h + 1]);
        }
      }
    }
    // (3) every warp has passed (1)'s reads of S (the barrier above)
    const float gl = sGam[n - 1];
    const int ksteps = (n + 7) / 8;
    for (int mt = warp; mt < DK / 16; mt += 8) {
      float s[NT][4], sc[NT][4] = {};
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float2 v = *reinterpret_cast<const float2*>(sS + (16 * mt + g + 8 * h) * GD_MSP + 8 * nt + 2 * t);
          s[nt][2 * h] = gl * v.x;
          s[nt][2 * h + 1] = gl * v.y;
        }
      for (int ks = 0; ks < ksteps; ++ks) {
        const Tf32Frag fa = frag_a(sK + 8 * ks * GD_MKP + 16 * mt, 1, GD_MKP, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma_3xtf32(s[nt], sc[nt], fa, frag_b(sDk + 8 * ks * GD_MSP + 8 * nt, GD_MSP, 1, lane));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          *reinterpret_cast<float2*>(sS + (16 * mt + g + 8 * h) * GD_MSP + 8 * nt + 2 * t) =
              make_float2(s[nt][2 * h] + sc[nt][2 * h], s[nt][2 * h + 1] + sc[nt][2 * h + 1]);
    }
    __syncthreads();
    if (c + 1 < chunks) stage_for_23(c + 1);  // k̂ and P are read
  }
  gd_store_slice(sS, GD_MSP, S_out, st_stride, j, c0, tid);
}
#endif  // DK % 16 == 0
#endif  // DK % 4 == 0 && DV % 16 == 0
#endif  // DK && DV

#if defined(DK) && defined(DV)
// One decode token's update of one warp's 8-column state slice (lane map as gated_delta: column quad lane & 1,
// rows 16·r + (lane >> 1)), from the conv outputs q, k of its key head at sq, sk (raw, normalised here exactly as
// gated_delta's decode entry does), the lane's 4 v columns, -exp(A_log), dt_bias, b, a of its value head. St is
// updated in place; returns o of column 2·bit4 + bit3 of the lane (quad_sum_t). The one-launch kernels below
// share it, so their bits equal the three kernels' (tests/cuda/test_conv_delta_norm.py).
__device__ __forceinline__ float delta_slice_decode(float4 (&St)[GD_R], const float* sq, const float* sk,
                                                    const float (&v)[4], float neg_A, float dtb, float bj, float aj,
                                                    int lane) {
  const int quad = lane & (GD_QUADS - 1), rl = lane / GD_QUADS;
  const float q_scale = 1.f / sqrtf(float(DK));
  float q[GD_R], k[GD_R];
  float sq2 = 0.f, sk2 = 0.f;
#pragma unroll
  for (int r = 0; r < GD_R; ++r) {
    const int i = r * GD_RPP + rl;
    q[r] = i < DK ? sq[i] : 0.f;
    k[r] = i < DK ? sk[i] : 0.f;
    sq2 += q[r] * q[r];
    sk2 += k[r] * k[r];
  }
  sq2 = quad_sum(sq2);
  sk2 = quad_sum(sk2);
  const float rq = q_scale / sqrtf(sq2 + 1e-6f), rk = 1.f / sqrtf(sk2 + 1e-6f);
#pragma unroll
  for (int r = 0; r < GD_R; ++r) {
    q[r] = q[r] * rq;
    k[r] = k[r] * rk;
  }
  const float beta = sigmoid(bj);
  const float alpha = expf(neg_A * softplus(aj + dtb));
  float4 m0 = make_float4(0.f, 0.f, 0.f, 0.f), m1 = m0;
#pragma unroll
  for (int r = 0; r < GD_R; ++r) {
    float4& s = St[r];
    s.x *= alpha;
    s.y *= alpha;
    s.z *= alpha;
    s.w *= alpha;
    float4& m = (r & 1) ? m1 : m0;
    m.x += k[r] * s.x;
    m.y += k[r] * s.y;
    m.z += k[r] * s.z;
    m.w += k[r] * s.w;
  }
  const float ms = quad_sum_t(m0.x + m1.x, m0.y + m1.y, m0.z + m1.z, m0.w + m1.w, lane);
  const float d0 = beta * (v[0] - __shfl_sync(0xffffffffu, ms, quad_sum_t_lane(quad, 0)));
  const float d1 = beta * (v[1] - __shfl_sync(0xffffffffu, ms, quad_sum_t_lane(quad, 1)));
  const float d2 = beta * (v[2] - __shfl_sync(0xffffffffu, ms, quad_sum_t_lane(quad, 2)));
  const float d3 = beta * (v[3] - __shfl_sync(0xffffffffu, ms, quad_sum_t_lane(quad, 3)));
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int r = 0; r < GD_R; ++r) {
    float4& s = St[r];
    s.x += k[r] * d0;
    s.y += k[r] * d1;
    s.z += k[r] * d2;
    s.w += k[r] * d3;
    o.x += q[r] * s.x;
    o.y += q[r] * s.y;
    o.z += q[r] * s.z;
    o.w += q[r] * s.w;
  }
  return quad_sum_t(o.x, o.y, o.z, o.w, lane);
}

// One warp's gated RMSNorm of one value head's DV outputs o: norm.cu gated_rms_norm with SEG = DV, NT = 32,
// VEC = 4 (lane l sums elements 4l .. 4l+3, + 128 per pass, with fmaf, then warp_sum), silu(z) by the CPU's
// formula. L2: o read through the L2 only (other blocks wrote it).
template <bool L2>
__device__ __forceinline__ void gated_norm_head_warp(const float* os, const float* __restrict__ zj,
                                                     const float* __restrict__ norm_w, float eps, float* outj,
                                                     int lane) {
  float ss = 0.f;
  float ov[(DV + 127) / 128][4];
#pragma unroll
  for (int p = 0; p < (DV + 127) / 128; ++p) {
    const int i = lane * 4 + 128 * p;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      ov[p][e] = i < DV ? (L2 ? ld_cg(os + i + e) : os[i + e]) : 0.f;
      if (i < DV) ss = fmaf(ov[p][e], ov[p][e], ss);
    }
  }
  const float r = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(warp_sum(ss), float(DV)), eps)));
#pragma unroll
  for (int p = 0; p < (DV + 127) / 128; ++p) {
    const int i = lane * 4 + 128 * p;
    if (i < DV)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float gz = zj[i + e];
        const float sg = __fdiv_rn(gz, __fadd_rn(1.f, expf(-gz)));  // silu, the CPU's formula
        outj[i + e] = __fmul_rn(__fmul_rn(norm_w[i + e], __fmul_rn(ov[p][e], r)), sg);
      }
  }
}
#endif  // DK, DV

// ---- conv_delta_norm (-D FUSED_WARPS = warps per block, with KTAPS, DK, DV): one decode row (T = 1) ----
//   The three kernels above plus norm.cu gated_rms_norm in one launch (Ops::conv_delta_norm, ops.h):
//     mixed = silu(conv(qkv; conv_in -> conv_out)),  o = gated_delta(mixed, b, a; rec_in -> rec_out),
//     out = (w · rmsnorm(o_j)) · silu(z_j) per value head j (SEG = DV, eps).
//   qkv f32 [1, C], C = 2·Hk·DK + Hv·DV; z, out f32 [1, Hv·DV]; b, a f32 [1, Hv]; conv_w f32 [C, KTAPS] (row
//   stride); A_log, dt_bias f32 [1, Hv]; norm_w f32 [1, DV]; conv_in/conv_out f32 [KTAPS-1, C] (conv_out may be
//   conv_in); rec_in/rec_out f32 [Hv·DK, DV] (rec_out may be rec_in; rows 16-byte aligned). mixed and delta_o
//   are not written (they stay in shared memory).
//   Grid Hk: block kh owns key head kh and its G = Hv/Hk value heads j = kh·G + g, i.e. every consumer of the
//   conv channels it updates (q, k of head kh; v of its value heads): the in-place conv state needs no
//   cross-block order. Block FUSED_WARPS × 32 threads (32 at the real shape: G·DV/8 = 32 warp slices).
//   1. conv: thread t takes channels t, t + blockDim, ... of the block's 2·DK + G·DV; reads its taps, K-1 rows
//      of conv_in and qkv, then writes conv_out (same thread, after its reads) and silu(acc) to shared memory.
//   2. scan: warp w takes the slices u = w, w + FUSED_WARPS, ... of (g, 8 columns), with gated_delta's lane map
//      (lane l: column quad l & 1, rows 16·r + (l >> 1)) and arithmetic for T = 1; o goes to shared memory.
//   3. norm: warp w takes value heads g = w, w + FUSED_WARPS, ...: gated_rms_norm's NT = 32, VEC = 4 sum
//      order (lane l sums elements 4l.. 4l+3 (+128 per pass) with fmaf, then warp_sum), the host takes this
//      path only where the composed norm would use VEC = 4.
//   Shared: (2·DK + 2·G·DV) floats (3 KiB at the real shape), dynamic.
//   Floor: as the three kernels (state 4 MiB per layer each way is the big term); saves 2 launches per layer.
//   Bits: equal to conv1d_silu + gated_delta + gated_rms_norm (tests/cuda/test_conv_delta_norm.py).
#if defined(FUSED_WARPS) && defined(KTAPS) && defined(DK) && defined(DV)
extern "C" __global__ void __launch_bounds__(FUSED_WARPS * 32)
    conv_delta_norm(const float* __restrict__ qkv, const float* __restrict__ z, const float* __restrict__ b,
                    const float* __restrict__ a, const float* __restrict__ conv_w, i64 w_stride,
                    const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                    const float* __restrict__ norm_w, float eps, const float* conv_in, i64 cin_stride,
                    float* conv_out, i64 cout_stride, const float* rec_in, i64 rin_stride, float* rec_out,
                    i64 rout_stride, float* __restrict__ out, int Hk, int Hv) {
  extern __shared__ float smem[];
  constexpr int S = KTAPS - 1;
  const int kh = blockIdx.x, G = Hv / Hk;
  const i64 key_dim = i64(Hk) * DK;
  float* sq_ = smem;                // q of key head kh [DK]
  float* sk_ = sq_ + DK;            // k [DK]
  float* sv_ = sk_ + DK;            // v of the G value heads [G·DV]
  float* so_ = sv_ + i64(G) * DV;   // o [G·DV]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad = lane & (GD_QUADS - 1), rl = lane / GD_QUADS;
  const int slices = G * (DV / GD_WCOLS);

  // Before the wait (common.cuh): the first conv channel's taps and carried rows, and the first state slice of
  // every warp (weights and the previous step's state; qkv, z, b, a are the projection's output, after it).
  const int nch = 2 * DK + G * DV;
  auto channel = [&](int t) -> i64 {
    return t < DK ? i64(kh) * DK + t
           : t < 2 * DK ? key_dim + i64(kh) * DK + (t - DK)
                        : 2 * key_dim + i64(kh) * G * DV + (t - 2 * DK);
  };
  // A channel's taps and carried rows; a warp slice u's state rows (in place, each is read before it is written,
  // by the thread or warp that writes it).
  float wk[KTAPS], hist[S > 0 ? S : 1];
  auto load_conv = [&](int t) {
    const i64 c = channel(t);
#pragma unroll
    for (int j = 0; j < KTAPS; ++j) wk[j] = conv_w[c * w_stride + j];
#pragma unroll
    for (int j = 0; j < S; ++j) hist[j] = ld_cg(conv_in + i64(j) * cin_stride + c);
  };
  float4 St[GD_R];
  auto load_slice = [&](int u) {
    const int j = kh * G + u / (DV / GD_WCOLS), col = (u % (DV / GD_WCOLS)) * GD_WCOLS + 4 * quad;
    delta_state_load(St, rec_in, rin_stride, j, col, rl);
  };
  if (int(threadIdx.x) < nch) load_conv(threadIdx.x);
  if (warp < slices) load_slice(warp);
  LILY_PDL_PROLOGUE();

  // 1. conv + silu of this key head's channels (the next channel's taps and rows loaded after this one's writes).
  for (int t = threadIdx.x; t < nch; t += blockDim.x) {
    const i64 c = channel(t);
    const float x = qkv[c];
    smem[t] = silu(conv_taps(wk, hist, x));  // sq_, sk_, sv_ are contiguous in channel order t
#pragma unroll
    for (int r = 0; r < S; ++r) conv_out[i64(r) * cout_stride + c] = r + 1 < S ? hist[r + 1] : x;
    if (t + int(blockDim.x) < nch) load_conv(t + blockDim.x);
  }
  __syncthreads();

  // 2. the recurrent update, gated_delta's decode body per warp slice.
  for (int u = warp; u < slices; u += FUSED_WARPS) {  // warp-uniform
    const int g = u / (DV / GD_WCOLS), c0 = (u % (DV / GD_WCOLS)) * GD_WCOLS;
    const int j = kh * G + g, col = c0 + 4 * quad;
    if (u != warp) load_slice(u);
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = sv_[g * DV + col + e];
    const float os = delta_slice_decode(St, sq_, sk_, v, -expf(A_log[j]), dt_bias[j], b[j], a[j], lane);
    if ((lane & 6) == 0) so_[g * DV + col + ((lane >> 3) & 1) + 2 * (lane >> 4)] = os;
    delta_state_store(St, rec_out, rout_stride, j, col, rl);
  }
  __syncthreads();

  // 3. gated RMSNorm per value head: norm.cu gated_rms_norm with SEG = DV, NT = 32, VEC = 4.
  for (int g = warp; g < G; g += FUSED_WARPS) {  // warp-uniform
    const int j = kh * G + g;
    gated_norm_head_warp<false>(so_ + g * DV, z + i64(j) * DV, norm_w, eps, out + i64(j) * DV, lane);
  }
}
#endif  // FUSED_WARPS && KTAPS && DK && DV

// ---- conv_delta_norm_wide (-D WIDE = 1, with KTAPS, DK, DV): one decode row (T = 1) ----
//   conv_delta_norm's product on gated_delta's geometry: grid (Hv, ⌈DV/16⌉) × 64 threads, warp w of block (j, y)
//   owns the 8 state columns c0 = (2y + w)·8 of value head j (256 blocks at the real shape, where
//   conv_delta_norm has 16). Each block computes the conv (+ silu) of the channels it reads itself, into shared
//   memory: q and k of its key head (2·DK) and its own 16 v columns. Two kinds of arrival counters (ints at
//   `counters`, zero between launches, reset by the last arrival; the host owns them):
//     counters[kh], over the key head's G·⌈DV/16⌉ blocks: each counts itself in after its conv reads, and the
//       last writes the key head's new conv state (2·DK + G·DV channels), so no block reads a carried row the
//       in-place update has replaced;
//     counters[Hk + j], over the value head's ⌈DV/16⌉ blocks: each counts itself in after storing its o columns
//       to delta_o, and the last normalises the head into out (gated_norm_head_warp).
//   Before the wait (common.cuh): the taps, the carried conv rows and the warp's state slice. mixed is not
//   written (ops.h allows it); delta_o is (the norm reads it back).
//   Floor: the state, 4 MiB each way per layer at the real shape; the rest a few KiB per block.
//   Bits: equal to conv1d_silu + gated_delta + gated_rms_norm (tests/cuda/test_conv_delta_norm.py).
#if (defined(WIDE) || defined(CLUSTER_G)) && defined(KTAPS) && defined(DK) && defined(DV)
#define WIDE_CH (2 * DK + 16)          // conv channels one block computes
#define WIDE_PT ((WIDE_CH + 63) / 64)  // per thread
// The conv side of the one-launch forms on gated_delta's grid (wide, cluster): block (j, y) computes the conv +
// silu of the channels it reads itself, local channel t = q (t < DK), k (t < 2·DK) of its key head kh, then v
// column 16·y + t − 2·DK of value head j; thread tid holds channels tid + 64·p (taps, carried rows, input).
struct WideConv {
  static constexpr int S = KTAPS - 1;
  float wk[WIDE_PT][KTAPS], hist[WIDE_PT][S > 0 ? S : 1], x[WIDE_PT];
  int j, y, kh;
  i64 key_dim;
  __device__ i64 channel(int t) const {
    return t < DK ? i64(kh) * DK + t
           : t < 2 * DK ? key_dim + i64(kh) * DK + (t - DK)
                        : 2 * key_dim + i64(j) * DV + 16 * y + (t - 2 * DK);
  }
  __device__ bool valid(int t) const { return t < 2 * DK || (t < WIDE_CH && 16 * y + (t - 2 * DK) < DV); }
  // Before the wait (common.cuh): the taps (weights) and the carried rows (the previous step's).
  __device__ void load(const float* __restrict__ conv_w, i64 w_stride, const float* conv_in, i64 cin_stride) {
#pragma unroll
    for (int p = 0; p < WIDE_PT; ++p) {
      const int t = threadIdx.x + 64 * p;
      if (valid(t)) {
        const i64 c = channel(t);
#pragma unroll
        for (int q = 0; q < KTAPS; ++q) wk[p][q] = conv_w[c * w_stride + q];
#pragma unroll
        for (int q = 0; q < S; ++q) hist[p][q] = ld_cg(conv_in + i64(q) * cin_stride + c);
      }
    }
  }
  // After it: the projection's row into silu(conv) in shared memory (sq, sk: DK each; sv: the block's 16 columns).
  __device__ void run(const float* __restrict__ qkv, float* sq, float* sk, float* sv) {
#pragma unroll
    for (int p = 0; p < WIDE_PT; ++p) {
      const int t = threadIdx.x + 64 * p;
      if (valid(t)) {
        x[p] = qkv[channel(t)];
        const float v = silu(conv_taps(wk[p], hist[p], x[p]));
        if (t < DK) sq[t] = v;
        else if (t < 2 * DK) sk[t - DK] = v;
        else sv[t - 2 * DK] = v;
      }
    }
  }
};
#endif  // (WIDE || CLUSTER_G) && KTAPS && DK && DV

#if defined(WIDE) && defined(KTAPS) && defined(DK) && defined(DV)
extern "C" __global__ void __launch_bounds__(64)
    conv_delta_norm_wide(const float* __restrict__ qkv, const float* __restrict__ z, const float* __restrict__ b,
                         const float* __restrict__ a, const float* __restrict__ conv_w, i64 w_stride,
                         const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                         const float* __restrict__ norm_w, float eps, const float* conv_in, i64 cin_stride,
                         float* conv_out, i64 cout_stride, const float* rec_in, i64 rin_stride, float* rec_out,
                         i64 rout_stride, float* delta_o, float* __restrict__ out, int* counters, int Hk, int Hv) {
  constexpr int S = KTAPS - 1;
  __shared__ float sq_[DK], sk_[DK], sv_[16];
  __shared__ int last_k, last_v;
  const int j = blockIdx.x, y = blockIdx.y, G = Hv / Hk, kh = j / G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int quad = lane & (GD_QUADS - 1), rl = lane / GD_QUADS;
  const i64 key_dim = i64(Hk) * DK;
  const int c0 = (2 * y + warp) * GD_WCOLS, col = c0 + 4 * quad;
  const bool live = c0 < DV;  // warp-uniform
  WideConv cv;
  cv.j = j, cv.y = y, cv.kh = kh, cv.key_dim = key_dim;
  cv.load(conv_w, w_stride, conv_in, cin_stride);
  float4 St[GD_R];
  if (live) {
    delta_state_load(St, rec_in, rin_stride, j, col, rl);
  }
  const float neg_A = -expf(A_log[j]), dtb = dt_bias[j];
  LILY_PDL_PROLOGUE();  // qkv, z, b, a are the projection's output

  cv.run(qkv, sq_, sk_, sv_);
  __syncthreads();
  if (tid == 0) {  // every thread's conv reads are done: count the block in for the key head's state write
    __threadfence();
    last_k = atomicAdd(&counters[kh], 1) == G * int(gridDim.y) - 1;
  }
  if (live) {
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = sv_[col - 16 * y + e];
    const float os = delta_slice_decode(St, sq_, sk_, v, neg_A, dtb, b[j], a[j], lane);
    if ((lane & 6) == 0) delta_o[i64(j) * DV + col + ((lane >> 3) & 1) + 2 * (lane >> 4)] = os;
    delta_state_store(St, rec_out, rout_stride, j, col, rl);
  }
  __threadfence();  // this block's o columns visible before it counts itself in for the norm
  __syncthreads();
  if (tid == 0) last_v = atomicAdd(&counters[Hk + j], 1) == int(gridDim.y) - 1;
  __syncthreads();
  if (last_k) {  // block-uniform: every block of the key head has read the carried rows
    __threadfence();
    const int nch = 2 * DK + G * DV;
    for (int t = tid; t < nch; t += 64) {
      const i64 c = t < 2 * DK ? cv.channel(t) : 2 * key_dim + i64(kh) * G * DV + (t - 2 * DK);
      float row[S > 0 ? S : 1];
#pragma unroll
      for (int q = 0; q + 1 < S; ++q) row[q] = ld_cg(conv_in + i64(q + 1) * cin_stride + c);
      if (S > 0) row[S > 0 ? S - 1 : 0] = qkv[c];
#pragma unroll
      for (int q = 0; q < S; ++q) conv_out[i64(q) * cout_stride + c] = row[q];
    }
    if (tid == 0) counters[kh] = 0;
  }
  if (last_v) {  // block-uniform: every block of the value head has stored its o columns
    __threadfence();
    if (warp == 0) gated_norm_head_warp<true>(delta_o + i64(j) * DV, z + i64(j) * DV, norm_w, eps, out + i64(j) * DV, lane);
    if (tid == 0) counters[Hk + j] = 0;
  }
}
#endif  // WIDE

// ---- conv_delta_norm_cluster (-D CLUSTER_G = Hv / Hk, with KTAPS, DK, DV; sm_90, DV % 16 == 0, DV <= 128,
//      CLUSTER_G · DV/16 <= 16): one decode row (T = 1) ----
//   conv_delta_norm_wide's product with thread-block clusters in place of its arrival counters: grid (Hv, DV/16) ×
//   64 threads, and the G·DV/16 blocks of a key head (value heads kh·G .. kh·G + G − 1, every y) form one cluster
//   (rank (j % G) + G·y; 16 blocks at the real shape, past the portable 8: the host allows it per function).
//   Each block computes the conv of the channels it reads (WideConv) and its 8-column slices' update (the state in
//   registers, loaded before the wait), keeps its 16 o columns in shared memory, and cluster_gated_norm (above)
//   normalises them with its value head's sums. The cluster barrier there also says every block of the key head
//   has read the carried conv rows (into registers, before the wait), so after it each block writes the new conv
//   rows of the channels it owns from its registers: its own v columns, and the q / k channels
//   t·(G·DV/16) / (2·DK) = its rank. mixed and delta_o are not written (ops.h allows it).
//   Floor: the state, 4 MiB per layer across memory; the rest a few KiB per block.
//   Bits: equal to conv1d_silu + gated_delta + gated_rms_norm (tests/cuda/test_conv_delta_norm.py).
#if defined(CLUSTER_G) && defined(KTAPS) && defined(DK) && defined(DV) && defined(__CUDA_ARCH__) && \
    __CUDA_ARCH__ >= 900 && DV % 16 == 0 && DV <= 128 && CLUSTER_G * (DV / 16) <= 16
extern "C" __global__ void __launch_bounds__(64) __cluster_dims__(CLUSTER_G, DV / 16, 1)
    conv_delta_norm_cluster(const float* __restrict__ qkv, const float* __restrict__ z, const float* __restrict__ b,
                            const float* __restrict__ a, const float* __restrict__ conv_w, i64 w_stride,
                            const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                            const float* __restrict__ norm_w, float eps, const float* conv_in, i64 cin_stride,
                            float* conv_out, i64 cout_stride, const float* rec_in, i64 rin_stride, float* rec_out,
                            i64 rout_stride, float* __restrict__ out, int Hk) {
  constexpr int S = KTAPS - 1, NB = CLUSTER_G * (DV / 16);
  __shared__ float sq_[DK], sk_[DK], sv_[16], o_cols[16], part[4];
  const int j = blockIdx.x, y = blockIdx.y, kh = j / CLUSTER_G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int quad = lane & (GD_QUADS - 1), rl = lane / GD_QUADS;
  const int col = (2 * y + warp) * GD_WCOLS + 4 * quad;  // every warp is live: DV % 16 == 0
  const unsigned rank = unsigned(j % CLUSTER_G + CLUSTER_G * y);
  const i64 base = i64(j) * DV + 16 * y;  // this block's 16 columns of the output row
  WideConv cv;
  cv.j = j, cv.y = y, cv.kh = kh, cv.key_dim = i64(Hk) * DK;
  cv.load(conv_w, w_stride, conv_in, cin_stride);
  float4 St[GD_R];
  delta_state_load(St, rec_in, rin_stride, j, col, rl);
  const float neg_A = -expf(A_log[j]), dtb = dt_bias[j];
  float zv = 0.f, wv = 0.f;
  if (tid < 16) wv = norm_w[16 * y + tid];  // a weight: before the wait
  LILY_PDL_PROLOGUE();                      // qkv, z, b, a are the projection's output (the kernel just before)

  if (tid < 16) zv = z[base + tid];
  cv.run(qkv, sq_, sk_, sv_);
  __syncthreads();
  float v[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = sv_[col - 16 * y + e];
  const float os = delta_slice_decode(St, sq_, sk_, v, neg_A, dtb, b[j], a[j], lane);
  if ((lane & 6) == 0) o_cols[col - 16 * y + ((lane >> 3) & 1) + 2 * (lane >> 4)] = os;
  delta_state_store(St, rec_out, rout_stride, j, col, rl);
  cluster_gated_norm(o_cols, part, zv, wv, eps, out + base, unsigned(j % CLUSTER_G), unsigned(CLUSTER_G), [&] {
    // every block of the key head has read its carried conv rows: the owners write the new ones
#pragma unroll
    for (int p = 0; p < WIDE_PT; ++p) {
      const int t = tid + 64 * p;
      if (cv.valid(t) && (t >= 2 * DK || t * NB / (2 * DK) == int(rank))) {
        const i64 c = cv.channel(t);
#pragma unroll
        for (int q = 0; q < S; ++q) conv_out[i64(q) * cout_stride + c] = q + 1 < S ? cv.hist[p][q + 1] : cv.x[p];
      }
    }
  });
}
#endif  // CLUSTER_G
