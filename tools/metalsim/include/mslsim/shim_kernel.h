// metal_stdlib shim, part 4: helpers for the code msl2cpp.py generates around kernels: the per-kernel
// entry thunk (binding buffer / threadgroup arguments and builtin attributes to the kernel's parameters)
// and the storage of `threadgroup T x[N];` declarations.
#pragma once

namespace mslsim {
template <int I, class... A>
struct type_at;
template <class H, class... A>
struct type_at<0, H, A...> {
  using type = H;
};
template <int I, class H, class... A>
struct type_at<I, H, A...> {
  using type = typename type_at<I - 1, A...>::type;
};

template <class F>
struct fn_traits;
template <class R, class... A>
struct fn_traits<R(A...)> {
  template <int I>
  using arg = typename type_at<I, A...>::type;
};
// Type of parameter I of the kernel function type F (address-space qualifiers included).
template <class F, int I>
using param_t = typename fn_traits<F>::template arg<I>;

// A [[buffer(i)]] / [[threadgroup(i)]] argument: a pointer, or a reference to the pointee.
template <class P>
METAL_FUNC P bind_arg(void* p) {
  if constexpr (metal::is_reference_v<P>)
    return *(metal::remove_reference_t<P>*)p;
  else
    return (P)p;
}

// Bytes a binding must have at least: the referenced object for references, unknown (0) for pointers.
template <class P>
constexpr size_t arg_min_bytes() {
  if constexpr (metal::is_reference_v<P>)
    return sizeof(metal::remove_reference_t<P>);
  else
    return 0;
}

// A builtin attribute value (uint[3] in libmslsim) as the parameter's declared type: a scalar takes x,
// a 2- or 3-vector takes the leading components.
template <class P>
METAL_FUNC P builtin_arg(const uint32_t* v) {
  using Q = metal::remove_cvref_t<P>;
  if constexpr (vinfo<Q>::is_vec) {
    Q r;
    for (int i = 0; i < vinfo<Q>::n; ++i) r[i] = (typename vinfo<Q>::elem)v[i];
    return r;
  } else {
    return (Q)v[0];
  }
}
}  // namespace mslsim
