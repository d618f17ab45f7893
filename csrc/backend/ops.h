// The Ops interface: every backend (cpu/, later cuda/ and metal/) implements these kernels once, and
// the Qwen3.6 graph (model/qwen36.cpp) is written once against them.
//
// Each public op declares the buffers it reads and writes before the backend's *_impl runs, so the
// HazardTracker can derive barrier-separated stages (reported per decode step and prefill chunk).
// Weights are read-only and never create hazards; activations and session state live in backend
// buffers addressed by Tensor views.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backend/hazard.h"
#include "model/weight.h"

namespace lily {

// A 2-D row-major view into a backend buffer.
struct Tensor {
  int32_t buf = -1;
  int64_t offset = 0;  // in elements from the buffer's start
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0;
  int64_t stride = 0;  // elements between rows

  bool valid() const { return buf >= 0; }
  Tensor rows_view(int64_t r0, int64_t n) const {
    Tensor t = *this;
    t.offset += r0 * stride;
    t.rows = n;
    return t;
  }
};

enum class Phase : uint8_t { Prefill, Decode };

// Routed experts of one MoE layer: per-expert [inter, hidden] gate/up and [hidden, inter] down.
struct ExpertSet {
  std::vector<Weight> gate, up, down;
};

struct AttentionShape {
  int64_t heads, kv_heads, head_dim, rotary_dim;
  double rope_theta;
  float eps;
};

struct DeltaShape {
  int64_t k_heads, v_heads, k_dim, v_dim, conv_kernel;
  float eps;
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual const char* name() const = 0;
  virtual std::string device() const = 0;
  virtual int threads() const { return 1; }

  // ---- memory (not recorded as ops) ----
  virtual Tensor alloc(const std::string& label, DType dtype, int64_t rows, int64_t cols) = 0;  // zeroed
  virtual void release(Tensor& t) = 0;
  virtual void upload(const Tensor& dst, const void* src) = 0;   // host -> whole view
  virtual void download(const Tensor& src, void* dst) = 0;       // whole view -> host
  virtual size_t allocated_bytes() const = 0;

  // ---- step bracketing: stats of the ops recorded since begin() ----
  void begin(Phase phase) {
    phase_ = phase;
    tracker_.begin();
  }
  const StepStats& stats() const { return tracker_.stats(); }
  Phase phase() const { return phase_; }

  // Host-side wall time per op name while profiling is on (meaningful for the CPU backend, which runs
  // each op synchronously; a recording backend would report its own timestamps).
  void set_profiling(bool on) {
    profiling_ = on;
    profile_.clear();
  }
  const std::map<std::string, double>& profile() const { return profile_; }

  // ---- ops (domain names; shapes as [rows, cols]) ----
  // out[t] = table[ids[t]]  (ids: I32 [T, 1])
  void embed(const Tensor& ids, const Weight& table, const Tensor& out) {
    record("embed", {ids.buf}, {out.buf},
           [&] { embed_impl(ids, table, out); });
  }
  // Plain-weight RMSNorm over segments of w.cols elements: out = x * rsqrt(mean(x^2) + eps) * w.
  // (Checkpoint loaders already turn 1+w norms into their effective multiplier.)
  void rms_norm(const Tensor& x, const Tensor& w, const Tensor& out, float eps) {
    record("rms_norm", {x.buf, w.buf}, {out.buf},
           [&] { rms_norm_impl(x, w, out, eps); });
  }
  // out[T, N] = x[T, K] · Wᵀ; kernel family picked from the phase (GEMV for decode, GEMM for prefill).
  void matmul(const Tensor& x, const Weight& w, const Tensor& out) {
    record("matmul", {x.buf}, {out.buf},
           [&] { matmul_impl(x, w, out); });
  }
  // out = a + b (out may alias a)
  void add(const Tensor& a, const Tensor& b, const Tensor& out) {
    record("add", {a.buf, b.buf}, {out.buf},
           [&] { add_impl(a, b, out); });
  }
  // Query/key preparation for gated attention (fused chain): split the per-head [query | gate] rows of
  // qg, RMSNorm q and k per head, rotate the first rotary_dim dims at positions pos0 + t.
  void attn_qk_prep(const Tensor& qg, const Tensor& k, const Tensor& q_norm, const Tensor& k_norm,
                    int64_t pos0, const AttentionShape& s, const Tensor& q_out, const Tensor& gate_out,
                    const Tensor& k_out) {
    record("attn_qk_prep", {qg.buf, k.buf, q_norm.buf, k_norm.buf}, {q_out.buf, gate_out.buf, k_out.buf},
           [&] { attn_qk_prep_impl(qg, k, q_norm, k_norm, pos0, s, q_out, gate_out, k_out); });
  }
  // Write T rows of k and v at positions pos0.. into the caches ([kv_heads * max_ctx, head_dim]).
  void kv_append(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                 int64_t pos0, int64_t max_ctx, const AttentionShape& s) {
    record("kv_append", {k.buf, v.buf}, {k_cache.buf, v_cache.buf},
           [&] { kv_append_impl(k, v, k_cache, v_cache, pos0, max_ctx, s); });
  }
  // Causal GQA attention of T queries at positions pos0.. over cache positions [0, pos0 + t],
  // then the output gate: out = attention · sigmoid(gate).
  void attention(const Tensor& q, const Tensor& gate, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t pos0, int64_t max_ctx,
                              const AttentionShape& s, const Tensor& out) {
    record(phase_ == Phase::Decode ? "attn_decode" : "attn_prefill",
          {q.buf, gate.buf, k_cache.buf, v_cache.buf}, {out.buf},
           [&] { attention_impl(q, gate, k_cache, v_cache, pos0, max_ctx, s, out); });
  }
  // Causal depthwise conv over [q|k|v] channels with the pre-conv rows of the last K-1 tokens kept in
  // conv_state ([K-1, C]), then silu. Updates conv_state.
  void conv1d_silu(const Tensor& mixed, const Tensor& conv_w, const Tensor& conv_state,
                   const Tensor& out) {
    record("conv1d_silu", {mixed.buf, conv_w.buf, conv_state.buf}, {out.buf, conv_state.buf},
           [&] { conv1d_silu_impl(mixed, conv_w, conv_state, out); });
  }
  // Gated delta rule over T tokens (L2-normed q/k, beta = sigmoid(b), g = -exp(A_log)·softplus(a+dt_bias)),
  // fp32 state [v_heads * k_dim, v_dim] carried across calls; out [T, v_heads * v_dim].
  void gated_delta(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                   const Tensor& dt_bias, const Tensor& state, const DeltaShape& s, const Tensor& out) {
    record("gated_delta", {qkv.buf, b.buf, a.buf, A_log.buf, dt_bias.buf, state.buf},
          {state.buf, out.buf},
           [&] { gated_delta_impl(qkv, b, a, A_log, dt_bias, state, s, out); });
  }
  // Per value head: out = (w · rmsnorm(o)) · silu(z)   (fused recurrent-output normalisation).
  void gated_rms_norm(const Tensor& o, const Tensor& z, const Tensor& w, float eps, const Tensor& out) {
    record("gated_rms_norm", {o.buf, z.buf, w.buf}, {out.buf},
           [&] { gated_rms_norm_impl(o, z, w, eps, out); });
  }
  // Router: softmax over all experts (fp32), top-k, renormalise. ids I32 [T, k], weights F32 [T, k].
  void moe_route(const Tensor& logits, int64_t k, const Tensor& ids, const Tensor& weights) {
    record("moe_route", {logits.buf}, {ids.buf, weights.buf},
           [&] { moe_route_impl(logits, k, ids, weights); });
  }
  // Routed experts (grouped by expert): out[t] = Σ_k w[t,k] · down(silu(gate(x)) ⊙ up(x)).
  void moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertSet& e,
                   const Tensor& out) {
    record("moe_experts", {x.buf, ids.buf, weights.buf}, {out.buf},
           [&] { moe_experts_impl(x, ids, weights, e, out); });
  }
  // out = silu(gate) ⊙ up
  void swiglu(const Tensor& gate, const Tensor& up, const Tensor& out) {
    record("swiglu", {gate.buf, up.buf}, {out.buf},
           [&] { swiglu_impl(gate, up, out); });
  }
  // h += routed + sigmoid(shared_gate_logit) · shared   (MoE output with the shared expert, residual)
  void moe_combine(const Tensor& routed, const Tensor& shared, const Tensor& shared_gate_logit,
                   const Tensor& h) {
    record("moe_combine", {routed.buf, shared.buf, shared_gate_logit.buf, h.buf}, {h.buf},
           [&] { moe_combine_impl(routed, shared, shared_gate_logit, h); });
  }

  // Kernel variant used for a weight in the current phase (engine.report()).
  virtual std::string matmul_variant(const Weight& w, Phase phase) const = 0;
  // Active optimizations and the ones not active, with reasons.
  virtual std::vector<std::string> optimizations() const = 0;

 protected:
  virtual void embed_impl(const Tensor& ids, const Weight& table, const Tensor& out) = 0;
  virtual void rms_norm_impl(const Tensor& x, const Tensor& w, const Tensor& out, float eps) = 0;
  virtual void matmul_impl(const Tensor& x, const Weight& w, const Tensor& out) = 0;
  virtual void add_impl(const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  virtual void attn_qk_prep_impl(const Tensor& qg, const Tensor& k, const Tensor& q_norm,
                                 const Tensor& k_norm, int64_t pos0, const AttentionShape& s,
                                 const Tensor& q_out, const Tensor& gate_out, const Tensor& k_out) = 0;
  virtual void kv_append_impl(const Tensor& k, const Tensor& v, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t pos0, int64_t max_ctx,
                              const AttentionShape& s) = 0;
  virtual void attention_impl(const Tensor& q, const Tensor& gate, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t pos0, int64_t max_ctx,
                              const AttentionShape& s, const Tensor& out) = 0;
  virtual void conv1d_silu_impl(const Tensor& mixed, const Tensor& conv_w, const Tensor& conv_state,
                                const Tensor& out) = 0;
  virtual void gated_delta_impl(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                                const Tensor& dt_bias, const Tensor& state, const DeltaShape& s,
                                const Tensor& out) = 0;
  virtual void gated_rms_norm_impl(const Tensor& o, const Tensor& z, const Tensor& w, float eps,
                                   const Tensor& out) = 0;
  virtual void moe_route_impl(const Tensor& logits, int64_t k, const Tensor& ids,
                              const Tensor& weights) = 0;
  virtual void moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                const ExpertSet& e, const Tensor& out) = 0;
  virtual void swiglu_impl(const Tensor& gate, const Tensor& up, const Tensor& out) = 0;
  virtual void moe_combine_impl(const Tensor& routed, const Tensor& shared,
                                const Tensor& shared_gate_logit, const Tensor& h) = 0;

  // A backend that records work (Metal, CUDA) inserts its barrier when this returns true.
  virtual void on_stage_boundary() {}

 private:
  template <class F>
  void record(const char* op, std::vector<int32_t> reads, std::vector<int32_t> writes, F&& run) {
    if (tracker_.record(op, reads, writes)) on_stage_boundary();
    if (!profiling_) return run();
    const auto t0 = std::chrono::steady_clock::now();
    run();
    profile_[op] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  HazardTracker tracker_;
  bool profiling_ = false;
  std::map<std::string, double> profile_;
  Phase phase_ = Phase::Prefill;
};

}  // namespace lily
