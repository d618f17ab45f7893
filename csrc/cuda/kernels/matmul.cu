// Weight-streaming matmul: y[T, N] = x[T, K] · Wᵀ with fp32 accumulation (Ops::matmul, ops.h; the oracle is
// csrc/cpu/matmul.cpp, tests/cuda/test_matmul.py). W is one matrix [N, K]: dense f32/f16/bf16 rows or MLX
// affine codes (bits 2/4/8, one scale and bias per GROUP inputs; MODEL.md §9: scales may be negative, the
// bias is not the group minimum, nibbles LSB first; §12.18).
//
// Buffers: x f32 [T, K] rows at stride ldx (read); y f32 [T, N] rows at stride ldy (written, every element
// of the T×N block exactly once; no aliasing with x); W bytes (row n at n · K·bits/8, read once per kernel
// in decode), scales/biases [N, K/GROUP] of dtype DT (affine only). Nothing is read past row N-1, column
// K-1 (bytes of a partial 16-byte chunk past the row end read as 0; see quant.cuh for the word rule) or the
// last scale.
//
// Specialisation (NVRTC -D, set by csrc/cuda/matmul.cpp from the weight alone, never from a model config):
//   K      input features (2048, 4096, 512 in Qwen3.6-35B-A3B; tests: 64·3, 64·17, 7, 100, 1000 ...)
//   BITS   2/4/8 affine, 0 dense;  DT  scale dtype (affine) or element dtype (dense): LILY_F32/F16/BF16
//   GROUP  affine group (64; tests 32/128), 0 for dense
//   AL     proven alignment of W's base and row stride: 16 (one 16-byte load per chunk), 4, or 1 (funnel)
//   SAL    1 when scales and biases are aligned to their element size, 0 for byte-wise reads
//   XS     GEMM only: x as 2 bf16 terms (hi + lo, error ~1e-5) or 1 (bf16 x, error ~1.5e-3)
//   XF     GEMM only, 1 with XS 1 and WM 0: x as one fp16 term scaled by 2^e per row and group part (quant.cuh
//          f16_part_scale; error ~2.4e-4), the codes as fp16, f16 MMAs
//   GFRAG  GEMM only, 4-bit codes in WM 0: the W tile stays raw codes in shared memory and each warp widens its own
//          columns' codes into B fragments (no f16/bf16 W tile, no ldmatrix for B): the same operands, the same bits
//   WF16   GEMM only, with XF (the host's gemm_w_f16): the W tile holds the weights themselves, f16(s·q + b) by one
//          f16x2 FMA per pair (s, b as f16), so each part's fold is acc += 2^-e·D: no group scale, no b·Σx term, no
//          Σx. Another rounding (the weight's, ≤ 2^-11 relative, besides x's), so not the codes path's bits
//   XROW   GEMM only, with WF16 (the host's gemm_x_rows): x arrives as f16 rows already scaled by 2^e per ROW (one e
//          over the whole K, matmul_x_rows below; row stride ldx in halves, K padded with zeros to whole K blocks),
//          staged by cp.async into two alternating tiles; the MMAs accumulate straight into the outputs (no group
//          accumulator, no fold) and the epilogue multiplies by the row's 2^-e. Not WF16's bits (another x scale)
//   GBM    GEMM only: tile rows 64, 32 / 16 for small grids, 128 (XROW only) for large ones (matmul.cpp)
//   GWDB   GEMM only, with XROW (the host's gemm_w_double): the W tile alternates between the two W arrays (the
//          second is free: only WM 2 uses it), so block kb + 1's weights are converted right after block kb's MMAs
//          and one barrier per K block remains, not two. The same MMAs in the same order: the same bits
//   NORM   GEMV only: 0 plain; 1 / 2: the RMSNorm (after a residual add) in front, done by every block (below)
// One module per (K, format, alignment) serves both phases: ~6 modules for the real model.
//
// matmul_gemv (decode, T <= 16; Ops::matmul and Ops::matmuls: up to GEMV_PARTS weights of one format read
// the same x in one launch, each part's rows starting on a block batch): block of NT = 256 threads; a row's 16-byte chunks are spread over TPR
// threads (TPR = next power of two of the chunk count C, at most 256; J = ceil(C / TPR) chunks per thread),
// RPP = 256 / TPR rows per pass, U = 4 rows per thread per batch (RB = RPP·U rows per block batch, all their
// 16-byte loads issued before any use; matmul_gemv_u1: U = 1, for weights whose rows all fit in one pass
// of the grid). x is staged once through shared memory (coalesced; the first batch's W loads are issued
// before it) and then stays in registers for the whole kernel: a thread only ever
// touches its own J·EPC inputs (prescaled for the 3-instruction code decode, quant.cuh), with per-subgroup
// Σx for the bias term, so no shared-memory traffic per weight. Row sums: xor shuffles within TPR lanes,
// then (TPR > 32) TPR/32 warp partials through shared memory, summed in warp order. Grid: T · nb blocks,
// block b serves x row b % T and batches b / T, b / T + nb, ... (persistent: nb = min(batches,
// MINB·SMs / T) with MINB = 2 blocks per SM guaranteed by __launch_bounds__; consecutive blocks read the
// same rows for different t, so for T > 1 W comes from L2 after the first). Small N (1, 32): one batch,
// every thread one 16-byte load: the kernel is one DRAM round trip, which splitting K further cannot shorten.
// Floor: W.bytes() per call (q4g64: 0.5625 B/weight; lm_head 248320 × 2048 q4g64 = 286 MB = 72 µs at
// 4 TB/s); instruction floor ~3 per code (q4: ~10 codes/clk/SMSP, above the 7.1 T codes/s HBM feeds).
//
// matmul_gemv_mma (decode, T <= 8, q4 weights of 32 MiB and more, i.e. the lm_head): the same product on
// the tensor cores, W codes exact, x as bf16 hi + lo; scales/biases staged per 32-row tile in shared memory
// with coalesced loads, two spans of codes in flight per warp; see its section at the end of the file. Floor as
// above: 286 MB for the lm_head; ~2.4 instructions per code instead of ~3.8.
//
// matmul_x_rows (prefill, XROW): x f32 [T, K] (stride ldx) -> f16 [T, KP] (KP = K rounded up to the 64-wide K block,
// the padding zero) scaled by 2^e, e from the row's max |x| (quant.cuh f16_part_scale: the max lands in [2^14, 2^15)),
// and the row's 2^-e in xinv [T]. Grid T, block 256. Floor: 6·T·K bytes (f32 read, f16 written).
//
// matmul_gemm (prefill, any T): mma.sync m16n8k16 bf16 → f32. Block 256 threads = 8 warps (2 along T × 4
// along N), tile BM 64 (T) × BN 128 (N) × BK 64 (K), warp tile 32 × 32; grid (ceil(T/BM), ceil(N/128)), T
// fastest so the T-blocks sharing a W tile run together and W is read from DRAM about once. GBM 32 / 16 (grids
// of a few blocks, matmul.cpp): BM 32 / 16, warps 1 × 8 of 32 × 16 / 16 × 16, 2x / 4x the blocks; the x rows are
// staged by the first 4·BM threads exactly as at BM 64, and every output's sums run in the same order, so the
// same bits. Per K block:
// x (f32, masked) → bf16 hi (+ lo = bf16(x − hi)) in shared memory; W → shared memory as
//   WM 0 (affine, GROUP % 16 == 0 and GROUP tiles BK or BK tiles GROUP): the integer codes as bf16 (exact);
//        the MMA accumulates Σ x·q per group in a second accumulator set that is folded in at the group's
//        end as acc += s·D, plus acc += b·Σx (Σx over the group part from f32 x): W itself is never rounded;
//   WM 1 (dense bf16): the elements as they are;
//   WM 2 (dense f32/f16, affine with other groups): hi + lo bf16 of the fp32 value fma(q, s, b).
// MMAs per k16 step: x_hi·W_hi (+ x_lo·W_hi if XS 2) (+ x_hi·W_lo if WM 2). XF 1 (WM 0, XS 1): x and the codes
// as f16 instead, x scaled by 2^e per row and group part, the group accumulator folded at every part's end as
// acc += (s·2^-e)·D. Shared memory 61,440 bytes (fixed layout, GEMM_SMEM; matmul.cpp must match). Floor:
// 2·T·N·K FLOP (×XS) on the tensor cores; W bytes once. Register-prefetch pipeline: block kb + 1's global loads
// (x, W chunks, scales) are issued into registers before block kb's MMAs and converted into the shared tile after
// them (x split by cvt.rn.bf16x2 or scaled to f16, q4 codes by PRMT + one half-pair FMA, quant.cuh); 2 blocks per SM
// (__launch_bounds__ caps registers at 128).
//
// Determinism: every output's reduction order depends on K, GROUP and the format only: GEMV sums each
// thread's chunks in ascending order, then a fixed shuffle tree and the warp partials in order; GEMM sums
// K blocks in order. Neither depends on T, on which block serves a row, or on the grid: a prefill in
// chunks gives the same bits as one prefill, and a decode row the same bits whatever T is.
#include "quant.cuh"

#ifndef K
#error "matmul.cu needs -DK"
#endif
#ifndef BITS
#define BITS 0
#endif
#ifndef DT
#define DT LILY_F32
#endif
#ifndef GROUP
#define GROUP 0
#endif
#ifndef AL
#define AL 1
#endif
#ifndef SAL
#define SAL 0
#endif
#ifndef XS
#define XS 2
#endif
#ifndef NORM
#define NORM 0
#endif
#ifndef XF
#define XF 0
#endif
#ifndef GFRAG
#define GFRAG 0  // GEMM only, 4-bit codes (WM 0): each warp widens its columns' codes into B fragments (below)
#endif
#ifndef GBM
#define GBM 64  // GEMM only: tile rows, 64, or 32 / 16 for small grids (matmul.cpp)
#endif
#ifndef WF16
#define WF16 0  // GEMM only, with XF: the W tile as f16 weights (s·q + b), folded by the x scale alone (below)
#endif
#ifndef XROW
#define XROW 0  // GEMM only, with WF16: x as pre-scaled f16 rows (matmul_x_rows), accumulated without a fold
#endif
#ifndef GWDB
#define GWDB 0  // GEMM only, with XROW: two alternating W tiles, one barrier per K block (below)
#endif

#define NT 256
#define GEMV_U 4     // rows per thread per batch (matmul.cpp kGemvRows must match)
#define GEMV_MINB 2  // blocks per SM the register budget must allow (matmul.cpp kGemvBlocksPerSm must match)

constexpr int imin(int a, int b) { return a < b ? a : b; }
constexpr int pow2ceil(int v) { return v <= 1 ? 1 : 2 * pow2ceil((v + 1) / 2); }

constexpr int EB = WFmt<BITS, DT>::EB;
constexpr int EPC = WFmt<BITS, DT>::EPC;
constexpr i64 RBYTES = i64(K) * EB / 8;  // bytes of one row
constexpr int C = int((RBYTES + 15) / 16);
constexpr int NG = BITS ? K / (GROUP ? GROUP : 1) : 1;

static_assert(BITS == 0 || BITS == 2 || BITS == 4 || BITS == 8, "BITS must be 0, 2, 4 or 8");
static_assert(BITS == 0 || (GROUP > 0 && K % GROUP == 0 && GROUP % (32 / BITS) == 0), "GROUP must tile K");
static_assert(BITS != 0 || DT == LILY_F32 || DT == LILY_F16 || DT == LILY_BF16, "dense dtype");

// ------------------------------------------------------------------------------------------------------
// GEMV (decode)

constexpr int TPR = imin(pow2ceil(C), NT);        // threads per row (matmul.cpp gemv_geometry must match)
constexpr int J = (C + TPR - 1) / TPR;            // chunks per thread
constexpr int RPP = NT / TPR;                     // rows per pass
constexpr int SG = BITS ? imin(GROUP, EPC) : EPC;  // elements of one (sub)group inside a chunk
constexpr int NSG = EPC / SG;
constexpr int WPS = BITS ? SG * BITS / 32 : 0;     // words per subgroup
constexpr int WPR = TPR > 32 ? TPR / 32 : 1;       // warps per row

// x is staged in shared memory (coalesced global reads; the old per-thread reads of 32 consecutive floats
// touched 32 cache lines per warp instruction: ~8k L1 wavefronts per block, ~4 us per block). Chunk c's EPC
// inputs sit at c·XLD (4 floats of padding per chunk: the 16-byte reads of lanes one chunk apart fall on
// distinct bank quads). Static shared memory is capped: past the cap threads read x from global directly.
constexpr int XLD = EPC + 4;
constexpr bool XSH = i64(C) * XLD * 4 <= 36 * 1024;
static_assert(NORM == 0 || XSH, "NORM stages the normed row in shared memory");

// The weights of one launch: GEMV_PARTS products of the same x with weights of this module's format
// (Ops::matmuls; a plain matmul is one part). Part p owns the block batches [bstart[p], bstart[p + 1]): its
// rows start on a batch boundary, so every batch reads one weight and writes one output. matmul.cpp's
// GemvParts must match.
#define GEMV_PARTS 4
struct GemvParts {
  const unsigned char* W[GEMV_PARTS];
  const void* S[GEMV_PARTS];
  const void* B[GEMV_PARTS];
  float* y[GEMV_PARTS];
  i64 ldy[GEMV_PARTS];
  int N[GEMV_PARTS];
  int bstart[GEMV_PARTS + 1];
  int np;
};
// NORM 1 / 2 (Ops::rms_norm_matmuls / add_rms_norm_matmuls, decode): x is the norm's input a, and every block
// normalises its row t itself while staging it (normed = rms_norm(a [+ b], w) over the whole row, K elements),
// with the arithmetic of kernels/norm.cu's rms_norm / add_rms_norm with 16-byte loads (its one-block form for
// K > 512, else its one-warp form), so the products and `normed` have the same bits as the two-launch form. The blocks with b0 == 0 store normed.
// NORM 2 also stores sum = a + b, which may alias a: every block of row t counts itself into counters[t] once
// its reads of a and b have landed, and the last one to arrive (all others have read) stores sum and puts the
// counter back to 0 for the next launch. No block waits for another. matmul.cpp's GemvNorm must match.
struct GemvNorm {
  const float* b;  // NORM 2: the residual's other term, row stride ldb
  i64 ldb;
  const float* w;  // the norm weight [K]
  float* sum;      // NORM 2: a + b, row stride lds
  i64 lds;
  float* normed;
  i64 ldn;
  int* counters;   // NORM 2: [T] arrivals, 0 between launches
  float eps;
  int pad;
};

// The part batch bt belongs to, found with constant indices only (a dynamically indexed kernel parameter
// would be copied to local memory).
__device__ __forceinline__ int gemv_part_of(const GemvParts& P, i64 bt) {
  int p = 0;
#pragma unroll
  for (int q = 1; q < GEMV_PARTS; ++q)
    if (q < P.np && bt >= P.bstart[q]) p = q;
  return p;
}
template <class V, int L>
__device__ __forceinline__ V gemv_pick(V const (&a)[L], int p) {
  V v = a[0];
#pragma unroll
  for (int q = 1; q < L; ++q)
    if (q == p) v = a[q];
  return v;
}

// matmul_gemv_async: the same GEMV with the codes, scales and biases of GEMV_STAGES batches in flight per
// thread through cp.async into thread-private shared memory (no registers hold loads in flight, so a thread
// keeps 4x the bytes of the register double buffer outstanding: the decode shapes give each block only 2-4
// batches, and the register form waited about one DRAM round trip per batch). Affine weights whose codes and
// scale/bias arrays are 4-byte aligned and whose rows are 16-byte aligned (AL 16, SAL 1); each thread reads back
// only what it copied, so cp.async.wait_group orders it without a barrier. Shared memory per block:
// GEMV_STAGES · NT · U·J·(16 + 8·NSG) bytes (matmul.cpp gemv_async_smem must match).
#ifndef GEMV_STAGES
#define GEMV_STAGES 4
#endif

// NORM: stages normed row t of x into xsh (the layout below), stores normed (blocks b0 == 0) and, NORM 2, sum.
// Σ sum² in norm.cu's order for this row length: K > 512 its one-block form (thread i sums its float4s at
// 4i, 4i + 1024, ..., then block_sum), else its one-warp form (lane l at 4l, 4l + 128, ..., then warp_sum;
// every warp of the block computes it).
template <int XLDV>
__device__ __forceinline__ void gemv_stage_normed(const float* xr, int t, int b0, int bstep, const GemvNorm& NP,
                                                  float* xsh) {
  static_assert(K % 4 == 0 && EPC % 4 == 0, "NORM needs K and the chunk's inputs in whole float4s");
  constexpr int NI = (K + NT * 4 - 1) / (NT * 4);
  constexpr bool BLOCK_SUM = K > 512;
  __shared__ float nred[32];
  const int tid = threadIdx.x;
  const float* br = NORM == 2 ? NP.b + i64(t) * NP.ldb : nullptr;
  auto load_sum = [&](int i) {
    float4 v = *reinterpret_cast<const float4*>(xr + i);
    if (NORM == 2) {
      const float4 b = *reinterpret_cast<const float4*>(br + i);
      v.x = __fadd_rn(v.x, b.x), v.y = __fadd_rn(v.y, b.y), v.z = __fadd_rn(v.z, b.z), v.w = __fadd_rn(v.w, b.w);
    }
    return v;
  };
  auto add_squares = [](float ss, const float4& v) {
    ss = fmaf(v.x, v.x, ss), ss = fmaf(v.y, v.y, ss), ss = fmaf(v.z, v.z, ss);
    return fmaf(v.w, v.w, ss);
  };
  float4 nv[NI], gv[NI];
  float ss = 0.f;
#pragma unroll
  for (int q = 0; q < NI; ++q) {
    const int i = tid * 4 + q * NT * 4;
    if (i < K) {
      nv[q] = load_sum(i);
      gv[q] = *reinterpret_cast<const float4*>(NP.w + i);
      if (BLOCK_SUM) ss = add_squares(ss, nv[q]);
    }
  }
  if (!BLOCK_SUM)
    for (int i = (tid & 31) * 4; i < K; i += 32 * 4) ss = add_squares(ss, load_sum(i));
  if (NORM == 2) {
    __shared__ int last_reader;
    __threadfence();  // this thread's reads of a are performed before the block counts itself in
    __syncthreads();
    if (tid == 0) {
      const int before = atomicAdd(NP.counters + t, 1);
      last_reader = before == bstep - 1;
      if (last_reader) NP.counters[t] = 0;
    }
    __syncthreads();
    if (last_reader) {
#pragma unroll
      for (int q = 0; q < NI; ++q) {
        const int i = tid * 4 + q * NT * 4;
        if (i < K) *reinterpret_cast<float4*>(NP.sum + i64(t) * NP.lds + i) = nv[q];
      }
    }
  }
  const float total = BLOCK_SUM ? block_sum(ss, nred) : warp_sum(ss);
  const float r = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, float(K)), NP.eps)));  // norm.cu's inv_rms
#pragma unroll
  for (int q = 0; q < NI; ++q) {
    const int i = tid * 4 + q * NT * 4;
    if (i < K) {
      float4 v = nv[q];
      const float4 g = gv[q];
      v.x = __fmul_rn(__fmul_rn(v.x, r), g.x), v.y = __fmul_rn(__fmul_rn(v.y, r), g.y);
      v.z = __fmul_rn(__fmul_rn(v.z, r), g.z), v.w = __fmul_rn(__fmul_rn(v.w, r), g.w);
      *reinterpret_cast<float4*>(&xsh[(i / EPC) * XLDV + i % EPC]) = v;
      if (b0 == 0) *reinterpret_cast<float4*>(NP.normed + i64(t) * NP.ldn + i) = v;
    }
  }
}

template <int U, bool ASYNC = false>
__device__ __forceinline__ void gemv_body(const float* __restrict__ x, int T, i64 ldx, const GemvParts& P,
                                          const GemvNorm& NP) {
  constexpr int RB = RPP * U;  // rows per block batch
  __shared__ float red[U][RPP][WPR];
  __shared__ __align__(16) float xsh[XSH ? C * XLD : 4];
  const int tid = threadIdx.x, tr = tid % TPR, rg = tid / TPR, lane = tid & 31;
  const int t = blockIdx.x % T, b0 = blockIdx.x / T, bstep = gridDim.x / T;
  const i64 nbatches = gemv_pick(P.bstart, P.np);
  const float* xr = x + i64(t) * ldx;

  // Batch loads: codes (and, affine, the converted scales/biases) of the U rows of batch bt. The next
  // batch's loads are issued before this batch's arithmetic (register double buffer), so a warp always
  // has U·J 16-byte loads in flight and no batch waits for its scales separately.
  u32 v[U][J][4];
  float sc[U][J][NSG], bi[U][J][NSG];
  auto load_batch = [&](i64 bt, u32 (&vv)[U][J][4], float (&ss)[U][J][NSG], float (&bb)[U][J][NSG]) {
    const int p = gemv_part_of(P, bt);
    const unsigned char* __restrict__ W = gemv_pick(P.W, p);
    const void* __restrict__ S = gemv_pick(P.S, p);
    const void* __restrict__ B = gemv_pick(P.B, p);
    const int N = gemv_pick(P.N, p);
    const i64 lb = bt - gemv_pick(P.bstart, p);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 n = lb * RB + u * RPP + rg;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int c = tr + j * TPR;
        const i64 off = i64(c) * 16;
        const bool live = n < N && c < C;
        if (live) {
          mm_load16<AL>(W + n * RBYTES + off, RBYTES - off >= 16 ? 16 : int(RBYTES - off), vv[u][j]);
        } else {
          vv[u][j][0] = vv[u][j][1] = vv[u][j][2] = vv[u][j][3] = 0u;
        }
#pragma unroll
        for (int s = 0; s < NSG; ++s) {
          const i64 k0 = i64(c) * EPC + s * SG;
          ss[u][j][s] = bb[u][j][s] = 0.f;
          if (BITS && live && k0 < K) {
            const i64 gi = n * NG + k0 / (GROUP ? GROUP : 1);
            ss[u][j][s] = mm_scalar<DT, SAL>(S, gi);
            bb[u][j][s] = mm_scalar<DT, SAL>(B, gi);
          }
        }
      }
    }
  };
  // ASYNC: stage st of this thread's slots: codes [U·J] uint4, then scale and bias words [U·J·NSG·2].
  constexpr int CW = U * J, SWN = U * J * NSG * 2;
  extern __shared__ __align__(16) unsigned char gemv_dyn_smem[];
  auto code_slot = [&](int st, int u, int j) {
    return reinterpret_cast<uint4*>(gemv_dyn_smem) + (i64(st) * CW + u * J + j) * NT + tid;
  };
  auto word_slot = [&](int st, int u, int j, int sg, int which) {
    return reinterpret_cast<u32*>(gemv_dyn_smem + i64(GEMV_STAGES) * CW * NT * 16) +
           (i64(st) * SWN + ((u * J + j) * NSG + sg) * 2 + which) * NT + tid;
  };
  // Copies batch bt (if it exists) into stage st, then commits a group (empty past the end, so the count of
  // outstanding groups stays uniform).
  auto issue_batch = [&](i64 bt, int st) {
    if (bt < nbatches) {
      const int p = gemv_part_of(P, bt);
      const unsigned char* __restrict__ W = gemv_pick(P.W, p);
      const unsigned char* __restrict__ S = static_cast<const unsigned char*>(gemv_pick(P.S, p));
      const unsigned char* __restrict__ B = static_cast<const unsigned char*>(gemv_pick(P.B, p));
      const int N = gemv_pick(P.N, p);
      const i64 lb = bt - gemv_pick(P.bstart, p);
      constexpr int ES = DT == LILY_F32 ? 4 : 2;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 n = lb * RB + u * RPP + rg;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const int c = tr + j * TPR;
          const i64 off = i64(c) * 16;
          const bool live = n < N && c < C;
          cp_async16(smem_addr(code_slot(st, u, j)), live ? W + n * RBYTES + off : W,
                     live ? (RBYTES - off >= 16 ? 16 : int(RBYTES - off)) : 0);
#pragma unroll
          for (int sg = 0; sg < NSG; ++sg) {
            const i64 k0 = i64(c) * EPC + sg * SG;
            const bool ok = live && k0 < K;
            const i64 gi = ok ? n * NG + k0 / (GROUP ? GROUP : 1) : 0;
            const i64 wb = (gi * ES) & ~i64(3);
            cp_async4(smem_addr(word_slot(st, u, j, sg, 0)), S + wb, ok ? 4 : 0);
            cp_async4(smem_addr(word_slot(st, u, j, sg, 1)), B + wb, ok ? 4 : 0);
          }
        }
      }
    }
    cp_async_commit();
  };
  // The first batch's W loads go out before x is staged: the two latencies overlap.
  if constexpr (ASYNC) {
#pragma unroll
    for (int st = 0; st < GEMV_STAGES - 1; ++st) issue_batch(b0 + i64(st) * bstep, st);
  } else {
    if (b0 < nbatches) load_batch(b0, v, sc, bi);
  }

  // This thread's inputs, once: xs (prescaled for affine codes), sx = Σx per subgroup (e ascending).
  if (XSH) {
    if constexpr (NORM != 0) {
      gemv_stage_normed<XLD>(xr, t, b0, bstep, NP, xsh);
    } else {
      for (int k = tid; k < K; k += NT) xsh[(k / EPC) * XLD + k % EPC] = xr[k];
    }
    __syncthreads();
  }
  float xs[J][EPC], sx[J][NSG];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int c = tr + j * TPR;
#pragma unroll
    for (int s = 0; s < NSG; ++s) sx[j][s] = 0.f;
    float xv[EPC];
#pragma unroll
    for (int e = 0; e < EPC; ++e) xv[e] = 0.f;
    if (XSH && c < C) {
#pragma unroll
      for (int e = 0; e < EPC; e += 4) {
        const float4 q = *reinterpret_cast<const float4*>(&xsh[c * XLD + e]);
        xv[e] = q.x, xv[e + 1] = q.y, xv[e + 2] = q.z, xv[e + 3] = q.w;
      }
    }
#pragma unroll
    for (int e = 0; e < EPC; ++e) {
      const i64 k = i64(c) * EPC + e;
      const float v = (c < C && k < K) ? (XSH ? xv[e] : xr[k]) : 0.f;
      sx[j][e / SG] += v;
      xs[j][e] = BITS ? v * q_prescale<BITS ? BITS : 4>(e) : v;
    }
  }

  constexpr int WL = imin(TPR, 32);  // lanes of one row inside a warp
  constexpr bool BFLY = U == 4 && WL >= 8;
  int it = 0;
  for (i64 bt = b0; bt < nbatches; bt += bstep, ++it) {
    u32 vn[U][J][4];
    float scn[U][J][NSG], bin[U][J][NSG];
    const bool more = bt + bstep < nbatches;
    if constexpr (ASYNC) {
      // Refill the stage this thread finished last iteration, then wait for this batch's group.
      issue_batch(bt + i64(GEMV_STAGES - 1) * bstep, (it + GEMV_STAGES - 1) % GEMV_STAGES);
      cp_async_wait<GEMV_STAGES - 1>();
      const int st = it % GEMV_STAGES;
      const i64 lb0 = bt - gemv_pick(P.bstart, gemv_part_of(P, bt));
      const int N0 = gemv_pick(P.N, gemv_part_of(P, bt));
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 n = lb0 * RB + u * RPP + rg;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const uint4 q = *code_slot(st, u, j);
          v[u][j][0] = q.x, v[u][j][1] = q.y, v[u][j][2] = q.z, v[u][j][3] = q.w;
          const int c = tr + j * TPR;
#pragma unroll
          for (int sg = 0; sg < NSG; ++sg) {
            const i64 k0 = i64(c) * EPC + sg * SG;
            const bool ok = n < N0 && c < C && k0 < K;
            const i64 gi = ok ? n * NG + k0 / (GROUP ? GROUP : 1) : 0;
            sc[u][j][sg] = ok ? word_scalar<DT>(*word_slot(st, u, j, sg, 0), gi) : 0.f;
            bi[u][j][sg] = ok ? word_scalar<DT>(*word_slot(st, u, j, sg, 1), gi) : 0.f;
          }
        }
      }
    } else {
      if (more) load_batch(bt + bstep, vn, scn, bin);
    }
    const int p = gemv_part_of(P, bt);
    float* __restrict__ y = gemv_pick(P.y, p);
    const i64 ldy = gemv_pick(P.ldy, p);
    const int N = gemv_pick(P.N, p);
    const i64 lb = bt - gemv_pick(P.bstart, p);  // the batch within its part

    float acc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      acc[u] = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (BITS) {
#pragma unroll
          for (int s = 0; s < NSG; ++s) {
            const float d = q_dot_words<BITS ? BITS : 4, WPS ? WPS : 1>(&v[u][j][s * WPS], &xs[j][s * SG]);
            acc[u] = fmaf(sc[u][j][s], d, acc[u]);  // zero scale/bias for dead rows, chunks, subgroups
            acc[u] = fmaf(bi[u][j][s], sx[j][s], acc[u]);
          }
        } else {
          acc[u] = dense_dot_chunk<DT>(v[u][j], xs[j], acc[u]);  // zero codes for dead rows and chunks
        }
      }
    }
    // Sum over the WL lanes of a row. U = 4, WL >= 8: a transposed butterfly (xor WL/2 halves the rows a
    // lane carries, xor WL/4 halves them again, then a plain tree): 6 shuffles instead of 20. Lane l then
    // holds row uq = 2·[l & WL/2] + [l & WL/4].
    float red1;
    int uq = 0;
    if (BFLY) {
      const bool h = lane & (WL / 2), q = lane & (WL / 4);
      const float s0 = __shfl_xor_sync(0xffffffffu, h ? acc[0] : acc[2], WL / 2);
      const float s1 = __shfl_xor_sync(0xffffffffu, h ? acc[1] : acc[3], WL / 2);
      const float p0 = (h ? acc[2] : acc[0]) + s0, p1 = (h ? acc[3] : acc[1]) + s1;
      const float s2 = __shfl_xor_sync(0xffffffffu, q ? p0 : p1, WL / 4);
      red1 = (q ? p1 : p0) + s2;
#pragma unroll
      for (int o = WL / 8; o > 0; o >>= 1) red1 += __shfl_xor_sync(0xffffffffu, red1, o);
      uq = (h ? 2 : 0) + (q ? 1 : 0);
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int o = WL / 2; o > 0; o >>= 1) acc[u] += __shfl_xor_sync(0xffffffffu, acc[u], o);
      }
    }
    if (TPR <= 32) {
      if (BFLY) {
        const i64 n = lb * RB + uq * RPP + rg;
        if ((tr & (WL / 4 - 1)) == 0 && n < N) y[i64(t) * ldy + n] = red1;
      } else if (tr == 0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const i64 n = lb * RB + u * RPP + rg;
          if (n < N) y[i64(t) * ldy + n] = acc[u];
        }
      }
    } else {
      if (BFLY) {
        if ((lane & (WL / 4 - 1)) == 0) red[uq][rg][tr / 32] = red1;
      } else if (lane == 0) {
#pragma unroll
        for (int u = 0; u < U; ++u) red[u][rg][tr / 32] = acc[u];
      }
      __syncthreads();
      if (tid < RB) {
        const int u = tid / RPP, r = tid % RPP;
        const i64 n = lb * RB + u * RPP + r;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WPR; ++w) s += red[u][r][w];
        if (n < N) y[i64(t) * ldy + n] = s;
      }
      __syncthreads();
    }
    if (!ASYNC && more) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < J; ++j) {
#pragma unroll
          for (int i = 0; i < 4; ++i) v[u][j][i] = vn[u][j][i];
#pragma unroll
          for (int s = 0; s < NSG; ++s) sc[u][j][s] = scn[u][j][s], bi[u][j][s] = bin[u][j][s];
        }
    }
  }
}

// NORM 1/2 modules take the GemvNorm after the parts (the same kernel names).
#if NORM
#define GEMV_NORM_PARAM , const GemvNorm NP
#define GEMV_NORM_ARG NP
#else
#define GEMV_NORM_PARAM
#define GEMV_NORM_ARG GemvNorm{}
#endif
extern "C" __global__ void __launch_bounds__(NT, GEMV_MINB)
    matmul_gemv(const float* __restrict__ x, int T, i64 ldx, const GemvParts P GEMV_NORM_PARAM) {
  LILY_PDL_PROLOGUE();
  gemv_body<GEMV_U>(x, T, ldx, P, GEMV_NORM_ARG);
}
// One row per thread per batch (U = 1): weights whose rows all fit in one pass of the grid
// (ceil(N / RPP) <= MINB·SMs; matmul.cpp decides from N alone, never from T). The U = 4 form would leave
// most SMs idle and make each thread walk 4 rows in series.
extern "C" __global__ void __launch_bounds__(NT, GEMV_MINB)
    matmul_gemv_u1(const float* __restrict__ x, int T, i64 ldx, const GemvParts P GEMV_NORM_PARAM) {
  LILY_PDL_PROLOGUE();
  gemv_body<1>(x, T, ldx, P, GEMV_NORM_ARG);
}
#if BITS > 0 && AL == 16 && SAL == 1
extern "C" __global__ void __launch_bounds__(NT, GEMV_MINB)
    matmul_gemv_async(const float* __restrict__ x, int T, i64 ldx, const GemvParts P GEMV_NORM_PARAM) {
  LILY_PDL_PROLOGUE();
  gemv_body<GEMV_U, true>(x, T, ldx, P, GEMV_NORM_ARG);
}
extern "C" __global__ void __launch_bounds__(NT, GEMV_MINB)
    matmul_gemv_async_u1(const float* __restrict__ x, int T, i64 ldx, const GemvParts P GEMV_NORM_PARAM) {
  LILY_PDL_PROLOGUE();
  gemv_body<1, true>(x, T, ldx, P, GEMV_NORM_ARG);
}
#endif

// ------------------------------------------------------------------------------------------------------
// matmul_gemv_dp4a (decode, T <= 16; the default for 4- and 8-bit affine weights with 16-byte-aligned rows,
// scales/biases aligned to their dtype and groups of whole chunks: every decode projection of the real model).
//
// Why: the fp32 GEMV above spends ~8 instructions per 4-bit code (3 for the decode and FMA, the rest on
// addressing, staging and reduction), so its big projections stopped at ~1.1 TB/s, bound by issue, not by HBM
// (benchmarks/NOTES.md). Here the codes meet x in integer dot products (dp4a: 4 code bytes × 4 int8 x bytes per
// instruction) and the per-chunk bookkeeping is a handful of 32-bit operations: ~45 instructions per 16-byte
// chunk of a 4-bit row (32 codes) instead of ~260.
//
// x as three int8 terms (quant.cuh, Dp4a): each block quantizes its row t once, per 16-byte chunk of a weight row
// (EPC inputs, inside one affine group), to within 3.1e-8 of the chunk's max|x|; each term's dot product with the
// codes is exact in int32 and the three combine in fp32 once per chunk: ~1e-7 relative against exact sums, the fp32
// form's own level (tests/cuda/test_matmul.py holds both to 1e-6 against float64). acc += scale_g · s_c · (H +
// (M + L/254)/254) + bias_g · Σ_c x, with Σ_c x the fp32 sum of the chunk's inputs in a fixed order.
//
// Geometry: a warp owns a row slot of TPR8 lanes (TPR8 = the power of two ≥ chunks per row, at most 32; RWP8 =
// 32 / TPR8 rows side by side), lane tr reads chunks tr, tr + TPR8, ... (J8 per row). A warp batch is RU8 row
// slots (RU8 · J8 ≤ 4 chunk loads per lane), RB8 = RU8 · RWP8 rows; the warp's next batch is loaded into
// registers (codes, raw scale/bias bits) before this one's arithmetic: up to 8 chunks, 128 bytes per lane in
// flight. Batches are dealt to the warps of the grid round robin (persistent grid of 2 blocks per SM / T);
// GemvParts' bstart counts warp batches. Block of 256 threads: x row t (NORM 1/2: normalised in shared memory
// as the fp32 form does) quantized by 4 threads per chunk, one code word each, into xq (the packed terms,
// chunk-minor so a warp's 16-byte reads of consecutive chunks are conflict-free), xsc (s_c, /16 for 4-bit)
// and xsm (Σ_c x). Row sums: xor shuffles within the TPR8 lanes. Shared memory C · (QW · 4 + 8) (+ NORM's row).
// Floor: W.bytes() per call, as above; ~1.4 instructions per 4-bit code (~10 codes per clock per SMSP).
// Under programmatic dependent launch the first batch's weight loads go out before the wait for the kernel before
// (common.cuh), so they stream while it finishes; x, the residual and the norm counters come after. GEMV_AHEAD 2
// (the host's gemv_ahead): the warp's first two batches before the wait, then two register buffers in turn.
// Determinism: a row's bits depend on K, the format and x's row only (not on T, the grid or the part).
// (The preprocessor's form of: 4/8 bits, AL 16, SAL 1, GROUP % EPC == 0, XSH.)
#if (BITS == 4 || BITS == 8) && AL == 16 && SAL == 1 && GROUP % (128 / (BITS ? BITS : 1)) == 0 && \
    (K * BITS / 128) * (128 / (BITS ? BITS : 1) + 4) * 4 <= 36 * 1024
static_assert(GROUP % EPC == 0 && XSH, "the dp4a GEMV's conditions");
constexpr int TPR8 = imin(pow2ceil(C), 32);
constexpr int J8 = (C + TPR8 - 1) / TPR8;
constexpr int RWP8 = 32 / TPR8;
constexpr int RU8 = J8 >= 4 ? 1 : 4 / J8;
constexpr int RB8 = RU8 * RWP8;                // rows per warp batch (matmul.cpp gemv_dp4a_rows must match)
constexpr int QW = Dp4a<BITS>::QW;             // packed x words per chunk (quant.cuh)
constexpr int QV = QW / 4;                     // as uint4

// A scale/bias as its raw bits (mm_scalar converts at the load; these convert at the use, so a prefetched batch
// does not wait for its loads before its arithmetic).
__device__ __forceinline__ u32 gemv_raw_scalar(const unsigned char* p, i64 i) {
  if (DT == LILY_F32) return *reinterpret_cast<const u32*>(p + 4 * i);
  return *reinterpret_cast<const u16*>(p + 2 * i);
}
__device__ __forceinline__ float gemv_raw_to_f32(u32 r) {
  if (DT == LILY_F32) return __uint_as_float(r);
  return DT == LILY_BF16 ? __uint_as_float(r << 16) : f16_to_f32(u16(r));
}

template <int kUnused = 0>
__device__ __forceinline__ void gemv_dp4a_body(const float* __restrict__ x, int T, i64 ldx, const GemvParts& P,
                                               const GemvNorm& NP) {
  __shared__ __align__(16) float xsh[NORM ? C * XLD : 4];  // NORM: the normed row, as the fp32 form stages it
  __shared__ uint4 xq[QV * C];
  __shared__ float xsc[C], xsm[C];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tr = lane % TPR8, rs = lane / TPR8;  // lane within its row, row within the warp's pass
  const int t = blockIdx.x % T, b0 = blockIdx.x / T, bstep = gridDim.x / T;
  const int nbatches = gemv_pick(P.bstart, P.np);
  const int wstep = bstep * (NT / 32);
  const float* xr = x + i64(t) * ldx;

  // The loads of warp batch bt: codes and raw scale/bias bits of RU8 row slots × J8 chunks.
  u32 cw[RU8][J8][4], cs[RU8][J8], cb[RU8][J8];
  auto load = [&](int bt, u32 (&vw)[RU8][J8][4], u32 (&vs)[RU8][J8], u32 (&vb)[RU8][J8]) {
    const int p = gemv_part_of(P, bt);
    const unsigned char* __restrict__ W = gemv_pick(P.W, p);
    const unsigned char* __restrict__ S = static_cast<const unsigned char*>(gemv_pick(P.S, p));
    const unsigned char* __restrict__ B = static_cast<const unsigned char*>(gemv_pick(P.B, p));
    const int N = gemv_pick(P.N, p);
    const int r0 = (bt - gemv_pick(P.bstart, p)) * RB8 + rs;
#pragma unroll
    for (int u = 0; u < RU8; ++u) {
      const int n = r0 + u * RWP8;
      const unsigned char* wrow = W + i64(n) * RBYTES;
      const i64 g0 = i64(n) * NG;
#pragma unroll
      for (int j = 0; j < J8; ++j) {
        const int c = tr + j * TPR8;
        if (n < N && c < C) {
          const uint4 q = mm_ld128(wrow + c * 16);
          vw[u][j][0] = q.x, vw[u][j][1] = q.y, vw[u][j][2] = q.z, vw[u][j][3] = q.w;
          const i64 gi = g0 + (c * EPC) / GROUP;
          vs[u][j] = gemv_raw_scalar(S, gi);
          vb[u][j] = gemv_raw_scalar(B, gi);
        } else {
          vw[u][j][0] = vw[u][j][1] = vw[u][j][2] = vw[u][j][3] = 0u;
          vs[u][j] = vb[u][j] = 0u;  // +0.0 in every dtype: dead rows and chunks add nothing
        }
      }
    }
  };
  int bt = b0 * (NT / 32) + warp;
  if (bt < nbatches) load(bt, cw, cs, cb);  // the first weights are in flight while x is quantized
#if GEMV_AHEAD == 2
  u32 nw[RU8][J8][4], ns[RU8][J8], nb[RU8][J8];
  if (bt + wstep < nbatches) load(bt + wstep, nw, ns, nb);  // and the warp's second batch
#endif
  // Weights only so far: under programmatic dependent launch they stream while the kernel before this one
  // finishes (common.cuh); x, the residual and the norm's counters are its output.
  LILY_PDL_PROLOGUE();

  // x row t into the packed terms: thread (chunk c, word i) = (tid / 4, tid % 4), C · 4 threads in passes of NT.
  if constexpr (NORM != 0) {
    gemv_stage_normed<XLD>(xr, t, b0, bstep, NP, xsh);
    __syncthreads();
    dp4a_quantize_rows<BITS>(xsh, 0, XLD, 1, C, true, xq, xsc, xsm);
  } else {
    dp4a_quantize_rows<BITS>(xr, 0, EPC, 1, C, (reinterpret_cast<unsigned long long>(xr) & 15u) == 0, xq, xsc, xsm);
  }
  __syncthreads();

  // Batch bt's products from buffer (vw, vs, vb): RU8 rows, reduced over the row's lanes, stored.
  auto compute = [&](int bt, const u32 (&vw)[RU8][J8][4], const u32 (&vs)[RU8][J8], const u32 (&vb)[RU8][J8]) {
    float acc[RU8];
#pragma unroll
    for (int u = 0; u < RU8; ++u) acc[u] = 0.f;
#pragma unroll
    for (int j = 0; j < J8; ++j) {
      const int c = tr + j * TPR8;
      if (c < C) {
        u32 xw[QW];
        dp4a_load_x<BITS>(xq, C, c, xw);
        const float xs = xsc[c], xsum = xsm[c];
#pragma unroll
        for (int u = 0; u < RU8; ++u)
          acc[u] = dp4a_chunk<BITS>(vw[u][j], xw, xs, xsum, gemv_raw_to_f32(vs[u][j]), gemv_raw_to_f32(vb[u][j]), acc[u]);
      }
    }
    const int p = gemv_part_of(P, bt);
    float* __restrict__ y = gemv_pick(P.y, p);
    const i64 ldy = gemv_pick(P.ldy, p);
    const int N = gemv_pick(P.N, p);
    const int r0 = (bt - gemv_pick(P.bstart, p)) * RB8 + rs;
#pragma unroll
    for (int u = 0; u < RU8; ++u) {
      float s = acc[u];
#pragma unroll
      for (int o = TPR8 / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      const int n = r0 + u * RWP8;
      if (tr == 0 && n < N) y[i64(t) * ldy + n] = s;
    }
  };
  // The next batch's registers become the current one's (waiting for its loads).
  auto take = [&](const u32 (&vw)[RU8][J8][4], const u32 (&vs)[RU8][J8], const u32 (&vb)[RU8][J8]) {
#pragma unroll
    for (int u = 0; u < RU8; ++u)
#pragma unroll
      for (int j = 0; j < J8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) cw[u][j][i] = vw[u][j][i];
        cs[u][j] = vs[u][j], cb[u][j] = vb[u][j];
      }
  };
#if GEMV_AHEAD == 2
  // Both buffers were loaded before the wait: the batch after next goes into the second one once the next batch
  // has moved into the first (so a warp's second batch was in flight during the wait and x's staging).
  for (; bt < nbatches; bt += wstep) {
    compute(bt, cw, cs, cb);
    if (bt + wstep >= nbatches) break;
    take(nw, ns, nb);
    if (bt + 2 * wstep < nbatches) load(bt + 2 * wstep, nw, ns, nb);
  }
#else
  // The next batch's loads go out before this one's arithmetic (a register double buffer).
  for (; bt < nbatches; bt += wstep) {
    u32 nw[RU8][J8][4], ns[RU8][J8], nb[RU8][J8];
    const bool more = bt + wstep < nbatches;
    if (more) load(bt + wstep, nw, ns, nb);
    compute(bt, cw, cs, cb);
    if (more) take(nw, ns, nb);
  }
#endif
}
extern "C" __global__ void __launch_bounds__(NT, GEMV_MINB)
    matmul_gemv_dp4a(const float* __restrict__ x, int T, i64 ldx, const GemvParts P GEMV_NORM_PARAM) {
  gemv_dp4a_body(x, T, ldx, P, GEMV_NORM_ARG);
}
#endif

// ------------------------------------------------------------------------------------------------------
// GEMM (prefill) and the tensor-core GEMV: not in NORM modules (the fused norm is a CUDA-core GEMV form only).
#if NORM == 0

#define BM GBM
#define BN 128
static_assert(BM == 128 || BM == 64 || BM == 32 || BM == 16, "GEMM tile rows: 64, 32 / 16 for small grids, 128");
static_assert(BM != 128 || XROW, "128-row tiles take x as f16 rows (XROW): the f32 staging has one row per 4 threads");
// Warps: 2 along T × 4 along N with warp tiles of 32 × 32 (BM 64), 4 × 2 with 32 × 64 (BM 128: each fragment feeds
// twice the MMAs, each converted W tile twice the rows), or 1 × 8 with 32 × 16 (BM 32) / 16 × 16 (BM 16).
#define G_WARPS_M (BM == 128 ? 4 : BM == 64 ? 2 : 1)
#define G_WARPS_N (8 / G_WARPS_M)
#define G_WTM (BM / G_WARPS_M)
#define G_WTN (BN / G_WARPS_N)
#define G_MI (G_WTM / 16)
#define G_NI (G_WTN / 8)
#define BK 64
#define LDS (BK + 8)  // bf16 per shared row: 144 bytes, so the 8 rows of an ldmatrix hit distinct banks

// Weight staging mode (matmul.cpp gemm_mode must match).
constexpr int WM = BITS ? ((GROUP % 16 == 0 && (GROUP % BK == 0 || BK % GROUP == 0)) ? 0 : 2)
                        : (DT == LILY_BF16 ? 1 : 2);
constexpr int GP = BITS ? imin(GROUP, BK) : BK;  // group part inside one K block (WM 0)
constexpr int NP = BK / GP;                      // parts per K block (1, 2 or 4 in WM 0)
constexpr int CPR = BK * EB / 8 / 16;            // 16-byte chunks of a row per K block
constexpr int KB = (K + BK - 1) / BK;

// Shared layout (bytes): x hi, x lo [BM][LDS] bf16; W hi, W lo [BN][LDS] bf16; Σx [BM][4] f32;
// scales, biases [BN][4] f32; x's 2^-e [BM][4] f32 (XF). 61,440 bytes in all at BM 64, 51,200 at 32, 46,080 at 16,
// 81,920 at 128 (matmul.cpp gemm_smem). XROW: x's two alternating f16 tiles are the x hi and x lo arrays.
#define SM_XH 0
#define SM_XL (SM_XH + BM * LDS * 2)
#define SM_WH (SM_XL + BM * LDS * 2)
#define SM_WL (SM_WH + BN * LDS * 2)
#define SM_SX (SM_WL + BN * LDS * 2)
#define SM_SS (SM_SX + BM * 4 * 4)
#define SM_BS (SM_SS + BN * 4 * 4)
#define SM_XR (SM_BS + BN * 4 * 4)
#define GEMM_SMEM (SM_XR + BM * 4 * 4)
static_assert(GEMM_SMEM == (BM == 128 ? 81920 : BM == 64 ? 61440 : BM == 32 ? 51200 : 46080), "matmul.cpp gemm_smem");
static_assert(XROW == 0 || WF16 == 1, "XROW: f16 weight tiles (WF16) with x as pre-scaled f16 rows");
static_assert(GWDB == 0 || (XROW == 1 && WM != 2), "GWDB: XROW's f16 tiles, the W lo array free for the second tile");
static_assert(XF == 0 || (XS == 1 && WM == 0), "XF: one f16 x term, affine codes folded per group part");
static_assert(WF16 == 0 || (XF == 1 && GFRAG == 0 && GROUP % EPC == 0),
              "WF16: f16 x, a converted W tile, one group per 16-byte chunk of codes");

// The GEMM's own shared-address form (common.cuh's smem_addr is the intrinsic; this asm form is what the GEMM was
// measured with: the intrinsic lets ptxas fold the address arithmetic differently).
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void ldsm_x4(u32 addr, u32 r[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ u32 pack_bf16(u16 lo, u16 hi) { return u32(lo) | (u32(hi) << 16); }
// bf16 hi and lo = bf16(v - hi) of an fp32 value.
__device__ __forceinline__ void split_bf16(float v, u16& h, u16& l) {
  h = f32_to_bf16(v);
  l = f32_to_bf16(v - bf16_to_f32(h));
}

// Register-prefetch pipeline: the global loads of K block kb + 1 (x, the W chunks, the group scales/biases) are
// issued into registers before block kb's MMAs, so their latency hides behind the tensor-core work; after the
// MMAs the registers are converted and stored into the shared tile (GWDB: the other of two). W chunks are
// prefetched when a thread carries at most GEMM_WPF of them (q2/q4/q8/bf16); f32 weights (8 chunks) load at store
// time.
constexpr int GEMM_WCH = (BN * CPR + NT - 1) / NT;  // W chunks per thread per K block
#define GEMM_WPF 4
constexpr bool GEMM_WPRE = GEMM_WCH <= GEMM_WPF;
// GFRAG: the K block's codes of W row nl sit raw at SM_WH + nl · GF_PITCH (CPR = 2 chunks of 16 bytes, padded to 48
// bytes: a warp's reads of 8 columns' 8-byte words hit distinct banks); the shared memory layout is unchanged.
static_assert(GFRAG == 0 || (BITS == 4 && WM == 0 && CPR == 2 && GEMM_WPRE), "GFRAG: 4-bit codes folded per group");
#define GF_PITCH 48
constexpr int GEMM_SCH = WM == 0 ? (BN * NP + NT - 1) / NT : 1;  // group scales per thread per K block

extern "C" __global__ void __launch_bounds__(NT, BM == 16 ? 3 : 2)
    matmul_gemm(const float* __restrict__ x, int T, i64 ldx, const unsigned char* __restrict__ W,
                const void* __restrict__ S, const void* __restrict__ B, float* __restrict__ y, i64 ldy, int N,
                const float* __restrict__ xinv) {
  LILY_PDL_PROLOGUE();
  extern __shared__ __align__(16) unsigned char smem[];
  u16* xh = reinterpret_cast<u16*>(smem + SM_XH);
  u16* xl = reinterpret_cast<u16*>(smem + SM_XL);
  u16* wh = reinterpret_cast<u16*>(smem + SM_WH);
  u16* wl = reinterpret_cast<u16*>(smem + SM_WL);
  float* sxs = reinterpret_cast<float*>(smem + SM_SX);
  float* ss = reinterpret_cast<float*>(smem + SM_SS);
  float* bs = reinterpret_cast<float*>(smem + SM_BS);
  float* sxr = reinterpret_cast<float*>(smem + SM_XR);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / G_WARPS_N, wn = warp % G_WARPS_N;
  const i64 t0 = i64(blockIdx.x) * BM, n0 = i64(blockIdx.y) * BN;
  // x tile: thread → row xr, columns xq·16 .. +16 (threads past the tile's BM rows stage no x: each row's 16-input
  // runs and their Σx are summed the same way at either tile height, so the bits do not depend on it).
  // Whole-float4 loads when x's base and row stride allow.
  const int xr = tid >> 2, xq = tid & 3;
  const bool xmine = xr < BM;
  const bool xrow = xmine && t0 + xr < T;
  const bool xvec = ((reinterpret_cast<unsigned long long>(x) & 15u) == 0) && (ldx % 4 == 0);
  const float* xrowp = x + (xrow ? (t0 + xr) * ldx : 0);

  float acc[G_MI][G_NI][4], accg[G_MI][G_NI][4];
#pragma unroll
  for (int mi = 0; mi < G_MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < G_NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = accg[mi][ni][e] = 0.f;

  // The registers that carry one K block from global to shared memory.
  float xv[16];
  u32 wv[GEMM_WPRE ? GEMM_WCH : 1][4];
  float sv[GEMM_SCH], bv[GEMM_SCH];
  float swv[WF16 ? GEMM_WCH : 1], bwv[WF16 ? GEMM_WCH : 1];  // WF16: each W chunk's group scale and bias

  auto load_w_chunk = [&](i64 kbase, int qi, u32 w[4]) {
    const int nl = qi / CPR, cc = qi % CPR;
    const i64 n = n0 + nl;
    const i64 boff = kbase * EB / 8 + i64(cc) * 16;
    const i64 valid = RBYTES - boff;
    w[0] = w[1] = w[2] = w[3] = 0u;
    if (qi < BN * CPR && n < N && valid > 0) mm_load16<AL>(W + n * RBYTES + boff, valid >= 16 ? 16 : int(valid), w);
  };
  auto load_block = [&](int kb) {
    const i64 kbase = i64(kb) * BK;
    const i64 k0 = kbase + xq * 16;
    if (XROW) {  // x comes by cp.async (issue_x)
    } else if (xrow && xvec && k0 + 16 <= K) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(xrowp + k0) + i);
        xv[4 * i] = f.x, xv[4 * i + 1] = f.y, xv[4 * i + 2] = f.z, xv[4 * i + 3] = f.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) xv[i] = (xrow && k0 + i < K) ? xrowp[k0 + i] : 0.f;
    }
    if (GEMM_WPRE) {
#pragma unroll
      for (int j = 0; j < GEMM_WCH; ++j) load_w_chunk(kbase, tid + j * NT, wv[GEMM_WPRE ? j : 0]);
    }
    if (WF16) {  // the chunk's group (GROUP % EPC == 0: one group per chunk)
#pragma unroll
      for (int j = 0; j < (WF16 ? GEMM_WCH : 0); ++j) {
        const int qi = tid + j * NT, nl = qi / CPR, cc = qi % CPR;
        const i64 n = n0 + nl, k = kbase + i64(cc) * EPC;
        swv[j] = bwv[j] = 0.f;
        if (qi < BN * CPR && n < N && k < K) {
          const i64 gi = n * NG + k / (GROUP ? GROUP : 1);
          swv[j] = mm_scalar<DT, SAL>(S, gi);
          bwv[j] = mm_scalar<DT, SAL>(B, gi);
        }
      }
    } else if (WM == 0) {
#pragma unroll
      for (int j = 0; j < GEMM_SCH; ++j) {
        const int i = tid + j * NT;
        const int nl = i / NP, p = i % NP;
        const i64 n = n0 + nl, kg0 = kbase + p * GP;
        sv[j] = bv[j] = 0.f;
        if (i < BN * NP && n < N && kg0 < K) {
          const i64 gi = n * NG + kg0 / (GROUP ? GROUP : 1);
          sv[j] = mm_scalar<DT, SAL>(S, gi);
          bv[j] = mm_scalar<DT, SAL>(B, gi);
        }
      }
    }
  };
  // Converts the carried block into the shared tile (the previous block's MMAs on that tile are done: barrier
  // before). GWDB: block kb's W tile is the W lo array for odd kb.
  auto store_block = [&](int kb) {
    const i64 kbase = i64(kb) * BK;
    u16* const wt = (GWDB && (kb & 1)) ? wl : wh;
    if (!XROW && xmine) {  // warp-uniform (BM · 4 threads are whole warps)
      constexpr int LP = GP >= 16 ? GP / 16 : 1;  // lanes sharing one group part (WM 0)
      u32 ph[8], pl[8];
      if (XF) {  // x · 2^e as f16, e from the part's max |x| over its LP lanes (quant.cuh)
        float am = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) am = fmaxf(am, fabsf(xv[i]));
        const float inv = f16_scaled_pairs<16, LP>(xv, am, ph);
        if (xq % LP == 0) sxr[xr * 4 + xq / LP] = inv;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) split2_bf16(xv[2 * i], xv[2 * i + 1], ph[i], pl[i]);
      }
      uint4* dh = reinterpret_cast<uint4*>(xh + xr * LDS + xq * 16);
      dh[0] = make_uint4(ph[0], ph[1], ph[2], ph[3]);
      dh[1] = make_uint4(ph[4], ph[5], ph[6], ph[7]);
      if (XS == 2) {
        uint4* dl = reinterpret_cast<uint4*>(xl + xr * LDS + xq * 16);
        dl[0] = make_uint4(pl[0], pl[1], pl[2], pl[3]);
        dl[1] = make_uint4(pl[4], pl[5], pl[6], pl[7]);
      }
      if (WM == 0 && !WF16) {  // Σx over each group part (GP / 16 neighbouring lanes share one)
        float ps = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) ps += xv[i];
#pragma unroll
        for (int o = LP / 2; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        if (xq % LP == 0) sxs[xr * 4 + xq / LP] = ps;
      }
    }
    // ---- W tile: chunk qi → row qi / CPR, chunk qi % CPR of this K block
#pragma unroll
    for (int j = 0; j < GEMM_WCH; ++j) {
      const int qi = tid + j * NT;
      if (qi >= BN * CPR) break;
      u32 w[4];
      if (GEMM_WPRE) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = wv[GEMM_WPRE ? j : 0][i];
      } else {
        load_w_chunk(kbase, qi, w);
      }
      const int nl = qi / CPR, cc = qi % CPR;
      const i64 n = n0 + nl;
      if (GFRAG) {  // raw codes; the warps widen them in registers
        *reinterpret_cast<uint4*>(smem + SM_WH + nl * GF_PITCH + cc * 16) = make_uint4(w[0], w[1], w[2], w[3]);
        continue;
      }
      u32* dh = reinterpret_cast<u32*>(wt + nl * LDS + cc * EPC);
      u32* dl = reinterpret_cast<u32*>(wl + nl * LDS + cc * EPC);
      if (WF16) {  // f16(s·q + b) per pair: the exact code pairs, then one f16x2 FMA with the chunk's group scale and bias
        const u32 s2 = f16x2_rn(swv[WF16 ? j : 0], swv[WF16 ? j : 0]), b2 = f16x2_rn(bwv[WF16 ? j : 0], bwv[WF16 ? j : 0]);
        u32 q[EPC / 2];
        if (BITS == 4) {
#pragma unroll
          for (int i = 0; i < 4; ++i) q4_word_pairs<true>(w[i], q + 4 * i);
        } else {
#pragma unroll
          for (int p = 0; p < EPC / 2; ++p) {
            constexpr int PW = 32 / (BITS ? BITS : 4);
            q[p] = half2_rn<true>(q_code<BITS ? BITS : 4>(w[(2 * p) / PW], (2 * p) % PW),
                                  q_code<BITS ? BITS : 4>(w[(2 * p + 1) / PW], (2 * p + 1) % PW));  // exact
          }
        }
#pragma unroll
        for (int p = 0; p < EPC / 2; ++p) asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(dh[p]) : "r"(q[p]), "r"(s2), "r"(b2));
        continue;
      }
      if (WM == 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) dh[i] = w[i];
      } else if (WM == 0 && BITS == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          u32 q[4];
          q4_word_pairs<XF != 0>(w[i], q);  // exact
          reinterpret_cast<uint4*>(dh)[i] = make_uint4(q[0], q[1], q[2], q[3]);
        }
      } else if (WM == 0) {
#pragma unroll
        for (int p = 0; p < EPC / 2; ++p) {
          const int e0 = 2 * p, e1 = 2 * p + 1;
          constexpr int PW = 32 / (BITS ? BITS : 4);
          dh[p] = half2_rn<XF != 0>(q_code<BITS ? BITS : 4>(w[e0 / PW], e0 % PW),
                                    q_code<BITS ? BITS : 4>(w[e1 / PW], e1 % PW));  // exact: q <= 255
        }
      } else {
#pragma unroll
        for (int p = 0; p < EPC / 2; ++p) {
          float f2[2];
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int e = 2 * p + h2;
            const i64 k = kbase + cc * EPC + e;
            float f = 0.f;
            if (BITS) {
              constexpr int PW = 32 / (BITS ? BITS : 4);
              if (n < N && k < K) {
                const i64 gi = n * NG + k / (GROUP ? GROUP : 1);
                f = fmaf(q_code<BITS ? BITS : 4>(w[e / PW], e % PW), mm_scalar<DT, SAL>(S, gi),
                         mm_scalar<DT, SAL>(B, gi));
              }
            } else {
              f = dense_elem<DT>(w, e);
            }
            f2[h2] = f;
          }
          split2_bf16(f2[0], f2[1], dh[p], dl[p]);
        }
      }
    }
    // ---- scales and biases of the group parts of this K block (WM 0; WF16 applied them in the tile)
    if (WM == 0 && !WF16) {
#pragma unroll
      for (int j = 0; j < GEMM_SCH; ++j) {
        const int i = tid + j * NT;
        if (i < BN * NP) {
          const int nl = i / NP, p = i % NP;
          ss[nl * 4 + p] = sv[j];
          bs[nl * 4 + p] = bv[j];
        }
      }
    }
  };

  // XROW: K block kb's f16 x tile by cp.async into tile kb & 1 (x hi for even blocks, x lo for odd), 16 bytes per
  // copy, rows past T zero-filled; the padded row stride means no column is ever past the rows' ends.
  auto issue_x = [&](int kb) {
    const u16* xh16 = reinterpret_cast<const u16*>(x);
    u16* tile = (kb & 1) ? xl : xh;
#pragma unroll
    for (int i = 0; i < (BM * 8 + NT - 1) / NT; ++i) {
      const int c = tid + i * NT, r = c >> 3, cc = c & 7;
      if (c < BM * 8) {
        const bool in = t0 + r < T;
        cp_async16(smem_u32(tile + r * LDS + cc * 8), xh16 + (in ? (t0 + r) * ldx : 0) + i64(kb) * BK + cc * 8, in ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  if (XROW) issue_x(0);
  load_block(0);
  if (GWDB) {  // block 0's tiles before the loop; each iteration then ends with the next block's
    store_block(0);
    cp_async_wait<0>();
    __syncthreads();
  }
  for (int kb = 0; kb < KB; ++kb) {
    const i64 kbase = i64(kb) * BK;
    if (!GWDB) {
      store_block(kb);
      if (XROW) cp_async_wait<0>();  // this thread's copies of x tile kb (the barrier makes them everyone's)
      __syncthreads();
    }
    if (kb + 1 < KB) {  // in flight during this block's MMAs (XROW: into the other x tile, last read two blocks ago)
      if (XROW) issue_x(kb + 1);
      load_block(kb + 1);
    }
    const u16* xa = (XROW && (kb & 1)) ? xl : xh;  // this block's A tile
    const u16* wb = (GWDB && (kb & 1)) ? wl : wh;  // and its W tile

    // ---- MMAs over the 4 k16 steps of the block
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      const i64 kg = kbase + ks * 16;
      if (kg >= K) break;  // uniform: past the last group (zeros), nothing to add
      u32 ah[G_MI][4], al[G_MI][4], bh[G_NI][2], bl[G_NI][2];
#pragma unroll
      for (int mi = 0; mi < G_MI; ++mi) {
        const int row = wm * G_WTM + mi * 16 + (lane & 15), col = ks * 16 + (lane >> 4) * 8;
        ldsm_x4(smem_u32(xa + row * LDS + col), ah[mi]);
        if (XS == 2) ldsm_x4(smem_u32(xl + row * LDS + col), al[mi]);
      }
      if (GFRAG) {
        // Lane (g, t4): words 2·ks and 2·ks + 1 of column g of each n8 tile, byte t4 of each widened to a pair.
        const u32 sel = u32(lane & 3) | u32(4 + (lane & 3)) << 8;
#pragma unroll
        for (int ni = 0; ni < G_NI; ++ni) {
          const uint2 c = *reinterpret_cast<const uint2*>(smem + SM_WH + (wn * G_WTN + ni * 8 + (lane >> 2)) * GF_PITCH +
                                                          ks * 8);
          bh[ni][0] = q4_byte_pair<XF != 0>(c.x, sel);
          bh[ni][1] = q4_byte_pair<XF != 0>(c.y, sel);
        }
      }
#pragma unroll
      for (int nj = 0; nj < (GFRAG ? 0 : G_NI / 2); ++nj) {
        const int row = wn * G_WTN + nj * 16 + (lane & 7) + (lane >> 4) * 8, col = ks * 16 + ((lane >> 3) & 1) * 8;
        u32 r[4];
        ldsm_x4(smem_u32(wb + row * LDS + col), r);
        bh[2 * nj][0] = r[0], bh[2 * nj][1] = r[1], bh[2 * nj + 1][0] = r[2], bh[2 * nj + 1][1] = r[3];
        if (WM == 2) {
          ldsm_x4(smem_u32(wl + row * LDS + col), r);
          bl[2 * nj][0] = r[0], bl[2 * nj][1] = r[1], bl[2 * nj + 1][0] = r[2], bl[2 * nj + 1][1] = r[3];
        }
      }
#pragma unroll
      for (int mi = 0; mi < G_MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < G_NI; ++ni) {
          float* c = WM == 0 && !XROW ? accg[mi][ni] : acc[mi][ni];
          mma_m16n8k16<XF != 0>(c, ah[mi], bh[ni][0], bh[ni][1]);
          if (XS == 2) mma_m16n8k16(c, al[mi], bh[ni][0], bh[ni][1]);
          if (WM == 2) mma_m16n8k16(c, ah[mi], bl[ni][0], bl[ni][1]);
        }
      if (WM == 0 && !XROW) {
        const int p = (ks * 16) / GP;
        const bool part_end = ((ks * 16 + 16) % GP) == 0;
        // XF folds at every part's end: each part has its own x scale
        const bool group_end = XF ? part_end : ((kg + 16) % (GROUP ? GROUP : 16)) == 0;
        if (group_end || part_end) {
#pragma unroll
          for (int mi = 0; mi < G_MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < G_NI; ++ni)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int nl = wn * G_WTN + ni * 8 + 2 * (lane & 3) + (e & 1);
                const int tl = wm * G_WTM + mi * 16 + (lane >> 2) + (e >> 1) * 8;
                if (group_end) {
                  const float s = WF16 ? sxr[tl * 4 + p] : XF ? ss[nl * 4 + p] * sxr[tl * 4 + p] : ss[nl * 4 + p];
                  acc[mi][ni][e] = fmaf(s, accg[mi][ni][e], acc[mi][ni][e]);
                  accg[mi][ni][e] = 0.f;
                }
                if (part_end && !WF16) acc[mi][ni][e] = fmaf(bs[nl * 4 + p], sxs[tl * 4 + p], acc[mi][ni][e]);
              }
        }
      }
    }
    if (GWDB) {  // block kb + 1's W into the other tile (last read by block kb - 1's MMAs, before the last barrier)
      if (kb + 1 < KB) store_block(kb + 1);
      cp_async_wait<0>();  // x tile kb + 1
    }
    __syncthreads();
  }

  // ---- epilogue
#pragma unroll
  for (int mi = 0; mi < G_MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < G_NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const i64 n = n0 + wn * G_WTN + ni * 8 + 2 * (lane & 3) + (e & 1);
        const i64 t = t0 + wm * G_WTM + mi * 16 + (lane >> 2) + (e >> 1) * 8;
        if (t < T && n < N) y[t * ldy + n] = XROW ? acc[mi][ni][e] * xinv[t] : acc[mi][ni][e];
      }
}

// x as f16 rows scaled by 2^e per row for the XROW GEMM (see the header): a block per row, the max |x| first (an
// exact max, so any order), then the scaled pairs and the zero padding up to KP.
extern "C" __global__ void __launch_bounds__(NT) matmul_x_rows(const float* __restrict__ x, int T, i64 ldx,
                                                               u32* __restrict__ xh, float* __restrict__ xinv) {
  LILY_PDL_PROLOGUE();
  constexpr int KP = KB * BK;
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= T) return;
  f16_scaled_row(x + i64(t) * ldx, K, KP, xh + i64(t) * (KP / 2), xinv + t, scratch);
}

// ------------------------------------------------------------------------------------------------------
// GEMV on the tensor cores (decode, q4 with GROUP 64 or a multiple of 128, K % 128 == 0, T <= 8)
//
// Why: the CUDA-core GEMV spends 3 instructions per code (LOP3, FADD, FFMA), which puts its issue ceiling
// near the HBM rate. Here W is the A operand of mma.m16n8k16 (16 rows × 16 k) holding the integer codes,
// made two at a time by one LOP3 ((w >> 4i) & 0x000F000F | 0x43004300 = bf16 pair 128 + q) and one exact
// bf16x2 fma (−128); x is the B operand (k16 × 8 tokens, columns ≥ T zero) as bf16 hi + lo, staged once per
// block in shared memory already in fragment order. ~2.4 instructions per code instead of ~3.8.
// Warp w owns rows [N·w/W, N·(w+1)/W) (W = all warps of the grid; balanced to a row), two 16-row tiles
// at a time; lane (g, c) loads 16 bytes of rows g, g+8, g+16, g+24 per 128-code span (a quad reads 64 contiguous bytes of a
// row), the next span's codes and scales in flight while this span is multiplied. With GROUP 64 a span
// holds two groups: one xor-2 exchange of two words inside each quad makes every k16 step one group
// (lane c then holds span words SWB[c] + {0, 1, 8, 9}; x is staged in that order). At each group's end
// acc += s·D + b·Σx (Σx of the group in f32, shared memory). Reduction order: fixed by K and GROUP.
// Shared memory: x fragments [K/128][8][T][4] × 16 bytes + 8 warps × MV_SWB (scale/bias tile) + Σx
// [T][K/GROUP] f32 (matmul.cpp gemv_mma_smem must match).

constexpr bool MV_OK = BITS == 4 && GROUP > 0 && (GROUP == 64 || GROUP % 128 == 0) && K % 128 == 0;
constexpr bool MV_EXCH = GROUP == 64;
constexpr int MV_SPANS = K / 128;

// Per-warp staging of a 32-row tile's scales and biases in shared memory, as raw elements [group][row] with a
// row stride MV_SRS that puts the 32 lanes' writes (one group each) on distinct banks: 34 u16 or 33 u32.
constexpr int MV_ES = DT == LILY_F32 ? 4 : 2;
constexpr int MV_SRS = MV_ES == 2 ? 34 : 33;
constexpr int MV_SWB = 2 * NG * MV_SRS * MV_ES;  // bytes per warp, scales then biases (matmul.cpp must match)
__device__ __forceinline__ u32 mv_raw(const void* p, i64 i) {  // element i of a scale/bias array, raw bits
  const unsigned char* b = static_cast<const unsigned char*>(p) + i * MV_ES;
  if (SAL) return MV_ES == 4 ? *reinterpret_cast<const u32*>(b) : u32(*reinterpret_cast<const u16*>(b));
  u32 v = u32(b[0]) | (u32(b[1]) << 8);
  if (MV_ES == 4) v |= (u32(b[2]) << 16) | (u32(b[3]) << 24);
  return v;
}
__device__ __forceinline__ void mv_put(unsigned char* p, int i, u32 v) {
  if (MV_ES == 4) reinterpret_cast<u32*>(p)[i] = v;
  else reinterpret_cast<u16*>(p)[i] = u16(v);
}
__device__ __forceinline__ float mv_get(const unsigned char* p, int i) {
  if (DT == LILY_F32) return __uint_as_float(reinterpret_cast<const u32*>(p)[i]);
  const u16 h = reinterpret_cast<const u16*>(p)[i];
  return DT == LILY_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

__device__ __forceinline__ u32 mv_pair(u32 w, int i) {  // bf16 pair (q_i, q_{i+4}) of a q4 word, exact
  const u32 p = ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;  // 128 + q
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(p), "r"(0x3F803F80u), "r"(0xC300C300u));
  return r;
}

extern "C" __global__ void __launch_bounds__(NT, 2)
    matmul_gemv_mma(const float* __restrict__ x, int T, i64 ldx, const unsigned char* __restrict__ W,
                    const void* __restrict__ S, const void* __restrict__ B, float* __restrict__ y, i64 ldy, int N) {
  LILY_PDL_PROLOGUE();
  if (!MV_OK) return;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* xf = reinterpret_cast<uint4*>(smem);
  float* sx = reinterpret_cast<float*>(smem + i64(MV_SPANS) * 8 * T * 4 * 16 + (NT / 32) * MV_SWB);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;

  // ---- stage x: fragments (hi, lo) and Σx per (token, group)
  const int nfrag = MV_SPANS * 8 * T * 4;
  for (int e = tid; e < nfrag; e += NT) {
    const int ec = e & 3, eg = (e >> 2) % T, es = (e / (4 * T)) % 8, sp = e / (32 * T);
    const int wi = es >> 1, h = es & 1;
    const int sw = MV_EXCH ? ((ec == 0 ? 0 : ec == 1 ? 4 : ec == 2 ? 2 : 6) + (wi < 2 ? wi : wi + 6)) : 4 * ec + wi;
    const i64 base = i64(sp) * 128 + 8 * sw + 2 * h;
    const float* xr = x + i64(eg) * ldx;
    u16 hi[4], lo[4];
    split_bf16(xr[base], hi[0], lo[0]);
    split_bf16(xr[base + 4], hi[1], lo[1]);
    split_bf16(xr[base + 1], hi[2], lo[2]);
    split_bf16(xr[base + 5], hi[3], lo[3]);
    xf[e] = make_uint4(pack_bf16(hi[0], hi[1]), pack_bf16(hi[2], hi[3]), pack_bf16(lo[0], lo[1]), pack_bf16(lo[2], lo[3]));
  }
  for (int e = tid; e < T * NG; e += NT) {
    const int et = e / NG, eg = e % NG;
    const float* xr = x + i64(et) * ldx + i64(eg) * GROUP;
    float s = 0.f;
    for (int k = 0; k < GROUP; ++k) s += xr[k];
    sx[e] = s;
  }
  __syncthreads();

  const i64 nw = i64(gridDim.x) * (NT / 32), gw = i64(blockIdx.x) * (NT / 32) + warp;
  const i64 r0 = i64(N) * gw / nw, r1 = i64(N) * (gw + 1) / nw;
  unsigned char* ssw = smem + i64(MV_SPANS) * 8 * T * 4 * 16 + warp * MV_SWB;  // this warp's scales, biases
  unsigned char* bsw = ssw + MV_SWB / 2;
  // Two 16-row tiles per pass: lane rows rt + g + 8·j, j = 0..3 (tile j / 2). Codes: 4 × 16 bytes per lane
  // per span, two spans in flight ahead of the one being multiplied (~8 MB across the GPU).
  for (i64 rt = r0; rt < r1; rt += 32) {
    i64 row[4];
    bool live[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) row[j] = rt + g + 8 * j, live[j] = row[j] < r1;
    auto load_span = [&](int sp, u32 (&q)[4][4]) {
      const i64 off = i64(sp) * 64 + 16 * c;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (live[j]) mm_load16<AL>(W + row[j] * RBYTES + off, 16, q[j]);
        else q[j][0] = q[j][1] = q[j][2] = q[j][3] = 0u;
      }
    };
    u32 w0[4][4], w1[4][4], w2[4][4];
    load_span(0, w0);
    if (MV_SPANS > 1) load_span(1, w1);
    // The tile's scales and biases (rows rt .. rt+31 are contiguous in memory: coalesced element loads, ~3
    // lines per warp instruction) into this warp's shared slice as [group][row]; per-span loads of them
    // touched 8 lines per instruction, 16 instructions per span: the L1 wavefronts capped the kernel.
    __syncwarp();
#pragma unroll 8
    for (int e = lane; e < 32 * NG; e += 32) {
      const int rl = e / NG, grp = e % NG;
      const bool ok = rt + rl < r1;
      const i64 gi = rt * NG + e;
      const u32 sv = ok ? mv_raw(S, gi) : 0u, bv = ok ? mv_raw(B, gi) : 0u;
      mv_put(ssw, grp * MV_SRS + rl, sv);
      mv_put(bsw, grp * MV_SRS + rl, bv);
    }
    __syncwarp();
    float acc[2][4], dg[2][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][e] = dg[m][e] = 0.f;
#pragma unroll 3  // three code buffers rotate: no copies
    for (int sp = 0; sp < MV_SPANS; ++sp) {
      if (sp + 2 < MV_SPANS) load_span(sp + 2, w2);
      if (MV_EXCH) {  // lanes 0,1 keep words 0,1 and take the partner's 0,1; lanes 2,3 keep 2,3
        const bool low = c < 2;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const u32 e0 = __shfl_xor_sync(0xffffffffu, low ? w0[j][2] : w0[j][0], 2);
          const u32 e1 = __shfl_xor_sync(0xffffffffu, low ? w0[j][3] : w0[j][1], 2);
          if (low) {
            w0[j][2] = e0, w0[j][3] = e1;
          } else {
            w0[j][0] = e0, w0[j][1] = e1;
          }
        }
      }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int wi = s >> 1, h = s & 1;
        uint4 f = make_uint4(0u, 0u, 0u, 0u);
        if (g < T) f = xf[((sp * 8 + s) * T + g) * 4 + c];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const u32 a[4] = {mv_pair(w0[2 * m][wi], 2 * h), mv_pair(w0[2 * m + 1][wi], 2 * h),
                            mv_pair(w0[2 * m][wi], 2 * h + 1), mv_pair(w0[2 * m + 1][wi], 2 * h + 1)};
          mma_m16n8k16(dg[m], a, f.x, f.y);
          if (XS == 2) mma_m16n8k16(dg[m], a, f.z, f.w);
        }
        const bool gend = MV_EXCH ? (s == 3 || s == 7) : (s == 7 && ((sp + 1) * 128) % (GROUP ? GROUP : 1) == 0);
        if (gend) {
          const int q = MV_EXCH ? (s == 7 ? 1 : 0) : 0;
          const int grp = MV_EXCH ? 2 * sp + q : (sp * 128) / (GROUP ? GROUP : 1);
          const int t0 = 2 * c, t1 = 2 * c + 1;
          const float x0 = t0 < T ? sx[t0 * NG + grp] : 0.f, x1 = t1 < T ? sx[t1 * NG + grp] : 0.f;
          float scj[4], bij[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) scj[j] = mv_get(ssw, grp * MV_SRS + g + 8 * j), bij[j] = mv_get(bsw, grp * MV_SRS + g + 8 * j);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            // C fragment: e 0,1 = row g of the tile (tokens 2c, 2c+1), e 2,3 = row g + 8
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int j = 2 * m + (e >> 1);
              acc[m][e] = fmaf(scj[j], dg[m][e], acc[m][e]);
              acc[m][e] = fmaf(bij[j], (e & 1) ? x1 : x0, acc[m][e]);
              dg[m][e] = 0.f;
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) w0[j][i] = w1[j][i], w1[j][i] = w2[j][i];
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = 2 * m + (e >> 1), t = 2 * c + (e & 1);
        if (live[j] && t < T) y[i64(t) * ldy + row[j]] = acc[m][e];
      }
  }
}
#endif  // NORM == 0
