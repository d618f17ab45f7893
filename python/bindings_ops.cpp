// lily._core.OpBench: one backend's Ops driven op by op from Python, so every GPU kernel is tested against
// the CPU oracle on the same inputs (tests/cuda). Each run() is one step holding one op, submitted and
// waited for. Not part of the public API.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "model/config.h"
#include "model/weight.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace lily;

namespace lily {
std::unique_ptr<Ops> make_backend_for_bench(const std::string& name, const nb::dict& options);
ModelConfig parse_config_for_bench(const nb::dict& cfg);
}  // namespace lily

namespace {

using AnyArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

DType dtype_of(const std::string& s) {
  if (s == "f32") return DType::F32;
  if (s == "f16") return DType::F16;
  if (s == "bf16") return DType::BF16;
  if (s == "i32") return DType::I32;
  throw std::invalid_argument("dtype must be f32, f16, bf16 or i32, got '" + s + "'");
}

uint16_t f32_to_f16(float f) {  // round to nearest even (finite inputs; overflow to inf)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  int32_t e = int32_t((u >> 23) & 0xff) - 127 + 15;
  uint32_t m = u & 0x7fffffu;
  if (((u >> 23) & 0xff) == 0xff) return uint16_t(sign | 0x7c00u | (m ? 0x200u : 0));
  if (e >= 31) return uint16_t(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return uint16_t(sign);
    m |= 0x800000u;
    const int shift = 14 - e;
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = (uint32_t(e) << 10) | (m >> 13);
  const uint32_t rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;
  return uint16_t(sign | h);
}

class OpBench {
 public:
  OpBench(const std::string& backend, const nb::dict& options) : ops_(make_backend_for_bench(backend, options)) {}
  ~OpBench() {
    for (Tensor& t : tensors_) ops_->release(t);
  }

  int tensor(nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu> a, const std::string& dtype) {
    const DType dt = dtype_of(dtype);
    if (a.ndim() != 2) throw std::invalid_argument("OpBench.tensor takes a 2-D array");
    const int64_t rows = int64_t(a.shape(0)), cols = int64_t(a.shape(1));
    Tensor t = ops_->alloc("bench", dt, rows, cols);
    const size_t n = size_t(rows * cols);
    if (dt == DType::I32) {
      if (a.dtype() != nb::dtype<int32_t>()) throw std::invalid_argument("an i32 tensor takes an int32 array");
      ops_->upload(t, a.data());
    } else {
      if (a.dtype() != nb::dtype<float>()) throw std::invalid_argument("a float tensor takes a float32 array");
      const float* f = static_cast<const float*>(a.data());
      if (dt == DType::F32) {
        ops_->upload(t, f);
      } else {
        std::vector<uint16_t> h(n);
        for (size_t i = 0; i < n; ++i) h[i] = dt == DType::BF16 ? f32_to_bf16(f[i]) : f32_to_f16(f[i]);
        ops_->upload(t, h.data());
      }
    }
    return keep(t);
  }

  int empty(int64_t rows, int64_t cols, const std::string& dtype, bool poison) {
    const DType dt = dtype_of(dtype);
    Tensor t = ops_->alloc("bench", dt, rows, cols);
    if (!poison) return keep(t);  // zeroed (the dry-run compile check never reads it)
    const size_t n = size_t(rows * cols);
    if (dtype_size(dt) == 4) {
      std::vector<uint32_t> p(n, dt == DType::I32 ? 0x7f7f7f7fu : 0x7fc00000u);
      ops_->upload(t, p.data());
    } else {
      std::vector<uint16_t> p(n, 0x7e00u);  // a NaN in both bf16 and f16
      ops_->upload(t, p.data());
    }
    return keep(t);
  }

  int view(int h, int64_t row0, int64_t rows) {
    const Tensor& t = get(h);
    if (row0 < 0 || rows < 0 || row0 + rows > t.rows) throw std::invalid_argument("view rows out of range");
    views_.push_back(t.rows_view(row0, rows));
    return -int(views_.size());  // views are negative handles (never released on their own)
  }

  int workspace(const nb::dict& cfg, int64_t rows, int64_t max_ctx) {
    const ModelConfig c = parse_config_for_bench(cfg);
    const size_t bytes = ops_->workspace_bytes(c, rows, max_ctx);
    ops_->reserve(c, rows);
    return keep(ops_->alloc("workspace", DType::F32, 1, int64_t(std::max<size_t>(bytes, 4) + 3) / 4));
  }

  int weight(const nb::dict& d) {
    Weight w;
    const auto shape = nb::cast<std::vector<int64_t>>(d["shape"]);
    if (shape.size() != 2) throw std::invalid_argument("weight shape must have two dims");
    w.rows = shape[0];
    w.cols = shape[1];
    const int64_t E = d.contains("experts") ? nb::cast<int64_t>(d["experts"]) : 0;
    const int64_t copies = E ? E : 1;
    auto reg = [&](const char* key, size_t bytes_one, int32_t& mapping, uint64_t& offset, uint64_t& stride) {
      AnyArray a = nb::cast<AnyArray>(d[key]);
      if (a.nbytes() != bytes_one * size_t(copies))
        throw std::invalid_argument(std::string("weight '") + key + "' holds " + std::to_string(a.nbytes()) +
                                    " bytes, expected " + std::to_string(bytes_one * size_t(copies)));
      keep_.push_back(nb::cast(a));
      mapping = ops_->register_mapping(a.data(), a.nbytes(), std::string("bench.") + key);
      offset = 0;
      stride = E ? bytes_one : 0;
    };
    const std::string kind = nb::cast<std::string>(d["kind"]);
    if (kind == "dense") {
      w.kind = WeightFormat::Kind::Dense;
      w.dtype = dtype_of(nb::cast<std::string>(d["dtype"]));
      reg("data", w.row_bytes() * size_t(w.rows), w.mapping, w.data, w.data_stride);
    } else if (kind == "affine") {
      w.kind = WeightFormat::Kind::Affine;
      w.bits = nb::cast<int>(d["bits"]);
      w.group = nb::cast<int>(d["group"]);
      w.scale_dtype = dtype_of(nb::cast<std::string>(d["scale_dtype"]));
      reg("data", w.row_bytes() * size_t(w.rows), w.mapping, w.data, w.data_stride);
      reg("scales", w.scale_bytes(), w.scale_mapping, w.scales, w.scale_stride);
      reg("biases", w.scale_bytes(), w.bias_mapping, w.biases, w.bias_stride);
    } else {
      throw std::invalid_argument("weight kind must be dense or affine");
    }
    w.experts = E;
    max_cols_ = std::max(max_cols_, w.cols);
    weights_.push_back(std::make_unique<Weight>(w));
    ops_->place_weights({weights_.back().get()});
    return int(weights_.size() - 1);
  }

  nb::object read(int h) {
    const Tensor& t = get(h);
    const size_t n = size_t(t.rows * t.cols);
    if (t.dtype == DType::I32) {
      auto* buf = new int32_t[std::max<size_t>(n, 1)];
      nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
      download(t, buf);
      return nb::cast(nb::ndarray<nb::numpy, int32_t, nb::ndim<2>>(buf, {size_t(t.rows), size_t(t.cols)}, owner));
    }
    auto* buf = new float[std::max<size_t>(n, 1)];
    nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    if (t.dtype == DType::F32) {
      download(t, buf);
    } else {
      std::vector<uint16_t> h16(n);
      download(t, h16.data());
      for (size_t i = 0; i < n; ++i) buf[i] = t.dtype == DType::BF16 ? bf16_to_f32(h16[i]) : f16_to_f32(h16[i]);
    }
    return nb::cast(nb::ndarray<nb::numpy, float, nb::ndim<2>>(buf, {size_t(t.rows), size_t(t.cols)}, owner));
  }

  void run(const std::string& op, const std::string& phase, const nb::kwargs& kw) { encode_and_run(op, phase, kw, 1); }

  // Seconds per op: one step holding `repeats` copies of the op, run `runs` times (a decode step is a CUDA
  // graph on the CUDA backend: the first run captures it, later ones replay), median of the later runs'
  // wall time / repeats. Launch gaps inside the step count (they are what a decode step pays).
  double time(const std::string& op, const std::string& phase, int64_t repeats, int runs, const nb::kwargs& kw) {
    std::vector<double> t;
    for (int r = 0; r < runs + 1; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      encode_and_run(op, phase, kw, repeats);
      if (r) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2] / double(repeats);
  }

  void encode_and_run(const std::string& op, const std::string& phase, const nb::kwargs& kw, int64_t repeats) {
    auto T = [&](const char* k) -> Tensor {
      if (!kw.contains(k)) throw std::invalid_argument("op '" + op + "' needs tensor '" + k + "'");
      return get(nb::cast<int>(kw[k]));
    };
    auto W = [&](const char* k) -> const Weight& {
      if (!kw.contains(k)) throw std::invalid_argument("op '" + op + "' needs weight '" + k + "'");
      return *weights_.at(size_t(nb::cast<int>(kw[k])));
    };
    auto F = [&](const char* k, double def) { return kw.contains(k) ? nb::cast<double>(kw[k]) : def; };
    auto I = [&](const char* k) -> int64_t {
      if (!kw.contains(k)) throw std::invalid_argument("op '" + op + "' needs '" + k + "'");
      return nb::cast<int64_t>(kw[k]);
    };
    auto attn = [&] {
      return AttentionShape{I("heads"), I("kv_heads"), I("head_dim"), I("rotary_dim"), F("rope_theta", 1e7),
                            float(F("eps", 1e-6))};
    };
    auto delta = [&] {
      return DeltaShape{I("k_heads"), I("v_heads"), I("k_dim"), I("v_dim"), I("conv_kernel"), float(F("eps", 1e-6))};
    };
    // capture=<tensor>, capture_first=r, capture_count=n: the DeltaNet state after rows r .. r+n-1 (StateCapture).
    auto capture = [&] {
      if (!kw.contains("capture")) return StateCapture{};
      return StateCapture{T("capture"), I("capture_first"), I("capture_count")};
    };
    // w0/out0 .. w3/out3, the first n present (MatmulGroup).
    auto group = [&] {
      MatmulGroup g;
      static const char* const names[4][2] = {{"w0", "out0"}, {"w1", "out1"}, {"w2", "out2"}, {"w3", "out3"}};
      for (const auto& nm : names)
        if (kw.contains(nm[0])) g.add(W(nm[0]), T(nm[1]));
      return g;
    };
    if (phase != "prefill" && phase != "decode") throw std::invalid_argument("phase must be prefill or decode");
    if (repeats < 1) throw std::invalid_argument("repeats must be >= 1");
    Ops& o = *ops_;
    // The bench has no model scratch: the ops with matmuls size the backend's for their rows and the widest weight.
    if (phase == "prefill" && (op.find("matmul") != std::string::npos || op == "moe"))
      o.reserve_matmul(T(op == "add_rms_norm_matmuls" ? "a" : "x").rows, max_cols_);
    o.begin(phase == "decode" ? Phase::Decode : Phase::Prefill);
    try {
     for (int64_t rep = 0; rep < repeats; ++rep) {
      if (op == "embed") o.embed(T("ids"), W("table"), T("out"));
      else if (op == "rms_norm") o.rms_norm(T("x"), T("w"), T("out"), float(F("eps", 1e-6)));
      else if (op == "matmul") o.matmul(T("x"), W("w"), T("out"));
      else if (op == "matmuls") o.matmuls(T("x"), group());
      else if (op == "rms_norm_matmuls") o.rms_norm_matmuls(T("x"), T("w"), float(F("eps", 1e-6)), T("normed"), group());
      else if (op == "add_rms_norm_matmuls")
        o.add_rms_norm_matmuls(T("a"), T("b"), T("w"), float(F("eps", 1e-6)), T("sum"), T("normed"), group());
      else if (op == "moe") {
        const MoeWeights mw{W("gate"), W("up"), W("down"), W("shared_gate_proj"), W("shared_up"), W("shared_down")};
        const MoeScratch ms{T("ids"), T("weights"), T("routed"), T("shared_g"), T("shared_u"), T("shared_act"), T("shared")};
        o.moe(T("x"), T("router_logits"), T("shared_gate_logit"), I("k"), mw, ms, T("ws"), T("h"));
      }
      else if (op == "add") o.add(T("a"), T("b"), T("out"));
      else if (op == "add_rms_norm") o.add_rms_norm(T("a"), T("b"), T("w"), float(F("eps", 1e-6)), T("sum"), T("normed"));
      else if (op == "attn_qk_prep")
        o.attn_qk_prep(T("qg"), T("k"), T("q_norm"), T("k_norm"), T("pos"), attn(), T("q_out"), T("gate_out"), T("k_out"));
      else if (op == "kv_append") o.kv_append(T("k"), T("v"), T("pos"), T("k_cache"), T("v_cache"), I("max_ctx"), attn());
      else if (op == "attn_qk_prep_append")
        o.attn_qk_prep_append(T("qg"), T("k"), T("v"), T("q_norm"), T("k_norm"), T("pos"), attn(), T("q_out"),
                              T("gate_out"), T("k_out"), T("k_cache"), T("v_cache"), I("max_ctx"));
      else if (op == "attention")
        o.attention(T("q"), T("gate"), T("k_cache"), T("v_cache"), T("pos"), I("max_ctx"), attn(), T("ws"), T("out"));
      else if (op == "conv1d_silu")
        o.conv1d_silu(T("mixed"), T("conv_w"), T("state_in"), T("state_out"), T("out"), capture());
      else if (op == "gated_delta")
        o.gated_delta(T("qkv"), T("b"), T("a"), T("A_log"), T("dt_bias"), T("state_in"), T("state_out"), delta(), T("ws"),
                      T("out"), capture());
      else if (op == "conv_delta_norm") {
        // conv_capture / rec_capture (with capture_first, capture_count): the two StateCaptures.
        auto cap = [&](const char* k) {
          return kw.contains(k) ? StateCapture{T(k), I("capture_first"), I("capture_count")} : StateCapture{};
        };
        o.conv_delta_norm(T("qkv"), T("z"), T("b"), T("a"), T("conv_w"), T("A_log"), T("dt_bias"), T("norm_w"),
                          float(F("eps", 1e-6)), delta(), T("conv_in"), T("conv_out"), T("rec_in"), T("rec_out"),
                          T("mixed"), T("delta_o"), T("ws"), T("out"), cap("conv_capture"), cap("rec_capture"));
      } else if (op == "gated_rms_norm") o.gated_rms_norm(T("o"), T("z"), T("w"), float(F("eps", 1e-6)), T("out"));
      else if (op == "moe_route") o.moe_route(T("logits"), I("k"), T("ws"), T("ids"), T("weights"));
      else if (op == "moe_experts")
        o.moe_experts(T("x"), T("ids"), T("weights"), W("gate"), W("up"), W("down"), T("ws"), T("out"));
      else if (op == "swiglu") o.swiglu(T("gate"), T("up"), T("out"));
      else if (op == "moe_combine") o.moe_combine(T("routed"), T("shared"), T("shared_gate_logit"), T("h"));
      else if (op == "copy") o.copy(T("src"), T("dst"));
      else if (op == "fill") o.fill(T("dst"), F("value", 0));
      else if (op == "advance_position") o.advance_position(T("pos_in"), T("pos_out"), I("T"));
      else if (op == "accept_drafts")
        o.accept_drafts(T("ids"), T("y"), T("pos_in"), T("accepted"), T("next_id"), T("pos_out"));
      else if (op == "copy_rows_at") o.copy_rows_at(T("src"), T("index"), I("offset"), T("dst"));
      else if (op == "mtp_input")
        o.mtp_input(T("ids"), W("table"), T("h"), T("w_e"), T("w_h"), float(F("eps", 1e-6)), T("e"), T("normed"),
                    T("out"));
      else if (op == "sample") {
        SamplerState st{T("counts"), T("seen"), T("rng"), T("ring"), T("ring_count")};
        SamplingParams p;
        p.temperature = float(F("temperature", 0));
        p.top_k = kw.contains("top_k") ? I("top_k") : 0;
        p.top_p = float(F("top_p", 1));
        p.min_p = float(F("min_p", 0));
        p.repetition_penalty = float(F("repetition_penalty", 1));
        p.presence_penalty = float(F("presence_penalty", 0));
        p.frequency_penalty = float(F("frequency_penalty", 0));
        if (kw.contains("seed") && !kw["seed"].is_none()) {
          p.has_seed = true;
          p.seed = nb::cast<uint64_t>(kw["seed"]);
        }
        p.validate();
        o.sample(T("logits"), st, p, T("ws"), T("next_id"));
      } else {
        throw std::invalid_argument("unknown op '" + op + "'");
      }
     }
    } catch (...) {
      o.abandon();
      throw;
    }
    const uint64_t f = o.submit();
    nb::gil_scoped_release release;
    o.wait(f);
    stats_ = o.stats();
  }

  nb::dict stats() const {
    nb::dict d;
    d["ops"] = stats_.ops;
    d["stages"] = stats_.stages;
    return d;
  }

  Ops& ops() { return *ops_; }

 private:
  int keep(const Tensor& t) {
    tensors_.push_back(t);
    return int(tensors_.size() - 1);
  }
  const Tensor& get(int h) const {
    if (h < 0) return views_.at(size_t(-h - 1));
    return tensors_.at(size_t(h));
  }
  void download(const Tensor& t, void* dst) { ops_->download(t, dst); }

  std::unique_ptr<Ops> ops_;
  std::vector<Tensor> tensors_, views_;
  int64_t max_cols_ = 0;  // the widest weight made (reserve_matmul)
  std::vector<std::unique_ptr<Weight>> weights_;
  std::vector<nb::object> keep_;  // the arrays weights point into (the CPU reads them in place)
  StepStats stats_{};
};

}  // namespace

namespace lily {
nb::dict report_for_bench(Ops& ops);

void bind_ops_bench(nb::module_& m) {
  nb::class_<OpBench>(m, "OpBench")
      .def(nb::init<const std::string&, const nb::dict&>(), "backend"_a, "options"_a = nb::dict())
      .def("tensor", &OpBench::tensor, "array"_a, "dtype"_a = "f32")
      .def("empty", &OpBench::empty, "rows"_a, "cols"_a, "dtype"_a = "f32", "poison"_a = true)
      .def("view", &OpBench::view, "tensor"_a, "row0"_a, "rows"_a)
      .def("workspace", &OpBench::workspace, "config"_a, "rows"_a, "max_ctx"_a)
      .def("weight", &OpBench::weight, "desc"_a)
      .def("read", &OpBench::read, "tensor"_a)
      .def("run", &OpBench::run, "op"_a, "phase"_a = "prefill", "kwargs"_a)
      .def("time", &OpBench::time, "op"_a, "phase"_a = "decode", "repeats"_a = 20, "runs"_a = 5, "kwargs"_a,
           "Seconds per op over `repeats` copies in one step, median of `runs` runs (after one warm-up).")
      .def("stats", &OpBench::stats)
      .def("report", [](OpBench& b) { return report_for_bench(b.ops()); });
}
}  // namespace lily
