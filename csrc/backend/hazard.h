// Turns each op's declared reads and writes into barrier-separated stages.
// Ops inside one stage touch no buffer that another op of the same stage writes, so a backend may run
// them concurrently (a Metal concurrent pass, CUDA graph branches); a barrier is needed only before an
// op that reads what the stage wrote (RAW), writes what it read (WAR) or writes what it wrote (WAW).
// Recording allocates nothing: each buffer carries the number of the stage that last read or wrote it.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace lily {

enum class OpKind : uint8_t {
  Embed, RmsNorm, Matmul, Add, AttnQkPrep, KvAppend, AttnDecode, AttnPrefill, Conv1dSilu, GatedDelta,
  GatedRmsNorm, MoeRoute, MoeExperts, Swiglu, MoeCombine, Copy, Fill, AdvancePosition, Sample, AddRmsNorm,
  Matmuls, Moe, NormMatmuls, ConvDeltaNorm, AcceptDrafts, CopyRowsAt, MtpInput, AttnQkPrepAppend, Count
};
constexpr size_t kOpKinds = size_t(OpKind::Count);
const char* op_name(OpKind k);

struct StepStats {
  int64_t ops = 0;
  int64_t stages = 0;
  std::array<int64_t, kOpKinds> op_counts{};  // per op kind
};

class HazardTracker {
 public:
  void begin();
  // Makes room for buffer ids below n (called when a buffer is allocated, outside steps).
  void ensure(int32_t n);
  // Returns true when this op starts a new stage (a backend inserts its barrier there).
  bool record(OpKind op, std::initializer_list<int32_t> reads, std::initializer_list<int32_t> writes);
  const StepStats& stats() const { return stats_; }
  // The stage (1-based) of the op recorded last.
  int64_t stage() const { return stats_.stages; }

 private:
  // Stage numbers are global and only grow, so starting a stage clears nothing.
  std::vector<uint64_t> read_in_, written_in_;
  uint64_t stage_ = 0;
  StepStats stats_;
};

}  // namespace lily
