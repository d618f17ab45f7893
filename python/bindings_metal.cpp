// Metal entry points of lily._core (macOS builds only): the device's name and one call per Metal kernel on
// numpy inputs, so tests/metal/test_metal_device.py compares each kernel with the CPU backend on a real GPU.
// The device (and its library, compiled from the embedded metal/*.metal) is created on first use.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "metal/kernels.h"

namespace nb = nanobind;
using namespace nb::literals;
using lily::metal::Arg;
using lily::metal::Device;
using lily::metal::Pass;

namespace {

Device& device() {
  static std::mutex lock;
  static std::unique_ptr<Device> dev;
  std::lock_guard<std::mutex> lk(lock);
  if (!dev) dev = std::make_unique<Device>(lily::metal::msl_source());
  return *dev;
}

// One GPU call at a time: the test entry points share one device and are not a serving path.
std::mutex& call_lock() {
  static std::mutex m;
  return m;
}

template <class T>
nb::ndarray<nb::numpy, T> owned_array(size_t n0, size_t n1, T** data) {
  T* p = new T[n0 * (n1 ? n1 : 1)];
  nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<T*>(q); });
  *data = p;
  if (n1) return nb::ndarray<nb::numpy, T>(p, {n0, n1}, owner);
  return nb::ndarray<nb::numpy, T>(p, {n0}, owner);
}

using F32Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32Vector = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

}  // namespace

void bind_metal(nb::module_& m) {
  m.def("metal_device_name", [] { return device().name(); });

  // y = W · x for one 4-bit affine weight given as the same dict cpu_matmul takes.
  m.def("metal_qmv4", [](F32Vector x, const nb::dict& weight) {
    if (nb::cast<std::string>(weight["kind"]) != "affine" || nb::cast<int>(weight["bits"]) != 4)
      throw std::invalid_argument("metal_qmv4 takes a 4-bit affine weight");
    auto codes = nb::cast<nb::ndarray<const uint32_t, nb::ndim<2>, nb::c_contig>>(weight["data"]);
    auto scales = nb::cast<nb::ndarray<nb::ndim<2>, nb::c_contig>>(weight["scales"]);
    auto biases = nb::cast<nb::ndarray<nb::ndim<2>, nb::c_contig>>(weight["biases"]);
    const std::string sd = nb::cast<std::string>(weight["scale_dtype"]);
    if (sd != "bf16" && sd != "f16") throw std::invalid_argument("metal_qmv4: scales must be bf16 or f16");
    if (scales.itemsize() != 2 || biases.itemsize() != 2 || scales.size() != biases.size())
      throw std::invalid_argument("metal_qmv4: scales/biases must be 2-byte arrays of one shape");
    lily::metal::QuantMatrix w;
    w.rows = int64_t(codes.shape(0));
    w.cols = int64_t(codes.shape(1)) * 8;
    w.group = nb::cast<int>(weight["group"]);
    w.scale_type = sd == "bf16" ? lily::metal::QuantMatrix::ScaleType::BF16 : lily::metal::QuantMatrix::ScaleType::F16;
    if (int64_t(x.shape(0)) != w.cols) throw std::invalid_argument("metal_qmv4: x has the wrong length");
    if (int64_t(scales.shape(0)) != w.rows || int64_t(scales.shape(1)) * w.group != w.cols)
      throw std::invalid_argument("metal_qmv4: scales have the wrong shape");
    float* out;
    auto result = owned_array<float>(size_t(w.rows), 0, &out);
    {
      nb::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lk(call_lock());
      Device& dev = device();
      auto c = dev.new_buffer(codes.data(), codes.size() * 4);
      auto s = dev.new_buffer(scales.data(), scales.size() * 2);
      auto b = dev.new_buffer(biases.data(), biases.size() * 2);
      auto xb = dev.new_buffer(x.data(), x.size() * 4);
      auto yb = dev.new_buffer(size_t(w.rows) * 4);
      w.codes = Arg::buf(c.get());
      w.scales = Arg::buf(s.get());
      w.biases = Arg::buf(b.get());
      Pass pass(dev);
      lily::metal::encode_qmv4(pass, w, Arg::buf(xb.get()), Arg::buf(yb.get()));
      pass.submit();
      std::memcpy(out, yb->contents(), size_t(w.rows) * 4);
    }
    return result;
  }, "x"_a, "weight"_a);

  m.def("metal_rms_norm", [](F32Matrix x, F32Vector w, float eps) {
    const size_t rows = x.shape(0), cols = x.shape(1), seg = w.shape(0);
    if (seg == 0 || cols % seg != 0) throw std::invalid_argument("x's columns must be a multiple of w's length");
    float* out;
    auto result = owned_array<float>(rows, cols, &out);
    {
      nb::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lk(call_lock());
      Device& dev = device();
      auto xb = dev.new_buffer(x.data(), x.size() * 4);
      auto wb = dev.new_buffer(w.data(), w.size() * 4);
      auto ob = dev.new_buffer(x.size() * 4);
      Pass pass(dev);
      lily::metal::encode_rms_norm(pass, Arg::buf(xb.get()), Arg::buf(wb.get()), Arg::buf(ob.get()), int64_t(rows),
                                   int64_t(cols), int64_t(seg), eps);
      pass.submit();
      std::memcpy(out, ob->contents(), x.size() * 4);
    }
    return result;
  }, "x"_a, "w"_a, "eps"_a);

  m.def("metal_row_dot", [](F32Matrix a, F32Matrix b) {
    if (a.shape(0) != b.shape(0) || a.shape(1) != b.shape(1)) throw std::invalid_argument("a and b differ in shape");
    const size_t rows = a.shape(0), cols = a.shape(1);
    float* out;
    auto result = owned_array<float>(rows, 0, &out);
    {
      nb::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lk(call_lock());
      Device& dev = device();
      auto ab = dev.new_buffer(a.data(), a.size() * 4);
      auto bb = dev.new_buffer(b.data(), b.size() * 4);
      auto ob = dev.new_buffer(rows * 4);
      Pass pass(dev);
      lily::metal::encode_row_dot(pass, Arg::buf(ab.get()), Arg::buf(bb.get()), Arg::buf(ob.get()), int64_t(rows),
                                  int64_t(cols));
      pass.submit();
      std::memcpy(out, ob->contents(), rows * 4);
    }
    return result;
  }, "a"_a, "b"_a);
}
