// Sparse MoE around the expert products (MODEL.md §6; oracle csrc/cpu/moe.cpp; host csrc/metal/moe.cpp).
// The expert products themselves (moe_gate_up, moe_down) are in matmul.metal with the other products.
//   moe_route:   per token t: p = softmax(logits[t]) over all E (fp32), the k largest (ties to the lower id, §12.13
//                renormalised: w = p / Σ top-k p). One simdgroup per token, lanes stride over the experts; each of
//                the k rounds is a simd_max of the best unchosen probability and a simd_min of its id. GPU-resident:
//                the ids never leave the device. Grid T, 32 threads. k ≤ 16.
//   swiglu:      out = silu(gate) ⊙ up                                     grid (⌈cols/64⌉, rows), 64 threads
//   moe_combine: h += routed + sigmoid(shared_gate_logit[t]) · shared       grid (⌈cols/64⌉, rows), 64 threads
// Buffers: logits f32 [T, E] (strided), ids I32 [T, k], weights f32 [T, k]; the elementwise ops strided f32 rows.
// No function constants. Floor: moe_route reads T·E·4 bytes; the elementwise ops read and write each element once.
#include <metal_stdlib>
using namespace metal;

// Shared with csrc/metal/moe.cpp.
struct RouteShape {
  uint E, k, ld_logits, ld_ids, ld_w;
};

[[kernel]] void moe_route(device const float* logits [[buffer(0)]],
                          device int* ids [[buffer(1)]],
                          device float* weights [[buffer(2)]],
                          constant RouteShape& s [[buffer(3)]],
                          uint t [[threadgroup_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint kMaxK = 16;
  device const float* l = logits + ulong(t) * s.ld_logits;
  float mx = -INFINITY;
  for (uint e = lane; e < s.E; e += 32) mx = max(mx, l[e]);
  mx = simd_max(mx);
  float sum = 0.0f;
  for (uint e = lane; e < s.E; e += 32) sum += exp(l[e] - mx);
  sum = simd_sum(sum);
  int chosen[kMaxK];
  float prob[kMaxK];
  for (uint r = 0; r < s.k; ++r) {
    float best = -1.0f;
    int best_id = 0x7fffffff;
    for (uint e = lane; e < s.E; e += 32) {
      bool taken = false;
      for (uint c = 0; c < r; ++c) taken = taken || chosen[c] == int(e);
      const float p = exp(l[e] - mx) / sum;
      if (!taken && p > best) best = p, best_id = int(e);  // ascending e per lane: ties keep the lower id
    }
    const float top = simd_max(best);
    const int id = simd_min(best == top ? best_id : 0x7fffffff);
    chosen[r] = id;
    prob[r] = top;
  }
  float total = 0.0f;
  for (uint r = 0; r < s.k; ++r) total += prob[r];
  for (uint r = lane; r < s.k; r += 32) {
    ids[ulong(t) * s.ld_ids + r] = chosen[r];
    weights[ulong(t) * s.ld_w + r] = prob[r] / total;
  }
}

// Shared with csrc/metal/moe.cpp (the same layout as RowsShape in backend.metal).
struct MoeRowsShape {
  uint rows, cols, lda, ldb, ldo;
};

[[kernel]] void swiglu(device const float* gate [[buffer(0)]],
                       device const float* up [[buffer(1)]],
                       device float* out [[buffer(2)]],
                       constant MoeRowsShape& s [[buffer(3)]],
                       uint2 tg [[threadgroup_position_in_grid]],
                       uint i_in [[thread_index_in_threadgroup]]) {
  const uint i = tg.x * 64 + i_in, t = tg.y;
  if (i >= s.cols) return;
  const float g = gate[ulong(t) * s.lda + i];
  out[ulong(t) * s.ldo + i] = g / (1.0f + exp(-g)) * up[ulong(t) * s.ldb + i];
}

// routed: lda, shared: ldb, h: ldo; shared_gate_logit [T, 1] with stride ld_gate.
struct CombineShape {
  uint rows, cols, lda, ldb, ldo, ld_gate;
};

[[kernel]] void moe_combine(device const float* routed [[buffer(0)]],
                            device const float* shared [[buffer(1)]],
                            device const float* sg [[buffer(2)]],
                            device float* h [[buffer(3)]],
                            constant CombineShape& s [[buffer(4)]],
                            uint2 tg [[threadgroup_position_in_grid]],
                            uint i_in [[thread_index_in_threadgroup]]) {
  const uint i = tg.x * 64 + i_in, t = tg.y;
  if (i >= s.cols) return;
  const float g = 1.0f / (1.0f + exp(-sg[ulong(t) * s.ld_gate]));
  const ulong o = ulong(t) * s.ldo + i;
  h[o] += routed[ulong(t) * s.lda + i] + g * shared[ulong(t) * s.ldb + i];
}
