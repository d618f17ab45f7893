// lily._core: the nanobind module. Converts Python descriptors of memory-mapped checkpoint tensors into
// the C++ model (the schema lives in csrc/model/loader.cpp), chooses the backend, and binds sessions.
// GIL and locks: every call that may wait for the engine lock or run a forward releases the GIL first;
// Python callbacks (tokens, progress) take it back only for their own duration, with no lock held.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <stdexcept>
#include <optional>
#include <string>

#include "cpu/alloc_guard.h"
#include "cpu/backend.h"
#include "cpu/reduce.h"
#include "model/loader.h"
#include "model/qwen36.h"
#include "runtime/mt19937.h"
#include "runtime/session.h"

#ifdef LILY_WITH_CUDA
#include "cuda/backend.h"
#endif

#ifdef LILY_WITH_METAL
#include "metal/backend.h"
#include "metal/kernels.h"
void bind_metal(nanobind::module_& m);  // python/bindings_metal.cpp
#endif
namespace lily {
void bind_ops_bench(nanobind::module_& m);  // python/bindings_ops.cpp
}

namespace nb = nanobind;
using namespace nb::literals;
using namespace lily;

namespace {

using AnyArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

// ---- descriptors -> weights ----

DType parse_dtype(const std::string& s, const std::string& where) {
  if (s == "f32") return DType::F32;
  if (s == "f16") return DType::F16;
  if (s == "bf16") return DType::BF16;
  throw std::invalid_argument("tensor '" + where + "': unsupported dtype '" + s + "'");
}

const void* array_ptr(const nb::dict& d, const char* key, size_t min_bytes, const std::string& where) {
  if (!d.contains(key)) throw std::invalid_argument("tensor '" + where + "': descriptor lacks '" + key + "'");
  AnyArray a = nb::cast<AnyArray>(d[key]);
  size_t bytes = a.nbytes();
  if (bytes < min_bytes)
    throw std::invalid_argument("tensor '" + where + "': '" + key + "' holds " + std::to_string(bytes) +
                                " bytes, expected " + std::to_string(min_bytes));
  return a.data();
}

HostMatrix parse_matrix(const nb::handle& h, const std::string& where, int64_t rows, int64_t cols) {
  nb::dict d = nb::cast<nb::dict>(h);
  HostMatrix m;
  WeightFormat& f = m.fmt;
  auto shape = nb::cast<std::vector<int64_t>>(d["shape"]);
  if (shape.size() != 2 || shape[0] != rows || shape[1] != cols)
    throw std::invalid_argument("tensor '" + where + "': shape does not match the config (expected [" +
                                std::to_string(rows) + ", " + std::to_string(cols) + "])");
  f.rows = rows;
  f.cols = cols;
  std::string kind = nb::cast<std::string>(d["kind"]);
  if (kind == "dense") {
    f.kind = WeightFormat::Kind::Dense;
    f.dtype = parse_dtype(nb::cast<std::string>(d["dtype"]), where);
    m.data = array_ptr(d, "data", f.row_bytes() * size_t(rows), where);
  } else if (kind == "affine") {
    f.kind = WeightFormat::Kind::Affine;
    f.bits = nb::cast<int>(d["bits"]);
    f.group = nb::cast<int>(d["group"]);
    if (f.bits != 4 && f.bits != 8)
      throw std::invalid_argument("tensor '" + where + "': " + std::to_string(f.bits) + "-bit weights are not supported");
    if (f.group <= 0 || cols % f.group) throw std::invalid_argument("tensor '" + where + "': bad group size");
    f.scale_dtype = parse_dtype(nb::cast<std::string>(d["scale_dtype"]), where);
    m.data = array_ptr(d, "data", f.row_bytes() * size_t(rows), where);
    m.scales = array_ptr(d, "scales", f.scale_bytes(), where);
    m.biases = array_ptr(d, "biases", f.scale_bytes(), where);
  } else {
    throw std::invalid_argument("tensor '" + where + "': unknown kind '" + kind + "'");
  }
  return m;
}

WeightView view_of(const HostMatrix& m) {
  WeightView v;
  static_cast<WeightFormat&>(v) = m.fmt;
  v.data = m.data;
  v.scales = m.scales;
  v.biases = m.biases;
  return v;
}

WeightView parse_view(const nb::dict& weight) {
  auto shape = nb::cast<std::vector<int64_t>>(weight["shape"]);
  if (shape.size() != 2) throw std::invalid_argument("weight shape must have two dims");
  return view_of(parse_matrix(weight, "weight", shape[0], shape[1]));
}

class DictSource final : public WeightSource {
 public:
  explicit DictSource(const nb::dict& t) : t_(t) {}
  HostMatrix matrix(const std::string& name, int64_t rows, int64_t cols) override {
    if (!t_.contains(name.c_str())) throw std::invalid_argument("missing tensor '" + name + "'");
    return parse_matrix(t_[name.c_str()], name, rows, cols);
  }
  const float* vector(const std::string& name, int64_t count) override {
    if (!t_.contains(name.c_str())) throw std::invalid_argument("missing tensor '" + name + "'");
    auto a = nb::cast<nb::ndarray<const float, nb::c_contig, nb::device::cpu>>(t_[name.c_str()]);
    if (int64_t(a.size()) != count)
      throw std::invalid_argument("tensor '" + name + "' has " + std::to_string(a.size()) + " values, expected " +
                                  std::to_string(count));
    return a.data();
  }

 private:
  const nb::dict& t_;
};

ModelConfig parse_config(const nb::dict& cfg) {
  ModelConfig c;
  auto get = [&](const char* key) {
    if (!cfg.contains(key)) throw std::invalid_argument(std::string("model config lacks '") + key + "'");
    return cfg[key];
  };
#define LILY_PARSE_FIELD(member, type, key, field) c.member = nb::cast<type>(get(key));
  LILY_CONFIG_FIELDS(LILY_PARSE_FIELD)
#undef LILY_PARSE_FIELD
  c.full_attention = nb::cast<std::vector<bool>>(get("full_attention"));
  if (cfg.contains("mtp_layers")) c.mtp_layers = nb::cast<int64_t>(cfg["mtp_layers"]);  // optional: 0 = none
  c.validate();
  return c;
}

// ---- backends ----

// What this build holds, in the order "auto" prefers them.
nb::dict backends_dict() {
  nb::dict d;
  auto put = [&](const char* name, bool built, bool usable, const std::string& why) {
    nb::dict b;
    b["built"] = built;
    b["usable"] = usable;
    b["status"] = why;
    d[name] = b;
  };
#ifdef LILY_WITH_CUDA
  {
    const cuda::Availability a = cuda::availability();
    put("cuda", true, a.usable, a.status);
  }
#else
  put("cuda", false, false, "not built: this extension was built without the CUDA backend (LILY_CUDA=OFF, or not Linux)");
#endif
#ifdef LILY_WITH_METAL
  put("metal", true, true,
      "built and usable (verified against the CPU backend in the Linux harness; its speed is unmeasured until a Mac "
      "runs it)");
#else
  put("metal", false, false, "not built: Metal exists only on macOS builds");
#endif
  put("cpu", true, true, "built and usable");
  return d;
}

// A backend option that takes one of a few names, or a bool standing for one of them (what it meant when it was a
// bool); anything else is refused naming the option and the accepted values.
template <class E>
E mode_option(const char* key, const nb::object& v, std::initializer_list<std::pair<const char*, E>> names,
              E if_true, E if_false) {
  if (nb::isinstance<nb::bool_>(v)) return nb::cast<bool>(v) ? if_true : if_false;
  std::string accepted;
  for (const auto& [n, e] : names) accepted += std::string(accepted.empty() ? "" : ", ") + "\"" + n + "\"";
  std::string got;
  if (nb::isinstance<nb::str>(v)) {
    got = nb::cast<std::string>(v);
    for (const auto& [n, e] : names)
      if (got == n) return e;
    got = "\"" + got + "\"";
  } else {
    got = nb::cast<std::string>(nb::repr(v));
  }
  throw std::invalid_argument(std::string("backend option ") + key + " must be " + accepted + " or a bool, got " + got);
}

#ifdef LILY_WITH_CUDA
// A backend option that must be an int (not a bool) in [lo, hi]; anything else is refused naming the option.
int bounded_int(const char* key, const nb::object& v, int64_t lo, int64_t hi, const char* what) {
  if (nb::isinstance<nb::bool_>(v) || !nb::isinstance<nb::int_>(v) || nb::cast<int64_t>(v) < lo ||
      nb::cast<int64_t>(v) > hi)
    throw std::invalid_argument(std::string("backend option ") + key + " must be " + what + ", got " +
                                nb::cast<std::string>(nb::repr(v)));
  return nb::cast<int>(v);
}
#endif

// The backend `name` with `options`; with build false, only checks them (every refusal raised as when building,
// nullptr returned): the engine checks its options before it maps a checkpoint.
std::unique_ptr<Ops> make_backend(const std::string& name, const nb::dict& options, bool build = true) {
  nb::dict all = backends_dict();
  if (!all.contains(name.c_str())) {
    std::string names;
    for (auto [k, v] : all) names += (names.empty() ? "" : ", ") + nb::cast<std::string>(k);
    throw std::invalid_argument("unknown backend '" + name + "' (known: " + names + ")");
  }
  nb::dict b = nb::cast<nb::dict>(all[name.c_str()]);
  // Every option a backend reads goes through opt(); a key it never asked for is refused by name before the backend
  // is built (a misspelt option must not silently leave the default in place: an A/B would compare the default with
  // itself). The engine passes its own (threads, LILY_CPU_DEBUG's switches) to every backend; only the CPU reads them.
  std::set<std::string> known = {"threads", "deferred", "shuffle_seed", "strict_alloc"};
  auto opt = [&](const char* k) {
    known.insert(k);
    return options.contains(k) ? options[k] : nb::none();
  };
  auto refuse_unknown = [&] {
    for (auto [k, v] : options) {
      const std::string key = nb::isinstance<nb::str>(k) ? nb::cast<std::string>(k) : nb::cast<std::string>(nb::repr(k));
      if (known.count(key)) continue;
      std::string names;
      for (const std::string& n : known) names += (names.empty() ? "" : ", ") + n;  // sorted: a std::set
      throw std::invalid_argument("unknown backend option '" + key + "' for the " + name + " backend (it takes: " +
                                  names + ")");
    }
  };
  // The options the CUDA prefill_x replaced are refused with what replaced them, before the generic check.
  if (name == "cuda" && (options.contains("prefill_x_terms") || options.contains("moe_x_terms")))
    throw std::invalid_argument(std::string("backend option ") +
                                (options.contains("prefill_x_terms") ? "prefill_x_terms was replaced by prefill_x"
                                                                     : "moe_x_terms was replaced by moe_x") +
                                ": \"bf16x2\" for 2 terms, \"bf16\" for 1, or \"f16\" (the default)");
#ifdef LILY_WITH_CUDA
  if (name == "cuda") {
    cuda::CudaOptions o;
    if (!opt("device").is_none()) o.device = nb::cast<int>(opt("device"));
    if (!opt("graphs").is_none()) o.graphs = nb::cast<bool>(opt("graphs"));
    if (!opt("speculative_graphs").is_none()) o.speculative_graphs = nb::cast<bool>(opt("speculative_graphs"));
    if (!opt("mtp_verify_decode").is_none()) o.mtp_verify_decode = nb::cast<bool>(opt("mtp_verify_decode"));
    if (!opt("branches").is_none()) o.branches = nb::cast<bool>(opt("branches"));
    if (!opt("replay_timing").is_none())
      o.replay_timing = bounded_int("replay_timing", opt("replay_timing"), 0, 1000000,
                                    "an int >= 0 (time one decode replay in N; 0: none)");
    if (!opt("smem_carveout").is_none())
      o.smem_carveout = bounded_int("smem_carveout", opt("smem_carveout"), -1, 100,
                                    "an int from 0 to 100 (percent shared), or -1 (the driver's choice)");
    if (!opt("pdl").is_none())  // True / False as before ("all" / "off")
      o.pdl = mode_option("pdl", opt("pdl"),
                          {{"off", cuda::CudaOptions::Pdl::Off}, {"decode", cuda::CudaOptions::Pdl::Decode},
                           {"all", cuda::CudaOptions::Pdl::All}},
                          cuda::CudaOptions::Pdl::All, cuda::CudaOptions::Pdl::Off);
    if (!opt("encode_memo").is_none()) o.encode_memo = nb::cast<bool>(opt("encode_memo"));
    if (!opt("prefill_memo").is_none()) o.prefill_memo = nb::cast<bool>(opt("prefill_memo"));
    if (!opt("gemv_async").is_none()) o.gemv_async = nb::cast<bool>(opt("gemv_async"));
    if (!opt("gemv_dp4a").is_none()) o.gemv_dp4a = nb::cast<bool>(opt("gemv_dp4a"));
    if (!opt("gemv_ahead").is_none())
      o.gemv_ahead = bounded_int("gemv_ahead", opt("gemv_ahead"), 1, 2,
                                 "1 or 2 (warp batches of the dp4a GEMV loaded before its wait)");
    if (!opt("fused_norm").is_none()) o.fused_norm = nb::cast<bool>(opt("fused_norm"));
    if (!opt("fused_delta").is_none())  // True / False as before ("narrow" / "off")
      o.fused_delta = mode_option("fused_delta", opt("fused_delta"),
                                  {{"off", cuda::CudaOptions::FusedDelta::Off},
                                   {"narrow", cuda::CudaOptions::FusedDelta::Narrow},
                                   {"wide", cuda::CudaOptions::FusedDelta::Wide},
                                   {"norm", cuda::CudaOptions::FusedDelta::Norm},
                                   {"cluster", cuda::CudaOptions::FusedDelta::Cluster}},
                                  cuda::CudaOptions::FusedDelta::Narrow, cuda::CudaOptions::FusedDelta::Off);
    // prefill_x / moe_x: the prefill GEMMs' activation form (CudaOptions::XForm); moe_x "prefill" follows prefill_x.
    auto x_form = [&](const char* key, bool follow_ok) -> std::optional<cuda::CudaOptions::XForm> {
      const nb::object v = opt(key);
      const std::string got = nb::isinstance<nb::str>(v) ? nb::cast<std::string>(v) : std::string();
      if (got == "f16") return cuda::CudaOptions::XForm::F16;
      if (got == "bf16x2") return cuda::CudaOptions::XForm::BF16x2;
      if (got == "bf16") return cuda::CudaOptions::XForm::BF16;
      if (follow_ok && got == "prefill") return std::nullopt;
      throw std::invalid_argument(std::string("backend option ") + key + " must be \"f16\", \"bf16x2\", \"bf16\"" +
                                  (follow_ok ? " or \"prefill\"" : "") + ", got " +
                                  nb::cast<std::string>(nb::repr(v)));
    };
    if (!opt("prefill_x").is_none()) o.prefill_x = *x_form("prefill_x", false);
    if (!opt("moe_x").is_none()) o.moe_x = x_form("moe_x", true);
    if (!opt("gemm_small_tiles").is_none()) o.gemm_small_tiles = nb::cast<bool>(opt("gemm_small_tiles"));
    if (!opt("gemm_frag").is_none()) o.gemm_frag = nb::cast<bool>(opt("gemm_frag"));
    if (!opt("gemm_w_f16").is_none()) o.gemm_w_f16 = nb::cast<bool>(opt("gemm_w_f16"));
    if (!opt("moe_w_f16").is_none()) o.moe_w_f16 = nb::cast<bool>(opt("moe_w_f16"));
    if (!opt("moe_x_rows").is_none()) o.moe_x_rows = nb::cast<bool>(opt("moe_x_rows"));
    if (!opt("moe_group_blocks").is_none()) o.moe_group_blocks = nb::cast<bool>(opt("moe_group_blocks"));
    if (!opt("gemm_x_rows").is_none()) o.gemm_x_rows = nb::cast<bool>(opt("gemm_x_rows"));
    if (!opt("moe_early_loads").is_none()) o.moe_early_loads = nb::cast<bool>(opt("moe_early_loads"));
    if (!opt("gemm_tile128").is_none()) o.gemm_tile128 = nb::cast<bool>(opt("gemm_tile128"));
    if (!opt("gemm_w_double").is_none()) o.gemm_w_double = nb::cast<bool>(opt("gemm_w_double"));
    if (!opt("attn_prefill_split").is_none()) o.attn_prefill_split = nb::cast<bool>(opt("attn_prefill_split"));
    if (!opt("qk_prep_append").is_none()) o.qk_prep_append = nb::cast<bool>(opt("qk_prep_append"));
    if (!opt("attn_decode_early").is_none()) o.attn_decode_early = nb::cast<bool>(opt("attn_decode_early"));
    if (!opt("moe_pipe").is_none()) o.moe_pipe = nb::cast<int>(opt("moe_pipe"));
    if (o.moe_pipe != 0 && (o.moe_pipe < 2 || o.moe_pipe > 4))
      throw std::invalid_argument("backend option moe_pipe must be 0 (off) or 2, 3 or 4 stages, got " +
                                  std::to_string(o.moe_pipe));
    if (!opt("moe_rows_g").is_none()) o.moe_rows_g = nb::cast<int>(opt("moe_rows_g"));
    if (o.moe_rows_g != 0 && o.moe_rows_g != 1 && o.moe_rows_g != 2 && o.moe_rows_g != 4)
      throw std::invalid_argument("backend option moe_rows_g must be 0 (by shape), 1, 2 or 4, got " +
                                  std::to_string(o.moe_rows_g));
    if (!opt("moe_rows_d").is_none()) o.moe_rows_d = nb::cast<int>(opt("moe_rows_d"));
    if (o.moe_rows_d < 1 || o.moe_rows_d > 64)
      throw std::invalid_argument("backend option moe_rows_d must be 1 to 64, got " + std::to_string(o.moe_rows_d));
    if (!opt("moe_decode_minb").is_none())  // 8 blocks of 256 threads fill an SM's 2048
      o.moe_decode_minb = bounded_int("moe_decode_minb", opt("moe_decode_minb"), 0, 8,
                                      "an int from 0 (the compiler's choice) to 8 blocks per SM");
    if (!opt("moe_frag").is_none()) o.moe_frag = nb::cast<int>(opt("moe_frag"));
    if (o.moe_frag != 0 && (o.moe_frag < 3 || o.moe_frag > 6))
      throw std::invalid_argument("backend option moe_frag must be 0 (off) or 3 to 6 stages, got " +
                                  std::to_string(o.moe_frag));
    if (!opt("moe_frag32_rows").is_none()) o.moe_frag32_rows = nb::cast<int>(opt("moe_frag32_rows"));
    if (!opt("moe_tile64_rows").is_none()) o.moe_tile64_rows = nb::cast<int>(opt("moe_tile64_rows"));
    if (!opt("moe_frag64_rows").is_none())
      o.moe_frag64_rows = bounded_int("moe_frag64_rows", opt("moe_frag64_rows"), 0, 1 << 20,
                                      "an int from 0 (never) to 2^20 expected rows per expert");
    if (o.moe_frag32_rows < 1 || o.moe_tile64_rows < 0 || o.moe_frag32_rows > (1 << 20) || o.moe_tile64_rows > (1 << 20))
      throw std::invalid_argument("backend options moe_frag32_rows and moe_tile64_rows must be 1 to 2^20 expected rows "
                                  "per expert (moe_tile64_rows 0: by format), got " + std::to_string(o.moe_frag32_rows) +
                                  " and " + std::to_string(o.moe_tile64_rows));
    if (!opt("attn_prefill_keys").is_none()) o.attn_prefill_keys = nb::cast<int>(opt("attn_prefill_keys"));
    if (o.attn_prefill_keys != 16 && o.attn_prefill_keys != 32)
      throw std::invalid_argument("backend option attn_prefill_keys must be 16 or 32, got " +
                                  std::to_string(o.attn_prefill_keys));
    if (!opt("delta_chunk_rows").is_none()) o.delta_chunk_rows = nb::cast<int>(opt("delta_chunk_rows"));
    if (!opt("delta_chunk_mma").is_none()) o.delta_chunk_mma = nb::cast<bool>(opt("delta_chunk_mma"));
    if (o.delta_chunk_rows < 0 || o.delta_chunk_rows > (1 << 24))
      throw std::invalid_argument("backend option delta_chunk_rows must be 0 (off) to 2^24 rows, got " +
                                  std::to_string(o.delta_chunk_rows));
    if (!opt("cache_dir").is_none()) o.cache_dir = nb::cast<std::string>(opt("cache_dir"));
    if (!opt("dry_arch").is_none()) o.dry_arch = nb::cast<int>(opt("dry_arch"));
    if (o.dry_arch == 0 && !nb::cast<bool>(b["usable"]))
      throw std::invalid_argument("backend 'cuda' is " + nb::cast<std::string>(b["status"]));
    if (o.dry_arch != 0 && o.dry_arch < 80) throw std::invalid_argument("dry_arch must be 80 or newer");
    refuse_unknown();
    if (!build) return nullptr;
    nb::gil_scoped_release nogil;  // the driver's initialisation can take a while
    return std::make_unique<cuda::CudaOps>(o);
  }
#endif
  if (!nb::cast<bool>(b["usable"]))
    throw std::invalid_argument("backend '" + name + "' is " + nb::cast<std::string>(b["status"]));
#ifdef LILY_WITH_METAL
  if (name == "metal") {
    refuse_unknown();
    if (!build) return nullptr;
    nb::gil_scoped_release nogil;  // compiling the kernel library takes a moment
    return std::make_unique<metal::MetalOps>(metal::msl_source());
  }
#endif
  cpu::CpuOptions o;
  if (!opt("threads").is_none()) o.threads = nb::cast<int>(opt("threads"));
  if (!opt("deferred").is_none()) o.deferred = nb::cast<bool>(opt("deferred"));
  if (!opt("shuffle_seed").is_none()) o.shuffle_seed = nb::cast<uint64_t>(opt("shuffle_seed"));
  if (!opt("strict_alloc").is_none()) o.strict_alloc = nb::cast<bool>(opt("strict_alloc"));
  refuse_unknown();
  if (!build) return nullptr;
  return std::make_unique<cpu::CpuOps>(o);
}

// Backend-specific figures for engine.report() (the CUDA backend: device, kernels, graphs, memory).
nb::dict backend_report(Ops& ops) {
  nb::dict d;
#ifdef LILY_WITH_CUDA
  if (auto* c = dynamic_cast<cuda::CudaOps*>(&ops)) {
    const cuda::DeviceInfo& i = c->info();
    nb::dict dev;
    dev["name"] = i.name;
    dev["arch"] = "sm_" + std::to_string(i.arch());
    dev["multiprocessors"] = i.sms;
    dev["memory_bytes"] = i.total_mem;
    dev["l2_bytes"] = i.l2_bytes;
    dev["peak_bandwidth_bytes_per_s"] = i.peak_bandwidth;
    d["device"] = dev;
    const auto& cs = c->compile_stats();
    nb::dict comp;
    comp["modules"] = cs.modules;
    comp["compiled"] = cs.compiled;
    comp["cache_hits"] = cs.cache_hits;
    comp["compile_seconds"] = cs.compile_seconds;
    comp["nvrtc"] = cuda::nvrtc().loaded ? std::to_string(cuda::nvrtc().major) + "." + std::to_string(cuda::nvrtc().minor)
                                         : cuda::nvrtc().error;
    d["compile"] = comp;
    const auto& g = c->graph_stats();
    nb::dict gr;
    gr["captured"] = g.captured;
    gr["capture_ms_per_graph"] = g.captured ? g.capture_us_sum / 1000.0 / double(g.captured) : 0.0;
    gr["replayed"] = g.replayed;
    gr["direct_steps"] = g.direct_steps;
    gr["launches_per_decode_step"] = g.last_decode_launches;
    gr["graph_nodes_per_decode_step"] = g.last_decode_nodes;
    // Means over replayed decode steps (captures excluded): host encode + replay call, and GPU time.
    gr["host_us_per_decode_step"] = g.replay_host_n ? g.replay_host_us_sum / double(g.replay_host_n) : 0.0;
    gr["gpu_us_per_decode_step"] = g.replay_gpu_n ? g.replay_gpu_us_sum / double(g.replay_gpu_n) : 0.0;
    gr["timed_decode_steps"] = g.replay_host_n;      // host time: every replayed decode step
    gr["gpu_timed_decode_steps"] = g.replay_gpu_n;  // GPU time: one in replay_timing, collected so far
    nb::dict memo;
    memo["hits"] = g.memo_hits;
    memo["misses"] = g.memo_misses;
    gr["encode_memo"] = memo;
    nb::dict pmemo;
    pmemo["hits"] = g.prefill_memo_hits;
    pmemo["misses"] = g.prefill_memo_misses;
    gr["prefill_memo"] = pmemo;
    gr["prefill_encode_us"] = g.last_prefill_encode_us;  // the last prefill step's, first launch to submit
    gr["last_step_digest"] = g.last_step_digest;          // dry runs only (0 otherwise)
    gr["steps_digest"] = g.steps_digest;                  // every step's so far, in order (dry runs only)
    gr["speculative_replays"] = g.speculative_replays;
    gr["launches_per_speculative_iteration"] = g.last_speculative_launches;  // the last one's (its k: mtp_stats)
    d["graphs"] = gr;
    nb::dict v;
    for (const auto& [k, s] : c->variants()) v[k.c_str()] = s;
    d["variants"] = v;
    // Each loaded kernel's resources and, per launch shape, its blocks per multiprocessor (None in a dry run).
    nb::list kernels;
    auto known = [](int v) { return v < 0 ? nb::none() : nb::cast(v); };
    for (const cuda::KernelResources& r : c->kernel_resources()) {
      nb::dict kd;
      kd["name"] = r.kernel->name;
      kd["module"] = r.kernel->module;
      kd["registers"] = known(r.kernel->registers);
      kd["local_bytes"] = known(r.kernel->local_bytes);
      kd["static_smem"] = known(r.kernel->static_smem);
      nb::list launches;
      for (const auto& cfg : r.configs) {
        nb::dict ld;
        ld["threads"] = cfg.threads;
        ld["dynamic_smem"] = cfg.dynamic_smem;
        ld["blocks_per_sm"] = known(cfg.blocks_per_sm);
        launches.append(ld);
      }
      kd["launches"] = launches;
      kernels.append(kd);
    }
    d["kernels"] = kernels;
    nb::dict mem;
    for (const auto& [k, n] : c->memory_by_kind()) mem[k.c_str()] = n;
    d["memory_bytes"] = mem;
  }
#endif
#ifdef LILY_WITH_METAL
  if (auto* m = dynamic_cast<metal::MetalOps*>(&ops)) {
    // The last submitted step of each phase: compute dispatches, and the stages the memory barriers separate
    // (dispatches within one stage may run concurrently on the GPU).
    const metal::MetalOps::Counters& k = m->counters();
    auto step = [](int64_t dispatches, int64_t stages, int64_t steps) {
      nb::dict s;
      s["dispatches"] = dispatches;
      s["stages"] = stages;
      s["barriers"] = stages > 0 ? stages - 1 : 0;
      s["submitted"] = steps;
      return s;
    };
    d["decode_step"] = step(k.decode_dispatches, k.decode_stages, k.decode_steps);
    d["prefill_chunk"] = step(k.prefill_dispatches, k.prefill_stages, k.prefill_steps);
    d["command_buffers"] = k.command_buffers;
    d["max_command_buffers_in_flight"] = k.max_in_flight;
    nb::dict pl;
    pl["built"] = m->metal_device().pipelines_built();
    pl["cache_hits"] = m->metal_device().pipeline_cache_hits();
    d["pipelines"] = pl;
  }
#endif
  return d;
}

}  // namespace

namespace lily {
std::unique_ptr<Ops> make_backend_for_bench(const std::string& name, const nb::dict& options) {
  return make_backend(name, options);
}
ModelConfig parse_config_for_bench(const nb::dict& cfg) { return parse_config(cfg); }
nb::dict report_for_bench(Ops& ops) {
  nb::dict d = backend_report(ops);
  d["backend"] = ops.name();
  d["device"] = ops.device();
  d["optimizations"] = ops.optimizations();
  return d;
}
}  // namespace lily

namespace {

// ---- the engine ----

struct PyEngine {
  std::unique_ptr<Ops> ops;
  std::unique_ptr<Qwen36> model;
  std::mutex lock;       // one backend call at a time (sessions, snapshots, report probes)
  nb::object keepalive;  // the Python objects owning the mapped weight memory
  LoadInfo info;
  CheckpointReserve reserve;  // sessions' checkpoints captured into tensors written ahead (guarded by lock)

  PyEngine(const nb::dict& cfg, const nb::dict& tensors, const std::vector<std::pair<AnyArray, std::string>>& files,
           const std::string& backend, const nb::dict& options) {
    ModelConfig c = parse_config(cfg);
    ops = make_backend(backend, options);
    model = std::make_unique<Qwen36>(c, *ops);
    keepalive = nb::make_tuple(tensors, nb::cast(files));
    std::vector<MappedRegion> regions;
    for (auto& [a, label] : files) regions.push_back({a.data(), a.nbytes(), label});
    DictSource src(tensors);
    info = load_weights(*model, src, regions);
  }

  ~PyEngine() {
    if (ops) reserve.release(*ops);
    model.reset();
    ops.reset();
  }

  // Reads backend state under the engine lock (taken without the GIL by the binding).
  nb::dict report() {
    nb::dict r;
    r["backend"] = ops->name();
    r["device"] = ops->device();
    r["threads"] = ops->threads();
    nb::dict wb;
    for (auto& [k, v] : info.weight_bytes) wb[k.c_str()] = v;
    r["weight_bytes"] = wb;
    r["backend_buffer_bytes"] = ops->allocated_bytes();
    r["mappings"] = info.mappings;
    r["repacked_expert_projections"] = info.repacked_projections;
    r["repacked_expert_bytes"] = info.repacked_bytes;
    nb::dict variants;
    const ModelWeights& W = model->weights();
    const LayerWeights* lin = nullptr;
    const LayerWeights* full = nullptr;
    for (auto& L : W.layers) {
      if (L.full && !full) full = &L;
      if (!L.full && !lin) lin = &L;
    }
    auto put = [&](const char* name, const Weight& w) {
      nb::dict d;
      d["format"] = w.describe();
      d["decode"] = ops->matmul_variant(w, Phase::Decode);
      d["prefill"] = ops->matmul_variant(w, Phase::Prefill);
      variants[name] = d;
    };
    {
      nb::dict d;  // the embedding is a row gather (dequantize one row per token), not a product
      d["format"] = W.embed.describe();
      d["decode"] = d["prefill"] = std::string("row_gather_") + W.embed.describe();
      variants["embed_tokens"] = d;
    }
    put("lm_head", W.lm_head);
    if (lin) put("deltanet.in_proj_qkv", lin->qkv);
    if (full) put("attention.q_proj", full->q);
    // One expert's matrix (a GPU backend's grouped MoE kernels are in its own variants list).
    put("experts.gate_proj", W.layers[0].experts_gate.expert(0));
    put("experts.down_proj", W.layers[0].experts_down.expert(0));
    put("router", W.layers[0].router);
    r["kernels"] = variants;
    r["optimizations"] = ops->optimizations();
    r["tied_embeddings"] = W.tied;
    nb::dict mtp;  // the MTP block (MODEL.md section 7): its KV rows run in every forward, drafts in generate(mtp="on")
    mtp["present"] = W.mtp.has_value();
    mtp["layers"] = W.mtp ? int64_t(W.mtp->layers.size()) : int64_t(0);
    mtp["bytes"] = info.mtp_bytes;
    mtp["repacked_expert_projections"] = info.mtp_repacked_projections;
    mtp["repacked_expert_bytes"] = info.mtp_repacked_bytes;
    mtp["format"] = W.mtp ? W.mtp->fc.describe() : std::string("none");
    mtp["decode_rows"] = ops->decode_rows();  // a verify of up to this many rows runs in the decode phase
    r["mtp"] = mtp;
    nb::dict cr;  // Session::prefill_snapshots: the inner checkpoint's state tensors, allocated and written ahead
    cr["bytes"] = reserve.bytes();
    cr["ready"] = reserve.ready;
    cr["taken"] = reserve.taken;
    cr["refilled"] = reserve.refilled;
    r["checkpoint_reserve"] = cr;
    nb::dict extra = backend_report(*ops);
    if (extra.size()) r[ops->name()] = extra;
    return r;
  }
};

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// Releases the GIL around `f` unless the interpreter is shutting down (then no other Python thread
// runs, and a thread state must not be dropped).
template <class F>
auto without_gil(F&& f) -> decltype(f()) {
  if (interpreter_finalizing()) return f();
  nb::gil_scoped_release nogil;
  return f();
}

struct PySnapshot {
  std::unique_ptr<DeviceSnapshot> s;
  nb::object owner;  // what must outlive it when no keep_alive policy can say so (prefill_snapshots' list)
  ~PySnapshot() {
    without_gil([&] { s.reset(); });
  }
};

struct PySession {
  std::unique_ptr<Session> s;
  int64_t vocab;
  ~PySession() {
    without_gil([&] { s.reset(); });
  }
};

nb::ndarray<nb::numpy, float, nb::ndim<2>> new_logits(int64_t rows, int64_t vocab, float** data) {
  float* buf = new float[size_t(std::max<int64_t>(rows, 1) * vocab)];
  *data = buf;
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return nb::ndarray<nb::numpy, float, nb::ndim<2>>(buf, {size_t(rows), size_t(vocab)}, owner);
}

template <class T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(const std::vector<T>& v) {
  T* buf = new T[v.size() ? v.size() : 1];
  std::copy(v.begin(), v.end(), buf);
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(buf, {v.size()}, owner);
}

nb::dict stats_dict(const StepStats& s) {
  nb::dict d;
  d["ops"] = s.ops;
  d["stages"] = s.stages;
  nb::dict c;
  for (size_t k = 0; k < kOpKinds; ++k)
    if (s.op_counts[k]) c[op_name(OpKind(k))] = s.op_counts[k];
  d["op_counts"] = c;
  return d;
}

nb::dict host_snapshot_arrays(const HostSnapshot& s) {
  nb::dict d;
  d["tokens"] = to_numpy(s.tokens);
  d["pending"] = to_numpy(std::vector<int32_t>{s.pending});
  d["logits"] = to_numpy(s.logits);
  for (size_t i = 0; i < s.kv.size(); ++i) d[("kv." + std::to_string(i)).c_str()] = to_numpy(s.kv[i]);
  if (!s.mtp_h.empty()) d["mtp_h"] = to_numpy(s.mtp_h);  // the MTP block's next input (MTP checkpoints)
  d["mtp_valid"] = to_numpy(std::vector<int32_t>{s.mtp_valid ? 1 : 0});  // whether the block's cache covers it
  for (size_t i = 0; i < s.conv.size(); ++i) {
    d[("conv." + std::to_string(i)).c_str()] = to_numpy(s.conv[i]);
    d[("recurrent." + std::to_string(i)).c_str()] = to_numpy(s.recurrent[i]);
  }
  return d;
}

HostSnapshot host_snapshot_from_arrays(const nb::dict& d) {
  auto f32 = [&](const std::string& k) {
    if (!d.contains(k.c_str())) throw std::invalid_argument("session state lacks '" + k + "'");
    auto a = nb::cast<nb::ndarray<const float, nb::c_contig, nb::device::cpu>>(d[k.c_str()]);
    return std::vector<float>(a.data(), a.data() + a.size());
  };
  auto i32 = [&](const std::string& k) {
    if (!d.contains(k.c_str())) throw std::invalid_argument("session state lacks '" + k + "'");
    auto a = nb::cast<nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu>>(d[k.c_str()]);
    return std::vector<int32_t>(a.data(), a.data() + a.size());
  };
  HostSnapshot s;
  s.tokens = i32("tokens");
  s.position = int64_t(s.tokens.size());
  auto pending = i32("pending");
  s.pending = pending.empty() ? -1 : pending[0];
  s.logits = f32("logits");
  for (size_t i = 0; d.contains(("kv." + std::to_string(i)).c_str()); ++i) s.kv.push_back(f32("kv." + std::to_string(i)));
  if (d.contains("mtp_h")) s.mtp_h = f32("mtp_h");
  // Files written before the engine could stop keeping the block's cache always kept it.
  s.mtp_valid = !d.contains("mtp_valid") || i32("mtp_valid") != std::vector<int32_t>{0};
  for (size_t i = 0; d.contains(("conv." + std::to_string(i)).c_str()); ++i) {
    s.conv.push_back(f32("conv." + std::to_string(i)));
    s.recurrent.push_back(f32("recurrent." + std::to_string(i)));
  }
  return s;
}

// Runs a Python callback from a thread without the GIL; a Python exception stops the loop and is
// re-raised once the C++ call has returned.
struct CallbackGuard {
  bool failed = false;
  template <class F>
  bool call(F&& f) {
    // A thread that takes the GIL during finalization is ended by Python mid-call; stop the loop instead.
    if (interpreter_finalizing()) return false;
    nb::gil_scoped_acquire gil;
    try {
      return f();
    } catch (nb::python_error& e) {
      e.restore();
      failed = true;
      return false;
    }
  }
  void rethrow() {
    if (failed) throw nb::python_error();
  }
};

// A prefill's between-chunks callback: lets Ctrl-C stop a long prefill, then runs `progress` (None: go on;
// a falsy return stops). Exceptions are held by `cb` and rethrown once the GIL is back.
std::function<bool(int64_t, int64_t)> prefill_progress(CallbackGuard& cb, const nb::object& progress) {
  return [&cb, &progress](int64_t done, int64_t total) {
    return cb.call([&] {
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      if (progress.is_none()) return true;
      nb::object r = progress(done, total);
      return r.is_none() || nb::cast<bool>(r);
    });
  };
}

SamplingParams parse_sampling(const nb::dict& p) {
  SamplingParams sp;
  sp.temperature = nb::cast<float>(p["temperature"]);
  sp.top_k = nb::cast<int64_t>(p["top_k"]);
  sp.top_p = nb::cast<float>(p["top_p"]);
  sp.min_p = nb::cast<float>(p["min_p"]);
  sp.repetition_penalty = nb::cast<float>(p["repetition_penalty"]);
  sp.presence_penalty = nb::cast<float>(p["presence_penalty"]);
  sp.frequency_penalty = nb::cast<float>(p["frequency_penalty"]);
  if (!p["seed"].is_none()) {
    sp.has_seed = true;
    sp.seed = nb::cast<uint64_t>(p["seed"]);
  }
  sp.validate();
  return sp;
}

// ---- Test entry points for the CPU runtime (thread pool, allocation guard, matmul scratch):
// tests/test_cpu_runtime.py.
namespace cpu_runtime_tests {

// Keeps an allocation observable, so the compiler cannot elide a new/delete pair under test.
inline void sink(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

// Spins until `flag` is set (or a second passes: a missing thread then shows up as a failed check).
inline void wait_for(const std::atomic<bool>& flag) {
  const auto t0 = std::chrono::steady_clock::now();
  while (!flag.load() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1))
    std::this_thread::yield();
}

// Every index of [0, n) must be visited exactly once by a plain loop (the pool after a failed job).
void check_plain_loop(cpu::ThreadPool& pool, std::vector<std::atomic<int>>& hits) {
  for (auto& h : hits) h.store(0);
  pool.parallel_for(int64_t(hits.size()), 1, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) hits[size_t(i)].fetch_add(1);
  });
  for (size_t i = 0; i < hits.size(); ++i)
    if (hits[i].load() != 1)
      throw std::logic_error("invariant: after a failed job, index " + std::to_string(i) + " ran " +
                             std::to_string(hits[i].load()) + " times");
}

// where: 0 any (the thread that gets index throw_at), 1 caller, 2 worker, 3 every range throws.
std::map<std::string, int64_t> parallel_for_throw(int threads, int64_t n, int64_t throw_at, int where,
                                                  int repeats, bool propagate) {
  cpu::ThreadPool pool(threads);
  std::vector<std::atomic<int>> hits(size_t(std::max<int64_t>(n, 1)));
  std::map<std::string, int64_t> stats{{"caller_threw", 0}, {"worker_threw", 0}, {"workers_overlapped", 0}};
  for (int r = 0; r < repeats; ++r) {
    std::atomic<int> in_body{0};
    std::atomic<bool> worker_threw{false}, caller_threw{false}, worker_in{false}, overlapped{false};
    auto body = [&](int64_t b, int64_t e, int tid) {
      struct Inside {  // counts threads inside the body, including while an exception unwinds it
        std::atomic<int>& c;
        explicit Inside(std::atomic<int>& c) : c(c) { c.fetch_add(1); }
        ~Inside() { c.fetch_sub(1); }
      } inside(in_body);
      const auto fail = [&](int64_t i) {
        (tid == 0 ? caller_threw : worker_threw).store(true);
        throw std::runtime_error("parallel_for body failed at index " + std::to_string(i) + " on thread " +
                                 std::to_string(tid));
      };
      if (where == 1) {
        // The caller throws while a worker is inside its range, which must finish before parallel_for
        // rethrows: the worker stays inside a while after the throw.
        if (tid == 0) {
          wait_for(worker_in);
          fail(b);
        }
        worker_in = true;
        wait_for(caller_threw);
        overlapped.store(caller_threw.load());
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return;
      }
      if (where == 2) {
        if (tid != 0) fail(b);
        wait_for(worker_threw);
        return;
      }
      if (where == 3) fail(b);
      for (int64_t i = b; i < e; ++i)
        if (i == throw_at) fail(i);
    };
    if (propagate) {
      pool.parallel_for(n, 1, body);
      throw std::logic_error("invariant: the throwing body did not make parallel_for throw");
    }
    bool caught = false;
    try {
      pool.parallel_for(n, 1, body);
    } catch (const std::runtime_error& ex) {
      caught = std::string(ex.what()).rfind("parallel_for body failed at index ", 0) == 0;
      if (!caught) throw;
    }
    if (!caught) throw std::logic_error("invariant: the throwing body did not make parallel_for throw");
    if (in_body.load() != 0)
      throw std::logic_error("invariant: parallel_for rethrew while " + std::to_string(in_body.load()) +
                             " thread(s) still ran the body");
    stats["caller_threw"] += caller_threw.load();
    stats["worker_threw"] += worker_threw.load();
    stats["workers_overlapped"] += overlapped.load();
    check_plain_loop(pool, hits);
  }
  return stats;
}

// Builds a pool (refusing thread `refuse_at`, 0 = none) and runs one loop on it; returns the pool size.
int thread_pool(int threads, int refuse_at) {
  cpu::ThreadPool pool(threads, refuse_at);
  std::vector<std::atomic<int>> hits(1000);
  check_plain_loop(pool, hits);
  return pool.size();
}

// Heap allocations counted by an AllocGuardScope around one kind of code (see the test).
int64_t alloc_guard(const std::string& kind, int threads) {
  cpu::ThreadPool pool(threads);  // started outside every scope
  if (kind == "new_caller") {
    cpu::AllocGuardScope g("new_caller");
    int* p = new int[16];
    sink(p);
    delete[] p;
    return g.count();
  }
  if (kind == "vector_caller") {
    cpu::AllocGuardScope g("vector_caller");
    std::vector<float> v(100);
    sink(v.data());
    return g.count();
  }
  if (kind == "vector_worker" || kind == "worker_active") {
    if (pool.size() < 2) throw std::invalid_argument("needs at least 2 threads");
    cpu::AllocGuardScope g(kind.c_str());
    std::atomic<bool> worker_done{false};
    std::atomic<int64_t> active{0};
    pool.parallel_for(pool.size(), 1, [&](int64_t, int64_t, int tid) {
      if (tid == 0) return wait_for(worker_done);  // the caller allocates nothing and leaves it to a worker
      if (kind == "vector_worker") {
        std::vector<float> v(64);
        sink(v.data());
      }
      active += cpu::alloc_guard_active();
      worker_done = true;
    });
    return kind == "vector_worker" ? g.count() : active.load();
  }
  if (kind == "worker_inactive_after") {  // a worker must not keep a finished job's scope
    if (pool.size() < 2) throw std::invalid_argument("needs at least 2 threads");
    std::atomic<int64_t> active{0};
    for (int guarded = 1; guarded >= 0; --guarded) {
      std::unique_ptr<cpu::AllocGuardScope> g;
      if (guarded) g = std::make_unique<cpu::AllocGuardScope>("worker_inactive_after");
      std::atomic<bool> worker_done{false};
      pool.parallel_for(pool.size(), 1, [&](int64_t, int64_t, int tid) {
        if (tid == 0) return wait_for(worker_done);
        if (!guarded) active += cpu::alloc_guard_active();
        worker_done = true;
      });
    }
    return active.load();
  }
  if (kind == "nested_inner" || kind == "nested_outer") {
    cpu::AllocGuardScope outer("outer");
    std::vector<float> a(10);
    sink(a.data());
    int64_t inner_count;
    {
      cpu::AllocGuardScope inner("inner");
      std::vector<float> b(10);
      sink(b.data());
      inner_count = inner.count();
    }
    return kind == "nested_inner" ? inner_count : outer.count();
  }
  if (kind == "parallel_for") {  // a call captures many references: std::function would allocate here
    std::vector<double> acc(size_t(pool.size()), 0.0);
    const double a = 1, b = 2, c = 3, d = 4;
    cpu::AllocGuardScope g("parallel_for");
    for (int rep = 0; rep < 100; ++rep)
      pool.parallel_for(1000, 1, [&](int64_t i0, int64_t i1, int tid) {
        for (int64_t i = i0; i < i1; ++i) acc[size_t(tid)] += a * double(i) + b * c - d;
      });
    sink(acc.data());
    return g.count();
  }
  if (kind == "check") {
    cpu::AllocGuardScope g("check");
    std::vector<float> v(1000);
    sink(v.data());
    g.check();
    return g.count();
  }
  throw std::invalid_argument("unknown kind '" + kind + "'");
}

}  // namespace cpu_runtime_tests

void bind_cpu_runtime_tests(nb::module_& m) {
  namespace t = cpu_runtime_tests;
  m.def("cpu_parallel_for_throw_test", [](int threads, int64_t n, int64_t throw_at, const std::string& where,
                                          int repeats, bool propagate) {
    const int w = where == "any" ? 0 : where == "caller" ? 1 : where == "worker" ? 2 : where == "all" ? 3 : -1;
    if (w < 0) throw std::invalid_argument("where must be 'any', 'caller', 'worker' or 'all'");
    nb::gil_scoped_release nogil;
    return t::parallel_for_throw(threads, n, throw_at, w, repeats, propagate);
  }, "threads"_a, "n"_a, "throw_at"_a, "where"_a = "any", "repeats"_a = 1, "propagate"_a = false);
  m.def("cpu_thread_pool_test", [](int threads, int refuse_at) {
    nb::gil_scoped_release nogil;
    return t::thread_pool(threads, refuse_at);
  }, "threads"_a, "refuse_at"_a = 0);
  m.def("cpu_alloc_guard_available", &cpu::alloc_guard_available);
  m.def("cpu_alloc_guard_test", [](const std::string& kind, int threads) {
    nb::gil_scoped_release nogil;
    return t::alloc_guard(kind, threads);
  }, "kind"_a, "threads"_a = 2);
  // The product of cpu_matmul under an allocation guard: the counts of `calls` guarded calls on one pool
  // and arena (threads = 0: matmul_serial on the arena's thread-0 scratch), reserved first if asked.
  m.def("cpu_matmul_guarded", [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x,
                                 const nb::dict& weight, const std::string& path, int threads, bool reserve,
                                 int calls) {
    WeightView w = parse_view(weight);
    const int64_t T = int64_t(x.shape(0));
    if (int64_t(x.shape(1)) != w.cols) throw std::invalid_argument("x has the wrong number of columns");
    if (path != "gemv" && path != "gemm") throw std::invalid_argument("path must be 'gemv' or 'gemm'");
    const cpu::MatmulPath mp = path == "gemv" ? cpu::MatmulPath::Gemv : cpu::MatmulPath::Gemm;
    float* out;
    auto arr = new_logits(T, w.rows, &out);
    std::vector<int64_t> counts(size_t(std::max(calls, 0)));
    {
      nb::gil_scoped_release nogil;
      cpu::ThreadPool pool(std::max(threads, 1));
      cpu::MatmulArena arena(pool.size());
      if (reserve) arena.reserve(T, w.cols, w.rows);
      for (auto& c : counts) {
        cpu::AllocGuardScope g("matmul");
        if (threads == 0)
          cpu::matmul_serial(x.data(), T, w.cols, w, out, w.rows, mp, arena.at(0));
        else
          cpu::matmul(x.data(), T, w.cols, w, out, w.rows, mp, pool, arena);
        c = g.count();
      }
    }
    return nb::make_tuple(arr, to_numpy(counts));
  }, "x"_a, "weight"_a, "path"_a, "threads"_a, "reserve"_a, "calls"_a = 1);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "Lily's compiled core: model graph, backends, session state and the decode loop.";
  // Objects a daemon thread still holds at interpreter exit are reported by nanobind as leaks; in a library
  // that lives inside other people's processes that is expected, not a bug to print.
  nb::set_leak_warnings(false);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ContextOverflow& e) {
      nb::object cls = nb::module_::import_("lily.errors").attr("ContextOverflowError");
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const SessionBusy& e) {
      nb::object cls = nb::module_::import_("lily.errors").attr("SessionBusyError");
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::logic_error& e) {  // a call the session's state does not allow (e.g. no context yet)
      nb::object cls = nb::module_::import_("lily.errors").attr("LilyError");
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const nb::builtin_exception&) {
      throw;  // nanobind's own TypeError / ValueError / ...: its default translator handles them
    } catch (const std::runtime_error& e) {  // the backend failed: a refused thread, a device error
      nb::object cls = nb::module_::import_("lily.errors").attr("BackendError");
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  m.def(
      "token_ids",
      [](nb::handle seq, int64_t vocab) -> nb::object {
        // A list or tuple of Python ints as int32 in one pass over the items, without a Python int object
        // read twice: numpy's asarray of an 8K-token list costs ~0.3 ms, which a warm prefix-cache turn pays
        // on top of prefilling its new tokens (issue 13 item 7). Anything else, or any item that is not an
        // exact int in [0, vocab), returns None: the caller's general path then converts or names the bad id.
        if (!PyList_CheckExact(seq.ptr()) && !PyTuple_CheckExact(seq.ptr())) return nb::none();
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
        if (n == 0) return nb::none();
        PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
        auto* buf = new int32_t[size_t(n)];
        for (Py_ssize_t i = 0; i < n; ++i) {
          PyObject* o = items[i];
          int overflow = 0;
          const long v = PyLong_CheckExact(o) ? PyLong_AsLongAndOverflow(o, &overflow) : -1;
          if (overflow || v < 0 || v >= vocab) {
            delete[] buf;
            return nb::none();
          }
          buf[i] = int32_t(v);
        }
        nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
        return nb::cast(nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>(buf, {size_t(n)}, owner));
      },
      "seq"_a, "vocab"_a,
      "A list or tuple of ints in [0, vocab) as a new int32 array; None for any other input (left to numpy).");
  m.def("backends", &backends_dict, "Every backend this build knows: built, usable, and why not.");
  m.def(
      "check_backend_options",
      [](const std::string& name, const nb::dict& options) {
        try {
          make_backend(name, options, false);
        } catch (const nb::cast_error&) {  // e.g. a str where a bool or an int belongs
          throw std::invalid_argument("a backend option has a value of the wrong type, in " +
                                      nb::cast<std::string>(nb::repr(options)));
        }
      },
      "name"_a, "options"_a, "Raises ValueError naming what make_backend would refuse in options; builds nothing.");
  bind_ops_bench(m);
#ifdef LILY_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("cuda_set_nvrtc_paths", &cuda::set_nvrtc_search_paths, "paths"_a,
        "Where to look for libnvrtc before the system's loader (set by lily.engine at import).");
  m.def("cuda_families", &cuda::CudaOps::families, "Every CUDA kernel family embedded in this build.");
  m.def("cuda_compile", [](const std::string& family, const std::vector<std::pair<std::string, int64_t>>& defines,
                           int arch) {
    double secs = 0;
    std::string cubin;
    {
      nb::gil_scoped_release nogil;
      cubin = cuda::compile_module(family, defines, arch, &secs);
    }
    return nb::make_tuple(cubin.size(), secs);
  }, "family"_a, "defines"_a, "arch"_a, "Compiles one kernel family with NVRTC (no GPU needed): (cubin bytes, seconds).");
#else
  m.attr("has_cuda") = false;
#endif

  nb::class_<PyEngine>(m, "Engine")
      .def(nb::init<const nb::dict&, const nb::dict&, const std::vector<std::pair<AnyArray, std::string>>&,
                    const std::string&, const nb::dict&>(),
           "config"_a, "tensors"_a, "files"_a, "backend"_a = "cpu", "options"_a = nb::dict())
      // The engine's MTP policy: whether sessions run the MTP block's rows (Qwen36::keep_mtp_rows).
      .def("set_keep_mtp_rows", [](PyEngine& e, bool keep) { e.model->set_keep_mtp_rows(keep); })
      .def("keep_mtp_rows", [](PyEngine& e) { return e.model->keep_mtp_rows(); })
      // Steps submitted to the backend so far (tests count what a call costs in steps).
      .def("steps_submitted",
           [](PyEngine& e) {
             return without_gil([&] {
               std::lock_guard<std::mutex> lk(e.lock);
               return e.ops->steps_submitted();
             });
           })
      .def("report",
           [](PyEngine& e) {
             nb::gil_scoped_release nogil;
             std::lock_guard<std::mutex> lk(e.lock);
             nb::gil_scoped_acquire gil;  // builds Python objects; no other thread waits on e.lock holding it
             return e.report();
           })
      .def("set_profiling",
           [](PyEngine& e, bool on) {
             without_gil([&] {
               std::lock_guard<std::mutex> lk(e.lock);
               e.ops->set_profiling(on);
             });
           })
      .def("profile", [](PyEngine& e) {
        std::map<std::string, double> out;
        without_gil([&] {
          std::lock_guard<std::mutex> lk(e.lock);
          for (size_t k = 0; k < kOpKinds; ++k)
            if (e.ops->profile()[k] > 0) out[op_name(OpKind(k))] = e.ops->profile()[k];
        });
        return out;
      });

  nb::class_<HostSnapshot>(m, "HostSnapshot")
      .def_prop_ro("position", [](const HostSnapshot& s) { return s.position + (s.pending >= 0); })
      .def_prop_ro("nbytes", &HostSnapshot::bytes)
      .def("to_arrays", &host_snapshot_arrays)
      .def_static("from_arrays", &host_snapshot_from_arrays);

  nb::class_<PySnapshot>(m, "Snapshot")
      .def_prop_ro("position", [](const PySnapshot& s) { return s.s->position(); })
      .def_prop_ro("nbytes", [](const PySnapshot& s) { return s.s->bytes(); })
      .def_prop_ro("own_nbytes", [](const PySnapshot& s) { return s.s->own_bytes(); })
      .def_prop_ro("base_position", [](const PySnapshot& s) { return s.s->base_position(); })
      .def_prop_ro("kv_segments", [](const PySnapshot& s) { return s.s->kv_segments(); })
      .def_prop_ro("kv_dtype", [](const PySnapshot& s) { return std::string(dtype_name(s.s->kv_dtype())); })
      .def("to_arrays", [](const PySnapshot& s) {
        HostSnapshot h = without_gil([&] { return s.s->to_host(); });
        return host_snapshot_arrays(h);
      });

  nb::class_<PySession>(m, "Session")
      .def("__init__",
           [](PySession* self, PyEngine& e, int64_t max_context, int64_t chunk, const std::string& kv_dtype) {
             if (kv_dtype != "f32" && kv_dtype != "bf16")
               throw std::invalid_argument("kv_cache_dtype must be 'f32' or 'bf16', got '" + kv_dtype + "'");
             auto s = without_gil([&] {
               return std::make_unique<Session>(*e.model, e.lock, max_context, chunk,
                                                kv_dtype == "bf16" ? DType::BF16 : DType::F32, &e.reserve);
             });
             new (self) PySession{std::move(s), e.model->config().vocab};
           },
           "engine"_a, "max_context"_a, "chunk"_a, "kv_dtype"_a = "f32", nb::keep_alive<1, 2>())
      .def_prop_ro("position", [](PySession& s) { return without_gil([&] { return s.s->position(); }); })
      .def_prop_ro("max_context", [](PySession& s) { return s.s->max_context(); })
      .def_prop_ro("chunk", [](PySession& s) { return s.s->chunk(); })
      .def_prop_ro("kv_dtype", [](PySession& s) { return std::string(dtype_name(s.s->kv_dtype())); })
      .def_prop_ro("state_bytes", [](PySession& s) { return s.s->state_bytes(); })
      .def_prop_ro("held_kv_rows", [](PySession& s) { return without_gil([&] { return s.s->held_kv_rows(); }); })
      .def("held_kv_rows_of",
           [](PySession& s, const PySnapshot& snap) { return without_gil([&] { return s.s->held_kv_rows(*snap.s); }); })
      .def("tokens", [](PySession& s) { return without_gil([&] { return s.s->tokens(); }); })
      .def("prefill",
           [](PySession& s, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> ids,
              bool all_logits, nb::object progress) {
             const int64_t n = int64_t(ids.shape(0));
             float* out;
             auto arr = new_logits(all_logits ? n : 1, s.vocab, &out);
             CallbackGuard cb;
             // Between chunks: run the progress callback, and let Ctrl-C stop a long prefill.
             const std::function<bool(int64_t, int64_t)> fn = prefill_progress(cb, progress);
             int64_t done;
             {
               nb::gil_scoped_release nogil;
               done = s.s->prefill(ids.data(), n, all_logits, out, fn);
             }
             cb.rethrow();
             return nb::make_tuple(arr, done);
           },
           "ids"_a, "all_logits"_a = false, "progress"_a = nb::none())
      .def("prefill_snapshots",
           [](nb::handle self, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> ids,
              const std::vector<int64_t>& at, const PySnapshot* base, nb::object progress, bool defer) {
             PySession& s = nb::cast<PySession&>(self);
             CallbackGuard cb;
             const std::function<bool(int64_t, int64_t)> fn = prefill_progress(cb, progress);
             std::vector<std::unique_ptr<DeviceSnapshot>> snaps;
             {
               nb::gil_scoped_release nogil;
               snaps =
                   s.s->prefill_snapshots(ids.data(), int64_t(ids.shape(0)), at, base ? base->s.get() : nullptr, fn,
                                          defer);
             }
             cb.rethrow();
             nb::list out;
             for (auto& snap : snaps)  // as snapshot()'s keep_alive: the session outlives its snapshots
               out.append(
                   nb::cast(new PySnapshot{std::move(snap), nb::borrow(self)}, nb::rv_policy::take_ownership));
             return out;
           },
           "ids"_a, "at"_a, "base"_a = nb::none(), "progress"_a = nb::none(), "defer"_a = true)
      .def_prop_ro("deferred_checkpoints",
                   [](PySession& s) { return without_gil([&] { return s.s->deferred_checkpoints(); }); })
      .def("step",
           [](PySession& s, int32_t token) {
             float* out;
             auto arr = new_logits(1, s.vocab, &out);
             {
               nb::gil_scoped_release nogil;
               s.s->step(token, out);
             }
             return arr;
           })
      .def("logits",
           [](PySession& s) {
             float* out;
             auto arr = new_logits(1, s.vocab, &out);
             {
               nb::gil_scoped_release nogil;
               s.s->logits(out);
             }
             return arr;
           })
      .def("generate",
           [](PySession& s, int64_t max_tokens, const nb::dict& p, const std::vector<int32_t>& stop_ids,
              nb::object on_token, bool with_logits, int mtp_k, nb::object policy, nb::object on_tokens) {
             SamplingParams sp = parse_sampling(p);
             // mtp="auto": {"cost": [c1..c4] (an iteration with k drafts in plain decode steps), "alpha0", "weight"}
             std::optional<MtpPolicy> pol;
             if (!policy.is_none()) {
               nb::dict pd = nb::cast<nb::dict>(policy);
               pol.emplace();
               const auto cost = nb::cast<std::vector<double>>(pd["cost"]);
               if (cost.size() != size_t(Session::kMaxMtpK))
                 throw std::invalid_argument("mtp policy: cost needs one ratio per k = 1.." +
                                             std::to_string(Session::kMaxMtpK));
               for (size_t k = 0; k < cost.size(); ++k) pol->cost[k + 1] = cost[k];
               pol->alpha0 = nb::cast<double>(pd["alpha0"]);
               pol->weight = nb::cast<double>(pd["weight"]);
             }
             CallbackGuard cb;
             const int64_t vocab = s.vocab;
             // on_token(tok[, logits]) answers 1 (received, go on), 0 (received, stop) or -1 (not received).
             std::function<int(int32_t, const float*)> fn = [&](int32_t tok, const float* logits) {
               int answer = -1;  // a failed callback delivered nothing
               cb.call([&] {
                 nb::object r;
                 if (logits) {
                   float* out;
                   auto row = new_logits(1, vocab, &out);
                   std::copy(logits, logits + vocab, out);
                   r = on_token(tok, row);
                 } else {
                   r = on_token(tok);
                 }
                 answer = r.is_none() ? 1 : nb::cast<int>(r);
                 return true;
               });
               return answer;
             };
             // on_tokens(ids, logits) for an MTP iteration's tokens (a list; logits [n, vocab] or None) answers
             // (received, go_on); a failed callback received nothing.
             Session::OnTokens batch = [&](const int32_t* ids, int64_t n, const float* rows, bool& go_on) {
               int64_t received = 0;
               cb.call([&] {
                 nb::list toks;
                 for (int64_t i = 0; i < n; ++i) toks.append(ids[i]);
                 nb::object r;
                 if (rows) {
                   float* out;
                   auto arr = new_logits(n, vocab, &out);
                   std::copy(rows, rows + n * vocab, out);
                   r = on_tokens(toks, arr);
                 } else {
                   r = on_tokens(toks, nb::none());
                 }
                 const auto answer = nb::cast<std::pair<int64_t, bool>>(r);
                 received = answer.first;
                 go_on = answer.second;
                 return true;
               });
               return received;
             };
             std::string reason;
             {
               nb::gil_scoped_release nogil;
               reason = mtp_k > 0 ? s.s->generate_mtp(max_tokens, sp, stop_ids, fn, with_logits, mtp_k,
                                                      pol ? &*pol : nullptr, on_tokens.is_none() ? nullptr : &batch)
                                  : s.s->generate(max_tokens, sp, stop_ids, fn, with_logits);
             }
             cb.rethrow();
             return reason;
           },
           "max_tokens"_a, "params"_a, "stop_ids"_a, "on_token"_a, "with_logits"_a = false, "mtp_k"_a = 0,
           "policy"_a = nb::none(), "on_tokens"_a = nb::none())
      .def("last_mtp_stats",
           [](PySession& s) {
             const MtpStats m = s.s->last_mtp_stats();
             nb::dict d;
             d["steps"] = m.steps;
             d["drafted"] = m.drafted;
             d["accepted"] = m.accepted;
             d["trials"] = m.trials;
             d["plain_tokens"] = m.plain_tokens;
             d["k_sum"] = m.k_sum;
             d["queued"] = m.queued;
             return d;
           })
      .def("mtp_cache_valid", [](PySession& s) { return s.s->mtp_cache_valid(); })
      // Tests only: the next drafts come from this list instead of the MTP block (Session::set_draft_override).
      .def("_draft_override",
           [](PySession& s, int64_t start, const std::vector<int32_t>& ids) {
             without_gil([&] { s.s->set_draft_override(start, ids); });
           })
      // Tests only: k chained draft logits rows [k, vocab] from the current state (Session::draft_logits).
      .def("_draft_logits",
           [](PySession& s, int32_t token, int k) {
             std::vector<float> rows = without_gil([&] { return s.s->draft_logits(token, k); });
             float* out;
             auto arr = new_logits(k, s.vocab, &out);
             std::copy(rows.begin(), rows.end(), out);
             return arr;
           },
           "token"_a, "k"_a)
      .def("snapshot",
           [](PySession& s, const PySnapshot* base) {
             auto snap = without_gil([&] { return s.s->snapshot(base ? base->s.get() : nullptr); });
             return new PySnapshot{std::move(snap), nb::object()};
           },
           "base"_a = nb::none(), nb::rv_policy::take_ownership, nb::keep_alive<0, 1>())
      .def("restore",
           [](PySession& s, const PySnapshot& snap) { without_gil([&] { s.s->restore(*snap.s); }); })
      .def("restore", [](PySession& s, const HostSnapshot& snap) { without_gil([&] { s.s->restore(snap); }); })
      .def("reset", [](PySession& s) { without_gil([&] { s.s->reset(); }); })
      .def_prop_ro("restore_pending", [](PySession& s) { return without_gil([&] { return s.s->restore_pending(); }); })
      .def("decode_stats", [](PySession& s) { return stats_dict(s.s->last_decode_stats()); })
      .def("prefill_stats", [](PySession& s) { return stats_dict(s.s->last_prefill_stats()); })
      .def("generate_transfers", [](PySession& s) {
        const Session::LoopTransfers t = s.s->last_generate_transfers();
        nb::dict d;
        d["steps"] = t.steps;
        d["uploads"] = t.uploads;
        d["downloads"] = t.downloads;
        d["download_bytes"] = t.download_bytes;
        return d;
      });

  // Kernel-level entry points for tests: the CPU oracle's products on raw descriptors.
  m.def("cpu_matmul", [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x,
                         const nb::dict& weight, const std::string& path, int threads) {
    WeightView w = parse_view(weight);
    const int64_t T = int64_t(x.shape(0));
    if (int64_t(x.shape(1)) != w.cols) throw std::invalid_argument("x has the wrong number of columns");
    float* out;
    auto arr = new_logits(T, w.rows, &out);
    if (path != "gemv" && path != "gemm") throw std::invalid_argument("path must be 'gemv' or 'gemm'");
    cpu::MatmulPath mp = path == "gemv" ? cpu::MatmulPath::Gemv : cpu::MatmulPath::Gemm;
    {
      nb::gil_scoped_release nogil;
      cpu::ThreadPool pool(threads);
      cpu::MatmulArena arena(pool.size());
      cpu::matmul(x.data(), T, w.cols, w, out, w.rows, mp, pool, arena);
    }
    return arr;
  }, "x"_a, "weight"_a, "path"_a, "threads"_a = 1);
  using F32Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
  m.def("cpu_rms_norm", [](F32Matrix x, nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> w,
                           float eps) {
    const int64_t rows = int64_t(x.shape(0)), cols = int64_t(x.shape(1)), seg = int64_t(w.shape(0));
    if (seg == 0 || cols % seg != 0) throw std::invalid_argument("x's columns must be a multiple of w's length");
    if (!(eps > 0.f)) throw std::invalid_argument("eps must be positive");
    float* out;
    auto arr = new_logits(rows, cols, &out);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t s = 0; s < cols / seg; ++s)
        cpu::rms_norm_segment(x.data() + r * cols + s * seg, w.data(), seg, eps, out + r * cols + s * seg);
    return arr;
  }, "x"_a, "w"_a, "eps"_a);
  m.def("cpu_row_dot", [](F32Matrix a, F32Matrix b) {
    if (a.shape(0) != b.shape(0) || a.shape(1) != b.shape(1)) throw std::invalid_argument("a and b differ in shape");
    const int64_t rows = int64_t(a.shape(0)), cols = int64_t(a.shape(1));
    std::vector<float> out(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) out[size_t(r)] = cpu::dot(a.data() + r * cols, b.data() + r * cols, cols);
    return to_numpy(out);
  }, "a"_a, "b"_a);
  // The sampler's Mersenne Twister against the standard library's, draw by draw (and the canonical
  // doubles against std::generate_canonical): the condition for seeded sampling to be reproducible.
  m.def("cpu_mt19937_matches_std", [](uint64_t seed, int64_t n) {
    std::vector<int32_t> w = sampler_rng_words(seed), w2 = w;
    std::mt19937_64 ref(seed), ref2(seed);
    for (int64_t i = 0; i < n; ++i) {
      if (mt::next(reinterpret_cast<uint32_t*>(w.data())) != ref()) return false;
      if (mt::canonical(reinterpret_cast<uint32_t*>(w2.data())) != std::generate_canonical<double, 53>(ref2))
        return false;
    }
    return true;
  }, "seed"_a, "n"_a);
  // The deferred CPU mode's host-access checks on a two-step scenario: what each access answers.
  m.def("cpu_deferred_selftest", [] {
    cpu::CpuOptions o;
    o.threads = 1;
    o.deferred = true;
    o.shuffle_seed = 1;
    cpu::CpuOps ops(o);
    Tensor a = ops.alloc("a", DType::F32, 1, 4), b = ops.alloc("b", DType::F32, 1, 4);
    float buf[4] = {0, 0, 0, 0};
    auto attempt = [&](auto&& f) -> std::string {
      try {
        f();
        return "ok";
      } catch (const std::logic_error& e) {
        return e.what();
      }
    };
    nb::dict r;
    ops.begin(Phase::Prefill);
    ops.fill(a, 3.0);
    const uint64_t f1 = ops.submit();
    r["read_while_written"] = attempt([&] { ops.download(a, buf); });
    ops.wait(f1);
    r["read_after_wait"] = attempt([&] {
      ops.download(a, buf);
      if (buf[0] != 3.f) throw std::logic_error("the deferred fill did not run");
    });
    ops.begin(Phase::Prefill);
    ops.copy(a, b);
    const uint64_t f2 = ops.submit();
    r["write_while_read"] = attempt([&] { ops.upload(a, buf); });
    r["read_of_buffer_only_read"] = attempt([&] { ops.download(a, buf); });
    ops.wait(f2);
    return r;
  });
#ifdef LILY_WITH_METAL
  m.attr("has_metal") = true;
  bind_metal(m);
#else
  m.attr("has_metal") = false;
#endif
  m.def("cpu_fma_peak", [](int threads, double seconds) {
    nb::gil_scoped_release nogil;
    return cpu::measure_fma_peak(threads, seconds);
  }, "threads"_a, "seconds"_a = 0.3);
  m.def("cpu_dequant_row", [](const nb::dict& weight, int64_t row) {
    WeightView w = parse_view(weight);
    if (row < 0 || row >= w.rows) throw std::invalid_argument("row out of range");
    std::vector<float> out(size_t(w.cols));
    cpu::dequant_row(w, row, out.data());
    return to_numpy(out);
  }, "weight"_a, "row"_a);
  m.def("cpu_matmul_variant", [](const nb::dict& weight, const std::string& path) {
    WeightView w = parse_view(weight);
    return std::string(cpu::matmul_variant(w, path == "gemv" ? cpu::MatmulPath::Gemv : cpu::MatmulPath::Gemm));
  });
  bind_cpu_runtime_tests(m);
}
