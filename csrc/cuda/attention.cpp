// Gated full attention on CUDA (MODEL.md section 4): kernels/attention.cu, oracle csrc/cpu/attention.cpp.
//
// Variants.
// - attn_qk_prep, kv_append: one kernel each, one warp per (token, head) / one block per (token, kv head);
//   attn_qk_prep_append (the graph's op) both in one kernel, a warp per (token, q, k or v head), unless
//   qk_prep_append=False.
// - attention, decode step (phase Decode, T = 1): always the split-KV form. The grid has ns blocks per kv
//   head, ns = min(ceil(max_ctx / 64), ceil(b·SMs / kv_heads), 256) with b the resident blocks per SM (1
//   for the tensor-core kernel, 2 for the fp32 one), fixed at encode time so the captured graph fits every
//   position; the live length pos[0] + 1 is cut on the device into a = min(ns, ceil(len / 64)) chunks
//   (blocks past a exit) and the reduce merges those a partials. So a short context costs a few blocks and
//   a 128K one fills the machine in one wave. bf16 caches: attn_decode_mma (tensor cores, q as three bf16
//   parts for G <= 8 (two above), p as two); f32 caches or LILY_CUDA_ATTENTION_DECODE=fp32:
//   attn_decode_split (fp32 FMA).
// - attention, prefill (any other call), bf16 caches and G dividing 64: attn_prefill_mma, flash attention
//   on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation) with q and p split into two bf16 halves so
//   the result stays within ~1e-5 of fp32. f32 caches (or LILY_CUDA_ATTENTION_PREFILL=fp32): the fp32
//   flash kernel (K/V tiles staged in shared memory by cp.async, shared by 8 tokens × G heads).
//   Either one, for at most 64 rows whose grid leaves SMs idle (a warm turn's new tokens, an MTP verify over a long
//   context): the key range is split over the grid's z (PF_SPLIT, ns ranges, each >= 64 keys of max_ctx, the
//   partials in ws) and attn_prefill_reduce merges them; attn_prefill_split=False turns it off.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cuda/backend.h"
#include "model/config.h"

namespace lily::cuda {

namespace {

constexpr int64_t kMinChunk = 64;   // MIN_CHUNK in attention.cu
constexpr int64_t kSplitCap = 256;  // most splits per kv head
constexpr int kDecodeWarps = 4;     // DEC_NW
constexpr int kPrefillTokens = 8;   // PF_QT
// Split prefill (PF_SPLIT): up to kSplitRowsMax rows get splits when their grid leaves SMs idle, and the workspace
// holds kSplitPartials (row, split) partials per head (16 rows of lily-tiny's f32 cache on 132 SMs: 6 blocks, 22 splits).
constexpr int64_t kSplitRowsMax = 64;
constexpr int64_t kSplitPartials = 1024;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Splits per kv head that the workspace holds for max_ctx (the grid never exceeds it).
int64_t split_room(int64_t max_ctx) { return std::max<int64_t>(1, std::min(kSplitCap, ceil_div(max_ctx, kMinChunk))); }

void check_shape(int64_t heads, int64_t kv, int64_t D, int64_t rd) {
  if (kv <= 0 || heads % kv != 0 || heads / kv > 16)
    throw std::invalid_argument("cuda attention: heads " + std::to_string(heads) + " / kv_heads " +
                                std::to_string(kv) + " must be a whole group of at most 16");
  if (D != 32 && D != 64 && D != 128 && D != 256)
    throw std::invalid_argument("cuda attention: head_dim " + std::to_string(D) + " must be 32, 64, 128 or 256");
  if (rd < 0 || rd > D || rd % 2 != 0)
    throw std::invalid_argument("cuda attention: rotary_dim " + std::to_string(rd) + " must be even, <= head_dim");
}

int cache_code(const Tensor& c) {
  if (c.dtype == DType::BF16) return 2;  // LILY_BF16
  if (c.dtype == DType::F32) return 0;   // LILY_F32
  throw std::invalid_argument("cuda attention: KV cache must be f32 or bf16");
}

}  // namespace

size_t attention_workspace_bytes(const ModelConfig& c, int64_t rows, int64_t max_ctx) {
  (void)rows;  // decode partials depend on max_ctx only; a split prefill's are bounded by kSplitPartials
  if (c.kv_heads <= 0 || c.heads <= 0) return 0;
  const int64_t G = c.heads / c.kv_heads, D = c.head_dim;
  const size_t decode = size_t(c.kv_heads) * size_t(split_room(max_ctx)) * size_t(G) * size_t(D + 2) * sizeof(float);
  // A split prefill's partials: at most kSplitPartials (token, split) pairs per head.
  const size_t prefill = size_t(kSplitPartials) * size_t(c.heads) * size_t(D + 2) * sizeof(float);
  return std::max(decode, prefill);
}

// Splits of the key range for a prefill of T rows whose grid has `blocks` blocks (0: none). Few rows over a long
// context leave most SMs idle without them (6 blocks for 16 tokens at G = 8 on 2 kv heads); each split is at least
// 64 keys of max_ctx, and the partials fit the workspace.
int64_t prefill_splits(int64_t T, int64_t blocks, int64_t max_ctx, int64_t sms, bool enabled) {
  if (!enabled || T > kSplitRowsMax || blocks >= sms) return 0;
  const int64_t ns = std::min({ceil_div(sms, blocks), split_room(max_ctx), kSplitPartials / T});
  return ns >= 2 ? ns : 0;
}

void CudaOps::attn_qk_prep_impl(const Tensor& qg, const Tensor& k, const Tensor& q_norm, const Tensor& k_norm,
                                const Tensor& pos, const AttentionShape& s, const Tensor& q_out,
                                const Tensor& gate_out, const Tensor& k_out) {
  check_shape(s.heads, s.kv_heads, s.head_dim, s.rotary_dim);
  if (qg.rows == 0) return;
  const Kernel& kn = kernel("attention", "attn_qk_prep", {{"HEAD_DIM", s.head_dim}});
  const unsigned gy = unsigned(ceil_div(s.heads + s.kv_heads, 4));
  launch(kn, Dim3{unsigned(qg.rows), gy, 1}, Dim3{128, 1, 1}, 0, ptr(qg), int64_t(qg.stride), ptr(k),
         int64_t(k.stride), ptr(q_norm), ptr(k_norm), ptr(pos), ptr(q_out), int64_t(q_out.stride), ptr(gate_out),
         int64_t(gate_out.stride), ptr(k_out), int64_t(k_out.stride), int(s.heads), int(s.kv_heads),
         int(s.rotary_dim), double(s.rope_theta), float(s.eps));
  note_variant("attention.qk_prep",
               "attn_qk_prep: warp per (token, head), RoPE angles in double, their cos / sin before the wait for the "
               "projections");
}

void CudaOps::kv_append_impl(const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& k_cache,
                             const Tensor& v_cache, int64_t max_ctx, const AttentionShape& s) {
  check_shape(s.heads, s.kv_heads, s.head_dim, s.rotary_dim);
  if (k.rows == 0) return;
  if (k_cache.dtype != v_cache.dtype) throw std::invalid_argument("cuda kv_append: K and V caches differ in dtype");
  const Kernel& kn = kernel("attention", "attn_kv_append", {{"HEAD_DIM", s.head_dim}});
  launch(kn, Dim3{unsigned(k.rows), unsigned(s.kv_heads), 1}, Dim3{64, 1, 1}, 0, ptr(k), int64_t(k.stride), ptr(v),
         int64_t(v.stride), ptr(pos), ptr(k_cache), ptr(v_cache), int64_t(max_ctx), cache_code(k_cache));
}

void CudaOps::attn_qk_prep_append_impl(const Tensor& qg, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                                       const Tensor& k_norm, const Tensor& pos, const AttentionShape& s,
                                       const Tensor& q_out, const Tensor& gate_out, const Tensor& k_out,
                                       const Tensor& k_cache, const Tensor& v_cache, int64_t max_ctx) {
  if (!options().qk_prep_append) {
    note_variant("attention.qk_prep_append", "attn_qk_prep, then attn_kv_append (qk_prep_append=False)");
    return Ops::attn_qk_prep_append_impl(qg, k, v, q_norm, k_norm, pos, s, q_out, gate_out, k_out, k_cache, v_cache,
                                         max_ctx);
  }
  check_shape(s.heads, s.kv_heads, s.head_dim, s.rotary_dim);
  if (qg.rows == 0) return;
  if (k_cache.dtype != v_cache.dtype)
    throw std::invalid_argument("cuda attn_qk_prep_append: K and V caches differ in dtype");
  const Kernel& kn = kernel("attention", "attn_qk_prep_append", {{"HEAD_DIM", s.head_dim}});
  const unsigned gy = unsigned(ceil_div(s.heads + 2 * s.kv_heads, 4));
  launch(kn, Dim3{unsigned(qg.rows), gy, 1}, Dim3{128, 1, 1}, 0, ptr(qg), int64_t(qg.stride), ptr(k),
         int64_t(k.stride), ptr(v), int64_t(v.stride), ptr(q_norm), ptr(k_norm), ptr(pos), ptr(q_out),
         int64_t(q_out.stride), ptr(gate_out), int64_t(gate_out.stride), ptr(k_out), int64_t(k_out.stride),
         ptr(k_cache), ptr(v_cache), int64_t(max_ctx), cache_code(k_cache), int(s.heads), int(s.kv_heads),
         int(s.rotary_dim), double(s.rope_theta), float(s.eps));
  note_variant("attention.qk_prep_append",
               "attn_qk_prep_append: the q/k prep and the k and v rows' cache writes in one launch, a warp per (token, "
               "q, k or v head)");
}

void CudaOps::attention_impl(const Tensor& q, const Tensor& gate, const Tensor& k_cache, const Tensor& v_cache,
                             const Tensor& pos, int64_t max_ctx, const AttentionShape& s, const Tensor& ws,
                             const Tensor& out) {
  check_shape(s.heads, s.kv_heads, s.head_dim, s.rotary_dim);
  const int64_t T = q.rows, D = s.head_dim, G = s.heads / s.kv_heads;
  if (T == 0) return;
  const int code = cache_code(k_cache);
  if (v_cache.dtype != k_cache.dtype) throw std::invalid_argument("cuda attention: K and V caches differ in dtype");
  if ((ptr(k_cache) | ptr(v_cache)) % 16 != 0)
    throw std::invalid_argument("cuda attention: KV caches must be 16-byte aligned");
  const Defines defs = {{"HEAD_DIM", D}, {"GROUP", G}, {"KV_BF16", code == 2 ? 1 : 0}};
  const float scale = 1.f / std::sqrt(float(D));

  if (phase() == Phase::Decode && T == 1) {
    // bf16 caches: the tensor-core split kernel (one block of 4 warps per SM, 152 KB of shared memory at
    // D = 256); f32 caches (or LILY_CUDA_ATTENTION_DECODE=fp32): the fp32 one (two blocks per SM). Both
    // write the same partials for the same reduce.
    const char* force = std::getenv("LILY_CUDA_ATTENTION_DECODE");
    const bool want_fp32 = force && std::string(force) == "fp32";
    const int dm_smem = int((2 * 16 + 4 * 2 * 2 * 16) * (D * 2 + 16));
    const bool mma = code == 2 && !want_fp32 && dm_smem <= info().max_smem_optin;
    const int64_t sms = int64_t(std::max(1, info().sms));
    const int64_t room = split_room(max_ctx);
    const int64_t fill = ceil_div((mma ? 1 : 2) * sms, s.kv_heads);  // one wave of resident blocks
    const int64_t ns = std::max<int64_t>(1, std::min(room, fill));
    const size_t part_o = size_t(s.kv_heads) * size_t(room) * size_t(G) * size_t(D);
    const size_t need = (part_o + size_t(s.kv_heads) * size_t(room) * size_t(G) * 2) * sizeof(float);
    if (ws.bytes() < need)
      throw std::logic_error("cuda attention: workspace of " + std::to_string(ws.bytes()) + " bytes, " +
                             std::to_string(need) + " needed");
    const CUdeviceptr po = ptr(ws), pml = po + part_o * sizeof(float);
    if (mma) {
      if (ptr(q) % 16 != 0)  // the kernel stages q with float4 loads
        throw std::invalid_argument("cuda attention: q must be 16-byte aligned for the tensor-core decode kernel");
      Defines mma_defs = defs;
      mma_defs.push_back({"DM_EARLY", options().attn_decode_early ? 1 : 0});
      const Kernel& split = kernel("attention", "attn_decode_mma", mma_defs);
      if (dm_smem > 48 * 1024) set_dynamic_smem(split, dm_smem);
      launch(split, Dim3{unsigned(ns), unsigned(s.kv_heads), 1}, Dim3{128, 1, 1}, uint32_t(dm_smem), ptr(q),
             ptr(k_cache), ptr(v_cache), ptr(pos), int64_t(max_ctx), int(ns), scale, po, pml);
    } else {
      const Kernel& split = kernel("attention", "attn_decode_split", defs);
      const int so_smem = int(kDecodeWarps * G * D * int64_t(sizeof(float)));
      if (so_smem > 48 * 1024) set_dynamic_smem(split, so_smem);
      launch(split, Dim3{unsigned(ns), unsigned(s.kv_heads), 1}, Dim3{32 * kDecodeWarps, 1, 1}, uint32_t(so_smem),
             ptr(q), ptr(k_cache), ptr(v_cache), ptr(pos), int64_t(max_ctx), int(ns), scale, po, pml);
    }
    const Kernel& reduce = kernel("attention", "attn_decode_reduce", defs);
    // wsplit [ns] rounded up to whole float4s: the compiler reads it 16 bytes at a time (compute-sanitizer's
    // memcheck caught a read past ns = 1..3).
    // Grid (heads, column blocks of min(D, 64)): kernels/attention.cu RED_RC.
    launch(reduce, Dim3{unsigned(s.heads), unsigned(D / std::min<int64_t>(D, 64)), 1}, Dim3{256, 1, 1},
           uint32_t((ns + 3) / 4 * 4 * sizeof(float)), po, pml, ptr(pos), int(ns), ptr(gate), ptr(out));
    const std::string splits = std::to_string(ns) + " splits/kv head (max_ctx " + std::to_string(max_ctx) +
                               ", >= 64 rows each, live length cut on device)";
    note_variant("attention.decode",
                 mma ? "split-KV mma.sync bf16: " + splits +
                           ", 4 warps × 16-key tiles via cp.async, G heads as mma rows, " +
                           (G <= 8 ? "q as three bf16 parts (the third in the padding rows)" : "q as bf16 hi + lo") +
                           ", p as bf16 hi + lo" +
                           (options().attn_decode_early
                                ? ", each warp's first tile but the step's new row loaded before the wait for the "
                                  "q/k prep"
                                : ", every tile loaded after the wait (attn_decode_early=False)") +
                           "; then the reduce"
                     : "split-KV fp32: " + splits + ", " + std::to_string(kDecodeWarps) + " warps × " +
                           (code == 2 ? "4 bf16" : "2 f32") +
                           " rows in flight, all G heads per KV row, fp32 FMA; then the reduce" +
                           (want_fp32 ? " (forced by LILY_CUDA_ATTENTION_DECODE)" : ""));
    return;
  }

  // Tensor-core prefill for bf16 caches (K and V exact in bf16; q and p carried as two bf16 halves) when the
  // group divides the 64-row query tile and the shared memory fits; LILY_CUDA_ATTENTION_PREFILL=fp32 forces
  // the fp32 kernel (tests compare the two).
  const char* force = std::getenv("LILY_CUDA_ATTENTION_PREFILL");
  const bool want_fp32 = force && std::string(force) == "fp32";
  const int keys = options().attn_prefill_keys;
  const int mm_smem = int((2 * 64 + 4 * keys) * (D * 2 + 16));
  const bool mma = code == 2 && 64 % G == 0 && !want_fp32 && mm_smem <= info().max_smem_optin;
  const int64_t tokens_per_block = mma ? 64 / G : kPrefillTokens;
  const int64_t blocks = ceil_div(T, tokens_per_block) * s.kv_heads;
  const int64_t ns = prefill_splits(T, blocks, max_ctx, std::max(1, info().sms), options().attn_prefill_split);
  Defines kdefs = defs;
  if (mma) kdefs.push_back({"MM_BN", keys});
  if (ns) kdefs.push_back({"PF_SPLIT", 1});
  const int64_t pf_rows = std::min<int64_t>(64, 16384 / (D * (code == 2 ? 2 : 4))) / 4 * 4;  // PF_R (a multiple of PF_U)
  const size_t part_o = size_t(T) * size_t(s.heads) * size_t(ns) * size_t(D);
  if (ns && ws.bytes() < (part_o + size_t(T) * size_t(s.heads) * size_t(ns) * 2) * sizeof(float))
    throw std::logic_error("cuda attention: workspace of " + std::to_string(ws.bytes()) +
                           " bytes is short of a split prefill's partials");
  const CUdeviceptr po = ns ? ptr(ws) : CUdeviceptr(0), pml = ns ? po + part_o * sizeof(float) : CUdeviceptr(0);
  const Dim3 grid{unsigned(ceil_div(T, tokens_per_block)), unsigned(s.kv_heads), unsigned(ns ? ns : 1)};
  std::string form;
  if (mma) {
    const Kernel& mm = kernel("attention", "attn_prefill_mma", kdefs);
    if (mm_smem > 48 * 1024) set_dynamic_smem(mm, mm_smem);
    launch(mm, grid, Dim3{128, 1, 1}, uint32_t(mm_smem), ptr(q), int64_t(q.stride), ptr(gate), int64_t(gate.stride),
           ptr(k_cache), ptr(v_cache), ptr(pos), int64_t(max_ctx), int(T), scale, ptr(out), int64_t(out.stride),
           int(ns ? ns : 1), po, pml);
    form = "mma.sync bf16 flash: 64 query rows (" + std::to_string(64 / G) + " tokens × " + std::to_string(G) +
           " heads) per block of 4 warps, K/V tiles of " + std::to_string(keys) + " rows via cp.async (2 stages, " +
           std::to_string(mm_smem) + " bytes of shared memory), q and p as bf16 hi + lo, fp32 softmax";
  } else {
    const int smem = int(2 * 2 * pf_rows * D * (code == 2 ? 2 : 4));  // two stages of K and V tiles
    const Kernel& pf = kernel("attention", "attn_prefill", kdefs);
    if (smem > 48 * 1024) set_dynamic_smem(pf, smem);
    launch(pf, grid, Dim3{32 * kPrefillTokens, 1, 1}, uint32_t(smem), ptr(q), int64_t(q.stride), ptr(gate),
           int64_t(gate.stride), ptr(k_cache), ptr(v_cache), ptr(pos), int64_t(max_ctx), int(T), scale, ptr(out),
           int64_t(out.stride), int(ns ? ns : 1), po, pml);
    form = "flash fp32: 8 tokens × G heads per block, K/V tiles of " + std::to_string(pf_rows) +
           " rows via cp.async (2 stages), online softmax" +
           (want_fp32 ? std::string(" (forced by LILY_CUDA_ATTENTION_PREFILL)") : std::string());
  }
  if (ns) {
    const Kernel& reduce = kernel("attention", "attn_prefill_reduce", kdefs);
    const int tile = mma ? keys : int(pf_rows);  // the kernel's MM_BN / PF_R: the reduce recomputes the splits' keys
    launch(reduce, Dim3{unsigned(T), unsigned(s.heads), 1}, Dim3{128, 1, 1}, uint32_t(ns * sizeof(float)), po, pml,
           ptr(pos), int(T), int(ns), tile, ptr(gate), int64_t(gate.stride), ptr(out), int64_t(out.stride));
    note_variant("attention.prefill_split",
                 form + "; split-KV for " + std::to_string(T) + " rows: " + std::to_string(ns) +
                     " key ranges per block row (up to " + std::to_string(kSplitRowsMax) +
                     " rows when the grid leaves SMs idle), then attn_prefill_reduce");
  } else {
    note_variant("attention.prefill", form);
  }
}

}  // namespace lily::cuda
