// CPU backend: buffers, mappings, the immediate and deferred execution modes, embedding, residual add,
// copies, matmul dispatch and the report.
#include "cpu/backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <thread>

#include <sys/mman.h>

#include "cpu/alloc_guard.h"
#include "model/config.h"

namespace lily::cpu {

namespace {
// Buffers of at least kMapBytes are mapped straight from the kernel and unmapped on release. Through
// malloc, a freed multi-MiB buffer (a KV cache) stays in the arena of the thread that freed it (glibc raises
// its mmap threshold after the first such free, so later ones come from the arenas), and sessions created
// and closed on many threads piled freed memory up: benchmarks/rss_sessions.py, 2026-12-01, +146 MiB RSS
// over 100 sessions on 4 threads while malloc's in-use bytes stayed flat (benchmarks/NOTES.md). Mapped
// pages are zero already and become resident only when first written (a KV cache row by row).
// Sanitizer builds keep malloc, whose bounds ASan checks.
constexpr size_t kMapBytes = size_t(64) << 10;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kMapLarge = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kMapLarge = false;
#else
constexpr bool kMapLarge = true;
#endif
#else
constexpr bool kMapLarge = true;
#endif

// Zeroed memory of `bytes` (a multiple of 64), 64-byte aligned; nullptr when the system has none.
void* buffer_alloc(size_t bytes, bool& mapped) {
  mapped = kMapLarge && bytes >= kMapBytes;
  if (mapped) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;  // page-aligned, zero-filled on first touch
  }
  void* p = std::aligned_alloc(64, bytes);
  if (p) std::memset(p, 0, bytes);
  return p;
}

void buffer_free(void* p, size_t bytes, bool mapped) {
  if (!p) return;
  if (mapped)
    munmap(p, bytes);
  else
    std::free(p);
}
}  // namespace

CpuOps::CpuOps(const CpuOptions& opt)
    : chunks_(new std::atomic<Buffer*>[kChunks]),
      opt_(opt),
      pool_(opt.threads > 0 ? opt.threads : int(std::max(1u, std::thread::hardware_concurrency()))),
      arena_(pool_.size()),
      shuffle_rng_(opt.shuffle_seed) {
  if (opt_.strict_alloc && !alloc_guard_available())
    throw std::invalid_argument(
        "strict_alloc needs the link-time allocation wrappers (GNU ld or lld on Linux), which this build lacks");
  for (int32_t i = 0; i < kChunks; ++i) chunks_[i].store(nullptr, std::memory_order_relaxed);
  if (opt_.deferred) executor_ = std::thread([this] { executor_loop(); });
}

CpuOps::~CpuOps() {
  if (executor_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    executor_.join();
  }
  for (int32_t c = 0; c < kChunks; ++c) {
    Buffer* chunk = chunks_[c].load(std::memory_order_acquire);
    if (!chunk) continue;
    for (int32_t i = 0; i < kChunk; ++i) buffer_free(chunk[i].data, chunk[i].bytes, chunk[i].mapped);
    delete[] chunk;
  }
}

std::string CpuOps::device() const {
  std::string model = "cpu";
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  return model + " (" + std::to_string(pool_.size()) + " threads)";
}

// ---- buffers ----

CpuOps::Buffer& CpuOps::buffer(int32_t id) const {
  Buffer* chunk = chunks_[id / kChunk].load(std::memory_order_acquire);
  return chunk[id % kChunk];
}

Tensor CpuOps::alloc_impl(const std::string& label, DType dtype, int64_t rows, int64_t cols) {
  // Checked before multiplying: shapes come from configs and session files.
  const size_t es = dtype_size(dtype), r = size_t(std::max<int64_t>(rows, 1));
  if (r > (size_t(1) << 46) / es / size_t(cols))
    throw std::invalid_argument("alloc('" + label + "'): [" + std::to_string(rows) + ", " + std::to_string(cols) +
                                "] is larger than any addressable memory");
  const size_t bytes = r * size_t(cols) * es;
  const size_t rounded = (bytes + 63) / 64 * 64;  // 64-byte aligned rows of SIMD loads never leave the block
  bool mapped = false;
  void* p = buffer_alloc(rounded, mapped);
  if (!p)
    throw std::bad_alloc();
  std::lock_guard<std::mutex> lk(mu_);
  int32_t id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    if (next_id_ >= kChunk * kChunks) {
      buffer_free(p, rounded, mapped);
      throw std::runtime_error("cpu backend: too many buffers");
    }
    id = next_id_++;
    if (!chunks_[id / kChunk].load(std::memory_order_acquire))
      chunks_[id / kChunk].store(new Buffer[kChunk], std::memory_order_release);
  }
  buffer(id) = {p, rounded, label, mapped};
  allocated_ += rounded;
  return Tensor::whole(id, dtype, rows, cols);
}

void CpuOps::release(Tensor& t) {
  if (!t.valid()) return;
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& s : unwaited_)
    if (std::count(s->reads.begin(), s->reads.end(), t.buf) || std::count(s->writes.begin(), s->writes.end(), t.buf))
      throw std::logic_error("release of buffer '" + buffer(t.buf).label + "' while a submitted step uses it");
  Buffer& b = buffer(t.buf);
  buffer_free(b.data, b.bytes, b.mapped);
  allocated_ -= b.bytes;
  b = {};
  free_ids_.push_back(t.buf);
  t = Tensor{};
}

void* CpuOps::raw(const Tensor& t) const {
  return static_cast<char*>(buffer(t.buf).data) + t.offset * int64_t(dtype_size(t.dtype));
}
float* CpuOps::f32(const Tensor& t) const { return static_cast<float*>(raw(t)); }
int32_t* CpuOps::i32(const Tensor& t) const { return static_cast<int32_t*>(raw(t)); }
uint16_t* CpuOps::u16(const Tensor& t) const { return static_cast<uint16_t*>(raw(t)); }

Arena CpuOps::arena(const Tensor& ws, const char* op) const {
  return Arena(raw(ws), size_t(ws.rows) * size_t(ws.cols) * dtype_size(ws.dtype), op);
}

void CpuOps::check_host_access(int32_t buf, bool host_writes, const char* what) const {
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& s : unwaited_) {
    const bool writes = std::count(s->writes.begin(), s->writes.end(), buf) > 0;
    const bool reads = std::count(s->reads.begin(), s->reads.end(), buf) > 0;
    if (writes || (host_writes && reads))
      throw std::logic_error(std::string(what) + " of buffer '" + buffer(buf).label + "' while the step with fence " +
                             std::to_string(s->fence) + " (submitted, not waited for) " +
                             (writes ? "writes" : "reads") + " it");
  }
}

void CpuOps::upload_impl(const Tensor& dst, const void* src) {
  if (opt_.deferred) check_host_access(dst.buf, true, "host write");
  const size_t es = dtype_size(dst.dtype), row = size_t(dst.cols) * es;
  char* base = static_cast<char*>(raw(dst));
  for (int64_t r = 0; r < dst.rows; ++r)
    std::memcpy(base + r * dst.stride * es, static_cast<const char*>(src) + r * row, row);
}

void CpuOps::download_impl(const Tensor& src, void* dst) {
  if (opt_.deferred) check_host_access(src.buf, false, "host read");
  const size_t es = dtype_size(src.dtype), row = size_t(src.cols) * es;
  const char* base = static_cast<const char*>(raw(src));
  for (int64_t r = 0; r < src.rows; ++r)
    std::memcpy(static_cast<char*>(dst) + r * row, base + r * src.stride * es, row);
}

int32_t CpuOps::register_mapping(const void* base, size_t, const std::string&) {
  mappings_.push_back(static_cast<const char*>(base));
  return int32_t(mappings_.size() - 1);
}

WeightView CpuOps::view(const Weight& w) const {
  WeightView v;
  static_cast<WeightFormat&>(v) = w;
  v.data = mappings_.at(size_t(w.mapping)) + w.data;
  if (w.quantized()) {
    v.scales = mappings_.at(size_t(w.scale_mapping)) + w.scales;
    v.biases = mappings_.at(size_t(w.bias_mapping)) + w.biases;
  }
  return v;
}

// ---- execution ----

void CpuOps::run_op(OpKind kind, const std::function<void()>* owned, const OpRun* now) {
  if (!opt_.strict_alloc) return owned ? (*owned)() : (*now)();
  AllocGuardScope guard(op_name(kind));
  owned ? (*owned)() : (*now)();
  guard.check();  // "allocation inside a step: ... in <op>"
}

void CpuOps::execute(OpKind kind, const OpRun& run) {
  if (!opt_.deferred) {
    exec_phase_ = phase();
    return run_op(kind, nullptr, &run);
  }
  recording_.push_back({kind, phase(), tracker_.stage(), run.own()});
  rec_reads_.insert(rec_reads_.end(), run.reads.begin(), run.reads.end());
  rec_writes_.insert(rec_writes_.end(), run.writes.begin(), run.writes.end());
}

uint64_t CpuOps::submit_impl() {
  const uint64_t fence = ++last_fence_;
  if (!opt_.deferred) return fence;
  auto s = std::make_shared<Submission>();
  s->fence = fence;
  s->ops = std::move(recording_);
  s->reads = std::move(rec_reads_);
  s->writes = std::move(rec_writes_);
  recording_.clear();
  rec_reads_.clear();
  rec_writes_.clear();
  // The ops of one stage are independent by their declarations: run them in a shuffled order, so a
  // missing declaration shows up as a wrong result instead of hiding behind the recorded order.
  if (opt_.shuffle_seed) {
    auto& ops = s->ops;
    for (size_t b = 0; b < ops.size();) {
      size_t e = b;
      while (e < ops.size() && ops[e].stage == ops[b].stage) ++e;
      std::shuffle(ops.begin() + int64_t(b), ops.begin() + int64_t(e), shuffle_rng_);
      b = e;
    }
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(s);
    unwaited_.push_back(s);
  }
  cv_.notify_all();
  return fence;
}

void CpuOps::abandon_impl() {
  recording_.clear();
  rec_reads_.clear();
  rec_writes_.clear();
}

void CpuOps::executor_loop() {
  for (;;) {
    std::shared_ptr<Submission> s;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      s = queue_.front();
    }
    std::exception_ptr err;
    try {
      for (const RecordedOp& op : s->ops) {
        exec_phase_ = op.phase;
        run_op(op.kind, &op.run, nullptr);
      }
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.pop_front();
      done_fence_ = s->fence;
      if (err && !failure_) failure_ = err;
    }
    cv_.notify_all();
  }
}

void CpuOps::wait(uint64_t fence) {
  if (!opt_.deferred) return;
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return done_fence_ >= fence; });
  unwaited_.erase(std::remove_if(unwaited_.begin(), unwaited_.end(),
                                 [&](const std::shared_ptr<Submission>& s) { return s->fence <= fence; }),
                  unwaited_.end());
  if (failure_) {
    std::exception_ptr e = failure_;
    failure_ = nullptr;
    std::rethrow_exception(e);
  }
}

// ---- small ops ----

void CpuOps::embed_impl(const Tensor& ids, const Weight& table, const Tensor& out) {
  const int32_t* id = i32(ids);
  const WeightView W = view(table);
  float* o = f32(out);
  for (int64_t t = 0; t < out.rows; ++t) dequant_row(W, id[t * ids.stride], o + t * out.stride);
}

void CpuOps::add_impl(const Tensor& a, const Tensor& b, const Tensor& out) {
  const float *pa = f32(a), *pb = f32(b);
  float* po = f32(out);
  for (int64_t t = 0; t < out.rows; ++t)
    for (int64_t i = 0; i < out.cols; ++i)
      po[t * out.stride + i] = pa[t * a.stride + i] + pb[t * b.stride + i];
}

void CpuOps::copy_impl(const Tensor& src, const Tensor& dst) {
  if (src.rows != dst.rows || src.cols != dst.cols) throw std::logic_error("copy: source and destination differ in shape");
  if (src.dtype == dst.dtype) {
    const size_t es = dtype_size(src.dtype), row = size_t(src.cols) * es;
    const char* s = static_cast<const char*>(raw(src));
    char* d = static_cast<char*>(raw(dst));
    for (int64_t r = 0; r < src.rows; ++r) std::memmove(d + r * dst.stride * es, s + r * src.stride * es, row);
    return;
  }
  // KV rows between an f32 and a bf16 cache (snapshots restored into a session of the other dtype).
  if (src.dtype == DType::BF16 && dst.dtype == DType::F32) {
    for (int64_t r = 0; r < src.rows; ++r)
      for (int64_t c = 0; c < src.cols; ++c) f32(dst)[r * dst.stride + c] = bf16_to_f32(u16(src)[r * src.stride + c]);
  } else if (src.dtype == DType::F32 && dst.dtype == DType::BF16) {
    for (int64_t r = 0; r < src.rows; ++r)
      for (int64_t c = 0; c < src.cols; ++c) u16(dst)[r * dst.stride + c] = f32_to_bf16(f32(src)[r * src.stride + c]);
  } else {
    throw std::logic_error("copy: unsupported dtype conversion");
  }
}

void CpuOps::fill_impl(const Tensor& dst, double value) {
  for (int64_t r = 0; r < dst.rows; ++r) {
    if (dst.dtype == DType::I32) {
      int32_t* p = i32(dst) + r * dst.stride;
      std::fill(p, p + dst.cols, int32_t(value));
    } else if (dst.dtype == DType::F32) {
      float* p = f32(dst) + r * dst.stride;
      std::fill(p, p + dst.cols, float(value));
    } else {
      uint16_t* p = u16(dst) + r * dst.stride;
      std::fill(p, p + dst.cols, f32_to_bf16(float(value)));
    }
  }
}

void CpuOps::advance_position_impl(const Tensor& pos_in, const Tensor& pos_out, int64_t T) {
  *i32(pos_out) = *i32(pos_in) + int32_t(T);
}

void CpuOps::accept_drafts_impl(const Tensor& ids, const Tensor& y, const Tensor& pos_in, const Tensor& accepted,
                                const Tensor& next_id, const Tensor& pos_out) {
  const int64_t k = ids.rows - 1;
  int32_t a = 0;
  while (a < k && i32(y)[a * y.stride] == i32(ids)[(a + 1) * ids.stride]) ++a;
  const int32_t pos = *i32(pos_in);  // read before any write: pos_out may be pos_in
  *i32(accepted) = a;
  *i32(next_id) = i32(y)[a * y.stride];
  *i32(pos_out) = pos + a + 1;
}

void CpuOps::copy_rows_at_impl(const Tensor& src, const Tensor& index, int64_t offset, const Tensor& dst) {
  const int64_t j = int64_t(*i32(index)) + offset, n = dst.rows;
  if (j < 0 || (j + 1) * n > src.rows) return;
  const char* s = static_cast<const char*>(raw(src)) + j * n * src.stride * 4;
  char* d = static_cast<char*>(raw(dst));
  for (int64_t r = 0; r < n; ++r) std::memcpy(d + r * dst.stride * 4, s + r * src.stride * 4, size_t(dst.cols) * 4);
}

void CpuOps::matmul_impl(const Tensor& x, const Weight& w, const Tensor& out) {
  cpu::matmul(f32(x), x.rows, x.stride, view(w), f32(out), out.stride, path(), pool_, arena_);
}

size_t CpuOps::workspace_bytes(const ModelConfig& cfg, int64_t rows, int64_t max_ctx) const {
  const int P = pool_.size();
  size_t need = moe_workspace_bytes(cfg, rows, P);
  if (cfg.n_full()) need = std::max(need, attention_workspace_bytes(cfg, rows, max_ctx, P));
  if (cfg.n_linear()) need = std::max(need, delta_workspace_bytes(cfg, P));
  return std::max(need, sample_workspace_bytes(cfg.vocab));
}

void CpuOps::reserve(const ModelConfig& cfg, int64_t rows) {
  // Every product's K and N: projections, experts, the shared expert, the router and the lm_head.
  const int64_t k = std::max({cfg.hidden, cfg.value_dim(), cfg.heads * cfg.head_dim, cfg.moe_inter,
                              cfg.shared_inter});
  const int64_t n = std::max({cfg.vocab, cfg.conv_dim(), 2 * cfg.heads * cfg.head_dim, cfg.experts, k});
  arena_.reserve(rows, k, n);
}

std::string CpuOps::matmul_variant(const Weight& w, Phase phase) const {
  WeightView v;
  static_cast<WeightFormat&>(v) = w;
  return cpu::matmul_variant(v, phase == Phase::Decode ? MatmulPath::Gemv : MatmulPath::Gemm);
}

std::vector<std::string> CpuOps::optimizations() const {
  std::vector<std::string> v = {
      "active: dequantize inside matmul tiles (4/8-bit weights never expanded to a full copy)",
      "active: weights memory-mapped from the checkpoint (no copy)",
      "active: GEMV kernels for decode, tiled GEMM kernels for prefill",
      "active: routed experts grouped by expert (each expert's weights read once per chunk)",
      "active: fused attention q/k preparation (split, RMSNorm, partial RoPE in one pass)",
      "active: GQA packing in attention (each cached K/V row read once for its group of query heads)",
      "active: fused causal conv + silu; fused gated RMSNorm + silu(z)",
      "active: chunked prefill with bounded scratch",
      "active: sampling as an op (state in backend buffers; the id goes straight into the next step's slot)",
      "active: decode pipelined one step ahead (the host reads id n while step n+1 is submitted)",
      "active: " + std::to_string(pool_.size()) + " threads (a persistent pool; loops split over rows, heads or channels)",
      "inactive: concurrent dispatch (CPU runs ops in order; stages are counted for GPU backends)",
      "opt-in: bf16 KV cache (Engine(kv_cache_dtype='bf16'): half the bytes per token; the default keeps the "
      "oracle's fp32)",
      "opt-in: MTP speculative decoding (generate(mtp='on', mtp_k=1..4) on a checkpoint with an MTP head; "
      "report()['mtp'])",
      "inactive: split (fixed-block) attention for long contexts (CPU parallelises over query rows and heads)",
  };
  if (opt_.deferred)
    v.push_back("debug: deferred execution (ops recorded, run at submit on an executor thread" +
                std::string(opt_.shuffle_seed ? ", stage order shuffled" : "") + "; host access to in-flight buffers fails)");
  if (opt_.strict_alloc) v.push_back("debug: strict allocation (an op that allocates heap memory fails)");
  return v;
}

}  // namespace lily::cpu

namespace lily::cpu {

// Peak fp32 FMA rate of this machine: each thread runs 8 independent 16-lane multiply-add chains that
// stay in registers (enough in flight to cover the FMA latency). The roofline for the benchmarks.
double measure_fma_peak(int threads, double seconds) {
  ThreadPool pool(threads);
  std::vector<double> flops(size_t(pool.size()), 0.0);
  pool.parallel_for(pool.size(), 1, [&](int64_t b, int64_t e, int tid) {
    for (int64_t r = b; r < e; ++r) {
      float acc[8][16];
      for (int i = 0; i < 8; ++i)
        for (int l = 0; l < 16; ++l) acc[i][l] = float(l + i) * 1e-3f;
      const float m = 0.999999f, a = 1e-7f;
      auto t0 = std::chrono::steady_clock::now();
      int64_t iters = 0;
      do {
        for (int k = 0; k < 4096; ++k)
          for (int i = 0; i < 8; ++i)
            for (int l = 0; l < 16; ++l) acc[i][l] = acc[i][l] * m + a;
        iters += 4096;
      } while (std::chrono::steady_clock::now() - t0 < std::chrono::duration<double>(seconds));
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      float sink = 0.f;
      for (int i = 0; i < 8; ++i)
        for (int l = 0; l < 16; ++l) sink += acc[i][l];
      flops[size_t(tid)] = double(iters) * 8 * 16 * 2 / dt + (sink == 12345.f ? 1.0 : 0.0);
    }
  });
  double total = 0.0;
  for (double f : flops) total += f;
  return total;
}

}  // namespace lily::cpu
