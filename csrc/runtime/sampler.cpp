#include "runtime/sampler.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "runtime/mt19937.h"

namespace lily {

// Below this temperature the scaled logits' differences leave float range (the draw degenerates), and
// the distribution is greedy to within float resolution anyway, so the sampler takes the greedy path.
constexpr float kGreedyBelow = 1e-5f;

bool SamplingParams::greedy() const { return temperature < kGreedyBelow; }

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

std::vector<int32_t> sampler_rng_words(uint64_t seed) {
  std::vector<int32_t> w(size_t(mt::kWords), 0);
  mt::seed(reinterpret_cast<uint32_t*>(w.data()), seed);
  return w;
}

std::vector<int32_t> sampler_seen_mask(const std::vector<int32_t>& context, int64_t vocab) {
  std::vector<int32_t> m(size_t(vocab), 0);
  for (int32_t t : context)
    if (t >= 0 && t < vocab) m[size_t(t)] = 1;
  return m;
}

}  // namespace lily
