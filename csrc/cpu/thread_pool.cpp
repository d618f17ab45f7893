#include "cpu/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax() { asm volatile("yield"); }
#else
static inline void cpu_relax() {}
#endif

namespace lily::cpu {

namespace {
constexpr auto kSpin = std::chrono::microseconds(200);
}

ThreadPool::ThreadPool(int threads) {
  threads = std::max(1, threads);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_acquire)) {
      cpu_relax();
      if (++spins % 64 == 0 && std::chrono::steady_clock::now() - t0 > kSpin) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_start_.wait(lk, [&] { return stop_.load() || generation_.load() != seen; });
        break;
      }
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    const int64_t n = job_n_, chunk = job_chunk_;
    const int64_t b = int64_t(index) * chunk, e = std::min(n, b + chunk);
    if (b < e) (*job_)(b, e, index);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t units = (n + grain - 1) / grain;
  const int use = int(std::min<int64_t>(size(), units));
  if (use <= 1) {
    fn(0, n, 0);
    return;
  }
  std::lock_guard<std::mutex> run(run_mu_);
  const int64_t chunk = ((units + use - 1) / use) * grain;
  job_ = &fn;
  job_n_ = n;
  job_chunk_ = chunk;
  pending_.store(int(workers_.size()), std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(mu_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  cv_start_.notify_all();
  fn(0, std::min(n, chunk), 0);
  auto t0 = std::chrono::steady_clock::now();
  int spins = 0;
  while (pending_.load(std::memory_order_acquire) != 0) {
    cpu_relax();
    if (++spins % 64 == 0 && std::chrono::steady_clock::now() - t0 > kSpin) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_done_.wait(lk, [&] { return pending_.load() == 0; });
      break;
    }
  }
  job_ = nullptr;
}

}  // namespace lily::cpu
