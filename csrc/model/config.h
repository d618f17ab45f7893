// Hyper-parameters of the Qwen3.6 (qwen3_5_moe) text decoder, as parsed and validated by lily/config.py.
// LILY_CONFIG_FIELDS is the one list of the integer and real fields: the struct, the bindings' parser and
// the error messages all come from it (the keys are those of ModelConfig.to_core() in config.py).
#pragma once
#include <cstdint>
#include <vector>

namespace lily {

// X(member, type, key of to_core(), the config.json field it comes from)
#define LILY_CONFIG_FIELDS(X)                                          \
  X(hidden, int64_t, "hidden", "hidden_size")                          \
  X(layers, int64_t, "layers", "num_hidden_layers")                    \
  X(vocab, int64_t, "vocab", "vocab_size")                             \
  X(eps, float, "eps", "rms_norm_eps")                                 \
  X(heads, int64_t, "heads", "num_attention_heads")                    \
  X(kv_heads, int64_t, "kv_heads", "num_key_value_heads")              \
  X(head_dim, int64_t, "head_dim", "head_dim")                         \
  X(rotary_dim, int64_t, "rotary_dim", "partial_rotary_factor")        \
  X(rope_theta, double, "rope_theta", "rope_theta")                    \
  X(lin_k_heads, int64_t, "lin_k_heads", "linear_num_key_heads")       \
  X(lin_v_heads, int64_t, "lin_v_heads", "linear_num_value_heads")     \
  X(lin_k_dim, int64_t, "lin_k_dim", "linear_key_head_dim")            \
  X(lin_v_dim, int64_t, "lin_v_dim", "linear_value_head_dim")          \
  X(conv_kernel, int64_t, "conv_kernel", "linear_conv_kernel_dim")     \
  X(experts, int64_t, "experts", "num_experts")                        \
  X(topk, int64_t, "topk", "num_experts_per_tok")                      \
  X(moe_inter, int64_t, "moe_inter", "moe_intermediate_size")          \
  X(shared_inter, int64_t, "shared_inter", "shared_expert_intermediate_size")

struct ModelConfig {
#define LILY_DECLARE_FIELD(member, type, key, field) type member = 0;
  LILY_CONFIG_FIELDS(LILY_DECLARE_FIELD)
#undef LILY_DECLARE_FIELD
  std::vector<bool> full_attention;  // per layer ("full_attention" key, from layer_types)
  // Decoder layers of the checkpoint's MTP block (MODEL.md section 7; optional "mtp_layers" key, 0 = no
  // block). What the checkpoint holds, counted by lily/checkpoint.py: mlx-lm keeps config.json's
  // mtp_num_hidden_layers but drops the tensors.
  int64_t mtp_layers = 0;

  int64_t key_dim() const { return lin_k_heads * lin_k_dim; }
  int64_t value_dim() const { return lin_v_heads * lin_v_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  int64_t n_full() const {
    int64_t n = 0;
    for (bool f : full_attention) n += f;
    return n;
  }
  int64_t n_linear() const { return layers - n_full(); }
  // Throws std::invalid_argument naming the field when the numbers cannot describe a model (or when a
  // size derived from them would overflow).
  void validate() const;
};

}  // namespace lily
