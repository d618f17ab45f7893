// The CUDA backend's core (backend.h): device and context, memory, weights, steps (launch lists, CUDA
// graphs for decode, fences), host transfers, and the backend's own small ops.
#include "cuda/backend.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdio>

#include "model/config.h"

namespace lily::cuda {

// Why programmatic dependent launch is off when the option says so (the report's line).
constexpr const char* PDL_OFF_WHY = "pdl=False: the default is \"decode\", +16% decode at 4K on the H200";

std::string cached_module(const std::string& dir, const std::string& family, const Defines& defines, int arch,
                          bool* hit, double* seconds);
std::string default_cache_dir();

namespace {

const Driver& drv() { return driver(); }

std::string gib(double bytes) {  // snprintf, not iostreams (see compile.cpp)
  char b[48];
  std::snprintf(b, sizeof b, "%.3g GiB", bytes / double(1ull << 30));
  return b;
}

}  // namespace

Availability availability() {
  Availability a = availability_detail();
  if (!a.usable) a.status = "built, but not usable here: " + a.status;
  return a;
}

Availability availability_detail() {
  Availability a;
  const Driver& d = drv();
  if (!d.loaded) {
    a.status = d.error;
    return a;
  }
  int n = 0;
  if (d.cuDeviceGetCount(&n) != CUDA_SUCCESS || n == 0) {
    a.status = "the NVIDIA driver sees no GPU";
    return a;
  }
  CUdevice dev = 0;
  int major = 0, minor = 0;
  d.cuDeviceGet(&dev, 0);
  d.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  d.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  char name[256] = {0};
  d.cuDeviceGetName(name, sizeof name, dev);
  if (major < 8) {
    a.status = std::string("GPU 0 (") + name + ", sm_" + std::to_string(major * 10 + minor) +
               ") is older than Lily's CUDA kernels need (sm_80 or newer)";
    return a;
  }
  const Nvrtc& r = nvrtc();
  if (!r.loaded) {
    a.status = r.error;
    return a;
  }
  a.usable = true;
  a.status = std::string("built and usable: ") + name + " (sm_" + std::to_string(major * 10 + minor) + "), NVRTC " +
             std::to_string(r.major) + "." + std::to_string(r.minor);
  return a;
}

// ---- modules ----

struct CudaOps::Module {
  CUmodule mod = nullptr;
  std::map<std::string, std::unique_ptr<Kernel>, std::less<>> kernels;  // found by a const char* without a copy
};

// A captured decode step: the launch list it was captured from (compared byte for byte) and its graph.
struct CudaOps::Graph {
  std::vector<unsigned char> key;
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  size_t nodes = 0;
};

CudaOps::CudaOps(const CudaOptions& opt) : opt_(opt) {
  if (opt_.cache_dir.empty()) opt_.cache_dir = default_cache_dir();
  if (opt_.dry_arch) {
    // No device: kernels are compiled for dry_arch and launches recorded, nothing runs (the CI's compile
    // check). The figures are an H200's so variant choices match the real device's.
    info_.name = "dry run (no device; kernels compiled for sm_" + std::to_string(opt_.dry_arch) + ")";
    info_.cc_major = opt_.dry_arch / 10;
    info_.cc_minor = opt_.dry_arch % 10;
    info_.sms = 132;
    info_.max_smem_optin = 227 * 1024;
    info_.l2_bytes = 50 << 20;
    info_.total_mem = size_t(141) << 30;
    norm_counters_ = CUdeviceptr(1) << 52;
    pdl_active_ = opt_.pdl != CudaOptions::Pdl::Off && info_.cc_major >= 9;  // compiles what a device would run
    return;
  }
  const Availability a = availability_detail();
  if (!a.usable) throw std::runtime_error("the CUDA backend is not usable here: " + a.status);
  const Driver& d = drv();
  int n = 0;
  check(d.cuDeviceGetCount(&n), "cuDeviceGetCount");
  if (opt_.device < 0 || opt_.device >= n)
    throw std::invalid_argument("CUDA device " + std::to_string(opt_.device) + " does not exist (" +
                                std::to_string(n) + " visible)");
  CUdevice dev = 0;
  check(d.cuDeviceGet(&dev, opt_.device), "cuDeviceGet");
  char name[256] = {0};
  d.cuDeviceGetName(name, sizeof name, dev);
  info_.name = name;
  info_.ordinal = opt_.device;
  auto attr = [&](int a) {
    int v = 0;
    check(d.cuDeviceGetAttribute(&v, a, dev), "cuDeviceGetAttribute");
    return v;
  };
  info_.cc_major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  info_.cc_minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  info_.sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  info_.max_threads = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  info_.max_smem_optin = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
  info_.l2_bytes = attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
  // Double data rate: bytes/s = 2 · clock (kHz) · 1000 · bus width (bits) / 8.
  info_.peak_bandwidth = 2.0 * attr(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE) * 1e3 *
                         attr(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH) / 8.0;
  check(d.cuDeviceTotalMem_v2(&info_.total_mem, dev), "cuDeviceTotalMem");
  pdl_active_ = opt_.pdl != CudaOptions::Pdl::Off && info_.cc_major >= 9 && d.cuLaunchKernelEx != nullptr;
  check(d.cuDevicePrimaryCtxRetain(&ctx_, dev), "cuDevicePrimaryCtxRetain");
  try {
    check(d.cuCtxSetCurrent(ctx_), "cuCtxSetCurrent");
    check(d.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    check(d.cuStreamCreate(&copy_stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    for (int i = 0; i + 1 < kBranchLanes; ++i) {  // graph branches (kBranchLanes)
      CUstream st = nullptr;
      CUevent ev = nullptr;
      check(d.cuStreamCreate(&st, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
      side_streams_.push_back(st);
      check(d.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      join_events_.push_back(ev);
    }
    check(d.cuEventCreate(&fork_event_, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    staging_bytes_ = size_t(4) << 20;
    check(d.cuMemAllocHost_v2(&staging_, staging_bytes_), "cuMemAllocHost (transfer staging)");
    check(d.cuMemAlloc_v2(&norm_counters_, kCounterBytes), "cuMemAlloc (arrival counters)");
    check(d.cuMemsetD8Async(norm_counters_, 0, kCounterBytes, copy_stream_), "cuMemsetD8Async");
    check(d.cuStreamSynchronize(copy_stream_), "cuStreamSynchronize");
  } catch (...) {
    if (norm_counters_) d.cuMemFree_v2(norm_counters_);
    if (staging_) d.cuMemFreeHost(staging_);
    for (CUstream st : side_streams_) d.cuStreamDestroy_v2(st);
    for (CUevent ev : join_events_) d.cuEventDestroy_v2(ev);
    if (fork_event_) d.cuEventDestroy_v2(fork_event_);
    if (stream_) d.cuStreamDestroy_v2(stream_);
    if (copy_stream_) d.cuStreamDestroy_v2(copy_stream_);
    d.cuDevicePrimaryCtxRelease_v2(dev);
    throw;
  }
}

CudaOps::~CudaOps() {
  if (opt_.dry_arch || !ctx_) return;
  const Driver& d = drv();
  d.cuCtxSetCurrent(ctx_);
  d.cuStreamSynchronize(stream_);  // nothing may still run on memory freed below (errors ignored: teardown)
  d.cuStreamSynchronize(copy_stream_);
  for (auto& g : graphs_) {
    if (g->exec) d.cuGraphExecDestroy(g->exec);
    if (g->graph) d.cuGraphDestroy(g->graph);
  }
  for (auto& [k, m] : modules_)
    if (m->mod) d.cuModuleUnload(m->mod);
  for (Buffer& b : buffers_)
    if (b.ptr) d.cuMemFree_v2(b.ptr);
  for (Mapping& m : mappings_)
    if (m.ptr) d.cuMemFree_v2(m.ptr);
  for (auto& [f, e] : pending_) d.cuEventDestroy_v2(e);
  for (CUevent e : spare_events_) d.cuEventDestroy_v2(e);
  for (auto* v : {&replay_timing_, &spare_timing_})
    for (auto& [a, b] : *v) d.cuEventDestroy_v2(a), d.cuEventDestroy_v2(b);
  for (CUstream st : side_streams_) d.cuStreamDestroy_v2(st);
  for (CUevent ev : join_events_) d.cuEventDestroy_v2(ev);
  if (fork_event_) d.cuEventDestroy_v2(fork_event_);
  if (staging_) d.cuMemFreeHost(staging_);
  if (norm_counters_) d.cuMemFree_v2(norm_counters_);
  d.cuStreamDestroy_v2(stream_);
  d.cuStreamDestroy_v2(copy_stream_);
  CUdevice dev = 0;
  if (d.cuDeviceGet(&dev, opt_.device) == CUDA_SUCCESS) d.cuDevicePrimaryCtxRelease_v2(dev);
}

std::string CudaOps::device() const {
  if (opt_.dry_arch) return info_.name;
  return info_.name + " (sm_" + std::to_string(info_.arch()) + ", " + std::to_string(info_.sms) + " SMs, " +
         gib(double(info_.total_mem)) + ")";
}

void CudaOps::bind_context() const {
  if (opt_.dry_arch) return;
  ensure_usable();
  check(drv().cuCtxSetCurrent(ctx_), "cuCtxSetCurrent");
}

void CudaOps::ensure_usable() const {
  if (!fault_.empty())
    throw std::runtime_error("the CUDA device reported a fault earlier (" + fault_ +
                             "); its context is lost: close this engine and load the model again");
}

void CudaOps::fault(const CudaError& e) {
  if (e.sticky() && fault_.empty()) fault_ = e.what();
}

template <class F>
void CudaOps::guarded(F&& f) {
  try {
    f();
  } catch (const CudaError& e) {
    fault(e);
    throw;
  }
}

// ---- memory ----

Tensor CudaOps::alloc_impl(const std::string& label, DType dtype, int64_t rows, int64_t cols) {
  forget_encodings();  // buffer ids and mappings may now stand for other addresses
  const size_t bytes = std::max<size_t>(size_t(rows) * size_t(cols) * dtype_size(dtype), 4);
  Buffer b;
  b.bytes = bytes;
  b.label = label;
  if (opt_.dry_arch) {
    b.ptr = (CUdeviceptr(buffers_.size() + 1) << 40);
  } else {
    bind_context();
    const CUresult r = drv().cuMemAlloc_v2(&b.ptr, bytes);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      size_t free_b = 0, total = 0;
      drv().cuMemGetInfo_v2(&free_b, &total);
      throw std::runtime_error("out of GPU memory allocating '" + label + "' (" + gib(double(bytes)) + "; " +
                               gib(double(free_b)) + " of " + gib(double(total)) + " free on " + info_.name +
                               "): use a smaller max_context or prefill_chunk");
    }
    guarded([&] { check(r, ("cuMemAlloc ('" + label + "')").c_str()); });
    guarded([&] {
      check(drv().cuMemsetD8Async(b.ptr, 0, bytes, copy_stream_), "cuMemsetD8Async");
      check(drv().cuStreamSynchronize(copy_stream_), "cuStreamSynchronize");
    });
  }
  int32_t id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
    buffers_[size_t(id)] = b;
  } else {
    id = int32_t(buffers_.size());
    buffers_.push_back(b);
  }
  allocated_ += bytes;
  return Tensor::whole(id, dtype, rows, cols);
}

void CudaOps::release(Tensor& t) {
  if (!t.valid()) return;  // (an empty handle: nothing moves, the memos stay)
  forget_encodings();  // buffer ids and mappings may now stand for other addresses
  Buffer& b = buffers_.at(size_t(t.buf));
  if (b.ptr && !opt_.dry_arch && fault_.empty()) {
    drv().cuCtxSetCurrent(ctx_);
    // Work still queued may use the buffer: the frees of a session come after its last wait, but a
    // release after an abandoned step must not race it.
    drv().cuStreamSynchronize(stream_);
    drv().cuMemFree_v2(b.ptr);
  }
  allocated_ -= b.bytes;
  b = Buffer{};
  free_ids_.push_back(t.buf);
  t = Tensor{};
}

CUdeviceptr CudaOps::ptr(const Tensor& t) const {
  return buffers_.at(size_t(t.buf)).ptr + CUdeviceptr(t.offset) * dtype_size(t.dtype);
}

CUdeviceptr CudaOps::ptr(int32_t mapping, uint64_t offset) const {
  const Mapping& m = mappings_.at(size_t(mapping));
  if (!m.ptr && !opt_.dry_arch)
    throw std::logic_error("weight in mapping '" + m.label + "' was never placed on the device (place_weights)");
  return m.ptr + offset;
}

int32_t CudaOps::register_mapping(const void* base, size_t bytes, const std::string& label) {
  forget_encodings();  // buffer ids and mappings may now stand for other addresses
  // Host regions only: place_weights copies the parts the model uses to the device, each aligned.
  Mapping m;
  m.host = static_cast<const char*>(base);
  m.bytes = bytes;
  m.label = label;
  mappings_.push_back(m);
  return int32_t(mappings_.size() - 1);
}

// Every byte range a weight reads (codes, scales, biases; all experts of a stacked one) is copied into
// one device buffer per range at a 256-byte aligned address; overlapping ranges (tied embeddings, a
// stacked span) are merged. Only what the model uses reaches the GPU, and every tensor starts aligned
// whatever its offset in the file.
void CudaOps::place_weights(const std::vector<Weight*>& weights) {
  forget_encodings();  // buffer ids and mappings may now stand for other addresses
  struct Part {
    int32_t mapping;
    uint64_t begin, end;
  };
  std::vector<Part> parts;
  auto span = [](const Weight& w, size_t one, uint64_t stride) {
    return uint64_t(w.experts > 1 ? stride * uint64_t(w.experts - 1) : 0) + one;
  };
  for (const Weight* w : weights) {
    if (!w->valid()) continue;
    if (!mappings_.at(size_t(w->mapping)).host) continue;  // already on the device
    parts.push_back({w->mapping, w->data, w->data + span(*w, w->row_bytes() * size_t(w->rows), w->data_stride)});
    if (w->quantized()) {
      parts.push_back({w->scale_mapping, w->scales, w->scales + span(*w, w->scale_bytes(), w->scale_stride)});
      parts.push_back({w->bias_mapping, w->biases, w->biases + span(*w, w->scale_bytes(), w->bias_stride)});
    }
  }
  std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) {
    return a.mapping != b.mapping ? a.mapping < b.mapping : a.begin < b.begin;
  });
  std::vector<Part> merged;
  for (const Part& p : parts) {
    if (!merged.empty() && merged.back().mapping == p.mapping && p.begin < merged.back().end)
      merged.back().end = std::max(merged.back().end, p.end);
    else
      merged.push_back(p);
  }
  size_t need = 0;
  for (const Part& p : merged) need += (p.end - p.begin + 255) / 256 * 256;
  if (!opt_.dry_arch) {
    bind_context();
    size_t free_b = 0, total = 0;
    check(drv().cuMemGetInfo_v2(&free_b, &total), "cuMemGetInfo");
    if (need > free_b)
      throw std::runtime_error("out of GPU memory loading the weights: they need " + gib(double(need)) + " but " +
                               gib(double(free_b)) + " of " + gib(double(total)) + " are free on " + info_.name);
  }
  // New mappings (device copies), and where each old (mapping, offset) went.
  struct Placed {
    Part src;
    int32_t id;
  };
  std::vector<Placed> placed;
  {
    mappings_.reserve(mappings_.size() + merged.size());
    for (const Part& p : merged) {
      const Mapping src = mappings_.at(size_t(p.mapping));  // a copy: mappings_ grows below
      if (p.end > src.bytes)
        throw std::invalid_argument("weight bytes [" + std::to_string(p.begin) + ", " + std::to_string(p.end) +
                                    ") lie outside '" + src.label + "' (" + std::to_string(src.bytes) + " bytes)");
      Mapping m;
      m.label = src.label;
      m.bytes = p.end - p.begin;
      if (opt_.dry_arch) {
        m.ptr = (CUdeviceptr(mappings_.size() + 1) << 44);
      } else {
        const CUresult r = drv().cuMemAlloc_v2(&m.ptr, m.bytes);
        if (r == CUDA_ERROR_OUT_OF_MEMORY)
          throw std::runtime_error("out of GPU memory placing weights of '" + src.label + "' (" +
                                   gib(double(m.bytes)) + "; all weights need " + gib(double(need)) + ")");
        guarded([&] { check(r, "cuMemAlloc (weights)"); });
        mappings_.push_back(m);  // owned from here: freed by the destructor even if a copy fails
        // Pageable host memory (the checkpoint mapping): the driver stages it; in chunks so page faults
        // of the mapped file overlap the copies.
        const size_t chunk = size_t(256) << 20;
        for (size_t off = 0; off < m.bytes; off += chunk)
          guarded([&] {
            check(drv().cuMemcpyHtoDAsync_v2(m.ptr + off, src.host + p.begin + off, std::min(chunk, m.bytes - off),
                                             copy_stream_),
                  "cuMemcpyHtoDAsync (weights)");
          });
        guarded([&] { check(drv().cuStreamSynchronize(copy_stream_), "cuStreamSynchronize (weights)"); });
        placed.push_back({p, int32_t(mappings_.size() - 1)});
        mapped_bytes_ += m.bytes;
        continue;
      }
      mappings_.push_back(m);
      placed.push_back({p, int32_t(mappings_.size() - 1)});
      mapped_bytes_ += m.bytes;
    }
  }
  auto move = [&](int32_t& mapping, uint64_t& offset) {
    for (const Placed& p : placed)
      if (p.src.mapping == mapping && offset >= p.src.begin && offset < p.src.end) {
        mapping = p.id;
        offset -= p.src.begin;
        return;
      }
  };
  for (Weight* w : weights) {
    if (!w->valid()) continue;
    auto relocate = [&](int32_t& mapping, uint64_t& offset) {
      if (mappings_.at(size_t(mapping)).host) move(mapping, offset);  // not yet a device copy
    };
    relocate(w->mapping, w->data);
    if (w->quantized()) {
      relocate(w->scale_mapping, w->scales);
      relocate(w->bias_mapping, w->biases);
    }
  }
}

size_t CudaOps::workspace_bytes(const ModelConfig& cfg, int64_t rows, int64_t max_ctx) const {
  size_t need = moe_workspace_bytes(cfg, rows);
  if (cfg.n_full()) need = std::max(need, attention_workspace_bytes(cfg, rows, max_ctx));
  if (cfg.n_linear()) need = std::max(need, delta_workspace_bytes(cfg, rows, options().delta_chunk_rows));
  return std::max(need, sample_workspace_bytes(cfg.vocab));
}

void CudaOps::reserve(const ModelConfig& cfg, int64_t rows) {
  // The widest input of any prefill matmul of the model: the projections (hidden), o_proj and out_proj (the heads'
  // and the value heads' width), the shared expert's down (its intermediate), the MTP block's fc (2 · hidden).
  const int64_t cols = std::max({2 * cfg.hidden, cfg.heads * cfg.head_dim, cfg.value_dim(), cfg.shared_inter, cfg.moe_inter});
  reserve_matmul(rows, cols);
}

std::map<std::string, size_t> CudaOps::memory_by_kind() const {
  std::map<std::string, size_t> m;
  m["weights"] = mapped_bytes_;
  for (const Buffer& b : buffers_) {
    if (!b.ptr) continue;
    const std::string& l = b.label;
    const char* kind = l == "kv_cache"                                ? "kv_cache"
                       : l == "recurrent_state" || l == "conv_state" ? "recurrent_state"
                       : l == "workspace"                            ? "workspace"
                       // session snapshots (prefix-cache checkpoints) and the engine's checkpoint reserve
                       : l.rfind("snapshot_", 0) == 0 || l.rfind("checkpoint_reserve_", 0) == 0 ? "snapshots"
                       : l.rfind("layers.", 0) == 0 || l == "final_norm" ? "weights_small"
                                                                     : "activations_and_other";
    m[kind] += b.bytes;
  }
  return m;
}

// ---- kernels ----

std::vector<std::string> CudaOps::families() {
  std::vector<std::string> f;
  for (const std::string& n : kernel_files())
    if (n.size() > 3 && n.compare(n.size() - 3, 3, ".cu") == 0) f.push_back(n.substr(0, n.size() - 3));
  return f;
}

const Kernel& CudaOps::kernel(const std::string& family, const char* name, const Defines& defines) {
  // Every launch of a step being encoded looks its kernel up: the key is built in place (no temporaries).
  std::string& key = kernel_key_;
  key.assign(family);
  for (const auto& [k, v] : defines) {
    char num[24];
    const auto end = std::to_chars(num, num + sizeof num, v).ptr;
    key += ' ';
    key += k;
    key += '=';
    key.append(num, end);
  }
  auto it = modules_.find(key);
  if (it == modules_.end()) {
    auto m = std::make_unique<Module>();
    bool hit = false;
    double secs = 0;
    const std::string cubin = cached_module(opt_.cache_dir, family, defines, info_.arch(), &hit, &secs);
    ++compile_stats_.modules;
    (hit ? compile_stats_.cache_hits : compile_stats_.compiled) += 1;
    compile_stats_.compile_seconds += secs;
    if (!opt_.dry_arch) {
      bind_context();
      guarded([&] { check(drv().cuModuleLoadData(&m->mod, cubin.data()), ("cuModuleLoadData (" + key + ")").c_str()); });
    }
    it = modules_.emplace(key, std::move(m)).first;
  }
  Module& m = *it->second;
  auto k = m.kernels.find(name);
  if (k == m.kernels.end()) {
    auto kr = std::make_unique<Kernel>();
    kr->family = family;
    kr->name = name;
    kr->module = key;
    if (!opt_.dry_arch)
      guarded([&] {
        check(drv().cuModuleGetFunction(&kr->fn, m.mod, name),
              ("cuModuleGetFunction ('" + std::string(name) + "' in kernels/" + family + ".cu)").c_str());
        if (opt_.smem_carveout >= 0)
          check(drv().cuFuncSetAttribute(kr->fn, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, opt_.smem_carveout),
                "cuFuncSetAttribute (shared memory carveout)");
        check(drv().cuFuncGetAttribute(&kr->registers, CU_FUNC_ATTRIBUTE_NUM_REGS, kr->fn), "cuFuncGetAttribute (registers)");
        check(drv().cuFuncGetAttribute(&kr->local_bytes, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, kr->fn),
              "cuFuncGetAttribute (local memory)");
        check(drv().cuFuncGetAttribute(&kr->static_smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kr->fn),
              "cuFuncGetAttribute (static shared memory)");
      });
    k = m.kernels.emplace(name, std::move(kr)).first;
  }
  return *k->second;
}

void CudaOps::set_dynamic_smem(const Kernel& k, int bytes, int static_bytes) {
  if (bytes + static_bytes > info_.max_smem_optin)
    throw std::invalid_argument("kernel '" + k.name + "' asks for " + std::to_string(bytes + static_bytes) +
                                " bytes of shared memory; " + info_.name + " allows " +
                                std::to_string(info_.max_smem_optin));
  // Past 48 KB in all (static arrays included) a launch needs the opt-in attribute for its dynamic part.
  if (bytes + static_bytes <= k.max_dynamic_smem) return;
  if (!opt_.dry_arch)
    guarded([&] {
      check(drv().cuFuncSetAttribute(k.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes),
            "cuFuncSetAttribute (dynamic shared memory)");
    });
  const_cast<Kernel&>(k).max_dynamic_smem = bytes + static_bytes;
}

void CudaOps::allow_large_clusters(const Kernel& k) {
  if (k.large_clusters) return;
  if (!opt_.dry_arch)
    guarded([&] {
      check(drv().cuFuncSetAttribute(k.fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
            "cuFuncSetAttribute (clusters of more than 8 blocks)");
    });
  const_cast<Kernel&>(k).large_clusters = true;
}

void CudaOps::note_variant(const std::string& key, const std::string& variant) { variants_[key] = variant; }

std::vector<KernelResources> CudaOps::kernel_resources() {
  std::vector<KernelResources> out;
  if (!opt_.dry_arch && fault_.empty()) bind_context();
  for (const auto& [key, m] : modules_)
    for (const auto& [name, k] : m->kernels) {
      KernelResources r;
      r.kernel = k.get();
      for (const auto& [threads, smem] : k->configs) {
        KernelResources::Config c;
        c.threads = threads;
        c.dynamic_smem = smem;
        // After a sticky fault the context is gone: the counts stay unknown rather than failing the report.
        if (!opt_.dry_arch && fault_.empty() &&
            drv().cuOccupancyMaxActiveBlocksPerMultiprocessor(&c.blocks_per_sm, k->fn, int(threads), smem) != CUDA_SUCCESS)
          c.blocks_per_sm = -1;
        r.configs.push_back(c);
      }
      out.push_back(std::move(r));
    }
  return out;
}

// ---- steps ----

void CudaOps::record_launch(Launch& l) {
  if (!in_step()) throw std::logic_error("kernel launch recorded outside a step");
  if (l.grid.x == 0 || l.grid.y == 0 || l.grid.z == 0) {  // nothing to do (an empty view): no launch
    args_.resize(l.args_at);
    return;
  }
  l.stage = stage_;
  l.op = op_;
  if (launches_.empty()) encode_t0_ = std::chrono::steady_clock::now();
  launches_.push_back(l);
}

void CudaOps::on_stage_boundary() {
  ++stage_;
  stage_op0_ = op_ + 1;  // the op about to execute opens the stage
}

void CudaOps::execute(OpKind kind, const OpRun& run) {
  ++op_;  // launches recorded by this op's *_impl carry this number (they run in order, on one lane)
  // Decode steps and speculative iterations memoise into memo_ (encode_memo), prefill steps into prefill_memo_.
  const bool decode_memo = opt_.encode_memo && replayable();
  const bool prefill_memo = !decode_memo && opt_.prefill_memo && phase() == Phase::Prefill && !once();
  if (!decode_memo && !prefill_memo) return run();
  auto& memo = decode_memo ? memo_ : prefill_memo_;
  memo_key_.assign(1, char(kind));
  memo_key_ += char(xrow_slot());  // the op's f16 x rows slot (matmul.cpp, XROW)
  run.append_key(memo_key_);
  const size_t hash = std::hash<std::string>{}(memo_key_);
  auto it = memo.find(hash);
  if (it != memo.end() && it->second.key == memo_key_) {
    for (const Launch& m : it->second.launches) {
      Launch l = m;
      l.args_at = args_base_ = args_.size();
      args_.insert(args_.end(), it->second.args.begin() + long(m.args_at), it->second.args.begin() + long(m.args_at + m.args_len));
      l.stage = stage_;
      l.op = op_;
      if (launches_.empty()) encode_t0_ = std::chrono::steady_clock::now();
      launches_.push_back(l);
    }
    ++(decode_memo ? graph_stats_.memo_hits : graph_stats_.prefill_memo_hits);
    return;
  }
  if (prefill_memo && prefill_seen_.insert(hash).second) {
    // A prefill op is recorded at its second sighting: a prompt in a fresh session (new buffers, keys never seen
    // again) pays a hash per op instead of an entry's copies (those cost an H100 host ~0.8 ms a chunk of the real
    // model: benchmarks/NOTES.md, "CUDA prefill: the encode memo for prefill steps").
    if (prefill_seen_.size() > 4 * kPrefillMemoEntries) prefill_seen_.clear();
    ++graph_stats_.prefill_memo_misses;
    return run();
  }
  const size_t first = launches_.size();
  memo_skip_ = false;
  run();
  ++(decode_memo ? graph_stats_.memo_misses : graph_stats_.prefill_memo_misses);
  if (memo_skip_) return;  // its launches depend on more than its arguments
  MemoEntry e;
  e.key = memo_key_;
  for (size_t i = first; i < launches_.size(); ++i) {
    Launch l = launches_[i];
    const size_t at = l.args_at;
    l.args_at = e.args.size();
    e.args.insert(e.args.end(), args_.begin() + long(at), args_.begin() + long(at + l.args_len));
    e.launches.push_back(l);
  }
  // Bounds against runaway growth: decode keeps what it has, prefill (prompt lengths without end) starts again.
  if (!decode_memo && memo.size() >= kPrefillMemoEntries) memo.clear();
  if (!decode_memo || memo.size() < 65536) memo.insert_or_assign(hash, std::move(e));  // (another key of this hash goes)
}

void CudaOps::issue(const Launch& l, CUstream s) {
  size_t size = l.args_len;
  void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, const_cast<unsigned char*>(args_.data() + l.args_at),
                   CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
  CUresult r;
  if (pdl_now()) {
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig cfg{l.grid.x, l.grid.y, l.grid.z, l.block.x, l.block.y, l.block.z, l.smem, s, &attr, 1};
    r = drv().cuLaunchKernelEx(&cfg, l.fn, nullptr, extra);
  } else {
    r = drv().cuLaunchKernel(l.fn, l.grid.x, l.grid.y, l.grid.z, l.block.x, l.block.y, l.block.z, l.smem, s, nullptr,
                             extra);
  }
  if (r != CUDA_SUCCESS)
    throw CudaError("launch of '" + l.kernel->name + "' (kernels/" + l.kernel->family + ".cu) failed: " +
                        error_text(r),
                    r, is_sticky(r));
}

// The launch list as bytes: kernel, geometry and arguments (what makes two decode steps the same graph).
static void append_key(std::vector<unsigned char>& key, const void* p, size_t n) {
  const auto* c = static_cast<const unsigned char*>(p);
  key.insert(key.end(), c, c + n);
}

void CudaOps::end_step_encoding() {
  launches_.clear();
  args_.clear();
  stage_ = 0;
  op_ = 0;
  stage_op0_ = 1;
  xrows_op_ = -1;  // the next step's op numbers start again: no slot is known to hold its x rows
}

// A hash of each launch's kernel, geometry, stage, op number and argument bytes, 8 bytes at a time (FNV-1a's
// step on words: a dry decode step's ~60 KB of arguments byte by byte would double its host time).
uint64_t CudaOps::digest_launches(const std::vector<Launch>& launches, const std::vector<unsigned char>& args) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, c + i, 8);
      h = (h ^ w) * 1099511628211ull;
    }
    for (; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
    h ^= n;
  };
  for (const Launch& l : launches) {
    mix(l.kernel->module.data(), l.kernel->module.size());
    mix(l.kernel->name.data(), l.kernel->name.size());
    mix(&l.grid, sizeof l.grid);
    mix(&l.block, sizeof l.block);
    mix(&l.smem, sizeof l.smem);
    mix(&l.stage, sizeof l.stage);
    mix(&l.op, sizeof l.op);
    mix(args.data() + l.args_at, l.args_len);
  }
  return h;
}

uint64_t CudaOps::submit_impl() {
  const uint64_t fence = ++last_fence_;
  steps_launches_ = int64_t(launches_.size());
  if (speculative()) graph_stats_.last_speculative_launches = steps_launches_;
  if (phase() == Phase::Prefill && !launches_.empty())
    graph_stats_.last_prefill_encode_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - encode_t0_).count();
  if (opt_.dry_arch) {
    if (decode_step() && repeats() && !launches_.empty()) {  // a decode step's host side, without a GPU
      graph_stats_.last_decode_launches = int64_t(launches_.size());
      graph_stats_.last_decode_host_us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - encode_t0_).count();
      graph_stats_.replay_host_us_sum += graph_stats_.last_decode_host_us;
      ++graph_stats_.replay_host_n;
    }
    graph_stats_.last_step_digest = digest_launches(launches_, args_);
    graph_stats_.steps_digest = (graph_stats_.steps_digest ^ graph_stats_.last_step_digest) * 1099511628211ull;
    end_step_encoding();
    done_fence_ = fence;
    return fence;
  }
  bind_context();
  try {
    if (replayable() && opt_.graphs && !launches_.empty()) {
      std::vector<unsigned char> key;
      key.reserve(launches_.size() * 96);
      for (const Launch& l : launches_) {
        append_key(key, &l.fn, sizeof l.fn);
        append_key(key, &l.grid, sizeof l.grid);
        append_key(key, &l.block, sizeof l.block);
        append_key(key, &l.smem, sizeof l.smem);
        const uint64_t n = l.args_len;
        append_key(key, &n, sizeof n);
        append_key(key, args_.data() + l.args_at, l.args_len);
      }
      size_t hit = graphs_.size();
      for (size_t i = 0; i < graphs_.size(); ++i)
        if (graphs_[i]->key == key) {
          hit = i;
          break;
        }
      if (hit == graphs_.size()) {
        const auto capture_t0 = std::chrono::steady_clock::now();
        auto g = std::make_unique<Graph>();
        g->key = std::move(key);
        check(drv().cuStreamBeginCapture_v2(stream_, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture");
        try {
          issue_staged();
        } catch (...) {
          CUgraph broken = nullptr;
          drv().cuStreamEndCapture(stream_, &broken);
          if (broken) drv().cuGraphDestroy(broken);
          throw;
        }
        check(drv().cuStreamEndCapture(stream_, &g->graph), "cuStreamEndCapture");
        check(drv().cuGraphInstantiateWithFlags(&g->exec, g->graph, 0), "cuGraphInstantiate");
        check(drv().cuGraphGetNodes(g->graph, nullptr, &g->nodes), "cuGraphGetNodes");
        ++graph_stats_.captured;
        graph_stats_.capture_us_sum +=
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - capture_t0).count();
        // Least recently used goes: decode's two, plus a speculative iteration's per k and state set and its
        // rollbacks per kept row.
        if (graphs_.size() >= 32) {
          drv().cuGraphExecDestroy(graphs_.back()->exec);
          drv().cuGraphDestroy(graphs_.back()->graph);
          graphs_.pop_back();
        }
        graphs_.insert(graphs_.begin(), std::move(g));
      } else {
        std::rotate(graphs_.begin(), graphs_.begin() + long(hit), graphs_.begin() + long(hit) + 1);
        ++graph_stats_.replayed;
      }
      // Decode replays only (not captures, not speculative iterations): the report's decode GPU time.
      const bool decode_replay = hit != graphs_.size() && decode_step();
      const bool timed = decode_replay && drv().cuEventElapsedTime && opt_.replay_timing > 0 &&
                         graph_stats_.replay_host_n % opt_.replay_timing == 0;
      std::pair<CUevent, CUevent> ev{nullptr, nullptr};
      if (timed) {
        if (!spare_timing_.empty()) {
          ev = spare_timing_.back();
          spare_timing_.pop_back();
        } else {
          check(drv().cuEventCreate(&ev.first, 0), "cuEventCreate");
          check(drv().cuEventCreate(&ev.second, 0), "cuEventCreate");
        }
        check(drv().cuEventRecord(ev.first, stream_), "cuEventRecord");
      }
      check(drv().cuGraphLaunch(graphs_.front()->exec, stream_), "cuGraphLaunch");
      if (decode_step())
        graph_stats_.last_decode_host_us =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - encode_t0_).count();
      if (timed) {
        check(drv().cuEventRecord(ev.second, stream_), "cuEventRecord");
        replay_timing_.push_back(ev);
      }
      if (decode_replay) {
        graph_stats_.replay_host_us_sum += graph_stats_.last_decode_host_us;
        ++graph_stats_.replay_host_n;
      }
      if (decode_step()) {
        graph_stats_.last_decode_launches = int64_t(launches_.size());
        graph_stats_.last_decode_nodes = int64_t(graphs_.front()->nodes);
      } else {
        ++graph_stats_.speculative_replays;
      }
    } else {
      issue_staged();
      ++graph_stats_.direct_steps;
      // (not a one-off decode step that also writes a restore: the report's figure is the steady step's)
      if (decode_step() && repeats()) graph_stats_.last_decode_launches = int64_t(launches_.size());
    }
    CUevent e = nullptr;
    if (!spare_events_.empty()) {
      e = spare_events_.back();
      spare_events_.pop_back();
    } else {
      check(drv().cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    }
    pending_.push_back({fence, e});
    check(drv().cuEventRecord(e, stream_), "cuEventRecord");
  } catch (const CudaError& e) {
    end_step_encoding();
    fault(e);
    throw;
  }
  end_step_encoding();
  return fence;
}

// Issues the step's launches on the compute stream; with branches on, the launches of one hazard stage
// (independent by construction: no two of them write what another reads or writes) are spread over side
// streams that fork from the compute stream at the stage's start and join it at its end. Under capture
// this gives the graph parallel branches; the ordering between stages is exactly the recorded one.
void CudaOps::issue_staged() {
  const Driver& d = drv();
  size_t i = 0;
  while (i < launches_.size()) {
    size_t j = i + 1;
    while (j < launches_.size() && launches_[j].stage == launches_[i].stage) ++j;
    // Ops of the stage are independent; the launches of one op (a kernel and its reduce, say) are not, so
    // each op stays on one lane, in order.
    const size_t ops = size_t(launches_[j - 1].op - launches_[i].op) + 1;
    const size_t lanes = std::min(ops, side_streams_.size() + 1);
    if (!opt_.branches || lanes < 2) {
      for (size_t k = i; k < j; ++k) issue(launches_[k], stream_);
    } else {
      check(d.cuEventRecord(fork_event_, stream_), "cuEventRecord (fork)");
      for (size_t s = 1; s < lanes; ++s) check(d.cuStreamWaitEvent(side_streams_[s - 1], fork_event_, 0), "cuStreamWaitEvent");
      for (size_t k = i; k < j; ++k) {
        const size_t lane = size_t(launches_[k].op - launches_[i].op) % lanes;
        issue(launches_[k], lane == 0 ? stream_ : side_streams_[lane - 1]);
      }
      for (size_t s = 1; s < lanes; ++s) {
        check(d.cuEventRecord(join_events_[s - 1], side_streams_[s - 1]), "cuEventRecord (join)");
        check(d.cuStreamWaitEvent(stream_, join_events_[s - 1], 0), "cuStreamWaitEvent");
      }
    }
    i = j;
  }
}

void CudaOps::abandon_impl() { end_step_encoding(); }

void CudaOps::wait(uint64_t fence) {
  if (opt_.dry_arch || fence <= done_fence_) return;
  bind_context();
  // Fences complete in order (one stream): wait for the newest event at or before `fence`.
  CUevent last = nullptr;
  size_t n = 0;
  for (; n < pending_.size() && pending_[n].first <= fence; ++n) last = pending_[n].second;
  if (!last) return;
  guarded([&] { check(drv().cuEventSynchronize(last), "a CUDA step (cuEventSynchronize)"); });
  for (size_t i = 0; i < n; ++i) spare_events_.push_back(pending_[i].second);
  pending_.erase(pending_.begin(), pending_.begin() + long(n));
  done_fence_ = std::max(done_fence_, fence);
  collect_replay_timing();
}

// GPU time of the replays that have finished (in order: one stream).
void CudaOps::collect_replay_timing() {
  size_t done = 0;
  for (; done < replay_timing_.size(); ++done) {
    const auto& [a, b] = replay_timing_[done];
    if (drv().cuEventQuery(b) != CUDA_SUCCESS) break;
    float ms = 0;
    if (drv().cuEventElapsedTime(&ms, a, b) == CUDA_SUCCESS) {
      graph_stats_.replay_gpu_us_sum += double(ms) * 1000.0;
      ++graph_stats_.replay_gpu_n;
    }
    spare_timing_.push_back(replay_timing_[done]);
  }
  replay_timing_.erase(replay_timing_.begin(), replay_timing_.begin() + long(done));
}

// ---- host transfers (outside steps, on the copy stream) ----

void CudaOps::upload_impl(const Tensor& dst, const void* src) {
  if (opt_.dry_arch) return;
  bind_context();
  const size_t es = dtype_size(dst.dtype), row = size_t(dst.cols) * es;
  const bool dense = dst.stride == dst.cols || dst.rows == 1;
  const size_t bytes = dst.bytes();
  guarded([&] {
    if (dense && bytes <= staging_bytes_) {
      std::memcpy(staging_, src, bytes);
      check(drv().cuMemcpyHtoDAsync_v2(ptr(dst), staging_, bytes, copy_stream_), "cuMemcpyHtoDAsync");
    } else {
      for (int64_t r = 0; r < dst.rows; ++r) {
        check(drv().cuMemcpyHtoDAsync_v2(ptr(dst) + CUdeviceptr(r) * dst.stride * es,
                                         static_cast<const char*>(src) + size_t(r) * row, dense ? bytes : row,
                                         copy_stream_),
              "cuMemcpyHtoDAsync");
        if (dense) break;
      }
    }
    check(drv().cuStreamSynchronize(copy_stream_), "cuStreamSynchronize (upload)");
  });
}

void CudaOps::download_impl(const Tensor& src, void* dst) {
  if (opt_.dry_arch) {
    std::memset(dst, 0, src.bytes());
    return;
  }
  bind_context();
  const size_t es = dtype_size(src.dtype), row = size_t(src.cols) * es;
  const bool dense = src.stride == src.cols || src.rows == 1;
  const size_t bytes = src.bytes();
  guarded([&] {
    if (dense && bytes <= staging_bytes_) {
      check(drv().cuMemcpyDtoHAsync_v2(staging_, ptr(src), bytes, copy_stream_), "cuMemcpyDtoHAsync");
      check(drv().cuStreamSynchronize(copy_stream_), "cuStreamSynchronize (download)");
      std::memcpy(dst, staging_, bytes);
    } else {
      for (int64_t r = 0; r < src.rows; ++r) {
        check(drv().cuMemcpyDtoHAsync_v2(static_cast<char*>(dst) + size_t(r) * row,
                                         ptr(src) + CUdeviceptr(r) * src.stride * es, dense ? bytes : row,
                                         copy_stream_),
              "cuMemcpyDtoHAsync");
        if (dense) break;
      }
      check(drv().cuStreamSynchronize(copy_stream_), "cuStreamSynchronize (download)");
    }
  });
}

// ---- the backend's own ops (kernels/backend.cu) ----

namespace {
// grid.y is limited to 65535: the row kernels loop over rows with a grid-sized stride.
unsigned grid_rows(int64_t rows) { return unsigned(std::max<int64_t>(1, std::min<int64_t>(rows, 65535))); }
unsigned blocks_for(int64_t n, int64_t per_block, unsigned cap = 65535) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(cap, (n + per_block - 1) / per_block)));
}
}  // namespace

void CudaOps::copy_impl(const Tensor& src, const Tensor& dst) {
  if (src.rows != dst.rows || src.cols != dst.cols) throw std::logic_error("copy: source and destination differ in shape");
  if (src.rows == 0) return;
  if (src.dtype == dst.dtype) {
    const int64_t es = int64_t(dtype_size(src.dtype)), row = src.cols * es;
    const CUdeviceptr s = ptr(src), d = ptr(dst);
    const int64_t ss = src.stride * es, ds = dst.stride * es;
    const int align16 = ((s | d) % 16 == 0) && ss % 16 == 0 && ds % 16 == 0 && row % 16 == 0;
    const Kernel& k = kernel("backend", "copy_rows");
    launch(k, Dim3{blocks_for(align16 ? row / 16 : row, 256, 1024), grid_rows(src.rows), 1}, Dim3{256, 1, 1}, 0, d,
           ds, s, ss, row, align16, src.rows);
    return;
  }
  int to_bf16;
  if (src.dtype == DType::F32 && dst.dtype == DType::BF16)
    to_bf16 = 1;
  else if (src.dtype == DType::BF16 && dst.dtype == DType::F32)
    to_bf16 = 0;
  else
    throw std::logic_error("copy: unsupported dtype conversion");
  const Kernel& k = kernel("backend", "convert_rows");
  launch(k, Dim3{blocks_for(src.cols, 256, 1024), grid_rows(src.rows), 1}, Dim3{256, 1, 1}, 0, ptr(dst), dst.stride,
         ptr(src), src.stride, src.cols, to_bf16, src.rows);
}

void CudaOps::fill_impl(const Tensor& dst, double value) {
  if (dst.rows == 0) return;
  uint32_t bits;
  int elem;
  if (dst.dtype == DType::I32) {
    const int32_t v = int32_t(value);
    std::memcpy(&bits, &v, 4);
    elem = 4;
  } else if (dst.dtype == DType::F32) {
    const float v = float(value);
    std::memcpy(&bits, &v, 4);
    elem = 4;
  } else {
    bits = f32_to_bf16(float(value));
    elem = 2;
  }
  const Kernel& k = kernel("backend", "fill_rows");
  launch(k, Dim3{blocks_for(dst.cols, 256, 1024), grid_rows(dst.rows), 1}, Dim3{256, 1, 1}, 0, ptr(dst), dst.stride,
         dst.cols, elem, bits, dst.rows);
}

void CudaOps::advance_position_impl(const Tensor& pos_in, const Tensor& pos_out, int64_t T) {
  launch(kernel("backend", "advance_position"), Dim3{1, 1, 1}, Dim3{32, 1, 1}, 0, ptr(pos_in), ptr(pos_out), int(T));
}

int64_t CudaOps::decode_rows() const {
  // The decode GEMV takes up to 16 rows, the fused decode MoE any; 8 covers a verify of 4 drafts with room.
  return opt_.mtp_verify_decode ? 8 : 1;
}

void CudaOps::accept_drafts_impl(const Tensor& ids, const Tensor& y, const Tensor& pos_in, const Tensor& accepted,
                                 const Tensor& next_id, const Tensor& pos_out) {
  launch(kernel("backend", "accept_drafts"), Dim3{1, 1, 1}, Dim3{32, 1, 1}, 0, ptr(ids), ids.stride, ptr(y), y.stride,
         int(ids.rows), ptr(pos_in), ptr(accepted), ptr(next_id), ptr(pos_out));
}

void CudaOps::copy_rows_at_impl(const Tensor& src, const Tensor& index, int64_t offset, const Tensor& dst) {
  launch(kernel("backend", "copy_rows_at"), Dim3{blocks_for(dst.cols, 256, 1024), grid_rows(dst.rows), 1},
         Dim3{256, 1, 1}, 0, ptr(dst), dst.stride, ptr(src), src.stride, src.rows, ptr(index), offset, dst.cols,
         dst.rows);
}

void CudaOps::add_impl(const Tensor& a, const Tensor& b, const Tensor& out) {
  if (out.rows == 0) return;
  launch(kernel("backend", "add_rows"), Dim3{blocks_for(out.cols, 256, 1024), grid_rows(out.rows), 1},
         Dim3{256, 1, 1}, 0, ptr(out), out.stride, ptr(a), a.stride, ptr(b), b.stride, out.cols, out.rows);
}

void CudaOps::embed_impl(const Tensor& ids, const Weight& table, const Tensor& out) {
  if (out.rows == 0) return;
  const bool q = table.quantized();
  launch(kernel("backend", "embed_rows"), Dim3{blocks_for(out.cols, 256, 1024), grid_rows(out.rows), 1},
         Dim3{256, 1, 1}, 0, ptr(out), out.stride, ptr(ids), ids.stride, data(table),
         q ? scales(table) : CUdeviceptr(0), q ? biases(table) : CUdeviceptr(0), table.rows, table.cols,
         int(table.dtype), q ? table.bits : 0, q ? table.group : 0, int(table.scale_dtype), out.rows);
}

// ---- report ----

std::vector<std::string> CudaOps::optimizations() const {
  std::vector<std::string> o;
  o.push_back(opt_.graphs ? "decode steps captured once as CUDA graphs and replayed (a graph per distinct launch "
                            "list: the two alternating slots and state sets give two)"
                          : "CUDA graphs off (graphs=False): every decode launch issued from the host");
 o.push_back(opt_.speculative_graphs
                  ? "speculative (MTP) iterations memoised and replayed as CUDA graphs like decode steps (one per k, "
                    "parity and state set; graphs.speculative_replays, graphs.launches_per_speculative_iteration)"
                  : "not active: speculative iterations as graphs (speculative_graphs=False): encoded and launched "
                    "from the host each time");
  o.push_back(opt_.mtp_verify_decode
                  ? "speculative (MTP) iterations verify their k + 1 rows through the decode kernels (up to " +
                        std::to_string(decode_rows()) + " rows: GEMV, the fused decode MoE), drafts as decode rows"
                  : "not active: MTP verify through the decode kernels (mtp_verify_decode=False): speculative "
                    "iterations run the prefill path (measured 2-2.7x slower on an H100 with lily-tiny)");
  o.push_back("kernels compiled by NVRTC for sm_" + std::to_string(info_.arch()) +
              " with the model's dimensions as compile-time constants; on-disk cache " +
              (opt_.cache_dir.empty() ? std::string("off (no cache directory)") : "at " + opt_.cache_dir));
  o.push_back("weights placed once in GPU memory, each tensor 256-byte aligned (only the tensors the model reads)");
  o.push_back(opt_.encode_memo ? "decode encode memo: an op with the same arguments as one already encoded reuses its "
                                 "launches (host encode skipped; hits and misses in graphs.encode_memo)"
                               : "not active: decode encode memo (encode_memo=False): every decode op runs its host code");
  o.push_back(opt_.prefill_memo
                  ? "prefill encode memo: a prefill op with the same arguments as one encoded twice before (a chunk "
                    "of a length already prefilled twice in the same session state) reuses its launches (hits and "
                    "misses in graphs.prefill_memo; the last chunk's host encode in graphs.prefill_encode_us)"
                  : "not active: prefill encode memo (prefill_memo=False): every prefill op runs its host code");
  o.push_back(opt_.fused_norm ? "decode norms fused into the projections after them: the GEMV's every block normalises "
                                "its row (and adds the residual) while staging it, one launch fewer per norm"
                              : "not active: fused decode norms (fused_norm=False): each norm is its own launch");
  o.push_back(opt_.gemv_dp4a ? "decode GEMVs of 4/8-bit weights (the lm_head too) with x as three int8 terms per 16-byte "
                               "chunk and dp4a integer dot products (~1e-7 relative error, the fp32 form's level)"
                             : "not active: dp4a decode GEMV (gemv_dp4a=False): fp32 x on the CUDA cores, the q4 lm_head "
                               "on the tensor-core GEMV");
  {
    using F = CudaOptions::FusedDelta;
    const F fd = opt_.fused_delta;
    const bool clusters = fd == F::Norm || fd == F::Cluster;
    const std::string name = fd == F::Narrow ? "narrow" : fd == F::Wide ? "wide" : fd == F::Norm ? "norm" : "cluster";
    if (fd == F::Off || (clusters && info_.arch() < 90))
      o.push_back("not active: fused DeltaNet decode (" +
                  (fd == F::Off ? std::string("fused_delta=\"off\"")
                                : "fused_delta=\"" + name + "\" needs thread-block clusters, sm_90") +
                  "): conv1d_silu, gated_delta and gated_rms_norm launch apart");
    else
      o.push_back("decode DeltaNet layers fused (fused_delta=\"" + name + "\"): " +
                  (fd == F::Cluster ? std::string("conv, recurrent update and gated norm in one launch, a key head's "
                                                  "blocks one thread-block cluster")
                   : fd == F::Norm  ? std::string("the recurrent update and gated norm in one launch after the conv's, "
                                                  "a value head's blocks one thread-block cluster")
                   : fd == F::Wide  ? std::string("conv, recurrent update and gated norm in one launch on 256 blocks "
                                                  "with arrival counters")
                                    : std::string("conv, recurrent update and gated norm in one launch, a block per "
                                                  "key head")) +
                  " (the variant conv_delta_norm.decode says where a shape composes the three kernels)");
  }
  o.push_back(opt_.gemv_ahead == 2
                  ? "dp4a decode GEMVs load each warp's first two weight batches before waiting for the kernel before "
                    "them (gemv_ahead=2)"
                  : std::string("not active: two weight batches before the dp4a GEMV's wait (gemv_ahead=1): one, then "
                                "one batch ahead"));
  o.push_back(opt_.gemm_frag ? "prefill GEMMs of 4-bit codes: each warp widens its columns' codes into tensor-core B "
                               "fragments (gemm_frag), no converted weight tile"
                             : "not active: prefill GEMM fragment widening (gemm_frag=False: the same bits, measured 2% "
                               "slower at 4K and 16K on the H200): the 4-bit codes are converted into a shared weight "
                               "tile");
  o.push_back(opt_.gemm_w_f16 ? "prefill GEMMs of affine codes with f16 x: the weights dequantized to f16 (s·q + b) in the "
                                "shared tile, each group part folded by the x scale alone (gemm_w_f16)"
                              : "not active: f16 weight tiles in the prefill GEMMs (gemm_w_f16=False): the integer codes "
                                "enter the MMAs exactly, folded per group part with the scale and b·Σx");
  o.push_back(opt_.moe_w_f16 ? "MoE prefill fragment tiles with f16 x: the experts' weights dequantized to f16 (s·q + b) in "
                               "registers, each group part folded by the x scale alone (moe_w_f16)"
                             : "not active: f16 expert weights in the MoE prefill GEMMs (moe_w_f16=False): the integer "
                               "codes enter the MMAs exactly");
  o.push_back(opt_.moe_w_f16 && opt_.moe_x_rows
                  ? "MoE prefill GEMMs with f16 expert weights take x and act as f16 rows scaled once per row by "
                    "pre-passes (moe_x_rows, moe_act_rows; moe_x_rows), the MMAs accumulating without a per-part fold"
                  : std::string("not active: x and act as pre-scaled f16 rows in the MoE prefill GEMMs (") +
                        (opt_.moe_w_f16 ? "moe_x_rows=False" : "it needs moe_w_f16") +
                        "): x is scaled per row and group part in the fragment tiles, each part folded");
  o.push_back(opt_.moe_group_blocks
                  ? "MoE prefill grouping split over a block per 1024-pair chunk (moe_group_blocks): the chunks' "
                    "stable scatters side by side"
                  : "not active: MoE prefill grouping across blocks (moe_group_blocks=False): one block of 1024 "
                    "threads scatters the 1024-pair chunks in turn");
  const bool x_rows = opt_.gemm_w_f16 && opt_.gemm_x_rows;
  o.push_back(x_rows ? "prefill GEMMs with f16 weight tiles take x as f16 rows scaled once per row by a pre-pass "
                       "(matmul_x_rows, once per op and x; gemm_x_rows), the MMAs accumulating without a group fold"
              : std::string("not active: x as pre-scaled f16 rows in the prefill GEMMs (") +
                    (opt_.gemm_w_f16 ? "gemm_x_rows=False" : "it needs gemm_w_f16") +
                    "): x is scaled per row and group part in the tile, each part folded");
  o.push_back(x_rows && opt_.gemm_tile128
                  ? "128-row prefill GEMM tiles where their grid fills every SM twice (gemm_tile128; warp tiles 32 x 64)"
                  : std::string("not active: 128-row prefill GEMM tiles (") +
                        (x_rows ? "gemm_tile128=False" : "they need x as f16 rows, gemm_x_rows") + ")");
  o.push_back(x_rows && opt_.gemm_w_double
                  ? "prefill GEMMs with two alternating W tiles, one barrier per K block (gemm_w_double)"
                  : std::string("not active: two alternating W tiles in the prefill GEMMs (") +
                        (x_rows ? "gemm_w_double=False" : "gemm_w_double needs x as f16 rows, gemm_x_rows") +
                        "): the next K block's weights are converted after a second barrier");
  o.push_back(opt_.moe_frag64_rows > 0
                  ? "MoE prefill fragment tiles of 64 rows from " + std::to_string(opt_.moe_frag64_rows) +
                        " expected rows per expert (moe_frag64_rows): four m16 tiles per warp on each widened B fragment"
                  : std::string("not active: 64-row MoE prefill fragment tiles (moe_frag64_rows=0): at most 32 rows, an "
                                "expert's codes widened once per 32 rows"));
  o.push_back(opt_.delta_chunk_mma
                  ? "chunked DeltaNet prefill on the tensor cores (delta_chunk_mma): every product of the chunk prep and "
                    "scan in 3xTF32 mma.sync (fp32's error level), the prep's solve as a blocked inverse"
                  : "not active: the chunked DeltaNet's products on the tensor cores (delta_chunk_mma=False): fp32 FMAs "
                    "on the CUDA cores, the prep's solve by forward substitution");
  o.push_back(opt_.attn_prefill_split
                  ? "split-KV prefill attention for few rows: up to 64 query rows whose grid leaves SMs idle read the "
                    "keys in ranges over more blocks, merged by attn_prefill_reduce (attention.prefill_split says when)"
                  : "not active: split-KV prefill attention (attn_prefill_split=False): a warm turn's few new tokens "
                    "read the whole context in a handful of blocks");
  o.push_back(opt_.qk_prep_append
                  ? "attention's q/k prep and KV append in one launch (qk_prep_append): the prep's warps write the k "
                    "rows, and v warps the v rows, into the caches"
                  : "not active: q/k prep and KV append in one launch (qk_prep_append=False): attn_kv_append launches "
                    "after attn_qk_prep");
  o.push_back(opt_.attn_decode_early
                  ? "decode attention on tensor cores loads each warp's first K/V tile, less the step's new row, before "
                    "waiting for the q/k prep (attn_decode_early)"
                  : "not active: early K/V loads in decode attention (attn_decode_early=False): every tile after the "
                    "wait");
  o.push_back("host reads of the sampled id on a separate copy stream: reading id k does not wait for step k + 1");
  o.push_back(opt_.branches ? "graph branches: the launches of one hazard stage run side by side (up to " +
                                  std::to_string(kBranchLanes) + " streams forked and joined per stage)"
                            : std::string("graph branches off (branches=False): launches run one after another"));
  o.push_back(opt_.smem_carveout >= 0
                  ? "one shared-memory carveout for every kernel: " + std::to_string(opt_.smem_carveout) +
                        "% of the SM's L1/shared capacity (smem_carveout)"
                  : std::string("not active: a common shared-memory carveout (smem_carveout=-1): the driver picks each "
                                "kernel's split"));
  o.push_back(opt_.moe_decode_minb > 0
                  ? "decode MoE kernels' registers capped for " + std::to_string(opt_.moe_decode_minb) +
                        " blocks per SM (moe_decode_minb)"
                  : std::string("not active: a register cap on the decode MoE kernels (moe_decode_minb=0): the "
                                "compiler's choice") + (opt_.moe_early_loads ? ", but 3 blocks per SM for gate/up's early loads"
                                                                             : ""));
  o.push_back(opt_.moe_early_loads
                  ? "decode MoE gate/up: every weight load issued while x is staged, the shared expert's before its "
                    "wait (moe_early_loads; where a lane holds at most 4 weight vectors)"
                  : "not active: early weight loads in the decode MoE gate/up (moe_early_loads=False): they follow "
                    "the staging of x");
  o.push_back(opt_.replay_timing == 0
                  ? std::string("decode GPU time not measured (replay_timing=0): no events around replays")
                  : "decode GPU time from events around " +
                        (opt_.replay_timing == 1 ? std::string("every replayed step")
                                                 : "one replayed step in " + std::to_string(opt_.replay_timing)) +
                        " (replay_timing)");
  if (pdl_active_)
    o.push_back(std::string("programmatic dependent launch (pdl=\"") +
                (opt_.pdl == CudaOptions::Pdl::All ? "all" : "decode") +
                "\"): each " + (opt_.pdl == CudaOptions::Pdl::All ? "" : "decode ") +
                "kernel is scheduled while the one before it runs and waits for it on the device (griddepcontrol); "
                "the decode GEMVs and the MoE down pass issue their weight loads before that wait" +
                (opt_.pdl == CudaOptions::Pdl::All ? std::string("")
                                                   : std::string("; prefill launches without it (measured -39% at "
                                                                 "4K: the next GEMM's blocks sit on SM resources)")));
  else
    o.push_back(std::string("not active: programmatic dependent launch (") +
                (opt_.pdl == CudaOptions::Pdl::Off ? PDL_OFF_WHY
                 : info_.cc_major < 9              ? "needs sm_90 or newer"
                                                   : "the driver lacks cuLaunchKernelEx") +
                "): each launch starts after the previous one finished");
  for (const auto& [k, v] : variants_) o.push_back(k + ": " + v);
  return o;
}

}  // namespace lily::cuda
