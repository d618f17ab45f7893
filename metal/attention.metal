// Gated full attention (MODEL.md §4; oracle csrc/cpu/attention.cpp; host csrc/metal/attention.cpp).
//   attn_qk_prep: per query head h: q = rope(rmsnorm(qg[t, h·2D .. h·2D + D]) · q_norm), gate = qg[t, h·2D + D ..];
//                 per kv head: k = rope(rmsnorm(k[t, h·D ..]) · k_norm); rope rotates pairs (i, i + rd/2), i < rd/2,
//                 by (pos[0] + t) · inv_freq[i] (decode fusion c). inv_freq [rd/2] f32 comes from the host, computed
//                 as the CPU does (in double, rounded once), so no float pow drifts the angle; the angle itself is
//                 pos · inv_freq exactly (a two-product with fma) reduced by 2π in three fma steps, which keeps
//                 the float sin/cos within an ulp or two of the CPU's double ones at any position below 2^24.
//                 Grid (heads + kv_heads, T), one simdgroup: lanes stride over D.
//   kv_append:    k_cache[h·max_ctx + pos[0] + t] = k[t, h·D ..] (and v), f32 or bf16 (function constant 10);
//                 rows past max_ctx are never written. Grid (⌈D/64⌉, kv_heads, T), 64 threads.
//   attention_rows: out[t, h] = softmax_j(q·k_j / √D) · v_j · sigmoid(gate), j ≤ pos[0] + t, kv head h / group.
//                 Grid (heads, T), one simdgroup per (t, h): blocks of 32 cached rows, lane l scores row j0 + l,
//                 an online softmax (running max and sum, fp32) and lane l accumulates dims l, l + 32, ... of
//                 the output. The simplest correct variant: each K/V row is read once per query head (no GQA
//                 packing yet) and K rows are read by one lane each (not coalesced).
// Buffers: qg f32 [T, heads·2D], k f32 [T, kv·D] (rows strided); caches [kv · max_ctx, D]; pos I32 [1, 1].
// Function constants 10-19 belong to this file: 10 attn_kv_bf16 (the cache holds bf16).
//   attention_split + attention_split_reduce: decode over long contexts in fixed blocks of rows (below).
// Floor per decode step: 2 · kv · (pos + 1) · D · (4 | 2) bytes of cache; attention_rows reads it group = heads/kv
// times (2 · 8 with the real model's 16 heads over 2 kv heads).
#include <metal_stdlib>
using namespace metal;

constant bool attn_kv_bf16 [[function_constant(10)]];

// Shared with csrc/metal/attention.cpp.
struct QkPrepShape {
  uint heads, kv_heads, D, rd;
  uint ld_qg, ld_k, ld_q, ld_gate, ld_ko;
  float eps;
};

struct KvShape {
  uint kv_heads, D, max_ctx, T;
  uint ld_k, ld_v;
};

struct AttnShape {
  uint heads, kv_heads, D, max_ctx;
  uint ld_q, ld_gate, ld_out;
  float scale;
};

struct SplitShape {
  uint heads, kv_heads, D, max_ctx;
  uint ld_q, ld_gate, ld_out;
  uint block, blocks, min_split;  // rows per block, blocks per row of partials (⌈max_ctx / block⌉), split from
  float scale;
};

[[kernel]] void attn_qk_prep(device const float* qg [[buffer(0)]],
                             device const float* k [[buffer(1)]],
                             device const float* q_norm [[buffer(2)]],
                             device const float* k_norm [[buffer(3)]],
                             device const int* pos [[buffer(4)]],
                             constant float* inv_freq [[buffer(5)]],
                             device float* q_out [[buffer(6)]],
                             device float* gate_out [[buffer(7)]],
                             device float* k_out [[buffer(8)]],
                             constant QkPrepShape& s [[buffer(9)]],
                             uint2 tg [[threadgroup_position_in_grid]],
                             uint lane [[thread_index_in_simdgroup]]) {
  const uint head = tg.x, t = tg.y, D = s.D;
  const bool is_q = head < s.heads;
  const uint h = is_q ? head : head - s.heads;
  device const float* src = is_q ? qg + ulong(t) * s.ld_qg + h * 2 * D : k + ulong(t) * s.ld_k + h * D;
  device const float* w = is_q ? q_norm : k_norm;
  device float* dst = is_q ? q_out + ulong(t) * s.ld_q + h * D : k_out + ulong(t) * s.ld_ko + h * D;
  float sq = 0.0f;
  for (uint i = lane; i < D; i += 32) sq += src[i] * src[i];
  const float r = 1.0f / sqrt(simd_sum(sq) / float(D) + s.eps);
  const uint half_rd = s.rd / 2;
  const float p = float(pos[0] + int(t));
  for (uint i = lane; i < half_rd; i += 32) {
    // angle = p · inv_freq exactly as hi + lo, then hi reduced by 2π = C1 + C2 + C3 (fma Cody-Waite).
    const float f = inv_freq[i];
    const float hi = p * f, lo = fma(p, f, -hi);
    const float n = rint(hi * 0.15915494309189535f);
    float a = fma(-n, 6.28318548202514648f, hi);
    a = fma(-n, -1.74845553e-7f, a);
    a = fma(-n, -6.86049798e-15f, a);
    a += lo;
    const float c = cos(a), sn = sin(a);
    const float x0 = src[i] * r * w[i], x1 = src[i + half_rd] * r * w[i + half_rd];
    dst[i] = x0 * c - x1 * sn;
    dst[i + half_rd] = x1 * c + x0 * sn;
  }
  for (uint i = s.rd + lane; i < D; i += 32) dst[i] = src[i] * r * w[i];
  if (is_q)
    for (uint i = lane; i < D; i += 32) gate_out[ulong(t) * s.ld_gate + h * D + i] = src[D + i];
}

inline ushort attn_f32_to_bf16(float f) {
  uint u = as_type<uint>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ushort((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return ushort(u >> 16);
}

[[kernel]] void kv_append(device const float* k [[buffer(0)]],
                          device const float* v [[buffer(1)]],
                          device const int* pos [[buffer(2)]],
                          device uchar* k_cache [[buffer(3)]],
                          device uchar* v_cache [[buffer(4)]],
                          constant KvShape& s [[buffer(5)]],
                          uint3 tg [[threadgroup_position_in_grid]],
                          uint i_in [[thread_index_in_threadgroup]]) {
  const uint e = tg.x * 64 + i_in, h = tg.y, t = tg.z;
  const int at = pos[0] + int(t);
  if (e >= s.D || at < 0 || uint(at) >= s.max_ctx) return;
  const ulong row = ulong(h) * s.max_ctx + uint(at);
  const float kv = k[ulong(t) * s.ld_k + h * s.D + e], vv = v[ulong(t) * s.ld_v + h * s.D + e];
  if (attn_kv_bf16) {
    ((device ushort*)k_cache)[row * s.D + e] = attn_f32_to_bf16(kv);
    ((device ushort*)v_cache)[row * s.D + e] = attn_f32_to_bf16(vv);
  } else {
    ((device float*)k_cache)[row * s.D + e] = kv;
    ((device float*)v_cache)[row * s.D + e] = vv;
  }
}

inline float attn_cache(device const uchar* cache, ulong i) {
  return attn_kv_bf16 ? as_type<float>(uint(((device const ushort*)cache)[i]) << 16)
                      : ((device const float*)cache)[i];
}

[[kernel]] void attention_rows(device const float* q [[buffer(0)]],
                               device const float* gate [[buffer(1)]],
                               device const uchar* k_cache [[buffer(2)]],
                               device const uchar* v_cache [[buffer(3)]],
                               device const int* pos [[buffer(4)]],
                               device float* out [[buffer(5)]],
                               constant AttnShape& s [[buffer(6)]],
                               uint2 tg [[threadgroup_position_in_grid]],
                               uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint kMaxDimsPerLane = 16;  // D <= 512
  const uint h = tg.x, t = tg.y, D = s.D, kvh = h / (s.heads / s.kv_heads);
  const uint n = min(uint(pos[0]) + t + 1, s.max_ctx);
  device const float* qh = q + ulong(t) * s.ld_q + h * D;
  const ulong cache0 = ulong(kvh) * s.max_ctx * D;
  float acc[kMaxDimsPerLane];
  for (uint m = 0; m < kMaxDimsPerLane; ++m) acc[m] = 0.0f;
  float run_max = -INFINITY, run_sum = 0.0f;
  for (uint j0 = 0; j0 < n; j0 += 32) {
    const uint j = j0 + lane;
    float score = -INFINITY;
    if (j < n) {
      float d = 0.0f;
      for (uint e = 0; e < D; ++e) d += qh[e] * attn_cache(k_cache, cache0 + ulong(j) * D + e);
      score = d * s.scale;
    }
    const float new_max = max(run_max, simd_max(score));
    const float corr = exp(run_max - new_max);
    const float p = j < n ? exp(score - new_max) : 0.0f;
    run_sum = run_sum * corr + simd_sum(p);
    run_max = new_max;
    for (uint m = 0; m < kMaxDimsPerLane; ++m) acc[m] *= corr;
    const uint rows = min(32u, n - j0);
    for (uint jj = 0; jj < rows; ++jj) {
      const float pj = simd_broadcast(p, ushort(jj));
      const ulong vrow = cache0 + ulong(j0 + jj) * D;
      for (uint m = 0; m * 32 + lane < D; ++m) acc[m] += pj * attn_cache(v_cache, vrow + m * 32 + lane);
    }
  }
  for (uint m = 0; m * 32 + lane < D; ++m) {
    const uint e = m * 32 + lane;
    const float g = gate[ulong(t) * s.ld_gate + h * D + e];
    out[ulong(t) * s.ld_out + h * D + e] = (acc[m] / run_sum) / (1.0f + exp(-g));
  }
}

// attention_gqa: the same result as attention_rows, GQA-packed with coalesced cache reads: one simdgroup takes up to
// 4 query heads that share a kv head, lane l holds dims l, l + 32, ... of each cached K and V row (adjacent lanes read
// adjacent words), so every cached row is read once for its 4 heads instead of once per head. Per row: 4 partial
// dot products, 4 simd_sums, an online softmax per head, 4 accumulations from the one V row. Grid
// (kv_heads · ⌈group/4⌉, T), 32 threads. Decode reads 2 · kv · (pos + 1) · D · (4 | 2) · ⌈group/4⌉ bytes of cache
// (2× the floor with the real model's group of 8). Long decode contexts take attention_split below instead.
[[kernel]] void attention_gqa(device const float* q [[buffer(0)]],
                              device const float* gate [[buffer(1)]],
                              device const uchar* k_cache [[buffer(2)]],
                              device const uchar* v_cache [[buffer(3)]],
                              device const int* pos [[buffer(4)]],
                              device float* out [[buffer(5)]],
                              constant AttnShape& s [[buffer(6)]],
                              uint2 tg [[threadgroup_position_in_grid]],
                              uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint kHeads = 4, kMaxDimsPerLane = 16;  // D <= 512
  const uint group = s.heads / s.kv_heads, packs = (group + kHeads - 1) / kHeads;
  const uint kvh = tg.x / packs, h0 = kvh * group + (tg.x % packs) * kHeads, t = tg.y, D = s.D;
  const uint nh = min(kHeads, kvh * group + group - h0);
  const uint n = min(uint(pos[0]) + t + 1, s.max_ctx);
  const uint dims = (D + 31) / 32;
  float qv[kHeads][kMaxDimsPerLane], acc[kHeads][kMaxDimsPerLane];
  float run_max[kHeads], run_sum[kHeads];
  for (uint h = 0; h < kHeads; ++h) {
    run_max[h] = -INFINITY;
    run_sum[h] = 0.0f;
    for (uint m = 0; m < kMaxDimsPerLane; ++m) {
      const uint e = m * 32 + lane;
      qv[h][m] = h < nh && m < dims && e < D ? q[ulong(t) * s.ld_q + (h0 + h) * D + e] : 0.0f;
      acc[h][m] = 0.0f;
    }
  }
  const ulong cache0 = ulong(kvh) * s.max_ctx * D;
  for (uint j = 0; j < n; ++j) {
    float kv[kMaxDimsPerLane], vv[kMaxDimsPerLane];
    for (uint m = 0; m < dims; ++m) {
      const uint e = m * 32 + lane;
      kv[m] = e < D ? attn_cache(k_cache, cache0 + ulong(j) * D + e) : 0.0f;
      vv[m] = e < D ? attn_cache(v_cache, cache0 + ulong(j) * D + e) : 0.0f;
    }
    for (uint h = 0; h < nh; ++h) {
      float d = 0.0f;
      for (uint m = 0; m < dims; ++m) d += qv[h][m] * kv[m];
      const float score = simd_sum(d) * s.scale;
      const float new_max = max(run_max[h], score);
      const float corr = exp(run_max[h] - new_max), p = exp(score - new_max);
      run_sum[h] = run_sum[h] * corr + p;
      run_max[h] = new_max;
      for (uint m = 0; m < dims; ++m) acc[h][m] = acc[h][m] * corr + p * vv[m];
    }
  }
  for (uint h = 0; h < nh; ++h)
    for (uint m = 0; m < dims; ++m) {
      const uint e = m * 32 + lane;
      if (e >= D) continue;
      const float g = gate[ulong(t) * s.ld_gate + (h0 + h) * D + e];
      out[ulong(t) * s.ld_out + (h0 + h) * D + e] = (acc[h][m] / run_sum[h]) / (1.0f + exp(-g));
    }
}

// attention_split: the first half of decode attention over a long context, cut into fixed blocks of s.block rows
// (block b holds cached rows [b · block, (b + 1) · block): a row's block never depends on the context length, so
// the result is deterministic). One simdgroup per (kv head, pack of up to 4 query heads, block, token), walking its
// block as attention_gqa walks the whole context (coalesced rows, 4 heads per row read), and writing the block's
// partial for each head: running max m, running sum l and the unnormalised accumulator acc[D].
// Contexts shorter than s.min_split rows are not split: block 0 then walks every row and the other blocks are
// empty (they write nothing and the reduce reads block 0 only), so the host can encode one form for any position.
// Shapes: q, gate f32 [T, heads · D] (rows strided); caches [kv · max_ctx, D] f32 or bf16 (function constant 10);
// pos I32 [1]. Writes: part f32 [T, heads, s.blocks, 2 + D] (m, l, acc), the workspace.
// Grid (kv_heads · ⌈group/4⌉, s.blocks, T), 32 threads. Reads 2 · kv · (pos + 1) · D · (4 | 2) · ⌈group/4⌉ bytes of
// cache (as attention_gqa) and writes heads · ⌈(pos + 1) / block⌉ · (D + 2) · 4 bytes of partials.
inline uint attn_split_count(uint n, constant SplitShape& s) {
  return n >= s.min_split ? (n + s.block - 1) / s.block : 1u;
}

[[kernel]] void attention_split(device const float* q [[buffer(0)]],
                                device const uchar* k_cache [[buffer(1)]],
                                device const uchar* v_cache [[buffer(2)]],
                                device const int* pos [[buffer(3)]],
                                device float* part [[buffer(4)]],
                                constant SplitShape& s [[buffer(5)]],
                                uint3 tg [[threadgroup_position_in_grid]],
                                uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint kHeads = 4, kMaxDimsPerLane = 16;  // D <= 512
  const uint group = s.heads / s.kv_heads, packs = (group + kHeads - 1) / kHeads;
  const uint kvh = tg.x / packs, h0 = kvh * group + (tg.x % packs) * kHeads, b = tg.y, t = tg.z, D = s.D;
  const uint nh = min(kHeads, kvh * group + group - h0);
  const uint n = min(uint(pos[0]) + t + 1, s.max_ctx);
  const bool split = n >= s.min_split;
  // This block's rows [j0, j1); empty (j0 == j1) past the context, or for b > 0 when the context is not split.
  const uint j0 = split ? min(b * s.block, n) : (b == 0 ? 0u : n);
  const uint j1 = split ? min(j0 + s.block, n) : n;
  const uint dims = (D + 31) / 32;
  float qv[kHeads][kMaxDimsPerLane], acc[kHeads][kMaxDimsPerLane];
  float run_max[kHeads], run_sum[kHeads];
  for (uint h = 0; h < kHeads; ++h) {
    run_max[h] = -INFINITY;
    run_sum[h] = 0.0f;
    for (uint m = 0; m < kMaxDimsPerLane; ++m) {
      const uint e = m * 32 + lane;
      qv[h][m] = h < nh && m < dims && e < D ? q[ulong(t) * s.ld_q + (h0 + h) * D + e] : 0.0f;
      acc[h][m] = 0.0f;
    }
  }
  const ulong cache0 = ulong(kvh) * s.max_ctx * D;
  for (uint j = j0; j < j1; ++j) {
    float kv[kMaxDimsPerLane], vv[kMaxDimsPerLane];
    for (uint m = 0; m < dims; ++m) {
      const uint e = m * 32 + lane;
      kv[m] = e < D ? attn_cache(k_cache, cache0 + ulong(j) * D + e) : 0.0f;
      vv[m] = e < D ? attn_cache(v_cache, cache0 + ulong(j) * D + e) : 0.0f;
    }
    for (uint h = 0; h < nh; ++h) {
      float d = 0.0f;
      for (uint m = 0; m < dims; ++m) d += qv[h][m] * kv[m];
      const float score = simd_sum(d) * s.scale;
      const float new_max = max(run_max[h], score);
      const float corr = exp(run_max[h] - new_max), p = exp(score - new_max);
      run_sum[h] = run_sum[h] * corr + p;
      run_max[h] = new_max;
      for (uint m = 0; m < dims; ++m) acc[h][m] = acc[h][m] * corr + p * vv[m];
    }
  }
  // An empty block writes nothing: the reduce never reads it.
  const uint stride = D + 2;
  for (uint h = 0; h < (j0 < j1 ? nh : 0u); ++h) {
    device float* p = part + ((ulong(t) * s.heads + h0 + h) * s.blocks + b) * stride;
    if (lane == 0) {
      p[0] = run_max[h];
      p[1] = run_sum[h];
    }
    for (uint m = 0; m < dims; ++m) {
      const uint e = m * 32 + lane;
      if (e < D) p[2 + e] = acc[h][m];
    }
  }
}

// attention_split_reduce: the second half. Per (token, query head) the blocks' partials combine in block order
// (fixed, so deterministic) by the log-sum-exp rescale: M = max_b m_b, L = Σ_b l_b · e^(m_b − M),
// o = Σ_b acc_b · e^(m_b − M) / L; then the output gate as attention_gqa: out = o · sigmoid(gate).
// Reads part f32 [T, heads, s.blocks, 2 + D] (blocks 0 .. attn_split_count(n) − 1 only), gate; writes out
// f32 [T, heads · D]. Grid (heads, T), 32 threads: lane l takes dims l, l + 32, ... . Reads and writes
// heads · ⌈(pos + 1) / block⌉ · (D + 2) · 4 bytes of partials plus the gate and the output.
[[kernel]] void attention_split_reduce(device const float* part [[buffer(0)]],
                                       device const float* gate [[buffer(1)]],
                                       device const int* pos [[buffer(2)]],
                                       device float* out [[buffer(3)]],
                                       constant SplitShape& s [[buffer(4)]],
                                       uint2 tg [[threadgroup_position_in_grid]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  const uint h = tg.x, t = tg.y, D = s.D, stride = D + 2;
  const uint n = min(uint(pos[0]) + t + 1, s.max_ctx);
  const uint count = attn_split_count(n, s);
  device const float* p0 = part + (ulong(t) * s.heads + h) * s.blocks * stride;
  float M = -INFINITY;
  for (uint b = 0; b < count; ++b) M = max(M, p0[ulong(b) * stride]);
  float L = 0.0f;
  for (uint b = 0; b < count; ++b) L += p0[ulong(b) * stride + 1] * exp(p0[ulong(b) * stride] - M);
  for (uint e = lane; e < D; e += 32) {
    float o = 0.0f;
    for (uint b = 0; b < count; ++b) o += p0[ulong(b) * stride + 2 + e] * exp(p0[ulong(b) * stride] - M);
    const float g = gate[ulong(t) * s.ld_gate + h * D + e];
    out[ulong(t) * s.ld_out + h * D + e] = (o / L) / (1.0f + exp(-g));
  }
}
