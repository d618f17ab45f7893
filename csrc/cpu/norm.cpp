// RMSNorm kernels. Shapes: x [T, D] normalised in segments of w.cols (D for the residual norms,
// head_dim for q/k norms); gated: o, z [T, Hv * Dv] per value head. fp32 statistics.
// Reads x (and z) once, writes out once: 8·T·D bytes, ~4·T·D FLOPs.
#include <cmath>

#include "cpu/backend.h"
#include "cpu/math.h"
#include "cpu/reduce.h"

namespace lily::cpu {

static inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_squares(x, n) / float(n) + eps);
}

void rms_norm_segment(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float r = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

void CpuOps::rms_norm_impl(const Tensor& x, const Tensor& w, const Tensor& out, float eps) {
  const float *px = f32(x), *pw = f32(w);
  float* po = f32(out);
  const int64_t seg = w.cols, nseg = x.cols / seg;
  pool().parallel_for(x.rows, 16, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t s = 0; s < nseg; ++s) {
        rms_norm_segment(px + t * x.stride + s * seg, pw, seg, eps, po + t * out.stride + s * seg);
      }
  });
}

void CpuOps::add_rms_norm_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                               const Tensor& normed) {
  const float *pa = f32(a), *pb = f32(b), *pw = f32(w);
  float *ps = f32(sum), *pn = f32(normed);
  const int64_t seg = w.cols, nseg = a.cols / seg;
  pool().parallel_for(a.rows, 16, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) {
      float* st = ps + t * sum.stride;
      for (int64_t i = 0; i < a.cols; ++i) st[i] = pa[t * a.stride + i] + pb[t * b.stride + i];
      for (int64_t s = 0; s < nseg; ++s) rms_norm_segment(st + s * seg, pw, seg, eps, pn + t * normed.stride + s * seg);
    }
  });
}

void CpuOps::gated_rms_norm_impl(const Tensor& o, const Tensor& z, const Tensor& w, float eps,
                                 const Tensor& out) {
  const float *po = f32(o), *pz = f32(z), *pw = f32(w);
  float* pout = f32(out);
  const int64_t dv = w.cols, heads = o.cols / dv;
  pool().parallel_for(o.rows, 16, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const float* os = po + t * o.stride + h * dv;
        const float* zs = pz + t * z.stride + h * dv;
        float* ys = pout + t * out.stride + h * dv;
        const float r = inv_rms(os, dv, eps);
        for (int64_t i = 0; i < dv; ++i) {
          const float g = silu(zs[i]);
          ys[i] = pw[i] * (os[i] * r) * g;
        }
      }
  });
}

}  // namespace lily::cpu
