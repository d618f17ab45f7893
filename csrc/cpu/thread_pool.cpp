#include "cpu/thread_pool.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

namespace lily::cpu {

namespace {
constexpr uint64_t kPublishing = 0xffffffffu;  // ticket index while a new job's fields are being written
// Workers poll for new work this long before sleeping: a decode step issues hundreds of short loops and
// a futex wake-up per loop would cost more than many of them take. Polling yields the core, so on a
// loaded machine the other threads still run.
constexpr auto kPoll = std::chrono::microseconds(100);
}  // namespace

ThreadPool::ThreadPool(int threads) { start(threads, 0); }
ThreadPool::ThreadPool(int threads, int refuse_at) { start(threads, refuse_at); }

void ThreadPool::start(int threads, int refuse_at) {
  threads = std::max(1, threads);
  workers_.reserve(size_t(threads - 1));  // emplace_back below then never reallocates
  for (int i = 1; i < threads; ++i) {
    try {
      if (i == refuse_at) throw std::system_error(EAGAIN, std::generic_category());
      workers_.emplace_back([this, i] { worker_loop(i); });
    } catch (const std::exception& e) {
      // A joinable std::thread destroyed during unwinding would call std::terminate: stop the started
      // workers first, then report which thread the OS refused (typically RLIMIT_NPROC / ulimit -u).
      shutdown();
      throw std::runtime_error("cannot start thread " + std::to_string(i) + " of " + std::to_string(threads) +
                               " for the CPU backend: " + e.what());
    }
  }
}

ThreadPool::~ThreadPool() { shutdown(); }

void ThreadPool::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

bool ThreadPool::claim(uint64_t gen, int64_t& range) {
  uint64_t v = ticket_.load(std::memory_order_acquire);
  for (;;) {
    if ((v >> 32) != gen) return false;
    const int64_t next = int64_t(v & 0xffffffffu);
    if (next >= job_ranges_.load(std::memory_order_acquire)) return false;
    if (ticket_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      range = next;
      return true;
    }
  }
}

void ThreadPool::run_range(int64_t range, int thread_index) {
  const int64_t n = job_n_.load(std::memory_order_acquire), chunk = job_chunk_.load(std::memory_order_acquire);
  const int64_t b = range * chunk, e = std::min(n, b + chunk);
  if (b < e && !failed_.load(std::memory_order_acquire)) {
    // Caught on every thread: an exception escaping a worker would terminate the process, and one
    // leaving the caller early would free the body's frame while workers still run it.
    try {
      job_call_.load(std::memory_order_acquire)(job_fn_.load(std::memory_order_acquire), b, e, thread_index);
    } catch (...) {
      if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
    }
  }
  done_.fetch_add(1, std::memory_order_acq_rel);
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    uint64_t gen;
    for (int spins = 0;; ++spins) {
      if (stop_.load(std::memory_order_acquire)) return;
      const uint64_t v = ticket_.load(std::memory_order_acquire);
      gen = v >> 32;
      if (gen != seen && (v & 0xffffffffu) != kPublishing) break;
      if (spins % 16 == 15) {
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() - t0 > kPoll) {
          std::unique_lock<std::mutex> lk(mu_);
          sleepers_.fetch_add(1);
          cv_.wait(lk, [&] {
            const uint64_t v = ticket_.load();
            return stop_.load() || ((v >> 32) != seen && (v & 0xffffffffu) != kPublishing);
          });
          sleepers_.fetch_sub(1);
          t0 = std::chrono::steady_clock::now();
        }
      }
    }
    seen = gen;
    int64_t range;
    if (!claim(gen, range)) continue;
    // Claimed, so the job's fields (published before its ticket) are this job's until our ranges finish.
    detail::AllocGuardAdopt guard(job_guard_.load(std::memory_order_acquire));
    do run_range(range, index);
    while (claim(gen, range));
  }
}

void ThreadPool::run(Body body, int64_t n, int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t units = (n + grain - 1) / grain;
  const int use = int(std::min<int64_t>(size(), units));
  if (use <= 1) {
    body.call(body.fn, 0, n, 0);
    return;
  }
  std::lock_guard<std::mutex> run(run_mu_);
  const int64_t chunk = ((units + use - 1) / use) * grain;
  const uint64_t gen = (ticket_.load(std::memory_order_acquire) >> 32) + 1;
  // Close the previous job to late claimers before its fields are overwritten.
  ticket_.store(gen << 32 | kPublishing, std::memory_order_release);
  job_call_.store(body.call, std::memory_order_release);
  job_fn_.store(body.fn, std::memory_order_release);
  job_guard_.store(detail::alloc_guard_current(), std::memory_order_release);
  failed_.store(false, std::memory_order_release);
  job_n_.store(n, std::memory_order_release);
  job_chunk_.store(chunk, std::memory_order_release);
  job_ranges_.store((n + chunk - 1) / chunk, std::memory_order_release);
  done_.store(0, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(mu_);  // pairs with the sleepers' predicate check
    ticket_.store(gen << 32, std::memory_order_release);
  }
  if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();

  int64_t range;
  while (claim(gen, range)) run_range(range, 0);
  // Only ranges a worker has already started remain; wait for those.
  const int64_t total = job_ranges_.load(std::memory_order_acquire);
  for (int spins = 0; done_.load(std::memory_order_acquire) < total; ++spins)
    if (spins % 16 == 15) std::this_thread::yield();
  if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(std::exchange(error_, nullptr));
}

}  // namespace lily::cpu
