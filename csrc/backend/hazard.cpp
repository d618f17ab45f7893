#include "backend/hazard.h"

#include <algorithm>

namespace lily {

void HazardTracker::begin() {
  stage_reads_.clear();
  stage_writes_.clear();
  stats_ = StepStats{};
}

bool HazardTracker::contains(const std::vector<int32_t>& set, int32_t b) {
  return std::find(set.begin(), set.end(), b) != set.end();
}

bool HazardTracker::record(const char* op, const std::vector<int32_t>& reads,
                           const std::vector<int32_t>& writes) {
  bool hazard = stats_.stages == 0;
  for (int32_t r : reads) hazard = hazard || contains(stage_writes_, r);
  for (int32_t w : writes) hazard = hazard || contains(stage_writes_, w) || contains(stage_reads_, w);
  if (hazard) {
    ++stats_.stages;
    stage_reads_.clear();
    stage_writes_.clear();
  }
  stage_reads_.insert(stage_reads_.end(), reads.begin(), reads.end());
  stage_writes_.insert(stage_writes_.end(), writes.begin(), writes.end());
  ++stats_.ops;
  ++stats_.op_counts[op];
  return hazard;
}

}  // namespace lily
