// Hyper-parameters of the Qwen3.6 (qwen3_5_moe) text decoder, as parsed and validated by lily/config.py.
#pragma once
#include <cstdint>
#include <vector>

namespace lily {

struct ModelConfig {
  int64_t hidden = 0, layers = 0, vocab = 0;
  float eps = 1e-6f;
  // gated full attention
  int64_t heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  double rope_theta = 1e7;
  // Gated DeltaNet
  int64_t lin_k_heads = 0, lin_v_heads = 0, lin_k_dim = 0, lin_v_dim = 0, conv_kernel = 4;
  // sparse MoE
  int64_t experts = 0, topk = 0, moe_inter = 0, shared_inter = 0;
  std::vector<bool> full_attention;  // per layer

  int64_t key_dim() const { return lin_k_heads * lin_k_dim; }
  int64_t value_dim() const { return lin_v_heads * lin_v_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  int64_t n_full() const {
    int64_t n = 0;
    for (bool f : full_attention) n += f;
    return n;
  }
  int64_t n_linear() const { return layers - n_full(); }
  // Throws std::invalid_argument naming the field when the numbers cannot describe a model.
  void validate() const;
};

}  // namespace lily
