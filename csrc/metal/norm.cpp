// Encoder for metal/norm.metal: one threadgroup per normalised segment, a multiple of 32 threads (at most
// 256: enough to stream a 2048-wide row in 8 loads per thread), one float of threadgroup memory per simdgroup.
#include <algorithm>
#include <string>

#include "metal/kernels.h"

namespace lily::metal {

namespace {
struct RmsNormShape {  // metal/norm.metal
  uint32_t cols, segment;
  float eps;
};
static_assert(sizeof(RmsNormShape) == 12, "RmsNormShape must match the MSL struct");
}  // namespace

void encode_rms_norm(Pass& pass, Arg x, Arg w, Arg out, int64_t rows, int64_t cols, int64_t segment, float eps) {
  if (rows <= 0 || segment <= 0 || cols <= 0 || cols % segment != 0 || cols > UINT32_MAX)
    throw MetalError("rms_norm: bad shape rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
                     " segment=" + std::to_string(segment));
  if (!(eps > 0.f)) throw MetalError("rms_norm: eps must be positive");
  const RmsNormShape shape{uint32_t(cols), uint32_t(segment), eps};
  const int64_t threads = std::min<int64_t>(256, (segment + 31) / 32 * 32);
  const auto segments = NS::UInteger(rows * (cols / segment));
  pass.dispatch(pass.device().pipeline("rms_norm"), {x, w, out, Arg::value(shape)}, MTL::Size(segments, 1, 1),
                MTL::Size(NS::UInteger(threads), 1, 1), {size_t(threads / 32) * sizeof(float)});
}

}  // namespace lily::metal

// ------------------------------------------------------------------------------------------------------------
// MetalOps: rms_norm (the kernel above), add_rms_norm and gated_rms_norm (metal/norm.metal).
#include "metal/backend.h"

namespace lily::metal {

namespace {
struct NormRowsShape {  // metal/norm.metal
  uint32_t cols, segment, lda, ldb, lds, ldo;
  float eps;
};
static_assert(sizeof(NormRowsShape) == 28, "NormRowsShape must match metal/norm.metal");
int64_t norm_threads(int64_t segment) { return std::min<int64_t>(256, (segment + 31) / 32 * 32); }
}  // namespace

void MetalOps::rms_norm_impl(const Tensor& x, const Tensor& w, const Tensor& out, float eps) {
  check_contiguous(x, "rms_norm", "x");
  check_contiguous(out, "rms_norm", "out");
  encode_rms_norm(pass(), arg(x), arg(w), arg(out), x.rows, x.cols, w.cols, eps);
  ++step_dispatches_;
}

void MetalOps::add_rms_norm_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                                 const Tensor& normed) {
  const int64_t seg = w.cols, threads = norm_threads(seg);
  if (a.cols % seg) throw MetalError("add_rms_norm: columns are not a multiple of the norm's length");
  const NormRowsShape s{uint32_t(a.cols), uint32_t(seg), uint32_t(a.stride), uint32_t(b.stride), uint32_t(sum.stride),
                        uint32_t(normed.stride), eps};
  dispatch("add_rms_norm", {}, {arg(a), arg(b), arg(w), arg(sum), arg(normed), Arg::value(s)},
           MTL::Size(NS::UInteger(a.rows * (a.cols / seg)), 1, 1), MTL::Size(NS::UInteger(threads), 1, 1),
           {size_t(threads / 32) * sizeof(float)});
}

void MetalOps::gated_rms_norm_impl(const Tensor& o, const Tensor& z, const Tensor& w, float eps, const Tensor& out) {
  const int64_t seg = w.cols, threads = norm_threads(seg);
  if (o.cols % seg) throw MetalError("gated_rms_norm: columns are not a multiple of the head size");
  const NormRowsShape s{uint32_t(o.cols), uint32_t(seg), uint32_t(o.stride), uint32_t(z.stride), 0,
                        uint32_t(out.stride), eps};
  dispatch("gated_rms_norm", {}, {arg(o), arg(z), arg(w), arg(out), Arg::value(s)},
           MTL::Size(NS::UInteger(o.rows * (o.cols / seg)), 1, 1), MTL::Size(NS::UInteger(threads), 1, 1),
           {size_t(threads / 32) * sizeof(float)});
}

}  // namespace lily::metal
