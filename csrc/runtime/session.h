// A conversation's state and the loops that advance it: chunked prefill, single decode steps, and the
// generation loop. The graph encodes steps; the session owns every upload, submission, wait and
// download: token ids go up once per call, logits come down only when the caller asks for them, and the
// decode loop keeps the next step in flight while it reads the previous step's id (one 4-byte read per
// token: the sampled id is written on the device into the next step's input slot).
//
// Locks: busy_ (try-locked) admits one call at a time per session; the engine's model_lock serialises
// backend work (encode, submit, wait, transfers, alloc/release) across sessions; state_mu_ guards the
// host-side context (tokens_, pending_, stats) so position()/tokens()/stats may be read from any
// thread while a call runs. Order: busy_ -> model_lock -> state_mu_. Callbacks run with no lock held.
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/qwen36.h"
#include "runtime/sampler.h"

namespace lily {

class Session;

// Raised when a call would pass max_context; the session is left as it was.
struct ContextOverflow : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Raised when a session is used by two threads at once.
struct SessionBusy : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A host copy of a session's state (session files): KV rows as fp32 (exact for a bf16 cache too).
struct HostSnapshot {
  int64_t position = 0;                 // tokens whose state is computed
  std::vector<int32_t> tokens;          // computed tokens
  int32_t pending = -1;                 // sampled but not yet fed
  std::vector<float> logits;            // logits after the last computed token (empty at position 0)
  std::vector<std::vector<float>> kv;   // per KV cache (full layers, then MTP layers): K then V rows
                                        // [kv_heads, position, head_dim]
  std::vector<float> mtp_h;             // MTP checkpoints: StepState::mtp_h [hidden] (empty at position 0)
  bool mtp_valid = false;               // Session::mtp_cache_valid() when it was taken
  std::vector<std::vector<float>> conv, recurrent;  // per DeltaNet layer
  size_t bytes() const;
};

// KV rows [begin, end) of every full-attention layer, on top of a parent's rows [0, begin): written once
// by the snapshot that created it, then immutable and shared (shared_ptr) by that snapshot, by snapshots
// taken on top of it and by their segments. A conversation's checkpoints form a tree of segments, so each
// KV row is held once however many checkpoints need it; rows are freed with the last reference.
// Releases its tensors under the engine lock when destroyed (after that, its parent reference drops).
struct KvSegment {
  KvSegment(Qwen36& model, std::mutex& model_lock) : model_(model), lock_(model_lock) {}
  ~KvSegment();
  KvSegment(const KvSegment&) = delete;
  KvSegment& operator=(const KvSegment&) = delete;

  std::shared_ptr<const KvSegment> parent;  // rows [0, begin); null when begin == 0
  int64_t begin = 0, end = 0;
  // per KV cache (full layers, then the MTP block's: SessionState::kv_caches): [kv_heads * (end - begin),
  // head_dim], head-major, cache rows [row0(i), row0(i) + end - begin).
  std::vector<Tensor> k, v;
  // The MTP block's cache lags one row (its row t needs token t + 1: at position end, rows [0, end - 1) are
  // valid), so its segments hold cache rows [begin - 1, end - 1): each one rewrites the row its parent could
  // not know yet. A root segment holds [0, end), its last row not valid yet (rewritten by the next forward
  // before it is read). `decoder_caches`: Qwen36 n_full().
  int64_t row0(size_t cache, size_t decoder_caches) const {
    return cache >= decoder_caches && begin > 0 ? begin - 1 : begin;
  }
  size_t bytes() const;      // this segment's rows only
  // The session whose cache still owes this segment its rows (a deferred checkpoint, Session::prefill_snapshots),
  // null once they are written. Guarded by the model lock; whoever reads the rows settles it first.
  mutable Session* deferred = nullptr;

 private:
  Qwen36& model_;
  std::mutex& lock_;
};

// A session's state copied into backend tensors by recorded copies (snapshot, restore and fork never
// leave the device): its own conv/recurrent state and logits, and a reference to the KV segments
// holding rows [0, position). Releases its tensors under the engine lock when destroyed.
class DeviceSnapshot {
 public:
  DeviceSnapshot(Qwen36& model, std::mutex& model_lock) : model_(model), lock_(model_lock) {}
  ~DeviceSnapshot();
  DeviceSnapshot(const DeviceSnapshot&) = delete;
  DeviceSnapshot& operator=(const DeviceSnapshot&) = delete;

  int64_t position() const { return position_ + (pending_ >= 0); }
  // Bytes this snapshot keeps alive: its state plus every KV segment it reaches (shared ones included).
  size_t bytes() const;
  // Bytes only this snapshot added: its state plus the KV rows [base_position(), position) it copied.
  size_t own_bytes() const;
  // Where the KV rows this snapshot copied begin: its base's position, 0 without a base.
  int64_t base_position() const { return base_position_; }
  size_t kv_segments() const;  // segments from rows 0 to position (restore issues copies for each)
  DType kv_dtype() const { return kv_dtype_; }
  const Ops* backend() const { return &model_.ops(); }
  HostSnapshot to_host() const;  // downloads (session files)

 private:
  friend class Session;
  size_t state_bytes() const;  // conv, recurrent, logits, tokens
  Qwen36& model_;
  std::mutex& lock_;
  int64_t position_ = 0;
  int64_t base_position_ = 0;
  std::vector<int32_t> tokens_;
  int32_t pending_ = -1;
  bool has_logits_ = false;
  bool mtp_valid_ = false;  // Session::mtp_cache_valid() when it was taken
  DType kv_dtype_ = DType::F32;
  std::shared_ptr<const KvSegment> kv_;  // rows [0, position_); null at position 0
  bool owns_tail_ = false;               // kv_ was written by this snapshot (rows [base_position_, position_))
  std::vector<Tensor> conv_, recurrent_;
  Tensor logits_;
  Tensor mtp_h_;  // MTP checkpoints: StepState::mtp_h
  // The session whose state set still owes this snapshot its conv/recurrent state, logits and mtp_h (a
  // deferred end-of-prompt checkpoint), null once written. Guarded by the model lock.
  Session* deferred_ = nullptr;
  // Sessions restored from this snapshot whose state is still read from it (Session::restore: the copies wait
  // for the session's next forward). The destructor writes their state first. Guarded by the model lock.
  mutable std::vector<Session*> readers_;
};

// One set of a checkpoint's own state tensors (conv/recurrent per DeltaNet layer, logits, mtp_h), allocated and
// written ahead, one per engine, so the checkpoint a prefill chunk captures (Session::prefill_snapshots' inner
// position) writes into memory that exists already: no allocation on the path to the first token (on CUDA an
// alloc, a memset and a sync each) and, on the CPU, no first-touch page faults (its large buffers are mapped
// lazily). Taken by prefill_snapshots; written again by the session that took it when its generate call ends,
// after its last token. Guarded by the model lock.
struct CheckpointReserve {
  std::vector<Tensor> conv, recurrent;  // per DeltaNet layer
  Tensor logits, mtp_h;
  bool ready = false;   // the tensors above are allocated and written
  int64_t taken = 0, refilled = 0;
  size_t bytes() const;
  void release(Ops& ops);
};

// What the last speculative generate call did (MTP drafting, verification by the model).
struct MtpStats {
  int64_t steps = 0;     // verify forwards (each feeds 1 + its drafts' rows)
  int64_t drafted = 0;   // draft tokens proposed
  int64_t accepted = 0;  // draft tokens the model's own choice agreed with
  int64_t trials = 0;    // drafts that were compared (accepted, plus the first rejected one of a forward)
  int64_t plain_tokens = 0;  // tokens the adaptive policy decoded without drafting (it switched off)
  int64_t k_sum = 0;         // sum of the k chosen per verify forward (mean k = k_sum / steps)
  int64_t queued = 0;        // verify forwards queued on the device before the previous one was read
};

// generate_mtp's adaptive choice (mtp="auto"): cost[k] is the measured time of one iteration with k drafts
// (k drafts, the k + 1-row verify forward, its wait and any rollback) in plain pipelined decode steps. With a
// per-draft acceptance probability a (independent drafts), an iteration yields (1 - a^(k+1)) / (1 - a) tokens,
// so the expected speedup over plain decoding is that over cost[k]. Each iteration takes the k in 1..mtp_k with
// the best speedup for the current estimate of a (the accepted share of the trials so far, started from
// alpha0 weighted as `weight` trials); once the best is below 1 the call decodes the rest without drafting.
struct MtpPolicy {
  double cost[5] = {1, 0, 0, 0, 0};
  double alpha0 = 0.5;
  double weight = 4;
  // The k with the best expected speedup (0 when no k in 1..max_k reaches 1) and that speedup.
  std::pair<int, double> choose(double alpha, int max_k) const;
};

class Session {
 public:
  // `lock` is shared by every session of one model: one backend call at a time per engine.
  // `reserve`: the engine's checkpoint reserve (null: none), guarded by model_lock like the session's backend work.
  Session(Qwen36& model, std::mutex& model_lock, int64_t max_context, int64_t chunk,
          DType kv_dtype = DType::F32, CheckpointReserve* reserve = nullptr);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int64_t max_context() const { return st_.max_ctx; }
  int64_t chunk() const { return chunk_; }
  DType kv_dtype() const { return st_.kv_dtype; }
  // Tokens in the context, including a sampled token not yet fed through the model.
  int64_t position() const;
  std::vector<int32_t> tokens() const;

  // Feeds ids (after any pending token). Writes logits of the last id, or of every id when all_logits,
  // into out ([1 or n, vocab]). progress(done, total) runs after each chunk; returning false cancels
  // between chunks (the chunks done stay in the context). Returns the number of ids fed: with
  // all_logits only that many rows of out are written; otherwise out holds the last fed id's logits.
  int64_t prefill(const int32_t* ids, int64_t n, bool all_logits, float* out,
                  const std::function<bool(int64_t, int64_t)>& progress);
  // Feeds one token, writes its logits to out [vocab].
  void step(int32_t token, float* out);
  // Logits after the last token (feeds a pending token first). Empty context: throws.
  void logits(float* out);

  // Samples up to max_tokens tokens; each is reported through on_token, which answers 1 (received, go
  // on), 0 (received, stop) or -1 (not received: the caller was interrupted first; the token then never
  // joins the context). Returns why it stopped: "stop", "length", "context" or "cancelled".
  // With `with_logits`, on_token also gets the logits [vocab] the token was sampled from (one extra
  // download per token, for log-probabilities); otherwise nullptr.
  std::string generate(int64_t max_tokens, const SamplingParams& params, const std::vector<int32_t>& stop_ids,
                       const std::function<int(int32_t, const float*)>& on_token, bool with_logits = false);
  // generate() with MTP speculative decoding, mtp_k (1..4) drafts per verify forward; the same contract, the
  // same output distribution (docs/ARCHITECTURE.md, "MTP speculative decoding"). Each iteration drafts k
  // tokens with the MTP block (greedy, chained through its own hidden state), feeds the pending token and
  // the drafts through the model in one forward of k + 1 rows, samples each row's token with `params` as
  // generate() would, keeps the rows up to the first row whose token differs from the next draft (its token
  // is the next pending one), and rolls the rest back: the DeltaNet state after the kept row comes from the
  // forward's StateCapture, KV rows past it are rewritten later. Throws std::invalid_argument naming mtp_k
  // (outside 1..4) or mtp (no MTP block), before touching the session.
  // With `policy` (mtp="auto"), mtp_k is the largest k and each iteration chooses its own (MtpPolicy).
  // Needs the MTP block's cache to cover the context (mtp_cache_valid()) and the model to keep it
  // (Qwen36::keep_mtp_rows): otherwise std::invalid_argument naming mtp.
  //
  // `on_tokens` (optional) takes the tokens one iteration keeps in one call instead of one on_token call each: a
  // caller that hands tokens to another thread then pays one handoff per verify forward, not one per token
  // (benchmarks/NOTES.md, "MTP: one handoff per iteration"). It gets ids[0 .. n) (cut after the first stop token)
  // and, with `with_logits`, their logits rows [n, vocab]; it returns how many the caller received, in order
  // (0..n; the rest never join the context), and clears go_on when the caller wants no more after them. The
  // first token and a switch to plain decoding (the policy stops drafting) still go through on_token.
  using OnTokens = std::function<int64_t(const int32_t* ids, int64_t n, const float* rows, bool& go_on)>;
  std::string generate_mtp(int64_t max_tokens, const SamplingParams& params, const std::vector<int32_t>& stop_ids,
                           const std::function<int(int32_t, const float*)>& on_token, bool with_logits, int mtp_k,
                           const MtpPolicy* policy = nullptr, const OnTokens* on_tokens = nullptr);
  MtpStats last_mtp_stats() const;
  // Whether the MTP block's KV rows and next input cover the context: true at position 0, false once a forward
  // fed tokens while the model did not keep them (Qwen36::keep_mtp_rows false), until reset or a restore of a
  // snapshot that had them. Always false without an MTP block.
  bool mtp_cache_valid() const;
  // Tests only (bindings: Session._draft_override): while set (non-empty ids), drafts come from ids instead
  // of the MTP block: the draft for the token at context index q is ids[q - start] (0 outside the list), so a
  // test controls which drafts are accepted (e.g. the greedy continuation: all of them).
  void set_draft_override(int64_t start, std::vector<int32_t> ids);
  // Tests only (bindings: Session._draft_logits): the logits [k, vocab] of k chained greedy drafts from the
  // current context with `token` as the pending token, computed as generate_mtp drafts (draft 1 from token and
  // the model's hidden after the last fed token; draft j + 1 from draft j's argmax and the block's own hidden).
  // A pending token is fed first; otherwise the state is unchanged (the block's KV rows it writes are past the
  // valid ones, as generate_mtp's drafts). Throws std::invalid_argument naming k, token or the context.
  std::vector<float> draft_logits(int32_t token, int k);
  static constexpr int kMaxMtpK = 4;

  // Feeds ids as prefill() does (logits of the last id only, kept in the session) and returns a snapshot of the
  // state at each position in `at` (strictly ascending, each in (position(), position() + n], a pending token
  // fed first), equal to what snapshot() taken there would hold: snapshot 0 shares KV rows with `base` (which
  // snapshot() would accept at at[0]; may be null), each later one with the one before. No position costs a
  // forward of its own: the chunk holding it captures the DeltaNet state after that row straight into the
  // snapshot (ops.h StateCapture), computes that row's logits in the lm_head pass of its last row when they are
  // at most 16 rows apart (one more pass otherwise), and copies the KV rows in the same step; a position at a
  // chunk's end is copied from the state. One capture per chunk: a chunk holding two inner positions ends at
  // the second. If progress cancels, the snapshots of the positions reached are returned.
  // With `defer`, the copies that need nothing from the chunk's scratch are left off the first-token path: every
  // KV segment's rows (never rewritten while the context only grows) and the end-of-prompt snapshot's state,
  // logits and mtp_h when that position ends the last chunk (its state set stays untouched until the second
  // decode step: the first writes the other set). They are written by the session's next call that could
  // overwrite them (generate's second decode step, its end, prefill, step, restore, reset, ..., destruction), or
  // first by anyone reading the snapshot (restore into any session, to_host): the snapshots are exactly those of
  // the eager path whenever they are read. deferred_checkpoints() says how many copies are owed.
  std::vector<std::unique_ptr<DeviceSnapshot>> prefill_snapshots(
      const int32_t* ids, int64_t n, const std::vector<int64_t>& at, const DeviceSnapshot* base,
      const std::function<bool(int64_t, int64_t)>& progress, bool defer = true);
  // KV segments and snapshot states this session still owes (prefill_snapshots with defer); 0 when settled.
  int64_t deferred_checkpoints() const;
  // Copies the state into a new snapshot. With `base` (a snapshot of this engine whose tokens are a
  // prefix of this session's, same KV dtype), the KV rows [0, base position) are shared with it and only
  // rows [base position, position) are copied; throws std::invalid_argument (naming base) otherwise.
  std::unique_ptr<DeviceSnapshot> snapshot(const DeviceSnapshot* base = nullptr);
  // Makes the session's state the snapshot's: each of its KV segments the cache does not hold already goes into
  // rows [begin, end) of the cache (rows [0, position) in all), and its conv/recurrent state, logits and mtp_h
  // become the session's. Nothing is copied yet: the session's next forward (prefill, prefill_snapshots, step, a
  // pending token fed) reads the DeltaNet state straight from the snapshot and writes its own set, and copies the
  // KV rows in that forward's step, so a restore costs no step of its own; any other reader of the state (logits,
  // generate, snapshot, draft_logits) writes it first, in one step, as does the snapshot's destructor when the
  // snapshot goes first. restore_pending() says whether that is still owed. A snapshot of another engine goes
  // through host memory (written at once).
  void restore(const DeviceSnapshot& s);
  void restore(const HostSnapshot& s);
  // Empties the context (position 0). The zeroed state is written by the next forward's step, as a restore's.
  void reset();
  // Whether the state of the last restore or reset is still to be written (restore()); false once written.
  bool restore_pending() const;

  StepStats last_decode_stats() const;
  StepStats last_prefill_stats() const;
  // Host transfers of the last generate call's decode loop (the loop's contract: one id read per token).
  struct LoopTransfers {
    int64_t steps = 0, uploads = 0, downloads = 0, download_bytes = 0;
  };
  LoopTransfers last_generate_transfers() const;
  size_t state_bytes() const;
  // Rows [0, n) of the KV cache that equal, bit for bit, KV segments still alive (what a restore of a
  // snapshot built on them would not copy): the engine's pool of closed sessions picks by it.
  int64_t held_kv_rows() const;
  // Rows of s's KV segments this cache holds bit for bit (a restore of s would not copy them).
  int64_t held_kv_rows(const DeviceSnapshot& s) const;

 private:
  void check_ids(const int32_t* ids, int64_t n) const;
  void check_prefill(const int32_t* ids, int64_t n) const;
  void check_restorable(int64_t position, int32_t pending, const std::vector<int32_t>& tokens) const;
  void ensure_scratch(Scratch& sc, int64_t rows, int64_t logit_rows);
  void feed_pending_locked();  // model lock held; also forgets held KV rows from the position on
  // Model lock held: the pending token (-1: none), left pending for the caller's first chunk to feed as its row 0;
  // forgets held KV rows from the position on, as feed_pending_locked.
  int32_t take_pending_locked();
  void upload_chunk_ids_locked(Scratch& sc, int32_t lead, const int32_t* ids, int64_t T);
  void append_chunk_tokens_locked(int32_t& lead, const int32_t* ids, int64_t n);
  std::vector<int32_t> generate_context_locked();
  uint64_t start_sampler_locked(const SamplingParams& params, const std::vector<int32_t>& context, const Tensor& ws,
                                const Tensor& first_id);
  void decode_one_locked(int32_t token, bool was_pending);
  // Encodes one decode step of the token in slot[s] into the open step (at_zero: at position 0), reading the
  // state from `in` (an owed restore's source: restore_source_locked) or st_.now(). Model lock held.
  void encode_decode(int s, bool at_zero = false, const StepState* in = nullptr);
  // Whether this forward runs the MTP block's rows; a forward of tokens that does not invalidates the block's
  // cache (mtp_valid_). Model lock held; call once per forward, before encoding it.
  bool mtp_rows_locked();
  // generate()'s pipelined loop from P fed tokens: id 0 is in slot[0] once `fence` completes; with
  // first_delivered it is the pending token the caller already has (generate_mtp switching to plain decoding)
  // and counts as delivered. Returns generate()'s reason.
  std::string plain_loop(int64_t max_tokens, const SamplingParams& params, const std::vector<int32_t>& stop_ids,
                         const std::function<int(int32_t, const float*)>& on_token, bool with_logits, int64_t P,
                         uint64_t fence, bool first_delivered);
  // Speculative decoding's buffers, allocated on first use (model lock held) and freed with the session.
  // Iteration n of generate_mtp uses parity[n % 2], so that iteration n + 1 can run while n's results are read.
  struct Spec {
    struct Parity {
      Scratch sc;                           // k + 1 rows; sc.ids: the verify input (pending token, drafts)
      Tensor y;                             // I32 [k + 1, 1]: the model's token for each verify row
      Tensor accepted;                      // I32 [1, 1]: drafts accepted (accept_drafts)
      Tensor counts, seen;                  // I32 [k, vocab]: the penalty state after each row's sample
      Tensor rng;                           // I32 [k, kRngWords]: the sampler's rng after each row's draw
      std::vector<Tensor> conv, recurrent;  // per layer (DeltaNet): the state after rows 0 .. k-1 (capture)
    };
    Parity parity[2];
    Tensor draft_logits;         // F32 [1, vocab]
    SamplerState draft_sampler;  // drafts are greedy: its state is never read back
    bool ready = false;
  };
  void ensure_spec_locked();
  // Encodes k chained greedy drafts into the open step (sc.ids row 0 holds the token they follow, `in` the state
  // they start from); their logits go to logits_rows [k, vocab] when given, else each to spec_.draft_logits.
  // Model lock held.
  void encode_drafts_locked(Scratch& sc, const StepState& in, int64_t k, const Tensor* logits_rows);
  // Encodes and submits one speculative iteration (generate_mtp): k drafts (unless `injected`: sc.ids holds
  // them), the verify forward from st_.sets[in] into the other set, the samples and the accept decision with its
  // rollback on the device. Writes the forward's op counts to stats; returns the fence. Model lock held.
  uint64_t submit_spec_locked(int64_t k, int p, int in, bool at_zero, bool injected, const SamplingParams& params,
                              bool penalties, StepStats& stats);
  // Encodes the copies that make dst's logits, conv/recurrent state and MTP hidden those after row
  // q.accepted[0] of an iteration with k drafts on parity q (the device's rollback, and a cut's). Model lock held.
  void encode_state_at_row_locked(const Spec::Parity& q, int64_t k, const StepState& dst);
  // The phase of an iteration with k drafts (drafts and verify): decode where the backend's decode kernels take
  // the k + 1 verify rows (Ops::decode_rows), so each row is computed as a plain decode step computes it.
  Phase verify_phase(int64_t k) const { return k + 1 <= ops_.decode_rows() ? Phase::Decode : Phase::Prefill; }
  void free_spec_locked();
  Spec spec_;
  std::vector<int32_t> draft_override_;  // guarded by busy_
  int64_t draft_override_start_ = 0;
  void restore_locked(const DeviceSnapshot& s);
  // ---- the state a restore or reset left to write (restore()); all under the model lock ----
  const DeviceSnapshot* restoring_ = nullptr;  // the state (and KV rows) are the snapshot's, not yet written
  bool zeroing_ = false;                       // the state is zero at position 0 (reset), not yet written
  std::string restore_lost_;  // why a restore could not be written (the snapshot's destructor failed): refused
  // Encodes into the open step what makes the state set `now` hold the owed state (the KV rows the cache lacks and
  // the position; a reset's zeros), and returns the set the step's forward reads: the snapshot's tensors in place
  // of the DeltaNet state (the forward writes st_.now() or st_.other() itself), else st_.now(). Call
  // commit_restore_locked() once the step is done. Throws restore_lost_. The set returned stays valid until then
  // (the snapshot's view lives in restore_src_): with nothing owed, no copy of a set is made.
  const StepState& restore_source_locked();
  StepState restore_src_;
  void commit_restore_locked();  // the owed state is written: forgets it, holds the KV segments copied
  // Writes the owed state into st_.now() in a step of its own (for readers other than a forward). A no-op if none.
  void write_restore_locked();
  void drop_restore_locked();  // a new restore or reset replaces the owed one: nothing is written
  // Throws std::invalid_argument (naming base) unless `base` can share KV rows with a snapshot of `tokens`.
  void check_base(const DeviceSnapshot& base, const std::vector<int32_t>& tokens) const;
  // Allocates snap's own tensors (conv/recurrent per DeltaNet layer, logits) and, when seg is given, seg's KV
  // rows [seg->begin, seg->end). Model lock held, outside a step.
  // defer_state / defer_kv: the snapshot's state / seg's rows get their shapes only (flush_deferred_locked
  // allocates them).
  // from_reserve: the state tensors come from the engine's CheckpointReserve when it is ready.
  void alloc_snapshot_locked(DeviceSnapshot& snap, KvSegment* seg, bool defer_state = false, bool defer_kv = false,
                             bool from_reserve = false);
  // Allocates and writes the reserve when it is empty (called by a session whose checkpoint found it taken or empty,
  // so engines without such checkpoints never hold one).
  void refill_reserve_locked();
  void materialize_locked(Tensor& t, const char* label);  // allocates a deferred (shape-only) tensor
  // Encodes the copies of the cache's KV rows [seg.begin, seg.end) into seg (inside a step).
  void encode_kv_copy(KvSegment& seg);
  void set_context(std::vector<int32_t> tokens, int32_t pending, bool has_logits, bool mtp_valid);
  // Deferred checkpoints (prefill_snapshots with defer). Guarded by the model lock: any session's thread may
  // settle them (the segments and snapshot unregister themselves under it when destroyed first).
  friend struct KvSegment;
  friend class DeviceSnapshot;
  std::vector<KvSegment*> deferred_kv_;     // segments whose rows the cache still owes
  DeviceSnapshot* deferred_state_ = nullptr;  // the snapshot whose state sets[deferred_set_] still owes
  int deferred_set_ = 0;
  // Writes what this session owes (one step, waited, so the snapshots can be read or released at once). Model
  // lock held, outside a step; a no-op when nothing is owed.
  void flush_deferred_locked();
  // Settles whatever session still owes `s` or one of its KV segments. Model lock held, outside a step.
  static void settle_locked(const DeviceSnapshot& s);
  // Encodes the copies of the state set's conv/recurrent state, logits and mtp_h into snap (inside a step).
  void encode_state_copy(StepState& set, DeviceSnapshot& snap);
  void settle_quietly();  // flush_deferred_locked under the model lock, for scope exits: errors leave them owed

  Qwen36& model_;
  Ops& ops_;
  std::mutex& model_lock_;
  std::mutex busy_;
  mutable std::mutex state_mu_;
  SessionState st_;
  Scratch prefill_sc_, decode_sc_;
  CheckpointReserve* reserve_;  // the engine's (may be null); guarded by the model lock
  bool took_reserve_ = false;   // a checkpoint of this session found the reserve taken or empty: it refills it when
                                // its generate call ends (model lock)
  int64_t chunk_;
  // KV segments whose rows [begin, end) the cache holds bit for bit (it was copied from them, or they from it),
  // so a restore of a snapshot reaching them skips their copy (a session reused for the next turn of a
  // conversation copies only the rows it lacks). Guarded by the model lock; rows from a session's position on
  // are dropped before any forward writes there (feed_pending_locked).
  // The weak_ptr is never locked here: all of this runs under the model lock, and if the shared_ptr a lock()
  // made were the segment's last owner (its snapshots dropped meanwhile on another thread), the segment's
  // destructor would take the model lock on this thread: a deadlock (seen in the server tests' teardown).
  // While the lock is held no segment can be freed (its destructor waits for the lock), so an entry that has not
  // expired is alive at `raw`, with the rows it was held with.
  struct HeldSegment {
    std::weak_ptr<const KvSegment> seg;
    const KvSegment* raw;
    int64_t begin, end;
  };
  std::vector<HeldSegment> kv_held_;
  bool holds_locked(const KvSegment* seg) const;
  void hold_locked(const std::shared_ptr<const KvSegment>& seg);
  // guarded by state_mu_ (written only by the thread holding busy_)
  std::vector<int32_t> tokens_;
  int32_t pending_ = -1;
  bool has_logits_ = false;
  StepStats decode_stats_, prefill_stats_;
  LoopTransfers loop_transfers_;
  MtpStats mtp_stats_;
  bool mtp_valid_ = true;  // mtp_cache_valid() (and has_mtp()); guarded by state_mu_, written under the model lock
};

}  // namespace lily
