// CPU weight-streaming matmul: y[T, N] = x[T, K] · W[N, K]ᵀ with fp32 accumulation.
//
// Reads: x (T rows, stride ldx ≥ K, fp32), W in place (dense f32/f16/bf16 rows, or MLX affine codes
// [N, K·bits/32] uint32 plus scales/biases [N, K/group] in bf16/f16/f32). Writes: y (T rows, stride ldy ≥ N),
// overwritten. Never reads past row N-1 of W, past column K-1 of a row of x, nor past the scale arrays.
//
// Floors: Gemv (decode) streams W once: W.bytes() per call (q4g64: 0.5625 B/weight), so time ≥ bytes /
// DRAM bandwidth. Gemm (prefill) does 2·T·N·K FLOPs; W is dequantized once per 256-column K block and
// 32..128-row panel and reused across all T rows, so time ≥ 2·T·N·K / peak fp32 FMA rate for T ≳ 32.
//
// Determinism (see matmul.h): every output element is reduced in an order fixed by K, the group size and
// the compiled ISA only — never by T, by which rows share a batch, by tile position or by thread count:
//   Gemv: per group g (AVX-512 q4: per 128-code block, lanes covering one or more groups) a lane-wise fp32
//         dot d = Σ x·q over the codes' vectors in a fixed order, then acc += s·d lane-wise; the bias term
//         Σ_g b_g·(Σx)_g is accumulated lane-wise over groups (Σx per group is computed once per x row and
//         reused for all N rows); y = a fixed horizontal sum. Dense: two lane-wise accumulators
//         (even/odd vector index), y = hsum(a0 + a1). Rows per block (R) and x rows per pass only change
//         interleaving, never an output's own chain.
//   Gemm: w = fma(q, s, b) in fp32, then one sequential fma chain per output over k = 0..K-1 (the K blocking
//         stores the partial sum to y and reloads it, which is exact). This is the same order the scalar
//         fallback uses, so Gemm results are identical across AVX-512, AVX2 and scalar builds (with FMA).
// K is never split across threads; row/column tails run the same per-element chain as full tiles.
#include "cpu/matmul.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers trip -W(maybe-)uninitialized on _mm512_undefined_* (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#if defined(__AVX512F__)
#define LILY_MM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LILY_MM_AVX2 1
#include <immintrin.h>
#endif

namespace lily::cpu {

// Growable 64-byte aligned fp32 buffer (grows to at least twice its size, so lazy growth is rare).
struct ScratchBuffer {
  float* p = nullptr;
  size_t n = 0;
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer() { ::operator delete(p, std::align_val_t(64)); }
  float* get(int64_t need) {
    if (size_t(need) > n) {
      const size_t want = std::max(size_t(need), n * 2);
      float* q = static_cast<float*>(::operator new(want * sizeof(float), std::align_val_t(64)));
      ::operator delete(p, std::align_val_t(64));
      p = q;
      n = want;
    }
    return p;
  }
};

struct alignas(64) MatmulScratch {  // own cache lines: each is written by its own thread
  ScratchBuffer prep;  // Gemv: prepared x rows (filled by the calling thread, read by all threads)
  ScratchBuffer work;  // per thread: Gemm packed panels, Gemm scalar row, Gemv scale rows
};

namespace {

// ---------------------------------------------------------------------------------------------------------
// Scalar helpers (portable path, scale conversion, tails)

// One fused multiply-add when the hardware has it, so the scalar Gemm chain equals the SIMD one bit for bit.
inline float madd(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// validate() refuses other dtypes, so load_scalar's f32 default is never a silent zero.
inline float scalar_at(const void* p, DType t, int64_t i) { return load_scalar(p, t, i); }

// Code j of an affine row (bits 2, 4 or 8: elements never straddle a word); rows may be misaligned.
inline uint32_t code_at(const uint32_t* row, int bits, int64_t j) {
  const int per = 32 / bits;
  return (load_unaligned<uint32_t>(row, j / per) >> ((j % per) * bits)) & ((1u << bits) - 1u);
}

const uint32_t* affine_row(const WeightView& W, int64_t n) {
  return static_cast<const uint32_t*>(W.data) + n * (W.cols * W.bits / 32);
}

void validate(const WeightView& W) {
  if (W.rows <= 0 || W.cols <= 0) throw std::invalid_argument("matmul: weight has an empty shape");
  if (!W.data) throw std::invalid_argument("matmul: weight has no data");
  if (W.quantized()) {
    if (W.bits != 2 && W.bits != 4 && W.bits != 8)
      throw std::invalid_argument("matmul: affine bits must be 2, 4 or 8, got " + std::to_string(W.bits));
    if (W.group <= 0 || W.cols % W.group != 0 || W.group % (32 / W.bits) != 0)
      throw std::invalid_argument("matmul: affine group " + std::to_string(W.group) +
                                  " does not tile cols " + std::to_string(W.cols));
    if (!W.scales || !W.biases) throw std::invalid_argument("matmul: affine weight lacks scales/biases");
    if (W.scale_dtype == DType::I32) throw std::invalid_argument("matmul: scales must be f32/f16/bf16");
  } else if (W.dtype == DType::I32) {
    throw std::invalid_argument("matmul: dense weight must be f32/f16/bf16");
  }
}

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

#if defined(LILY_MM_AVX512) || defined(LILY_MM_AVX2)
// 8×8 fp32 transpose: src rows (stride ld) → dst rows (stride ldd).
inline void transpose8x8(const float* src, int64_t ld, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    r[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * ldd, _mm256_permute2f128_ps(r[j], r[4 + j], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ldd, _mm256_permute2f128_ps(r[j], r[4 + j], 0x31));
  }
}
#endif

// ---------------------------------------------------------------------------------------------------------
// Portable scalar kernels (the reference order; also the fallback for shapes the SIMD paths do not take)

// Row n, columns [k0, k0+len) as fp32 (affine: fma(q, s, b), exactly what the SIMD Gemm packers compute).
void decode_row_scalar(const WeightView& W, int64_t n, int64_t k0, int64_t len, float* out) {
  if (W.quantized()) {
    const uint32_t* row = affine_row(W, n);
    const int64_t ng = W.cols / W.group;
    for (int64_t i = 0; i < len; ++i) {
      int64_t k = k0 + i, g = k / W.group;
      out[i] = madd(float(code_at(row, W.bits, k)), scalar_at(W.scales, W.scale_dtype, n * ng + g),
                    scalar_at(W.biases, W.scale_dtype, n * ng + g));
    }
  } else {
    for (int64_t i = 0; i < len; ++i) out[i] = scalar_at(W.data, W.dtype, n * W.cols + k0 + i);
  }
}

void gemv_scalar(const float* x, int64_t T, int64_t ldx, const WeightView& W, float* y, int64_t ldy,
                 int64_t n0, int64_t n1) {
  const int64_t K = W.cols;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t t = 0; t < T; ++t) {
      const float* xr = x + t * ldx;
      if (W.quantized()) {
        const uint32_t* row = affine_row(W, n);
        const int64_t ng = K / W.group;
        float acc = 0.f, bsum = 0.f;
        for (int64_t g = 0; g < ng; ++g) {
          float d = 0.f, sx = 0.f;
          for (int64_t j = g * W.group; j < (g + 1) * W.group; ++j) {
            d = madd(xr[j], float(code_at(row, W.bits, j)), d);
            sx += xr[j];
          }
          acc = madd(scalar_at(W.scales, W.scale_dtype, n * ng + g), d, acc);
          bsum = madd(scalar_at(W.biases, W.scale_dtype, n * ng + g), sx, bsum);
        }
        y[t * ldy + n] = acc + bsum;
      } else {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc = madd(xr[k], scalar_at(W.data, W.dtype, n * K + k), acc);
        y[t * ldy + n] = acc;
      }
    }
  }
}

// Scratch sizes in floats, shared by the kernels and MatmulArena::reserve.
int64_t gemm_scalar_work(int64_t K) { return K; }

void gemm_scalar(const float* x, int64_t t0, int64_t t1, int64_t ldx, const WeightView& W, float* y,
                 int64_t ldy, int64_t n0, int64_t n1, ScratchBuffer& work) {
  const int64_t K = W.cols;
  float* w = work.get(gemm_scalar_work(K));
  for (int64_t n = n0; n < n1; ++n) {
    decode_row_scalar(W, n, 0, K, w);
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = x + t * ldx;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = madd(xr[k], w[k], acc);
      y[t * ldy + n] = acc;
    }
  }
}

#if defined(LILY_MM_AVX512) || defined(LILY_MM_AVX2)
// ---------------------------------------------------------------------------------------------------------
// SIMD layer: one struct per ISA with the same static interface, so the kernels below are written once.

#if defined(LILY_MM_AVX512)
struct V {
  using R = __m512;
  static constexpr int W = 16;                     // fp32 lanes
  static constexpr int GEMM_MR = 8, GEMM_NR = 32;  // micro-tile: 8 x-rows × 2 zmm of outputs
  static constexpr const char* isa = "avx512";
  static constexpr bool Q4_DWORD = true;  // Gemv q4 decodes whole uint32 words (see gemv_q4dw_block)
  static R zero() { return _mm512_setzero_ps(); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R set1(float v) { return _mm512_set1_ps(v); }
  static R bcast(const float* p) { return _mm512_set1_ps(*p); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(R v) {  // fixed tree: 16 → 8 → 4 → 2 → 1
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
  // hsum of four vectors at once, pairing lanes exactly as hsum does (so each result is bitwise equal).
  static __m128 hsum4(R a, R b, R c, R d) {
    R hab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));  // v_j + v_j+8
    R hcd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    R q = _mm512_add_ps(_mm512_shuffle_f32x4(hab, hcd, 0x88), _mm512_shuffle_f32x4(hab, hcd, 0xDD));  // +4
    q = _mm512_add_ps(q, _mm512_shuffle_ps(q, q, 0xEE));  // lane 0: q0 + q2, lane 1: q1 + q3
    q = _mm512_add_ps(q, _mm512_movehdup_ps(q));          // lane 0: (q0 + q2) + (q1 + q3)
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), q));
  }
  // Dense element loads of W lanes.
  static R load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static R load_bf16(const uint16_t* p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
  // 4-bit chunk of 32 codes (16 bytes) → 2 vectors in Gemv order: [even codes 0,2..30], [odd 1,3..31].
  static void q4_gemv(const uint8_t* p, R* out) {
    __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
    out[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
  }
  // 8-bit chunk of 32 codes → 2 vectors in natural order.
  static void q8_chunk(const uint8_t* p, R* out) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    out[1] = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
  // 4-bit chunk of 32 codes → 2 vectors in natural order (Gemm packing, dequant_row).
  static void q4_natural(const uint8_t* p, R* out) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i m = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
  }
  // In-register transpose of a W×W block: rows r[i] (stride ld in src) → dst rows (stride ldd).
  static void transpose_block(const float* src, int64_t ld, float* dst, int64_t ldd) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    // r[4i+j] holds rows 4i..4i+3 at columns j, j+4, j+8, j+12 (one per 128-bit lane).
    for (int j = 0; j < 4; ++j) {
      __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
      __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88),
             d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
      _mm512_storeu_ps(dst + (j + 0) * ldd, _mm512_shuffle_f32x4(a, c, 0x88));
      _mm512_storeu_ps(dst + (j + 8) * ldd, _mm512_shuffle_f32x4(a, c, 0xDD));
      _mm512_storeu_ps(dst + (j + 4) * ldd, _mm512_shuffle_f32x4(b, d, 0x88));
      _mm512_storeu_ps(dst + (j + 12) * ldd, _mm512_shuffle_f32x4(b, d, 0xDD));
    }
  }
  // Masked row load/store of the first `cols` lanes (Gemm tile edges; never touches lanes ≥ cols).
  static R load_n(const float* p, int cols) {
    return cols >= W ? load(p) : _mm512_maskz_loadu_ps(__mmask16((1u << cols) - 1u), p);
  }
  static void store_n(float* p, R v, int cols) {
    if (cols >= W)
      store(p, v);
    else
      _mm512_mask_storeu_ps(p, __mmask16((1u << cols) - 1u), v);
  }
  // Prefetch base + bytes into L2; the address may lie past the weights (prefetches never fault), so it is formed
  // as an integer rather than by pointer arithmetic.
  static void prefetch(const void* base, int64_t bytes) {
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + uintptr_t(bytes)), _MM_HINT_T1);
  }
};
#else  // AVX2 + FMA + F16C
struct V {
  using R = __m256;
  static constexpr int W = 8;
  static constexpr int GEMM_MR = 6, GEMM_NR = 16;  // 12 ymm accumulators + 2 weights + 1 broadcast
  static constexpr const char* isa = "avx2";
  static constexpr bool Q4_DWORD = false;
  static R zero() { return _mm256_setzero_ps(); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R set1(float v) { return _mm256_set1_ps(v); }
  static R bcast(const float* p) { return _mm256_set1_ps(*p); }  // not _mm256_broadcast_ss: GCC then spills
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(R v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
  static R load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static R load_bf16(const uint16_t* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  // 16 bytes → 4 vectors: [2l], [2l+1] for bytes 0..7, then [16+2l], [17+2l] for bytes 8..15.
  static void q4_gemv(const uint8_t* p, R* out) {
    const __m256i m = _mm256_set1_epi32(15);
    __m256i w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m256i w1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(w0, m));
    out[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4));
    out[2] = _mm256_cvtepi32_ps(_mm256_and_si256(w1, m));
    out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4));
  }
  static void q8_chunk(const uint8_t* p, R* out) {
    for (int i = 0; i < 4; ++i)
      out[i] = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
  static void q4_natural(const uint8_t* p, R* out) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i m = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
  }
  static void transpose_block(const float* src, int64_t ld, float* dst, int64_t ldd) {
    transpose8x8(src, ld, dst, ldd);
  }
  static __m256i lane_mask(int cols) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static R load_n(const float* p, int cols) { return cols >= W ? load(p) : _mm256_maskload_ps(p, lane_mask(cols)); }
  static void store_n(float* p, R v, int cols) {
    if (cols >= W)
      store(p, v);
    else
      _mm256_maskstore_ps(p, lane_mask(cols), v);
  }
  // Prefetch base + bytes into L2; the address may lie past the weights (prefetches never fault), so it is formed
  // as an integer rather than by pointer arithmetic.
  static void prefetch(const void* base, int64_t bytes) {
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + uintptr_t(bytes)), _MM_HINT_T1);
  }
};
#endif

constexpr int VW = V::W;
constexpr int CV = 32 / VW;  // vectors per 32-code chunk

// Converts n consecutive scale/bias values (from element off) to fp32 into dst, zero-padded to a multiple
// of VW so whole-vector reads are harmless.
template <DType DT>
inline void convert_run(const void* src, int64_t off, int64_t n, float* dst) {
  int64_t i = 0;
  if (DT == DType::F32) {
    std::memcpy(dst, static_cast<const float*>(src) + off, size_t(n) * 4);
    i = n;
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + off;
    for (; i + VW <= n; i += VW) V::store(dst + i, DT == DType::BF16 ? V::load_bf16(s + i) : V::load_f16(s + i));
    for (; i < n; ++i) {
      const uint16_t v = load_unaligned<uint16_t>(s, i);
      dst[i] = DT == DType::BF16 ? bf16_to_f32(v) : f16_to_f32(v);
    }
  }
  for (const int64_t e = round_up(n, VW); i < e; ++i) dst[i] = 0.f;
}

// ---------------------------------------------------------------------------------------------------------
// Gemv: x is first rewritten once per call (xp: codes' lane order, zero-padded; sx: per-group Σx), then
// each thread streams its contiguous rows of W, R rows at a time against up to 4 x rows.

struct GemvPrep {
  const float* xp;  // [T][Kp]
  const float* sx;  // [T][ngp] (affine only)
  int64_t Kp, ngp;
};

// Whether Gemv q4 takes the whole-word kernel: its lanes map to groups by (8·lane) / G, exact for these G.
bool gemv_q4dw(const WeightView& W) {
  return V::Q4_DWORD && W.quantized() && W.bits == 4 &&
         (W.group == 32 || W.group == 64 || W.group % 128 == 0);
}

// Prepared x: T rows of Kp (K rounded up to 128 or VW) plus ngp (K / group rounded up to VW) floats.
int64_t gemv_prep_floats(int64_t T, int64_t Kp, int64_t ngp) { return T * (Kp + ngp); }

GemvPrep gemv_prepare(const float* x, int64_t T, int64_t ldx, const WeightView& W, ScratchBuffer& prep) {
  const int64_t K = W.cols;
  GemvPrep p{};
  const bool q4dw = gemv_q4dw(W);
  p.Kp = round_up(K, q4dw ? 128 : VW);
  p.ngp = W.quantized() ? round_up(K / W.group, VW) : 0;
  float* buf = prep.get(gemv_prep_floats(T, p.Kp, p.ngp));
  float* xp = buf;
  float* sx = buf + T * p.Kp;
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * ldx;
    float* o = xp + t * p.Kp;
    if (q4dw) {
      // 128-code block: lane i of vector m holds code 8i + m (nibble m of word i), i.e. the block is a
      // 16×8 matrix to transpose: two 8×8 register transposes (rows 0-7 → lanes 0-7, rows 8-15 → 8-15).
      int64_t c = 0;
      for (; c + 128 <= K; c += 128) {
        transpose8x8(xr + c, 8, o + c, 16);
        transpose8x8(xr + c + 64, 8, o + c + 8, 16);
      }
      if (c < K) {  // partial block: zero codes meet zero x
        for (int m = 0; m < 8; ++m)
          for (int i = 0; i < 16; ++i) o[c + 16 * m + i] = c + 8 * i + m < K ? xr[c + 8 * i + m] : 0.f;
      }
    } else if (W.quantized() && W.bits == 4) {
      // Byte b of a 32-code chunk feeds lane b % VW of vectors 2(b / VW) (low nibble) and 2(b / VW) + 1.
      for (int64_t c = 0; c < K; c += 32)
        for (int b = 0; b < 16; ++b) {
          o[c + (2 * (b / VW)) * VW + b % VW] = xr[c + 2 * b];
          o[c + (2 * (b / VW) + 1) * VW + b % VW] = xr[c + 2 * b + 1];
        }
    } else {
      std::memcpy(o, xr, size_t(K) * 4);
    }
    if (!q4dw)
      for (int64_t k = K; k < p.Kp; ++k) o[k] = 0.f;
    if (W.quantized()) {
      const int64_t ng = K / W.group;
      float* s = sx + t * p.ngp;
      // Σx per group: lane-wise over the group's vectors, then the fixed horizontal tree.
      for (int64_t g = 0; g < ng; ++g) {
        typename V::R a = V::load(xr + g * W.group);
        for (int64_t j = g * W.group + VW; j < (g + 1) * W.group; j += VW) a = V::add(a, V::load(xr + j));
        s[g] = V::hsum(a);
      }
      for (int64_t g = ng; g < p.ngp; ++g) s[g] = 0.f;
    }
  }
  p.xp = xp;
  p.sx = sx;
  return p;
}

// Gemv software prefetch (into L2) of the block PF_BLOCKS row blocks ahead. A block's R rows are read in
// lock-step (R short streams), which the hardware prefetchers track poorly. 75 MB q4 matrix, 1 thread:
// no prefetch 5.7 GB/s; L1 hint, 1-4 blocks 9.2; L2 hint, 4 blocks 11.0 (kernel from cache: 15.4).
constexpr int PF_BLOCKS = 4;

template <int BITS, int R, int TT>
void gemv_affine_block(const WeightView& W, const GemvPrep& P, int64_t n, int64_t t0, float* y, int64_t ldy,
                       float* sc, float* bi) {
  const int64_t K = W.cols, G = W.group, ng = K / G, ngp = P.ngp;
  const int64_t words = K * BITS / 32;
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r)
    rows[r] = reinterpret_cast<const uint8_t*>(static_cast<const uint32_t*>(W.data) + (n + r) * words);
  const float* xs[TT];
  for (int t = 0; t < TT; ++t) xs[t] = P.xp + (t0 + t) * P.Kp;

  // Bias part, lane-wise over groups: Σ_g b_g · Σx_g.
  typename V::R bacc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) bacc[r][t] = V::zero();
  for (int64_t g = 0; g < ngp; g += VW)
    for (int r = 0; r < R; ++r) {
      typename V::R b = V::load(bi + r * ngp + g);
      for (int t = 0; t < TT; ++t) bacc[r][t] = V::fma(b, V::load(P.sx + (t0 + t) * ngp + g), bacc[r][t]);
    }

  typename V::R acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = V::zero();
  const int64_t chunks = G / 32;
  for (int64_t g = 0; g < ng; ++g) {
    typename V::R d[R][TT];
    // The rows of this block are read in lock-step (R short streams), which the hardware prefetchers
    // track poorly: fetch the same bytes of the block after next ahead of time. Prefetches never fault.
    if (PF_BLOCKS > 0 && t0 == 0)
      for (int64_t off = round_up(g * G * BITS / 8, 64); off < (g + 1) * G * BITS / 8; off += 64)
        for (int r = 0; r < R; ++r) V::prefetch(rows[r], PF_BLOCKS * R * words * 4 + off);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = g * G + c * 32;
      typename V::R wv[R][CV];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = rows[r] + k * BITS / 8;
        if (BITS == 4)
          V::q4_gemv(p, wv[r]);
        else
          V::q8_chunk(p, wv[r]);
      }
      for (int t = 0; t < TT; ++t)
        for (int v = 0; v < CV; ++v) {
          typename V::R xv = V::load(xs[t] + k + v * VW);
          for (int r = 0; r < R; ++r)
            d[r][t] = (c == 0 && v == 0) ? V::mul(wv[r][v], xv) : V::fma(wv[r][v], xv, d[r][t]);
        }
    }
    for (int r = 0; r < R; ++r) {
      typename V::R s = V::bcast(sc + r * ngp + g);
      for (int t = 0; t < TT; ++t) acc[r][t] = V::fma(s, d[r][t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + n + r] = V::hsum(acc[r][t]) + V::hsum(bacc[r][t]);
}

#if defined(LILY_MM_AVX512)
// Up to 16 scale/bias values from element off as fp32 lanes (masked: never reads past `count`).
inline __m512 load_scalars16(const void* base, DType t, int64_t off, int64_t count) {
  const __mmask16 m = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1u);
  if (t == DType::F32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + off);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + off);
  if (t == DType::F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// AVX-512 q4: a 64-byte load holds 16 uint32 words = 128 codes; vector m takes nibble m of every word
// (shift, then vpermps on a 0..15 table: the permute reads only the index's low 4 bits, so no mask and no
// int→float convert). Lane i of a block is code 8i + m, so its group varies by lane: the scale is applied
// lane-wise, permuted out of a register holding 16 of the row's scales (loaded straight from W, no
// staging buffer). A partial last block is a masked load (zero codes, zero x).
template <int R, int TT>
void gemv_q4dw_block(const WeightView& W, const GemvPrep& P, int64_t n, int64_t t0, float* y, int64_t ldy) {
  const int64_t K = W.cols, G = W.group, ng = K / G, ngp = P.ngp;
  const int64_t words = K / 8;
  const uint32_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const uint32_t*>(W.data) + (n + r) * words;
  const float* xs[TT];
  for (int t = 0; t < TT; ++t) xs[t] = P.xp + (t0 + t) * P.Kp;

  if (PF_BLOCKS > 0 && t0 == 0) {  // this block's scales/biases were prefetched PF_BLOCKS blocks ago
    const int64_t sb = int64_t(dtype_size(W.scale_dtype)), ahead = (n + PF_BLOCKS * R) * ng * sb;
    for (int64_t off = 0; off < R * ng * sb; off += 64) {
      V::prefetch(W.scales, ahead + off);
      V::prefetch(W.biases, ahead + off);
    }
  }
  // The accumulators start with the bias part, lane-wise over groups: Σ_g b_g · Σx_g (Σx is zero past ng).
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ngp; g += 16)
    for (int r = 0; r < R; ++r) {
      __m512 b = load_scalars16(W.biases, W.scale_dtype, (n + r) * ng + g, ng - g);
      for (int t = 0; t < TT; ++t)
        acc[r][t] = _mm512_fmadd_ps(b, _mm512_loadu_ps(P.sx + (t0 + t) * ngp + g), acc[r][t]);
    }

  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Lane i of a block reads group (8i) / G past the block's first group (G ≥ 128: the same group).
  const __m512i lane_group = G >= 128 ? _mm512_setzero_si512()
                                      : _mm512_srli_epi32(_mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64,
                                                                            72, 80, 88, 96, 104, 112, 120),
                                                          G == 64 ? 6 : 5);
  const int64_t pf = PF_BLOCKS * R * words * 4;  // bytes ahead: the same block PF_BLOCKS row-blocks on
  __m512 sv[R];       // scales of groups [gbase, gbase + 16) of each row
  int64_t gbase = -16;
  // One 128-code block; dw[r] holds its 16 words of row r; g0 is the block's first group.
  auto block = [&](const __m512i* dw, int64_t c, int64_t g0) __attribute__((always_inline)) {
    if (g0 >= gbase + 16) {
      gbase = g0;
      for (int r = 0; r < R; ++r) sv[r] = load_scalars16(W.scales, W.scale_dtype, (n + r) * ng + g0, ng - g0);
    }
    const __m512i idx = _mm512_add_epi32(lane_group, _mm512_set1_epi32(int(g0 - gbase)));
    __m512 d[R][TT];
    for (int m = 0; m < 8; ++m) {
      __m512 q[R];
      for (int r = 0; r < R; ++r)
        q[r] = _mm512_permutexvar_ps(m == 0 ? dw[r] : _mm512_srli_epi32(dw[r], 4 * m), table);
      for (int t = 0; t < TT; ++t) {
        __m512 xv = _mm512_loadu_ps(xs[t] + c + 16 * m);
        for (int r = 0; r < R; ++r) d[r][t] = m == 0 ? _mm512_mul_ps(q[r], xv) : _mm512_fmadd_ps(q[r], xv, d[r][t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 sl = _mm512_permutexvar_ps(idx, sv[r]);
      for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_fmadd_ps(sl, d[r][t], acc[r][t]);
    }
  };
  const int64_t full = K / 128 * 128;
  const int64_t gstep = G <= 128 ? 128 / G : 0;  // G > 128 is a multiple of 128: count blocks instead
  const int64_t bpg = G <= 128 ? 1 : G / 128;
  int64_t g0 = 0, in_group = 0;
  for (int64_t c = 0; c < full; c += 128) {
    __m512i dw[R];
    for (int r = 0; r < R; ++r) {
      if (PF_BLOCKS > 0 && t0 == 0) V::prefetch(rows[r], c / 2 + pf);
      dw[r] = _mm512_loadu_si512(rows[r] + c / 8);
    }
    block(dw, c, g0);
    if (gstep) {
      g0 += gstep;
    } else if (++in_group == bpg) {
      in_group = 0;
      ++g0;
    }
  }
  if (full < K) {  // 32, 64 or 96 codes left: masked words read as zero codes (x is zero there too)
    const __mmask16 m = __mmask16((1u << ((K - full) / 8)) - 1u);
    __m512i dw[R];
    for (int r = 0; r < R; ++r) dw[r] = _mm512_maskz_loadu_epi32(m, rows[r] + full / 8);
    block(dw, full, g0);
  }
  if (R == 4 && TT == 1) {  // decode: four adjacent outputs, reduced together (same tree as V::hsum)
    _mm_storeu_ps(y + t0 * ldy + n, V::hsum4(acc[0][0], acc[1 % R][0], acc[2 % R][0], acc[3 % R][0]));
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + n + r] = V::hsum(acc[r][t]);
}
#endif

// Dense rows: W lanes per step, accumulators alternate by vector index parity; the K tail goes through a
// zero-padded copy (never reads past the row) with the parity of its index.
template <DType DT>
inline typename V::R load_dense(const void* base, int64_t i) {
  if (DT == DType::F32) return V::load(static_cast<const float*>(base) + i);
  if (DT == DType::F16) return V::load_f16(static_cast<const uint16_t*>(base) + i);
  return V::load_bf16(static_cast<const uint16_t*>(base) + i);
}

template <DType DT, int R, int TT>
void gemv_dense_block(const WeightView& W, const GemvPrep& P, int64_t n, int64_t t0, float* y, int64_t ldy) {
  const int64_t K = W.cols, full = K / VW;
  const size_t es = dtype_size(DT);
  const char* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const char*>(W.data) + (n + r) * K * es;
  const float* xs[TT];
  for (int t = 0; t < TT; ++t) xs[t] = P.xp + (t0 + t) * P.Kp;
  typename V::R acc[2][R][TT];
  for (int p = 0; p < 2; ++p)
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TT; ++t) acc[p][r][t] = V::zero();
  auto step = [&](int p, const typename V::R* wv, int64_t k) {
    for (int t = 0; t < TT; ++t) {
      typename V::R xv = V::load(xs[t] + k);
      for (int r = 0; r < R; ++r) acc[p][r][t] = V::fma(wv[r], xv, acc[p][r][t]);
    }
  };
  int64_t c = 0;
  for (; c + 2 <= full; c += 2) {
    typename V::R wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_dense<DT>(rows[r], c * VW);
    step(0, wv, c * VW);
    for (int r = 0; r < R; ++r) wv[r] = load_dense<DT>(rows[r], (c + 1) * VW);
    step(1, wv, (c + 1) * VW);
  }
  if (c < full) {
    typename V::R wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_dense<DT>(rows[r], c * VW);
    step(0, wv, c * VW);
    ++c;
  }
  if (K % VW) {
    alignas(64) uint8_t tail[R][VW * 4];
    typename V::R wv[R];
    for (int r = 0; r < R; ++r) {
      std::memset(tail[r], 0, sizeof(tail[r]));
      std::memcpy(tail[r], rows[r] + c * VW * es, size_t(K % VW) * es);
      wv[r] = load_dense<DT>(tail[r], 0);
    }
    step(int(c & 1), wv, c * VW);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + n + r] = V::hsum(V::add(acc[0][r][t], acc[1][r][t]));
}

// Rows [n0, n1) for all T: R rows per block (fewer x rows → more W rows in flight), TT ≤ 4 x rows at once.
template <int R, int TT>
void gemv_block_dispatch(const WeightView& W, const GemvPrep& P, int64_t n, int64_t t0, float* y, int64_t ldy,
                         float* sc, float* bi) {
  if (W.quantized()) {
    if (W.bits == 4) {
#if defined(LILY_MM_AVX512)
      if (gemv_q4dw(W)) return gemv_q4dw_block<R, TT>(W, P, n, t0, y, ldy);
#endif
      gemv_affine_block<4, R, TT>(W, P, n, t0, y, ldy, sc, bi);
    }
    else
      gemv_affine_block<8, R, TT>(W, P, n, t0, y, ldy, sc, bi);
  } else if (W.dtype == DType::F32) {
    gemv_dense_block<DType::F32, R, TT>(W, P, n, t0, y, ldy);
  } else if (W.dtype == DType::F16) {
    gemv_dense_block<DType::F16, R, TT>(W, P, n, t0, y, ldy);
  } else {
    gemv_dense_block<DType::BF16, R, TT>(W, P, n, t0, y, ldy);
  }
}

template <int R>
void gemv_rows(const WeightView& W, const GemvPrep& P, int64_t T, int64_t n, float* y, int64_t ldy, float* sc,
               float* bi) {
  if (W.quantized() && !gemv_q4dw(W)) {
    // Scales and biases as fp32, row r at r·ngp (a multiple of VW, so the kernel's vector reads line up
    // with these stores), zero past ng.
    const int64_t ng = W.cols / W.group;
    for (int r = 0; r < R; ++r) {
      switch (W.scale_dtype) {
        case DType::F32:
          convert_run<DType::F32>(W.scales, (n + r) * ng, ng, sc + r * P.ngp);
          convert_run<DType::F32>(W.biases, (n + r) * ng, ng, bi + r * P.ngp);
          break;
        case DType::F16:
          convert_run<DType::F16>(W.scales, (n + r) * ng, ng, sc + r * P.ngp);
          convert_run<DType::F16>(W.biases, (n + r) * ng, ng, bi + r * P.ngp);
          break;
        default:
          convert_run<DType::BF16>(W.scales, (n + r) * ng, ng, sc + r * P.ngp);
          convert_run<DType::BF16>(W.biases, (n + r) * ng, ng, bi + r * P.ngp);
          break;
      }
    }
  }
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) gemv_block_dispatch<R, 4>(W, P, n, t, y, ldy, sc, bi);
  switch (T - t) {
    case 3: gemv_block_dispatch<R, 3>(W, P, n, t, y, ldy, sc, bi); break;
    case 2: gemv_block_dispatch<R, 2>(W, P, n, t, y, ldy, sc, bi); break;
    case 1: gemv_block_dispatch<R, 1>(W, P, n, t, y, ldy, sc, bi); break;
    default: break;
  }
}

constexpr int RMAX = 4;  // most W rows per Gemv block
int64_t gemv_work_floats(int64_t ngp) { return 2 * RMAX * ngp + 1; }

void gemv_simd_range(const WeightView& W, const GemvPrep& P, int64_t T, float* y, int64_t ldy, int64_t n0,
                     int64_t n1, ScratchBuffer& work) {
  float* sc = work.get(gemv_work_floats(P.ngp));
  float* bi = sc + RMAX * P.ngp;
  int64_t n = n0;
  if (T <= 2) {
    for (; n + 4 <= n1; n += 4) gemv_rows<4>(W, P, T, n, y, ldy, sc, bi);
  }
  for (; n + 2 <= n1; n += 2) gemv_rows<2>(W, P, T, n, y, ldy, sc, bi);
  for (; n < n1; ++n) gemv_rows<1>(W, P, T, n, y, ldy, sc, bi);
}

bool gemv_simd_ok(const WeightView& W) {
  return !W.quantized() || ((W.bits == 4 || W.bits == 8) && W.group % 32 == 0);
}

// ---------------------------------------------------------------------------------------------------------
// Gemm: per K block of KC columns, NR-row panels of W are dequantized and transposed into Wp[k][NR]
// (fp32, L2-resident), then an MR×NR register tile runs over all x rows with one fma chain per output.

constexpr int MR = V::GEMM_MR, NR = V::GEMM_NR;
constexpr int64_t KC = 256;        // K block (multiple of 32 and of every supported group size ≤ 256)
constexpr int64_t KS = 64;         // rows are decoded KS columns at a time into a small row-major tile
constexpr int64_t PANELS = 4;      // panels packed per K block: x tile reused from L1 across them

// WeightView kinds the Gemm packer is specialised for (one dispatch per panel, not per segment).
enum Kind { KQ4, KQ8, KF32, KF16, KBF16 };
int kind_of(const WeightView& W) {
  if (W.quantized()) return W.bits == 4 ? KQ4 : KQ8;
  return W.dtype == DType::F32 ? KF32 : W.dtype == DType::F16 ? KF16 : KBF16;
}

// Decodes row n, columns [k0, k0+len) (len ≤ KS) as fp32 into out[0..KS), zero beyond len.
template <int KIND>
inline void decode_seg_k(const WeightView& W, int64_t n, int64_t k0, int64_t len, float* out) {
  if constexpr (KIND == KQ4 || KIND == KQ8) {
    // K and k0 are multiples of 32, so len is too; every 32-code chunk sits inside one group.
    const int64_t G = W.group, ng = W.cols / G;
    const uint8_t* row = reinterpret_cast<const uint8_t*>(affine_row(W, n));
    int64_t g = k0 / G, gend = (g + 1) * G;  // one division per segment
    typename V::R s = V::set1(scalar_at(W.scales, W.scale_dtype, n * ng + g));
    typename V::R b = V::set1(scalar_at(W.biases, W.scale_dtype, n * ng + g));
    for (int64_t c = 0; c < len; c += 32) {
      const int64_t k = k0 + c;
      if (k >= gend) {
        ++g;
        gend += G;
        s = V::set1(scalar_at(W.scales, W.scale_dtype, n * ng + g));
        b = V::set1(scalar_at(W.biases, W.scale_dtype, n * ng + g));
      }
      typename V::R q[CV];
      if constexpr (KIND == KQ4)
        V::q4_natural(row + k / 2, q);
      else
        V::q8_chunk(row + k, q);
      for (int v = 0; v < CV; ++v) V::store(out + c + v * VW, V::fma(q[v], s, b));
    }
  } else {
    constexpr DType DT = KIND == KF32 ? DType::F32 : KIND == KF16 ? DType::F16 : DType::BF16;
    const int64_t base = n * W.cols + k0;
    int64_t i = 0;
    for (; i + VW <= len; i += VW) V::store(out + i, load_dense<DT>(W.data, base + i));
    for (; i < len; ++i) out[i] = scalar_at(W.data, DT, base + i);
  }
  for (int64_t i = len; i < KS; ++i) out[i] = 0.f;
}

void decode_seg(const WeightView& W, int64_t n, int64_t k0, int64_t len, float* out) {
  switch (kind_of(W)) {
    case KQ4: return decode_seg_k<KQ4>(W, n, k0, len, out);
    case KQ8: return decode_seg_k<KQ8>(W, n, k0, len, out);
    case KF32: return decode_seg_k<KF32>(W, n, k0, len, out);
    case KF16: return decode_seg_k<KF16>(W, n, k0, len, out);
    default: return decode_seg_k<KBF16>(W, n, k0, len, out);
  }
}

// Panel of rows [nb, nb+NR) ∩ [0, N), columns [k0, k0+kc) → wp[k][NR]; rows past N are zero.
template <int KIND>
void pack_panel(const WeightView& W, int64_t nb, int64_t k0, int64_t kc, float* wp, float* tile) {
  for (int64_t ks = 0; ks < kc; ks += KS) {
    const int64_t len = std::min(KS, kc - ks);
    for (int i = 0; i < NR; ++i) {
      if (nb + i < W.rows)
        decode_seg_k<KIND>(W, nb + i, k0 + ks, len, tile + i * KS);
      else
        std::memset(tile + i * KS, 0, KS * sizeof(float));
    }
    // Transposing whole VW-wide column blocks may write rows up to round_up(len, VW) ≤ KS: the packed
    // panel is KC + KS rows tall, and rows ≥ kc are never read.
    for (int64_t kk = 0; kk < len; kk += VW)
      for (int ib = 0; ib < NR; ib += VW) V::transpose_block(tile + ib * KS + kk, KS, wp + (ks + kk) * NR + ib, NR);
  }
}

// y[i][0..cols) (+)= Σ_k x[i][k] · wp[k][·] for i < M. One fma chain per output, k ascending.
template <int M>
inline void micro_loop(const float* x, int64_t ldx, const float* wp, int64_t kc,
                       typename V::R (&acc)[M][NR / VW]) {
  constexpr int NV = NR / VW;
  const float* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = x + i * ldx;
  for (int64_t k = 0; k < kc; ++k) {
    typename V::R b[NV];
    for (int j = 0; j < NV; ++j) b[j] = V::load(wp + k * NR + j * VW);
    for (int i = 0; i < M; ++i) {
      typename V::R a = V::bcast(xr[i] + k);
      for (int j = 0; j < NV; ++j) acc[i][j] = V::fma(a, b[j], acc[i][j]);
    }
  }
}

template <int M>
void micro_kernel(const float* x, int64_t ldx, const float* wp, int64_t kc, float* y, int64_t ldy,
                  bool accumulate, int cols) {
  constexpr int NV = NR / VW;
  typename V::R acc[M][NV];
  if (cols == NR) {  // full tile: plain loads and stores keep the accumulators in registers
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = accumulate ? V::load(y + i * ldy + j * VW) : V::zero();
    micro_loop<M>(x, ldx, wp, kc, acc);
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) V::store(y + i * ldy + j * VW, acc[i][j]);
    return;
  }
  // Column tail: the same chain per output; lanes ≥ cols hold zero weights and are never stored.
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NV; ++j)
      acc[i][j] = accumulate && cols > j * VW ? V::load_n(y + i * ldy + j * VW, cols - j * VW) : V::zero();
  micro_loop<M>(x, ldx, wp, kc, acc);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NV; ++j)
      if (cols > j * VW) V::store_n(y + i * ldy + j * VW, acc[i][j], cols - j * VW);
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, int);
template <int... Ms>
constexpr auto make_micro_table(std::integer_sequence<int, Ms...>) {
  return std::array<MicroFn, sizeof...(Ms)>{&micro_kernel<Ms + 1>...};
}

constexpr int64_t GEMM_PANEL_FLOATS = (KC + KS) * NR;
constexpr int64_t GEMM_WORK_FLOATS = PANELS * GEMM_PANEL_FLOATS + NR * KS;  // panels + decode tile

void gemm_simd_range(const float* x, int64_t t0, int64_t t1, int64_t ldx, const WeightView& W, float* y,
                     int64_t ldy, int64_t n0, int64_t n1, ScratchBuffer& work) {
  static constexpr auto micro = make_micro_table(std::make_integer_sequence<int, MR>{});
  const int64_t K = W.cols;
  const int64_t panel_floats = GEMM_PANEL_FLOATS;
  using PackFn = void (*)(const WeightView&, int64_t, int64_t, int64_t, float*, float*);
  static constexpr PackFn packers[] = {&pack_panel<KQ4>, &pack_panel<KQ8>, &pack_panel<KF32>, &pack_panel<KF16>,
                                       &pack_panel<KBF16>};
  const PackFn pack = packers[kind_of(W)];
  float* wp = work.get(GEMM_WORK_FLOATS);
  float* tile = wp + PANELS * panel_floats;
  for (int64_t nc = n0; nc < n1; nc += PANELS * NR) {
    const int64_t npan = std::min<int64_t>(PANELS, (n1 - nc + NR - 1) / NR);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t p = 0; p < npan; ++p) pack(W, nc + p * NR, k0, kc, wp + p * panel_floats, tile);
      for (int64_t t = t0; t < t1; t += MR) {
        const int m = int(std::min<int64_t>(MR, t1 - t));
        for (int64_t p = 0; p < npan; ++p) {
          const int64_t nb = nc + p * NR;
          const int cols = int(std::min<int64_t>(NR, n1 - nb));
          micro[m - 1](x + t * ldx + k0, ldx, wp + p * panel_floats, kc, y + t * ldy + nb, ldy, k0 > 0, cols);
        }
      }
    }
  }
}

bool gemm_simd_ok(const WeightView& W) {
  return !W.quantized() || ((W.bits == 4 || W.bits == 8) && W.group % 32 == 0);
}
#endif  // SIMD

// ---------------------------------------------------------------------------------------------------------
// Dispatch shared by matmul / matmul_serial: kernels take a range of W rows (and of x rows for Gemm).

bool uses_simd(const WeightView& W, MatmulPath path) {
#if defined(LILY_MM_AVX512) || defined(LILY_MM_AVX2)
  return path == MatmulPath::Gemv ? gemv_simd_ok(W) : gemm_simd_ok(W);
#else
  (void)W;
  (void)path;
  return false;
#endif
}

// pool == nullptr: serial on `scratch(0)`; else thread t of the pool uses scratch(t) (the caller is 0).
template <class ScratchOf>
void run(const float* x, int64_t T, int64_t ldx, const WeightView& W, float* y, int64_t ldy, MatmulPath path,
         ThreadPool* pool, ScratchOf&& scratch) {
  validate(W);
  if (T <= 0) return;
  if (ldx < W.cols || ldy < W.rows) throw std::invalid_argument("matmul: ldx < K or ldy < N");
  const int64_t N = W.rows;
  const int threads = pool ? pool->size() : 1;
  [[maybe_unused]] const bool simd = uses_simd(W, path);
  // fn(b, e, work): a template, not std::function, so a product never allocates outside its scratch.
  auto over_n = [&](int64_t grain, auto&& fn) {
    if (pool && threads > 1)
      pool->parallel_for(N, grain, [&](int64_t b, int64_t e, int t) { fn(b, e, scratch(t).work); });
    else
      fn(0, N, scratch(0).work);
  };
  if (path == MatmulPath::Gemv) {
#if defined(LILY_MM_AVX512) || defined(LILY_MM_AVX2)
    if (simd) {
      GemvPrep P = gemv_prepare(x, T, ldx, W, scratch(0).prep);
      over_n(16, [&](int64_t b, int64_t e, ScratchBuffer& work) { gemv_simd_range(W, P, T, y, ldy, b, e, work); });
      return;
    }
#endif
    over_n(16, [&](int64_t b, int64_t e, ScratchBuffer&) { gemv_scalar(x, T, ldx, W, y, ldy, b, e); });
    return;
  }
  // Gemm: split N in NR-aligned ranges; if N has too few panels for the threads, split the x rows instead
  // (each thread then packs the same panels; the per-output chain is unchanged).
  auto range = [&](int64_t tb, int64_t te, int64_t nb, int64_t ne, ScratchBuffer& work) {
#if defined(LILY_MM_AVX512) || defined(LILY_MM_AVX2)
    if (simd) return gemm_simd_range(x, tb, te, ldx, W, y, ldy, nb, ne, work);
#endif
    gemm_scalar(x, tb, te, ldx, W, y, ldy, nb, ne, work);
  };
#if defined(LILY_MM_AVX512) || defined(LILY_MM_AVX2)
  const int64_t nr = NR, mr = MR;
#else
  const int64_t nr = 16, mr = 4;
#endif
  const int64_t panels = (N + nr - 1) / nr;
  if (pool && threads > 1 && panels < 2 * threads && T >= 2 * mr) {
    pool->parallel_for(T, mr, [&](int64_t b, int64_t e, int t) { range(b, e, 0, N, scratch(t).work); });
    return;
  }
  over_n(nr, [&](int64_t b, int64_t e, ScratchBuffer& work) { range(0, T, b, e, work); });
}

}  // namespace

MatmulArena::MatmulArena(int threads) : threads_(std::max(1, threads)), s_(new MatmulScratch[size_t(threads_)]) {}
MatmulArena::~MatmulArena() = default;

MatmulScratch& MatmulArena::at(int thread_index) {
  if (thread_index < 0 || thread_index >= threads_)
    throw std::out_of_range("MatmulArena: thread index " + std::to_string(thread_index) + " of an arena for " +
                            std::to_string(threads_) + " threads");
  return s_[size_t(thread_index)];
}

void MatmulArena::reserve(int64_t max_rows, int64_t max_k, int64_t max_n) {
  if (max_rows < 0 || max_k < 0 || max_n < 0) throw std::invalid_argument("MatmulArena::reserve: negative bound");
  // N never sizes scratch (every kernel streams W rows through fixed-size blocks); the bounds over weight
  // kinds are the largest each kernel's own size formula can reach for K <= max_k.
  int64_t prep = 0, work = gemm_scalar_work(max_k);
#if defined(LILY_MM_AVX512) || defined(LILY_MM_AVX2)
  // SIMD affine groups are multiples of 32 (gemv_simd_ok), so K / group <= K / 32; Kp pads to <= 128.
  const int64_t ngp = round_up(max_k / 32, VW), kp = round_up(max_k, 128);
  prep = gemv_prep_floats(max_rows, kp, ngp);
  work = std::max({work, gemv_work_floats(ngp), GEMM_WORK_FLOATS});
#endif
  for (int t = 0; t < threads_; ++t) {  // every thread: matmul_serial prepares x in its own scratch
    if (prep > 0) s_[size_t(t)].prep.get(prep);
    s_[size_t(t)].work.get(work);
  }
}

size_t MatmulArena::bytes() const {
  size_t b = 0;
  for (int t = 0; t < threads_; ++t) b += (s_[size_t(t)].prep.n + s_[size_t(t)].work.n) * sizeof(float);
  return b;
}

void matmul(const float* x, int64_t T, int64_t ldx, const WeightView& W, float* y, int64_t ldy,
            MatmulPath path, ThreadPool& pool, MatmulArena& arena) {
  run(x, T, ldx, W, y, ldy, path, &pool, [&](int t) -> MatmulScratch& { return arena.at(t); });
}

void matmul_serial(const float* x, int64_t T, int64_t ldx, const WeightView& W, float* y, int64_t ldy,
                   MatmulPath path, MatmulScratch& scratch) {
  run(x, T, ldx, W, y, ldy, path, nullptr, [&](int) -> MatmulScratch& { return scratch; });
}

void dequant_row(const WeightView& W, int64_t r, float* out) {
  validate(W);
  if (r < 0 || r >= W.rows) throw std::out_of_range("dequant_row: row " + std::to_string(r) + " out of range");
#if defined(LILY_MM_AVX512) || defined(LILY_MM_AVX2)
  if (gemm_simd_ok(W)) {
    // Same values the Gemm packer produces (fma(q, s, b)), KS columns at a time through a small buffer.
    alignas(64) float seg[KS];
    for (int64_t k = 0; k < W.cols; k += KS) {
      const int64_t len = std::min<int64_t>(KS, W.cols - k);
      decode_seg(W, r, k, len, seg);
      std::memcpy(out + k, seg, size_t(len) * sizeof(float));
    }
    return;
  }
#endif
  decode_row_scalar(W, r, 0, W.cols, out);
}

const char* matmul_variant(const WeightView& W, MatmulPath path) {
  // Static strings for each (path, weight kind, ISA) the dispatcher in run() can take.
  const bool simd = uses_simd(W, path);
  const bool gemv = path == MatmulPath::Gemv;
  int kind;  // 0 q4, 1 q8, 2 f32, 3 f16, 4 bf16, 5 other quantized (q2)
  if (W.quantized())
    kind = W.bits == 4 ? 0 : W.bits == 8 ? 1 : 5;
  else
    kind = W.dtype == DType::F32 ? 2 : W.dtype == DType::F16 ? 3 : 4;
  static const char* scalar_names[2][6] = {
      {"gemm_q4_scalar", "gemm_q8_scalar", "gemm_f32_scalar", "gemm_f16_scalar", "gemm_bf16_scalar",
       "gemm_q2_scalar"},
      {"gemv_q4_scalar", "gemv_q8_scalar", "gemv_f32_scalar", "gemv_f16_scalar", "gemv_bf16_scalar",
       "gemv_q2_scalar"}};
  if (!simd) return scalar_names[gemv][kind];
#if defined(LILY_MM_AVX512)
  if (gemv && kind == 0 && !gemv_q4dw(W)) return "gemv_q4_avx512_bytewise";  // groups not in {32, 64, 128·m}
  static const char* names[2][5] = {
      {"gemm_q4_avx512_8x32", "gemm_q8_avx512_8x32", "gemm_f32_avx512_8x32", "gemm_f16_avx512_8x32",
       "gemm_bf16_avx512_8x32"},
      {"gemv_q4_avx512", "gemv_q8_avx512", "gemv_f32_avx512", "gemv_f16_avx512", "gemv_bf16_avx512"}};
  return names[gemv][kind];
#elif defined(LILY_MM_AVX2)
  static const char* names[2][5] = {
      {"gemm_q4_avx2_6x16", "gemm_q8_avx2_6x16", "gemm_f32_avx2_6x16", "gemm_f16_avx2_6x16",
       "gemm_bf16_avx2_6x16"},
      {"gemv_q4_avx2", "gemv_q8_avx2", "gemv_f32_avx2", "gemv_f16_avx2", "gemv_bf16_avx2"}};
  return names[gemv][kind];
#else
  return scalar_names[gemv][kind];
#endif
}

}  // namespace lily::cpu
