// Planted bug: a helper that takes threadgroup memory is handed a device pointer. MSL rejects it; the
// emulator's typed build must too (the asan build erases address spaces and compiles it).
#include <metal_stdlib>
using namespace metal;

inline void scale_shared(threadgroup float* shared, uint i) { shared[i] *= 2.0f; }

kernel void wrong_space(device float* x [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  scale_shared(x, gid);
}
