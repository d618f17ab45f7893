// Weight-row helpers shared by the matmul and MoE kernel families (NVRTC; no CUDA headers).
//
// Formats (model/weight.h, MODEL.md §9): a row of W is either dense elements (f32 / f16 / bf16) or MLX affine
// codes (uint32 words, `bits` 2/4/8, element j of a row in word j / (32/bits) at bit bits·(j % (32/bits)),
// LSB first) with one scale and one bias per `group` elements: w = scale · q + bias (scale may be negative).
// Everything here works on 16-byte chunks of a row: EPC = 128 / bits-per-element elements per chunk
// (q4: 32, q8: 16, q2: 64, bf16/f16: 8, f32: 4).
//
// Alignment: mapped checkpoints start tensors at any byte offset (MLX's safetensors header is not padded).
// mm_load16<AL> reads the 16 bytes at p for a caller-proven alignment AL of p:
//   AL = 16: one 16-byte load (ld.global.nc.v4);  AL = 4: four 4-byte loads;
//   AL = 1 (any address): the five aligned words covering the bytes, realigned with funnel shifts.
// Bytes at or past `valid` read as 0, and a 4-byte word that holds no valid byte is never touched (so a
// chunk at the end of a mapping cannot fault: a word containing a valid byte lies in that byte's page).
//
// Affine dot products use "prescaled" x: for a code at bit offset o of its source word (the word itself for
// o + bits <= 23, else the word >> 12), the code is turned into a float by one LOP3 and one FADD,
// f = as_float(0x4B000000 | (src & (mask << o))) - 2^23 = q · 2^o (exact), and multiplied with
// x · 2^-o (exact: a power-of-two scaling) in one FMA. So a code costs 3 instructions, not 4-5
// (shift, and, convert, fma). q_prescale<BITS>(j) gives 2^-o for element j of a word-aligned run.
// Signatures here are stable (the MoE family includes this file).
#pragma once
#include "common.cuh"

// Bits per element and elements per 16-byte chunk of a format: kBits = 2/4/8 (affine) or 0 (dense, kDt the
// element dtype: LILY_F32 / LILY_F16 / LILY_BF16).
template <int kBits, int kDt>
struct WFmt {
  static constexpr int EB = kBits ? kBits : (kDt == LILY_F32 ? 32 : 16);
  static constexpr int EPC = 128 / EB;
};

__device__ __forceinline__ u32 mm_ld32(const unsigned char* p) {
  u32 v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 mm_ld128(const unsigned char* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Keeps the first n (0..16) bytes of a chunk, zeroes the rest.
__device__ __forceinline__ void mm_mask_bytes(u32 w[4], int n) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int b = n - 4 * i;
    if (b <= 0)
      w[i] = 0u;
    else if (b < 4)
      w[i] &= (1u << (8 * b)) - 1u;
  }
}

// The 16 bytes at p (alignment kAlign proven by the caller), bytes >= valid read as zero. valid may be <= 0.
template <int kAlign>
__device__ __forceinline__ void mm_load16(const unsigned char* p, int valid, u32 w[4]) {
  if (kAlign >= 16) {
    if (valid >= 16) {
      uint4 v = mm_ld128(p);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
      return;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = 4 * i < valid ? mm_ld32(p + 4 * i) : 0u;
    mm_mask_bytes(w, valid);
  } else if (kAlign >= 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = 4 * i < valid ? mm_ld32(p + 4 * i) : 0u;
    if (valid < 16) mm_mask_bytes(w, valid);
  } else {
    const int off = int(reinterpret_cast<unsigned long long>(p) & 3ull);
    const unsigned char* a = p - off;
    u32 r[5];
#pragma unroll
    for (int i = 0; i < 5; ++i) r[i] = 4 * i < off + valid ? mm_ld32(a + 4 * i) : 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __funnelshift_r(r[i], r[i + 1], 8 * off);  // off = 0: r[i]
    if (valid < 16) mm_mask_bytes(w, valid);
  }
}

// One scale / bias / dense element of dtype kDt at element index i of an array at p; kSal = 1 when p is
// aligned to the element size, 0 when it may sit at any byte address (then read byte by byte).
template <int kDt, int kSal>
__device__ __forceinline__ float mm_scalar(const void* p, i64 i) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  if (kDt == LILY_F32) {
    u32 u;
    if (kSal) {
      u = *reinterpret_cast<const u32*>(b + 4 * i);
    } else {
      const unsigned char* q = b + 4 * i;
      u = u32(q[0]) | (u32(q[1]) << 8) | (u32(q[2]) << 16) | (u32(q[3]) << 24);
    }
    return __uint_as_float(u);
  }
  u16 h;
  if (kSal) {
    h = *reinterpret_cast<const u16*>(b + 2 * i);
  } else {
    const unsigned char* q = b + 2 * i;
    h = u16(u32(q[0]) | (u32(q[1]) << 8));
  }
  return kDt == LILY_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// ---- affine codes ----

// Bit offset of code i (0 <= i < 32/kBits) within the word it is decoded from (see the file comment).
template <int kBits>
__device__ __forceinline__ constexpr int q_offset(int i) {
  return kBits * i + kBits > 23 ? kBits * i - 12 : kBits * i;
}
// 2^-offset of element j of a word-aligned run (multiply x_j by it once, when x is staged).
template <int kBits>
__device__ __forceinline__ float q_prescale(int j) {
  return __uint_as_float(u32(127 - q_offset<kBits>(j % (32 / kBits))) << 23);
}
// Code i of a word as an exact float (plain, not prescaled: for dequantising a tile).
template <int kBits>
__device__ __forceinline__ float q_code(u32 w, int i) {
  return float((w >> (kBits * i)) & ((1u << kBits) - 1u));
}
// d + Σ_i xs[i] · q_i over the 32/kBits codes of word w, xs prescaled by q_prescale (one fma chain, i ascending).
template <int kBits>
__device__ __forceinline__ float q_dot_word(u32 w, const float* xs, float d) {
  constexpr int kPer = 32 / kBits;
  constexpr u32 kMask = (1u << kBits) - 1u;
  const u32 hi = w >> 12;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const bool shifted = kBits * i + kBits > 23;
    const u32 src = shifted ? hi : w;
    const float q = __uint_as_float(0x4B000000u | (src & (kMask << q_offset<kBits>(i)))) - 8388608.f;
    d = fmaf(xs[i], q, d);
  }
  return d;
}
// Σ xs · q over kWords consecutive words (kWords · 32/kBits codes), starting from 0, one chain.
template <int kBits, int kWords>
__device__ __forceinline__ float q_dot_words(const u32* w, const float* xs) {
  float d = 0.f;
#pragma unroll
  for (int i = 0; i < kWords; ++i) d = q_dot_word<kBits>(w[i], xs + i * (32 / kBits), d);
  return d;
}

// ---- dense rows ----

// Element i (0 <= i < EPC) of a dense 16-byte chunk as f32.
template <int kDt>
__device__ __forceinline__ float dense_elem(const u32 w[4], int i) {
  if (kDt == LILY_F32) return __uint_as_float(w[i]);
  const u32 word = w[i >> 1];
  if (kDt == LILY_BF16) return __uint_as_float((i & 1) ? (word & 0xffff0000u) : (word << 16));
  return f16_to_f32(u16((i & 1) ? (word >> 16) : (word & 0xffffu)));
}
// acc + Σ_i x[i] · w_i over one dense chunk (EPC elements), one fma chain, i ascending.
template <int kDt>
__device__ __forceinline__ float dense_dot_chunk(const u32 w[4], const float* x, float acc) {
  constexpr int kEpc = WFmt<0, kDt>::EPC;
#pragma unroll
  for (int i = 0; i < kEpc; ++i) acc = fmaf(x[i], dense_elem<kDt>(w, i), acc);
  return acc;
}

// ---- bf16 operands for the tensor-core (mma.sync) kernels: matmul_gemm and the MoE prefill GEMMs ----

// bf16 pair (lo half = rn(lo), hi half = rn(hi)); round to nearest even, as f32_to_bf16.
__device__ __forceinline__ u32 bf16x2_rn(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// hi = bf16 pair of (a, b), lo = bf16 pair of the residuals (exact in f32: v − bf16(v) is representable).
__device__ __forceinline__ void split2_bf16(float a, float b, u32& hi, u32& lo) {
  hi = bf16x2_rn(a, b);
  lo = bf16x2_rn(a - __uint_as_float(hi << 16), b - __uint_as_float(hi & 0xffff0000u));
}

// The 8 codes of a q4 word as 4 exact bf16 pairs (codes 2j, 2j+1 in pair j): bytes of the even and odd
// codes, one PRMT + one LOP3 per pair giving the bf16 of 128 + q, and one exact bf16x2 fma subtracting 128.
__device__ __forceinline__ void q4_word_bf16(u32 w, u32* out) {
  const u32 ev = w & 0x0F0F0F0Fu, od = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 p;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(p) : "r"(ev), "r"(od), "r"(u32(j | ((4 + j) << 8))));
    p = (p & 0x00FF00FFu) | 0x43004300u;  // bf16 (128 + q_2j, 128 + q_2j+1)
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out[j]) : "r"(p), "r"(0x3F803F80u), "r"(0xC300C300u));
  }
}
