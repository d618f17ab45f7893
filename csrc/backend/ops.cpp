#include "backend/ops.h"

#include <stdexcept>
#include <string>

namespace lily {

Tensor Ops::alloc(const std::string& label, DType dtype, int64_t rows, int64_t cols) {
  if (in_step_) throw std::logic_error("alloc('" + label + "') inside a step: scratch comes from the workspace");
  if (rows < 0 || cols <= 0)
    throw std::invalid_argument("alloc('" + label + "'): bad shape [" + std::to_string(rows) + ", " +
                                std::to_string(cols) + "]");
  Tensor t = alloc_impl(label, dtype, rows, cols);
  tracker_.ensure(t.buf + 1);
  return t;
}

void Ops::upload(const Tensor& dst, const void* src) {
  if (in_step_) throw std::logic_error("upload inside a step: steps read their inputs from device tensors");
  ++transfers_.uploads;
  transfers_.upload_bytes += int64_t(dst.bytes());
  upload_impl(dst, src);
}

void Ops::download(const Tensor& src, void* dst) {
  if (in_step_) throw std::logic_error("download inside a step: submit and wait first");
  ++transfers_.downloads;
  transfers_.download_bytes += int64_t(src.bytes());
  download_impl(src, dst);
}

void Ops::begin(Phase phase, bool repeats, bool once) {
  if (in_step_) throw std::logic_error("begin: the previous step was not submitted");
  phase_ = phase;
  repeats_ = repeats;
  once_ = once;
  speculative_ = false;
  tracker_.begin();
  in_step_ = true;
}

uint64_t Ops::submit() {
  if (!in_step_) throw std::logic_error("submit without begin");
  in_step_ = false;
  ++submitted_;
  return submit_impl();
}

void Ops::matmuls_impl(const Tensor& x, const MatmulGroup& g) {
  for (int i = 0; i < g.n; ++i) matmul_impl(x, g.w[size_t(i)], g.out[size_t(i)]);
}

void Ops::norm_matmuls_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                            const Tensor& normed, const MatmulGroup& g) {
  if (b.valid())
    add_rms_norm_impl(a, b, w, eps, sum, normed);
  else
    rms_norm_impl(a, w, normed, eps);
  barrier_in_op();
  matmuls_impl(normed, g);
}

// The MoE as its parts, in four dependent groups: routing and the shared expert's gate/up (all read x or the
// logits only); the routed experts and the shared activation; the shared down projection; the combine.
void Ops::moe_impl(const Tensor& x, const Tensor& router_logits, const Tensor& shared_gate_logit, int64_t k,
                   const MoeWeights& w, const MoeScratch& sc, const Tensor& ws, const Tensor& h) {
  moe_route_impl(router_logits, k, ws, sc.ids, sc.weights);
  matmul_impl(x, w.shared_gate_proj, sc.shared_g);
  matmul_impl(x, w.shared_up, sc.shared_u);
  barrier_in_op();
  swiglu_impl(sc.shared_g, sc.shared_u, sc.shared_act);
  moe_experts_impl(x, sc.ids, sc.weights, w.gate, w.up, w.down, ws, sc.routed);
  barrier_in_op();
  matmul_impl(sc.shared_act, w.shared_down, sc.shared);
  barrier_in_op();
  moe_combine_impl(sc.routed, sc.shared, shared_gate_logit, h);
}

void Ops::attn_qk_prep_append_impl(const Tensor& qg, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                                   const Tensor& k_norm, const Tensor& pos, const AttentionShape& s,
                                   const Tensor& q_out, const Tensor& gate_out, const Tensor& k_out,
                                   const Tensor& k_cache, const Tensor& v_cache, int64_t max_ctx) {
  attn_qk_prep_impl(qg, k, q_norm, k_norm, pos, s, q_out, gate_out, k_out);
  barrier_in_op();
  kv_append_impl(k_out, v, pos, k_cache, v_cache, max_ctx, s);
}

void Ops::conv_delta_norm_impl(const Tensor& qkv, const Tensor& z, const Tensor& b, const Tensor& a,
                               const Tensor& conv_w, const Tensor& A_log, const Tensor& dt_bias, const Tensor& norm_w,
                               float eps, const DeltaShape& s, const Tensor& conv_in, const Tensor& conv_out,
                               const Tensor& rec_in, const Tensor& rec_out, const Tensor& mixed, const Tensor& delta_o,
                               const Tensor& ws, const Tensor& out, const StateCapture& conv_cap,
                               const StateCapture& rec_cap) {
  conv1d_silu_impl(qkv, conv_w, conv_in, conv_out, mixed, conv_cap);
  barrier_in_op();
  gated_delta_impl(mixed, b, a, A_log, dt_bias, rec_in, rec_out, s, ws, delta_o, rec_cap);
  barrier_in_op();
  gated_rms_norm_impl(delta_o, z, norm_w, eps, out);
}

void Ops::check_capture(const char* op, const StateCapture& c, int64_t T, const Tensor& state) {
  if (c.count == 0) return;
  auto fail = [&](const std::string& why) { throw std::invalid_argument(std::string(op) + ": capture " + why); };
  if (c.count < 0 || c.first < 0 || c.first + c.count > T)
    fail("rows [" + std::to_string(c.first) + ", " + std::to_string(c.first + c.count) + ") are not inside the " +
         std::to_string(T) + " rows of the call");
  if (!c.states.valid() || c.states.dtype != DType::F32 || c.states.cols != state.cols ||
      c.states.rows != c.count * state.rows)
    fail("tensor must be F32 [" + std::to_string(c.count) + " * " + std::to_string(state.rows) + ", " +
         std::to_string(state.cols) + "] (count slices of the state), got [" + std::to_string(c.states.rows) + ", " +
         std::to_string(c.states.cols) + "]");
  if (c.states.buf == state.buf) fail("tensor must not be the state's buffer");
}

namespace {
std::string shape_of(const Tensor& t) {
  return std::string(dtype_name(t.dtype)) + " [" + std::to_string(t.rows) + ", " + std::to_string(t.cols) + "]";
}
}  // namespace

void Ops::check_accept_drafts(const Tensor& ids, const Tensor& y, const Tensor& pos_in, const Tensor& accepted,
                              const Tensor& next_id, const Tensor& pos_out) {
  auto fail = [](const std::string& why) { throw std::invalid_argument("accept_drafts: " + why); };
  auto i32 = [&](const Tensor& t, const char* name, int64_t rows) {
    if (!t.valid() || t.dtype != DType::I32 || t.rows != rows || t.cols != 1)
      fail(std::string(name) + " must be I32 [" + std::to_string(rows) + ", 1], got " + shape_of(t));
  };
  if (ids.rows < 1 || ids.rows > 64) fail("ids must hold 1 to 64 rows (the pending token and its drafts), got " + shape_of(ids));
  i32(ids, "ids", ids.rows);
  i32(y, "y", ids.rows);
  i32(pos_in, "pos_in", 1);
  i32(accepted, "accepted", 1);
  i32(next_id, "next_id", 1);
  i32(pos_out, "pos_out", 1);
}

void Ops::check_copy_rows_at(const Tensor& src, const Tensor& index, const Tensor& dst) {
  auto fail = [](const std::string& why) { throw std::invalid_argument("copy_rows_at: " + why); };
  if (!index.valid() || index.dtype != DType::I32 || index.rows != 1 || index.cols != 1)
    fail("index must be I32 [1, 1], got " + shape_of(index));
  if (!src.valid() || !dst.valid() || src.dtype != dst.dtype || src.cols != dst.cols)
    fail("src " + shape_of(src) + " and dst " + shape_of(dst) + " must share dtype and columns");
  if (dtype_size(src.dtype) != 4) fail("copies 4-byte elements (F32, I32), got " + shape_of(src));
  if (dst.rows < 1) fail("dst must hold at least one row, got " + shape_of(dst));
  if (src.buf == dst.buf) fail("src and dst must be different buffers");
}

void Ops::check_sample_rows(const Tensor& logits, const Tensor& next_id) {
  if (!logits.valid() || logits.rows < 1 || !next_id.valid() || next_id.rows != logits.rows)
    throw std::invalid_argument("sample: logits " + shape_of(logits) + " and next_id " + shape_of(next_id) +
                                " must have the same number of rows (at least one)");
}

void Ops::sample_rows_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p, const Tensor& ws,
                           const Tensor& next_id) {
  for (int64_t r = 0; r < logits.rows; ++r) {
    if (r > 0) barrier_in_op();  // row r reads the sampler state row r - 1 wrote
    sample_impl(logits.rows_view(r, 1), st, p, ws, next_id.rows_view(r, 1));
  }
}

void Ops::check_mtp_input(const Tensor& ids, const Weight& table, const Tensor& h, const Tensor& w_e,
                          const Tensor& w_h, const Tensor& e, const Tensor& normed, const Tensor& out) {
  auto fail = [](const std::string& why) { throw std::invalid_argument("mtp_input: " + why); };
  const int64_t n = ids.rows, H = h.cols;
  if (!ids.valid() || ids.dtype != DType::I32 || ids.cols != 1 || n < 1)
    fail("ids must be I32 [n, 1] with n >= 1, got " + shape_of(ids));
  if (table.cols != H) fail("the embedding table's rows (" + std::to_string(table.cols) + " columns) must match h " +
                            shape_of(h));
  auto f32 = [&](const Tensor& t, const char* name, int64_t rows, int64_t cols) {
    if (!t.valid() || t.dtype != DType::F32 || t.rows != rows || t.cols != cols)
      fail(std::string(name) + " must be F32 [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " +
           shape_of(t));
  };
  f32(h, "h", n, H);
  f32(w_e, "w_e", 1, H);
  f32(w_h, "w_h", 1, H);
  f32(e, "e", n, H);
  f32(normed, "normed", n, H);
  f32(out, "out", n, 2 * H);
  for (const Tensor* t : {&e, &normed, &out})
    if (t->buf == h.buf || t->buf == ids.buf) fail("e, normed and out must not share a buffer with ids or h");
  if (e.buf == out.buf || normed.buf == out.buf) fail("e and normed must not share out's buffer");
}

void Ops::mtp_input_impl(const Tensor& ids, const Weight& table, const Tensor& h, const Tensor& w_e,
                         const Tensor& w_h, float eps, const Tensor& e, const Tensor& normed, const Tensor& out) {
  const int64_t H = h.cols;
  Tensor left = out, right = out;
  left.cols = right.cols = H;
  right.offset += H;
  embed_impl(ids, table, e);
  barrier_in_op();
  if (ids.rows == 1) {  // one row has no stride to honour: the norms write the halves
    rms_norm_impl(e, w_e, left, eps);
    rms_norm_impl(h, w_h, right, eps);
    return;
  }
  rms_norm_impl(e, w_e, normed, eps);
  barrier_in_op();
  copy_impl(normed, left);
  barrier_in_op();
  rms_norm_impl(h, w_h, normed, eps);
  barrier_in_op();
  copy_impl(normed, right);
}

void Ops::set_profiling(bool on) {
  profiling_ = on;
  profile_.fill(0.0);
}

}  // namespace lily
