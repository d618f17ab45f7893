// Allocation guard: counting wrappers for the allocator entry points (linked with --wrap=X, which binds
// Lily's references to X to __wrap_X and __real_X to the real X). Built only when CMake found a linker
// that supports it (LILY_ALLOC_GUARD); otherwise the guard reports itself unavailable.
#include "cpu/alloc_guard.h"

#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

namespace lily::cpu {
namespace {
// Constant-initialised, so reading it never runs a TLS initialiser (the wrappers run on every allocation).
thread_local detail::AllocGuardState* tl_scope = nullptr;

[[maybe_unused]] inline void note(size_t bytes) {
  for (detail::AllocGuardState* s = tl_scope; s; s = s->outer) {
    s->count.fetch_add(1, std::memory_order_relaxed);
    int64_t none = -1;
    s->first_bytes.compare_exchange_strong(none, int64_t(bytes), std::memory_order_relaxed);
  }
}

#ifdef LILY_ALLOC_GUARD
// The wrapping is a property of the link, so prove it on the running binary: one malloc and one operator
// new, called through volatile pointers the compiler cannot see through or elide, must both be counted.
bool probe() {
  detail::AllocGuardState s;
  detail::AllocGuardState* prev = tl_scope;
  tl_scope = &s;
  void* (*volatile m)(size_t) = &std::malloc;
  void* (*volatile nw)(size_t) = static_cast<void* (*)(size_t)>(&::operator new);
  void* p = m(8);
  void* q = nw(8);
  tl_scope = prev;
  std::free(p);
  ::operator delete(q);
  return s.count.load() == 2;
}
#endif
}  // namespace

bool alloc_guard_available() {
#ifdef LILY_ALLOC_GUARD
  static const bool ok = probe();
  return ok;
#else
  return false;
#endif
}

bool alloc_guard_active() { return tl_scope != nullptr; }

namespace detail {
AllocGuardState* alloc_guard_current() { return tl_scope; }
AllocGuardAdopt::AllocGuardAdopt(AllocGuardState* s) : prev_(tl_scope) { tl_scope = s; }
AllocGuardAdopt::~AllocGuardAdopt() { tl_scope = prev_; }
}  // namespace detail

AllocGuardScope::AllocGuardScope(const char* what) : what_(what) {
  if (!alloc_guard_available())
    throw std::runtime_error(
        "the allocation guard is unavailable in this build (it needs Linux and a linker with --wrap: GNU ld "
        "or lld); refusing to check nothing");
  state_.outer = tl_scope;
  tl_scope = &state_;
}

AllocGuardScope::~AllocGuardScope() { tl_scope = state_.outer; }

void AllocGuardScope::check() const {
  const int64_t n = state_.count.load(std::memory_order_acquire);
  if (n == 0) return;
  throw std::logic_error("allocation inside a step: " + std::to_string(n) + " heap allocation(s) (first: " +
                         std::to_string(state_.first_bytes.load(std::memory_order_acquire)) + " bytes) in " +
                         (what_ ? what_ : "?"));
}

}  // namespace lily::cpu

#ifdef LILY_ALLOC_GUARD
// Mangled C++ names are declared extern "C" so the wrapper symbols get exactly the names ld looks for
// (Itanium ABI, size_t = unsigned long: CMake enables this only on 64-bit Linux).
using lily::cpu::note;
extern "C" {
void* __real_malloc(size_t);
void* __real_calloc(size_t, size_t);
void* __real_realloc(void*, size_t);
void* __real_aligned_alloc(size_t, size_t);
int __real_posix_memalign(void**, size_t, size_t);
void* __real__Znwm(size_t);
void* __real__Znam(size_t);
void* __real__ZnwmSt11align_val_t(size_t, std::align_val_t);
void* __real__ZnamSt11align_val_t(size_t, std::align_val_t);
void* __real__ZnwmRKSt9nothrow_t(size_t, const std::nothrow_t&) noexcept;
void* __real__ZnamRKSt9nothrow_t(size_t, const std::nothrow_t&) noexcept;
void* __real__ZnwmSt11align_val_tRKSt9nothrow_t(size_t, std::align_val_t, const std::nothrow_t&) noexcept;
void* __real__ZnamSt11align_val_tRKSt9nothrow_t(size_t, std::align_val_t, const std::nothrow_t&) noexcept;

void* __wrap_malloc(size_t n) { note(n); return __real_malloc(n); }
void* __wrap_calloc(size_t c, size_t n) { note(c * n); return __real_calloc(c, n); }
void* __wrap_realloc(void* p, size_t n) { note(n); return __real_realloc(p, n); }
void* __wrap_aligned_alloc(size_t a, size_t n) { note(n); return __real_aligned_alloc(a, n); }
int __wrap_posix_memalign(void** p, size_t a, size_t n) { note(n); return __real_posix_memalign(p, a, n); }
void* __wrap__Znwm(size_t n) { note(n); return __real__Znwm(n); }
void* __wrap__Znam(size_t n) { note(n); return __real__Znam(n); }
void* __wrap__ZnwmSt11align_val_t(size_t n, std::align_val_t a) { note(n); return __real__ZnwmSt11align_val_t(n, a); }
void* __wrap__ZnamSt11align_val_t(size_t n, std::align_val_t a) { note(n); return __real__ZnamSt11align_val_t(n, a); }
void* __wrap__ZnwmRKSt9nothrow_t(size_t n, const std::nothrow_t& t) noexcept {
  note(n);
  return __real__ZnwmRKSt9nothrow_t(n, t);
}
void* __wrap__ZnamRKSt9nothrow_t(size_t n, const std::nothrow_t& t) noexcept {
  note(n);
  return __real__ZnamRKSt9nothrow_t(n, t);
}
void* __wrap__ZnwmSt11align_val_tRKSt9nothrow_t(size_t n, std::align_val_t a, const std::nothrow_t& t) noexcept {
  note(n);
  return __real__ZnwmSt11align_val_tRKSt9nothrow_t(n, a, t);
}
void* __wrap__ZnamSt11align_val_tRKSt9nothrow_t(size_t n, std::align_val_t a, const std::nothrow_t& t) noexcept {
  note(n);
  return __real__ZnamSt11align_val_tRKSt9nothrow_t(n, a, t);
}
}
#endif
