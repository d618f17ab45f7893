// Kernels for the harness features of tests/metal/test_harness.py: threadgroup arrays of half, bfloat and
// vectors, atomic_thread_fence, the `template [[host_name]] kernel void f<T>(...)` instantiation form,
// implicit [[buffer]] indices, the threadgroup-memory budget and threadgroup start order. Kernels named
// *_bug plant the bug the harness must report.
#include <metal_stdlib>
using namespace metal;

#include "emu_helpers.metal"

// Reverses 64 values of each type through threadgroup tiles: half, bfloat, half4 and float4 arrays.
kernel void tile_reverse(device const half* x [[buffer(0)]], device float* y [[buffer(1)]],
                         uint i [[thread_index_in_threadgroup]]) {
  threadgroup half th[64];
  threadgroup bfloat tb[64];
  threadgroup half4 t4[64];
  threadgroup float2 tf[64], tg2[64];
  th[i] = x[i];
  tb[i] = bfloat(float(x[i]));
  t4[i] = half4(x[i]);
  tf[i] = float2(float(x[i]), 1.0f);
  tg2[i] = tf[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint j = 63 - i;
  y[i] = float(th[j]) + float(tb[j]) + float(t4[j].w) + tf[j].x + tg2[j].y;
}

// The same with atomic_thread_fence where a barrier belongs: a fence orders memory but makes no thread
// wait, so lanes read slots their neighbours have not written yet (poison).
kernel void fence_not_barrier_bug(device const half* x [[buffer(0)]], device float* y [[buffer(1)]],
                                  uint i [[thread_index_in_threadgroup]]) {
  threadgroup half th[64];
  th[i] = x[i];
  atomic_thread_fence(mem_flags::mem_threadgroup, memory_order_seq_cst, thread_scope_threadgroup);
  y[i] = float(th[63 - i]);
}

// A fence plus the barrier: correct.
kernel void fence_and_barrier(device const half* x [[buffer(0)]], device float* y [[buffer(1)]],
                              uint i [[thread_index_in_threadgroup]]) {
  threadgroup half th[64];
  th[i] = x[i];
  atomic_thread_fence(mem_flags::mem_threadgroup, memory_order_seq_cst, thread_scope_threadgroup);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = float(th[63 - i]);
}

// Explicit instantiation with the kernel keyword and a parameter list of types only (attributes come from
// the template). Its tile is sized by T, so each instantiation has its own static threadgroup length.
template <typename T>
kernel void scale_tpl(device const T* x [[buffer(0)]], device T* y [[buffer(1)]], constant float& s [[buffer(2)]],
                      uint i [[thread_position_in_grid]], uint l [[thread_index_in_threadgroup]]) {
  threadgroup T tile[128];
  tile[l] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = T(float(tile[l]) * s);
}
template [[host_name("scale_f32")]] kernel void scale_tpl<float>(device const float*, device float*, constant float&,
                                                                 uint, uint);
template [[host_name("scale_f16")]] kernel void scale_tpl<half>(device const half*, device half*, constant float&,
                                                                uint, uint);

// Implicit indices: `a` and `c` have no [[buffer]] attribute. Explicit ones are reserved first, so a takes 0,
// c takes 2 (1 is b's), and out takes 3.
kernel void implicit_indices(device const float* a, device const float* b [[buffer(1)]], constant float& c,
                             device float* out, uint i [[thread_position_in_grid]]) {
  out[i] = a[i] * 100.0f + b[i] * 10.0f + c;
}

// 32 KiB of static threadgroup memory: the whole default budget, so any dynamic memory is too much.
kernel void big_tile(device float* out [[buffer(0)]], threadgroup float* extra [[threadgroup(0)]],
                     uint i [[thread_index_in_threadgroup]]) {
  threadgroup float tile[8192];
  tile[i] = float(i);
  extra[i % 4] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = tile[i] + extra[0];
}

// Threadgroup memory declared in a helper counts for the kernel that calls it (threadgroup_sum: 32 floats).
kernel void helper_tile(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                        uint i [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]]) {
  threadgroup float mine[4];
  if (i < 4) mine[i] = 0.0f;
  const float s = threadgroup_sum(x[i], i, n);
  if (i == 0) out[0] = s + mine[0];
}

// Records the order in which threadgroups start (one worker runs them one after another).
kernel void start_order(device atomic_uint* counter [[buffer(0)]], device uint* order [[buffer(1)]],
                        uint tg [[threadgroup_position_in_grid]], uint l [[thread_index_in_threadgroup]]) {
  if (l == 0) order[atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed)] = tg;
}

// Planted bug: threadgroup 0 "initialises" the accumulator that the others add to, assuming it starts first.
kernel void first_group_inits_bug(device atomic_uint* acc [[buffer(0)]], uint tg [[threadgroup_position_in_grid]],
                                  uint l [[thread_index_in_threadgroup]]) {
  if (l != 0) return;
  if (tg == 0)
    atomic_store_explicit(acc, 0u, memory_order_relaxed);
  else
    atomic_fetch_add_explicit(acc, 1u, memory_order_relaxed);
}

// Threadgroup memory in a member function: invisible to the load-time count (static length 0 here), so the
// budget is enforced when the declaration executes.
struct Scratch {
  static float fill(uint i) {
    threadgroup float big[8192];
    big[i] = 1.0f;
    return big[i];
  }
};
kernel void member_tile(device float* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  out[i] = Scratch::fill(i);
}
kernel void big_tile_member(device float* out [[buffer(0)]], threadgroup float* extra [[threadgroup(0)]],
                            uint i [[thread_index_in_threadgroup]]) {
  extra[i % 4] = 0.0f;
  out[i] = Scratch::fill(i);
}
