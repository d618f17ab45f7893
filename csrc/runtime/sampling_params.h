// How the next token is chosen (validated in Python first; validate() repeats the checks for C++ callers).
#pragma once
#include <cstdint>

namespace lily {

struct SamplingParams {
  float temperature = 0.f;         // 0 (or below kGreedyBelow): greedy
  int64_t top_k = 0;               // 0: off
  float top_p = 1.f;               // 1: off
  float min_p = 0.f;               // 0: off
  float repetition_penalty = 1.f;  // HF style, over the whole context (prompt and output)
  float presence_penalty = 0.f;    // OpenAI style, over tokens generated in this call
  float frequency_penalty = 0.f;   // OpenAI style, over tokens generated in this call
  bool has_seed = false;
  uint64_t seed = 0;
  void validate() const;  // throws std::invalid_argument naming the field
  bool greedy() const;
};

}  // namespace lily
