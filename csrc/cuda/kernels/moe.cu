// Sparse MoE block (MODEL.md section 6; §12.13 router, §12.18 quant format): router, routed experts,
// SwiGLU and the shared-expert combine. Oracle: CpuOps::moe_* (csrc/cpu/moe.cpp); test: tests/cuda/test_moe.py.
//
// The module is built in three parts (-D MOE_PART), so a route build does not compile the GEMMs:
//
// MOE_PART 1, router.  moe_route: logits f32 [T, E] (row stride ls) -> ids i32 [T, k], weights f32 [T, k].
//   p = softmax_fp32(logits) over all E, top-k by p (ties to the lower id, the CPU's partial_sort order),
//   w = p / Σ_{s<k} p_s (the sum in slot order, as the CPU). Grid ⌈T/4⌉, block 128: one warp per token,
//   lane l holds experts l, l+32, ... in registers (E ≤ 512: 16 per lane); k rounds of a warp arg-max.
//   The softmax sum is a warp tree (not the CPU's serial sum): p differs by ≤ 1 ulp, which cannot reorder
//   distinct values except ones within an ulp of each other; exact ties (equal logits) stay exact ties.
//   -D NEXP (E), TOPK (k). Floor: T·E·4 bytes read; negligible.
//
// MOE_PART 2, experts.  x f32 [T, H] (stride), ids i32 [T, k], weights f32 [T, k]; stacked expert weights
//   gate, up [E, I, H] and down [E, H, I] (one format for all three: MLX affine codes uint32 LSB first with
//   scales/biases [rows, cols/GROUP], or dense f32/f16/bf16 rows); out f32 [T, H] (stride), written whole.
//   out[t] = Σ_s w[t,s] · down_e(silu(gate_e(x_t)) ⊙ up_e(x_t)), e = ids[t,s], the k terms summed in
//   ascending (expert id, slot) order starting from 0 (the CPU's order), so the result does not depend on
//   T, chunking or grid size. Expert ids outside [0, E) contribute nothing (the CPU throws; a kernel cannot).
//   Workspace (MoeArgs pointers, carved by moe.cpp): act f32 [T·k, I]; prefill also y f32 [T·k, H], the tile
//   map int [1 + 3·max_tiles], pair_token int [T·k] (sorted row -> token), pair_pos int [T·k] ((t,s) ->
//   sorted row).
//   Decode (2 launches; every expert's weights stream once per token, 16-byte loads, dequantized in
//   registers, fp32 accumulation as Σ_g s_g·(Σ x·q)_g + b_g·(Σ x)_g):
//     moe_gate_up_decode: grid (⌈I / (8·ROWS_G)⌉, T·k), block 256 (8 warps). Block (i, slot) reads the
//       expert id from ids on the device, keeps x_t in shared memory (H floats, float4 index f stored at
//       f ^ ((f>>3)&7): a lane reads 32 consecutive inputs, the swizzle makes a quarter-warp's float4
//       reads hit 8 distinct bank quads), each warp owns ROWS_G rows of gate AND up (the same rows), lane
//       l reads vectors l, l+32, ... of each row; act[slot, row] = silu(g)·u. Order (GU_EARLY, the default
//       geometry): x into registers right after the wait, the routing, a barrier, then all the lane's weight
//       loads, and only then x into shared memory and the barrier before the products, so x's L2 round trip
//       overlaps the routing and its staging the weights' DRAM round trip (before, both preceded the loads,
//       which the compiler then spread over the arithmetic); the shared expert's slot needs no routing and
//       issues its weight loads before the wait (common.cuh's contract: weights only).
//     moe_down_decode: grid (⌈H / ROWS_D⌉, T), block 256. The k act rows of token t in shared memory
//       (swizzled as above); a group of LPR lanes (LPR = the power of two ≥ I/CPV, ≤ 32) owns one (row,
//       slot) dot product, the ROWS_D·k partials land in shared memory and thread r sums row r's k of them
//       in (id, slot) order times the routing weights. No atomics. PREROUTE (fused, under programmatic dependent
//       launch): the block routes its token from the router logits and issues its weight loads before it waits
//       for the gate/up pass (common.cuh's contract); only the act rows come after the wait.
//     DP4A (4/8-bit affine experts, 16-byte loads, groups of whole vectors; the host's gemv_dp4a, on by
//       default): x and the act rows are staged as three int8 terms per 16-byte vector instead of fp32 (quant.cuh;
//       4 threads per vector) and each vector's products are dp4a integer dot products combined in fp32 per
//       vector: ~45 instructions per 4-bit vector instead of ~190 (3 per code plus the x reads), error ~1e-7.
//   Prefill (4 launches, 6 with MXROW's pre-passes moe_x_rows and moe_act_rows (below); grids sized for the worst
//   case, so no host knowledge of the routing):
//     moe_group (1 block of 1024; or split over a block per 1024-pair chunk, moe_group_blocks: below): histogram of
//       rows per expert (shared atomics: counts only), exclusive
//       scans of rows and of tiles (⌈n_e/BM⌉) per expert, the tile map (expert, first sorted row, rows),
//       and a stable scatter of the (token, slot) pairs into expert-sorted order (tokens ascending per
//       expert, the CPU's counting sort): per 1024-pair chunk, warp peers from __match_any_sync, per-warp
//       counts in shared memory, a prefix over warps.
//     moe_gate_up_mma: grid (max_tiles, ⌈I/64⌉), block 256 (8 warps; 2 blocks per SM: registers capped at
//       128, a few bytes spill, measured faster than 1 block with 180 registers: benchmarks/NOTES.md). Tile = BM gathered rows of one
//       expert × 64 columns of gate and the same 64 of up; K (= H) in steps of BK = 64 (32 for dense f16/f32
//       weights). Per step the x rows are loaded (float4) and split into bf16 hi + lo, the weight vectors
//       (16 B) converted in registers (affine: the integer codes, exact; dense bf16: as stored; dense
//       f16/f32: hi + lo bf16), all stored to shared memory (row pitch BK + 8 halves: fragment loads
//       conflict-free); the next step's global loads are issued before this step's MMAs (PIPE = S: the raw
//       blocks come through a ring of S stages of cp.async copies instead, S - 1 blocks ahead). mma.sync m16n8k16
//       bf16×bf16 -> f32: x_hi·W + x_lo·W (+ x_hi·W_lo for f16/f32). Affine: Σ x·q per group in its own
//       fp32 fragments, folded in as acc += s·D at the group's end, plus acc += b·Σx (Σx from the f32 x).
//       Epilogue: act = silu(g)·u to the workspace (sorted rows). Tiles past the map's count exit at once.
//     moe_down_mma: the same kernel shape on act (sorted rows, K = I) × down (N = H, 128 columns per
//       block) -> y (sorted rows, fp32).
//     FRAG = S (4-bit affine, 16, 32 or 64-row tiles; the host's moe_frag): both GEMMs as moe_frag_block instead,
//       grid (max_tiles, ⌈I/(R/2)⌉) and (max_tiles, ⌈H/R⌉) for R = FRAG_ROWS weight rows per block (256 at BM 16,
//       128 at BM 32 and 64), each warp widening its own rows' codes into B fragments in registers (no bf16 weight
//       tile) for BM/16 m16 tiles, A by ldmatrix, raw K blocks by a cp.async ring of S stages; the same MMAs in the
//       same order, so the same bits (see its section).
//     moe_expert_sum: grid T, block 256: out[t] = Σ_s w[t,s]·y[pair_pos[t,s]] in (id, slot) order.
//   -D DEC_MINB (decode: blocks per SM the registers must allow, 0 = the compiler's choice, but 3 for the
//   gate/up pass's early loads: GU_EARLY),
//   WKIND (0 dense, 1 affine), WDT (dense dtype code), BITS, GROUP, SDT (scale dtype code), ALIGNED
//   (1: every weight/activation address and stride allows 16-byte loads; 0: byte loads, a slow but
//   correct path for unpadded checkpoints), DP4A (decode, above), PIPE (prefill ring stages, 0 = off), FRAG (the
//   fragment tiles' ring stages, 0 = off), MMA_MINB (blocks per SM the GEMMs' registers allow), NEXP, TOPK, HID,
//   INTER, ROWS_G, ROWS_D, LPR, BM (16, 32 (FRAG only) or 64, picked on the host from the expected rows per
//   expert T·k/E and the format; the sums do not depend on it: each output element accumulates its K steps in
//   the same order whatever BM is).
//   Floors (Qwen3.6 q4g64): decode streams the k = 8 hit experts' 3·512·2048 weights at 0.5625 B each,
//   4.7 MB per layer per token (plus T·k·(H+I)·4 B of activations); prefill reads every hit expert's
//   weights once per BM-row tile (at most 453 MB per layer when all 256 are hit) and does 6·T·k·I·H FLOPs
//   (twice over on the tensor cores: x hi and x lo; three times for f16/f32 weights).
//   Prefill precision: the weights enter the MMAs exactly (codes, bf16) or as hi + lo (f16/f32), scales and
//   biases in fp32, the activations as hi + lo bf16 (residual ≤ 2^-17 relative, bf16's range: no overflow
//   short of fp32's): ~3e-6 relative against the fp32 CPU per GEMM (~5e-6 for the whole block), while
//   decode is fp32 throughout (~1e-6). Cost: 2 MMAs per k16 step (3 for f16/f32 weights).
//
// MOE_PART 3, elementwise.  swiglu: out = silu(gate) ⊙ up; moe_combine: h += routed + σ(sg[t])·shared.
//   f32 [T, C] views with strides; grid (⌈C / (256·VEC)⌉, T), block 256, VEC = 4 (float4) when every
//   address and stride allows it, else 1. Floor: 3 (resp. 4) · T·C·4 bytes.
#include "quant.cuh"  // common.cuh, and the code/element helpers shared with the matmul family

#ifndef MOE_PART
#define MOE_PART 0
#endif

// ================================================================================================
#if MOE_PART == 1 || MOE_PART == 2

// One warp routes one token: softmax over the NEXP logits at l, top-TOPK; lane s < TOPK gets slot s's id
// and its renormalised weight (the rule above). Used by moe_route and by the fused decode MoE.
// L2 = true reads the logits through the L2 only (ld.global.cg), for a read before LILY_PDL_WAIT (common.cuh).
template <bool L2 = false>
__device__ __forceinline__ void route_warp(const float* __restrict__ l, int lane, int& my_id, float& my_w) {
  constexpr int NJ = (NEXP + 31) / 32;
  float v[NJ];
  float mx = -3.402823466e38f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int e = lane + 32 * j;
    float le = -3.402823466e38f;
    if (e < NEXP) le = L2 ? ld_cg(l + e) : l[e];
    v[j] = le;
    mx = fmaxf(mx, v[j]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < NEXP ? expf(v[j] - mx) : 0.f;
    sum += v[j];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < NJ; ++j) v[j] = lane + 32 * j < NEXP ? v[j] / sum : -1.f;  // -1: not selectable

  // k rounds: the lane's best (higher p, then lower id), then the warp's best by two warp reductions (redux:
  // the highest key, then the lowest id holding it) instead of a 5-step shuffle tree over (p, id) pairs. Key
  // = p's bits + 1 (p >= 0, so its bits order as its values), 0 for a taken entry or NaN (never selected, as
  // before: an all-taken round yields the invalid id INT_MAX and p = -1).
  u32 key[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) key[j] = v[j] >= 0.f ? __float_as_uint(v[j]) + 1u : 0u;
  my_id = 0;
  float my_p = 0.f, top = 0.f;
#pragma unroll 1
  for (int s = 0; s < TOPK; ++s) {
    u32 bk = 0u;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (key[j] > bk) {  // j ascending = id ascending: the first of equal values is kept
        bk = key[j];
        bi = lane + 32 * j;
      }
    u32 wk;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(wk) : "r"(bk));
    const int cand = bk == wk ? bi : 0x7fffffff;
    int wi;
    asm volatile("redux.sync.min.s32 %0, %1, 0xffffffff;" : "=r"(wi) : "r"(cand));
    const float bp = wk ? __uint_as_float(wk - 1u) : -1.f;
    if (!wk) wi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (lane + 32 * j == wi) key[j] = 0u;
    top += bp;  // slot order, as the CPU sums
    if (lane == s) {
      my_id = wi;
      my_p = bp;
    }
  }
  my_w = my_p / top;
}
#endif

#if MOE_PART == 1

extern "C" __global__ void __launch_bounds__(128)
    moe_route(const float* __restrict__ logits, i64 ls, int T, int* __restrict__ ids, i64 is,
              float* __restrict__ w, i64 wstride) {
  LILY_PDL_PROLOGUE();
  const int lane = threadIdx.x & 31, t = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (t >= T) return;  // whole warps leave; nothing below synchronises the block
  int id;
  float wt;
  route_warp(logits + i64(t) * ls, lane, id, wt);
  if (lane < TOPK) {
    ids[i64(t) * is + lane] = id;
    w[i64(t) * wstride + lane] = wt;
  }
}

#endif  // MOE_PART 1

// ================================================================================================
#if MOE_PART == 2

// Must match struct MoeArgs in csrc/cuda/moe.cpp (static_assert there on its size).
struct MoeArgs {
  u64 x;
  i64 x_stride;
  u64 ids;
  i64 ids_stride;
  u64 wts;
  i64 wts_stride;
  u64 out;
  i64 out_stride;
  u64 data[3], scales[3], biases[3];  // gate, up, down: expert 0
  u64 data_stride[3], scale_stride[3], bias_stride[3];  // bytes per expert
  u64 act, y, tiles, pair_token, pair_pos;  // workspace
  int T, k, max_tiles, pad;
  // FUSED decode only: the shared expert's gate_proj, up, down (one matrix each), the router logits [T, NEXP]
  // the routing is computed from, and the shared expert's gate logit [T, 1]; out is then h, added into.
  u64 sdata[3], sscales[3], sbiases[3];
  u64 logits;
  i64 logits_stride;
  u64 sgate;
  i64 sgate_stride;
  u64 xh, xinv;  // MXROW prefill: x's (then act's) rows as f16 scaled by 2^e per row, and each row's 2^-e (workspace)
  u64 gcount;    // prefill grouping across blocks (moe_group_blocks): int [⌈T·k/1024⌉][NEXP] (workspace)
};
#ifndef FUSED
#define FUSED 0
#endif
#define SLOTS (TOPK + FUSED)  // act rows per token in decode: the routed experts, then the shared expert

// ---- weight format ----
#if WKIND == 1
#define CPV (128 / BITS)  // codes per 16-byte vector
#elif WDT == LILY_F32
#define CPV 4
#else
#define CPV 8
#endif
#define ESIZE_SCALE (SDT == LILY_F32 ? 4 : 2)

// 16 bytes of weights (or activations) at p.
__device__ __forceinline__ uint4 moe_ld16(const unsigned char* p) {
#if ALIGNED
  return *reinterpret_cast<const uint4*>(p);
#else
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = u32(p[4 * i]) | (u32(p[4 * i + 1]) << 8) | (u32(p[4 * i + 2]) << 16) | (u32(p[4 * i + 3]) << 24);
  return make_uint4(w[0], w[1], w[2], w[3]);
#endif
}

// Scale / bias element i (dtype SDT) of the array at p.
__device__ __forceinline__ float moe_scalar(const unsigned char* p, i64 i) {
#if ALIGNED
  return load_as_f32(p, SDT, i);
#else
  const unsigned char* q = p + i * ESIZE_SCALE;
  if (SDT == LILY_F32) return __uint_as_float(u32(q[0]) | (u32(q[1]) << 8) | (u32(q[2]) << 16) | (u32(q[3]) << 24));
  const u16 h = u16(u32(q[0]) | (u32(q[1]) << 8));
  return SDT == LILY_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
#endif
}

// The CPV values of one 16-byte vector: codes q (affine) or the weights themselves (dense), in input order.
__device__ __forceinline__ void moe_unpack(const uint4 v, float* w) {
  const u32 words[4] = {v.x, v.y, v.z, v.w};
#if WKIND == 1
  constexpr int PER = 32 / BITS;
  constexpr u32 MASK = (1u << BITS) - 1u;
#pragma unroll
  for (int i = 0; i < CPV; ++i) w[i] = float((words[i / PER] >> (BITS * (i % PER))) & MASK);
#elif WDT == LILY_F32
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = __uint_as_float(words[i]);
#else
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const u16 h = u16(words[i / 2] >> (16 * (i % 2)));
    w[i] = WDT == LILY_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
#endif
}

// Row bytes of one matrix row with `cols` inputs.
#if WKIND == 1
#define ROW_BYTES(cols) (i64(cols) * BITS / 8)
#define VEC_BYTES_AT(k) (i64(k) * BITS / 8)
#else
#define ROW_BYTES(cols) (i64(cols) * (WDT == LILY_F32 ? 4 : 2))
#define VEC_BYTES_AT(k) (i64(k) * (WDT == LILY_F32 ? 4 : 2))
#endif

__device__ __forceinline__ int moe_swz(int f) { return f ^ ((f >> 3) & 7); }

// Decode with x / act as three int8 terms and dp4a (quant.cuh; the host's option gemv_dp4a): 4/8-bit affine
// experts, 16-byte loads, groups of whole 16-byte vectors. The packed terms of a row of n vectors take the
// dynamic shared memory the fp32 rows would (3.25 or 3.5 bytes per input instead of 4).
#ifndef DP4A
#define DP4A 0
#endif
#if DP4A && !(WKIND == 1 && (BITS == 4 || BITS == 8) && ALIGNED && GROUP % CPV == 0)
#error "DP4A needs 4/8-bit affine experts, 16-byte loads and groups of whole vectors"
#endif
#if DP4A
constexpr int MQV = Dp4a<BITS>::QW / 4;  // uint4 of packed terms per vector
// The dp4a form of moe_vec_dot: vector c of a row whose packed terms start at xq (n vectors per row).
__device__ __forceinline__ float moe_vec_dot_dp4a(const uint4 wv, const uint4* xq, const float* xsc, const float* xsm,
                                                  int n, int c, float s, float b, float acc) {
  u32 xw[Dp4a<BITS>::QW];
  dp4a_load_x<BITS>(xq, n, c, xw);
  const u32 w4[4] = {wv.x, wv.y, wv.z, wv.w};
  return dp4a_chunk<BITS>(w4, xw, xsc[c], xsm[c], s, b, acc);
}
#endif

__device__ __forceinline__ bool moe_valid_expert(int e) { return e >= 0 && e < NEXP; }

// DEC_MINB (the host's moe_decode_minb): blocks per SM the two decode kernels' registers must allow (0: the
// compiler's choice, 77 registers for moe_down_decode at the real shape, 3 blocks per SM; moe_gate_up_decode: below).
// At 4, 64 registers: the 288 gate/up blocks and nearly all 256 down blocks fit the SMs together, so more down blocks
// load their weights during gate/up.
#ifndef DEC_MINB
#define DEC_MINB 0
#endif
#if DEC_MINB > 0
#define MOE_DEC_BOUNDS __launch_bounds__(256, DEC_MINB)
#else
#define MOE_DEC_BOUNDS __launch_bounds__(256)
#endif
// GU_EARLY: moe_gate_up_decode issues its weight loads before it stages x, where a lane's weight vectors are the
// host's default count (ROWS_G·GU_NIT ≤ 4: rows_g = 4 / nit) and the cap leaves registers for them (DEC_MINB ≤ 3).
// All its weights and one vector's packed x are then live at once: left to itself the compiler takes 102 registers at
// the real shape (2 blocks per SM: 264 slots on an H100 for the 288 blocks), so with DEC_MINB 0 and DP4A the bound
// asks for 3 blocks (80 registers, one 4-byte spill after the staging's barrier). Otherwise the loads follow the
// staging, as they did before (the compiler then spreads them over the arithmetic: 4-8 dependent DRAM round trips).
#ifndef GU_ORDER
#define GU_ORDER 1  // the host's moe_early_loads (0: the loads after the staging, for an A/B)
#endif
#define GU_NIT ((HID / CPV + 31) / 32)
#define GU_EARLY (GU_ORDER && ROWS_G * GU_NIT <= 4 && DEC_MINB <= 3)
#if DEC_MINB == 0 && DP4A && GU_EARLY
#define MOE_GU_BOUNDS __launch_bounds__(256, 3)
#else
#define MOE_GU_BOUNDS MOE_DEC_BOUNDS
#endif

// ---------------------------------------------------------------------------------------------
// Decode 1: grouped gate + up + SiLU·mul.

// Σ over one vector of a row (vector index c: inputs [c·CPV, (c+1)·CPV)) of w·x, affine form applied.
__device__ __forceinline__ float moe_vec_dot(const uint4 wv, const float4* xs, int c, float s, float b) {
  float w[CPV];
  moe_unpack(wv, w);
  const int f0 = c * (CPV / 4);
  float d = 0.f, sx = 0.f;
#pragma unroll
  for (int j = 0; j < CPV / 4; ++j) {
    const float4 xv = xs[moe_swz(f0 + j)];
    d = fmaf(w[4 * j], xv.x, d);
    d = fmaf(w[4 * j + 1], xv.y, d);
    d = fmaf(w[4 * j + 2], xv.z, d);
    d = fmaf(w[4 * j + 3], xv.w, d);
    sx += (xv.x + xv.y) + (xv.z + xv.w);
  }
#if WKIND == 1
  return fmaf(s, d, b * sx);
#else
  return d;
#endif
}

constexpr int GU_NV = HID / CPV;  // vectors per gate/up row (GU_NIT per lane)

// The lane's vectors of rows row0 .. row0 + ROWS_G - 1 of one expert's gate and up (shared: the shared expert's
// matrices, else routed expert e's), with their groups' scales and biases: ROWS_G·2·GU_NIT 16-byte loads in flight.
// GU_EARLY: every load is issued, unpredicated: a row past INTER or a vector past GU_NV reads the last one instead
// (the caller ignores both: a row's result is stored only for row < INTER and the products skip c ≥ GU_NV).
// Predicated loads made the compiler branch around the last ones and widen the bf16 scales of the first ones before
// that branch, i.e. wait a DRAM round trip before issuing them. Otherwise (loads after the staging) as before.
__device__ __forceinline__ void moe_gate_up_load(const MoeArgs& a, bool shared, int e, int row0, int lane,
                                                 uint4 (&wv)[ROWS_G][2][GU_NIT], float (&sc)[ROWS_G][2][GU_NIT],
                                                 float (&bi)[ROWS_G][2][GU_NIT]) {
  const unsigned char* base[2];
#if WKIND == 1
  const unsigned char* sbase[2];
  const unsigned char* bbase[2];
#endif
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    base[m] = shared ? reinterpret_cast<const unsigned char*>(a.sdata[m])
                     : reinterpret_cast<const unsigned char*>(a.data[m]) + i64(e) * i64(a.data_stride[m]);
#if WKIND == 1
    sbase[m] = shared ? reinterpret_cast<const unsigned char*>(a.sscales[m])
                      : reinterpret_cast<const unsigned char*>(a.scales[m]) + i64(e) * i64(a.scale_stride[m]);
    bbase[m] = shared ? reinterpret_cast<const unsigned char*>(a.sbiases[m])
                      : reinterpret_cast<const unsigned char*>(a.biases[m]) + i64(e) * i64(a.bias_stride[m]);
#endif
  }
#pragma unroll
  for (int r = 0; r < ROWS_G; ++r)
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int it = 0; it < GU_NIT; ++it) {
#if GU_EARLY
        const int row = min(row0 + r, INTER - 1), c = min(lane + 32 * it, GU_NV - 1);
        const bool ok = true;
#else
        const int row = row0 + r, c = lane + 32 * it;
        const bool ok = row < INTER && c < GU_NV;
#endif
        wv[r][m][it] = make_uint4(0, 0, 0, 0);
        sc[r][m][it] = 0.f;
        bi[r][m][it] = 0.f;
        if (ok) {
          wv[r][m][it] = moe_ld16(base[m] + i64(row) * ROW_BYTES(HID) + VEC_BYTES_AT(c * CPV));
#if WKIND == 1
          const i64 gi = i64(row) * (HID / GROUP) + (c * CPV) / GROUP;
          sc[r][m][it] = moe_scalar(sbase[m], gi);
          bi[r][m][it] = moe_scalar(bbase[m], gi);
#endif
        }
      }
}

// The thread's share of x_t for the staging, into registers (DP4A: dp4a_quantize_rows' items for one row of GU_NV
// vectors, 4 threads per vector, passes of 256 threads; else the fp32 float4s of the loop it replaces).
#if DP4A
constexpr int GU_XPASS = (GU_NV * 4 + 255) / 256;
typedef float GuX[GU_XPASS][Dp4a<BITS>::EW];
#else
constexpr int GU_XF4 = (HID / 4 + 7) / 8 * 8;  // float4 of fp32 x in shared memory (padded for the swizzle)
constexpr int GU_XPASS = (GU_XF4 + 255) / 256;
typedef float4 GuX[GU_XPASS];
#endif
__device__ __forceinline__ void moe_gate_up_load_x(const float* x, int tid, GuX& xr) {
#pragma unroll
  for (int p = 0; p < GU_XPASS; ++p) {
#if DP4A
    constexpr int EW = Dp4a<BITS>::EW;
    const int q = 256 * p + tid;
    const float* xp = x + i64(q >> 2) * CPV + (q & 3) * EW;
#pragma unroll
    for (int j = 0; j < EW; j += 4) {
      float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
      if (q < GU_NV * 4) f = *reinterpret_cast<const float4*>(xp + j);
      xr[p][j] = f.x, xr[p][j + 1] = f.y, xr[p][j + 2] = f.z, xr[p][j + 3] = f.w;
    }
#else
    const int f = 256 * p + tid;
    xr[p] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (f < GU_XF4) {
      xr[p].x = 4 * f < HID ? x[4 * f] : 0.f;
      xr[p].y = 4 * f + 1 < HID ? x[4 * f + 1] : 0.f;
      xr[p].z = 4 * f + 2 < HID ? x[4 * f + 2] : 0.f;
      xr[p].w = 4 * f + 3 < HID ? x[4 * f + 3] : 0.f;
    }
#endif
  }
}

// Order (GU_EARLY): a shared-expert block issues its weight loads, waits (LILY_PDL_PROLOGUE) and loads its x; a
// routed block waits, loads its x into registers, routes (warp 0; non-FUSED: reads its id) and, after a barrier,
// issues its weight loads. Then every block moves x from registers to shared memory (DP4A: its packed terms), meets
// a barrier and computes: x's L2 round trip overlaps the routing, its staging the weights' DRAM round trip. One
// branch per kind of block (s is the block's), so no weight register is live across the routing. Without GU_EARLY
// the weight loads of both kinds follow the staging's barrier. The arithmetic and its order are unchanged.
extern "C" __global__ void MOE_GU_BOUNDS moe_gate_up_decode(const MoeArgs a) {
  constexpr int NV = GU_NV, NIT = GU_NIT;
  extern __shared__ float4 moe_smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slot = blockIdx.y, t = slot / SLOTS, s = slot - t * SLOTS;
  const int row0 = (blockIdx.x * 8 + warp) * ROWS_G;
  const float* x = reinterpret_cast<const float*>(a.x) + i64(t) * a.x_stride;
  float* act = reinterpret_cast<float*>(a.act) + i64(slot) * INTER;
  uint4 wv[ROWS_G][2][NIT];
  float sc[ROWS_G][2][NIT], bi[ROWS_G][2][NIT];
  GuX xr;
  const bool shared_slot = FUSED && s == TOPK;
  int e = 0;
  if (shared_slot) {  // FUSED only
#if GU_EARLY
    // No kernel writes the shared expert's weights: their loads go out before the wait (common.cuh's contract).
    moe_gate_up_load(a, true, 0, row0, lane, wv, sc, bi);
#endif
    LILY_PDL_PROLOGUE();
    moe_gate_up_load_x(x, tid, xr);
  } else {
    LILY_PDL_PROLOGUE();
#if FUSED
    moe_gate_up_load_x(x, tid, xr);  // its L2 round trip overlaps the routing
    // Every routed block routes its token itself (one warp, NEXP logits: cheaper than a launch); block
    // (0, token's slot 0) also stores the routing for moe_down_decode and the caller.
    __shared__ int route_id[TOPK];
    if (warp == 0) {
      int id;
      float wt;
      route_warp(reinterpret_cast<const float*>(a.logits) + i64(t) * a.logits_stride, lane, id, wt);
      if (lane < TOPK) {
        route_id[lane] = id;
        if (blockIdx.x == 0 && s == 0) {
          reinterpret_cast<int*>(a.ids)[i64(t) * a.ids_stride + lane] = id;
          reinterpret_cast<float*>(a.wts)[i64(t) * a.wts_stride + lane] = wt;
        }
      }
    }
    __syncthreads();  // route_id
    e = route_id[s];
#else
    e = reinterpret_cast<const int*>(a.ids)[i64(t) * a.ids_stride + s];
    moe_gate_up_load_x(x, tid, xr);
#endif
    if (!moe_valid_expert(e)) {  // e is the block's: the whole block leaves
      if (lane < ROWS_G && row0 + lane < INTER) act[row0 + lane] = 0.f;
      return;
    }
#if GU_EARLY
    moe_gate_up_load(a, false, e, row0, lane, wv, sc, bi);  // in flight while x is staged
#endif
  }
#if DP4A
  uint4* xq = reinterpret_cast<uint4*>(moe_smem);
  float* xsc = reinterpret_cast<float*>(xq + MQV * NV);
  float* xsm = xsc + NV;
#pragma unroll
  for (int p = 0; p < GU_XPASS; ++p) {
    const int q = 256 * p + tid;
    dp4a_quantize_word<BITS>(xr[p], xq, NV, xsc, xsm, q >> 2, q & 3, q < NV * 4);
  }
#else
  float4* xs = moe_smem;  // [GU_XF4], swizzled
#pragma unroll
  for (int p = 0; p < GU_XPASS; ++p)
    if (256 * p + tid < GU_XF4) xs[moe_swz(256 * p + tid)] = xr[p];
#endif
  __syncthreads();
#if !GU_EARLY
  moe_gate_up_load(a, shared_slot, e, row0, lane, wv, sc, bi);
#endif
#if DP4A
  // Vector-major: each vector's packed x is read once for the warp's ROWS_G gate and up rows.
  float accd[ROWS_G][2];
#pragma unroll
  for (int r = 0; r < ROWS_G; ++r) accd[r][0] = accd[r][1] = 0.f;
#pragma unroll
  for (int it = 0; it < NIT; ++it) {
    const int c = lane + 32 * it;
    if (c < NV) {
      u32 xw[Dp4a<BITS>::QW];
      dp4a_load_x<BITS>(xq, NV, c, xw);
#pragma unroll
      for (int r = 0; r < ROWS_G; ++r)
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const uint4 v = wv[r][m][it];
          const u32 w4[4] = {v.x, v.y, v.z, v.w};
          accd[r][m] = dp4a_chunk<BITS>(w4, xw, xsc[c], xsm[c], sc[r][m][it], bi[r][m][it], accd[r][m]);
        }
    }
  }
#endif
#pragma unroll
  for (int r = 0; r < ROWS_G; ++r) {
    float acc[2] = {0.f, 0.f};
#if DP4A
    acc[0] = accd[r][0], acc[1] = accd[r][1];
#else
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int it = 0; it < NIT; ++it) {
        const int c = lane + 32 * it;
        if (c < NV) acc[m] += moe_vec_dot(wv[r][m][it], xs, c, sc[r][m][it], bi[r][m][it]);
      }
#endif
    const float g = warp_sum(acc[0]), u = warp_sum(acc[1]);
    const int row = row0 + r;
    if (lane == 0 && row < INTER) act[row] = silu(g) * u;
  }
}

// ---------------------------------------------------------------------------------------------
// Decode 2: grouped down + routing weights, summed per output row in (id, slot) order.

constexpr int AF4 = (INTER / 4 + 7) / 8 * 8;  // float4 per fp32 act row in shared memory (padded for the swizzle)

// The k (+ shared) act rows of a token into shared memory: the packed dp4a terms, or fp32 float4s swizzled per row.
__device__ __forceinline__ void moe_down_stage_act(const float* act, float4* moe_smem) {
#if DP4A
  constexpr int NVI = INTER / CPV;
  uint4* aq = reinterpret_cast<uint4*>(moe_smem);
  float* asc = reinterpret_cast<float*>(aq + SLOTS * MQV * NVI);
  float* asm_ = asc + SLOTS * NVI;
  dp4a_quantize_rows<BITS>(act, INTER, CPV, SLOTS, NVI, true, aq, asc, asm_);
#else
  for (int i = threadIdx.x; i < SLOTS * AF4; i += 256) {
    const int s = i / AF4, f = i - s * AF4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (4 * f < INTER) v = *reinterpret_cast<const float4*>(act + i64(s) * INTER + 4 * f);  // INTER % 4 == 0
    moe_smem[s * AF4 + moe_swz(f)] = v;
  }
#endif
}

// PREROUTE (FUSED only; the host sets it when the launch is a programmatic dependent one): the block routes its
// token itself from the router logits, written two kernels back, and issues its weight loads before
// LILY_PDL_WAIT, so routing and the first DRAM round trip overlap moe_gate_up_decode's run; only the act rows
// wait for it. route_warp is the gate/up blocks' own, so the ids and weights are theirs bit for bit.
#ifndef PREROUTE
#define PREROUTE 0
#endif
#if PREROUTE && !FUSED
#error "PREROUTE needs the fused decode MoE (its router logits)"
#endif
extern "C" __global__ void MOE_DEC_BOUNDS moe_down_decode(const MoeArgs a) {
#if !PREROUTE
  LILY_PDL_PROLOGUE();
#endif
  constexpr int NVI = INTER / CPV;                 // vectors per down row
  constexpr int NITD = (NVI + LPR - 1) / LPR;      // per lane of a group
  constexpr int NGRP = 256 / LPR;                  // (row, slot) items in flight per pass
  constexpr int ITEMS = ROWS_D * SLOTS;
  constexpr int PASSES = (ITEMS + NGRP - 1) / NGRP;
  extern __shared__ float4 moe_smem[];
  __shared__ float part[ITEMS];
  __shared__ int eid[SLOTS], ord[TOPK];
  __shared__ float ew[TOPK];
  const int tid = threadIdx.x, t = blockIdx.y, n0 = blockIdx.x * ROWS_D;
#if PREROUTE
  if (tid < 32) {
    int id;
    float wt;
    route_warp<true>(reinterpret_cast<const float*>(a.logits) + i64(t) * a.logits_stride, tid, id, wt);
    if (tid < TOPK) eid[tid] = id, ew[tid] = wt;
  }
#else
  if (tid < TOPK) {
    eid[tid] = reinterpret_cast<const int*>(a.ids)[i64(t) * a.ids_stride + tid];
    ew[tid] = reinterpret_cast<const float*>(a.wts)[i64(t) * a.wts_stride + tid];
  }
#endif
  if (FUSED && tid == TOPK) eid[tid] = 0;  // the shared expert's slot: one matrix, always present
  const float* act = reinterpret_cast<const float*>(a.act) + i64(t) * SLOTS * INTER;
#if PREROUTE
  __syncthreads();  // eid for the weight loads below, which go out before the wait
#else
  moe_down_stage_act(act, moe_smem);
  __syncthreads();
#endif
  if (tid < TOPK) {  // rank of slot tid by (expert id, slot)
    int rank = 0;
    for (int j = 0; j < TOPK; ++j) rank += eid[j] < eid[tid] || (eid[j] == eid[tid] && j < tid);
    ord[rank] = tid;
  }

  const int grp = tid / LPR, gl = tid % LPR;
  uint4 wv[PASSES][NITD];
  float sc[PASSES][NITD], bi[PASSES][NITD];
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int item = grp + NGRP * p, r = item / SLOTS, s = item - r * SLOTS, n = n0 + r;
    const int e = item < ITEMS ? eid[s] : -1;
    const bool ok = item < ITEMS && n < HID && moe_valid_expert(e);
    const bool sh = FUSED && s == TOPK;
#pragma unroll
    for (int j = 0; j < NITD; ++j) {
      const int c = gl + LPR * j;
      wv[p][j] = make_uint4(0, 0, 0, 0);
      sc[p][j] = 0.f;
      bi[p][j] = 0.f;
      if (ok && c < NVI) {
        const unsigned char* base = sh ? reinterpret_cast<const unsigned char*>(a.sdata[2])
                                       : reinterpret_cast<const unsigned char*>(a.data[2]) + i64(e) * i64(a.data_stride[2]);
        wv[p][j] = moe_ld16(base + i64(n) * ROW_BYTES(INTER) + VEC_BYTES_AT(c * CPV));
#if WKIND == 1
        const i64 gi = i64(n) * (INTER / GROUP) + (c * CPV) / GROUP;
        const unsigned char* sb = sh ? reinterpret_cast<const unsigned char*>(a.sscales[2])
                                     : reinterpret_cast<const unsigned char*>(a.scales[2]) + i64(e) * i64(a.scale_stride[2]);
        const unsigned char* bb = sh ? reinterpret_cast<const unsigned char*>(a.sbiases[2])
                                     : reinterpret_cast<const unsigned char*>(a.biases[2]) + i64(e) * i64(a.bias_stride[2]);
        sc[p][j] = moe_scalar(sb, gi);
        bi[p][j] = moe_scalar(bb, gi);
#endif
      }
    }
  }
#if PREROUTE
  LILY_PDL_PROLOGUE();  // the act rows are moe_gate_up_decode's output
  moe_down_stage_act(act, moe_smem);
  __syncthreads();
#endif
#if DP4A
  const uint4* aq = reinterpret_cast<const uint4*>(moe_smem);  // slot s's packed terms at aq + s·MQV·NVI
  const float* asc = reinterpret_cast<const float*>(aq + SLOTS * MQV * NVI);
  const float* asm_ = asc + SLOTS * NVI;
#else
  const float4* acts = moe_smem;  // [SLOTS][AF4], swizzled per row
#endif
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int item = grp + NGRP * p, r = item / SLOTS, s = item - r * SLOTS;
    float d = 0.f;
#pragma unroll
    for (int j = 0; j < NITD; ++j) {
      const int c = gl + LPR * j;
#if DP4A
      if (c < NVI && item < ITEMS)
        d = moe_vec_dot_dp4a(wv[p][j], aq + s * MQV * NVI, asc + s * NVI, asm_ + s * NVI, NVI, c, sc[p][j], bi[p][j], d);
#else
      if (c < NVI && item < ITEMS) d += moe_vec_dot(wv[p][j], acts + s * AF4, c, sc[p][j], bi[p][j]);
#endif
    }
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if (gl == 0 && item < ITEMS) part[item] = d;
  }
  __syncthreads();
  if (tid < ROWS_D && n0 + tid < HID) {
    float o = 0.f;
    for (int j = 0; j < TOPK; ++j) {
      const int s = ord[j];
      if (moe_valid_expert(eid[s])) o += ew[s] * part[tid * SLOTS + s];
    }
    float* out = reinterpret_cast<float*>(a.out) + i64(t) * a.out_stride + n0 + tid;
#if FUSED
    // moe_combine's expression: h += routed + σ(shared gate logit) · shared.
    const float g = sigmoid(reinterpret_cast<const float*>(a.sgate)[i64(t) * a.sgate_stride]);
    *out += o + g * part[tid * SLOTS + TOPK];
#else
    *out = o;
#endif
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill 1: grouping. moe_group: one block of 1024 threads does it all. With more than one 1024-pair chunk, the
// host's moe_group_blocks splits it in three (the same tile map, pair_token and pair_pos, int for int):
// moe_group_count (a block per chunk: its histogram into gcount[chunk][E]), moe_group_scan (one block: per expert
// the chunks' exclusive prefix plus the expert's first row, in place, and the tile map) and moe_group_scatter (a
// block per chunk: its stable scatter from those cursors), so the chunks' scatters run side by side instead of one
// after another (121 µs a layer at 4,096 rows on an H100 for the single block).

__device__ __forceinline__ int moe_pair_expert(const MoeArgs& a, int p) {
  const int t = p / a.k, s = p - t * a.k;
  const int e = reinterpret_cast<const int*>(a.ids)[i64(t) * a.ids_stride + s];
  return moe_valid_expert(e) ? e : -1;
}

// hist[e] = the pairs p in [p0, p1) routed to expert e (shared atomics: counts only). Ends with a barrier.
__device__ __forceinline__ void moe_group_histogram(const MoeArgs& a, int p0, int p1, int* hist) {
  for (int e = threadIdx.x; e < NEXP; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int p = p0 + int(threadIdx.x); p < p1; p += blockDim.x) {
    const int e = moe_pair_expert(a, p);
    if (e >= 0) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
}

// From rows per expert (hist), by warp 0: each expert's first sorted row (cursor) and first tile (tstart), exclusive
// scans of lane-serial chunks then a warp scan; tiles[0] = the tile count (at most max_tiles). Then, by the whole
// block, the tile map (expert, first row, rows) of every tile. Ends with a barrier.
__device__ __forceinline__ void moe_group_scan_experts(const MoeArgs& a, const int* hist, int* cursor, int* tstart) {
  constexpr int EPL = (NEXP + 31) / 32;  // experts per lane in the scans
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int* tiles = reinterpret_cast<int*>(a.tiles);
  if (warp == 0) {
    int rows = 0, ntl = 0;
    for (int j = 0; j < EPL; ++j) {
      const int e = lane * EPL + j;
      if (e < NEXP) {
        rows += hist[e];
        ntl += (hist[e] + BM - 1) / BM;
      }
    }
    int ir = rows, it = ntl;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int vr = __shfl_up_sync(0xffffffffu, ir, o), vt = __shfl_up_sync(0xffffffffu, it, o);
      if (lane >= o) {
        ir += vr;
        it += vt;
      }
    }
    int r0 = ir - rows, t0 = it - ntl;
    for (int j = 0; j < EPL; ++j) {
      const int e = lane * EPL + j;
      if (e < NEXP) {
        cursor[e] = r0;
        tstart[e] = t0;
        r0 += hist[e];
        t0 += (hist[e] + BM - 1) / BM;
      }
    }
    if (lane == 31) tiles[0] = it < a.max_tiles ? it : a.max_tiles;
  }
  __syncthreads();
  for (int e = tid; e < NEXP; e += blockDim.x) {
    const int n = hist[e];
    for (int j = 0; j * BM < n; ++j) {
      const int ti = tstart[e] + j;
      if (ti < a.max_tiles) {
        tiles[1 + 3 * ti] = e;
        tiles[2 + 3 * ti] = cursor[e] + j * BM;
        tiles[3 + 3 * ti] = n - j * BM < BM ? n - j * BM : BM;
      }
    }
  }
  __syncthreads();
}

// The stable scatter of pairs [base, base + 1024) (one per thread of a 1024-thread block) from the sorted row where
// each expert's pairs of this chunk start (cursor): warp peers from __match_any_sync, per-warp counts in wcnt, a
// prefix over warps. With advance, the cursors then move past the chunk's pairs (the next chunk's starts).
__device__ __forceinline__ void moe_group_scatter_chunk(const MoeArgs& a, int base, int* cursor,
                                                        u16 (*wcnt)[NEXP + (NEXP & 1)], bool advance) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int P = a.T * a.k;
  u32* wz = reinterpret_cast<u32*>(&wcnt[0][0]);
  constexpr int WZ = 32 * (NEXP + (NEXP & 1)) / 2;
  for (int i = tid; i < WZ; i += 1024) wz[i] = 0u;
  __syncthreads();
  const int p = base + tid;
  const int e = p < P ? moe_pair_expert(a, p) : -1;
  const u32 peers = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && rank == 0) wcnt[warp][e] = u16(__popc(peers));
  __syncthreads();
  if (e >= 0) {
    int before = 0;
    for (int w = 0; w < warp; ++w) before += wcnt[w][e];
    const int pos = cursor[e] + before + rank;
    reinterpret_cast<int*>(a.pair_token)[pos] = p / a.k;
    reinterpret_cast<int*>(a.pair_pos)[p] = pos;
  } else if (p < P) {
    reinterpret_cast<int*>(a.pair_pos)[p] = -1;
  }
  if (!advance) return;
  __syncthreads();
  for (int e2 = tid; e2 < NEXP; e2 += 1024) {
    int n = 0;
    for (int w = 0; w < 32; ++w) n += wcnt[w][e2];
    cursor[e2] += n;
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(1024) moe_group(const MoeArgs a) {
  LILY_PDL_PROLOGUE();
  __shared__ int hist[NEXP], cursor[NEXP], tstart[NEXP];
  __shared__ u16 wcnt[32][NEXP + (NEXP & 1)];  // pairs of expert e in warp w of the current chunk
  const int P = a.T * a.k;
  moe_group_histogram(a, 0, P, hist);
  moe_group_scan_experts(a, hist, cursor, tstart);
  for (int base = 0; base < P; base += 1024) moe_group_scatter_chunk(a, base, cursor, wcnt, true);
}

// moe_group_blocks, 1 of 3: chunk blockIdx.x's pairs per expert into gcount[chunk][E].
extern "C" __global__ void __launch_bounds__(1024) moe_group_count(const MoeArgs a) {
  LILY_PDL_PROLOGUE();
  __shared__ int hist[NEXP];
  const int p0 = blockIdx.x * 1024;
  moe_group_histogram(a, p0, min(p0 + 1024, a.T * a.k), hist);
  int* cnt = reinterpret_cast<int*>(a.gcount) + i64(blockIdx.x) * NEXP;
  for (int e = threadIdx.x; e < NEXP; e += 1024) cnt[e] = hist[e];
}

// 2 of 3 (one block): per expert, gcount[c][e] becomes the sorted row where chunk c's pairs of e start; the tile map.
extern "C" __global__ void __launch_bounds__(1024) moe_group_scan(const MoeArgs a) {
  LILY_PDL_PROLOGUE();
  __shared__ int hist[NEXP], cursor[NEXP], tstart[NEXP];
  const int chunks = (a.T * a.k + 1023) / 1024;
  int* cnt = reinterpret_cast<int*>(a.gcount);
  for (int e = threadIdx.x; e < NEXP; e += 1024) {
    int n = 0;
    for (int c = 0; c < chunks; ++c) {
      const int v = cnt[i64(c) * NEXP + e];
      cnt[i64(c) * NEXP + e] = n;
      n += v;
    }
    hist[e] = n;
  }
  __syncthreads();
  moe_group_scan_experts(a, hist, cursor, tstart);
  for (int e = threadIdx.x; e < NEXP; e += 1024)
    for (int c = 0; c < chunks; ++c) cnt[i64(c) * NEXP + e] += cursor[e];
}

// 3 of 3: chunk blockIdx.x's stable scatter from its cursors.
extern "C" __global__ void __launch_bounds__(1024) moe_group_scatter(const MoeArgs a) {
  LILY_PDL_PROLOGUE();
  __shared__ int cursor[NEXP];
  __shared__ u16 wcnt[32][NEXP + (NEXP & 1)];
  const int* cnt = reinterpret_cast<const int*>(a.gcount) + i64(blockIdx.x) * NEXP;
  for (int e = threadIdx.x; e < NEXP; e += 1024) cursor[e] = cnt[e];  // read after the chunk's first barrier
  moe_group_scatter_chunk(a, int(blockIdx.x) * 1024, cursor, wcnt, false);
}

// ---------------------------------------------------------------------------------------------
// Prefill 2/3: grouped GEMM on tensor cores, mma.sync m16n8k16 bf16 × bf16 -> f32 (the matmul family's
// operand scheme, kernels/matmul.cu matmul_gemm).
//   A = the activation rows (x gathered, or act), f32 split into two bf16 terms hi = bf16(v), lo =
//       bf16(v − hi): |v − hi − lo| ≤ 2^-17·|v|; two MMAs per step, x_hi·W and x_lo·W. With -D XS=1 (the
//       backend option prefill_x = bf16) only hi: |v − hi| ≤ 2^-9·|v|, one MMA per step. With -D XF=1 (XS 1, affine
//       weights; prefill_x = f16, the default) one f16 term of v·2^e, e per row and group part (quant.cuh
//       f16_part_scale): ≤ 2^-12·|v| relative, one f16 MMA per step against the codes as f16 (exact), and the group
//       accumulator folded at every part's end as acc += (s_g·2^-e)·D.
//   B = the weights, by MMA_WM:
//     0 (affine): the integer codes, exact in bf16 (q ≤ 255). D_g = Σ_{k ∈ g} x·q accumulates in its own
//       fp32 fragment set, folded in at the group's end as acc += s_g·D_g; acc += b_g·Σx at the end of each
//       group part (a group's part inside one K block; Σx from the f32 x). Scales/biases stay fp32 and the
//       weight itself is never rounded.
//     1 (dense bf16): the stored elements, exact.
//     2 (dense f16 / f32): hi + lo bf16 of the element, a third MMA x_hi·W_lo (x_lo·W_lo, ≤ 2^-18 relative,
//       is dropped); BK 32 so the four shared tiles stay within 48 KB.
//   Error per product ≲ 2^-17 relative, in random directions: ~3e-6 relative per GEMM against the fp32 CPU.

#define MMA_NT 256  // threads of a GEMM block (8 warps; moe.cpp kMmaThreads must match)
#ifndef XS
#define XS 2  // activation terms: 2 = bf16 hi + lo (two MMAs per step), 1 = bf16 (one MMA, lo never computed)
#endif
#ifndef XF
#define XF 0  // 1: the one term is f16, scaled per row and group part (XS 1, affine weights)
#endif

#if WKIND == 1
#define MMA_WM 0
#elif WDT == LILY_BF16
#define MMA_WM 1
#else
#define MMA_WM 2
#endif

// PIPE = S > 0 (affine weights, ALIGNED; the host sets it for 64-row tiles): the raw K blocks (activation rows f32,
// weight codes, the 4-byte words holding the group scales and biases) are copied global -> shared by cp.async into a
// ring of S stages in dynamic shared memory, S - 1 blocks ahead of the one being converted, instead of one block
// ahead through registers (whose staging spilled at the 128-register cap). Measured +1% prefill at 2K-8K on the
// H200, and slower with 16-row tiles, which are bound by shared-memory traffic, not by load latency (ncu:
// benchmarks/NOTES.md). The conversion and the MMAs are the register path's, so the bits are the same.
#ifndef PIPE
#define PIPE 0
#endif
#if PIPE && !(MMA_WM == 0 && ALIGNED)
#error "PIPE needs affine weights with 16-byte loads"
#endif
#ifndef FRAG
#define FRAG 0
#endif
#if PIPE || FRAG
extern __shared__ __align__(16) unsigned char moe_ring[];
#endif

#if MMA_WM == 0
static_assert(GROUP % 16 == 0, "prefill: affine groups are multiples of 16 (one k16 MMA step)");
#endif
static_assert(XF == 0 || (XS == 1 && MMA_WM == 0), "XF: one f16 x term against affine codes");
// An activation chunk of 4 inputs as two pairs for the A tile: bf16 hi (+ lo), or (XF) f16 of v·2^e with e from the
// max |v| over the chunk's group part (lp neighbouring lanes, a fixed xor tree; every lane takes part); inv = 2^-e.
template <int LPARTS>
__device__ __forceinline__ void moe_a_chunk(const float4& v, u32& h0, u32& h1, u32& l0, u32& l1, float& inv) {
  if constexpr (XF) {
    const float x[4] = {v.x, v.y, v.z, v.w};
    u32 h[2];
    inv = f16_scaled_pairs<4, LPARTS>(x, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))), h);
    h0 = h[0], h1 = h[1];
    l0 = l1 = 0u;
  } else {
    split2_bf16(v.x, v.y, h0, l0);
    split2_bf16(v.z, v.w, h1, l1);
    inv = 1.f;
  }
}

// Epilogue, one lane's two adjacent outputs (a sorted row, columns n and n + 1) from accumulator fragments: gate/up
// (c = gate, u = up of the same columns) -> act = silu(gate)·up; down (c) -> y.
template <int NMAT>
__device__ __forceinline__ void moe_store_pair(const MoeArgs& a, i64 row, int n, const float* c, const float* u) {
  float2 v;
  if constexpr (NMAT == 2) {
    v.x = silu(c[0]) * u[0];
    v.y = silu(c[1]) * u[1];
    *reinterpret_cast<float2*>(reinterpret_cast<float*>(a.act) + row * INTER + n) = v;
  } else {
    v.x = c[0];
    v.y = c[1];
    *reinterpret_cast<float2*>(reinterpret_cast<float*>(a.y) + row * HID + n) = v;
  }
}

// One block: BM sorted rows of one expert × BN columns of NMAT weight matrices (mat0, mat0 + 1, ...).
// A rows: GATHER ? x[pair_token[row]] : act[row]; K = KDIM; weights [N = NDIM, KDIM] per expert.
template <int NMAT, int BN, int KDIM, int NDIM, bool GATHER>
__device__ __forceinline__ void moe_mma_block(const MoeArgs& a, int mat0) {
  constexpr int BK = MMA_WM == 2 ? 32 : 64;
  constexpr int PITCH = BK + 8;  // halves; 36 (20) words per row: fragment loads conflict-free
  constexpr int WARPS_M = BM >= 32 ? 2 : 1, WARPS_N = MMA_NT / 32 / WARPS_M;
  constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N, MT = WTM / 16, NT = WTN / 8;
  constexpr int A_CH = BM * BK / 4, A_PER = (A_CH + MMA_NT - 1) / MMA_NT;
  constexpr int BROWS = NMAT * BN, B_CH = BROWS * BK / CPV, B_PER = (B_CH + MMA_NT - 1) / MMA_NT;
  constexpr int KT = (KDIM + BK - 1) / BK;
  __shared__ __align__(16) u16 Ah[BM * PITCH];
  __shared__ __align__(16) u16 Al[XS == 2 ? BM * PITCH : 8];
  __shared__ __align__(16) u16 Bh[BROWS * PITCH];
#if MMA_WM == 2
  __shared__ __align__(16) u16 Bl[BROWS * PITCH];
#endif
#if MMA_WM == 0
  // Group parts: GP inputs of one group inside one K block (a group tiles BK or BK tiles it; else 16).
  constexpr int GP = (GROUP % BK == 0 || BK % GROUP == 0) ? (GROUP < BK ? GROUP : BK) : 16;
  constexpr int NP = BK / GP, S_CH = BROWS * NP, S_PER = (S_CH + MMA_NT - 1) / MMA_NT, LP = GP / 4;
  __shared__ float sxs[BM * NP], ss[BROWS * NP], bs[BROWS * NP];
  __shared__ float sxr[XF ? BM * NP : 1];  // XF: 2^-e of each row's group part
#endif
  __shared__ int rowsrc[BM];

  const int* tiles = reinterpret_cast<const int*>(a.tiles);
  const int tile = blockIdx.x;
  if (tile >= tiles[0]) return;  // uniform over the block
  const int e = tiles[1 + 3 * tile], r0 = tiles[2 + 3 * tile], rn = tiles[3 + 3 * tile];
  const int n0 = blockIdx.y * BN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N, g = lane >> 2, t4 = lane & 3;
  if (tid < BM)
    rowsrc[tid] = tid < rn ? (GATHER ? reinterpret_cast<const int*>(a.pair_token)[r0 + tid] : r0 + tid) : -1;
  __syncthreads();

  const float* asrc = reinterpret_cast<const float*>(GATHER ? a.x : a.act);
  const i64 astride = GATHER ? a.x_stride : i64(KDIM);
  const unsigned char* wbase[NMAT];
#if MMA_WM == 0
  const unsigned char* sbase[NMAT];
  const unsigned char* bbase[NMAT];
#endif
#pragma unroll
  for (int m = 0; m < NMAT; ++m) {
    wbase[m] = reinterpret_cast<const unsigned char*>(a.data[mat0 + m]) + i64(e) * i64(a.data_stride[mat0 + m]);
#if MMA_WM == 0
    sbase[m] = reinterpret_cast<const unsigned char*>(a.scales[mat0 + m]) + i64(e) * i64(a.scale_stride[mat0 + m]);
    bbase[m] = reinterpret_cast<const unsigned char*>(a.biases[mat0 + m]) + i64(e) * i64(a.bias_stride[mat0 + m]);
#endif
  }

  // Register staging of one K block (issued before the previous block's MMAs).
  float4 ra[A_PER];
  uint4 rb[B_PER];
#if MMA_WM == 0
  float rs[S_PER], rz[S_PER];
#endif
  auto load = [&](int kt) {
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      const int c = tid + MMA_NT * i, row = c / (BK / 4), k = kt * BK + (c % (BK / 4)) * 4;
      ra[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (c < A_CH && k < KDIM) {  // KDIM % 4 == 0
        const int src = rowsrc[row];
        if (src >= 0) {
#if ALIGNED
          ra[i] = *reinterpret_cast<const float4*>(asrc + i64(src) * astride + k);
#else
          const float* p = asrc + i64(src) * astride + k;
          ra[i] = make_float4(p[0], p[1], p[2], p[3]);
#endif
        }
      }
    }
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
      const int c = tid + MMA_NT * i, row = c / (BK / CPV), k = kt * BK + (c % (BK / CPV)) * CPV;
      const int m = row / BN, n = n0 + row % BN;
      rb[i] = make_uint4(0, 0, 0, 0);
      if (c < B_CH && n < NDIM && k < KDIM) {  // KDIM % CPV == 0
        // NMAT ≤ 2: select, not index (a dynamic index would put the pointer arrays in local memory)
        const bool m1 = NMAT > 1 && m > 0;
        rb[i] = moe_ld16((m1 ? wbase[NMAT - 1] : wbase[0]) + i64(n) * ROW_BYTES(KDIM) + VEC_BYTES_AT(k));
      }
    }
#if MMA_WM == 0
#pragma unroll
    for (int i = 0; i < S_PER; ++i) {
      const int idx = tid + MMA_NT * i, row = idx / NP, p = idx % NP;
      const int m = row / BN, n = n0 + row % BN, k0 = kt * BK + p * GP;
      rs[i] = 0.f;
      rz[i] = 0.f;
      if (idx < S_CH && n < NDIM && k0 < KDIM) {
        const bool m1 = NMAT > 1 && m > 0;
        const i64 gi = i64(n) * (KDIM / GROUP) + k0 / GROUP;
        rs[i] = moe_scalar(m1 ? sbase[NMAT - 1] : sbase[0], gi);
        rz[i] = moe_scalar(m1 ? bbase[NMAT - 1] : bbase[0], gi);
      }
    }
#endif
  };
#if PIPE
  // Ring stage: A rows [BM][BK] f32, then the codes [BROWS][BK·BITS/8], then S_CH scale words and S_CH bias words.
  constexpr int ST_A = BM * BK * 4, ST_B = BROWS * BK * BITS / 8, ST_S = S_CH * 4;
  constexpr int STAGE = ST_A + ST_B + 2 * ST_S;
  static_assert(BROWS == 128, "moe.cpp pipe_stage_bytes stages 128 weight rows");
  static_assert(ST_A % 16 == 0 && ST_B % 16 == 0 && ST_S % 16 == 0, "16-byte stage parts");
  const u32 ring = smem_addr(moe_ring);
  // The scale / bias element gi of matrix m lies in the 4-byte word at its address rounded down (the host checks
  // that the per-expert bases are 4-byte aligned, so a 2-byte element's half is gi's parity).
  auto issue = [&](int kt) {
    if (kt < KT) {
      const u32 st = ring + u32((kt % PIPE) * STAGE);
#pragma unroll
      for (int i = 0; i < A_PER; ++i) {
        const int c = tid + MMA_NT * i, row = c / (BK / 4), k = kt * BK + (c % (BK / 4)) * 4;
        if (c < A_CH) {
          const int src = rowsrc[row];
          const bool ok = src >= 0 && k < KDIM;
          cp_async16(st + u32(c * 16), ok ? asrc + i64(src) * astride + k : asrc, ok ? 16 : 0);
        }
      }
#pragma unroll
      for (int i = 0; i < B_PER; ++i) {
        const int c = tid + MMA_NT * i, row = c / (BK / CPV), k = kt * BK + (c % (BK / CPV)) * CPV;
        const int m = row / BN, n = n0 + row % BN;
        if (c < B_CH) {
          const bool ok = n < NDIM && k < KDIM;
          const unsigned char* wb = NMAT > 1 && m > 0 ? wbase[NMAT - 1] : wbase[0];
          cp_async16(st + u32(ST_A + c * 16), ok ? wb + i64(n) * ROW_BYTES(KDIM) + VEC_BYTES_AT(k) : wb, ok ? 16 : 0);
        }
      }
#pragma unroll
      for (int i = 0; i < S_PER; ++i) {
        const int idx = tid + MMA_NT * i, row = idx / NP, p = idx % NP;
        const int m = row / BN, n = n0 + row % BN, k0 = kt * BK + p * GP;
        if (idx < S_CH) {
          const bool ok = n < NDIM && k0 < KDIM, m1 = NMAT > 1 && m > 0;
          const i64 gi = ok ? i64(n) * (KDIM / GROUP) + k0 / GROUP : 0;
          const i64 off = (gi * ESIZE_SCALE) & ~i64(3);
          cp_async4(st + u32(ST_A + ST_B + idx * 4), (m1 ? sbase[NMAT - 1] : sbase[0]) + off, ok ? 4 : 0);
          cp_async4(st + u32(ST_A + ST_B + ST_S + idx * 4), (m1 ? bbase[NMAT - 1] : bbase[0]) + off, ok ? 4 : 0);
        }
      }
    }
    cp_async_commit();  // every thread, every call: the wait below counts groups
  };
  // Stage kt -> the registers the register path's load() fills (zeros where the copy zero-filled).
  auto fetch = [&](int kt) {
    const unsigned char* st = moe_ring + (kt % PIPE) * STAGE;
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      const int c = tid + MMA_NT * i;
      ra[i] = c < A_CH ? *reinterpret_cast<const float4*>(st + c * 16) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
      const int c = tid + MMA_NT * i;
      rb[i] = c < B_CH ? *reinterpret_cast<const uint4*>(st + ST_A + c * 16) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < S_PER; ++i) {
      const int idx = tid + MMA_NT * i, row = idx / NP, p = idx % NP;
      const int n = n0 + row % BN, k0 = kt * BK + p * GP;
      rs[i] = rz[i] = 0.f;
      if (idx < S_CH) {  // zero-filled words give 0 whichever half is taken
        const i64 gi = i64(n) * (KDIM / GROUP) + k0 / GROUP;
        rs[i] = word_scalar<SDT>(*reinterpret_cast<const u32*>(st + ST_A + ST_B + idx * 4), gi);
        rz[i] = word_scalar<SDT>(*reinterpret_cast<const u32*>(st + ST_A + ST_B + ST_S + idx * 4), gi);
      }
    }
  };
#endif
  auto store = [&]() {
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      const int c = tid + MMA_NT * i, row = c / (BK / 4), col = (c % (BK / 4)) * 4;
      u32 h0, l0, h1, l1;
      float inv;
#if MMA_WM == 0
      moe_a_chunk<LP>(ra[i], h0, h1, l0, l1, inv);
#else
      moe_a_chunk<1>(ra[i], h0, h1, l0, l1, inv);
#endif
      if (c < A_CH) {
        *reinterpret_cast<uint2*>(&Ah[row * PITCH + col]) = make_uint2(h0, h1);
        if (XS == 2) *reinterpret_cast<uint2*>(&Al[row * PITCH + col]) = make_uint2(l0, l1);
      }
#if MMA_WM == 0
      // Σx over each group part of the row: LP neighbouring lanes (a row's BK/4 chunks are consecutive
      // threads), a fixed xor tree. Every lane takes part (the loop bounds are uniform).
      float ps = (ra[i].x + ra[i].y) + (ra[i].z + ra[i].w);
#pragma unroll
      for (int o = LP / 2; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
      const int q = c % (BK / 4);
      if (c < A_CH && q % LP == 0) {
        sxs[row * NP + q / LP] = ps;
        if (XF) sxr[row * NP + q / LP] = inv;
      }
#else
      (void)inv;
#endif
    }
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
      const int c = tid + MMA_NT * i, row = c / (BK / CPV), col = (c % (BK / CPV)) * CPV;
      if (c >= B_CH) continue;
      const u32 wd[4] = {rb[i].x, rb[i].y, rb[i].z, rb[i].w};
      uint4* dh = reinterpret_cast<uint4*>(&Bh[row * PITCH + col]);
#if MMA_WM == 0 && BITS == 4
      u32 q[16];
#pragma unroll
      for (int w = 0; w < 4; ++w) q4_word_pairs<XF != 0>(wd[w], q + 4 * w);  // exact
#pragma unroll
      for (int v = 0; v < 4; ++v) dh[v] = make_uint4(q[4 * v], q[4 * v + 1], q[4 * v + 2], q[4 * v + 3]);
#elif MMA_WM == 0
      u32 q[8];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        q[2 * w] = half2_rn<XF != 0>(q_code<8>(wd[w], 0), q_code<8>(wd[w], 1));  // exact: q ≤ 255
        q[2 * w + 1] = half2_rn<XF != 0>(q_code<8>(wd[w], 2), q_code<8>(wd[w], 3));
      }
      dh[0] = make_uint4(q[0], q[1], q[2], q[3]);
      dh[1] = make_uint4(q[4], q[5], q[6], q[7]);
#elif MMA_WM == 1
      dh[0] = rb[i];
#else
      uint4* dl = reinterpret_cast<uint4*>(&Bl[row * PITCH + col]);
#if WDT == LILY_F32
      u32 h[2], l[2];
      split2_bf16(__uint_as_float(wd[0]), __uint_as_float(wd[1]), h[0], l[0]);
      split2_bf16(__uint_as_float(wd[2]), __uint_as_float(wd[3]), h[1], l[1]);
      *reinterpret_cast<uint2*>(dh) = make_uint2(h[0], h[1]);
      *reinterpret_cast<uint2*>(dl) = make_uint2(l[0], l[1]);
#else
      u32 h[4], l[4];
#pragma unroll
      for (int w = 0; w < 4; ++w)
        split2_bf16(dense_elem<LILY_F16>(wd, 2 * w), dense_elem<LILY_F16>(wd, 2 * w + 1), h[w], l[w]);
      dh[0] = make_uint4(h[0], h[1], h[2], h[3]);
      dl[0] = make_uint4(l[0], l[1], l[2], l[3]);
#endif
#endif
    }
#if MMA_WM == 0
#pragma unroll
    for (int i = 0; i < S_PER; ++i) {
      const int idx = tid + MMA_NT * i;
      if (idx < S_CH) {
        ss[idx] = rs[i];
        bs[idx] = rz[i];
      }
    }
#endif
  };

  float acc[NMAT][MT][NT][4];
#if MMA_WM == 0
  float accg[NMAT][MT][NT][4];  // Σ x·q of the current group
#endif
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[m][i][j][q] = 0.f;
#if MMA_WM == 0
          accg[m][i][j][q] = 0.f;
#endif
        }

  const u32* Ah32 = reinterpret_cast<const u32*>(Ah);
  const u32* Al32 = reinterpret_cast<const u32*>(Al);
  const u32* Bh32 = reinterpret_cast<const u32*>(Bh);
#if MMA_WM == 2
  const u32* Bl32 = reinterpret_cast<const u32*>(Bl);
#endif
#if PIPE
  // Blocks 0 .. PIPE-2 in flight; at step kt, block kt + PIPE - 1 goes into the slot block kt - 1 left (every
  // thread converted it before the barrier that also ends block kt - 1's MMAs).
#pragma unroll
  for (int s = 0; s + 1 < PIPE; ++s) issue(s);
#else
  load(0);
#endif
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
#if PIPE
    cp_async_wait<PIPE - 2>();  // this thread's copies of block kt have landed
    __syncthreads();            // everyone's have; block kt - 1's MMAs are done with the tiles
    fetch(kt);
    store();
    issue(kt + PIPE - 1);
    __syncthreads();
#else
    store();
    __syncthreads();
    if (kt + 1 < KT) load(kt + 1);  // in flight during this step's MMAs
#endif
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const int k = kt * BK + kk * 16;
      if (k >= KDIM) break;  // uniform; the K tail of a block holds zeros
      u32 ah[MT][4], al[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int rb0 = wm * WTM + i * 16 + g, w0 = kk * 8 + t4;  // words: (row, col) -> row·PITCH/2 + col/2
        ah[i][0] = Ah32[rb0 * (PITCH / 2) + w0];
        ah[i][1] = Ah32[(rb0 + 8) * (PITCH / 2) + w0];
        ah[i][2] = Ah32[rb0 * (PITCH / 2) + w0 + 4];
        ah[i][3] = Ah32[(rb0 + 8) * (PITCH / 2) + w0 + 4];
        if (XS == 2) {
          al[i][0] = Al32[rb0 * (PITCH / 2) + w0];
          al[i][1] = Al32[(rb0 + 8) * (PITCH / 2) + w0];
          al[i][2] = Al32[rb0 * (PITCH / 2) + w0 + 4];
          al[i][3] = Al32[(rb0 + 8) * (PITCH / 2) + w0 + 4];
        }
      }
#pragma unroll
      for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int nr = m * BN + wn * WTN + j * 8 + g, w0 = kk * 8 + t4;
          const u32 bh[2] = {Bh32[nr * (PITCH / 2) + w0], Bh32[nr * (PITCH / 2) + w0 + 4]};
#if MMA_WM == 2
          const u32 bl[2] = {Bl32[nr * (PITCH / 2) + w0], Bl32[nr * (PITCH / 2) + w0 + 4]};
#endif
#pragma unroll
          for (int i = 0; i < MT; ++i) {
#if MMA_WM == 0
            float* c = accg[m][i][j];
#else
            float* c = acc[m][i][j];
#endif
            mma_m16n8k16<XF != 0>(c, ah[i], bh[0], bh[1]);
            if (XS == 2) mma_m16n8k16(c, al[i], bh[0], bh[1]);
#if MMA_WM == 2
            mma_m16n8k16(c, ah[i], bl[0], bl[1]);
#endif
          }
        }
#if MMA_WM == 0
      const int p = (kk * 16) / GP;
      const bool part_end = (kk * 16 + 16) % GP == 0;  // compile time
      const bool group_end = XF ? part_end : (k + 16) % GROUP == 0;  // XF: each part has its own x scale
      if (group_end || part_end) {
#pragma unroll
        for (int m = 0; m < NMAT; ++m)
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                const int col = m * BN + wn * WTN + j * 8 + 2 * t4 + (q & 1);
                const int row = wm * WTM + i * 16 + g + 8 * (q >> 1);
                if (group_end) {
                  const float s = XF ? ss[col * NP + p] * sxr[row * NP + p] : ss[col * NP + p];
                  acc[m][i][j][q] = fmaf(s, accg[m][i][j][q], acc[m][i][j][q]);
                  accg[m][i][j][q] = 0.f;
                }
                if (part_end) acc[m][i][j][q] = fmaf(bs[col * NP + p], sxs[row * NP + p], acc[m][i][j][q]);
              }
      }
#endif
    }
#if !PIPE
    __syncthreads();
#endif
  }

  // Epilogue: c0,c1 at (row g, cols 2·t4, 2·t4+1), c2,c3 at row g + 8.
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int hrow = 0; hrow < 2; ++hrow) {
        const int row = wm * WTM + i * 16 + g + 8 * hrow, n = n0 + wn * WTN + j * 8 + 2 * t4;
        if (row >= rn || n >= NDIM) continue;  // NDIM is even (a multiple of CPV)
        moe_store_pair<NMAT>(a, i64(r0 + row), n, &acc[0][i][j][2 * hrow], &acc[NMAT - 1][i][j][2 * hrow]);
      }
}

#ifndef MMA_MINB
#define MMA_MINB 2  // blocks per SM the GEMMs' registers must allow (the host asks 3 for moe_frag_block's 3 stages)
#endif
#if FRAG
// ---------------------------------------------------------------------------------------------
// FRAG = S (the host's moe_frag; 4-bit affine experts, 16-byte loads, 16 or 32-row tiles): the weights never become a
// bf16 tile in shared memory. Each warp owns its own columns (every B element has one consumer warp), so the lanes
// widen their codes straight into B fragments in registers. The 16-row tiles were bound by shared-memory traffic (ncu
// at T = 512: L1/TEX 88%): per K block a 128-row block stored 16 KB of bf16 weights, read them back, and every warp
// read the whole A tile for 2 n8 tiles. Here a block stages its weight rows as raw codes (pitch 48 bytes:
// conflict-free 16-byte reads), each warp reads its rows' 32-byte K blocks and the A tile once (ldmatrix). BM = 16:
// a block covers 256 weight rows, 4 n8 tiles per warp. BM = 32 (FMT = 2 m16 tiles): 128 weight rows, 2 n8 tiles per
// warp, and each widened B fragment feeds both m16 tiles, so an expert with 17-32 rows has its weights read and
// widened once instead of by two 16-row tiles; a tile of at most 16 rows skips its second m16 tile's MMAs (uniform
// over the block). The raw K blocks (gathered x rows f32, codes, scale and bias words) come by cp.async through a
// ring of S stages (S - 2 blocks in flight during a block's MMAs); the A tile is double buffered, so a K block costs
// one barrier. Same MMA operands (the codes, x hi / lo), same order per output (k16 steps, hi then lo, the group
// folds), same Σx tree: the bits of moe_mma_block at any BM.
#if !(MMA_WM == 0 && BITS == 4 && ALIGNED && (BM == 16 || BM == 32 || BM == 64))
#error "FRAG needs 4-bit affine weights with 16-byte loads and 16, 32 or 64-row tiles"
#endif
#if FRAG < 3 || PIPE
#error "FRAG: at least 3 ring stages, and not with PIPE"
#endif
#define FMT (BM / 16)  // m16 tiles per warp
// Weight rows per block: 256 / FMT at 16 and 32 rows; 128 at 64 rows (the host's moe_frag64_rows: each widened B
// fragment feeds 4 m16 tiles, so an expert with 33-64 rows has its codes read and widened once, not by two 32-row
// tiles; a warp still owns whole n8 tiles of gate and of up).
#define FRAG_ROWS (FMT == 4 ? 128 : 256 / FMT)
// MWF16 (the host's moe_w_f16, with XF): each lane turns its widened code pairs into f16 weights, s·q + b by one f16x2
// FMA with its column's group scale and bias, so a part's fold is acc += 2^-e·D: no scale per output, no b·Σx, no Σx.
// The weights are rounded to f16 (≤ 2^-11 relative): not the codes path's bits.
#ifndef MWF16
#define MWF16 0
#endif
#if MWF16 && !XF
#error "MWF16 needs x as one f16 term (XF)"
#endif
// MXROW (the host's moe_x_rows, with MWF16): both GEMMs take their activations as f16 rows scaled by one 2^e per row
// (quant.cuh f16_scaled_row, matmul_x_rows' rule), written into the workspace's xh / xinv by a pre-pass: moe_x_rows
// (x, before gate/up), then moe_act_rows (the sorted act rows, before down; gate/up's rows are dead by then, so both
// use one region). The ring copies the (gathered) f16 rows straight into the A tile's layout, the MMAs accumulate
// into the outputs without a per-part fold (no group accumulator, no conversion), and the epilogue multiplies each
// row by its 2^-e. Not MWF16's bits alone (another x scale).
#ifndef MXROW
#define MXROW 0
#endif
#if MXROW && !MWF16
#error "MXROW needs the f16 expert weights (MWF16)"
#endif

// One block: BM sorted rows of one expert × FBN columns of each of NMAT matrices (NMAT · FBN = 256 / FMT weight
// rows); warp w owns columns [w·WC, (w+1)·WC) of every matrix, NTM n8 tiles each, for all FMT m16 tiles.
template <int NMAT, int FBN, int KDIM, int NDIM, bool GATHER>
__device__ __forceinline__ void moe_frag_block(const MoeArgs& a, int mat0) {
  constexpr bool XR = MXROW;  // x / act as pre-scaled f16 rows: the ring stage holds the A tile itself
  constexpr int BK = 64, PITCH = BK + 8;  // A tile: halves per row (144 bytes: ldmatrix rows conflict-free)
  constexpr int BROWS = NMAT * FBN, WC = FBN / 8, NTM = WC / 8, NTW = NMAT * NTM;
  static_assert(BROWS == FRAG_ROWS && NTM >= 1, "moe.cpp frag_stage_bytes stages FRAG_ROWS weight rows");
  constexpr int GP = (GROUP % BK == 0 || BK % GROUP == 0) ? (GROUP < BK ? GROUP : BK) : 16;
  constexpr int NP = BK / GP, LP = GP / 4, KT = (KDIM + BK - 1) / BK;
  constexpr int CPITCH = 48;  // bytes per weight row of a stage: its 32 bytes of codes, 16 of padding
  constexpr int ST_X = XR ? BM * PITCH * 2 : BM * BK * 4, ST_C = BROWS * CPITCH, ST_S = BROWS * NP * 4;
  constexpr int STAGE = ST_X + ST_C + 2 * ST_S;
  static_assert(ST_X % 16 == 0 && ST_C % 16 == 0 && ST_S % 16 == 0, "16-byte stage parts");
  static_assert((BM * BK / 4) % MMA_NT == 0 && (BROWS * 2) % MMA_NT == 0, "whole 16-byte chunks per thread");
  __shared__ __align__(16) u16 Ah[XR ? 1 : 2][XR ? 8 : BM * PITCH];
  __shared__ __align__(16) u16 Al[2][XS == 2 ? BM * PITCH : 8];
  __shared__ float sxs[XR ? 1 : 2][XR ? 1 : BM * NP];
  __shared__ float sxr[XR ? 1 : 2][XF && !XR ? BM * NP : 1];  // XF: 2^-e of each row's group part
  __shared__ int rowsrc[BM];
  __shared__ float rowinv[XR ? BM : 1];  // XR: each tile row's 2^-e

  const int* tiles = reinterpret_cast<const int*>(a.tiles);
  const int tile = blockIdx.x;
  if (tile >= tiles[0]) return;  // uniform over the block
  const int e = tiles[1 + 3 * tile], r0 = tiles[2 + 3 * tile], rn = tiles[3 + 3 * tile];
  // m16 tile mt holds no rows (uniform over the block): its MMAs are skipped. Tile 0 always holds some.
  const int mlive = (rn + 15) / 16;
  auto m16_idle = [&](int mt) { return mt > 0 && mt >= mlive; };
  const int n0 = blockIdx.y * FBN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  if (tid < BM) {
    rowsrc[tid] = tid < rn ? (GATHER ? reinterpret_cast<const int*>(a.pair_token)[r0 + tid] : r0 + tid) : -1;
    if (XR) rowinv[tid] = tid < rn ? reinterpret_cast<const float*>(a.xinv)[rowsrc[tid]] : 0.f;
  }
  __syncthreads();

  const float* asrc = reinterpret_cast<const float*>(GATHER ? a.x : a.act);
  const i64 astride = GATHER ? a.x_stride : i64(KDIM);
  const unsigned char* wbase[NMAT];
  const unsigned char* sbase[NMAT];
  const unsigned char* bbase[NMAT];
#pragma unroll
  for (int m = 0; m < NMAT; ++m) {
    wbase[m] = reinterpret_cast<const unsigned char*>(a.data[mat0 + m]) + i64(e) * i64(a.data_stride[mat0 + m]);
    sbase[m] = reinterpret_cast<const unsigned char*>(a.scales[mat0 + m]) + i64(e) * i64(a.scale_stride[mat0 + m]);
    bbase[m] = reinterpret_cast<const unsigned char*>(a.biases[mat0 + m]) + i64(e) * i64(a.bias_stride[mat0 + m]);
  }

  const u32 ring = smem_addr(moe_ring);
  // Stage kt: x rows [BM][BK] f32 (16-byte chunks), codes [BROWS][CPITCH] (two chunks per row), then the scale words
  // and the bias words of the rows' group parts (moe_mma_block's PIPE copies them so too).
  auto issue = [&](int kt) {
    if (kt < KT) {
      const u32 st = ring + u32((kt % FRAG) * STAGE);
      if constexpr (XR) {  // 8 chunks of 8 halves per row, into the A tile's pitch; rows are zero-padded to KT·BK
        const u16* xh = reinterpret_cast<const u16*>(a.xh);
        for (int c = tid; c < BM * (BK / 8); c += MMA_NT) {
          const int row = c / (BK / 8), kc = c % (BK / 8), src = rowsrc[row];
          cp_async16(st + u32((row * PITCH + kc * 8) * 2), src >= 0 ? xh + i64(src) * (KT * BK) + kt * BK + kc * 8 : xh,
                     src >= 0 ? 16 : 0);
        }
      } else {
#pragma unroll
        for (int i = 0; i < BM * BK / 4 / MMA_NT; ++i) {
          const int c = tid + MMA_NT * i, row = c / (BK / 4), k = kt * BK + (c % (BK / 4)) * 4, src = rowsrc[row];
          const bool ok = src >= 0 && k < KDIM;
          cp_async16(st + u32(c * 16), ok ? asrc + i64(src) * astride + k : asrc, ok ? 16 : 0);
        }
      }
#pragma unroll
      for (int i = 0; i < BROWS * 2 / MMA_NT; ++i) {
        const int c = tid + MMA_NT * i, row = c >> 1, half = c & 1;
        const int m = row / FBN, n = n0 + row % FBN, k = kt * BK + half * 32;
        const bool ok = n < NDIM && k < KDIM;  // KDIM % 32 == 0 (a group is whole 16-byte vectors)
        const unsigned char* wb = NMAT > 1 && m > 0 ? wbase[NMAT - 1] : wbase[0];
        cp_async16(st + u32(ST_X + row * CPITCH + half * 16), ok ? wb + i64(n) * ROW_BYTES(KDIM) + VEC_BYTES_AT(k) : wb,
                   ok ? 16 : 0);
      }
#pragma unroll
      for (int i = 0; i < (BROWS * NP + MMA_NT - 1) / MMA_NT; ++i) {
        const int idx = tid + MMA_NT * i, row = idx / NP, p = idx % NP;
        if (idx < BROWS * NP) {
          const int m = row / FBN, n = n0 + row % FBN, k0 = kt * BK + p * GP;
          const bool ok = n < NDIM && k0 < KDIM, m1 = NMAT > 1 && m > 0;
          const i64 gi = ok ? i64(n) * (KDIM / GROUP) + k0 / GROUP : 0;
          const i64 off = (gi * ESIZE_SCALE) & ~i64(3);
          cp_async4(st + u32(ST_X + ST_C + idx * 4), (m1 ? sbase[NMAT - 1] : sbase[0]) + off, ok ? 4 : 0);
          cp_async4(st + u32(ST_X + ST_C + ST_S + idx * 4), (m1 ? bbase[NMAT - 1] : bbase[0]) + off, ok ? 4 : 0);
        }
      }
    }
    cp_async_commit();  // every thread, every call: the waits count groups
  };
  // Stage kt's x rows -> A tile (kt & 1) as bf16 hi (+ lo), and Σx per group part: moe_mma_block's store() (the same
  // thread per chunk, the same xor tree).
  auto convert = [&](int kt) {
    if constexpr (XR) return;
    const int b = kt & 1;
#pragma unroll
    for (int i = 0; i < BM * BK / 4 / MMA_NT; ++i) {
      const int c = tid + MMA_NT * i, row = c / (BK / 4), col = (c % (BK / 4)) * 4;
      const float4 v = *reinterpret_cast<const float4*>(moe_ring + (kt % FRAG) * STAGE + c * 16);
      u32 h0, l0, h1, l1;
      float inv;
      moe_a_chunk<LP>(v, h0, h1, l0, l1, inv);
      *reinterpret_cast<uint2*>(&Ah[b][row * PITCH + col]) = make_uint2(h0, h1);
      if (XS == 2) *reinterpret_cast<uint2*>(&Al[b][row * PITCH + col]) = make_uint2(l0, l1);
      float ps = (v.x + v.y) + (v.z + v.w);
#pragma unroll
      for (int o = LP / 2; o > 0; o >>= 1) ps += MWF16 ? 0.f : __shfl_xor_sync(0xffffffffu, ps, o);  // MWF16: no Σx
      const int q = c % (BK / 4);
      if (q % LP == 0) {
        if (!MWF16) sxs[b][row * NP + q / LP] = ps;
        if (XF) sxr[b][row * NP + q / LP] = inv;
      }
    }
  };

  float acc[FMT][NTW][4], accg[FMT][NTW][4];
#pragma unroll
  for (int mt = 0; mt < FMT; ++mt)
#pragma unroll
    for (int j = 0; j < NTW; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mt][j][q] = accg[mt][j][q] = 0.f;
  // n8 tile j of this warp: matrix j / NTM, columns w·WC + 8·(j % NTM) .. + 7 of it; its stage row for lane group g.
  auto tile_row = [&](int j) { return (j / NTM) * FBN + warp * WC + 8 * (j % NTM); };
  const u32 sel = u32(t4) | u32(4 + t4) << 8;
  u32 ws2[NTW], wb2[NTW];  // MWF16: this lane's column's group scale and bias of the current part, as f16 pairs
  // The A fragment of a k16 step by ldmatrix (common.cuh): matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
  // (8-15, 8-15), so lane l gives row (l & 15) at k offset 8·(l >> 4) of the step; m16 tile mt 16 rows further.
  const u32 a_lane = u32(((lane & 15) * PITCH + 8 * (lane >> 4)) * 2);
  const u32 ah0 = smem_addr(&Ah[0][0]) + a_lane, al0 = smem_addr(&Al[0][0]) + a_lane;
  const u32 ring_a = ring + a_lane;  // XR: the A tile of stage s at ring_a + s·STAGE
  constexpr u32 AH_BYTES = sizeof(Ah[0]), AL_BYTES = sizeof(Al[0]);  // one buffer (a selector, not an array index)
  constexpr u32 M16_BYTES = 16 * PITCH * 2;

#pragma unroll
  for (int s = 0; s + 1 < FRAG; ++s) issue(s);
  cp_async_wait<FRAG - 2>();
  __syncthreads();
  convert(0);
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<FRAG - 3>();  // this thread's copies of block kt + 1 have landed
    __syncthreads();            // everyone's have; A tile kt & 1 is written; block kt - 1's reads are done
    issue(kt + FRAG - 1);       // into the slot block kt - 1 left
    if (kt + 1 < KT) convert(kt + 1);
    const unsigned char* st = moe_ring + (kt % FRAG) * STAGE;
    const int b = kt & 1;
    uint4 cw[NTW][2];  // the 32 bytes of codes of this lane's row of each n8 tile: words 2·kk, 2·kk + 1 per k16 step
#pragma unroll
    for (int j = 0; j < NTW; ++j) {
      const uint4* src = reinterpret_cast<const uint4*>(st + ST_X + (tile_row(j) + g) * CPITCH);
      cw[j][0] = src[0];
      cw[j][1] = src[1];
    }
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const int k = kt * BK + kk * 16;
      if (k >= KDIM) break;  // uniform; the K tail of a block holds zeros
      u32 ah[FMT][4], al[FMT][4];
#pragma unroll
      for (int mt = 0; mt < FMT; ++mt) {
        if (m16_idle(mt)) break;
        ldsm_x4(ah[mt], (XR ? ring_a + u32((kt % FRAG) * STAGE) : ah0 + b * AH_BYTES) + mt * M16_BYTES + kk * 32);
        if (XS == 2) ldsm_x4(al[mt], al0 + b * AL_BYTES + mt * M16_BYTES + kk * 32);
      }
      if (MWF16 && (kk * 16) % GP == 0) {  // a part starts: this lane's column's group scale and bias, as f16 pairs
        const u32* sw = reinterpret_cast<const u32*>(st + ST_X + ST_C);
        const u32* bw = reinterpret_cast<const u32*>(st + ST_X + ST_C + ST_S);
        const int p = (kk * 16) / GP, k0 = kt * BK + p * GP;
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          const int col = tile_row(j) + g;
          const i64 gi = i64(n0 + col % FBN) * (KDIM / GROUP) + k0 / GROUP;
          const float sg = word_scalar<SDT>(sw[col * NP + p], gi), bg = word_scalar<SDT>(bw[col * NP + p], gi);
          ws2[j] = f16x2_rn(sg, sg);
          wb2[j] = f16x2_rn(bg, bg);
        }
      }
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        const uint4 c = cw[j][kk >> 1];
        const u32 w0 = (kk & 1) ? c.z : c.x, w1 = (kk & 1) ? c.w : c.y;
        u32 bq[2] = {q4_byte_pair<XF != 0>(w0, sel), q4_byte_pair<XF != 0>(w1, sel)};
        if (MWF16) {  // f16(s·q + b): lane g's pairs all belong to column tile_row(j) + g
#pragma unroll
          for (int h = 0; h < 2; ++h)
            asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(bq[h]) : "r"(bq[h]), "r"(ws2[j]), "r"(wb2[j]));
        }
#pragma unroll
        for (int mt = 0; mt < FMT; ++mt) {
          if (m16_idle(mt)) break;
          mma_m16n8k16<XF != 0>(XR ? acc[mt][j] : accg[mt][j], ah[mt], bq[0], bq[1]);
          if (XS == 2) mma_m16n8k16(accg[mt][j], al[mt], bq[0], bq[1]);
        }
      }
      const int p = (kk * 16) / GP;
      const bool part_end = (kk * 16 + 16) % GP == 0;  // compile time
      const bool group_end = XF ? part_end : (k + 16) % GROUP == 0;  // XF: each part has its own x scale
      if (!XR && (group_end || part_end)) {  // XR: no fold, each row's 2^-e at the end
        const u32* sw = reinterpret_cast<const u32*>(st + ST_X + ST_C);
        const u32* bw = reinterpret_cast<const u32*>(st + ST_X + ST_C + ST_S);
        const int k0 = kt * BK + p * GP;
#pragma unroll
        for (int j = 0; j < NTW; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int col = tile_row(j) + 2 * t4 + (q & 1);
            const i64 gi = i64(n0 + col % FBN) * (KDIM / GROUP) + k0 / GROUP;  // the word's half (2-byte scales)
            const float sg = group_end && !MWF16 ? word_scalar<SDT>(sw[col * NP + p], gi) : 0.f;
            const float bg = part_end && !MWF16 ? word_scalar<SDT>(bw[col * NP + p], gi) : 0.f;
#pragma unroll
            for (int mt = 0; mt < FMT; ++mt) {
              if (m16_idle(mt)) break;
              const int row = mt * 16 + g + 8 * (q >> 1);
              if (group_end) {
                const float f = MWF16 ? sxr[b][row * NP + p] : XF ? sg * sxr[b][row * NP + p] : sg;
                acc[mt][j][q] = fmaf(f, accg[mt][j][q], acc[mt][j][q]);
                accg[mt][j][q] = 0.f;
              }
              if (part_end && !MWF16) acc[mt][j][q] = fmaf(bg, sxs[b][row * NP + p], acc[mt][j][q]);
            }
          }
      }
    }
  }
  cp_async_wait<0>();  // no copy may still target this block's shared memory when it exits

  // Epilogue: c0,c1 at (row g, cols 2·t4, 2·t4+1), c2,c3 at row g + 8, of each m16 tile.
#pragma unroll
  for (int mt = 0; mt < FMT; ++mt)
#pragma unroll
    for (int jj = 0; jj < NTM; ++jj)
#pragma unroll
      for (int hrow = 0; hrow < 2; ++hrow) {
        const int row = mt * 16 + g + 8 * hrow, n = n0 + warp * WC + 8 * jj + 2 * t4;
        if (row >= rn || n >= NDIM) continue;  // NDIM is even (a multiple of CPV)
        if (XR)
#pragma unroll
          for (int m = 0; m < NMAT; ++m)
#pragma unroll
            for (int q = 0; q < 2; ++q) acc[mt][m * NTM + jj][2 * hrow + q] *= rowinv[row];
        moe_store_pair<NMAT>(a, i64(r0 + row), n, &acc[mt][jj][2 * hrow], &acc[mt][(NMAT - 1) * NTM + jj][2 * hrow]);
      }
}
#endif  // FRAG

extern "C" __global__ void __launch_bounds__(MMA_NT, MMA_MINB) moe_gate_up_mma(const MoeArgs a) {
  LILY_PDL_PROLOGUE();
#if FRAG
  moe_frag_block<2, FRAG_ROWS / 2, HID, INTER, true>(a, 0);
#else
  moe_mma_block<2, 64, HID, INTER, true>(a, 0);
#endif
}

extern "C" __global__ void __launch_bounds__(MMA_NT, MMA_MINB) moe_down_mma(const MoeArgs a) {
  LILY_PDL_PROLOGUE();
#if FRAG
  moe_frag_block<1, FRAG_ROWS, INTER, HID, false>(a, 2);
#else
  moe_mma_block<1, 128, INTER, HID, false>(a, 2);
#endif
}

#if MXROW
// MXROW: x row t (moe_x_rows, for gate/up; grid T, block 256) or sorted act row r (moe_act_rows, for down; grid T·k,
// block 128) as f16 scaled by 2^e (quant.cuh f16_scaled_row, zero-padded to whole K blocks) and its 2^-e.
// Floors: T·H·(4 + 2) and T·k·I·(4 + 2) bytes.
extern "C" __global__ void __launch_bounds__(256) moe_x_rows(const MoeArgs a) {
  LILY_PDL_PROLOGUE();
  constexpr int HP = (HID + 63) / 64 * 64;
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  f16_scaled_row(reinterpret_cast<const float*>(a.x) + i64(t) * a.x_stride, HID, HP,
                 reinterpret_cast<u32*>(a.xh) + i64(t) * (HP / 2), reinterpret_cast<float*>(a.xinv) + t, scratch);
}
extern "C" __global__ void __launch_bounds__(128) moe_act_rows(const MoeArgs a) {
  LILY_PDL_PROLOGUE();
  constexpr int IP = (INTER + 63) / 64 * 64;
  __shared__ float scratch[32];
  const int r = blockIdx.x;
  f16_scaled_row(reinterpret_cast<const float*>(a.act) + i64(r) * INTER, INTER, IP,
                 reinterpret_cast<u32*>(a.xh) + i64(r) * (IP / 2), reinterpret_cast<float*>(a.xinv) + r, scratch);
}
#endif

// ---------------------------------------------------------------------------------------------
// Prefill 4: out[t] = Σ_s w[t,s] · y[pair_pos[t,s]] in (expert id, slot) order.

extern "C" __global__ void __launch_bounds__(256) moe_expert_sum(const MoeArgs a) {
  LILY_PDL_PROLOGUE();
  __shared__ int pos[TOPK], ord[TOPK], eid[TOPK];
  __shared__ float ew[TOPK];
  const int t = blockIdx.x, tid = threadIdx.x;
  if (tid < TOPK) {
    eid[tid] = reinterpret_cast<const int*>(a.ids)[i64(t) * a.ids_stride + tid];
    ew[tid] = reinterpret_cast<const float*>(a.wts)[i64(t) * a.wts_stride + tid];
    pos[tid] = reinterpret_cast<const int*>(a.pair_pos)[i64(t) * TOPK + tid];
  }
  __syncthreads();
  if (tid < TOPK) {
    int rank = 0;
    for (int j = 0; j < TOPK; ++j) rank += eid[j] < eid[tid] || (eid[j] == eid[tid] && j < tid);
    ord[rank] = tid;
  }
  __syncthreads();
  const float* y = reinterpret_cast<const float*>(a.y);
  float* out = reinterpret_cast<float*>(a.out) + i64(t) * a.out_stride;
  for (int c = tid; c < HID; c += 256) {
    float o = 0.f;
    for (int j = 0; j < TOPK; ++j) {
      const int s = ord[j], p = pos[s];
      if (p >= 0) o += ew[s] * y[i64(p) * HID + c];
    }
    out[c] = o;
  }
}

#endif  // MOE_PART 2

// ================================================================================================
#if MOE_PART == 3

#ifndef VEC
#define VEC 1
#endif

// The element ops: one row per blockIdx.y, VEC consecutive columns per thread.
#if VEC == 4
__device__ __forceinline__ float4 moe_swiglu4(float4 g, float4 u) {
  return make_float4(silu(g.x) * u.x, silu(g.y) * u.y, silu(g.z) * u.z, silu(g.w) * u.w);
}
#endif

extern "C" __global__ void __launch_bounds__(256)
    swiglu(const float* __restrict__ gate, i64 gs, const float* __restrict__ up, i64 us, float* __restrict__ out,
           i64 os, int cols) {
  LILY_PDL_PROLOGUE();
  const i64 t = blockIdx.y;
  const int c = (blockIdx.x * 256 + threadIdx.x) * VEC;
  if (c >= cols) return;
#if VEC == 4
  const float4 g = *reinterpret_cast<const float4*>(gate + t * gs + c);
  const float4 u = *reinterpret_cast<const float4*>(up + t * us + c);
  *reinterpret_cast<float4*>(out + t * os + c) = moe_swiglu4(g, u);
#else
  out[t * os + c] = silu(gate[t * gs + c]) * up[t * us + c];
#endif
}

extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const float* __restrict__ routed, i64 rs, const float* __restrict__ shared, i64 ss,
                const float* __restrict__ sg, i64 gs, float* h, i64 hs, int cols) {
  LILY_PDL_PROLOGUE();
  const i64 t = blockIdx.y;
  const int c = (blockIdx.x * 256 + threadIdx.x) * VEC;
  if (c >= cols) return;
  const float g = sigmoid(sg[t * gs]);
#if VEC == 4
  const float4 r = *reinterpret_cast<const float4*>(routed + t * rs + c);
  const float4 s = *reinterpret_cast<const float4*>(shared + t * ss + c);
  float4 v = *reinterpret_cast<const float4*>(h + t * hs + c);
  v.x += r.x + g * s.x;
  v.y += r.y + g * s.y;
  v.z += r.z + g * s.z;
  v.w += r.w + g * s.w;
  *reinterpret_cast<float4*>(h + t * hs + c) = v;
#else
  h[t * hs + c] += routed[t * rs + c] + g * shared[t * ss + c];
#endif
}

#endif  // MOE_PART 3
