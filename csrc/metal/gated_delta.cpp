// MetalOps: conv1d_silu, gated_delta and their fusion with gated_rms_norm, conv_delta_norm (metal/gated_delta.metal;
// oracle csrc/cpu/gated_delta.cpp and the composed default of csrc/backend/ops.cpp).
#include <algorithm>
#include <string>
#include <vector>

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
struct ConvDeltaNormShape {
  uint32_t k_heads, v_heads, Dk, Dv, K, head_threads, ld_conv_in, ld_conv_out, ld_state_in, ld_state_out;
  float eps;
};
static_assert(sizeof(ConvDeltaNormShape) == 44, "ConvDeltaNormShape must match metal/gated_delta.metal");
struct DeltaChunkShape {
  uint32_t T, k_heads, v_heads, Dk, Dv, ld_qkv, ld_b, ld_a, ld_out, ld_state_in, ld_state_out, rec_floats;
};
static_assert(sizeof(DeltaChunkShape) == 48, "DeltaChunkShape must match metal/gated_delta.metal");
constexpr int64_t kMaxTaps = 16, kMaxDk = 256;  // metal/gated_delta.metal
constexpr int64_t kChunk = 64, kChunkRows = 64;  // rows per chunk; calls of at least kChunkRows rows are chunked
// The threadgroup arrays of gated_delta_chunk_prep (A [64, 64] and six rows of 64) and gated_delta_chunk_scan (the
// state slice [256, 16], Δ and its scaled copy [64, 16]), all 4-byte: checked before the pipelines are built (a device
// refuses to build a pipeline over its threadgroup memory).
constexpr size_t kChunkPrepTgBytes = (64 * 64 + 6 * 64) * 4, kChunkScanTgBytes = (256 * 16 + 2 * 64 * 16) * 4;
constexpr size_t kChunkTgBytes = std::max(kChunkPrepTgBytes, kChunkScanTgBytes);
int64_t chunk_record_floats(int64_t Dk, int64_t Dv) { return kChunk * (Dv + Dk + kChunk + 4); }
int64_t register_budget(int64_t Dk) { return Dk <= 32 ? 32 : Dk <= 64 ? 64 : Dk <= 128 ? 128 : 256; }
}  // namespace

size_t delta_chunk_workspace_bytes(int64_t rows, int64_t v_heads, int64_t k_dim, int64_t v_dim) {
  if (rows < kChunkRows || v_heads <= 0) return 0;
  return size_t((rows + kChunk - 1) / kChunk * v_heads * chunk_record_floats(k_dim, v_dim)) * 4;
}

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
                                const DeltaShape& s, const Tensor& ws, const Tensor& out,
                                const StateCapture& capture) {
  if (s.k_dim > kMaxDk) throw MetalError("gated_delta: key head dim above 256 is not supported");
  if (s.v_dim > 1024) throw MetalError("gated_delta: value head dim above 1024 is not supported");
  // The chunked form (auto: from 64 rows; "chunked": every call it can take), or why not.
  const int64_t T = qkv.rows;
  std::string why;
  if (delta_scan_ == "thread" || delta_scan_ == "simdgroup")
    why = "the " + delta_scan_ + " form forced";
  else if (delta_scan_ == "auto" && T < kChunkRows)
    why = std::to_string(T) + " rows < 64";
  else if (capture.active())
    why = "a state capture (the scans store the state after the captured rows)";
  else if (s.k_heads <= 0 || s.v_heads % s.k_heads != 0)
    why = "v_heads not a multiple of k_heads";
  else if (!ws.valid() || ws.bytes() < delta_chunk_workspace_bytes(std::max(T, kChunkRows), s.v_heads, s.k_dim, s.v_dim))
    why = "a workspace smaller than the chunk records (delta_chunk_workspace_bytes)";
  else if (kChunkTgBytes > dev_.device()->maxThreadgroupMemoryLength() ||
           dev_.device()->maxThreadsPerThreadgroup().width < 256)
    why = std::to_string(kChunkTgBytes) + " bytes of threadgroup memory and 256 "
          "threads per threadgroup needed, the device allows " +
          std::to_string(dev_.device()->maxThreadgroupMemoryLength()) + " and " +
          std::to_string(dev_.device()->maxThreadsPerThreadgroup().width);
  if (why.empty() && T > 0) {
    ++counters_.delta_chunked_calls;
    const DeltaChunkShape sh{uint32_t(T),          uint32_t(s.k_heads),   uint32_t(s.v_heads),   uint32_t(s.k_dim),
                             uint32_t(s.v_dim),    uint32_t(qkv.stride),  uint32_t(b.stride),    uint32_t(a.stride),
                             uint32_t(out.stride), uint32_t(state_in.stride), uint32_t(state_out.stride),
                             uint32_t(chunk_record_floats(s.k_dim, s.v_dim))};
    dispatch("gated_delta_chunk_prep", {}, {arg(qkv), arg(b), arg(a), arg(A_log), arg(dt_bias), arg(ws), Arg::value(sh)},
             MTL::Size(NS::UInteger((T + kChunk - 1) / kChunk), NS::UInteger(s.v_heads), 1), MTL::Size(256, 1, 1));
    barrier_in_op();  // the scan reads every chunk's record
    dispatch("gated_delta_chunk_scan", {},
             {arg(qkv), arg(ws), arg(state_in), arg(state_out), arg(out), Arg::value(sh)},
             MTL::Size(NS::UInteger((s.v_dim + 15) / 16), NS::UInteger(s.v_heads), 1), MTL::Size(256, 1, 1));
    return;
  }
  if (T >= 2) counters_.delta_not_chunked_reason = why;
  const Tensor& cap = capture.active() ? capture.states : state_out;  // as in conv1d_silu_impl
  const DeltaScanShape sh{uint32_t(qkv.rows),        uint32_t(s.k_heads),       uint32_t(s.v_heads),
                          uint32_t(s.k_dim),         uint32_t(s.v_dim),         uint32_t(qkv.stride),
                          uint32_t(b.stride),        uint32_t(a.stride),        uint32_t(out.stride),
                          uint32_t(state_in.stride), uint32_t(state_out.stride), uint32_t(capture.first),
                          uint32_t(capture.count),   uint32_t(cap.stride)};
  const std::vector<Arg> args = {arg(qkv),      arg(b),         arg(a),   arg(A_log),     arg(dt_bias),
                                 arg(state_in), arg(state_out), arg(out), Arg::value(sh), arg(cap)};
  // Calls the chunked form does not take: "chunked" forced falls to the simdgroup scan for them (captures).
  const bool sg = delta_scan_ == "simdgroup" || ((delta_scan_ == "auto" || delta_scan_ == "chunked") && qkv.rows >= 2);
  if (sg) {  // gated_delta_scan_sg: 4 columns (simdgroups) per threadgroup, Dk spread over the 32 lanes
    ++counters_.delta_scan_sg_calls;
    const int64_t per_lane = s.k_dim <= 32 ? 1 : s.k_dim <= 64 ? 2 : s.k_dim <= 128 ? 4 : 8;
    dispatch("gated_delta_scan_sg_" + std::to_string(per_lane), {}, args,
             MTL::Size(NS::UInteger((s.v_dim + 3) / 4), NS::UInteger(s.v_heads), 1), MTL::Size(128, 1, 1));
    return;
  }
  ++counters_.delta_scan_thread_calls;
  const int64_t threads = (s.v_dim + 31) / 32 * 32;
  dispatch("gated_delta_scan_" + std::to_string(register_budget(s.k_dim)), {}, args,
           MTL::Size(NS::UInteger(s.v_heads), 1, 1), MTL::Size(NS::UInteger(threads), 1, 1));
}

void MetalOps::set_delta_scan(const std::string& form) {
  if (form != "auto" && form != "thread" && form != "simdgroup" && form != "chunked")
    throw std::invalid_argument("delta scan form must be 'auto', 'thread', 'simdgroup' or 'chunked', got '" + form +
                                "'");
  delta_scan_ = form;
}

// One dispatch for a decode row (metal/gated_delta.metal conv_delta_norm); every other call composes the three
// kernels (the default), and the counters say which path ran and why (optimizations()).
void MetalOps::conv_delta_norm_impl(const Tensor& qkv, const Tensor& z, const Tensor& b, const Tensor& a,
                                    const Tensor& conv_w, const Tensor& A_log, const Tensor& dt_bias,
                                    const Tensor& norm_w, float eps, const DeltaShape& s, const Tensor& conv_in,
                                    const Tensor& conv_out, const Tensor& rec_in, const Tensor& rec_out,
                                    const Tensor& mixed, const Tensor& delta_o, const Tensor& ws, const Tensor& out,
                                    const StateCapture& conv_cap, const StateCapture& rec_cap) {
  const int64_t head_threads = (s.v_dim + 31) / 32 * 32;
  const int64_t threads = s.k_heads > 0 ? s.v_heads / s.k_heads * head_threads : 0;
  const std::string kernel = "conv_delta_norm_" + std::to_string(register_budget(s.k_dim));
  std::string why;  // empty: fused
  if (qkv.rows != 1)
    why = std::to_string(qkv.rows) + " rows (the fused kernel takes one decode row)";
  else if (conv_cap.active() || rec_cap.active())
    why = "a state capture";
  else if (s.k_dim > kMaxDk || s.v_dim > 256 || conv_w.cols > kMaxTaps || norm_w.cols != s.v_dim ||
           s.k_heads <= 0 || s.v_heads % s.k_heads != 0)
    why = "shape Dk=" + std::to_string(s.k_dim) + " Dv=" + std::to_string(s.v_dim) + " K=" +
          std::to_string(conv_w.cols) + " (fused: Dk <= 256, Dv <= 256, K <= 16)";
  else if (threads > int64_t(dev_.pipeline(kernel)->maxTotalThreadsPerThreadgroup()))
    why = std::to_string(threads) + " threads per key head above the pipeline's " +
          std::to_string(dev_.pipeline(kernel)->maxTotalThreadsPerThreadgroup());
  if (!why.empty()) {
    ++counters_.delta_composed_calls;
    counters_.delta_composed_reason = why;
    return Ops::conv_delta_norm_impl(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, eps, s, conv_in, conv_out, rec_in,
                                     rec_out, mixed, delta_o, ws, out, conv_cap, rec_cap);
  }
  ++counters_.delta_fused_calls;
  const ConvDeltaNormShape sh{uint32_t(s.k_heads),       uint32_t(s.v_heads),        uint32_t(s.k_dim),
                              uint32_t(s.v_dim),         uint32_t(conv_w.cols),      uint32_t(head_threads),
                              uint32_t(conv_in.stride),  uint32_t(conv_out.stride),  uint32_t(rec_in.stride),
                              uint32_t(rec_out.stride),  eps};
  dispatch(kernel, {},
           {arg(qkv), arg(z), arg(b), arg(a), arg(conv_w), arg(A_log), arg(dt_bias), arg(norm_w), arg(conv_in),
            arg(conv_out), arg(rec_in), arg(rec_out), arg(out), Arg::value(sh)},
           MTL::Size(NS::UInteger(s.k_heads), 1, 1), MTL::Size(NS::UInteger(threads), 1, 1));
}

}  // namespace lily::metal
