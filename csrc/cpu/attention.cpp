// Gated full attention kernels (MODEL.md section 4).
// qk_prep: qg [T, heads*2*D] (per head [query D | gate D]), k [T, kv*D] -> q, gate [T, heads*D], k [T, kv*D].
// kv cache: [kv_heads * max_ctx, D] per layer, fp32 or bf16 (rows widened to fp32 as they are read),
// head-major so one head's keys are contiguous.
// attention: per query head h (kv head h / group), scores over cache rows 0..pos, fp32 softmax,
// weighted sum of values, times sigmoid(gate). Floor per decode step: reads 2·kv·pos·D·4 bytes of cache; a prefill
// chunk reads it once per tile of up to 16 query rows (attention_tile_rows), not once per row.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/backend.h"
#include "cpu/math.h"
#include "cpu/reduce.h"
#include "model/config.h"

namespace lily::cpu {

// Partial rotate-half RoPE on the first rd dims: pairs (i, i + rd/2), angle p · theta^(-2i/rd).
static void rope(float* x, int64_t rd, int64_t pos, double theta) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; ++i) {
    // Frequencies in fp32 like the reference, angle in double so large positions keep their precision.
    const float inv_freq = float(1.0 / std::pow(theta, double(2 * i) / double(rd)));
    const double ang = double(pos) * double(inv_freq);
    const float c = float(std::cos(ang)), s = float(std::sin(ang));
    const float x0 = x[i], x1 = x[i + half];
    x[i] = x0 * c - x1 * s;
    x[i + half] = x1 * c + x0 * s;
  }
}

void CpuOps::attn_qk_prep_impl(const Tensor& qg, const Tensor& k, const Tensor& q_norm,
                               const Tensor& k_norm, const Tensor& pos, const AttentionShape& s,
                               const Tensor& q_out, const Tensor& gate_out, const Tensor& k_out) {
  const int64_t D = s.head_dim, pos0 = *i32(pos);
  const float *pqg = f32(qg), *pk = f32(k), *wq = f32(q_norm), *wk = f32(k_norm);
  float *pq = f32(q_out), *pg = f32(gate_out), *pko = f32(k_out);
  pool().parallel_for(qg.rows, 4, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pos = pos0 + t;
      for (int64_t h = 0; h < s.heads; ++h) {
        const float* src = pqg + t * qg.stride + h * 2 * D;
        float* q = pq + t * q_out.stride + h * D;
        rms_norm_segment(src, wq, D, s.eps, q);
        rope(q, s.rotary_dim, pos, s.rope_theta);
        std::copy(src + D, src + 2 * D, pg + t * gate_out.stride + h * D);
      }
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        float* ko = pko + t * k_out.stride + h * D;
        rms_norm_segment(pk + t * k.stride + h * D, wk, D, s.eps, ko);
        rope(ko, s.rotary_dim, pos, s.rope_theta);
      }
    }
  });
}

void CpuOps::kv_append_impl(const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& k_cache,
                            const Tensor& v_cache, int64_t max_ctx, const AttentionShape& s) {
  const int64_t D = s.head_dim, pos0 = *i32(pos);
  // The session never submits past max_context; a position that says otherwise is a corrupted state.
  if (pos0 < 0 || pos0 + k.rows > max_ctx)
    throw std::logic_error("kv_append: position " + std::to_string(pos0) + " + " + std::to_string(k.rows) +
                           " rows exceeds max_context " + std::to_string(max_ctx));
  const float *pk = f32(k), *pv = f32(v);
  const bool half = k_cache.dtype == DType::BF16;
  for (int64_t t = 0; t < k.rows; ++t)
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t row = h * max_ctx + pos0 + t;
      const float* ks = pk + t * k.stride + h * D;
      const float* vs = pv + t * v.stride + h * D;
      if (half) {
        uint16_t *kd = u16(k_cache) + row * D, *vd = u16(v_cache) + row * D;
        for (int64_t e = 0; e < D; ++e) {
          kd[e] = f32_to_bf16(ks[e]);
          vd[e] = f32_to_bf16(vs[e]);
        }
      } else {
        std::copy(ks, ks + D, f32(k_cache) + row * D);
        std::copy(vs, vs + D, f32(v_cache) + row * D);
      }
    }
}

// Query rows per work item: the rows of a tile share each cached K and V row's load (and its bf16 widening), so a
// prefill chunk reads the cache once per tile instead of once per row; their scores are kept whole, [rows · group,
// max_ctx] per thread, so at most 16 rows and a 2 MiB score buffer (one row at the real model's longest contexts);
// and few enough rows that the items (tiles × kv heads) still cover every thread (a warm turn's 18 rows on 16
// threads: tiles of 2). Never more for fewer rows, so a workspace sized for a scratch's rows fits every call.
static int64_t attention_tile_rows(int64_t rows, int64_t group, int64_t kv_heads, int64_t max_ctx, int64_t threads) {
  const int64_t per_row = std::max<int64_t>(1, group * max_ctx * int64_t(sizeof(float)));
  const int64_t fit = std::max<int64_t>(1, (int64_t(2) << 20) / per_row);
  const int64_t tiles_needed = (std::max<int64_t>(1, threads) + kv_heads - 1) / std::max<int64_t>(1, kv_heads);
  return std::max<int64_t>(1, std::min({int64_t(16), fit, rows / tiles_needed}));
}
// Cached rows per key block: a tile's query heads walk the block's K (then V) rows while one query vector (one
// accumulator row) stays in L1 beside them, rather than every query vector and accumulator per key.
constexpr int64_t kKeyBlock = 16;

// Per thread: scores [tile · group, max_ctx], the output accumulators [tile · group, D] and a key block widened from
// bf16 [kKeyBlock, D].
static size_t attention_thread_floats(size_t tile, size_t group, size_t D, size_t max_ctx) {
  auto r16 = [](size_t n) { return (n + 15) / 16 * 16; };
  return r16(tile * group * max_ctx) + r16(tile * group * D) + r16(size_t(kKeyBlock) * D);
}

size_t attention_workspace_bytes(const ModelConfig& c, int64_t rows, int64_t max_ctx, int threads) {
  const int64_t group = c.heads / c.kv_heads;
  const size_t tile = size_t(attention_tile_rows(rows, group, c.kv_heads, max_ctx, threads));
  return Arena::need<float>(size_t(threads) *
                            attention_thread_floats(tile, size_t(group), size_t(c.head_dim), size_t(max_ctx)));
}

void CpuOps::attention_impl(const Tensor& q, const Tensor& gate, const Tensor& k_cache,
                            const Tensor& v_cache, const Tensor& pos, int64_t max_ctx,
                            const AttentionShape& s, const Tensor& ws, const Tensor& out) {
  const int64_t D = s.head_dim, T = q.rows, group = s.heads / s.kv_heads, pos0 = *i32(pos);
  const float scale = 1.f / std::sqrt(float(D));
  const float *pq = f32(q), *pg = f32(gate);
  float* po = f32(out);
  const bool half = k_cache.dtype == DType::BF16;
  // Cached rows [j0, j0 + n) of one kv head as fp32 rows of stride D: the cache itself (fp32) or widened into `tmp`.
  auto rows_at = [&](const Tensor& cache, int64_t kvh, int64_t j0, int64_t n, float* tmp) -> const float* {
    const int64_t r = (kvh * max_ctx + j0) * D;
    if (!half) return f32(cache) + r;
    const uint16_t* src = u16(cache) + r;
    for (int64_t e = 0; e < n * D; ++e) tmp[e] = bf16_to_f32(src[e]);
    return tmp;
  };
  // GQA packing, row tiles and key blocks: one work item is (a tile of R query rows, kv head); each cached K and V
  // row is loaded once per item, a block of kKeyBlock rows at a time, and used by the `group` query heads of every
  // row of the tile that sees it (causal: row t sees positions < pos0 + t + 1). Items are dealt round-robin so the
  // long causal rows at the end of a chunk spread over every thread. Each row's arithmetic (its dot products, its
  // softmax over the positions in order, its weighted sum in position order) is the same whatever R, the blocks and
  // whichever item holds it, and depends only on its absolute position, so chunked and unchunked prefill agree
  // bitwise.
  if (pos0 + T > max_ctx) throw std::logic_error("attention: position past max_context");
  const int64_t P = pool().size();
  const int64_t R = attention_tile_rows(T, group, s.kv_heads, max_ctx, P), tiles = (T + R - 1) / R;
  const int64_t items = tiles * s.kv_heads;
  Arena a = arena(ws, "attention");
  const size_t per = attention_thread_floats(size_t(R), size_t(group), size_t(D), size_t(max_ctx));
  float* const base = a.take<float>(size_t(P) * per);
  pool().parallel_for(std::min(P, items), 1, [&](int64_t r0, int64_t r1, int tid) {
    float* scores = base + size_t(tid) * per;  // [(ti · group + g) · max_ctx + j]
    float* acc = scores + (size_t(R * group * max_ctx) + 15) / 16 * 16;  // [(ti · group + g) · D + e]
    float* tmp = acc + (size_t(R * group * D) + 15) / 16 * 16;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = r; i < items; i += P) {
        const int64_t tile = i / s.kv_heads, kvh = i % s.kv_heads;
        const int64_t t0 = tile * R, rows = std::min(R, T - t0), last = pos0 + t0 + rows;  // positions seen: < last
        for (int64_t j0 = 0; j0 < last; j0 += kKeyBlock) {
          const int64_t nb = std::min(kKeyBlock, last - j0);
          const float* kb = rows_at(k_cache, kvh, j0, nb, tmp);
          for (int64_t ti = std::max<int64_t>(0, j0 - pos0 - t0); ti < rows; ++ti) {  // the rows that see j0
            const int64_t jend = std::min(j0 + nb, pos0 + t0 + ti + 1);
            for (int64_t g = 0; g < group; ++g) {
              const float* qv = pq + (t0 + ti) * q.stride + (kvh * group + g) * D;
              float* sc = scores + (ti * group + g) * max_ctx;
              for (int64_t j = j0; j < jend; ++j) sc[j] = dot(qv, kb + (j - j0) * D, D) * scale;
            }
          }
        }
        for (int64_t ti = 0; ti < rows; ++ti) {
          const int64_t n = pos0 + t0 + ti + 1;
          for (int64_t g = 0; g < group; ++g) {
            float* sc = scores + (ti * group + g) * max_ctx;
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sc[j]);
            float sum = 0.f;
            for (int64_t j = 0; j < n; ++j) {
              sc[j] = std::exp(sc[j] - mx);
              sum += sc[j];
            }
            const float inv = 1.f / sum;
            for (int64_t j = 0; j < n; ++j) sc[j] *= inv;
          }
        }
        std::fill(acc, acc + rows * group * D, 0.f);
        for (int64_t j0 = 0; j0 < last; j0 += kKeyBlock) {
          const int64_t nb = std::min(kKeyBlock, last - j0);
          const float* vb = rows_at(v_cache, kvh, j0, nb, tmp);
          for (int64_t ti = std::max<int64_t>(0, j0 - pos0 - t0); ti < rows; ++ti) {
            const int64_t jend = std::min(j0 + nb, pos0 + t0 + ti + 1);
            for (int64_t g = 0; g < group; ++g) {
              const float* sc = scores + (ti * group + g) * max_ctx;
              float* ag = acc + (ti * group + g) * D;
              for (int64_t j = j0; j < jend; ++j) {  // positions in order, per element
                const float p = sc[j];
                const float* vr = vb + (j - j0) * D;
                for (int64_t e = 0; e < D; ++e) ag[e] += p * vr[e];
              }
            }
          }
        }
        for (int64_t ti = 0; ti < rows; ++ti)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t t = t0 + ti, h = kvh * group + g;
            const float* gt = pg + t * gate.stride + h * D;
            float* o = po + t * out.stride + h * D;
            const float* ag = acc + (ti * group + g) * D;
            for (int64_t e = 0; e < D; ++e) o[e] = ag[e] / (1.f + std::exp(-gt[e]));
          }
      }
  });
}

}  // namespace lily::cpu
