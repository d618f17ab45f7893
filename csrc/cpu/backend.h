// The CPU backend: the numerical oracle of every other backend (fp32 activations, fp32 accumulation,
// fp32 KV cache and recurrent state) and a usable multi-threaded engine.
//
// Two modes. Immediate (the default): each op runs as it is recorded, so submit() finds the work done.
// Deferred (a debug mode proving the step model without a GPU): ops are only recorded; submit() hands
// the step to an executor thread that runs each hazard stage's ops in a shuffled order, and any host
// access to a buffer that submitted, unwaited work uses fails loudly. A correct session gives the same
// bits in both modes.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/ops.h"
#include "cpu/matmul.h"
#include "cpu/thread_pool.h"

namespace lily::cpu {

struct CpuOptions {
  int threads = 0;            // 0: one per hardware thread
  bool deferred = false;      // record on submit, execute later on an executor thread
  uint64_t shuffle_seed = 0;  // deferred: order of the ops inside each stage (0: recorded order)
  bool strict_alloc = false;  // fail an op that allocates heap memory (alloc_guard.h)
};

// Bump allocation from a workspace tensor; running out is a sizing bug and throws naming the op.
class Arena {
 public:
  Arena(void* base, size_t bytes, const char* op) : p_(static_cast<char*>(base)), left_(bytes), op_(op) {}
  template <class T>
  T* take(size_t n) {
    const size_t want = (n * sizeof(T) + 63) / 64 * 64;
    if (want > left_)
      throw std::logic_error(std::string("workspace too small for ") + op_ + ": needs " + std::to_string(want) +
                             " more bytes, " + std::to_string(left_) + " left");
    T* out = reinterpret_cast<T*>(p_);
    p_ += want;
    left_ -= want;
    return out;
  }
  // What take() will consume for n elements of T (the sizing functions add these up).
  template <class T>
  static size_t need(size_t n) {
    return (n * sizeof(T) + 63) / 64 * 64;
  }

 private:
  char* p_;
  size_t left_;
  const char* op_;
};

class CpuOps final : public Ops {
 public:
  explicit CpuOps(const CpuOptions& opt);
  ~CpuOps() override;
  const char* name() const override { return "cpu"; }
  std::string device() const override;
  int threads() const override { return pool_.size(); }
  // The GEMV path and the decode MoE take any number of rows, each row's sums in the order of a one-row call.
  int64_t decode_rows() const override { return 8; }
  const CpuOptions& options() const { return opt_; }

  void release(Tensor& t) override;
  size_t allocated_bytes() const override { return allocated_; }
  int32_t register_mapping(const void* base, size_t bytes, const std::string& label) override;
  size_t workspace_bytes(const ModelConfig& cfg, int64_t rows, int64_t max_ctx) const override;
  void reserve(const ModelConfig& cfg, int64_t rows) override;
  void wait(uint64_t fence) override;

  std::string matmul_variant(const Weight& w, Phase phase) const override;
  std::vector<std::string> optimizations() const override;

  ThreadPool& pool() { return pool_; }
  MatmulArena& matmul_arena() { return arena_; }
  WeightView view(const Weight& w) const;

 protected:
  Tensor alloc_impl(const std::string& label, DType dtype, int64_t rows, int64_t cols) override;
  void upload_impl(const Tensor& dst, const void* src) override;
  void download_impl(const Tensor& src, void* dst) override;
  void execute(OpKind kind, const OpRun& run) override;
  uint64_t submit_impl() override;
  void abandon_impl() override;

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
  void moe_route_impl(const Tensor& logits, int64_t k, const Tensor& ws, const Tensor& ids,
                      const Tensor& weights) override;
  void moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights, const Weight& gate,
                        const Weight& up, const Weight& down, const Tensor& ws, const Tensor& out) override;
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
  float* f32(const Tensor& t) const;
  int32_t* i32(const Tensor& t) const;
  uint16_t* u16(const Tensor& t) const;
  void* raw(const Tensor& t) const;
  Arena arena(const Tensor& ws, const char* op) const;
  // The phase of the op being executed (the deferred executor runs a step while the host may already
  // encode the next one, so kernels never read phase() directly).
  Phase exec_phase_ = Phase::Prefill;
  MatmulPath path() const { return exec_phase_ == Phase::Decode ? MatmulPath::Gemv : MatmulPath::Gemm; }

  struct Buffer {
    void* data = nullptr;
    size_t bytes = 0;
    std::string label;
    bool mapped = false;  // from mmap (large buffers, backend.cpp buffer_alloc), else from malloc
  };
  // Buffers live in fixed chunks so an entry never moves: the deferred executor reads entries while
  // the host thread allocates new ones.
  static constexpr int32_t kChunk = 1024, kChunks = 4096;
  Buffer& buffer(int32_t id) const;
  std::unique_ptr<std::atomic<Buffer*>[]> chunks_;
  int32_t next_id_ = 0;
  std::vector<int32_t> free_ids_;
  size_t allocated_ = 0;
  std::vector<const char*> mappings_;  // base of each registered mapping (CPU: host memory, no copy)

  CpuOptions opt_;
  ThreadPool pool_;
  MatmulArena arena_;  // per-thread matmul scratch, indexed like the pool's threads

  // ---- deferred mode (guarded by mu_) ----
  struct RecordedOp {
    OpKind kind;
    Phase phase;
    int64_t stage;
    std::function<void()> run;
  };
  struct Submission {
    uint64_t fence;
    std::vector<RecordedOp> ops;
    std::vector<int32_t> reads, writes;  // buffers the step touches (for host-access checks)
  };
  void executor_loop();
  // Runs one op (recorded or immediate) under the allocation guard when strict_alloc is on.
  void run_op(OpKind kind, const std::function<void()>* owned, const OpRun* now);
  void check_host_access(int32_t buf, bool host_writes, const char* what) const;
  std::vector<RecordedOp> recording_;
  std::vector<int32_t> rec_reads_, rec_writes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Submission>> queue_;        // submitted, not yet executed
  std::vector<std::shared_ptr<Submission>> unwaited_;    // submitted, not yet waited for by the host
  uint64_t done_fence_ = 0;
  std::exception_ptr failure_;  // first exception of a deferred op, raised by wait()
  bool stop_ = false;
  std::mt19937_64 shuffle_rng_;
  std::thread executor_;
};

// Measured peak fp32 FMA throughput (FLOP/s) of `threads` threads, for rooflines.
double measure_fma_peak(int threads, double seconds);

// One RMSNorm segment: out[i] = x[i] · w[i] / sqrt(mean(x²) + eps), fp32 statistics in the fixed order of
// reduce.h. The kernel of CpuOps::rms_norm, exposed as the oracle for GPU norm kernels.
void rms_norm_segment(const float* x, const float* w, int64_t n, float eps, float* out);

// Workspace each op family needs for `rows` tokens on `threads` threads (sizes for CpuOps::workspace_bytes).
size_t moe_workspace_bytes(const ModelConfig& c, int64_t rows, int threads);
size_t attention_workspace_bytes(const ModelConfig& c, int64_t rows, int64_t max_ctx, int threads);
size_t delta_workspace_bytes(const ModelConfig& c, int threads);
size_t sample_workspace_bytes(int64_t vocab);

}  // namespace lily::cpu
