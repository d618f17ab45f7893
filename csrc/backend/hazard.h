// Turns each op's declared reads and writes into barrier-separated stages.
// Ops inside one stage touch no buffer that another op of the same stage writes, so a backend may run
// them concurrently (a Metal concurrent pass, CUDA graph branches); a barrier is needed only before an
// op that reads what the stage wrote (RAW), writes what it read (WAR) or writes what it wrote (WAW).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace lily {

struct StepStats {
  int64_t ops = 0;
  int64_t stages = 0;
  std::map<std::string, int64_t> op_counts;  // per op name
};

class HazardTracker {
 public:
  void begin();
  // Returns true when this op starts a new stage (a backend inserts its barrier there).
  bool record(const char* op, const std::vector<int32_t>& reads, const std::vector<int32_t>& writes);
  const StepStats& stats() const { return stats_; }

 private:
  static bool contains(const std::vector<int32_t>& set, int32_t b);
  std::vector<int32_t> stage_reads_, stage_writes_;
  StepStats stats_;
};

}  // namespace lily
