// MetalOps: buffers, checkpoint mappings, the step's command buffer (one concurrent compute pass, barriers at the
// hazard tracker's stage boundaries), asynchronous submission with fences from completed handlers, and the small
// ops (embed is in matmul.cpp with the other weight reads). See backend.h.
#include "metal/backend.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

#include "metal/kernels.h"
#include "model/config.h"

namespace lily::metal {

// Completion state shared with the completed handlers (which may outlive nothing: ~MetalOps waits for them).
struct FenceState {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::string> done;  // fence -> "" or the command buffer's error, until waited for
};

namespace {
constexpr size_t kNoCopyAlignment = 16384;  // Apple silicon's page: newBufferWithBytesNoCopy wants page-aligned memory
constexpr size_t kMaxInFlight = 2;          // the decode loop's two alternating command buffers

struct RowsShape {  // metal/backend.metal
  uint32_t rows, cols, lda, ldb, ldo;
};
static_assert(sizeof(RowsShape) == 20, "RowsShape must match metal/backend.metal");
struct FillShape {  // metal/backend.metal
  uint32_t rows, cols, ld, bits;
};
static_assert(sizeof(FillShape) == 16, "FillShape must match metal/backend.metal");
struct PickShape {  // metal/backend.metal
  uint32_t rows, cols, lds, ldd, src_rows;
  int32_t offset;
};
static_assert(sizeof(PickShape) == 24, "PickShape must match metal/backend.metal");
struct AcceptShape {  // metal/backend.metal
  uint32_t n, ld_ids, ld_y;
};
static_assert(sizeof(AcceptShape) == 12, "AcceptShape must match metal/backend.metal");

uint32_t u32(int64_t v, const char* what) {
  if (v < 0 || v > int64_t(UINT32_MAX)) throw MetalError(std::string("metal: ") + what + " does not fit 32 bits");
  return uint32_t(v);
}
}  // namespace

size_t BoundPart::exact_offset() const { return bind_offset + size_t(element) * elem_size; }

MetalOps::MetalOps(const std::string& msl) : dev_(msl), fences_(std::make_shared<FenceState>()) {
  // A planted bug for the harness tests only (tests/metal/test_backend.py): encode no memory barriers, so the
  // fake runtime's hazard check must stop the first dependent dispatch.
  const char* drop = std::getenv("LILY_METAL_DROP_BARRIERS");
  drop_barriers_ = drop && *drop && std::string(drop) != "0";
  const char* group = std::getenv("LILY_METAL_GROUP_MATMULS");
  group_matmuls_ = !(group && std::string(group) == "0");
  const char* combine = std::getenv("LILY_METAL_FUSE_MOE_COMBINE");
  fuse_moe_combine_ = !(combine && std::string(combine) == "0");
  const char* mma = std::getenv("LILY_METAL_MOE_MMA");
  moe_mma_ = !(mma && std::string(mma) == "0");
  const char* tile_rows = std::getenv("LILY_METAL_MOE_TILE_ROWS");
  if (tile_rows && *tile_rows) set_moe_tile_rows(std::stoll(tile_rows));
  const char* split_min = std::getenv("LILY_METAL_SPLIT_ATTENTION_MIN");
  const char* split_block = std::getenv("LILY_METAL_SPLIT_ATTENTION_BLOCK");
  set_split_attention(split_min && *split_min ? std::stoll(split_min) : split_min_,
                      split_block && *split_block ? std::stoll(split_block) : split_block_);
}

MetalOps::~MetalOps() {
  try {
    if (open_) abandon_impl();
    for (auto& f : flight_) f.pass->wait_completed();
  } catch (...) {
  }
  // The completed handlers have run once waitUntilCompleted returned for every command buffer... but a handler may
  // still be finishing on its thread: wait until each fence is marked.
  std::unique_lock<std::mutex> lk(fences_->mu);
  for (auto& f : flight_) fences_->cv.wait(lk, [&] { return fences_->done.count(f.fence) > 0; });
}

std::string MetalOps::device() const { return dev_.name(); }

// ---- buffers ----

Tensor MetalOps::alloc_impl(const std::string& label, DType dtype, int64_t rows, int64_t cols) {
  const size_t es = dtype_size(dtype), r = size_t(std::max<int64_t>(rows, 1));
  if (r > (size_t(1) << 46) / es / size_t(cols))
    throw std::invalid_argument("alloc('" + label + "'): [" + std::to_string(rows) + ", " + std::to_string(cols) +
                                "] is larger than any addressable memory");
  const size_t bytes = (r * size_t(cols) * es + 15) / 16 * 16;
  if (bytes > size_t(dev_.device()->maxBufferLength()))
    throw MetalError("alloc('" + label + "'): " + std::to_string(bytes) + " bytes exceed the device's maxBufferLength");
  Ref<MTL::Buffer> b = dev_.new_buffer(bytes);
  Device::set_label(b.get(), label);
  std::memset(b->contents(), 0, bytes);
  int32_t id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = int32_t(bufs_.size());
    bufs_.emplace_back();
  }
  bufs_[size_t(id)] = {std::move(b), bytes, label};
  allocated_ += bytes;
  return Tensor::whole(id, dtype, rows, cols);
}

void MetalOps::release(Tensor& t) {
  if (!t.valid()) return;
  // A command buffer retains the buffers it binds until it completes, so dropping ours is safe even in flight.
  Buf& b = bufs_.at(size_t(t.buf));
  allocated_ -= b.bytes;
  b = Buf{};
  free_ids_.push_back(t.buf);
  t = Tensor{};
}

MTL::Buffer* MetalOps::buffer_of(const Tensor& t) const {
  if (!t.valid() || size_t(t.buf) >= bufs_.size() || !bufs_[size_t(t.buf)].mtl)
    throw std::logic_error("metal: tensor refers to no live buffer");
  return bufs_[size_t(t.buf)].mtl.get();
}

Arg MetalOps::arg(const Tensor& t) const {
  return Arg::buf(buffer_of(t), size_t(t.offset) * dtype_size(t.dtype));
}

void MetalOps::upload_impl(const Tensor& dst, const void* src) {
  const size_t es = dtype_size(dst.dtype), row = size_t(dst.cols) * es;
  char* base = static_cast<char*>(buffer_of(dst)->contents()) + size_t(dst.offset) * es;
  for (int64_t r = 0; r < dst.rows; ++r)
    std::memcpy(base + size_t(r * dst.stride) * es, static_cast<const char*>(src) + size_t(r) * row, row);
}

void MetalOps::download_impl(const Tensor& src, void* dst) {
  const size_t es = dtype_size(src.dtype), row = size_t(src.cols) * es;
  const char* base = static_cast<const char*>(buffer_of(src)->contents()) + size_t(src.offset) * es;
  for (int64_t r = 0; r < src.rows; ++r)
    std::memcpy(static_cast<char*>(dst) + size_t(r) * row, base + size_t(r * src.stride) * es, row);
}

int32_t MetalOps::register_mapping(const void* base, size_t bytes, const std::string& label) {
  Mapping m;
  m.base = static_cast<const char*>(base);
  m.bytes = bytes;
  m.label = label;
  const size_t page = size_t(getpagesize());
  const size_t max_len = size_t(dev_.device()->maxBufferLength()) / page * page;
  const bool aligned = reinterpret_cast<uintptr_t>(base) % kNoCopyAlignment == 0 && bytes > 0;
  // A mapping larger than maxBufferLength becomes windows of max_len bytes every max_len / 2 bytes (each byte in
  // two windows), so every weight part up to max_len / 2 bytes lies whole inside one of them (the window starting
  // at or before it by less than max_len / 2). Wrapped windows are views of the same pages; copied ones cost
  // twice the mapping.
  const size_t window = std::min(max_len, (bytes + page - 1) / page * page);
  // (Window starts stay 16 KB aligned, so wrapped windows start on a page.)
  m.step = bytes <= window ? window : window / 2 / kNoCopyAlignment * kNoCopyAlignment;
  if (m.step == 0) throw MetalError("metal: maxBufferLength is too small to map '" + label + "'");
  for (size_t off = 0; off == 0 || off < bytes; off += m.step) {
    const size_t len = std::min(window, (bytes - off + page - 1) / page * page);
    Ref<MTL::Buffer> b;
    if (aligned) {
      // The checkpoint's pages become the GPU's: no copy. Lily never writes weights, and the engine keeps the
      // mapping alive as long as the model (so no deallocator).
      b = Ref<MTL::Buffer>(dev_.device()->newBuffer(const_cast<char*>(m.base) + off, NS::UInteger(len),
                                                   MTL::ResourceStorageModeShared, nullptr));
      if (!b) throw MetalError("metal: wrapping mapping '" + label + "' without a copy failed");
    } else {
      b = dev_.new_buffer(m.base + off, std::min(len, bytes - off));
    }
    // "<mapping label>@<byte offset of the window in the mapping>": which weight bytes a dispatch reads.
    Device::set_label(b.get(), label + "@" + std::to_string(off));
    m.windows.push_back(std::move(b));
  }
  m.copied = !aligned;
  if (aligned) {
    ++counters_.mappings_wrapped;
    counters_.wrapped_bytes += bytes;
  } else {
    ++counters_.mappings_copied;
    counters_.copied_bytes += bytes;
  }
  counters_.mapping_windows += int64_t(m.windows.size());
  mappings_.push_back(std::move(m));
  return int32_t(mappings_.size() - 1);
}

BoundPart MetalOps::part(int32_t mapping, uint64_t offset, size_t bytes, size_t elem_size) {
  const Mapping& m = mappings_.at(size_t(mapping));
  if (offset + bytes > m.bytes) throw std::logic_error("metal: weight lies outside its mapping '" + m.label + "'");
  BoundPart p;
  p.elem_size = elem_size;
  const size_t w = std::min(size_t(offset) / m.step, m.windows.size() - 1);
  const size_t in_window = size_t(offset) - w * m.step;
  if ((offset % 16) % elem_size == 0 && in_window + bytes <= m.windows[w]->length()) {
    p.buffer = m.windows[w].get();
    p.bind_offset = in_window / 16 * 16;
    p.element = uint32_t((in_window % 16) / elem_size);
    return p;
  }
  if (in_window + bytes > m.windows[w]->length() && bytes > size_t(dev_.device()->maxBufferLength()))
    throw MetalError("metal: a weight of " + std::to_string(bytes) + " bytes in '" + m.label +
                     "' exceeds the device's maxBufferLength");
  // A part not aligned to its own element size (a safetensors header of odd length), or larger than half a window:
  // copied once, reported.
  auto key = std::make_tuple(mapping, offset, bytes);
  auto it = part_copies_.find(key);
  if (it == part_copies_.end()) {
    it = part_copies_.emplace(key, dev_.new_buffer(m.base + offset, bytes)).first;
    Device::set_label(it->second.get(), m.label + "@" + std::to_string(offset) + " (copied part)");
    ++counters_.parts_copied;
    counters_.part_copied_bytes += bytes;
  }
  p.buffer = it->second.get();
  return p;
}

size_t MetalOps::workspace_bytes(const ModelConfig& cfg, int64_t rows, int64_t max_ctx) const {
  // moe_experts: the SwiGLU activations of every (token, expert) pair, [rows · k, moe_inter] f32, and for prefill
  // the grouping, the tile map and the grouped outputs (moe_workspace); the sampler's sort keys; split attention's
  // partials (split_attention_bytes); the chunked DeltaNet form's records. Each op uses the workspace alone.
  return std::max<size_t>({64, size_t(rows) * size_t(cfg.topk) * size_t(cfg.moe_inter) * 4,
                           moe_workspace(rows, cfg.topk, cfg.experts, cfg.moe_inter, cfg.hidden).bytes,
                           sample_workspace_bytes(cfg.vocab), split_attention_bytes(cfg, rows, max_ctx),
                           delta_chunk_workspace_bytes(rows, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim)});
}

// ---- steps ----

Pass& MetalOps::pass() {
  if (!open_) {
    // At most two command buffers in flight: the third waits for the oldest (whose fence the host has not
    // waited for yet) so the queue never grows without bound.
    while (flight_.size() >= kMaxInFlight) wait(flight_.front().fence);
    open_ = std::make_unique<Pass>(dev_);
    open_->set_label(phase() == Phase::Decode ? "lily decode step" : "lily prefill chunk");
  }
  return *open_;
}

void MetalOps::execute(OpKind, const OpRun& run) { run(); }  // encodes the op's dispatches into the open pass

void MetalOps::on_stage_boundary() {
  if (!open_ || step_dispatches_ == 0 || drop_barriers_) return;  // nothing encoded yet: nothing to order
  open_->barrier();
  ++step_barriers_;
}

void MetalOps::barrier_in_op() {
  if (drop_barriers_) return;
  pass().barrier();
  ++step_barriers_;
}

void MetalOps::dispatch(const std::string& kernel, const std::vector<FunctionConstant>& constants,
                        const std::vector<Arg>& args, MTL::Size groups, MTL::Size threads,
                        const std::vector<size_t>& threadgroup_bytes) {
  if (groups.width == 0 || groups.height == 0 || groups.depth == 0) return;  // empty op
  MTL::ComputePipelineState* p = dev_.pipeline(kernel, constants);
  pass().dispatch(p, args, groups, threads, threadgroup_bytes);
  ++step_dispatches_;
}

uint64_t MetalOps::submit_impl() {
  const uint64_t fence = ++last_fence_;
  counters_.last_dispatches = step_dispatches_;
  counters_.last_barriers = step_barriers_;
  counters_.dispatches += step_dispatches_;
  counters_.barriers += step_barriers_;
  const bool decode = phase() == Phase::Decode;
  (decode ? counters_.decode_dispatches : counters_.prefill_dispatches) = step_dispatches_;
  (decode ? counters_.decode_stages : counters_.prefill_stages) = step_dispatches_ ? step_barriers_ + 1 : 0;
  ++(decode ? counters_.decode_steps : counters_.prefill_steps);
  step_dispatches_ = step_barriers_ = 0;
  std::unique_ptr<Pass> p = std::move(open_);
  if (!p) p = std::make_unique<Pass>(dev_);  // an empty step still gets its fence from the GPU's order
  std::shared_ptr<FenceState> fs = fences_;
  p->commit([fs, fence](const std::string& error) {
    std::lock_guard<std::mutex> lk(fs->mu);
    fs->done[fence] = error;
    fs->cv.notify_all();
  });
  ++counters_.command_buffers;
  flight_.push_back({fence, std::move(p)});
  counters_.max_in_flight = std::max<int64_t>(counters_.max_in_flight, int64_t(flight_.size()));
  return fence;
}

void MetalOps::wait(uint64_t fence) {
  std::string error;
  {
    std::unique_lock<std::mutex> lk(fences_->mu);
    for (const InFlight& f : flight_) {
      if (f.fence > fence) break;
      fences_->cv.wait(lk, [&] { return fences_->done.count(f.fence) > 0; });
      if (error.empty()) error = fences_->done[f.fence];
      fences_->done.erase(f.fence);
    }
  }
  while (!flight_.empty() && flight_.front().fence <= fence) flight_.pop_front();
  if (!error.empty()) throw MetalError(error);
}

void MetalOps::abandon_impl() {
  open_.reset();  // ~Pass ends the encoder; the command buffer is never committed
  step_dispatches_ = step_barriers_ = 0;
}

void MetalOps::check_contiguous(const Tensor& t, const char* op, const char* what) const {
  if (t.stride != t.cols && t.rows > 1)
    throw MetalError(std::string("metal ") + op + ": " + what + " must have contiguous rows");
}

// ---- small ops ----

namespace {
MTL::Size rows_grid(int64_t rows, int64_t cols) {
  return MTL::Size(NS::UInteger((cols + 63) / 64), NS::UInteger(rows), 1);
}
uint32_t type_code(DType t) { return t == DType::F32 ? 0 : t == DType::BF16 ? 1 : t == DType::I32 ? 2 : 3; }
}  // namespace

void MetalOps::add_impl(const Tensor& a, const Tensor& b, const Tensor& out) {
  const RowsShape s{u32(out.rows, "rows"), u32(out.cols, "cols"), u32(a.stride, "stride"), u32(b.stride, "stride"),
                    u32(out.stride, "stride")};
  dispatch("add_rows", {}, {arg(a), arg(b), arg(out), Arg::value(s)}, rows_grid(out.rows, out.cols),
           MTL::Size(64, 1, 1));
}

void MetalOps::copy_impl(const Tensor& src, const Tensor& dst) {
  if (src.rows != dst.rows || src.cols != dst.cols) throw std::logic_error("copy: source and destination differ in shape");
  const uint32_t st = type_code(src.dtype), dt = type_code(dst.dtype);
  if (st != dt && !((st == 0 && dt == 1) || (st == 1 && dt == 0))) throw std::logic_error("copy: unsupported dtype conversion");
  const RowsShape s{u32(src.rows, "rows"), u32(src.cols, "cols"), u32(src.stride, "stride"), 0,
                    u32(dst.stride, "stride")};
  dispatch("copy_rows", {FunctionConstant::u32(40, st), FunctionConstant::u32(41, dt)},
           {arg(src), arg(dst), Arg::value(s)}, rows_grid(src.rows, src.cols), MTL::Size(64, 1, 1));
}

void MetalOps::fill_impl(const Tensor& dst, double value) {
  uint32_t bits;
  uint32_t type = 0;
  if (dst.dtype == DType::I32) {
    const int32_t v = int32_t(value);
    std::memcpy(&bits, &v, 4);
    type = 2;
  } else if (dst.dtype == DType::F32) {
    const float v = float(value);
    std::memcpy(&bits, &v, 4);
  } else {
    bits = f32_to_bf16(float(value));
    type = 1;
  }
  const FillShape s{u32(dst.rows, "rows"), u32(dst.cols, "cols"), u32(dst.stride, "stride"), bits};
  dispatch("fill_rows", {FunctionConstant::u32(42, type)}, {arg(dst), Arg::value(s)}, rows_grid(dst.rows, dst.cols),
           MTL::Size(64, 1, 1));
}

void MetalOps::set_moe_tile_rows(int64_t rows) {
  if (rows != 0 && rows != 16 && rows != 32)
    throw MetalError("metal moe_experts: tile rows must be 0 (chosen per chunk), 16 or 32, got " + std::to_string(rows));
  moe_tile_rows_ = rows;
}

void MetalOps::advance_position_impl(const Tensor& pos_in, const Tensor& pos_out, int64_t T) {
  const int32_t t = int32_t(T);
  dispatch("advance_position", {}, {arg(pos_in), arg(pos_out), Arg::value(t)}, MTL::Size(1, 1, 1),
           MTL::Size(32, 1, 1));
}

void MetalOps::accept_drafts_impl(const Tensor& ids, const Tensor& y, const Tensor& pos_in, const Tensor& accepted,
                                  const Tensor& next_id, const Tensor& pos_out) {
  const AcceptShape s{u32(ids.rows, "rows"), u32(ids.stride, "stride"), u32(y.stride, "stride")};
  dispatch("accept_drafts", {}, {arg(ids), arg(y), arg(pos_in), arg(accepted), arg(next_id), arg(pos_out),
                                 Arg::value(s)}, MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));
}

void MetalOps::copy_rows_at_impl(const Tensor& src, const Tensor& index, int64_t offset, const Tensor& dst) {
  if (offset < INT32_MIN || offset > INT32_MAX) throw MetalError("metal copy_rows_at: offset does not fit 32 bits");
  const PickShape s{u32(dst.rows, "rows"), u32(dst.cols, "cols"), u32(src.stride, "stride"), u32(dst.stride, "stride"),
                    u32(src.rows, "rows"), int32_t(offset)};
  dispatch("copy_rows_at", {}, {arg(src), arg(index), arg(dst), Arg::value(s)}, rows_grid(dst.rows, dst.cols),
           MTL::Size(64, 1, 1));
}

namespace {
std::string fixed1(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}
}  // namespace

std::vector<std::string> MetalOps::optimizations() const {
  std::vector<std::string> v = {
      "active: buffers in shared storage (unified memory: no device copies)",
      "active: checkpoint mappings wrapped without a copy where 16 KB aligned (" +
          std::to_string(counters_.mappings_wrapped) + " wrapped, " + std::to_string(counters_.wrapped_bytes) +
          " bytes; " + std::to_string(counters_.mappings_copied) + " copied at load, " +
          std::to_string(counters_.copied_bytes) + " bytes; " + std::to_string(counters_.mapping_windows) +
          " buffers in all (mappings over maxBufferLength split into overlapping windows); " +
          std::to_string(counters_.parts_copied) +
          " misaligned weight parts copied, " + std::to_string(counters_.part_copied_bytes) + " bytes)",
      "active: pipelines specialised by function constants (weight format, group size, scale and cache dtypes; the "
      "decode GEMV qmv4 also by its input width) and cached (" + std::to_string(dev_.pipelines_built()) + " built, " +
          std::to_string(dev_.pipeline_cache_hits()) + " dispatches served from the cache)",
      "active: concurrent dispatch (one concurrent compute pass per step; memory barriers only where the hazard "
      "tracker starts a stage)",
      "active: asynchronous submission (fences from completed handlers; two command buffers in flight)",
      "active: dequantize inside matmul (4/8-bit weights never expanded)",
      "active: row-parallel 4-bit GEMV for decode (qmv4; a weight part misaligned in the checkpoint is copied once "
      "at load, so every 4-bit decode row takes it)",
      "active: fused expert gate/up + SiLU·mul; fused expert down + routing weight",
      std::string(counters_.moe_down_combined_calls ? "active" : "inactive") +
          ": fused expert down + routing weight + gated shared expert + residual for decode rows (moe_down_combine: "
          "no moe_combine dispatch; " + std::to_string(counters_.moe_down_combined_calls) + " calls fused, " +
          std::to_string(counters_.moe_combine_calls) + " with moe_combine after the down pass" +
          (counters_.moe_combine_calls ? ", the last for " + counters_.moe_combine_reason : std::string()) + ")",
      "active: fused q/k RMSNorm + RoPE prep",
      "inactive: the KV append inside the q/k prep's dispatch (attn_qk_prep_append runs composed here: attn_qk_prep, "
      "a barrier, kv_append; the fusion is written for CUDA, one launch fewer per attention layer there)",
      std::string(counters_.delta_scan_sg_calls ? "active" : "inactive") +
          ": register-resident DeltaNet scan with one state column per simdgroup for prefill rows (gated_delta_scan_sg: "
          "the column over the 32 lanes, reductions by simd_sum; " + std::to_string(counters_.delta_scan_sg_calls) +
          " calls; " + std::to_string(counters_.delta_scan_thread_calls) + " calls with one column per thread" +
          (delta_scan_ == "auto" ? std::string(", the form of single rows, whose sums conv_delta_norm repeats bit "
                                               "for bit)")
                                 : ", every call forced to the " + delta_scan_ + " form)"),
      std::string(counters_.delta_chunked_calls ? "active" : "inactive") +
          ": chunked (WY / UT-transform) DeltaNet prefill form for calls of >= 64 rows without a state capture "
          "(gated_delta_chunk_prep builds each 64-row chunk's factors in parallel, gated_delta_chunk_scan walks the "
          "chunks; the row threshold follows the CUDA backend's measurement, not measured on a Mac; " +
          std::to_string(counters_.delta_chunked_calls) + " calls" +
          (counters_.delta_not_chunked_reason.empty() ? std::string()
                                                      : ", the last scanned call: " + counters_.delta_not_chunked_reason) +
          ")",
      std::string(counters_.delta_fused_calls ? "active" : "inactive") +
          ": fused conv + recurrent update + gated norm for decode rows (conv_delta_norm: one dispatch per DeltaNet "
          "layer at T = 1; " + std::to_string(counters_.delta_fused_calls) + " calls fused, " +
          std::to_string(counters_.delta_composed_calls) + " composed from conv1d_silu, gated_delta_scan and "
          "gated_rms_norm" +
          (counters_.delta_composed_calls ? ", the last for " + counters_.delta_composed_reason : std::string()) +
          ")",
      std::string(counters_.matmul_group_calls ? "active" : "inactive") +
          ": one dispatch per MatmulGroup (the products of one input that share a kind: qmv4_multi for a decode "
          "row's 4-bit products, matmul_rows_multi for the rest, per format; " +
          std::to_string(counters_.matmul_group_calls) + " calls grouped, " +
          std::to_string(counters_.matmul_grouped_products) + " products in " +
          std::to_string(counters_.qmv4_multi_dispatches) + " qmv4_multi and " +
          std::to_string(counters_.matmul_rows_multi_dispatches) + " matmul_rows_multi dispatches; " +
          std::to_string(counters_.matmul_group_split_calls) + " with products run alone" +
          (counters_.matmul_group_split_calls ? " (the last: " + counters_.matmul_group_split_reason + ")"
                                              : std::string()) +
          "; " + std::to_string(counters_.matmul_group_composed_calls) + " composed, one dispatch per product" +
          (counters_.matmul_group_composed_calls ? ", the last for " + counters_.matmul_group_composed_reason
                                                 : std::string()) +
          ")",
      "active: GPU-resident routing (top-k on the GPU; ids never read by the host)",
      "active: sampling on the GPU, greedy and seeded (the id goes straight into the next step's slot)",
      "active: experts grouped on the GPU for prefill (moe_group: histogram, scan, scatter and a tile map of the "
      "chunk's tile rows)",
      std::string(counters_.moe_mma16_calls + counters_.moe_mma32_calls ? "active" : "inactive") +
          ": grouped expert GEMM on simdgroup matrices for prefill (moe_gate_up_mma / moe_down_mma: routed x rows and "
          "weight blocks dequantized into threadgroup memory, 8x8 float products, fp32 accumulate, every weight "
          "format; tiles of " +
          (moe_tile_rows_ ? std::to_string(moe_tile_rows_) + " rows (set)"
                          : std::string("16 rows (2 simdgroups) below 24 rows per expert on average (T·k / E), 32 rows "
                                        "(4 simdgroups) from 24")) +
          (moe_mma_ ? std::string() : std::string("; off: LILY_METAL_MOE_MMA=0")) + "; " +
          std::to_string(counters_.moe_mma16_calls) + " chunks with 16-row tiles, " +
          std::to_string(counters_.moe_mma32_calls) + " with 32-row tiles, " +
          std::to_string(counters_.moe_lane_tile_calls) + " on the 8-row lane-dot tiles (moe_gate_up_tiles)" +
          (counters_.moe_mma16_calls + counters_.moe_mma32_calls + counters_.moe_lane_tile_calls
               ? ", the last at " + fixed1(counters_.moe_tiles_last_rows_per_expert) + " rows per expert"
               : std::string()) +
          (counters_.moe_tiles_reason.empty() ? std::string() : "; the last fallback: " + counters_.moe_tiles_reason) +
          ")",
      "active: GQA packing and coalesced KV reads in decode attention (attention_gqa: 4 query heads per cached row)",
      std::string(counters_.attention_split_calls ? "active" : "inactive") +
          ": split decode attention for long contexts (attention_split + attention_split_reduce: fixed blocks of " +
          std::to_string(split_block_) + " rows once the context reaches " + std::to_string(split_min_) +
          " rows, decided on the GPU; " + std::to_string(counters_.attention_split_calls) + " calls encoded split, " +
          std::to_string(counters_.attention_unsplit_calls) + " decode calls not" +
          (counters_.attention_unsplit_calls ? ", the last for " + counters_.attention_unsplit_reason : std::string()) +
          ")",
      "inactive: Metal 4 tensor-op GEMM",
  };
  return v;
}

}  // namespace lily::metal
