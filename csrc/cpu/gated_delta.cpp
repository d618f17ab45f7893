// Gated DeltaNet kernels (MODEL.md section 5).
// conv1d_silu: mixed [T, C] with conv_state [K-1, C] (pre-conv rows of the previous K-1 tokens, oldest
//   first), weights [C, K] (tap K-1 = current token) -> out [T, C] = silu(conv); state keeps the last K-1 rows.
// gated_delta: direct sequential scan, one value head per work item, its fp32 state [Dk, Dv] read and
//   written twice per token while it sits in cache. Floor: T·Hv·Dk·Dv·8 FLOPs; the state moves through
//   memory once per call (Hv·Dk·Dv·4 bytes each way), not once per token.
// Captures (ops.h StateCapture): the state after row r is a copy taken when the scan has just finished row r
//   (gated_delta: the head's [Dk, Dv] rows; conv1d_silu: the K-1 pre-conv rows ending at r), so it is the state
//   a call over rows 0..r leaves, bit for bit; each capture writes R·cols·4 bytes more.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/backend.h"
#include "cpu/math.h"
#include "cpu/reduce.h"
#include "model/config.h"

namespace lily::cpu {

// Per thread: normalised q and k [Dk], and m, delta, o [Dv].
static size_t delta_thread_floats(size_t Dk, size_t Dv) { return (2 * Dk + 3 * Dv + 15) / 16 * 16; }

size_t delta_workspace_bytes(const ModelConfig& c, int threads) {
  return Arena::need<float>(size_t(threads) * delta_thread_floats(size_t(c.lin_k_dim), size_t(c.lin_v_dim)));
}

void CpuOps::conv1d_silu_impl(const Tensor& mixed, const Tensor& conv_w, const Tensor& state_in,
                              const Tensor& state_out, const Tensor& out, const StateCapture& capture) {
  // Out of place (a decode step writing the other state set): start from a copy, then update in place.
  if (state_in.buf != state_out.buf || state_in.offset != state_out.offset) copy_impl(state_in, state_out);
  const Tensor& conv_state = state_out;
  const int64_t T = mixed.rows, C = mixed.cols, K = conv_w.cols, S = K - 1;
  const float *px = f32(mixed), *pw = f32(conv_w);
  float *pst = f32(conv_state), *po = f32(out);
  float* const pcap = capture.active() ? f32(capture.states) : nullptr;
  // Blocks of channels, rows walked in order inside a block: every load is a contiguous run of the
  // row-major [T, C] input (walking one channel down all rows would touch a new cache line per tap).
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  pool().parallel_for(blocks, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, T * K)), [&](int64_t b0, int64_t b1, int) {
    float w[16][kBlock];  // taps transposed to [K][block] (K <= 16)
    float acc[kBlock];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t c0 = blk * kBlock, n = std::min(kBlock, C - c0);
      for (int64_t j = 0; j < K; ++j)
        for (int64_t c = 0; c < n; ++c) w[j][c] = pw[(c0 + c) * K + j];
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t c = 0; c < n; ++c) acc[c] = 0.f;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t src = t - S + j;  // token index; negative = from the carried state
          const float* x = src >= 0 ? px + src * mixed.stride + c0 : pst + (S + src) * conv_state.stride + c0;
          for (int64_t c = 0; c < n; ++c) acc[c] += w[j][c] * x[c];
        }
        float* o = po + t * out.stride + c0;
        for (int64_t c = 0; c < n; ++c) o[c] = silu(acc[c]);
      }
      // Captures first, while the state still holds the rows before the chunk: after row t the state is the
      // S pre-conv rows t-S+1 .. t of [state; mixed], the same rows the update below picks for t = T-1.
      for (int64_t i = 0; i < capture.count; ++i)
        for (int64_t r = 0; r < S; ++r) {
          const int64_t src = capture.first + i - S + 1 + r;
          const float* x = src >= 0 ? px + src * mixed.stride + c0 : pst + (S + src) * conv_state.stride + c0;
          float* dst = pcap + (i * S + r) * capture.states.stride + c0;
          for (int64_t c = 0; c < n; ++c) dst[c] = x[c];
        }
      // New state: the last S pre-conv rows of [state; mixed]. Row r reads row r + T of the old state
      // (or an input row), always at or after r, so ascending r is safe in place.
      for (int64_t r = 0; r < S; ++r) {
        const int64_t src = T - S + r;
        const float* x = src >= 0 ? px + src * mixed.stride + c0 : pst + (S + src) * conv_state.stride + c0;
        float* dst = pst + r * conv_state.stride + c0;
        for (int64_t c = 0; c < n; ++c) dst[c] = x[c];
      }
    }
  });
}

void CpuOps::gated_delta_impl(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                              const Tensor& dt_bias, const Tensor& state_in, const Tensor& state_out,
                              const DeltaShape& s, const Tensor& ws, const Tensor& out,
                              const StateCapture& capture) {
  const int64_t T = qkv.rows, Dk = s.k_dim, Dv = s.v_dim, key_dim = s.k_heads * Dk;
  const int64_t ratio = s.v_heads / s.k_heads;
  const float *px = f32(qkv), *pb = f32(b), *pa = f32(a), *pA = f32(A_log), *pdt = f32(dt_bias);
  // The first token's decay reads state_in and writes state_out; every later access is to state_out, so
  // an out-of-place step (a decode step writing the other state set) costs no extra pass over the state.
  const Tensor& state = state_out;
  const float* pS_in = f32(state_in);
  float *pS = f32(state_out), *po = f32(out);
  float* const pcap = capture.active() ? f32(capture.states) : nullptr;
  const Tensor& cap = capture.states;
  const float q_scale = 1.f / std::sqrt(float(Dk));
  Arena arn = arena(ws, "gated_delta");
  const size_t per = delta_thread_floats(size_t(Dk), size_t(Dv));
  float* const base = arn.take<float>(size_t(pool().size()) * per);
  pool().parallel_for(s.v_heads, 1, [&](int64_t h0, int64_t h1, int tid) {
    float* const qn = base + size_t(tid) * per;
    float* const kn = qn + Dk;
    float* const m = kn + Dk;
    float* const delta = m + Dv;
    float* const o = delta + Dv;
    for (int64_t j = h0; j < h1; ++j) {
      const int64_t kh = j / ratio;  // value heads 2g, 2g+1 share key head g (ratio 2)
      float* S = pS + j * Dk * state.stride;
      const float* S_first = pS_in + j * Dk * state_in.stride;
      const float neg_A = -std::exp(pA[j]);
      for (int64_t t = 0; t < T; ++t) {
        const float* row = px + t * qkv.stride;
        const float* q = row + kh * Dk;
        const float* k = row + key_dim + kh * Dk;
        const float* v = row + 2 * key_dim + j * Dv;
        const float sq = sum_squares(q, Dk), sk = sum_squares(k, Dk);
        const float rq = q_scale / std::sqrt(sq + 1e-6f), rk = 1.f / std::sqrt(sk + 1e-6f);
        for (int64_t i = 0; i < Dk; ++i) {
          qn[i] = q[i] * rq;
          kn[i] = k[i] * rk;
        }
        const float beta = sigmoid(pb[t * b.stride + j]);
        const float alpha = std::exp(neg_A * softplus(pa[t * a.stride + j] + pdt[j]));
        // 1-2: decay, then read with the decayed state
        std::fill(m, m + Dv, 0.f);
        for (int64_t i = 0; i < Dk; ++i) {
          float* Si = S + i * state.stride;
          const float* src = t == 0 ? S_first + i * state_in.stride : Si;
          const float ki = kn[i];
          for (int64_t e = 0; e < Dv; ++e) {
            Si[e] = src[e] * alpha;
            m[e] += ki * Si[e];
          }
        }
        // 3: delta
        for (int64_t e = 0; e < Dv; ++e) delta[e] = beta * (v[e] - m[e]);
        // 4-5: rank-1 write, then the output reads the updated state
        std::fill(o, o + Dv, 0.f);
        for (int64_t i = 0; i < Dk; ++i) {
          float* Si = S + i * state.stride;
          const float ki = kn[i], qi = qn[i];
          for (int64_t e = 0; e < Dv; ++e) {
            Si[e] += ki * delta[e];
            o[e] += qi * Si[e];
          }
        }
        std::copy(o, o + Dv, po + t * out.stride + j * Dv);
        const int64_t ci = t - capture.first;  // slice ci of the capture: the state after row t
        if (ci >= 0 && ci < capture.count)
          for (int64_t i = 0; i < Dk; ++i)
            std::copy(S + i * state.stride, S + i * state.stride + Dv,
                      pcap + ((ci * s.v_heads + j) * Dk + i) * cap.stride);
      }
    }
  });
}

}  // namespace lily::cpu
