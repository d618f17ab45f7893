// The sample op (the oracle every GPU sampler is tested against): one id from logits [1, vocab].
// Steps: penalties (repetition over the context's tokens, presence/frequency over this call's), then
// greedy (first maximum), or candidates by logit (ties: lower id) -> top-k -> top-p -> min-p -> a draw
// from the renormalised weights with the call's mt19937_64. The chosen id goes to the next step's slot,
// the call's ring and the penalty state. Scratch: vocab floats and vocab ids from the workspace.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "cpu/backend.h"
#include "runtime/mt19937.h"

namespace lily::cpu {

static_assert(SamplerState::kRngWords == mt::kWords, "sampler rng tensor must hold the mt19937_64 words");

size_t sample_workspace_bytes(int64_t vocab) {
  return Arena::need<float>(size_t(vocab)) + Arena::need<int32_t>(size_t(vocab));
}

namespace {

void apply_penalties(float* work, int64_t vocab, const SamplingParams& p, const int32_t* seen,
                     const int32_t* counts) {
  if (p.repetition_penalty != 1.f)
    for (int64_t t = 0; t < vocab; ++t)
      if (seen[t]) work[t] = work[t] > 0.f ? work[t] / p.repetition_penalty : work[t] * p.repetition_penalty;
  if (p.presence_penalty != 0.f || p.frequency_penalty != 0.f)
    for (int64_t t = 0; t < vocab; ++t)
      if (counts[t]) work[t] -= p.presence_penalty + p.frequency_penalty * float(counts[t]);
}

// Candidates in idx ordered by logit (descending, ties: lower id) far enough for the filters, and the
// number that survive top-k, top-p and min-p. weight(i) = exp(logit_i / T - logit_0 / T).
struct Candidates {
  const float* work;
  int32_t* idx;
  int64_t vocab, n, sorted;
  float inv_t, top;
  bool by_logit(int32_t a, int32_t b) const { return work[a] > work[b] || (work[a] == work[b] && a < b); }
  double weight(int64_t i) const { return std::exp(work[idx[i]] * inv_t - top); }
  void sort_to(int64_t end) {  // idx[sorted, end) becomes the next `end - sorted` candidates in order
    auto cmp = [this](int32_t a, int32_t b) { return by_logit(a, b); };
    if (end == vocab)
      std::sort(idx + sorted, idx + vocab, cmp);  // the order is total, so this equals a partial sort
    else
      std::partial_sort(idx + sorted, idx + end, idx + vocab, cmp);
    sorted = end;
  }
};

Candidates order_candidates(const float* work, int32_t* idx, int64_t vocab, const SamplingParams& p) {
  Candidates c{work, idx, vocab, vocab, 0, 1.f / p.temperature, 0.f};
  std::iota(idx, idx + vocab, 0);
  if (p.top_k > 0 && p.top_k < vocab) c.n = p.top_k;
  // Sorting the whole vocabulary is the slow part: sort a prefix, widened only if top-p needs more.
  // A top-k cut is sorted exactly (its total must not include tokens outside the top k).
  c.sort_to(c.n < vocab ? c.n : std::min<int64_t>(vocab, 1024));
  c.top = work[idx[0]] * c.inv_t;
  return c;
}

int64_t nucleus(Candidates& c, const SamplingParams& p) {
  double total = 0.0;
  for (int64_t i = 0; i < c.sorted; ++i) total += c.weight(i);
  for (int64_t i = c.sorted; i < c.n; ++i) total += c.weight(i);  // the unsorted tail (no top-k: n = vocab)
  if (p.top_p >= 1.f) {
    if (c.sorted < c.n) c.sort_to(c.n);
    return c.n;
  }
  double cum = 0.0;
  int64_t keep = 0;
  for (;;) {
    if (keep == c.sorted && c.sorted < c.n) c.sort_to(std::min<int64_t>(c.n, c.sorted * 4));
    cum += c.weight(keep) / total;
    ++keep;
    if (cum >= p.top_p || keep == c.n) return keep;
  }
}

int64_t min_p_cut(const Candidates& c, int64_t keep, const SamplingParams& p) {
  if (p.min_p <= 0.f) return keep;
  int64_t k = 1;  // weight(0) == 1 is the largest probability (scaled)
  while (k < keep && c.weight(k) >= p.min_p) ++k;
  return k;
}

int32_t draw(const Candidates& c, int64_t keep, uint32_t* rng) {
  double mass = 0.0;
  for (int64_t i = 0; i < keep; ++i) mass += c.weight(i);
  double r = mt::canonical(rng) * mass;
  for (int64_t i = 0; i < keep; ++i) {
    r -= c.weight(i);
    if (r < 0.0) return c.idx[i];
  }
  return c.idx[keep - 1];
}

}  // namespace

void CpuOps::sample_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p, const Tensor& ws,
                         const Tensor& next_id) {
  const int64_t vocab = logits.cols;
  Arena a = arena(ws, "sample");
  float* work = a.take<float>(size_t(vocab));
  int32_t* idx = a.take<int32_t>(size_t(vocab));
  int32_t *counts = i32(st.counts), *seen = i32(st.seen);
  std::copy(f32(logits), f32(logits) + vocab, work);
  apply_penalties(work, vocab, p, seen, counts);
  int32_t choice;
  if (p.greedy()) {
    choice = int32_t(std::max_element(work, work + vocab) - work);  // first max wins
  } else {
    Candidates c = order_candidates(work, idx, vocab, p);
    const int64_t keep = min_p_cut(c, nucleus(c, p), p);
    choice = draw(c, keep, reinterpret_cast<uint32_t*>(i32(st.rng)));
  }
  ++counts[choice];
  seen[choice] = 1;
  int32_t& n = *i32(st.ring_count);
  i32(st.ring)[n % st.ring.rows] = choice;
  ++n;
  *i32(next_id) = choice;
}

}  // namespace lily::cpu
