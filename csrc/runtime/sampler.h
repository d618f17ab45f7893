// Sampling: the parameters (runtime/sampling_params.h), validated here, and the host side of the
// sampler state a generate call starts from (the per-token work is the `sample` op of each backend;
// the CPU's, csrc/cpu/sample.cpp, is the oracle).
#pragma once
#include <cstdint>
#include <vector>

#include "runtime/sampling_params.h"

namespace lily {

// The initial rng words of a generate call (mt19937.h layout) for this seed.
std::vector<int32_t> sampler_rng_words(uint64_t seed);
// 1 for every token id that occurs in `context` (the repetition penalty's set), vocab entries.
std::vector<int32_t> sampler_seen_mask(const std::vector<int32_t>& context, int64_t vocab);

}  // namespace lily
