// The CPU backend: the numerical oracle of every other backend (fp32 activations, fp32 accumulation,
// fp32 KV cache and recurrent state) and a usable multi-threaded engine. Ops run in order as they are
// recorded; the hazard tracker still counts the stages a concurrent backend would need.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "cpu/matmul.h"
#include "cpu/thread_pool.h"

namespace lily::cpu {

class CpuOps final : public Ops {
 public:
  explicit CpuOps(int threads);
  ~CpuOps() override;
  const char* name() const override { return "cpu"; }
  std::string device() const override;
  int threads() const override { return pool_.size(); }

  Tensor alloc(const std::string& label, DType dtype, int64_t rows, int64_t cols) override;
  void release(Tensor& t) override;
  void upload(const Tensor& dst, const void* src) override;
  void download(const Tensor& src, void* dst) override;
  size_t allocated_bytes() const override { return allocated_; }

  std::string matmul_variant(const Weight& w, Phase phase) const override;
  std::vector<std::string> optimizations() const override;

  ThreadPool& pool() { return pool_; }
  MatmulArena& arena() { return arena_; }

 protected:
  void embed_impl(const Tensor& ids, const Weight& table, const Tensor& out) override;
  void rms_norm_impl(const Tensor& x, const Tensor& w, const Tensor& out, float eps) override;
  void matmul_impl(const Tensor& x, const Weight& w, const Tensor& out) override;
  void add_impl(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void attn_qk_prep_impl(const Tensor& qg, const Tensor& k, const Tensor& q_norm, const Tensor& k_norm,
                         int64_t pos0, const AttentionShape& s, const Tensor& q_out,
                         const Tensor& gate_out, const Tensor& k_out) override;
  void kv_append_impl(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                      int64_t pos0, int64_t max_ctx, const AttentionShape& s) override;
  void attention_impl(const Tensor& q, const Tensor& gate, const Tensor& k_cache, const Tensor& v_cache,
                      int64_t pos0, int64_t max_ctx, const AttentionShape& s, const Tensor& out) override;
  void conv1d_silu_impl(const Tensor& mixed, const Tensor& conv_w, const Tensor& conv_state,
                        const Tensor& out) override;
  void gated_delta_impl(const Tensor& qkv, const Tensor& b, const Tensor& a, const Tensor& A_log,
                        const Tensor& dt_bias, const Tensor& state, const DeltaShape& s,
                        const Tensor& out) override;
  void gated_rms_norm_impl(const Tensor& o, const Tensor& z, const Tensor& w, float eps,
                           const Tensor& out) override;
  void moe_route_impl(const Tensor& logits, int64_t k, const Tensor& ids, const Tensor& weights) override;
  void moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertSet& e,
                        const Tensor& out) override;
  void swiglu_impl(const Tensor& gate, const Tensor& up, const Tensor& out) override;
  void moe_combine_impl(const Tensor& routed, const Tensor& shared, const Tensor& shared_gate_logit,
                        const Tensor& h) override;

 private:
  float* f32(const Tensor& t) const;
  int32_t* i32(const Tensor& t) const;
  uint16_t* u16(const Tensor& t) const;
  MatmulPath path() const { return phase() == Phase::Decode ? MatmulPath::Gemv : MatmulPath::Gemm; }

  struct Buffer {
    void* data = nullptr;
    size_t bytes = 0;
  };
  std::vector<Buffer> buffers_;
  std::vector<int32_t> free_ids_;
  size_t allocated_ = 0;
  ThreadPool pool_;
  MatmulArena arena_;  // per pool thread index: matmul scratch (declared after pool_, sized from it)
};

// Measured peak fp32 FMA throughput (FLOP/s) of `threads` threads, for rooflines.
double measure_fma_peak(int threads, double seconds);

// One RMSNorm segment: out[i] = x[i] · w[i] / sqrt(mean(x²) + eps), fp32 statistics in the fixed order of
// reduce.h. The kernel of CpuOps::rms_norm, exposed as the oracle for GPU norm kernels.
void rms_norm_segment(const float* x, const float* w, int64_t n, float eps, float* out);

}  // namespace lily::cpu
