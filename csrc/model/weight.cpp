#include "model/weight.h"

#include <cmath>
#include <cstring>

#include "model/config.h"
#include <stdexcept>
#include <string>

namespace lily {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
  }
  return "?";
}

std::string WeightView::describe() const {
  if (quantized()) return "q" + std::to_string(bits) + "g" + std::to_string(group);
  return dtype_name(dtype);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000 | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void ModelConfig::validate() const {
  auto need = [](bool ok, const char* field) {
    if (!ok) throw std::invalid_argument(std::string("invalid model config field '") + field + "'");
  };
  need(hidden > 0, "hidden_size");
  need(layers > 0, "num_hidden_layers");
  need(vocab > 0, "vocab_size");
  need(int64_t(full_attention.size()) == layers, "layer_types");
  need(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "num_key_value_heads");
  need(head_dim > 0, "head_dim");
  need(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0, "partial_rotary_factor");
  need(lin_k_heads > 0 && lin_v_heads > 0 && lin_v_heads % lin_k_heads == 0, "linear_num_value_heads");
  need(lin_k_dim > 0 && lin_v_dim > 0, "linear_key_head_dim");
  need(conv_kernel >= 1 && conv_kernel <= 16, "linear_conv_kernel_dim");
  need(experts > 0 && topk > 0 && topk <= experts, "num_experts_per_tok");
  need(moe_inter > 0 && shared_inter > 0, "moe_intermediate_size");
  need(eps > 0, "rms_norm_eps");
}

}  // namespace lily
