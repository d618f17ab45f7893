// RMSNorm family on CUDA: the host side of kernels/norm.cu (oracle: csrc/cpu/norm.cpp).
// One launch per op. A segment (w.cols elements: 2048 for the residual norms, 128 for the gated DeltaNet
// output norm) is one block of 256 threads when it is long (> 512 elements), else one warp, 4 segments per
// 128-thread block; rows over grid.y. 16-byte loads when every pointer, stride and the segment allow them.
#include <stdexcept>
#include <string>

#include "cuda/backend.h"

namespace lily::cuda {

namespace {

struct NormGeometry {
  int nt, spb, vec;
};

[[noreturn]] void bad(const char* op, const std::string& why) {
  throw std::invalid_argument(std::string(op) + " (cuda): " + why);
}

void require_f32(const char* op, const Tensor& t, const char* what) {
  if (t.dtype != DType::F32) bad(op, std::string(what) + " must be F32");
}

NormGeometry select_norm(int64_t seg, bool aligned16) {
  NormGeometry g;
  if (seg > 512) {
    g.nt = 256, g.spb = 1;
  } else {
    g.nt = 32, g.spb = 4;
  }
  g.vec = (aligned16 && seg % 4 == 0) ? 4 : 1;
  return g;
}

std::string describe(const NormGeometry& g, int64_t seg) {
  std::string s = g.nt == 32 ? "one warp per segment, 4 per block" : "one 256-thread block per segment";
  s += ", segment " + std::to_string(seg) + (g.vec == 4 ? ", 16-byte loads" : ", 4-byte loads (unaligned)");
  return s;
}

}  // namespace

void CudaOps::rms_norm_impl(const Tensor& x, const Tensor& w, const Tensor& out, float eps) {
  const char* op = "rms_norm";
  require_f32(op, x, "x");
  require_f32(op, w, "w");
  require_f32(op, out, "out");
  const int64_t seg = w.cols, T = x.rows;
  if (seg < 1 || x.cols % seg != 0 || out.rows != T || out.cols != x.cols)
    bad(op, "x [T, n·w.cols] and out must match (x.cols " + std::to_string(x.cols) + ", w.cols " +
                std::to_string(seg) + ")");
  if (T == 0) return;
  if (T > 65535) bad(op, "more than 65535 rows in one call");
  const int64_t nseg = x.cols / seg;
  const bool al = ptr(x) % 16 == 0 && ptr(w) % 16 == 0 && ptr(out) % 16 == 0 && x.stride % 4 == 0 &&
                  out.stride % 4 == 0;
  const NormGeometry g = select_norm(seg, al);
  const Kernel& k = kernel("norm", "rms_norm", {{"SEG", seg}, {"NT", g.nt}, {"SPB", g.spb}, {"VEC", g.vec}});
  launch(k, Dim3{unsigned((nseg + g.spb - 1) / g.spb), unsigned(T), 1}, Dim3{unsigned(g.nt), unsigned(g.spb), 1}, 0,
         ptr(x), int64_t(x.stride), ptr(w), ptr(out), int64_t(out.stride), int(nseg), eps);
  note_variant("rms_norm.seg" + std::to_string(seg), describe(g, seg));
}

void CudaOps::add_rms_norm_impl(const Tensor& a, const Tensor& b, const Tensor& w, float eps, const Tensor& sum,
                                const Tensor& normed) {
  const char* op = "add_rms_norm";
  for (const Tensor* t : {&a, &b, &w, &sum, &normed}) require_f32(op, *t, "every tensor");
  const int64_t seg = w.cols, T = a.rows;
  if (seg < 1 || a.cols % seg != 0 || b.rows != T || b.cols != a.cols || sum.rows != T || sum.cols != a.cols ||
      normed.rows != T || normed.cols != a.cols)
    bad(op, "a, b, sum, normed must be [T, n·w.cols]");
  if (T == 0) return;
  if (T > 65535) bad(op, "more than 65535 rows in one call");
  const int64_t nseg = a.cols / seg;
  const bool al = ptr(a) % 16 == 0 && ptr(b) % 16 == 0 && ptr(w) % 16 == 0 && ptr(sum) % 16 == 0 &&
                  ptr(normed) % 16 == 0 && a.stride % 4 == 0 && b.stride % 4 == 0 && sum.stride % 4 == 0 &&
                  normed.stride % 4 == 0;
  const NormGeometry g = select_norm(seg, al);
  const Kernel& k = kernel("norm", "add_rms_norm", {{"SEG", seg}, {"NT", g.nt}, {"SPB", g.spb}, {"VEC", g.vec}});
  launch(k, Dim3{unsigned((nseg + g.spb - 1) / g.spb), unsigned(T), 1}, Dim3{unsigned(g.nt), unsigned(g.spb), 1}, 0,
         ptr(a), int64_t(a.stride), ptr(b), int64_t(b.stride), ptr(w), ptr(sum), int64_t(sum.stride), ptr(normed),
         int64_t(normed.stride), int(nseg), eps);
  note_variant("add_rms_norm.seg" + std::to_string(seg), describe(g, seg));
}

void CudaOps::gated_rms_norm_impl(const Tensor& o, const Tensor& z, const Tensor& w, float eps, const Tensor& out) {
  const char* op = "gated_rms_norm";
  for (const Tensor* t : {&o, &z, &w, &out}) require_f32(op, *t, "every tensor");
  const int64_t seg = w.cols, T = o.rows;
  if (seg < 1 || o.cols % seg != 0 || z.rows != T || z.cols != o.cols || out.rows != T || out.cols != o.cols)
    bad(op, "o, z, out must be [T, heads·w.cols]");
  if (T == 0) return;
  if (T > 65535) bad(op, "more than 65535 rows in one call");
  const int64_t nseg = o.cols / seg;
  const bool al = ptr(o) % 16 == 0 && ptr(z) % 16 == 0 && ptr(w) % 16 == 0 && ptr(out) % 16 == 0 &&
                  o.stride % 4 == 0 && z.stride % 4 == 0 && out.stride % 4 == 0;
  const NormGeometry g = select_norm(seg, al);
  const Kernel& k = kernel("norm", "gated_rms_norm", {{"SEG", seg}, {"NT", g.nt}, {"SPB", g.spb}, {"VEC", g.vec}});
  launch(k, Dim3{unsigned((nseg + g.spb - 1) / g.spb), unsigned(T), 1}, Dim3{unsigned(g.nt), unsigned(g.spb), 1}, 0,
         ptr(o), int64_t(o.stride), ptr(z), int64_t(z.stride), ptr(w), ptr(out), int64_t(out.stride), int(nseg), eps);
  note_variant("gated_rms_norm.seg" + std::to_string(seg), describe(g, seg));
}

// One launch for the MTP block's input row (kernels/norm.cu mtp_input): the embedding gather and both norms, in
// decode and prefill alike. The e and normed intermediates of the composed form are not written.
void CudaOps::mtp_input_impl(const Tensor& ids, const Weight& table, const Tensor& h, const Tensor& w_e,
                             const Tensor& w_h, float eps, const Tensor& e, const Tensor& normed, const Tensor& out) {
  const char* op = "mtp_input";
  const int64_t T = ids.rows, H = h.cols;
  if (T > 65535) bad(op, "more than 65535 rows in one call");
  const bool q = table.quantized();
  const bool al = ptr(h) % 16 == 0 && ptr(w_e) % 16 == 0 && ptr(w_h) % 16 == 0 && ptr(out) % 16 == 0 &&
                  h.stride % 4 == 0 && out.stride % 4 == 0 && H % 4 == 0;
  const NormGeometry g = select_norm(H, al);
  const Kernel& k = kernel("norm", "mtp_input", {{"SEG", H}, {"NT", g.nt}, {"SPB", g.spb}, {"VEC", g.vec}});
  launch(k, Dim3{unsigned((2 + g.spb - 1) / g.spb), unsigned(T), 1}, Dim3{unsigned(g.nt), unsigned(g.spb), 1}, 0,
         ptr(ids), int64_t(ids.stride), data(table), q ? scales(table) : CUdeviceptr(0),
         q ? biases(table) : CUdeviceptr(0), table.rows, int(table.dtype), q ? table.bits : 0, q ? table.group : 0,
         int(table.scale_dtype), ptr(h), int64_t(h.stride), ptr(w_e), ptr(w_h), ptr(out), int64_t(out.stride), eps);
  note_variant("mtp_input", "one launch: the embedding row and h normalised side by side (" + describe(g, H) +
                                "), the bits of embed_rows + two rms_norm");
}

}  // namespace lily::cuda
