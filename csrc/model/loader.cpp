#include "model/loader.h"

#include <cstring>
#include <stdexcept>
#include <tuple>

namespace lily {

namespace {

class Loader {
 public:
  Loader(Qwen36& model, WeightSource& src, LoadInfo& info) : ops_(model.ops()), src_(src), info_(info) {}

  void add_region(const MappedRegion& r) {
    regions_.push_back({r.base, r.bytes, ops_.register_mapping(r.base, r.bytes, r.label)});
    ++info_.mappings;
  }

  // The mapping holding [p, p + n) and p's offset in it; an array outside every file (one Python made)
  // becomes a mapping of its own (the engine keeps the Python object alive).
  std::pair<int32_t, uint64_t> locate(const void* p, size_t n, const std::string& name) {
    const char* c = static_cast<const char*>(p);
    for (const Region& r : regions_) {
      const char* b = static_cast<const char*>(r.base);
      if (c >= b && c + n <= b + r.bytes) return {r.id, uint64_t(c - b)};
    }
    add_region({p, n, name});
    return {regions_.back().id, 0};
  }

  Weight place(const HostMatrix& h, const std::string& name) {
    Weight w;
    static_cast<WeightFormat&>(w) = h.fmt;
    std::tie(w.mapping, w.data) = locate(h.data, h.fmt.row_bytes() * size_t(h.fmt.rows), name);
    if (h.fmt.quantized()) {
      std::tie(w.scale_mapping, w.scales) = locate(h.scales, h.fmt.scale_bytes(), name + ".scales");
      std::tie(w.bias_mapping, w.biases) = locate(h.biases, h.fmt.scale_bytes(), name + ".biases");
    }
    return w;
  }

  // While set, bytes and repacks count as the MTP block's (LoadInfo::mtp_*), not the decoder's.
  void count_as_mtp(bool on) { mtp_ = on; }

  Weight mat(const std::string& name, int64_t rows, int64_t cols, const char* component) {
    Weight w = place(src_.matrix(name, rows, cols), name);
    bytes(component) += w.bytes();
    return w;
  }

  Tensor vec(const std::string& name, int64_t rows, int64_t cols) {
    const float* p = src_.vector(name, rows * cols);
    Tensor t = ops_.alloc(name, DType::F32, rows, cols);
    ops_.upload(t, p);
    return t;
  }

  // Experts e = 0..E-1 of one projection as one stacked weight.
  Weight experts(const std::string& prefix, const char* proj, int64_t E, int64_t rows, int64_t cols) {
    std::vector<HostMatrix> hs;
    hs.reserve(size_t(E));
    for (int64_t e = 0; e < E; ++e) {
      const std::string name = prefix + std::to_string(e) + "." + proj;
      hs.push_back(src_.matrix(name, rows, cols));
      if (hs.back().fmt.describe() != hs[0].fmt.describe() || hs.back().fmt.scale_dtype != hs[0].fmt.scale_dtype)
        throw std::invalid_argument("tensor '" + name + "' is stored as " + hs.back().fmt.describe() +
                                    " but expert 0 of this projection as " + hs[0].fmt.describe());
    }
    const WeightFormat& f = hs[0].fmt;
    const std::string label = prefix + "*." + proj;
    bytes("experts") += f.bytes() * size_t(E);
    auto stride_of = [&](const void* HostMatrix::*part, int64_t& stride) {
      if (E < 2) return (stride = 0, true);
      auto at = [&](int64_t e) { return static_cast<const char*>(hs[size_t(e)].*part); };
      stride = at(1) - at(0);
      for (int64_t e = 2; e < E; ++e)
        if (at(e) - at(e - 1) != stride) return false;
      return stride >= 0;
    };
    int64_t ds = 0, ss = 0, bs = 0;
    bool uniform = stride_of(&HostMatrix::data, ds);
    if (f.quantized()) uniform = uniform && stride_of(&HostMatrix::scales, ss) && stride_of(&HostMatrix::biases, bs);
    if (uniform) {
      // One region from the first expert's start to the last one's end must lie in one mapping.
      Weight w;
      static_cast<WeightFormat&>(w) = f;
      const size_t span = size_t(ds) * size_t(E - 1) + f.row_bytes() * size_t(rows);
      std::tie(w.mapping, w.data) = locate(hs[0].data, span, label);
      if (f.quantized()) {
        std::tie(w.scale_mapping, w.scales) = locate(hs[0].scales, size_t(ss) * size_t(E - 1) + f.scale_bytes(), label);
        std::tie(w.bias_mapping, w.biases) = locate(hs[0].biases, size_t(bs) * size_t(E - 1) + f.scale_bytes(), label);
      }
      w.experts = E;
      w.data_stride = uint64_t(ds);
      w.scale_stride = uint64_t(ss);
      w.bias_stride = uint64_t(bs);
      return w;
    }
    // Repack: [E][codes] then [E][scales] then [E][biases], each expert's part contiguous.
    const size_t db = f.row_bytes() * size_t(rows), sb = f.scale_bytes();
    const size_t total = (db + 2 * sb) * size_t(E);
    std::unique_ptr<uint8_t[]> buf(new uint8_t[total]);
    for (int64_t e = 0; e < E; ++e) {
      std::memcpy(buf.get() + size_t(e) * db, hs[size_t(e)].data, db);
      if (f.quantized()) {
        std::memcpy(buf.get() + size_t(E) * db + size_t(e) * sb, hs[size_t(e)].scales, sb);
        std::memcpy(buf.get() + size_t(E) * (db + sb) + size_t(e) * sb, hs[size_t(e)].biases, sb);
      }
    }
    add_region({buf.get(), total, label + " (repacked)"});
    Weight w;
    static_cast<WeightFormat&>(w) = f;
    w.mapping = w.scale_mapping = w.bias_mapping = regions_.back().id;
    w.data = 0;
    w.scales = size_t(E) * db;
    w.biases = size_t(E) * (db + sb);
    w.experts = E;
    w.data_stride = db;
    w.scale_stride = w.bias_stride = sb;
    ++(mtp_ ? info_.mtp_repacked_projections : info_.repacked_projections);
    (mtp_ ? info_.mtp_repacked_bytes : info_.repacked_bytes) += total;
    info_.owned.push_back(std::move(buf));
    return w;
  }

 private:
  size_t& bytes(const char* component) { return mtp_ ? info_.mtp_bytes : info_.weight_bytes[component]; }

  struct Region {
    const void* base;
    size_t bytes;
    int32_t id;
  };
  Ops& ops_;
  WeightSource& src_;
  LoadInfo& info_;
  std::vector<Region> regions_;
  bool mtp_ = false;
};

// One decoder layer (MODEL.md section 2) under canonical prefix `p` ("layers.3.", "mtp.layers.0.").
LayerWeights load_layer(Loader& ld, const ModelConfig& c, const std::string& p, bool full) {
  LayerWeights L;
  const int64_t QD = c.heads * c.head_dim, KD = c.kv_heads * c.head_dim, VD = c.value_dim();
  L.full = full;
  L.input_norm = ld.vec(p + "input_norm", 1, c.hidden);
  L.post_norm = ld.vec(p + "post_norm", 1, c.hidden);
  if (L.full) {
    L.q = ld.mat(p + "attn.q", 2 * QD, c.hidden, "attention");
    L.k = ld.mat(p + "attn.k", KD, c.hidden, "attention");
    L.v = ld.mat(p + "attn.v", KD, c.hidden, "attention");
    L.o = ld.mat(p + "attn.o", c.hidden, QD, "attention");
    L.q_norm = ld.vec(p + "attn.q_norm", 1, c.head_dim);
    L.k_norm = ld.vec(p + "attn.k_norm", 1, c.head_dim);
  } else {
    L.qkv = ld.mat(p + "delta.qkv", c.conv_dim(), c.hidden, "deltanet");
    L.z = ld.mat(p + "delta.z", VD, c.hidden, "deltanet");
    L.b = ld.mat(p + "delta.b", c.lin_v_heads, c.hidden, "deltanet");
    L.a = ld.mat(p + "delta.a", c.lin_v_heads, c.hidden, "deltanet");
    L.out = ld.mat(p + "delta.out", c.hidden, VD, "deltanet");
    L.conv = ld.vec(p + "delta.conv", c.conv_dim(), c.conv_kernel);
    L.A_log = ld.vec(p + "delta.A_log", 1, c.lin_v_heads);
    L.dt_bias = ld.vec(p + "delta.dt_bias", 1, c.lin_v_heads);
    L.delta_norm = ld.vec(p + "delta.norm", 1, c.lin_v_dim);
  }
  L.router = ld.mat(p + "moe.router", c.experts, c.hidden, "router");
  L.shared_gate = ld.mat(p + "moe.shared_gate", 1, c.hidden, "router");
  L.shared_gate_proj = ld.mat(p + "moe.shared.gate", c.shared_inter, c.hidden, "shared_expert");
  L.shared_up = ld.mat(p + "moe.shared.up", c.shared_inter, c.hidden, "shared_expert");
  L.shared_down = ld.mat(p + "moe.shared.down", c.hidden, c.shared_inter, "shared_expert");
  const std::string e = p + "moe.experts.";
  L.experts_gate = ld.experts(e, "gate", c.experts, c.moe_inter, c.hidden);
  L.experts_up = ld.experts(e, "up", c.experts, c.moe_inter, c.hidden);
  L.experts_down = ld.experts(e, "down", c.experts, c.hidden, c.moe_inter);
  return L;
}

// The MTP block (MODEL.md section 7): fc, its two input norms, the decoder layers and the output norm.
MtpWeights load_mtp(Loader& ld, const ModelConfig& c) {
  MtpWeights M;
  ld.count_as_mtp(true);
  M.fc = ld.mat("mtp.fc", c.hidden, 2 * c.hidden, "mtp");
  M.pre_fc_norm_embedding = ld.vec("mtp.pre_fc_norm_embedding", 1, c.hidden);
  M.pre_fc_norm_hidden = ld.vec("mtp.pre_fc_norm_hidden", 1, c.hidden);
  for (int64_t j = 0; j < c.mtp_layers; ++j)
    M.layers.push_back(load_layer(ld, c, "mtp.layers." + std::to_string(j) + ".", true));
  M.norm = ld.vec("mtp.norm", 1, c.hidden);
  ld.count_as_mtp(false);
  return M;
}

}  // namespace

LoadInfo load_weights(Qwen36& model, WeightSource& src, const std::vector<MappedRegion>& files) {
  LoadInfo info;
  Loader ld(model, src, info);
  for (const MappedRegion& f : files) ld.add_region(f);
  const ModelConfig& c = model.config();
  ModelWeights& W = model.weights();
  W.embed = ld.mat("embed", c.vocab, c.hidden, "embed_tokens");
  W.lm_head = ld.mat("lm_head", c.vocab, c.hidden, "lm_head");
  W.tied = W.lm_head.mapping == W.embed.mapping && W.lm_head.data == W.embed.data;
  if (W.tied) info.weight_bytes["lm_head"] -= W.lm_head.bytes();
  W.final_norm = ld.vec("final_norm", 1, c.hidden);
  W.layers.reserve(size_t(c.layers));
  for (int64_t i = 0; i < c.layers; ++i)
    W.layers.push_back(load_layer(ld, c, "layers." + std::to_string(i) + ".", c.full_attention[size_t(i)]));
  if (c.mtp_layers > 0) W.mtp = load_mtp(ld, c);
  std::vector<Weight*> all = {&W.embed, &W.lm_head};
  auto add_layer = [&all](LayerWeights& L) {
    for (Weight* w : {&L.qkv, &L.z, &L.b, &L.a, &L.out, &L.q, &L.k, &L.v, &L.o, &L.router, &L.shared_gate,
                      &L.shared_gate_proj, &L.shared_up, &L.shared_down, &L.experts_gate, &L.experts_up,
                      &L.experts_down})
      if (w->valid()) all.push_back(w);
  };
  for (LayerWeights& L : W.layers) add_layer(L);
  // The MTP block (read by every forward's encode_mtp_rows and by drafting); it has no lm_head of its own:
  // the graph hands it W.lm_head, so a GPU backend places the head once.
  if (W.mtp) {
    all.push_back(&W.mtp->fc);
    for (LayerWeights& L : W.mtp->layers) add_layer(L);
  }
  model.ops().place_weights(all);
  return info;
}

}  // namespace lily
