// Gated DeltaNet on CUDA (MODEL.md section 5): the host side of kernels/gated_delta.cu.
// conv1d_silu: one kernel, channels over threads, token blocks over grid.y.
// gated_delta: one kernel for decode and prefill, a sequential scan over T with each warp's slice of the
//   fp32 state in registers (see the kernel file for the geometry). No chunked (WY) form yet: every T
//   takes the scan, so no workspace is needed.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/backend.h"
#include "model/config.h"

namespace lily::cuda {

namespace {
constexpr int kConvThreads = 128;
constexpr int kConvMinTokens = 32;  // tokens per block row (at least K-1: see the kernel's aliasing rule)
constexpr int kDeltaColsPerBlock = 16;  // 2 warps × 8 columns
constexpr int kDeltaThreads = 64;

void require_f32(const Tensor& t, const char* what) {
  if (t.dtype != DType::F32) throw std::invalid_argument(std::string("gated_delta (cuda): ") + what + " must be F32");
}
}  // namespace

size_t delta_workspace_bytes(const ModelConfig&, int64_t) { return 0; }

void CudaOps::conv1d_silu_impl(const Tensor& mixed, const Tensor& conv_w, const Tensor& state_in,
                               const Tensor& state_out, const Tensor& out) {
  require_f32(mixed, "mixed");
  require_f32(conv_w, "conv_w");
  require_f32(state_in, "conv state");
  require_f32(state_out, "conv state");
  require_f32(out, "out");
  const int64_t T = mixed.rows, C = mixed.cols, K = conv_w.cols;
  if (K < 1 || K > 16 || conv_w.rows != C || state_in.rows != K - 1 || state_in.cols != C ||
      state_out.rows != K - 1 || state_out.cols != C || out.rows != T || out.cols != C)
    throw std::invalid_argument("conv1d_silu (cuda): shapes do not match mixed [T, C], conv_w [C, K]");
  const int tpb = int(std::max<int64_t>(kConvMinTokens, K - 1));
  const Kernel& k = kernel("gated_delta", "conv1d_silu", {{"KTAPS", K}});
  const Dim3 grid{unsigned((C + kConvThreads - 1) / kConvThreads), unsigned(std::max<int64_t>(1, (T + tpb - 1) / tpb)), 1};
  launch(k, grid, Dim3{kConvThreads, 1, 1}, 0, ptr(mixed), int64_t(mixed.stride), ptr(conv_w), int64_t(conv_w.stride),
         ptr(state_in), int64_t(state_in.stride), ptr(state_out), int64_t(state_out.stride), ptr(out),
         int64_t(out.stride), int(T), int(C), tpb);
  note_variant("conv1d_silu", "channels over 128 threads, " + std::to_string(tpb) +
                                  "-token blocks over grid.y, K = " + std::to_string(K) + " taps in registers");
}

void CudaOps::gated_delta_impl(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                               const Tensor& dt_bias, const Tensor& state_in, const Tensor& state_out,
                               const DeltaShape& s, const Tensor& ws, const Tensor& out) {
  (void)ws;
  for (const Tensor* t : {&qkv, &b, &a, &A_log, &dt_bias, &state_in, &state_out, &out}) require_f32(*t, "every tensor");
  const int64_t T = qkv.rows, Hk = s.k_heads, Hv = s.v_heads, Dk = s.k_dim, Dv = s.v_dim;
  if (Hk < 1 || Hv % Hk != 0 || Dk < 1 || Dv < 1)
    throw std::invalid_argument("gated_delta (cuda): needs v_heads a multiple of k_heads");
  if (qkv.cols != 2 * Hk * Dk + Hv * Dv || b.rows != T || a.rows != T || b.cols != Hv || a.cols != Hv ||
      A_log.cols != Hv || dt_bias.cols != Hv || out.rows != T || out.cols != Hv * Dv ||
      state_in.rows != Hv * Dk || state_in.cols != Dv || state_out.rows != Hv * Dk || state_out.cols != Dv)
    throw std::invalid_argument("gated_delta (cuda): shapes do not match the DeltaShape");
  // The state moves as float4 rows of 8-column warp slices.
  if (Dv % 8 != 0 || state_in.stride % 4 != 0 || state_out.stride % 4 != 0 || ptr(state_in) % 16 != 0 ||
      ptr(state_out) % 16 != 0)
    throw std::invalid_argument("gated_delta (cuda): needs v_dim % 8 == 0 and 16-byte aligned state rows");
  if (T == 0) return;  // as the CPU: nothing to do, the state is not touched
  const Kernel& k = kernel("gated_delta", "gated_delta", {{"DK", Dk}, {"DV", Dv}});
  const Dim3 grid{unsigned(Hv), unsigned((Dv + kDeltaColsPerBlock - 1) / kDeltaColsPerBlock), 1};
  launch(k, grid, Dim3{kDeltaThreads, 1, 1}, 0, ptr(qkv), int64_t(qkv.stride), ptr(b), int64_t(b.stride), ptr(a),
         int64_t(a.stride), ptr(A_log), ptr(dt_bias), ptr(state_in), int64_t(state_in.stride), ptr(state_out),
         int64_t(state_out.stride), ptr(out), int64_t(out.stride), int(T), int(Hk), int(Hv));
  const std::string geo = "grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) +
                          ") × 64 threads, 8 state columns per warp in registers";
  if (phase() == Phase::Decode)
    note_variant("gated_delta.decode", "scan (one token): " + geo + ", state read and written once");
  else
    note_variant("gated_delta.prefill", "sequential scan over T (no chunked form yet): " + geo);
}

}  // namespace lily::cuda
