// Encoder for metal/reduce.metal: row dot products, one simdgroup per row, 4 rows per 128-thread threadgroup.
#include <string>

#include "metal/kernels.h"

namespace lily::metal {

namespace {
struct RowDotShape {  // metal/reduce.metal
  uint32_t rows, cols;
};
static_assert(sizeof(RowDotShape) == 8, "RowDotShape must match the MSL struct");
constexpr int64_t kRowsPerThreadgroup = 4;
}  // namespace

void encode_row_dot(Pass& pass, Arg a, Arg b, Arg out, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0 || rows > UINT32_MAX || cols > UINT32_MAX)
    throw MetalError("row_dot: bad shape rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
  const RowDotShape shape{uint32_t(rows), uint32_t(cols)};
  const auto groups = NS::UInteger((rows + kRowsPerThreadgroup - 1) / kRowsPerThreadgroup);
  pass.dispatch(pass.device().pipeline("row_dot"), {a, b, out, Arg::value(shape)}, MTL::Size(groups, 1, 1),
                MTL::Size(NS::UInteger(32 * kRowsPerThreadgroup), 1, 1));
}

}  // namespace lily::metal
