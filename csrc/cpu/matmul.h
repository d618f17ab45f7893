// WeightView-streaming matrix products for the CPU backend: y[T, N] = x[T, K] · W[N, K]ᵀ.
// W is dense (f32 / f16 / bf16) or MLX affine (4- or 8-bit, any group size dividing K), read in place;
// quantized weights are dequantized inside the kernel's tile, never into a full copy. fp32 accumulation.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "cpu/thread_pool.h"
#include "model/weight.h"

namespace lily::cpu {

// Which kernel family: Gemv for batch-1 decode (bandwidth bound), Gemm for prefill rows (compute bound).
// Within one family the accumulation order of an output element never depends on T or on the
// thread count, so a prompt prefilled in chunks gives bitwise the same result as one prefill.
enum class MatmulPath : uint8_t { Gemv, Gemm };

// A thread's kernel scratch: 64-byte aligned fp32 buffers (prep: Gemv's rewritten x rows; work: Gemm's
// packed W panels, Gemv's fp32 scale rows). They only grow, and only when a product needs more.
struct MatmulScratch;

// One MatmulScratch per pool thread index. Explicit rather than thread_local so that steps may run on any
// caller thread and a reserved arena makes every product within its bounds allocation-free.
class MatmulArena {
 public:
  explicit MatmulArena(int threads);
  ~MatmulArena();
  MatmulArena(const MatmulArena&) = delete;
  MatmulArena& operator=(const MatmulArena&) = delete;
  MatmulScratch& at(int thread_index);  // throws std::out_of_range past the thread count
  // Grow every thread's buffers so that any product with at most max_rows x rows, K <= max_k and
  // N <= max_n needs no allocation (exact upper bounds from the kernels' own formulas).
  void reserve(int64_t max_rows, int64_t max_k, int64_t max_n);
  size_t bytes() const;

 private:
  int threads_;
  std::unique_ptr<MatmulScratch[]> s_;
};

// x: T rows with stride ldx floats; y: T rows with stride ldy floats (y is overwritten). The caller is
// thread index 0 of `pool`; `arena` needs at least pool.size() threads.
void matmul(const float* x, int64_t T, int64_t ldx, const WeightView& W, float* y, int64_t ldy,
            MatmulPath path, ThreadPool& pool, MatmulArena& arena);

// Same, single-threaded: for callers that already parallelise over independent products (MoE experts),
// inside a parallel_for body with that thread's scratch (arena.at(thread_index)).
void matmul_serial(const float* x, int64_t T, int64_t ldx, const WeightView& W, float* y, int64_t ldy,
                   MatmulPath path, MatmulScratch& scratch);

// Row `r` of W as fp32 (embedding lookup).
void dequant_row(const WeightView& W, int64_t r, float* out);

// Name of the kernel variant used for a product of this shape (for engine.report()).
const char* matmul_variant(const WeightView& W, MatmulPath path);

}  // namespace lily::cpu
