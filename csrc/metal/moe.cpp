// MetalOps: moe_route, swiglu and moe_combine (metal/moe.metal; oracle csrc/cpu/moe.cpp). The routed experts
// (moe_experts) are encoded in matmul.cpp with the other products.
#include "metal/backend.h"

namespace lily::metal {

namespace {
struct RouteShape {  // metal/moe.metal
  uint32_t E, k, ld_logits, ld_ids, ld_w;
};
static_assert(sizeof(RouteShape) == 20, "RouteShape must match metal/moe.metal");
struct MoeRowsShape {
  uint32_t rows, cols, lda, ldb, ldo;
};
static_assert(sizeof(MoeRowsShape) == 20, "MoeRowsShape must match metal/moe.metal");
struct CombineShape {
  uint32_t rows, cols, lda, ldb, ldo, ld_gate;
};
static_assert(sizeof(CombineShape) == 24, "CombineShape must match metal/moe.metal");
constexpr int64_t kMaxK = 16;  // metal/moe.metal
}  // namespace

void MetalOps::moe_route_impl(const Tensor& logits, int64_t k, const Tensor&, const Tensor& ids,
                              const Tensor& weights) {
  if (k < 1 || k > kMaxK || k > logits.cols) throw MetalError("moe_route: k must be in 1..16 and at most the experts");
  const RouteShape s{uint32_t(logits.cols), uint32_t(k), uint32_t(logits.stride), uint32_t(ids.stride),
                     uint32_t(weights.stride)};
  dispatch("moe_route", {}, {arg(logits), arg(ids), arg(weights), Arg::value(s)},
           MTL::Size(NS::UInteger(logits.rows), 1, 1), MTL::Size(32, 1, 1));
}

void MetalOps::swiglu_impl(const Tensor& gate, const Tensor& up, const Tensor& out) {
  const MoeRowsShape s{uint32_t(out.rows), uint32_t(out.cols), uint32_t(gate.stride), uint32_t(up.stride),
                       uint32_t(out.stride)};
  dispatch("swiglu", {}, {arg(gate), arg(up), arg(out), Arg::value(s)},
           MTL::Size(NS::UInteger((out.cols + 63) / 64), NS::UInteger(out.rows), 1), MTL::Size(64, 1, 1));
}

void MetalOps::moe_combine_impl(const Tensor& routed, const Tensor& shared, const Tensor& sg, const Tensor& h) {
  const CombineShape s{uint32_t(h.rows), uint32_t(h.cols), uint32_t(routed.stride), uint32_t(shared.stride),
                       uint32_t(h.stride), uint32_t(sg.stride)};
  dispatch("moe_combine", {}, {arg(routed), arg(shared), arg(sg), arg(h), Arg::value(s)},
           MTL::Size(NS::UInteger((h.cols + 63) / 64), NS::UInteger(h.rows), 1), MTL::Size(64, 1, 1));
}

}  // namespace lily::metal
