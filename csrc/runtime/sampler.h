// Token sampling from one row of logits: penalties, then greedy (temperature 0) or
// temperature -> top-k -> top-p -> min-p -> a draw from the renormalised distribution.
#pragma once
#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

namespace lily {

struct SamplingParams {
  float temperature = 0.f;         // 0: greedy
  int64_t top_k = 0;               // 0: off
  float top_p = 1.f;               // 1: off
  float min_p = 0.f;               // 0: off
  float repetition_penalty = 1.f;  // HF style, over the whole context (prompt and output)
  float presence_penalty = 0.f;    // OpenAI style, over tokens generated in this call
  float frequency_penalty = 0.f;   // OpenAI style, over tokens generated in this call
  bool has_seed = false;
  uint64_t seed = 0;
  void validate() const;  // throws std::invalid_argument naming the field
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // context: every token of the session (for the repetition penalty). Records the choice as generated.
  int32_t sample(const float* logits, int64_t vocab, const std::vector<int32_t>& context);

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::unordered_map<int32_t, int32_t> generated_;  // token -> times generated in this call
  std::vector<float> work_;
  std::vector<int32_t> idx_;
};

}  // namespace lily
