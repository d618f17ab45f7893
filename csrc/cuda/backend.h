// The CUDA backend: the model graph on one NVIDIA GPU (sm_80 or newer).
//
// Shape of a step. Ops are encoded between begin() and submit() as before; each *_impl picks kernels and
// records their launches (kernel, grid, block, shared memory, packed arguments) in a host list, nothing
// runs yet. submit() hands the list to the device: a prefill step's launches go to the compute stream as
// they are; a decode step's list is compared with the decode graphs already captured (same kernels, same
// arguments, byte for byte) and replayed as a CUDA graph, or captured once into a new one. The step's end
// is marked by an event: that is the fence wait() blocks on. Because a decode step reads its token id and
// position from device tensors and the session alternates two slots and two state sets, two graphs serve a
// whole generation.
//
// Kernels come from csrc/cuda/kernels/<family>.cu (embedded in the extension), compiled by NVRTC at first
// use with the model's dimensions as -D constants and the device's architecture, and cached on disk
// (kernel(); compile.cpp). Host transfers (upload/download, outside steps) use a separate copy stream, so
// reading id k while step k + 1 runs does not wait for step k + 1.
//
// Threads: a CudaOps is used by one thread at a time (the engine lock); nothing here is shared between
// engines except the loaded driver tables (driver.h) and the on-disk kernel cache (written atomically).
#pragma once
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "backend/ops.h"
#include "cuda/driver.h"

namespace lily::cuda {

// Compile-time constants of one module build, e.g. {{"HIDDEN", 2048}, {"BITS", 4}}: -DHIDDEN=2048 -DBITS=4.
using Defines = std::vector<std::pair<std::string, int64_t>>;

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct Kernel {
  CUfunction fn = nullptr;
  std::string family, name;
  std::string module;  // the family and its defines (the compile key)
  int max_dynamic_smem = 48 * 1024;  // static + dynamic bytes a launch may use; raised with set_dynamic_smem
  bool large_clusters = false;       // thread-block clusters past the portable 8 allowed (allow_large_clusters)
  // What the compiler gave it (cuFuncGetAttribute at load; -1 in a dry run): registers per thread, local memory per
  // thread (spills and stack), static shared memory.
  int registers = -1, local_bytes = -1, static_smem = -1;
  // The (threads per block, dynamic shared memory) of its launches so far (engine.report()["cuda"]["kernels"]); written
  // under the engine lock by launch().
  mutable std::vector<std::pair<unsigned, uint32_t>> configs;
};

// A kernel's resources and, per launch shape, how many of its blocks one multiprocessor holds (report()).
struct KernelResources {
  const Kernel* kernel = nullptr;
  struct Config {
    unsigned threads = 0;
    uint32_t dynamic_smem = 0;
    int blocks_per_sm = -1;  // cuOccupancyMaxActiveBlocksPerMultiprocessor; -1 in a dry run
  };
  std::vector<Config> configs;
};

struct CudaOptions {
  int device = 0;
  bool graphs = true;                // decode steps replayed as CUDA graphs
  // Speculative (MTP) iterations too: their steps are marked repeating (Ops::begin), so the encode memo and
  // graph replay apply to them as to decode steps (needs graphs / encode_memo for each).
  bool speculative_graphs = true;
  // Speculative iterations verify their k + 1 rows through the decode kernels (GEMV, the fused decode MoE: each
  // row as a decode step computes it) instead of the prefill path; drafts run as decode rows too.
  bool mtp_verify_decode = true;
  bool branches = true;              // independent launches of a stage on parallel streams / graph branches
  // GPU time of replayed decode steps (the report's gpu_us_per_decode_step) from events recorded around one replay
  // in `replay_timing` (1: every replay; 0: none, the report then says it was not measured).
  int replay_timing = 1;
  // The preferred shared-memory carveout (percent of the SM's unified L1/shared capacity) given to every kernel; -1:
  // none, the driver's choice per kernel. An SM changes its split only when idle, so kernels of different splits in
  // sequence (the decode attention's 152 KB blocks after the GEMVs' few KB) cannot overlap under programmatic launch.
  int smem_carveout = -1;
  // Decode encode memo: an op whose arguments equal (byte for byte) those of an op already encoded in a decode
  // step reuses its recorded launches instead of running its host code again (forgotten at any allocation,
  // release or weight placement, which are what turn buffer ids and mappings into addresses).
  bool encode_memo = true;
  // Prefill encode memo: the same for the ops of prefill steps. A chunk's ops recur with the same arguments whenever
  // a chunk of the same length is encoded in the same session state (positions are read on the device, so the
  // chunk's place in the context does not matter): every full chunk of a long prompt from the third, a prompt length
  // seen twice before. An op is recorded at its second sighting (its first costs a hash), so prompts in fresh
  // sessions pay next to nothing for it. Bounded: the memo is emptied when it holds kPrefillMemoEntries ops.
  bool prefill_memo = true;
  // Decode GEMV with its weight loads staged through shared memory by cp.async, 4 batches deep
  // (matmul_gemv_async); false: the register double buffer (matmul_gemv).
  bool gemv_async = true;
  // Decode GEMV of 4/8-bit affine weights (16-byte rows, aligned scales, groups of whole chunks) with x as three
  // int8 terms per chunk and dp4a integer dot products (matmul_gemv_dp4a; error ~1e-7 relative, the fp32 form's
  // level); false: the fp32 CUDA-core forms above.
  bool gemv_dp4a = true;
  // Warp batches of the dp4a decode GEMV whose weight loads go out before its programmatic-launch wait: 1 (then one
  // batch ahead, a register double buffer) or 2 (the second buffer filled before the wait as well; the default:
  // +0.7% decode at 4K on the H100).
  int gemv_ahead = 2;
  // Decode: the RMSNorm in front of a layer's projections (Ops::rms_norm_matmuls / add_rms_norm_matmuls) done by
  // every block of their GEMV launch; false: the norm's own launch, then the GEMV (the same bits).
  bool fused_norm = true;
  // Decode: a DeltaNet layer's conv + recurrent update + gated RMSNorm (Ops::conv_delta_norm) as one launch per
  // layer (the same bits as the three kernels). Narrow: a block per key head (kernels/gated_delta.cu
  // conv_delta_norm; measured slower on the H200: 16 blocks stream the state where the scan has 256). Wide:
  // gated_delta's 256 blocks, each computing the conv of the channels it reads, arrival counters for the conv state
  // and the norm (conv_delta_norm_wide). Norm (sm_90): conv1d_silu, then the recurrent update and the gated norm
  // in one launch on gated_delta's grid, the blocks of a value head a cluster summing the norm through distributed
  // shared memory (gated_delta_norm; +1.2% decode at 4K on the H100 over the three kernels). Cluster (sm_90; the
  // default: +0.7% at 4K over Norm): wide's product with a key head's blocks one thread-block cluster in place of the
  // arrival counters (conv_delta_norm_cluster). Where a form's shape or device does not allow it, the three kernels,
  // and the report says why. Off: the three kernels. benchmarks/NOTES.md.
  enum class FusedDelta { Off, Narrow, Wide, Norm, Cluster };
  FusedDelta fused_delta = FusedDelta::Cluster;
  // Prefill GEMMs (dense and MoE): how the fp32 activations enter the tensor cores. F16: one fp16 term scaled by a
  // power of two per row and group part (quant.cuh f16_part_scale; ~2.4e-4 relative per product, one MMA per step),
  // for affine weights whose integer codes enter the MMA exactly; the others (dense weights, groups that do not tile
  // the 64-wide K block) take BF16x2, and the variant says so. BF16x2: hi + lo bf16 (~1e-5, two MMAs per step).
  // BF16: one bf16 term (~2e-3: the random test models' logits leave the bf16 tolerance). benchmarks/NOTES.md.
  enum class XForm { F16, BF16x2, BF16 };
  XForm prefill_x = XForm::F16;
  // The MoE expert GEMMs' own setting (unset: prefill_x): the dense and the expert GEMMs' error reaches the logits
  // differently, so each can be A/B'd alone.
  std::optional<XForm> moe_x;
  XForm moe_prefill_x() const { return moe_x ? *moe_x : prefill_x; }
  // MoE prefill GEMMs of affine experts: K blocks staged by cp.async in a ring of this many stages (2..4; fewer if
  // the device's shared memory is smaller), 0 = the register prefetch one block ahead. benchmarks/NOTES.md.
  int moe_pipe = 3;
  // MoE prefill GEMMs of 4-bit affine experts with 16-row tiles (T·k/E < 32): each warp widens its own columns' codes
  // into B fragments in registers (no bf16 weight tile in shared memory), the raw K blocks through a cp.async ring of
  // this many stages (3..6; fewer if the device's shared memory is smaller; 3 leave room for 3 blocks per SM); 0 = the
  // shared bf16 tile. The same bits. benchmarks/NOTES.md.
  int moe_frag = 3;
  // The MoE prefill tile height by the expected rows per expert T·k/E: from moe_frag32_rows the fragment tiles (above)
  // take 32 rows, two m16 tiles per warp on the same widened codes (an expert with 17-32 rows has its weights read
  // once instead of by two 16-row tiles); from moe_tile64_rows the tiles take 64 rows (the shared bf16 tile and the
  // moe_pipe ring); 0 = by format: 32 for experts without fragment tiles, never for those with them (32-row fragment
  // tiles measured faster at every length). The same bits at any height. benchmarks/NOTES.md.
  int moe_frag32_rows = 20;
  int moe_tile64_rows = 0;
  // From this expected rows per expert T·k/E the fragment tiles take 64 rows (four m16 tiles per warp on each widened
  // B fragment, 128 weight rows per block; kernels/moe.cu FRAG_ROWS); 0: never. The same bits at any height.
  // Measured +1.5% prefill at 4K on the H100 (from 32 rows: -3% at 1K): benchmarks/NOTES.md.
  int moe_frag64_rows = 64;
  // Decode MoE geometry: gate/up rows per warp of moe_gate_up_decode (1, 2 or 4; 0 = by shape: 4 / 16-byte vectors
  // per lane of a row, 2 for the real model) and output rows per moe_down_decode block (1..64). Fewer, fuller blocks
  // leave room on each SM for the down pass's blocks to sit resident (and load their weights) while gate/up runs.
  int moe_rows_g = 0;
  int moe_rows_d = 8;
  // Blocks per SM the decode MoE kernels' registers must allow (__launch_bounds__; 0 = the compiler's choice, 3 at
  // the real shape; 4 caps them at 64 registers so the down pass's blocks sit beside gate/up's). The same bits.
  int moe_decode_minb = 0;
  // The decode MoE's gate/up pass issues its weight loads while x is staged (after the routing; the shared expert's
  // before its wait) instead of after: one DRAM round trip instead of several (kernels/moe.cu GU_EARLY). The same
  // bits. Measured +2.3% decode at 4K, +1.6% at 128K on the H100: benchmarks/NOTES.md.
  bool moe_early_loads = true;
  // Prefill attention on tensor cores (bf16 caches): keys per K/V tile, 16 or 32. Shared memory per block is 101 KB or
  // 135 KB at head dim 256: two blocks per SM or one. benchmarks/NOTES.md.
  int attn_prefill_keys = 16;
  // Prefill attention for at most 64 rows whose grid leaves SMs idle (a warm turn's new tokens or an MTP verify after
  // a long context): the key range split over more blocks and the partials merged (kernels/attention.cu PF_SPLIT).
  // False: one block per query tile reads every key (A/B). benchmarks/NOTES.md.
  bool attn_prefill_split = true;
  // Ops::attn_qk_prep_append as one kernel (kernels/attention.cu attn_qk_prep_append: the k and v rows go into the
  // caches from the prep's warps, the same values); false: attn_qk_prep, then attn_kv_append (A/B).
  bool qk_prep_append = true;
  // Decode attention on tensor cores: each warp's first K/V tile, less the step's new row, loaded before the
  // programmatic-launch wait (kernels/attention.cu DM_EARLY; the same bits). False: after it (A/B).
  bool attn_decode_early = true;
  // Prefill DeltaNet: calls of at least this many rows without a state capture take the chunked (WY / UT-transform)
  // form (kernels/gated_delta.cu gated_delta_chunk_prep / _scan: 64-token chunks, three small products per chunk
  // instead of 64 dependent token steps); shorter calls, captures (the prefix cache's checkpoint inside a chunk, MTP
  // verification) and 0 take the sequential scan. Another summation order than the scan: not the same bits, the
  // same tolerance to the CPU. benchmarks/NOTES.md.
  int delta_chunk_rows = 64;
  // The chunked form's products on the tensor cores (gated_delta_chunk_prep_mma / _scan_mma: mma.sync m16n8k8 in
  // 3xTF32, fp32's error level; the prep's solve as a blocked inverse of the four 16-row diagonal blocks) where
  // Dk % 16 == 0. False: the fp32 FMA kernels (A/B). Not their bits: another summation order. benchmarks/NOTES.md.
  bool delta_chunk_mma = true;
  // Prefill GEMMs whose 64-row grid has at most a quarter (half) as many blocks as there are SMs (small T and small
  // N) run 16-row (32-row) tiles: 4x (2x) the blocks, the same bits. False: always 64 rows (A/B). benchmarks/NOTES.md.
  bool gemm_small_tiles = true;
  // Prefill GEMMs of 4-bit codes: the W tile stays raw codes in shared memory and each warp widens its own columns'
  // codes into tensor-core B fragments in registers (no converted W tile, no ldmatrix for B: the dense GEMM is bound
  // by shared-memory traffic, ncu). The same bits by construction. Off until a GPU has run its tests and an A/B
  // (built and compile-checked without one): benchmarks/NOTES.md.
  bool gemm_frag = false;
  // Prefill GEMMs of affine codes with x as f16 (prefill_x "f16"): the W tile holds f16(s·q + b) instead of the codes,
  // so no per-group fold of the scale and no b·Σx term (kernels/matmul.cu WF16). Not the codes path's bits: the
  // weights are rounded to f16 (≤ 2^-11 relative). Measured +5% prefill at 4K on the H100: benchmarks/NOTES.md.
  bool gemm_w_f16 = true;
  // The same for the MoE prefill GEMMs' fragment tiles (4-bit experts, x as f16): each lane turns its widened code
  // pairs into f16 weights (kernels/moe.cu MWF16). Measured +4% more at 4K on the H100.
  bool moe_w_f16 = true;
  // With moe_w_f16: the MoE prefill GEMMs' x and act as f16 rows scaled once per row by pre-passes (moe_x_rows,
  // moe_act_rows), the fragment tiles' ring copying them straight into the A tile and the MMAs accumulating without a
  // per-part fold (kernels/moe.cu MXROW). Not moe_w_f16's bits alone (another x scale). Measured +9.3% prefill at 4K
  // on the H100 (benchmarks/NOTES.md).
  bool moe_x_rows = true;
  // MoE prefill grouping of more than 1024 (token, expert) pairs split over a block per 1024-pair chunk (count, one
  // scan block, scatter: kernels/moe.cu moe_group_count / _scan / _scatter) instead of one block walking the chunks
  // in turn. The same tile map and row order. Measured +2.6% prefill at 4K on the H100 (-1.7% at 512, within one
  // quickbench's spread): benchmarks/NOTES.md.
  bool moe_group_blocks = true;
  // Prefill GEMMs with f16 weight tiles (gemm_w_f16): x as f16 rows scaled once per row by a pre-pass (matmul_x_rows,
  // one per op and x), copied into the tiles by cp.async, the MMAs accumulating straight into the outputs (no group
  // accumulator, no fold; kernels/matmul.cu XROW). Not gemm_w_f16's bits alone (another x scale). Measured +15%
  // prefill at 4K, +6% at 512 on the H100: benchmarks/NOTES.md.
  bool gemm_x_rows = true;
  // With gemm_x_rows, GEMMs whose 128-row grid still fills every SM twice run 128-row tiles (warp tiles 32 x 64: each
  // converted W tile and fragment serves twice the rows). The same bits as the smaller tiles.
  bool gemm_tile128 = true;
  // With gemm_x_rows, the prefill GEMM's W tile alternates between two shared arrays (kernels/matmul.cu GWDB): the
  // next K block's weights are converted right after this block's MMAs, one barrier per K block instead of two. The
  // same bits. Measured +1.2% prefill at 4K on the H100: benchmarks/NOTES.md.
  bool gemm_w_double = true;
  // Programmatic dependent launch (sm_90+): which launches get it. Decode (the default): the decode steps' (their
  // grids fit in one wave, so the next kernel's blocks take SM room its predecessor no longer needs; the decode
  // GEMVs, the MoE down pass, the conv and the recurrence load weights and carried state before they wait):
  // decode at 4K +16% on the H200. All: prefill too (measured -39% at 4K: the early-scheduled blocks of the next
  // GEMM sit on the resources of the current one's later waves). Off: none. benchmarks/NOTES.md.
  enum class Pdl { Off, Decode, All };
  Pdl pdl = Pdl::Decode;
  std::string cache_dir;             // kernel cache ("" = LILY_CACHE_DIR, else ~/.cache/lily/cuda)
  int dry_arch = 0;                  // > 0: no device; compile for sm_<dry_arch> and record only (CI)
};

struct DeviceInfo {
  std::string name;
  int ordinal = 0, cc_major = 0, cc_minor = 0, sms = 0, max_threads = 1024;
  int max_smem_optin = 48 * 1024;
  int64_t l2_bytes = 0;
  size_t total_mem = 0;
  double peak_bandwidth = 0;  // bytes/s from the memory clock and bus width (a datasheet figure)
  int arch() const { return cc_major * 10 + cc_minor; }
};

// Which CUDA pieces this machine has (engine.backends(): built, usable, and why not).
struct Availability {
  bool usable = false;
  std::string status;
};
Availability availability();         // status reads after "backend 'cuda' is ..."
Availability availability_detail();  // the same without the "built, but not usable here: " prefix

class CudaOps final : public Ops {
 public:
  explicit CudaOps(const CudaOptions& opt);
  ~CudaOps() override;
  const char* name() const override { return "cuda"; }
  std::string device() const override;

  void release(Tensor& t) override;
  size_t allocated_bytes() const override { return allocated_; }
  int32_t register_mapping(const void* base, size_t bytes, const std::string& label) override;
  void place_weights(const std::vector<Weight*>& weights) override;
  size_t workspace_bytes(const ModelConfig& cfg, int64_t rows, int64_t max_ctx) const override;
  void reserve(const ModelConfig& cfg, int64_t rows) override;
  void reserve_matmul(int64_t rows, int64_t cols) override;
  void wait(uint64_t fence) override;

  std::string matmul_variant(const Weight& w, Phase phase) const override;
  std::vector<std::string> optimizations() const override;

  // ---- for the kernel families (csrc/cuda/<family>.cpp) ----
  // Kernel `name` (an extern "C" __global__ function) of kernels/<family>.cu compiled with `defines`.
  // Compiled once per (family, defines) for this device (or taken from the disk cache).
  const Kernel& kernel(const std::string& family, const char* name, const Defines& defines = {});
  // Allows k `bytes` of dynamic shared memory next to its `static_bytes` of static arrays when the two pass 48 KB
  // (up to the device's opt-in limit).
  void set_dynamic_smem(const Kernel& k, int bytes, int static_bytes = 0);
  // Lets k's compile-time clusters hold more than the portable 8 blocks (up to 16 on sm_90).
  void allow_large_clusters(const Kernel& k);
  // Records one launch in the current step. Arguments are packed with their natural alignment, the layout
  // the kernel's parameter list has: pass scalars (int, int64_t, float, unsigned, CUdeviceptr) or small
  // trivially copyable structs, exactly the kernel's parameter types, in order.
  template <class... A>
  void launch(const Kernel& k, Dim3 grid, Dim3 block, uint32_t smem, const A&... args) {
    Launch l;
    l.fn = k.fn;
    l.grid = grid;
    l.block = block;
    l.smem = smem;
    l.kernel = &k;
    const std::pair<unsigned, uint32_t> cfg{block.x * block.y * block.z, smem};
    if (std::find(k.configs.begin(), k.configs.end(), cfg) == k.configs.end()) k.configs.push_back(cfg);
    l.args_at = args_base_ = args_.size();
    (pack(args), ...);
    l.args_len = args_.size() - l.args_at;
    record_launch(l);
  }
  // Device address of a view's first element, and of a byte offset in a registered mapping.
  CUdeviceptr ptr(const Tensor& t) const;
  CUdeviceptr ptr(int32_t mapping, uint64_t offset) const;
  // A weight's codes / scales / biases (expert 0 of a stacked weight; add e * w.data_stride and so on).
  CUdeviceptr data(const Weight& w) const { return ptr(w.mapping, w.data); }
  CUdeviceptr scales(const Weight& w) const { return ptr(w.scale_mapping, w.scales); }
  CUdeviceptr biases(const Weight& w) const { return ptr(w.bias_mapping, w.biases); }
  const DeviceInfo& info() const { return info_; }
  const CudaOptions& options() const { return opt_; }
  // Whether this step's launches are programmatic dependent ones (kernels may then read weights, and what the
  // kernel two back wrote, before their griddepcontrol.wait: common.cuh).
  bool pdl_now() const {
    return pdl_active_ && (opt_.pdl == CudaOptions::Pdl::All || phase() == Phase::Decode);
  }
  // The variant each op family chose and why (engine.report()["cuda"]["variants"]); later notes for the
  // same key replace earlier ones.
  void note_variant(const std::string& key, const std::string& variant);

  // ---- report ----
  struct CompileStats {
    int modules = 0, compiled = 0, cache_hits = 0;
    double compile_seconds = 0;
  };
  const CompileStats& compile_stats() const { return compile_stats_; }
  struct GraphStats {
    int64_t captured = 0, replayed = 0, direct_steps = 0;
    // Host time of the captures (capture, instantiate): what a step that is not yet a graph costs on top.
    double capture_us_sum = 0;
    int64_t last_decode_launches = 0, last_decode_nodes = 0;
    int64_t last_speculative_launches = 0;  // launches of the last speculative (MTP) iteration step
    // Host time of the last decode step from its first recorded launch to the graph launch returning (the
    // encode, the key compare, the replay call): the step is host bound if this exceeds its GPU time.
    double last_decode_host_us = 0;
    // Means over replayed decode steps: host time as above, and GPU time from events around each replay.
    double replay_host_us_sum = 0, replay_gpu_us_sum = 0;
    int64_t replay_host_n = 0, replay_gpu_n = 0;
    int64_t memo_hits = 0, memo_misses = 0;  // decode ops replayed from the encode memo / encoded
    int64_t prefill_memo_hits = 0, prefill_memo_misses = 0;  // the same for prefill ops (prefill_memo)
    // Host time of the last prefill step from its first recorded launch to its submit (the GPU waits for it).
    double last_prefill_encode_us = 0;
    // A dry run's digest of the last submitted step's launches (kernel, geometry, stage, op, arguments) and one of
    // every step's so far, in order: tests compare encodings by them. 0 outside dry runs.
    uint64_t last_step_digest = 0, steps_digest = 0;
    int64_t speculative_replays = 0;         // speculative (MTP) iteration steps replayed as graphs
  };
  // Whether this step's launches may come from the encode memo and a graph (Ops::repeats).
  bool replayable() const { return repeats() && (decode_step() || opt_.speculative_graphs); }
  // A plain decode step (not a speculative iteration run in the decode phase): what the decode figures count.
  bool decode_step() const { return phase() == Phase::Decode && !speculative(); }
  int64_t decode_rows() const override;
  const GraphStats& graph_stats() const { return graph_stats_; }
  const std::map<std::string, std::string>& variants() const { return variants_; }
  // Every kernel loaded so far with its registers, spills and static shared memory, and for each launch shape the
  // blocks per multiprocessor its resources allow (the residency a PDL pair or a wave count depends on).
  std::vector<KernelResources> kernel_resources();
  // Bytes by kind: weights (registered mappings), and allocations by label prefix.
  std::map<std::string, size_t> memory_by_kind() const;
  // Compiles every kernel family with the constants `cfg` gives (used by the CI compile check and at load).
  static std::vector<std::string> families();

 protected:
  Tensor alloc_impl(const std::string& label, DType dtype, int64_t rows, int64_t cols) override;
  void upload_impl(const Tensor& dst, const void* src) override;
  void download_impl(const Tensor& src, void* dst) override;
  uint64_t submit_impl() override;
  void abandon_impl() override;
  void on_stage_boundary() override;
  void execute(OpKind kind, const OpRun& run) override;

  void embed_impl(const Tensor& ids, const Weight& table, const Tensor& out) override;
  void rms_norm_impl(const Tensor& x, const Tensor& w, const Tensor& out, float eps) override;
  void matmul_impl(const Tensor& x, const Weight& w, const Tensor& out) override;
  void add_impl(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void add_rms_norm_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                         const Tensor& normed) override;
  void attn_qk_prep_impl(const Tensor& qg, const Tensor& k, const Tensor& q_norm, const Tensor& k_norm,
                         const Tensor& pos, const AttentionShape& s, const Tensor& q_out,
                         const Tensor& gate_out, const Tensor& k_out) override;
  void kv_append_impl(const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& k_cache,
                      const Tensor& v_cache, int64_t max_ctx, const AttentionShape& s) override;
  void attn_qk_prep_append_impl(const Tensor& qg, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                                const Tensor& k_norm, const Tensor& pos, const AttentionShape& s, const Tensor& q_out,
                                const Tensor& gate_out, const Tensor& k_out, const Tensor& k_cache,
                                const Tensor& v_cache, int64_t max_ctx) override;
  void attention_impl(const Tensor& q, const Tensor& gate, const Tensor& k_cache, const Tensor& v_cache,
                      const Tensor& pos, int64_t max_ctx, const AttentionShape& s, const Tensor& ws,
                      const Tensor& out) override;
  void conv1d_silu_impl(const Tensor& mixed, const Tensor& conv_w, const Tensor& state_in,
                        const Tensor& state_out, const Tensor& out,
                        const StateCapture& capture) override;
  void gated_delta_impl(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                        const Tensor& dt_bias, const Tensor& state_in, const Tensor& state_out,
                        const DeltaShape& s, const Tensor& ws, const Tensor& out,
                        const StateCapture& capture) override;
  void gated_rms_norm_impl(const Tensor& o, const Tensor& z, const Tensor& w, float eps,
                           const Tensor& out) override;
  void conv_delta_norm_impl(const Tensor& qkv, const Tensor& z, const Tensor& b, const Tensor& a,
                            const Tensor& conv_w, const Tensor& A_log, const Tensor& dt_bias, const Tensor& norm_w,
                            float eps, const DeltaShape& s, const Tensor& conv_in, const Tensor& conv_out,
                            const Tensor& rec_in, const Tensor& rec_out, const Tensor& mixed, const Tensor& delta_o,
                            const Tensor& ws, const Tensor& out, const StateCapture& conv_cap,
                            const StateCapture& rec_cap) override;
  void moe_route_impl(const Tensor& logits, int64_t k, const Tensor& ws, const Tensor& ids,
                      const Tensor& weights) override;
  void moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights, const Weight& gate,
                        const Weight& up, const Weight& down, const Tensor& ws, const Tensor& out) override;
  void swiglu_impl(const Tensor& gate, const Tensor& up, const Tensor& out) override;
  void matmuls_impl(const Tensor& x, const MatmulGroup& g) override;
  void norm_matmuls_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                         const Tensor& normed, const MatmulGroup& g) override;
  void moe_impl(const Tensor& x, const Tensor& router_logits, const Tensor& shared_gate_logit, int64_t k,
                const MoeWeights& w, const MoeScratch& sc, const Tensor& ws, const Tensor& h) override;
  void moe_combine_impl(const Tensor& routed, const Tensor& shared, const Tensor& shared_gate_logit,
                        const Tensor& h) override;
  void copy_impl(const Tensor& src, const Tensor& dst) override;
  void fill_impl(const Tensor& dst, double value) override;
  void advance_position_impl(const Tensor& pos_in, const Tensor& pos_out, int64_t T) override;
  void accept_drafts_impl(const Tensor& ids, const Tensor& y, const Tensor& pos_in, const Tensor& accepted,
                          const Tensor& next_id, const Tensor& pos_out) override;
  void copy_rows_at_impl(const Tensor& src, const Tensor& index, int64_t offset, const Tensor& dst) override;
  void sample_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p, const Tensor& ws,
                   const Tensor& next_id) override;
  void mtp_input_impl(const Tensor& ids, const Weight& table, const Tensor& h, const Tensor& w_e, const Tensor& w_h,
                      float eps, const Tensor& e, const Tensor& normed, const Tensor& out) override;
  void sample_rows_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p, const Tensor& ws,
                        const Tensor& next_id) override;

 private:
  struct Launch {
    CUfunction fn = nullptr;
    const Kernel* kernel = nullptr;
    Dim3 grid, block;
    uint32_t smem = 0;
    size_t args_at = 0, args_len = 0;  // in args_
    int64_t stage = 0;
    int64_t op = 0;  // which op recorded it (ops of one stage are independent; one op's launches are not)
  };
  template <class T>
  void pack(const T& v) {
    static_assert(std::is_trivially_copyable<T>::value, "kernel arguments must be trivially copyable");
    const size_t a = alignof(T);
    size_t at = (args_.size() - args_base_ + a - 1) / a * a + args_base_;
    args_.resize(at + sizeof(T));
    std::memcpy(args_.data() + at, &v, sizeof(T));
  }
  void record_launch(Launch& l);
  // The CUDA-core GEMV over n parts of one format; `norm` (rms_norm_matmuls / add_rms_norm_matmuls) puts the
  // RMSNorm in front, done by every block (kernels/matmul.cu, NORM).
  void launch_gemv(const Tensor& x, const Weight* w, const Tensor* out, int n, const Defines& defines,
                   const struct GemvNorm* norm = nullptr);
  // add_rms_norm_matmuls' arrival counters (kernels/matmul.cu, NORM 2): kNormCounterSlots slots of 16 rows,
  // zero between launches. A slot per sum buffer, so two such launches that may run side by side (different
  // sums: the hazard tracker orders ones writing the same) never share one; -1 when every slot is taken.
  static constexpr int kNormCounterSlots = 64;
  static constexpr size_t kNormCounterBytes = size_t(kNormCounterSlots) * 16 * 4;
  // conv_delta_norm_wide's arrival counters (Hk + Hv ints, zero between launches) after them in the same
  // allocation: one set for every layer, whose launches never overlap (each reads the h the one before wrote).
  static constexpr int kDeltaCounters = 1024;
  static constexpr size_t kCounterBytes = kNormCounterBytes + size_t(kDeltaCounters) * 4;
  CUdeviceptr norm_counters_ = 0;
  std::unordered_map<int32_t, int> norm_counter_slot_;
  int norm_counter_slot(int32_t sum_buf);
  // Graph branches: up to kBranchLanes launches of one hazard stage side by side (issue_staged), on the compute
  // stream and kBranchLanes - 1 side streams.
  static constexpr int kBranchLanes = 4;
  // The XROW prefill GEMMs' x as f16 rows (gemm_x_rows; kernels/matmul.cu matmul_x_rows): kXRowSlots slots of
  // [xrows_rows_][xrows_kp_] halves then [xrows_rows_] floats (each row's 2^-e), one per lane a hazard stage's ops may
  // run on side by side. An op's slot is its place in its stage mod kXRowSlots (xrow_slot): issue_staged puts op o of
  // a stage on lane (o - first) % lanes, lanes = min(the stage's ops, kBranchLanes): with lanes < kBranchLanes every
  // op of the stage has its own slot, else lanes == kXRowSlots; so two ops on different lanes differ in it, ops of
  // different stages are ordered, and an op keeps its slot whatever came before its stage (the encode memo's key
  // carries it). Sized outside steps by reserve() / reserve_matmul(); a GEMM that does not fit is refused by name.
  // xrows_op_ / xrows_src_: the op and x whose rows the slot holds, so the products of one matmuls group share one
  // pre-pass.
  static constexpr int kXRowSlots = kBranchLanes;  // not fewer: ops on different lanes would share a slot
  int xrow_slot() const { return int((op_ - stage_op0_) % kXRowSlots); }
  Tensor xrows_;
  int64_t xrows_rows_ = 0, xrows_kp_ = 0;
  int64_t xrows_op_ = -1;
  std::string xrows_src_;
  size_t xrow_slot_bytes() const, xrow_scales_at() const;
  struct MoeArgs experts_args(const Tensor& x, const Tensor& ids, const Tensor& weights, const Weight& gate,
                              const Weight& up, const Weight& down, const Tensor& ws, const Tensor& out,
                              const std::string& what, bool& aligned);
  void issue(const Launch& l, CUstream s);
  void issue_staged();
  void ensure_usable() const;  // throws after a device fault
  void bind_context() const;   // makes the context current on the calling thread (engine threads vary)
  void fault(const CudaError& e);
  template <class F>
  void guarded(F&& f);  // runs f; a sticky CudaError marks the context lost before it propagates

  struct Buffer {
    CUdeviceptr ptr = 0;
    size_t bytes = 0;
    std::string label;
  };
  struct Mapping {
    const char* host = nullptr;  // a registered host region (not yet on the device)
    CUdeviceptr ptr = 0;         // a device copy made by place_weights
    size_t bytes = 0;
    std::string label;
  };
  struct Graph;  // a captured decode step (backend.cpp)

  CudaOptions opt_;
  DeviceInfo info_;
  CUcontext ctx_ = nullptr;
  CUstream stream_ = nullptr, copy_stream_ = nullptr;
  std::vector<CUstream> side_streams_;
  std::vector<CUevent> join_events_;
  CUevent fork_event_ = nullptr;
  bool pdl_active_ = false;  // opt_.pdl is not Off, the device is sm_90+ and the driver has cuLaunchKernelEx
  void* staging_ = nullptr;  // pinned host memory for small transfers
  size_t staging_bytes_ = 0;
  std::vector<Buffer> buffers_;
  std::vector<int32_t> free_ids_;
  size_t allocated_ = 0;
  std::vector<Mapping> mappings_;
  size_t mapped_bytes_ = 0;

  // The step being encoded.
  std::vector<Launch> launches_;
  std::vector<unsigned char> args_;
  size_t args_base_ = 0;  // start of the launch being packed (arguments align relative to it)
  int64_t stage_ = 0;
  int64_t op_ = 0;  // the op being encoded, numbered from 1 in each step
  int64_t stage_op0_ = 1;  // the first op of the current hazard stage
  int64_t steps_launches_ = 0;  // launches of the last submitted step
  std::chrono::steady_clock::time_point encode_t0_;  // the current step's first launch

  // Fences: event per submitted step, recycled once waited for.
  std::vector<std::pair<uint64_t, CUevent>> pending_;
  std::vector<CUevent> spare_events_;
  uint64_t done_fence_ = 0;

  std::vector<std::unique_ptr<Graph>> graphs_;  // most recently used first
  // The encode memos (CudaOptions::encode_memo, prefill_memo): op kind + argument bytes -> the launches it recorded,
  // their arguments packed back to back. Found by the key's hash, computed once per op (prefill_seen_ takes the same
  // one); the entry keeps the key, and only an equal key is a hit.
  struct MemoEntry {
    std::string key;
    std::vector<Launch> launches;  // args_at relative to `args`
    std::vector<unsigned char> args;
  };
  std::unordered_map<size_t, MemoEntry> memo_;
  std::string memo_key_;  // scratch for the lookup (no allocation once grown)
  bool memo_skip_ = false;  // set by an op whose launches depend on more than its arguments: not memoised
  static constexpr size_t kPrefillMemoEntries = 16384;  // ~1 KB each: ~40 chunk lengths of the real model
  std::unordered_map<size_t, MemoEntry> prefill_memo_;
  std::unordered_set<size_t> prefill_seen_;  // hashes of prefill op keys seen once (recorded at the second sighting)
  void forget_encodings() {
    memo_.clear();
    prefill_memo_.clear();
    prefill_seen_.clear();
  }
  void end_step_encoding();  // clears the step's launches, arguments, stage and op numbers
  static uint64_t digest_launches(const std::vector<Launch>& launches, const std::vector<unsigned char>& args);
  // Timing events around graph replays, oldest first; read once the step's fence has been waited for.
  std::vector<std::pair<CUevent, CUevent>> replay_timing_, spare_timing_;
  void collect_replay_timing();
  GraphStats graph_stats_;

  struct Module;
  std::map<std::string, std::unique_ptr<Module>> modules_;  // by family + defines
  std::string kernel_key_;  // kernel()'s scratch for that key
  CompileStats compile_stats_;
  std::map<std::string, std::string> variants_;
  std::string fault_;  // set after a sticky error: the context is lost
};

// Workspace each kernel family needs for `rows` tokens (sizes for CudaOps::workspace_bytes; 0 if none).
size_t moe_workspace_bytes(const ModelConfig& c, int64_t rows);
size_t attention_workspace_bytes(const ModelConfig& c, int64_t rows, int64_t max_ctx);
size_t delta_workspace_bytes(const ModelConfig& c, int64_t rows, int64_t chunk_rows);
size_t sample_workspace_bytes(int64_t vocab);

// The module sources (generated from csrc/cuda/kernels by CMake): the text of kernels/<name>.
const char* kernel_source(const std::string& file);  // nullptr if absent
std::vector<std::string> kernel_files();               // every .cu and .cuh

// Compiles kernels/<family>.cu with `defines` for sm_<arch> through NVRTC and returns the cubin, or
// throws CudaError with the compiler's log. Used by CudaOps (through its cache) and by the CI check.
std::string compile_module(const std::string& family, const Defines& defines, int arch, double* seconds);

}  // namespace lily::cuda
