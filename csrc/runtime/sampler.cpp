#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace lily {

void SamplingParams::validate() const {
  auto bad = [](const char* field, const std::string& why) {
    throw std::invalid_argument(std::string("SamplingParams.") + field + " " + why);
  };
  if (!(temperature >= 0.f) || !std::isfinite(temperature)) bad("temperature", "must be a finite number >= 0");
  if (top_k < 0) bad("top_k", "must be >= 0 (0 disables it)");
  if (!(top_p > 0.f && top_p <= 1.f)) bad("top_p", "must be in (0, 1]");
  if (!(min_p >= 0.f && min_p <= 1.f)) bad("min_p", "must be in [0, 1]");
  if (!(repetition_penalty > 0.f) || !std::isfinite(repetition_penalty))
    bad("repetition_penalty", "must be a finite number > 0");
  if (!std::isfinite(presence_penalty)) bad("presence_penalty", "must be finite");
  if (!std::isfinite(frequency_penalty)) bad("frequency_penalty", "must be finite");
}

Sampler::Sampler(const SamplingParams& p) : p_(p) {
  p_.validate();
  rng_.seed(p.has_seed ? p.seed : std::random_device{}());
}

int32_t Sampler::sample(const float* logits, int64_t vocab, const std::vector<int32_t>& context) {
  work_.assign(logits, logits + vocab);
  if (p_.repetition_penalty != 1.f) {
    std::unordered_set<int32_t> seen(context.begin(), context.end());
    for (int32_t t : seen) {
      if (t < 0 || t >= vocab) continue;
      float& l = work_[size_t(t)];
      l = l > 0.f ? l / p_.repetition_penalty : l * p_.repetition_penalty;
    }
  }
  if (p_.presence_penalty != 0.f || p_.frequency_penalty != 0.f)
    for (auto [t, n] : generated_) work_[size_t(t)] -= p_.presence_penalty + p_.frequency_penalty * float(n);

  int32_t choice;
  if (p_.temperature == 0.f) {
    choice = int32_t(std::max_element(work_.begin(), work_.end()) - work_.begin());  // first max wins
  } else {
    // Candidates ordered by logit, descending (ties: lower id first).
    idx_.resize(size_t(vocab));
    std::iota(idx_.begin(), idx_.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) {
      return work_[size_t(a)] > work_[size_t(b)] || (work_[size_t(a)] == work_[size_t(b)] && a < b);
    };
    int64_t n = vocab;
    if (p_.top_k > 0 && p_.top_k < n) n = p_.top_k;
    // Sorting the whole vocabulary is the slow part: sort a prefix, widen it only if top-p needs more.
    int64_t sorted = std::min<int64_t>(n, 1024);
    std::partial_sort(idx_.begin(), idx_.begin() + sorted, idx_.end(), by_logit);
    const float inv_t = 1.f / p_.temperature, top = work_[size_t(idx_[0])] * inv_t;
    auto weight = [&](int64_t i) { return std::exp(work_[size_t(idx_[size_t(i)])] * inv_t - top); };
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) total += i < sorted ? weight(i) : 0.0;
    if (sorted < n) {  // probabilities of the unsorted tail, for an exact top-p cut
      for (int64_t i = sorted; i < vocab; ++i) total += weight(i);
    }
    int64_t keep = n;
    if (p_.top_p < 1.f) {
      double cum = 0.0;
      keep = 0;
      for (;;) {
        if (keep == sorted && sorted < n) {  // need more of the order
          int64_t more = std::min<int64_t>(n, sorted * 4);
          std::partial_sort(idx_.begin() + sorted, idx_.begin() + more, idx_.end(), by_logit);
          sorted = more;
        }
        cum += weight(keep) / total;
        ++keep;
        if (cum >= p_.top_p || keep == n) break;
      }
    } else if (sorted < n) {
      std::sort(idx_.begin() + sorted, idx_.begin() + n, by_logit);
      sorted = n;
    }
    if (p_.min_p > 0.f) {  // weight(0) == 1 is the largest probability (scaled)
      int64_t k = 1;
      while (k < keep && weight(k) >= p_.min_p) ++k;
      keep = k;
    }
    double mass = 0.0;
    for (int64_t i = 0; i < keep; ++i) mass += weight(i);
    double r = std::uniform_real_distribution<double>(0.0, mass)(rng_);
    choice = idx_[size_t(keep - 1)];
    for (int64_t i = 0; i < keep; ++i) {
      r -= weight(i);
      if (r < 0.0) {
        choice = idx_[size_t(i)];
        break;
      }
    }
  }
  ++generated_[choice];
  return choice;
}

}  // namespace lily
