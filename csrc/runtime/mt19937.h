// The 64-bit Mersenne Twister (mt19937_64, as the C++ standard defines it: w=64, n=312, m=156, r=31) on a
// state stored as plain 32-bit words, so it can live in a backend buffer and a GPU sampler can run the
// same recurrence. Draws equal std::mt19937_64's (tests/test_sampling.py checks), and canonical() equals
// libstdc++'s generate_canonical<double, 53> of one draw, so seeded sampling is what it always was.
// Words: [0, 624) the 312 state values as (low, high) pairs, [624] the index of the next value.
#pragma once
#include <cstdint>

namespace lily::mt {

constexpr int kN = 312, kM = 156;
constexpr int kWords = 2 * kN + 2;

inline uint64_t get(const uint32_t* w, int i) { return uint64_t(w[2 * i]) | uint64_t(w[2 * i + 1]) << 32; }
inline void put(uint32_t* w, int i, uint64_t v) {
  w[2 * i] = uint32_t(v);
  w[2 * i + 1] = uint32_t(v >> 32);
}

inline void seed(uint32_t* w, uint64_t s) {
  put(w, 0, s);
  for (int i = 1; i < kN; ++i) {
    const uint64_t prev = get(w, i - 1);
    put(w, i, 6364136223846793005ULL * (prev ^ (prev >> 62)) + uint64_t(i));
  }
  w[2 * kN] = kN;  // the first draw regenerates the whole state
  w[2 * kN + 1] = 0;
}

inline uint64_t next(uint32_t* w) {
  constexpr uint64_t upper = ~uint64_t(0) << 31, lower = ~upper, a = 0xB5026F5AA96619E9ULL;
  if (w[2 * kN] >= uint32_t(kN)) {
    for (int k = 0; k < kN; ++k) {
      const uint64_t y = (get(w, k) & upper) | (get(w, (k + 1) % kN) & lower);
      put(w, k, get(w, (k + kM) % kN) ^ (y >> 1) ^ ((y & 1) ? a : 0));
    }
    w[2 * kN] = 0;
  }
  uint64_t z = get(w, int(w[2 * kN]++));
  z ^= (z >> 29) & 0x5555555555555555ULL;
  z ^= (z << 17) & 0x71D67FFFEDA60000ULL;
  z ^= (z << 37) & 0xFFF7EEE000000000ULL;
  z ^= z >> 43;
  return z;
}

// A double in [0, 1): one draw divided by 2^64, kept below 1 (what libstdc++ computes).
inline double canonical(uint32_t* w) {
  const double r = double(next(w)) / 18446744073709551616.0;
  return r >= 1.0 ? 0.99999999999999988898 : r;  // nextafter(1, 0)
}

}  // namespace lily::mt
