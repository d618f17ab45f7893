// End-to-end proof of the Metal backend on Linux: the real host code (csrc/metal) drives the real kernels
// (metal/*.metal) through metal-cpp, the fake Metal runtime and the MSL emulator. One Pass records
// rms_norm(x -> xn), a barrier, qmv4(W, xn[r] -> y[r]) for every row r, and an independent row_dot(a, b),
// then submits once. tests/metal/test_fake_runtime.py writes the inputs, runs this program and compares
// the outputs with the CPU backend.
//
// usage: proof_main [--skip-barrier] --rows R --cols C --out O --group G --scale bf16|f16 --eps E
//                   --dot-rows R2 --dot-cols C2 --in DIR --out-dir DIR METAL_FILE...
// DIR holds raw little-endian arrays: x.f32 [R, C], w.f32 [C], codes.u32 [O, C/8], scales.u16 / biases.u16
// [O, C/G] (bf16 or f16 bits), a.f32 and b.f32 [R2, C2]. Outputs: xn.f32 [R, C], y.f32 [R, O], dot.f32 [R2].
// --skip-barrier omits the barrier between rms_norm and qmv4 (a planted bug: with FAKEMETAL_REVERSE=1 qmv4
// then reads xn before rms_norm has written it).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "metal/kernels.h"

namespace {

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

template <class T>
std::vector<T> read_array(const std::string& path, size_t count) {
  const std::string bytes = read_all(path);
  if (bytes.size() != count * sizeof(T))
    throw std::runtime_error(path + ": " + std::to_string(bytes.size()) + " bytes, expected " +
                             std::to_string(count * sizeof(T)));
  std::vector<T> v(count);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

void write_array(const std::string& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), std::streamsize(bytes));
  if (!f) throw std::runtime_error("cannot write " + path);
}

struct Options {
  bool skip_barrier = false;
  long rows = 0, cols = 0, out = 0, group = 64, dot_rows = 0, dot_cols = 0;
  std::string scale = "bf16", in_dir, out_dir;
  float eps = 1e-6f;
  std::vector<std::string> metal_files;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--skip-barrier") o.skip_barrier = true;
    else if (a == "--rows") o.rows = std::stol(next());
    else if (a == "--cols") o.cols = std::stol(next());
    else if (a == "--out") o.out = std::stol(next());
    else if (a == "--group") o.group = std::stol(next());
    else if (a == "--scale") o.scale = next();
    else if (a == "--eps") o.eps = std::stof(next());
    else if (a == "--dot-rows") o.dot_rows = std::stol(next());
    else if (a == "--dot-cols") o.dot_cols = std::stol(next());
    else if (a == "--in") o.in_dir = next();
    else if (a == "--out-dir") o.out_dir = next();
    else if (!a.empty() && a[0] == '-') throw std::runtime_error("unknown option " + a);
    else o.metal_files.push_back(a);
  }
  if (o.rows <= 0 || o.cols <= 0 || o.out <= 0 || o.dot_rows <= 0 || o.dot_cols <= 0 || o.in_dir.empty() ||
      o.out_dir.empty() || o.metal_files.empty())
    throw std::runtime_error("missing arguments (see the usage comment in proof_main.cpp)");
  return o;
}

int run(const Options& o) {
  using namespace lily::metal;
  std::string msl;  // the files in the order given (the test passes metal/*.metal sorted), as CMake embeds them
  for (const auto& f : o.metal_files) msl += "// ---- " + f + "\n" + read_all(f) + "\n";
  Device device(msl);

  const size_t R = size_t(o.rows), C = size_t(o.cols), O = size_t(o.out), G = size_t(o.group);
  const size_t R2 = size_t(o.dot_rows), C2 = size_t(o.dot_cols);
  const std::string in = o.in_dir + "/";
  const auto x = read_array<float>(in + "x.f32", R * C);
  const auto w = read_array<float>(in + "w.f32", C);
  const auto codes = read_array<uint32_t>(in + "codes.u32", O * C / 8);
  const auto scales = read_array<uint16_t>(in + "scales.u16", O * C / G);
  const auto biases = read_array<uint16_t>(in + "biases.u16", O * C / G);
  const auto a = read_array<float>(in + "a.f32", R2 * C2);
  const auto b = read_array<float>(in + "b.f32", R2 * C2);

  Ref<MTL::Buffer> x_buf = device.new_buffer(x.data(), x.size() * 4);
  Ref<MTL::Buffer> w_buf = device.new_buffer(w.data(), w.size() * 4);
  Ref<MTL::Buffer> codes_buf = device.new_buffer(codes.data(), codes.size() * 4);
  Ref<MTL::Buffer> scales_buf = device.new_buffer(scales.data(), scales.size() * 2);
  Ref<MTL::Buffer> biases_buf = device.new_buffer(biases.data(), biases.size() * 2);
  Ref<MTL::Buffer> a_buf = device.new_buffer(a.data(), a.size() * 4);
  Ref<MTL::Buffer> b_buf = device.new_buffer(b.data(), b.size() * 4);
  Ref<MTL::Buffer> xn_buf = device.new_buffer(R * C * 4);
  Ref<MTL::Buffer> y_buf = device.new_buffer(R * O * 4);
  Ref<MTL::Buffer> dot_buf = device.new_buffer(R2 * 4);

  QuantMatrix W;
  W.codes = Arg::buf(codes_buf.get());
  W.scales = Arg::buf(scales_buf.get());
  W.biases = Arg::buf(biases_buf.get());
  W.rows = o.out;
  W.cols = o.cols;
  W.group = int(o.group);
  W.scale_type = o.scale == "f16" ? QuantMatrix::ScaleType::F16 : QuantMatrix::ScaleType::BF16;

  Pass pass(device);
  encode_rms_norm(pass, Arg::buf(x_buf.get()), Arg::buf(w_buf.get()), Arg::buf(xn_buf.get()), o.rows, o.cols,
                  o.cols, o.eps);
  encode_row_dot(pass, Arg::buf(a_buf.get()), Arg::buf(b_buf.get()), Arg::buf(dot_buf.get()), o.dot_rows,
                 o.dot_cols);
  if (!o.skip_barrier) pass.barrier();
  for (size_t r = 0; r < R; ++r)
    encode_qmv4(pass, W, Arg::buf(xn_buf.get(), r * C * 4), Arg::buf(y_buf.get(), r * O * 4));
  pass.submit();

  const std::string out = o.out_dir + "/";
  write_array(out + "xn.f32", xn_buf->contents(), R * C * 4);
  write_array(out + "y.f32", y_buf->contents(), R * O * 4);
  write_array(out + "dot.f32", dot_buf->contents(), R2 * 4);
  printf("device=%s dispatches=%d stages=%d\n", device.name().c_str(), pass.dispatches(), pass.stages());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    fprintf(stderr, "proof_main: error: %s\n", e.what());
    return 2;
  }
}
