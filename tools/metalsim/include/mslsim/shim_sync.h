// metal_stdlib shim, part 3: everything that synchronises or communicates between lanes:
// threadgroup_barrier, simd_* / quad_* collectives, atomics and simdgroup_matrix. Each collective passes
// its call site (file, line, column of the caller, through default arguments) to libmslsim, which resolves
// it once every active lane of the simdgroup waits at that same site, and calls the combining function
// below with all lanes' data.
#pragma once

// Call site of the caller, for matching collectives and for error messages.
#define MSLSIM_SITE                                                                               \
  const char *__mslsim_file = __builtin_FILE(), unsigned __mslsim_line = __builtin_LINE(),        \
             unsigned __mslsim_col = __builtin_COLUMN()
#define MSLSIM_AT __mslsim_file, __mslsim_line, __mslsim_col

namespace metal {

enum class mem_flags : uint {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags(uint(a) & uint(b)); }

// Fibers of one threadgroup run one at a time on one OS thread and switch only inside libmslsim calls,
// so memory written before a barrier is visible after it without fences.
METAL_FUNC void threadgroup_barrier(mem_flags flags, MSLSIM_SITE) {
  (void)flags;
  mslsim_barrier("threadgroup_barrier", MSLSIM_AT);
}

namespace __c {
inline void noop(void* const*, int) {}

inline int width() { return (int)mslsim_lane_builtins()->threads_per_simdgroup[0]; }

template <class T>
struct one {
  T in;
  T out;
};
template <class T>
struct with_arg {
  T in;
  T out;
  uint arg;
};

template <class T>
METAL_FUNC T splat(typename mslsim::vinfo<T>::elem v) {
  return T(v);
}

struct Sum {
  template <class T> static T f(T a, T b) { return a + b; }
  template <class T> static T id() { return splat<T>(0); }
};
struct Prod {
  template <class T> static T f(T a, T b) { return a * b; }
  template <class T> static T id() { return splat<T>(1); }
};
struct Min {
  template <class T> static T f(T a, T b) { return metal::min(a, b); }
};
struct Max {
  template <class T> static T f(T a, T b) { return metal::max(a, b); }
};
struct And {
  template <class T> static T f(T a, T b) { return a & b; }
};
struct Or {
  template <class T> static T f(T a, T b) { return a | b; }
};
struct Xor {
  template <class T> static T f(T a, T b) { return a ^ b; }
};
struct LAnd {
  template <class T> static T f(T a, T b) { return a && b; }
};
struct LOr {
  template <class T> static T f(T a, T b) { return a || b; }
};

// Butterfly reduction as on the GPU: at each step lane i combines with lane i ^ offset, offsets from
// group/2 down to 1, so every lane ends with the same value. Lanes that have exited take no part.
template <class T, class Op, int Group>
void reduce(void* const* lanes, int width) {
  T v[MSLSIM_MAX_SIMD_WIDTH], nv[MSLSIM_MAX_SIMD_WIDTH];
  bool p[MSLSIM_MAX_SIMD_WIDTH], np[MSLSIM_MAX_SIMD_WIDTH];
  for (int i = 0; i < width; ++i) {
    p[i] = lanes[i] != nullptr;
    if (p[i]) v[i] = ((one<T>*)lanes[i])->in;
  }
  const int group = Group ? Group : width;
  for (int off = group / 2; off >= 1; off >>= 1) {
    for (int i = 0; i < width; ++i) {
      int j = i ^ off;
      if (p[i] && p[j])
        nv[i] = Op::f(v[i], v[j]);
      else if (p[i])
        nv[i] = v[i];
      else if (p[j])
        nv[i] = v[j];
      np[i] = p[i] || p[j];
    }
    for (int i = 0; i < width; ++i) {
      v[i] = nv[i];
      p[i] = np[i];
    }
  }
  for (int i = 0; i < width; ++i)
    if (lanes[i]) ((one<T>*)lanes[i])->out = v[i];
}

// Prefix scans in log steps (Hillis-Steele): lane i adds lane i - offset for offsets 1, 2, 4, ...
template <class T, class Op, bool Inclusive>
void scan(void* const* lanes, int width) {
  T v[MSLSIM_MAX_SIMD_WIDTH], nv[MSLSIM_MAX_SIMD_WIDTH];
  for (int i = 0; i < width; ++i) {
    int src = Inclusive ? i : i - 1;
    v[i] = (src >= 0 && lanes[src]) ? ((one<T>*)lanes[src])->in : Op::template id<T>();
  }
  for (int off = 1; off < width; off <<= 1) {
    for (int i = 0; i < width; ++i) nv[i] = i >= off ? Op::f(v[i - off], v[i]) : v[i];
    for (int i = 0; i < width; ++i) v[i] = nv[i];
  }
  for (int i = 0; i < width; ++i)
    if (lanes[i]) ((one<T>*)lanes[i])->out = v[i];
}

enum ShuffleKind { IDX, UP, DOWN, XOR, ROT_UP, ROT_DOWN, FIRST };

// Reading an exited or missing lane yields poison (all bits set), as undefined as on the GPU.
template <class T, int Kind, int Group>
void shuffle(void* const* lanes, int width) {
  const int group = Group ? Group : width;
  int first = -1;
  for (int i = 0; i < width && first < 0; ++i)
    if (lanes[i]) first = i;
  for (int i = 0; i < width; ++i) {
    if (!lanes[i]) continue;
    with_arg<T>* me = (with_arg<T>*)lanes[i];
    const int base = i - i % group, k = i % group;
    const int a = (int)me->arg;
    int src;
    switch (Kind) {
      case IDX: src = base + (a % group); break;
      case UP: src = k - a >= 0 ? i - a : i; break;
      case DOWN: src = k + a < group ? i + a : i; break;
      case XOR: src = base + ((k ^ a) % group); break;
      case ROT_UP: src = base + ((k - a % group + group) % group); break;
      case ROT_DOWN: src = base + ((k + a) % group); break;
      default: src = first; break;
    }
    if (src >= 0 && src < width && lanes[src]) {
      me->out = ((with_arg<T>*)lanes[src])->in;
    } else {
      __builtin_memset((void*)&me->out, 0xFF, sizeof(T));
    }
  }
}

inline void is_first(void* const* lanes, int width) {
  bool seen = false;
  for (int i = 0; i < width; ++i) {
    if (!lanes[i]) continue;
    ((one<bool>*)lanes[i])->out = !seen;
    seen = true;
  }
}

template <int Group>
void ballot(void* const* lanes, int width) {
  const int group = Group ? Group : width;
  for (int i = 0; i < width; ++i) {
    if (!lanes[i]) continue;
    ulong bits = 0;
    const int base = i - i % group;
    for (int j = base; j < base + group; ++j)
      if (lanes[j] && ((one<ulong>*)lanes[j])->in) bits |= 1ul << (j - base);
    ((one<ulong>*)lanes[i])->out = bits;
  }
}

template <class T, class Op, int Group>
METAL_FUNC T do_reduce(T x, const char* what, const char* f, unsigned l, unsigned c) {
  one<T> d{x, x};
  mslsim_simd_sync(&reduce<T, Op, Group>, &d, 0, what, f, l, c);
  return d.out;
}
template <class T, int Kind, int Group>
METAL_FUNC T do_shuffle(T x, uint arg, const char* what, const char* f, unsigned l, unsigned c) {
  with_arg<T> d{x, x, arg};
  mslsim_simd_sync(&shuffle<T, Kind, Group>, &d, 0, what, f, l, c);
  return d.out;
}
}  // namespace __c

METAL_FUNC void simdgroup_barrier(mem_flags flags, MSLSIM_SITE) {
  (void)flags;
  char dummy = 0;
  mslsim_simd_sync(&__c::noop, &dummy, 0, "simdgroup_barrier", MSLSIM_AT);
}

#define MSLSIM_REDUCE(name, Op, Group)                                      \
  template <class T>                                                        \
  METAL_FUNC T name(T x, MSLSIM_SITE) {                                     \
    return __c::do_reduce<T, __c::Op, Group>(x, #name, MSLSIM_AT);          \
  }
MSLSIM_REDUCE(simd_sum, Sum, 0)
MSLSIM_REDUCE(simd_product, Prod, 0)
MSLSIM_REDUCE(simd_prod, Prod, 0)
MSLSIM_REDUCE(simd_min, Min, 0)
MSLSIM_REDUCE(simd_max, Max, 0)
MSLSIM_REDUCE(simd_and, And, 0)
MSLSIM_REDUCE(simd_or, Or, 0)
MSLSIM_REDUCE(simd_xor, Xor, 0)
MSLSIM_REDUCE(quad_sum, Sum, 4)
MSLSIM_REDUCE(quad_product, Prod, 4)
MSLSIM_REDUCE(quad_prod, Prod, 4)
MSLSIM_REDUCE(quad_min, Min, 4)
MSLSIM_REDUCE(quad_max, Max, 4)
MSLSIM_REDUCE(quad_and, And, 4)
MSLSIM_REDUCE(quad_or, Or, 4)
MSLSIM_REDUCE(quad_xor, Xor, 4)
#undef MSLSIM_REDUCE

METAL_FUNC bool simd_all(bool x, MSLSIM_SITE) { return __c::do_reduce<bool, __c::LAnd, 0>(x, "simd_all", MSLSIM_AT); }
METAL_FUNC bool simd_any(bool x, MSLSIM_SITE) { return __c::do_reduce<bool, __c::LOr, 0>(x, "simd_any", MSLSIM_AT); }
METAL_FUNC bool quad_all(bool x, MSLSIM_SITE) { return __c::do_reduce<bool, __c::LAnd, 4>(x, "quad_all", MSLSIM_AT); }
METAL_FUNC bool quad_any(bool x, MSLSIM_SITE) { return __c::do_reduce<bool, __c::LOr, 4>(x, "quad_any", MSLSIM_AT); }

#define MSLSIM_SCAN(name, Op, Incl)                                             \
  template <class T>                                                            \
  METAL_FUNC T name(T x, MSLSIM_SITE) {                                         \
    __c::one<T> d{x, x};                                                        \
    mslsim_simd_sync(&__c::scan<T, __c::Op, Incl>, &d, 0, #name, MSLSIM_AT);   \
    return d.out;                                                               \
  }
MSLSIM_SCAN(simd_prefix_inclusive_sum, Sum, true)
MSLSIM_SCAN(simd_prefix_exclusive_sum, Sum, false)
MSLSIM_SCAN(simd_prefix_inclusive_product, Prod, true)
MSLSIM_SCAN(simd_prefix_exclusive_product, Prod, false)
#undef MSLSIM_SCAN

#define MSLSIM_SHUFFLE(name, Kind, Group, ArgT)                                       \
  template <class T>                                                                  \
  METAL_FUNC T name(T x, ArgT a, MSLSIM_SITE) {                                       \
    return __c::do_shuffle<T, __c::Kind, Group>(x, uint(a), #name, MSLSIM_AT);        \
  }
MSLSIM_SHUFFLE(simd_shuffle, IDX, 0, ushort)
MSLSIM_SHUFFLE(simd_shuffle_up, UP, 0, ushort)
MSLSIM_SHUFFLE(simd_shuffle_down, DOWN, 0, ushort)
MSLSIM_SHUFFLE(simd_shuffle_xor, XOR, 0, ushort)
MSLSIM_SHUFFLE(simd_shuffle_rotate_up, ROT_UP, 0, ushort)
MSLSIM_SHUFFLE(simd_shuffle_rotate_down, ROT_DOWN, 0, ushort)
MSLSIM_SHUFFLE(simd_broadcast, IDX, 0, ushort)
MSLSIM_SHUFFLE(quad_shuffle, IDX, 4, ushort)
MSLSIM_SHUFFLE(quad_shuffle_up, UP, 4, ushort)
MSLSIM_SHUFFLE(quad_shuffle_down, DOWN, 4, ushort)
MSLSIM_SHUFFLE(quad_shuffle_xor, XOR, 4, ushort)
MSLSIM_SHUFFLE(quad_shuffle_rotate_up, ROT_UP, 4, ushort)
MSLSIM_SHUFFLE(quad_shuffle_rotate_down, ROT_DOWN, 4, ushort)
MSLSIM_SHUFFLE(quad_broadcast, IDX, 4, ushort)
#undef MSLSIM_SHUFFLE

// simd_shuffle_and_fill_up/down: lanes shifted out are filled from `fill` of the lane that wraps.
template <class T>
METAL_FUNC T simd_shuffle_and_fill_down(T x, T fill, ushort delta, MSLSIM_SITE) {
  T a = __c::do_shuffle<T, __c::ROT_DOWN, 0>(x, delta, "simd_shuffle_and_fill_down", MSLSIM_AT);
  T b = __c::do_shuffle<T, __c::ROT_DOWN, 0>(fill, delta, "simd_shuffle_and_fill_down", MSLSIM_AT);
  uint lane = mslsim_lane_builtins()->thread_index_in_simdgroup[0];
  return lane + delta < (uint)__c::width() ? a : b;
}
template <class T>
METAL_FUNC T simd_shuffle_and_fill_up(T x, T fill, ushort delta, MSLSIM_SITE) {
  T a = __c::do_shuffle<T, __c::ROT_UP, 0>(x, delta, "simd_shuffle_and_fill_up", MSLSIM_AT);
  T b = __c::do_shuffle<T, __c::ROT_UP, 0>(fill, delta, "simd_shuffle_and_fill_up", MSLSIM_AT);
  uint lane = mslsim_lane_builtins()->thread_index_in_simdgroup[0];
  return lane >= delta ? a : b;
}

template <class T>
METAL_FUNC T simd_broadcast_first(T x, MSLSIM_SITE) {
  return __c::do_shuffle<T, __c::FIRST, 0>(x, 0, "simd_broadcast_first", MSLSIM_AT);
}

METAL_FUNC bool simd_is_first(MSLSIM_SITE) {
  __c::one<bool> d{false, false};
  mslsim_simd_sync(&__c::is_first, &d, 0, "simd_is_first", MSLSIM_AT);
  return d.out;
}

// A simdgroup's vote: bit i is lane i's predicate (exited lanes contribute 0).
struct simd_vote {
  using vote_t = ulong;
  vote_t __v = 0;
  constexpr simd_vote() = default;
  explicit constexpr simd_vote(vote_t v) : __v(v) {}
  explicit constexpr operator vote_t() const { return __v; }
  bool all() const {
    int w = __c::width();
    return __v == (w >= 64 ? ~0ul : ((1ul << w) - 1));
  }
  bool any() const { return __v != 0; }
};
struct quad_vote {
  using vote_t = ushort;
  vote_t __v = 0;
  constexpr quad_vote() = default;
  explicit constexpr quad_vote(vote_t v) : __v(v) {}
  explicit constexpr operator vote_t() const { return __v; }
  bool all() const { return __v == 0xF; }
  bool any() const { return __v != 0; }
};

METAL_FUNC simd_vote simd_ballot(bool pred, MSLSIM_SITE) {
  __c::one<ulong> d{pred ? 1ul : 0ul, 0};
  mslsim_simd_sync(&__c::ballot<0>, &d, 0, "simd_ballot", MSLSIM_AT);
  return simd_vote(d.out);
}
METAL_FUNC simd_vote simd_active_threads_mask(MSLSIM_SITE) {
  __c::one<ulong> d{1, 0};
  mslsim_simd_sync(&__c::ballot<0>, &d, 0, "simd_active_threads_mask", MSLSIM_AT);
  return simd_vote(d.out);
}
METAL_FUNC quad_vote quad_ballot(bool pred, MSLSIM_SITE) {
  __c::one<ulong> d{pred ? 1ul : 0ul, 0};
  mslsim_simd_sync(&__c::ballot<4>, &d, 0, "quad_ballot", MSLSIM_AT);
  return quad_vote(ushort(d.out));
}

// ---- atomics ---------------------------------------------------------------------------------------------
enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst,
};
enum thread_scope {
  thread_scope_thread,
  thread_scope_simdgroup,
  thread_scope_threadgroup,
  thread_scope_device,
};

template <class T>
struct atomic {
  using value_type = T;
  T __v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<long> atomic_long;
typedef atomic<ulong> atomic_ulong;

namespace __a {
constexpr int order(memory_order o) {
  return o == memory_order_relaxed   ? __ATOMIC_RELAXED
         : o == memory_order_acquire ? __ATOMIC_ACQUIRE
         : o == memory_order_release ? __ATOMIC_RELEASE
         : o == memory_order_acq_rel ? __ATOMIC_ACQ_REL
                                     : __ATOMIC_SEQ_CST;
}
// Device atomics are real atomics on the value's bits: workers run threadgroups in parallel.
template <class T>
using bits_t = conditional_t<sizeof(T) == 1, uchar, conditional_t<sizeof(T) == 2, ushort,
                             conditional_t<sizeof(T) == 4, uint, ulong>>>;
template <class A>
METAL_FUNC bits_t<typename A::value_type>* bits(A* obj) {
  return (bits_t<typename A::value_type>*)(void*)obj;
}
template <class T>
METAL_FUNC T from(bits_t<T> b) { return __builtin_bit_cast(T, b); }
template <class T>
METAL_FUNC bits_t<T> to(T v) { return __builtin_bit_cast(bits_t<T>, v); }

template <class A, class F>
METAL_FUNC typename A::value_type rmw(A* obj, F f, memory_order o) {
  using T = typename A::value_type;
  auto* p = bits(obj);
  bits_t<T> old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(p, &old, to<T>(f(from<T>(old))), true, order(o), __ATOMIC_RELAXED)) {
  }
  return from<T>(old);
}
}  // namespace __a

// atomic_thread_fence (MSL 3.2 spelling: flags, order, scope). Lanes of a threadgroup run on one OS thread
// and switch only inside libmslsim, so a fence has nothing to order between them; threadgroups on other
// workers see device memory through a real fence of the requested strength. A fence is not a barrier: it
// makes no thread wait, so code that needs one still fails without threadgroup_barrier.
METAL_FUNC void atomic_thread_fence(mem_flags flags, memory_order o, thread_scope scope = thread_scope_device) {
  (void)scope;
  if (uint(flags) != 0) __atomic_thread_fence(__a::order(o));
}

template <class A>
METAL_FUNC void atomic_store_explicit(A* obj, typename A::value_type desired, memory_order o) {
  __atomic_store_n(__a::bits(obj), __a::to(desired), __a::order(o));
}
template <class A>
METAL_FUNC typename A::value_type atomic_load_explicit(A* obj, memory_order o) {
  return __a::from<typename A::value_type>(__atomic_load_n(__a::bits(obj), __a::order(o)));
}
template <class A>
METAL_FUNC typename A::value_type atomic_exchange_explicit(A* obj, typename A::value_type desired, memory_order o) {
  return __a::from<typename A::value_type>(__atomic_exchange_n(__a::bits(obj), __a::to(desired), __a::order(o)));
}
template <class A>
METAL_FUNC bool atomic_compare_exchange_weak_explicit(A* obj, thread typename A::value_type* expected,
                                                      typename A::value_type desired, memory_order succ,
                                                      memory_order fail) {
  using T = typename A::value_type;
  auto e = __a::to(*expected);
  bool ok = __atomic_compare_exchange_n(__a::bits(obj), &e, __a::to(desired), false, __a::order(succ),
                                        __a::order(fail) == __ATOMIC_RELEASE ? __ATOMIC_RELAXED : __a::order(fail));
  if (!ok) *expected = __a::from<T>(e);
  return ok;
}
template <class A>
METAL_FUNC bool atomic_compare_exchange_strong_explicit(A* obj, thread typename A::value_type* expected,
                                                        typename A::value_type desired, memory_order succ,
                                                        memory_order fail) {
  return atomic_compare_exchange_weak_explicit(obj, expected, desired, succ, fail);
}

#define MSLSIM_ATOMIC_RMW(name, expr)                                                                   \
  template <class A>                                                                                    \
  METAL_FUNC typename A::value_type atomic_fetch_##name##_explicit(A* obj, typename A::value_type operand, \
                                                                   memory_order o) {                    \
    using T = typename A::value_type;                                                                   \
    return __a::rmw(obj, [operand](T v) -> T { return expr; }, o);                                      \
  }
MSLSIM_ATOMIC_RMW(add, T(v + operand))
MSLSIM_ATOMIC_RMW(sub, T(v - operand))
MSLSIM_ATOMIC_RMW(and, T(v & operand))
MSLSIM_ATOMIC_RMW(or, T(v | operand))
MSLSIM_ATOMIC_RMW(xor, T(v ^ operand))
MSLSIM_ATOMIC_RMW(min, T(operand < v ? operand : v))
MSLSIM_ATOMIC_RMW(max, T(v < operand ? operand : v))
#undef MSLSIM_ATOMIC_RMW

// ---- simdgroup_matrix ------------------------------------------------------------------------------------
// Each lane holds two elements of the 8x8 matrix, with Apple's lane -> element map (documented in MLX's
// steel/gemm/mma.h): q = lane / 4, row = (q & 4) + (lane / 2) % 4, column = (q & 2) * 2 + (lane % 2) * 2,
// elements (row, column) and (row, column + 1). Loads, stores and products are simdgroup collectives:
// the last lane to arrive gathers every lane's elements, computes, and scatters the results.
namespace __sm {
METAL_FUNC void coords(int lane, int& row, int& col) {
  int q = lane / 4;
  row = (q & 4) + (lane / 2) % 4;
  col = (q & 2) * 2 + (lane % 2) * 2;
}
}  // namespace __sm

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator supports 8x8 simdgroup matrices only");
  vec<T, 2> __e;
  simdgroup_matrix() = default;
  // MSL: a diagonal matrix with `dval` on the diagonal.
  METAL_FUNC simdgroup_matrix(T dval) {
    int r, c;
    __sm::coords((int)mslsim_lane_builtins()->thread_index_in_simdgroup[0], r, c);
    __e[0] = r == c ? dval : T(0);
    __e[1] = r == c + 1 ? dval : T(0);
  }
  METAL_FUNC thread vec<T, 2>& thread_elements() { return __e; }
  METAL_FUNC const thread vec<T, 2>& thread_elements() const { return __e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
METAL_FUNC simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.__e = vec<T, 2>(value);
  return m;
}

namespace __sm {
template <class T>
struct mem_op {
  simdgroup_matrix<T, 8, 8>* m;
  T* p;
  ulong stride;
  ulong2 origin;
  bool transpose;
};
template <class T>
METAL_FUNC T* elem(const mem_op<T>& o, int row, int col) {
  if (o.transpose) {
    int t = row;
    row = col;
    col = t;
  }
  return o.p + (o.origin.y + (ulong)row) * o.stride + o.origin.x + (ulong)col;
}
template <class T>
void load(void* const* lanes, int width) {
  for (int i = 0; i < width; ++i) {
    mem_op<T>& o = *(mem_op<T>*)lanes[i];
    int r, c;
    coords(i, r, c);
    o.m->__e[0] = *elem(o, r, c);
    o.m->__e[1] = *elem(o, r, c + 1);
  }
}
template <class T>
void store(void* const* lanes, int width) {
  for (int i = 0; i < width; ++i) {
    mem_op<T>& o = *(mem_op<T>*)lanes[i];
    int r, c;
    coords(i, r, c);
    *elem(o, r, c) = o.m->__e[0];
    *elem(o, r, c + 1) = o.m->__e[1];
  }
}
template <class TD, class TA, class TB, class TC>
struct mma_op {
  simdgroup_matrix<TD, 8, 8>* d;
  const simdgroup_matrix<TA, 8, 8>* a;
  const simdgroup_matrix<TB, 8, 8>* b;
  const simdgroup_matrix<TC, 8, 8>* c;  // null: multiply only
};
template <class T>
void gather(float (&out)[8][8], const simdgroup_matrix<T, 8, 8>* const* ms) {
  for (int i = 0; i < 32; ++i) {
    int r, c;
    coords(i, r, c);
    out[r][c] = float(ms[i]->__e[0]);
    out[r][c + 1] = float(ms[i]->__e[1]);
  }
}
// D = A * B (+ C), accumulated in float over k = 0..7 in order, rounded once to D's element type.
template <class TD, class TA, class TB, class TC>
void mma(void* const* lanes, int) {
  using Op = mma_op<TD, TA, TB, TC>;
  const simdgroup_matrix<TA, 8, 8>* as[32];
  const simdgroup_matrix<TB, 8, 8>* bs[32];
  const simdgroup_matrix<TC, 8, 8>* cs[32];
  for (int i = 0; i < 32; ++i) {
    const Op& o = *(const Op*)lanes[i];
    as[i] = o.a;
    bs[i] = o.b;
    cs[i] = o.c;
  }
  float A[8][8], B[8][8], C[8][8] = {};
  gather(A, as);
  gather(B, bs);
  if (cs[0]) gather(C, cs);
  for (int i = 0; i < 32; ++i) {
    const Op& o = *(const Op*)lanes[i];
    int r, c;
    coords(i, r, c);
    for (int e = 0; e < 2; ++e) {
      float acc = C[r][c + e];
      for (int k = 0; k < 8; ++k) acc += A[r][k] * B[k][c + e];
      o.d->__e[e] = TD(acc);
    }
  }
}
}  // namespace __sm

template <class T, class P>
METAL_FUNC void simdgroup_load(thread simdgroup_matrix<T, 8, 8>& d, P* src, ulong elements_per_row = 8,
                               ulong2 matrix_origin = ulong2{0, 0}, bool transpose_matrix = false, MSLSIM_SITE) {
  __sm::mem_op<T> o{&d, (T*)(void*)src, elements_per_row, matrix_origin, transpose_matrix};
  mslsim_simd_sync(&__sm::load<T>, &o, MSLSIM_SYNC_FULL, "simdgroup_load", MSLSIM_AT);
}
template <class T, class P>
METAL_FUNC void simdgroup_store(thread const simdgroup_matrix<T, 8, 8>& s, P* dst, ulong elements_per_row = 8,
                                ulong2 matrix_origin = ulong2{0, 0}, bool transpose_matrix = false, MSLSIM_SITE) {
  __sm::mem_op<T> o{(simdgroup_matrix<T, 8, 8>*)&s, (T*)(void*)dst, elements_per_row, matrix_origin,
                    transpose_matrix};
  mslsim_simd_sync(&__sm::store<T>, &o, MSLSIM_SYNC_FULL, "simdgroup_store", MSLSIM_AT);
}
template <class TD, class TA, class TB, class TC>
METAL_FUNC void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, 8, 8>& d,
                                              thread const simdgroup_matrix<TA, 8, 8>& a,
                                              thread const simdgroup_matrix<TB, 8, 8>& b,
                                              thread const simdgroup_matrix<TC, 8, 8>& c, MSLSIM_SITE) {
  __sm::mma_op<TD, TA, TB, TC> o{&d, &a, &b, &c};
  mslsim_simd_sync(&__sm::mma<TD, TA, TB, TC>, &o, MSLSIM_SYNC_FULL, "simdgroup_multiply_accumulate", MSLSIM_AT);
}
template <class TD, class TA, class TB>
METAL_FUNC void simdgroup_multiply(thread simdgroup_matrix<TD, 8, 8>& d, thread const simdgroup_matrix<TA, 8, 8>& a,
                                   thread const simdgroup_matrix<TB, 8, 8>& b, MSLSIM_SITE) {
  __sm::mma_op<TD, TA, TB, TD> o{&d, &a, &b, nullptr};
  mslsim_simd_sync(&__sm::mma<TD, TA, TB, TD>, &o, MSLSIM_SYNC_FULL, "simdgroup_multiply", MSLSIM_AT);
}

// MSL's metal::array (thread-space use).
template <class T, size_t N>
struct array {
  T __elems[N ? N : 1];
  METAL_FUNC constexpr size_t size() const { return N; }
  METAL_FUNC thread T& operator[](size_t i) { return __elems[i]; }
  METAL_FUNC constexpr const thread T& operator[](size_t i) const { return __elems[i]; }
};

}  // namespace metal
