// Debug check that a step makes no heap allocation. The link wraps the allocation entry points referenced
// by Lily's own object files (GNU ld / lld --wrap, see CMakeLists.txt); each wrapper counts the call when
// the current thread is inside a guard scope, then forwards. Other libraries in the process are untouched,
// and so are allocations made inside libstdc++.so itself (e.g. std::string members it instantiates).
#pragma once
#include <atomic>
#include <cstdint>

namespace lily::cpu {

// False when the build could not wrap the allocator (not Linux, or a linker without --wrap): then an
// AllocGuardScope refuses to start rather than pass silently.
bool alloc_guard_available();

namespace detail {
// What a scope counts into. Owned by the scope, shared by pointer with the pool workers that run the
// scope's parallel_for jobs; `outer` chains nested scopes so an inner allocation counts in each of them.
struct AllocGuardState {
  std::atomic<int64_t> count{0};
  std::atomic<int64_t> first_bytes{-1};
  AllocGuardState* outer = nullptr;
};
AllocGuardState* alloc_guard_current();  // innermost scope of this thread (or adopted job), or null

// A pool worker counts into the scope of the job it is running, for the duration of one range.
class AllocGuardAdopt {
 public:
  explicit AllocGuardAdopt(AllocGuardState* s);
  ~AllocGuardAdopt();
  AllocGuardAdopt(const AllocGuardAdopt&) = delete;
  AllocGuardAdopt& operator=(const AllocGuardAdopt&) = delete;

 private:
  AllocGuardState* prev_;
};
}  // namespace detail

// While an AllocGuardScope is alive on a thread (and on pool workers running that thread's parallel_for
// jobs), allocations by Lily's code are counted; `check()` throws std::logic_error naming `what`, the
// count and the size of the first allocation if any happened since the scope began.
class AllocGuardScope {
 public:
  explicit AllocGuardScope(const char* what);  // throws std::runtime_error if !alloc_guard_available()
  ~AllocGuardScope();
  AllocGuardScope(const AllocGuardScope&) = delete;
  AllocGuardScope& operator=(const AllocGuardScope&) = delete;

  // throws std::logic_error("allocation inside a step: N heap allocation(s) (first: B bytes) in <what>")
  void check() const;
  int64_t count() const { return state_.count.load(std::memory_order_acquire); }

 private:
  detail::AllocGuardState state_;
  const char* what_;
};

bool alloc_guard_active();  // current thread inside a scope (ThreadPool uses it)

}  // namespace lily::cpu
