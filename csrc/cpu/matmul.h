// WeightView-streaming matrix products for the CPU backend: y[T, N] = x[T, K] · W[N, K]ᵀ.
// W is dense (f32 / f16 / bf16) or MLX affine (4- or 8-bit, any group size dividing K), read in place;
// quantized weights are dequantized inside the kernel's tile, never into a full copy. fp32 accumulation.
#pragma once
#include <cstdint>

#include "cpu/thread_pool.h"
#include "model/weight.h"

namespace lily::cpu {

// Which kernel family: Gemv for batch-1 decode (bandwidth bound), Gemm for prefill rows (compute bound).
// Within one family the accumulation order of an output element never depends on T or on the
// thread count, so a prompt prefilled in chunks gives bitwise the same result as one prefill.
enum class MatmulPath : uint8_t { Gemv, Gemm };

// x: T rows with stride ldx floats; y: T rows with stride ldy floats (y is overwritten).
void matmul(const float* x, int64_t T, int64_t ldx, const WeightView& W, float* y, int64_t ldy,
            MatmulPath path, ThreadPool& pool);

// Same, single-threaded: for callers that already parallelise over independent products (MoE experts).
void matmul_serial(const float* x, int64_t T, int64_t ldx, const WeightView& W, float* y, int64_t ldy,
                   MatmulPath path);

// Row `r` of W as fp32 (embedding lookup).
void dequant_row(const WeightView& W, int64_t r, float* out);

// Name of the kernel variant used for a product of this shape (for engine.report()).
const char* matmul_variant(const WeightView& W, MatmulPath path);

}  // namespace lily::cpu
