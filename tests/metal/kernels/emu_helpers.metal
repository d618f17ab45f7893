// Helpers included by emu_basic.metal (tests relative includes and threadgroup storage in a helper).
#pragma once
#include <metal_stdlib>
using namespace metal;

// Sum of one value per thread over the threadgroup: simd_sum, then the simdgroups' partials through a
// threadgroup array declared here, in a helper rather than in the kernel.
inline float threadgroup_sum(float v, uint tid, uint threads) {
  threadgroup float partial[32];
  const uint lane = tid % 32, sg = tid / 32;
  v = simd_sum(v);
  if (lane == 0) partial[sg] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  if (sg == 0) {
    total = simd_sum(lane < (threads + 31) / 32 ? partial[lane] : 0.0f);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total;
}
