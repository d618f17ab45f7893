// Sparse MoE kernels (MODEL.md section 6).
// moe_route: logits [T, E] -> fp32 softmax over all E, top-k (ties to the lower id), renormalised.
// moe_experts: x [T, H]; tokens grouped by expert so each expert's gate/up [I, H] and down [H, I]
//   weights stream once per call; per token the k expert outputs are summed in ascending expert id, so
//   the result does not depend on how a prompt is chunked. Floor: reads the weights of every expert hit
//   (3·I·H weights each), 6·T·k·I·H FLOPs.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/backend.h"

namespace lily::cpu {

static inline float silu(float x) { return x / (1.f + std::exp(-x)); }

void CpuOps::moe_route_impl(const Tensor& logits, int64_t k, const Tensor& ids, const Tensor& weights) {
  const int64_t E = logits.cols;
  const float* pl = f32(logits);
  int32_t* pid = i32(ids);
  float* pw = f32(weights);
  std::vector<float> p(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < logits.rows; ++t) {
    const float* l = pl + t * logits.stride;
    const float mx = *std::max_element(l, l + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[size_t(e)] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[size_t(e)] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t x, int32_t y) {
      return p[size_t(x)] > p[size_t(y)] || (p[size_t(x)] == p[size_t(y)] && x < y);
    });
    float top = 0.f;
    for (int64_t s = 0; s < k; ++s) top += p[size_t(order[size_t(s)])];
    for (int64_t s = 0; s < k; ++s) {
      pid[t * ids.stride + s] = order[size_t(s)];
      pw[t * weights.stride + s] = p[size_t(order[size_t(s)])] / top;
    }
  }
}

namespace {
// One expert's SwiGLU MLP over n gathered rows: y = down(silu(gate(x)) ⊙ up(x)).
struct ExpertScratch {
  std::vector<float> g, u, y;
  void run(const float* x, int64_t n, int64_t H, const Weight& G, const Weight& U, const Weight& D,
           MatmulPath path, MatmulScratch& ms) {
    const int64_t I = G.rows;
    g.resize(size_t(n * I));
    u.resize(size_t(n * I));
    y.resize(size_t(n * H));
    matmul_serial(x, n, H, G, g.data(), I, path, ms);
    matmul_serial(x, n, H, U, u.data(), I, path, ms);
    for (size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
    matmul_serial(g.data(), n, I, D, y.data(), H, path, ms);
  }
};
}  // namespace

void CpuOps::moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights,
                              const ExpertSet& ex, const Tensor& out) {
  const int64_t T = x.rows, H = x.cols, k = ids.cols, E = int64_t(ex.gate.size());
  const float *px = f32(x), *pw = f32(weights);
  const int32_t* pid = i32(ids);
  float* po = f32(out);

  // Group (token, slot) pairs by expert: counting sort keeps tokens in ascending order per expert.
  std::vector<int64_t> count(static_cast<size_t>(E) + 1, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) ++count[size_t(pid[t * ids.stride + s]) + 1];
  std::partial_sum(count.begin(), count.end(), count.begin());
  std::vector<int64_t> token(static_cast<size_t>(T * k)), fill(count.begin(), count.end() - 1);
  std::vector<float> gate_w(static_cast<size_t>(T * k));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = pid[t * ids.stride + s], at = fill[size_t(e)]++;
      token[size_t(at)] = t;
      gate_w[size_t(at)] = pw[t * weights.stride + s];
    }
  std::vector<int32_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (count[size_t(e) + 1] > count[size_t(e)]) active.push_back(int32_t(e));

  for (int64_t t = 0; t < T; ++t) std::fill(po + t * out.stride, po + t * out.stride + H, 0.f);

  if (phase() == Phase::Decode) {
    // A handful of single-row experts: spread the experts over the threads, sum afterwards in id order.
    std::vector<ExpertScratch> res(active.size());
    pool().parallel_for(int64_t(active.size()), 1, [&](int64_t i0, int64_t i1, int tid) {
      for (int64_t i = i0; i < i1; ++i) {
        const int32_t e = active[size_t(i)];
        const int64_t b = count[size_t(e)], n = count[size_t(e) + 1] - b;
        std::vector<float> xg(static_cast<size_t>(n * H));
        for (int64_t r = 0; r < n; ++r)
          std::copy(px + token[size_t(b + r)] * x.stride, px + token[size_t(b + r)] * x.stride + H,
                    xg.data() + r * H);
        res[size_t(i)].run(xg.data(), n, H, ex.gate[size_t(e)], ex.up[size_t(e)], ex.down[size_t(e)],
                           MatmulPath::Gemv, arena().at(tid));
      }
    });
    for (size_t i = 0; i < active.size(); ++i) {
      const int32_t e = active[i];
      const int64_t b = count[size_t(e)], n = count[size_t(e) + 1] - b;
      for (int64_t r = 0; r < n; ++r) {
        float* o = po + token[size_t(b + r)] * out.stride;
        const float w = gate_w[size_t(b + r)];
        const float* y = res[i].y.data() + r * H;
        for (int64_t c = 0; c < H; ++c) o[c] += w * y[c];
      }
    }
    return;
  }

  // Prefill: whole experts are dealt to threads (largest load first, each to the least-loaded thread)
  // and run single-threaded, so no product pays a fork/join; outputs land in grouped order and are then
  // summed per token in ascending expert id.
  const int P = pool().size();
  std::vector<int32_t> by_load(active);
  std::stable_sort(by_load.begin(), by_load.end(), [&](int32_t a, int32_t b) {
    return count[size_t(a) + 1] - count[size_t(a)] > count[size_t(b) + 1] - count[size_t(b)];
  });
  std::vector<std::vector<int32_t>> bins(static_cast<size_t>(P));
  std::vector<int64_t> bin_rows(static_cast<size_t>(P), 0);
  for (int32_t e : by_load) {
    const size_t bin = size_t(std::min_element(bin_rows.begin(), bin_rows.end()) - bin_rows.begin());
    bins[bin].push_back(e);
    bin_rows[bin] += count[size_t(e) + 1] - count[size_t(e)];
  }
  std::vector<float> y_all(static_cast<size_t>(T * k * H));
  pool().parallel_for(P, 1, [&](int64_t r0, int64_t r1, int tid) {
    ExpertScratch sc;
    std::vector<float> xg;
    for (int64_t r = r0; r < r1; ++r)
      for (int32_t e : bins[size_t(r)]) {
        const int64_t b = count[size_t(e)], n = count[size_t(e) + 1] - b;
        xg.resize(size_t(n * H));
        for (int64_t i = 0; i < n; ++i)
          std::copy(px + token[size_t(b + i)] * x.stride, px + token[size_t(b + i)] * x.stride + H,
                    xg.data() + i * H);
        sc.run(xg.data(), n, H, ex.gate[size_t(e)], ex.up[size_t(e)], ex.down[size_t(e)], MatmulPath::Gemm,
               arena().at(tid));
        std::copy(sc.y.begin(), sc.y.begin() + n * H, y_all.begin() + b * H);
      }
  });
  for (int32_t e : active) {
    const int64_t b = count[size_t(e)], n = count[size_t(e) + 1] - b;
    for (int64_t r = 0; r < n; ++r) {
      float* o = po + token[size_t(b + r)] * out.stride;
      const float w = gate_w[size_t(b + r)];
      const float* y = y_all.data() + (b + r) * H;
      for (int64_t c = 0; c < H; ++c) o[c] += w * y[c];
    }
  }
}

void CpuOps::swiglu_impl(const Tensor& gate, const Tensor& up, const Tensor& out) {
  const float *pg = f32(gate), *pu = f32(up);
  float* po = f32(out);
  for (int64_t t = 0; t < out.rows; ++t)
    for (int64_t i = 0; i < out.cols; ++i)
      po[t * out.stride + i] = silu(pg[t * gate.stride + i]) * pu[t * up.stride + i];
}

void CpuOps::moe_combine_impl(const Tensor& routed, const Tensor& shared, const Tensor& sg,
                              const Tensor& h) {
  const float *pr = f32(routed), *ps = f32(shared), *pg = f32(sg);
  float* ph = f32(h);
  for (int64_t t = 0; t < h.rows; ++t) {
    const float g = 1.f / (1.f + std::exp(-pg[t * sg.stride]));
    for (int64_t i = 0; i < h.cols; ++i)
      ph[t * h.stride + i] += pr[t * routed.stride + i] + g * ps[t * shared.stride + i];
  }
}

}  // namespace lily::cpu
