// metal_stdlib shim, part 1: MSL scalar and vector types, type traits, numeric_limits, conversions
// (the vector constructors behind `float4(a, b)` and the cast helpers the rewriter calls), as_type.
// Included only through <metal_stdlib>; compiled by clang as C++17.
#pragma once

typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

namespace metal {

template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));

// ---- type traits (MSL's <metal_type_traits>) --------------------------------------------------------
template <class T, T v>
struct integral_constant {
  static constexpr T value = v;
  using value_type = T;
  constexpr operator T() const { return v; }
};
using true_type = integral_constant<bool, true>;
using false_type = integral_constant<bool, false>;
template <bool B>
using bool_constant = integral_constant<bool, B>;

template <class A, class B> struct is_same : false_type {};
template <class A> struct is_same<A, A> : true_type {};
template <class A, class B> constexpr bool is_same_v = is_same<A, B>::value;

template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;

template <bool B, class T, class F> struct conditional { using type = T; };
template <class T, class F> struct conditional<false, T, F> { using type = F; };
template <bool B, class T, class F> using conditional_t = typename conditional<B, T, F>::type;

template <class T> struct type_identity { using type = T; };
template <class T> using type_identity_t = typename type_identity<T>::type;

template <class T> struct remove_const { using type = T; };
template <class T> struct remove_const<const T> { using type = T; };
template <class T> struct remove_volatile { using type = T; };
template <class T> struct remove_volatile<volatile T> { using type = T; };
template <class T> struct remove_cv { using type = typename remove_volatile<typename remove_const<T>::type>::type; };
template <class T> using remove_cv_t = typename remove_cv<T>::type;
template <class T> struct remove_reference { using type = T; };
template <class T> struct remove_reference<T&> { using type = T; };
template <class T> struct remove_reference<T&&> { using type = T; };
template <class T> using remove_reference_t = typename remove_reference<T>::type;
template <class T> using remove_cvref_t = remove_cv_t<remove_reference_t<T>>;
template <class T> struct remove_pointer { using type = T; };
template <class T> struct remove_pointer<T*> { using type = T; };
template <class T> using remove_pointer_t = typename remove_pointer<T>::type;

template <class T> struct is_reference : false_type {};
template <class T> struct is_reference<T&> : true_type {};
template <class T> struct is_reference<T&&> : true_type {};
template <class T> constexpr bool is_reference_v = is_reference<T>::value;
template <class T> struct is_pointer : false_type {};
template <class T> struct is_pointer<T*> : true_type {};
template <class T> struct is_pointer<T* const> : true_type {};
template <class T> constexpr bool is_pointer_v = is_pointer<T>::value;
template <class T> struct is_const : false_type {};
template <class T> struct is_const<const T> : true_type {};
template <class T> constexpr bool is_const_v = is_const<T>::value;

template <class T> struct __is_fp : false_type {};
template <> struct __is_fp<float> : true_type {};
template <> struct __is_fp<half> : true_type {};
template <> struct __is_fp<bfloat> : true_type {};
template <> struct __is_fp<double> : true_type {};
template <class T> struct is_floating_point : __is_fp<remove_cv_t<T>> {};
template <class T> constexpr bool is_floating_point_v = is_floating_point<T>::value;

template <class T> struct __is_int : false_type {};
#define MSLSIM_INT(T) \
  template <>         \
  struct __is_int<T> : true_type {};
MSLSIM_INT(bool)
MSLSIM_INT(char)
MSLSIM_INT(signed char)
MSLSIM_INT(unsigned char)
MSLSIM_INT(short)
MSLSIM_INT(unsigned short)
MSLSIM_INT(int)
MSLSIM_INT(unsigned int)
MSLSIM_INT(long)
MSLSIM_INT(unsigned long)
MSLSIM_INT(long long)
MSLSIM_INT(unsigned long long)
#undef MSLSIM_INT
template <class T> struct is_integral : __is_int<remove_cv_t<T>> {};
template <class T> constexpr bool is_integral_v = is_integral<T>::value;
template <class T> struct is_arithmetic : bool_constant<is_integral_v<T> || is_floating_point_v<T>> {};
template <class T> constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> struct is_scalar : is_arithmetic<T> {};
template <class T> constexpr bool is_scalar_v = is_scalar<T>::value;
template <class T> struct is_signed : bool_constant<is_arithmetic_v<T> && (T(-1) < T(0))> {};
template <class T> constexpr bool is_signed_v = is_signed<T>::value;
template <class T> struct is_unsigned : bool_constant<is_integral_v<T> && !(T(-1) < T(0))> {};
template <class T> constexpr bool is_unsigned_v = is_unsigned<T>::value;

template <class T> struct is_vector : false_type {};
template <class T, int N> struct is_vector<vec<T, N>> : true_type {};
template <class T> constexpr bool is_vector_v = is_vector<remove_cv_t<T>>::value;

template <class T> struct vec_elements : integral_constant<int, 1> {};
template <class T, int N> struct vec_elements<vec<T, N>> : integral_constant<int, N> {};

template <class T> struct make_unsigned { using type = T; };
template <> struct make_unsigned<char> { using type = uchar; };
template <> struct make_unsigned<signed char> { using type = uchar; };
template <> struct make_unsigned<short> { using type = ushort; };
template <> struct make_unsigned<int> { using type = uint; };
template <> struct make_unsigned<long> { using type = ulong; };
template <class T> using make_unsigned_t = typename make_unsigned<T>::type;
template <class T> struct make_signed { using type = T; };
template <> struct make_signed<uchar> { using type = signed char; };
template <> struct make_signed<ushort> { using type = short; };
template <> struct make_signed<uint> { using type = int; };
template <> struct make_signed<ulong> { using type = long; };
template <class T> using make_signed_t = typename make_signed<T>::type;

template <class T> T&& declval() noexcept;

// ---- numeric_limits ------------------------------------------------------------------------------
template <class T> struct numeric_limits {
  static constexpr bool is_specialized = false;
};

template <class T, bool Signed, int Digits, T Min, T Max>
struct __int_limits {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = Signed;
  static constexpr bool is_integer = true;
  static constexpr bool is_exact = true;
  static constexpr bool has_infinity = false;
  static constexpr bool has_quiet_NaN = false;
  static constexpr int digits = Digits;
  static constexpr int radix = 2;
  static constexpr T min() { return Min; }
  static constexpr T max() { return Max; }
  static constexpr T lowest() { return Min; }
  static constexpr T epsilon() { return 0; }
};
template <> struct numeric_limits<bool> : __int_limits<bool, false, 1, false, true> {};
template <> struct numeric_limits<char> : __int_limits<char, true, 7, -128, 127> {};
template <> struct numeric_limits<signed char> : __int_limits<signed char, true, 7, -128, 127> {};
template <> struct numeric_limits<uchar> : __int_limits<uchar, false, 8, 0, 255> {};
template <> struct numeric_limits<short> : __int_limits<short, true, 15, -32768, 32767> {};
template <> struct numeric_limits<ushort> : __int_limits<ushort, false, 16, 0, 65535> {};
template <> struct numeric_limits<int> : __int_limits<int, true, 31, -2147483647 - 1, 2147483647> {};
template <> struct numeric_limits<uint> : __int_limits<uint, false, 32, 0, 4294967295u> {};
template <> struct numeric_limits<long> : __int_limits<long, true, 63, -9223372036854775807L - 1, 9223372036854775807L> {};
template <> struct numeric_limits<ulong> : __int_limits<ulong, false, 64, 0, 18446744073709551615ul> {};

template <class T, class Bits, int Digits, Bits MaxB, Bits MinB, Bits EpsB, Bits InfB, Bits NanB, Bits DenB>
struct __fp_limits {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = Digits;
  static constexpr int radix = 2;
  static constexpr T max() { return __builtin_bit_cast(T, MaxB); }
  static constexpr T min() { return __builtin_bit_cast(T, MinB); }
  static constexpr T lowest() { return -max(); }
  static constexpr T epsilon() { return __builtin_bit_cast(T, EpsB); }
  static constexpr T infinity() { return __builtin_bit_cast(T, InfB); }
  static constexpr T quiet_NaN() { return __builtin_bit_cast(T, NanB); }
  static constexpr T signaling_NaN() { return quiet_NaN(); }
  static constexpr T denorm_min() { return __builtin_bit_cast(T, DenB); }
};
template <> struct numeric_limits<float>
    : __fp_limits<float, uint, 24, 0x7F7FFFFFu, 0x00800000u, 0x34000000u, 0x7F800000u, 0x7FC00000u, 1u> {};
template <> struct numeric_limits<half>
    : __fp_limits<half, ushort, 11, 0x7BFF, 0x0400, 0x1400, 0x7C00, 0x7E00, 1> {};
template <> struct numeric_limits<bfloat>
    : __fp_limits<bfloat, ushort, 8, 0x7F7F, 0x0080, 0x3C00, 0x7F80, 0x7FC0, 1> {};
template <class T> struct numeric_limits<const T> : numeric_limits<T> {};

}  // namespace metal

// ---- vector typedefs (global, as in MSL, and in namespace metal) ---------------------------------------
#define MSLSIM_VEC_TYPEDEFS(T, name)    \
  typedef metal::vec<T, 2> name##2;     \
  typedef metal::vec<T, 3> name##3;     \
  typedef metal::vec<T, 4> name##4;     \
  namespace metal {                     \
  using ::name##2;                      \
  using ::name##3;                      \
  using ::name##4;                      \
  }
MSLSIM_VEC_TYPEDEFS(float, float)
MSLSIM_VEC_TYPEDEFS(half, half)
MSLSIM_VEC_TYPEDEFS(bfloat, bfloat)
MSLSIM_VEC_TYPEDEFS(int, int)
MSLSIM_VEC_TYPEDEFS(uint, uint)
MSLSIM_VEC_TYPEDEFS(short, short)
MSLSIM_VEC_TYPEDEFS(ushort, ushort)
MSLSIM_VEC_TYPEDEFS(char, char)
MSLSIM_VEC_TYPEDEFS(uchar, uchar)
MSLSIM_VEC_TYPEDEFS(long, long)
MSLSIM_VEC_TYPEDEFS(ulong, ulong)
MSLSIM_VEC_TYPEDEFS(bool, bool)
#undef MSLSIM_VEC_TYPEDEFS

// Packed vectors: element alignment instead of vector alignment (2 and 4 elements only).
#define MSLSIM_PACKED(T, name)                                                  \
  typedef T packed_##name##2 __attribute__((ext_vector_type(2), aligned(sizeof(T)))); \
  typedef T packed_##name##4 __attribute__((ext_vector_type(4), aligned(sizeof(T))));
MSLSIM_PACKED(float, float)
MSLSIM_PACKED(half, half)
MSLSIM_PACKED(bfloat, bfloat)
MSLSIM_PACKED(int, int)
MSLSIM_PACKED(uint, uint)
MSLSIM_PACKED(short, short)
MSLSIM_PACKED(ushort, ushort)
MSLSIM_PACKED(char, char)
MSLSIM_PACKED(uchar, uchar)
#undef MSLSIM_PACKED

namespace metal {
using ::half;
using ::bfloat;
using ::uint;
using ::ushort;
using ::uchar;
using ::ulong;

template <class T, class U>
METAL_FUNC T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type: the two types must have the same size");
  return __builtin_bit_cast(T, x);
}
}  // namespace metal

// ---- conversions -----------------------------------------------------------------------------------
namespace mslsim {
using metal::vec;

template <class T> struct vinfo {
  static constexpr int n = 1;
  static constexpr bool is_vec = false;
  using elem = T;
};
template <class T, int N> struct vinfo<vec<T, N>> {
  static constexpr int n = N;
  static constexpr bool is_vec = true;
  using elem = T;
};

// One scalar converted the MSL way. clang refuses half <-> bfloat directly; MSL's conversion is exact
// through float for both directions' representable values, so it goes through float.
template <class T, class U>
METAL_FUNC constexpr T cvt(U x) {
  if constexpr (metal::is_same_v<T, bool>)
    return x != U(0);
  else if constexpr ((metal::is_same_v<T, half> && metal::is_same_v<U, bfloat>) ||
                     (metal::is_same_v<T, bfloat> && metal::is_same_v<U, half>))
    return T(float(x));
  else
    return T(x);
}

template <class T, int N, class V>
METAL_FUNC vec<T, N> convert_vec(V v) {
  using E = typename vinfo<V>::elem;
  static_assert(vinfo<V>::n == N, "vector conversion between different element counts");
  if constexpr (metal::is_same_v<E, T>) {
    return v;
  } else if constexpr (metal::is_same_v<T, bool> || metal::is_same_v<E, bool> ||
                       metal::is_same_v<T, bfloat> || metal::is_same_v<E, bfloat>) {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = cvt<T>(E(v[i]));
    return r;
  } else {
    return __builtin_convertvector(v, vec<T, N>);
  }
}

template <class T, class A>
METAL_FUNC void vput_one(T* out, int& k, A a) {
  if constexpr (vinfo<A>::is_vec) {
    for (int i = 0; i < vinfo<A>::n; ++i) out[k++] = cvt<T>(typename vinfo<A>::elem(a[i]));
  } else {
    out[k++] = cvt<T>(a);
  }
}

// `float4(...)` and friends: a scalar splats, a vector of the same size converts, anything else is a
// concatenation of scalars and vectors whose element counts must add up to N.
template <class T, int N, class... A>
METAL_FUNC vec<T, N> make_vec(A... a) {
  if constexpr (sizeof...(A) == 0) {
    return vec<T, N>(T(0));
  } else if constexpr (sizeof...(A) == 1 && !(vinfo<A>::is_vec || ...)) {
    return vec<T, N>(cvt<T>(a...));
  } else if constexpr (sizeof...(A) == 1) {
    return convert_vec<T, N>(a...);
  } else {
    static_assert((vinfo<A>::n + ...) == N, "vector constructor: element counts do not add up");
    T tmp[N];
    int k = 0;
    (vput_one<T>(tmp, k, a), ...);
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = tmp[i];
    return r;
  }
}

template <class T, class U>
METAL_FUNC T make_scalar(U x) {
  return cvt<T>(x);
}
template <class T>
METAL_FUNC T make_scalar() {
  return T(0);
}

// The rewriter turns `static_cast<T>(x)` (T neither a pointer nor a reference) into this: MSL's
// static_cast converts vectors element by element, where a C++ cast between clang vectors would
// reinterpret the bits.
template <class T, class U>
METAL_FUNC constexpr T msl_static_cast(U x) {
  if constexpr (vinfo<T>::is_vec && vinfo<U>::is_vec)
    return convert_vec<typename vinfo<T>::elem, vinfo<T>::n>(x);
  else if constexpr (!vinfo<T>::is_vec && !vinfo<U>::is_vec && metal::is_arithmetic_v<T> &&
                     metal::is_arithmetic_v<U>)
    return cvt<T>(x);
  else
    return static_cast<T>(x);
}

// Address-space stripping: libmslsim and the collectives work on plain pointers.
template <class T>
METAL_FUNC void* raw(T* p) {
  return (void*)p;
}
}  // namespace mslsim
