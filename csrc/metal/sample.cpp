// MetalOps: sample (metal/sample.metal; oracle csrc/cpu/sample.cpp). Greedy decoding with the penalties, and the
// seeded draw (temperature > 0: top-k, top-p, min-p and the call's mt19937_64 stream), both on the GPU.
#include "metal/backend.h"

namespace lily::metal {

namespace {
struct SampleShape {  // metal/sample.metal
  uint32_t vocab, ring_rows;
  float repetition_penalty, presence_penalty, frequency_penalty;
};
static_assert(sizeof(SampleShape) == 20, "SampleShape must match metal/sample.metal");
struct SeededShape {  // metal/sample.metal
  uint32_t vocab, ring_rows, P, top_k;
  float repetition_penalty, presence_penalty, frequency_penalty, inv_t, top_p, min_p;
};
static_assert(sizeof(SeededShape) == 40, "SeededShape must match metal/sample.metal");
constexpr int64_t kThreads = 256;
}  // namespace

size_t sample_workspace_bytes(int64_t vocab) {
  size_t P = 1;
  while (P < size_t(vocab)) P *= 2;
  return P * 8;  // the sort keys of sample_seeded
}

void MetalOps::sample_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p, const Tensor& ws,
                           const Tensor& next_id) {
  if (!p.greedy()) {
    const size_t need = sample_workspace_bytes(logits.cols);
    if (need > ws.bytes()) throw std::logic_error("workspace too small for sample");
    const SeededShape s{uint32_t(logits.cols), uint32_t(st.ring.rows), uint32_t(need / 8),
                        uint32_t(p.top_k > 0 && p.top_k < logits.cols ? p.top_k : 0), p.repetition_penalty,
                        p.presence_penalty, p.frequency_penalty, 1.f / p.temperature, p.top_p, p.min_p};
    dispatch("sample_seeded", {},
             {arg(logits), arg(st.counts), arg(st.seen), arg(st.rng), arg(st.ring), arg(st.ring_count), arg(next_id),
              arg(ws), Arg::value(s)},
             MTL::Size(1, 1, 1), MTL::Size(kThreads, 1, 1));
    return;
  }
  const SampleShape s{uint32_t(logits.cols), uint32_t(st.ring.rows), p.repetition_penalty, p.presence_penalty,
                      p.frequency_penalty};
  dispatch("sample_greedy", {},
           {arg(logits), arg(st.counts), arg(st.seen), arg(st.ring), arg(st.ring_count), arg(next_id), Arg::value(s)},
           MTL::Size(1, 1, 1), MTL::Size(kThreads, 1, 1), {kThreads / 32 * 4, kThreads / 32 * 4});
}

}  // namespace lily::metal
