// Encoder for metal/matmul.metal: the 4-bit affine matrix-vector product (decode shape). Threadgroups of
// 2 simdgroups × 4 rows = 8 rows; the group size is the kernel's function constant 0, so one pipeline exists
// per (scale type, group size).
#include <string>

#include "metal/kernels.h"

namespace lily::metal {

namespace {
struct Qmv4Shape {  // metal/matmul.metal
  uint32_t rows, cols;
};
static_assert(sizeof(Qmv4Shape) == 8, "Qmv4Shape must match the MSL struct");
constexpr int64_t kRowsPerThreadgroup = 8;
}  // namespace

void encode_qmv4(Pass& pass, const QuantMatrix& w, Arg x, Arg y) {
  if (w.group != 32 && w.group != 64 && w.group != 128)
    throw MetalError("qmv4: group size " + std::to_string(w.group) + " is not 32, 64 or 128");
  if (w.rows <= 0 || w.cols <= 0 || w.cols % w.group != 0 || w.rows > UINT32_MAX || w.cols > UINT32_MAX)
    throw MetalError("qmv4: bad matrix shape [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) + "]");
  if (x.offset % 16 != 0) throw MetalError("qmv4: x must be 16-byte aligned (float4 loads)");
  const Qmv4Shape shape{uint32_t(w.rows), uint32_t(w.cols)};
  const char* kernel = w.scale_type == QuantMatrix::ScaleType::BF16 ? "qmv4_bf16" : "qmv4_f16";
  MTL::ComputePipelineState* pipeline =
      pass.device().pipeline(kernel, {FunctionConstant::u32(0, uint32_t(w.group))});
  const auto groups = NS::UInteger((w.rows + kRowsPerThreadgroup - 1) / kRowsPerThreadgroup);
  pass.dispatch(pipeline, {w.codes, w.scales, w.biases, x, y, Arg::value(shape)}, MTL::Size(groups, 1, 1),
                MTL::Size(64, 1, 1));
}

}  // namespace lily::metal
