// The Qwen3.6 forward (MODEL.md section 2):
//   h = E[ids]
//   for each layer: h += mixer(rmsnorm(h))   (Gated DeltaNet, or gated attention every 4th layer)
//                   h += moe(rmsnorm(h))     (routed top-k experts + sigmoid-gated shared expert)
//   logits = lm_head(rmsnorm(h))
#include "model/qwen36.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace lily {

// Gated DeltaNet mixer (MODEL.md section 5): the input norm with the projections, causal conv + silu on [q|k|v], the gated delta
// recurrence, per-head gated RMSNorm with silu(z), output projection.
void Qwen36::delta_layer(const LayerWeights& L, const StepState& in, const StepState& out, size_t li, Scratch& sc,
                         int64_t T, const ChunkCapture* capture) {
  auto r = [T](const Tensor& t) { return t.rows_view(0, T); };
  ops_.rms_norm_matmuls(r(sc.h), L.input_norm, cfg_.eps, r(sc.u),
                        MatmulGroup().add(L.qkv, r(sc.qkv)).add(L.z, r(sc.z)).add(L.b, r(sc.b)).add(L.a, r(sc.a)));
  StateCapture conv_cap, recurrent_cap;  // none unless the chunk keeps states after inner rows
  if (capture) {
    conv_cap = {capture->conv[li], capture->first, capture->count};
    recurrent_cap = {capture->recurrent[li], capture->first, capture->count};
  }
  ops_.conv_delta_norm(r(sc.qkv), r(sc.z), r(sc.b), r(sc.a), L.conv, L.A_log, L.dt_bias, L.delta_norm, cfg_.eps,
                       delta_shape(), in.conv[li], out.conv[li], in.recurrent[li], out.recurrent[li], r(sc.mixed),
                       r(sc.delta_o), sc.ws, r(sc.delta_y), conv_cap, recurrent_cap);
  ops_.matmul(r(sc.delta_y), L.out, r(sc.mixer_out));
}

// Gated full attention (MODEL.md section 4): the input norm with the projections, q/gate split per head,
// q/k RMSNorm, partial RoPE, KV cache, causal GQA softmax attention, sigmoid output gate, output projection.
void Qwen36::attention_layer(const LayerWeights& L, SessionState& st, const Tensor& pos, size_t li, Scratch& sc,
                             int64_t T) {
  attend(L, sc.h, st.k_cache[li], st.v_cache[li], st.max_ctx, pos, sc, T);
}

// The attention mixer over residual stream x (the decoder's sc.h or the MTP block's sc.mtp_x) into sc.mixer_out,
// with the KV cache given (a decoder layer's or the MTP block's).
void Qwen36::attend(const LayerWeights& L, const Tensor& x, const Tensor& k_cache, const Tensor& v_cache,
                    int64_t max_ctx, const Tensor& pos, Scratch& sc, int64_t T) {
  auto r = [T](const Tensor& t) { return t.rows_view(0, T); };
  const AttentionShape s = attn_shape();
  ops_.rms_norm_matmuls(r(x), L.input_norm, cfg_.eps, r(sc.u),
                        MatmulGroup().add(L.q, r(sc.qg)).add(L.k, r(sc.k)).add(L.v, r(sc.v)));
  ops_.attn_qk_prep_append(r(sc.qg), r(sc.k), r(sc.v), L.q_norm, L.k_norm, pos, s, r(sc.q), r(sc.gate), r(sc.kr),
                           k_cache, v_cache, max_ctx);
  ops_.attention(r(sc.q), r(sc.gate), k_cache, v_cache, pos, max_ctx, s, sc.ws, r(sc.attn_o));
  ops_.matmul(r(sc.attn_o), L.o, r(sc.mixer_out));
}

// Sparse MoE (MODEL.md section 6), added into the residual stream after the mixer's: the residual add, the
// post-attention norm, the router and the shared expert's sigmoid gate (they read the same normed rows) as one
// op, then the rest of the block as one op.
void Qwen36::moe_block(const LayerWeights& L, Scratch& sc, int64_t T) { moe_block(L, sc, T, sc.h); }

// The same into residual stream h [T, hidden] (the decoder's sc.h or the MTP block's sc.mtp_x).
void Qwen36::moe_block(const LayerWeights& L, Scratch& sc, int64_t T, const Tensor& h) {
  auto r = [T](const Tensor& t) { return t.rows_view(0, T); };
  ops_.add_rms_norm_matmuls(r(h), r(sc.mixer_out), L.post_norm, cfg_.eps, r(h), r(sc.u),
                            MatmulGroup().add(L.router, r(sc.router_logits)).add(L.shared_gate, r(sc.sh_gate)));
  const MoeWeights w{L.experts_gate, L.experts_up, L.experts_down, L.shared_gate_proj, L.shared_up, L.shared_down};
  const MoeScratch ms{r(sc.topk_ids), r(sc.topk_w), r(sc.routed), r(sc.sh_g), r(sc.sh_u), r(sc.sh_act), r(sc.shared)};
  ops_.moe(r(sc.u), r(sc.router_logits), r(sc.sh_gate), cfg_.topk, w, ms, sc.ws, r(h));
}

void Qwen36::encode_layers(SessionState& st, const StepState& in, const StepState& out, Scratch& sc,
                           const Tensor& ids, int64_t T, Phase phase, const ChunkCapture* capture) {
  if (T <= 0 || T > sc.rows) throw std::logic_error("encode_layers: chunk larger than scratch");
  if (phase == Phase::Decode && T > ops_.decode_rows())
    throw std::logic_error("encode_layers: a decode-phase forward of " + std::to_string(T) + " rows (the backend takes " +
                           std::to_string(ops_.decode_rows()) + ")");
  auto r = [T](const Tensor& t) { return t.rows_view(0, T); };
  ops_.embed(ids.rows_view(0, T), w_.embed, r(sc.h));
  for (size_t li = 0; li < w_.layers.size(); ++li) {
    const LayerWeights& L = w_.layers[li];
    if (L.full)  // each mixer opens with its input norm, fused with its projections
      attention_layer(L, st, in.pos, li, sc, T);
    else
      delta_layer(L, in, out, li, sc, T, capture);
    moe_block(L, sc, T);
  }
  ops_.advance_position(in.pos, out.pos, T);
}

void Qwen36::encode_logits(Scratch& sc, int64_t row0, int64_t n, const Tensor& out) {
  if (n <= 0 || n > sc.logit_rows || out.rows != n) throw std::logic_error("encode_logits: bad row block");
  ops_.rms_norm_matmuls(sc.h.rows_view(row0, n), w_.final_norm, cfg_.eps, sc.final_h.rows_view(0, n),
                        MatmulGroup().add(w_.lm_head, out));
}

// ---- the MTP block (MODEL.md section 7) ----
// Semantics of vLLM (models/qwen3_5_mtp.py, qwen3_next_mtp.py; v1/spec_decode/eagle.py prepares its inputs):
// the block's row for the pair (token t + 1, h_t) runs at position t, h_t is the main model's output after
// its final norm (the model's forward returns norm(h)), and a chained draft step takes the block's own output
// after mtp.norm, the same rows its logits come from. MODEL.md section 7 writes "at position t + 1": vLLM's
// positions are the target positions (t), and each further draft step adds one; Lily follows vLLM.
// All norms are RMSNorm1p, folded to plain multipliers by the loader like the decoder's (ops.h rms_norm).

void Qwen36::mtp_block(SessionState& st, Scratch& sc, const Tensor& ids, const Tensor& h, const Tensor& pos,
                       int64_t n, bool kv_only) {
  const MtpWeights& M = *w_.mtp;
  auto r = [n](const Tensor& t) { return t.rows_view(0, n); };
  // [e | hn]: the normalised embedding and hidden rows side by side (embedding first), the fc's input.
  ops_.mtp_input(ids, w_.embed, h, M.pre_fc_norm_embedding, M.pre_fc_norm_hidden, cfg_.eps, r(sc.u), r(sc.mixer_out),
                 r(sc.mtp_in));
  ops_.matmul(r(sc.mtp_in), M.fc, r(sc.mtp_x));
  for (size_t j = 0; j < M.layers.size(); ++j) {
    const LayerWeights& L = M.layers[j];
    if (kv_only && j + 1 == M.layers.size()) {  // only the K/V rows of the last layer are read later
      const AttentionShape s = attn_shape();
      ops_.rms_norm_matmuls(r(sc.mtp_x), L.input_norm, cfg_.eps, r(sc.u),
                            MatmulGroup().add(L.q, r(sc.qg)).add(L.k, r(sc.k)).add(L.v, r(sc.v)));
      ops_.attn_qk_prep_append(r(sc.qg), r(sc.k), r(sc.v), L.q_norm, L.k_norm, pos, s, r(sc.q), r(sc.gate), r(sc.kr),
                               st.mtp_k_cache[j], st.mtp_v_cache[j], st.max_ctx);
      return;
    }
    attend(L, sc.mtp_x, st.mtp_k_cache[j], st.mtp_v_cache[j], st.max_ctx, pos, sc, n);
    moe_block(L, sc, n, sc.mtp_x);  // the residual add and post norm included
  }
}

void Qwen36::encode_mtp_rows(SessionState& st, const StepState& in, const StepState& out, Scratch& sc,
                             const Tensor& ids, int64_t T, bool at_zero) {
  if (!has_mtp()) return;
  if (T <= 0 || T > sc.rows) throw std::logic_error("encode_mtp_rows: chunk larger than scratch");
  if (!at_zero) ops_.copy(in.mtp_h, sc.mtp_hn.rows_view(0, 1));
  ops_.rms_norm(sc.h.rows_view(0, T), w_.final_norm, sc.mtp_hn.rows_view(1, T), cfg_.eps);
  ops_.copy(sc.mtp_hn.rows_view(T, 1), out.mtp_h);
  const int64_t s = at_zero ? 1 : 0, n = T - s;  // rows s .. T-1: token j with h of token j - 1
  if (n == 0) return;
  // From out.pos, which encode_layers advanced to pos0 + T (in.pos is the same tensor in an in-place prefill).
  ops_.advance_position(out.pos, sc.mtp_pos, s - 1 - T);
  mtp_block(st, sc, ids.rows_view(s, n), sc.mtp_hn.rows_view(s, n), sc.mtp_pos, n, true);
}

void Qwen36::encode_mtp_draft(SessionState& st, Scratch& sc, const Tensor& token, const Tensor& h,
                              const Tensor& pos, int64_t shift, const Tensor& logits) {
  if (!has_mtp()) throw std::logic_error("encode_mtp_draft: the checkpoint has no MTP block");
  ops_.advance_position(pos, sc.mtp_pos, shift);
  mtp_block(st, sc, token, h, sc.mtp_pos, 1, false);
  ops_.rms_norm_matmuls(sc.mtp_x.rows_view(0, 1), w_.mtp->norm, cfg_.eps, sc.mtp_draft_h,
                        MatmulGroup().add(w_.lm_head, logits));  // the target's LM head, not a copy (issue 14)
}

// ---- state and scratch ----

AttentionShape Qwen36::attn_shape() const {
  return {cfg_.heads, cfg_.kv_heads, cfg_.head_dim, cfg_.rotary_dim, cfg_.rope_theta, cfg_.eps};
}

DeltaShape Qwen36::delta_shape() const {
  return {cfg_.lin_k_heads, cfg_.lin_v_heads, cfg_.lin_k_dim, cfg_.lin_v_dim, cfg_.conv_kernel, cfg_.eps};
}

std::vector<StateTensor> Qwen36::state_tensors(int64_t max_ctx, DType kv_dtype) const {
  std::vector<StateTensor> v;
  for (size_t i = 0; i < size_t(cfg_.layers); ++i) {
    if (cfg_.full_attention[i]) {
      v.push_back({StateTensor::Kind::K, i, 0, kv_dtype, cfg_.kv_heads * max_ctx, cfg_.head_dim});
      v.push_back({StateTensor::Kind::V, i, 0, kv_dtype, cfg_.kv_heads * max_ctx, cfg_.head_dim});
    } else {
      for (int set = 0; set < 2; ++set) {
        v.push_back({StateTensor::Kind::Conv, i, set, DType::F32, cfg_.conv_kernel - 1, cfg_.conv_dim()});
        v.push_back({StateTensor::Kind::Recurrent, i, set, DType::F32, cfg_.lin_v_heads * cfg_.lin_k_dim,
                     cfg_.lin_v_dim});
      }
    }
  }
  for (size_t j = 0; j < size_t(cfg_.mtp_layers) && has_mtp(); ++j) {
    v.push_back({StateTensor::Kind::MtpK, j, 0, kv_dtype, cfg_.kv_heads * max_ctx, cfg_.head_dim});
    v.push_back({StateTensor::Kind::MtpV, j, 0, kv_dtype, cfg_.kv_heads * max_ctx, cfg_.head_dim});
  }
  return v;
}

size_t Qwen36::state_bytes(int64_t max_ctx, DType kv_dtype) const {
  // The KV rows of one layer must fit an int64 element count and the whole state a size_t, checked
  // before anything is multiplied out (max_context comes from users and session files).
  const int64_t kv_row = cfg_.kv_heads * cfg_.head_dim;
  constexpr int64_t kMax = int64_t(1) << 46;  // 64 TiB: no machine holds a larger state
  if (max_ctx <= 0 || max_ctx > kMax / (kv_row * 2 * std::max<int64_t>(1, cfg_.n_full() + cfg_.mtp_layers)))
    throw std::invalid_argument("max_context " + std::to_string(max_ctx) +
                                " gives a KV cache larger than any addressable memory");
  size_t total = 0;
  for (const StateTensor& t : state_tensors(max_ctx, kv_dtype))
    total += size_t(t.rows) * size_t(t.cols) * dtype_size(t.dtype);
  return total;
}

SessionState Qwen36::new_state(int64_t max_ctx, DType kv_dtype) {
  state_bytes(max_ctx, kv_dtype);  // validates max_ctx
  SessionState st;
  st.max_ctx = max_ctx;
  st.kv_dtype = kv_dtype;
  const size_t n = size_t(cfg_.layers);
  st.k_cache.resize(n);
  st.v_cache.resize(n);
  st.mtp_k_cache.resize(has_mtp() ? size_t(cfg_.mtp_layers) : 0);
  st.mtp_v_cache.resize(st.mtp_k_cache.size());
  for (StepState& set : st.sets) {
    set.conv.resize(n);
    set.recurrent.resize(n);
  }
  try {
    for (const StateTensor& t : state_tensors(max_ctx, kv_dtype)) {
      static const char* labels[] = {"kv_cache", "kv_cache", "conv_state", "recurrent_state", "mtp_kv_cache",
                                     "mtp_kv_cache"};
      std::vector<Tensor>* lists[] = {&st.k_cache, &st.v_cache, &st.sets[t.set].conv, &st.sets[t.set].recurrent,
                                      &st.mtp_k_cache, &st.mtp_v_cache};
      (*lists[size_t(t.kind)])[t.layer] = ops_.alloc(labels[size_t(t.kind)], t.dtype, t.rows, t.cols);
    }
    for (StepState& set : st.sets) {
      set.pos = ops_.alloc("position", DType::I32, 1, 1);
      set.logits = ops_.alloc("last_logits", DType::F32, 1, cfg_.vocab);
      if (has_mtp()) set.mtp_h = ops_.alloc("mtp_hidden", DType::F32, 1, cfg_.hidden);
    }
    st.slot[0] = ops_.alloc("decode_slot_0", DType::I32, 1, 1);
    st.slot[1] = ops_.alloc("decode_slot_1", DType::I32, 1, 1);
    st.sampler.counts = ops_.alloc("sampler_counts", DType::I32, 1, cfg_.vocab);
    st.sampler.seen = ops_.alloc("sampler_seen", DType::I32, 1, cfg_.vocab);
    st.sampler.rng = ops_.alloc("sampler_rng", DType::I32, 1, SamplerState::kRngWords);
    st.sampler.ring = ops_.alloc("sampler_ring", DType::I32, 64, 1);
    st.sampler.ring_count = ops_.alloc("sampler_ring_count", DType::I32, 1, 1);
  } catch (...) {
    free_state(st);  // a failed allocation leaks nothing
    throw;
  }
  return st;
}

void Qwen36::free_state(SessionState& st) {
  for (auto* v : {&st.k_cache, &st.v_cache, &st.sets[0].conv, &st.sets[0].recurrent, &st.sets[1].conv,
                  &st.sets[1].recurrent, &st.mtp_k_cache, &st.mtp_v_cache})
    for (Tensor& t : *v) ops_.release(t);
  for (Tensor* t : {&st.sets[0].pos, &st.sets[0].logits, &st.sets[1].pos, &st.sets[1].logits, &st.slot[0],
                    &st.slot[1], &st.sets[0].mtp_h, &st.sets[1].mtp_h, &st.sampler.counts, &st.sampler.seen, &st.sampler.rng, &st.sampler.ring,
                    &st.sampler.ring_count})
    ops_.release(*t);
}

Scratch Qwen36::new_scratch(int64_t rows, int64_t logit_rows, int64_t max_ctx) {
  Scratch s;
  s.rows = rows;
  s.logit_rows = logit_rows;
  s.max_ctx = max_ctx;
  const ModelConfig& c = cfg_;
  try {
#define LILY_ALLOC_SCRATCH(name, dtype, nrows, cols, needed) \
  if (needed) s.name = ops_.alloc(#name, DType::dtype, nrows, cols);
    LILY_SCRATCH_FIELDS(LILY_ALLOC_SCRATCH)
#undef LILY_ALLOC_SCRATCH
    const size_t ws = ops_.workspace_bytes(cfg_, rows, max_ctx);
    s.ws = ops_.alloc("workspace", DType::F32, 1, int64_t(std::max<size_t>(ws, 4) + 3) / 4);
    ops_.reserve(cfg_, rows);
  } catch (...) {
    free_scratch(s);
    throw;
  }
  return s;
}

void Qwen36::free_scratch(Scratch& s) {
#define LILY_FREE_SCRATCH(name, dtype, nrows, cols, needed) ops_.release(s.name);
  LILY_SCRATCH_FIELDS(LILY_FREE_SCRATCH)
#undef LILY_FREE_SCRATCH
  ops_.release(s.ws);
  s.rows = s.logit_rows = 0;
}

}  // namespace lily
