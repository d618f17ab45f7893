// A fixed pool of worker threads for the CPU backend's data-parallel loops.
// parallel_for splits [0, n) into contiguous ranges, one per thread, and blocks until all are done;
// the calling thread takes the first range, so a pool of 1 runs inline with no synchronisation.
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
  // fn(begin, end, thread_index) over [0, n) split into at most size() ranges aligned to `grain`.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  void worker_loop(int index);
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0, job_chunk_ = 0;
  // Workers spin briefly on these before sleeping: a decode step issues hundreds of short loops, and a
  // condition-variable wake-up per loop would cost more than many of them take.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex run_mu_;  // one parallel_for at a time (sessions on different threads share the pool)
};

}  // namespace lily::cpu
