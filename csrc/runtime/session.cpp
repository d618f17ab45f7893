#include "runtime/session.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>

namespace lily {

namespace {
// Holds the session for one call; a second thread gets SessionBusy instead of corrupting state.
struct BusyGuard {
  std::unique_lock<std::mutex> lk;
  explicit BusyGuard(std::mutex& m) : lk(m, std::try_to_lock) {
    if (!lk.owns_lock()) throw SessionBusy("session is in use by another thread");
  }
};

// One step being encoded: an exception before submit() drops it, so the engine stays usable.
struct Step {
  Ops& ops;
  Step(Ops& o, Phase phase, bool repeats = false, bool once = false) : ops(o) { ops.begin(phase, repeats, once); }
  ~Step() {
    if (ops.in_step()) ops.abandon();
  }
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  uint64_t submit() { return ops.submit(); }
};

// Runs f when the scope ends, however it ends.
template <class F>
struct AtExit {
  F f;
  explicit AtExit(F fn) : f(std::move(fn)) {}
  ~AtExit() { f(); }
  AtExit(const AtExit&) = delete;
  AtExit& operator=(const AtExit&) = delete;
};
}  // namespace

// ---- snapshots ----

size_t HostSnapshot::bytes() const {
  size_t b = tokens.size() * 4 + logits.size() * 4;
  for (auto* v : {&kv, &conv, &recurrent})
    for (auto& x : *v) b += x.size() * 4;
  return b;
}

KvSegment::~KvSegment() {
  std::lock_guard<std::mutex> lk(lock_);
  if (deferred) {  // dropped before its rows were owed to anyone: nobody will read them
    auto& owed = deferred->deferred_kv_;
    owed.erase(std::remove(owed.begin(), owed.end(), this), owed.end());
  }
  Ops& ops = model_.ops();
  for (auto* list : {&k, &v})
    for (Tensor& t : *list) ops.release(t);
}  // the parent reference drops after the lock is released (a chain unwinds one lock at a time)

size_t KvSegment::bytes() const {
  size_t b = 0;
  for (auto* list : {&k, &v})
    for (const Tensor& t : *list) b += t.bytes();
  return b;
}

namespace {
// The segments holding rows [0, tail->end), root first.
std::vector<const KvSegment*> chain(const std::shared_ptr<const KvSegment>& tail) {
  std::vector<const KvSegment*> segs;
  for (const KvSegment* s = tail.get(); s; s = s->parent.get()) segs.push_back(s);
  std::reverse(segs.begin(), segs.end());
  return segs;
}
}  // namespace

DeviceSnapshot::~DeviceSnapshot() {
  std::lock_guard<std::mutex> lk(lock_);
  if (deferred_ && deferred_->deferred_state_ == this) deferred_->deferred_state_ = nullptr;
  // Sessions restored from it that have not run a forward since: their state is written now, while it exists.
  while (!readers_.empty()) {
    Session* r = readers_.back();
    try {
      r->write_restore_locked();  // unregisters r
    } catch (const std::exception& e) {  // a failed device: that session's state cannot be written; it says so
      r->restore_lost_ = std::string("its restore could not be written before the snapshot was dropped (") + e.what() +
                         "); reset() or restore() it";
      r->drop_restore_locked();
    }
  }
  Ops& ops = model_.ops();
  for (auto* v : {&conv_, &recurrent_})
    for (Tensor& t : *v) ops.release(t);
  ops.release(logits_);
  ops.release(mtp_h_);
}  // kv_ drops after the lock is released: a segment's destructor takes it

size_t DeviceSnapshot::state_bytes() const {
  // Shapes only (a deferred snapshot's tensors are allocated later, under the lock; bytes() reads no buffer id).
  size_t b = tokens_.size() * 4 + logits_.bytes() + mtp_h_.bytes();
  for (auto* v : {&conv_, &recurrent_})
    for (const Tensor& t : *v) b += t.bytes();
  return b;
}

size_t DeviceSnapshot::bytes() const {
  size_t b = state_bytes();
  for (const KvSegment* seg : chain(kv_)) b += seg->bytes();
  return b;
}

size_t DeviceSnapshot::own_bytes() const { return state_bytes() + (owns_tail_ ? kv_->bytes() : 0); }

size_t DeviceSnapshot::kv_segments() const { return chain(kv_).size(); }

HostSnapshot DeviceSnapshot::to_host() const {
  std::lock_guard<std::mutex> lk(lock_);
  Session::settle_locked(*this);  // a deferred checkpoint's copies first
  Ops& ops = model_.ops();
  const ModelConfig& c = model_.config();
  HostSnapshot h;
  h.position = position_;
  h.tokens = tokens_;
  h.pending = pending_;
  h.mtp_valid = mtp_valid_;
  if (has_logits_) {
    h.logits.resize(size_t(c.vocab));
    ops.download(logits_, h.logits.data());
    if (mtp_h_.valid()) {
      h.mtp_h.resize(size_t(c.hidden));
      ops.download(mtp_h_, h.mtp_h.data());
    }
  }
  // Session files hold per layer K then V as [kv_heads, position, head_dim]; a segment holds its rows
  // [begin, end) as [kv_heads, end - begin, head_dim], so each head's rows land at begin.
  const int64_t pos = position_, hd = c.head_dim;
  const size_t n_full = model_.kv_cache_count();  // the decoder's KV caches, then the MTP block's
  for (size_t i = 0; i < n_full; ++i) h.kv.emplace_back(size_t(2 * c.kv_heads * pos * hd));
  std::vector<float> rows;
  std::vector<uint16_t> raw;
  for (const KvSegment* seg : chain(kv_)) {
    const int64_t n = seg->end - seg->begin;
    for (size_t i = 0; i < n_full && n > 0; ++i) {
      for (int kv = 0; kv < 2; ++kv) {
        const Tensor& t = kv == 0 ? seg->k[i] : seg->v[i];
        rows.resize(size_t(t.rows * t.cols));
        if (t.dtype == DType::F32) {
          ops.download(t, rows.data());
        } else {
          raw.resize(rows.size());
          ops.download(t, raw.data());
          for (size_t j = 0; j < raw.size(); ++j) rows[j] = bf16_to_f32(raw[j]);
        }
        float* dst = h.kv[i].data() + size_t(kv) * size_t(c.kv_heads * pos * hd);
        for (int64_t hh = 0; hh < c.kv_heads; ++hh)
          std::copy(rows.begin() + hh * n * hd, rows.begin() + (hh + 1) * n * hd,
                    dst + (hh * pos + seg->row0(i, size_t(c.n_full()))) * hd);
      }
    }
  }
  // The MTP block's cache holds only rows [0, position - 1) (its last row waits for the next token), and none
  // when it was not kept: those rows are written as zeros, so equal states give equal host copies and files.
  for (size_t i = size_t(c.n_full()); i < n_full && pos > 0; ++i)
    for (int kv = 0; kv < 2; ++kv)
      for (int64_t hh = 0; hh < c.kv_heads; ++hh) {
        float* head = h.kv[i].data() + size_t(kv) * size_t(c.kv_heads * pos * hd) + size_t(hh * pos * hd);
        std::fill(mtp_valid_ ? head + (pos - 1) * hd : head, head + pos * hd, 0.f);
      }
  if (!mtp_valid_) std::fill(h.mtp_h.begin(), h.mtp_h.end(), 0.f);
  for (size_t i = 0; i < conv_.size(); ++i) {
    h.conv.emplace_back(size_t(conv_[i].rows * conv_[i].cols));
    h.recurrent.emplace_back(size_t(recurrent_[i].rows * recurrent_[i].cols));
    ops.download(conv_[i], h.conv.back().data());
    ops.download(recurrent_[i], h.recurrent.back().data());
  }
  return h;
}

size_t CheckpointReserve::bytes() const {
  size_t b = logits.bytes() + mtp_h.bytes();
  for (auto* v : {&conv, &recurrent})
    for (const Tensor& t : *v) b += t.bytes();
  return b;
}

void CheckpointReserve::release(Ops& ops) {
  for (auto* v : {&conv, &recurrent}) {
    for (Tensor& t : *v) ops.release(t);
    v->clear();
  }
  ops.release(logits);
  ops.release(mtp_h);
  ready = false;
}

// ---- session ----

Session::Session(Qwen36& model, std::mutex& model_lock, int64_t max_context, int64_t chunk, DType kv_dtype,
                 CheckpointReserve* reserve)
    : model_(model), ops_(model.ops()), model_lock_(model_lock), reserve_(reserve), chunk_(chunk) {
  if (kv_dtype != DType::F32 && kv_dtype != DType::BF16) throw std::invalid_argument("kv_cache_dtype must be f32 or bf16");
  if (max_context <= 0) throw std::invalid_argument("max_context must be > 0");
  if (chunk <= 0) throw std::invalid_argument("prefill_chunk must be > 0");
  std::lock_guard<std::mutex> lk(model_lock_);
  st_ = model_.new_state(max_context, kv_dtype);
  try {
    decode_sc_ = model_.new_scratch(1, 1, max_context);
  } catch (...) {
    model_.free_state(st_);
    throw;
  }
}

Session::~Session() {
  std::lock_guard<std::mutex> lk(model_lock_);
  try {
    flush_deferred_locked();  // snapshots outliving the session get what it owes them
  } catch (...) {  // a failed device: nothing can be written; the owed snapshots are left unwritten
    for (KvSegment* seg : deferred_kv_) seg->deferred = nullptr;
    if (deferred_state_) deferred_state_->deferred_ = nullptr;
  }
  drop_restore_locked();
  free_spec_locked();
  model_.free_state(st_);
  model_.free_scratch(prefill_sc_);
  model_.free_scratch(decode_sc_);
}

int64_t Session::position() const {
  std::lock_guard<std::mutex> lk(state_mu_);
  return int64_t(tokens_.size()) + (pending_ >= 0);
}

std::vector<int32_t> Session::tokens() const {
  std::lock_guard<std::mutex> lk(state_mu_);
  std::vector<int32_t> t = tokens_;
  if (pending_ >= 0) t.push_back(pending_);
  return t;
}

StepStats Session::last_decode_stats() const {
  std::lock_guard<std::mutex> lk(state_mu_);
  return decode_stats_;
}
StepStats Session::last_prefill_stats() const {
  std::lock_guard<std::mutex> lk(state_mu_);
  return prefill_stats_;
}
Session::LoopTransfers Session::last_generate_transfers() const {
  std::lock_guard<std::mutex> lk(state_mu_);
  return loop_transfers_;
}

size_t Session::state_bytes() const { return model_.state_bytes(st_.max_ctx, st_.kv_dtype); }

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
  Scratch fresh = model_.new_scratch(rows, logit_rows, st_.max_ctx);  // the old one stays on failure
  model_.free_scratch(sc);
  sc = fresh;
}

void Session::set_context(std::vector<int32_t> tokens, int32_t pending, bool has_logits, bool mtp_valid) {
  std::lock_guard<std::mutex> lk(state_mu_);
  tokens_ = std::move(tokens);
  pending_ = pending;
  has_logits_ = has_logits;
  mtp_valid_ = mtp_valid;
}

bool Session::mtp_rows_locked() {
  if (!model_.has_mtp()) return false;
  std::lock_guard<std::mutex> slk(state_mu_);
  if (mtp_valid_ && !model_.keep_mtp_rows()) mtp_valid_ = false;  // this forward's rows will be missing
  return mtp_valid_;
}

bool Session::mtp_cache_valid() const {
  std::lock_guard<std::mutex> slk(state_mu_);
  return model_.has_mtp() && mtp_valid_;
}

void Session::encode_decode(int s, bool at_zero, const StepState* in) {
  const StepState& src = in ? *in : st_.now();
  model_.encode_layers(st_, src, st_.other(), decode_sc_, st_.slot[s], 1, Phase::Decode);
  if (mtp_rows_locked()) model_.encode_mtp_rows(st_, src, st_.other(), decode_sc_, st_.slot[s], 1, at_zero);
  model_.encode_logits(decode_sc_, 0, 1, st_.other().logits);
}

// One decode step of `token` (the current state set to the other, which becomes current); `was_pending`:
// the token is the pending one (the context shows it once throughout). Model lock held.
void Session::decode_one_locked(int32_t token, bool was_pending) {
  ops_.upload(st_.slot[0], &token);
  // With a restore owed, this step also copies it and reads the snapshot: not one to memoise or replay (CUDA would
  // capture a graph used once).
  Step step(ops_, Phase::Decode, false, restoring_ != nullptr || zeroing_);
  const StepState& src = restore_source_locked();  // an owed restore: read from the snapshot in this step
  encode_decode(0, tokens_.empty(), &src);  // tokens_ changes only under busy_, which the caller holds
  const StepStats stats = ops_.stats();
  ops_.wait(step.submit());
  commit_restore_locked();
  std::lock_guard<std::mutex> lk(state_mu_);
  decode_stats_ = stats;
  tokens_.push_back(token);
  if (was_pending) pending_ = -1;
  st_.cur = 1 - st_.cur;
  has_logits_ = true;
}

int32_t Session::take_pending_locked() {
  std::lock_guard<std::mutex> lk(state_mu_);
  // Every forward of the calling API writes KV rows from here on: they no longer equal any segment's.
  const int64_t from = int64_t(tokens_.size());
  kv_held_.erase(std::remove_if(kv_held_.begin(), kv_held_.end(),
                                [from](const HeldSegment& h) { return h.end > from || h.seg.expired(); }),
                 kv_held_.end());
  return pending_;
}

void Session::feed_pending_locked() {
  const int32_t t = take_pending_locked();
  if (t < 0) return;
  flush_deferred_locked();  // after this step the next forward writes the set a deferred state is owed from
  decode_one_locked(t, true);
}

// Model lock held. Uploads chunk row 0 = lead (a pending token, when lead >= 0) then the T - (lead >= 0) ids.
void Session::upload_chunk_ids_locked(Scratch& sc, int32_t lead, const int32_t* ids, int64_t T) {
  if (lead < 0) {
    ops_.upload(sc.ids.rows_view(0, T), ids);
    return;
  }
  std::vector<int32_t> rows(static_cast<size_t>(T));
  rows[0] = lead;
  std::copy(ids, ids + (T - 1), rows.begin() + 1);
  ops_.upload(sc.ids.rows_view(0, T), rows.data());
}

// State lock held. A fed chunk joins the context: its pending row (lead >= 0; then no longer pending, and lead is
// cleared for the next chunk) and its n ids.
void Session::append_chunk_tokens_locked(int32_t& lead, const int32_t* ids, int64_t n) {
  if (lead >= 0) {
    tokens_.push_back(lead);
    pending_ = lead = -1;
  }
  tokens_.insert(tokens_.end(), ids, ids + n);
  has_logits_ = true;
}

bool Session::holds_locked(const KvSegment* seg) const {
  for (const HeldSegment& h : kv_held_)
    if (h.raw == seg && !h.seg.expired()) return true;  // alive, so no other segment has its address
  return false;
}

void Session::hold_locked(const std::shared_ptr<const KvSegment>& seg) {
  if (seg && !holds_locked(seg.get())) kv_held_.push_back({seg, seg.get(), seg->begin, seg->end});
}

int64_t Session::held_kv_rows() const {
  std::lock_guard<std::mutex> lk(model_lock_);
  // The longest run from row 0: segments chain from begin 0 upwards.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const HeldSegment& h : kv_held_)
    if (!h.seg.expired()) spans.emplace_back(h.begin, h.end);  // never lock(): see HeldSegment
  std::sort(spans.begin(), spans.end());
  int64_t rows = 0;
  for (const auto& [b, e] : spans)
    if (b <= rows) rows = std::max(rows, e);
  return rows;
}

// What every prefill checks first: tokens to feed, valid ids, room in the context.
void Session::check_prefill(const int32_t* ids, int64_t n) const {
  if (n <= 0) throw std::invalid_argument("prefill needs at least one token");
  check_ids(ids, n);
  if (position() + n > st_.max_ctx)
    throw ContextOverflow("prefill of " + std::to_string(n) + " tokens at position " + std::to_string(position()) +
                          " exceeds max_context " + std::to_string(st_.max_ctx));
}

int64_t Session::prefill(const int32_t* ids, int64_t n, bool all_logits, float* out,
                         const std::function<bool(int64_t, int64_t)>& progress) {
  BusyGuard busy(busy_);
  check_prefill(ids, n);
  const int64_t vocab = model_.config().vocab;
  // A pending token (the last one a generate call delivered, or a restored snapshot's) is the first chunk's row 0:
  // no decode step of its own before the chunk (a whole forward: every weight read once for one token).
  int32_t lead;
  {
    std::lock_guard<std::mutex> lk(model_lock_);
    flush_deferred_locked();
    lead = take_pending_locked();
    // Logits rows come in blocks of up to 16 to bound the [rows, vocab] scratch. Every prefill asks for the 16 that
    // all_logits and prefill_snapshots use, so a kept session state serves either without growing: a scratch grows
    // whole (on CUDA ~30 allocations, each an alloc, a memset and a sync: ~0.2 ms of a warm turn on the H200).
    ensure_scratch(prefill_sc_, std::min(chunk_, n + (lead >= 0)), std::min<int64_t>(16, chunk_));
  }
  int64_t done = 0;
  while (done < n) {
    const int64_t L = lead >= 0 ? 1 : 0;                // rows before the ids: the pending token, first chunk only
    const int64_t T = std::min(chunk_, n - done + L);  // rows of this chunk (with prefill_chunk 1, the pending alone)
    {
      std::lock_guard<std::mutex> lk(model_lock_);
      Scratch& sc = prefill_sc_;
      upload_chunk_ids_locked(sc, L ? lead : -1, ids + done, T);
      StepStats stats;
      {
        Step step(ops_, Phase::Prefill);
        const StepState& src = restore_source_locked();  // an owed restore: the first chunk reads the snapshot
        model_.encode_layers(st_, src, st_.now(), sc, sc.ids, T, Phase::Prefill);
        if (mtp_rows_locked()) model_.encode_mtp_rows(st_, src, st_.now(), sc, sc.ids, T, tokens_.empty());
        stats = ops_.stats();
        // Every chunk computes its last row's logits, so a cancelled prefill still has valid ones.
        if (!all_logits) model_.encode_logits(sc, T - 1, 1, st_.now().logits);
        ops_.wait(step.submit());
        commit_restore_locked();
      }
      for (int64_t r0 = L; all_logits && r0 < T; r0 += sc.logit_rows) {  // the ids' rows (not the pending one's)
        const int64_t nb = std::min(sc.logit_rows, T - r0);
        const Tensor rows = sc.logits.rows_view(0, nb);
        Step step(ops_, Phase::Prefill);
        model_.encode_logits(sc, r0, nb, rows);
        if (r0 + nb == T) ops_.copy(rows.rows_view(nb - 1, 1), st_.now().logits);
        ops_.wait(step.submit());
        ops_.download(rows, out + (done + r0 - L) * vocab);
      }
      std::lock_guard<std::mutex> slk(state_mu_);
      prefill_stats_ = stats;
      append_chunk_tokens_locked(lead, ids + done, T - L);
    }
    done += T - L;
    if (progress && !progress(done, n) && done < n) break;  // cancelled between chunks
  }
  if (!all_logits) {
    std::lock_guard<std::mutex> lk(model_lock_);
    ops_.download(st_.now().logits, out);
  }
  return done;
}

void Session::step(int32_t token, float* out) {
  BusyGuard busy(busy_);
  check_ids(&token, 1);
  if (position() + 1 > st_.max_ctx)
    throw ContextOverflow("step at position " + std::to_string(position()) + " exceeds max_context " +
                          std::to_string(st_.max_ctx));
  std::lock_guard<std::mutex> lk(model_lock_);
  flush_deferred_locked();
  feed_pending_locked();
  decode_one_locked(token, false);
  ops_.download(st_.now().logits, out);
}

void Session::logits(float* out) {
  BusyGuard busy(busy_);
  std::lock_guard<std::mutex> lk(model_lock_);
  flush_deferred_locked();
  feed_pending_locked();
  write_restore_locked();  // the snapshot's logits, when no token was pending
  {
    std::lock_guard<std::mutex> slk(state_mu_);
    if (!has_logits_) throw std::logic_error("no logits yet: the session's context is empty");
  }
  ops_.download(st_.now().logits, out);
}

// Model lock held. Feeds a pending token and returns the context a generate call continues.
std::vector<int32_t> Session::generate_context_locked() {
  feed_pending_locked();
  write_restore_locked();  // the sampler reads the logits, drafts the state
  std::lock_guard<std::mutex> slk(state_mu_);
  if (!has_logits_) throw std::logic_error("generate needs a prefilled context");
  return tokens_;
}

// Model lock held. The call's sampler state (seeded rng, the context's seen mask, zeroed counts and ring), then
// its first id sampled from the logits already computed into first_id, as one decode step; returns its fence.
uint64_t Session::start_sampler_locked(const SamplingParams& params, const std::vector<int32_t>& context,
                                       const Tensor& ws, const Tensor& first_id) {
  const uint64_t seed = params.has_seed ? params.seed : std::random_device{}();
  ops_.upload(st_.sampler.rng, sampler_rng_words(seed).data());
  ops_.upload(st_.sampler.seen, sampler_seen_mask(context, model_.config().vocab).data());
  // Once per call, not a decode step: a backend neither replays it nor counts it in its decode-step figures.
  Step step(ops_, Phase::Decode, false, true);
  ops_.fill(st_.sampler.counts, 0);
  ops_.fill(st_.sampler.ring_count, 0);
  ops_.sample(st_.now().logits, st_.sampler, params, ws, first_id);
  return step.submit();
}

std::string Session::generate(int64_t max_tokens, const SamplingParams& params, const std::vector<int32_t>& stop_ids,
                              const std::function<int(int32_t, const float*)>& on_token, bool with_logits) {
  BusyGuard busy(busy_);
  if (max_tokens < 0) throw std::invalid_argument("max_tokens must be >= 0");
  params.validate();
  // A deferred checkpoint is written after the first token at the latest (plain_loop), also when the call
  // stops at the first token, is cancelled or raises.
  const AtExit settle([this] { settle_quietly(); });
  uint64_t fence = 0;
  int64_t P = 0;
  {
    std::lock_guard<std::mutex> lk(model_lock_);
    const std::vector<int32_t> context = generate_context_locked();
    P = int64_t(context.size());
    if (max_tokens == 0) return "length";
    if (P >= st_.max_ctx) return "context";
    fence = start_sampler_locked(params, context, decode_sc_.ws, st_.slot[0]);
    std::lock_guard<std::mutex> slk(state_mu_);
    mtp_stats_ = {};  // this call drafts nothing
  }
  return plain_loop(max_tokens, params, stop_ids, on_token, with_logits, P, fence, false);
}

std::string Session::plain_loop(int64_t max_tokens, const SamplingParams& params, const std::vector<int32_t>& stop_ids,
                                const std::function<int(int32_t, const float*)>& on_token, bool with_logits, int64_t P,
                                uint64_t fence, bool first_delivered) {
  const int64_t vocab = model_.config().vocab;
  const Ops::Transfers before = ops_.transfers();
  int64_t steps = 0;
  std::vector<float> row(with_logits ? size_t(vocab) : 0);
  auto account = [&] {
    const Ops::Transfers& now = ops_.transfers();
    std::lock_guard<std::mutex> slk(state_mu_);
    loop_transfers_ = {steps, now.uploads - before.uploads, now.downloads - before.downloads,
                       now.download_bytes - before.download_bytes};
  };
  // Iteration k leaves id k in slot[k % 2]; iteration k + 1 feeds it and samples id k + 1 into the other
  // slot. It is submitted before id k is read, so the device never waits for the host. When id k ends
  // the call, iteration k + 1 has only fed id k (which the caller has seen): its sample is discarded.
  for (int64_t k = 0;; ++k) {
    const bool next = k + 1 < max_tokens && P + k + 1 < st_.max_ctx;
    uint64_t next_fence = 0;
    int32_t id;
    {
      std::lock_guard<std::mutex> lk(model_lock_);
      // Iteration 0 writes the other state set; iteration 1 writes the set a deferred end-of-prompt checkpoint
      // reads, so it is written first, after the first token is out.
      if (k == 1) flush_deferred_locked();
      if (next) {
        Step step(ops_, Phase::Decode);
        encode_decode(int(k % 2));
        const StepStats stats = ops_.stats();
        ops_.sample(st_.other().logits, st_.sampler, params, decode_sc_.ws, st_.slot[(k + 1) % 2]);
        next_fence = step.submit();
        std::lock_guard<std::mutex> slk(state_mu_);
        decode_stats_ = stats;
      }
      ops_.wait(fence);
      ops_.download(st_.slot[k % 2], &id);
      // Id k was sampled from the current set's logits; the submitted iteration only writes the other set.
      if (with_logits) ops_.download(st_.now().logits, row.data());
      ++steps;
    }
    account();
    // Whether the caller received id k (1: yes, go on; 0: yes, stop; -1: no, it was interrupted first).
    const int delivered = k == 0 && first_delivered ? 1 : on_token(id, with_logits ? row.data() : nullptr);
    if (delivered < 0) {
      if (next) {  // iteration k + 1 fed id k into the other state set: not switching undoes it
        std::lock_guard<std::mutex> lk(model_lock_);
        ops_.wait(next_fence);
      }
      return "cancelled";
    }
    {
      std::lock_guard<std::mutex> slk(state_mu_);
      if (next) {
        tokens_.push_back(id);  // fed by the submitted iteration, whose state becomes the session's
        st_.cur = 1 - st_.cur;
        if (k == 0 && first_delivered) pending_ = -1;  // it was the pending token
      } else {
        pending_ = id;  // fed lazily: a final token costs no forward unless the context continues
      }
    }
    const bool stop = std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end();
    if (stop || delivered == 0 || !next) {
      if (next) {
        std::lock_guard<std::mutex> lk(model_lock_);
        ops_.wait(next_fence);
      }
      if (stop) return "stop";
      if (delivered == 0) return "cancelled";
      return k + 1 >= max_tokens ? "length" : "context";
    }
    fence = next_fence;
  }
}

// ---- MTP speculative decoding ----

std::pair<int, double> MtpPolicy::choose(double alpha, int max_k) const {
  alpha = std::min(std::max(alpha, 0.0), 0.999);
  std::pair<int, double> best{0, 1.0};
  double yield = 1, p = 1;  // expected tokens of an iteration with k drafts: 1 + a + ... + a^k
  for (int k = 1; k <= std::min(max_k, 4); ++k) {
    p *= alpha;
    yield += p;
    if (cost[k] > 0 && yield / cost[k] > best.second) best = {k, yield / cost[k]};
  }
  return best;
}

MtpStats Session::last_mtp_stats() const {
  std::lock_guard<std::mutex> lk(state_mu_);
  return mtp_stats_;
}

void Session::set_draft_override(int64_t start, std::vector<int32_t> ids) {
  BusyGuard busy(busy_);
  check_ids(ids.data(), int64_t(ids.size()));
  draft_override_ = std::move(ids);
  draft_override_start_ = start;
}

std::vector<float> Session::draft_logits(int32_t token, int k) {
  BusyGuard busy(busy_);
  if (k < 1 || k > kMaxMtpK)
    throw std::invalid_argument("k must be in 1.." + std::to_string(kMaxMtpK) + ", got " + std::to_string(k));
  if (!model_.has_mtp()) throw std::invalid_argument("draft_logits needs an MTP head, and this checkpoint has none");
  check_ids(&token, 1);
  const int64_t vocab = model_.config().vocab;
  std::vector<float> out(size_t(k * vocab));
  std::lock_guard<std::mutex> lk(model_lock_);
  flush_deferred_locked();
  feed_pending_locked();
  write_restore_locked();
  int64_t P = 0;
  {
    std::lock_guard<std::mutex> slk(state_mu_);
    P = int64_t(tokens_.size());
  }
  if (P < 1) throw std::invalid_argument("draft_logits needs at least one token in the context");
  if (P - 1 + k > st_.max_ctx)  // draft j writes the block's KV row P - 1 + j
    throw std::invalid_argument("k=" + std::to_string(k) + " drafts at position " + std::to_string(P) +
                                " exceed max_context " + std::to_string(st_.max_ctx));
  ensure_spec_locked();
  Scratch& sc = spec_.parity[0].sc;
  ops_.upload(sc.ids.rows_view(0, 1), &token);
  {
    Step step(ops_, verify_phase(k));
    const Tensor rows = sc.logits.rows_view(0, k);
    encode_drafts_locked(sc, st_.now(), k, &rows);  // exactly generate_mtp's drafts (the phase included)
    ops_.wait(step.submit());
  }
  ops_.download(sc.logits.rows_view(0, k), out.data());
  return out;
}

// Drafts: draft j + 1 from (token j in sc.ids, h before it) at MTP position P - 1 + j (P = in.pos); the first h is
// the model's (in.mtp_h, after the last fed token), the next ones the block's own. Each draft's greedy id goes to
// ids row j + 1.
void Session::encode_drafts_locked(Scratch& sc, const StepState& in, int64_t k, const Tensor* logits_rows) {
  const SamplingParams greedy;
  for (int64_t j = 0; j < k; ++j) {
    const Tensor row = logits_rows ? logits_rows->rows_view(j, 1) : spec_.draft_logits;
    model_.encode_mtp_draft(st_, sc, sc.ids.rows_view(j, 1), j == 0 ? in.mtp_h : sc.mtp_draft_h, in.pos, j - 1, row);
    ops_.sample(row, spec_.draft_sampler, greedy, sc.ws, sc.ids.rows_view(j + 1, 1));
  }
}

void Session::ensure_spec_locked() {
  if (spec_.ready) return;
  const ModelConfig& c = model_.config();
  const int64_t rows = kMaxMtpK + 1;
  Spec sp;
  try {
    sp.draft_logits = ops_.alloc("mtp_draft_logits", DType::F32, 1, c.vocab);
    sp.draft_sampler.counts = ops_.alloc("mtp_draft_counts", DType::I32, 1, c.vocab);
    sp.draft_sampler.seen = ops_.alloc("mtp_draft_seen", DType::I32, 1, c.vocab);
    sp.draft_sampler.rng = ops_.alloc("mtp_draft_rng", DType::I32, 1, SamplerState::kRngWords);
    sp.draft_sampler.ring = ops_.alloc("mtp_draft_ring", DType::I32, 64, 1);
    sp.draft_sampler.ring_count = ops_.alloc("mtp_draft_ring_count", DType::I32, 1, 1);
    for (Spec::Parity& q : sp.parity) {
      q.sc = model_.new_scratch(rows, rows, st_.max_ctx);
      q.y = ops_.alloc("mtp_verify_ids", DType::I32, rows, 1);
      q.accepted = ops_.alloc("mtp_accepted", DType::I32, 1, 1);
      q.counts = ops_.alloc("mtp_counts_after_row", DType::I32, kMaxMtpK, c.vocab);
      q.seen = ops_.alloc("mtp_seen_after_row", DType::I32, kMaxMtpK, c.vocab);
      q.rng = ops_.alloc("mtp_rng_after_row", DType::I32, kMaxMtpK, SamplerState::kRngWords);
      q.conv.resize(size_t(c.layers));
      q.recurrent.resize(size_t(c.layers));
      for (size_t li = 0; li < size_t(c.layers); ++li) {
        if (c.full_attention[li]) continue;
        const Tensor& cs = st_.now().conv[li];
        const Tensor& rs = st_.now().recurrent[li];
        q.conv[li] = ops_.alloc("mtp_conv_after_row", DType::F32, kMaxMtpK * cs.rows, cs.cols);
        q.recurrent[li] = ops_.alloc("mtp_recurrent_after_row", DType::F32, kMaxMtpK * rs.rows, rs.cols);
      }
    }
  } catch (...) {
    std::swap(spec_, sp);
    free_spec_locked();
    throw;
  }
  sp.ready = true;
  spec_ = std::move(sp);
}

void Session::free_spec_locked() {
  for (Tensor* t : {&spec_.draft_logits, &spec_.draft_sampler.counts, &spec_.draft_sampler.seen,
                    &spec_.draft_sampler.rng, &spec_.draft_sampler.ring, &spec_.draft_sampler.ring_count})
    ops_.release(*t);
  for (Spec::Parity& q : spec_.parity) {
    model_.free_scratch(q.sc);
    for (Tensor* t : {&q.y, &q.accepted, &q.counts, &q.seen, &q.rng}) ops_.release(*t);
    for (auto* v : {&q.conv, &q.recurrent})
      for (Tensor& t : *v) ops_.release(t);
  }
  spec_.ready = false;
}

// Iteration n of generate_mtp on parity p = n % 2: k drafts from the pending token (in sc.ids row 0), the verify
// forward of the pending token and the drafts from state set `in` into set 1 - in, a token y_j for every row, and
// the accept decision with the rollback to the state after the last accepted row, all on the device: the next
// iteration's pending token goes to the other parity's ids row 0, so it can be queued behind this one before the
// host has read anything (pipelined like generate()).
uint64_t Session::submit_spec_locked(int64_t k, int p, int in, bool at_zero, bool injected,
                                     const SamplingParams& params, bool penalties, StepStats& stats) {
  const ModelConfig& c = model_.config();
  Spec::Parity& q = spec_.parity[p];
  Scratch& sc = q.sc;
  const StepState& src = st_.sets[in];
  const StepState& dst = st_.sets[1 - in];
  const int64_t T = k + 1;
  ChunkCapture cap;  // the DeltaNet state after rows 0 .. k-1 (after row k: the forward's output set)
  cap.first = 0;
  cap.count = k;
  cap.conv.resize(size_t(c.layers));
  cap.recurrent.resize(size_t(c.layers));
  for (size_t li = 0; li < size_t(c.layers); ++li) {
    if (c.full_attention[li]) continue;
    cap.conv[li] = q.conv[li].rows_view(0, k * src.conv[li].rows);
    cap.recurrent[li] = q.recurrent[li].rows_view(0, k * src.recurrent[li].rows);
  }
  const Phase phase = verify_phase(k);
  Step step(ops_, phase, true);  // the same launches for the same k, parity and state set
  ops_.mark_speculative();
  if (!injected) encode_drafts_locked(sc, src, k, nullptr);
  model_.encode_layers(st_, src, dst, sc, sc.ids, T, phase, k > 0 ? &cap : nullptr);
  model_.encode_mtp_rows(st_, src, dst, sc, sc.ids, T, at_zero);
  stats = ops_.stats();
  const Tensor logits = sc.logits.rows_view(0, T);
  model_.encode_logits(sc, 0, T, logits);
  // Greedy without penalties: the rows do not depend on each other, one op (a GPU takes them in one pass). Else row
  // by row, keeping the penalty counts and the rng after each row for the rollback.
  if (params.greedy() && !penalties) {
    ops_.sample(logits, st_.sampler, params, sc.ws, q.y.rows_view(0, T));
  } else {
    for (int64_t j = 0; j < T; ++j) {
      ops_.sample(logits.rows_view(j, 1), st_.sampler, params, sc.ws, q.y.rows_view(j, 1));
      if (penalties && j < k) {
        ops_.copy(st_.sampler.counts, q.counts.rows_view(j, 1));
        ops_.copy(st_.sampler.seen, q.seen.rows_view(j, 1));
      }
      if (!params.greedy() && j < k) ops_.copy(st_.sampler.rng, q.rng.rows_view(j, 1));
    }
  }
  // a = accepted drafts; the state, position, logits, hidden and sampler become those after row a. Row k's are
  // already in place (the forward wrote them), so a block past the captured rows copies nothing.
  const Spec::Parity& next = spec_.parity[1 - p];
  ops_.accept_drafts(sc.ids.rows_view(0, T), q.y.rows_view(0, T), src.pos, q.accepted, next.sc.ids.rows_view(0, 1),
                     dst.pos);
  encode_state_at_row_locked(q, k, dst);
  if (k > 0) {
    if (penalties) {
      ops_.copy_rows_at(q.counts.rows_view(0, k), q.accepted, 0, st_.sampler.counts);
      ops_.copy_rows_at(q.seen.rows_view(0, k), q.accepted, 0, st_.sampler.seen);
    }
    if (!params.greedy()) ops_.copy_rows_at(q.rng.rows_view(0, k), q.accepted, 0, st_.sampler.rng);
  }
  return step.submit();
}

// Into the open step: dst's logits (row j of the iteration's), and with drafts its conv/recurrent state (the
// capture's slice j) and MTP hidden (mtp_hn row j + 1), j = q.accepted[0]. Row k's state and hidden are what the
// forward already wrote into dst, so for j = k only the logits move (the slices lie past the capture).
void Session::encode_state_at_row_locked(const Spec::Parity& q, int64_t k, const StepState& dst) {
  const ModelConfig& c = model_.config();
  ops_.copy_rows_at(q.sc.logits.rows_view(0, k + 1), q.accepted, 0, dst.logits);  // the forward leaves them there
  if (k == 0) return;
  for (size_t li = 0; li < size_t(c.layers); ++li) {
    if (c.full_attention[li]) continue;
    ops_.copy_rows_at(q.conv[li].rows_view(0, k * dst.conv[li].rows), q.accepted, 0, dst.conv[li]);
    ops_.copy_rows_at(q.recurrent[li].rows_view(0, k * dst.recurrent[li].rows), q.accepted, 0, dst.recurrent[li]);
  }
  ops_.copy_rows_at(q.sc.mtp_hn.rows_view(0, k + 2), q.accepted, 1, dst.mtp_h);  // row j + 1: h after token j
}

// Why the output is the model's, token for token (greedy) and in distribution (sampling): verify row j holds the
// logits after the context plus drafts 1..j, and its token y_j is drawn by the same sample op with the same
// parameters generate() uses. Row j's token is kept only while drafts 1..j equal y_0..y_{j-1}, i.e. while row j's
// context is the one generate() would have had; its penalty state then is too (the sampler counted y_0..y_{j-1},
// which are the drafts). So each kept token is distributed as p(· | context) after every transform of the
// sampler. This is speculative sampling (accept x with min(1, p(x)/q(x)), else draw from norm(max(p - q, 0)))
// for a greedy drafter: q is one-hot at the draft d, so d is accepted with probability p(d), and a rejection draws
// from p with d removed, renormalised, which is p conditioned on y != d: exactly what "draw y ~ p, accept iff
// y == d, else emit y" does. Rows after the first mismatch are discarded, and so are their draws: the rng and the
// counts are rolled back to their state after the last kept row. So the n-th generated token always takes the
// n-th number of the seeded stream, as in generate(): seeded output does not depend on k or on whether the call
// drafts at all (a draw discarded with its row is independent of the choice to discard it: no bias).
//
// The pipeline: iteration n + 1 is queued before iteration n is read whenever it is safe whatever n accepts (it
// cannot pass max_context, n cannot end the call by max_tokens, drafts are not injected, and the policy wants
// drafts). It reads n's output set and writes n's input set, on the other parity's scratch and captures, so n's
// results stay readable. When the caller keeps fewer of n's tokens than n accepted (a stop token, a cancel),
// n + 1 is waited for and dropped, and n's output set is rolled back to the kept row from n's captures.
std::string Session::generate_mtp(int64_t max_tokens, const SamplingParams& params,
                                  const std::vector<int32_t>& stop_ids,
                                  const std::function<int(int32_t, const float*)>& on_token, bool with_logits,
                                  int mtp_k, const MtpPolicy* policy, const OnTokens* on_tokens) {
  BusyGuard busy(busy_);
  if (mtp_k < 1 || mtp_k > kMaxMtpK)
    throw std::invalid_argument("mtp_k must be in 1.." + std::to_string(kMaxMtpK) + ", got " + std::to_string(mtp_k));
  if (!model_.has_mtp()) throw std::invalid_argument("mtp='on' needs an MTP head, and this checkpoint has none");
  if (!model_.keep_mtp_rows())
    throw std::invalid_argument("mtp: the engine does not keep the MTP block's cache (its mtp policy is 'off', or "
                                "'auto' decided against drafting): load it with mtp='on' to draft");
  if (!mtp_cache_valid())
    throw std::invalid_argument("mtp: this session's MTP block cache does not cover its context (tokens were fed "
                                "while the engine did not keep it); draft in a new or reset session");
  if (max_tokens < 0) throw std::invalid_argument("max_tokens must be >= 0");
  params.validate();
  const AtExit settle([this] { settle_quietly(); });  // as generate()
  const ModelConfig& c = model_.config();
  const int64_t vocab = c.vocab;
  const bool penalties =
      params.repetition_penalty != 1.f || params.presence_penalty != 0.f || params.frequency_penalty != 0.f;
  Spec& sp = spec_;
  int32_t x = -1;  // the pending token: delivered, its row not yet fed
  int64_t P = 0;   // tokens fed
  {
    std::lock_guard<std::mutex> lk(model_lock_);
    const std::vector<int32_t> context = generate_context_locked();
    {
      std::lock_guard<std::mutex> slk(state_mu_);
      mtp_stats_ = {};
    }
    P = int64_t(context.size());
    if (max_tokens == 0) return "length";
    if (P >= st_.max_ctx) return "context";
    ensure_spec_locked();
    const Tensor first = sp.parity[0].y.rows_view(0, 1);
    ops_.wait(start_sampler_locked(params, context, sp.parity[0].sc.ws, first));
    ops_.download(first, &x);
  }
  const Ops::Transfers before = ops_.transfers();
  int64_t forwards = 0;
  auto account = [&] {  // generate_transfers(): per verify forward two downloads (a, the tokens), uploads only
                        // where nothing was queued to put the pending token on the device
    const Ops::Transfers& now = ops_.transfers();
    std::lock_guard<std::mutex> slk(state_mu_);
    loop_transfers_ = {forwards, now.uploads - before.uploads, now.downloads - before.downloads,
                       now.download_bytes - before.download_bytes};
  };
  std::vector<float> rows(with_logits ? size_t((kMaxMtpK + 1) * vocab) : 0);
  if (with_logits) {
    std::lock_guard<std::mutex> lk(model_lock_);
    ops_.download(st_.now().logits, rows.data());
  }
  const int first = on_token(x, with_logits ? rows.data() : nullptr);
  {  // the first token is out: a deferred checkpoint now, before any verify forward writes the state
    std::lock_guard<std::mutex> lk(model_lock_);
    flush_deferred_locked();
  }
  if (first < 0) return "cancelled";
  {
    std::lock_guard<std::mutex> slk(state_mu_);
    pending_ = x;  // received: in the context, fed by the first verify forward
  }
  int64_t delivered = 1;
  auto is_stop = [&](int32_t t) { return std::find(stop_ids.begin(), stop_ids.end(), t) != stop_ids.end(); };
  if (is_stop(x)) return "stop";
  if (first == 0) return "cancelled";
  const bool injected = !draft_override_.empty();  // tests: drafts from a list, by context position (not queued)

  // The k for an iteration that may yield up to `remaining` tokens with `room` rows of context left (0: a
  // one-row forward, the limits leave no room for drafts; -1: the policy stops drafting).
  auto plan = [&](int64_t remaining, int64_t room) -> int64_t {
    int64_t k = std::min<int64_t>({mtp_k, remaining - 1, room - 1});
    if (!policy || k <= 0) return std::max<int64_t>(k, 0);
    MtpStats so_far;
    {
      std::lock_guard<std::mutex> slk(state_mu_);
      so_far = mtp_stats_;
    }
    const double alpha =
        (double(so_far.accepted) + policy->alpha0 * policy->weight) / (double(so_far.trials) + policy->weight);
    const int best = policy->choose(alpha, int(k)).first;
    return best > 0 ? best : -1;
  };
  struct Iter {
    int64_t k = 0;
    int p = 0, in = 0;  // parity, the state set it reads
    uint64_t fence = 0;
    StepStats stats;
    bool queued = false;  // submitted before the previous iteration was read
  };
  // Submits an iteration; with injected drafts (and only then) its ids come from the host: x and the drafts.
  auto submit = [&](int64_t k, int p, int in, bool upload_x, bool at_zero) {
    Iter it{k, p, in, 0, {}, false};
    std::lock_guard<std::mutex> lk(model_lock_);
    Scratch& sc = sp.parity[p].sc;
    if (injected) {  // the pending token and the drafts for context indexes P + 1 ..
      std::vector<int32_t> ids(size_t(k + 1));
      ids[0] = x;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = P + 1 + j - draft_override_start_;
        ids[size_t(j + 1)] = i >= 0 && i < int64_t(draft_override_.size()) ? draft_override_[size_t(i)] : 0;
      }
      ops_.upload(sc.ids.rows_view(0, k + 1), ids.data());
    } else if (upload_x) {
      ops_.upload(sc.ids.rows_view(0, 1), &x);
    }
    it.fence = submit_spec_locked(k, p, in, at_zero, injected && k > 0, params, penalties, it.stats);
    return it;
  };
  // Decodes the rest without drafting (the policy found that drafting no longer pays), pipelined like generate().
  auto plain = [&]() {
    {
      std::lock_guard<std::mutex> lk(model_lock_);
      ops_.upload(st_.slot[0], &x);
    }
    int64_t plain_tokens = 0;
    auto count = [&](int32_t t, const float* l) {
      const int answer = on_token(t, l);
      plain_tokens += answer >= 0;
      return answer;
    };
    const std::string why = plain_loop(max_tokens - delivered + 1, params, stop_ids, count, with_logits, P, 0, true);
    std::lock_guard<std::mutex> slk(state_mu_);
    mtp_stats_.plain_tokens = plain_tokens;
    return why;
  };

  Iter cur;
  {
    const int64_t remaining = max_tokens - delivered, room = st_.max_ctx - (P + 1);
    if (remaining <= 0) return "length";
    if (room <= 0) return "context";
    const int64_t k = plan(remaining, room);
    if (k < 0) return plain();
    cur = submit(k, 0, st_.cur, true, P == 0);
  }
  std::vector<int32_t> y(size_t(kMaxMtpK + 1));
  for (;;) {
    std::optional<Iter> next;
    if (!injected) {  // queue the next iteration if it is safe whatever this one accepts
      const int64_t remaining_min = max_tokens - (delivered + cur.k + 1), room_min = st_.max_ctx - (P + cur.k + 2);
      if (remaining_min >= 1 && room_min >= 1) {
        const int64_t k = plan(remaining_min, room_min);
        if (k > 0) {
          next = submit(k, 1 - cur.p, 1 - cur.in, false, false);
          next->queued = true;
        }
      }
    }
    const Spec::Parity& q = sp.parity[cur.p];
    const int64_t T = cur.k + 1;
    int32_t a = 0;
    {
      std::lock_guard<std::mutex> lk(model_lock_);
      ops_.wait(cur.fence);
      ops_.download(q.accepted, &a);
      if (a < 0 || a > cur.k)  // never index the tokens with a corrupt count
        throw std::runtime_error("generate_mtp: the device reported " + std::to_string(a) + " accepted drafts of " +
                                 std::to_string(cur.k));
      ops_.download(q.y.rows_view(0, T), y.data());
      if (with_logits) ops_.download(q.sc.logits.rows_view(0, T), rows.data());
      ++forwards;
      std::lock_guard<std::mutex> slk(state_mu_);
      decode_stats_ = cur.stats;
      mtp_stats_.steps += 1;
      mtp_stats_.drafted += cur.k;
      mtp_stats_.accepted += a;
      mtp_stats_.trials += a + (a < cur.k);  // compared drafts: the accepted ones and the first rejected one
      mtp_stats_.k_sum += cur.k;
      mtp_stats_.queued += cur.queued;
    }
    account();
    // Keeps rows 0 .. r of this iteration (the pending token and the tokens received but the last, which becomes
    // the pending one: y_0 .. y_{m-1} received) and makes them the session's; m == a + 1 keeps all it accepted.
    // When the call ends here, a queued iteration is waited for first (it reads this one's output set and writes
    // its input set) and dropped.
    auto keep = [&](int64_t m, bool ending) {
      const int64_t r = std::max<int64_t>(m, 1) - 1;
      std::lock_guard<std::mutex> lk(model_lock_);
      if (ending && next) ops_.wait(next->fence);
      if (r < a) {  // back from the state after row a to the one after row r: n's captures, n's scratch
        const StepState& out = st_.sets[1 - cur.in];
        const int32_t row = int32_t(r);
        ops_.upload(q.accepted, &row);  // read by the host already; the device's rollback, now to row r
        Step step(ops_, Phase::Prefill);
        encode_state_at_row_locked(q, cur.k, out);
        ops_.advance_position(out.pos, out.pos, r - a);
        ops_.wait(step.submit());  // the sampler is not rolled back: the call ends here
      }
      std::lock_guard<std::mutex> slk(state_mu_);
      st_.cur = 1 - cur.in;
      tokens_.push_back(x);
      tokens_.insert(tokens_.end(), y.begin(), y.begin() + r);
      pending_ = m > 0 ? y[size_t(m - 1)] : -1;
      has_logits_ = true;
    };
    // Hand over y_0 .. y_a (drafts 1..a, then the model's token after them): in one on_tokens call up to the
    // first stop token, or one on_token call at a time.
    int64_t m = 0;  // tokens the caller received
    int answer = 1;
    bool stop = false;
    try {
      if (on_tokens) {
        int64_t n = a + 1;
        for (int64_t i = 0; i < n; ++i)
          if (is_stop(y[size_t(i)])) n = i + 1;
        bool go_on = true;
        m = std::clamp<int64_t>((*on_tokens)(y.data(), n, with_logits ? rows.data() : nullptr, go_on), 0, n);
        delivered += m;
        stop = m > 0 && is_stop(y[size_t(m - 1)]);
        answer = m < n ? -1 : go_on ? 1 : 0;
      } else {
        for (int64_t i = 0; i <= a; ++i) {
          answer = on_token(y[size_t(i)], with_logits ? rows.data() + i * vocab : nullptr);
          if (answer < 0) break;
          ++m;
          ++delivered;
          stop = is_stop(y[size_t(i)]);
          if (stop || answer == 0) break;
        }
      }
    } catch (...) {  // the caller's exception: the tokens it received stay, as after a cancel
      keep(m, true);
      throw;
    }
    if (m < a + 1 || stop || answer <= 0) {
      keep(m, true);
      return stop ? "stop" : "cancelled";
    }
    keep(m, false);  // all of them: no rollback beyond the device's
    P += a + 1;
    x = y[size_t(a)];
    if (next) {
      cur = *next;
      continue;
    }
    const int64_t remaining = max_tokens - delivered, room = st_.max_ctx - (P + 1);
    if (remaining <= 0) return "length";
    if (room <= 0) return "context";
    const int64_t k = plan(remaining, room);
    if (k < 0) return plain();
    cur = submit(k, 1 - cur.p, st_.cur, injected, false);  // x is in that parity's ids row 0 (accept_drafts put it there)
  }
}

void Session::check_base(const DeviceSnapshot& base, const std::vector<int32_t>& tokens) const {
  if (base.backend() != &ops_) throw std::invalid_argument("snapshot: base is a snapshot of another engine");
  if (base.kv_dtype_ != st_.kv_dtype)
    throw std::invalid_argument(std::string("snapshot: base holds a ") + dtype_name(base.kv_dtype_) +
                                " KV cache, this session a " + dtype_name(st_.kv_dtype) + " one");
  if (base.position_ > int64_t(tokens.size()) || !std::equal(base.tokens_.begin(), base.tokens_.end(), tokens.begin()))
    throw std::invalid_argument("snapshot: base's " + std::to_string(base.position_) +
                                " tokens are not a prefix of this session's " + std::to_string(tokens.size()));
}

void Session::alloc_snapshot_locked(DeviceSnapshot& snap, KvSegment* seg, bool defer_state, bool defer_kv,
                                    bool from_reserve) {
  const ModelConfig& c = model_.config();
  // A deferred tensor is its shape only (no buffer: bytes() is right, valid() false) until flush_deferred_locked
  // allocates it: allocations (on CUDA an alloc, a memset and a sync each) leave the first-token path too.
  auto make = [&](bool defer, const char* label, DType dtype, int64_t rows, int64_t cols) {
    return defer ? Tensor::whole(-1, dtype, rows, cols) : ops_.alloc(label, dtype, rows, cols);
  };
  if (seg) {
    const int64_t n = seg->end - seg->begin;
    for (size_t i = 0; i < model_.kv_cache_count(); ++i) {
      seg->k.push_back(make(defer_kv, "snapshot_k", st_.kv_dtype, c.kv_heads * n, c.head_dim));
      seg->v.push_back(make(defer_kv, "snapshot_v", st_.kv_dtype, c.kv_heads * n, c.head_dim));
    }
  }
  if (from_reserve && reserve_ && !defer_state) {
    if (reserve_->ready) {  // the state tensors exist and are written: taken whole
      snap.conv_ = std::move(reserve_->conv);
      snap.recurrent_ = std::move(reserve_->recurrent);
      snap.logits_ = reserve_->logits;
      snap.mtp_h_ = reserve_->mtp_h;
      reserve_->conv.clear();
      reserve_->recurrent.clear();
      reserve_->logits = Tensor{};
      reserve_->mtp_h = Tensor{};
      reserve_->ready = false;
      ++reserve_->taken;
      took_reserve_ = true;
      return;
    }
    took_reserve_ = true;  // it was empty: this session fills it for the next checkpoint
  }
  for (size_t li = 0; li < size_t(c.layers); ++li) {
    if (c.full_attention[li]) continue;
    const StepState& now = st_.now();
    snap.conv_.push_back(make(defer_state, "snapshot_conv", DType::F32, now.conv[li].rows, now.conv[li].cols));
    snap.recurrent_.push_back(
        make(defer_state, "snapshot_recurrent", DType::F32, now.recurrent[li].rows, now.recurrent[li].cols));
  }
  snap.logits_ = make(defer_state, "snapshot_logits", DType::F32, 1, c.vocab);
  if (model_.has_mtp()) snap.mtp_h_ = make(defer_state, "snapshot_mtp_hidden", DType::F32, 1, c.hidden);
}

void Session::refill_reserve_locked() {
  if (!reserve_ || reserve_->ready) return;
  const ModelConfig& c = model_.config();
  CheckpointReserve& r = *reserve_;
  try {
    for (size_t li = 0; li < size_t(c.layers); ++li) {
      if (c.full_attention[li]) continue;
      const StepState& now = st_.now();
      r.conv.push_back(ops_.alloc("checkpoint_reserve_conv", DType::F32, now.conv[li].rows, now.conv[li].cols));
      r.recurrent.push_back(
          ops_.alloc("checkpoint_reserve_recurrent", DType::F32, now.recurrent[li].rows, now.recurrent[li].cols));
    }
    r.logits = ops_.alloc("checkpoint_reserve_logits", DType::F32, 1, c.vocab);
    if (model_.has_mtp()) r.mtp_h = ops_.alloc("checkpoint_reserve_mtp_hidden", DType::F32, 1, c.hidden);
    // Written once, so its pages exist (the CPU backend maps large buffers lazily; a capture would fault them in).
    Step step(ops_, Phase::Prefill);
    for (auto* v : {&r.conv, &r.recurrent})
      for (const Tensor& t : *v) ops_.fill(t, 0);
    ops_.fill(r.logits, 0);
    if (r.mtp_h.valid()) ops_.fill(r.mtp_h, 0);
    ops_.wait(step.submit());
  } catch (...) {
    r.release(ops_);  // out of memory, say: the next checkpoint allocates its own, as without a reserve
    throw;
  }
  r.ready = true;
  ++r.refilled;
}

void Session::materialize_locked(Tensor& t, const char* label) {
  if (t.valid()) return;
  const Tensor a = ops_.alloc(label, t.dtype, t.rows, t.cols);
  // Only the buffer fields: rows/cols/dtype (what bytes() reads, without the lock) never change.
  t.buf = a.buf;
  t.offset = a.offset;
  t.stride = a.stride;
}

void Session::encode_kv_copy(KvSegment& seg) {
  const ModelConfig& c = model_.config();
  const int64_t n = seg.end - seg.begin;
  size_t fi = 0;
  for (const auto& [kc, vc] : st_.kv_caches()) {
    // Only rows [begin, end) (the MTP block's one row earlier): rows before them are the parent's, which holds
    // the same tokens.
    const int64_t from = seg.row0(fi, size_t(c.n_full()));
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      ops_.copy(kc.rows_view(h * st_.max_ctx + from, n), seg.k[fi].rows_view(h * n, n));
      ops_.copy(vc.rows_view(h * st_.max_ctx + from, n), seg.v[fi].rows_view(h * n, n));
    }
    ++fi;
  }
}

std::unique_ptr<DeviceSnapshot> Session::snapshot(const DeviceSnapshot* base) {
  BusyGuard busy(busy_);
  // Declared before the engine lock is taken, so that on an exception they are destroyed after it is
  // released (their destructors take it).
  auto snap = std::make_unique<DeviceSnapshot>(model_, model_lock_);
  std::shared_ptr<KvSegment> seg;
  {
    std::lock_guard<std::mutex> slk(state_mu_);  // tokens_ changes only under busy_, which this call holds
    snap->position_ = int64_t(tokens_.size());
    snap->tokens_ = tokens_;
    snap->pending_ = pending_;
    snap->has_logits_ = has_logits_;
    snap->mtp_valid_ = mtp_valid_;
  }
  snap->kv_dtype_ = st_.kv_dtype;
  const int64_t pos = snap->position_;
  if (base) {
    check_base(*base, snap->tokens_);
    snap->kv_ = base->kv_;
    snap->base_position_ = base->position_;
  }
  const int64_t from = snap->base_position_;
  if (pos > from) {
    seg = std::make_shared<KvSegment>(model_, model_lock_);
    seg->parent = snap->kv_;
    seg->begin = from;
    seg->end = pos;
  }
  std::lock_guard<std::mutex> lk(model_lock_);
  flush_deferred_locked();
  write_restore_locked();
  alloc_snapshot_locked(*snap, seg.get());
  Step step(ops_, Phase::Prefill);
  if (seg) encode_kv_copy(*seg);
  encode_state_copy(st_.now(), *snap);
  ops_.wait(step.submit());
  if (seg) {
    snap->kv_ = std::move(seg);
    snap->owns_tail_ = true;
    hold_locked(snap->kv_);  // copied from the cache: the cache's rows are its rows
  }
  return snap;
}

std::vector<std::unique_ptr<DeviceSnapshot>> Session::prefill_snapshots(
    const int32_t* ids, int64_t n, const std::vector<int64_t>& at, const DeviceSnapshot* base,
    const std::function<bool(int64_t, int64_t)>& progress, bool defer) {
  BusyGuard busy(busy_);
  check_prefill(ids, n);
  const int64_t pos0 = position();  // a pending token, at pos0 - 1, is the first chunk's row 0
  for (size_t i = 0; i < at.size(); ++i)
    if (at[i] <= pos0 || at[i] > pos0 + n || (i > 0 && at[i] <= at[i - 1]))
      throw std::invalid_argument("prefill_snapshots: positions must ascend strictly within (" + std::to_string(pos0) +
                                  ", " + std::to_string(pos0 + n) + "], got " + std::to_string(at[i]) + " at index " +
                                  std::to_string(i));
  std::vector<int32_t> all = tokens();  // the context once every id is fed
  all.insert(all.end(), ids, ids + n);
  if (base && !at.empty()) check_base(*base, std::vector<int32_t>(all.begin(), all.begin() + at[0]));
  const ModelConfig& c = model_.config();
  // Declared before any engine lock: their destructors take it.
  std::vector<std::unique_ptr<DeviceSnapshot>> snaps;
  std::shared_ptr<const KvSegment> parent_kv = base ? base->kv_ : nullptr;  // the KV rows the next one shares
  int64_t parent_pos = base ? base->position_ : 0;
  int32_t lead;  // the pending token (as in prefill: row 0 of the first chunk, no decode step of its own)
  {
    std::lock_guard<std::mutex> lk(model_lock_);
    flush_deferred_locked();
    lead = take_pending_locked();
    // Up to 16 logits rows: a position's row and the chunk's last row in one lm_head pass.
    ensure_scratch(prefill_sc_, std::min(chunk_, n + (lead >= 0)), std::min<int64_t>(16, chunk_));
  }
  size_t next = 0;  // the first position in `at` not yet taken
  int64_t done = 0;  // ids fed
  while (done < n) {
    const int64_t L = lead >= 0 ? 1 : 0;         // rows before the ids: the pending token, first chunk only
    int64_t T = std::min(chunk_, n - done + L);  // rows of this chunk (with prefill_chunk 1, the pending alone)
    const int64_t c0 = pos0 + done - L;          // the context position of row 0
    int64_t inner = -1;  // a position strictly inside the chunk: captured after row inner - c0 - 1
    if (next < at.size() && at[next] < c0 + T) {
      inner = at[next];
      if (next + 1 < at.size() && at[next + 1] < c0 + T) T = at[next + 1] - c0;  // one capture per chunk
    }
    const size_t end_i = next + (inner >= 0);
    const bool at_end = end_i < at.size() && at[end_i] == c0 + T;  // a position at the chunk's end
    // The chunk's snapshots (inner first) and their KV segments, allocated under the lock below.
    std::vector<std::unique_ptr<DeviceSnapshot>> made;
    std::vector<std::shared_ptr<KvSegment>> segs;
    for (int64_t p : {inner, at_end ? at[end_i] : int64_t(-1)}) {
      if (p < 0) continue;
      auto snap = std::make_unique<DeviceSnapshot>(model_, model_lock_);
      snap->position_ = p;
      snap->tokens_.assign(all.begin(), all.begin() + p);
      snap->has_logits_ = true;
      snap->kv_dtype_ = st_.kv_dtype;
      snap->base_position_ = parent_pos;
      std::shared_ptr<KvSegment> seg;
      if (p > parent_pos) {
        seg = std::make_shared<KvSegment>(model_, model_lock_);
        seg->begin = parent_pos;
        seg->end = p;
      }
      parent_pos = p;
      made.push_back(std::move(snap));
      segs.push_back(std::move(seg));
    }
    {
      std::lock_guard<std::mutex> lk(model_lock_);
      Scratch& sc = prefill_sc_;
      // With defer: every segment's rows, and the end snapshot's state when this chunk ends the prefill, wait.
      const bool defer_end = defer && at_end && done + (T - L) == n;
      for (size_t i = 0; i < made.size(); ++i)  // an inner position's state goes into the engine's reserve
        alloc_snapshot_locked(*made[i], segs[i].get(), defer_end && i + 1 == made.size(), defer,
                              inner >= 0 && i == 0);
      ChunkCapture cap;
      if (inner >= 0) {
        cap.first = inner - c0 - 1;
        cap.count = 1;
        cap.conv.resize(size_t(c.layers));
        cap.recurrent.resize(size_t(c.layers));
        for (size_t li = 0, di = 0; li < size_t(c.layers); ++li) {
          if (c.full_attention[li]) continue;
          cap.conv[li] = made[0]->conv_[di];
          cap.recurrent[li] = made[0]->recurrent_[di];
          ++di;
        }
      }
      upload_chunk_ids_locked(sc, L ? lead : -1, ids + done, T);
      StepStats stats;
      {
        Step step(ops_, Phase::Prefill);
        const StepState& src = restore_source_locked();  // an owed restore: the first chunk reads the snapshot
        model_.encode_layers(st_, src, st_.now(), sc, sc.ids, T, Phase::Prefill, inner >= 0 ? &cap : nullptr);
        const bool rows = mtp_rows_locked();
        if (rows) model_.encode_mtp_rows(st_, src, st_.now(), sc, sc.ids, T, c0 == 0);
        for (auto& m : made) m->mtp_valid_ = rows;  // as the session's cache after this chunk
        if (rows && inner >= 0 && made[0]->mtp_h_.valid())  // h after the inner position's last token (row inner - c0 - 1)
          ops_.copy(sc.mtp_hn.rows_view(inner - c0, 1), made[0]->mtp_h_);
        stats = ops_.stats();
        const int64_t row = cap.first, nb = T - row;  // the inner position's logits row .. the last row
        if (inner >= 0 && nb <= sc.logit_rows) {
          const Tensor rows = sc.logits.rows_view(0, nb);
          model_.encode_logits(sc, row, nb, rows);
          ops_.copy(rows.rows_view(0, 1), made[0]->logits_);
          ops_.copy(rows.rows_view(nb - 1, 1), st_.now().logits);
        } else {
          if (inner >= 0) model_.encode_logits(sc, row, 1, made[0]->logits_);
          model_.encode_logits(sc, T - 1, 1, st_.now().logits);
        }
        for (size_t i = 0; i < made.size(); ++i) {
          if (!segs[i]) continue;
          if (defer) {  // rows below the position are never rewritten while the context grows
            segs[i]->deferred = this;
            deferred_kv_.push_back(segs[i].get());
          } else {
            encode_kv_copy(*segs[i]);
          }
        }
        if (at_end) {  // the state after the chunk's last row is the session's
          DeviceSnapshot& e = *made.back();
          if (defer_end) {  // the last chunk: its set is next written by the second decode step
            e.deferred_ = this;
            deferred_state_ = &e;
            deferred_set_ = st_.cur;
          } else {
            encode_state_copy(st_.now(), e);
          }
        }
        ops_.wait(step.submit());
        commit_restore_locked();
      }
      std::lock_guard<std::mutex> slk(state_mu_);
      prefill_stats_ = stats;
      append_chunk_tokens_locked(lead, ids + done, T - L);
    }
    for (size_t i = 0; i < made.size(); ++i) {  // in order: each one's rows sit on the previous one's
      made[i]->kv_ = parent_kv;
      if (segs[i]) {
        segs[i]->parent = parent_kv;
        made[i]->kv_ = std::move(segs[i]);
        made[i]->owns_tail_ = true;
        std::lock_guard<std::mutex> lk(model_lock_);
        hold_locked(made[i]->kv_);
      }
      parent_kv = made[i]->kv_;
      snaps.push_back(std::move(made[i]));
    }
    next = end_i + at_end;
    done += T - L;
    if (progress && !progress(done, n) && done < n) break;  // cancelled between chunks
  }
  return snaps;
}

void Session::encode_state_copy(StepState& set, DeviceSnapshot& snap) {
  const ModelConfig& c = model_.config();
  for (size_t li = 0, di = 0; li < size_t(c.layers); ++li) {
    if (c.full_attention[li]) continue;
    ops_.copy(set.conv[li], snap.conv_[di]);
    ops_.copy(set.recurrent[li], snap.recurrent_[di]);
    ++di;
  }
  ops_.copy(set.logits, snap.logits_);
  if (snap.mtp_h_.valid()) ops_.copy(set.mtp_h, snap.mtp_h_);
}

// ---- deferred checkpoints ----

void Session::flush_deferred_locked() {
  if (deferred_kv_.empty() && !deferred_state_) return;
  for (KvSegment* seg : deferred_kv_)  // allocations first: outside a step
    for (size_t i = 0; i < seg->k.size(); ++i) {
      materialize_locked(seg->k[i], "snapshot_k");
      materialize_locked(seg->v[i], "snapshot_v");
    }
  if (DeviceSnapshot* d = deferred_state_) {
    for (size_t i = 0; i < d->conv_.size(); ++i) {
      materialize_locked(d->conv_[i], "snapshot_conv");
      materialize_locked(d->recurrent_[i], "snapshot_recurrent");
    }
    materialize_locked(d->logits_, "snapshot_logits");
    if (d->mtp_h_.rows) materialize_locked(d->mtp_h_, "snapshot_mtp_hidden");
  }
  {
    Step step(ops_, Phase::Prefill);
    for (KvSegment* seg : deferred_kv_) encode_kv_copy(*seg);
    if (deferred_state_) encode_state_copy(st_.sets[deferred_set_], *deferred_state_);
    ops_.wait(step.submit());
  }
  // Marked written only once the step is done: on a failure they stay owed (and the next call retries).
  for (KvSegment* seg : deferred_kv_) seg->deferred = nullptr;
  deferred_kv_.clear();
  if (deferred_state_) deferred_state_->deferred_ = nullptr;
  deferred_state_ = nullptr;
}

void Session::settle_locked(const DeviceSnapshot& s) {
  if (s.deferred_) s.deferred_->flush_deferred_locked();
  for (const KvSegment* seg : chain(s.kv_))
    if (seg->deferred) seg->deferred->flush_deferred_locked();
}

void Session::settle_quietly() {
  try {
    std::lock_guard<std::mutex> lk(model_lock_);
    flush_deferred_locked();
    if (took_reserve_) {  // after the last token: the next checkpoint finds its tensors written
      took_reserve_ = false;
      refill_reserve_locked();
    }
  } catch (...) {  // left owed: the next call on the session, or a reader of the snapshot, retries
  }
}

int64_t Session::deferred_checkpoints() const {
  std::lock_guard<std::mutex> lk(model_lock_);
  return int64_t(deferred_kv_.size()) + (deferred_state_ != nullptr);
}

int64_t Session::held_kv_rows(const DeviceSnapshot& s) const {
  std::lock_guard<std::mutex> lk(model_lock_);
  int64_t rows = 0;
  for (const KvSegment* seg : chain(s.kv_))
    if (holds_locked(seg)) rows += seg->end - seg->begin;
  return rows;
}

void Session::check_restorable(int64_t position, int32_t pending, const std::vector<int32_t>& tokens) const {
  const int64_t need = position + (pending >= 0);
  if (need > st_.max_ctx)
    throw ContextOverflow("snapshot holds " + std::to_string(need) + " tokens, more than max_context " +
                          std::to_string(st_.max_ctx));
  if (int64_t(tokens.size()) != position) throw std::invalid_argument("snapshot: token count mismatch");
  check_ids(tokens.data(), int64_t(tokens.size()));
  if (pending >= 0) check_ids(&pending, 1);
}

void Session::restore_locked(const DeviceSnapshot& s) {
  flush_deferred_locked();  // what this session owes reads its state and KV rows, which the restore replaces
  settle_locked(s);         // and s may be owed by a session (this one or another)
  drop_restore_locked();    // a restore not written yet is replaced whole
  restore_lost_.clear();
  zeroing_ = false;
  restoring_ = &s;          // written by the next forward, or by whoever reads the state first
  s.readers_.push_back(this);
}

const StepState& Session::restore_source_locked() {
  if (!restore_lost_.empty()) throw std::runtime_error("this session's state is lost: " + restore_lost_);
  StepState& now = st_.now();
  const ModelConfig& c = model_.config();
  if (zeroing_) {
    for (size_t li = 0; li < size_t(c.layers); ++li) {
      if (c.full_attention[li]) continue;  // KV rows past the position are never read
      ops_.fill(now.conv[li], 0);
      ops_.fill(now.recurrent[li], 0);
    }
    ops_.fill(now.pos, 0);
    return now;
  }
  if (!restoring_) return now;
  const DeviceSnapshot& s = *restoring_;
  // Segments whose rows the cache already holds, bit for bit, are not copied again.
  std::vector<const KvSegment*> copy;
  for (const KvSegment* seg : chain(s.kv_))
    if (!holds_locked(seg)) copy.push_back(seg);
  size_t fi = 0;
  for (const auto& [kc, vc] : st_.kv_caches()) {
    for (const KvSegment* seg : copy) {  // rows [seg->begin, seg->end) of each head (KvSegment::row0)
      const int64_t n = seg->end - seg->begin, r0 = seg->row0(fi, size_t(c.n_full()));
      for (int64_t h = 0; h < c.kv_heads && n > 0; ++h) {
        ops_.copy(seg->k[fi].rows_view(h * n, n), kc.rows_view(h * st_.max_ctx + r0, n));
        ops_.copy(seg->v[fi].rows_view(h * n, n), vc.rows_view(h * st_.max_ctx + r0, n));
      }
    }
    ++fi;
  }
  ops_.fill(now.pos, double(s.position_));
  // The forward reads the snapshot's DeltaNet state and MTP input in place of the session's; it writes its own.
  StepState& src = restore_src_;
  src = now;
  for (size_t li = 0, di = 0; li < size_t(c.layers); ++li) {
    if (c.full_attention[li]) continue;
    src.conv[li] = s.conv_[di];
    src.recurrent[li] = s.recurrent_[di];
    ++di;
  }
  if (s.mtp_h_.valid() && now.mtp_h.valid()) src.mtp_h = s.mtp_h_;
  return src;
}

void Session::commit_restore_locked() {
  zeroing_ = false;
  if (!restoring_) return;
  const DeviceSnapshot& s = *restoring_;
  drop_restore_locked();
  kv_held_.clear();  // rows [0, position) are now the chain's (rows past it are never read before rewritten)
  for (std::shared_ptr<const KvSegment> seg = s.kv_; seg; seg = seg->parent) hold_locked(seg);
}

void Session::write_restore_locked() {
  if (!restoring_ && !zeroing_ && restore_lost_.empty()) return;
  const DeviceSnapshot* s = restoring_;
  {
    Step step(ops_, Phase::Prefill);
    const StepState& src = restore_source_locked();
    if (s) {  // the state the forward would have read, and the logits no forward recomputed
      const ModelConfig& c = model_.config();
      for (size_t li = 0; li < size_t(c.layers); ++li) {
        if (c.full_attention[li]) continue;
        ops_.copy(src.conv[li], st_.now().conv[li]);
        ops_.copy(src.recurrent[li], st_.now().recurrent[li]);
      }
      ops_.copy(s->logits_, st_.now().logits);
      if (src.mtp_h.buf != st_.now().mtp_h.buf) ops_.copy(src.mtp_h, st_.now().mtp_h);
    }
    ops_.wait(step.submit());
  }
  commit_restore_locked();
}

void Session::drop_restore_locked() {
  if (!restoring_) return;
  auto& r = restoring_->readers_;
  r.erase(std::remove(r.begin(), r.end(), this), r.end());
  restoring_ = nullptr;
}

bool Session::restore_pending() const {
  std::lock_guard<std::mutex> lk(model_lock_);
  return restoring_ != nullptr || zeroing_;
}

void Session::restore(const DeviceSnapshot& s) {
  if (s.backend() != &ops_) {  // another engine's snapshot: its tensors live in another backend
    restore(s.to_host());
    return;
  }
  BusyGuard busy(busy_);
  check_restorable(s.position_, s.pending_, s.tokens_);
  {
    std::lock_guard<std::mutex> lk(model_lock_);
    restore_locked(s);
  }
  set_context(s.tokens_, s.pending_, s.has_logits_, s.mtp_valid_);
}

void Session::restore(const HostSnapshot& s) {
  BusyGuard busy(busy_);
  const ModelConfig& c = model_.config();
  // Validate everything before touching the state, so a bad snapshot leaves the session as it was.
  check_restorable(s.position, s.pending, s.tokens);
  const size_t n_full = model_.kv_cache_count(), n_lin = size_t(c.n_linear());
  if (s.kv.size() != n_full || s.conv.size() != n_lin || s.recurrent.size() != n_lin)
    throw std::invalid_argument("snapshot: layer count does not match this model (" + std::to_string(n_full) +
                                " KV caches, the MTP block's included, and " + std::to_string(n_lin) +
                                " DeltaNet states expected)");
  const bool mtp_h = model_.has_mtp() && !s.logits.empty();  // the MTP block's input for the next token
  if (int64_t(s.mtp_h.size()) != (mtp_h ? c.hidden : 0))
    throw std::invalid_argument("snapshot: MTP hidden state size does not match this model");
  if (!s.logits.empty() && int64_t(s.logits.size()) != c.vocab)
    throw std::invalid_argument("snapshot: logits size does not match this model's vocabulary");
  for (auto& kv : s.kv)
    if (int64_t(kv.size()) != 2 * c.kv_heads * s.position * c.head_dim)
      throw std::invalid_argument("snapshot: KV cache size does not match this model");
  for (size_t i = 0; i < n_lin; ++i)
    if (int64_t(s.conv[i].size()) != (c.conv_kernel - 1) * c.conv_dim() ||
        int64_t(s.recurrent[i].size()) != c.lin_v_heads * c.lin_k_dim * c.lin_v_dim)
      throw std::invalid_argument("snapshot: recurrent state size does not match this model");

  // Stage the host copy in fp32 device tensors (one KV segment), then restore it like any snapshot.
  // Both are declared before the engine lock: their destructors take it.
  DeviceSnapshot d(model_, model_lock_);
  d.position_ = s.position;
  d.tokens_ = s.tokens;
  d.pending_ = s.pending;
  d.has_logits_ = !s.logits.empty();
  auto seg = s.position > 0 ? std::make_shared<KvSegment>(model_, model_lock_) : nullptr;
  {
    std::lock_guard<std::mutex> lk(model_lock_);
    const int64_t rows = c.kv_heads * s.position;
    for (const auto& kv : s.kv) {
      if (!seg) break;
      seg->end = s.position;
      seg->k.push_back(ops_.alloc("staged_k", DType::F32, rows, c.head_dim));
      seg->v.push_back(ops_.alloc("staged_v", DType::F32, rows, c.head_dim));
      ops_.upload(seg->k.back(), kv.data());
      ops_.upload(seg->v.back(), kv.data() + rows * c.head_dim);
    }
    d.kv_ = seg;
    for (size_t i = 0; i < n_lin; ++i) {
      d.conv_.push_back(ops_.alloc("staged_conv", DType::F32, c.conv_kernel - 1, c.conv_dim()));
      d.recurrent_.push_back(ops_.alloc("staged_recurrent", DType::F32, c.lin_v_heads * c.lin_k_dim, c.lin_v_dim));
      ops_.upload(d.conv_.back(), s.conv[i].data());
      ops_.upload(d.recurrent_.back(), s.recurrent[i].data());
    }
    d.logits_ = ops_.alloc("staged_logits", DType::F32, 1, c.vocab);
    if (d.has_logits_) ops_.upload(d.logits_, s.logits.data());
    if (mtp_h) {
      d.mtp_h_ = ops_.alloc("staged_mtp_hidden", DType::F32, 1, c.hidden);
      ops_.upload(d.mtp_h_, s.mtp_h.data());
    }
    restore_locked(d);
    try {
      write_restore_locked();  // the staged copy is freed when this call returns
    } catch (...) {
      drop_restore_locked();
      throw;
    }
  }
  set_context(s.tokens, s.pending, d.has_logits_, s.mtp_valid || s.position == 0);
}

void Session::reset() {
  BusyGuard busy(busy_);
  {
    std::lock_guard<std::mutex> lk(model_lock_);
    flush_deferred_locked();
    drop_restore_locked();
    restore_lost_.clear();
    zeroing_ = true;  // the zeros are written by the next forward's step (restore_source_locked)
  }
  set_context({}, -1, false, true);
}

}  // namespace lily
