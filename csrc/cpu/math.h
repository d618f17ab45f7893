// Scalar activations shared by the CPU kernels (fp32, libm exp: the oracle's exact formulas).
#pragma once
#include <cmath>

namespace lily::cpu {

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float silu(float x) { return x / (1.f + std::exp(-x)); }
// torch returns x above 20 (the difference is below fp32 resolution there).
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

}  // namespace lily::cpu
