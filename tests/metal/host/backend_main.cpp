// The Metal backend (csrc/metal, MetalOps) against the CPU backend (csrc/cpu, CpuOps, the oracle), op by op and
// end to end, on the fake Metal runtime with the real kernels (metal/*.metal) in the MSL emulator.
// tests/metal/test_backend.py runs it.
//
// usage: backend_main ops [--only NAME] METAL_FILE...
//        backend_main model [--layers-spec NAME] METAL_FILE...
// ops:   every op of csrc/backend/ops.h on fresh random inputs (never zeros), at real-model-like and awkward
//        shapes, each in its own step on both backends; prints "op <name> <case>: max_err <e> tol <t> ok|FAIL" and
//        exits 1 when any case fails. Integer outputs (ids, positions, sampler state) must match exactly.
// model: a tiny random Qwen3.6 (DeltaNet and attention layers, 4-bit and dense weights, stacked experts) loaded
//        into both backends through csrc/model/loader.cpp and driven by the real Session (chunked prefill, the
//        decode loop with two alternating command buffers, snapshot/restore): logits and greedy tokens compared.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/backend.h"
#include "metal/backend.h"
#include "model/config.h"
#include "model/loader.h"
#include "model/qwen36.h"
#include "runtime/mt19937.h"
#include "runtime/session.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace lily;

namespace {

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::mt19937_64 g_rng(1234);
float signed_uniform() {  // magnitudes in [0.1, 1), both signs: zeros hide indexing mistakes
  std::uniform_real_distribution<float> u(0.1f, 1.f);
  return (g_rng() & 1 ? -1.f : 1.f) * u(g_rng);
}
std::vector<float> randv(size_t n, float scale = 1.f) {
  std::vector<float> v(n);
  for (auto& x : v) x = signed_uniform() * scale;
  return v;
}

// ---- weights in one host blob (a "checkpoint mapping"), 16 KB aligned so Metal wraps it without a copy ----
struct Blob {
  size_t cap, used = 0;
  uint8_t* p;
  explicit Blob(size_t bytes, size_t misalign = 0) : cap(bytes) {
    p = static_cast<uint8_t*>(std::aligned_alloc(16384, (bytes + misalign + 16383) / 16384 * 16384));
    std::memset(p, 0, (bytes + misalign + 16383) / 16384 * 16384);
    p += misalign;
    base_misalign = misalign;
  }
  ~Blob() { std::free(p - base_misalign); }
  size_t base_misalign;
  uint64_t take(size_t n, size_t align = 64) {
    used = (used + align - 1) / align * align;
    const uint64_t off = used;
    used += n;
    if (used > cap) throw std::runtime_error("blob too small");
    return off;
  }
};

uint16_t f32_bf16(float f) { return f32_to_bf16(f); }
uint16_t f32_f16(float f) {  // round to nearest even (values here are small normals)
  _Float16 h = _Float16(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

// A random weight [rows, cols] (E stacked experts) of the given format written into the blob.
Weight make_weight(Blob& blob, int32_t mapping, const std::string& fmt, int64_t rows, int64_t cols, int64_t E = 0,
                   size_t extra_offset = 0) {
  Weight w;
  w.rows = rows;
  w.cols = cols;
  w.mapping = w.scale_mapping = w.bias_mapping = mapping;
  w.experts = E;
  const int64_t n = E ? E : 1;
  const float scale = 1.f / std::sqrt(float(cols));
  if (fmt == "f32" || fmt == "bf16" || fmt == "f16") {
    w.kind = WeightFormat::Kind::Dense;
    w.dtype = fmt == "f32" ? DType::F32 : fmt == "bf16" ? DType::BF16 : DType::F16;
    const size_t per = w.row_bytes() * size_t(rows);
    w.data = blob.take(per * size_t(n) + extra_offset) + extra_offset;
    w.data_stride = E ? per : 0;
    for (int64_t i = 0; i < n * rows * cols; ++i) {
      const float v = signed_uniform() * scale;
      uint8_t* d = blob.p + w.data;
      if (w.dtype == DType::F32) std::memcpy(d + i * 4, &v, 4);
      else {
        const uint16_t b = w.dtype == DType::BF16 ? f32_bf16(v) : f32_f16(v);
        std::memcpy(d + i * 2, &b, 2);
      }
    }
    return w;
  }
  // "q4g64-bf16", "q8g32-f16", ...
  w.kind = WeightFormat::Kind::Affine;
  w.bits = fmt[1] - '0';
  w.group = std::stoi(fmt.substr(3, fmt.find('-') - 3));
  w.scale_dtype = fmt.substr(fmt.find('-') + 1) == "bf16" ? DType::BF16 : DType::F16;
  const size_t cb = w.row_bytes() * size_t(rows), sb = w.scale_bytes();
  // extra_offset: every part that many bytes past an aligned start (a shard whose header length is odd)
  w.data = blob.take(cb * size_t(n) + extra_offset) + extra_offset;
  w.scales = blob.take(sb * size_t(n) + extra_offset) + extra_offset;
  w.biases = blob.take(sb * size_t(n) + extra_offset) + extra_offset;
  if (E) w.data_stride = cb, w.scale_stride = sb, w.bias_stride = sb;
  for (size_t i = 0; i < cb * size_t(n); ++i) blob.p[w.data + i] = uint8_t(g_rng());
  const float qmax = float((1 << w.bits) - 1);
  for (size_t i = 0; i < sb / 2 * size_t(n); ++i) {
    const float s = scale * 2.f / qmax * (0.5f + 0.5f * std::fabs(signed_uniform()));
    const float b = -s * qmax / 2.f + 0.1f * scale * signed_uniform();
    const uint16_t sv = w.scale_dtype == DType::BF16 ? f32_bf16(s) : f32_f16(s);
    const uint16_t bv = w.scale_dtype == DType::BF16 ? f32_bf16(b) : f32_f16(b);
    std::memcpy(blob.p + w.scales + i * 2, &sv, 2);
    std::memcpy(blob.p + w.biases + i * 2, &bv, 2);
  }
  return w;
}

// E stacked experts whose bytes overlap: expert e starts e/256 of an expert's bytes after expert 0 (E ≤ 257),
// so a layer of 256 experts at the real shapes indexes like the checkpoint's without 384 MiB of weights; each
// expert still reads its own window of random codes, scales and biases.
Weight make_overlapped_experts(Blob& blob, int32_t mapping, const std::string& fmt, int64_t rows, int64_t cols,
                               int64_t E) {
  Weight w = make_weight(blob, mapping, fmt, rows, cols, 2, 0);  // room for two whole experts
  auto shrink = [](uint64_t per) { return per / 256 / 16 * 16; };
  w.experts = E;
  w.data_stride = shrink(w.data_stride), w.scale_stride = shrink(w.scale_stride), w.bias_stride = shrink(w.bias_stride);
  return w;
}

// ---- the two backends side by side ----
struct Both {
  cpu::CpuOps cpu{cpu::CpuOptions{1}};
  metal::MetalOps mtl;
  explicit Both(const std::string& msl) : mtl(msl) {}
  struct T2 {
    Tensor c, m;
  };
  T2 alloc(DType dt, int64_t rows, int64_t cols, const void* data = nullptr) {
    T2 t{cpu.alloc("t", dt, rows, cols), mtl.alloc("t", dt, rows, cols)};
    if (data) cpu.upload(t.c, data), mtl.upload(t.m, data);
    return t;
  }
  T2 f32(int64_t rows, int64_t cols, float scale = 1.f) {
    auto v = randv(size_t(rows * cols), scale);
    return alloc(DType::F32, rows, cols, v.data());
  }
  T2 i32(int64_t rows, int64_t cols, const std::vector<int32_t>& v) { return alloc(DType::I32, rows, cols, v.data()); }
  void run(Phase ph, const std::function<void(Ops&, bool metal)>& f) {
    for (int which = 0; which < 2; ++which) {
      Ops& o = which ? static_cast<Ops&>(mtl) : static_cast<Ops&>(cpu);
      o.begin(ph);
      try {
        f(o, which == 1);
      } catch (...) {
        o.abandon();
        throw;
      }
      o.wait(o.submit());
    }
  }
  template <class V>
  std::vector<V> get(Ops& o, const Tensor& t) {
    std::vector<V> v(size_t(t.rows * t.cols) * dtype_size(t.dtype) / sizeof(V));
    o.download(t, v.data());
    return v;
  }
};

int g_failures = 0;
std::string g_only;

bool wanted(const std::string& op) { return g_only.empty() || g_only == op; }

// NaN in every element of both backends' tensor, so an element a kernel forgets to write fails the comparison.
void poison(Both& b, const Both::T2& t) {
  const std::vector<float> nan(size_t(t.c.rows * t.c.cols), NAN);
  b.cpu.upload(t.c, nan.data()), b.mtl.upload(t.m, nan.data());
}

// Worst |metal − cpu| relative to the largest |cpu| of the output (fp32 reordering error is ~1e-6 of it).
void check_f32(Both& b, const std::string& op, const std::string& name, const Both::T2& t, double tol = 2e-5) {
  auto c = b.get<float>(b.cpu, t.c);
  auto m = b.get<float>(b.mtl, t.m);
  double scale = 1e-30, err = 0;
  size_t bad = 0;
  for (float x : c) scale = std::max(scale, double(std::fabs(x)));
  for (size_t i = 0; i < c.size(); ++i) {
    const double e = std::isfinite(m[i]) ? std::fabs(double(m[i]) - c[i]) / scale : INFINITY;
    if (e > err) err = e, bad = i;
  }
  const bool ok = err <= tol;
  printf("op %s %s: max_err %.3g tol %.3g %s", op.c_str(), name.c_str(), err, tol, ok ? "ok\n" : "FAIL");
  if (!ok) printf(" (element %zu: cpu %.9g metal %.9g)\n", bad, c[bad], m[bad]), ++g_failures;
}

void check_i32(Both& b, const std::string& op, const std::string& name, const Both::T2& t) {
  auto c = b.get<int32_t>(b.cpu, t.c);
  auto m = b.get<int32_t>(b.mtl, t.m);
  size_t diff = 0;
  for (size_t i = 0; i < c.size(); ++i) diff += c[i] != m[i];
  printf("op %s %s: %zu of %zu differ %s\n", op.c_str(), name.c_str(), diff, c.size(), diff ? "FAIL" : "ok");
  g_failures += diff != 0;
}

// bf16 rows written from fp32 values that differ by a few ulps on the two backends (a prepared k row): one bf16
// rounding may go the other way, so widened and compared as check_f32 does.
void check_bf16_close(Both& b, const std::string& op, const std::string& name, const Both::T2& t, double tol) {
  auto c = b.get<uint16_t>(b.cpu, t.c);
  auto m = b.get<uint16_t>(b.mtl, t.m);
  auto widen = [](uint16_t u) {
    const uint32_t w = uint32_t(u) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  };
  double scale = 1e-30, err = 0;
  for (uint16_t x : c) scale = std::max(scale, double(std::fabs(widen(x))));
  for (size_t i = 0; i < c.size(); ++i) {
    const float mv = widen(m[i]);
    err = std::max(err, std::isfinite(mv) ? std::fabs(double(mv) - widen(c[i])) / scale : double(INFINITY));
  }
  const bool ok = err <= tol;
  printf("op %s %s: max_err %.3g tol %.3g %s\n", op.c_str(), name.c_str(), err, tol, ok ? "ok" : "FAIL");
  g_failures += !ok;
}

void check_u16(Both& b, const std::string& op, const std::string& name, const Both::T2& t) {
  auto c = b.get<uint16_t>(b.cpu, t.c);
  auto m = b.get<uint16_t>(b.mtl, t.m);
  size_t diff = 0;
  for (size_t i = 0; i < c.size(); ++i) diff += c[i] != m[i];
  printf("op %s %s: %zu of %zu differ %s\n", op.c_str(), name.c_str(), diff, c.size(), diff ? "FAIL" : "ok");
  g_failures += diff != 0;
}

int run_ops(const std::string& msl) {
  Both b(msl);
  Blob blob(12 << 20);
  const int32_t mc = b.cpu.register_mapping(blob.p, blob.cap, "weights");
  const int32_t mm = b.mtl.register_mapping(blob.p, blob.cap, "weights");
  if (mc != mm) throw std::runtime_error("mapping ids differ");
  // A mapping that is not 16 KB aligned: copied at load (so its weights are written before it is registered).
  Blob odd(1 << 20, 4096);
  const int32_t modd = mc + 1;
  const Weight odd_weight = make_weight(odd, modd, "q8g32-f16", 11, 96);
  b.cpu.register_mapping(odd.p, odd.cap, "odd");
  if (b.mtl.register_mapping(odd.p, odd.cap, "odd") != modd) throw std::runtime_error("mapping ids differ");

  // ---- matmul and embed: every format, decode (GEMV, qmv4 for 4-bit) and prefill rows ----
  struct MatCase { std::string fmt; int64_t N, K, T; Phase ph; bool odd_map; size_t misalign; };
  const std::vector<MatCase> mats = {
      {"q4g64-bf16", 37, 192, 1, Phase::Decode, false, 0},  {"q4g64-bf16", 37, 192, 5, Phase::Prefill, false, 0},
      {"q4g32-f16", 13, 320, 1, Phase::Decode, false, 0},   {"q4g128-bf16", 9, 256, 3, Phase::Prefill, false, 0},
      {"q8g64-bf16", 40, 128, 1, Phase::Decode, false, 0},  {"q8g32-f16", 11, 96, 4, Phase::Prefill, true, 0},
      {"f32", 21, 70, 3, Phase::Prefill, false, 0},        {"bf16", 33, 96, 1, Phase::Decode, false, 0},
      {"f16", 7, 48, 2, Phase::Prefill, false, 0},         {"bf16", 5, 64, 2, Phase::Decode, false, 1},
      // 4-bit parts at odd byte offsets (codes, scales, biases): copied once at load, so the decode row keeps qmv4
      {"q4g64-bf16", 19, 192, 1, Phase::Decode, false, 3},  {"q4g32-f16", 6, 128, 1, Phase::Decode, false, 1},
  };
  if (wanted("matmul") || wanted("embed"))
    for (const auto& c : mats) {
      const size_t misalign_bytes = c.misalign;  // parts at odd byte offsets: copied once, reported
      Weight w = c.odd_map ? odd_weight : make_weight(blob, mc, c.fmt, c.N, c.K, 0, misalign_bytes);
      const std::string name = c.fmt + " [" + std::to_string(c.N) + "x" + std::to_string(c.K) + "] T=" +
                               std::to_string(c.T) + (c.ph == Phase::Decode ? " decode" : " prefill") +
                               (c.odd_map ? " copied-mapping" : "") + (c.misalign ? " misaligned-part" : "");
      if (wanted("matmul")) {
        auto x = b.f32(c.T, c.K);
        auto y = b.alloc(DType::F32, c.T, c.N);
        const int64_t qmv4_0 = b.mtl.counters().qmv4_dispatches;
        b.run(c.ph, [&](Ops& o, bool m) { o.matmul(m ? x.m : x.c, w, m ? y.m : y.c); });
        // The kernel that ran (the counter) next to the one the report names (matmul_variant).
        const bool ran_qmv4 = b.mtl.counters().qmv4_dispatches > qmv4_0;
        check_f32(b, "matmul", name + " ran " + (ran_qmv4 ? "qmv4" : "matmul_rows") + " " + b.mtl.matmul_variant(w, c.ph), y);
      }
      if (wanted("embed")) {
        std::vector<int32_t> idv;
        for (int64_t t = 0; t < c.T + 2; ++t) idv.push_back(int32_t(g_rng() % uint64_t(c.N)));
        auto ids = b.i32(c.T + 2, 1, idv);
        auto out = b.alloc(DType::F32, c.T + 2, c.K);
        b.run(c.ph, [&](Ops& o, bool m) { o.embed(m ? ids.m : ids.c, w, m ? out.m : out.c); });
        check_f32(b, "embed", name, out, 0);
      }
    }

  // ---- matmuls: one x, up to four weights. The products of one kind share a dispatch (qmv4_multi for a decode
  // row's 4-bit products, matmul_rows_multi for the rest); each case checks the CPU, the path and dispatch count,
  // and bit equality with the same products run as separate matmuls on Metal. ----
  if (wanted("matmuls")) {
    struct GroupCase { std::string name; std::vector<std::pair<std::string, int64_t>> parts; int64_t K, T; Phase ph; };
    const std::vector<GroupCase> groups = {
        // a DeltaNet layer's qkv, z, b, a at the real K and the real b/a rows (qkv and z scaled down)
        {"delta", {{"q4g64-bf16", 96}, {"q4g64-bf16", 64}, {"q4g64-bf16", 32}, {"q4g64-bf16", 32}}, 2048, 1, Phase::Decode},
        // attention's q (with the gate), k, v; ragged rows, f16 scales, group 32
        {"attention", {{"q4g32-f16", 40}, {"q4g32-f16", 9}, {"q4g32-f16", 9}}, 320, 1, Phase::Decode},
        {"ragged", {{"q4g64-bf16", 37}, {"q4g64-bf16", 5}, {"q4g64-bf16", 1}, {"q4g64-bf16", 13}}, 192, 1, Phase::Decode},
        {"pair", {{"q4g128-bf16", 17}, {"q4g128-bf16", 8}}, 256, 1, Phase::Decode},
        // products qmv4 does not take (8-bit, another group size) run alone next to the grouped ones
        {"mixed", {{"q4g64-bf16", 21}, {"q8g64-bf16", 6}, {"q4g64-bf16", 3}, {"q4g32-bf16", 4}}, 192, 1, Phase::Decode},
        // two qmv4 kinds (bf16 and f16 scales): the pair of one kind shares a dispatch, the other runs alone
        {"scales", {{"q4g64-bf16", 9}, {"q4g64-f16", 10}, {"q4g64-f16", 11}}, 192, 1, Phase::Decode},
        // the router and the shared-expert gate (8-bit): one matmul_rows_multi
        {"router", {{"q8g64-bf16", 24}, {"q8g64-bf16", 1}}, 192, 1, Phase::Decode},
        {"dense", {{"f16", 7}, {"f16", 20}, {"f32", 3}}, 96, 1, Phase::Decode},
        {"kinds", {{"q4g64-bf16", 5}, {"q4g32-bf16", 7}}, 192, 1, Phase::Decode},  // no two of one kind: composed
        // prefill rows: matmul_rows_multi, one dispatch per format
        {"prefill", {{"q4g64-bf16", 37}, {"q4g64-bf16", 5}, {"q4g64-bf16", 1}}, 192, 5, Phase::Prefill},
        {"prefill-mixed", {{"q4g64-bf16", 37}, {"bf16", 9}, {"q4g64-bf16", 5}, {"bf16", 3}}, 192, 3, Phase::Prefill},
    };
    for (const auto& c : groups) {
      std::vector<Weight> ws;
      std::vector<Both::T2> ys, zs;
      for (const auto& [fmt, N] : c.parts) {
        ws.push_back(make_weight(blob, mc, fmt, N, c.K));
        ys.push_back(b.alloc(DType::F32, c.T, N));
        zs.push_back(b.alloc(DType::F32, c.T, N));
      }
      auto x = b.f32(c.T, c.K);
      const auto before = b.mtl.counters();
      b.run(c.ph, [&](Ops& o, bool m) {
        MatmulGroup g;
        for (size_t i = 0; i < ws.size(); ++i) g.add(ws[i], m ? ys[i].m : ys[i].c);
        o.matmuls(m ? x.m : x.c, g);
      });
      const auto& after = b.mtl.counters();
      const int64_t dispatches = after.last_dispatches;
      const char* path = after.matmul_group_split_calls > before.matmul_group_split_calls ? "split"
                         : after.matmul_group_calls > before.matmul_group_calls          ? "grouped"
                                                                                          : "composed";
      const std::string name = c.name + " [" + std::to_string(c.K) + "] T=" + std::to_string(c.T);
      printf("op matmuls %s: path %s, %lld dispatches\n", name.c_str(), path, (long long)dispatches);
      for (size_t i = 0; i < ws.size(); ++i)
        check_f32(b, "matmuls", name + " part " + std::to_string(i) + " " + c.parts[i].first, ys[i]);
      // The same products as separate matmuls (one dispatch each) on Metal: the grouped kernel's bits must equal them.
      b.mtl.begin(c.ph);
      for (size_t i = 0; i < ws.size(); ++i) b.mtl.matmul(x.m, ws[i], zs[i].m);
      b.mtl.wait(b.mtl.submit());
      size_t differ = 0;
      for (size_t i = 0; i < ws.size(); ++i) {
        auto y = b.get<uint32_t>(b.mtl, ys[i].m), z = b.get<uint32_t>(b.mtl, zs[i].m);
        for (size_t e = 0; e < y.size(); ++e) differ += y[e] != z[e];
      }
      printf("op matmuls %s: grouped == separate: %zu words differ %s\n", name.c_str(), differ, differ ? "FAIL" : "ok");
      g_failures += differ != 0;
    }
  }

  // ---- norms, add ----
  for (auto [T, D, seg] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 96, 96}, {5, 2048, 2048}, {3, 64, 16}}) {
    const std::string name = "T=" + std::to_string(T) + " D=" + std::to_string(D) + " seg=" + std::to_string(seg);
    auto x = b.f32(T, D, 3.f), y = b.f32(T, D), w = b.f32(1, seg), out = b.alloc(DType::F32, T, D);
    if (wanted("rms_norm")) {
      b.run(Phase::Prefill, [&](Ops& o, bool m) { o.rms_norm(m ? x.m : x.c, m ? w.m : w.c, m ? out.m : out.c, 1e-6f); });
      check_f32(b, "rms_norm", name, out);
    }
    if (wanted("add")) {
      b.run(Phase::Prefill, [&](Ops& o, bool m) { o.add(m ? x.m : x.c, m ? y.m : y.c, m ? out.m : out.c); });
      check_f32(b, "add", name, out, 0);
    }
    if (wanted("add_rms_norm")) {  // sum aliases a, as the graph uses it
      auto a = b.f32(T, D), n = b.alloc(DType::F32, T, D);
      b.run(Phase::Prefill, [&](Ops& o, bool m) {
        o.add_rms_norm(m ? a.m : a.c, m ? y.m : y.c, m ? w.m : w.c, 1e-6f, m ? a.m : a.c, m ? n.m : n.c);
      });
      check_f32(b, "add_rms_norm", name + " sum", a, 0);
      check_f32(b, "add_rms_norm", name + " normed", n);
    }
    if (wanted("gated_rms_norm")) {
      auto z = b.f32(T, D, 2.f);
      b.run(Phase::Prefill, [&](Ops& o, bool m) {
        o.gated_rms_norm(m ? x.m : x.c, m ? z.m : z.c, m ? w.m : w.c, 1e-6f, m ? out.m : out.c);
      });
      check_f32(b, "gated_rms_norm", name, out);
    }
    if (wanted("swiglu")) {
      b.run(Phase::Prefill, [&](Ops& o, bool m) { o.swiglu(m ? x.m : x.c, m ? y.m : y.c, m ? out.m : out.c); });
      check_f32(b, "swiglu", name, out, 1e-6);
    }
    if (wanted("moe_combine")) {
      auto h = b.f32(T, D), sg = b.f32(T, 1, 2.f);
      b.run(Phase::Prefill, [&](Ops& o, bool m) { o.moe_combine(m ? x.m : x.c, m ? y.m : y.c, m ? sg.m : sg.c, m ? h.m : h.c); });
      check_f32(b, "moe_combine", name, h, 1e-6);
    }
  }

  // ---- attention: q/k prep (RoPE at small and large positions), the cache, attention ----
  struct AttnCase { int64_t heads, kv, D, rd, T, pos, max_ctx; bool bf16; Phase ph; };
  for (const auto& c : std::vector<AttnCase>{{6, 2, 32, 8, 5, 33, 70, false, Phase::Prefill},
                                             {4, 1, 64, 16, 1, 64, 70, false, Phase::Decode},
                                             {6, 2, 16, 8, 3, 100000, 100010, false, Phase::Prefill},
                                             {8, 2, 32, 8, 1, 40, 48, true, Phase::Decode},
                                             {3, 3, 48, 48, 2, 0, 8, false, Phase::Prefill},
                                             // the real model's attention: 16 heads over 2, D 256, rotary 64
                                             {16, 2, 256, 64, 1, 300, 320, true, Phase::Decode}}) {
    const std::string name = "heads=" + std::to_string(c.heads) + "/" + std::to_string(c.kv) + " D=" +
                             std::to_string(c.D) + " rd=" + std::to_string(c.rd) + " T=" + std::to_string(c.T) +
                             " pos=" + std::to_string(c.pos) + (c.bf16 ? " bf16-cache" : "");
    AttentionShape s{c.heads, c.kv, c.D, c.rd, 1e7, 1e-6f};
    auto pos = b.i32(1, 1, {int32_t(c.pos)});
    auto qg = b.f32(c.T, 2 * c.heads * c.D, 2.f), k = b.f32(c.T, c.kv * c.D, 2.f), v = b.f32(c.T, c.kv * c.D);
    auto qn = b.f32(1, c.D), kn = b.f32(1, c.D);
    auto q = b.alloc(DType::F32, c.T, c.heads * c.D), gate = b.alloc(DType::F32, c.T, c.heads * c.D);
    auto kr = b.alloc(DType::F32, c.T, c.kv * c.D);
    if (wanted("attn_qk_prep") || wanted("attention")) {
      b.run(c.ph, [&](Ops& o, bool m) {
        o.attn_qk_prep(m ? qg.m : qg.c, m ? k.m : k.c, m ? qn.m : qn.c, m ? kn.m : kn.c, m ? pos.m : pos.c, s,
                       m ? q.m : q.c, m ? gate.m : gate.c, m ? kr.m : kr.c);
      });
      check_f32(b, "attn_qk_prep", name + " q", q, 2e-6);
      check_f32(b, "attn_qk_prep", name + " gate", gate, 0);
      check_f32(b, "attn_qk_prep", name + " k", kr, 2e-6);
      // The cache and attention below get the CPU's prepared q, gate and k on both backends.
      for (auto* t : {&q, &gate, &kr}) {
        auto v = b.get<float>(b.cpu, t->c);
        b.mtl.upload(t->m, v.data());
      }
    }
    if (wanted("attn_qk_prep_append") && c.max_ctx <= 1000) {
      // The fused op (Metal runs Ops' composition: attn_qk_prep, a barrier, kv_append) into caches of random rows.
      const DType cd = c.bf16 ? DType::BF16 : DType::F32;
      const int64_t rows = c.kv * c.max_ctx;
      std::vector<uint16_t> kb(size_t(rows * c.D)), vb(kb.size());
      for (auto& x : kb) x = f32_bf16(signed_uniform());
      for (auto& x : vb) x = f32_bf16(signed_uniform());
      auto kc = c.bf16 ? b.alloc(cd, rows, c.D, kb.data()) : b.f32(rows, c.D);
      auto vc = c.bf16 ? b.alloc(cd, rows, c.D, vb.data()) : b.f32(rows, c.D);
      auto q2 = b.alloc(DType::F32, c.T, c.heads * c.D), gate2 = b.alloc(DType::F32, c.T, c.heads * c.D);
      auto kr2 = b.alloc(DType::F32, c.T, c.kv * c.D);
      for (auto* t : {&q2, &gate2, &kr2}) poison(b, *t);
      b.run(c.ph, [&](Ops& o, bool m) {
        o.attn_qk_prep_append(m ? qg.m : qg.c, m ? k.m : k.c, m ? v.m : v.c, m ? qn.m : qn.c, m ? kn.m : kn.c,
                              m ? pos.m : pos.c, s, m ? q2.m : q2.c, m ? gate2.m : gate2.c, m ? kr2.m : kr2.c,
                              m ? kc.m : kc.c, m ? vc.m : vc.c, c.max_ctx);
      });
      check_f32(b, "attn_qk_prep_append", name + " q", q2, 2e-6);
      check_f32(b, "attn_qk_prep_append", name + " gate", gate2, 0);
      check_f32(b, "attn_qk_prep_append", name + " k", kr2, 2e-6);
      if (c.bf16) {
        check_bf16_close(b, "attn_qk_prep_append", name + " k cache", kc, 1.0 / 128);
        check_u16(b, "attn_qk_prep_append", name + " v cache", vc);
      } else {
        check_f32(b, "attn_qk_prep_append", name + " k cache", kc, 2e-6);
        check_f32(b, "attn_qk_prep_append", name + " v cache", vc, 0);
      }
    }
    if (!wanted("attention") || c.max_ctx > 1000) continue;
    // A cache already holding random rows before pos (the context), then this step's rows appended.
    const DType cd = c.bf16 ? DType::BF16 : DType::F32;
    const int64_t rows = c.kv * c.max_ctx;
    Both::T2 kc, vc;
    if (c.bf16) {
      std::vector<uint16_t> kb(size_t(rows * c.D)), vb(kb.size());
      for (auto& x : kb) x = f32_bf16(signed_uniform());
      for (auto& x : vb) x = f32_bf16(signed_uniform());
      kc = b.alloc(cd, rows, c.D, kb.data()), vc = b.alloc(cd, rows, c.D, vb.data());
    } else {
      kc = b.f32(rows, c.D), vc = b.f32(rows, c.D);
    }
    auto out = b.alloc(DType::F32, c.T, c.heads * c.D);
    // Each backend's workspace as it sizes it (the split path's partials on Metal: blocks of 16 rows from the first).
    ModelConfig cfg;
    cfg.heads = c.heads, cfg.kv_heads = c.kv, cfg.head_dim = c.D;
    b.mtl.set_split_attention(1, 16);
    auto ws = b.alloc(DType::F32, 1, int64_t(std::max(cpu::attention_workspace_bytes(cfg, c.T, c.max_ctx, 1),
                                                      b.mtl.split_attention_bytes(cfg, c.T, c.max_ctx)) / 4 + 16));
    b.run(c.ph, [&](Ops& o, bool m) {
      o.kv_append(m ? kr.m : kr.c, m ? v.m : v.c, m ? pos.m : pos.c, m ? kc.m : kc.c, m ? vc.m : vc.c, c.max_ctx, s);
    });
    if (c.bf16) check_u16(b, "kv_append", name + " k", kc), check_u16(b, "kv_append", name + " v", vc);
    else check_f32(b, "kv_append", name + " k", kc, 0), check_f32(b, "kv_append", name + " v", vc, 0);
    for (const char* variant : {"rows", "gqa", "split"}) {  // each Metal variant against the CPU, whatever the
      b.mtl.set_attention_variant(variant);                    // selector picks; the output poisoned before each
      poison(b, out);
      b.run(c.ph, [&](Ops& o, bool m) {
        o.attention(m ? q.m : q.c, m ? gate.m : gate.c, m ? kc.m : kc.c, m ? vc.m : vc.c, m ? pos.m : pos.c, c.max_ctx,
                    s, m ? ws.m : ws.c, m ? out.m : out.c);
      });
      check_f32(b, "attention", name + " attention_" + variant, out, 1e-5);
    }
    b.mtl.set_attention_variant("auto");
    b.mtl.set_split_attention(32768, 1024);
  }

  // ---- attention, the split path for long decode contexts: fixed blocks, partials in the workspace, the reduce ----
  // Contexts ending inside a block, exactly at a block's edge, one past it and of one row; below the threshold (block
  // 0 walks it all); rows crossing the threshold; groups 8 (real), 4, 2, 1; D 256 (real) and 64; both cache dtypes.
  // Each against the CPU and against attention_gqa, and the path auto takes.
  struct SplitCase { int64_t heads, kv, D, T, pos, max_ctx; bool bf16; int64_t block, min; Phase ph; };
  for (const auto& c : std::vector<SplitCase>{{16, 2, 256, 1, 2099, 2112, true, 1024, 1024, Phase::Decode},
                                              {8, 1, 64, 1, 2047, 2100, false, 1024, 1024, Phase::Decode},
                                              {16, 2, 256, 1, 127, 200, false, 64, 64, Phase::Decode},
                                              {16, 2, 256, 1, 299, 320, false, 64, 310, Phase::Decode},
                                              {4, 2, 64, 1, 0, 40, false, 16, 1, Phase::Decode},
                                              {3, 3, 64, 1, 64, 100, true, 32, 1, Phase::Decode},
                                              {8, 2, 64, 3, 62, 80, true, 16, 64, Phase::Prefill},
                                              {4, 1, 64, 1, 20, 30, false, 16, 64, Phase::Decode}}) {
    if (!wanted("attention")) break;
    const std::string name = "split heads=" + std::to_string(c.heads) + "/" + std::to_string(c.kv) + " D=" +
                             std::to_string(c.D) + " T=" + std::to_string(c.T) + " ctx=" + std::to_string(c.pos + 1) +
                             " block=" + std::to_string(c.block) + " min=" + std::to_string(c.min) +
                             (c.bf16 ? " bf16-cache" : "");
    AttentionShape s{c.heads, c.kv, c.D, c.D / 4, 1e7, 1e-6f};
    b.mtl.set_split_attention(c.min, c.block);
    auto pos = b.i32(1, 1, {int32_t(c.pos)});
    auto q = b.f32(c.T, c.heads * c.D, 2.f), gate = b.f32(c.T, c.heads * c.D, 2.f);
    const int64_t rows = c.kv * c.max_ctx;
    if (size_t(rows * c.D) * (c.bf16 ? 2 : 4) > size_t(b.mtl.metal_device().device()->maxBufferLength())) {
      printf("op attention %s: skipped (the cache is above the device's maxBufferLength)\n", name.c_str());
      continue;
    }
    Both::T2 kc, vc;
    if (c.bf16) {
      std::vector<uint16_t> kb(size_t(rows * c.D)), vb(kb.size());
      for (auto& x : kb) x = f32_bf16(signed_uniform());
      for (auto& x : vb) x = f32_bf16(signed_uniform());
      kc = b.alloc(DType::BF16, rows, c.D, kb.data()), vc = b.alloc(DType::BF16, rows, c.D, vb.data());
    } else {
      kc = b.f32(rows, c.D), vc = b.f32(rows, c.D);
    }
    ModelConfig cfg;
    cfg.heads = c.heads, cfg.kv_heads = c.kv, cfg.head_dim = c.D;
    auto ws = b.alloc(DType::F32, 1, int64_t(std::max(cpu::attention_workspace_bytes(cfg, c.T, c.max_ctx, 1),
                                                      b.mtl.workspace_bytes(cfg, c.T, c.max_ctx)) / 4 + 16));
    auto out = b.alloc(DType::F32, c.T, c.heads * c.D), gqa = b.alloc(DType::F32, c.T, c.heads * c.D);
    auto attend = [&](const char* variant, const Both::T2& dst) {
      b.mtl.set_attention_variant(variant);
      poison(b, dst);
      b.run(c.ph, [&](Ops& o, bool m) {
        o.attention(m ? q.m : q.c, m ? gate.m : gate.c, m ? kc.m : kc.c, m ? vc.m : vc.c, m ? pos.m : pos.c, c.max_ctx,
                    s, m ? ws.m : ws.c, m ? dst.m : dst.c);
      });
      return b.mtl.counters().last_dispatches;
    };
    const int64_t split_dispatches = attend("split", out);
    check_f32(b, "attention", name + " attention_split", out, 1e-5);
    attend("gqa", gqa);
    {  // split against attention_gqa, relative to the largest output
      auto sp = b.get<float>(b.mtl, out.m), gq = b.get<float>(b.mtl, gqa.m);
      double scale = 1e-30, err = 0;
      for (float x : gq) scale = std::max(scale, double(std::fabs(x)));
      for (size_t i = 0; i < sp.size(); ++i)
        err = std::max(err, std::isfinite(sp[i]) ? std::fabs(double(sp[i]) - gq[i]) / scale : INFINITY);
      printf("op attention %s: split against gqa max_err %.3g tol 1e-05 %s\n", name.c_str(), err,
             err <= 1e-5 ? "ok" : "FAIL");
      g_failures += !(err <= 1e-5);
    }
    const int64_t auto_dispatches = attend("auto", out);
    check_f32(b, "attention", name + " attention_auto", out, 1e-5);
    printf("op attention %s: split %lld dispatches, auto %lld dispatches\n", name.c_str(),
           (long long)split_dispatches, (long long)auto_dispatches);
  }
  b.mtl.set_attention_variant("auto");
  b.mtl.set_split_attention(32768, 1024);

  // ---- DeltaNet: conv, the scan (in and out of place), each with a capture of the state after rows T/3 .. T-1 ----
  struct DeltaCase { int64_t Hk, Hv, Dk, Dv, T; bool in_place; };
  for (const auto& c : std::vector<DeltaCase>{{2, 4, 16, 24, 1, false}, {2, 4, 16, 24, 6, true}, {3, 3, 32, 32, 3, false},
                                              {1, 2, 128, 128, 2, true}, {1, 1, 48, 40, 3, false},
                                              {2, 2, 200, 30, 4, false}}) {  // Dk past 128, Dv not /4
    const std::string name = "Hk=" + std::to_string(c.Hk) + " Hv=" + std::to_string(c.Hv) + " Dk=" + std::to_string(c.Dk) +
                             " Dv=" + std::to_string(c.Dv) + " T=" + std::to_string(c.T) + (c.in_place ? " in-place" : "");
    const int64_t C = 2 * c.Hk * c.Dk + c.Hv * c.Dv, K = 4;
    auto mixed = b.f32(c.T, C), cw = b.f32(C, K, 0.5f), cs = b.f32(K - 1, C), qkv = b.alloc(DType::F32, c.T, C);
    auto cs2 = c.in_place ? cs : b.alloc(DType::F32, K - 1, C);
    const int64_t cap_first = c.T / 3, cap_count = c.T - c.T / 3;
    if (wanted("conv1d_silu")) {
      auto ccap = b.alloc(DType::F32, cap_count * (K - 1), C);
      b.run(Phase::Prefill, [&](Ops& o, bool m) {
        o.conv1d_silu(m ? mixed.m : mixed.c, m ? cw.m : cw.c, m ? cs.m : cs.c, m ? cs2.m : cs2.c, m ? qkv.m : qkv.c,
                      StateCapture{m ? ccap.m : ccap.c, cap_first, cap_count});
      });
      check_f32(b, "conv1d_silu", name + " out", qkv, 1e-6);
      check_f32(b, "conv1d_silu", name + " state", cs2, 0);
      check_f32(b, "conv1d_silu", name + " captured states", ccap, 0);
    }
    if (!wanted("gated_delta")) continue;
    // Both scan forms on every shape (one state column per thread, and per simdgroup), each on fresh inputs.
    for (const char* form : {"thread", "simdgroup"}) {
      b.mtl.set_delta_scan(form);
      const std::string fname = name + " " + form;
      auto x = b.f32(c.T, C), bb = b.f32(c.T, c.Hv, 2.f), aa = b.f32(c.T, c.Hv, 2.f), Al = b.f32(1, c.Hv),
           dt = b.f32(1, c.Hv), S = b.f32(c.Hv * c.Dk, c.Dv, 0.5f);
      auto S2 = c.in_place ? S : b.alloc(DType::F32, c.Hv * c.Dk, c.Dv);
      auto out = b.alloc(DType::F32, c.T, c.Hv * c.Dv);
      ModelConfig cfg;
      cfg.lin_k_dim = c.Dk, cfg.lin_v_dim = c.Dv;
      auto ws = b.alloc(DType::F32, 1, int64_t(cpu::delta_workspace_bytes(cfg, 1) / 4 + 16));
      DeltaShape ds{c.Hk, c.Hv, c.Dk, c.Dv, K, 1e-6f};
      auto rcap = b.alloc(DType::F32, cap_count * c.Hv * c.Dk, c.Dv);
      b.run(Phase::Prefill, [&](Ops& o, bool m) {
        o.gated_delta(m ? x.m : x.c, m ? bb.m : bb.c, m ? aa.m : aa.c, m ? Al.m : Al.c, m ? dt.m : dt.c, m ? S.m : S.c,
                      m ? S2.m : S2.c, ds, m ? ws.m : ws.c, m ? out.m : out.c,
                      StateCapture{m ? rcap.m : rcap.c, cap_first, cap_count});
      });
      check_f32(b, "gated_delta", fname + " out", out, 1e-5);
      check_f32(b, "gated_delta", fname + " state", S2, 1e-5);
      check_f32(b, "gated_delta", fname + " captured states", rcap, 1e-5);
    }
    b.mtl.set_delta_scan("auto");
  }

  // ---- gated_delta in the chunked (WY) form: calls of >= 64 rows without a capture (auto), and shorter calls with the
  // form forced; whole and partial chunks, in place and not, a decay strong enough to underflow within a chunk. ----
  struct ChunkCase { int64_t Hk, Hv, Dk, Dv, T; bool in_place; const char* form; float gate_scale; };
  if (wanted("gated_delta"))
    for (const auto& c : std::vector<ChunkCase>{{2, 4, 16, 24, 70, false, "auto", 2.f},
                                                {1, 2, 128, 128, 64, true, "auto", 2.f},
                                                {1, 1, 48, 40, 130, false, "auto", 2.f},
                                                {2, 2, 200, 30, 67, true, "auto", 2.f},
                                                {3, 3, 32, 32, 5, false, "chunked", 2.f},
                                                {2, 4, 16, 24, 80, true, "auto", 40.f}}) {
      const std::string name = "Hk=" + std::to_string(c.Hk) + " Hv=" + std::to_string(c.Hv) + " Dk=" +
                               std::to_string(c.Dk) + " Dv=" + std::to_string(c.Dv) + " T=" + std::to_string(c.T) +
                               (c.in_place ? " in-place" : "") + " " + c.form + (c.gate_scale > 2.f ? " strong-decay" : "");
      b.mtl.set_delta_scan(c.form);
      const int64_t C = 2 * c.Hk * c.Dk + c.Hv * c.Dv, K = 4;
      // a: the gate's input; a scale of 40 gives softplus up to ~100 and per-row decays down to exp(-1e2·A)
      auto x = b.f32(c.T, C), bb = b.f32(c.T, c.Hv, 2.f), aa = b.f32(c.T, c.Hv, c.gate_scale), Al = b.f32(1, c.Hv),
           dt = b.f32(1, c.Hv), S = b.f32(c.Hv * c.Dk, c.Dv, 0.5f);
      auto S2 = c.in_place ? S : b.alloc(DType::F32, c.Hv * c.Dk, c.Dv);
      auto out = b.alloc(DType::F32, c.T, c.Hv * c.Dv);
      const size_t ws_bytes = std::max(lily::metal::delta_chunk_workspace_bytes(std::max<int64_t>(c.T, 64), c.Hv, c.Dk, c.Dv),
                                       size_t(1024));
      auto ws = b.alloc(DType::F32, 1, int64_t(ws_bytes / 4));
      DeltaShape ds{c.Hk, c.Hv, c.Dk, c.Dv, K, 1e-6f};
      const int64_t chunked_0 = b.mtl.counters().delta_chunked_calls;
      b.run(Phase::Prefill, [&](Ops& o, bool m) {
        o.gated_delta(m ? x.m : x.c, m ? bb.m : bb.c, m ? aa.m : aa.c, m ? Al.m : Al.c, m ? dt.m : dt.c, m ? S.m : S.c,
                      m ? S2.m : S2.c, ds, m ? ws.m : ws.c, m ? out.m : out.c);
      });
      const bool chunked = b.mtl.counters().delta_chunked_calls > chunked_0;
      printf("op gated_delta %s: path %s\n", name.c_str(), chunked ? "chunked" : "scan");
      check_f32(b, "gated_delta", name + " out", out, 1e-5);
      check_f32(b, "gated_delta", name + " state", S2, 1e-5);
    }
  b.mtl.set_delta_scan("auto");

  // ---- conv_delta_norm: the DeltaNet recurrence as one op. Against the CPU (which composes the three ops), and the
  // fused decode kernel against Metal's own three kernels bit for bit (the same inputs through conv1d_silu,
  // gated_delta, gated_rms_norm in one Metal step). Prints the path each case took (the host's counters). ----
  struct CdnCase { int64_t Hk, Hv, Dk, Dv, K, T; bool in_place, capture; };
  for (const auto& c : std::vector<CdnCase>{{4, 8, 128, 128, 4, 1, true, false},     // a real key head (4 of 16: buffers ≤ 1 MiB)
                                            {3, 6, 48, 40, 4, 1, false, false},     // padded heads, Dk not /16
                                            {1, 4, 32, 128, 3, 1, true, false},     // 512 threads per key head
                                            {2, 2, 16, 24, 2, 1, false, false},     // g = 1, two taps
                                            {2, 4, 32, 32, 4, 3, true, true}}) {    // prefill rows with captures
    if (!wanted("conv_delta_norm")) break;
    const std::string name = "Hk=" + std::to_string(c.Hk) + " Hv=" + std::to_string(c.Hv) + " Dk=" + std::to_string(c.Dk) +
                             " Dv=" + std::to_string(c.Dv) + " K=" + std::to_string(c.K) + " T=" + std::to_string(c.T) +
                             (c.in_place ? " in-place" : "") + (c.capture ? " capture" : "");
    const int64_t C = 2 * c.Hk * c.Dk + c.Hv * c.Dv, VD = c.Hv * c.Dv;
    auto qkv = b.f32(c.T, C), z = b.f32(c.T, VD), bb = b.f32(c.T, c.Hv, 2.f), aa = b.f32(c.T, c.Hv, 2.f);
    auto cw = b.f32(C, c.K, 0.5f), Al = b.f32(1, c.Hv), dt = b.f32(1, c.Hv), nw = b.f32(1, c.Dv);
    auto cs = b.f32(c.K - 1, C), S = b.f32(c.Hv * c.Dk, c.Dv, 0.5f);
    auto cs2 = c.in_place ? cs : b.alloc(DType::F32, c.K - 1, C);
    auto S2 = c.in_place ? S : b.alloc(DType::F32, c.Hv * c.Dk, c.Dv);
    auto mixed = b.alloc(DType::F32, c.T, C), dout = b.alloc(DType::F32, c.T, VD), out = b.alloc(DType::F32, c.T, VD);
    const int64_t cap_first = c.T / 3, cap_count = c.capture ? c.T - c.T / 3 : 0;
    auto ccap = b.alloc(DType::F32, std::max<int64_t>(cap_count, 1) * (c.K - 1), C);
    auto rcap = b.alloc(DType::F32, std::max<int64_t>(cap_count, 1) * c.Hv * c.Dk, c.Dv);
    ModelConfig cfg;
    cfg.lin_k_dim = c.Dk, cfg.lin_v_dim = c.Dv;
    auto ws = b.alloc(DType::F32, 1, int64_t(cpu::delta_workspace_bytes(cfg, 1) / 4 + 16));
    const DeltaShape ds{c.Hk, c.Hv, c.Dk, c.Dv, c.K, 1e-6f};
    const Phase ph = c.T == 1 ? Phase::Decode : Phase::Prefill;
    // Metal's three kernels first, out of place (the fused run below may update the states in place).
    metal::MetalOps& mt = b.mtl;
    const Tensor ucs = mt.alloc("t", DType::F32, c.K - 1, C), uS = mt.alloc("t", DType::F32, c.Hv * c.Dk, c.Dv);
    const Tensor umixed = mt.alloc("t", DType::F32, c.T, C), udo = mt.alloc("t", DType::F32, c.T, VD),
                 uout = mt.alloc("t", DType::F32, c.T, VD);
    const Tensor uccap = mt.alloc("t", DType::F32, std::max<int64_t>(cap_count, 1) * (c.K - 1), C);
    const Tensor urcap = mt.alloc("t", DType::F32, std::max<int64_t>(cap_count, 1) * c.Hv * c.Dk, c.Dv);
    mt.begin(ph);
    mt.conv1d_silu(qkv.m, cw.m, cs.m, ucs, umixed, StateCapture{uccap, cap_first, cap_count});
    mt.gated_delta(umixed, bb.m, aa.m, Al.m, dt.m, S.m, uS, ds, ws.m, udo, StateCapture{urcap, cap_first, cap_count});
    mt.gated_rms_norm(udo, z.m, nw.m, 1e-6f, uout);
    mt.wait(mt.submit());
    const int64_t fused0 = mt.counters().delta_fused_calls;
    b.run(ph, [&](Ops& o, bool m) {
      auto p = [m](const Both::T2& t) { return m ? t.m : t.c; };
      o.conv_delta_norm(p(qkv), p(z), p(bb), p(aa), p(cw), p(Al), p(dt), p(nw), 1e-6f, ds, p(cs), p(cs2), p(S), p(S2),
                        p(mixed), p(dout), p(ws), p(out), StateCapture{p(ccap), cap_first, cap_count},
                        StateCapture{p(rcap), cap_first, cap_count});
    });
    const bool fused = mt.counters().delta_fused_calls > fused0;
    printf("op conv_delta_norm %s: path %s%s\n", name.c_str(), fused ? "fused" : "composed",
           fused ? "" : (" (" + mt.counters().delta_composed_reason + ")").c_str());
    check_f32(b, "conv_delta_norm", name + " out", out, 1e-5);
    check_f32(b, "conv_delta_norm", name + " conv state", cs2, 0);
    check_f32(b, "conv_delta_norm", name + " recurrent state", S2, 1e-5);
    if (c.capture) {
      check_f32(b, "conv_delta_norm", name + " captured conv states", ccap, 0);
      check_f32(b, "conv_delta_norm", name + " captured recurrent states", rcap, 1e-5);
    }
    // Bit for bit against Metal's unfused kernels.
    auto same = [&](const char* what, const Tensor& fused_t, const Tensor& unfused_t) {
      std::vector<float> f(size_t(fused_t.rows * fused_t.cols)), u(f.size());
      mt.download(fused_t, f.data());
      mt.download(unfused_t, u.data());
      size_t diff = 0;
      for (size_t i = 0; i < f.size(); ++i) diff += std::memcmp(&f[i], &u[i], 4) != 0;
      printf("op conv_delta_norm %s %s vs unfused metal: %zu of %zu differ %s\n", name.c_str(), what, diff, f.size(),
             diff ? "FAIL" : "ok");
      g_failures += diff != 0;
    };
    same("out", out.m, uout);
    same("conv state", cs2.m, ucs);
    same("recurrent state", S2.m, uS);
  }

  // ---- MoE: routing and the experts ----
  struct MoeCase { int64_t T, E, k, H, I; std::string fmt; Phase ph; };
  for (const auto& c : std::vector<MoeCase>{{5, 6, 3, 96, 48, "bf16", Phase::Prefill}, {1, 40, 8, 128, 64, "q4g64-bf16", Phase::Decode},
                                            {7, 16, 4, 128, 64, "q4g64-f16", Phase::Prefill}, {2, 8, 2, 64, 64, "q8g64-bf16", Phase::Decode},
                                            {20, 4, 2, 64, 64, "q4g64-bf16", Phase::Prefill}}) {
    const std::string name = "T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) +
                             " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I) + " " + c.fmt;
    if (!wanted("moe_route") && !wanted("moe_experts")) continue;
    auto logits = b.f32(c.T, c.E, 3.f);
    auto ids = b.alloc(DType::I32, c.T, c.k), wts = b.alloc(DType::F32, c.T, c.k);
    ModelConfig cfg;
    cfg.experts = c.E, cfg.topk = c.k, cfg.hidden = c.H, cfg.moe_inter = c.I;
    const size_t wsb = std::max(cpu::moe_workspace_bytes(cfg, c.T, 1), b.mtl.workspace_bytes(cfg, c.T, 1));
    auto ws = b.alloc(DType::F32, 1, int64_t(wsb / 4 + 16));
    b.run(c.ph, [&](Ops& o, bool m) { o.moe_route(m ? logits.m : logits.c, c.k, m ? ws.m : ws.c, m ? ids.m : ids.c, m ? wts.m : wts.c); });
    if (wanted("moe_route")) check_i32(b, "moe_route", name + " ids", ids), check_f32(b, "moe_route", name + " weights", wts, 1e-6);
    if (!wanted("moe_experts")) continue;
    Weight g = make_weight(blob, mc, c.fmt, c.I, c.H, c.E), u = make_weight(blob, mc, c.fmt, c.I, c.H, c.E),
           d = make_weight(blob, mc, c.fmt, c.H, c.I, c.E);
    auto x = b.f32(c.T, c.H), out = b.f32(c.T, c.H);
    b.run(c.ph, [&](Ops& o, bool m) {
      o.moe_experts(m ? x.m : x.c, m ? ids.m : ids.c, m ? wts.m : wts.c, g, u, d, m ? ws.m : ws.c, m ? out.m : out.c);
    });
    check_f32(b, "moe_experts", name + (c.ph == Phase::Prefill ? " grouped" : " per-pair"), out, 2e-5);
    if (c.ph == Phase::Prefill) {
      // The 8-row lane-dot tiles (the fallback) and the per-pair (decode) kernels build every sum in the same
      // order: same bits. (The simdgroup-matrix tiles sum in another order: tested against the CPU below.)
      auto again = b.alloc(DType::F32, c.T, c.H), lane = b.alloc(DType::F32, c.T, c.H);
      poison(b, again), poison(b, lane);
      b.mtl.begin(Phase::Decode);
      b.mtl.moe_experts(x.m, ids.m, wts.m, g, u, d, ws.m, again.m);
      b.mtl.wait(b.mtl.submit());
      const int64_t lane0 = b.mtl.counters().moe_lane_tile_calls;
      b.mtl.set_moe_mma(false);
      b.mtl.begin(Phase::Prefill);
      b.mtl.moe_experts(x.m, ids.m, wts.m, g, u, d, ws.m, lane.m);
      b.mtl.wait(b.mtl.submit());
      b.mtl.set_moe_mma(true);
      const auto grouped = b.get<float>(b.mtl, lane.m), pairs = b.get<float>(b.mtl, again.m);
      const bool same = b.mtl.counters().moe_lane_tile_calls == lane0 + 1 &&
                        std::memcmp(grouped.data(), pairs.data(), grouped.size() * 4) == 0;
      printf("op moe_experts %s lane-dot tiles == per-pair: %s\n", name.c_str(), same ? "bitwise ok" : "DIFFER FAIL");
      g_failures += !same;
    }
  }

  // ---- moe_experts, grouped prefill tiles: the simdgroup-matrix GEMM (moe_gate_up_mma / moe_down_mma) with R = 16
  // and R = 32 forced, the rule's choice, and the 8-row lane-dot tiles, each against the CPU on routings built to
  // hit the tile edges: experts with 0, 1, R − 1, R, R + 1 and many rows, T·k not a multiple of R, K and N not
  // multiples of the 32-column blocks (dense formats: affine K is a multiple of its group), every weight format.
  // Tolerance 1e-5 of the largest output: the operands are the CPU's floats (x, act, and scale · code + bias in fp32,
  // as the CPU's prefill GEMM dequantizes) and both sum each output over K in ascending order, so the emulator gives
  // the CPU's bits (max_err 0); a GPU's 8x8 products may order and fuse their adds differently, fp32 over K ≤ 2048
  // (~1e-6 of the output at worst, the lane-dot tiles' 5e-7 here), while a wrong row, column, mask or a missing
  // block is O(1). R = 16 and R = 32 sum every output in the same order (K ascending): bitwise equal. ----
  if (wanted("moe_experts")) {
    struct TileCase { std::string name, fmt; int64_t H, I, T, k; std::vector<int64_t> counts; bool overlapped; };
    const std::vector<TileCase> tcases = {
        {"edges", "bf16", 100, 40, 72, 3, {0, 1, 15, 16, 17, 31, 32, 33, 71}, false},  // 24 rows per expert: auto takes 32
        {"q4", "q4g64-bf16", 192, 128, 40, 2, {1, 7, 0, 40, 25, 7}, false},
        {"q8", "q8g32-f16", 96, 64, 9, 3, {9, 9, 0, 8, 1}, false},
        {"f16", "f16", 48, 36, 11, 2, {11, 0, 6, 5}, false},
        {"f32", "f32", 70, 24, 5, 2, {5, 2, 3}, false},
        {"real", "q4g64-bf16", 2048, 512, 6, 8, {}, true},
    };
    for (const auto& c : tcases) {
      std::vector<int64_t> counts = c.counts;
      if (c.name == "real") {  // 256 experts, 10 of them routed, 3 to 6 rows each (T·k = 48)
        counts.assign(256, 0);
        const int64_t hit[][2] = {{3, 6}, {17, 6}, {50, 4}, {51, 4}, {52, 3}, {53, 3}, {100, 5}, {101, 5}, {200, 6}, {255, 6}};
        for (const auto& h : hit) counts[size_t(h[0])] = h[1];
      }
      const int64_t E = int64_t(counts.size());
      // Pair i of the experts' rows listed in expert order goes to token i % T, slot i / T: an expert's rows (≤ T)
      // land on distinct tokens, so each token's k ids are distinct, as moe_route gives them.
      std::vector<int32_t> idv(size_t(c.T * c.k));
      int64_t i = 0;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < counts[size_t(e)]; ++r, ++i) idv[size_t((i % c.T) * c.k + i / c.T)] = int32_t(e);
      if (i != c.T * c.k) throw std::runtime_error("tile case " + c.name + ": counts do not sum to T·k");
      std::vector<float> wv(size_t(c.T * c.k));
      for (auto& v : wv) v = std::fabs(signed_uniform());
      const std::string name = c.name + " T=" + std::to_string(c.T) + " E=" + std::to_string(E) + " k=" +
                               std::to_string(c.k) + " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I) + " " +
                               c.fmt;
      auto ids = b.i32(c.T, c.k, idv);
      auto wts = b.alloc(DType::F32, c.T, c.k, wv.data());
      ModelConfig cfg;
      cfg.experts = E, cfg.topk = c.k, cfg.hidden = c.H, cfg.moe_inter = c.I;
      const size_t wsb = std::max(cpu::moe_workspace_bytes(cfg, c.T, 1), b.mtl.workspace_bytes(cfg, c.T, 1));
      auto ws = b.alloc(DType::F32, 1, int64_t(wsb / 4 + 16));
      auto experts = [&](int64_t rows, int64_t cols) {
        return c.overlapped ? make_overlapped_experts(blob, mc, c.fmt, rows, cols, E)
                            : make_weight(blob, mc, c.fmt, rows, cols, E);
      };
      const Weight g = experts(c.I, c.H), u = experts(c.I, c.H), d = experts(c.H, c.I);
      auto x = b.f32(c.T, c.H);
      std::map<int64_t, std::vector<float>> got;
      // R: 16, 32 (forced), 0 (the rule: 32 from 24 rows per expert), -1 (the lane-dot tiles, LILY_METAL_MOE_MMA=0).
      for (int64_t R : {int64_t(16), int64_t(32), int64_t(0), int64_t(-1)}) {
        if (c.name == "real" && R < 1) continue;  // the slow case once per R
        auto out = b.alloc(DType::F32, c.T, c.H);
        poison(b, out);
        // NaN in Metal's workspace too: an act or y row a tile forgets to write reaches the output as NaN.
        b.mtl.upload(ws.m, std::vector<float>(size_t(ws.m.cols), NAN).data());
        const bool mma0 = b.mtl.moe_mma();
        const int64_t rows0 = b.mtl.moe_tile_rows();
        b.mtl.set_moe_mma(R >= 0);
        b.mtl.set_moe_tile_rows(R > 0 ? R : 0);
        const auto before = b.mtl.counters();
        b.run(Phase::Prefill, [&](Ops& o, bool m) {
          o.moe_experts(m ? x.m : x.c, m ? ids.m : ids.c, m ? wts.m : wts.c, g, u, d, m ? ws.m : ws.c, m ? out.m : out.c);
        });
        b.mtl.set_moe_mma(mma0);
        b.mtl.set_moe_tile_rows(rows0);
        const auto& after = b.mtl.counters();
        const std::string path = after.moe_mma16_calls > before.moe_mma16_calls   ? "mma R=16"
                           : after.moe_mma32_calls > before.moe_mma32_calls ? "mma R=32"
                                                                            : "lane-dot tiles";
        const std::string setting = R == 16 ? "R=16" : R == 32 ? "R=32" : R == 0 ? "auto" : "mma off";
        printf("op moe_experts tiles %s %s: path %s%s\n", name.c_str(), setting.c_str(), path.c_str(),
               after.moe_tiles_last_reason.empty() ? "" : (" (" + after.moe_tiles_last_reason + ")").c_str());
        check_f32(b, "moe_experts", "tiles " + name + " " + setting, out, 1e-5);
        if (R > 0 && path == "mma R=" + std::to_string(R)) got[R] = b.get<float>(b.mtl, out.m);
      }
      if (got.size() < 2) {  // a device where one R did not fit: nothing to compare
        printf("op moe_experts tiles %s R=16 == R=32: not compared (a fallback ran)\n", name.c_str());
        continue;
      }
      const bool same = std::memcmp(got[16].data(), got[32].data(), got[16].size() * 4) == 0;
      printf("op moe_experts tiles %s R=16 == R=32: %s\n", name.c_str(), same ? "bitwise ok" : "DIFFER FAIL");
      g_failures += !same;
    }
  }

  // ---- moe: the whole block after the router product. Decode rows: the routed down pass adds the gated shared
  // expert and the residual (moe_down_combine), bit for bit the unfused order (moe_down, then moe_combine);
  // prefill rows keep moe_combine. The real layer (256 experts, k 8, hidden 2048, 512 intermediate) and awkward
  // ones: odd k, hidden not a multiple of the threadgroup's 8 rows, several decode rows. ----
  if (wanted("moe")) {
    struct MoeBlockCase { int64_t T, E, k, H, I; std::string fmt; Phase ph; bool overlapped; };
    for (const auto& c : std::vector<MoeBlockCase>{{1, 40, 8, 128, 64, "q4g64-bf16", Phase::Decode, false},
                                                   {7, 16, 4, 128, 64, "q4g64-f16", Phase::Prefill, false},
                                                   {1, 256, 8, 2048, 512, "q4g64-bf16", Phase::Decode, true},
                                                   {3, 12, 5, 100, 40, "bf16", Phase::Decode, false},
                                                   {1, 9, 3, 84, 32, "f16", Phase::Decode, false}}) {
      const std::string name = "T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) +
                               " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I) + " " + c.fmt +
                               (c.ph == Phase::Decode ? " decode" : " prefill");
      ModelConfig cfg;
      cfg.experts = c.E, cfg.topk = c.k, cfg.hidden = c.H, cfg.moe_inter = c.I;
      const size_t wsb = std::max(cpu::moe_workspace_bytes(cfg, c.T, 1), b.mtl.workspace_bytes(cfg, c.T, 1));
      auto ws = b.alloc(DType::F32, 1, int64_t(wsb / 4 + 16));
      auto experts = [&](int64_t rows, int64_t cols) {
        return c.overlapped ? make_overlapped_experts(blob, mc, c.fmt, rows, cols, c.E)
                            : make_weight(blob, mc, c.fmt, rows, cols, c.E);
      };
      const MoeWeights w{experts(c.I, c.H), experts(c.I, c.H), experts(c.H, c.I), make_weight(blob, mc, c.fmt, c.I, c.H),
                         make_weight(blob, mc, c.fmt, c.I, c.H), make_weight(blob, mc, c.fmt, c.H, c.I)};
      auto x = b.f32(c.T, c.H), logits = b.f32(c.T, c.E, 3.f), sg = b.f32(c.T, 1, 2.f);
      const std::vector<float> h0 = randv(size_t(c.T * c.H), 1.f);
      auto h = b.alloc(DType::F32, c.T, c.H, h0.data()), h_unfused = b.alloc(DType::F32, c.T, c.H, h0.data());
      auto ids = b.alloc(DType::I32, c.T, c.k), wts = b.alloc(DType::F32, c.T, c.k);
      auto routed = b.alloc(DType::F32, c.T, c.H), shared = b.alloc(DType::F32, c.T, c.H);
      auto sgp = b.alloc(DType::F32, c.T, c.I), su = b.alloc(DType::F32, c.T, c.I), sa = b.alloc(DType::F32, c.T, c.I);
      auto block = [&](Ops& o, bool m, const Both::T2& out) {
        const MoeScratch sc{m ? ids.m : ids.c,       m ? wts.m : wts.c, m ? routed.m : routed.c, m ? sgp.m : sgp.c,
                            m ? su.m : su.c,         m ? sa.m : sa.c,   m ? shared.m : shared.c};
        o.moe(m ? x.m : x.c, m ? logits.m : logits.c, m ? sg.m : sg.c, c.k, w, sc, m ? ws.m : ws.c, m ? out.m : out.c);
      };
      const auto before = b.mtl.counters();
      b.run(c.ph, [&](Ops& o, bool m) { block(o, m, h); });
      const auto& after = b.mtl.counters();
      const bool fused = after.moe_down_combined_calls > before.moe_down_combined_calls;
      printf("op moe %s: path %s%s, %lld dispatches\n", name.c_str(), fused ? "fused" : "composed",
             fused ? "" : (" (" + after.moe_combine_reason + ")").c_str(), (long long)after.last_dispatches);
      check_i32(b, "moe", name + " ids", ids);
      check_f32(b, "moe", name + " h", h, 2e-5);
      // The unfused Metal order (moe_down into routed, then moe_combine) on the same inputs: the same bits.
      const bool fuse = b.mtl.fuse_moe_combine();  // LILY_METAL_FUSE_MOE_COMBINE
      b.mtl.set_fuse_moe_combine(false);
      b.mtl.begin(c.ph);
      block(b.mtl, true, h_unfused);
      b.mtl.wait(b.mtl.submit());
      b.mtl.set_fuse_moe_combine(fuse);
      const auto hf = b.get<float>(b.mtl, h.m), hu = b.get<float>(b.mtl, h_unfused.m);
      size_t diff = 0;
      for (size_t i = 0; i < hf.size(); ++i) diff += std::memcmp(&hf[i], &hu[i], 4) != 0;
      printf("op moe %s unfused: %lld dispatches; fused vs unfused metal: %zu of %zu differ %s\n", name.c_str(),
             (long long)b.mtl.counters().last_dispatches, diff, hf.size(), diff ? "FAIL" : "ok");
      g_failures += diff != 0;
    }
  }

  // ---- copies, fills, the position, sampling ----
  if (wanted("copy")) {
    auto a = b.f32(5, 33), a16 = b.alloc(DType::BF16, 5, 33), back = b.alloc(DType::F32, 5, 33);
    auto iv = b.i32(2, 3, {1, -2, 3, 4, 5, 1 << 30}), io = b.alloc(DType::I32, 2, 3);
    b.run(Phase::Prefill, [&](Ops& o, bool m) {
      o.copy(m ? a.m : a.c, m ? a16.m : a16.c);
      o.copy(m ? iv.m : iv.c, m ? io.m : io.c);
    });
    b.run(Phase::Prefill, [&](Ops& o, bool m) { o.copy((m ? a16.m : a16.c).rows_view(1, 3), (m ? back.m : back.c).rows_view(2, 3)); });
    check_u16(b, "copy", "f32->bf16", a16);
    check_f32(b, "copy", "bf16->f32 rows", back, 0);
    check_i32(b, "copy", "i32", io);
  }
  if (wanted("fill")) {
    auto f = b.f32(3, 7), i = b.alloc(DType::I32, 4, 5), h = b.alloc(DType::BF16, 2, 9);
    b.run(Phase::Prefill, [&](Ops& o, bool m) {
      o.fill((m ? f.m : f.c).rows_view(1, 2), -2.5);
      o.fill(m ? i.m : i.c, 7);
      o.fill(m ? h.m : h.c, 0.3);
    });
    check_f32(b, "fill", "f32 rows", f, 0);
    check_i32(b, "fill", "i32", i);
    check_u16(b, "fill", "bf16", h);
  }
  if (wanted("advance_position")) {
    auto p = b.i32(1, 1, {41}), q = b.alloc(DType::I32, 1, 1);
    b.run(Phase::Decode, [&](Ops& o, bool m) { o.advance_position(m ? p.m : p.c, m ? q.m : q.c, 7); });
    b.run(Phase::Decode, [&](Ops& o, bool m) { o.advance_position(m ? p.m : p.c, m ? p.m : p.c, 1); });
    check_i32(b, "advance_position", "out of place", q);
    check_i32(b, "advance_position", "in place", p);
  }
  if (wanted("accept_drafts")) {
    // All drafts agree, some, none, a lone pending token; rows with a stride (views of a wider tensor).
    const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> cases = {
        {{7, 3, 4, 5}, {3, 4, 5, 9}}, {{7, 3, 4, 5}, {3, 4, 6, 9}}, {{7, 3, 4, 5}, {2, 4, 5, 9}}, {{7}, {8}}};
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const auto& [ids, y] = cases[ci];
      const int64_t n = int64_t(ids.size());
      std::vector<int32_t> wide_ids, wide_y;
      for (int64_t r = 0; r < n; ++r) wide_ids.insert(wide_ids.end(), {ids[size_t(r)], -5}), wide_y.insert(wide_y.end(), {-6, y[size_t(r)]});
      auto ti = b.i32(n, 2, wide_ids), ty = b.i32(n, 2, wide_y), pos = b.i32(1, 1, {41});
      auto acc = b.i32(1, 1, {-1}), nxt = b.i32(1, 1, {-1}), out = b.i32(1, 1, {-1});
      auto col = [](const Tensor& t, int64_t c) {
        Tensor v = t;
        v.cols = 1;
        v.offset += uint64_t(c);  // in elements
        return v;
      };
      b.run(Phase::Decode, [&](Ops& o, bool m) {
        o.accept_drafts(col(m ? ti.m : ti.c, 0), col(m ? ty.m : ty.c, 1), m ? pos.m : pos.c, m ? acc.m : acc.c,
                        m ? nxt.m : nxt.c, m ? out.m : out.c);
        o.accept_drafts(col(m ? ti.m : ti.c, 0), col(m ? ty.m : ty.c, 1), m ? pos.m : pos.c, m ? acc.m : acc.c,
                        m ? nxt.m : nxt.c, m ? pos.m : pos.c);  // in place, after the first read it
      });
      const std::string name = "case " + std::to_string(ci);
      check_i32(b, "accept_drafts", name + " accepted", acc);
      check_i32(b, "accept_drafts", name + " next_id", nxt);
      check_i32(b, "accept_drafts", name + " pos_out", out);
      check_i32(b, "accept_drafts", name + " pos in place", pos);
    }
  }
  if (wanted("copy_rows_at")) {
    // Blocks of 3 rows of a [12, 37] f32 source with a row stride, picked by index + offset, and indexes that fall
    // outside (dst keeps its random rows); an i32 source.
    auto src = b.f32(12, 40);
    Tensor sc = src.c, sm = src.m;
    sc.cols = sm.cols = 37;
    for (const auto& pick : std::vector<std::pair<int32_t, int64_t>>{{2, 0}, {0, 1}, {3, 0}, {3, 1}, {-1, 0}, {1, 2}}) {
      const int32_t index = pick.first;
      const int64_t offset = pick.second;
      auto dst = b.f32(3, 37), idx = b.i32(1, 1, {index});
      b.run(Phase::Decode, [&](Ops& o, bool m) { o.copy_rows_at(m ? sm : sc, m ? idx.m : idx.c, offset, m ? dst.m : dst.c); });
      check_f32(b, "copy_rows_at", "f32 index " + std::to_string(index) + " offset " + std::to_string(offset), dst, 0);
    }
    auto ints = b.i32(4, 2, {0, 1, 2, 3, 4, 5, 6, 7}), one = b.i32(1, 2, {-1, -1}), idx = b.i32(1, 1, {2});
    b.run(Phase::Decode, [&](Ops& o, bool m) { o.copy_rows_at(m ? ints.m : ints.c, m ? idx.m : idx.c, 1, m ? one.m : one.c); });
    check_i32(b, "copy_rows_at", "i32", one);
  }
  if (wanted("mtp_input")) {
    // The MTP block's fc input [norm(embed) | norm(h)]: one decode row (the norms write the halves) and prefill rows
    // (through `normed` and copies), a 4-bit and a bf16 table.
    for (const auto& c : std::vector<std::tuple<std::string, int64_t, Phase>>{
             {"q4g64-bf16", 1, Phase::Decode}, {"q4g64-bf16", 4, Phase::Prefill}, {"bf16", 3, Phase::Prefill}}) {
      const std::string& fmt = std::get<0>(c);
      const int64_t n = std::get<1>(c), H = 192;
      const Weight table = make_weight(blob, mc, fmt, 40, H);
      std::vector<int32_t> idv;
      for (int64_t t = 0; t < n; ++t) idv.push_back(int32_t(g_rng() % 40));
      auto ids = b.i32(n, 1, idv);
      auto h = b.f32(n, H, 3.f), we = b.f32(1, H), wh = b.f32(1, H);
      auto e = b.alloc(DType::F32, n, H), normed = b.alloc(DType::F32, n, H), out = b.alloc(DType::F32, n, 2 * H);
      b.run(std::get<2>(c), [&](Ops& o, bool m) {
        o.mtp_input(m ? ids.m : ids.c, table, m ? h.m : h.c, m ? we.m : we.c, m ? wh.m : wh.c, 1e-6f, m ? e.m : e.c,
                    m ? normed.m : normed.c, m ? out.m : out.c);
      });
      check_f32(b, "mtp_input", fmt + " n=" + std::to_string(n), out);
    }
  }
  if (wanted("sample")) {
    // Greedy, then seeded draws: temperature alone, top-k, top-p, min-p, everything with penalties. Five draws each
    // from one seeded stream; ids, penalty state, ring and the mt19937_64 words must equal the CPU's.
    std::vector<std::pair<std::string, SamplingParams>> cases;
    SamplingParams g;
    cases.push_back({"greedy", g});
    g.repetition_penalty = 1.3f, g.presence_penalty = 0.5f, g.frequency_penalty = 0.7f;
    cases.push_back({"greedy+penalties", g});
    SamplingParams t;
    t.temperature = 0.8f;
    cases.push_back({"T=0.8", t});
    SamplingParams tk = t;
    tk.temperature = 1.5f, tk.top_k = 20;
    cases.push_back({"T=1.5 top_k=20", tk});
    SamplingParams tp = t;
    tp.top_p = 0.9f;
    cases.push_back({"T=0.8 top_p=0.9", tp});
    SamplingParams mp = t;
    mp.temperature = 1.0f, mp.min_p = 0.05f;
    cases.push_back({"T=1 min_p=0.05", mp});
    SamplingParams all = t;
    all.top_k = 50, all.top_p = 0.95f, all.min_p = 0.01f, all.repetition_penalty = 1.2f, all.frequency_penalty = 0.3f;
    cases.push_back({"T=0.8 top_k=50 top_p=0.95 min_p=0.01 penalties", all});
    for (const auto& named : cases) {
      const std::string& name = named.first;
      const SamplingParams& p = named.second;
      const int64_t V = 1000, R = 4;
      auto logits = b.f32(1, V, 5.f);
      std::vector<int32_t> cnt(V), seen(V), words(SamplerState::kRngWords);
      for (int64_t i = 0; i < V; ++i) cnt[size_t(i)] = int32_t(g_rng() % 3), seen[size_t(i)] = int32_t(g_rng() % 2);
      mt::seed(reinterpret_cast<uint32_t*>(words.data()), g_rng());
      SamplerState st[2];
      auto counts = b.i32(1, V, cnt), sn = b.i32(1, V, seen), rng = b.i32(1, SamplerState::kRngWords, words);
      auto ring = b.i32(R, 1, {9, 9, 9, 9}), rc = b.i32(1, 1, {6}), next = b.alloc(DType::I32, 1, 1);
      st[0] = {counts.c, sn.c, rng.c, ring.c, rc.c};
      st[1] = {counts.m, sn.m, rng.m, ring.m, rc.m};
      const size_t wsb = std::max(cpu::sample_workspace_bytes(V), metal::sample_workspace_bytes(V));
      auto ws = b.alloc(DType::F32, 1, int64_t(wsb / 4 + 16));
      std::vector<int32_t> ids_c, ids_m;
      for (int step = 0; step < 5; ++step) {
        b.run(Phase::Decode, [&](Ops& o, bool m) { o.sample(m ? logits.m : logits.c, st[m], p, m ? ws.m : ws.c, m ? next.m : next.c); });
        ids_c.push_back(b.get<int32_t>(b.cpu, next.c)[0]);
        ids_m.push_back(b.get<int32_t>(b.mtl, next.m)[0]);
      }
      // Three rows in one op (an MTP verify's): three calls in row order, a barrier between them.
      auto rows = b.f32(3, V, 5.f);
      auto next3 = b.alloc(DType::I32, 3, 1);
      b.run(Phase::Decode, [&](Ops& o, bool m) { o.sample(m ? rows.m : rows.c, st[m], p, m ? ws.m : ws.c, m ? next3.m : next3.c); });
      check_i32(b, "sample", name + " rows ids", next3);
      const bool same = ids_c == ids_m;
      printf("op sample %s ids:", name.c_str());
      for (size_t i = 0; i < ids_m.size(); ++i) printf(" %d/%d", ids_c[i], ids_m[i]);
      printf(" %s\n", same ? "ok" : "FAIL");
      g_failures += !same;
      check_i32(b, "sample", name + " counts", counts);
      check_i32(b, "sample", name + " seen", sn);
      check_i32(b, "sample", name + " ring", ring);
      check_i32(b, "sample", name + " ring_count", rc);
      check_i32(b, "sample", name + " rng words", rng);
    }
  }
  const auto& k = b.mtl.counters();
  printf("metal: %lld command buffers, %lld dispatches, %lld barriers; mappings wrapped %lld copied %lld; parts copied "
         "%lld; mapping buffers %lld\n", (long long)k.command_buffers, (long long)k.dispatches, (long long)k.barriers,
         (long long)k.mappings_wrapped, (long long)k.mappings_copied, (long long)k.parts_copied,
         (long long)k.mapping_windows);
  printf("%s: %d failures\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}

}  // namespace

int run_model(const std::string& msl, const std::string& spec);
int run_checkpoint(const std::string& msl, const std::string& dir);
int run_traffic(const std::string& msl, const std::string& dir, int decode_steps);
std::string g_dir;

int main(int argc, char** argv) {
  try {
    if (argc < 3) throw std::runtime_error("usage: backend_main ops|model [--only NAME] METAL_FILE...");
    const std::string mode = argv[1];
    std::string msl, spec = "mixed";
    int steps = 1;
    for (int i = 2; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--only" && i + 1 < argc) g_only = argv[++i];
      else if (a == "--spec" && i + 1 < argc) spec = argv[++i];
      else if (a == "--dir" && i + 1 < argc) g_dir = argv[++i];
      else if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
      else msl += "// ---- " + a + "\n" + read_all(a) + "\n";
    }
    if (mode == "ops") return run_ops(msl);
    if (mode == "model") return run_model(msl, spec);
    if (mode == "checkpoint") return run_checkpoint(msl, g_dir);
    if (mode == "traffic") return run_traffic(msl, g_dir, steps);
    throw std::runtime_error("unknown mode " + mode);
  } catch (const std::exception& e) {
    fprintf(stderr, "backend_main: error: %s\n", e.what());
    return 2;
  }
}

// ---- the end-to-end model ----
namespace {

// Random canonical tensors in one 16 KB aligned blob (one "checkpoint file"): 4-bit affine where the input dim
// allows group 64, the router 8-bit (as MLX converts it), the rest bf16; experts laid out at a uniform stride.
class RandomSource final : public WeightSource {
 public:
  explicit RandomSource(size_t bytes) : blob_(bytes) {}
  HostMatrix matrix(const std::string& name, int64_t rows, int64_t cols) override {
    auto it = mats_.find(name);
    if (it != mats_.end()) return it->second;
    const bool router = name.find("moe.router") != std::string::npos;
    const std::string fmt = cols % 64 ? "bf16" : router ? "q8g64-bf16" : "q4g64-bf16";
    Weight w = make_weight(blob_, 0, fmt, rows, cols);
    HostMatrix h;
    h.fmt = w;
    h.data = blob_.p + w.data;
    if (w.quantized()) h.scales = blob_.p + w.scales, h.biases = blob_.p + w.biases;
    return mats_[name] = h;
  }
  const float* vector(const std::string& name, int64_t count) override {
    auto it = vecs_.find(name);
    if (it != vecs_.end()) return it->second.data();
    std::vector<float> v(static_cast<size_t>(count));
    for (auto& x : v) {
      const float u = signed_uniform();
      if (name.find("norm") != std::string::npos) x = 1.f + 0.2f * u;
      else if (name.find("A_log") != std::string::npos) x = 0.5f * u;
      else if (name.find("dt_bias") != std::string::npos) x = 0.5f * u;
      else x = 0.5f * u;  // conv taps
    }
    return (vecs_[name] = std::move(v)).data();
  }
  MappedRegion region() const { return {blob_.p, blob_.used, "random checkpoint"}; }

 private:
  Blob blob_;
  std::map<std::string, HostMatrix> mats_;
  std::map<std::string, std::vector<float>> vecs_;
};

ModelConfig model_config(const std::string& spec) {
  ModelConfig c;
  // "mixed": hidden 128 (two quantization groups per row), GQA group 3, DeltaNet ratio 2 with Dk != Dv, 8 experts
  // top 2, attention in the first and last layer. "wide": head dim 64, 16 experts top 4, ratio 1.
  const bool wide = spec == "wide";
  c.hidden = 128;
  c.layers = wide ? 3 : 4;
  c.vocab = 320;
  c.eps = 1e-6f;
  c.heads = wide ? 4 : 6;
  c.kv_heads = 2;
  c.head_dim = wide ? 64 : 32;
  c.rotary_dim = wide ? 16 : 8;
  c.rope_theta = 1e7;
  c.lin_k_heads = wide ? 3 : 2;
  c.lin_v_heads = wide ? 3 : 4;
  c.lin_k_dim = wide ? 32 : 16;
  c.lin_v_dim = wide ? 32 : 24;
  c.conv_kernel = 4;
  c.experts = wide ? 16 : 8;
  c.topk = wide ? 4 : 2;
  c.moe_inter = 64;
  c.shared_inter = wide ? 64 : 96;
  c.full_attention = wide ? std::vector<bool>{false, true, false} : std::vector<bool>{true, false, false, true};
  c.validate();
  return c;
}

double max_rel(const std::vector<float>& ref, const std::vector<float>& got) {
  double scale = 1e-30, err = 0;
  for (float x : ref) scale = std::max(scale, double(std::fabs(x)));
  for (size_t i = 0; i < ref.size(); ++i)
    err = std::max(err, std::isfinite(got[i]) ? std::fabs(double(got[i]) - ref[i]) / scale : INFINITY);
  return err;
}

}  // namespace

// Logits are compared relative to the largest |logit| of the reference: fp32 reordering through a few layers
// stays below 1e-5 of it; a wrong stride, head mapping or missing barrier moves them by 1e-2 and more.
int run_model(const std::string& msl, const std::string& spec) {
  const ModelConfig cfg = model_config(spec);
  RandomSource src(8 << 20);
  cpu::CpuOps cpu_ops(cpu::CpuOptions{1});
  metal::MetalOps mtl_ops(msl);
  Qwen36 cpu_model(cfg, cpu_ops), mtl_model(cfg, mtl_ops);
  // Generate every tensor first (the loader asks by name), then register the blob: the region must cover them all.
  {
    cpu::CpuOps probe(cpu::CpuOptions{1});
    Qwen36 m(cfg, probe);
    load_weights(m, src, {});
  }
  const LoadInfo cpu_info = load_weights(cpu_model, src, {src.region()}),  // own any repacked stacks
      mtl_info = load_weights(mtl_model, src, {src.region()});
  std::mutex cpu_lock, mtl_lock;
  const int64_t max_ctx = 80, chunk = 5;  // 12 prompt tokens, 32 greedy steps, then snapshots, forks and sampling
  Session cs(cpu_model, cpu_lock, max_ctx, chunk), ms(mtl_model, mtl_lock, max_ctx, chunk);
  const double tol = 2e-5;
  int fails = 0;
  auto report = [&](const std::string& what, double err) {
    const bool ok = err <= tol;
    printf("model %s %s: max_err %.3g tol %.3g %s\n", spec.c_str(), what.c_str(), err, tol, ok ? "ok" : "FAIL");
    fails += !ok;
  };
  // Chunked prefill (3 chunks of at most 5 tokens), logits of every position.
  std::vector<int32_t> prompt;
  for (int i = 0; i < 12; ++i) prompt.push_back(int32_t(g_rng() % uint64_t(cfg.vocab)));
  std::vector<float> cl(prompt.size() * size_t(cfg.vocab)), ml(cl.size());
  cs.prefill(prompt.data(), int64_t(prompt.size()), true, cl.data(), nullptr);
  ms.prefill(prompt.data(), int64_t(prompt.size()), true, ml.data(), nullptr);
  report("prefill logits (12 tokens in chunks of 5)", max_rel(cl, ml));
  int top1 = 0;
  for (size_t t = 0; t < prompt.size(); ++t) {
    auto row = [&](const std::vector<float>& v) {
      return std::max_element(v.begin() + long(t) * cfg.vocab, v.begin() + long(t + 1) * cfg.vocab) - v.begin();
    };
    top1 += row(cl) == row(ml);
  }
  printf("model %s prefill top-1 agreement: %d of %zu\n", spec.c_str(), top1, prompt.size());
  fails += top1 != int(prompt.size());
  // Greedy decode through the real loop (two slots, one-step-behind id reads), logits of every step.
  auto gen = [&](Session& s, int n, std::vector<int32_t>& ids, std::vector<float>& logits) {
    SamplingParams p;
    return s.generate(n, p, {}, [&](int32_t id, const float* l) {
      ids.push_back(id);
      logits.insert(logits.end(), l, l + cfg.vocab);
      return 1;
    }, true);
  };
  std::vector<int32_t> cid, mid;
  std::vector<float> cgl, mgl;
  gen(cs, 32, cid, cgl);
  gen(ms, 32, mid, mgl);
  report("decode logits (32 greedy steps)", max_rel(cgl, mgl));
  printf("model %s greedy tokens: cpu", spec.c_str());
  for (int32_t i : cid) printf(" %d", i);
  printf(" | metal");
  for (int32_t i : mid) printf(" %d", i);
  printf(" %s\n", cid == mid ? "same" : "DIFFERENT");
  fails += cid != mid;
  const StepStats ds = ms.last_decode_stats(), ps = ms.last_prefill_stats();
  const auto& k = mtl_ops.counters();
  printf("model %s metal decode step: %lld ops, %lld stages; last command buffer: %lld dispatches, %lld barriers; "
         "max in flight %lld\n", spec.c_str(), (long long)ds.ops, (long long)ds.stages, (long long)k.last_dispatches,
         (long long)k.last_barriers, (long long)k.max_in_flight);
  printf("model %s metal prefill chunk: %lld ops, %lld stages\n", spec.c_str(), (long long)ps.ops, (long long)ps.stages);
  for (const std::string& line : mtl_ops.optimizations())
    if (line.find("conv_delta_norm") != std::string::npos || line.find("MatmulGroup") != std::string::npos ||
        line.find("split decode attention") != std::string::npos ||
        line.find("moe_down_combine") != std::string::npos || line.find("moe_gate_up_mma") != std::string::npos)
      printf("model %s metal %s\n", spec.c_str(), line.c_str());
  // Snapshot, run on, restore: the same continuation again, on Metal and equal to the CPU's. The decode pipelines
  // are all built by the second run: its steps take every one from the cache.
  const metal::Device& dev = mtl_ops.metal_device();
  auto snap = ms.snapshot();
  std::vector<int32_t> a, b2;
  std::vector<float> al, bl;
  gen(ms, 4, a, al);
  ms.restore(*snap);
  const int64_t built_0 = dev.pipelines_built(), hits_0 = dev.pipeline_cache_hits();
  gen(ms, 4, b2, bl);
  printf("model %s pipelines: %lld built in all, the 4 steps after the restore built %lld and took %lld from the "
         "cache\n", spec.c_str(), (long long)dev.pipelines_built(), (long long)(dev.pipelines_built() - built_0),
         (long long)(dev.pipeline_cache_hits() - hits_0));
  const bool same = a == b2 && max_rel(al, bl) == 0.0;
  printf("model %s snapshot/restore: continuation %s\n", spec.c_str(), same ? "identical" : "DIFFERENT");
  fails += !same;
  std::vector<int32_t> c4;
  std::vector<float> c4l;
  gen(cs, 4, c4, c4l);
  report("decode logits after the snapshot", max_rel(c4l, al));
  // Seeded sampling through the decode loop: the same stream of ids from both samplers.
  SamplingParams sp;
  sp.temperature = 0.9f, sp.top_p = 0.95f, sp.top_k = 40, sp.has_seed = true, sp.seed = 42;
  std::vector<int32_t> sc, sm;
  cs.generate(8, sp, {}, [&](int32_t id, const float*) { return sc.push_back(id), 1; });
  ms.generate(8, sp, {}, [&](int32_t id, const float*) { return sm.push_back(id), 1; });
  printf("model %s seeded tokens: cpu", spec.c_str());
  for (int32_t i : sc) printf(" %d", i);
  printf(" | metal");
  for (int32_t i : sm) printf(" %d", i);
  printf(" %s\n", sc == sm ? "same" : "DIFFERENT");
  fails += sc != sm;
  // Snapshots taken inside prefill chunks (the DeltaNet state captured after a row, ops.h StateCapture): at
  // two inner positions of one chunk (which then ends at the second) and at the end, Metal's equal the CPU's.
  {
    std::vector<int32_t> more;
    for (int i = 0; i < 7; ++i) more.push_back(int32_t(g_rng() % uint64_t(cfg.vocab)));
    const int64_t p0 = cs.position();
    const std::vector<int64_t> at{p0 + 2, p0 + 4, p0 + 7};
    auto csn = cs.prefill_snapshots(more.data(), int64_t(more.size()), at, nullptr, nullptr);
    auto msn = ms.prefill_snapshots(more.data(), int64_t(more.size()), at, nullptr, nullptr);
    fails += csn.size() != at.size() || msn.size() != at.size();
    for (size_t i = 0; i < std::min(csn.size(), msn.size()); ++i) {
      const HostSnapshot hc = csn[i]->to_host(), hm = msn[i]->to_host();
      double state = 0, kv = 0;
      for (size_t l = 0; l < hc.conv.size(); ++l)
        state = std::max({state, max_rel(hc.conv[l], hm.conv[l]), max_rel(hc.recurrent[l], hm.recurrent[l])});
      for (size_t l = 0; l < hc.kv.size(); ++l) kv = std::max(kv, max_rel(hc.kv[l], hm.kv[l]));
      const std::string where = "prefill_snapshots at position " + std::to_string(at[i]);
      report(where + " conv/recurrent state", state);
      report(where + " KV rows", kv);
      report(where + " logits", max_rel(hc.logits, hm.logits));
    }
  }
  // Fork mid-generation, as Session.fork does it (src/lily/session.py: a new session restored from the parent's
  // snapshot). Parent and child both go on, interleaved, the child after two tokens of its own: each equals a
  // fresh Metal session prefilled with its tokens (greedy ids; logits within the prefill/decode tolerance), and
  // each continues bit for bit as a session restored from a snapshot taken at the fork that ran alone (the child
  // leaves the parent unchanged, and the parent the child).
  {
    auto random_ids = [&](int n) {
      std::vector<int32_t> v;
      for (int i = 0; i < n; ++i) v.push_back(int32_t(g_rng() % uint64_t(cfg.vocab)));
      return v;
    };
    const std::vector<int32_t> start = random_ids(6), own = random_ids(2);
    std::vector<float> last(size_t(cfg.vocab));
    Session parent(mtl_model, mtl_lock, max_ctx, chunk);
    parent.prefill(start.data(), int64_t(start.size()), false, last.data(), nullptr);
    std::vector<int32_t> ignored;
    std::vector<float> ignored_l;
    gen(parent, 3, ignored, ignored_l);  // the third id is pending: the fork happens mid-generation
    const std::vector<int32_t> at_fork = parent.tokens();
    auto before = parent.snapshot();
    Session child(mtl_model, mtl_lock, max_ctx, chunk);
    child.restore(*parent.snapshot());
    child.prefill(own.data(), int64_t(own.size()), false, last.data(), nullptr);
    std::vector<int32_t> child_tokens = child.tokens(), p_ids, c_ids;
    std::vector<float> p_l, c_l;
    gen(child, 3, c_ids, c_l);
    gen(parent, 3, p_ids, p_l);
    gen(child, 2, c_ids, c_l);
    // Fresh sessions prefilled with each one's tokens at the point it went its own way.
    auto fresh = [&](const std::vector<int32_t>& tokens, int n, std::vector<int32_t>& ids, std::vector<float>& l) {
      Session f(mtl_model, mtl_lock, max_ctx, chunk);
      f.prefill(tokens.data(), int64_t(tokens.size()), false, last.data(), nullptr);
      gen(f, n, ids, l);
    };
    std::vector<int32_t> fp_ids, fc_ids;
    std::vector<float> fp_l, fc_l;
    fresh(at_fork, 3, fp_ids, fp_l);
    fresh(child_tokens, 5, fc_ids, fc_l);
    printf("model %s fork: parent %s a fresh session of its tokens, child %s\n", spec.c_str(),
           p_ids == fp_ids ? "same as" : "DIFFERENT from", c_ids == fc_ids ? "same" : "DIFFERENT");
    fails += p_ids != fp_ids || c_ids != fc_ids;
    report("fork: parent logits vs a fresh session", max_rel(fp_l, p_l));
    report("fork: child logits vs a fresh session", max_rel(fc_l, c_l));
    // Each alone from the fork's snapshot: the same bits.
    Session alone(mtl_model, mtl_lock, max_ctx, chunk);
    alone.restore(*before);
    std::vector<int32_t> ap_ids, ac_ids;
    std::vector<float> ap_l, ac_l;
    gen(alone, 3, ap_ids, ap_l);
    alone.restore(*before);
    alone.prefill(own.data(), int64_t(own.size()), false, last.data(), nullptr);
    gen(alone, 3, ac_ids, ac_l);
    gen(alone, 2, ac_ids, ac_l);
    const bool parent_same = ap_ids == p_ids && max_rel(ap_l, p_l) == 0.0;
    const bool child_same = ac_ids == c_ids && max_rel(ac_l, c_l) == 0.0;
    printf("model %s fork: parent continuation %s, child continuation %s (vs each alone from the fork's snapshot)\n",
           spec.c_str(), parent_same ? "unchanged" : "CHANGED", child_same ? "unchanged" : "CHANGED");
    fails += !parent_same || !child_same;
  }
  printf("%s: %d failures\n", fails ? "FAILED" : "PASSED", fails);
  return fails ? 1 : 0;
}

// ---- a real checkpoint (lily-tiny), as tests/metal/test_backend.py lays it out ----
// dir/manifest.txt: "config KEY VALUE", "full_attention 0 1 ...", "file PATH", "matrix NAME FILE affine BITS GROUP
// SCALE ROWS COLS DATA SCALES BIASES" or "matrix NAME FILE dense DTYPE ROWS COLS DATA", "vector NAME COUNT OFFSET"
// (floats into dir/vectors.f32); dir/teacher.i32 and dir/prompt.i32: token ids. Each checkpoint file is mapped
// read-only at a 16 KB aligned address, as macOS maps it, so Metal wraps it without a copy.
namespace {

struct MappedFile {
  const uint8_t* base = nullptr;
  size_t bytes = 0;
  void* reserve = nullptr;
  size_t reserved = 0;
  explicit MappedFile(const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) throw std::runtime_error("cannot open " + path);
    struct stat st;
    fstat(fd, &st);
    bytes = size_t(st.st_size);
    reserved = bytes + 16384;
    reserve = mmap(nullptr, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    const uintptr_t aligned = (reinterpret_cast<uintptr_t>(reserve) + 16383) / 16384 * 16384;
    void* p = mmap(reinterpret_cast<void*>(aligned), bytes, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("cannot map " + path);
    base = static_cast<const uint8_t*>(p);
  }
  ~MappedFile() { munmap(reserve, reserved); }
};

class ManifestSource final : public WeightSource {
 public:
  ManifestSource(const std::string& dir, ModelConfig& cfg) {
    std::ifstream f(dir + "/manifest.txt");
    if (!f) throw std::runtime_error("no manifest in " + dir);
    const std::string vbytes = read_all(dir + "/vectors.f32");
    vectors_.resize(vbytes.size() / 4);
    std::memcpy(vectors_.data(), vbytes.data(), vbytes.size());
    std::string line;
    while (std::getline(f, line)) {
      std::istringstream in(line);
      std::string kind;
      in >> kind;
      if (kind == "config") {
        std::string key;
        double v;
        in >> key >> v;
#define LILY_SET_FIELD(member, type, k, field) \
  if (key == k) cfg.member = type(v);
        LILY_CONFIG_FIELDS(LILY_SET_FIELD)
#undef LILY_SET_FIELD
      } else if (kind == "full_attention") {
        int b;
        while (in >> b) cfg.full_attention.push_back(b != 0);
      } else if (kind == "file") {
        std::string path;
        in >> path;
        files_.push_back(std::make_unique<MappedFile>(path));
      } else if (kind == "matrix") {
        std::string name, fmt;
        size_t file;
        in >> name >> file >> fmt;
        HostMatrix h;
        const uint8_t* base = files_.at(file)->base;
        uint64_t d = 0, sc = 0, bi = 0;
        if (fmt == "affine") {
          std::string sd;
          h.fmt.kind = WeightFormat::Kind::Affine;
          in >> h.fmt.bits >> h.fmt.group >> sd >> h.fmt.rows >> h.fmt.cols >> d >> sc >> bi;
          h.fmt.scale_dtype = sd == "bf16" ? DType::BF16 : DType::F16;
          h.scales = base + sc;
          h.biases = base + bi;
        } else {
          std::string dt;
          in >> dt >> h.fmt.rows >> h.fmt.cols >> d;
          h.fmt.dtype = dt == "f32" ? DType::F32 : dt == "bf16" ? DType::BF16 : DType::F16;
        }
        h.data = base + d;
        mats_[name] = h;
      } else if (kind == "vector") {
        std::string name;
        size_t count, off;
        in >> name >> count >> off;
        vecs_[name] = {off, count};
      }
    }
  }
  HostMatrix matrix(const std::string& name, int64_t rows, int64_t cols) override {
    auto it = mats_.find(name);
    if (it == mats_.end() || it->second.fmt.rows != rows || it->second.fmt.cols != cols)
      throw std::invalid_argument("manifest: no matrix '" + name + "' of that shape");
    return it->second;
  }
  const float* vector(const std::string& name, int64_t count) override {
    auto it = vecs_.find(name);
    if (it == vecs_.end() || int64_t(it->second.second) != count) throw std::invalid_argument("manifest: no vector " + name);
    return vectors_.data() + it->second.first;
  }
  std::vector<MappedRegion> regions() const {
    std::vector<MappedRegion> r;
    for (size_t i = 0; i < files_.size(); ++i) r.push_back({files_[i]->base, files_[i]->bytes, "checkpoint file " + std::to_string(i)});
    return r;
  }

 private:
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::map<std::string, HostMatrix> mats_;
  std::map<std::string, std::pair<size_t, size_t>> vecs_;
  std::vector<float> vectors_;
};

std::vector<int32_t> read_ids(const std::string& path) {
  const std::string b = read_all(path);
  std::vector<int32_t> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

}  // namespace

// Teacher-forced top-1 agreement over the held-out text (chunked prefill, every position's logits) and greedy
// decoding from a prompt: Metal against the CPU on the same mapped bytes.
int run_checkpoint(const std::string& msl, const std::string& dir) {
  ModelConfig cfg;
  ManifestSource src(dir, cfg);
  cfg.validate();
  cpu::CpuOps cpu_ops(cpu::CpuOptions{2});
  metal::MetalOps mtl_ops(msl);
  Qwen36 cpu_model(cfg, cpu_ops), mtl_model(cfg, mtl_ops);
  // The load infos own the expert stacks the loader repacked (per-expert checkpoints whose experts do not sit at a
  // uniform stride): they must live as long as the models.
  const LoadInfo cpu_info = load_weights(cpu_model, src, src.regions()),
                 mtl_info = load_weights(mtl_model, src, src.regions());
  std::mutex l1, l2;
  const std::vector<int32_t> teacher = read_ids(dir + "/teacher.i32"), prompt = read_ids(dir + "/prompt.i32");
  const int64_t max_ctx = int64_t(teacher.size() + prompt.size() + 64), chunk = 32;
  int fails = 0;
  // The teacher rows prefilled in chunks of `rows` on both backends: how many top-1 tokens agree, and the logits' error.
  auto teacher_forced = [&](int64_t rows, int& same, double& err) {
    Session cs(cpu_model, l1, max_ctx, rows), ms(mtl_model, l2, max_ctx, rows);
    std::vector<float> cl(teacher.size() * size_t(cfg.vocab)), ml(cl.size());
    cs.prefill(teacher.data(), int64_t(teacher.size()), true, cl.data(), nullptr);
    ms.prefill(teacher.data(), int64_t(teacher.size()), true, ml.data(), nullptr);
    same = 0;
    for (size_t t = 0; t < teacher.size(); ++t) {
      auto arg = [&](const std::vector<float>& v) {
        return std::max_element(v.begin() + long(t) * cfg.vocab, v.begin() + long(t + 1) * cfg.vocab) - v.begin();
      };
      same += arg(cl) == arg(ml);
    }
    err = max_rel(cl, ml);
    return double(same) >= 0.99 * double(teacher.size()) && err <= 1e-4;
  };
  {
    int same;
    double err;
    fails += !teacher_forced(chunk, same, err);
    printf("checkpoint teacher-forced top-1 agreement: %d of %zu (%.2f%%), logits max_err %.3g\n", same,
           teacher.size(), 100.0 * double(same) / double(teacher.size()), err);
  }
  {  // the teacher rows as one prefill call: its DeltaNet layers take the chunked form (>= 64 rows)
    const int64_t rows = int64_t(teacher.size()), chunked_0 = mtl_ops.counters().delta_chunked_calls;
    int same;
    double err;
    const bool ok = teacher_forced(rows, same, err);
    const int64_t chunked = mtl_ops.counters().delta_chunked_calls - chunked_0;
    printf("checkpoint one %lld-row chunk: %lld chunked DeltaNet calls, top-1 agreement %d of %zu, logits max_err "
           "%.3g\n", (long long)rows, (long long)chunked, same, teacher.size(), err);
    fails += chunked == 0 || !ok;
  }
  {
    Session cs(cpu_model, l1, max_ctx, chunk), ms(mtl_model, l2, max_ctx, chunk);
    std::vector<float> tmp(size_t(cfg.vocab));
    cs.prefill(prompt.data(), int64_t(prompt.size()), false, tmp.data(), nullptr);
    ms.prefill(prompt.data(), int64_t(prompt.size()), false, tmp.data(), nullptr);
    std::vector<int32_t> a, b;
    SamplingParams p;
    cs.generate(32, p, {}, [&](int32_t id, const float*) { return a.push_back(id), 1; });
    ms.generate(32, p, {}, [&](int32_t id, const float*) { return b.push_back(id), 1; });
    printf("checkpoint greedy 32 tokens: %s (", a == b ? "identical" : "DIFFERENT");
    for (int32_t i : b) printf(" %d", i);
    printf(" )\n");
    fails += a != b;
    const StepStats ds = ms.last_decode_stats();
    const auto& k = mtl_ops.counters();
    printf("checkpoint metal decode step: %lld ops, %lld stages, %lld dispatches, %lld barriers; mappings wrapped %lld "
           "(%zu bytes), copied %lld\n", (long long)ds.ops, (long long)ds.stages, (long long)k.last_dispatches,
           (long long)k.last_barriers, (long long)k.mappings_wrapped, k.wrapped_bytes, (long long)k.mappings_copied);
  }
  printf("%s: %d failures\n", fails ? "FAILED" : "PASSED", fails);
  return fails ? 1 : 0;
}

// The traffic benchmark (benchmarks/bench_metal_traffic.py, traffic-mode build with FAKEMETAL_TRAFFIC set): the
// checkpoint of dir on the Metal backend alone; dir/prompt.i32 prefilled as one chunk, then `decode_steps` greedy
// decode steps. Prints what MetalOps and the hazard tracker counted for each phase; the emulator writes the bytes.
int run_traffic(const std::string& msl, const std::string& dir, int decode_steps) {
  ModelConfig cfg;
  ManifestSource src(dir, cfg);
  cfg.validate();
  metal::MetalOps mtl_ops(msl);
  Qwen36 model(cfg, mtl_ops);
  const LoadInfo info = load_weights(model, src, src.regions());  // owns any repacked expert stacks
  std::mutex lock;
  const std::vector<int32_t> prompt = read_ids(dir + "/prompt.i32");
  const int64_t n = int64_t(prompt.size()), max_ctx = n + decode_steps + 8;
  Session ms(model, lock, max_ctx, n);
  std::vector<float> logits(size_t(cfg.vocab));
  ms.prefill(prompt.data(), n, false, logits.data(), nullptr);
  const StepStats ps = ms.last_prefill_stats();
  std::vector<int32_t> ids;
  SamplingParams p;
  ms.generate(decode_steps, p, {}, [&](int32_t id, const float*) { return ids.push_back(id), 1; });
  const StepStats ds = ms.last_decode_stats();
  const auto& k = mtl_ops.counters();
  printf("traffic prefill chunk: %lld tokens, %lld ops, %lld stages (hazard tracker), %lld dispatches, %lld stages "
         "(metal), %lld chunks\n", (long long)n, (long long)ps.ops, (long long)ps.stages,
         (long long)k.prefill_dispatches, (long long)k.prefill_stages, (long long)k.prefill_steps);
  printf("traffic decode step: position %lld, %lld ops, %lld stages (hazard tracker), %lld dispatches, %lld stages "
         "(metal), %lld steps\n", (long long)n, (long long)ds.ops, (long long)ds.stages, (long long)k.decode_dispatches,
         (long long)k.decode_stages, (long long)k.decode_steps);
  printf("traffic tokens:");
  for (int32_t i : ids) printf(" %d", i);
  printf("\nPASSED: 0 failures\n");
  return 0;
}
