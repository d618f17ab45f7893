// Gated DeltaNet on CUDA (MODEL.md section 5): the host side of kernels/gated_delta.cu.
// conv1d_silu: one kernel, channels over threads, token blocks over grid.y.
// gated_delta: a sequential scan over T with each warp's slice of the fp32 state in registers (see the
//   kernel file for the geometry). T = 1 (decode): one kernel that also normalises q, k and computes
//   alpha, beta per warp. T > 1: gated_delta_prep writes q̂, k̂, alpha, beta once per token into the
//   workspace, then gated_delta_prepped scans; from delta_chunk_rows rows without a capture the chunked (WY /
//   UT-transform) form instead: gated_delta_chunk_prep builds each 64-token chunk's U, W, P and decay factors at
//   once (parallel over chunks), gated_delta_chunk_scan walks the chunks in order (the kernel file derives it).
// Captures (ops.h StateCapture) are one extra pointer, first row and count for both kernels: the conv copies
//   pre-conv rows, the scan stores its registers after the captured tokens (kernels/gated_delta.cu).
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

constexpr int64_t kChunk = 64;           // tokens per chunk of the chunked form (GD_CHUNK)
constexpr int kChunkThreads = 256;

// The prefill path's workspace: qn, kn [T, Hk·Dk], alpha, beta [T, Hv], each region 256-byte aligned; then, for
// the chunked form, one record per (chunk, value head): U [64, Dv], W [64, Dk], P [64, 64], two [64] factor rows.
size_t region(int64_t floats) { return (size_t(floats) * 4 + 255) / 256 * 256; }
size_t prep_bytes(int64_t T, int64_t key_dim, int64_t Hv) { return 2 * region(T * key_dim) + 2 * region(T * Hv); }
int64_t chunk_record_floats(int64_t Dk, int64_t Dv) { return kChunk * (Dv + Dk + kChunk + 2); }
size_t chunk_bytes(int64_t T, int64_t Hv, int64_t Dk, int64_t Dv) {
  return region((T + kChunk - 1) / kChunk * Hv * chunk_record_floats(Dk, Dv));
}
// gated_delta_chunk_prep's dynamic shared memory: the q̂, k̂ tiles (rows of Dk + 4) or the solve's [64, Dv + Dk],
// A [64, 68], L (fp64), β and βΓ of the chunk.
size_t chunk_prep_smem(int64_t Dk, int64_t Dv) {
  const int64_t tiles = std::max(2 * kChunk * (Dk + 4), kChunk * (Dv + Dk));
  return size_t(tiles + kChunk * 68) * 4 + kChunk * 8 + 2 * kChunk * 4;
}
// gated_delta_chunk_scan: state columns per block (GD_SCW) and dynamic shared memory: the state slice [Dk, cw + 4],
// W and q̂ tiles [64, Dk + 4], k̂ [64, Dk], P [64, 68], Δ and its scaled copy [64, cw].
int64_t chunk_scan_cols(int64_t Dv) { return Dv % 32 == 0 ? 32 : 16; }
size_t chunk_scan_smem(int64_t Dk, int64_t Dv) {
  const int64_t cw = chunk_scan_cols(Dv);
  return size_t(Dk * (cw + 4) + 2 * kChunk * (Dk + 4) + kChunk * Dk + kChunk * (kChunk + 4) + 2 * kChunk * cw) * 4;
}
// The tensor-core forms (delta_chunk_mma): the prep's tiles or X [64, Dv + Dk + 8], A and the block inverse [64, 68]
// each, L, β, βΓ; the scan's slice [Dk, cw + 8], W and q̂ [64, Dk + 4], k̂ [64, Dk + 8], P [64, 68], Δ, ksc·Δ and
// the U slice [64, cw + 8], two chunks' Γ and ksc [2][128] (pitches for conflict-free fragment loads).
size_t chunk_prep_mma_smem(int64_t Dk, int64_t Dv) {
  const int64_t tiles = std::max(2 * kChunk * (Dk + 4), kChunk * (Dv + Dk + 8));
  return size_t(tiles + 2 * kChunk * 68) * 4 + kChunk * 8 + 2 * kChunk * 4;
}
size_t chunk_scan_mma_smem(int64_t Dk, int64_t Dv) {
  const int64_t cw = chunk_scan_cols(Dv);
  return size_t(Dk * (cw + 8) + 2 * kChunk * (Dk + 4) + kChunk * (Dk + 8) + kChunk * (kChunk + 4) +
                3 * kChunk * (cw + 8) + 4 * kChunk) * 4;
}
}  // namespace

size_t delta_workspace_bytes(const ModelConfig& c, int64_t rows, int64_t chunk_rows) {
  if (rows <= 1) return 0;
  size_t need = prep_bytes(rows, c.key_dim(), c.lin_v_heads);
  if (chunk_rows > 0 && rows >= chunk_rows) need += chunk_bytes(rows, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim);
  return need;
}

void CudaOps::conv1d_silu_impl(const Tensor& mixed, const Tensor& conv_w, const Tensor& state_in,
                               const Tensor& state_out, const Tensor& out, const StateCapture& capture) {
  require_f32(mixed, "mixed");
  require_f32(conv_w, "conv_w");
  require_f32(state_in, "conv state");
  require_f32(state_out, "conv state");
  require_f32(out, "out");
  if (capture.active()) require_f32(capture.states, "capture");
  const int64_t T = mixed.rows, C = mixed.cols, K = conv_w.cols;
  if (K < 1 || K > 16 || conv_w.rows != C || state_in.rows != K - 1 || state_in.cols != C ||
      state_out.rows != K - 1 || state_out.cols != C || out.rows != T || out.cols != C)
    throw std::invalid_argument("conv1d_silu (cuda): shapes do not match mixed [T, C], conv_w [C, K]");
  const int tpb = int(std::max<int64_t>(kConvMinTokens, K - 1));
  const Kernel& k = kernel("gated_delta", "conv1d_silu", {{"KTAPS", K}});
  const Dim3 grid{unsigned((C + kConvThreads - 1) / kConvThreads), unsigned(std::max<int64_t>(1, (T + tpb - 1) / tpb)), 1};
  launch(k, grid, Dim3{kConvThreads, 1, 1}, 0, ptr(mixed), int64_t(mixed.stride), ptr(conv_w), int64_t(conv_w.stride),
         ptr(state_in), int64_t(state_in.stride), ptr(state_out), int64_t(state_out.stride), ptr(out),
         int64_t(out.stride), capture.active() ? ptr(capture.states) : CUdeviceptr(0),
         int64_t(capture.active() ? capture.states.stride : 0), int(capture.first), int(capture.count), int(T), int(C),
         tpb);
  note_variant("conv1d_silu", "channels over 128 threads, " + std::to_string(tpb) +
                                  "-token blocks over grid.y, K = " + std::to_string(K) + " taps in registers");
}

void CudaOps::gated_delta_impl(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                               const Tensor& dt_bias, const Tensor& state_in, const Tensor& state_out,
                               const DeltaShape& s, const Tensor& ws, const Tensor& out,
                               const StateCapture& capture) {
  for (const Tensor* t : {&qkv, &b, &a, &A_log, &dt_bias, &state_in, &state_out, &out}) require_f32(*t, "every tensor");
  if (capture.active()) require_f32(capture.states, "capture");
  const int64_t T = qkv.rows, Hk = s.k_heads, Hv = s.v_heads, Dk = s.k_dim, Dv = s.v_dim;
  if (Hk < 1 || Hv % Hk != 0 || Dk < 1 || Dv < 1)
    throw std::invalid_argument("gated_delta (cuda): needs v_heads a multiple of k_heads");
  if (qkv.cols != 2 * Hk * Dk + Hv * Dv || b.rows != T || a.rows != T || b.cols != Hv || a.cols != Hv ||
      A_log.cols != Hv || dt_bias.cols != Hv || out.rows != T || out.cols != Hv * Dv ||
      state_in.rows != Hv * Dk || state_in.cols != Dv || state_out.rows != Hv * Dk || state_out.cols != Dv)
    throw std::invalid_argument("gated_delta (cuda): shapes do not match the DeltaShape");
  // The state moves as float4 rows of 8-column warp slices.
  if (Dv % 8 != 0 || state_in.stride % 4 != 0 || state_out.stride % 4 != 0 || ptr(state_in) % 16 != 0 ||
      ptr(state_out) % 16 != 0 ||
      (capture.active() && (capture.states.stride % 4 != 0 || ptr(capture.states) % 16 != 0)))
    throw std::invalid_argument("gated_delta (cuda): needs v_dim % 8 == 0 and 16-byte aligned state rows");
  const CUdeviceptr cap = capture.active() ? ptr(capture.states) : CUdeviceptr(0);
  const int64_t cap_stride = capture.active() ? capture.states.stride : 0;
  const int cap_first = int(capture.first), cap_count = int(capture.count);
  if (T == 0) return;  // as the CPU: nothing to do, the state is not touched
  // One token, or the few rows of a decode-phase forward (an MTP verify window: decode_rows): the decode entry,
  // whose warps normalise q, k and form the gates themselves, so each row's arithmetic is a decode step's and the
  // prep launch is saved. Longer calls prepare those once per token (gated_delta_prep) for the scan.
  const bool decode_entry = T == 1 || phase() == Phase::Decode;
  const Kernel& k = kernel("gated_delta", decode_entry ? "gated_delta" : "gated_delta_prepped", {{"DK", Dk}, {"DV", Dv}});
  const Dim3 grid{unsigned(Hv), unsigned((Dv + kDeltaColsPerBlock - 1) / kDeltaColsPerBlock), 1};
  const Dim3 block{kDeltaThreads, 1, 1};
  const std::string geo = "grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) +
                          ") × 64 threads, 8 state columns per warp in registers";
  if (decode_entry) {
    launch(k, grid, block, 0, ptr(qkv), int64_t(qkv.stride), ptr(b), int64_t(b.stride), ptr(a), int64_t(a.stride),
           ptr(A_log), ptr(dt_bias), ptr(state_in), int64_t(state_in.stride), ptr(state_out),
           int64_t(state_out.stride), ptr(out), int64_t(out.stride), cap, cap_stride, cap_first, cap_count, int(T),
           int(Hk), int(Hv));
    note_variant(phase() == Phase::Decode ? "gated_delta.decode" : "gated_delta.prefill",
                 std::string(T == 1 ? "fused scan (one token" : "fused scan (a decode-phase forward's rows, each") +
                     ", norms and gates per warp): " + geo + ", state read and written once");
    return;
  }
  const int64_t key_dim = Hk * Dk;
  // The chunked form, or why not (the report names it).
  const int64_t chunk_rows = options().delta_chunk_rows;
  // The larger of a form's two kernels' shared memory where it is past the device's limit, else 0.
  auto over_smem = [&](size_t prep, size_t scan) {
    const size_t need = std::max(prep, scan);
    return need > size_t(info().max_smem_optin) ? need : size_t(0);
  };
  std::string scan_why;
  if (chunk_rows == 0)
    scan_why = "delta_chunk_rows = 0";
  else if (T < chunk_rows)
    scan_why = std::to_string(T) + " rows < delta_chunk_rows = " + std::to_string(chunk_rows);
  else if (capture.active())
    scan_why = "a state capture (the scan stores the state after the captured rows)";
  else if (Dk % 4 != 0 || Dv % 16 != 0)
    scan_why = "shape Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv) + " (chunked: Dk % 4 == 0, Dv % 16 == 0)";
  else if (out.stride % 4 != 0 || ptr(out) % 16 != 0)
    scan_why = "output rows not 16-byte aligned";
  else if (const size_t need = over_smem(chunk_prep_smem(Dk, Dv), chunk_scan_smem(Dk, Dv)))
    scan_why = "the chunked kernels need " + std::to_string(need) + " bytes of shared memory";
  const bool chunked = scan_why.empty();
  // The tensor-core form of the chunked kernels, or why not.
  std::string mma_why;
  if (!options().delta_chunk_mma)
    mma_why = "delta_chunk_mma=False";
  else if (Dk % 16 != 0)
    mma_why = "Dk=" + std::to_string(Dk) + " (tensor cores: Dk % 16 == 0)";
  else if (qkv.stride % 4 != 0 || ptr(qkv) % 16 != 0)
    mma_why = "qkv rows not 16-byte aligned (the prep copies v by cp.async)";
  else if (const size_t need = over_smem(chunk_prep_mma_smem(Dk, Dv), chunk_scan_mma_smem(Dk, Dv)))
    mma_why = "they need " + std::to_string(need) + " bytes of shared memory";
  const bool mma = mma_why.empty();
  const size_t need = prep_bytes(T, key_dim, Hv) + (chunked ? chunk_bytes(T, Hv, Dk, Dv) : 0);
  if (!ws.valid() || ws.bytes() < need)
    throw std::invalid_argument("gated_delta (cuda): workspace smaller than delta_workspace_bytes");
  const CUdeviceptr qn = ptr(ws), kn = qn + region(T * key_dim), alpha = kn + region(T * key_dim),
                    beta = alpha + region(T * Hv);
  const Kernel& kp = kernel("gated_delta", "gated_delta_prep", {{"DK", Dk}, {"DV", Dv}});
  launch(kp, Dim3{unsigned(T), unsigned((Hk + 3) / 4), 1}, Dim3{128, 1, 1}, 0, ptr(qkv), int64_t(qkv.stride), ptr(b),
         int64_t(b.stride), ptr(a), int64_t(a.stride), ptr(A_log), ptr(dt_bias), qn, kn, alpha, beta, int(Hk),
         int(Hv));
  if (chunked) {
    const CUdeviceptr rec = ptr(ws) + prep_bytes(T, key_dim, Hv);
    const unsigned chunks = unsigned((T + kChunk - 1) / kChunk);
    const uint32_t prep_smem = uint32_t(mma ? chunk_prep_mma_smem(Dk, Dv) : chunk_prep_smem(Dk, Dv));
    const uint32_t scan_smem = uint32_t(mma ? chunk_scan_mma_smem(Dk, Dv) : chunk_scan_smem(Dk, Dv));
    const char* prep_name = mma ? "gated_delta_chunk_prep_mma" : "gated_delta_chunk_prep";
    const char* scan_name = mma ? "gated_delta_chunk_scan_mma" : "gated_delta_chunk_scan";
    const Kernel& kc = kernel("gated_delta", prep_name, {{"DK", Dk}, {"DV", Dv}});
    set_dynamic_smem(kc, int(prep_smem), 0);  // ~85-104 KB at the real shape: past the 48 KB default
    launch(kc, Dim3{chunks, unsigned(Hv), 1}, Dim3{kChunkThreads, 1, 1}, prep_smem, ptr(qkv), int64_t(qkv.stride),
           ptr(a), int64_t(a.stride), ptr(A_log), ptr(dt_bias), qn, kn, beta, rec, int(T), int(Hk), int(Hv));
    const Kernel& ks = kernel("gated_delta", scan_name, {{"DK", Dk}, {"DV", Dv}});
    const int64_t cw = chunk_scan_cols(Dv);
    set_dynamic_smem(ks, int(scan_smem), 0);
    launch(ks, Dim3{unsigned(Hv), unsigned(Dv / cw), 1}, Dim3{kChunkThreads, 1, 1}, scan_smem, rec, qn, kn,
           ptr(state_in), int64_t(state_in.stride), ptr(state_out), int64_t(state_out.stride), ptr(out),
           int64_t(out.stride), int(T), int(Hk), int(Hv));
    note_variant(phase() == Phase::Decode ? "gated_delta.decode" : "gated_delta.prefill",
                 "chunked (WY / UT-transform, " + std::to_string(T) + " rows >= delta_chunk_rows = " +
                     std::to_string(chunk_rows) + "): gated_delta_prep, " + prep_name + " over (" +
                     std::to_string(chunks) + " chunks of 64, " + std::to_string(Hv) + " heads) × 256 threads, " +
                     std::string(scan_name) + " over (" + std::to_string(Hv) + ", " + std::to_string(Dv / cw) +
                     ") × 256 threads, " + std::to_string(cw) +
                     " state columns per block and each chunk's tiles in shared memory (cp.async); " +
                     (mma ? "products on the tensor cores (3xTF32 mma.sync m16n8k8)"
                          : "products in fp32 FMAs (not on the tensor cores: " + mma_why + ")"));
    return;
  }
  launch(k, grid, block, 0, ptr(qkv), int64_t(qkv.stride), ptr(b), int64_t(b.stride), ptr(a), int64_t(a.stride),
         ptr(A_log), ptr(dt_bias), qn, kn, alpha, beta, ptr(state_in), int64_t(state_in.stride), ptr(state_out),
         int64_t(state_out.stride), ptr(out), int64_t(out.stride), cap, cap_stride, cap_first, cap_count, int(T),
         int(Hk), int(Hv));
  note_variant(phase() == Phase::Decode ? "gated_delta.decode" : "gated_delta.prefill",
               "gated_delta_prep (q̂, k̂, alpha, beta once per token) + sequential scan over T: " + geo +
                   "; not chunked: " + scan_why);
}

// One launch for a decode row (kernels/gated_delta.cu conv_delta_norm): a block of 16 warps per key head (32
// warps, one per 8-column slice, would need more than 64 registers a thread: ptxas spills), each warp takes two
// slices in turn at the real shape. Every other call composes the three kernels (Ops::conv_delta_norm_impl),
// and note_variant says which ran and why.
void CudaOps::conv_delta_norm_impl(const Tensor& qkv, const Tensor& z, const Tensor& b, const Tensor& a,
                                   const Tensor& conv_w, const Tensor& A_log, const Tensor& dt_bias,
                                   const Tensor& norm_w, float eps, const DeltaShape& s, const Tensor& conv_in,
                                   const Tensor& conv_out, const Tensor& rec_in, const Tensor& rec_out,
                                   const Tensor& mixed, const Tensor& delta_o, const Tensor& ws, const Tensor& out,
                                   const StateCapture& conv_cap, const StateCapture& rec_cap) {
  constexpr int kFusedWarps = 16;
  const int64_t Hk = s.k_heads, Hv = s.v_heads, Dk = s.k_dim, Dv = s.v_dim, K = conv_w.cols;
  const int64_t G = Hk > 0 ? Hv / Hk : 0;
  const int64_t smem = (2 * Dk + 2 * G * Dv) * 4;
  // The composed norm's VEC = 4 sum order (norm.cpp select_norm) is what the fused kernel reproduces.
  const bool norm_vec4 = Dv % 4 == 0 && ptr(delta_o) % 16 == 0 && ptr(z) % 16 == 0 && ptr(norm_w) % 16 == 0 &&
                         ptr(out) % 16 == 0 && delta_o.stride % 4 == 0 && z.stride % 4 == 0 && out.stride % 4 == 0;
  const std::string key = phase() == Phase::Decode ? "conv_delta_norm.decode" : "conv_delta_norm.prefill";
  using F = CudaOptions::FusedDelta;
  const bool wide = options().fused_delta == F::Wide, norm = options().fused_delta == F::Norm,
             cluster = options().fused_delta == F::Cluster;
  std::string why;  // empty: fused
  if (options().fused_delta == F::Off)
    why = "option fused_delta = \"off\"";
  else if (qkv.rows != 1)
    why = std::to_string(qkv.rows) + " rows (the fused kernel takes one decode row)";
  else if (conv_cap.active() || rec_cap.active())
    why = "a state capture";
  else if (Hk < 1 || Hv % Hk != 0 || Dk < 1 || Dv < 8 || Dv % 8 != 0 || Dv > 512 || K < 1 || K > 16 ||
           norm_w.cols != Dv || norm_w.rows != 1 || smem > 48 * 1024)
    why = "shape Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv) + " K=" + std::to_string(K) +
          " (fused: Hv % Hk == 0, Dv % 8 == 0, Dv <= 512 (a warp per norm segment, as norm.cpp), K <= 16, norm "
          "over Dv, shared memory <= 48 KiB)";
  else if (!norm_vec4)
    why = "unaligned norm operands (the composed norm would take 4-byte loads, another sum order)";
  else if (rec_in.stride % 4 != 0 || rec_out.stride % 4 != 0 || ptr(rec_in) % 16 != 0 || ptr(rec_out) % 16 != 0)
    why = "recurrent state rows not 16-byte aligned";
  else if ((norm || cluster) && info().arch() < 90)
    why = "fused_delta \"" + std::string(norm ? "norm" : "cluster") + "\" needs thread-block clusters (sm_90; this "
          "device is sm_" + std::to_string(info().arch()) + ")";
  else if (norm && (Dv % kDeltaColsPerBlock != 0 || Dv > 8 * kDeltaColsPerBlock))
    why = "Dv=" + std::to_string(Dv) + " (fused_delta \"norm\": a value head's Dv/16 blocks form one cluster of at "
          "most 8, so Dv % 16 == 0 and Dv <= 128)";
  else if (cluster && (Dv % kDeltaColsPerBlock != 0 || Dv > 8 * kDeltaColsPerBlock || G * Dv > 16 * kDeltaColsPerBlock))
    why = "Dv=" + std::to_string(Dv) + ", Hv/Hk=" + std::to_string(G) + " (fused_delta \"cluster\": a key head's "
          "Hv/Hk · Dv/16 blocks form one cluster of at most 16, so Dv % 16 == 0, Dv <= 128 and Hv/Hk · Dv/16 <= 16)";
  else if (wide && (Hk + Hv > kDeltaCounters || delta_o.dtype != DType::F32 || delta_o.rows != 1 ||
                    delta_o.cols != Hv * Dv))
    why = "Hk + Hv over the " + std::to_string(kDeltaCounters) + " arrival counters, or delta_o not F32 [1, Hv·Dv]";
  if (!why.empty()) {
    note_variant(key, "composed (conv1d_silu, gated_delta, gated_rms_norm): " + why);
    return Ops::conv_delta_norm_impl(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, eps, s, conv_in, conv_out, rec_in,
                                     rec_out, mixed, delta_o, ws, out, conv_cap, rec_cap);
  }
  for (const Tensor* t : {&qkv, &z, &b, &a, &conv_w, &A_log, &dt_bias, &norm_w, &conv_in, &conv_out, &rec_in,
                          &rec_out, &out})
    require_f32(*t, "every tensor");
  if (qkv.cols != 2 * Hk * Dk + Hv * Dv || conv_w.rows != qkv.cols || conv_in.rows != K - 1 ||
      conv_in.cols != qkv.cols || conv_out.rows != K - 1 || conv_out.cols != qkv.cols || z.rows != 1 ||
      z.cols != Hv * Dv || out.rows != 1 || out.cols != Hv * Dv || b.rows != 1 || a.rows != 1 || b.cols != Hv ||
      a.cols != Hv || A_log.cols != Hv || dt_bias.cols != Hv || rec_in.rows != Hv * Dk || rec_in.cols != Dv ||
      rec_out.rows != Hv * Dk || rec_out.cols != Dv)
    throw std::invalid_argument("conv_delta_norm (cuda): shapes do not match the DeltaShape");
  if (cluster) {
    const Kernel& k = kernel("gated_delta", "conv_delta_norm_cluster",
                             {{"KTAPS", K}, {"DK", Dk}, {"DV", Dv}, {"CLUSTER_G", G}});
    const Dim3 grid{unsigned(Hv), unsigned(Dv / kDeltaColsPerBlock), 1};
    const int64_t blocks = G * grid.y;
    if (blocks > 8) allow_large_clusters(k);
    launch(k, grid, Dim3{kDeltaThreads, 1, 1}, 0, ptr(qkv), ptr(z), ptr(b), ptr(a), ptr(conv_w), int64_t(conv_w.stride),
           ptr(A_log), ptr(dt_bias), ptr(norm_w), eps, ptr(conv_in), int64_t(conv_in.stride), ptr(conv_out),
           int64_t(conv_out.stride), ptr(rec_in), int64_t(rec_in.stride), ptr(rec_out), int64_t(rec_out.stride),
           ptr(out), int(Hk));
    note_variant(key, "fused cluster: one launch on gated_delta's grid (" + std::to_string(grid.x) + ", " +
                          std::to_string(grid.y) + ") × 64 threads, each key head's " + std::to_string(blocks) +
                          " blocks a thread-block cluster: each block computes the conv of the channels it reads, "
                          "writes the conv state of those it owns after the cluster barrier and normalises its "
                          "columns with its value head's sums (distributed shared memory); mixed and delta_o stay in "
                          "shared memory");
    return;
  }
  if (norm) {  // conv1d_silu's launch, then the recurrence with the norm (kernels/gated_delta.cu gated_delta_norm)
    conv1d_silu_impl(qkv, conv_w, conv_in, conv_out, mixed, conv_cap);
    barrier_in_op();
    const Kernel& k = kernel("gated_delta", "gated_delta_norm", {{"DK", Dk}, {"DV", Dv}});
    const Dim3 grid{unsigned(Hv), unsigned(Dv / kDeltaColsPerBlock), 1};
    launch(k, grid, Dim3{kDeltaThreads, 1, 1}, 0, ptr(mixed), int64_t(mixed.stride), ptr(b), int64_t(b.stride), ptr(a),
           int64_t(a.stride), ptr(A_log), ptr(dt_bias), ptr(z), ptr(norm_w), eps, ptr(rec_in), int64_t(rec_in.stride),
           ptr(rec_out), int64_t(rec_out.stride), ptr(out), int(Hk), int(Hv));
    note_variant(key, "fused norm: conv1d_silu, then the recurrent update and the gated RMSNorm in one launch "
                      "(gated_delta_norm) on gated_delta's grid (" + std::to_string(grid.x) + ", " +
                          std::to_string(grid.y) + ") × 64 threads, each value head's " + std::to_string(grid.y) +
                          " blocks a thread-block cluster summing the norm through distributed shared memory; "
                          "delta_o stays in shared memory");
    return;
  }
  if (wide) {
    const Kernel& k = kernel("gated_delta", "conv_delta_norm_wide", {{"KTAPS", K}, {"DK", Dk}, {"DV", Dv}, {"WIDE", 1}});
    const Dim3 grid{unsigned(Hv), unsigned((Dv + kDeltaColsPerBlock - 1) / kDeltaColsPerBlock), 1};
    launch(k, grid, Dim3{kDeltaThreads, 1, 1}, 0, ptr(qkv), ptr(z), ptr(b), ptr(a), ptr(conv_w), int64_t(conv_w.stride),
           ptr(A_log), ptr(dt_bias), ptr(norm_w), eps, ptr(conv_in), int64_t(conv_in.stride), ptr(conv_out),
           int64_t(conv_out.stride), ptr(rec_in), int64_t(rec_in.stride), ptr(rec_out), int64_t(rec_out.stride),
           ptr(delta_o), ptr(out), norm_counters_ + kNormCounterBytes, int(Hk), int(Hv));
    note_variant(key, "fused wide: one launch on gated_delta's grid (" + std::to_string(grid.x) + ", " +
                          std::to_string(grid.y) + ") × 64 threads, each block computing the conv of the channels it "
                          "reads; the last block of a key head writes its conv state, the last of a value head "
                          "normalises it (arrival counters); mixed stays in shared memory");
    return;
  }
  const int warps = int(std::min<int64_t>(kFusedWarps, G * Dv / 8));
  const Kernel& k = kernel("gated_delta", "conv_delta_norm",
                           {{"KTAPS", K}, {"DK", Dk}, {"DV", Dv}, {"FUSED_WARPS", warps}});
  launch(k, Dim3{unsigned(Hk), 1, 1}, Dim3{unsigned(warps * 32), 1, 1}, uint32_t(smem), ptr(qkv), ptr(z), ptr(b),
         ptr(a), ptr(conv_w), int64_t(conv_w.stride), ptr(A_log), ptr(dt_bias), ptr(norm_w), eps, ptr(conv_in),
         int64_t(conv_in.stride), ptr(conv_out), int64_t(conv_out.stride), ptr(rec_in), int64_t(rec_in.stride),
         ptr(rec_out), int64_t(rec_out.stride), ptr(out), int(Hk), int(Hv));
  note_variant(key, "fused narrow: one launch, a block of " + std::to_string(warps * 32) +
                                      " threads per key head (grid " + std::to_string(Hk) + "), " +
                                      std::to_string(G * Dv / 8) + " 8-column state slices per block; mixed and "
                                      "delta_o stay in shared memory");
}

}  // namespace lily::cuda
