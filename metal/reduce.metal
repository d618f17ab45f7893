// Row dot products: out[r] = Σ_i a[r, i] · b[r, i], a and b float32 [rows, cols], out float32 [rows]
// (with b = a: the sum of squares behind the norms). One simdgroup per row, 4 rows per threadgroup of
// 128 threads; each lane sums a strided slice, simd_sum combines the lanes.
// Floor: reads 8·rows·cols bytes, writes 4·rows; 2·rows·cols FLOPs. Bandwidth-bound.
#include <metal_stdlib>
using namespace metal;

// Shared with csrc/metal/reduce.cpp.
struct RowDotShape {
  uint rows;
  uint cols;
};

[[kernel]] void row_dot(device const float* a [[buffer(0)]],
                        device const float* b [[buffer(1)]],
                        device float* out [[buffer(2)]],
                        constant RowDotShape& shape [[buffer(3)]],
                        uint group_id [[threadgroup_position_in_grid]],
                        uint simdgroup [[simdgroup_index_in_threadgroup]],
                        uint simdgroups [[simdgroups_per_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]],
                        uint width [[threads_per_simdgroup]]) {
  const uint wanted = group_id * simdgroups + simdgroup;
  // A simdgroup past the last row redoes the last row (uniform control flow for simd_sum), never writes.
  const uint row = min(wanted, shape.rows - 1);
  device const float* ar = a + ulong(row) * shape.cols;
  device const float* br = b + ulong(row) * shape.cols;
  float acc = 0.0f;
  for (uint i = lane; i < shape.cols; i += width) acc += ar[i] * br[i];
  const float total = simd_sum(acc);
  if (lane == 0 && wanted < shape.rows) out[wanted] = total;
}
