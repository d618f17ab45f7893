// A fixed pool of worker threads for the CPU backend's data-parallel loops.
// parallel_for splits [0, n) into one contiguous range per thread. Ranges are claimed dynamically: the
// calling thread works too and takes over any range a descheduled worker has not started, so a busy
// machine slows a loop down instead of stalling it. Each index is processed by exactly one thread.
// A call allocates nothing: the body is passed by a non-owning reference (it lives on the caller's stack,
// which outlives the job because the caller waits for every range).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpu/alloc_guard.h"

namespace lily::cpu {

class ThreadPool {
 public:
  // Throws std::runtime_error("cannot start thread K of N for the CPU backend: ...") when the OS refuses a
  // thread (K = its thread_index); the workers already started are stopped and joined first.
  explicit ThreadPool(int threads);
  // Test hook: as above, but starting worker `refuse_at` fails the way the OS fails it (EAGAIN), so the
  // unwinding path can be exercised where RLIMIT_NPROC does not apply (root).
  ThreadPool(int threads, int refuse_at);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }
  // fn(begin, end, thread_index) over [0, n) split into at most size() ranges aligned to `grain`;
  // thread_index is unique among concurrently running calls (0 = the caller), for per-thread scratch.
  // If fn throws (on any thread), ranges already started finish, ranges not yet started are skipped, and
  // the first exception is rethrown here once no thread runs fn any more; the pool stays usable.
  template <class F>
  void parallel_for(int64_t n, int64_t grain, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run({&call<Fn>, const_cast<void*>(static_cast<const void*>(std::addressof(fn)))}, n, grain);
  }

 private:
  struct Body {
    void (*call)(void*, int64_t, int64_t, int);
    void* fn;
  };
  template <class Fn>
  static void call(void* fn, int64_t b, int64_t e, int t) {
    (*static_cast<Fn*>(fn))(b, e, t);
  }

  void start(int threads, int refuse_at);
  void shutdown();
  void run(Body body, int64_t n, int64_t grain);
  void worker_loop(int index);
  // Claims the next range of the job published under `gen`; false when none is left or the job is over.
  bool claim(uint64_t gen, int64_t& range);
  void run_range(int64_t range, int thread_index);

  std::vector<std::thread> workers_;
  // (generation << 32) | next range index: claims of a finished job can never touch the next one.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<void (*)(void*, int64_t, int64_t, int)> job_call_{nullptr};
  std::atomic<void*> job_fn_{nullptr};
  // The caller's allocation-guard scope (or null): workers count into it while they run the job.
  std::atomic<detail::AllocGuardState*> job_guard_{nullptr};
  std::atomic<int64_t> job_n_{0}, job_chunk_{0}, job_ranges_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> failed_{false};  // set by the first throwing range; later ranges are skipped
  std::exception_ptr error_;         // written once by that range, read by the caller after done_
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::mutex run_mu_;  // one parallel_for at a time (sessions on different threads share the pool)
};

}  // namespace lily::cpu
