// Sparse MoE kernels (MODEL.md section 6).
// moe_route: logits [T, E] -> fp32 softmax over all E, top-k (ties to the lower id), renormalised.
// moe_experts: x [T, H]; experts stacked gate/up [E, I, H], down [E, H, I]; tokens grouped by expert so
//   each expert's weights stream once per call; per token the k expert outputs are summed in ascending
//   expert id, so the result does not depend on how a prompt is chunked. Floor: reads the weights of
//   every expert hit (3·I·H weights each), 6·T·k·I·H FLOPs. All scratch comes from the workspace.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "cpu/backend.h"
#include "cpu/math.h"
#include "model/config.h"

namespace lily::cpu {

namespace {

// The grouping of (token, slot) pairs by expert, in workspace memory.
struct Grouping {
  int64_t* count;   // [E + 1]: expert e's pairs are [count[e], count[e + 1])
  int64_t* token;   // [T·k] token of each grouped pair
  float* gate_w;    // [T·k] its routing weight
  int32_t* active;  // experts with at least one pair, ascending
  int64_t n_active;
};

size_t grouping_bytes(int64_t T, int64_t k, int64_t E) {
  return Arena::need<int64_t>(size_t(E + 1)) + Arena::need<int64_t>(size_t(T * k)) +
         Arena::need<int64_t>(size_t(E)) + Arena::need<float>(size_t(T * k)) + Arena::need<int32_t>(size_t(E));
}

// One expert's SwiGLU MLP over n gathered rows: y = down(silu(gate(x)) ⊙ up(x)), single-threaded.
struct ExpertBuffers {
  float *xg, *g, *u, *y;  // [n, H], [n, I], [n, I], [n, H]
  static size_t floats(int64_t n, int64_t H, int64_t I) { return size_t(n) * size_t(2 * H + 2 * I); }
  static ExpertBuffers at(float* p, int64_t n, int64_t H, int64_t I) {
    return {p, p + n * H, p + n * H + n * I, p + n * H + 2 * n * I};
  }
  void run(int64_t n, int64_t H, const WeightView& G, const WeightView& U, const WeightView& D, MatmulPath path,
           MatmulScratch& ms) {
    const int64_t I = G.rows;
    matmul_serial(xg, n, H, G, g, I, path, ms);
    matmul_serial(xg, n, H, U, u, I, path, ms);
    for (int64_t i = 0; i < n * I; ++i) g[i] = silu(g[i]) * u[i];
    matmul_serial(g, n, I, D, y, H, path, ms);
  }
};

}  // namespace

size_t moe_workspace_bytes(const ModelConfig& c, int64_t rows, int threads) {
  const int64_t T = rows, k = c.topk, E = c.experts, H = c.hidden, I = c.moe_inter;
  const size_t route = Arena::need<float>(size_t(E)) + Arena::need<int32_t>(size_t(E));
  // Decode: every active expert (at most T·k) keeps its single-row outputs; prefill: the grouped outputs
  // [T·k, H] plus one expert's buffers per thread (an expert sees at most T rows).
  const size_t decode = Arena::need<float>(size_t(T * k) * ExpertBuffers::floats(1, H, I));
  const size_t prefill = Arena::need<float>(size_t(T * k * H)) +
                         Arena::need<float>(size_t(threads) * ExpertBuffers::floats(T, H, I)) +
                         Arena::need<int32_t>(size_t(threads) * size_t(E)) + 2 * Arena::need<int64_t>(size_t(threads));
  return std::max(route, grouping_bytes(T, k, E) + std::max(decode, prefill));
}

void CpuOps::moe_route_impl(const Tensor& logits, int64_t k, const Tensor& ws, const Tensor& ids,
                            const Tensor& weights) {
  const int64_t E = logits.cols;
  const float* pl = f32(logits);
  int32_t* pid = i32(ids);
  float* pw = f32(weights);
  Arena a = arena(ws, "moe_route");
  float* p = a.take<float>(size_t(E));
  int32_t* order = a.take<int32_t>(size_t(E));
  for (int64_t t = 0; t < logits.rows; ++t) {
    const float* l = pl + t * logits.stride;
    const float mx = *std::max_element(l, l + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::iota(order, order + E, 0);
    std::partial_sort(order, order + k, order + E, [&](int32_t x, int32_t y) {
      return p[x] > p[y] || (p[x] == p[y] && x < y);
    });
    float top = 0.f;
    for (int64_t s = 0; s < k; ++s) top += p[order[s]];
    for (int64_t s = 0; s < k; ++s) {
      pid[t * ids.stride + s] = order[s];
      pw[t * weights.stride + s] = p[order[s]] / top;
    }
  }
}

void CpuOps::moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights, const Weight& gate,
                              const Weight& up, const Weight& down, const Tensor& ws, const Tensor& out) {
  const int64_t T = x.rows, H = x.cols, k = ids.cols, E = gate.experts, I = gate.rows;
  const float *px = f32(x), *pw = f32(weights);
  const int32_t* pid = i32(ids);
  float* po = f32(out);
  Arena a = arena(ws, "moe_experts");

  // Group (token, slot) pairs by expert: counting sort keeps tokens in ascending order per expert.
  Grouping gr;
  gr.count = a.take<int64_t>(size_t(E + 1));
  gr.token = a.take<int64_t>(size_t(T * k));
  int64_t* fill = a.take<int64_t>(size_t(E));
  gr.gate_w = a.take<float>(size_t(T * k));
  gr.active = a.take<int32_t>(size_t(E));
  std::fill(gr.count, gr.count + E + 1, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const int32_t e = pid[t * ids.stride + s];
      if (e < 0 || e >= E) throw std::logic_error("moe_experts: expert id out of range");
      ++gr.count[e + 1];
    }
  std::partial_sum(gr.count, gr.count + E + 1, gr.count);
  std::copy(gr.count, gr.count + E, fill);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = pid[t * ids.stride + s], at = fill[e]++;
      gr.token[at] = t;
      gr.gate_w[at] = pw[t * weights.stride + s];
    }
  gr.n_active = 0;
  for (int64_t e = 0; e < E; ++e)
    if (gr.count[e + 1] > gr.count[e]) gr.active[gr.n_active++] = int32_t(e);

  for (int64_t t = 0; t < T; ++t) std::fill(po + t * out.stride, po + t * out.stride + H, 0.f);
  auto views = [&](int32_t e) {
    return std::array<WeightView, 3>{view(gate.expert(e)), view(up.expert(e)), view(down.expert(e))};
  };
  auto gather = [&](const ExpertBuffers& b, int64_t first, int64_t n) {
    for (int64_t r = 0; r < n; ++r) {
      const float* src = px + gr.token[first + r] * x.stride;
      std::copy(src, src + H, b.xg + r * H);
    }
  };
  // Adds expert outputs y [n, H] (rows of grouped pairs first..) into their tokens, weighted.
  auto scatter = [&](const float* y, int64_t first, int64_t n) {
    for (int64_t r = 0; r < n; ++r) {
      float* o = po + gr.token[first + r] * out.stride;
      const float w = gr.gate_w[first + r];
      const float* yr = y + r * H;
      for (int64_t c = 0; c < H; ++c) o[c] += w * yr[c];
    }
  };

  if (exec_phase_ == Phase::Decode) {
    // A handful of single-row experts: spread the experts over the threads, sum afterwards in id order.
    const size_t per = ExpertBuffers::floats(1, H, I);
    float* res = a.take<float>(size_t(T * k) * per);
    pool().parallel_for(gr.n_active, 1, [&](int64_t i0, int64_t i1, int tid) {
      for (int64_t i = i0; i < i1; ++i) {
        const int32_t e = gr.active[i];
        const int64_t b = gr.count[e], n = gr.count[e + 1] - b;
        ExpertBuffers eb = ExpertBuffers::at(res + size_t(b) * per, n, H, I);
        gather(eb, b, n);
        const auto v = views(e);
        eb.run(n, H, v[0], v[1], v[2], MatmulPath::Gemv, matmul_arena().at(tid));
      }
    });
    for (int64_t i = 0; i < gr.n_active; ++i) {
      const int32_t e = gr.active[i];
      const int64_t b = gr.count[e], n = gr.count[e + 1] - b;
      scatter(ExpertBuffers::at(res + size_t(b) * per, n, H, I).y, b, n);
    }
    return;
  }

  // Prefill: whole experts are dealt to threads (largest load first, each to the least-loaded thread)
  // and run single-threaded, so no product pays a fork/join; outputs land in grouped order and are then
  // summed per token in ascending expert id.
  const int P = pool().size();
  float* y_all = a.take<float>(size_t(T * k * H));
  const size_t per = ExpertBuffers::floats(T, H, I);
  float* buffers = a.take<float>(size_t(P) * per);
  int32_t* bins = a.take<int32_t>(size_t(P) * size_t(E));  // bins[p·E ..] experts of thread p, in order
  int64_t* bin_size = a.take<int64_t>(size_t(P));
  int64_t* bin_rows = a.take<int64_t>(size_t(P));
  int32_t* by_load = gr.active;  // sorted in place: the sums below walk experts by id through count[]
  std::fill(bin_rows, bin_rows + P, 0);
  std::fill(bin_size, bin_size + P, 0);
  // Heaviest first, ties by ascending id (what a stable sort of the id-ordered list gives, without the
  // temporary buffer std::stable_sort allocates).
  std::sort(by_load, by_load + gr.n_active, [&](int32_t x, int32_t y) {
    const int64_t nx = gr.count[x + 1] - gr.count[x], ny = gr.count[y + 1] - gr.count[y];
    return nx > ny || (nx == ny && x < y);
  });
  for (int64_t i = 0; i < gr.n_active; ++i) {
    const int32_t e = by_load[i];
    const int64_t bin = std::min_element(bin_rows, bin_rows + P) - bin_rows;
    bins[bin * E + bin_size[bin]++] = e;
    bin_rows[bin] += gr.count[e + 1] - gr.count[e];
  }
  pool().parallel_for(P, 1, [&](int64_t r0, int64_t r1, int tid) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < bin_size[r]; ++j) {
        const int32_t e = bins[r * E + j];
        const int64_t b = gr.count[e], n = gr.count[e + 1] - b;
        ExpertBuffers eb = ExpertBuffers::at(buffers + size_t(tid) * per, n, H, I);
        gather(eb, b, n);
        const auto v = views(e);
        eb.run(n, H, v[0], v[1], v[2], MatmulPath::Gemm, matmul_arena().at(tid));
        std::copy(eb.y, eb.y + n * H, y_all + b * H);
      }
  });
  // Ascending expert id per token: walk the experts in id order (the grouped order of count[]).
  for (int32_t e = 0; e < E; ++e) {
    const int64_t b = gr.count[e], n = gr.count[e + 1] - b;
    if (n) scatter(y_all + b * H, b, n);
  }
}

void CpuOps::swiglu_impl(const Tensor& gate, const Tensor& up, const Tensor& out) {
  const float *pg = f32(gate), *pu = f32(up);
  float* po = f32(out);
  for (int64_t t = 0; t < out.rows; ++t)
    for (int64_t i = 0; i < out.cols; ++i)
      po[t * out.stride + i] = silu(pg[t * gate.stride + i]) * pu[t * up.stride + i];
}

void CpuOps::moe_combine_impl(const Tensor& routed, const Tensor& shared, const Tensor& sg, const Tensor& h) {
  const float *pr = f32(routed), *ps = f32(shared), *pg = f32(sg);
  float* ph = f32(h);
  for (int64_t t = 0; t < h.rows; ++t) {
    const float g = sigmoid(pg[t * sg.stride]);
    for (int64_t i = 0; i < h.cols; ++i)
      ph[t * h.stride + i] += pr[t * routed.stride + i] + g * ps[t * shared.stride + i];
  }
}

}  // namespace lily::cpu
