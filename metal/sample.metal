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

// sample_seeded: the seeded draw (temperature > 0), the oracle's steps in its order. One threadgroup of 256 threads:
//   1. keys[i] = (descending penalised logit, ascending id) as one ulong per id, padded to P = 2^⌈log2 vocab⌉;
//      a bitonic sort of the keys in the workspace (P · 8 bytes), a device-memory barrier between passes: the
//      candidates in the CPU's total order (logit descending, ties to the lower id);
//   2. thread 0 walks the sorted prefix: top-k cut, total and nucleus (top-p), min-p, the mass of the kept
//      candidates, one mt19937_64 draw (state in the sampler's rng words, the CPU's recurrence) scaled by the mass,
//      and the walk that picks the id. The CPU sums weights in double; here they are float-float pairs (about 48
//      bits), so a draw can differ from the CPU's only when it falls within ~1e-14 of a boundary.
// Weights: exp(logit / T − top / T) in float, as the CPU computes them. Floor: the sort moves P · 8 bytes
// log2(P)·(log2(P)+1)/2 times through cache; thread 0's walk is serial (the simplest correct variant).

struct SeededShape {
  uint vocab, ring_rows, P, top_k;
  float repetition_penalty, presence_penalty, frequency_penalty;
  float inv_t, top_p, min_p;
};

inline float sample_penalised(device const float* logits, device const int* counts, device const int* seen,
                              constant SeededShape& s, uint t) {
  float x = logits[t];
  if (s.repetition_penalty != 1.0f && seen[t] != 0) x = x > 0.0f ? x / s.repetition_penalty : x * s.repetition_penalty;
  if ((s.presence_penalty != 0.0f || s.frequency_penalty != 0.0f) && counts[t] != 0)
    x -= s.presence_penalty + s.frequency_penalty * float(counts[t]);
  return x;
}

// Float-float numbers (hi + lo, |lo| ≤ ulp(hi)/2) for the sums the CPU keeps in double.
struct SampleFF {
  float hi, lo;
};
inline SampleFF sample_fast_two_sum(float a, float b) {
  const float s = a + b;
  return {s, b - (s - a)};
}
inline SampleFF sample_add(SampleFF x, SampleFF y) {
  const float s = x.hi + y.hi, bb = s - x.hi;
  const float e = (x.hi - (s - bb)) + (y.hi - bb) + x.lo + y.lo;
  return sample_fast_two_sum(s, e);
}
inline SampleFF sample_neg(SampleFF x) { return {-x.hi, -x.lo}; }
inline SampleFF sample_mul(SampleFF x, SampleFF y) {
  const float p = x.hi * y.hi;
  const float e = fma(x.hi, y.hi, -p) + (x.hi * y.lo + x.lo * y.hi);
  return sample_fast_two_sum(p, e);
}
inline SampleFF sample_div(SampleFF x, SampleFF y) {
  const float q1 = x.hi / y.hi;
  const SampleFF r = sample_add(x, sample_neg(sample_mul({q1, 0.0f}, y)));
  return sample_fast_two_sum(q1, r.hi / y.hi);
}
inline bool sample_ge(SampleFF x, float f) { return x.hi > f || (x.hi == f && x.lo >= 0.0f); }
inline bool sample_negative(SampleFF x) { return x.hi < 0.0f || (x.hi == 0.0f && x.lo < 0.0f); }

// mt19937_64 over the state's 32-bit words (csrc/runtime/mt19937.h): [0, 624) the values, [624] the index.
inline ulong sample_mt_get(device int* w, uint i) { return ulong(uint(w[2 * i])) | (ulong(uint(w[2 * i + 1])) << 32); }
inline void sample_mt_put(device int* w, uint i, ulong v) {
  w[2 * i] = int(uint(v & 0xffffffffu));
  w[2 * i + 1] = int(uint(v >> 32));
}
inline ulong sample_mt_next(device int* w) {
  constexpr uint n = 312, m = 156;
  const ulong upper = ~ulong(0) << 31, lower = ~upper, a = 0xB5026F5AA96619E9ul;
  if (uint(w[2 * n]) >= n) {
    for (uint k = 0; k < n; ++k) {
      const ulong y = (sample_mt_get(w, k) & upper) | (sample_mt_get(w, (k + 1) % n) & lower);
      sample_mt_put(w, k, sample_mt_get(w, (k + m) % n) ^ (y >> 1) ^ ((y & 1) ? a : 0ul));
    }
    w[2 * n] = 0;
  }
  const uint at = uint(w[2 * n]);
  w[2 * n] = int(at + 1);
  ulong z = sample_mt_get(w, at);
  z ^= (z >> 29) & 0x5555555555555555ul;
  z ^= (z << 17) & 0x71D67FFFEDA60000ul;
  z ^= (z << 37) & 0xFFF7EEE000000000ul;
  z ^= z >> 43;
  return z;
}

[[kernel]] void sample_seeded(device const float* logits [[buffer(0)]],
                              device int* counts [[buffer(1)]],
                              device int* seen [[buffer(2)]],
                              device int* rng [[buffer(3)]],
                              device int* ring [[buffer(4)]],
                              device int* ring_count [[buffer(5)]],
                              device int* next_id [[buffer(6)]],
                              device ulong* keys [[buffer(7)]],
                              constant SeededShape& s [[buffer(8)]],
                              uint tid [[thread_position_in_threadgroup]],
                              uint threads [[threads_per_threadgroup]]) {
  for (uint i = tid; i < s.P; i += threads) {
    ulong key = ~ulong(0);
    if (i < s.vocab) {
      const uint u = as_type<uint>(sample_penalised(logits, counts, seen, s, i));
      const uint ord = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);  // ascending with the float
      key = (ulong(~ord) << 32) | ulong(i);
    }
    keys[i] = key;
  }
  threadgroup_barrier(mem_flags::mem_device);
  for (uint k = 2; k <= s.P; k <<= 1)
    for (uint j = k >> 1; j > 0; j >>= 1) {
      for (uint i = tid; i < s.P; i += threads) {
        const uint l = i ^ j;
        if (l > i) {
          const ulong a = keys[i], b = keys[l];
          if ((a > b) == ((i & k) == 0)) {
            keys[i] = b;
            keys[l] = a;
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_device);
    }
  if (tid != 0) return;
  const uint n = s.top_k > 0 && s.top_k < s.vocab ? s.top_k : s.vocab;
  const float top = sample_penalised(logits, counts, seen, s, uint(keys[0] & 0xffffffffu)) * s.inv_t;
#define LILY_SAMPLE_WEIGHT(i) \
  exp(sample_penalised(logits, counts, seen, s, uint(keys[i] & 0xffffffffu)) * s.inv_t - top)
  uint keep = n;
  if (s.top_p < 1.0f) {
    SampleFF total = {0.0f, 0.0f};
    for (uint i = 0; i < n; ++i) total = sample_add(total, {LILY_SAMPLE_WEIGHT(i), 0.0f});
    SampleFF cum = {0.0f, 0.0f};
    keep = 0;
    for (;;) {
      cum = sample_add(cum, sample_div({LILY_SAMPLE_WEIGHT(keep), 0.0f}, total));
      ++keep;
      if (sample_ge(cum, s.top_p) || keep == n) break;
    }
  }
  if (s.min_p > 0.0f) {
    uint k = 1;
    while (k < keep && LILY_SAMPLE_WEIGHT(k) >= s.min_p) ++k;
    keep = k;
  }
  SampleFF mass = {0.0f, 0.0f};
  for (uint i = 0; i < keep; ++i) mass = sample_add(mass, {LILY_SAMPLE_WEIGHT(i), 0.0f});
  // One draw as a fraction of 2^64: its top 48 bits, exactly (the CPU rounds the 64 bits to 53).
  const ulong z = sample_mt_next(rng);
  const SampleFF u = sample_fast_two_sum(float(uint(z >> 40)) * 5.9604644775390625e-8f,
                                             float(uint((z >> 16) & 0xffffffu)) * 3.5527136788005009e-15f);
  SampleFF r = sample_mul(u, mass);
  uint choice = uint(keys[keep - 1] & 0xffffffffu);
  for (uint i = 0; i < keep; ++i) {
    r = sample_add(r, {-LILY_SAMPLE_WEIGHT(i), 0.0f});
    if (sample_negative(r)) {
      choice = uint(keys[i] & 0xffffffffu);
      break;
    }
  }
#undef LILY_SAMPLE_WEIGHT
  counts[choice] += 1;
  seen[choice] = 1;
  const int c = ring_count[0];
  ring[uint(c) % s.ring_rows] = int(choice);
  ring_count[0] = c + 1;
  next_id[0] = int(choice);
}
