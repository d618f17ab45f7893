// A fixed pool of worker threads for the CPU backend's data-parallel loops.
// parallel_for splits [0, n) into one contiguous range per thread. Ranges are claimed dynamically: the
// calling thread works too and takes over any range a descheduled worker has not started, so a busy
// machine slows a loop down instead of stalling it. Each index is processed by exactly one thread.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lily::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }
  // fn(begin, end, thread_index) over [0, n) split into at most size() ranges aligned to `grain`;
  // thread_index is unique among concurrently running calls (0 = the caller), for per-thread scratch.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  void worker_loop(int index);
  // Claims the next range of the job published under `gen`; false when none is left or the job is over.
  bool claim(uint64_t gen, int64_t& range);
  void run_range(int64_t range, int thread_index);

  std::vector<std::thread> workers_;
  // (generation << 32) | next range index: claims of a finished job can never touch the next one.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<const std::function<void(int64_t, int64_t, int)>*> job_{nullptr};
  std::atomic<int64_t> job_n_{0}, job_chunk_{0}, job_ranges_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::mutex run_mu_;  // one parallel_for at a time (sessions on different threads share the pool)
};

}  // namespace lily::cpu
