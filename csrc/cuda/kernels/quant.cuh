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

// Element gi of dtype kDt (f32, or a 2-byte type whose array is 4-byte aligned) from the aligned 4-byte word holding
// it, as a cp.async of 4 bytes staged it: a 2-byte element's half is gi's parity.
template <int kDt>
__device__ __forceinline__ float word_scalar(u32 w, i64 gi) {
  if (kDt == LILY_F32) return __uint_as_float(w);
  const u16 h = u16(w >> ((gi & 1) * 16));
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

// ---- f16 operands: x as one fp16 term with a power-of-two scale per row and group part (the prefill GEMMs' default
// for affine weights whose codes enter the MMA exactly; the backend option prefill_x) ----
//
// Why not plain fp16: activations reach ~1e4 and beyond (the SiLU products before a down projection), past fp16's
// 65504, and tiny rows would lose precision as subnormals. Each row's inputs inside one group part (the inputs that
// share one fold into the fp32 accumulator) are multiplied by 2^e with e chosen so that their max |x| lands in
// [2^14, 2^15): exact in fp32, then one rounding to fp16 (relative error ≤ 2^-11, 8x finer than one bf16 term), and
// the fold multiplies the part's product sum by the group scale times 2^-e (exact: a power of two). e depends on the
// row's own inputs only, so the bits do not depend on T, the tile or the chunking.

// f16 pair (lo half = rn(lo), hi half = rn(hi)).
__device__ __forceinline__ u32 f16x2_rn(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The scale 2^e and its inverse 2^-e for inputs of max magnitude amax: amax · 2^e in [2^14, 2^15) when amax is a
// normal float of exponent 15 - 127 or more (smaller maxima keep e = 126: their scaled values stay below 2^14, no
// overflow, and the inverse stays a normal float); an infinite or NaN max gives a scale that keeps it infinite.
__device__ __forceinline__ void f16_part_scale(float amax, float& scale, float& inv) {
  const int E = max(int((__float_as_uint(amax) >> 23) & 0xffu), 15);  // biased exponent, ≥ 15
  scale = __uint_as_float(u32(268 - E) << 23);  // 2^(141 - E): amax · scale < 2^15
  inv = __uint_as_float(u32(E - 14) << 23);     // 2^(E - 141)
}

// N inputs of one row (N even; the row's group part spread over LANES neighbouring lanes, every lane taking part) as
// N / 2 f16 pairs of x · 2^e, e from the part's max |x|: this lane's max |v| (am), then a fixed xor tree over the
// lanes. Returns 2^-e.
template <int N, int LANES>
__device__ __forceinline__ float f16_scaled_pairs(const float* v, float am, u32* out) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
  float sc, inv;
  f16_part_scale(am, sc, inv);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) out[i] = f16x2_rn(v[2 * i] * sc, v[2 * i + 1] * sc);
  return inv;
}

// One row of n floats as padded / 2 f16 pairs of x · 2^e with one e for the whole row (f16_part_scale of the row's
// max |x|; an exact max, so any order), zeros from n up to padded, and 2^-e to *inv: the x rows of the prefill GEMMs
// (matmul_x_rows, moe_x_rows). Every thread of the block calls it; scratch is 32 floats of shared memory.
__device__ __forceinline__ void f16_scaled_row(const float* __restrict__ row, int n, int padded, u32* __restrict__ out,
                                               float* inv, float* scratch) {  // n, padded: K and KP (K is a macro)
  float am = 0.f;
  for (int k = threadIdx.x; k < n; k += blockDim.x) am = fmaxf(am, fabsf(row[k]));
  am = block_max(am, scratch);
  float sc, iv;
  f16_part_scale(am, sc, iv);
  for (int p = threadIdx.x; p < padded / 2; p += blockDim.x) {
    const int k = 2 * p;
    out[p] = f16x2_rn(k < n ? row[k] * sc : 0.f, k + 1 < n ? row[k + 1] * sc : 0.f);
  }
  if (threadIdx.x == 0) *inv = iv;
}

// An exact small integer pair (8-bit codes) as bf16x2, or f16x2 (F16).
template <bool F16>
__device__ __forceinline__ u32 half2_rn(float lo, float hi) {
  return F16 ? f16x2_rn(lo, hi) : bf16x2_rn(lo, hi);
}

// ---- 4-bit codes as exact half-precision pairs for the tensor cores: bf16, or f16 (F16) ----
// A code byte at the low byte of each half of p: OR-ing in the exponent of 128 (bf16: 8 mantissa bits) or 1024 (f16:
// 10) gives 128 + q or 1024 + q exactly, and one pair FMA subtracts it exactly.
template <bool F16>
__device__ __forceinline__ u32 q4_biased_pair(u32 p) {
  u32 r;
  if constexpr (F16)
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(p | 0x64006400u), "r"(0x3C003C00u), "r"(0xE400E400u));
  else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(p | 0x43004300u), "r"(0x3F803F80u), "r"(0xC300C300u));
  return r;
}

// The 8 codes of a q4 word as 4 exact pairs (codes 2j, 2j+1 in pair j): bytes of the even and odd codes, one PRMT
// per pair, then q4_biased_pair.
template <bool F16>
__device__ __forceinline__ void q4_word_pairs(u32 w, u32* out) {
  const u32 ev = w & 0x0F0F0F0Fu, od = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 p;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(p) : "r"(ev), "r"(od), "r"(u32(j | ((4 + j) << 8))));
    out[j] = q4_biased_pair<F16>(p & 0x00FF00FFu);
  }
}

// Codes widened straight into tensor-core B fragments (the MoE's fragment tiles, the dense GEMM's GFRAG): lane
// (g, t4) of an m16n8k16 B fragment holds k = 2·t4, 2·t4 + 1 (and + 8) of column g, i.e. byte t4 of the column's code
// word for those k. sel = t4 | (4 + t4) << 8: byte t4 of w and of w >> 4 land in bytes 0 and 2, the mask keeps each
// one's low nibble (a nibble at bit 4 of a half would reach the exponent). The pair (code 2·t4, code 2·t4 + 1).
template <bool F16>
__device__ __forceinline__ u32 q4_byte_pair(u32 w, u32 sel) {
  u32 p;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(p) : "r"(w), "r"(w >> 4), "r"(sel));
  return q4_biased_pair<F16>(p & 0x000F000Fu);
}

// ---- x as three int8 terms for dp4a (the decode GEMV matmul_gemv_dp4a and the decode MoE experts) ----
//
// A 16-byte chunk of a kBits affine row (EPC = 128 / kBits codes, inside one group) meets x as three int8 terms:
// s_c = max|x| / 127 over the chunk's inputs, y = x / s_c, h = rint(y), m = rint(254 (y − h)), l = rint(254 (254
// (y − h) − m)): x = s_c (h + m/254 + l/254²) to within 0.5 s_c / 254² = 3.1e-8 max|x_c| (plus fp32's rounding of
// y). Each term's dot product with the codes is exact in int32; the three combine in fp32 once per chunk.
// 4-bit: word i of a chunk holds codes 8i .. 8i+7, nibbles LSB first; w & 0x0F0F0F0F gives the even codes as bytes
// and w & 0xF0F0F0F0 the odd ones times 16, so each term is packed as even / odd byte quads and a chunk's integer
// sum is 16·Σeven + Σodd16 (= 16 Σ q·x_term): 8 LOP3 + 24 dp4a per chunk, no shifts. 8-bit: each word is 4 codes
// as bytes: 12 dp4a per chunk. Packed word (term t, parity p, code word i) of chunk c of an x row of nchunks chunks
// sits in uint4 xq[(t·NPAR + p)·nchunks + c], component i (chunk-minor: consecutive lanes reading consecutive chunks
// are conflict-free); xsc[c] = s_c (/16 for 4-bit), xsm[c] = Σ_c x in a fixed order.
template <int kBits>
struct Dp4a {
  static_assert(kBits == 4 || kBits == 8, "dp4a: 4- or 8-bit codes");
  static constexpr int EPC = 128 / kBits;      // inputs per chunk
  static constexpr int EW = EPC / 4;           // inputs per code word
  static constexpr int NPAR = kBits == 4 ? 2 : 1;
  static constexpr int QW = 3 * NPAR * 4;      // packed words per chunk
};
__device__ __forceinline__ int dp4a_us(u32 a, u32 b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 pack_i8x4(int a, int b, int c, int d) {
  return (u32(a) & 0xffu) | ((u32(b) & 0xffu) << 8) | ((u32(c) & 0xffu) << 16) | (u32(d) << 24);
}
// Code word i's inputs v of chunk c into their packed terms. The chunk's 4 words are taken by 4 neighbouring lanes
// (lane & 3 = i), all of which must call this (the max and sum are shuffles); live = false only pads a pass.
template <int kBits>
__device__ __forceinline__ void dp4a_quantize_word(const float (&v)[Dp4a<kBits>::EW], uint4* xq, int nchunks,
                                                   float* xsc, float* xsm, int c, int i, bool live) {
  constexpr int EW = Dp4a<kBits>::EW;
  float mx = 0.f, sum = 0.f;
#pragma unroll
  for (int e = 0; e < EW; ++e) mx = fmaxf(mx, fabsf(v[e])), sum += v[e];
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // a fixed tree: deterministic (a NaN input reaches the sum)
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  if (!live) return;
  const float inv = mx > 0.f ? __fdiv_rn(127.f, mx) : 0.f;  // an all-zero chunk: every term 0
  int h[EW], m[EW], l[EW];
#pragma unroll
  for (int e = 0; e < EW; ++e) {
    const float y = v[e] * inv;
    const float hf = rintf(y);
    const float r1 = (y - hf) * 254.f;
    const float mf = rintf(r1);
    h[e] = int(fminf(fmaxf(hf, -127.f), 127.f));
    m[e] = int(mf);
    l[e] = int(rintf((r1 - mf) * 254.f));
  }
  u32* q = reinterpret_cast<u32*>(xq);
  auto store_term = [&](int t, const int (&a)[EW]) {
    if (kBits == 4) {
      q[((t * 2 + 0) * nchunks + c) * 4 + i] = pack_i8x4(a[0], a[2], a[4 % EW], a[6 % EW]);
      q[((t * 2 + 1) * nchunks + c) * 4 + i] = pack_i8x4(a[1], a[3], a[5 % EW], a[7 % EW]);
    } else {
      q[(t * nchunks + c) * 4 + i] = pack_i8x4(a[0], a[1], a[2], a[3]);
    }
  };
  store_term(0, h);
  store_term(1, m);
  store_term(2, l);
  if (i == 0) {
    xsc[c] = (mx / 127.f) * (kBits == 4 ? 0.0625f : 1.f);
    xsm[c] = sum;
  }
}
// Rows r < rows of n chunks each (chunk c of row r: EPC floats at src + r·rstride + c·cstride) into their packed
// terms (row r's at xq + r·QW/4·n, xsc + r·n, xsm + r·n), by the whole block: 4 threads per chunk, passes of
// blockDim.x (a multiple of 32). vec: src and both strides allow 16-byte loads. The block must reach this together.
template <int kBits>
__device__ __forceinline__ void dp4a_quantize_rows(const float* src, i64 rstride, int cstride, int rows, int n,
                                                   bool vec, uint4* xq, float* xsc, float* xsm) {
  constexpr int EW = Dp4a<kBits>::EW, QV = Dp4a<kBits>::QW / 4;
  for (int base = 0; base < rows * n * 4; base += int(blockDim.x)) {
    const int q = base + int(threadIdx.x), r = q / (n * 4), c = (q >> 2) - r * n, i = q & 3;
    const bool live = r < rows;
    const int rr = live ? r : 0;
    const float* p = src + i64(rr) * rstride + i64(c) * cstride + i * EW;
    float v[EW];
#pragma unroll
    for (int e = 0; e < EW; e += 4) {
      float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
      if (live && vec) f = *reinterpret_cast<const float4*>(p + e);
      else if (live) f = make_float4(p[e], p[e + 1], p[e + 2], p[e + 3]);
      v[e] = f.x, v[e + 1] = f.y, v[e + 2] = f.z, v[e + 3] = f.w;
    }
    dp4a_quantize_word<kBits>(v, xq + rr * QV * n, n, xsc + rr * n, xsm + rr * n, c, i, live);
  }
}
// Chunk c's packed terms.
template <int kBits>
__device__ __forceinline__ void dp4a_load_x(const uint4* xq, int nchunks, int c, u32 (&xw)[Dp4a<kBits>::QW]) {
#pragma unroll
  for (int q = 0; q < Dp4a<kBits>::QW / 4; ++q) {
    const uint4 v = xq[q * nchunks + c];
    xw[4 * q] = v.x, xw[4 * q + 1] = v.y, xw[4 * q + 2] = v.z, xw[4 * q + 3] = v.w;
  }
}
// acc + scale·s_c·(H + (M + L/254)/254) + bias·Σ_c x over one chunk (codes wv, packed terms xw).
template <int kBits>
__device__ __forceinline__ float dp4a_chunk(const u32 (&wv)[4], const u32 (&xw)[Dp4a<kBits>::QW], float xs,
                                            float xsum, float sc, float bi, float acc) {
  int t0 = 0, t1 = 0, t2 = 0;
  if (kBits == 4) {
    int o0 = 0, o1 = 0, o2 = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 ev = wv[i] & 0x0F0F0F0Fu, od = wv[i] & 0xF0F0F0F0u;
      t0 = dp4a_us(ev, xw[0 * 4 + i], t0), o0 = dp4a_us(od, xw[1 * 4 + i], o0);
      t1 = dp4a_us(ev, xw[2 * 4 + i], t1), o1 = dp4a_us(od, xw[3 * 4 + i], o1);
      t2 = dp4a_us(ev, xw[4 * 4 + i], t2), o2 = dp4a_us(od, xw[5 * 4 + i], o2);
    }
    t0 = 16 * t0 + o0, t1 = 16 * t1 + o1, t2 = 16 * t2 + o2;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      t0 = dp4a_us(wv[i], xw[0 * 4 + i], t0);
      t1 = dp4a_us(wv[i], xw[1 * 4 + i], t1);
      t2 = dp4a_us(wv[i], xw[2 * 4 + i], t2);
    }
  }
  const float f = fmaf(fmaf(float(t2), 1.f / 254.f, float(t1)), 1.f / 254.f, float(t0));
  acc = fmaf(sc, f * xs, acc);
  return fmaf(bi, xsum, acc);
}
