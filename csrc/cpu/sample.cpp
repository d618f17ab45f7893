// The sample op (the oracle every GPU sampler is tested against): one id from logits [1, vocab].
// Steps: penalties (repetition over the context's tokens, presence/frequency over this call's), then
// greedy (first maximum), or candidates by logit (ties: lower id) -> top-k -> top-p -> min-p -> a draw
// from the renormalised weights with the call's mt19937_64 (the exact definition: below). The chosen id goes
// to the next step's slot, the call's ring and the penalty state. Scratch from the workspace: vocab floats,
// vocab ids and vocab fixed-point weights.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "cpu/backend.h"
#include "runtime/mt19937.h"

namespace lily::cpu {

static_assert(SamplerState::kRngWords == mt::kWords, "sampler rng tensor must hold the mt19937_64 words");

size_t sample_workspace_bytes(int64_t vocab) {
  return Arena::need<float>(size_t(vocab)) + Arena::need<int32_t>(size_t(vocab)) +
         Arena::need<uint64_t>(size_t(vocab));
}

namespace {

void apply_penalties(float* work, int64_t vocab, const SamplingParams& p, const int32_t* seen,
                     const int32_t* counts) {
  if (p.repetition_penalty != 1.f)
    for (int64_t t = 0; t < vocab; ++t)
      if (seen[t]) work[t] = work[t] > 0.f ? work[t] / p.repetition_penalty : work[t] * p.repetition_penalty;
  if (p.presence_penalty != 0.f || p.frequency_penalty != 0.f)
    for (int64_t t = 0; t < vocab; ++t)
      if (counts[t]) work[t] -= std::fma(float(counts[t]), p.frequency_penalty, p.presence_penalty);  // CUDA: same
}

// The sampler's definition, shared bit for bit with the CUDA sampler (csrc/cuda/kernels/sample.cu), so that
// both pick the same id by construction, independent of summation order:
//   x_i = fmaf(work_i, 1/T, -top), top = work_max * (1/T)        (float; monotone in work)
//   w_i = weight_exp(x_i)                                          (float; the shared exp below)
//   q_i = round(w_i * 2^F) as an integer, F = min(44, 62 - bit_length(vocab))  (every sum is an exact u64 sum)
//   candidates: logit descending, ties lower id; n = top_k if 0 < top_k < vocab, else vocab
//   total Q = sum of q over the first n; top-p (top_p < 1): keep = the least k >= 1 with
//     q_0 + .. + q_{k-1} >= round(top_p * double(Q)), at most n
//   min-p (min_p > 0): keep only the leading candidates with x_i >= float(log(double(min_p))) (at least one)
//   mass M = q sum over the kept; R = min(round(u * double(M)), M - 1), u = mt::canonical();
//     the choice is the first kept candidate whose running q sum exceeds R (M == 0: the first candidate).
// Rounding is to nearest even everywhere.

// e^x rounded to float through a double evaluation written as explicit IEEE operations (fma where a product
// meets a sum), so a compiler cannot contract or reorder it: the CUDA sampler's weight_exp is the same
// sequence. NaN stays NaN; below -104 the float result is 0.
float weight_exp(float xf) {
  if (xf != xf) return xf;
  if (xf < -104.f) return 0.f;
  if (xf > 89.f) return HUGE_VALF;
  const double x = xf;
  const double k = std::nearbyint(x * 1.4426950408889634);
  double r = std::fma(-k, 0.6931471805599453, x);
  r = std::fma(-k, 2.3190468138462996e-17, r);
  double e = 1.6059043836821613e-10;
  e = std::fma(e, r, 2.08767569878681e-09);
  e = std::fma(e, r, 2.505210838544172e-08);
  e = std::fma(e, r, 2.755731922398589e-07);
  e = std::fma(e, r, 2.7557319223985893e-06);
  e = std::fma(e, r, 2.48015873015873e-05);
  e = std::fma(e, r, 0.0001984126984126984);
  e = std::fma(e, r, 0.001388888888888889);
  e = std::fma(e, r, 0.008333333333333333);
  e = std::fma(e, r, 0.041666666666666664);
  e = std::fma(e, r, 0.16666666666666666);
  e = std::fma(e, r, 0.5);
  e = std::fma(e, r, 1.0);
  e = std::fma(e, r, 1.0);
  return float(e * std::ldexp(1.0, int(k)));  // k in [-151, 129]: 2^k is a normal double, the product exact
}

int fix_bits(int64_t vocab) {
  int bits = 0;
  while (bits < 63 && (vocab >> bits) != 0) ++bits;
  return std::min(44, 62 - bits);
}

uint64_t to_u64(double v) { return uint64_t(std::nearbyint(v)); }  // v >= 0, below 2^64

// Candidates in idx ordered by logit (descending, ties: lower id) far enough for the filters.
struct Candidates {
  const float* work;
  int32_t* idx;
  uint64_t* q_of;  // q by token id
  int64_t vocab, n, sorted;
  float inv_t, top;
  double fix;  // 2^F
  bool by_logit(int32_t a, int32_t b) const { return work[a] > work[b] || (work[a] == work[b] && a < b); }
  float x(int64_t i) const { return std::fma(work[idx[i]], inv_t, -top); }
  uint64_t q(int64_t i) const { return q_of[idx[i]]; }
  void weigh() {  // q of every token (top must be set)
    for (int64_t t = 0; t < vocab; ++t) {
      const float w = weight_exp(std::fma(work[t], inv_t, -top));
      q_of[t] = w > 0.f && w <= 2.f ? to_u64(double(w) * fix) : 0;  // NaN (no finite logit) weighs nothing
    }
  }
  void sort_to(int64_t end) {  // idx[sorted, end) becomes the next `end - sorted` candidates in order
    auto cmp = [this](int32_t a, int32_t b) { return by_logit(a, b); };
    // The order is total, so any selection gives the same sorted range; what is left behind is unordered
    // (no sum depends on its order).
    if (end < vocab) std::nth_element(idx + sorted, idx + end, idx + vocab, cmp);
    std::sort(idx + sorted, idx + end, cmp);
    sorted = end;
  }
};

Candidates order_candidates(const float* work, int32_t* idx, uint64_t* q_of, int64_t vocab,
                            const SamplingParams& p) {
  Candidates c{work, idx, q_of, vocab, vocab, 0, 1.f / p.temperature, 0.f, std::ldexp(1.0, fix_bits(vocab))};
  std::iota(idx, idx + vocab, 0);
  if (p.top_k > 0 && p.top_k < vocab) c.n = p.top_k;
  // Sorting the whole vocabulary is the slow part: sort a prefix, widened only if the walk needs more.
  // A top-k cut is sorted exactly (its total must not include tokens outside the top k).
  c.sort_to(c.n < vocab ? c.n : std::min<int64_t>(vocab, 1024));
  c.top = work[idx[0]] * c.inv_t;
  c.weigh();
  return c;
}

int64_t nucleus(Candidates& c, const SamplingParams& p) {
  uint64_t total = 0;  // an exact integer sum: the unsorted tail's order does not matter
  for (int64_t i = 0; i < c.n; ++i) total += c.q(i);
  if (p.top_p >= 1.f) {
    if (c.sorted < c.n) c.sort_to(c.n);
    return c.n;
  }
  const uint64_t target = p.top_p > 0.f ? to_u64(double(p.top_p) * double(total)) : 0;
  uint64_t cum = 0;
  int64_t keep = 0;
  for (;;) {
    if (keep == c.sorted && c.sorted < c.n) c.sort_to(std::min<int64_t>(c.n, c.sorted * 4));
    cum += c.q(keep);
    ++keep;
    if (cum >= target || keep == c.n) return keep;
  }
}

int64_t min_p_cut(const Candidates& c, int64_t keep, const SamplingParams& p) {
  if (p.min_p <= 0.f) return keep;
  const float thr = float(std::log(double(p.min_p)));  // the CUDA host computes the same threshold
  int64_t k = 1;  // the first candidate always stays
  while (k < keep && c.x(k) >= thr) ++k;
  return k;
}

int32_t draw(const Candidates& c, int64_t keep, uint32_t* rng) {
  uint64_t mass = 0;
  for (int64_t i = 0; i < keep; ++i) mass += c.q(i);
  const double u = mt::canonical(rng);  // every sampled draw takes exactly one number
  if (mass == 0) return c.idx[0];
  const uint64_t r = std::min(to_u64(u * double(mass)), mass - 1);
  uint64_t cum = 0;
  for (int64_t i = 0; i < keep; ++i) {
    cum += c.q(i);
    if (cum > r) return c.idx[i];
  }
  return c.idx[keep - 1];  // not reached: cum reaches mass > r
}

}  // namespace

void CpuOps::sample_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p, const Tensor& ws,
                         const Tensor& next_id) {
  const int64_t vocab = logits.cols;
  Arena a = arena(ws, "sample");
  float* work = a.take<float>(size_t(vocab));
  int32_t* idx = a.take<int32_t>(size_t(vocab));
  uint64_t* q_of = a.take<uint64_t>(size_t(vocab));
  int32_t *counts = i32(st.counts), *seen = i32(st.seen);
  std::copy(f32(logits), f32(logits) + vocab, work);
  apply_penalties(work, vocab, p, seen, counts);
  int32_t choice;
  if (p.greedy()) {
    choice = int32_t(std::max_element(work, work + vocab) - work);  // first max wins
  } else {
    Candidates c = order_candidates(work, idx, q_of, vocab, p);
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
