// Encoder for metal/matmul.metal: the 4-bit affine matrix-vector product (decode shape). Threadgroups of
// 2 simdgroups × 4 rows = 8 rows; the group size is the kernel's function constant 0, so one pipeline exists
// per (scale type, group size).
#include <algorithm>
#include <string>

#include "metal/kernels.h"

namespace lily::metal {

namespace {
struct Qmv4Shape {  // metal/matmul.metal
  uint32_t rows, cols;
};
static_assert(sizeof(Qmv4Shape) == 8, "Qmv4Shape must match the MSL struct");
constexpr int64_t kRowsPerThreadgroup = 8;
}  // namespace

void encode_qmv4(Pass& pass, const QuantMatrix& w, Arg x, Arg y) {
  if (w.group != 32 && w.group != 64 && w.group != 128)
    throw MetalError("qmv4: group size " + std::to_string(w.group) + " is not 32, 64 or 128");
  if (w.rows <= 0 || w.cols <= 0 || w.cols % w.group != 0 || w.rows > UINT32_MAX || w.cols > UINT32_MAX)
    throw MetalError("qmv4: bad matrix shape [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) + "]");
  if (x.offset % 16 != 0) throw MetalError("qmv4: x must be 16-byte aligned (float4 loads)");
  const Qmv4Shape shape{uint32_t(w.rows), uint32_t(w.cols)};
  const char* kernel = w.scale_type == QuantMatrix::ScaleType::BF16 ? "qmv4_bf16" : "qmv4_f16";
  MTL::ComputePipelineState* pipeline =
      pass.device().pipeline(kernel, {FunctionConstant::u32(0, uint32_t(w.group)),  // specialised by group and K
                                      FunctionConstant::u32(4, shape.cols)});
  const auto groups = NS::UInteger((w.rows + kRowsPerThreadgroup - 1) / kRowsPerThreadgroup);
  pass.dispatch(pipeline, {w.codes, w.scales, w.biases, x, y, Arg::value(shape)}, MTL::Size(groups, 1, 1),
                MTL::Size(64, 1, 1));
}

}  // namespace lily::metal

// ------------------------------------------------------------------------------------------------------------
// MetalOps: matmul, embed and the routed experts (metal/matmul.metal: matmul_rows, embed_rows, moe_gate_up,
// moe_down, moe_down_combine; qmv4 for aligned 4-bit decode rows).
#include "metal/backend.h"

namespace lily::metal {

namespace {
struct WeightRef {  // metal/matmul.metal
  uint32_t N, K, data_off, scale_off, bias_off, data_stride, scale_stride, bias_stride;
};
static_assert(sizeof(WeightRef) == 32, "WeightRef must match metal/matmul.metal");
struct MatmulShape {  // metal/matmul.metal
  uint32_t T, ldx, ldy, k;
};
static_assert(sizeof(MatmulShape) == 16, "MatmulShape must match metal/matmul.metal");
struct DownCombineShape {  // metal/matmul.metal (moe_down_combine)
  uint32_t ldh, ld_shared, ld_gate, k;
};
static_assert(sizeof(DownCombineShape) == 16, "DownCombineShape must match metal/matmul.metal");
constexpr int64_t kRowsPerGroup = 8;  // matmul_rows / moe_*: 2 simdgroups × 4 rows (metal/matmul.metal)
// Grouped expert tiles: the lane-dot tiles (moe_gate_up_tiles / moe_down_tiles) take 8 rows (must match kTileRows in
// metal/matmul.metal); the simdgroup-matrix tiles (moe_*_mma_r16 / _r32) 16 or 32, R / 8 simdgroups of 32 lanes. The
// workspace's tile map is sized for the smallest, 8, which bounds every R.
constexpr int64_t kLaneTileRows = 8;
constexpr int64_t kMmaColumns = 32;  // output columns per mma threadgroup and K block: kMmaBN = kMmaBK in metal/matmul.metal
// Rows per expert on average (T·k / E) from which a chunk takes 32-row tiles. Below it most active experts hold
// fewer than 32 rows, so a 32-row tile would be mostly masked rows (work and threadgroup memory for nothing) while
// a 16-row tile is at least half full for experts with ≥ 8 rows; from 24 rows on average a 32-row tile is ≥ 3/4 full
// for the typical expert and halves the weight re-reads of experts above 16 rows. For the real model (E 256, k 8)
// that is chunks of ≥ 768 tokens: 512-token chunks take 16 rows, 2K chunks 32 (issue 12's ablation points).
constexpr int64_t kRowsPerExpertFor32 = 24;
struct GroupShape {                   // metal/matmul.metal
  uint32_t T, k, E, max_tiles, tile_rows;
};
static_assert(sizeof(GroupShape) == 20, "GroupShape must match metal/matmul.metal");

uint32_t format_code(const WeightFormat& f) {
  if (f.quantized()) {
    if (f.bits != 4 && f.bits != 8) throw MetalError("metal matmul: " + std::to_string(f.bits) + "-bit weights are not supported");
    return uint32_t(f.bits);
  }
  return f.dtype == DType::F32 ? 0 : f.dtype == DType::F16 ? 1 : 2;
}
}  // namespace

struct MetalOps::WeightBinding {
  BoundPart data, scales, biases;
  WeightRef ref{};
  std::vector<FunctionConstant> constants;
  std::vector<Arg> args() const {
    return {Arg::buf(data.buffer, data.bind_offset), Arg::buf(scales.buffer, scales.bind_offset),
            Arg::buf(biases.buffer, biases.bind_offset)};
  }
};

MetalOps::WeightBinding MetalOps::bind_weight(const Weight& w) {
  WeightBinding b;
  const int64_t E = w.experts ? w.experts : 1;
  const size_t de = w.quantized() ? 4 : dtype_size(w.dtype);
  const size_t data_bytes = size_t(w.data_stride) * size_t(E - 1) + w.row_bytes() * size_t(w.rows);
  b.data = part(w.mapping, w.data, data_bytes, de);
  b.ref.N = uint32_t(w.rows);
  b.ref.K = uint32_t(w.cols);
  b.ref.data_off = b.data.element;
  if (w.data_stride % de) throw MetalError("metal: expert stride is not a whole number of elements");
  b.ref.data_stride = uint32_t(w.data_stride / de);
  if (w.quantized()) {
    if (w.cols % w.group || w.group % (32 / w.bits)) throw MetalError("metal: group size does not divide the row");
    const size_t sb = size_t(w.scale_stride) * size_t(E - 1) + w.scale_bytes();
    b.scales = part(w.scale_mapping, w.scales, sb, 2);
    b.biases = part(w.bias_mapping, w.biases, size_t(w.bias_stride) * size_t(E - 1) + w.scale_bytes(), 2);
    b.ref.scale_off = b.scales.element;
    b.ref.bias_off = b.biases.element;
    b.ref.scale_stride = uint32_t(w.scale_stride / 2);
    b.ref.bias_stride = uint32_t(w.bias_stride / 2);
    if (w.scale_dtype != DType::BF16 && w.scale_dtype != DType::F16)
      throw MetalError("metal: affine scales must be bf16 or f16");
  } else {
    b.scales = b.biases = b.data;  // unused by dense kernels, bound so every argument slot is valid
  }
  b.constants = {FunctionConstant::u32(1, format_code(w)), FunctionConstant::u32(2, uint32_t(w.quantized() ? w.group : 1)),
                 FunctionConstant::boolean(3, w.scale_dtype == DType::BF16)};
  return b;
}

namespace {
// qmv4 reads codes as uint (4-byte aligned) and scales/biases as bfloat/half (2-byte aligned). bind_weight gives
// every part that alignment whatever its offset in the checkpoint: a part not aligned to its element in the file
// (a safetensors header of a length that is no multiple of 4 shifts a whole shard) is copied once at load
// (MetalOps::part, counted in parts_copied). So the checkpoint's offsets do not decide the kernel; they used to,
// and the LM head of such a shard ran matmul_rows (benchmarks/NOTES.md, "Metal: ... at the real widths").
bool qmv4_takes(const Weight& w) {  // the weight's side (matmul_variant reports from it)
  return w.quantized() && w.bits == 4 && !w.experts && (w.group == 32 || w.group == 64 || w.group == 128);
}
bool qmv4_fits(const Weight& w, int64_t rows, size_t x_offset) { return qmv4_takes(w) && rows == 1 && x_offset % 16 == 0; }
}  // namespace

void MetalOps::matmul_impl(const Tensor& x, const Weight& w, const Tensor& out) {
  if (x.cols != w.cols || out.cols != w.rows || x.rows != out.rows) throw std::logic_error("matmul: shape mismatch");
  const Arg xa = arg(x), ya = arg(out);
  if (qmv4_fits(w, x.rows, xa.offset)) {
    QuantMatrix q;
    const WeightBinding b = bind_weight(w);
    q.codes = Arg::buf(b.data.buffer, b.data.exact_offset());
    q.scales = Arg::buf(b.scales.buffer, b.scales.exact_offset());
    q.biases = Arg::buf(b.biases.buffer, b.biases.exact_offset());
    q.rows = w.rows;
    q.cols = w.cols;
    q.group = w.group;
    q.scale_type = w.scale_dtype == DType::BF16 ? QuantMatrix::ScaleType::BF16 : QuantMatrix::ScaleType::F16;
    encode_qmv4(pass(), q, xa, ya);
    ++step_dispatches_;
    ++counters_.qmv4_dispatches;
    return;
  }
  const WeightBinding b = bind_weight(w);
  const MatmulShape s{uint32_t(x.rows), uint32_t(x.stride), uint32_t(out.stride), 1};
  std::vector<Arg> args = b.args();
  args.push_back(Arg::value(b.ref));
  args.push_back(xa);
  args.push_back(ya);
  args.push_back(Arg::value(s));
  dispatch("matmul_rows", b.constants, args,
           MTL::Size(NS::UInteger((w.rows + kRowsPerGroup - 1) / kRowsPerGroup), NS::UInteger(x.rows), 1),
           MTL::Size(64, 1, 1));
}

// A MatmulGroup: one dispatch for the products that can share one (metal/matmul.metal; the same bits as their
// separate kernels): at a decode row the 4-bit products qmv4 takes that share the first one's scale type and group
// size run as one qmv4_multi; the others (and every product of a prefill chunk) that share K and a format run as
// one matmul_rows_multi per format; a product alone in its kind runs as matmul would run it.
// LILY_METAL_GROUP_MATMULS=0 turns this off (every product its own dispatch, for A/B on a Mac); the counters say
// which path ran and why (optimizations()).
namespace {
struct Qmv4MultiShape {  // metal/matmul.metal Qmv4GroupShape
  uint32_t cols, products, rows[4], start[3];
};
static_assert(sizeof(Qmv4MultiShape) == 36, "Qmv4MultiShape must match metal/matmul.metal");
struct MatmulMultiShape {  // metal/matmul.metal
  uint32_t T, ldx, ldy[4], start[3];
};
static_assert(sizeof(MatmulMultiShape) == 36, "MatmulMultiShape must match metal/matmul.metal");
}  // namespace

void MetalOps::matmuls_impl(const Tensor& x, const MatmulGroup& g) {
  if (!group_matmuls_ || g.n < 2) {
    if (g.n >= 2) ++counters_.matmul_group_composed_calls, counters_.matmul_group_composed_reason = "LILY_METAL_GROUP_MATMULS=0";
    return Ops::matmuls_impl(x, g);
  }
  const Arg xa = arg(x);
  // Products of one kind (qmv4 or not, format, group, scale dtype, K) share a dispatch; a kind with one product
  // runs it alone, as matmul would.
  std::vector<std::vector<int>> quads, rows;  // qmv4_multi's and matmul_rows_multi's products, one list per kind
  std::vector<int> alone;
  for (int i = 0; i < g.n; ++i) {
    const Weight& w = g.w[size_t(i)];
    const bool q4 = qmv4_fits(w, x.rows, xa.offset);
    auto same = [&](const std::vector<int>& l) {
      const Weight& v = g.w[size_t(l[0])];
      return format_code(v) == format_code(w) && v.group == w.group && v.scale_dtype == w.scale_dtype && v.cols == w.cols;
    };
    std::vector<std::vector<int>>& kinds = q4 ? quads : rows;
    auto it = std::find_if(kinds.begin(), kinds.end(), same);
    if (it == kinds.end()) kinds.push_back({i});
    else it->push_back(i);
  }
  for (auto* kinds : {&quads, &rows})
    for (auto it = kinds->begin(); it != kinds->end();) {
      if (it->size() < 2) alone.push_back((*it)[0]), it = kinds->erase(it);
      else ++it;
    }
  std::sort(alone.begin(), alone.end());
  if (quads.empty() && rows.empty()) {
    ++counters_.matmul_group_composed_calls;
    counters_.matmul_group_composed_reason = "no two products of one kind";
    return Ops::matmuls_impl(x, g);
  }
  ++counters_.matmul_group_calls;
  if (!alone.empty()) {
    ++counters_.matmul_group_split_calls;
    counters_.matmul_group_split_reason.clear();
    for (int i : alone)
      counters_.matmul_group_split_reason += (counters_.matmul_group_split_reason.empty() ? "" : ", ") +
                                             g.w[size_t(i)].describe();
  }
  for (const std::vector<int>& l : quads) {
    const Weight& first = g.w[size_t(l[0])];
    Qmv4MultiShape shape{uint32_t(first.cols), uint32_t(l.size()), {}, {}};
    std::vector<Arg> codes, scales, biases, ys;
    uint32_t groups = 0;
    for (size_t j = 0; j < 4; ++j) {
      const size_t i = size_t(l[j < l.size() ? j : 0]);  // unused slots repeat product 0, never read
      const WeightBinding b = bind_weight(g.w[i]);
      codes.push_back(Arg::buf(b.data.buffer, b.data.exact_offset()));
      scales.push_back(Arg::buf(b.scales.buffer, b.scales.exact_offset()));
      biases.push_back(Arg::buf(b.biases.buffer, b.biases.exact_offset()));
      ys.push_back(arg(g.out[i]));
      shape.rows[j] = uint32_t(g.w[i].rows);
      if (j > 0) shape.start[j - 1] = groups;  // unused products: the total, which no threadgroup reaches
      if (j < l.size()) groups += uint32_t((g.w[i].rows + kRowsPerGroup - 1) / kRowsPerGroup);
    }
    std::vector<Arg> args;
    for (const auto* part : {&codes, &scales, &biases}) args.insert(args.end(), part->begin(), part->end());
    args.push_back(xa);
    args.insert(args.end(), ys.begin(), ys.end());
    args.push_back(Arg::value(shape));
    dispatch(first.scale_dtype == DType::BF16 ? "qmv4_multi_bf16" : "qmv4_multi_f16",
             {FunctionConstant::u32(0, uint32_t(first.group)), FunctionConstant::u32(4, uint32_t(first.cols))}, args,
             MTL::Size(groups, 1, 1), MTL::Size(64, 1, 1));
    ++counters_.qmv4_multi_dispatches;
    counters_.matmul_grouped_products += int64_t(l.size());
  }
  for (const std::vector<int>& l : rows) {
    MatmulMultiShape shape{uint32_t(x.rows), uint32_t(x.stride), {}, {}};
    std::vector<WeightBinding> bs;
    std::vector<Arg> ys;
    uint32_t groups = 0;
    for (size_t j = 0; j < 4; ++j) {
      const size_t i = size_t(l[j < l.size() ? j : 0]);  // unused slots repeat product 0, never read
      bs.push_back(bind_weight(g.w[i]));
      ys.push_back(arg(g.out[i]));
      shape.ldy[j] = uint32_t(g.out[i].stride);
      if (j > 0) shape.start[j - 1] = groups;
      if (j < l.size()) groups += uint32_t((g.w[i].rows + kRowsPerGroup - 1) / kRowsPerGroup);
    }
    std::vector<Arg> args;
    for (int part = 0; part < 3; ++part)
      for (const WeightBinding& b : bs) args.push_back(b.args()[size_t(part)]);
    for (const WeightBinding& b : bs) args.push_back(Arg::value(b.ref));
    args.push_back(xa);
    args.insert(args.end(), ys.begin(), ys.end());
    args.push_back(Arg::value(shape));
    dispatch("matmul_rows_multi", bs[0].constants, args, MTL::Size(groups, NS::UInteger(x.rows), 1), MTL::Size(64, 1, 1));
    ++counters_.matmul_rows_multi_dispatches;
    counters_.matmul_grouped_products += int64_t(l.size());
  }
  for (int i : alone) matmul_impl(x, g.w[size_t(i)], g.out[size_t(i)]);
}

void MetalOps::embed_impl(const Tensor& ids, const Weight& table, const Tensor& out) {
  const WeightBinding b = bind_weight(table);
  const MatmulShape s{uint32_t(out.rows), uint32_t(ids.stride), uint32_t(out.stride), 1};
  std::vector<Arg> args = {arg(ids)};
  for (const Arg& a : b.args()) args.push_back(a);
  args.push_back(Arg::value(b.ref));
  args.push_back(arg(out));
  args.push_back(Arg::value(s));
  dispatch("embed_rows", b.constants, args,
           MTL::Size(NS::UInteger((table.cols + 63) / 64), NS::UInteger(out.rows), 1), MTL::Size(64, 1, 1));
}

MoeWorkspace moe_workspace(int64_t T, int64_t k, int64_t E, int64_t I, int64_t H) {
  auto r16 = [](size_t n) { return (n + 15) / 16 * 16; };
  MoeWorkspace w;
  w.max_tiles = (T * k + kLaneTileRows - 1) / kLaneTileRows + E;
  w.offsets = 0;
  w.pair_of = w.offsets + r16(size_t(E + 1) * 4);
  w.position_of = w.pair_of + r16(size_t(T * k) * 4);
  w.tiles = w.position_of + r16(size_t(T * k) * 4);
  w.tile_count = w.tiles + r16(size_t(w.max_tiles) * 8);
  w.act = w.tile_count + 16;
  w.y = w.act + r16(size_t(T * k * I) * 4);
  w.bytes = w.y + r16(size_t(T * k * H) * 4);
  return w;
}

bool MetalOps::grouped_experts(int64_t T, int64_t E) const { return phase() == Phase::Prefill && T > 1 && E <= 1024; }

void MetalOps::moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights, const Weight& gate,
                                const Weight& up, const Weight& down, const Tensor& ws, const Tensor& out) {
  const int64_t T = x.rows;
  check_experts(ids, weights, gate, up);
  if (grouped_experts(T, gate.experts))
    return moe_experts_grouped(x, ids, weights, bind_weight(gate), bind_weight(up), bind_weight(down), gate.experts,
                               ws, out);
  moe_pairs_gate_up(x, ids, gate, up, ws);
  barrier_in_op();  // moe_down reads every act row
  moe_pairs_down(ids, weights, down, ws, out, nullptr, nullptr);
}

void MetalOps::check_experts(const Tensor& ids, const Tensor& weights, const Weight& gate, const Weight& up) const {
  const int64_t k = ids.cols;
  if (ids.stride != k || weights.stride != k) throw MetalError("metal moe_experts: ids and weights must be contiguous");
  if (format_code(gate) != format_code(up) || gate.group != up.group || gate.scale_dtype != up.scale_dtype)
    throw MetalError("metal moe_experts: gate and up projections differ in format");
}

// Stage 1 of the per-pair experts: act[t·k + s] = silu(gate_e(x_t)) ⊙ up_e(x_t) into the workspace.
void MetalOps::moe_pairs_gate_up(const Tensor& x, const Tensor& ids, const Weight& gate, const Weight& up,
                                 const Tensor& ws) {
  const int64_t T = x.rows, k = ids.cols, I = gate.rows;
  if (size_t(T * k * I) * 4 > ws.bytes()) throw std::logic_error("workspace too small for moe_experts");
  const WeightBinding g = bind_weight(gate), u = bind_weight(up);
  const MatmulShape s1{uint32_t(T), uint32_t(x.stride), uint32_t(I), uint32_t(k)};
  std::vector<Arg> a1 = g.args();
  a1.push_back(Arg::value(g.ref));
  for (const Arg& a : u.args()) a1.push_back(a);
  a1.push_back(Arg::value(u.ref));
  a1.push_back(arg(x));
  a1.push_back(arg(ids));
  a1.push_back(arg(ws));
  a1.push_back(Arg::value(s1));
  dispatch("moe_gate_up", g.constants, a1,
           MTL::Size(NS::UInteger((I + kRowsPerGroup - 1) / kRowsPerGroup), NS::UInteger(T * k), 1), MTL::Size(64, 1, 1));
}

// Stage 2: out[t] = Σ_s w[t, s] · down_e(act[t·k + s]), ascending expert id (moe_down). With `shared` and `sg`
// (moe_down_combine) `out` is the residual h instead: h += that sum + sigmoid(sg) · shared.
void MetalOps::moe_pairs_down(const Tensor& ids, const Tensor& weights, const Weight& down, const Tensor& ws,
                              const Tensor& out, const Tensor* shared, const Tensor* sg) {
  const int64_t T = ids.rows, k = ids.cols, I = down.cols, H = down.rows;
  const WeightBinding d = bind_weight(down);
  std::vector<Arg> a2 = d.args();
  a2.push_back(Arg::value(d.ref));
  a2.push_back(arg(ws));
  a2.push_back(arg(ids));
  a2.push_back(arg(weights));
  const MTL::Size grid(NS::UInteger((H + kRowsPerGroup - 1) / kRowsPerGroup), NS::UInteger(T), 1);
  // Arg::value keeps a pointer: both shapes live until the dispatch is encoded.
  const MatmulShape s2{uint32_t(T), uint32_t(I), uint32_t(out.stride), uint32_t(k)};
  const DownCombineShape sc{uint32_t(out.stride), uint32_t(shared ? shared->stride : 0), uint32_t(sg ? sg->stride : 0),
                            uint32_t(k)};
  if (!shared) {
    a2.push_back(arg(out));
    a2.push_back(Arg::value(s2));
    return dispatch("moe_down", d.constants, a2, grid, MTL::Size(64, 1, 1));
  }
  a2.push_back(arg(*shared));
  a2.push_back(arg(*sg));
  a2.push_back(arg(out));
  a2.push_back(Arg::value(sc));
  dispatch("moe_down_combine", d.constants, a2, grid, MTL::Size(64, 1, 1));
}

// Which tiles a prefill chunk's grouped experts take (one decision, used by the encoder and reported): the
// simdgroup-matrix GEMM with R = 16 or 32 rows (forced by set_moe_tile_rows / LILY_METAL_MOE_TILE_ROWS, else 32 from
// kRowsPerExpertFor32 rows per expert on average), unless LILY_METAL_MOE_MMA=0 or neither R's pipelines fit the
// device (threads, threadgroup memory): then the 8-row lane-dot tiles, with the reason.
MetalOps::MoeTiles MetalOps::choose_moe_tiles(int64_t T, int64_t k, int64_t E,
                                              const std::vector<FunctionConstant>& gate_constants,
                                              const std::vector<FunctionConstant>& down_constants) {
  MoeTiles c;
  if (!moe_mma_) {
    c.reason = "LILY_METAL_MOE_MMA=0";
    return c;
  }
  const int64_t wanted = moe_tile_rows_ ? moe_tile_rows_ : T * k >= kRowsPerExpertFor32 * E ? 32 : 16;
  const size_t limit = dev_.device()->maxThreadgroupMemoryLength();
  std::string why;
  for (int64_t R : {wanted, wanted == 32 ? int64_t(16) : int64_t(32)}) {
    if (moe_tile_rows_ && R != moe_tile_rows_) break;  // a forced R has no second choice
    bool fits = true;
    for (int weights : {2, 1}) {  // gate/up stages two weight blocks, down one
      const std::string name = std::string(weights == 2 ? "moe_gate_up_mma_r" : "moe_down_mma_r") + std::to_string(R);
      // Must match the threadgroup arrays of moe_gate_up_mma / moe_down_mma (metal/matmul.metal): xs [R, BK],
      // one [BK, BN] block per weight, xrow [R], all 4-byte. Checked before the pipeline is built: a device refuses
      // to build a pipeline over its threadgroup memory.
      const size_t bytes = size_t(R) * kMmaColumns * 4 + size_t(weights) * kMmaColumns * kMmaColumns * 4 + size_t(R) * 4;
      const size_t threads = size_t(R / 8 * 32);
      std::string miss;
      if (bytes > limit)
        miss = "needs " + std::to_string(bytes) + " bytes of threadgroup memory, the device allows " + std::to_string(limit);
      else if (const size_t t = dev_.pipeline(name, weights == 2 ? gate_constants : down_constants)
                                    ->maxTotalThreadsPerThreadgroup();
               threads > t)
        miss = "needs " + std::to_string(threads) + " threads, the pipeline allows " + std::to_string(t);
      if (!miss.empty()) fits = false, why += (why.empty() ? "" : "; ") + name + " " + miss;
    }
    if (fits) {
      c.rows = R;
      c.mma = true;
      c.reason = R == wanted ? "" : why;  // the other R fitted where the chosen one did not
      return c;
    }
  }
  c.reason = why;
  return c;
}

// Prefill: group the (token, slot) pairs by expert on the GPU (moe_group), then per tile of R rows of one expert the
// grouped GEMM (moe_gate_up_mma / moe_down_mma, simdgroup matrices over dequantized blocks in threadgroup memory),
// or the 8-row lane-dot tiles (each weight word dequantized once per tile), then the per-token sums in ascending
// expert id (metal/matmul.metal).
void MetalOps::moe_experts_grouped(const Tensor& x, const Tensor& ids, const Tensor& weights, const WeightBinding& g,
                                   const WeightBinding& u, const WeightBinding& d, int64_t E, const Tensor& ws,
                                   const Tensor& out) {
  const int64_t T = x.rows, k = ids.cols, I = g.ref.N, H = x.cols;
  const MoeWorkspace w = moe_workspace(T, k, E, I, H);
  if (w.bytes > ws.bytes()) throw std::logic_error("workspace too small for moe_experts (grouped)");
  const MoeTiles tiles = choose_moe_tiles(T, k, E, g.constants, d.constants);
  const int64_t R = tiles.mma ? tiles.rows : kLaneTileRows;
  // Tiles: Σ_e ⌈c_e / R⌉ ≤ ⌈T·k / R⌉ + E, and never more than the T·k rows; the threadgroups past tile_count return.
  const int64_t grid_tiles = std::min((T * k + R - 1) / R + E, T * k);
  ++(tiles.mma ? (R == 16 ? counters_.moe_mma16_calls : counters_.moe_mma32_calls) : counters_.moe_lane_tile_calls);
  counters_.moe_tiles_last_rows_per_expert = double(T * k) / double(E);
  counters_.moe_tiles_last_reason = tiles.reason;
  if (!tiles.reason.empty()) counters_.moe_tiles_reason = tiles.reason;
  const Arg base = arg(ws);
  auto at = [&](size_t off) { return Arg::buf(base.buffer, base.offset + off); };
  const GroupShape gs{uint32_t(T), uint32_t(k), uint32_t(E), uint32_t(w.max_tiles), uint32_t(R)};
  const int64_t threads = (E + 31) / 32 * 32;
  dispatch("moe_group", {},
           {arg(ids), at(w.offsets), at(w.pair_of), at(w.position_of), at(w.tiles), at(w.tile_count), Arg::value(gs)},
           MTL::Size(1, 1, 1), MTL::Size(NS::UInteger(threads), 1, 1), {size_t(2 * (E + 1)) * 4});
  barrier_in_op();
  const int64_t cols = tiles.mma ? kMmaColumns : kRowsPerGroup;  // output columns per threadgroup
  const MTL::Size tg_threads(NS::UInteger(tiles.mma ? R / 8 * 32 : 64), 1, 1);
  const std::string suffix = tiles.mma ? "_mma_r" + std::to_string(R) : "_tiles";
  const MatmulShape s1{uint32_t(T), uint32_t(x.stride), uint32_t(I), uint32_t(k)};
  std::vector<Arg> a1 = g.args();
  a1.push_back(Arg::value(g.ref));
  for (const Arg& a : u.args()) a1.push_back(a);
  a1.push_back(Arg::value(u.ref));
  for (const Arg& a : {arg(x), at(w.offsets), at(w.pair_of), at(w.tiles), at(w.tile_count), at(w.act)}) a1.push_back(a);
  a1.push_back(Arg::value(s1));
  dispatch("moe_gate_up" + suffix, g.constants, a1,
           MTL::Size(NS::UInteger((I + cols - 1) / cols), NS::UInteger(grid_tiles), 1), tg_threads);
  barrier_in_op();
  std::vector<Arg> a2 = d.args();
  a2.push_back(Arg::value(d.ref));
  for (const Arg& a : {at(w.act), at(w.offsets), at(w.tiles), at(w.tile_count), at(w.y)}) a2.push_back(a);
  dispatch("moe_down" + suffix, d.constants, a2,
           MTL::Size(NS::UInteger((H + cols - 1) / cols), NS::UInteger(grid_tiles), 1), tg_threads);
  barrier_in_op();
  const MatmulShape s3{uint32_t(T), 0, uint32_t(out.stride), uint32_t(k)};
  const uint32_t h32 = uint32_t(H);
  dispatch("moe_gather_sum", {},
           {at(w.y), arg(ids), arg(weights), at(w.position_of), arg(out), Arg::value(s3), Arg::value(h32)},
           MTL::Size(NS::UInteger((H + 63) / 64), NS::UInteger(T), 1), MTL::Size(64, 1, 1));
}

std::string MetalOps::matmul_variant(const Weight& w, Phase phase) const {
  const std::string fmt = w.describe();
  if (phase == Phase::Decode && qmv4_takes(w))  // a decode row's x is 16-byte aligned
    return std::string(w.scale_dtype == DType::BF16 ? "qmv4_bf16" : "qmv4_f16") + " (" + fmt +
           (w.data % 4 || w.scales % 2 || w.biases % 2 ? ", misaligned in the checkpoint: copied at load" : "") + ")";
  return "matmul_rows (" + fmt + ")";
}

}  // namespace lily::metal
