// Gated DeltaNet (MODEL.md §5; oracle csrc/cpu/gated_delta.cpp; host csrc/metal/gated_delta.cpp).
//   conv1d_silu: out[t, c] = silu(Σ_j w[c, j] · x[t - (K-1) + j, c]), rows before the chunk from the conv state
//                [K-1, C] (oldest first); the state advances to the last K-1 pre-conv rows. Thread c owns channel c
//                of input, state and output (in place when state_in = state_out). Grid ⌈C/64⌉, 64 threads.
//                Taps summed j = 0..K-1 in order, as the CPU does. K ≤ 16. Captures (csrc/backend/ops.h StateCapture):
//                thread c also copies channel c of the state after rows cap_first .. cap_first + cap_count - 1 (the
//                pre-conv rows ending there, from x or state_in) to cap, before it writes state_out.
//   gated_delta_scan: the gated delta rule per value head j (key head j / (Hv/Hk), §12.6), in the order of §12.9:
//                S ← α·S;  m = Sᵀk̂;  δ = β·(v − m);  S ← S + k̂ ⊗ δ;  o = Sᵀq̂;   q̂ = q / ‖q‖ / √Dk, k̂ = k / ‖k‖
//                (eps 1e-6 on the sum of squares), β = σ(b), α = exp(−exp(A_log) · softplus(a + dt_bias)), all fp32.
//                Register-resident: one threadgroup per value head, thread e owns column e of S (Dk floats held in
//                registers from the first token to the last), so m[e] and o[e] are per-thread sums (ascending i,
//                the CPU's order) and no barrier or threadgroup memory is needed; every thread recomputes the
//                head's norms and gates (Dk reads each, from cache). State read once from state_in and written
//                once to state_out per call. Grid Hv, Dv threads (Dv ≤ 1024, Dk ≤ 256). Instantiated per register
//                budget: gated_delta_scan_{32,64,128,256} hold that many floats of S per thread. Captures: after token
//                cap_first + i (i < cap_count) thread e stores its column of S to slice i of cap (rows i·Hv·Dk ..), the
//                registers a call ending at that token would store to state_out: the same bits.
//   conv_delta_norm: both of the above and gated_rms_norm (metal/norm.metal) for one decode row in one dispatch, one
//                threadgroup per key head (its own section below: shapes, geometry, floor).
// Buffers: qkv f32 [T, 2·Hk·Dk + Hv·Dv] (after conv1d_silu), b, a f32 [T, Hv], A_log, dt_bias f32 [Hv],
//          S f32 [Hv·Dk, Dv] (Lily's layout, csrc/model/qwen36.h), out f32 [T, Hv·Dv]; cap (written only when
//          cap_count > 0; the host binds state_out otherwise) f32 [cap_count·(K-1), C] or [cap_count·Hv·Dk, Dv].
// Floor (real model, decode): the state crosses memory once each way, 2 · 32 · 128 · 128 · 4 B = 4 MiB per layer;
//          T · Hv · Dk · Dv · 8 FLOPs. No function constants.
#include <metal_stdlib>
using namespace metal;

// Shared with csrc/metal/gated_delta.cpp.
struct ConvShape {
  uint T, C, K;
  uint ld_x, ld_out, ld_state_in, ld_state_out;
  uint cap_first, cap_count, ld_cap;
};

struct DeltaScanShape {
  uint T, k_heads, v_heads, Dk, Dv;
  uint ld_qkv, ld_b, ld_a, ld_out, ld_state_in, ld_state_out;
  uint cap_first, cap_count, ld_cap;
};

inline float delta_silu(float x) { return x / (1.0f + exp(-x)); }
inline float delta_sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }
inline float delta_softplus(float x) { return x > 20.0f ? x : log(1.0f + exp(x)); }

// Σ a[i]² in the CPU's order (csrc/cpu/reduce.h: sixteen partial sums, a pairwise tree, then the tail).
inline float delta_sum_squares(device const float* a, uint n) {
  float part[16];
  for (uint l = 0; l < 16; ++l) part[l] = 0.0f;
  uint i = 0;
  for (; i + 16 <= n; i += 16)
    for (uint l = 0; l < 16; ++l) part[l] += a[i + l] * a[i + l];
  for (uint w = 8; w >= 1; w /= 2)
    for (uint l = 0; l < w; ++l) part[l] += part[l + w];
  float s = part[0];
  for (; i < n; ++i) s += a[i] * a[i];
  return s;
}

[[kernel]] void conv1d_silu(device const float* x [[buffer(0)]],
                            device const float* w [[buffer(1)]],
                            device const float* state_in [[buffer(2)]],
                            device float* state_out [[buffer(3)]],
                            device float* out [[buffer(4)]],
                            constant ConvShape& s [[buffer(5)]],
                            device float* cap [[buffer(6)]],
                            uint c [[thread_position_in_grid]]) {
  constexpr uint kMaxTaps = 16;
  if (c >= s.C) return;
  const uint S = s.K - 1;
  float hist[kMaxTaps];  // the last S pre-conv values of this channel, oldest first
  for (uint r = 0; r < S; ++r) hist[r] = state_in[ulong(r) * s.ld_state_in + c];
  for (uint t = 0; t < s.T; ++t) {
    const float cur = x[ulong(t) * s.ld_x + c];
    float acc = 0.0f;
    for (uint j = 0; j < S; ++j) acc += w[ulong(c) * s.K + j] * hist[j];
    acc += w[ulong(c) * s.K + S] * cur;
    out[ulong(t) * s.ld_out + c] = delta_silu(acc);
    for (uint r = 0; r + 1 < S; ++r) hist[r] = hist[r + 1];
    if (S > 0) hist[S - 1] = cur;
  }
  for (uint i = 0; i < s.cap_count; ++i)  // state_in is still unchanged here (this thread owns channel c)
    for (uint r = 0; r < S; ++r) {
      const int src = int(s.cap_first + i + r + 1) - int(S);  // token index; negative = from the carried state
      cap[ulong(i * S + r) * s.ld_cap + c] =
          src >= 0 ? x[ulong(src) * s.ld_x + c] : state_in[ulong(int(S) + src) * s.ld_state_in + c];
    }
  for (uint r = 0; r < S; ++r) state_out[ulong(r) * s.ld_state_out + c] = hist[r];
}

template <uint MaxDk>
[[kernel]] void gated_delta_scan(device const float* qkv [[buffer(0)]],
                                 device const float* b [[buffer(1)]],
                                 device const float* a [[buffer(2)]],
                                 device const float* A_log [[buffer(3)]],
                                 device const float* dt_bias [[buffer(4)]],
                                 device const float* state_in [[buffer(5)]],
                                 device float* state_out [[buffer(6)]],
                                 device float* out [[buffer(7)]],
                                 constant DeltaScanShape& s [[buffer(8)]],
                                 device float* cap [[buffer(9)]],
                                 uint j [[threadgroup_position_in_grid]],
                                 uint e [[thread_position_in_threadgroup]]) {
  if (e >= s.Dv) return;
  const uint Dk = s.Dk, kh = j / (s.v_heads / s.k_heads), key_dim = s.k_heads * Dk;
  float S[MaxDk];
  for (uint i = 0; i < Dk; ++i) S[i] = state_in[(ulong(j) * Dk + i) * s.ld_state_in + e];
  const float neg_A = -exp(A_log[j]);
  const float q_scale = 1.0f / sqrt(float(Dk));
  for (uint t = 0; t < s.T; ++t) {
    device const float* row = qkv + ulong(t) * s.ld_qkv;
    device const float* q = row + kh * Dk;
    device const float* k = row + key_dim + kh * Dk;
    const float v = row[2 * key_dim + j * s.Dv + e];
    const float rq = q_scale / sqrt(delta_sum_squares(q, Dk) + 1e-6f);
    const float rk = 1.0f / sqrt(delta_sum_squares(k, Dk) + 1e-6f);
    const float beta = delta_sigmoid(b[ulong(t) * s.ld_b + j]);
    const float alpha = exp(neg_A * delta_softplus(a[ulong(t) * s.ld_a + j] + dt_bias[j]));
    // §5.4: decay first, then read with the decayed state.
    float m = 0.0f;
    for (uint i = 0; i < Dk; ++i) {
      S[i] = S[i] * alpha;
      m += (k[i] * rk) * S[i];
    }
    const float delta = beta * (v - m);
    float o = 0.0f;
    for (uint i = 0; i < Dk; ++i) {
      S[i] += (k[i] * rk) * delta;
      o += (q[i] * rq) * S[i];
    }
    out[ulong(t) * s.ld_out + j * s.Dv + e] = o;
    if (t - s.cap_first < s.cap_count)  // unsigned: t >= cap_first too
      for (uint i = 0; i < Dk; ++i) cap[((ulong(t - s.cap_first) * s.v_heads + j) * Dk + i) * s.ld_cap + e] = S[i];
  }
  for (uint i = 0; i < Dk; ++i) state_out[(ulong(j) * Dk + i) * s.ld_state_out + e] = S[i];
}

// The state column's registers sized by the key head dim (the host picks the smallest MaxDk >= Dk; the real
// model's Dk = 128 keeps 128 floats per thread).
template [[host_name("gated_delta_scan_32")]] [[kernel]] decltype(gated_delta_scan<32>) gated_delta_scan<32>;
template [[host_name("gated_delta_scan_64")]] [[kernel]] decltype(gated_delta_scan<64>) gated_delta_scan<64>;
template [[host_name("gated_delta_scan_128")]] [[kernel]] decltype(gated_delta_scan<128>) gated_delta_scan<128>;
template [[host_name("gated_delta_scan_256")]] [[kernel]] decltype(gated_delta_scan<256>) gated_delta_scan<256>;

// ---- gated_delta_scan_sg: the same recurrence for prefill rows (T >= 2), one state column per simdgroup ----
// The per-thread form above holds Dk floats of S per thread (128 at the real model's Dk): on a GPU that many live
// registers cap occupancy or spill, and a prefill chunk then runs 32 value heads on 32 threadgroups. Here a
// simdgroup owns column e of value head j and spreads it over its 32 lanes (lane l holds rows i = l, l + 32, ..:
// PerLane = ceil(Dk / 32) floats, 4 at Dk = 128), loaded once, carried through all T rows in registers and
// written back once. The two per-row reductions (m = Sᵀk̂ and o = Sᵀq̂, and the norms of q and k) are a lane
// partial in ascending row order then simd_sum: lanes exchange through simd operations, never threadgroup memory,
// and no barrier is needed (simdgroups are independent). The sums are ordered differently from the CPU's (a tree
// over lanes), so results agree to fp32 rounding, not bit for bit; single rows keep the per-thread form, whose
// order conv_delta_norm repeats bit for bit (the host chooses by T and reports the calls of each).
// Grid (⌈Dv / 4⌉, Hv), 4 simdgroups (128 threads) per threadgroup, simdgroup s of threadgroup x owns column
// e = 4x + s (a whole simdgroup past Dv returns: nothing below waits for it). Captures: after token cap_first + i
// each lane stores its rows of the column to slice i of cap, as the per-thread form does.
// Reads: qkv [T, 2·Hk·Dk + Hv·Dv] (a key head's q and k rows are re-read, from cache, by every column of its value
// heads), b, a [T, Hv], A_log, dt_bias [Hv], state_in [Hv·Dk, Dv]; writes out [T, Hv·Dv], state_out, cap.
// Floor (real model, a 2K chunk): the state once each way (4 MiB per layer) plus qkv once (2K · 8 K floats ·
// 4 B = 64 MiB per layer); T · Hv · Dk · Dv · 8 FLOPs.
template <uint PerLane>
[[kernel]] void gated_delta_scan_sg(device const float* qkv [[buffer(0)]],
                                    device const float* b [[buffer(1)]],
                                    device const float* a [[buffer(2)]],
                                    device const float* A_log [[buffer(3)]],
                                    device const float* dt_bias [[buffer(4)]],
                                    device const float* state_in [[buffer(5)]],
                                    device float* state_out [[buffer(6)]],
                                    device float* out [[buffer(7)]],
                                    constant DeltaScanShape& s [[buffer(8)]],
                                    device float* cap [[buffer(9)]],
                                    uint2 tg [[threadgroup_position_in_grid]],
                                    uint simdgroup [[simdgroup_index_in_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  const uint e = tg.x * 4 + simdgroup, j = tg.y;
  if (e >= s.Dv) return;  // uniform over the simdgroup
  const uint Dk = s.Dk, group = s.v_heads / s.k_heads, kh = j / group, key_dim = s.k_heads * Dk;
  float S[PerLane];
  for (uint p = 0; p < PerLane; ++p) {
    const uint i = lane + 32 * p;
    S[p] = i < Dk ? state_in[(ulong(j) * Dk + i) * s.ld_state_in + e] : 0.0f;
  }
  const float neg_A = -exp(A_log[j]);
  const float q_scale = 1.0f / sqrt(float(Dk));
  for (uint t = 0; t < s.T; ++t) {
    device const float* row = qkv + ulong(t) * s.ld_qkv;
    device const float* q = row + kh * Dk;
    device const float* k = row + key_dim + kh * Dk;
    float qv[PerLane], kv[PerLane];
    float qq = 0.0f, kk = 0.0f;
    for (uint p = 0; p < PerLane; ++p) {
      const uint i = lane + 32 * p;
      qv[p] = i < Dk ? q[i] : 0.0f;
      kv[p] = i < Dk ? k[i] : 0.0f;
      qq += qv[p] * qv[p];
      kk += kv[p] * kv[p];
    }
    const float rq = q_scale / sqrt(simd_sum(qq) + 1e-6f);
    const float rk = 1.0f / sqrt(simd_sum(kk) + 1e-6f);
    const float beta = delta_sigmoid(b[ulong(t) * s.ld_b + j]);
    const float alpha = exp(neg_A * delta_softplus(a[ulong(t) * s.ld_a + j] + dt_bias[j]));
    const float v = row[2 * key_dim + j * s.Dv + e];
    // §5.4: decay first, then read with the decayed state.
    float m = 0.0f;
    for (uint p = 0; p < PerLane; ++p) {
      S[p] = S[p] * alpha;
      m += (kv[p] * rk) * S[p];
    }
    const float delta = beta * (v - simd_sum(m));
    float o = 0.0f;
    for (uint p = 0; p < PerLane; ++p) {
      S[p] += (kv[p] * rk) * delta;
      o += (qv[p] * rq) * S[p];
    }
    o = simd_sum(o);
    if (lane == 0) out[ulong(t) * s.ld_out + j * s.Dv + e] = o;
    if (t >= s.cap_first && t < s.cap_first + s.cap_count)
      for (uint p = 0; p < PerLane; ++p) {
        const uint i = lane + 32 * p;
        if (i < Dk) cap[((ulong(t - s.cap_first) * s.v_heads + j) * Dk + i) * s.ld_cap + e] = S[p];
      }
  }
  for (uint p = 0; p < PerLane; ++p) {
    const uint i = lane + 32 * p;
    if (i < Dk) state_out[(ulong(j) * Dk + i) * s.ld_state_out + e] = S[p];
  }
}

// Rows per lane by the key head dim (the host picks the smallest PerLane with 32 · PerLane >= Dk: 4 at Dk = 128).
template [[host_name("gated_delta_scan_sg_1")]] [[kernel]] decltype(gated_delta_scan_sg<1>) gated_delta_scan_sg<1>;
template [[host_name("gated_delta_scan_sg_2")]] [[kernel]] decltype(gated_delta_scan_sg<2>) gated_delta_scan_sg<2>;
template [[host_name("gated_delta_scan_sg_4")]] [[kernel]] decltype(gated_delta_scan_sg<4>) gated_delta_scan_sg<4>;
template [[host_name("gated_delta_scan_sg_8")]] [[kernel]] decltype(gated_delta_scan_sg<8>) gated_delta_scan_sg<8>;

// ---- conv_delta_norm: conv1d_silu + gated_delta_scan + gated_rms_norm for one decode row (T = 1), one dispatch ----
// Grid Hk threadgroups (one per key head kh), g·Dvp threads (g = Hv/Hk value heads of that key head, Dvp = Dv
// rounded up to 32, so each value head owns whole simdgroups; host keeps g·Dvp ≤ the pipeline's limit, Dv ≤ 256).
// A key head's threadgroup owns every conv channel it reads: q and k channels kh·Dk .. (kh+1)·Dk (shared by its g
// value heads, convolved once into threadgroup memory) and the v channels of its value heads, so each channel's
// conv state is read and written by one thread and in-place states (conv_in = conv_out) are race-free.
// Thread (h, e) = value head j = kh·g + h, column e: the conv of v channel e, then column e of S as in
// gated_delta_scan (Dk registers, the same operation order), then the gated RMSNorm of head j over its Dv threads
// (simd_sum, one partial per simdgroup, as gated_rms_norm with Dvp threads). Every sum runs in the unfused kernels'
// order: the result is bit for bit theirs. mixed and delta_o are not written (nothing after the op reads them).
// Reads: qkv row (C floats), z, b, a rows, conv_w [C, K], A_log, dt_bias [Hv], norm_w [Dv], conv state [K-1, C],
// S [Hv·Dk, Dv]; writes the conv state, S and out [1, Hv·Dv]. Threadgroup memory 2·MaxDk + 32 floats (static).
// Floor (real model): S read + written once, 4 MiB per layer, as gated_delta_scan; the composed path also moves
// mixed and delta_o through memory (and 2 more dispatches and barriers). Hv·Dk·Dv·8 FLOPs.
struct ConvDeltaNormShape {
  uint k_heads, v_heads, Dk, Dv, K, head_threads;  // head_threads = Dvp
  uint ld_conv_in, ld_conv_out, ld_state_in, ld_state_out;
  float eps;
};

// The conv of channel c for one row (conv1d_silu with T = 1, same order): reads its K-1 state rows and x, writes
// the advanced state (after the reads: in place is safe, this thread owns the channel) and returns silu(acc).
inline float cdn_conv_channel(device const float* x, device const float* w, device const float* state_in,
                              device float* state_out, constant ConvDeltaNormShape& s, uint c) {
  constexpr uint kMaxTaps = 16;
  const uint S = s.K - 1;
  float hist[kMaxTaps];
  for (uint r = 0; r < S; ++r) hist[r] = state_in[ulong(r) * s.ld_conv_in + c];
  const float cur = x[c];
  float acc = 0.0f;
  for (uint j = 0; j < S; ++j) acc += w[ulong(c) * s.K + j] * hist[j];
  acc += w[ulong(c) * s.K + S] * cur;
  for (uint r = 0; r + 1 < S; ++r) state_out[ulong(r) * s.ld_conv_out + c] = hist[r + 1];
  if (S > 0) state_out[ulong(S - 1) * s.ld_conv_out + c] = cur;
  return delta_silu(acc);
}

// delta_sum_squares over threadgroup memory (the same order).
inline float cdn_sum_squares(threadgroup const float* a, uint n) {
  float part[16];
  for (uint l = 0; l < 16; ++l) part[l] = 0.0f;
  uint i = 0;
  for (; i + 16 <= n; i += 16)
    for (uint l = 0; l < 16; ++l) part[l] += a[i + l] * a[i + l];
  for (uint w = 8; w >= 1; w /= 2)
    for (uint l = 0; l < w; ++l) part[l] += part[l + w];
  float s = part[0];
  for (; i < n; ++i) s += a[i] * a[i];
  return s;
}

template <uint MaxDk>
[[kernel]] void conv_delta_norm(device const float* qkv [[buffer(0)]],
                                device const float* z [[buffer(1)]],
                                device const float* b [[buffer(2)]],
                                device const float* a [[buffer(3)]],
                                device const float* conv_w [[buffer(4)]],
                                device const float* A_log [[buffer(5)]],
                                device const float* dt_bias [[buffer(6)]],
                                device const float* norm_w [[buffer(7)]],
                                device const float* conv_in [[buffer(8)]],
                                device float* conv_out [[buffer(9)]],
                                device const float* state_in [[buffer(10)]],
                                device float* state_out [[buffer(11)]],
                                device float* out [[buffer(12)]],
                                constant ConvDeltaNormShape& s [[buffer(13)]],
                                uint kh [[threadgroup_position_in_grid]],
                                uint tid [[thread_position_in_threadgroup]],
                                uint threads [[threads_per_threadgroup]],
                                uint simdgroup [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float qk[2 * MaxDk];  // the key head's q then k after the conv
  threadgroup float partials[32];   // one sum of squares per simdgroup
  const uint Dk = s.Dk, Dv = s.Dv, key_dim = s.k_heads * Dk;
  const uint g = s.v_heads / s.k_heads, h = tid / s.head_threads, e = tid % s.head_threads;
  const uint j = kh * g + h;
  const bool live = e < Dv;  // the padding lanes of a head only join the barriers and the sums
  for (uint i = tid; i < 2 * Dk; i += threads) {
    const uint c = i < Dk ? kh * Dk + i : key_dim + kh * Dk + (i - Dk);
    qk[i] = cdn_conv_channel(qkv, conv_w, conv_in, conv_out, s, c);
  }
  const float v = live ? cdn_conv_channel(qkv, conv_w, conv_in, conv_out, s, 2 * key_dim + j * Dv + e) : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float o = 0.0f;
  if (live) {
    float S[MaxDk];
    for (uint i = 0; i < Dk; ++i) S[i] = state_in[(ulong(j) * Dk + i) * s.ld_state_in + e];
    threadgroup const float* q = qk;
    threadgroup const float* k = qk + Dk;
    const float rq = (1.0f / sqrt(float(Dk))) / sqrt(cdn_sum_squares(q, Dk) + 1e-6f);
    const float rk = 1.0f / sqrt(cdn_sum_squares(k, Dk) + 1e-6f);
    const float beta = delta_sigmoid(b[j]);
    const float alpha = exp(-exp(A_log[j]) * delta_softplus(a[j] + dt_bias[j]));
    float m = 0.0f;
    for (uint i = 0; i < Dk; ++i) {  // decay first, then read with the decayed state (as gated_delta_scan)
      S[i] *= alpha;
      m += (k[i] * rk) * S[i];
    }
    const float delta = beta * (v - m);
    for (uint i = 0; i < Dk; ++i) {
      S[i] += (k[i] * rk) * delta;
      o += (q[i] * rq) * S[i];
    }
    for (uint i = 0; i < Dk; ++i) state_out[(ulong(j) * Dk + i) * s.ld_state_out + e] = S[i];
  }

  // The gated RMSNorm of head j: its Dvp / 32 simdgroups' partials, summed as gated_rms_norm sums them.
  const float sq = simd_sum(o * o);
  if (lane == 0) partials[simdgroup] = sq;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint per_head = s.head_threads / 32;
  const float total = simd_sum(lane < per_head ? partials[h * per_head + lane] : 0.0f);
  const float r = 1.0f / sqrt(total / float(Dv) + s.eps);
  if (live) {
    const float zv = z[j * Dv + e];
    out[j * Dv + e] = norm_w[e] * (o * r) * (zv / (1.0f + exp(-zv)));
  }
}

template [[host_name("conv_delta_norm_32")]] [[kernel]] decltype(conv_delta_norm<32>) conv_delta_norm<32>;
template [[host_name("conv_delta_norm_64")]] [[kernel]] decltype(conv_delta_norm<64>) conv_delta_norm<64>;
template [[host_name("conv_delta_norm_128")]] [[kernel]] decltype(conv_delta_norm<128>) conv_delta_norm<128>;
template [[host_name("conv_delta_norm_256")]] [[kernel]] decltype(conv_delta_norm<256>) conv_delta_norm<256>;

// ---- The chunked (WY / UT-transform) form of gated_delta_scan: prefill calls of >= 64 rows without a capture ----
// Over a chunk of 64 rows with L_i = Σ_{t<=i} g_t (g = −exp(A_log)·softplus(a + dt_bias), the log of α) and S0 the
// state before it, the recurrence is exactly (benchmarks/NOTES.md, "Chunked DeltaNet prefill on CUDA"):
//   A_ij = β_i e^{L_i−L_j} k̂_i·k̂_j (j < i),  (I + A)[U | W] = [diag(β) V | diag(β e^L) K̂]  (forward substitution),
//   Δ = U − W S0,  o_i = e^{L_i} q̂_iᵀS0 + Σ_{j<=i} P_ij Δ_j with P_ij = e^{L_i−L_j} q̂_i·k̂_j,
//   S = e^{L_last} S0 + Σ_j e^{L_last−L_j} k̂_j Δ_jᵀ.
// Metal has no fp64: L is carried as an unevaluated sum of two floats (hi + lo, a compensated running sum), and only
// L_i and differences L_i − L_j = (hi_i − hi_j) + (lo_i − lo_j) <= 0 are exponentiated, so a chunk whose early decays
// are strong keeps the relative precision of its later ratios (no factor overflows).
// gated_delta_chunk_prep: grid (⌈T/64⌉, Hv), 256 threads. Per (chunk, value head) it writes one record of the
// workspace (floats): U [64, Dv], W [64, Dk], P [64, 64], then rows of 64: e^{L}, e^{L_last − L}, the q and k norm
// factors (rows past the chunk: zeros). Threads < 64 take a row's norms and gates, thread 0 the running sum, each
// thread 16 of the 64 × 64 (i, j) pairs (dot products over Dk read from qkv), then each thread whole columns of the
// solve, in place in the record (its own column only: no thread reads another's writes). Threadgroup memory: A
// [64, 64] and six rows of 64, 17.9 KB (static).
// gated_delta_chunk_scan: grid (⌈Dv/16⌉, Hv), 256 threads; threadgroup (x, j) keeps state columns [16x, 16x + 16) of
// value head j in threadgroup memory for the whole call (Dk·16 floats) and walks the chunks: (1) thread (i, q) =
// (tid / 4, tid % 4), row i, columns 4q..4q+3: Δ_i = U_i − W_i S0, e^{L_i}·q̂_iᵀS0; (2) o_i adds Σ_j P_ij Δ_j;
// (3) each thread updates entries of S (row d, column c): e^{L_last} S0 + Σ_j k̂_j[d] e^{L_last−L_j} Δ_j. Two barriers
// per chunk. Threadgroup memory Dk·16 + 2·64·16 floats, 24 KB at Dk = 256. Sums in ascending d and j: agrees with the
// scans to fp32 rounding, not bit for bit (the host reports the calls of each form).
// Reads: qkv [T, 2·Hk·Dk + Hv·Dv], b, a [T, Hv], A_log, dt_bias [Hv], state_in [Hv·Dk, Dv]; writes the records,
// out [T, Hv·Dv], state_out. Floor (real model, a 2K chunk): ~1 MFLOP per (chunk, head) in the prep and
// 2·64·Dk·Dv + 64·64·Dv + 64·Dk·Dv FMAs per (chunk, head) in the scan, ~15 GFLOP per layer in all, against the scans'
// T·Hv·Dk·Dv·8 FLOPs (~8.6 GFLOP) carried through 2K dependent steps.
struct DeltaChunkShape {
  uint T, k_heads, v_heads, Dk, Dv;
  uint ld_qkv, ld_b, ld_a, ld_out, ld_state_in, ld_state_out;
  uint rec_floats;  // one record: 64·(Dv + Dk + 64 + 4)
};

[[kernel]] void gated_delta_chunk_prep(device const float* qkv [[buffer(0)]],
                                       device const float* b [[buffer(1)]],
                                       device const float* a [[buffer(2)]],
                                       device const float* A_log [[buffer(3)]],
                                       device const float* dt_bias [[buffer(4)]],
                                       device float* rec [[buffer(5)]],
                                       constant DeltaChunkShape& s [[buffer(6)]],
                                       uint2 tg [[threadgroup_position_in_grid]],
                                       uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float sA[64 * 64];
  threadgroup float sRq[64], sRk[64], sBeta[64], sGate[64], sLh[64], sLl[64];
  const uint c = tg.x, j = tg.y, Dk = s.Dk, Dv = s.Dv;
  const uint t0 = c * 64, n = min(64u, s.T - t0);
  const uint heads_per_key = s.v_heads / s.k_heads, kh = j / heads_per_key, key_dim = s.k_heads * Dk;
  device float* R = rec + (ulong(c) * s.v_heads + j) * s.rec_floats;
  device float* P = R + 64 * (Dv + Dk);
  device float* fac = P + 64 * 64;  // e^{L} | e^{L_last − L} | rq | rk, 64 each
  if (tid < 64) {
    const uint r = tid;
    float rq = 0.0f, rk = 0.0f, beta = 0.0f, gate = 0.0f;
    if (r < n) {
      device const float* row = qkv + ulong(t0 + r) * s.ld_qkv;
      rq = (1.0f / sqrt(float(Dk))) / sqrt(delta_sum_squares(row + kh * Dk, Dk) + 1e-6f);
      rk = 1.0f / sqrt(delta_sum_squares(row + key_dim + kh * Dk, Dk) + 1e-6f);
      beta = delta_sigmoid(b[ulong(t0 + r) * s.ld_b + j]);
      gate = -exp(A_log[j]) * delta_softplus(a[ulong(t0 + r) * s.ld_a + j] + dt_bias[j]);
    }
    sRq[r] = rq, sRk[r] = rk, sBeta[r] = beta, sGate[r] = gate;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {  // the running sum of the log decays as hi + lo (TwoSum: the rounding error of each add kept)
    float hi = 0.0f, lo = 0.0f;
    for (uint i = 0; i < 64; ++i) {
      const float g = sGate[i];
      const float sum = hi + g, bv = sum - hi;
      lo += (hi - (sum - bv)) + (g - bv);
      hi = sum;
      sLh[i] = hi, sLl[i] = lo;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < 64 * 64; e += 256) {
    const uint i = e / 64, jj = e % 64;
    float p = 0.0f, av = 0.0f;
    if (i < n && jj <= i) {
      device const float* qi = qkv + ulong(t0 + i) * s.ld_qkv + kh * Dk;
      device const float* ki = qkv + ulong(t0 + i) * s.ld_qkv + key_dim + kh * Dk;
      device const float* kj = qkv + ulong(t0 + jj) * s.ld_qkv + key_dim + kh * Dk;
      float qk = 0.0f, kk = 0.0f;
      for (uint d = 0; d < Dk; ++d) {
        qk += qi[d] * kj[d];
        kk += ki[d] * kj[d];
      }
      const float dec = exp((sLh[i] - sLh[jj]) + (sLl[i] - sLl[jj]));
      p = dec * (sRq[i] * sRk[jj] * qk);
      if (jj < i) av = sBeta[i] * dec * (sRk[i] * sRk[jj] * kk);
    }
    P[e] = p;
    sA[e] = av;
  }
  if (tid < 64) {
    const bool live = tid < n;
    fac[tid] = live ? exp(sLh[tid] + sLl[tid]) : 0.0f;
    fac[64 + tid] = live ? exp((sLh[n - 1] - sLh[tid]) + (sLl[n - 1] - sLl[tid])) : 0.0f;
    fac[128 + tid] = sRq[tid];
    fac[192 + tid] = sRk[tid];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
  // The solve, a column per thread, in place: U's columns (pitch Dv) then W's (pitch Dk).
  for (uint col = tid; col < Dv + Dk; col += 256) {
    const bool is_u = col < Dv;
    device float* x = is_u ? R + col : R + 64 * Dv + (col - Dv);
    const uint pitch = is_u ? Dv : Dk;
    for (uint i = 0; i < 64; ++i) {
      float acc = 0.0f;
      if (i < n) {
        device const float* row = qkv + ulong(t0 + i) * s.ld_qkv;
        acc = is_u ? sBeta[i] * row[2 * key_dim + j * Dv + col]
                   : sBeta[i] * exp(sLh[i] + sLl[i]) * (sRk[i] * row[key_dim + kh * Dk + (col - Dv)]);
        for (uint jj = 0; jj < i; ++jj) acc -= sA[i * 64 + jj] * x[jj * pitch];
      }
      x[i * pitch] = acc;
    }
  }
}

[[kernel]] void gated_delta_chunk_scan(device const float* qkv [[buffer(0)]],
                                       device const float* rec [[buffer(1)]],
                                       device const float* state_in [[buffer(2)]],
                                       device float* state_out [[buffer(3)]],
                                       device float* out [[buffer(4)]],
                                       constant DeltaChunkShape& s [[buffer(5)]],
                                       uint2 tg [[threadgroup_position_in_grid]],
                                       uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float sS[256 * 16];  // [Dk, 16] (Dk <= 256)
  threadgroup float sD[64 * 16], sDk[64 * 16];
  const uint Dk = s.Dk, Dv = s.Dv, j = tg.y, c0 = tg.x * 16;
  const uint heads_per_key = s.v_heads / s.k_heads, kh = j / heads_per_key, key_dim = s.k_heads * Dk;
  for (uint e = tid; e < Dk * 16; e += 256) {
    const uint d = e / 16, cc = c0 + e % 16;
    sS[e] = cc < Dv ? state_in[(ulong(j) * Dk + d) * s.ld_state_in + cc] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint i = tid / 4, q = tid % 4;
  const uint chunks = (s.T + 63) / 64;
  for (uint c = 0; c < chunks; ++c) {
    const uint t0 = c * 64, n = min(64u, s.T - t0);
    device const float* R = rec + (ulong(c) * s.v_heads + j) * s.rec_floats;
    device const float* W = R + 64 * Dv;
    device const float* P = W + 64 * Dk;
    device const float* fac = P + 64 * 64;
    // (1) Δ and the decayed read of q̂ (rows past the chunk have zero U, W and factors: Δ = 0)
    float o[4];
    {
      float w[4] = {0.0f, 0.0f, 0.0f, 0.0f}, qs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      device const float* qrow = qkv + ulong(t0 + min(i, n - 1)) * s.ld_qkv + kh * Dk;
      const float rq = fac[128 + i];
      for (uint d = 0; d < Dk; ++d) {
        const float wv = W[i * Dk + d], qv = qrow[d] * rq;
        for (uint u = 0; u < 4; ++u) {
          const float sv = sS[d * 16 + 4 * q + u];
          w[u] += wv * sv;
          qs[u] += qv * sv;
        }
      }
      const float g = fac[i], ks = fac[64 + i];
      for (uint u = 0; u < 4; ++u) {
        const uint cc = c0 + 4 * q + u;
        const float dl = cc < Dv ? R[i * Dv + cc] - w[u] : 0.0f;
        sD[i * 16 + 4 * q + u] = dl;
        sDk[i * 16 + 4 * q + u] = ks * dl;
        o[u] = g * qs[u];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (i < n) {  // (2)
      for (uint jj = 0; jj <= i; ++jj) {
        const float p = P[i * 64 + jj];
        for (uint u = 0; u < 4; ++u) o[u] += p * sD[jj * 16 + 4 * q + u];
      }
      for (uint u = 0; u < 4; ++u) {
        const uint cc = c0 + 4 * q + u;
        if (cc < Dv) out[ulong(t0 + i) * s.ld_out + j * Dv + cc] = o[u];
      }
    }
    const float gl = fac[n - 1];
    for (uint e = tid; e < Dk * 16; e += 256) {  // (3): entries (d, column) owned by one thread
      const uint d = e / 16, cc = e % 16;
      float acc = gl * sS[e];
      for (uint jj = 0; jj < n; ++jj)
        acc += (qkv[ulong(t0 + jj) * s.ld_qkv + key_dim + kh * Dk + d] * fac[192 + jj]) * sDk[jj * 16 + cc];
      sS[e] = acc;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint e = tid; e < Dk * 16; e += 256) {
    const uint d = e / 16, cc = c0 + e % 16;
    if (cc < Dv) state_out[(ulong(j) * Dk + d) * s.ld_state_out + cc] = sS[e];
  }
}
