// The Qwen3.6 (qwen3_5_moe) text decoder: weights in canonical form and the forward pass, written
// once against the Ops interface (MODEL.md sections 2-6).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "model/config.h"
#include "model/weight.h"

namespace lily {

struct LayerWeights {
  bool full = false;
  Tensor input_norm, post_norm;  // effective RMSNorm multipliers [1, hidden]
  // Gated DeltaNet
  Weight qkv, z, b, a, out;
  Tensor conv, A_log, dt_bias, delta_norm;  // [C, K], [1, Hv], [1, Hv], [1, Dv]
  // gated attention
  Weight q, k, v, o;
  Tensor q_norm, k_norm;  // [1, head_dim]
  // sparse MoE
  Weight router, shared_gate, shared_gate_proj, shared_up, shared_down;
  ExpertSet experts;
};

struct ModelWeights {
  Weight embed, lm_head;
  Tensor final_norm;
  std::vector<LayerWeights> layers;
  bool tied = false;
};

// Per-session state that carries context across prefill chunks and decode steps.
struct SessionState {
  int64_t max_ctx = 0;
  DType kv_dtype = DType::F32;  // F32 (the oracle's default) or BF16 (half the bytes per token)
  std::vector<Tensor> k_cache, v_cache;  // per layer (full attention only): [kv_heads * max_ctx, head_dim]
  std::vector<Tensor> conv, recurrent;    // per layer (DeltaNet only): [K-1, conv_dim], [Hv * Dk, Dv]
};

// Activation buffers for up to `rows` tokens per forward call.
struct Scratch {
  int64_t rows = 0;
  Tensor ids, h, u, mixer_out;
  Tensor qkv, mixed, z, b, a, delta_o, delta_y;                  // DeltaNet
  Tensor qg, k, v, q, gate, kr, attn_o;                          // attention
  Tensor router_logits, topk_ids, topk_w, routed, sh_g, sh_u, sh_act, shared, sh_gate;  // MoE
  Tensor final_h, logits;
  int64_t logit_rows = 0;
};

class Qwen36 {
 public:
  // Takes ownership of the vector parameters it is given (uploaded into backend buffers).
  Qwen36(const ModelConfig& cfg, Ops& ops) : cfg_(cfg), ops_(ops) {}
  const ModelConfig& config() const { return cfg_; }
  ModelWeights& weights() { return w_; }
  const ModelWeights& weights() const { return w_; }
  Ops& ops() { return ops_; }

  SessionState new_state(int64_t max_ctx, DType kv_dtype);
  void free_state(SessionState& st);
  Scratch new_scratch(int64_t rows, int64_t logit_rows);
  void free_scratch(Scratch& sc);
  size_t state_bytes(int64_t max_ctx, DType kv_dtype) const;

  // Runs T tokens at positions pos0.. through the decoder (Phase::Decode requires T == 1) and writes the
  // logits of the last `n_logits` rows (1 or T) into logits_out [n_logits, vocab].
  void forward(SessionState& st, Scratch& sc, const int32_t* ids, int64_t T, int64_t pos0, Phase phase,
               int64_t n_logits, float* logits_out);

 private:
  void delta_layer(const LayerWeights& L, SessionState& st, size_t li, Scratch& sc, int64_t T);
  void attention_layer(const LayerWeights& L, SessionState& st, size_t li, Scratch& sc, int64_t T,
                       int64_t pos0);
  void moe_block(const LayerWeights& L, Scratch& sc, int64_t T);
  AttentionShape attn_shape() const;
  DeltaShape delta_shape() const;

  ModelConfig cfg_;
  Ops& ops_;
  ModelWeights w_;
};

}  // namespace lily
