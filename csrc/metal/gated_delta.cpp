// MetalOps: conv1d_silu and gated_delta (metal/gated_delta.metal; oracle csrc/cpu/gated_delta.cpp).
#include <string>

#include "metal/backend.h"

namespace lily::metal {

namespace {
struct ConvShape {  // metal/gated_delta.metal
  uint32_t T, C, K, ld_x, ld_out, ld_state_in, ld_state_out, cap_first, cap_count, ld_cap;
};
static_assert(sizeof(ConvShape) == 40, "ConvShape must match metal/gated_delta.metal");
struct DeltaScanShape {
  uint32_t T, k_heads, v_heads, Dk, Dv, ld_qkv, ld_b, ld_a, ld_out, ld_state_in, ld_state_out, cap_first, cap_count,
      ld_cap;
};
static_assert(sizeof(DeltaScanShape) == 56, "DeltaScanShape must match metal/gated_delta.metal");
constexpr int64_t kMaxTaps = 16, kMaxDk = 256;  // metal/gated_delta.metal
}  // namespace

void MetalOps::conv1d_silu_impl(const Tensor& mixed, const Tensor& conv_w, const Tensor& state_in,
                                const Tensor& state_out, const Tensor& out, const StateCapture& capture) {
  if (conv_w.cols > kMaxTaps) throw MetalError("conv1d_silu: more than 16 taps");
  // Without a capture, state_out stands in for the capture buffer (count 0: never written through it).
  const Tensor& cap = capture.active() ? capture.states : state_out;
  const ConvShape s{uint32_t(mixed.rows),       uint32_t(mixed.cols),      uint32_t(conv_w.cols),
                    uint32_t(mixed.stride),     uint32_t(out.stride),      uint32_t(state_in.stride),
                    uint32_t(state_out.stride), uint32_t(capture.first),   uint32_t(capture.count),
                    uint32_t(cap.stride)};
  dispatch("conv1d_silu", {},
           {arg(mixed), arg(conv_w), arg(state_in), arg(state_out), arg(out), Arg::value(s), arg(cap)},
           MTL::Size(NS::UInteger((mixed.cols + 63) / 64), 1, 1), MTL::Size(64, 1, 1));
}

void MetalOps::gated_delta_impl(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                                const Tensor& dt_bias, const Tensor& state_in, const Tensor& state_out,
                                const DeltaShape& s, const Tensor&, const Tensor& out,
                                const StateCapture& capture) {
  if (s.k_dim > kMaxDk) throw MetalError("gated_delta: key head dim above 256 is not supported");
  if (s.v_dim > 1024) throw MetalError("gated_delta: value head dim above 1024 is not supported");
  const Tensor& cap = capture.active() ? capture.states : state_out;  // as in conv1d_silu_impl
  const DeltaScanShape sh{uint32_t(qkv.rows),        uint32_t(s.k_heads),       uint32_t(s.v_heads),
                          uint32_t(s.k_dim),         uint32_t(s.v_dim),         uint32_t(qkv.stride),
                          uint32_t(b.stride),        uint32_t(a.stride),        uint32_t(out.stride),
                          uint32_t(state_in.stride), uint32_t(state_out.stride), uint32_t(capture.first),
                          uint32_t(capture.count),   uint32_t(cap.stride)};
  const int64_t threads = (s.v_dim + 31) / 32 * 32;
  const int64_t regs = s.k_dim <= 32 ? 32 : s.k_dim <= 64 ? 64 : s.k_dim <= 128 ? 128 : 256;
  dispatch("gated_delta_scan_" + std::to_string(regs), {},
           {arg(qkv), arg(b), arg(a), arg(A_log), arg(dt_bias), arg(state_in), arg(state_out), arg(out), Arg::value(sh),
            arg(cap)},
           MTL::Size(NS::UInteger(s.v_heads), 1, 1), MTL::Size(NS::UInteger(threads), 1, 1));
}

}  // namespace lily::metal
