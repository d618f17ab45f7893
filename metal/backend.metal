// Small ops of the Metal backend (csrc/metal/backend.cpp encodes them; oracle: csrc/cpu/backend.cpp):
//   add_rows:         out[t, i] = a[t, i] + b[t, i]          f32 [rows, cols], row strides lda/ldb/ldo; out may alias a
//   copy_rows:        dst[t, i] = src[t, i]                   same shape; dtype pair from function constants 40/41
//                     (0 f32, 1 bf16, 2 any other 4-byte type copied bit for bit, 3 any other 2-byte type)
//   fill_rows:        dst[t, i] = value                       f32, i32 or bf16 (function constant 42: 0 f32, 1 bf16, 2 i32)
//   advance_position: pos_out[0] = pos_in[0] + T              I32 [1, 1]
//   accept_drafts:    a = leading drafts the model agreed with (y[i] == ids[i + 1], i < a <= n - 1); accepted = a,
//                     next_id = y[a], pos_out = pos_in + a + 1    I32; one thread
//   copy_rows_at:     dst = block j = index[0] + offset of `rows` rows of src (4-byte elements); nothing when the
//                     block is not inside src's src_rows rows     grid (⌈cols/64⌉, rows), 64 threads
// Geometry: grid (⌈cols/64⌉, rows), 64 threads; thread i of threadgroup x owns element 64·x + i of its row.
// Function constants 40-49 belong to this file. Floor: each element read and written once (bandwidth-bound).
#include <metal_stdlib>
using namespace metal;

constant uint copy_src_type [[function_constant(40)]];
constant uint copy_dst_type [[function_constant(41)]];
constant uint fill_type [[function_constant(42)]];

// Shared with csrc/metal/backend.cpp.
struct RowsShape {
  uint rows;
  uint cols;
  uint lda;  // first input (src, a) row stride in elements
  uint ldb;  // second input row stride
  uint ldo;  // output row stride
};

// fp32 -> bf16 round to nearest even, NaN kept quiet: the CPU's f32_to_bf16 (csrc/model/weight.h).
inline ushort backend_f32_to_bf16(float f) {
  uint u = as_type<uint>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ushort((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return ushort(u >> 16);
}

[[kernel]] void add_rows(device const float* a [[buffer(0)]],
                         device const float* b [[buffer(1)]],
                         device float* out [[buffer(2)]],
                         constant RowsShape& s [[buffer(3)]],
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint i_in [[thread_index_in_threadgroup]]) {
  const uint i = tg.x * 64 + i_in, t = tg.y;
  if (i >= s.cols) return;
  out[ulong(t) * s.ldo + i] = a[ulong(t) * s.lda + i] + b[ulong(t) * s.ldb + i];
}

[[kernel]] void copy_rows(device const uchar* src [[buffer(0)]],
                          device uchar* dst [[buffer(1)]],
                          constant RowsShape& s [[buffer(2)]],
                          uint2 tg [[threadgroup_position_in_grid]],
                          uint i_in [[thread_index_in_threadgroup]]) {
  const uint i = tg.x * 64 + i_in, t = tg.y;
  if (i >= s.cols) return;
  const ulong si = ulong(t) * s.lda + i, di = ulong(t) * s.ldo + i;
  if (copy_src_type == copy_dst_type) {
    if (copy_src_type == 1 || copy_src_type == 3)
      ((device ushort*)dst)[di] = ((device const ushort*)src)[si];
    else
      ((device uint*)dst)[di] = ((device const uint*)src)[si];
  } else if (copy_src_type == 1 && copy_dst_type == 0) {
    ((device float*)dst)[di] = as_type<float>(uint(((device const ushort*)src)[si]) << 16);
  } else if (copy_src_type == 0 && copy_dst_type == 1) {
    ((device ushort*)dst)[di] = backend_f32_to_bf16(((device const float*)src)[si]);
  }
}

// Shared with csrc/metal/backend.cpp.
struct FillShape {
  uint rows;
  uint cols;
  uint ld;
  uint bits;  // the value's bits in the destination type (f32, i32, or bf16 in the low half)
};

[[kernel]] void fill_rows(device uchar* dst [[buffer(0)]],
                          constant FillShape& s [[buffer(1)]],
                          uint2 tg [[threadgroup_position_in_grid]],
                          uint i_in [[thread_index_in_threadgroup]]) {
  const uint i = tg.x * 64 + i_in, t = tg.y;
  if (i >= s.cols) return;
  const ulong di = ulong(t) * s.ld + i;
  if (fill_type == 1)
    ((device ushort*)dst)[di] = ushort(s.bits);
  else
    ((device uint*)dst)[di] = s.bits;
}

[[kernel]] void advance_position(device const int* pos_in [[buffer(0)]],
                                 device int* pos_out [[buffer(1)]],
                                 constant int& T [[buffer(2)]],
                                 uint i [[thread_position_in_grid]]) {
  if (i == 0) pos_out[0] = pos_in[0] + T;
}

// Shared with csrc/metal/backend.cpp.
struct AcceptShape {
  uint n;       // ids and y rows: the pending token and its drafts
  uint ld_ids;  // row strides in elements
  uint ld_y;
};

[[kernel]] void accept_drafts(device const int* ids [[buffer(0)]],
                              device const int* y [[buffer(1)]],
                              device const int* pos_in [[buffer(2)]],
                              device int* accepted [[buffer(3)]],
                              device int* next_id [[buffer(4)]],
                              device int* pos_out [[buffer(5)]],
                              constant AcceptShape& s [[buffer(6)]],
                              uint i [[thread_position_in_grid]]) {
  if (i != 0) return;
  uint a = 0;
  while (a + 1 < s.n && y[a * s.ld_y] == ids[(a + 1) * s.ld_ids]) ++a;
  const int pos = pos_in[0];  // pos_out may be pos_in
  accepted[0] = int(a);
  next_id[0] = y[a * s.ld_y];
  pos_out[0] = pos + int(a) + 1;
}

// Shared with csrc/metal/backend.cpp.
struct PickShape {
  uint rows;      // dst rows (the block's height)
  uint cols;
  uint lds;       // src row stride in elements
  uint ldd;       // dst row stride
  uint src_rows;  // rows of src the block must lie in
  int offset;     // added to index[0]
};

[[kernel]] void copy_rows_at(device const uint* src [[buffer(0)]],
                             device const int* index [[buffer(1)]],
                             device uint* dst [[buffer(2)]],
                             constant PickShape& s [[buffer(3)]],
                             uint2 tg [[threadgroup_position_in_grid]],
                             uint i_in [[thread_index_in_threadgroup]]) {
  const uint i = tg.x * 64 + i_in, t = tg.y;
  const long j = long(index[0]) + long(s.offset);
  if (i >= s.cols || j < 0 || (j + 1) * long(s.rows) > long(s.src_rows)) return;
  dst[ulong(t) * s.ldd + i] = src[(ulong(j) * s.rows + t) * s.lds + i];
}
