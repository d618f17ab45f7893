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

// Whether the kernel may write through a buffer argument: the pointee (or referenced object) is not const.
// The rewriter handles the `constant` address space itself (its objects are read-only either way).
template <class P>
constexpr int arg_writes() {
  if constexpr (metal::is_reference_v<P>)
    return !metal::is_const_v<metal::remove_reference_t<P>>;
  else if constexpr (metal::is_pointer_v<P>)
    return !metal::is_const_v<metal::remove_pointer_t<metal::remove_cv_t<P>>>;
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

// Static threadgroup memory bookkeeping (see mslsim_tg_register): tg_key<Tag> is a unique address per tag
// type; fn_tag<&f<T>> tags one kernel instantiation, a rewriter-declared struct tags a helper function.
// tg_static<...>::reg has a dynamic initializer that runs when the library is loaded, because the
// declaration's rewritten code names it (which instantiates it), whether or not that code ever runs.
template <auto F>
struct fn_tag {};
template <class Tag>
struct tg_key {
  static const char id;
};
template <class Tag>
const char tg_key<Tag>::id = 0;
template <class Tag, int Decl, size_t Size>
struct tg_static {
  static const int reg;
};
template <class Tag, int Decl, size_t Size>
const int tg_static<Tag, Decl, Size>::reg = (::mslsim_tg_register(&tg_key<Tag>::id, Decl, Size), 0);
template <class... Tags>
size_t tg_static_bytes() {
  const void* keys[] = {&tg_key<Tags>::id..., nullptr};
  return ::mslsim_tg_static_bytes(keys, (int)sizeof...(Tags));
}
}  // namespace mslsim
