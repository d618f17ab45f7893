// Greedy sampling on the GPU (oracle csrc/cpu/sample.cpp; host csrc/metal/sample.cpp): the penalties
// (repetition over the context's tokens, presence / frequency over this call's), then the first maximum; the id
// goes to the next step's input slot, the call's ring and the penalty state, so decode never waits for the host.
//   sample_greedy: one threadgroup of 256 threads; thread i scans ids i, i + 256, ... keeping its first maximum,
//                  a simd reduction (largest value, then lowest id) and one over the 8 simdgroups through
//                  threadgroup memory; thread 0 updates the state. Grid 1.
// Buffers: logits f32 [1, vocab]; counts, seen I32 [1, vocab]; ring I32 [R, 1], ring_count I32 [1, 1];
//          next_id I32 [1, 1]. Function constants 50-59 belong to this file (none used yet).
// Floor: reads vocab · 12 bytes (logits and both penalty arrays).
#include <metal_stdlib>
using namespace metal;

// Shared with csrc/metal/sample.cpp.
struct SampleShape {
  uint vocab, ring_rows;
  float repetition_penalty, presence_penalty, frequency_penalty;
};

[[kernel]] void sample_greedy(device const float* logits [[buffer(0)]],
                              device int* counts [[buffer(1)]],
                              device int* seen [[buffer(2)]],
                              device int* ring [[buffer(3)]],
                              device int* ring_count [[buffer(4)]],
                              device int* next_id [[buffer(5)]],
                              constant SampleShape& s [[buffer(6)]],
                              threadgroup float* best_v [[threadgroup(0)]],
                              threadgroup int* best_i [[threadgroup(1)]],
                              uint tid [[thread_position_in_threadgroup]],
                              uint threads [[threads_per_threadgroup]],
                              uint simdgroup [[simdgroup_index_in_threadgroup]],
                              uint simdgroups [[simdgroups_per_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]]) {
  float v = -INFINITY;
  int id = 0x7fffffff;
  for (uint t = tid; t < s.vocab; t += threads) {
    float x = logits[t];
    if (s.repetition_penalty != 1.0f && seen[t] != 0)
      x = x > 0.0f ? x / s.repetition_penalty : x * s.repetition_penalty;
    if ((s.presence_penalty != 0.0f || s.frequency_penalty != 0.0f) && counts[t] != 0)
      x -= s.presence_penalty + s.frequency_penalty * float(counts[t]);
    if (x > v || id == 0x7fffffff) v = x, id = int(t);
  }
  float top = simd_max(v);
  int top_id = simd_min(v == top ? id : 0x7fffffff);
  if (lane == 0) {
    best_v[simdgroup] = top;
    best_i[simdgroup] = top_id;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float pv = lane < simdgroups ? best_v[lane] : -INFINITY;
  const int pi = lane < simdgroups ? best_i[lane] : 0x7fffffff;
  top = simd_max(pv);
  top_id = simd_min(pv == top ? pi : 0x7fffffff);
  if (tid == 0) {
    counts[top_id] += 1;
    seen[top_id] = 1;
    const int n = ring_count[0];
    ring[uint(n) % s.ring_rows] = top_id;
    ring_count[0] = n + 1;
    next_id[0] = top_id;
  }
}
