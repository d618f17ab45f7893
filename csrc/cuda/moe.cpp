// Host encoders of the MoE family (MODEL.md section 6): moe_route, moe_experts (decode: two grouped GEMV
// launches; prefill: device-side grouping + two grouped tensor-core GEMMs + a fixed-order combine),
// swiglu and moe_combine. Kernels and their geometry: csrc/cuda/kernels/moe.cu; oracle: csrc/cpu/moe.cpp;
// test: tests/cuda/test_moe.py. Every choice below is made by select_experts / select_elementwise, whose
// result is what is launched and what note_variant reports.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/backend.h"
#include "model/config.h"

namespace lily::cuda {

// Must match struct MoeArgs in kernels/moe.cu (MOE_PART 2).
struct MoeArgs {
  uint64_t x;
  int64_t x_stride;
  uint64_t ids;
  int64_t ids_stride;
  uint64_t wts;
  int64_t wts_stride;
  uint64_t out;
  int64_t out_stride;
  uint64_t data[3], scales[3], biases[3];
  uint64_t data_stride[3], scale_stride[3], bias_stride[3];
  uint64_t act, y, tiles, pair_token, pair_pos;
  int32_t T, k, max_tiles, pad;
  uint64_t sdata[3], sscales[3], sbiases[3];  // fused decode: the shared expert
  uint64_t logits;
  int64_t logits_stride;
  uint64_t sgate;
  int64_t sgate_stride;
  uint64_t xh, xinv;  // prefill with moe_x_rows: x as scaled f16 rows and their 2^-e (workspace)
  uint64_t gcount;    // prefill grouping across blocks (moe_group_blocks): per chunk and expert (workspace)
};
static_assert(sizeof(MoeArgs) == 8 * 8 + 18 * 8 + 5 * 8 + 16 + 9 * 8 + 4 * 8 + 3 * 8,
              "must match struct MoeArgs in kernels/moe.cu");

namespace {



constexpr int64_t kMaxExperts = 512;  // moe_route keeps 16 logits per lane; moe_group's tables are [32][E]
constexpr int64_t kMaxTopk = 16;
constexpr int kMmaBlockN = 64;        // moe_gate_up_mma columns of gate (and of up) per block
constexpr int kMmaBlockNDown = 128;   // moe_down_mma columns per block
// FRAG (codes widened in registers): weight rows per block at tile height bm (kernels/moe.cu FRAG_ROWS): gate/up
// blocks take half of them from each matrix, down blocks all from one.
int frag_rows(int bm) { return bm == 64 ? 128 : 256 / (bm / 16); }
constexpr unsigned kMmaThreads = 256;  // MMA_NT in kernels/moe.cu: threads of a GEMM block

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Tiles of the prefill tile map: Σ_e ⌈n_e / bm⌉ ≤ ⌈P / bm⌉ + (number of experts hit) for P = T·k pairs.
int64_t max_tiles(int64_t T, int64_t k, int64_t E, int bm) {
  const int64_t P = T * k;
  return (P + bm - 1) / bm + std::min(E, P);
}

// Workspace carve-up (byte offsets from the workspace start, each 256-byte aligned).
struct Layout {
  size_t act = 0, y = 0, tiles = 0, pair_token = 0, pair_pos = 0, xh = 0, xinv = 0, gcount = 0, total = 0;
};
Layout layout(int64_t T, int64_t k, int64_t E, int64_t H, int64_t I) {
  const size_t P = size_t(T * k);
  Layout l;
  l.act = 0;
  l.y = l.act + align256((P + size_t(T)) * size_t(I) * 4);  // the fused decode adds the shared expert's row
  l.tiles = l.y + align256(P * size_t(H) * 4);
  l.pair_token = l.tiles + align256(size_t(1 + 3 * max_tiles(T, k, E, 16)) * 4);  // bm = 16: the most tiles
  l.pair_pos = l.pair_token + align256(P * 4);
  // moe_x_rows: x's rows [T][⌈H/64⌉·64] f16 and their 2^-e [T] f32, later the act rows [P][⌈I/64⌉·64] and [P]
  l.xh = l.pair_pos + align256(P * 4);
  l.xinv = l.xh + align256(std::max(size_t(T) * size_t((H + 63) / 64 * 64), P * size_t((I + 63) / 64 * 64)) * 2);
  l.gcount = l.xinv + align256(std::max(size_t(T), P) * 4);  // moe_group_blocks: int [⌈P/1024⌉][E]
  l.total = l.gcount + align256((P + 1023) / 1024 * size_t(E) * 4);
  return l;
}

int codes_per_vector(const WeightFormat& w) {
  if (w.quantized()) return 128 / w.bits;
  return w.dtype == DType::F32 ? 4 : 8;
}

int next_pow2(int64_t n) {
  int p = 1;
  while (p < n && p < 32) p <<= 1;
  return p;
}

bool same_format(const WeightFormat& a, const WeightFormat& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.bits == b.bits && a.group == b.group &&
         (!a.quantized() || a.scale_dtype == b.scale_dtype);
}

std::string shape_text(const Weight& gate) {
  return "E " + std::to_string(gate.experts) + ", H " + std::to_string(gate.cols) + ", inter " +
         std::to_string(gate.rows) + ", " + gate.describe();
}

struct ExpertsVariant {
  Defines defines;
  std::string text;  // for note_variant
  int rows_g = 1, rows_d = 8, bm = 16;  // decode: gate/up rows per warp, down rows per block (ROWS_G, ROWS_D)
  int pipe = 0, pipe_smem = 0, static_smem = 0;  // prefill's cp.async ring: stages, its bytes, the tiles' bytes
  int frag = 0;  // 16 or 32-row tiles with the codes widened in registers (kernels/moe.cu FRAG): ring stages, 0 = off
  int min_blocks = 2;  // blocks per SM the GEMMs' registers must allow (MMA_MINB)
};

}  // namespace

size_t moe_workspace_bytes(const ModelConfig& c, int64_t rows) {
  if (rows <= 0 || c.experts <= 0) return 0;
  return layout(rows, c.topk, c.experts, c.hidden, c.moe_inter).total;
}

// ---------------------------------------------------------------------------------------------------------
// moe_route

void CudaOps::moe_route_impl(const Tensor& logits, int64_t k, const Tensor& ws, const Tensor& ids,
                             const Tensor& weights) {
  (void)ws;  // the router needs no scratch on the GPU (everything stays in one warp's registers)
  const int64_t T = logits.rows, E = logits.cols;
  if (logits.dtype != DType::F32 || ids.dtype != DType::I32 || weights.dtype != DType::F32)
    throw std::invalid_argument("moe_route (cuda): logits and weights must be f32, ids i32");
  if (E < 1 || E > kMaxExperts || k < 1 || k > std::min(E, kMaxTopk))
    throw std::invalid_argument("moe_route (cuda): " + std::to_string(E) + " experts, top-" + std::to_string(k) +
                                " (supported: E ≤ 512, 1 ≤ k ≤ min(E, 16))");
  if (ids.rows != T || weights.rows != T || ids.cols != k || weights.cols != k)
    throw std::invalid_argument("moe_route (cuda): ids and weights must be [T, k]");
  if (T == 0) return;
  const Kernel& kr = kernel("moe", "moe_route", {{"MOE_PART", 1}, {"NEXP", E}, {"TOPK", k}});
  note_variant("moe.route", "moe_route: one warp per token, " + std::to_string((E + 31) / 32) +
                                " logits per lane in registers, " + std::to_string(k) + " warp arg-max rounds");
  launch(kr, Dim3{unsigned((T + 3) / 4), 1, 1}, Dim3{128, 1, 1}, 0, ptr(logits), int64_t(logits.stride), int(T),
         ptr(ids), int64_t(ids.stride), ptr(weights), int64_t(weights.stride));
}

// ---------------------------------------------------------------------------------------------------------
// moe_experts

namespace {

// The kernels' constants for this weight format, shape and phase (and whether 16-byte loads are legal).
// Group parts per 64-input K block of the prefill GEMMs (moe_mma_block's NP: a group tiles the block or the block
// tiles it, else parts of 16).
int64_t group_parts(const WeightFormat& w) {
  return 64 / ((w.group % 64 == 0 || 64 % w.group == 0) ? std::min<int64_t>(w.group, 64) : 16);
}

// Prefill's cp.async ring (kernels/moe.cu PIPE): one stage's bytes for this format and tile height (the same for
// the gate/up and the down pass: both stage 128 weight rows of a 64-input K block).
int64_t pipe_stage_bytes(const WeightFormat& w, int bm) {
  return int64_t(bm) * 64 * 4 + 128 * 64 * w.bits / 8 + 2 * 128 * group_parts(w) * 4;
}

// The static shared memory of kernels/moe.cu moe_mma_block (its arrays: A hi, A lo when x_terms = 2, 128 weight
// rows of pitch 72 halves, Σx and the scale/bias parts, x's part scales when xf16, the row map): with the ring it
// must fit the device.
int64_t mma_static_smem(const WeightFormat& w, int bm, int x_terms, bool xf16) {
  const int64_t np = group_parts(w);
  return int64_t(bm) * 72 * 2 * (x_terms == 2 ? 2 : 1) + (x_terms == 2 ? 0 : 16) + 128 * 72 * 2 + bm * np * 4 +
         2 * 128 * np * 4 + bm * 4 + (xf16 ? bm * np * 4 : 0);
}

// FRAG's ring (kernels/moe.cu moe_frag_block, bm = 16, 32 or 64): one stage's bytes (bm x rows of 64 f32, frag_rows(bm)
// weight rows of 48 bytes, a scale and a bias word per row and group part), and the kernel's static arrays (two A
// tiles hi (+ lo), Σx, rows).
int64_t frag_stage_bytes(const WeightFormat& w, int bm) {
  const int64_t rows = frag_rows(bm);
  return int64_t(bm) * 64 * 4 + rows * 48 + 2 * rows * group_parts(w) * 4;
}
int64_t frag_static_smem(const WeightFormat& w, int x_terms, bool xf16, int bm) {
  return 2 * int64_t(bm) * 72 * 2 * (x_terms == 2 ? 2 : 1) + (x_terms == 2 ? 0 : 2 * 16) +
         2 * int64_t(bm) * group_parts(w) * 4 * (xf16 ? 2 : 1) + bm * 4;
}

// pipe: the backend option's stage count (0: the register path), lowered to what fits smem_cap next to the
// static arrays; `scales4`: whether every scale and bias base and per-expert stride is 4-byte aligned (the ring
// copies them as aligned 4-byte words).
// frag32_from / tile64_from: the expected rows per expert T·k/E from which the fragment tiles take 32 rows and from
// which the tiles take 64 (backend options moe_frag32_rows, moe_tile64_rows; tile64_from 0: 32 for experts without
// fragment tiles, none for those with them). frag64_from: from it the fragment tiles take 64 rows (moe_frag64_rows;
// 0: never).
ExpertsVariant select_experts(const Weight& gate, int64_t T, int64_t k, Phase phase, bool aligned,
                              CudaOptions::XForm xform, bool dp4a_option, int rows_g, int rows_d, int pipe = 0,
                              bool scales4 = false, int64_t smem_cap = 0, int frag = 0, int frag32_from = 20,
                              int tile64_from = 0, int frag64_from = 0) {
  const int64_t E = gate.experts, H = gate.cols, I = gate.rows;
  const int cpv = codes_per_vector(gate);
  ExpertsVariant v;
  // Decode with x / act as three int8 terms and dp4a (kernels/moe.cu DP4A): the option, and its conditions.
  const bool dp4a = phase == Phase::Decode && dp4a_option && gate.quantized() && (gate.bits == 4 || gate.bits == 8) &&
                    aligned && gate.group % cpv == 0;
  const int64_t nit = (H / cpv + 31) / 32;  // 16-byte vectors per lane per gate/up row
  v.rows_g = rows_g > 0 ? rows_g : int(std::max<int64_t>(1, std::min<int64_t>(4, 4 / nit)));
  v.rows_d = rows_d;
  const int lpr = next_pow2(I / cpv);
  std::string pipe_text, rows_text;
  // The prefill GEMMs' activation form (kernels/moe.cu XS, XF): f16 needs affine codes; dense weights take hi + lo.
  const bool xf16 = phase == Phase::Prefill && xform == CudaOptions::XForm::F16 && gate.quantized();
  const int x_terms = phase != Phase::Prefill ? 2 : xform == CudaOptions::XForm::BF16 || xf16 ? 1 : 2;
  if (phase == Phase::Prefill) {
    // Fragment tiles (FRAG: each warp's 4-bit codes widened to B fragments in registers, no bf16 weight tile) where
    // the format allows and a 3-stage ring fits; their height by the expected rows per expert r = T·k/E: 16 rows
    // below frag32_from, else 32 (an expert with 17-32 rows then has its weights read and widened once, not by two
    // 16-row tiles), 64 from frag64_from when it is set. Without them: the shared bf16 weight tile, 16 rows below
    // tile64_from (register prefetch; a ring measured slower there), 64 rows from it (a cp.async ring of `pipe`
    // stages). benchmarks/NOTES.md.
    const char* no_frag = frag == 0                ? "moe_frag = 0"
                          : !gate.quantized()      ? "dense weights"
                          : gate.bits != 4         ? "8-bit codes"
                          : !aligned || !scales4   ? "unaligned weights or scales"
                                                   : nullptr;
    const int fbm = frag64_from > 0 && T * k >= int64_t(frag64_from) * E ? 64
                    : T * k >= int64_t(frag32_from) * E                 ? 32
                                                                        : 16;
    const int64_t stage = no_frag ? 0 : frag_stage_bytes(gate, fbm),  // group_parts needs an affine format
                  fixed = no_frag ? 0 : frag_static_smem(gate, x_terms, xf16, fbm);
    int stages = no_frag ? 0 : frag;
    while (stages >= 3 && stages * stage + fixed > smem_cap) --stages;
    if (!no_frag && stages < 3) no_frag = "a 3-stage ring exceeds the device's shared memory per block";
    const bool tile64 = tile64_from > 0 ? T * k >= int64_t(tile64_from) * E : no_frag && T * k >= 32 * E;
    const std::string t64 = tile64_from > 0 ? "T·k/E ≥ " + std::to_string(tile64_from) : "T·k/E ≥ 32";
    if (tile64) {
      v.bm = 64;
      rows_text = " (" + t64 + (tile64_from > 0 ? ", moe_tile64_rows" : "") + ")";
    } else if (no_frag) {
      v.bm = 16;
      rows_text = " (T·k/E < " + std::to_string(tile64_from > 0 ? tile64_from : 32) + ")";
      pipe_text = std::string("a shared bf16 weight tile, register prefetch one K block ahead (") + no_frag + ")";
    } else {
      v.bm = fbm;
      rows_text = fbm == 64 ? " (T·k/E ≥ " + std::to_string(frag64_from) +
                                  ", moe_frag64_rows: four m16 tiles per warp on the same widened codes, the idle ones "
                                  "skipped)"
                  : fbm == 32 ? " (T·k/E ≥ " + std::to_string(frag32_from) +
                                  ": a second m16 tile per warp on the same widened codes, skipped for ≤ 16 rows)"
                            : " (T·k/E < " + std::to_string(frag32_from) + ")";
      v.frag = stages;
      v.pipe_smem = int(stages * stage);
      v.static_smem = int(fixed);
      // Three blocks per SM where their shared memory fits (the SM has the opt-in limit + 1 KB; each block costs 1 KB
      // more): 24 warps to hide the latencies of a latency-bound kernel (ncu: 0.5 instructions per scheduler per
      // cycle at 2 blocks), registers capped at 80 for it.
      // 64-row tiles hold 32 accumulators a lane: 2 blocks (128 registers).
      v.min_blocks = fbm < 64 && 3 * (stages * stage + fixed + 1024) <= smem_cap + 1024 ? 3 : 2;
      pipe_text = "each warp's weight codes widened to B fragments in registers, no bf16 weight tile; a cp.async ring "
                  "of " + std::to_string(stages) + " K blocks (" + std::to_string(v.pipe_smem) +
                  " bytes of shared memory, " + std::to_string(v.min_blocks) + " blocks per SM" +
                  (stages < frag ? ", fewer than moe_frag = " + std::to_string(frag) + " to fit the device"
                                 : std::string()) +
                  ")";
    }
  }
  if (phase == Phase::Prefill && v.bm == 64 && v.frag == 0) {  // the shared bf16 weight tile's 64 rows
    if (pipe == 0) pipe_text = "register prefetch one K block ahead (moe_pipe = 0)";
    else if (!gate.quantized()) pipe_text = "register prefetch one K block ahead (dense weights: no cp.async ring)";
    else if (!aligned || !scales4) pipe_text = "register prefetch one K block ahead (unaligned weights or scales)";
    else {
      const int64_t stage = pipe_stage_bytes(gate, v.bm), fixed = mma_static_smem(gate, v.bm, x_terms, xf16);
      int stages = pipe;
      while (stages >= 2 && stages * stage + fixed > smem_cap) --stages;
      if (stages < 2) {
        pipe_text = "register prefetch one K block ahead (a 2-stage cp.async ring exceeds the device's " +
                    std::to_string(smem_cap) + " bytes of shared memory per block)";
      } else {
        v.pipe = stages;
        v.pipe_smem = int(stages * stage);
        v.static_smem = int(fixed);
        pipe_text = "cp.async ring of " + std::to_string(stages) + " K blocks (" + std::to_string(v.pipe_smem) +
                    " bytes of shared memory" + (stages < pipe ? ", fewer than moe_pipe = " + std::to_string(pipe) +
                                                                   " to fit the device"
                                                             : std::string()) +
                    ")";
      }
    }
  }
  v.defines = {{"MOE_PART", 2},
               {"WKIND", gate.quantized() ? 1 : 0},
               {"WDT", int64_t(gate.dtype)},
               {"BITS", gate.quantized() ? gate.bits : 0},
               {"GROUP", gate.quantized() ? gate.group : 0},
               {"SDT", int64_t(gate.scale_dtype)},
               {"ALIGNED", aligned ? 1 : 0},
               {"NEXP", E},
               {"TOPK", k},
               {"HID", H},
               {"INTER", I},
               {"ROWS_G", v.rows_g},
               {"ROWS_D", v.rows_d},
               {"LPR", lpr},
               {"BM", v.bm},
               {"XS", x_terms},
               {"XF", xf16 ? 1 : 0},
               {"DP4A", dp4a ? 1 : 0},
               {"PIPE", v.pipe},
               {"FRAG", v.frag},
               {"MMA_MINB", v.min_blocks}};
  const std::string fmt = gate.describe() + (aligned ? ", 16-byte loads" : ", byte loads (unaligned weights)");
  if (phase == Phase::Decode)
    v.text = "moe_gate_up_decode (" + std::to_string(v.rows_g) + " gate+up rows per warp) + moe_down_decode (" +
             std::to_string(lpr) + " lanes per expert row, " + std::to_string(v.rows_d) +
             " rows per block), " + fmt +
             (dp4a ? ", x and act as three int8 terms per 16-byte vector, dp4a dot products"
                   : gate.quantized() && !dp4a_option ? ", fp32 x and act (gemv_dp4a=False)" : ", fp32 x and act");
  else
    v.text = "moe_group + moe_gate_up_mma / moe_down_mma (mma.sync m16n8k16 " + std::string(xf16 ? "f16" : "bf16") +
             ", x as " +
             std::string(xf16 ? "one f16 term scaled by 2^e per row and group part (prefill_x or moe_x = f16)"
                         : x_terms == 1 ? "one bf16 term (prefill_x or moe_x = bf16)"
                         : xform == CudaOptions::XForm::F16 ? "hi + lo bf16 (f16 x needs affine codes)"
                                                            : "hi + lo bf16 (prefill_x or moe_x = bf16x2)") +
             ", " +
             std::string(gate.quantized() ? "exact codes with fp32 per-group scale/bias"
                         : gate.dtype == DType::BF16 ? "exact bf16 weights"
                                                     : "weights as hi + lo bf16") +
             ", " + std::to_string(v.bm) + "-row tiles" + rows_text + ", " +
             pipe_text +
             ") + moe_expert_sum, " + fmt;
  return v;
}

bool aligned16(uint64_t v) { return v % 16 == 0; }

// The prefill fragment tiles with the weights dequantized to f16 in registers (the option moe_w_f16; kernels/moe.cu
// MWF16): only where the fragment tiles run with x as one f16 term. With them, both GEMMs' x and act as f16 rows scaled
// once per row by pre-passes (the option moe_x_rows; MXROW). Returns whether those pre-passes run.
bool f16_expert_forms(ExpertsVariant& v, bool w_f16, bool x_rows) {
  if (!w_f16) return false;
  auto define = [&](const char* name) {
    for (const auto& [k, val] : v.defines)
      if (k == name) return val;
    return int64_t(0);
  };
  if (define("FRAG") > 0 && define("XF") == 1) {
    v.defines.push_back({"MWF16", 1});
    v.text += "; the experts' weights dequantized to f16 (s·q + b) in registers, each group part folded by the x "
              "scale alone (moe_w_f16)";
    if (x_rows) {
      v.defines.push_back({"MXROW", 1});
      v.text += "; x and act as f16 rows scaled by 2^e per row by pre-passes (moe_x_rows, moe_act_rows), "
                "accumulated without a fold (moe_x_rows)";
      return true;
    }
  } else {
    v.text += "; moe_w_f16 not applied: it needs the fragment tiles and x as one f16 term";
  }
  return false;
}

// The decode kernels' register cap for `minb` blocks per SM (the option moe_decode_minb; kernels/moe.cu DEC_MINB) and
// the gate/up pass's load order (the option moe_early_loads; GU_ORDER, GU_EARLY: where a lane's weight vectors fit).
void decode_caps_and_order(ExpertsVariant& v, const Weight& gate, int minb, bool early) {
  v.defines.push_back({"DEC_MINB", minb});
  if (minb > 0)
    v.text += ", registers capped for " + std::to_string(minb) + " blocks per SM (moe_decode_minb)";
  if (!early) v.defines.push_back({"GU_ORDER", 0});
  const int64_t nit = (gate.cols / codes_per_vector(gate) + 31) / 32;
  const char* why_not = !early                  ? "moe_early_loads=False"
                        : v.rows_g * nit > 4     ? "more than 4 weight vectors per lane"
                        : minb > 3               ? "moe_decode_minb > 3 leaves no registers for them"
                                                 : nullptr;
  v.text += why_not ? std::string(", gate/up weight loads after x is staged (") + why_not + ")"
                    : ", gate/up weight loads in flight while x is staged (the shared expert's before the wait)";
}

}  // namespace

// Checks moe_experts' arguments and fills the kernels' MoeArgs (the routed part); `aligned` says whether
// every address and stride allows 16-byte loads.
MoeArgs CudaOps::experts_args(const Tensor& x, const Tensor& ids, const Tensor& weights, const Weight& gate,
                              const Weight& up, const Weight& down, const Tensor& ws, const Tensor& out,
                              const std::string& what, bool& aligned) {
  const int64_t T = x.rows, H = x.cols, k = ids.cols, E = gate.experts, I = gate.rows;
  if (x.dtype != DType::F32 || out.dtype != DType::F32 || weights.dtype != DType::F32 || ids.dtype != DType::I32)
    throw std::invalid_argument(what + ": x, weights and out must be f32, ids i32");
  if (E < 1 || E > kMaxExperts || up.experts != E || down.experts != E)
    throw std::invalid_argument(what + ": gate, up and down must stack the same 1..512 experts");
  if (k < 1 || k > kMaxTopk || weights.cols != k || ids.rows != T || weights.rows != T)
    throw std::invalid_argument(what + ": ids and weights must be [T, k] with 1 ≤ k ≤ 16");
  if (gate.cols != H || up.cols != H || up.rows != I || down.rows != H || down.cols != I || out.cols != H ||
      out.rows != T)
    throw std::invalid_argument(what + ": gate/up must be [E, inter, H], down [E, H, inter], out [T, H]");
  if (!same_format(gate, up) || !same_format(gate, down))
    throw std::invalid_argument(what + ": gate, up and down must share one format (" + gate.describe() + ", " +
                                up.describe() + ", " + down.describe() + ")");
  const int cpv = codes_per_vector(gate);
  if (gate.quantized() && ((gate.bits != 4 && gate.bits != 8) || gate.group <= 0 || gate.group % cpv != 0 ||
                           H % gate.group != 0 || I % gate.group != 0))
    throw std::invalid_argument(what + ": affine weights need bits 4 or 8 and a group that is a multiple of " +
                                std::to_string(cpv) + " dividing H and inter");
  if (H % cpv != 0 || I % cpv != 0)
    throw std::invalid_argument(what + ": H and inter must be multiples of " + std::to_string(cpv) +
                                " (one 16-byte weight vector)");
  const Layout L = layout(T, k, E, H, I);
  if (ws.bytes() < L.total)
    throw std::invalid_argument(what + ": workspace too small for moe_experts (" + std::to_string(ws.bytes()) +
                                " < " + std::to_string(L.total) + " bytes)");

  MoeArgs a{};
  a.x = ptr(x);
  a.x_stride = x.stride;
  a.ids = ptr(ids);
  a.ids_stride = ids.stride;
  a.wts = ptr(weights);
  a.wts_stride = weights.stride;
  a.out = ptr(out);
  a.out_stride = out.stride;
  const Weight* mats[3] = {&gate, &up, &down};
  // The workspace carve-up is 256-byte aligned from the workspace start; the kernels' float2/float4
  // workspace accesses need that start 16-byte aligned (a backend allocation always is).
  if (!aligned16(ptr(ws))) throw std::invalid_argument(what + ": workspace not 16-byte aligned");
  aligned = aligned16(a.x) && x.stride % 4 == 0;
  const size_t sbytes = dtype_size(gate.scale_dtype);
  for (int m = 0; m < 3; ++m) {
    const Weight& w = *mats[m];
    a.data[m] = data(w);
    a.data_stride[m] = w.data_stride;
    aligned = aligned && aligned16(a.data[m]) && aligned16(w.data_stride) && aligned16(w.row_bytes());
    if (w.quantized()) {
      a.scales[m] = scales(w);
      a.biases[m] = biases(w);
      a.scale_stride[m] = w.scale_stride;
      a.bias_stride[m] = w.bias_stride;
      aligned = aligned && a.scales[m] % sbytes == 0 && a.biases[m] % sbytes == 0 && w.scale_stride % sbytes == 0 &&
                w.bias_stride % sbytes == 0;
    }
  }
  const CUdeviceptr base = ptr(ws);
  a.act = base + L.act;
  a.y = base + L.y;
  a.tiles = base + L.tiles;
  a.pair_token = base + L.pair_token;
  a.pair_pos = base + L.pair_pos;
  a.xh = base + L.xh;
  a.xinv = base + L.xinv;
  a.gcount = base + L.gcount;
  a.T = int32_t(T);
  a.k = int32_t(k);
  return a;
}

void CudaOps::moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights, const Weight& gate,
                               const Weight& up, const Weight& down, const Tensor& ws, const Tensor& out) {
  const int64_t T = x.rows, H = x.cols, k = ids.cols, E = gate.experts, I = gate.rows;
  const std::string what = "moe_experts (cuda, " + shape_text(gate) + ")";
  bool aligned = false;
  MoeArgs a = experts_args(x, ids, weights, gate, up, down, ws, out, what, aligned);
  if (T == 0) return;
  const Phase ph = phase();
  bool scales4 = gate.quantized();
  for (int m = 0; m < 3 && scales4; ++m)
    scales4 = a.scales[m] % 4 == 0 && a.biases[m] % 4 == 0 && a.scale_stride[m] % 4 == 0 && a.bias_stride[m] % 4 == 0;
  ExpertsVariant v = select_experts(gate, T, k, ph, aligned, options().moe_prefill_x(), options().gemv_dp4a,
                                          options().moe_rows_g, options().moe_rows_d, options().moe_pipe, scales4,
                                          info().max_smem_optin, options().moe_frag, options().moe_frag32_rows,
                                          options().moe_tile64_rows, options().moe_frag64_rows);
  if (ph == Phase::Decode) {
    decode_caps_and_order(v, gate, options().moe_decode_minb, options().moe_early_loads);
    note_variant("moe.experts.decode", v.text);
    const Kernel& k1 = kernel("moe", "moe_gate_up_decode", v.defines);
    const Kernel& k2 = kernel("moe", "moe_down_decode", v.defines);
    // Dynamic shared memory: x (⌈H/4⌉ float4 padded to 8) and the k act rows (⌈I/4⌉ padded to 8 each).
    const int smem1 = int((H / 4 + 7) / 8 * 8 * 16), smem2 = int(k * ((I / 4 + 7) / 8 * 8) * 16);
    if (smem1 > 48 * 1024) set_dynamic_smem(k1, smem1);
    if (smem2 > 48 * 1024) set_dynamic_smem(k2, smem2);
    if (T * k > 65535) throw std::invalid_argument(what + ": decode supports T·k ≤ 65535");
    launch(k1, Dim3{unsigned((I + 8 * v.rows_g - 1) / (8 * v.rows_g)), unsigned(T * k), 1}, Dim3{256, 1, 1},
           uint32_t(smem1), a);
    launch(k2, Dim3{unsigned((H + v.rows_d - 1) / v.rows_d), unsigned(T), 1}, Dim3{256, 1, 1},
           uint32_t(smem2), a);
    return;
  }
  const bool x_rows = f16_expert_forms(v, options().moe_w_f16, options().moe_x_rows);
  const unsigned chunks = unsigned((T * k + 1023) / 1024);  // the grouping's 1024-pair chunks
  const bool group_blocks = options().moe_group_blocks && chunks > 1;
  if (group_blocks)
    v.text += "; the grouping split over a block per 1024-pair chunk (moe_group_count / _scan / _scatter, " +
              std::to_string(chunks) + " chunks; moe_group_blocks)";
  note_variant("moe.experts.prefill", v.text);
  a.max_tiles = int32_t(max_tiles(T, k, E, v.bm));
  const Kernel& kg = kernel("moe", "moe_group", v.defines);
  const Kernel& k1 = kernel("moe", "moe_gate_up_mma", v.defines);
  const Kernel& k2 = kernel("moe", "moe_down_mma", v.defines);
  const Kernel& k3 = kernel("moe", "moe_expert_sum", v.defines);
  if (v.pipe_smem > 0) {  // a ring is dynamic shared memory next to the tiles (select_experts fitted both)
    set_dynamic_smem(k1, v.pipe_smem, v.static_smem);
    set_dynamic_smem(k2, v.pipe_smem, v.static_smem);
  }
  if (group_blocks) {  // the same grouping, each chunk's scatter in its own block
    launch(kernel("moe", "moe_group_count", v.defines), Dim3{chunks, 1, 1}, Dim3{1024, 1, 1}, 0, a);
    launch(kernel("moe", "moe_group_scan", v.defines), Dim3{1, 1, 1}, Dim3{1024, 1, 1}, 0, a);
    launch(kernel("moe", "moe_group_scatter", v.defines), Dim3{chunks, 1, 1}, Dim3{1024, 1, 1}, 0, a);
  } else {
    launch(kg, Dim3{1, 1, 1}, Dim3{1024, 1, 1}, 0, a);
  }
  if (x_rows) launch(kernel("moe", "moe_x_rows", v.defines), Dim3{unsigned(T), 1, 1}, Dim3{256, 1, 1}, 0, a);
  const int bn1 = v.frag ? frag_rows(v.bm) / 2 : kMmaBlockN, bn2 = v.frag ? frag_rows(v.bm) : kMmaBlockNDown;
  launch(k1, Dim3{unsigned(a.max_tiles), unsigned((I + bn1 - 1) / bn1), 1}, Dim3{kMmaThreads, 1, 1},
         uint32_t(v.pipe_smem), a);
  if (x_rows) launch(kernel("moe", "moe_act_rows", v.defines), Dim3{unsigned(T * k), 1, 1}, Dim3{128, 1, 1}, 0, a);
  launch(k2, Dim3{unsigned(a.max_tiles), unsigned((H + bn2 - 1) / bn2), 1}, Dim3{kMmaThreads, 1, 1},
         uint32_t(v.pipe_smem), a);
  launch(k3, Dim3{unsigned(T), 1, 1}, Dim3{256, 1, 1}, 0, a);
}

// ---------------------------------------------------------------------------------------------------------
// moe: the whole block after the router product

// Decode, when the shared expert has the routed experts' format and shape (the real model's does): two
// launches. moe_gate_up_decode (FUSED) routes each token in every block from the router logits (one warp)
// and runs the k routed experts' and the shared expert's gate/up rows as k + 1 slots; moe_down_decode
// (FUSED) sums the routed rows in (id, slot) order with their weights, adds σ(shared gate) · shared and
// adds the result into h. Otherwise, and in prefill, the composed form (Ops::moe_impl), reported.
void CudaOps::moe_impl(const Tensor& x, const Tensor& router_logits, const Tensor& shared_gate_logit, int64_t k,
                       const MoeWeights& w, const MoeScratch& sc, const Tensor& ws, const Tensor& h) {
  const int64_t T = x.rows, H = x.cols, E = w.gate.experts, I = w.gate.rows;
  std::string why;
  if (phase() != Phase::Decode) why = "prefill";
  else if (w.shared_gate_proj.experts > 1 || w.shared_up.experts > 1 || w.shared_down.experts > 1)
    why = "stacked shared-expert weights";
  else if (!same_format(w.gate, w.shared_gate_proj) || !same_format(w.gate, w.shared_up) ||
           !same_format(w.gate, w.shared_down))
    why = "the shared expert's format (" + w.shared_gate_proj.describe() + ") differs from the experts' (" +
          w.gate.describe() + ")";
  else if (w.shared_gate_proj.rows != I || w.shared_up.rows != I || w.shared_gate_proj.cols != H ||
           w.shared_up.cols != H || w.shared_down.rows != H || w.shared_down.cols != I)
    why = "the shared expert's width (" + std::to_string(w.shared_gate_proj.rows) + ") differs from the experts' (" +
          std::to_string(I) + ")";
  else if (router_logits.dtype != DType::F32 || router_logits.cols != E || router_logits.rows != T ||
           shared_gate_logit.dtype != DType::F32 || shared_gate_logit.rows != T || shared_gate_logit.cols < 1 ||
           h.dtype != DType::F32 || h.rows != T || h.cols != H)
    why = "logits or h of other shapes than the block's";
  else if (E > kMaxExperts || k < 1 || k > std::min<int64_t>(E, kMaxTopk))
    why = "an expert count or top-k the fused router does not take";
  if (!why.empty()) {
    note_variant(std::string("moe.block.") + (phase() == Phase::Decode ? "decode" : "prefill"),
                 "composed: moe_route + moe_experts + shared-expert matmuls + swiglu + moe_combine (" + why + ")");
    return Ops::moe_impl(x, router_logits, shared_gate_logit, k, w, sc, ws, h);
  }
  const std::string what = "moe (cuda, " + shape_text(w.gate) + ")";
  bool aligned = false;
  MoeArgs a = experts_args(x, sc.ids, sc.weights, w.gate, w.up, w.down, ws, h, what, aligned);
  if (T == 0) return;
  const Weight* sm[3] = {&w.shared_gate_proj, &w.shared_up, &w.shared_down};
  const size_t sbytes = dtype_size(w.gate.scale_dtype);
  for (int m = 0; m < 3; ++m) {
    const Weight& sw = *sm[m];
    a.sdata[m] = data(sw);
    aligned = aligned && aligned16(a.sdata[m]) && aligned16(sw.row_bytes());
    if (sw.quantized()) {
      a.sscales[m] = scales(sw);
      a.sbiases[m] = biases(sw);
      aligned = aligned && a.sscales[m] % sbytes == 0 && a.sbiases[m] % sbytes == 0;
    }
  }
  a.logits = ptr(router_logits);
  a.logits_stride = router_logits.stride;
  a.sgate = ptr(shared_gate_logit);
  a.sgate_stride = shared_gate_logit.stride;
  ExpertsVariant v = select_experts(w.gate, T, k, Phase::Decode, aligned, CudaOptions::XForm::BF16x2, options().gemv_dp4a,
                                    options().moe_rows_g, options().moe_rows_d);
  decode_caps_and_order(v, w.gate, options().moe_decode_minb, options().moe_early_loads);
  v.defines.push_back({"FUSED", 1});
  // Under programmatic dependent launch the down pass routes its token itself and loads its weights before it
  // waits for the gate/up pass (kernels/moe.cu PREROUTE); otherwise it reads the ids the gate/up pass stored.
  const bool preroute = pdl_now();
  if (preroute) v.defines.push_back({"PREROUTE", 1});
  note_variant("moe.block.decode", "fused, 2 launches: routing in every block + the shared expert as slot k of " +
                                       v.text + ", the down pass adding σ(gate)·shared and the residual" +
                                       (preroute ? "; the down pass routes and loads its weights before waiting "
                                                   "for the gate/up pass (programmatic dependent launch)"
                                                 : ""));
  const Kernel& k1 = kernel("moe", "moe_gate_up_decode", v.defines);
  const Kernel& k2 = kernel("moe", "moe_down_decode", v.defines);
  const int smem1 = int((H / 4 + 7) / 8 * 8 * 16), smem2 = int((k + 1) * ((I / 4 + 7) / 8 * 8) * 16);
  if (smem1 > 48 * 1024) set_dynamic_smem(k1, smem1);
  if (smem2 > 48 * 1024) set_dynamic_smem(k2, smem2);
  if (T * (k + 1) > 65535) throw std::invalid_argument(what + ": decode supports T·(k + 1) ≤ 65535");
  launch(k1, Dim3{unsigned((I + 8 * v.rows_g - 1) / (8 * v.rows_g)), unsigned(T * (k + 1)), 1}, Dim3{256, 1, 1},
         uint32_t(smem1), a);
  launch(k2, Dim3{unsigned((H + v.rows_d - 1) / v.rows_d), unsigned(T), 1}, Dim3{256, 1, 1},
         uint32_t(smem2), a);
}

// ---------------------------------------------------------------------------------------------------------
// swiglu, moe_combine

namespace {

bool vec4(const std::initializer_list<std::pair<CUdeviceptr, int64_t>>& views, int64_t cols) {
  if (cols % 4 != 0) return false;
  for (const auto& [p, stride] : views)
    if (p % 16 != 0 || stride % 4 != 0) return false;
  return true;
}

}  // namespace

void CudaOps::swiglu_impl(const Tensor& gate, const Tensor& up, const Tensor& out) {
  const int64_t T = out.rows, C = out.cols;
  if (gate.dtype != DType::F32 || up.dtype != DType::F32 || out.dtype != DType::F32 || gate.rows != T ||
      up.rows != T || gate.cols != C || up.cols != C)
    throw std::invalid_argument("swiglu (cuda): gate, up and out must be f32 of one shape");
  if (T > 65535) throw std::invalid_argument("swiglu (cuda): at most 65535 rows");
  if (T == 0 || C == 0) return;
  const int vec = vec4({{ptr(gate), gate.stride}, {ptr(up), up.stride}, {ptr(out), out.stride}}, C) ? 4 : 1;
  const Kernel& kr = kernel("moe", "swiglu", {{"MOE_PART", 3}, {"VEC", vec}});
  note_variant("moe.swiglu", vec == 4 ? "swiglu: float4" : "swiglu: scalar (unaligned view)");
  launch(kr, Dim3{unsigned((C + 256 * vec - 1) / (256 * vec)), unsigned(T), 1}, Dim3{256, 1, 1}, 0, ptr(gate),
         int64_t(gate.stride), ptr(up), int64_t(up.stride), ptr(out), int64_t(out.stride), int(C));
}

void CudaOps::moe_combine_impl(const Tensor& routed, const Tensor& shared, const Tensor& sg, const Tensor& h) {
  const int64_t T = h.rows, C = h.cols;
  if (routed.dtype != DType::F32 || shared.dtype != DType::F32 || sg.dtype != DType::F32 ||
      h.dtype != DType::F32 || routed.rows != T || shared.rows != T || sg.rows != T || routed.cols != C ||
      shared.cols != C || sg.cols < 1)
    throw std::invalid_argument("moe_combine (cuda): routed, shared, h f32 [T, C], shared_gate_logit f32 [T, 1]");
  if (T > 65535) throw std::invalid_argument("moe_combine (cuda): at most 65535 rows");
  if (T == 0 || C == 0) return;
  const int vec =
      vec4({{ptr(routed), routed.stride}, {ptr(shared), shared.stride}, {ptr(h), h.stride}}, C) ? 4 : 1;
  const Kernel& kr = kernel("moe", "moe_combine", {{"MOE_PART", 3}, {"VEC", vec}});
  note_variant("moe.combine", vec == 4 ? "moe_combine: float4" : "moe_combine: scalar (unaligned view)");
  launch(kr, Dim3{unsigned((C + 256 * vec - 1) / (256 * vec)), unsigned(T), 1}, Dim3{256, 1, 1}, 0, ptr(routed),
         int64_t(routed.stride), ptr(shared), int64_t(shared.stride), ptr(sg), int64_t(sg.stride), ptr(h),
         int64_t(h.stride), int(C));
}

}  // namespace lily::cuda
