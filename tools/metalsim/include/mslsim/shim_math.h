// metal_stdlib shim, part 2: MSL math, common, geometric, relational and integer functions for scalars
// and vectors, plus the metal::fast / metal::precise spellings. half and bfloat compute in float and round
// once per call (Metal is allowed to be less exact: compare GPU results with a tolerance). Only clang
// builtins are used, so no libc declaration leaks into the global namespace of kernel code.
#pragma once

// The float constants MSL defines as macros (MSL specification, "Math Functions").
#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
#ifndef NAN
#define NAN __builtin_nanf("")
#endif
#ifndef MAXFLOAT
#define MAXFLOAT 0x1.fffffep+127f
#endif
#ifndef HUGE_VALF
#define HUGE_VALF __builtin_huge_valf()
#endif

namespace metal {
namespace __m {
#define MSLSIM_LIBM1(fn)                                                 \
  METAL_FUNC float fn(float x) { return __builtin_##fn##f(x); }          \
  METAL_FUNC double fn(double x) { return __builtin_##fn(x); }
#define MSLSIM_LIBM2(fn)                                                           \
  METAL_FUNC float fn(float x, float y) { return __builtin_##fn##f(x, y); }        \
  METAL_FUNC double fn(double x, double y) { return __builtin_##fn(x, y); }
MSLSIM_LIBM1(exp)
MSLSIM_LIBM1(exp2)
MSLSIM_LIBM1(log)
MSLSIM_LIBM1(log2)
MSLSIM_LIBM1(log10)
MSLSIM_LIBM1(sqrt)
MSLSIM_LIBM1(cbrt)
MSLSIM_LIBM1(sin)
MSLSIM_LIBM1(cos)
MSLSIM_LIBM1(tan)
MSLSIM_LIBM1(asin)
MSLSIM_LIBM1(acos)
MSLSIM_LIBM1(atan)
MSLSIM_LIBM1(sinh)
MSLSIM_LIBM1(cosh)
MSLSIM_LIBM1(tanh)
MSLSIM_LIBM1(asinh)
MSLSIM_LIBM1(acosh)
MSLSIM_LIBM1(atanh)
MSLSIM_LIBM1(floor)
MSLSIM_LIBM1(ceil)
MSLSIM_LIBM1(round)
MSLSIM_LIBM1(rint)
MSLSIM_LIBM1(trunc)
MSLSIM_LIBM1(fabs)
MSLSIM_LIBM1(erf)
MSLSIM_LIBM2(pow)
MSLSIM_LIBM2(atan2)
MSLSIM_LIBM2(fmod)
MSLSIM_LIBM2(copysign)
MSLSIM_LIBM2(fmin)
MSLSIM_LIBM2(fmax)
MSLSIM_LIBM2(hypot)
MSLSIM_LIBM2(fdim)
#undef MSLSIM_LIBM1
#undef MSLSIM_LIBM2
METAL_FUNC float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
METAL_FUNC double fma(double a, double b, double c) { return __builtin_fma(a, b, c); }
template <class T>
using calc = conditional_t<is_same_v<remove_cv_t<T>, double>, double, float>;
template <class T>
constexpr bool fp = is_floating_point_v<T>;
template <class T>
constexpr bool in = is_integral_v<T>;
}  // namespace __m

// Elementwise vector forms of a scalar function (declared after the scalar overloads they call).
#define MSLSIM_VEC1(name)                                                          \
  template <class T, int N>                                                        \
  METAL_FUNC auto name(vec<T, N> v)->vec<decltype(name(T())), N> {                 \
    vec<decltype(name(T())), N> r;                                                 \
    for (int i = 0; i < N; ++i) r[i] = name(T(v[i]));                              \
    return r;                                                                      \
  }
#define MSLSIM_VEC2(name)                                                          \
  template <class T, int N>                                                        \
  METAL_FUNC vec<T, N> name(vec<T, N> a, vec<T, N> b) {                            \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; ++i) r[i] = name(T(a[i]), T(b[i]));                     \
    return r;                                                                      \
  }                                                                                \
  template <class T, int N>                                                        \
  METAL_FUNC vec<T, N> name(vec<T, N> a, type_identity_t<T> b) {                   \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; ++i) r[i] = name(T(a[i]), b);                           \
    return r;                                                                      \
  }                                                                                \
  template <class T, int N>                                                        \
  METAL_FUNC vec<T, N> name(type_identity_t<T> a, vec<T, N> b) {                   \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; ++i) r[i] = name(a, T(b[i]));                           \
    return r;                                                                      \
  }

#define MSLSIM_F1(name, expr)                                                     \
  template <class T, enable_if_t<__m::fp<T>, int> = 0>                            \
  METAL_FUNC T name(T x_) {                                                       \
    using C = __m::calc<T>;                                                       \
    C x = C(x_);                                                                  \
    return T(expr);                                                               \
  }                                                                               \
  MSLSIM_VEC1(name)
#define MSLSIM_F2(name, expr)                                                     \
  template <class T, enable_if_t<__m::fp<T>, int> = 0>                            \
  METAL_FUNC T name(T x_, T y_) {                                                 \
    using C = __m::calc<T>;                                                       \
    C x = C(x_), y = C(y_);                                                       \
    return T(expr);                                                               \
  }                                                                               \
  MSLSIM_VEC2(name)

MSLSIM_F1(exp, __m::exp(x))
MSLSIM_F1(exp2, __m::exp2(x))
MSLSIM_F1(exp10, __m::pow(C(10), x))
MSLSIM_F1(log, __m::log(x))
MSLSIM_F1(log2, __m::log2(x))
MSLSIM_F1(log10, __m::log10(x))
MSLSIM_F1(sqrt, __m::sqrt(x))
MSLSIM_F1(rsqrt, C(1) / __m::sqrt(x))
MSLSIM_F1(cbrt, __m::cbrt(x))
MSLSIM_F1(sin, __m::sin(x))
MSLSIM_F1(cos, __m::cos(x))
MSLSIM_F1(tan, __m::tan(x))
MSLSIM_F1(sinpi, __m::sin(x * C(3.14159265358979323846)))
MSLSIM_F1(cospi, __m::cos(x * C(3.14159265358979323846)))
MSLSIM_F1(asin, __m::asin(x))
MSLSIM_F1(acos, __m::acos(x))
MSLSIM_F1(atan, __m::atan(x))
MSLSIM_F1(sinh, __m::sinh(x))
MSLSIM_F1(cosh, __m::cosh(x))
MSLSIM_F1(tanh, __m::tanh(x))
MSLSIM_F1(asinh, __m::asinh(x))
MSLSIM_F1(acosh, __m::acosh(x))
MSLSIM_F1(atanh, __m::atanh(x))
MSLSIM_F1(floor, __m::floor(x))
MSLSIM_F1(ceil, __m::ceil(x))
MSLSIM_F1(round, __m::round(x))
MSLSIM_F1(rint, __m::rint(x))
MSLSIM_F1(trunc, __m::trunc(x))
MSLSIM_F1(fabs, __m::fabs(x))
MSLSIM_F1(erf, __m::erf(x))
MSLSIM_F1(fract, __m::fmin(x - __m::floor(x), C(0x1.fffffep-1)))
MSLSIM_F1(saturate, __m::fmin(__m::fmax(x, C(0)), C(1)))
MSLSIM_F1(sign, x > 0 ? C(1) : (x < 0 ? C(-1) : (x == x ? x * C(0) : x)))
MSLSIM_F2(pow, __m::pow(x, y))
MSLSIM_F2(powr, __m::pow(x, y))
MSLSIM_F2(atan2, __m::atan2(x, y))
MSLSIM_F2(fmod, __m::fmod(x, y))
MSLSIM_F2(copysign, __m::copysign(x, y))
MSLSIM_F2(fmin, __m::fmin(x, y))
MSLSIM_F2(fmax, __m::fmax(x, y))
MSLSIM_F2(hypot, __m::hypot(x, y))
MSLSIM_F2(fdim, __m::fdim(x, y))
MSLSIM_F2(divide, x / y)
MSLSIM_F2(step, y < x ? C(0) : C(1))

// min / max: fmin / fmax semantics for floating point, plain comparison for integers.
template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
METAL_FUNC T min(T a, T b) {
  if constexpr (__m::fp<T>)
    return fmin(a, b);
  else
    return b < a ? b : a;
}
template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
METAL_FUNC T max(T a, T b) {
  if constexpr (__m::fp<T>)
    return fmax(a, b);
  else
    return a < b ? b : a;
}
MSLSIM_VEC2(min)
MSLSIM_VEC2(max)

template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
METAL_FUNC T abs(T x) {
  if constexpr (__m::fp<T>)
    return fabs(x);
  else if constexpr (is_signed_v<T>)
    return x < 0 ? T(-x) : x;
  else
    return x;
}
MSLSIM_VEC1(abs)

template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
METAL_FUNC T min3(T a, T b, T c) { return min(min(a, b), c); }
template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
METAL_FUNC T max3(T a, T b, T c) { return max(max(a, b), c); }
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T fmin3(T a, T b, T c) { return fmin(fmin(a, b), c); }
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T fmax3(T a, T b, T c) { return fmax(fmax(a, b), c); }
template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
METAL_FUNC T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }

// Three-argument functions: scalar, vector, and vector with scalar bounds / weight.
template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
METAL_FUNC T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T, int N>
METAL_FUNC vec<T, N> clamp(vec<T, N> x, vec<T, N> lo, vec<T, N> hi) { return min(max(x, lo), hi); }
template <class T, int N>
METAL_FUNC vec<T, N> clamp(vec<T, N> x, type_identity_t<T> lo, type_identity_t<T> hi) {
  return min(max(x, lo), hi);
}

template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T mix(T x, T y, T a) { return x + (y - x) * a; }
template <class T, int N>
METAL_FUNC vec<T, N> mix(vec<T, N> x, vec<T, N> y, vec<T, N> a) { return x + (y - x) * a; }
template <class T, int N>
METAL_FUNC vec<T, N> mix(vec<T, N> x, vec<T, N> y, type_identity_t<T> a) { return x + (y - x) * a; }

template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T fma(T a, T b, T c) {
  using C = __m::calc<T>;
  return T(__m::fma(C(a), C(b), C(c)));
}
template <class T, int N>
METAL_FUNC vec<T, N> fma(vec<T, N> a, vec<T, N> b, vec<T, N> c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(T(a[i]), T(b[i]), T(c[i]));
  return r;
}
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T mad(T a, T b, T c) { return a * b + c; }
template <class T, int N>
METAL_FUNC vec<T, N> mad(vec<T, N> a, vec<T, N> b, vec<T, N> c) { return a * b + c; }

template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T smoothstep(T e0, T e1, T x) {
  T t = clamp(T((x - e0) / (e1 - e0)), T(0), T(1));
  return t * t * (T(3) - T(2) * t);
}
template <class T, int N>
METAL_FUNC vec<T, N> smoothstep(vec<T, N> e0, vec<T, N> e1, vec<T, N> x) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = smoothstep(T(e0[i]), T(e1[i]), T(x[i]));
  return r;
}
template <class T, int N>
METAL_FUNC vec<T, N> smoothstep(type_identity_t<T> e0, type_identity_t<T> e1, vec<T, N> x) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = smoothstep(e0, e1, T(x[i]));
  return r;
}

template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T sincos(T x, thread T& cosval) {
  cosval = cos(x);
  return sin(x);
}
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T ldexp(T x, int e) {
  return T(__builtin_ldexp(double(x), e));
}
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T frexp(T x, thread int& e) {
  return T(__builtin_frexp(double(x), &e));
}
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC T modf(T x, thread T& ip) {
  ip = trunc(x);
  return x - ip;
}

// ---- relational -------------------------------------------------------------------------------------
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC bool isnan(T x) { return x != x; }
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC bool isinf(T x) { return __m::fabs(__m::calc<T>(x)) == __builtin_inf(); }
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC bool isfinite(T x) { return !isnan(x) && !isinf(x); }
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC bool isnormal(T x) {
  return isfinite(x) && __m::fabs(__m::calc<T>(x)) >= __m::calc<T>(numeric_limits<T>::min());
}
template <class T, enable_if_t<__m::fp<T>, int> = 0>
METAL_FUNC bool signbit(T x) { return __builtin_signbit(float(x)); }
MSLSIM_VEC1(isnan)
MSLSIM_VEC1(isinf)
MSLSIM_VEC1(isfinite)
MSLSIM_VEC1(isnormal)
MSLSIM_VEC1(signbit)

METAL_FUNC bool all(bool b) { return b; }
METAL_FUNC bool any(bool b) { return b; }
template <class T, int N>
METAL_FUNC bool all(vec<T, N> v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <class T, int N>
METAL_FUNC bool any(vec<T, N> v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}

// select(a, b, c): c ? b : a, elementwise for vector conditions (bool vectors or comparison masks).
template <class T, enable_if_t<is_scalar_v<T>, int> = 0>
METAL_FUNC T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N>
METAL_FUNC vec<T, N> select(vec<T, N> a, vec<T, N> b, bool c) { return c ? b : a; }
template <class T, int N, class M>
METAL_FUNC vec<T, N> select(vec<T, N> a, vec<T, N> b, vec<M, N> c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? T(b[i]) : T(a[i]);
  return r;
}

// ---- geometric -------------------------------------------------------------------------------------
template <class T, int N>
METAL_FUNC T dot(vec<T, N> a, vec<T, N> b) {
  T s = T(a[0]) * T(b[0]);
  for (int i = 1; i < N; ++i) s += T(a[i]) * T(b[i]);
  return s;
}
template <class T, int N>
METAL_FUNC T length_squared(vec<T, N> a) { return dot(a, a); }
template <class T, int N>
METAL_FUNC T length(vec<T, N> a) { return sqrt(dot(a, a)); }
template <class T, int N>
METAL_FUNC T distance(vec<T, N> a, vec<T, N> b) { return length(a - b); }
template <class T, int N>
METAL_FUNC vec<T, N> normalize(vec<T, N> a) { return a * rsqrt(dot(a, a)); }
template <class T>
METAL_FUNC vec<T, 3> cross(vec<T, 3> a, vec<T, 3> b) {
  return vec<T, 3>{T(a.y * b.z - a.z * b.y), T(a.z * b.x - a.x * b.z), T(a.x * b.y - a.y * b.x)};
}

// ---- integer -----------------------------------------------------------------------------------------
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T popcount(T x) {
  return T(__builtin_popcountll((unsigned long long)(make_unsigned_t<T>)x));
}
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T clz(T x) {
  constexpr int bits = 8 * sizeof(T);
  unsigned long long u = (make_unsigned_t<T>)x;
  return u == 0 ? T(bits) : T(__builtin_clzll(u) - (64 - bits));
}
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T ctz(T x) {
  constexpr int bits = 8 * sizeof(T);
  unsigned long long u = (make_unsigned_t<T>)x;
  return u == 0 ? T(bits) : T(__builtin_ctzll(u));
}
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T mulhi(T a, T b) {
  if constexpr (sizeof(T) == 8) {
    using W = conditional_t<is_signed_v<T>, __int128, unsigned __int128>;
    return T(((W)a * (W)b) >> 64);
  } else {
    using W = conditional_t<is_signed_v<T>, long, ulong>;
    return T(((W)a * (W)b) >> (8 * sizeof(T)));
  }
}
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T mul24(T a, T b) { return a * b; }
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T mad24(T a, T b, T c) { return a * b + c; }
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T absdiff(T a, T b) { return a > b ? T(a - b) : T(b - a); }
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T addsat(T a, T b) {
  T r;
  if (__builtin_add_overflow(a, b, &r)) return (b > 0) ? numeric_limits<T>::max() : numeric_limits<T>::min();
  return r;
}
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T subsat(T a, T b) {
  T r;
  if (__builtin_sub_overflow(a, b, &r)) return (b > 0) ? numeric_limits<T>::min() : numeric_limits<T>::max();
  return r;
}
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T hadd(T a, T b) { return T((a >> 1) + (b >> 1) + (a & b & 1)); }
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T rhadd(T a, T b) { return T((a >> 1) + (b >> 1) + ((a | b) & 1)); }
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T rotate(T v, T i) {
  constexpr unsigned bits = 8 * sizeof(T);
  using U = make_unsigned_t<T>;
  unsigned s = unsigned(i) % bits;
  return s == 0 ? v : T((U(v) << s) | (U(v) >> (bits - s)));
}
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T reverse_bits(T x) {
  constexpr int bits = 8 * sizeof(T);
  using U = make_unsigned_t<T>;
  U u = U(x), r = 0;
  for (int i = 0; i < bits; ++i) r = U((r << 1) | ((u >> i) & 1));
  return T(r);
}
// extract_bits: `bits` bits starting at `offset`, sign-extended for signed types.
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T extract_bits(T x, uint offset, uint bits) {
  constexpr uint width = 8 * sizeof(T);
  if (bits == 0) return T(0);
  using U = make_unsigned_t<T>;
  U u = U(U(x) << (width - offset - bits));
  if constexpr (is_signed_v<T>)
    return T(T(u) >> (width - bits));
  else
    return T(u >> (width - bits));
}
template <class T, enable_if_t<__m::in<T>, int> = 0>
METAL_FUNC T insert_bits(T base, T insert, uint offset, uint bits) {
  constexpr uint width = 8 * sizeof(T);
  if (bits == 0) return base;
  using U = make_unsigned_t<T>;
  U mask = bits >= width ? U(~U(0)) : U(((U(1) << bits) - 1) << offset);
  return T((U(base) & ~mask) | ((U(insert) << offset) & mask));
}
MSLSIM_VEC1(popcount)
MSLSIM_VEC1(clz)
MSLSIM_VEC1(ctz)
MSLSIM_VEC2(mulhi)
MSLSIM_VEC2(absdiff)
MSLSIM_VEC2(addsat)
MSLSIM_VEC2(subsat)
MSLSIM_VEC2(hadd)
MSLSIM_VEC2(rhadd)
MSLSIM_VEC2(rotate)
MSLSIM_VEC1(reverse_bits)
template <class T, int N>
METAL_FUNC vec<T, N> extract_bits(vec<T, N> x, uint offset, uint bits) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = extract_bits(T(x[i]), offset, bits);
  return r;
}

#undef MSLSIM_F1
#undef MSLSIM_F2

// metal::fast and metal::precise name the same functions (the emulator uses libm for both).
#define MSLSIM_FAST_PRECISE                                                                                 \
  using metal::exp;                                                                                         \
  using metal::exp2;                                                                                        \
  using metal::exp10;                                                                                       \
  using metal::log;                                                                                         \
  using metal::log2;                                                                                        \
  using metal::log10;                                                                                       \
  using metal::sqrt;                                                                                        \
  using metal::rsqrt;                                                                                       \
  using metal::pow;                                                                                         \
  using metal::powr;                                                                                        \
  using metal::sin;                                                                                         \
  using metal::cos;                                                                                         \
  using metal::tan;                                                                                         \
  using metal::sinpi;                                                                                       \
  using metal::cospi;                                                                                       \
  using metal::asin;                                                                                        \
  using metal::acos;                                                                                        \
  using metal::atan;                                                                                        \
  using metal::atan2;                                                                                       \
  using metal::sinh;                                                                                        \
  using metal::cosh;                                                                                        \
  using metal::tanh;                                                                                        \
  using metal::floor;                                                                                       \
  using metal::ceil;                                                                                        \
  using metal::round;                                                                                       \
  using metal::rint;                                                                                        \
  using metal::trunc;                                                                                       \
  using metal::fabs;                                                                                        \
  using metal::abs;                                                                                         \
  using metal::fmin;                                                                                        \
  using metal::fmax;                                                                                        \
  using metal::min;                                                                                         \
  using metal::max;                                                                                         \
  using metal::clamp;                                                                                       \
  using metal::saturate;                                                                                    \
  using metal::fma;                                                                                         \
  using metal::fmod;                                                                                        \
  using metal::fract;                                                                                       \
  using metal::divide;                                                                                      \
  using metal::sincos;                                                                                      \
  using metal::length;                                                                                      \
  using metal::normalize;                                                                                   \
  using metal::distance;                                                                                    \
  using metal::dot;
namespace fast {
MSLSIM_FAST_PRECISE
}
namespace precise {
MSLSIM_FAST_PRECISE
}
#undef MSLSIM_FAST_PRECISE
}  // namespace metal
