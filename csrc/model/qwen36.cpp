// The Qwen3.6 forward (MODEL.md section 2):
//   h = E[ids]
//   for each layer: h += mixer(rmsnorm(h))   (Gated DeltaNet, or gated attention every 4th layer)
//                   h += moe(rmsnorm(h))     (routed top-k experts + sigmoid-gated shared expert)
//   logits = lm_head(rmsnorm(h))
#include "model/qwen36.h"

#include <stdexcept>

namespace lily {

AttentionShape Qwen36::attn_shape() const {
  return {cfg_.heads, cfg_.kv_heads, cfg_.head_dim, cfg_.rotary_dim, cfg_.rope_theta, cfg_.eps};
}

DeltaShape Qwen36::delta_shape() const {
  return {cfg_.lin_k_heads, cfg_.lin_v_heads, cfg_.lin_k_dim, cfg_.lin_v_dim, cfg_.conv_kernel, cfg_.eps};
}

SessionState Qwen36::new_state(int64_t max_ctx, DType kv_dtype) {
  SessionState st;
  st.max_ctx = max_ctx;
  st.kv_dtype = kv_dtype;
  size_t n = size_t(cfg_.layers);
  st.k_cache.resize(n);
  st.v_cache.resize(n);
  st.conv.resize(n);
  st.recurrent.resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (cfg_.full_attention[i]) {
      st.k_cache[i] = ops_.alloc("kv_cache", kv_dtype, cfg_.kv_heads * max_ctx, cfg_.head_dim);
      st.v_cache[i] = ops_.alloc("kv_cache", kv_dtype, cfg_.kv_heads * max_ctx, cfg_.head_dim);
    } else {
      st.conv[i] = ops_.alloc("conv_state", DType::F32, cfg_.conv_kernel - 1, cfg_.conv_dim());
      st.recurrent[i] =
          ops_.alloc("recurrent_state", DType::F32, cfg_.lin_v_heads * cfg_.lin_k_dim, cfg_.lin_v_dim);
    }
  }
  return st;
}

void Qwen36::free_state(SessionState& st) {
  for (auto* v : {&st.k_cache, &st.v_cache, &st.conv, &st.recurrent})
    for (Tensor& t : *v)
      if (t.valid()) ops_.release(t);
}

size_t Qwen36::state_bytes(int64_t max_ctx, DType kv_dtype) const {
  size_t full = size_t(cfg_.n_full()) * 2 * cfg_.kv_heads * max_ctx * cfg_.head_dim * dtype_size(kv_dtype);
  size_t lin = size_t(cfg_.n_linear()) *
               ((cfg_.conv_kernel - 1) * cfg_.conv_dim() + cfg_.lin_v_heads * cfg_.lin_k_dim * cfg_.lin_v_dim) * 4;
  return full + lin;
}

Scratch Qwen36::new_scratch(int64_t rows, int64_t logit_rows) {
  Scratch s;
  s.rows = rows;
  s.logit_rows = logit_rows;
  auto f = [&](const char* label, int64_t cols) { return ops_.alloc(label, DType::F32, rows, cols); };
  const int64_t H = cfg_.hidden, C = cfg_.conv_dim(), VD = cfg_.value_dim();
  const int64_t QD = cfg_.heads * cfg_.head_dim, KD = cfg_.kv_heads * cfg_.head_dim;
  s.ids = ops_.alloc("ids", DType::I32, rows, 1);
  s.h = f("residual", H);
  s.u = f("normed", H);
  s.mixer_out = f("mixer_out", H);
  if (cfg_.n_linear()) {
    s.qkv = f("delta_qkv", C);
    s.mixed = f("delta_conv", C);
    s.z = f("delta_z", VD);
    s.b = f("delta_b", cfg_.lin_v_heads);
    s.a = f("delta_a", cfg_.lin_v_heads);
    s.delta_o = f("delta_o", VD);
    s.delta_y = f("delta_y", VD);
  }
  if (cfg_.n_full()) {
    s.qg = f("attn_qg", 2 * QD);
    s.k = f("attn_k", KD);
    s.v = f("attn_v", KD);
    s.q = f("attn_q", QD);
    s.gate = f("attn_gate", QD);
    s.kr = f("attn_k_rot", KD);
    s.attn_o = f("attn_o", QD);
  }
  s.router_logits = f("router_logits", cfg_.experts);
  s.topk_ids = ops_.alloc("topk_ids", DType::I32, rows, cfg_.topk);
  s.topk_w = f("topk_w", cfg_.topk);
  s.routed = f("routed", H);
  s.sh_g = f("shared_gate_proj", cfg_.shared_inter);
  s.sh_u = f("shared_up", cfg_.shared_inter);
  s.sh_act = f("shared_act", cfg_.shared_inter);
  s.shared = f("shared_out", H);
  s.sh_gate = f("shared_gate_logit", 1);
  s.final_h = ops_.alloc("final_norm", DType::F32, logit_rows, H);
  s.logits = ops_.alloc("logits", DType::F32, logit_rows, cfg_.vocab);
  return s;
}

void Qwen36::free_scratch(Scratch& s) {
  for (Tensor* t : {&s.ids, &s.h, &s.u, &s.mixer_out, &s.qkv, &s.mixed, &s.z, &s.b, &s.a, &s.delta_o,
                    &s.delta_y, &s.qg, &s.k, &s.v, &s.q, &s.gate, &s.kr, &s.attn_o, &s.router_logits,
                    &s.topk_ids, &s.topk_w, &s.routed, &s.sh_g, &s.sh_u, &s.sh_act, &s.shared,
                    &s.sh_gate, &s.final_h, &s.logits})
    if (t->valid()) ops_.release(*t);
  s.rows = 0;
}

// Gated DeltaNet mixer (MODEL.md section 5): projections, causal conv + silu on [q|k|v], the gated delta
// recurrence, per-head gated RMSNorm with silu(z), output projection.
void Qwen36::delta_layer(const LayerWeights& L, SessionState& st, size_t li, Scratch& sc, int64_t T) {
  auto r = [T](const Tensor& t) { return t.rows_view(0, T); };
  ops_.matmul(r(sc.u), L.qkv, r(sc.qkv));
  ops_.matmul(r(sc.u), L.z, r(sc.z));
  ops_.matmul(r(sc.u), L.b, r(sc.b));
  ops_.matmul(r(sc.u), L.a, r(sc.a));
  ops_.conv1d_silu(r(sc.qkv), L.conv, st.conv[li], r(sc.mixed));
  ops_.gated_delta(r(sc.mixed), r(sc.b), r(sc.a), L.A_log, L.dt_bias, st.recurrent[li], delta_shape(),
                   r(sc.delta_o));
  ops_.gated_rms_norm(r(sc.delta_o), r(sc.z), L.delta_norm, cfg_.eps, r(sc.delta_y));
  ops_.matmul(r(sc.delta_y), L.out, r(sc.mixer_out));
}

// Gated full attention (MODEL.md section 4): q/gate split per head, q/k RMSNorm, partial RoPE, KV cache,
// causal GQA softmax attention, sigmoid output gate, output projection.
void Qwen36::attention_layer(const LayerWeights& L, SessionState& st, size_t li, Scratch& sc, int64_t T,
                             int64_t pos0) {
  auto r = [T](const Tensor& t) { return t.rows_view(0, T); };
  const AttentionShape s = attn_shape();
  ops_.matmul(r(sc.u), L.q, r(sc.qg));
  ops_.matmul(r(sc.u), L.k, r(sc.k));
  ops_.matmul(r(sc.u), L.v, r(sc.v));
  ops_.attn_qk_prep(r(sc.qg), r(sc.k), L.q_norm, L.k_norm, pos0, s, r(sc.q), r(sc.gate), r(sc.kr));
  ops_.kv_append(r(sc.kr), r(sc.v), st.k_cache[li], st.v_cache[li], pos0, st.max_ctx, s);
  ops_.attention(r(sc.q), r(sc.gate), st.k_cache[li], st.v_cache[li], pos0, st.max_ctx, s,
                 r(sc.attn_o));
  ops_.matmul(r(sc.attn_o), L.o, r(sc.mixer_out));
}

// Sparse MoE (MODEL.md section 6), added into the residual stream.
void Qwen36::moe_block(const LayerWeights& L, Scratch& sc, int64_t T) {
  auto r = [T](const Tensor& t) { return t.rows_view(0, T); };
  ops_.matmul(r(sc.u), L.router, r(sc.router_logits));
  ops_.moe_route(r(sc.router_logits), cfg_.topk, r(sc.topk_ids), r(sc.topk_w));
  ops_.moe_experts(r(sc.u), r(sc.topk_ids), r(sc.topk_w), L.experts, r(sc.routed));
  ops_.matmul(r(sc.u), L.shared_gate_proj, r(sc.sh_g));
  ops_.matmul(r(sc.u), L.shared_up, r(sc.sh_u));
  ops_.swiglu(r(sc.sh_g), r(sc.sh_u), r(sc.sh_act));
  ops_.matmul(r(sc.sh_act), L.shared_down, r(sc.shared));
  ops_.matmul(r(sc.u), L.shared_gate, r(sc.sh_gate));
  ops_.moe_combine(r(sc.routed), r(sc.shared), r(sc.sh_gate), r(sc.h));
}

void Qwen36::forward(SessionState& st, Scratch& sc, const int32_t* ids, int64_t T, int64_t pos0,
                     Phase phase, int64_t n_logits, float* logits_out) {
  if (T <= 0 || T > sc.rows) throw std::logic_error("forward: chunk larger than scratch");
  if (phase == Phase::Decode && T != 1) throw std::logic_error("forward: decode runs one token");
  if (n_logits != 1 && n_logits != T) throw std::logic_error("forward: logits of last row or all rows");
  auto r = [T](const Tensor& t) { return t.rows_view(0, T); };

  ops_.begin(phase);
  ops_.upload(r(sc.ids), ids);
  ops_.embed(r(sc.ids), w_.embed, r(sc.h));
  for (size_t li = 0; li < w_.layers.size(); ++li) {
    const LayerWeights& L = w_.layers[li];
    ops_.rms_norm(r(sc.h), L.input_norm, r(sc.u), cfg_.eps);
    if (L.full)
      attention_layer(L, st, li, sc, T, pos0);
    else
      delta_layer(L, st, li, sc, T);
    ops_.add(r(sc.h), r(sc.mixer_out), r(sc.h));
    ops_.rms_norm(r(sc.h), L.post_norm, r(sc.u), cfg_.eps);
    moe_block(L, sc, T);
  }
  // Final norm and lm_head over the requested rows, in blocks that fit the logits scratch.
  for (int64_t r0 = T - n_logits; r0 < T; r0 += sc.logit_rows) {
    int64_t n = std::min(sc.logit_rows, T - r0);
    ops_.rms_norm(sc.h.rows_view(r0, n), w_.final_norm, sc.final_h.rows_view(0, n), cfg_.eps);
    ops_.matmul(sc.final_h.rows_view(0, n), w_.lm_head, sc.logits.rows_view(0, n));
    ops_.download(sc.logits.rows_view(0, n), logits_out + (r0 - (T - n_logits)) * cfg_.vocab);
  }
}

}  // namespace lily
