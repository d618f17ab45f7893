// The sample op on CUDA: the host side of kernels/sample.cu (oracle: csrc/cpu/sample.cpp).
// Greedy: sample_prep (grid over V) + sample_greedy (one block). Sampling: sample_prep + sample_weights (grid
// over V) + sample_select (one 1024-thread block). Nothing here depends on device data, so the same launches
// replay in a decode graph.
// Workspace: keys [V] u32, weights [V] f32, one partial maximum per prep block.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/backend.h"

namespace lily::cuda {

namespace {

constexpr int64_t kChunk = 2048;       // tokens per prep block: PREP_CHUNK in kernels/sample.cu
constexpr int kCap = 2048;             // sorted prefix: CAP in kernels/sample.cu
constexpr int kSelectSmem = 60 * 1024;  // SELECT_SMEM in kernels/sample.cu

int64_t prep_blocks(int64_t vocab) { return (vocab + kChunk - 1) / kChunk; }
size_t round16(size_t b) { return (b + 15) / 16 * 16; }

// Must match the kernel's structs (natural alignment, no implicit padding beyond it).
struct FinishArgs {
  CUdeviceptr counts, seen, ring, ring_count, next_id;
  int64_t ring_rows, ring_stride;
};
struct SelectArgs {
  CUdeviceptr keys, wts, rng;
  FinishArgs fa;
  int V, n;
  float top_p, inv_t, min_x;
  int has_min_p;
  double fix;
};
static_assert(sizeof(SelectArgs) == 3 * 8 + 7 * 8 + 24 + 8, "SelectArgs layout must match kernels/sample.cu");

// csrc/cpu/sample.cpp's fixed-point scale 2^F, F = min(44, 62 - bit_length(vocab)).
double fix_scale(int64_t vocab) {
  int bits = 0;
  while (bits < 63 && (vocab >> bits) != 0) ++bits;
  return std::ldexp(1.0, std::min(44, 62 - bits));
}

[[noreturn]] void bad(const std::string& why) { throw std::invalid_argument("sample (cuda): " + why); }

// The shapes every sample launch relies on (one_row: logits [1, vocab], else [rows, vocab]).
void check_sample(const Tensor& logits, bool one_row, const SamplerState& st, const Tensor& ws,
                  const Tensor& next_id) {
  const int64_t V = logits.cols;
  if (logits.dtype != DType::F32 || (one_row && logits.rows != 1) || V < 1)
    bad(std::string("logits must be F32 ") + (one_row ? "[1, vocab]" : "[rows, vocab]"));
  if (V >= (int64_t(1) << 31)) bad("vocab too large");
  for (const Tensor* t : {&st.counts, &st.seen, &st.rng, &st.ring, &st.ring_count, &next_id})
    if (t->dtype != DType::I32) bad("sampler state and next_id must be I32");
  if (st.counts.cols != V || st.seen.cols != V || st.rng.cols != SamplerState::kRngWords || st.ring.rows < 1)
    bad("sampler state does not match vocab " + std::to_string(V));
  if (ws.bytes() < sample_workspace_bytes(V)) bad("workspace too small");
}

}  // namespace

size_t sample_workspace_bytes(int64_t vocab) {
  return round16(size_t(vocab) * 4) * 2 + round16(size_t(prep_blocks(vocab)) * 8);
}

void CudaOps::sample_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p, const Tensor& ws,
                          const Tensor& next_id) {
  const int64_t V = logits.cols;
  check_sample(logits, true, st, ws, next_id);

  const CUdeviceptr base = ptr(ws);
  const CUdeviceptr keys = base, wts = base + round16(size_t(V) * 4), partials = wts + round16(size_t(V) * 4);
  const int G = int(prep_blocks(V));
  const FinishArgs fa{ptr(st.counts), ptr(st.seen), ptr(st.ring), ptr(st.ring_count), ptr(next_id),
                      int64_t(st.ring.rows), int64_t(st.ring.stride)};
  const int has_rep = p.repetition_penalty != 1.f, has_pf = p.presence_penalty != 0.f || p.frequency_penalty != 0.f;

  const Kernel& prep = kernel("sample", "sample_prep");
  launch(prep, Dim3{unsigned(G), 1, 1}, Dim3{256, 1, 1}, 0, ptr(logits), int64_t(logits.stride), ptr(st.seen),
         ptr(st.counts), keys, partials, int(V), p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
         has_rep, has_pf);
  if (p.greedy()) {
    const Kernel& g = kernel("sample", "sample_greedy");
    launch(g, Dim3{1, 1, 1}, Dim3{256, 1, 1}, 0, partials, G, 1, int64_t(next_id.stride), fa);
    note_variant("sample.greedy", "prep over " + std::to_string(G) +
                                      " blocks (first maximum per block) + one block reducing the partials");
    return;
  }
  const float inv_t = 1.f / p.temperature;  // the CPU's Candidates::inv_t
  const int n = int(p.top_k > 0 && p.top_k < V ? p.top_k : V);
  const Kernel& w = kernel("sample", "sample_weights");
  launch(w, Dim3{unsigned(G), 1, 1}, Dim3{256, 1, 1}, 0, keys, partials, G, wts, int(V), inv_t);
  const Kernel& sel = kernel("sample", "sample_select");
  set_dynamic_smem(sel, kSelectSmem);
  // min-p's bound on x = fmaf(work, 1/T, -top): the CPU's min_p_cut computes the same float on the host.
  const float min_x = p.min_p > 0.f ? float(std::log(double(p.min_p))) : 0.f;
  const SelectArgs sa{keys, wts, ptr(st.rng), fa, int(V), n, p.top_p, inv_t, min_x, p.min_p > 0.f ? 1 : 0,
                      fix_scale(V)};
  launch(sel, Dim3{1, 1, 1}, Dim3{1024, 1, 1}, kSelectSmem, sa);
  note_variant("sample.draw", "prep + weights over " + std::to_string(G) + " blocks, one 1024-thread block: radix " +
                                  "descent to the first " + std::to_string(kCap) +
                                  " candidates, bitonic sort, the CPU's walk in exact fixed-point sums; " +
                                  "whole-vocabulary descents where top-p/min-p/top-k reach past them");
}

// Greedy rows without penalties do not depend on each other (no row reads the counts or the seen mask the rows
// before it write, and no draw takes a number): one prep launch over (blocks, rows) writing only the partials
// (into the keys' room: greedy reads no keys), then one block taking the rows in order, as T calls would (the
// ring and the counts in row order). Any other case is T one-row calls (Ops::sample_rows_impl).
void CudaOps::sample_rows_impl(const Tensor& logits, const SamplerState& st, const SamplingParams& p,
                               const Tensor& ws, const Tensor& next_id) {
  const int64_t T = logits.rows, V = logits.cols;
  const bool independent = p.greedy() && p.repetition_penalty == 1.f && p.presence_penalty == 0.f &&
                           p.frequency_penalty == 0.f;
  if (T == 1 || !independent) return Ops::sample_rows_impl(logits, st, p, ws, next_id);
  check_sample(logits, false, st, ws, next_id);
  const int G = int(prep_blocks(V));
  if (T > 65535 || size_t(T) * size_t(G) * 8 > ws.bytes()) {  // 8 bytes a partial: (value, id)
    note_variant("sample.greedy_rows", "row by row: the workspace holds no partials for " + std::to_string(T) + " rows");
    return Ops::sample_rows_impl(logits, st, p, ws, next_id);
  }
  const CUdeviceptr partials = ptr(ws);  // greedy reads no keys or weights: the partials take their room
  const FinishArgs fa{ptr(st.counts), ptr(st.seen), ptr(st.ring), ptr(st.ring_count), ptr(next_id),
                      int64_t(st.ring.rows), int64_t(st.ring.stride)};
  launch(kernel("sample", "sample_prep"), Dim3{unsigned(G), unsigned(T), 1}, Dim3{256, 1, 1}, 0, ptr(logits),
         int64_t(logits.stride), ptr(st.seen), ptr(st.counts), CUdeviceptr(0), partials, int(V), 1.f, 0.f, 0.f, 0, 0);
  launch(kernel("sample", "sample_greedy"), Dim3{1, 1, 1}, Dim3{256, 1, 1}, 0, partials, G, int(T),
         int64_t(next_id.stride), fa);
  note_variant("sample.greedy_rows", "greedy rows without penalties: one prep over (" + std::to_string(G) +
                                         " blocks, " + std::to_string(T) +
                                         " rows) + one block taking the rows in order");
}

}  // namespace lily::cuda
