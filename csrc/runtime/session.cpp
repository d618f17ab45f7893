#include "runtime/session.h"

#include <algorithm>
#include <cstring>

namespace lily {

namespace {
// Holds the session for one call; a second thread gets SessionBusy instead of corrupting state.
struct BusyGuard {
  std::unique_lock<std::mutex> lk;
  explicit BusyGuard(std::mutex& m) : lk(m, std::try_to_lock) {
    if (!lk.owns_lock()) throw SessionBusy("session is in use by another thread");
  }
};
}  // namespace

size_t Snapshot::bytes() const {
  size_t b = tokens.size() * 4 + logits.size() * 4;
  for (auto* v : {&kv, &conv, &recurrent})
    for (auto& x : *v) b += x.size() * 4;
  return b;
}

Session::Session(Qwen36& model, std::mutex& model_lock, int64_t max_context, int64_t chunk, DType kv_dtype)
    : model_(model), model_lock_(model_lock), chunk_(chunk) {
  if (kv_dtype != DType::F32 && kv_dtype != DType::BF16)
    throw std::invalid_argument("kv_cache_dtype must be f32 or bf16");
  if (max_context <= 0) throw std::invalid_argument("max_context must be > 0");
  if (chunk <= 0) throw std::invalid_argument("prefill_chunk must be > 0");
  std::lock_guard<std::mutex> lk(model_lock_);
  st_ = model_.new_state(max_context, kv_dtype);
}

Session::~Session() {
  std::lock_guard<std::mutex> lk(model_lock_);
  model_.free_state(st_);
  if (prefill_sc_.rows) model_.free_scratch(prefill_sc_);
  if (decode_sc_.rows) model_.free_scratch(decode_sc_);
}

std::vector<int32_t> Session::tokens() const {
  std::vector<int32_t> t = tokens_;
  if (pending_ >= 0) t.push_back(pending_);
  return t;
}

size_t Session::state_bytes() const { return model_.state_bytes(st_.max_ctx, st_.kv_dtype); }

void Session::read_kv_rows(const Tensor& cache, int64_t head, int64_t n, float* dst) {
  const Tensor rows = cache.rows_view(head * st_.max_ctx, n);
  if (cache.dtype == DType::F32) return model_.ops().download(rows, dst);
  std::vector<uint16_t> raw(static_cast<size_t>(n * cache.cols));
  model_.ops().download(rows, raw.data());
  for (size_t i = 0; i < raw.size(); ++i) dst[i] = bf16_to_f32(raw[i]);
}

void Session::write_kv_rows(const Tensor& cache, int64_t head, int64_t n, const float* src) {
  const Tensor rows = cache.rows_view(head * st_.max_ctx, n);
  if (cache.dtype == DType::F32) return model_.ops().upload(rows, src);
  std::vector<uint16_t> raw(static_cast<size_t>(n * cache.cols));
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = f32_to_bf16(src[i]);
  model_.ops().upload(rows, raw.data());
}

void Session::check_ids(const int32_t* ids, int64_t n) const {
  const int64_t vocab = model_.config().vocab;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw std::out_of_range("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

void Session::ensure_scratch(Scratch& sc, int64_t rows, int64_t logit_rows) {
  if (sc.rows >= rows && sc.logit_rows >= logit_rows) return;
  rows = std::max(rows, sc.rows);
  logit_rows = std::max(logit_rows, sc.logit_rows);
  if (sc.rows) model_.free_scratch(sc);
  sc = model_.new_scratch(rows, logit_rows);
}

void Session::decode_locked(int32_t token) {
  ensure_scratch(decode_sc_, 1, 1);
  last_logits_.resize(size_t(model_.config().vocab));
  model_.forward(st_, decode_sc_, &token, 1, int64_t(tokens_.size()), Phase::Decode, 1, last_logits_.data());
  decode_stats_ = model_.ops().stats();
  tokens_.push_back(token);
}

void Session::feed_pending() {
  if (pending_ < 0) return;
  std::lock_guard<std::mutex> lk(model_lock_);
  int32_t t = pending_;
  decode_locked(t);
  pending_ = -1;
}

void Session::prefill(const int32_t* ids, int64_t n, bool all_logits, float* out,
                      const std::function<bool(int64_t, int64_t)>& progress) {
  BusyGuard busy(busy_);
  if (n <= 0) throw std::invalid_argument("prefill needs at least one token");
  check_ids(ids, n);
  if (position() + n > st_.max_ctx)
    throw ContextOverflow("prefill of " + std::to_string(n) + " tokens at position " +
                          std::to_string(position()) + " exceeds max_context " + std::to_string(st_.max_ctx));
  feed_pending();
  const int64_t vocab = model_.config().vocab;
  std::vector<float> row(static_cast<size_t>(vocab));
  for (int64_t done = 0; done < n;) {
    const int64_t T = std::min(chunk_, n - done);
    {
      std::lock_guard<std::mutex> lk(model_lock_);
      // Logits rows are computed in blocks of 16 to bound the [rows, vocab] scratch. Every chunk
      // computes at least its last row, so a cancelled prefill still leaves valid logits.
      ensure_scratch(prefill_sc_, std::min(chunk_, n), all_logits ? std::min<int64_t>(16, chunk_) : 1);
      float* dst = all_logits ? out + done * vocab : row.data();
      model_.forward(st_, prefill_sc_, ids + done, T, int64_t(tokens_.size()), Phase::Prefill,
                     all_logits ? T : 1, dst);
      prefill_stats_ = model_.ops().stats();
      tokens_.insert(tokens_.end(), ids + done, ids + done + T);
      const float* last = all_logits ? out + (done + T - 1) * vocab : row.data();
      last_logits_.assign(last, last + vocab);
    }
    done += T;
    if (progress && !progress(done, n) && done < n) return;  // cancelled between chunks
  }
  if (!all_logits) std::memcpy(out, last_logits_.data(), size_t(vocab) * 4);
}

void Session::step(int32_t token, float* out) {
  BusyGuard busy(busy_);
  check_ids(&token, 1);
  if (position() + 1 > st_.max_ctx)
    throw ContextOverflow("step at position " + std::to_string(position()) + " exceeds max_context " +
                          std::to_string(st_.max_ctx));
  feed_pending();
  std::lock_guard<std::mutex> lk(model_lock_);
  decode_locked(token);
  std::memcpy(out, last_logits_.data(), last_logits_.size() * 4);
}

void Session::logits(float* out) {
  BusyGuard busy(busy_);
  feed_pending();
  if (last_logits_.empty()) throw std::logic_error("no logits yet: the session's context is empty");
  std::memcpy(out, last_logits_.data(), last_logits_.size() * 4);
}

std::string Session::generate(int64_t max_tokens, const SamplingParams& params,
                              const std::vector<int32_t>& stop_ids,
                              const std::function<bool(int32_t)>& on_token) {
  BusyGuard busy(busy_);
  if (max_tokens < 0) throw std::invalid_argument("max_tokens must be >= 0");
  Sampler sampler(params);
  feed_pending();
  if (last_logits_.empty()) throw std::logic_error("generate needs a prefilled context");
  const int64_t vocab = model_.config().vocab;
  std::vector<int32_t> context = tokens_;
  for (int64_t i = 0; i < max_tokens; ++i) {
    if (position() >= st_.max_ctx) return "context";
    if (pending_ >= 0) {
      std::lock_guard<std::mutex> lk(model_lock_);
      decode_locked(pending_);
      pending_ = -1;
    }
    const int32_t tok = sampler.sample(last_logits_.data(), vocab, context);
    context.push_back(tok);
    pending_ = tok;  // fed lazily: a stop token costs no forward unless the context continues
    const bool keep_going = on_token(tok);
    if (std::find(stop_ids.begin(), stop_ids.end(), tok) != stop_ids.end()) return "stop";
    if (!keep_going) return "cancelled";
  }
  return "length";
}

Snapshot Session::snapshot() {
  BusyGuard busy(busy_);
  std::lock_guard<std::mutex> lk(model_lock_);
  const ModelConfig& c = model_.config();
  Snapshot s;
  s.position = int64_t(tokens_.size());
  s.tokens = tokens_;
  s.pending = pending_;
  s.logits = last_logits_;
  Ops& ops = model_.ops();
  for (size_t li = 0; li < size_t(c.layers); ++li) {
    if (c.full_attention[li]) {
      std::vector<float> kv(static_cast<size_t>(2 * c.kv_heads * s.position * c.head_dim));
      float* p = kv.data();
      for (const Tensor* cache : {&st_.k_cache[li], &st_.v_cache[li]})
        for (int64_t h = 0; h < c.kv_heads; ++h) {
          if (s.position) read_kv_rows(*cache, h, s.position, p);
          p += s.position * c.head_dim;
        }
      s.kv.push_back(std::move(kv));
    } else {
      std::vector<float> conv(static_cast<size_t>(st_.conv[li].rows * st_.conv[li].cols));
      std::vector<float> rec(static_cast<size_t>(st_.recurrent[li].rows * st_.recurrent[li].cols));
      ops.download(st_.conv[li], conv.data());
      ops.download(st_.recurrent[li], rec.data());
      s.conv.push_back(std::move(conv));
      s.recurrent.push_back(std::move(rec));
    }
  }
  return s;
}

void Session::restore(const Snapshot& s) {
  BusyGuard busy(busy_);
  const ModelConfig& c = model_.config();
  // Validate everything before touching the state, so a bad snapshot leaves the session as it was.
  const int64_t need = s.position + (s.pending >= 0);
  if (need > st_.max_ctx)
    throw ContextOverflow("snapshot holds " + std::to_string(need) + " tokens, more than max_context " +
                          std::to_string(st_.max_ctx));
  if (int64_t(s.tokens.size()) != s.position) throw std::invalid_argument("snapshot: token count mismatch");
  size_t n_full = size_t(c.n_full()), n_lin = size_t(c.n_linear());
  if (s.kv.size() != n_full || s.conv.size() != n_lin || s.recurrent.size() != n_lin)
    throw std::invalid_argument("snapshot: layer count does not match this model");
  if (!s.logits.empty() && int64_t(s.logits.size()) != c.vocab)
    throw std::invalid_argument("snapshot: logits size does not match this model's vocabulary");
  for (auto& kv : s.kv)
    if (int64_t(kv.size()) != 2 * c.kv_heads * s.position * c.head_dim)
      throw std::invalid_argument("snapshot: KV cache size does not match this model");
  for (size_t i = 0; i < n_lin; ++i)
    if (int64_t(s.conv[i].size()) != (c.conv_kernel - 1) * c.conv_dim() ||
        int64_t(s.recurrent[i].size()) != c.lin_v_heads * c.lin_k_dim * c.lin_v_dim)
      throw std::invalid_argument("snapshot: recurrent state size does not match this model");
  check_ids(s.tokens.data(), int64_t(s.tokens.size()));
  if (s.pending >= 0) check_ids(&s.pending, 1);

  std::lock_guard<std::mutex> lk(model_lock_);
  Ops& ops = model_.ops();
  size_t fi = 0, di = 0;
  for (size_t li = 0; li < size_t(c.layers); ++li) {
    if (c.full_attention[li]) {
      const float* p = s.kv[fi++].data();
      for (const Tensor* cache : {&st_.k_cache[li], &st_.v_cache[li]})
        for (int64_t h = 0; h < c.kv_heads; ++h) {
          if (s.position) write_kv_rows(*cache, h, s.position, p);
          p += s.position * c.head_dim;
        }
    } else {
      ops.upload(st_.conv[li], s.conv[di].data());
      ops.upload(st_.recurrent[li], s.recurrent[di].data());
      ++di;
    }
  }
  tokens_ = s.tokens;
  pending_ = s.pending;
  last_logits_ = s.logits;
}

void Session::reset() {
  BusyGuard busy(busy_);
  std::lock_guard<std::mutex> lk(model_lock_);
  const ModelConfig& c = model_.config();
  for (size_t li = 0; li < size_t(c.layers); ++li) {
    if (c.full_attention[li]) continue;  // KV rows past the position are never read
    std::vector<float> zeros(static_cast<size_t>(std::max(st_.conv[li].rows * st_.conv[li].cols,
                                             st_.recurrent[li].rows * st_.recurrent[li].cols)));
    model_.ops().upload(st_.conv[li], zeros.data());
    model_.ops().upload(st_.recurrent[li], zeros.data());
  }
  tokens_.clear();
  pending_ = -1;
  last_logits_.clear();
}

}  // namespace lily
