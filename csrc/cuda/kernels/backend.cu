// The backend's own small ops: copy, fill, advance_position, add, embed (row gather).
//
// copy_rows:   dst[r, :] = src[r, :] for `rows` rows of `row_bytes` bytes (strides in bytes); same dtype.
//              grid (ceil(row_bytes / (16·256)), min(rows, 65535)) (rows loop over grid.y), 256 threads; 16-byte accesses when ALIGN16 (all
//              addresses and strides multiples of 16), else bytes. Floor: 2·rows·row_bytes moved.
// convert_rows: dst = src between f32 and bf16 rows (KV snapshots restored across dtypes).
// fill_rows:   every 32-bit (or 16-bit) element of a [rows, cols] view = value bits.
// advance_position: pos_out[0] = pos_in[0] + T (one thread).
// accept_drafts: a = leading drafts the model agreed with (y[i] == ids[i + 1], i < a <= k = n - 1); accepted = a,
//              next_id = y[a], pos_out = pos_in + a + 1 (one thread; n <= 64 ids).
// copy_rows_at: dst = the block j = index[0] + offset of dst.rows rows in src (4-byte elements), nothing when the
//              block is not inside src; grid (ceil(cols/256), min(rows, 65535)), 256 threads. Floor: 2·rows·cols·4 bytes.
// add_rows:    out = a + b over [rows, cols] f32 views; grid (ceil(cols/256), rows).
// embed_rows:  out[t, :] = dequantized row ids[t] of the table (dense f32/f16/bf16, or affine bits/group);
//              grid (ceil(cols/256), T), 256 threads. Floor: T rows of the table read, T·cols·4 written.
#include "common.cuh"

extern "C" __global__ void copy_rows(unsigned char* dst, i64 dst_stride, const unsigned char* src, i64 src_stride,
                                     i64 row_bytes, int align16, i64 rows) {
  LILY_PDL_PROLOGUE();
  for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
  unsigned char* d = dst + r * dst_stride;
  const unsigned char* s = src + r * src_stride;
  if (align16) {
    const i64 n = row_bytes / 16;
    for (i64 i = i64(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += i64(gridDim.x) * blockDim.x)
      reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
  } else {
    for (i64 i = i64(blockIdx.x) * blockDim.x + threadIdx.x; i < row_bytes; i += i64(gridDim.x) * blockDim.x)
      d[i] = s[i];
  }
  }
}

// to_bf16 = 1: f32 -> bf16; 0: bf16 -> f32. Strides in elements.
extern "C" __global__ void convert_rows(void* dst, i64 dst_stride, const void* src, i64 src_stride, i64 cols,
                                        int to_bf16, i64 rows) {
  LILY_PDL_PROLOGUE();
  for (i64 r = blockIdx.y; r < rows; r += gridDim.y)
  for (i64 c = i64(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += i64(gridDim.x) * blockDim.x) {
    if (to_bf16)
      static_cast<u16*>(dst)[r * dst_stride + c] = f32_to_bf16(static_cast<const float*>(src)[r * src_stride + c]);
    else
      static_cast<float*>(dst)[r * dst_stride + c] = bf16_to_f32(static_cast<const u16*>(src)[r * src_stride + c]);
  }
}

// elem_bytes 4 or 2; bits holds the element's bit pattern.
extern "C" __global__ void fill_rows(void* dst, i64 stride, i64 cols, int elem_bytes, u32 bits, i64 rows) {
  LILY_PDL_PROLOGUE();
  for (i64 r = blockIdx.y; r < rows; r += gridDim.y)
  for (i64 c = i64(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += i64(gridDim.x) * blockDim.x) {
    if (elem_bytes == 4)
      static_cast<u32*>(dst)[r * stride + c] = bits;
    else
      static_cast<u16*>(dst)[r * stride + c] = u16(bits);
  }
}

extern "C" __global__ void advance_position(const int* pos_in, int* pos_out, int T) {
  LILY_PDL_PROLOGUE();
  if (threadIdx.x == 0 && blockIdx.x == 0) pos_out[0] = pos_in[0] + T;
}

extern "C" __global__ void accept_drafts(const int* ids, i64 ids_stride, const int* y, i64 y_stride, int n,
                                         const int* pos_in, int* accepted, int* next_id, int* pos_out) {
  LILY_PDL_PROLOGUE();
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int a = 0;
  while (a < n - 1 && y[a * y_stride] == ids[(a + 1) * ids_stride]) ++a;
  const int pos = pos_in[0];  // pos_out may be pos_in
  accepted[0] = a;
  next_id[0] = y[a * y_stride];
  pos_out[0] = pos + a + 1;
}

extern "C" __global__ void copy_rows_at(unsigned* dst, i64 dst_stride, const unsigned* src, i64 src_stride,
                                        i64 src_rows, const int* index, i64 offset, i64 cols, i64 rows) {
  LILY_PDL_PROLOGUE();
  const i64 j = i64(index[0]) + offset;
  if (j < 0 || (j + 1) * rows > src_rows) return;
  const unsigned* s = src + j * rows * src_stride;
  for (i64 r = blockIdx.y; r < rows; r += gridDim.y)
  for (i64 c = i64(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += i64(gridDim.x) * blockDim.x)
    dst[r * dst_stride + c] = s[r * src_stride + c];
}

extern "C" __global__ void add_rows(float* out, i64 os, const float* a, i64 as, const float* b, i64 bs, i64 cols,
                                    i64 rows) {
  LILY_PDL_PROLOGUE();
  for (i64 r = blockIdx.y; r < rows; r += gridDim.y)
  for (i64 c = i64(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += i64(gridDim.x) * blockDim.x)
    out[r * os + c] = a[r * as + c] + b[r * bs + c];
}

// Dense: data holds rows of `cols` elements of dtype. Affine: data holds uint32 words of `bits`-bit codes
// (LSB first), scales/biases [rows, cols/group] of scale_dtype; value = fma(code, scale, bias) as the CPU.
extern "C" __global__ void embed_rows(float* out, i64 os, const int* ids, i64 ids_stride, const void* data,
                                      const void* scales, const void* biases, i64 rows, i64 cols, int dtype,
                                      int bits, int group, int scale_dtype, i64 T) {
  LILY_PDL_PROLOGUE();
  for (i64 t = blockIdx.y; t < T; t += gridDim.y) {
  const int id = ids[t * ids_stride];
  for (i64 c = i64(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += i64(gridDim.x) * blockDim.x) {
    float v;
    if (id < 0 || id >= rows) {
      v = __uint_as_float(0x7fc00000u);  // an id outside the table: NaN, visible downstream
    } else if (bits == 0) {
      v = load_as_f32(data, dtype, i64(id) * cols + c);
    } else {
      const int per = 32 / bits;
      const u32* w = static_cast<const u32*>(data) + i64(id) * (cols / per);
      const u32 word = w[c / per];
      const float q = float((word >> ((c % per) * bits)) & ((1u << bits) - 1u));
      const i64 g = i64(id) * (cols / group) + c / group;
      v = fmaf(q, load_as_f32(scales, scale_dtype, g), load_as_f32(biases, scale_dtype, g));
    }
    out[t * os + c] = v;
  }
  }
}
