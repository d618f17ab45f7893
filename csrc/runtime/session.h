// A conversation's state and the loops that advance it: chunked prefill, single decode steps, and the
// generation loop (sampling and stop conditions in C++, one callback per token to stream it out).
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

// Raised when a call would pass max_context; the session is left as it was.
struct ContextOverflow : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Raised when a session is used by two threads at once.
struct SessionBusy : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A host copy of everything a session needs to continue exactly where it was.
struct Snapshot {
  int64_t position = 0;                 // tokens whose state is computed
  std::vector<int32_t> tokens;          // computed tokens
  int32_t pending = -1;                 // sampled but not yet fed
  std::vector<float> logits;            // logits after the last computed token (empty at position 0)
  std::vector<std::vector<float>> kv;   // per full layer: K then V rows [kv_heads, position, head_dim]
  std::vector<std::vector<float>> conv, recurrent;  // per DeltaNet layer
  size_t bytes() const;
};

class Session {
 public:
  // `lock` is shared by every session of one model: one forward runs at a time per engine.
  Session(Qwen36& model, std::mutex& model_lock, int64_t max_context, int64_t chunk,
          DType kv_dtype = DType::F32);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int64_t max_context() const { return st_.max_ctx; }
  int64_t chunk() const { return chunk_; }
  DType kv_dtype() const { return st_.kv_dtype; }
  // Tokens in the context, including a sampled token not yet fed through the model.
  int64_t position() const { return int64_t(tokens_.size()) + (pending_ >= 0); }
  std::vector<int32_t> tokens() const;

  // Feeds ids (after any pending token). Writes logits of the last id, or of every id when all_logits,
  // into out ([1 or n, vocab]). progress(done, total) runs after each chunk; returning false cancels
  // between chunks (the chunks done stay in the context).
  void prefill(const int32_t* ids, int64_t n, bool all_logits, float* out,
               const std::function<bool(int64_t, int64_t)>& progress);
  // Feeds one token, writes its logits to out [vocab].
  void step(int32_t token, float* out);
  // Logits after the last token (feeds a pending token first). Empty context: throws.
  void logits(float* out);

  // Samples up to max_tokens tokens; each is reported through on_token (returning false stops) and
  // becomes part of the context. Returns why it stopped: "stop", "length", "context" or "cancelled".
  std::string generate(int64_t max_tokens, const SamplingParams& params,
                       const std::vector<int32_t>& stop_ids,
                       const std::function<bool(int32_t)>& on_token);

  Snapshot snapshot();
  void restore(const Snapshot& s);
  void reset();

  const StepStats& last_decode_stats() const { return decode_stats_; }
  const StepStats& last_prefill_stats() const { return prefill_stats_; }
  size_t state_bytes() const;

 private:
  void check_ids(const int32_t* ids, int64_t n) const;
  void ensure_scratch(Scratch& sc, int64_t rows, int64_t logit_rows);
  void feed_pending();
  void decode_locked(int32_t token);  // model lock held
  // KV rows [0, n) of one head as fp32, and back (converting when the cache is bf16).
  void read_kv_rows(const Tensor& cache, int64_t head, int64_t n, float* dst);
  void write_kv_rows(const Tensor& cache, int64_t head, int64_t n, const float* src);

  Qwen36& model_;
  std::mutex& model_lock_;
  std::mutex busy_;
  SessionState st_;
  Scratch prefill_sc_, decode_sc_;
  int64_t chunk_;
  std::vector<int32_t> tokens_;
  int32_t pending_ = -1;
  std::vector<float> last_logits_;
  StepStats decode_stats_, prefill_stats_;
};

}  // namespace lily
