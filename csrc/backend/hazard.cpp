#include "backend/hazard.h"

#include <stdexcept>
#include <string>

namespace lily {

const char* op_name(OpKind k) {
  static const char* names[kOpKinds] = {
      "embed",        "rms_norm",     "matmul",      "add",         "attn_qk_prep", "kv_append",
      "attn_decode",  "attn_prefill", "conv1d_silu", "gated_delta", "gated_rms_norm", "moe_route",
      "moe_experts",  "swiglu",       "moe_combine", "copy",        "fill",         "advance_position",
      "sample",       "add_rms_norm", "matmuls",     "moe",         "norm_matmuls", "conv_delta_norm", "accept_drafts", "copy_rows_at",
      "mtp_input",    "attn_qk_prep_append"};
  return size_t(k) < kOpKinds ? names[size_t(k)] : "?";
}

void HazardTracker::begin() {
  ++stage_;  // nothing recorded before begin() can conflict with the new step's first stage
  stats_ = StepStats{};
}

void HazardTracker::ensure(int32_t n) {
  if (n > int32_t(read_in_.size())) {
    read_in_.resize(size_t(n), 0);
    written_in_.resize(size_t(n), 0);
  }
}

bool HazardTracker::record(OpKind op, std::initializer_list<int32_t> reads, std::initializer_list<int32_t> writes) {
  auto check = [&](int32_t b) {
    if (b < 0 || b >= int32_t(read_in_.size()))
      throw std::logic_error(std::string(op_name(op)) + ": buffer " + std::to_string(b) + " is not allocated");
  };
  bool hazard = stats_.stages == 0;
  for (int32_t r : reads) {
    check(r);
    hazard = hazard || written_in_[size_t(r)] == stage_;
  }
  for (int32_t w : writes) {
    check(w);
    hazard = hazard || written_in_[size_t(w)] == stage_ || read_in_[size_t(w)] == stage_;
  }
  if (hazard) {
    ++stats_.stages;
    ++stage_;
  }
  for (int32_t r : reads) read_in_[size_t(r)] = stage_;
  for (int32_t w : writes) written_in_[size_t(w)] = stage_;
  ++stats_.ops;
  ++stats_.op_counts[size_t(op)];
  return hazard;
}

}  // namespace lily
