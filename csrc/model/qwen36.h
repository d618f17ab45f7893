// The Qwen3.6 (qwen3_5_moe) text decoder: weights in canonical form and the forward pass, written
// once against the Ops interface (MODEL.md sections 2-6). The graph only encodes: it reads token ids and
// the position from device tensors and leaves logits in device tensors; the Session submits and reads.
#pragma once
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
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
  // sparse MoE: router, shared expert, and the routed experts stacked [experts, out, in]
  Weight router, shared_gate, shared_gate_proj, shared_up, shared_down;
  Weight experts_gate, experts_up, experts_down;
};

// The multi-token-prediction block (MODEL.md section 7): x = [RMSNorm1p(E[t+1]) | RMSNorm1p(h_t)] · fcᵀ,
// then full-attention decoder layers, then RMSNorm1p(x, norm) into the model's lm_head (it has no
// embedding or head of its own). Every forward of a session also runs the block's KV rows (encode_mtp_rows),
// so its cache always covers the context; speculative decoding drafts with encode_mtp_draft.
struct MtpWeights {
  Weight fc;                                                  // [hidden, 2 * hidden]: embedding half first
  Tensor pre_fc_norm_embedding, pre_fc_norm_hidden, norm;     // effective RMSNorm multipliers [1, hidden]
  std::vector<LayerWeights> layers;                           // full attention (full == true)
};

struct ModelWeights {
  Weight embed, lm_head;
  Tensor final_norm;
  std::vector<LayerWeights> layers;
  bool tied = false;
  std::optional<MtpWeights> mtp;  // the checkpoint's MTP block, if it has one (ModelConfig::mtp_layers)
};

// What a step changes besides the KV cache, held twice: a decode step reads one set and writes the
// other, so a speculative step whose token the caller never received is undone by not switching sets
// (KV rows past the position are never read, so the cache needs no second copy). Prefill updates the
// current set in place.
struct StepState {
  std::vector<Tensor> conv, recurrent;  // per layer (DeltaNet only): [K-1, conv_dim], [Hv * Dk, Dv]
  Tensor pos;                           // I32 [1, 1]: tokens whose state is computed
  Tensor logits;                        // F32 [1, vocab]: logits after the last computed token
  Tensor mtp_h;                         // F32 [1, hidden] (MTP checkpoints): h of the last computed token
                                        // after the final norm, the MTP block's input for the next token
};

// DeltaNet states a prefill chunk also leaves after some of its rows (Ops' StateCapture, per layer): the conv
// and recurrent state after rows first .. first + count - 1, count slices each (DeltaNet layers only; the
// entries of attention layers stay invalid). The KV rows need no capture: rows up to any position are in the
// cache once the chunk is done.
struct ChunkCapture {
  int64_t first = 0, count = 0;
  std::vector<Tensor> conv, recurrent;  // per layer: [count * (K-1), conv_dim], [count * Hv * Dk, Dv]
};

// Per-session state that carries context across prefill chunks and decode steps, all in backend tensors.
struct SessionState {
  int64_t max_ctx = 0;
  DType kv_dtype = DType::F32;  // F32 (the oracle's default) or BF16 (half the bytes per token)
  std::vector<Tensor> k_cache, v_cache;  // per layer (full attention only): [kv_heads * max_ctx, head_dim]
  // The MTP block's KV cache, per MTP layer, same layout. Row t holds the block's K/V for the pair
  // (token t + 1, h_t) at RoPE position t (vLLM's shift, see encode_mtp_rows): rows [0, position - 1)
  // are valid, the last token's pair waits for the next token (its h_t is StepState::mtp_h).
  std::vector<Tensor> mtp_k_cache, mtp_v_cache;
  StepState sets[2];
  int cur = 0;  // host-side: which set holds the session's state
  StepState& now() { return sets[cur]; }
  StepState& other() { return sets[1 - cur]; }
  // Every KV cache pair (k, v) in Qwen36::kv_cache_count() order.
  std::vector<std::pair<Tensor, Tensor>> kv_caches() const {
    std::vector<std::pair<Tensor, Tensor>> v;
    for (size_t i = 0; i < k_cache.size(); ++i)
      if (k_cache[i].valid()) v.emplace_back(k_cache[i], v_cache[i]);
    for (size_t j = 0; j < mtp_k_cache.size(); ++j) v.emplace_back(mtp_k_cache[j], mtp_v_cache[j]);
    return v;
  }
  Tensor slot[2];  // I32 [1, 1]: decode input slots, alternating
  SamplerState sampler;
};

// One tensor of a session's state (for sizes, snapshots and the report, from one place).
struct StateTensor {
  enum class Kind : uint8_t { K, V, Conv, Recurrent, MtpK, MtpV } kind;
  size_t layer;  // MtpK / MtpV: the MTP layer
  int set;  // Conv / Recurrent: which StepState
  DType dtype;
  int64_t rows, cols;
};

// Activation buffers for up to `rows` tokens per forward: one list, so declaring, allocating and
// releasing a field cannot drift apart. X(name, dtype, rows (rows | logit_rows), columns, needed).
#define LILY_SCRATCH_FIELDS(X)                                                     \
  X(ids, I32, rows, 1, true)                                                       \
  X(h, F32, rows, c.hidden, true)                                                  \
  X(u, F32, rows, c.hidden, true)                                                  \
  X(mixer_out, F32, rows, c.hidden, true)                                          \
  X(qkv, F32, rows, c.conv_dim(), c.n_linear() > 0)                                \
  X(mixed, F32, rows, c.conv_dim(), c.n_linear() > 0)                              \
  X(z, F32, rows, c.value_dim(), c.n_linear() > 0)                                 \
  X(b, F32, rows, c.lin_v_heads, c.n_linear() > 0)                                 \
  X(a, F32, rows, c.lin_v_heads, c.n_linear() > 0)                                 \
  X(delta_o, F32, rows, c.value_dim(), c.n_linear() > 0)                           \
  X(delta_y, F32, rows, c.value_dim(), c.n_linear() > 0)                           \
  X(qg, F32, rows, 2 * c.heads * c.head_dim, c.n_full() > 0)                       \
  X(k, F32, rows, c.kv_heads * c.head_dim, c.n_full() > 0)                         \
  X(v, F32, rows, c.kv_heads * c.head_dim, c.n_full() > 0)                         \
  X(q, F32, rows, c.heads * c.head_dim, c.n_full() > 0)                            \
  X(gate, F32, rows, c.heads * c.head_dim, c.n_full() > 0)                         \
  X(kr, F32, rows, c.kv_heads * c.head_dim, c.n_full() > 0)                        \
  X(attn_o, F32, rows, c.heads * c.head_dim, c.n_full() > 0)                       \
  X(router_logits, F32, rows, c.experts, true)                                     \
  X(topk_ids, I32, rows, c.topk, true)                                             \
  X(topk_w, F32, rows, c.topk, true)                                               \
  X(routed, F32, rows, c.hidden, true)                                             \
  X(sh_g, F32, rows, c.shared_inter, true)                                         \
  X(sh_u, F32, rows, c.shared_inter, true)                                         \
  X(sh_act, F32, rows, c.shared_inter, true)                                       \
  X(shared, F32, rows, c.hidden, true)                                             \
  X(sh_gate, F32, rows, 1, true)                                                   \
  X(final_h, F32, logit_rows, c.hidden, true)                                      \
  X(logits, F32, logit_rows, c.vocab, true)                                        \
  X(mtp_hn, F32, rows + 1, c.hidden, c.mtp_layers > 0)                             \
  X(mtp_in, F32, rows, 2 * c.hidden, c.mtp_layers > 0)                             \
  X(mtp_x, F32, rows, c.hidden, c.mtp_layers > 0)                                  \
  X(mtp_draft_h, F32, 1, c.hidden, c.mtp_layers > 0)                               \
  X(mtp_pos, I32, 1, 1, c.mtp_layers > 0)

struct Scratch {
  int64_t rows = 0, logit_rows = 0, max_ctx = 0;
#define LILY_DECLARE_SCRATCH(name, dtype, nrows, cols, needed) Tensor name;
  LILY_SCRATCH_FIELDS(LILY_DECLARE_SCRATCH)
#undef LILY_DECLARE_SCRATCH
  Tensor ws;  // the workspace ops take their scratch from (Ops::workspace_bytes)
};

class Qwen36 {
 public:
  Qwen36(const ModelConfig& cfg, Ops& ops) : cfg_(cfg), ops_(ops) {}
  const ModelConfig& config() const { return cfg_; }
  ModelWeights& weights() { return w_; }
  const ModelWeights& weights() const { return w_; }
  Ops& ops() { return ops_; }

  // Every state tensor of a session with this context and KV dtype.
  std::vector<StateTensor> state_tensors(int64_t max_ctx, DType kv_dtype) const;
  // Throws std::invalid_argument (naming max_context) when the state would not be addressable.
  size_t state_bytes(int64_t max_ctx, DType kv_dtype) const;
  SessionState new_state(int64_t max_ctx, DType kv_dtype);  // on failure releases what it allocated
  void free_state(SessionState& st);
  Scratch new_scratch(int64_t rows, int64_t logit_rows, int64_t max_ctx);
  void free_scratch(Scratch& sc);

  // Encodes the decoder over T tokens read from ids ([T, 1], I32) at positions in.pos.., reading the
  // recurrent state from `in` and writing it, and the advanced position, to `out` (the same set for an
  // in-place prefill); the final hidden rows stay in sc.h. Phase::Decode requires T == 1. `capture`, if
  // given, also receives the DeltaNet state after the rows it names (its rows must lie in [0, T)).
  void encode_layers(SessionState& st, const StepState& in, const StepState& out, Scratch& sc, const Tensor& ids,
                     int64_t T, Phase phase, const ChunkCapture* capture = nullptr);
  // Final norm and lm_head over rows [row0, row0 + n) of sc.h into out [n, vocab] (n <= sc.logit_rows).
  void encode_logits(Scratch& sc, int64_t row0, int64_t n, const Tensor& out);

  // ---- the MTP block (MODEL.md section 7; a no-op without one) ----
  bool has_mtp() const { return w_.mtp.has_value(); }
  // Whether sessions run the block's rows in their forwards (engine-wide; the engine's mtp policy sets it):
  // off, a forward skips them (about one layer's fc and q/k/v products per token) and the session's block
  // cache stops covering its context (Session::mtp_cache_valid). Any thread; read once per forward.
  bool keep_mtp_rows() const { return has_mtp() && keep_mtp_rows_.load(std::memory_order_relaxed); }
  void set_keep_mtp_rows(bool keep) { keep_mtp_rows_.store(keep, std::memory_order_relaxed); }
  // KV caches of a session: the decoder's full-attention layers, then the MTP block's (snapshots, session
  // files and SessionState::kv_caches list them in this order).
  size_t kv_cache_count() const { return size_t(cfg_.n_full()) + (has_mtp() ? size_t(cfg_.mtp_layers) : 0); }
  // After encode_layers over the T rows ids [T, 1] at positions in.pos..: the MTP block's KV rows for those
  // tokens. Row j pairs token j with the main model's h of the token before it (after the final norm): the
  // one before the chunk from in.mtp_h, the others from sc.h. sc.mtp_hn rows 1 .. T get the normed h of the
  // chunk's rows (row j + 1: after token j, what a draft from there reads); row T goes to out.mtp_h.
  // `at_zero`: the chunk starts the context (its first token has no h before it: one row fewer). Call it after
  // encode_layers with the same sets: it reads the position from out.pos (advanced to pos0 + T).
  void encode_mtp_rows(SessionState& st, const StepState& in, const StepState& out, Scratch& sc, const Tensor& ids,
                       int64_t T, bool at_zero);
  // One draft step: the block over the pair (token [1, 1], h [1, hidden]) at MTP position pos[0] + shift
  // (the main position of the token, minus one), writing that KV row, the block's hidden after mtp.norm to
  // sc.mtp_draft_h (the next draft step's h: drafts chain through the block's own hidden) and the logits
  // through the model's lm_head (the same Weight, never a copy) to logits [1, vocab]. h may be sc.mtp_draft_h.
  void encode_mtp_draft(SessionState& st, Scratch& sc, const Tensor& token, const Tensor& h, const Tensor& pos,
                        int64_t shift, const Tensor& logits);

 private:
  void delta_layer(const LayerWeights& L, const StepState& in, const StepState& out, size_t li, Scratch& sc,
                   int64_t T, const ChunkCapture* capture);
  void attention_layer(const LayerWeights& L, SessionState& st, const Tensor& pos, size_t li, Scratch& sc,
                       int64_t T);
  void attend(const LayerWeights& L, const Tensor& x, const Tensor& k_cache, const Tensor& v_cache, int64_t max_ctx,
              const Tensor& pos, Scratch& sc, int64_t T);
  void moe_block(const LayerWeights& L, Scratch& sc, int64_t T);
  void moe_block(const LayerWeights& L, Scratch& sc, int64_t T, const Tensor& h);  // into residual h [T, hidden]
  // The MTP block over n rows: x = [RMSNorm1p(E[ids]) | RMSNorm1p(h)] · fcᵀ into sc.mtp_x, then its layers at
  // positions pos[0]..; with kv_only the last layer stops after writing its KV rows (nothing reads its output).
  void mtp_block(SessionState& st, Scratch& sc, const Tensor& ids, const Tensor& h, const Tensor& pos, int64_t n,
                 bool kv_only);
  AttentionShape attn_shape() const;
  DeltaShape delta_shape() const;

  ModelConfig cfg_;
  Ops& ops_;
  ModelWeights w_;
  std::atomic<bool> keep_mtp_rows_{true};
};

}  // namespace lily
