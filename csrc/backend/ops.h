// The Ops interface: every backend (cpu/, later cuda/ and metal/) implements these kernels once, and
// the Qwen3.6 graph (model/qwen36.cpp) is written once against them.
//
// The step model (docs/ARCHITECTURE.md, "Writing a backend"): a step is encoded between begin() and
// submit(). Every op names the buffers it reads and writes before the backend sees it, so the
// HazardTracker derives barrier-separated stages; a recording backend inserts its barrier at
// on_stage_boundary(). Ops read their inputs (token ids, positions, logits) from backend tensors and
// leave their results there: nothing inside a step touches host memory. submit() hands the recorded
// work to the device and returns a fence; wait(fence) blocks until it is done; upload/download are the
// only host transfers and happen outside steps (a download of a buffer that unwaited work writes, or an
// upload into one that unwaited work uses, is a bug the deferred CPU backend reports).
//
// Weights are read-only, live in checkpoint mappings registered once at load (register_mapping) and
// never create hazards. Scratch an op needs comes from a workspace tensor the session allocated
// (workspace_bytes); nothing is allocated inside a step.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "backend/hazard.h"
#include "model/weight.h"
#include "runtime/sampling_params.h"

namespace lily {

struct ModelConfig;

// A 2-D row-major view into a backend buffer.
struct Tensor {
  int32_t buf = -1;
  int64_t offset = 0;  // in elements from the buffer's start
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0;
  int64_t stride = 0;  // elements between rows

  bool valid() const { return buf >= 0; }
  // A whole buffer of [rows, cols] row-major elements (what every backend's alloc_impl returns).
  static Tensor whole(int32_t buf, DType dtype, int64_t rows, int64_t cols) {
    Tensor t;
    t.buf = buf;
    t.dtype = dtype;
    t.rows = rows;
    t.cols = cols;
    t.stride = cols;
    return t;
  }
  Tensor rows_view(int64_t r0, int64_t n) const {
    Tensor t = *this;
    t.offset += r0 * stride;
    t.rows = n;
    return t;
  }
  size_t bytes() const { return size_t(rows) * size_t(cols) * dtype_size(dtype); }
};

enum class Phase : uint8_t { Prefill, Decode };

struct AttentionShape {
  int64_t heads, kv_heads, head_dim, rotary_dim;
  double rope_theta;
  float eps;
};

struct DeltaShape {
  int64_t k_heads, v_heads, k_dim, v_dim, conv_kernel;
  float eps;
};

// The DeltaNet state after some rows of a chunk, kept besides the state after the last row: conv1d_silu and
// gated_delta write the state after rows first, first + 1, ..., first + count - 1 to slices 0 .. count - 1 of
// `states`, slice i = states.rows_view(i · R, R), R the state's rows (K-1 for the conv state [K-1, C], Hv·Dk for
// the recurrent state [Hv·Dk, Dv]; same columns, F32). Slice i holds, bit for bit, the state a call over rows
// 0 .. first + i alone leaves in state_out. One forward thus serves a checkpoint inside a chunk (the prefix
// cache's cut before a chat's generation prompt) and the per-position states MTP verification keeps (issue 14:
// after each of the drafted rows). One contiguous range in one tensor keeps every backend's kernel to one
// extra pointer; count = 0 (the default) captures nothing and declares no extra write.
struct StateCapture {
  Tensor states;
  int64_t first = 0, count = 0;
  bool active() const { return count > 0; }
};

// The sampler's state for one generate call, in backend buffers (all I32):
//   counts [1, vocab]  times each token was generated in this call (presence / frequency penalties)
//   seen   [1, vocab]  1 where the token occurs in the context (repetition penalty)
//   rng    [1, kRngWords]  the Mersenne Twister (mt19937_64) state and its index
//   ring   [R, 1]      ids generated in this call, id i at row i % R; ring_count [1, 1] = ids so far
// Up to four products of one input, recorded as one op (Ops::matmuls): out[i] = x · w[i]ᵀ.
struct MatmulGroup {
  static constexpr int kMax = 4;
  int n = 0;
  std::array<Weight, kMax> w;
  std::array<Tensor, kMax> out;
  MatmulGroup& add(const Weight& weight, const Tensor& o) {
    if (n == kMax) throw std::logic_error("MatmulGroup: more than 4 products");
    w[size_t(n)] = weight;
    out[size_t(n)] = o;
    ++n;
    return *this;
  }
  int32_t out_buf(int i) const { return out[size_t(i < n ? i : 0)].buf; }  // repeats the first past n
};

// One layer's sparse-MoE weights after the router product (Ops::moe): the routed experts, stacked
// [experts, out, in], and the shared expert's three projections.
struct MoeWeights {
  Weight gate, up, down;
  Weight shared_gate_proj, shared_up, shared_down;
};

// The intermediates of Ops::moe as the composed form (every backend's default) materialises them:
// ids I32 / weights F32 [T, k] (the routing), routed [T, H], shared_g / shared_u / shared_act [T, I_shared],
// shared [T, H]. A fused backend may leave any of them unwritten except ids and weights.
struct MoeScratch {
  Tensor ids, weights, routed, shared_g, shared_u, shared_act, shared;
};

struct SamplerState {
  static constexpr int64_t kRngWords = 2 * 312 + 2;
  Tensor counts, seen, rng, ring, ring_count;
};

// Field-by-field keys of op arguments (OpRun::key): every member written, padding never.
template <class T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>, int> = 0>
inline void key_append(std::string& k, const T& v) {
  k.append(reinterpret_cast<const char*>(&v), sizeof v);
}
inline void key_append(std::string& k, const Tensor& t) {
  for (int64_t v : {int64_t(t.buf), t.offset, int64_t(t.dtype), t.rows, t.cols, t.stride}) key_append(k, v);
}
inline void key_append(std::string& k, const Weight& w) {
  for (int64_t v : {int64_t(w.kind), int64_t(w.dtype), w.rows, w.cols, int64_t(w.bits), int64_t(w.group),
                    int64_t(w.scale_dtype), int64_t(w.mapping), int64_t(w.scale_mapping), int64_t(w.bias_mapping),
                    int64_t(w.data), int64_t(w.scales), int64_t(w.biases), w.experts, int64_t(w.data_stride),
                    int64_t(w.scale_stride), int64_t(w.bias_stride)})
    key_append(k, v);
}
inline void key_append(std::string& k, const MatmulGroup& g) {
  key_append(k, g.n);
  for (int i = 0; i < g.n; ++i) key_append(k, g.w[size_t(i)]), key_append(k, g.out[size_t(i)]);
}
inline void key_append(std::string& k, const MoeWeights& w) {
  for (const Weight* x : {&w.gate, &w.up, &w.down, &w.shared_gate_proj, &w.shared_up, &w.shared_down}) key_append(k, *x);
}
inline void key_append(std::string& k, const MoeScratch& s) {
  for (const Tensor* t : {&s.ids, &s.weights, &s.routed, &s.shared_g, &s.shared_u, &s.shared_act, &s.shared})
    key_append(k, *t);
}
inline void key_append(std::string& k, const AttentionShape& s) {
  for (int64_t v : {s.heads, s.kv_heads, s.head_dim, s.rotary_dim}) key_append(k, v);
  key_append(k, s.rope_theta);
  key_append(k, s.eps);
}
inline void key_append(std::string& k, const DeltaShape& s) {
  for (int64_t v : {s.k_heads, s.v_heads, s.k_dim, s.v_dim, s.conv_kernel}) key_append(k, v);
  key_append(k, s.eps);
}
inline void key_append(std::string& k, const StateCapture& c) {
  key_append(k, c.states);
  key_append(k, c.first), key_append(k, c.count);
}
inline void key_append(std::string& k, const SamplerState& s) {
  for (const Tensor* t : {&s.counts, &s.seen, &s.rng, &s.ring, &s.ring_count}) key_append(k, *t);
}
inline void key_append(std::string& k, const SamplingParams& p) {
  key_append(k, p.temperature), key_append(k, p.top_k), key_append(k, p.top_p), key_append(k, p.min_p);
  key_append(k, p.repetition_penalty), key_append(k, p.presence_penalty), key_append(k, p.frequency_penalty);
  key_append(k, p.has_seed), key_append(k, p.seed);
}

class Ops {
 public:
  virtual ~Ops() = default;
  virtual const char* name() const = 0;
  virtual std::string device() const = 0;
  virtual int threads() const { return 1; }
  // The most rows a decode-phase forward may hold. Speculative decoding verifies its k + 1 rows in the decode
  // phase up to this (the decode kernels then compute each row as a one-row decode step would), else in the
  // prefill phase. 1 where the decode kernels take one row.
  virtual int64_t decode_rows() const { return 1; }

  // ---- memory (outside steps; not recorded) ----
  Tensor alloc(const std::string& label, DType dtype, int64_t rows, int64_t cols);  // zeroed
  virtual void release(Tensor& t) = 0;
  void upload(const Tensor& dst, const void* src);   // host -> whole view
  void download(const Tensor& src, void* dst);       // whole view -> host; the caller waited for its writer
  virtual size_t allocated_bytes() const = 0;
  // A checkpoint file (or a buffer Lily repacked) that weights point into; returns its mapping id.
  virtual int32_t register_mapping(const void* base, size_t bytes, const std::string& label) = 0;
  // Called once after loading with every Weight of the model (and by op harnesses for theirs): a backend
  // whose kernels need the weights elsewhere (device memory, aligned) moves them and rewrites the Weights'
  // mappings and offsets. The CPU reads them where the checkpoint mapping has them.
  virtual void place_weights(const std::vector<Weight*>& weights) {}
  // Scratch one forward of `rows` tokens needs (MoE grouping, attention scores, DeltaNet work, sampling).
  virtual size_t workspace_bytes(const ModelConfig& cfg, int64_t rows, int64_t max_ctx) const = 0;
  // Grows backend-internal per-thread scratch for forwards of up to `rows` tokens (outside steps).
  virtual void reserve(const ModelConfig& cfg, int64_t rows) {}
  // The same for prefill matmuls of up to `rows` rows of `cols` inputs, for op harnesses that call matmul without a
  // model (reserve() covers the model's). Outside steps.
  virtual void reserve_matmul(int64_t rows, int64_t cols) {}

  // ---- steps ----
  // `repeats`: the step's launches recur with the same arguments, step after step (decode steps do by design;
  // a speculative iteration with the same k and state set does too), so a backend may memoise and replay them
  // (CUDA: the encode memo and graph replay); it changes no kernel choice. `once`: this decode step will not
  // recur (it also writes a restore's copies and reads a snapshot's state), so it is neither memoised nor replayed.
  void begin(Phase phase, bool repeats = false, bool once = false);
  uint64_t submit();                      // hands the step to the device; returns its fence
  int64_t steps_submitted() const { return submitted_; }  // so far (tests count a call's steps by it)
  virtual void wait(uint64_t fence) {}    // blocks until the step with this fence is done
  // Drops a step whose encoding failed half-way (an exception), so the engine stays usable.
  void abandon() {
    in_step_ = false;
    abandon_impl();
  }
  bool in_step() const { return in_step_; }
  const StepStats& stats() const { return tracker_.stats(); }
  Phase phase() const { return phase_; }
  bool repeats() const { return !once_ && (phase_ == Phase::Decode || repeats_); }
  bool once() const { return once_; }
  // Marks the open step as a speculative (MTP) iteration, so a backend keeps its decode-step figures (launches
  // per step, GPU time) to plain decode steps when the iteration runs in the decode phase. Cleared by begin().
  void mark_speculative() { speculative_ = true; }
  bool speculative() const { return speculative_; }

  // Host transfers so far (the decode loop counts its own: one id read per token).
  struct Transfers {
    int64_t uploads = 0, downloads = 0, upload_bytes = 0, download_bytes = 0;
  };
  const Transfers& transfers() const { return transfers_; }

  // Per-op-kind time while profiling is on (host wall time around each op: exact for the CPU backend,
  // which runs ops synchronously).
  void set_profiling(bool on);
  const std::array<double, kOpKinds>& profile() const { return profile_; }
  bool profiling() const { return profiling_; }

  // ---- ops (domain names; shapes as [rows, cols]) ----
  // out[t] = table[ids[t]]  (ids: I32 [T, 1])
  void embed(const Tensor& ids, const Weight& table, const Tensor& out) {
    record(OpKind::Embed, {ids.buf}, {out.buf}, &Ops::embed_impl, ids, table, out);
  }
  // Plain-weight RMSNorm over segments of w.cols elements: out = x * rsqrt(mean(x^2) + eps) * w.
  // (Checkpoint loaders already turn 1+w norms into their effective multiplier.)
  void rms_norm(const Tensor& x, const Tensor& w, const Tensor& out, float eps) {
    record(OpKind::RmsNorm, {x.buf, w.buf}, {out.buf}, &Ops::rms_norm_impl, x, w, out, eps);
  }
  // out[T, N] = x[T, K] · Wᵀ; kernel family picked from the phase (GEMV for decode, GEMM for prefill).
  void matmul(const Tensor& x, const Weight& w, const Tensor& out) {
    record(OpKind::Matmul, {x.buf}, {out.buf}, &Ops::matmul_impl, x, w, out);
  }
  // Products of one input with up to four weights, as one op (out[i] = x · w[i]ᵀ; the outputs do not
  // alias x or each other). A GPU backend runs them as one launch; the default runs matmul for each.
  void matmuls(const Tensor& x, const MatmulGroup& g) {
    if (g.n < 1) throw std::logic_error("matmuls: an empty group");
    record(OpKind::Matmuls, {x.buf}, {g.out_buf(0), g.out_buf(1), g.out_buf(2), g.out_buf(3)},
           &Ops::matmuls_impl, x, g);
  }
  // The norm in front of a layer's projections, fused with them (the same numbers as rms_norm then matmuls):
  //   normed = rms_norm(x, w, eps) (one segment: w.cols == x.cols), out[i] = normed · g.w[i]ᵀ.
  // normed aliases nothing the op reads; the outputs alias none of x, w, normed or each other. A GPU backend
  // runs it as one launch in decode (each block normalises the row for itself); the default composes the two.
  void rms_norm_matmuls(const Tensor& x, const Tensor& w, float eps, const Tensor& normed, const MatmulGroup& g) {
    if (g.n < 1) throw std::logic_error("rms_norm_matmuls: an empty group");
    record(OpKind::NormMatmuls, {x.buf, w.buf}, {normed.buf, g.out_buf(0), g.out_buf(1), g.out_buf(2), g.out_buf(3)},
           &Ops::norm_matmuls_impl, x, Tensor{}, w, eps, x, normed, g);
  }
  // The same after the residual add (add_rms_norm then matmuls): sum = a + b (sum may alias a),
  // normed = rms_norm(sum, w, eps), out[i] = normed · g.w[i]ᵀ.
  void add_rms_norm_matmuls(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                            const Tensor& normed, const MatmulGroup& g) {
    if (g.n < 1) throw std::logic_error("add_rms_norm_matmuls: an empty group");
    record(OpKind::NormMatmuls, {a.buf, b.buf, w.buf},
           {sum.buf, normed.buf, g.out_buf(0), g.out_buf(1), g.out_buf(2), g.out_buf(3)}, &Ops::norm_matmuls_impl, a,
           b, w, eps, sum, normed, g);
  }
  // out = a + b (out may alias a)
  void add(const Tensor& a, const Tensor& b, const Tensor& out) {
    record(OpKind::Add, {a.buf, b.buf}, {out.buf}, &Ops::add_impl, a, b, out);
  }
  // The residual add and the norm after it, fused: sum = a + b (sum may alias a), then
  // normed = rms_norm(sum, w, eps). The same numbers as add then rms_norm, one stage and one pass fewer.
  void add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                    const Tensor& normed) {
    record(OpKind::AddRmsNorm, {a.buf, b.buf, w.buf}, {sum.buf, normed.buf},
           &Ops::add_rms_norm_impl, a, b, w, eps, sum, normed);
  }
  // Query/key preparation for gated attention (fused chain): split the per-head [query | gate] rows of
  // qg, RMSNorm q and k per head, rotate the first rotary_dim dims at positions pos[0] + t.
  void attn_qk_prep(const Tensor& qg, const Tensor& k, const Tensor& q_norm, const Tensor& k_norm,
                    const Tensor& pos, const AttentionShape& s, const Tensor& q_out, const Tensor& gate_out,
                    const Tensor& k_out) {
    record(OpKind::AttnQkPrep, {qg.buf, k.buf, q_norm.buf, k_norm.buf, pos.buf},
           {q_out.buf, gate_out.buf, k_out.buf},
           &Ops::attn_qk_prep_impl, qg, k, q_norm, k_norm, pos, s, q_out, gate_out, k_out);
  }
  // Write T rows of k and v at positions pos[0].. into the caches ([kv_heads * max_ctx, head_dim]).
  void kv_append(const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& k_cache,
                 const Tensor& v_cache, int64_t max_ctx, const AttentionShape& s) {
    record(OpKind::KvAppend, {k.buf, v.buf, pos.buf}, {k_cache.buf, v_cache.buf},
           &Ops::kv_append_impl, k, v, pos, k_cache, v_cache, max_ctx, s);
  }
  // attn_qk_prep, then kv_append of its prepared k rows and of v, as one op: q_out, gate_out and k_out as
  // attn_qk_prep writes them, and rows pos[0].. of the caches as kv_append writes them (the same values). The
  // graph's form: a backend that runs it as one kernel saves a dependent launch per attention layer.
  void attn_qk_prep_append(const Tensor& qg, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                           const Tensor& k_norm, const Tensor& pos, const AttentionShape& s, const Tensor& q_out,
                           const Tensor& gate_out, const Tensor& k_out, const Tensor& k_cache, const Tensor& v_cache,
                           int64_t max_ctx) {
    record(OpKind::AttnQkPrepAppend, {qg.buf, k.buf, v.buf, q_norm.buf, k_norm.buf, pos.buf},
           {q_out.buf, gate_out.buf, k_out.buf, k_cache.buf, v_cache.buf}, &Ops::attn_qk_prep_append_impl, qg, k, v,
           q_norm, k_norm, pos, s, q_out, gate_out, k_out, k_cache, v_cache, max_ctx);
  }
  // Causal GQA attention of T queries at positions pos[0].. over cache positions [0, pos[0] + t],
  // then the output gate: out = attention · sigmoid(gate).
  void attention(const Tensor& q, const Tensor& gate, const Tensor& k_cache, const Tensor& v_cache,
                 const Tensor& pos, int64_t max_ctx, const AttentionShape& s, const Tensor& ws,
                 const Tensor& out) {
    record(phase_ == Phase::Decode ? OpKind::AttnDecode : OpKind::AttnPrefill,
           {q.buf, gate.buf, k_cache.buf, v_cache.buf, pos.buf}, {out.buf, ws.buf},
           &Ops::attention_impl, q, gate, k_cache, v_cache, pos, max_ctx, s, ws, out);
  }
  // Causal depthwise conv over [q|k|v] channels with the pre-conv rows of the last K-1 tokens kept in the
  // conv state ([K-1, C]), then silu. Reads state_in, writes the advanced state to state_out (the same
  // tensor for an in-place update); `capture` also keeps the state after the rows it names (StateCapture).
  void conv1d_silu(const Tensor& mixed, const Tensor& conv_w, const Tensor& state_in, const Tensor& state_out,
                   const Tensor& out, const StateCapture& capture = {}) {
    check_capture("conv1d_silu", capture, mixed.rows, state_out);
    if (!capture.active())
      return record(OpKind::Conv1dSilu, {mixed.buf, conv_w.buf, state_in.buf}, {out.buf, state_out.buf},
                    &Ops::conv1d_silu_impl, mixed, conv_w, state_in, state_out, out, capture);
    record(OpKind::Conv1dSilu, {mixed.buf, conv_w.buf, state_in.buf}, {out.buf, state_out.buf, capture.states.buf},
           &Ops::conv1d_silu_impl, mixed, conv_w, state_in, state_out, out, capture);
  }
  // Gated delta rule over T tokens (L2-normed q/k, beta = sigmoid(b), g = -exp(A_log)·softplus(a+dt_bias)),
  // fp32 state [v_heads * k_dim, v_dim] read from state_in and written to state_out (may be the same
  // tensor); out [T, v_heads * v_dim]; `capture` also keeps the state after the rows it names (StateCapture).
  void gated_delta(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                   const Tensor& dt_bias, const Tensor& state_in, const Tensor& state_out, const DeltaShape& s,
                   const Tensor& ws, const Tensor& out, const StateCapture& capture = {}) {
    check_capture("gated_delta", capture, qkv.rows, state_out);
    if (!capture.active())
      return record(OpKind::GatedDelta, {qkv.buf, b.buf, a.buf, A_log.buf, dt_bias.buf, state_in.buf},
                    {state_out.buf, out.buf, ws.buf}, &Ops::gated_delta_impl, qkv, b, a, A_log, dt_bias, state_in,
                    state_out, s, ws, out, capture);
    record(OpKind::GatedDelta, {qkv.buf, b.buf, a.buf, A_log.buf, dt_bias.buf, state_in.buf},
           {state_out.buf, out.buf, ws.buf, capture.states.buf},
           &Ops::gated_delta_impl, qkv, b, a, A_log, dt_bias, state_in, state_out, s, ws, out, capture);
  }
  // Per value head: out = (w · rmsnorm(o)) · silu(z)   (fused recurrent-output normalisation).
  void gated_rms_norm(const Tensor& o, const Tensor& z, const Tensor& w, float eps, const Tensor& out) {
    record(OpKind::GatedRmsNorm, {o.buf, z.buf, w.buf}, {out.buf},
           &Ops::gated_rms_norm_impl, o, z, w, eps, out);
  }
  // A DeltaNet layer's recurrence as one op: conv1d_silu, gated_delta and gated_rms_norm above, in sequence,
  //   mixed = conv1d_silu(qkv, conv_w; conv_in -> conv_out, conv_cap)
  //   delta_o = gated_delta(mixed, b, a, A_log, dt_bias; rec_in -> rec_out, s, ws, rec_cap)
  //   out = gated_rms_norm(delta_o, z, norm_w, eps)
  // with the same state and capture rules as those ops. mixed and delta_o are the intermediates as the composed
  // form (the default) writes them; a fused backend may leave them unwritten. A GPU backend runs a decode row as
  // one launch (the state never leaves the threads that update it between the three steps).
  void conv_delta_norm(const Tensor& qkv, const Tensor& z, const Tensor& b, const Tensor& a, const Tensor& conv_w,
                       const Tensor& A_log, const Tensor& dt_bias, const Tensor& norm_w, float eps, const DeltaShape& s,
                       const Tensor& conv_in, const Tensor& conv_out, const Tensor& rec_in, const Tensor& rec_out,
                       const Tensor& mixed, const Tensor& delta_o, const Tensor& ws, const Tensor& out,
                       const StateCapture& conv_cap = {}, const StateCapture& rec_cap = {}) {
    check_capture("conv_delta_norm (conv)", conv_cap, qkv.rows, conv_out);
    check_capture("conv_delta_norm (recurrent)", rec_cap, qkv.rows, rec_out);
    // An inactive capture declares its state again (a repeated write adds no hazard).
    const int32_t cc = conv_cap.active() ? conv_cap.states.buf : conv_out.buf;
    const int32_t rc = rec_cap.active() ? rec_cap.states.buf : rec_out.buf;
    record(OpKind::ConvDeltaNorm,
           {qkv.buf, z.buf, b.buf, a.buf, conv_w.buf, A_log.buf, dt_bias.buf, norm_w.buf, conv_in.buf, rec_in.buf},
           {conv_out.buf, rec_out.buf, mixed.buf, delta_o.buf, ws.buf, out.buf, cc, rc}, &Ops::conv_delta_norm_impl,
           qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, eps, s, conv_in, conv_out, rec_in, rec_out, mixed, delta_o,
           ws, out, conv_cap, rec_cap);
  }
  // Router: softmax over all experts (fp32), top-k, renormalise. ids I32 [T, k], weights F32 [T, k].
  void moe_route(const Tensor& logits, int64_t k, const Tensor& ws, const Tensor& ids, const Tensor& weights) {
    record(OpKind::MoeRoute, {logits.buf}, {ids.buf, weights.buf, ws.buf},
           &Ops::moe_route_impl, logits, k, ws, ids, weights);
  }
  // Routed experts (grouped by expert): out[t] = Σ_k w[t,k] · down(silu(gate(x)) ⊙ up(x)).
  // gate, up, down are stacked [experts, ...] weights.
  void moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights, const Weight& gate,
                   const Weight& up, const Weight& down, const Tensor& ws, const Tensor& out) {
    record(OpKind::MoeExperts, {x.buf, ids.buf, weights.buf}, {out.buf, ws.buf},
           &Ops::moe_experts_impl, x, ids, weights, gate, up, down, ws, out);
  }
  // out = silu(gate) ⊙ up
  void swiglu(const Tensor& gate, const Tensor& up, const Tensor& out) {
    record(OpKind::Swiglu, {gate.buf, up.buf}, {out.buf}, &Ops::swiglu_impl, gate, up, out);
  }
  // h += routed + sigmoid(shared_gate_logit) · shared   (MoE output with the shared expert, residual)
  void moe_combine(const Tensor& routed, const Tensor& shared, const Tensor& shared_gate_logit,
                   const Tensor& h) {
    record(OpKind::MoeCombine, {routed.buf, shared.buf, shared_gate_logit.buf, h.buf}, {h.buf},
           &Ops::moe_combine_impl, routed, shared, shared_gate_logit, h);
  }
  // The whole sparse MoE block after the router product, added into the residual (MODEL.md section 6):
  //   ids, weights = top-k of softmax(router_logits), renormalised (moe_route)
  //   h += Σ_s weights[s] · expert_ids[s](x) + sigmoid(shared_gate_logit) · shared_expert(x)
  // where an expert is down(silu(gate(x)) ⊙ up(x)). The default composes moe_route, moe_experts, the shared
  // expert's matmuls, swiglu and moe_combine through `sc`; a GPU backend fuses them into a few launches.
  void moe(const Tensor& x, const Tensor& router_logits, const Tensor& shared_gate_logit, int64_t k,
           const MoeWeights& w, const MoeScratch& sc, const Tensor& ws, const Tensor& h) {
    record(OpKind::Moe, {x.buf, router_logits.buf, shared_gate_logit.buf, h.buf},
           {h.buf, ws.buf, sc.ids.buf, sc.weights.buf, sc.routed.buf, sc.shared_g.buf, sc.shared_u.buf,
            sc.shared_act.buf, sc.shared.buf},
           &Ops::moe_impl, x, router_logits, shared_gate_logit, k, w, sc, ws, h);
  }
  // dst = src (same shape and dtype; state handles and the logits hand-over).
  void copy(const Tensor& src, const Tensor& dst) {
    record(OpKind::Copy, {src.buf}, {dst.buf}, &Ops::copy_impl, src, dst);
  }
  // Every element of dst = value (F32 or I32 tensors).
  void fill(const Tensor& dst, double value) {
    record(OpKind::Fill, {}, {dst.buf}, &Ops::fill_impl, dst, value);
  }
  // pos_out[0] = pos_in[0] + T: the step moves its own position, so a recorded decode step stays valid.
  void advance_position(const Tensor& pos_in, const Tensor& pos_out, int64_t T) {
    record(OpKind::AdvancePosition, {pos_in.buf}, {pos_out.buf}, &Ops::advance_position_impl, pos_in, pos_out, T);
  }
  // Samples one id from logits [1, vocab] (penalties from the sampler state, then greedy or a seeded
  // draw), writes it to next_id [1, 1] (the next step's input slot) and appends it to st.ring.
  // logits [T, vocab] and next_id [T, 1]: T such calls on the rows in order, each seeing the sampler state
  // the one before left (an MTP verify's rows); a backend may run independent rows (greedy, no penalties) at once.
  void sample(const Tensor& logits, const SamplerState& st, const SamplingParams& p, const Tensor& ws,
              const Tensor& next_id) {
    check_sample_rows(logits, next_id);
    record(OpKind::Sample, {logits.buf, st.counts.buf, st.seen.buf, st.rng.buf, st.ring_count.buf},
           {next_id.buf, st.counts.buf, st.seen.buf, st.rng.buf, st.ring.buf, st.ring_count.buf, ws.buf},
           &Ops::sample_rows_impl, logits, st, p, ws, next_id);
  }

  // Speculative decoding's accept decision, on the device so that the next iteration can be queued behind it
  // (docs/ARCHITECTURE.md, "MTP speculative decoding"). ids [k + 1, 1]: the verify forward's input (the pending
  // token, then k drafts); y [k + 1, 1]: the model's token for each row. a = the number of leading drafts the
  // model agreed with (the largest a <= k with y[i] == ids[i + 1] for every i < a); accepted[0] = a,
  // next_id[0] = y[a] (the next iteration's pending token), pos_out[0] = pos_in[0] + a + 1. All I32.
  void accept_drafts(const Tensor& ids, const Tensor& y, const Tensor& pos_in, const Tensor& accepted,
                     const Tensor& next_id, const Tensor& pos_out) {
    check_accept_drafts(ids, y, pos_in, accepted, next_id, pos_out);
    record(OpKind::AcceptDrafts, {ids.buf, y.buf, pos_in.buf}, {accepted.buf, next_id.buf, pos_out.buf},
           &Ops::accept_drafts_impl, ids, y, pos_in, accepted, next_id, pos_out);
  }
  // dst = rows [j·n, (j + 1)·n) of src, j = index[0] + offset, n = dst.rows; when that block is not inside src
  // (j < 0 or past its end) dst keeps what it holds. Same dtype (4-byte: F32 or I32) and columns. The rollback
  // of a speculative iteration picks the state after the last accepted row from the forward's capture with it.
  void copy_rows_at(const Tensor& src, const Tensor& index, int64_t offset, const Tensor& dst) {
    check_copy_rows_at(src, index, dst);
    record(OpKind::CopyRowsAt, {src.buf, index.buf}, {dst.buf}, &Ops::copy_rows_at_impl, src, index, offset, dst);
  }

  // The MTP block's input rows (MODEL.md section 7): out[t] = [rms_norm(table[ids[t]]) ⊙ w_e | rms_norm(h[t]) ⊙ w_h]
  // (ids I32 [n, 1]; h, e, normed F32 [n, H]; w_e, w_h F32 [1, H]; out F32 [n, 2H]). e and normed are the composed
  // form's intermediates (the embedding rows, a normalised half before its copy into out); a fused backend may leave
  // them unwritten. One op so that a GPU builds the row in one launch where the composed form takes three to five.
  void mtp_input(const Tensor& ids, const Weight& table, const Tensor& h, const Tensor& w_e, const Tensor& w_h,
                 float eps, const Tensor& e, const Tensor& normed, const Tensor& out) {
    check_mtp_input(ids, table, h, w_e, w_h, e, normed, out);
    record(OpKind::MtpInput, {ids.buf, h.buf, w_e.buf, w_h.buf}, {e.buf, normed.buf, out.buf}, &Ops::mtp_input_impl,
           ids, table, h, w_e, w_h, eps, e, normed, out);
  }

  // Kernel variant used for a weight in the current phase (engine.report()).
  virtual std::string matmul_variant(const Weight& w, Phase phase) const = 0;
  // Active optimizations and the ones not active, with reasons.
  virtual std::vector<std::string> optimizations() const = 0;

 protected:
  virtual Tensor alloc_impl(const std::string& label, DType dtype, int64_t rows, int64_t cols) = 0;
  virtual void upload_impl(const Tensor& dst, const void* src) = 0;
  virtual void download_impl(const Tensor& src, void* dst) = 0;
  // One op as a backend receives it. `run()` executes it now; `own()` copies it into a std::function for
  // a backend that executes later (the copy allocates: only the deferred debug backend does it).
  struct OpRun {
    void (*call)(const void*);
    std::function<void()> (*clone)(const void*);
    const void* fn;
    std::initializer_list<int32_t> reads, writes;
    // Appends the op's arguments, field by field (no padding bytes), to a key: equal keys mean equal
    // arguments, so a recording backend may reuse what it recorded for them (CudaOps' encode memo).
    void (*key)(const void*, std::string&);
    void append_key(std::string& k) const { key(fn, k); }
    void operator()() const { call(fn); }
    std::function<void()> own() const { return clone(fn); }
  };
  virtual void execute(OpKind kind, const OpRun& run) { run(); }
  // Orders the work of one op that runs dependent kernels (a Metal memory barrier); the CPU runs in order
  // and the CUDA backend keeps one op's launches in order on one stream.
  virtual void barrier_in_op() {}
  // Called when the hazard tracker starts a new stage (a recording backend inserts its barrier).
  virtual void on_stage_boundary() {}
  // Deferred backends return a fence for the work recorded since begin(); immediate ones the next number.
  virtual uint64_t submit_impl() { return ++last_fence_; }
  virtual void abandon_impl() {}
  uint64_t last_fence_ = 0;
  Transfers transfers_;
  int64_t submitted_ = 0;

  virtual void embed_impl(const Tensor& ids, const Weight& table, const Tensor& out) = 0;
  virtual void rms_norm_impl(const Tensor& x, const Tensor& w, const Tensor& out, float eps) = 0;
  virtual void matmul_impl(const Tensor& x, const Weight& w, const Tensor& out) = 0;
  virtual void add_impl(const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  virtual void add_rms_norm_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                                 const Tensor& normed) = 0;
  virtual void attn_qk_prep_impl(const Tensor& qg, const Tensor& k, const Tensor& q_norm,
                                 const Tensor& k_norm, const Tensor& pos, const AttentionShape& s,
                                 const Tensor& q_out, const Tensor& gate_out, const Tensor& k_out) = 0;
  virtual void kv_append_impl(const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t max_ctx, const AttentionShape& s) = 0;
  // Default: attn_qk_prep_impl, then kv_append_impl of k_out and v (ops.cpp).
  virtual void attn_qk_prep_append_impl(const Tensor& qg, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                                        const Tensor& k_norm, const Tensor& pos, const AttentionShape& s,
                                        const Tensor& q_out, const Tensor& gate_out, const Tensor& k_out,
                                        const Tensor& k_cache, const Tensor& v_cache, int64_t max_ctx);
  virtual void attention_impl(const Tensor& q, const Tensor& gate, const Tensor& k_cache,
                              const Tensor& v_cache, const Tensor& pos, int64_t max_ctx,
                              const AttentionShape& s, const Tensor& ws, const Tensor& out) = 0;
  virtual void conv1d_silu_impl(const Tensor& mixed, const Tensor& conv_w, const Tensor& state_in,
                                const Tensor& state_out, const Tensor& out, const StateCapture& capture) = 0;
  virtual void gated_delta_impl(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                                const Tensor& dt_bias, const Tensor& state_in, const Tensor& state_out,
                                const DeltaShape& s, const Tensor& ws, const Tensor& out,
                                const StateCapture& capture) = 0;
  virtual void gated_rms_norm_impl(const Tensor& o, const Tensor& z, const Tensor& w, float eps,
                                   const Tensor& out) = 0;
  virtual void moe_route_impl(const Tensor& logits, int64_t k, const Tensor& ws, const Tensor& ids,
                              const Tensor& weights) = 0;
  virtual void moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights, const Weight& gate,
                                const Weight& up, const Weight& down, const Tensor& ws,
                                const Tensor& out) = 0;
  virtual void swiglu_impl(const Tensor& gate, const Tensor& up, const Tensor& out) = 0;
  // Defaults (ops.cpp): matmul for each product; the norm, then the products; the MoE and the DeltaNet recurrence
  // composed from their parts.
  virtual void matmuls_impl(const Tensor& x, const MatmulGroup& g);
  // b invalid: rms_norm_matmuls (sum is a and is not written); else add_rms_norm_matmuls.
  virtual void norm_matmuls_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                                 const Tensor& normed, const MatmulGroup& g);
  virtual void moe_impl(const Tensor& x, const Tensor& router_logits, const Tensor& shared_gate_logit, int64_t k,
                        const MoeWeights& w, const MoeScratch& sc, const Tensor& ws, const Tensor& h);
  // Default: conv1d_silu_impl, gated_delta_impl, gated_rms_norm_impl, a barrier between each.
  virtual void conv_delta_norm_impl(const Tensor& qkv, const Tensor& z, const Tensor& b, const Tensor& a,
                                    const Tensor& conv_w, const Tensor& A_log, const Tensor& dt_bias,
                                    const Tensor& norm_w, float eps, const DeltaShape& s, const Tensor& conv_in,
                                    const Tensor& conv_out, const Tensor& rec_in, const Tensor& rec_out,
                                    const Tensor& mixed, const Tensor& delta_o, const Tensor& ws, const Tensor& out,
                                    const StateCapture& conv_cap, const StateCapture& rec_cap);
  virtual void moe_combine_impl(const Tensor& routed, const Tensor& shared, const Tensor& shared_gate_logit,
                                const Tensor& h) = 0;
  virtual void copy_impl(const Tensor& src, const Tensor& dst) = 0;
  virtual void fill_impl(const Tensor& dst, double value) = 0;
  virtual void advance_position_impl(const Tensor& pos_in, const Tensor& pos_out, int64_t T) = 0;
  virtual void sample_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p,
                           const Tensor& ws, const Tensor& next_id) = 0;
  // Default: embed, then the two norms; one row's norms write out's halves, several rows' go through `normed`
  // and copies (copies honour row strides on every backend; a norm's output need not).
  virtual void mtp_input_impl(const Tensor& ids, const Weight& table, const Tensor& h, const Tensor& w_e,
                              const Tensor& w_h, float eps, const Tensor& e, const Tensor& normed, const Tensor& out);
  // Default: sample_impl on each row in order (a barrier between rows).
  virtual void sample_rows_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p,
                                const Tensor& ws, const Tensor& next_id);
  virtual void accept_drafts_impl(const Tensor& ids, const Tensor& y, const Tensor& pos_in, const Tensor& accepted,
                                  const Tensor& next_id, const Tensor& pos_out) = 0;
  virtual void copy_rows_at_impl(const Tensor& src, const Tensor& index, int64_t offset, const Tensor& dst) = 0;

  HazardTracker tracker_;

 private:
  // Throws std::invalid_argument unless the capture's rows lie in [0, T) and its tensor holds count F32 slices
  // shaped like `state` (a capture with count 0 is not checked).
  static void check_capture(const char* op, const StateCapture& c, int64_t T, const Tensor& state);
  // Throw std::logic_error naming the op and the tensor unless the shapes and dtypes are the ops' contracts.
  static void check_accept_drafts(const Tensor& ids, const Tensor& y, const Tensor& pos_in, const Tensor& accepted,
                                  const Tensor& next_id, const Tensor& pos_out);
  static void check_copy_rows_at(const Tensor& src, const Tensor& index, const Tensor& dst);
  static void check_sample_rows(const Tensor& logits, const Tensor& next_id);
  static void check_mtp_input(const Tensor& ids, const Weight& table, const Tensor& h, const Tensor& w_e,
                              const Tensor& w_h, const Tensor& e, const Tensor& normed, const Tensor& out);
  // The op as one impl call on its arguments (by reference for the immediate run; `clone` copies them for a
  // backend that runs later).
  template <class... P, class... A>
  void record(OpKind kind, std::initializer_list<int32_t> reads, std::initializer_list<int32_t> writes,
              void (Ops::*impl)(P...), const A&... args) {
    if (!in_step_) throw std::logic_error(std::string("op '") + op_name(kind) + "' recorded outside a step");
    if (tracker_.record(kind, reads, writes)) on_stage_boundary();
    struct Bound {
      Ops* self;
      void (Ops::*impl)(P...);
      std::tuple<const A&...> args;
    };
    const Bound bound{this, impl, std::tie(args...)};
    const OpRun op{[](const void* p) {
                     const Bound& b = *static_cast<const Bound*>(p);
                     std::apply([&](const A&... a) { (b.self->*b.impl)(a...); }, b.args);
                   },
                   [](const void* p) -> std::function<void()> {
                     const Bound& b = *static_cast<const Bound*>(p);
                     return [self = b.self, impl = b.impl, copies = std::tuple<A...>(b.args)] {
                       std::apply([&](const A&... a) { (self->*impl)(a...); }, copies);
                     };
                   },
                   &bound, reads, writes,
                   [](const void* p, std::string& k) {
                     std::apply([&](const A&... a) { (key_append(k, a), ...); }, static_cast<const Bound*>(p)->args);
                   }};
    if (!profiling_) return execute(kind, op);
    const auto t0 = std::chrono::steady_clock::now();
    execute(kind, op);
    profile_[size_t(kind)] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  bool in_step_ = false;
  bool profiling_ = false;
  std::array<double, kOpKinds> profile_{};
  Phase phase_ = Phase::Prefill;
  bool repeats_ = false;
  bool once_ = false;
  bool speculative_ = false;
};

}  // namespace lily
