// 4-bit affine matrix-vector product, the decode shape: y[rows] = W[rows, cols] · x[cols].
// W in MLX's layout: codes uint32 [rows, cols/8] (element 8k+j in nibble j of word k, low nibble first),
// scales and biases [rows, cols/group] in bf16 (qmv4_bf16) or f16 (qmv4_f16); value = scale · code + bias.
// x and y are float32; x must be 16-byte aligned. The group size is function constant 0 (32, 64 or 128); the input
// width is function constant 4 where the host specialises the pipeline by shape (csrc/metal/matmul.cpp does, one
// pipeline per K: the row's word count and group count become compile-time constants), else Qmv4Shape::cols.
// Threadgroup: 2 simdgroups of 32 lanes, 4 rows per simdgroup; lane l reads words l, l+32, ... of its rows,
// and one simd_sum per row finishes the dot product.
// Floor: streams rows·cols/2 bytes of codes plus rows·cols/group·2·2 bytes of scales and biases
// (x stays in cache); 2·rows·cols FLOPs. Bandwidth-bound.
#include <metal_stdlib>
using namespace metal;

constant uint qmv4_group [[function_constant(0)]];
constant uint qmv4_cols_constant [[function_constant(4)]];
// 0: not specialised, the kernels read the width from their shape argument.
constant uint qmv4_cols_fixed = is_function_constant_defined(qmv4_cols_constant) ? qmv4_cols_constant : 0u;

// Shared with csrc/metal/matmul.cpp (same field order and sizes).
struct Qmv4Shape {
  uint rows;
  uint cols;
};

// Rows row0 .. row0 + 3 of one matrix (one simdgroup's share): the body of qmv4 and qmv4_multi, so a product
// gives the same bits in either kernel.
template <typename S>
inline void qmv4_rows(device const uint* codes, device const S* scales, device const S* biases,
                      device const float* x, device float* y, uint rows, uint cols, uint row0, uint lane,
                      uint width) {
  constexpr uint rows_per_simdgroup = 4;
  const uint words = cols / 8;
  const uint groups = cols / qmv4_group;
  const uint words_per_group = qmv4_group / 8;

  float acc[rows_per_simdgroup] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (uint w = lane; w < words; w += width) {
    const device float4* xv = (const device float4*)(x + 8 * w);
    const float4 x_lo = xv[0];
    const float4 x_hi = xv[1];
    // Σ (s·q + b)·x over the word's 8 elements = s·Σ q·x + b·Σ x: one multiply per element.
    const float x_sum = (x_lo.x + x_lo.y) + (x_lo.z + x_lo.w) + (x_hi.x + x_hi.y) + (x_hi.z + x_hi.w);
    const uint g = w / words_per_group;
    for (uint r = 0; r < rows_per_simdgroup; ++r) {
      // Rows past the end repeat the last row (kept uniform for simd_sum) and are never written.
      const uint row = min(row0 + r, rows - 1);
      const uint q = codes[row * words + w];
      const float4 q_lo = float4((uint4(q) >> uint4(0, 4, 8, 12)) & 0xfu);
      const float4 q_hi = float4((uint4(q) >> uint4(16, 20, 24, 28)) & 0xfu);
      const float qx = dot(q_lo, x_lo) + dot(q_hi, x_hi);
      const float scale = float(scales[row * groups + g]);
      const float bias = float(biases[row * groups + g]);
      acc[r] += scale * qx + bias * x_sum;
    }
  }
  for (uint r = 0; r < rows_per_simdgroup; ++r) {
    const float total = simd_sum(acc[r]);
    if (lane == 0 && row0 + r < rows) y[row0 + r] = total;
  }
}

template <typename S>
[[kernel]] void qmv4(device const uint* codes [[buffer(0)]],
                     device const S* scales [[buffer(1)]],
                     device const S* biases [[buffer(2)]],
                     device const float* x [[buffer(3)]],
                     device float* y [[buffer(4)]],
                     constant Qmv4Shape& shape [[buffer(5)]],
                     uint group_id [[threadgroup_position_in_grid]],
                     uint simdgroup [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]],
                     uint width [[threads_per_simdgroup]]) {
  const uint row0 = (group_id * 2 + simdgroup) * 4;  // 2 simdgroups × 4 rows
  const uint cols = qmv4_cols_fixed ? qmv4_cols_fixed : shape.cols;
  qmv4_rows<S>(codes, scales, biases, x, y, shape.rows, cols, row0, lane, width);
}

template [[host_name("qmv4_bf16")]] [[kernel]] decltype(qmv4<bfloat>) qmv4<bfloat>;
template [[host_name("qmv4_f16")]] [[kernel]] decltype(qmv4<half>) qmv4<half>;

// ------------------------------------------------------------------------------------------------------------
// qmv4_multi: up to four 4-bit products of one x in one dispatch (Ops::matmuls at a decode row: a DeltaNet layer's
// qkv, z, b, a; attention's q, k, v): y_p[rows_p] = W_p[rows_p, cols] · x[cols], p < products.
// Reads: W_p's codes, scales, biases (buffers 0-3, 4-7, 8-11: product p in slot p; unused slots repeat product 0 and
// are never touched), x (12). Writes: y_p (13-16). All products share cols, the scale type and the group size
// (function constant 0), which is what lets one pipeline run them.
// Grid: Σ_p ⌈rows_p / 8⌉ threadgroups of 64 threads; threadgroup g serves product p = #{i ≥ 1 : g ≥ start_i}
// (start_i: the prefix of ⌈rows / 8⌉ over products before i; unused starts equal the total, never reached) and
// runs exactly qmv4's threadgroup g − start_p on it (qmv4_rows), so every product's bits equal its own qmv4.
// Floor: the products' qmv4 floors summed (x stays in cache); one dispatch instead of `products`.
struct Qmv4GroupShape {
  uint cols;
  uint products;
  uint rows0;
  uint rows1;
  uint rows2;
  uint rows3;
  uint start1;
  uint start2;
  uint start3;
};

template <typename S>
[[kernel]] void qmv4_multi(device const uint* codes0 [[buffer(0)]],
                           device const uint* codes1 [[buffer(1)]],
                           device const uint* codes2 [[buffer(2)]],
                           device const uint* codes3 [[buffer(3)]],
                           device const S* scales0 [[buffer(4)]],
                           device const S* scales1 [[buffer(5)]],
                           device const S* scales2 [[buffer(6)]],
                           device const S* scales3 [[buffer(7)]],
                           device const S* biases0 [[buffer(8)]],
                           device const S* biases1 [[buffer(9)]],
                           device const S* biases2 [[buffer(10)]],
                           device const S* biases3 [[buffer(11)]],
                           device const float* x [[buffer(12)]],
                           device float* y0 [[buffer(13)]],
                           device float* y1 [[buffer(14)]],
                           device float* y2 [[buffer(15)]],
                           device float* y3 [[buffer(16)]],
                           constant Qmv4GroupShape& shape [[buffer(17)]],
                           uint group_id [[threadgroup_position_in_grid]],
                           uint simdgroup [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint width [[threads_per_simdgroup]]) {
  // Uniform per threadgroup: every lane takes the same product, so the simd_sums stay convergent.
  const uint p = uint(group_id >= shape.start1) + uint(group_id >= shape.start2) + uint(group_id >= shape.start3);
  const uint start = p == 0 ? 0u : p == 1 ? shape.start1 : p == 2 ? shape.start2 : shape.start3;
  const uint rows = p == 0 ? shape.rows0 : p == 1 ? shape.rows1 : p == 2 ? shape.rows2 : shape.rows3;
  device const uint* codes = p == 0 ? codes0 : p == 1 ? codes1 : p == 2 ? codes2 : codes3;
  device const S* scales = p == 0 ? scales0 : p == 1 ? scales1 : p == 2 ? scales2 : scales3;
  device const S* biases = p == 0 ? biases0 : p == 1 ? biases1 : p == 2 ? biases2 : biases3;
  device float* y = p == 0 ? y0 : p == 1 ? y1 : p == 2 ? y2 : y3;
  const uint row0 = ((group_id - start) * 2 + simdgroup) * 4;  // qmv4's geometry inside product p
  const uint cols = qmv4_cols_fixed ? qmv4_cols_fixed : shape.cols;
  qmv4_rows<S>(codes, scales, biases, x, y, rows, cols, row0, lane, width);
}

template [[host_name("qmv4_multi_bf16")]] [[kernel]] decltype(qmv4_multi<bfloat>) qmv4_multi<bfloat>;
template [[host_name("qmv4_multi_f16")]] [[kernel]] decltype(qmv4_multi<half>) qmv4_multi<half>;

// ------------------------------------------------------------------------------------------------------------
// Every weight format, any number of rows: the general products of the Metal backend (csrc/metal/matmul.cpp).
// A weight is dense f32 / f16 / bf16 [N, K] or MLX affine (4 or 8 bits, LSB first, one scale and bias per group
// of inputs, f16 or bf16). Its parts are bound at a 16-byte aligned byte offset and located by the element
// offsets of WeightRef (codes in uint32 words, scales and biases in 2-byte elements, dense in elements); stacked
// experts add element strides. Function constants 1-3: mm_format (0 f32, 1 f16, 2 bf16, 4 / 8 affine bits),
// mm_group (affine group size), mm_scale_bf16 (affine scales: bf16, else f16).
//
//   embed_rows:   out[t, i] = W[ids[t], i]                       grid (⌈K/64⌉, T), 64 threads, one element each
//   matmul_rows:  y[t, n] = Σ_k x[t, k] · W[n, k]                grid (⌈N/8⌉, T), 2 simdgroups × 4 rows; lane l
//                 takes words (affine) or elements (dense) l, l + 32, ...; one simd_sum per row. The sum order
//                 depends on K and the format only, never on T (prefill chunks agree bitwise).
//   moe_gate_up:  act[p, i] = silu(gate_e(x_t)[i]) · up_e(x_t)[i], p = t·k + s, e = ids[t, s]   (decode fusion a)
//                 grid (⌈I/8⌉, T·k), same geometry; the act rows live in the workspace [T·k, I]
//   moe_down:     out[t, c] = Σ_s w[t, s] · down_e(act[t·k + s])[c], slots in ascending expert id (the CPU's order,
//                 csrc/cpu/moe.cpp), routing weight applied in registers                    (decode fusion b)
//                 grid (⌈H/8⌉, T), same geometry
//   moe_down_combine: h[t, c] += out[t, c] + sigmoid(sg[t]) · shared[t, c], out as moe_down builds it (decode:
//                 down + routing weight + shared expert + residual in one dispatch, moe_combine's arithmetic; the
//                 shared expert's down projection ran before it). Reads h, shared [T, H] and sg [T, 1] strided.
//                 Same grid as moe_down
// Floor (decode, the real model, MODEL.md §10): each active expert's gate/up/down codes once (3 · 512 · 2048 / 2 B
// = 1.5 MiB per expert, 8 experts per layer) plus scales and biases; x and act stay in cache.
// Oracle: csrc/cpu/matmul.cpp (matmul, dequant_row), csrc/cpu/moe.cpp (moe_experts); tests/metal/test_ops.py.

constant uint mm_format [[function_constant(1)]];
constant uint mm_group [[function_constant(2)]];
constant bool mm_scale_bf16 [[function_constant(3)]];

// Shared with csrc/metal/matmul.cpp.
struct WeightRef {
  uint N;            // rows (outputs) of one matrix
  uint K;            // columns (inputs)
  uint data_off;     // element offset of row 0 from the data binding (uint32 words when affine)
  uint scale_off;    // element offsets of the scales and biases (affine)
  uint bias_off;
  uint data_stride;  // stacked experts: elements (words) between experts, and for scales / biases
  uint scale_stride;
  uint bias_stride;
};

struct MatmulShape {
  uint T;
  uint ldx;  // x row stride (elements)
  uint ldy;  // y row stride
  uint k;    // experts per token (moe kernels)
};

inline float mm_half_bits(ushort b) { return float(as_type<half>(b)); }
inline float mm_bf16_bits(ushort b) { return as_type<float>(uint(b) << 16); }
inline float mm_scale_value(device const ushort* p, ulong i) {
  return mm_scale_bf16 ? mm_bf16_bits(p[i]) : mm_half_bits(p[i]);
}

// Element (row, col) of one matrix (expert `e` of a stacked weight).
inline float mm_element(device const uchar* data, device const ushort* scales, device const ushort* biases,
                        constant WeightRef& w, uint e, uint row, uint col) {
  const ulong base = ulong(w.data_off) + ulong(e) * w.data_stride;
  if (mm_format == 0) return ((device const float*)data)[base + ulong(row) * w.K + col];
  if (mm_format == 1) return mm_half_bits(((device const ushort*)data)[base + ulong(row) * w.K + col]);
  if (mm_format == 2) return mm_bf16_bits(((device const ushort*)data)[base + ulong(row) * w.K + col]);
  const uint per_word = 32 / mm_format;
  const uint word = ((device const uint*)data)[base + ulong(row) * (w.K / per_word) + col / per_word];
  const uint q = (word >> (mm_format * (col % per_word))) & ((1u << mm_format) - 1u);
  const ulong g = ulong(row) * (w.K / mm_group) + col / mm_group;
  const float s = mm_scale_value(scales, w.scale_off + ulong(e) * w.scale_stride + g);
  const float b = mm_scale_value(biases, w.bias_off + ulong(e) * w.bias_stride + g);
  return s * float(q) + b;
}

// This lane's part of row·x (lane l: words or elements l, l + 32, ...); the caller simd_sums it.
inline float mm_lane_dot(device const uchar* data, device const ushort* scales, device const ushort* biases,
                         constant WeightRef& w, uint e, uint row, device const float* x, uint lane) {
  float acc = 0.0f;
  const ulong base = ulong(w.data_off) + ulong(e) * w.data_stride;
  if (mm_format < 4) {
    for (uint c = lane; c < w.K; c += 32) {
      const ulong i = base + ulong(row) * w.K + c;
      const float v = mm_format == 0 ? ((device const float*)data)[i]
                      : mm_format == 1 ? mm_half_bits(((device const ushort*)data)[i])
                                       : mm_bf16_bits(((device const ushort*)data)[i]);
      acc += v * x[c];
    }
    return acc;
  }
  const uint per_word = 32 / mm_format, words = w.K / per_word, groups = w.K / mm_group;
  const uint mask = (1u << mm_format) - 1u;
  device const uint* codes = (device const uint*)data + base + ulong(row) * words;
  const ulong srow = ulong(w.scale_off) + ulong(e) * w.scale_stride + ulong(row) * groups;
  const ulong brow = ulong(w.bias_off) + ulong(e) * w.bias_stride + ulong(row) * groups;
  for (uint k = lane; k < words; k += 32) {
    const uint word = codes[k];
    const uint g = k * per_word / mm_group;
    float qx = 0.0f, xs = 0.0f;
    for (uint j = 0; j < per_word; ++j) {
      const float xv = x[k * per_word + j];
      qx += float((word >> (mm_format * j)) & mask) * xv;
      xs += xv;
    }
    acc += mm_scale_value(scales, srow + g) * qx + mm_scale_value(biases, brow + g) * xs;
  }
  return acc;
}

[[kernel]] void embed_rows(device const int* ids [[buffer(0)]],
                           device const uchar* data [[buffer(1)]],
                           device const ushort* scales [[buffer(2)]],
                           device const ushort* biases [[buffer(3)]],
                           constant WeightRef& w [[buffer(4)]],
                           device float* out [[buffer(5)]],
                           constant MatmulShape& s [[buffer(6)]],
                           uint2 tg [[threadgroup_position_in_grid]],
                           uint i_in [[thread_index_in_threadgroup]]) {
  const uint i = tg.x * 64 + i_in, t = tg.y;
  if (i >= w.K) return;
  const int id = ids[ulong(t) * s.ldx];
  if (id < 0 || uint(id) >= w.N) return;  // the session checks ids; never read outside the table
  out[ulong(t) * s.ldy + i] = mm_element(data, scales, biases, w, 0, uint(id), i);
}

[[kernel]] void matmul_rows(device const uchar* data [[buffer(0)]],
                            device const ushort* scales [[buffer(1)]],
                            device const ushort* biases [[buffer(2)]],
                            constant WeightRef& w [[buffer(3)]],
                            device const float* x [[buffer(4)]],
                            device float* y [[buffer(5)]],
                            constant MatmulShape& s [[buffer(6)]],
                            uint2 tg [[threadgroup_position_in_grid]],
                            uint simdgroup [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  const uint t = tg.y, row0 = (tg.x * 2 + simdgroup) * 4;
  device const float* xt = x + ulong(t) * s.ldx;
  for (uint r = 0; r < 4; ++r) {
    const uint row = min(row0 + r, w.N - 1);  // past the end: redo the last row (uniform simd_sum), never store
    const float total = simd_sum(mm_lane_dot(data, scales, biases, w, 0, row, xt, lane));
    if (lane == 0 && row0 + r < w.N) y[ulong(t) * s.ldy + row0 + r] = total;
  }
}

// matmul_rows_multi: up to four products of one x in one dispatch (Ops::matmuls where qmv4_multi does not apply:
// prefill rows, 8-bit and dense weights, e.g. the router with the shared-expert gate): y_p[t, n] = Σ_k x[t, k] · W_p[n, k].
// Reads: W_p (data, scales, biases: buffers 0-3, 4-7, 8-11; WeightRef 12-15; product p in slot p, unused slots
// repeat product 0 and are never touched), x (16). Writes: y_p (17-20). All products share K and the function
// constants 1-3 (format, group, scale dtype). Grid (Σ_p ⌈N_p / 8⌉, T): threadgroup column g serves product
// p = #{i ≥ 1 : g ≥ start_i} (unused starts equal the total) and runs matmul_rows' threadgroup g − start_p on it
// (the same mm_lane_dot and simd_sum per row), so every product's bits equal its own matmul_rows.
struct MatmulMultiShape {
  uint T;
  uint ldx;
  uint ldy0;
  uint ldy1;
  uint ldy2;
  uint ldy3;
  uint start1;
  uint start2;
  uint start3;
};

[[kernel]] void matmul_rows_multi(device const uchar* data0 [[buffer(0)]],
                                  device const uchar* data1 [[buffer(1)]],
                                  device const uchar* data2 [[buffer(2)]],
                                  device const uchar* data3 [[buffer(3)]],
                                  device const ushort* scales0 [[buffer(4)]],
                                  device const ushort* scales1 [[buffer(5)]],
                                  device const ushort* scales2 [[buffer(6)]],
                                  device const ushort* scales3 [[buffer(7)]],
                                  device const ushort* biases0 [[buffer(8)]],
                                  device const ushort* biases1 [[buffer(9)]],
                                  device const ushort* biases2 [[buffer(10)]],
                                  device const ushort* biases3 [[buffer(11)]],
                                  constant WeightRef& w0 [[buffer(12)]],
                                  constant WeightRef& w1 [[buffer(13)]],
                                  constant WeightRef& w2 [[buffer(14)]],
                                  constant WeightRef& w3 [[buffer(15)]],
                                  device const float* x [[buffer(16)]],
                                  device float* y0 [[buffer(17)]],
                                  device float* y1 [[buffer(18)]],
                                  device float* y2 [[buffer(19)]],
                                  device float* y3 [[buffer(20)]],
                                  constant MatmulMultiShape& s [[buffer(21)]],
                                  uint2 tg [[threadgroup_position_in_grid]],
                                  uint simdgroup [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  // Uniform per threadgroup: every lane takes the same product, so the simd_sums stay convergent.
  const uint p = uint(tg.x >= s.start1) + uint(tg.x >= s.start2) + uint(tg.x >= s.start3);
  const uint start = p == 0 ? 0u : p == 1 ? s.start1 : p == 2 ? s.start2 : s.start3;
  device const uchar* data = p == 0 ? data0 : p == 1 ? data1 : p == 2 ? data2 : data3;
  device const ushort* scales = p == 0 ? scales0 : p == 1 ? scales1 : p == 2 ? scales2 : scales3;
  device const ushort* biases = p == 0 ? biases0 : p == 1 ? biases1 : p == 2 ? biases2 : biases3;
  constant WeightRef& w = p == 0 ? w0 : p == 1 ? w1 : p == 2 ? w2 : w3;
  device float* y = p == 0 ? y0 : p == 1 ? y1 : p == 2 ? y2 : y3;
  const uint ldy = p == 0 ? s.ldy0 : p == 1 ? s.ldy1 : p == 2 ? s.ldy2 : s.ldy3;
  const uint t = tg.y, row0 = ((tg.x - start) * 2 + simdgroup) * 4;
  device const float* xt = x + ulong(t) * s.ldx;
  for (uint r = 0; r < 4; ++r) {
    const uint row = min(row0 + r, w.N - 1);  // past the end: redo the last row (uniform simd_sum), never store
    const float total = simd_sum(mm_lane_dot(data, scales, biases, w, 0, row, xt, lane));
    if (lane == 0 && row0 + r < w.N) y[ulong(t) * ldy + row0 + r] = total;
  }
}

[[kernel]] void moe_gate_up(device const uchar* g_data [[buffer(0)]],
                            device const ushort* g_scales [[buffer(1)]],
                            device const ushort* g_biases [[buffer(2)]],
                            constant WeightRef& gw [[buffer(3)]],
                            device const uchar* u_data [[buffer(4)]],
                            device const ushort* u_scales [[buffer(5)]],
                            device const ushort* u_biases [[buffer(6)]],
                            constant WeightRef& uw [[buffer(7)]],
                            device const float* x [[buffer(8)]],
                            device const int* ids [[buffer(9)]],
                            device float* act [[buffer(10)]],
                            constant MatmulShape& s [[buffer(11)]],
                            uint2 tg [[threadgroup_position_in_grid]],
                            uint simdgroup [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  const uint p = tg.y, t = p / s.k, row0 = (tg.x * 2 + simdgroup) * 4;
  const uint e = uint(ids[p]);  // ids [T, k] contiguous (ld = k)
  device const float* xt = x + ulong(t) * s.ldx;
  for (uint r = 0; r < 4; ++r) {
    const uint row = min(row0 + r, gw.N - 1);
    const float g = simd_sum(mm_lane_dot(g_data, g_scales, g_biases, gw, e, row, xt, lane));
    const float u = simd_sum(mm_lane_dot(u_data, u_scales, u_biases, uw, e, row, xt, lane));
    if (lane == 0 && row0 + r < gw.N) act[ulong(p) * gw.N + row0 + r] = g / (1.0f + exp(-g)) * u;
  }
}

// moe_down's sums for rows row0 .. row0 + 3 of token t into o (a row past N redoes the last one, so that every
// lane takes part in the simd_sums; the caller stores rows below N only).
inline void mm_moe_down_rows(device const uchar* data, device const ushort* scales, device const ushort* biases,
                             constant WeightRef& w, device const float* act, device const int* ids,
                             device const float* weights, uint k, uint t, uint row0, uint lane, thread float* o) {
  for (uint r = 0; r < 4; ++r) o[r] = 0.0f;
  int last = -1;
  for (uint n = 0; n < k; ++n) {
    // The next slot in ascending expert id (a token's k ids are distinct).
    uint slot = 0;
    int best = 0x7fffffff;
    for (uint j = 0; j < k; ++j) {
      const int id = ids[ulong(t) * k + j];
      if (id > last && id < best) best = id, slot = j;
    }
    last = best;
    const uint p = t * k + slot;
    const float wt = weights[p];
    for (uint r = 0; r < 4; ++r) {
      const uint row = min(row0 + r, w.N - 1);
      const float y = simd_sum(mm_lane_dot(data, scales, biases, w, uint(best), row, act + ulong(p) * w.K, lane));
      o[r] += wt * y;
    }
  }
}

[[kernel]] void moe_down(device const uchar* data [[buffer(0)]],
                         device const ushort* scales [[buffer(1)]],
                         device const ushort* biases [[buffer(2)]],
                         constant WeightRef& w [[buffer(3)]],
                         device const float* act [[buffer(4)]],
                         device const int* ids [[buffer(5)]],
                         device const float* weights [[buffer(6)]],
                         device float* out [[buffer(7)]],
                         constant MatmulShape& s [[buffer(8)]],
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint simdgroup [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  const uint t = tg.y, row0 = (tg.x * 2 + simdgroup) * 4;
  float o[4];
  mm_moe_down_rows(data, scales, biases, w, act, ids, weights, s.k, t, row0, lane, o);
  for (uint r = 0; r < 4; ++r)
    if (lane == 0 && row0 + r < w.N) out[ulong(t) * s.ldy + row0 + r] = o[r];
}

// Shared with csrc/metal/matmul.cpp: h row stride, shared row stride, the gate logit's row stride, k.
struct DownCombineShape {
  uint ldh, ld_shared, ld_gate, k;
};

[[kernel]] void moe_down_combine(device const uchar* data [[buffer(0)]],
                                 device const ushort* scales [[buffer(1)]],
                                 device const ushort* biases [[buffer(2)]],
                                 constant WeightRef& w [[buffer(3)]],
                                 device const float* act [[buffer(4)]],
                                 device const int* ids [[buffer(5)]],
                                 device const float* weights [[buffer(6)]],
                                 device const float* shared [[buffer(7)]],
                                 device const float* sg [[buffer(8)]],
                                 device float* h [[buffer(9)]],
                                 constant DownCombineShape& s [[buffer(10)]],
                                 uint2 tg [[threadgroup_position_in_grid]],
                                 uint simdgroup [[simdgroup_index_in_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  const uint t = tg.y, row0 = (tg.x * 2 + simdgroup) * 4;
  float o[4];
  mm_moe_down_rows(data, scales, biases, w, act, ids, weights, s.k, t, row0, lane, o);
  // moe_combine's expression (metal/moe.metal, csrc/cpu/moe.cpp) with the routed sum from registers.
  const float g = 1.0f / (1.0f + exp(-sg[ulong(t) * s.ld_gate]));
  for (uint r = 0; r < 4; ++r)
    if (lane == 0 && row0 + r < w.N) {
      const ulong i = ulong(t) * s.ldh + row0 + r;
      h[i] += o[r] + g * shared[ulong(t) * s.ld_shared + row0 + r];
    }
}

// ------------------------------------------------------------------------------------------------------------
// Prefill experts, grouped on the GPU (GPU-resident routing: the host never sees ids, counts or offsets).
//   moe_group:        one threadgroup, thread e owns expert e (E ≤ 1024): its histogram count over the T·k (token,
//                     slot) pairs, an exclusive prefix scan of counts and of tiles (⌈count / R⌉ tiles of R =
//                     s.tile_rows rows: 8, 16 or 32, the host's choice for the chunk),
//                     the scatter of its pairs in ascending pair (so token) order, and its tile map entries.
//                     Writes, in the workspace (I32): offsets [E + 1], pair_of [T·k] (grouped position -> pair),
//                     position_of [T·k] (pair -> grouped position), tiles [max_tiles, 2] (expert, first position),
//                     tile_count [1].
//   moe_gate_up_tiles: act[g, i] = silu(gate_e(x)) ⊙ up_e(x) for the ≤ 8 grouped rows g of one tile: each weight
//                     word is dequantized once per tile and used for all its rows (the weight traffic of a prefill
//                     chunk falls by the tile's row count). Grid (⌈I/8⌉, min(⌈T·k/8⌉ + E, T·k)), 2 simdgroups ×
//                     4 rows. The fallback of the simdgroup-matrix tiles below (LILY_METAL_MOE_MMA=0, or a device
//                     whose threadgroup memory or threads neither R fits).
//   moe_down_tiles:   y[g, c] = down_e(act[g])[c], same geometry over H.
//   moe_gather_sum:   out[t, c] = Σ_s w[t, s] · y[position_of[t·k + s], c], slots in ascending expert id.
//                     Grid (⌈H/64⌉, T), 64 threads.
// moe_group builds tiles of s.tile_rows rows (8 for the lane-dot tiles here; 16 or 32 for the simdgroup-matrix
// tiles below, moe_gate_up_mma / moe_down_mma, chosen by the host per chunk). In the lane-dot tiles each (row,
// output) sum is built lane by lane exactly as mm_lane_dot builds it, so that path gives the same bits as the
// per-pair kernels above; tiles past tile_count return at once (the grid is an upper bound, ⌈T·k/R⌉ + E).

struct GroupShape {
  uint T, k, E, max_tiles, tile_rows;
};

constant constexpr uint kTileRows = 8;  // the lane-dot tiles' rows: must match kLaneTileRows in csrc/metal/matmul.cpp

[[kernel]] void moe_group(device const int* ids [[buffer(0)]],
                          device int* offsets [[buffer(1)]],
                          device int* pair_of [[buffer(2)]],
                          device int* position_of [[buffer(3)]],
                          device int* tiles [[buffer(4)]],
                          device int* tile_count [[buffer(5)]],
                          constant GroupShape& s [[buffer(6)]],
                          threadgroup int* counts [[threadgroup(0)]],
                          uint e [[thread_position_in_threadgroup]],
                          uint threads [[threads_per_threadgroup]]) {
  // counts: [2 · (E + 1)] ints: pair offsets, then tile offsets (exclusive scans).
  const uint pairs = s.T * s.k;
  uint n = 0;
  if (e < s.E)
    for (uint p = 0; p < pairs; ++p) n += uint(ids[p]) == e;
  if (e < s.E) counts[e] = int(n);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (e == 0) {
    int run = 0, tile_run = 0;
    for (uint x = 0; x < s.E; ++x) {
      const int c = counts[x];
      counts[x] = run;
      counts[s.E + 1 + x] = tile_run;
      run += c;
      tile_run += (c + int(s.tile_rows) - 1) / int(s.tile_rows);
    }
    counts[s.E] = run;
    counts[2 * s.E + 1] = tile_run;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint x = e; x <= s.E; x += threads) offsets[x] = counts[x];
  if (e == 0) tile_count[0] = counts[2 * s.E + 1];
  if (e >= s.E) return;
  const int first = counts[e];
  int at = first;
  for (uint p = 0; p < pairs; ++p)
    if (uint(ids[p]) == e) {
      pair_of[at] = int(p);
      position_of[p] = at;
      ++at;
    }
  const int tile0 = counts[s.E + 1 + e];
  for (int r = first, i = 0; r < at; r += int(s.tile_rows), ++i) {
    tiles[2 * (tile0 + i)] = int(e);
    tiles[2 * (tile0 + i) + 1] = r;
  }
}

// This lane's parts of row·x_j for the tile's rows j < rows (x_j = x + xoff[j]); the same order as mm_lane_dot.
inline void mm_lane_dot_tile(device const uchar* data, device const ushort* scales, device const ushort* biases,
                             constant WeightRef& w, uint e, uint row, device const float* x, thread const ulong* xoff,
                             uint rows, uint lane, thread float* acc) {
  for (uint j = 0; j < kTileRows; ++j) acc[j] = 0.0f;
  const ulong base = ulong(w.data_off) + ulong(e) * w.data_stride;
  if (mm_format < 4) {
    for (uint c = lane; c < w.K; c += 32) {
      const ulong i = base + ulong(row) * w.K + c;
      const float v = mm_format == 0 ? ((device const float*)data)[i]
                      : mm_format == 1 ? mm_half_bits(((device const ushort*)data)[i])
                                       : mm_bf16_bits(((device const ushort*)data)[i]);
      for (uint j = 0; j < rows; ++j) acc[j] += v * x[xoff[j] + c];
    }
    return;
  }
  const uint per_word = 32 / mm_format, words = w.K / per_word, groups = w.K / mm_group;
  const uint mask = (1u << mm_format) - 1u;
  device const uint* codes = (device const uint*)data + base + ulong(row) * words;
  const ulong srow = ulong(w.scale_off) + ulong(e) * w.scale_stride + ulong(row) * groups;
  const ulong brow = ulong(w.bias_off) + ulong(e) * w.bias_stride + ulong(row) * groups;
  for (uint k = lane; k < words; k += 32) {
    const uint word = codes[k];
    const uint g = k * per_word / mm_group;
    const float sc = mm_scale_value(scales, srow + g), bi = mm_scale_value(biases, brow + g);
    for (uint j = 0; j < rows; ++j) {
      float qx = 0.0f, xs = 0.0f;
      for (uint q = 0; q < per_word; ++q) {
        const float xv = x[xoff[j] + k * per_word + q];
        qx += float((word >> (mm_format * q)) & mask) * xv;
        xs += xv;
      }
      acc[j] += sc * qx + bi * xs;
    }
  }
}

[[kernel]] void moe_gate_up_tiles(device const uchar* g_data [[buffer(0)]],
                                  device const ushort* g_scales [[buffer(1)]],
                                  device const ushort* g_biases [[buffer(2)]],
                                  constant WeightRef& gw [[buffer(3)]],
                                  device const uchar* u_data [[buffer(4)]],
                                  device const ushort* u_scales [[buffer(5)]],
                                  device const ushort* u_biases [[buffer(6)]],
                                  constant WeightRef& uw [[buffer(7)]],
                                  device const float* x [[buffer(8)]],
                                  device const int* offsets [[buffer(9)]],
                                  device const int* pair_of [[buffer(10)]],
                                  device const int* tiles [[buffer(11)]],
                                  device const int* tile_count [[buffer(12)]],
                                  device float* act [[buffer(13)]],
                                  constant MatmulShape& s [[buffer(14)]],
                                  uint2 tg [[threadgroup_position_in_grid]],
                                  uint simdgroup [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  if (int(tg.y) >= tile_count[0]) return;  // uniform over the threadgroup: no collective is skipped by part of it
  const uint e = uint(tiles[2 * tg.y]), first = uint(tiles[2 * tg.y + 1]);
  const uint rows = min(kTileRows, uint(offsets[e + 1]) - first);
  ulong xoff[kTileRows];
  for (uint j = 0; j < kTileRows; ++j) xoff[j] = ulong(uint(pair_of[first + min(j, rows - 1)]) / s.k) * s.ldx;
  const uint row0 = (tg.x * 2 + simdgroup) * 4;
  float ga[kTileRows], ua[kTileRows];
  for (uint r = 0; r < 4; ++r) {
    const uint row = min(row0 + r, gw.N - 1);
    mm_lane_dot_tile(g_data, g_scales, g_biases, gw, e, row, x, xoff, rows, lane, ga);
    mm_lane_dot_tile(u_data, u_scales, u_biases, uw, e, row, x, xoff, rows, lane, ua);
    for (uint j = 0; j < kTileRows; ++j) {
      const float g = simd_sum(ga[j]), u = simd_sum(ua[j]);
      if (lane == 0 && j < rows && row0 + r < gw.N) act[ulong(first + j) * gw.N + row0 + r] = g / (1.0f + exp(-g)) * u;
    }
  }
}

[[kernel]] void moe_down_tiles(device const uchar* data [[buffer(0)]],
                               device const ushort* scales [[buffer(1)]],
                               device const ushort* biases [[buffer(2)]],
                               constant WeightRef& w [[buffer(3)]],
                               device const float* act [[buffer(4)]],
                               device const int* offsets [[buffer(5)]],
                               device const int* tiles [[buffer(6)]],
                               device const int* tile_count [[buffer(7)]],
                               device float* y [[buffer(8)]],
                               uint2 tg [[threadgroup_position_in_grid]],
                               uint simdgroup [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  if (int(tg.y) >= tile_count[0]) return;  // uniform over the threadgroup
  const uint e = uint(tiles[2 * tg.y]), first = uint(tiles[2 * tg.y + 1]);
  const uint rows = min(kTileRows, uint(offsets[e + 1]) - first);
  ulong xoff[kTileRows];
  for (uint j = 0; j < kTileRows; ++j) xoff[j] = ulong(first + min(j, rows - 1)) * w.K;
  const uint row0 = (tg.x * 2 + simdgroup) * 4;
  float acc[kTileRows];
  for (uint r = 0; r < 4; ++r) {
    const uint row = min(row0 + r, w.N - 1);
    mm_lane_dot_tile(data, scales, biases, w, e, row, act, xoff, rows, lane, acc);
    for (uint j = 0; j < kTileRows; ++j) {
      const float v = simd_sum(acc[j]);
      if (lane == 0 && j < rows && row0 + r < w.N) y[ulong(first + j) * w.N + row0 + r] = v;
    }
  }
}

[[kernel]] void moe_gather_sum(device const float* y [[buffer(0)]],
                               device const int* ids [[buffer(1)]],
                               device const float* weights [[buffer(2)]],
                               device const int* position_of [[buffer(3)]],
                               device float* out [[buffer(4)]],
                               constant MatmulShape& s [[buffer(5)]],
                               constant uint& H [[buffer(6)]],
                               uint2 tg [[threadgroup_position_in_grid]],
                               uint i_in [[thread_index_in_threadgroup]]) {
  const uint c = tg.x * 64 + i_in, t = tg.y;
  if (c >= H) return;
  float o = 0.0f;
  int last = -1;
  for (uint n = 0; n < s.k; ++n) {
    uint slot = 0;
    int best = 0x7fffffff;
    for (uint j = 0; j < s.k; ++j) {
      const int id = ids[ulong(t) * s.k + j];
      if (id > last && id < best) best = id, slot = j;
    }
    last = best;
    const uint p = t * s.k + slot;
    o += weights[p] * y[ulong(position_of[p]) * H + c];
  }
  out[ulong(t) * s.ldy + c] = o;
}

// ------------------------------------------------------------------------------------------------------------
// Prefill experts as a grouped GEMM on simdgroup matrices, over moe_group's tile map (tiles of R = 16 or 32 grouped
// rows of one expert; the host picks R per chunk from T·k / E, csrc/metal/matmul.cpp choose_moe_tiles):
//   moe_gate_up_mma_r{16,32}: act[g, i] = silu(Σ_c x[t_g, c] · gate_e[i, c]) · (Σ_c x[t_g, c] · up_e[i, c]) for the
//                     tile's grouped rows g (t_g = pair_of[g] / k). Reads gate/up (any format: f32/f16/bf16 dense,
//                     4- or 8-bit affine with f16/bf16 scales and biases, function constants 1-3 as above), x f32
//                     [T, ldx], offsets, pair_of, tiles, tile_count (moe_group); writes act f32 [T·k, I] (grouped
//                     positions, row stride I). Buffers as moe_gate_up_tiles.
//   moe_down_mma_r{16,32}:   y[g, n] = Σ_i act[g, i] · down_e[n, i]. Reads down, act, offsets, tiles, tile_count;
//                     writes y f32 [T·k, H] (grouped positions). Buffers as moe_down_tiles.
// Grid (⌈N/32⌉, ⌈T·k/R⌉ + E clamped to T·k): threadgroup (b, tile) owns the tile's R rows × output columns
// [32b, 32b + 32); tiles past tile_count return at once (uniform over the threadgroup, before any barrier).
// Threadgroup: R/8 simdgroups (64 or 128 threads); simdgroup s owns rows [8s, 8s + 8) × the 32 columns: four
// simdgroup_float8x8 accumulators per product (gate and up: eight). The K loop takes blocks of 32 columns:
//   stage  xs [R, 32] f32: the tile's rows of x (act), zero for rows ≥ the tile's count and columns ≥ K;
//          ws [32, 32] f32 per weight, k-major (ws[kk·32 + n] = W[n0 + n, k0 + kk]): the weight block dequantized
//          (scale · code + bias, computed in registers from the codes; no dequantized copy reaches device memory),
//          zero outside [N, K], so partial blocks add exact zeros;
//   barrier, then 4 steps of 8: A = xs[8s.., kk..] (simdgroup_load), B = ws[kk.., 8c..], C_c += A·B (fp32), barrier.
// Epilogue: the accumulators go to threadgroup memory (simdgroup_store; xs and ws reused), then the threads write
// the tile's rows < count and columns < N (gate/up: silu(g)·u there), so partial tiles never write past their rows.
// Threadgroup memory: R·32·4 + 32·32·4 per weight + R·4 bytes: gate/up 10.1 KB (R 16) / 12.1 KB (R 32), down 6.1 /
// 8.1 KB, under 16 KB (the small limits; the host checks these counts against the device's limit before building
// the pipelines, choose_moe_tiles, and takes the other R or the lane-dot tiles, reported, where one does not fit).
// Sum order: for each output, Σ over K in ascending order, one fp32 add per column (the 8x8 products accumulate
// k = 0..7 in order in the emulator; on a GPU the order inside one 8-step product is the hardware's). It depends
// on K only, never on R, the tile a row falls in, T or the chunking: R = 16 and R = 32 give the same bits (the
// test checks it), not the bits of the lane-dot tiles (which sum s·Σq·x + b·Σx per word).
// Floor (the real model, MODEL.md §10: H 2048, I 512, q4g64 bf16): each tile reads its expert's gate, up and down
// once, 3 · 512 · 2048 · 0.5625 B = 1.77 MB, so a chunk reads Σ_e ⌈c_e / R⌉ · 1.77 MB of weights per layer (R = 32
// halves R = 16's re-reads once experts hold ≥ 32 rows); x and act cross once per column block (L2 traffic);
// 6 · T·k · 512 · 2048 FLOPs per layer (T·k = 8T routed rows).
// Oracle: CpuOps::moe_experts_impl (csrc/cpu/moe.cpp); tests/metal/host/backend_main.cpp `ops --only moe_experts`.

// Both must match kMmaColumns in csrc/metal/matmul.cpp (the grid and the threadgroup-memory check).
constant constexpr uint kMmaBK = 32;  // K block (columns staged per step)
constant constexpr uint kMmaBN = 32;  // output columns per threadgroup; the epilogue reuses xs [R, BK] as [R, BN]

// One weight block, dequantized, k-major into ws[kk · BN + n] = W_e[n0 + n, k0 + kk] (zero outside [N, K]).
inline void mma_stage_weight(device const uchar* data, device const ushort* scales, device const ushort* biases,
                             constant WeightRef& w, uint e, uint n0, uint k0, threadgroup float* ws, uint tid,
                             uint threads) {
  const ulong base = ulong(w.data_off) + ulong(e) * w.data_stride;
  if (mm_format < 4) {
    for (uint i = tid; i < kMmaBN * kMmaBK; i += threads) {
      const uint n = i / kMmaBK, kk = i % kMmaBK, row = n0 + n, col = k0 + kk;
      float v = 0.0f;
      if (row < w.N && col < w.K) {
        const ulong at = base + ulong(row) * w.K + col;
        v = mm_format == 0 ? ((device const float*)data)[at]
            : mm_format == 1 ? mm_half_bits(((device const ushort*)data)[at])
                             : mm_bf16_bits(((device const ushort*)data)[at]);
      }
      ws[kk * kMmaBN + n] = v;
    }
    return;
  }
  // Affine: one code word (8 or 4 elements of one group) per thread and step; K is a multiple of the group and
  // the group of the word size, so a word is wholly inside or outside [0, K).
  const uint per_word = 32 / mm_format, words_per_row = kMmaBK / per_word;
  const uint words = w.K / per_word, groups = w.K / mm_group, mask = (1u << mm_format) - 1u;
  for (uint i = tid; i < kMmaBN * words_per_row; i += threads) {
    const uint n = i / words_per_row, kw = i % words_per_row, row = n0 + n, col = k0 + kw * per_word;
    const bool inside = row < w.N && col < w.K;
    uint word = 0;
    float sc = 0.0f, bi = 0.0f;
    if (inside) {
      word = ((device const uint*)data)[base + ulong(row) * words + col / per_word];
      const ulong g = ulong(row) * groups + col / mm_group;
      sc = mm_scale_value(scales, w.scale_off + ulong(e) * w.scale_stride + g);
      bi = mm_scale_value(biases, w.bias_off + ulong(e) * w.bias_stride + g);
    }
    for (uint j = 0; j < per_word; ++j)
      ws[(kw * per_word + j) * kMmaBN + n] = inside ? sc * float((word >> (mm_format * j)) & mask) + bi : 0.0f;
  }
}

// The tile's rows of x (row j at x + xrow[j]), columns k0 .. k0 + BK, into xs [R, BK]; zero past `rows` and K.
template <uint R>
inline void mma_stage_rows(device const float* x, threadgroup const uint* xrow, uint rows, uint K, uint k0,
                           threadgroup float* xs, uint tid) {
  for (uint i = tid; i < R * kMmaBK; i += R / 8 * 32) {
    const uint j = i / kMmaBK, col = k0 + i % kMmaBK;
    xs[i] = j < rows && col < K ? x[ulong(xrow[j]) + col] : 0.0f;
  }
}

// C_c += xs[8s .. 8s + 8, :] · ws[:, 8c .. 8c + 8] for the four column blocks c, over the staged K block.
inline void mma_block(threadgroup const float* xs, threadgroup const float* ws, uint sg,
                      thread simdgroup_float8x8* acc) {
  for (uint kk = 0; kk < kMmaBK; kk += 8) {
    simdgroup_float8x8 a;
    simdgroup_load(a, xs + sg * 8 * kMmaBK + kk, kMmaBK);
    for (uint c = 0; c < kMmaBN / 8; ++c) {
      simdgroup_float8x8 b;
      simdgroup_load(b, ws + kk * kMmaBN + c * 8, kMmaBN);
      simdgroup_multiply_accumulate(acc[c], a, b, acc[c]);
    }
  }
}

template <uint R>
[[kernel]] void moe_gate_up_mma(device const uchar* g_data [[buffer(0)]],
                                device const ushort* g_scales [[buffer(1)]],
                                device const ushort* g_biases [[buffer(2)]],
                                constant WeightRef& gw [[buffer(3)]],
                                device const uchar* u_data [[buffer(4)]],
                                device const ushort* u_scales [[buffer(5)]],
                                device const ushort* u_biases [[buffer(6)]],
                                constant WeightRef& uw [[buffer(7)]],
                                device const float* x [[buffer(8)]],
                                device const int* offsets [[buffer(9)]],
                                device const int* pair_of [[buffer(10)]],
                                device const int* tiles [[buffer(11)]],
                                device const int* tile_count [[buffer(12)]],
                                device float* act [[buffer(13)]],
                                constant MatmulShape& s [[buffer(14)]],
                                uint2 tg [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float xs[R * kMmaBK];         // x rows; after the K loop the gate sums [R, BN]
  threadgroup float gs[kMmaBK * kMmaBN];    // gate block; after the K loop the up sums [R, BN]
  threadgroup float us[kMmaBK * kMmaBN];    // up block
  threadgroup uint xrow[R];                 // x offset of each tile row (the last real row repeated)
  if (int(tg.y) >= tile_count[0]) return;  // uniform over the threadgroup: no barrier or collective is split
  const uint e = uint(tiles[2 * tg.y]), first = uint(tiles[2 * tg.y + 1]);
  const uint rows = min(R, uint(offsets[e + 1]) - first), n0 = tg.x * kMmaBN, N = gw.N;
  if (tid < R) xrow[tid] = uint(pair_of[first + min(tid, rows - 1)]) / s.k * s.ldx;
  simdgroup_float8x8 ga[kMmaBN / 8], ua[kMmaBN / 8];
  for (uint c = 0; c < kMmaBN / 8; ++c)
    ga[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f), ua[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k0 = 0; k0 < gw.K; k0 += kMmaBK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the last block's products are done (and xrow is written)
    mma_stage_rows<R>(x, xrow, rows, gw.K, k0, xs, tid);
    mma_stage_weight(g_data, g_scales, g_biases, gw, e, n0, k0, gs, tid, R / 8 * 32);
    mma_stage_weight(u_data, u_scales, u_biases, uw, e, n0, k0, us, tid, R / 8 * 32);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every staged element is written before any simdgroup loads
    mma_block(xs, gs, sg, ga);
    mma_block(xs, us, sg, ua);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the products have read xs and gs
  for (uint c = 0; c < kMmaBN / 8; ++c) {
    simdgroup_store(ga[c], xs + sg * 8 * kMmaBN + c * 8, kMmaBN);
    simdgroup_store(ua[c], gs + sg * 8 * kMmaBN + c * 8, kMmaBN);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < R * kMmaBN; i += R / 8 * 32) {
    const uint j = i / kMmaBN, n = n0 + i % kMmaBN;
    const float g = xs[i], u = gs[i];
    if (j < rows && n < N) act[ulong(first + j) * N + n] = g / (1.0f + exp(-g)) * u;
  }
}

template <uint R>
[[kernel]] void moe_down_mma(device const uchar* data [[buffer(0)]],
                             device const ushort* scales [[buffer(1)]],
                             device const ushort* biases [[buffer(2)]],
                             constant WeightRef& w [[buffer(3)]],
                             device const float* act [[buffer(4)]],
                             device const int* offsets [[buffer(5)]],
                             device const int* tiles [[buffer(6)]],
                             device const int* tile_count [[buffer(7)]],
                             device float* y [[buffer(8)]],
                             uint2 tg [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float xs[R * kMmaBK];       // act rows; after the K loop the sums [R, BN]
  threadgroup float ws[kMmaBK * kMmaBN];  // down block
  threadgroup uint xrow[R];
  if (int(tg.y) >= tile_count[0]) return;  // uniform over the threadgroup
  const uint e = uint(tiles[2 * tg.y]), first = uint(tiles[2 * tg.y + 1]);
  const uint rows = min(R, uint(offsets[e + 1]) - first), n0 = tg.x * kMmaBN;
  if (tid < R) xrow[tid] = (first + min(tid, rows - 1)) * w.K;
  simdgroup_float8x8 acc[kMmaBN / 8];
  for (uint c = 0; c < kMmaBN / 8; ++c) acc[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k0 = 0; k0 < w.K; k0 += kMmaBK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mma_stage_rows<R>(act, xrow, rows, w.K, k0, xs, tid);
    mma_stage_weight(data, scales, biases, w, e, n0, k0, ws, tid, R / 8 * 32);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mma_block(xs, ws, sg, acc);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint c = 0; c < kMmaBN / 8; ++c) simdgroup_store(acc[c], xs + sg * 8 * kMmaBN + c * 8, kMmaBN);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < R * kMmaBN; i += R / 8 * 32) {
    const uint j = i / kMmaBN, n = n0 + i % kMmaBN;
    if (j < rows && n < w.N) y[ulong(first + j) * w.N + n] = xs[i];
  }
}

template [[host_name("moe_gate_up_mma_r16")]] [[kernel]] decltype(moe_gate_up_mma<16>) moe_gate_up_mma<16>;
template [[host_name("moe_gate_up_mma_r32")]] [[kernel]] decltype(moe_gate_up_mma<32>) moe_gate_up_mma<32>;
template [[host_name("moe_down_mma_r16")]] [[kernel]] decltype(moe_down_mma<16>) moe_down_mma<16>;
template [[host_name("moe_down_mma_r32")]] [[kernel]] decltype(moe_down_mma<32>) moe_down_mma<32>;
