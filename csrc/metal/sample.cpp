// MetalOps: sample (metal/sample.metal; oracle csrc/cpu/sample.cpp). Greedy decoding with the penalties runs on
// the GPU; a seeded draw (temperature > 0: top-k / top-p / min-p and the mt19937_64 stream) is not implemented
// yet and raises instead of falling back to the host.
#include "metal/backend.h"

namespace lily::metal {

namespace {
struct SampleShape {  // metal/sample.metal
  uint32_t vocab, ring_rows;
  float repetition_penalty, presence_penalty, frequency_penalty;
};
static_assert(sizeof(SampleShape) == 20, "SampleShape must match metal/sample.metal");
constexpr int64_t kThreads = 256;
}  // namespace

void MetalOps::sample_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p, const Tensor&,
                           const Tensor& next_id) {
  if (!p.greedy())
    throw MetalError("metal sample: seeded sampling (temperature > 0) is not implemented on the Metal backend yet; "
                     "use temperature=0");
  const SampleShape s{uint32_t(logits.cols), uint32_t(st.ring.rows), p.repetition_penalty, p.presence_penalty,
                      p.frequency_penalty};
  dispatch("sample_greedy", {},
           {arg(logits), arg(st.counts), arg(st.seen), arg(st.ring), arg(st.ring_count), arg(next_id), Arg::value(s)},
           MTL::Size(1, 1, 1), MTL::Size(kThreads, 1, 1), {kThreads / 32 * 4, kThreads / 32 * 4});
}

}  // namespace lily::metal
