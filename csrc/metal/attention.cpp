// MetalOps: attn_qk_prep, kv_append and attention (metal/attention.metal; oracle csrc/cpu/attention.cpp).
#include <algorithm>
#include <cmath>
#include <vector>

#include "metal/backend.h"
#include "model/config.h"

namespace lily::metal {

namespace {
struct QkPrepShape {  // metal/attention.metal
  uint32_t heads, kv_heads, D, rd, ld_qg, ld_k, ld_q, ld_gate, ld_ko;
  float eps;
};
static_assert(sizeof(QkPrepShape) == 40, "QkPrepShape must match metal/attention.metal");
struct KvShape {
  uint32_t kv_heads, D, max_ctx, T, ld_k, ld_v;
};
static_assert(sizeof(KvShape) == 24, "KvShape must match metal/attention.metal");
struct AttnShape {
  uint32_t heads, kv_heads, D, max_ctx, ld_q, ld_gate, ld_out;
  float scale;
};
static_assert(sizeof(AttnShape) == 32, "AttnShape must match metal/attention.metal");
struct SplitShape {
  uint32_t heads, kv_heads, D, max_ctx, ld_q, ld_gate, ld_out, block, blocks, min_split;
  float scale;
};
static_assert(sizeof(SplitShape) == 44, "SplitShape must match metal/attention.metal");
constexpr int64_t kMaxHeadDim = 512;  // attention_rows keeps D/32 accumulators per lane (kMaxDimsPerLane = 16)
}  // namespace

void MetalOps::attn_qk_prep_impl(const Tensor& qg, const Tensor& k, const Tensor& q_norm, const Tensor& k_norm,
                                 const Tensor& pos, const AttentionShape& s, const Tensor& q_out,
                                 const Tensor& gate_out, const Tensor& k_out) {
  const int64_t half = s.rotary_dim / 2;
  if (s.rotary_dim % 2 || s.rotary_dim > s.head_dim || half > 1024) throw MetalError("attn_qk_prep: bad rotary_dim");
  // The rotary frequencies exactly as the CPU computes them (in double, rounded once to float).
  std::vector<float> inv_freq(size_t(std::max<int64_t>(half, 1)));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[size_t(i)] = float(1.0 / std::pow(s.rope_theta, double(2 * i) / double(s.rotary_dim)));
  const QkPrepShape sh{uint32_t(s.heads), uint32_t(s.kv_heads), uint32_t(s.head_dim), uint32_t(s.rotary_dim),
                       uint32_t(qg.stride), uint32_t(k.stride), uint32_t(q_out.stride), uint32_t(gate_out.stride),
                       uint32_t(k_out.stride), s.eps};
  dispatch("attn_qk_prep", {},
           {arg(qg), arg(k), arg(q_norm), arg(k_norm), arg(pos), Arg::raw(inv_freq.data(), inv_freq.size() * 4),
            arg(q_out), arg(gate_out), arg(k_out), Arg::value(sh)},
           MTL::Size(NS::UInteger(s.heads + s.kv_heads), NS::UInteger(qg.rows), 1), MTL::Size(32, 1, 1));
}

void MetalOps::kv_append_impl(const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t max_ctx, const AttentionShape& s) {
  const KvShape sh{uint32_t(s.kv_heads), uint32_t(s.head_dim), uint32_t(max_ctx), uint32_t(k.rows), uint32_t(k.stride),
                   uint32_t(v.stride)};
  dispatch("kv_append", {FunctionConstant::boolean(10, k_cache.dtype == DType::BF16)},
           {arg(k), arg(v), arg(pos), arg(k_cache), arg(v_cache), Arg::value(sh)},
           MTL::Size(NS::UInteger((s.head_dim + 63) / 64), NS::UInteger(s.kv_heads), NS::UInteger(k.rows)),
           MTL::Size(64, 1, 1));
}

namespace {
// Blocks of the split path's partials per (row, head): every block max_ctx can hold (fixed at encode time).
int64_t split_blocks(int64_t max_ctx, int64_t block) { return std::max<int64_t>(1, (max_ctx + block - 1) / block); }

// Why a call does not take the split path (empty: it does).
std::string split_refusal(const std::string& variant, Phase phase, int64_t rows, int64_t max_ctx, int64_t min) {
  if (variant == "rows" || variant == "gqa") return "attention variant '" + variant + "'";
  if (variant == "auto" && phase != Phase::Decode) return "prefill rows";
  if (rows > MetalOps::kMaxSplitRows) return std::to_string(rows) + " rows above " +
                                             std::to_string(MetalOps::kMaxSplitRows);
  if (variant == "auto" && max_ctx < min)
    return "max_ctx " + std::to_string(max_ctx) + " below " + std::to_string(min) + " rows";
  return {};
}
}  // namespace

size_t MetalOps::split_attention_bytes(const ModelConfig& cfg, int64_t rows, int64_t max_ctx) const {
  if (cfg.heads <= 0) return 0;
  return size_t(std::min<int64_t>(rows, kMaxSplitRows)) * size_t(cfg.heads) *
         size_t(split_blocks(max_ctx, split_block_)) * size_t(cfg.head_dim + 2) * sizeof(float);
}

void MetalOps::attention_impl(const Tensor& q, const Tensor& gate, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& pos, int64_t max_ctx, const AttentionShape& s, const Tensor& ws,
                              const Tensor& out) {
  if (s.head_dim > kMaxHeadDim) throw MetalError("attention: head_dim above 512 is not supported");
  const std::vector<FunctionConstant> fc = {FunctionConstant::boolean(10, k_cache.dtype == DType::BF16)};
  const int64_t packs = (s.heads / s.kv_heads + 3) / 4;
  // Long decode contexts: fixed blocks of split_block_ rows, a partial per (head, block) in the workspace, then the
  // reduce. The host cannot see pos (it lives on the GPU), so it takes this form whenever the context could reach
  // split_min_ rows; the kernels split only once pos + 1 does (below that, block 0 walks the whole context).
  const std::string refused = split_refusal(attention_variant_, phase(), q.rows, max_ctx, split_min_);
  if (refused.empty()) {
    const int64_t blocks = split_blocks(max_ctx, split_block_);
    const size_t need = size_t(q.rows) * size_t(s.heads) * size_t(blocks) * size_t(s.head_dim + 2) * sizeof(float);
    if (ws.bytes() < need)
      throw MetalError("attention: workspace of " + std::to_string(ws.bytes()) + " bytes below the split path's " +
                       std::to_string(need) + " (workspace_bytes)");
    check_contiguous(ws, "attention", "ws");
    const SplitShape sh{uint32_t(s.heads), uint32_t(s.kv_heads), uint32_t(s.head_dim), uint32_t(max_ctx),
                        uint32_t(q.stride), uint32_t(gate.stride), uint32_t(out.stride), uint32_t(split_block_),
                        uint32_t(blocks), uint32_t(std::min<int64_t>(split_min_, int64_t(UINT32_MAX))),
                        1.f / std::sqrt(float(s.head_dim))};
    dispatch("attention_split", fc, {arg(q), arg(k_cache), arg(v_cache), arg(pos), arg(ws), Arg::value(sh)},
             MTL::Size(NS::UInteger(s.kv_heads * packs), NS::UInteger(blocks), NS::UInteger(q.rows)),
             MTL::Size(32, 1, 1));
    barrier_in_op();  // the reduce reads every block's partial
    dispatch("attention_split_reduce", {}, {arg(ws), arg(gate), arg(pos), arg(out), Arg::value(sh)},
             MTL::Size(NS::UInteger(s.heads), NS::UInteger(q.rows), 1), MTL::Size(32, 1, 1));
    ++counters_.attention_split_calls;
    return;
  }
  if (phase() == Phase::Decode) {
    ++counters_.attention_unsplit_calls;
    counters_.attention_unsplit_reason = refused;
  }
  const AttnShape sh{uint32_t(s.heads), uint32_t(s.kv_heads), uint32_t(s.head_dim), uint32_t(max_ctx),
                     uint32_t(q.stride), uint32_t(gate.stride), uint32_t(out.stride),
                     1.f / std::sqrt(float(s.head_dim))};
  const std::vector<Arg> args = {arg(q), arg(gate), arg(k_cache), arg(v_cache), arg(pos), arg(out), Arg::value(sh)};
  // Decode: GQA-packed with coalesced rows (4 query heads per cached row read). Prefill rows: one simdgroup per
  // (row, head), scoring 32 cached rows at once (the longer causal rows keep every lane busy).
  const bool gqa = attention_variant_ == "gqa" || (attention_variant_ == "auto" && phase() == Phase::Decode);
  if (gqa) {
    dispatch("attention_gqa", fc, args, MTL::Size(NS::UInteger(s.kv_heads * packs), NS::UInteger(q.rows), 1),
             MTL::Size(32, 1, 1));
    return;
  }
  dispatch("attention_rows", fc, args, MTL::Size(NS::UInteger(s.heads), NS::UInteger(q.rows), 1), MTL::Size(32, 1, 1));
}

void MetalOps::set_attention_variant(const std::string& v) {
  if (v != "auto" && v != "rows" && v != "gqa" && v != "split")
    throw std::invalid_argument("attention variant must be 'auto', 'rows', 'gqa' or 'split', got '" + v + "'");
  attention_variant_ = v;
}

void MetalOps::set_split_attention(int64_t min_ctx, int64_t block) {
  if (min_ctx < 1 || block < 1 || block > int64_t(UINT32_MAX))
    throw std::invalid_argument("split attention: min_ctx and block must be at least 1");
  split_min_ = min_ctx;
  split_block_ = block;
}

}  // namespace lily::metal
