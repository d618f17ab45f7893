// MetalOps: attn_qk_prep, kv_append and attention (metal/attention.metal; oracle csrc/cpu/attention.cpp).
#include <cmath>
#include <vector>

#include "metal/backend.h"

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

void MetalOps::attention_impl(const Tensor& q, const Tensor& gate, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& pos, int64_t max_ctx, const AttentionShape& s, const Tensor&,
                              const Tensor& out) {
  if (s.head_dim > kMaxHeadDim) throw MetalError("attention: head_dim above 512 is not supported");
  const AttnShape sh{uint32_t(s.heads), uint32_t(s.kv_heads), uint32_t(s.head_dim), uint32_t(max_ctx),
                     uint32_t(q.stride), uint32_t(gate.stride), uint32_t(out.stride),
                     1.f / std::sqrt(float(s.head_dim))};
  const std::vector<FunctionConstant> fc = {FunctionConstant::boolean(10, k_cache.dtype == DType::BF16)};
  const std::vector<Arg> args = {arg(q), arg(gate), arg(k_cache), arg(v_cache), arg(pos), arg(out), Arg::value(sh)};
  // Decode: GQA-packed with coalesced rows (4 query heads per cached row read). Prefill rows: one simdgroup per
  // (row, head), scoring 32 cached rows at once (the longer causal rows keep every lane busy).
  const bool gqa = attention_variant_ == "gqa" || (attention_variant_ == "auto" && phase() == Phase::Decode);
  if (gqa) {
    const int64_t packs = (s.heads / s.kv_heads + 3) / 4;
    dispatch("attention_gqa", fc, args, MTL::Size(NS::UInteger(s.kv_heads * packs), NS::UInteger(q.rows), 1),
             MTL::Size(32, 1, 1));
    return;
  }
  dispatch("attention_rows", fc, args, MTL::Size(NS::UInteger(s.heads), NS::UInteger(q.rows), 1), MTL::Size(32, 1, 1));
}

void MetalOps::set_attention_variant(const std::string& v) {
  if (v != "auto" && v != "rows" && v != "gqa")
    throw std::invalid_argument("attention variant must be 'auto', 'rows' or 'gqa', got '" + v + "'");
  attention_variant_ = v;
}

}  // namespace lily::metal
