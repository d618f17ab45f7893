// The Metal backend: MetalOps implements every op of csrc/backend/ops.h with the kernels of metal/*.metal
// (the CPU backend, csrc/cpu, is its oracle). Host model (docs/ARCHITECTURE.md, "Writing a backend"):
//   * buffers: one shared-storage MTL::Buffer per tensor (CPU and GPU see the same memory), zeroed;
//   * weights: each registered checkpoint mapping is wrapped with newBufferWithBytesNoCopy where its base is
//     16 KB aligned (Apple silicon's page), else copied once at load, and split into overlapping windows when it
//     is larger than maxBufferLength; optimizations() says which and how many bytes;
//   * pipelines: specialised by function constants (weight format, group size, cache dtype) and cached by the
//     Device; one concurrent compute encoder per step (per command buffer), a memory barrier exactly where the
//     HazardTracker starts a stage (on_stage_boundary) and inside the few ops that run two dependent kernels;
//   * submission: submit() commits the step's command buffer without waiting and returns its fence; a completed
//     handler marks the fence done, wait(fence) blocks on it. At most two command buffers are in flight (the decode
//     loop's two alternating steps); opening a third waits for the oldest.
// File map (one op family per file, as csrc/cpu): backend.cpp (buffers, mappings, steps, embed, add, copy, fill,
// advance_position), matmul.cpp (matmul, matmuls, moe_experts), norm.cpp, attention.cpp, gated_delta.cpp, moe.cpp
// (moe, moe_route, swiglu, moe_combine), sample.cpp.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "backend/ops.h"
#include "metal/device.h"

namespace lily::metal {

// One bound part of a weight: the buffer holding it, bound at a 16-byte aligned offset, and the element offset
// of the part's first element from there (the kernels' WeightRef).
struct BoundPart {
  MTL::Buffer* buffer = nullptr;
  size_t bind_offset = 0;
  uint32_t element = 0;
  size_t exact_offset() const;  // byte offset of the part itself
  size_t elem_size = 1;
};

// Byte offsets of the grouped prefill experts' scratch inside the workspace (csrc/metal/matmul.cpp).
struct MoeWorkspace {
  int64_t max_tiles = 0;
  size_t offsets = 0, pair_of = 0, position_of = 0, tiles = 0, tile_count = 0, act = 0, y = 0, bytes = 0;
};
MoeWorkspace moe_workspace(int64_t T, int64_t k, int64_t E, int64_t I, int64_t H);
size_t sample_workspace_bytes(int64_t vocab);  // the seeded sampler's sort keys (csrc/metal/sample.cpp)
// The chunked DeltaNet form's records, one per (64-row chunk, value head) of a call of `rows` rows
// (csrc/metal/gated_delta.cpp; metal/gated_delta.metal gated_delta_chunk_prep).
size_t delta_chunk_workspace_bytes(int64_t rows, int64_t v_heads, int64_t k_dim, int64_t v_dim);

class MetalOps final : public Ops {
 public:
  // msl: the kernel library's source (metal/*.metal concatenated; default: the one embedded at build time).
  explicit MetalOps(const std::string& msl);
  ~MetalOps() override;
  const char* name() const override { return "metal"; }
  std::string device() const override;

  void release(Tensor& t) override;
  size_t allocated_bytes() const override { return allocated_; }
  int32_t register_mapping(const void* base, size_t bytes, const std::string& label) override;
  size_t workspace_bytes(const ModelConfig& cfg, int64_t rows, int64_t max_ctx) const override;
  void wait(uint64_t fence) override;

  std::string matmul_variant(const Weight& w, Phase phase) const override;
  std::vector<std::string> optimizations() const override;

  // What the host did (the report and the tests).
  struct Counters {
    int64_t command_buffers = 0, dispatches = 0, barriers = 0;  // since construction
    int64_t last_dispatches = 0, last_barriers = 0;             // of the last submitted step
    // The last submitted step of each phase (engine.report()): dispatches, and the stages memory barriers
    // separate (barriers + 1; 0 for an empty step); steps: how many of each phase were submitted.
    int64_t decode_dispatches = 0, decode_stages = 0, decode_steps = 0;
    int64_t prefill_dispatches = 0, prefill_stages = 0, prefill_steps = 0;
    int64_t mappings_wrapped = 0, mappings_copied = 0, parts_copied = 0;
    size_t wrapped_bytes = 0, copied_bytes = 0, part_copied_bytes = 0;
    int64_t max_in_flight = 0;
    int64_t mapping_windows = 0;  // Metal buffers the mappings became
    // conv_delta_norm: calls that ran as one dispatch, calls composed from the three kernels, and why the last
    // composed one was.
    int64_t delta_fused_calls = 0, delta_composed_calls = 0;
    std::string delta_composed_reason;
    // matmuls (a MatmulGroup): calls that ran some products together, and how (qmv4_multi, matmul_rows_multi
    // dispatches; the products they took); calls where some products ran alone (and which, the last time);
    // calls composed from one dispatch per product (and why).
    int64_t matmul_group_calls = 0, qmv4_multi_dispatches = 0, matmul_rows_multi_dispatches = 0;
    int64_t qmv4_dispatches = 0;  // single products on qmv4 (matmul, or a product alone in its kind)
    int64_t matmul_grouped_products = 0, matmul_group_split_calls = 0, matmul_group_composed_calls = 0;
    std::string matmul_group_split_reason, matmul_group_composed_reason;
    // moe: calls whose routed down pass also added the gated shared expert and the residual (moe_down_combine),
    // calls that ran moe_combine as its own dispatch, and why the last of those did.
    int64_t moe_down_combined_calls = 0, moe_combine_calls = 0;
    std::string moe_combine_reason;
    // attention: calls encoded as the split path (attention_split + attention_split_reduce), decode calls that
    // were not, and why the last one was not.
    int64_t attention_split_calls = 0, attention_unsplit_calls = 0;
    std::string attention_unsplit_reason;
    // gated_delta: calls scanned with one state column per simdgroup (gated_delta_scan_sg) and per thread.
    int64_t delta_scan_sg_calls = 0, delta_scan_thread_calls = 0;
    // gated_delta: calls run in the chunked (WY) form (gated_delta_chunk_prep + _scan), and why the last scanned
    // prefill call of >= 2 rows was not chunked.
    int64_t delta_chunked_calls = 0;
    std::string delta_not_chunked_reason;
    // Grouped prefill experts: chunks on the simdgroup-matrix GEMM with 16- and 32-row tiles, chunks on the 8-row
    // lane-dot tiles, T·k / E of the last chunk, and the last reason a chunk did not get the R it was meant to
    // (the other R, or the lane-dot tiles).
    int64_t moe_mma16_calls = 0, moe_mma32_calls = 0, moe_lane_tile_calls = 0;
    double moe_tiles_last_rows_per_expert = 0;
    std::string moe_tiles_reason, moe_tiles_last_reason;  // the last fallback's reason; the last chunk's ("" if none)
  };
  const Counters& counters() const { return counters_; }
  Device& metal_device() { return dev_; }
  const Device& metal_device() const { return dev_; }
  // Which attention kernel: "auto" (attention_gqa for decode, attention_rows for prefill), or one for every call
  // (the tests compare each variant with the CPU on every shape).
  // ... or "split": the long-context form (attention_split + attention_split_reduce) for every call of up to
  // kMaxSplitRows rows; "auto" takes it for decode calls whose max_ctx reaches the split threshold.
  void set_attention_variant(const std::string& v);
  // Decode MoE: the routed down pass adds the gated shared expert and the residual (moe_down_combine), or
  // moe_combine runs after it (LILY_METAL_FUSE_MOE_COMBINE=0; the tests compare the two).
  void set_fuse_moe_combine(bool on) { fuse_moe_combine_ = on; }
  bool fuse_moe_combine() const { return fuse_moe_combine_; }
  // Grouped prefill experts: the simdgroup-matrix GEMM (on; LILY_METAL_MOE_MMA=0 takes the 8-row lane-dot tiles)
  // and its tile rows (0: chosen per chunk from T·k / E; 16 or 32 forced, LILY_METAL_MOE_TILE_ROWS). The tests run
  // every choice against the CPU.
  void set_moe_mma(bool on) { moe_mma_ = on; }
  bool moe_mma() const { return moe_mma_; }
  void set_moe_tile_rows(int64_t rows);
  int64_t moe_tile_rows() const { return moe_tile_rows_; }
  // The split path: contexts of at least min_ctx rows (pos + 1, decided on the GPU) are cut into blocks of `block`
  // rows. Defaults 32768 and 1024; LILY_METAL_SPLIT_ATTENTION_MIN and LILY_METAL_SPLIT_ATTENTION_BLOCK set them at
  // construction (a minimum above every context turns the path off). Set before workspace_bytes.
  void set_split_attention(int64_t min_ctx, int64_t block);
  // The DeltaNet scan's form: "auto" (one state column per thread for a single row, whose sums conv_delta_norm
  // repeats bit for bit; one column per simdgroup for two rows and more), or one form for every call (the tests
  // compare each with the CPU on every shape).
  void set_delta_scan(const std::string& form);
  static constexpr int64_t kMaxSplitRows = 8;  // the partials of at most 8 query rows (decode, a speculative verify)
  // The split path's partials, f32 [min(rows, 8), heads, ⌈max_ctx / block⌉, head_dim + 2] (csrc/metal/attention.cpp).
  size_t split_attention_bytes(const ModelConfig& cfg, int64_t rows, int64_t max_ctx) const;

 protected:
  Tensor alloc_impl(const std::string& label, DType dtype, int64_t rows, int64_t cols) override;
  void upload_impl(const Tensor& dst, const void* src) override;
  void download_impl(const Tensor& src, void* dst) override;
  void execute(OpKind kind, const OpRun& run) override;
  void on_stage_boundary() override;
  uint64_t submit_impl() override;
  void abandon_impl() override;

  void embed_impl(const Tensor& ids, const Weight& table, const Tensor& out) override;
  void rms_norm_impl(const Tensor& x, const Tensor& w, const Tensor& out, float eps) override;
  void matmul_impl(const Tensor& x, const Weight& w, const Tensor& out) override;
  void matmuls_impl(const Tensor& x, const MatmulGroup& g) override;
  void add_impl(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void add_rms_norm_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                         const Tensor& normed) override;
  void attn_qk_prep_impl(const Tensor& qg, const Tensor& k, const Tensor& q_norm, const Tensor& k_norm,
                         const Tensor& pos, const AttentionShape& s, const Tensor& q_out,
                         const Tensor& gate_out, const Tensor& k_out) override;
  void kv_append_impl(const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& k_cache,
                      const Tensor& v_cache, int64_t max_ctx, const AttentionShape& s) override;
  void attention_impl(const Tensor& q, const Tensor& gate, const Tensor& k_cache, const Tensor& v_cache,
                      const Tensor& pos, int64_t max_ctx, const AttentionShape& s, const Tensor& ws,
                      const Tensor& out) override;
  void conv1d_silu_impl(const Tensor& mixed, const Tensor& conv_w, const Tensor& state_in, const Tensor& state_out,
                        const Tensor& out,
                        const StateCapture& capture) override;
  void gated_delta_impl(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                        const Tensor& dt_bias, const Tensor& state_in, const Tensor& state_out, const DeltaShape& s,
                        const Tensor& ws, const Tensor& out,
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
  void moe_impl(const Tensor& x, const Tensor& router_logits, const Tensor& shared_gate_logit, int64_t k,
                const MoeWeights& w, const MoeScratch& sc, const Tensor& ws, const Tensor& h) override;
  void swiglu_impl(const Tensor& gate, const Tensor& up, const Tensor& out) override;
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

 private:
  // ---- encoding (matmul.cpp and the family files use these) ----
  Arg arg(const Tensor& t) const;  // the tensor's buffer at its byte offset
  MTL::Buffer* buffer_of(const Tensor& t) const;
  // A weight part (mapping id, byte offset, bytes, element size) ready to bind; misaligned parts are copied once.
  BoundPart part(int32_t mapping, uint64_t offset, size_t bytes, size_t elem_size);
  struct WeightBinding;
  WeightBinding bind_weight(const Weight& w);
  // Opens the step's command buffer and encoder when the first dispatch needs them.
  Pass& pass();
  void dispatch(const std::string& kernel, const std::vector<FunctionConstant>& constants, const std::vector<Arg>& args,
                MTL::Size groups, MTL::Size threads, const std::vector<size_t>& threadgroup_bytes = {});
  void barrier_in_op() override;  // between two dependent kernels of one op
  bool grouped_experts(int64_t T, int64_t E) const;  // prefill rows: experts grouped on the GPU
  struct MoeTiles {
    bool mma = false;   // the simdgroup-matrix GEMM, else the lane-dot tiles of 8 rows
    int64_t rows = 8;   // R
    std::string reason;  // why not the GEMM, or not the R the rule or the setting asked for; empty when it got it
  };
  MoeTiles choose_moe_tiles(int64_t T, int64_t k, int64_t E, const std::vector<FunctionConstant>& gate_constants,
                            const std::vector<FunctionConstant>& down_constants);
  void moe_experts_grouped(const Tensor& x, const Tensor& ids, const Tensor& weights, const WeightBinding& g,
                           const WeightBinding& u, const WeightBinding& d, int64_t E, const Tensor& ws,
                           const Tensor& out);
  void check_contiguous(const Tensor& t, const char* op, const char* what) const;
  // The per-pair (decode) experts in two stages: moe_gate_up into the workspace, then moe_down into out, or with
  // shared and sg moe_down_combine (out is then h: h += the routed sum + sigmoid(sg) · shared).
  void check_experts(const Tensor& ids, const Tensor& weights, const Weight& gate, const Weight& up) const;
  void moe_pairs_gate_up(const Tensor& x, const Tensor& ids, const Weight& gate, const Weight& up, const Tensor& ws);
  void moe_pairs_down(const Tensor& ids, const Tensor& weights, const Weight& down, const Tensor& ws,
                      const Tensor& out, const Tensor* shared, const Tensor* sg);

  Device dev_;
  struct Buf {
    Ref<MTL::Buffer> mtl;
    size_t bytes = 0;
    std::string label;
  };
  std::vector<Buf> bufs_;
  std::vector<int32_t> free_ids_;
  size_t allocated_ = 0;
  struct Mapping {
    std::vector<Ref<MTL::Buffer>> windows;  // one, or overlapping windows every `step` bytes (maxBufferLength)
    size_t step = 0;
    const char* base = nullptr;
    size_t bytes = 0;
    std::string label;
    bool copied = false;
  };
  std::vector<Mapping> mappings_;
  std::map<std::tuple<int32_t, uint64_t, size_t>, Ref<MTL::Buffer>> part_copies_;

  std::unique_ptr<Pass> open_;  // the step being encoded
  int64_t step_dispatches_ = 0, step_barriers_ = 0;  // of the step being encoded
  struct InFlight {
    uint64_t fence;
    std::unique_ptr<Pass> pass;
  };
  std::deque<InFlight> flight_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<struct FenceState> fences_;
  Counters counters_;
  bool drop_barriers_ = false;  // LILY_METAL_DROP_BARRIERS=1: the planted bug of the harness tests
  bool group_matmuls_ = true;  // LILY_METAL_GROUP_MATMULS=0: every product of a MatmulGroup its own dispatch
  bool fuse_moe_combine_ = true;  // LILY_METAL_FUSE_MOE_COMBINE=0: decode MoE ends with its own moe_combine
  bool moe_mma_ = true;           // LILY_METAL_MOE_MMA=0: grouped prefill experts on the 8-row lane-dot tiles
  int64_t moe_tile_rows_ = 0;     // LILY_METAL_MOE_TILE_ROWS: 0 (by rows per expert), 16 or 32
  std::string attention_variant_ = "auto";
  int64_t split_min_ = 32768, split_block_ = 1024;  // set_split_attention
  std::string delta_scan_ = "auto";                  // set_delta_scan
};

}  // namespace lily::metal
