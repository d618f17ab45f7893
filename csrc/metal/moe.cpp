// MetalOps: moe (the block), moe_route, swiglu and moe_combine (metal/moe.metal; oracle csrc/cpu/moe.cpp). The
// routed experts (moe_experts) are encoded in matmul.cpp with the other products.
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

// The MoE block as ops.cpp composes it, except that the shared expert's gate and up projections (both read x)
// run as one MatmulGroup: one dispatch instead of two (matmuls_impl; the same bits). Per-pair experts (decode
// rows) reorder it so that the shared expert's output exists before the routed down pass, which then adds it and
// the residual itself (moe_down_combine: moe_combine's arithmetic, one dispatch and one stage fewer):
//   route + shared gate/up | swiglu + moe_gate_up | shared down | moe_down_combine
// and leave sc.routed unwritten (ops.h allows it). Prefill rows (experts grouped on the GPU) keep
//   route + shared gate/up | swiglu + grouped experts ... | shared down | moe_combine
void MetalOps::moe_impl(const Tensor& x, const Tensor& router_logits, const Tensor& shared_gate_logit, int64_t k,
                        const MoeWeights& w, const MoeScratch& sc, const Tensor& ws, const Tensor& h) {
  const bool pairs = !grouped_experts(x.rows, w.gate.experts);
  moe_route_impl(router_logits, k, ws, sc.ids, sc.weights);
  matmuls_impl(x, MatmulGroup().add(w.shared_gate_proj, sc.shared_g).add(w.shared_up, sc.shared_u));
  barrier_in_op();
  swiglu_impl(sc.shared_g, sc.shared_u, sc.shared_act);
  if (pairs && fuse_moe_combine_) {
    check_experts(sc.ids, sc.weights, w.gate, w.up);
    moe_pairs_gate_up(x, sc.ids, w.gate, w.up, ws);
    barrier_in_op();
    matmul_impl(sc.shared_act, w.shared_down, sc.shared);
    barrier_in_op();  // moe_down_combine reads the act rows and the shared output
    moe_pairs_down(sc.ids, sc.weights, w.down, ws, h, &sc.shared, &shared_gate_logit);
    ++counters_.moe_down_combined_calls;
    return;
  }
  moe_experts_impl(x, sc.ids, sc.weights, w.gate, w.up, w.down, ws, sc.routed);
  barrier_in_op();
  matmul_impl(sc.shared_act, w.shared_down, sc.shared);
  barrier_in_op();
  moe_combine_impl(sc.routed, sc.shared, shared_gate_logit, h);
  ++counters_.moe_combine_calls;
  counters_.moe_combine_reason = pairs ? "LILY_METAL_FUSE_MOE_COMBINE=0"
                                       : std::to_string(x.rows) + " prefill rows (experts grouped on the GPU)";
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
