#include "model/config.h"

#include <stdexcept>
#include <string>

namespace lily {

void ModelConfig::validate() const {
  auto need = [](bool ok, const char* field) {
    if (!ok) throw std::invalid_argument(std::string("invalid model config field '") + field + "'");
  };
  // Bounds far above the real model (MODEL.md 1.2) that keep every derived size well inside int64.
  auto dim = [&](int64_t v, int64_t max, const char* field) { need(v > 0 && v <= max, field); };
  dim(hidden, 1 << 16, "hidden_size");
  dim(layers, 4096, "num_hidden_layers");
  dim(vocab, 1 << 24, "vocab_size");
  need(int64_t(full_attention.size()) == layers, "layer_types");
  dim(heads, 4096, "num_attention_heads");
  dim(kv_heads, 4096, "num_key_value_heads");
  need(heads % kv_heads == 0, "num_key_value_heads");
  dim(head_dim, 4096, "head_dim");
  need(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0, "partial_rotary_factor");
  dim(lin_k_heads, 4096, "linear_num_key_heads");
  dim(lin_v_heads, 4096, "linear_num_value_heads");
  need(lin_v_heads % lin_k_heads == 0, "linear_num_value_heads");
  dim(lin_k_dim, 4096, "linear_key_head_dim");
  dim(lin_v_dim, 4096, "linear_value_head_dim");
  need(conv_kernel >= 1 && conv_kernel <= 16, "linear_conv_kernel_dim");
  dim(experts, 1 << 16, "num_experts");
  need(topk > 0 && topk <= experts, "num_experts_per_tok");
  dim(moe_inter, 1 << 20, "moe_intermediate_size");
  dim(shared_inter, 1 << 20, "shared_expert_intermediate_size");
  need(eps > 0, "rms_norm_eps");
  need(mtp_layers >= 0 && mtp_layers <= 64, "mtp_num_hidden_layers");
}

}  // namespace lily
