// Matmul on CUDA: out[T, N] = x[T, K] · Wᵀ (Ops::matmul), kernels/matmul.cu, oracle csrc/cpu/matmul.cpp.
//
// Variants (select_matmul is the one place that decides; matmul_impl launches what it returns and
// matmul_variant reports the same name):
// - phase Decode, T <= 16 (more rows in a decode step are refused): 4/8-bit affine weights with 16-byte rows,
//   aligned scales and groups of whole chunks (every projection of the real model, the lm_head included) take
//   matmul_gemv_dp4a (x as three int8 terms, integer dot products: ~1.4 instructions per 4-bit code; measured
//   +5.5% decode over the fp32 forms, +9% with the lm_head on it: benchmarks/NOTES.md). Otherwise, or with
//   gemv_dp4a=False: weights of 32 MiB and more in q4 (group 64 or a multiple of 128, K % 128 == 0) take
//   matmul_gemv_mma for T <= 8 (the fp32 CUDA-core GEMV spends ~3.8 instructions per code, the tensor-core form
//   ~2.4), the rest matmul_gemv (x in registers, W streamed once with 16-byte loads). Prefill: matmul_gemm for every T (tensor cores, W dequantized into
//   shared memory tile by tile), never the GEMV, so a prefill in chunks of any size gives the same bits as
//   one prefill (STYLE.md §5: select by phase and weight, not by T).
// - Alignment (checkpoints map tensors at any byte offset): the code loads are 16-byte (AL 16) when data(w)
//   and the row stride are 16-byte aligned, 4-byte (AL 4) when both are 4-byte aligned, else the funnel
//   form (AL 1: aligned words realigned in registers). Scales/biases off their element alignment are read
//   byte-wise (SAL 0). Each case is named in the variant and its reason.
// - GEMM weight staging (WM in matmul.cu): affine with GROUP % 16 == 0 tiling the 64-wide K block (or
//   tiled by it) keeps integer codes (exact in bf16 and f16) and applies scale and bias per group in fp32; dense
//   bf16 is staged as is; dense f32/f16 and other affine groups as bf16 hi + lo of the fp32 value. x (backend
//   option prefill_x): one f16 term scaled by 2^e per row and group part with f16 codes (XF 1, the default, error
//   ~2.4e-4; codes mode only, the other modes take hi + lo and say so), bf16 hi + lo (error ~1e-5), or one bf16
//   term (error ~2e-3); decode GEMVs are not affected.
// - GEMM tiles: 64 rows, or 16 when even 4x the 64-row grid's blocks fit on the SMs at one each (small T and small
//   N: the router, the shared expert, b/a, k/v at T <= 512), 32 when 2x does (out_proj at T = 256): those few blocks
//   each walked the whole K alone; smaller tiles make more blocks with fewer MMAs per K block each (each still
//   converts a whole W tile, so grids closer to the SM count measured slower with 16 rows). Each output's sums (Σx
//   per 16-input run, the MMAs per k16 step, the group folds) are the same at any height, so the bits are too and
//   choosing by T keeps a prefill in chunks equal to one prefill (backend option gemm_small_tiles).
// Module defines come from the weight alone (K, BITS, DT, GROUP, AL, SAL, XS, XF; GBM 32 / 16 for the small-grid GEMM
// modules): one module serves both phases for one (K, format, alignment); the real Qwen3.6 checkpoint needs about
// six, and a 32 and a 16-row GEMM module per format its small grids use.
#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "cuda/backend.h"

namespace lily::cuda {

// Must match struct GemvNorm in kernels/matmul.cu (NORM 1 / 2).
struct GemvNorm {
  uint64_t b;
  int64_t ldb;
  uint64_t w, sum;
  int64_t lds;
  uint64_t normed;
  int64_t ldn;
  uint64_t counters;
  float eps;
  int32_t pad;
};
static_assert(sizeof(GemvNorm) == 72, "must match kernels/matmul.cu");

namespace {

constexpr int kThreads = 256;          // NT in matmul.cu
constexpr int kGemvRows = 4;           // GEMV_U
constexpr int kGemvBlocksPerSm = 2;    // GEMV_MINB (__launch_bounds__ guarantees the registers)
constexpr int kGemmBM = 64, kGemmBN = 128;  // BM (the big tiles; 32 / 16 for small grids), BN
// GEMM_SMEM of matmul_gemm at tile rows bm: x hi + lo [bm][72] bf16, W hi + lo [128][72] bf16, Σx [bm][4] f32,
// scales and biases [128][4] f32, x's part scales [bm][4] f32 (61,440 bytes at 64, 51,200 at 32, 46,080 at 16).
int gemm_smem(int bm) { return 2 * bm * 144 + 2 * kGemmBN * 144 + 2 * bm * 16 + 2 * kGemmBN * 16; }
constexpr int kGemmBK = 64;            // BK
constexpr int kXSplit = 2;             // XS
constexpr int64_t kMaxDecodeRows = 16;
constexpr int64_t kMmaMaxRows = 8;                // matmul_gemv_mma: tokens are the n8 of the MMA
constexpr size_t kMmaMinBytes = size_t(32) << 20;  // below this the mma GEMV's per-warp K walk is latency bound
constexpr int kMmaBlocksPerSm = 2;                 // __launch_bounds__(NT, 2) of matmul_gemv_mma

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int pow2ceil(int64_t v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

int dtype_code(DType t) {
  switch (t) {
    case DType::F32: return 0;   // LILY_F32
    case DType::F16: return 1;   // LILY_F16
    case DType::BF16: return 2;  // LILY_BF16
    default: return -1;
  }
}

// "q4g64-bf16 [248320, 2048]" / "f32 [3, 7]"
std::string describe(const Weight& w) {
  std::string s = w.describe();
  if (w.quantized()) s += std::string("-") + dtype_name(w.scale_dtype);
  return s + " [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) + "]";
}

void validate(const Weight& w) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument("cuda matmul: weight " + describe(w) + ": " + why);
  };
  if (!w.valid()) fail("has no mapping");
  if (w.rows <= 0 || w.cols <= 0) fail("empty shape");
  if (w.rows > INT_MAX) fail("more than 2^31 - 1 rows");
  if (w.quantized()) {
    if (w.bits != 2 && w.bits != 4 && w.bits != 8) fail("affine bits must be 2, 4 or 8");
    if (w.group <= 0 || w.cols % w.group != 0 || w.group % (32 / w.bits) != 0)
      fail("group " + std::to_string(w.group) + " does not tile cols (and whole words)");
    if (dtype_code(w.scale_dtype) < 0) fail("scales must be f32, f16 or bf16");
  } else if (dtype_code(w.dtype) < 0) {
    fail("dense weight must be f32, f16 or bf16");
  }
}

int alignment_of(uint64_t addr, uint64_t stride) {
  const uint64_t a = addr | stride;
  return a % 16 == 0 ? 16 : a % 4 == 0 ? 4 : 1;
}

// matmul_gemv_mma's format conditions (MV_OK in matmul.cu) and weight size.
bool gemv_mma_fits(const Weight& w) {
  return w.quantized() && w.bits == 4 && (w.group == 64 || w.group % 128 == 0) && w.cols % 128 == 0 &&
         w.bytes() >= kMmaMinBytes;
}
// Shared memory of matmul_gemv_mma for T tokens: x fragments + per-warp scale/bias tiles (MV_SWB: 2 arrays
// × groups × MV_SRS rows × element size) + Σx (matmul.cu's layout).
int gemv_mma_smem(const Weight& w, int64_t T) {
  const int64_t ng = w.cols / w.group, es = dtype_size(w.scale_dtype), srs = es == 2 ? 34 : 33;
  return int((w.cols / 128) * 8 * T * 4 * 16 + (kThreads / 32) * 2 * ng * srs * es + T * ng * 4);
}

// Rows one pass of a matmul_gemv block covers (RPP in matmul.cu).
int64_t gemv_rows_per_pass(const Weight& w) {
  const int64_t chunks = ceil_div(int64_t(w.row_bytes()), 16);
  return kThreads / std::min<int64_t>(pow2ceil(chunks), kThreads);
}
// matmul_gemv_u1 (one row per thread) when every row fits in one pass of the grid; from N alone (never T),
// so a row's bits do not depend on T.
bool gemv_one_row(const CudaOps& ops, const Weight& w, int64_t rows) {
  return ceil_div(rows, gemv_rows_per_pass(w)) <= int64_t(kGemvBlocksPerSm) * std::max(1, ops.info().sms);
}
bool gemv_one_row(const CudaOps& ops, const Weight& w) { return gemv_one_row(ops, w, w.rows); }

// Must match struct GemvParts in kernels/matmul.cu.
constexpr int kGemvParts = 4;
struct GemvParts {
  uint64_t W[kGemvParts], S[kGemvParts], B[kGemvParts], y[kGemvParts];
  int64_t ldy[kGemvParts];
  int32_t N[kGemvParts];
  int32_t bstart[kGemvParts + 1];
  int32_t np;
};
static_assert(sizeof(GemvParts) == 4 * 8 * 4 + 8 * 4 + 4 * 4 + 4 * 5 + 4, "must match kernels/matmul.cu");

// matmul_gemv_async for these weights: its stage count (GEMV_STAGES in matmul.cu: 4, or 3 where 4 do not fit)
// and dynamic shared memory (stages · NT · U·J·(16 + 8·NSG) bytes), or {0, 0} where the register form runs:
// dense weights, codes or rows not 16-byte aligned, scale or bias arrays not 4-byte aligned, the option off, or
// more shared memory than two blocks per SM can have.
struct GemvAsync {
  int stages = 0, smem = 0;
};
GemvAsync gemv_async(const CudaOps& ops, const Weight* w, int n, bool u1) {
  if (!ops.options().gemv_async) return {};
  for (int i = 0; i < n; ++i) {
    const Weight& x = w[i];
    if (!x.quantized() || alignment_of(uint64_t(ops.data(x)), x.row_bytes()) != 16 ||
        uint64_t(ops.scales(x)) % 4 != 0 || uint64_t(ops.biases(x)) % 4 != 0)
      return {};
  }
  const int64_t chunks = ceil_div(int64_t(w[0].row_bytes()), 16);
  const int64_t tpr = std::min<int64_t>(pow2ceil(chunks), kThreads), j = ceil_div(chunks, tpr);
  const int64_t epc = 128 / w[0].bits, sg = std::min<int64_t>(w[0].group, epc), nsg = epc / sg;
  // Static shared memory: x staged as C chunks of EPC + 4 floats when that is at most 36 KB (XSH), the reduction.
  const int64_t xsh = chunks * (epc + 4) * 4;
  const int64_t fixed = (xsh <= 36 * 1024 ? xsh : 16) + 1024;
  const int64_t cap = std::min<int64_t>(ops.info().max_smem_optin, 227 * 1024 / kGemvBlocksPerSm);
  for (int stages : {4, 3}) {
    const int64_t bytes = int64_t(stages) * kThreads * (u1 ? 1 : kGemvRows) * j * (16 + 8 * nsg);
    if (bytes + fixed <= cap) return {stages, int(bytes)};
  }
  return {};
}

// matmul_gemv_dp4a's conditions (the #if in matmul.cu): 4/8-bit affine, 16-byte-aligned codes and rows, scales and
// biases aligned to their dtype, groups of whole 16-byte chunks, x stageable in 36 KB; and the option.
bool gemv_dp4a_fits(const CudaOps& ops, const Weight& w) {
  if (!ops.options().gemv_dp4a || !w.quantized() || (w.bits != 4 && w.bits != 8)) return false;
  const int64_t epc = 128 / w.bits, chunks = ceil_div(int64_t(w.row_bytes()), 16);
  const uint64_t es = dtype_size(w.scale_dtype);
  return alignment_of(uint64_t(ops.data(w)), w.row_bytes()) == 16 && uint64_t(ops.scales(w)) % es == 0 &&
         uint64_t(ops.biases(w)) % es == 0 && w.group % epc == 0 && chunks * (epc + 4) * 4 <= 36 * 1024;
}
// Rows of one warp batch of matmul_gemv_dp4a (RB8 = RU8 · RWP8 in matmul.cu).
int64_t gemv_dp4a_rows(const Weight& w) {
  const int64_t chunks = ceil_div(int64_t(w.row_bytes()), 16);
  const int64_t tpr = std::min<int64_t>(pow2ceil(chunks), 32), j = ceil_div(chunks, tpr);
  return (j >= 4 ? 1 : 4 / j) * (32 / tpr);
}

struct MatmulVariant {
  bool gemm = false, mma = false, dp4a = false, xrow = false;
  std::string name, reason;
  Defines defines;
};

MatmulVariant select_matmul(const CudaOps& ops, const Weight& w, Phase phase) {
  validate(w);
  MatmulVariant v;
  v.gemm = phase == Phase::Prefill;
  const int al = alignment_of(uint64_t(ops.data(w)), w.row_bytes());
  int sal = 1;
  if (w.quantized()) {
    const uint64_t es = dtype_size(w.scale_dtype);
    sal = (uint64_t(ops.scales(w)) % es == 0 && uint64_t(ops.biases(w)) % es == 0) ? 1 : 0;
  }
  const int dt = w.quantized() ? dtype_code(w.scale_dtype) : dtype_code(w.dtype);
  // The prefill GEMM's x form: f16 needs the codes mode (WM 0 in matmul.cu), the others fall back to hi + lo.
  const bool codes = w.quantized() && w.group % 16 == 0 && (w.group % kGemmBK == 0 || kGemmBK % w.group == 0);
  const CudaOptions::XForm xform = ops.options().prefill_x;
  const bool xf16 = v.gemm && xform == CudaOptions::XForm::F16 && codes;
  const int xs = !v.gemm ? kXSplit : xform == CudaOptions::XForm::BF16 || xf16 ? 1 : 2;
  v.defines = {{"K", w.cols}, {"BITS", w.quantized() ? w.bits : 0}, {"DT", dt}, {"GROUP", w.quantized() ? w.group : 0},
               {"AL", al}, {"SAL", sal}, {"XS", xs}, {"XF", xf16 ? 1 : 0}};
  // 4-bit codes: each warp widens its columns' codes into B fragments (matmul.cu GFRAG), unless gemm_frag=False.
  const bool gfrag = v.gemm && codes && w.bits == 4 && ops.options().gemm_frag;
  if (gfrag) v.defines.push_back({"GFRAG", 1});
  // f16 weights in the W tile (matmul.cu WF16): x as f16, the converted tile, one group per 16-byte chunk of codes.
  const char* no_wf16 = !ops.options().gemm_w_f16          ? "gemm_w_f16=False"
                        : !xf16                           ? "x is not one f16 term"  // (decode, dense weights too)
                        : gfrag                           ? "gemm_frag widens the codes per warp"
                        : w.group % (128 / w.bits) != 0   ? "a 16-byte chunk of codes spans two groups"
                                                          : nullptr;
  const bool wf16 = no_wf16 == nullptr;  // xf16: a prefill GEMM of affine codes (bits 2, 4 or 8)
  if (wf16) v.defines.push_back({"WF16", 1});
  // x as f16 rows scaled once per row by a pre-pass (matmul.cu XROW), accumulated without a fold.
  v.xrow = wf16 && ops.options().gemm_x_rows;
  if (v.xrow) v.defines.push_back({"XROW", 1});

  const std::string kind = w.quantized() ? "q" + std::to_string(w.bits) : dtype_name(w.dtype);
  std::string fmt = w.quantized() ? "g" + std::to_string(w.group) + "_" + dtype_name(w.scale_dtype) + "s" : "";
  const std::string loads = al == 16 ? "16-byte loads" : al == 4 ? "4-byte loads (data or row stride not 16-byte aligned)"
                                                                 : "funnel-shifted word loads (data or row stride not 4-byte aligned)";
  const std::string ld_suffix = al == 16 ? "" : al == 4 ? "_ld4" : "_ldfunnel";
  const std::string sc_suffix = sal ? "" : "_scalebytes";
  const std::string sc_reason = sal ? "" : ", scales/biases read byte-wise (not aligned to their dtype)";
  if (!v.gemm && gemv_dp4a_fits(ops, w)) {
    v.dp4a = true;
    const int64_t rb = gemv_dp4a_rows(w);
    v.name = "gemv_" + kind + "_dp4a_" + fmt;
    v.reason = "x quantized per 16-byte chunk into three int8 terms (error ~1e-7 relative) and dotted with the codes "
               "by dp4a, fp32 per-chunk combine with the group's scale and bias; a warp per " + std::to_string(rb) +
               (rb == 1 ? " row" : " rows") + " per batch, the next batch's 16-byte loads in flight during this one's "
               "arithmetic" + (ops.options().gemv_ahead == 2 ? ", the first two batches loaded before the wait" : "") +
               ", persistent grid, 16-byte loads";
  } else if (!v.gemm && gemv_mma_fits(w) && gemv_mma_smem(w, kMmaMaxRows) <= ops.info().max_smem_optin) {
    v.mma = true;
    v.name = "gemv_" + kind + "_mma_" + fmt + ld_suffix + sc_suffix;
    v.reason = "tensor-core GEMV for T <= 8 (codes as bf16 A operand, x as bf16 hi+lo B operand, fp32 per-group "
               "scale/bias staged per 32-row tile in shared memory), warps own balanced row ranges, 2 tiles of 16 "
               "rows per pass, 2 spans of codes in flight, " + loads + sc_reason +
               "; T > 8 takes the CUDA-core GEMV" + std::string(ops.options().gemv_dp4a ? "" : " (gemv_dp4a=False)");
  } else if (!v.gemm) {
    const int64_t rpp = gemv_rows_per_pass(w);
    const bool u1 = gemv_one_row(ops, w);
    const GemvAsync as = gemv_async(ops, &w, 1, u1);
    v.name = "gemv_" + kind + "_cuda" + (as.stages ? "_async" : "") + (fmt.empty() ? "" : "_" + fmt) + ld_suffix +
             sc_suffix;
    v.reason = "x staged through shared memory into registers, " + std::to_string(kThreads / rpp) +
               " threads per row, " + std::to_string(rpp * (u1 ? 1 : kGemvRows)) + " rows per block batch (" +
               (u1 ? "1 row per thread: every row in one pass of the grid" : "4 rows per thread, persistent grid") +
               "), " + loads + sc_reason +
               (as.stages ? ", codes/scales/biases staged by cp.async " + std::to_string(as.stages) + " batches deep"
                          : ", register double buffer" + std::string(ops.options().gemv_async ? " (dense or unaligned weights)"
                                                                                           : " (gemv_async=False)")) +
               (w.quantized() && !ops.options().gemv_dp4a ? "; fp32 x (gemv_dp4a=False)" : "");
  } else {
    const std::string mode = codes ? "codes" : (!w.quantized() && w.dtype == DType::BF16) ? "bf16" : "split";
    v.name = "gemm_" + kind + "_mma_" + mode + (fmt.empty() ? "" : "_" + fmt) +
             (xf16 ? "_xf16" : "_x" + std::to_string(xs)) + (gfrag ? "_frag" : "") + (wf16 ? "_wf16" : "") +
             (v.xrow ? "_xrows" : "") + ld_suffix + sc_suffix;
    const bool f16_refused = xform == CudaOptions::XForm::F16 && !codes;
    v.reason = std::string("mma.sync m16n8k16 ") + (xf16 ? "f16" : "bf16") +
               ", tile 64x128x64, next K block prefetched into registers during the MMAs, 2 blocks per SM, " +
               (wf16  ? std::string("weights dequantized to f16 (s·q + b) in the shared tile") +
                            (v.xrow ? " (gemm_w_f16)" : ", each group part folded by the x scale alone (gemm_w_f16)")
                : codes ? "integer codes with fp32 per-group scale/bias" +
                            std::string(gfrag ? ", each warp widening its columns' 4-bit codes into B fragments (gemm_frag)"
                                        : w.bits == 4 ? ", a converted W tile in shared memory (gemm_frag=False)"
                                                      : ", a converted W tile in shared memory (8/2-bit codes)")
                      : mode == "bf16" ? "bf16 weights as stored" : "weights as bf16 hi+lo") +
               (codes && !wf16 && ops.options().gemm_w_f16 ? std::string(" (no f16 weight tile: ") + no_wf16 + ")" : "") +
               ", x as " +
               (v.xrow ? "f16 rows scaled by 2^e per row by a pre-pass (matmul_x_rows, once per op and x), copied "
                         "into two alternating tiles by cp.async, the MMAs accumulating straight into the outputs "
                         "(gemm_x_rows)"
                : xf16 ? "one f16 term scaled by 2^e per row and group part (prefill_x = f16)" +
                             std::string(wf16 ? " (gemm_x_rows=False)" : "")
                     : xs == 2 ? std::string("bf16 hi+lo") +
                                     (f16_refused ? " (prefill_x = f16 needs integer codes in groups tiling the 64-wide "
                                                    "K block)" : " (prefill_x = bf16x2)")
                               : "one bf16 term (prefill_x = bf16)") +
               ", " + loads + sc_reason;
  }
  return v;
}

}  // namespace

// Bytes of one slot of the XROW x rows (backend.h): the f16 rows, then the rows' 2^-e, each part 256-byte aligned.
size_t CudaOps::xrow_slot_bytes() const { return xrow_scales_at() + (size_t(xrows_rows_) * 4 + 255) / 256 * 256; }
// Where the rows' 2^-e start inside a slot.
size_t CudaOps::xrow_scales_at() const { return (size_t(xrows_rows_) * size_t(xrows_kp_) * 2 + 255) / 256 * 256; }

void CudaOps::reserve_matmul(int64_t rows, int64_t cols) {
  if (!opt_.gemm_w_f16 || !opt_.gemm_x_rows || rows <= 0 || cols <= 0) return;
  const int64_t kp = ceil_div(cols, int64_t(kGemmBK)) * kGemmBK;
  if (rows <= xrows_rows_ && kp <= xrows_kp_) return;
  const int64_t old_rows = xrows_rows_, old_kp = xrows_kp_;
  xrows_rows_ = std::max(rows, old_rows);
  xrows_kp_ = std::max(kp, old_kp);
  Tensor grown;
  try {
    grown = alloc("workspace", DType::F32, 1, int64_t(kXRowSlots * xrow_slot_bytes() / 4));
  } catch (...) {
    xrows_rows_ = old_rows, xrows_kp_ = old_kp;
    throw;
  }
  release(xrows_);
  xrows_ = grown;
  xrows_op_ = -1;
}

// For a stacked weight (engine.report() asks about the routed experts) the variant of one expert's matrix.
std::string CudaOps::matmul_variant(const Weight& w, Phase phase) const {
  return select_matmul(*this, w.experts > 1 ? w.expert(0) : w, phase).name;
}

void CudaOps::matmul_impl(const Tensor& x, const Weight& w, const Tensor& out) {
  if (w.experts > 1)
    throw std::invalid_argument("cuda matmul: weight " + describe(w) + " is a stack of " + std::to_string(w.experts) +
                                " experts (matmul takes one matrix)");
  const MatmulVariant v = select_matmul(*this, w, phase());
  const int64_t T = x.rows, K = w.cols, N = w.rows;
  if (x.dtype != DType::F32 || out.dtype != DType::F32)
    throw std::invalid_argument("cuda matmul: x and out must be f32 (weight " + describe(w) + ")");
  if (x.cols != K || out.cols != N || out.rows != T)
    throw std::invalid_argument("cuda matmul: x [" + std::to_string(T) + ", " + std::to_string(x.cols) +
                                "] and out [" + std::to_string(out.rows) + ", " + std::to_string(out.cols) +
                                "] do not fit weight " + describe(w));
  if (x.stride < K || out.stride < N) throw std::invalid_argument("cuda matmul: row stride below the row length");
  if (T <= 0) return;
  if (T > INT_MAX) throw std::invalid_argument("cuda matmul: too many rows");

  const std::string key = std::string("matmul.") + (v.gemm ? "prefill." : "decode.") + describe(w);
  const CUdeviceptr S = w.quantized() ? scales(w) : 0, B = w.quantized() ? biases(w) : 0;
  const int Ti = int(T), Ni = int(N);
  const int64_t ldx = x.stride, ldy = out.stride;

  if (!v.gemm) {
    note_variant(key, v.name + ": " + v.reason);
    if (T > kMaxDecodeRows)
      throw std::invalid_argument("cuda matmul: decode GEMV takes at most " + std::to_string(kMaxDecodeRows) +
                                  " rows, got " + std::to_string(T) + " (weight " + describe(w) + ")");
    if (v.mma && T <= kMmaMaxRows) {
      const Kernel& k = kernel("matmul", "matmul_gemv_mma", v.defines);
      const int smem = gemv_mma_smem(w, T);
      if (smem > 48 * 1024 && k.max_dynamic_smem < smem) set_dynamic_smem(k, smem);
      const int64_t blocks = std::min<int64_t>(int64_t(kMmaBlocksPerSm) * std::max(1, info().sms),
                                               ceil_div(N, 32 * (kThreads / 32)));
      launch(k, Dim3{unsigned(blocks), 1, 1}, Dim3{unsigned(kThreads), 1, 1}, uint32_t(smem), ptr(x), Ti, ldx,
             data(w), S, B, ptr(out), ldy, Ni);
      return;
    }
    launch_gemv(x, &w, &out, 1, v.defines);
    return;
  }
  const int64_t gy = ceil_div(N, kGemmBN);
  if (gy > 65535) throw std::invalid_argument("cuda matmul: weight " + describe(w) + " has too many rows for the GEMM grid");
  // 16 / 32-row tiles when 4x / 2x the 64-row grid still fits the SMs one block each (see the header): the same bits.
  const int64_t big_blocks = ceil_div(T, kGemmBM) * gy, sms = std::max(1, info().sms);
  const int64_t blocks128 = ceil_div(T, 128) * gy;
  const int bm = v.xrow && options().gemm_tile128 && blocks128 >= 2 * sms ? 128
                 : !options().gemm_small_tiles ? kGemmBM
                 : 4 * big_blocks <= sms ? 16
                 : 2 * big_blocks <= sms ? 32
                                         : kGemmBM;
  Defines d = v.defines;
  if (bm != kGemmBM) d.push_back({"GBM", bm});
  const bool wdouble = v.xrow && options().gemm_w_double;  // two alternating W tiles (matmul.cu GWDB)
  if (wdouble) d.push_back({"GWDB", 1});
  const int smem = gemm_smem(bm);
  const std::string grid = std::to_string(big_blocks) + " blocks";
  note_variant(key, v.name + (bm != kGemmBM ? "_m" + std::to_string(bm) : "") + (wdouble ? "_wdb" : "") + ": " +
                        v.reason + "; " +
                        (bm == 128  ? "128-row tiles (the 128-row grid, " + std::to_string(blocks128) +
                                        " blocks, fills every SM twice; warp tiles 32 x 64, gemm_tile128)"
                         : bm == 16 ? "16-row tiles (the 64-row grid, " + grid +
                                        ", is at most a quarter of the SMs: 4x the blocks, a quarter of the MMAs each)"
                         : bm == 32 ? "32-row tiles (the 64-row grid, " + grid +
                                        ", is at most half the SMs: 2x the blocks, half the MMAs each)"
                                    : "64-row tiles (" + std::string(options().gemm_small_tiles
                                                                         ? grid + ", over half the SMs"
                                                                         : "gemm_small_tiles=False") +
                                          ")") +
                        (wdouble ? "; two alternating W tiles, one barrier per K block (gemm_w_double)" : ""));
  CUdeviceptr xa = ptr(x), xinv = 0;
  int64_t lda = ldx;
  if (v.xrow) {  // x as f16 rows in this op's slot (backend.h), written once per op and x
    const int64_t kp = ceil_div(K, int64_t(kGemmBK)) * kGemmBK;
    if (T > xrows_rows_ || kp > xrows_kp_)
      throw std::logic_error("cuda matmul: the f16 x rows scratch holds " + std::to_string(xrows_rows_) + " rows of " +
                             std::to_string(xrows_kp_) + " inputs, weight " + describe(w) + " needs " +
                             std::to_string(T) + " of " + std::to_string(kp) + " (reserve / reserve_matmul size it)");
    xa = ptr(xrows_) + CUdeviceptr(xrow_slot()) * xrow_slot_bytes();
    xinv = xa + xrow_scales_at();
    lda = kp;
    const std::string src = std::to_string(ptr(x)) + ":" + std::to_string(T) + ":" + std::to_string(ldx) + ":" +
                            std::to_string(K);
    if (xrows_op_ != op_ || xrows_src_ != src) {
      launch(kernel("matmul", "matmul_x_rows", v.defines), Dim3{unsigned(T), 1, 1}, Dim3{unsigned(kThreads), 1, 1}, 0u,
             ptr(x), Ti, ldx, xa, xinv);
      xrows_op_ = op_;
      xrows_src_ = src;
    }
  }
  const Kernel& k = kernel("matmul", "matmul_gemm", d);
  if (k.max_dynamic_smem < smem) set_dynamic_smem(k, smem);
  launch(k, Dim3{unsigned(ceil_div(T, bm)), unsigned(gy), 1}, Dim3{unsigned(kThreads), 1, 1}, uint32_t(smem), xa,
         Ti, lda, data(w), S, B, ptr(out), ldy, Ni, xinv);
}

// The CUDA-core GEMV over n parts (one weight format, the same x): each part's rows start on a block batch.
void CudaOps::launch_gemv(const Tensor& x, const Weight* w, const Tensor* out, int n, const Defines& defines,
                          const GemvNorm* norm) {
  const int64_t T = x.rows;
  int64_t rows = 0;
  for (int i = 0; i < n; ++i) rows += w[i].rows;
  // The kernel and its geometry (as matmul.cu derives it: must match). Every part has w[0]'s module defines, so
  // the same conditions. rb: rows per batch; per_block: batches one block serves at once (dp4a: one per warp).
  Defines d = defines;
  const char* name;
  int smem = 0;
  int64_t rb, per_block = 1;
  if (gemv_dp4a_fits(*this, w[0])) {
    name = "matmul_gemv_dp4a";
    rb = gemv_dp4a_rows(w[0]);
    if (options().gemv_ahead == 2) d.push_back({"GEMV_AHEAD", 2});
    per_block = kThreads / 32;
  } else {  // U from all the parts' rows, never from T
    const int64_t rpp = gemv_rows_per_pass(w[0]);
    const bool u1 = gemv_one_row(*this, w[0], rows);
    const GemvAsync as = gemv_async(*this, w, n, u1);
    smem = as.smem;
    name = as.stages ? (u1 ? "matmul_gemv_async_u1" : "matmul_gemv_async") : (u1 ? "matmul_gemv_u1" : "matmul_gemv");
    if (as.stages && as.stages != 4) d.push_back({"GEMV_STAGES", as.stages});
    rb = rpp * (u1 ? 1 : kGemvRows);
  }
  if (norm) d.push_back({"NORM", norm->b ? 2 : 1});
  const Kernel& k = kernel("matmul", name, d);
  if (smem > 48 * 1024 && k.max_dynamic_smem < smem) set_dynamic_smem(k, smem);
  GemvParts P{};
  P.np = n;
  int64_t batches = 0;
  for (int i = 0; i < n; ++i) {
    P.W[i] = data(w[i]);
    P.S[i] = w[i].quantized() ? scales(w[i]) : 0;
    P.B[i] = w[i].quantized() ? biases(w[i]) : 0;
    P.y[i] = ptr(out[i]);
    P.ldy[i] = out[i].stride;
    P.N[i] = int32_t(w[i].rows);
    P.bstart[i] = int32_t(batches);
    batches += ceil_div(w[i].rows, rb);
  }
  if (batches > INT_MAX) throw std::invalid_argument("cuda matmul: too many rows in one GEMV launch");
  for (int i = n; i <= kGemvParts; ++i) P.bstart[i] = int32_t(batches);
  const int64_t slots = std::max<int64_t>(1, int64_t(kGemvBlocksPerSm) * std::max(1, info().sms) / T);
  const int64_t nb = std::min(ceil_div(batches, per_block), slots);
  const Dim3 grid{unsigned(nb * T), 1, 1}, block{unsigned(kThreads), 1, 1};
  if (norm)
    launch(k, grid, block, uint32_t(smem), ptr(x), int(T), int64_t(x.stride), P, *norm);
  else
    launch(k, grid, block, uint32_t(smem), ptr(x), int(T), int64_t(x.stride), P);
}

namespace {

// Why the products of g cannot be one CUDA-core GEMV launch in decode ("" when they can); v0 gets the first
// product's variant.
std::string gemv_group_blocker(const CudaOps& ops, const Tensor& x, const MatmulGroup& g, Phase phase,
                               MatmulVariant& v0) {
  std::string why;
  v0 = select_matmul(ops, g.w[0], phase);
  for (int i = 0; i < g.n && why.empty(); ++i) {
    const Weight& w = g.w[size_t(i)];
    const Tensor& out = g.out[size_t(i)];
    if (w.experts > 1) why = "a stacked weight";
    const MatmulVariant v = select_matmul(ops, w, phase);
    if (v.mma) why = "a tensor-core GEMV part (" + describe(w) + ")";
    else if (v.defines != v0.defines) why = "weights of different formats or alignment";
    if (x.dtype != DType::F32 || out.dtype != DType::F32 || x.cols != w.cols || out.cols != w.rows ||
        out.rows != x.rows || x.stride < w.cols || out.stride < w.rows)
      why = "shapes checked per product";  // matmul_impl names the mismatch
  }
  if (x.rows > kMaxDecodeRows) why = "more rows than the decode GEMV takes";
  return why;
}

std::string group_names(const MatmulGroup& g) {
  std::string names;
  for (int i = 0; i < g.n; ++i) names += (i ? " + " : "") + describe(g.w[size_t(i)]);
  return names;
}

}  // namespace

// Decode: the products whose weights share one CUDA-core GEMV module run as one launch (the real model's
// groups all do: 4-bit input projections, the 8-bit router with the 8-bit shared gate); any other group is
// one matmul per product, and the report says why. Prefill: one GEMM per product.
void CudaOps::matmuls_impl(const Tensor& x, const MatmulGroup& g) {
  if (phase() == Phase::Prefill || g.n == 1) return Ops::matmuls_impl(x, g);
  MatmulVariant v0;
  const std::string why = gemv_group_blocker(*this, x, g, phase(), v0);
  const std::string names = group_names(g);
  if (!why.empty()) {
    note_variant("matmuls.decode." + names, std::to_string(g.n) + " launches, one per product: " + why);
    return Ops::matmuls_impl(x, g);
  }
  if (x.rows <= 0) return;
  note_variant("matmuls.decode." + names, "one launch: " + v0.name + " over " + std::to_string(g.n) +
                                              " weights, each part's rows starting on a block batch");
  launch_gemv(x, g.w.data(), g.out.data(), g.n, v0.defines);
}

int CudaOps::norm_counter_slot(int32_t sum_buf) {
  auto it = norm_counter_slot_.find(sum_buf);
  if (it != norm_counter_slot_.end()) return it->second;
  if (norm_counter_slot_.size() >= size_t(kNormCounterSlots)) return -1;
  const int slot = int(norm_counter_slot_.size());
  norm_counter_slot_.emplace(sum_buf, slot);
  return slot;
}

// Decode: the norm and the products as one GEMV launch whose every block normalises its row (NORM in
// kernels/matmul.cu) when the products are one launch anyway and the norm takes kernels/norm.cu's 16-byte form
// (so the bits are those of the two-launch form); otherwise, and in prefill, the norm op and then matmuls, with
// the reason in the report.
void CudaOps::norm_matmuls_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                                const Tensor& normed, const MatmulGroup& g) {
  if (phase() == Phase::Prefill) return Ops::norm_matmuls_impl(a, b, w, eps, sum, normed, g);
  const bool add = b.valid();
  const int64_t T = a.rows, K = a.cols;
  MatmulVariant v0;
  std::string why = g.n < 1 ? "an empty group" : gemv_group_blocker(*this, normed, g, phase(), v0);
  auto aligned = [&](const Tensor& t) { return ptr(t) % 16 == 0 && t.stride % 4 == 0; };
  if (!opt_.fused_norm) {
    why = "fused_norm=False";
  } else if (!why.empty()) {
    why = "the products are not one GEMV launch (" + why + ")";
  } else if (a.dtype != DType::F32 || w.dtype != DType::F32 || normed.dtype != DType::F32 ||
             (add && (b.dtype != DType::F32 || sum.dtype != DType::F32))) {
    why = "a tensor that is not f32";
  } else if (w.cols != K || normed.rows != T || normed.cols != K || (add && (b.rows != T || b.cols != K ||
                                                                             sum.rows != T || sum.cols != K))) {
    why = "not one norm segment per row";  // the norm op names the mismatch
  } else if (K % 4 != 0) {
    why = "rows of " + std::to_string(K) + " (the fused form reads whole float4s: a multiple of 4)";
  } else if (!aligned(a) || ptr(w) % 16 != 0 || !aligned(normed) || (add && (!aligned(b) || !aligned(sum)))) {
    why = "a norm tensor not 16-byte aligned";
  } else {
    const Weight& w0 = g.w[0];
    const int64_t epc = w0.quantized() ? 128 / w0.bits : 16 / int64_t(dtype_size(w0.dtype));
    if (ceil_div(int64_t(w0.row_bytes()), 16) * (epc + 4) * 4 > 36 * 1024) why = "x too long to stage in shared memory";
  }
  int slot = 0;
  if (why.empty() && add && (slot = norm_counter_slot(sum.buf)) < 0)
    why = "every arrival-counter slot taken (" + std::to_string(kNormCounterSlots) + " sum buffers)";
  const std::string key = std::string(add ? "add_rms_norm_matmuls" : "rms_norm_matmuls") + ".decode." + group_names(g);
  if (!why.empty()) {
    note_variant(key, std::string(add ? "add_rms_norm" : "rms_norm") + ", then the products: " + why);
    return Ops::norm_matmuls_impl(a, b, w, eps, sum, normed, g);
  }
  if (T <= 0) return;
  note_variant(key, "one launch: " + v0.name + " over " + std::to_string(g.n) + " weights, every block " +
                        (add ? "adding the residual and " : "") + "normalising its row while staging it");
  GemvNorm n{};
  n.b = add ? ptr(b) : 0;
  n.ldb = add ? b.stride : 0;
  n.w = ptr(w);
  n.sum = add ? ptr(sum) : 0;
  n.lds = add ? sum.stride : 0;
  n.normed = ptr(normed);
  n.ldn = normed.stride;
  n.counters = norm_counters_ + uint64_t(slot) * 16 * 4;
  n.eps = eps;
  launch_gemv(a, g.w.data(), g.out.data(), g.n, v0.defines, &n);
}

}  // namespace lily::cuda
