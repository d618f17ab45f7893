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
