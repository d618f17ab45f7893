// Fixed-order fp32 reductions for the CPU kernels. Sixteen independent partial sums let the compiler use
// SIMD lanes without reassociating (no -ffast-math), and the order is the same for every call, so results
// never depend on chunking or threading.
#pragma once
#include <cstdint>

namespace lily::cpu {

inline float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += a[i + l] * b[i + l];
  // Pairwise tree over the lanes (a fixed order the compiler can keep in vector registers).
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  float s = part[0];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline float sum_squares(const float* a, int64_t n) { return dot(a, a, n); }

}  // namespace lily::cpu
