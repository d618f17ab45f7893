"""The MSL lint (tools/metalsim/lint.py).

Each planted source marks the lines that must be flagged with a comment `// expect(rule)`. The lint
strips comments before it matches, so the marker never influences the result. Each test compares the
exact set of (line, rule) pairs, so a missing finding and an extra finding both fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from metalsim import lint  # noqa: E402

EXPECT_RE = re.compile(r"expect\(([\w\-, ]+)\)")


def src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def expected(text: str) -> set[tuple[int, str]]:
    out = set()
    for n, line in enumerate(text.splitlines(), 1):
        for m in EXPECT_RE.finditer(line):
            out.update((n, r.strip()) for r in m.group(1).split(","))
    return out


def found(text: str, filename: str = "t.metal") -> set[tuple[int, str]]:
    return {(f.line, f.rule) for f in lint.check_source(text, filename)}


def assert_exact(text: str) -> None:
    want, got = expected(text), found(text)
    assert got == want, "\n".join(
        [f"missing: {sorted(want - got)}", f"unexpected: {sorted(got - want)}"]
        + [str(f) for f in lint.check_source(text, "t.metal")])


# --------------------------------------------------------------------------------------------------
# One planted source per rule
# --------------------------------------------------------------------------------------------------

PLANTED = {
    "std-namespace": """
        #include <metal_stdlib>
        using namespace metal;
        using namespace std;                        // expect(std-namespace)
        kernel void k(device float* o [[buffer(0)]]) {
          o[0] = std::max(1.0f, 2.0f);              // expect(std-namespace)
          o[1] = metal::max(1.0f, 2.0f);
          float std_dev = 0.0f; o[2] = std_dev;
        }
        """,
    "std-include": """
        #include <metal_stdlib>
        #include <metal_simdgroup_matrix>
        #include <cmath>                            // expect(std-include)
        #include   <stdint.h>                       // expect(std-include)
        #include "local_header.h"
        #include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>   // expect(std-include)
        #if defined(LILY_METAL4)
        #include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
        #endif
        """,
    "exceptions": """
        kernel void k(device float* o [[buffer(0)]]) {
          try {                                     // expect(exceptions)
            throw 1;                                // expect(exceptions)
          } catch (...) {                           // expect(exceptions)
          }
        }
        """,
    "recursion": """
        float fact(float x) {
          return x <= 1.0f ? 1.0f : x * fact(x - 1.0f);   // expect(recursion)
        }
        struct S {
          int depth(int n) const { return n == 0 ? 0 : 1 + depth(n - 1); }   // expect(recursion)
        };
        float ping(int n);
        float pong(int n) { return n > 0 ? ping(n - 1) : 0.0f; }   // expect(recursion)
        float ping(int n) { return n > 0 ? pong(n - 1) : 1.0f; }
        // Not recursion: overloads, template instantiations, metal:: calls, builtin overloads.
        inline float sq(float x) { return x * x; }
        inline float sq(float2 v, float w) { return sq(v.x) + sq(v.y) + w; }
        template <int N> float tsum(thread const float* x) {
          if constexpr (N == 1) { return x[0]; } else { return x[0] + tsum<N - 1>(x + 1); }
        }
        inline float exp(float x, float s) { return metal::exp(x) * s; }
        struct Pair { float a; float b; };
        inline Pair simd_shuffle_down(Pair p, ushort d) {
          return Pair{simd_shuffle_down(p.a, d), simd_shuffle_down(p.b, d)};
        }
        """,
    "virtual": """
        struct Op {
          virtual float apply(float x) const;       // expect(virtual)
        };
        """,
    "rtti": """
        struct A { int x; };
        kernel void k(device float* o [[buffer(0)]]) {
          thread A a;
          auto& t = typeid(a);                        // expect(rtti)
          thread A* p = dynamic_cast<thread A*>(&a);  // expect(rtti)
        }
        """,
    "dynamic-alloc": """
        struct NoCopy { NoCopy(const thread NoCopy&) = delete; };
        kernel void k(device float* o [[buffer(0)]]) {
          thread float* p = new float[4];           // expect(dynamic-alloc)
          delete[] p;                               // expect(dynamic-alloc)
          thread void* q = malloc(16);              // expect(dynamic-alloc)
          free(q);                                  // expect(dynamic-alloc)
          uint free_slots = 3; o[0] = free_slots;
        }
        """,
    "double": """
        kernel void k(device float* o [[buffer(0)]]) {
          double d = 1.0;                           // expect(double)
          long double e = 2.0;                      // expect(double)
          o[0] = float(d + e);
          float double_buffered = 0.0f; o[1] = double_buffered;
        }
        """,
    "thread-local": """
        kernel void k(device float* o [[buffer(0)]]) {
          thread_local float cache = 0.0f;          // expect(thread-local)
          o[0] = cache;
        }
        """,
    "mutable-global": """
        #define MTL_CONST static constant constexpr const
        float g_scale = 1.0f;                       // expect(mutable-global)
        static int g_count;                         // expect(mutable-global)
        threadgroup float g_tg[32];                 // expect(mutable-global)
        constant float k_ok = 2.0f;
        constexpr int k_rows = 4;
        static constant constexpr int k_cols = 8;
        MTL_CONST int k_simd = 32;
        constant bool has_bias [[function_constant(0)]];
        float declared_function(float x);
        struct P {
          float not_static;
          static float s;                           // expect(mutable-global)
          static constant constexpr int N = 4;
          static float helper(float x) { return x; }
        };
        kernel void k(device float* o [[buffer(0)]]) {
          static float acc = 0.0f;                  // expect(mutable-global)
          static constexpr float two = 2.0f;
          constexpr float three = 3.0f;
          o[0] = acc + two + three;
        }
        """,
    "function-pointer": """
        inline float twice(float x) { return 2.0f * x; }
        typedef float (*unary_fn)(float);           // expect(function-pointer)
        using unary_fn2 = float (*)(float);         // expect(function-pointer)
        template <float (*F)(float)> float apply_t(float x) { return F(x); }
        struct Functor {
          float operator()(float x) const { return x; }
          float call(float x) const { return (*this)(x); }
        };
        kernel void k(device float* o [[buffer(0)]]) {
          float (*fp)(float) = twice;               // expect(function-pointer)
          float arr[4] = {0, 1, 2, 3};
          thread float (&ref)[4] = arr;
          o[0] = fp(1.0f) + ref[0] + apply_t<twice>(1.0f);
        }
        """,
    "goto": """
        kernel void k(device float* o [[buffer(0)]]) {
          goto done;                                // expect(goto)
        done:
          o[0] = 1.0f;
        }
        """,
    "printf": """
        kernel void k(device float* o [[buffer(0)]]) {
          printf("%f", o[0]);                       // expect(printf)
        }
        """,
    "bfloat-from-half": """
        struct Q { half hs; float fs; };
        half hfun(half x) { return x; }
        kernel void k(device bfloat* o [[buffer(0)]],
                      device const half* hx [[buffer(1)]],
                      device const half4* h4 [[buffer(2)]],
                      constant Q& q [[buffer(3)]],
                      uint i [[thread_position_in_grid]]) {
          half h = hx[i];
          float f = 2.0f;
          o[0] = bfloat(h);                         // expect(bfloat-from-half)
          o[1] = bfloat(hx[i + 1]);                 // expect(bfloat-from-half)
          o[2] = static_cast<bfloat>(h);            // expect(bfloat-from-half)
          o[3] = (bfloat)h;                         // expect(bfloat-from-half)
          o[4] = bfloat(half(f));                   // expect(bfloat-from-half)
          o[5] = bfloat(as_type<half>(ushort(7)));  // expect(bfloat-from-half)
          o[6] = bfloat(1.5h);                      // expect(bfloat-from-half)
          o[7] = bfloat(q.hs);                      // expect(bfloat-from-half)
          o[8] = bfloat(hfun(h));                   // expect(bfloat-from-half)
          o[9] = bfloat(h * 2);                     // expect(bfloat-from-half)
          bfloat4 b4 = bfloat4(h4[0]);              // expect(bfloat-from-half)
          bfloat2 b2 = bfloat2(h4[0].xy);           // expect(bfloat-from-half)
          auto ah = half(f);
          o[10] = bfloat(ah);                       // expect(bfloat-from-half)
          // Fine: through float, from float, bit casts, half*float (float).
          o[11] = bfloat(float(h));
          o[12] = bfloat(f);
          o[13] = bfloat(q.fs);
          o[14] = static_cast<bfloat>(float(h));
          o[15] = as_type<bfloat>(as_type<ushort>(h));
          o[16] = bfloat(h * f);
          o[17] = bfloat(b4.x) + bfloat(b2.y);
        }
        """,
    "divergent-collective": """
        inline void sync_tg() { threadgroup_barrier(mem_flags::mem_threadgroup); }
        inline float tg_sum(float v) { sync_tg(); return simd_sum(v); }
        kernel void k(device float* o [[buffer(0)]],
                      constant uint& n [[buffer(1)]],
                      uint gid [[thread_position_in_grid]],
                      uint lid [[thread_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint q [[thread_index_in_quadgroup]]) {
          float v = o[gid];
          if (gid < n) {
            v = simd_sum(v);                                     // expect(divergent-collective)
          }
          uint row = lid * 4 + 1;
          if (row < n) threadgroup_barrier(mem_flags::mem_threadgroup);   // expect(divergent-collective)
          for (uint i = lane; i < n; i += 32) {
            v += simd_shuffle_xor(v, 1);                         // expect(divergent-collective)
          }
          v = lane < 16 ? simd_max(v) : 0.0f;                    // expect(divergent-collective)
          bool any = lane < 8 && simd_any(v > 0.0f);             // expect(divergent-collective)
          if (sg == 0) {
            threadgroup_barrier(mem_flags::mem_none);            // expect(divergent-collective)
            v = simd_sum(v);
          }
          if (q == 0) { v = quad_sum(v); }                       // expect(divergent-collective)
          if (lane == 0) { v = tg_sum(v); }                      // expect(divergent-collective)
          while (v < float(lid)) {
            simdgroup_barrier(mem_flags::mem_none);              // expect(divergent-collective)
            v += 1.0f;
          }
          // Uniform: simd_sum's result, loops over uniform bounds, per-simdgroup conditions for simd ops.
          float s = simd_sum(v);
          if (s > 0.0f) { v = simd_max(v); }
          for (uint r = 0; r < 4; ++r) { v += simd_sum(v); }
          o[gid] = v + float(any);
        }
        """,
    "early-return-collective": """
        kernel void k(device float* o [[buffer(0)]],
                      constant uint& n [[buffer(1)]],
                      uint gid [[thread_position_in_grid]],
                      uint lane [[thread_index_in_simdgroup]]) {
          float v = 0.0f;
          for (uint i = 0; i < 8; ++i) {
            if (lane == i) continue;
            v += simd_sum(v);                                    // expect(early-return-collective)
          }
          for (uint i = 0; i < 8; ++i) {
            v += simd_max(v);                                    // expect(early-return-collective)
            if (lane == i) break;
          }
          uint idx = gid;
          if (idx >= n) return;
          v = o[idx];
          v = simd_sum(v);                                       // expect(early-return-collective)
          threadgroup_barrier(mem_flags::mem_device);            // expect(early-return-collective)
          o[idx] = v;
        }
        """,
}


def test_every_rule_has_a_planted_case():
    rules = set(lint.RULES) - {"bad-suppression"}
    assert rules == set(PLANTED)


@pytest.mark.parametrize("rule", sorted(PLANTED))
def test_planted(rule):
    text = src(PLANTED[rule])
    assert any(r == rule for _, r in expected(text))
    assert_exact(text)


def test_finding_format_and_columns():
    text = "kernel void k(device float* o [[buffer(0)]]) {\n  o[0] = 1.0f;  double d = 2.0;\n}\n"
    (f,) = lint.check_source(text, "dir/x.metal")
    assert (f.file, f.line, f.col, f.rule) == ("dir/x.metal", 2, 17, "double")
    assert str(f) == f"dir/x.metal:2:17: double: {f.message}"
    assert f.message


def test_comments_and_strings_are_ignored_and_lines_kept():
    text = src("""
        /* std::vector<double> v; throw; goto x;
           virtual new delete malloc( printf( */
        // double thread_local typeid
        constant char msg[] = "std::max double goto throw";
        kernel void k(device float* o [[buffer(0)]]) {
          o[0] = 1.0f; /* double */ o[1] = 'd';
          double d = 0;   // expect(double)
        }
        """)
    assert_exact(text)


def test_code_the_metal_compiler_never_sees_is_skipped():
    text = src("""
        #ifndef __METAL_VERSION__
        #include <cstdint>
        struct HostOnly { double d; virtual ~HostOnly(); };
        static int host_counter = 0;
        #else
        #include <metal_stdlib>
        #endif
        #if !defined(__METAL_VERSION__)
        #include <vector>
        #endif
        #ifdef __METAL_VERSION__
        using namespace metal;
        #else
        #include <cmath>
        #endif
        #if 0
        double old_code;
        #endif
        #if defined(SOME_FEATURE)
        double d2;                                  // expect(double, mutable-global)
        #endif
        struct Shared { uint n; float eps; };
        """)
    assert_exact(text)


def test_shadowed_loop_variables_do_not_leak_lane_dependence():
    text = src("""
        kernel void k(device float* o [[buffer(0)]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
          float v = 0.0f;
          for (int i = sg; i < 64; i += 4) { v += o[i]; }
          for (int i = 0; i < 4; i++) { threadgroup_barrier(mem_flags::mem_threadgroup); }
          for (int i = lane; i < 64; i += 32) { v += o[i]; }
          for (int i = 0; i < 4; i++) { v += simd_sum(v); }
          if (sg == 0) { v = simd_sum(v); }
          o[lane] = v;
        }
        """)
    assert_exact(text)


def test_bfloat_rule_does_not_guess_types():
    text = src("""
        struct S { half x; half hs; };
        half proto(half y);
        template <typename T>
        kernel void k(device bfloat* o [[buffer(0)]], device const float4* v [[buffer(1)]],
                      constant S& s [[buffer(2)]], constant T& y [[buffer(3)]]) {
          o[0] = bfloat(v[0].x);
          o[1] = bfloat(y);
          o[2] = bfloat(s.hs);                      // expect(bfloat-from-half)
          float h = 1.0f;
          o[3] = bfloat(h);
        }
        kernel void k2(device bfloat* o [[buffer(0)]], device const half* h [[buffer(1)]]) {
          o[0] = bfloat(h[0]);                      // expect(bfloat-from-half)
        }
        """)
    assert_exact(text)


# --------------------------------------------------------------------------------------------------
# Suppressions
# --------------------------------------------------------------------------------------------------


def test_suppression_same_line_and_line_above():
    text = src("""
        kernel void k(device float* o [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
          double a = 1.0;   // lint: allow(double) host-side reference value, never compiled for the GPU
          // lint: allow(divergent-collective) every lane of this simdgroup takes the branch
          if (lane < 32) { o[0] = simd_sum(o[1]); }
          double b = 2.0;   /* lint: allow(double, goto) block comment form, with a reason */
          double c = 3.0;   // expect(double)
          o[2] = float(a + b + c);
        }
        """)
    assert_exact(text)


def test_suppression_requires_a_reason():
    text = (
        "kernel void k(device float* o [[buffer(0)]]) {\n"
        "  double a = 1.0;   // lint: allow(double)\n"
        "  double b = 1.0;   /* lint: allow(double)  */\n"
        "  // lint: allow(double) -\n"
        "  double c = 1.0;\n"
        "  o[0] = float(a + b + c);\n"
        "}\n")
    got = found(text)
    assert got == {(2, "double"), (2, "bad-suppression"), (3, "double"), (3, "bad-suppression"),
                   (4, "bad-suppression"), (5, "double")}
    msgs = [f.message for f in lint.check_source(text, "t.metal") if f.rule == "bad-suppression"]
    assert all("reason" in m for m in msgs)


def test_prose_mentioning_the_syntax_is_not_a_suppression():
    text = src("""
        // Suppress with `// lint: allow(rule) reason` on the line.
        kernel void k(device float* o [[buffer(0)]]) {
          double a = 1.0;   // note: lint: allow(double) is not at the start here   expect(double)
          o[0] = float(a);
        }
        """)
    assert_exact(text)


def test_suppression_of_another_rule_or_unknown_rule_does_not_hide():
    text = src("""
        kernel void k(device float* o [[buffer(0)]]) {
          double a = 1.0;   // lint: allow(goto) wrong rule named here            expect(double)
          double b = 1.0;   // lint: allow(dubble) typo in the rule name          expect(double, bad-suppression)
          o[0] = float(a + b);
        }
        """)
    assert_exact(text)


# --------------------------------------------------------------------------------------------------
# Idiomatic MSL: no findings
# --------------------------------------------------------------------------------------------------

IDIOMATIC = """
    // Idiomatic MSL (MLX/llama.cpp style). std::max in a comment, "double" in a string.
    #include <metal_stdlib>
    #include <metal_simdgroup>
    #include <metal_simdgroup_matrix>
    #include "lily_shared.h"
    using namespace metal;

    #define MTL_CONST static constant constexpr const
    MTL_CONST int SIMD_SIZE = 32;
    constant constexpr float kEps = 1e-6f;
    constant bool has_bias [[function_constant(0)]];
    static constant constexpr int kRows = 4;

    struct Params {
      uint rows;
      uint cols;
      float eps;
      static constant constexpr int kMax = 8;
      float twice() const thread { return eps * 2.0f; }
    };
    static_assert(sizeof(Params) == 12, "host/MSL layout must match");

    enum class Mode : uint { A = 0, B = 1 };

    template <typename T>
    METAL_FUNC T square(T x) { return x * x; }

    inline float square(float2 v) { return square(v.x) + square(v.y); }

    inline float block_sum(float v, threadgroup float* shm, uint lane, uint sg, uint nsg) {
      v = simd_sum(v);
      if (lane == 0) { shm[sg] = v; }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      v = lane < nsg ? shm[lane] : 0.0f;
      return simd_sum(v);
    }

    template <typename T>
    [[kernel]] void rms_norm(device const T* x [[buffer(0)]],
                             device const T* w [[buffer(1)]],
                             device T* out [[buffer(2)]],
                             constant Params& p [[buffer(3)]],
                             uint row [[threadgroup_position_in_grid]],
                             uint lid [[thread_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint tg_size [[threads_per_threadgroup]]) {
      threadgroup float shm[32];
      float acc = 0.0f;
      device const T* xr = x + row * p.cols;
      for (uint i = lid; i < p.cols; i += tg_size) {
        float v = float(xr[i]);
        acc += v * v;
      }
      acc = simd_sum(acc);
      if (lane == 0) { shm[sg] = acc; }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (sg == 0) {
        acc = simd_sum(lane < (tg_size + 31) / 32 ? shm[lane] : 0.0f);
        if (lane == 0) { shm[0] = acc; }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      float inv = metal::rsqrt(shm[0] / float(p.cols) + p.eps);
      acc = block_sum(acc, shm, lane, sg, tg_size / 32);
      for (uint i = lid; i < p.cols; i += tg_size) {
        out[row * p.cols + i] = T(float(xr[i]) * inv * float(w[i]));
      }
    }

    template [[host_name("rms_norm_float")]] [[kernel]] decltype(rms_norm<float>) rms_norm<float>;
    template [[host_name("rms_norm_half")]] [[kernel]] decltype(rms_norm<half>) rms_norm<half>;
    template [[host_name("rms_norm_bfloat")]] [[kernel]] decltype(rms_norm<bfloat>) rms_norm<bfloat>;

    kernel void axpy(device float* y [[buffer(0)]],
                     device const float* x [[buffer(1)]],
                     constant float& a [[buffer(2)]],
                     constant uint& n [[buffer(3)]],
                     uint tid [[thread_position_in_grid]]) {
      if (tid >= n) return;
      y[tid] = a * x[tid] + y[tid];
    }

    kernel void qmv4(device const uint32_t* w [[buffer(0)]],
                     device const bfloat* scales [[buffer(1)]],
                     device const bfloat* biases [[buffer(2)]],
                     device const half* x [[buffer(3)]],
                     device half* y [[buffer(4)]],
                     constant uint& in_dim [[buffer(5)]],
                     constant uint& out_dim [[buffer(6)]],
                     uint3 tgid [[threadgroup_position_in_grid]],
                     uint sg [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
      const uint out_row = (tgid.x * 2 + sg) * kRows;
      const bool row_ok = out_row < out_dim;
      float acc[kRows] = {0, 0, 0, 0};
      for (uint k = lane * 8; k < in_dim; k += 32 * 8) {
        half4 xa = *(device const half4*)(x + k);
        for (int r = 0; r < kRows; ++r) {
          uint word = row_ok ? w[((out_row + r) * in_dim + k) / 8] : 0u;
          float s = float(scales[((out_row + r) * in_dim + k) / 64]);
          float b = float(biases[((out_row + r) * in_dim + k) / 64]);
          bfloat hb = bfloat(float(xa.x));
          acc[r] += (s * float(word & 0xF) + b) * float(xa.x) + float(hb);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        float v = simd_sum(acc[r]);
        if (lane == 0 && row_ok) { y[out_row + r] = half(v); }
      }
    }

    kernel void mm8(device const float* a [[buffer(0)]], device float* c [[buffer(1)]],
                    uint sg [[simdgroup_index_in_threadgroup]]) {
      simdgroup_float8x8 ma;
      simdgroup_float8x8 acc = simdgroup_float8x8(0);
      simdgroup_load(ma, a + sg * 64, 8);
      simdgroup_multiply_accumulate(acc, ma, ma, acc);
      simdgroup_store(acc, c + sg * 64, 8);
    }
"""


def test_idiomatic_msl_has_no_findings():
    findings = lint.check_source(src(IDIOMATIC), "idiomatic.metal")
    assert findings == [], "\n".join(map(str, findings))


@pytest.mark.parametrize("snippet", [
    "template [[host_name(\"f_half\")]] [[kernel]] decltype(f<half>) f<half>;",
    "kernel void k(constant float& x [[buffer(0)]], device float* o [[buffer(1)]]) { o[0] = metal::exp(x); }",
    "kernel void k(device float* o [[buffer(0)]], constant uint& n [[buffer(1)]],"
    " uint tid [[thread_position_in_grid]]) { if (tid < n) { o[tid] = metal::precise::sqrt(o[tid]); } }",
    "kernel void k(device float* o [[buffer(0)]], constant uint& n [[buffer(1)]],"
    " uint tid [[thread_position_in_grid]]) { float s = 0; for (uint i = 0; i < n; ++i) { s += o[i]; }"
    " s = simd_sum(s); if (tid < n) o[tid] = s; }",
    "struct alignas(16) Args { uint n; float scale; };",
    "namespace lily { inline float silu(float x) { return x / (1.0f + metal::fast::exp(-x)); } }",
    "template <typename T, int N = 4> struct Vec { T v[N]; T sum() const thread"
    " { T s = 0; for (int i = 0; i < N; ++i) s += v[i]; return s; } };",
])
def test_idiomatic_snippets(snippet):
    findings = lint.check_source(snippet, "s.metal")
    assert findings == [], "\n".join(map(str, findings))


# --------------------------------------------------------------------------------------------------
# Paths and the command line
# --------------------------------------------------------------------------------------------------


def test_check_paths_searches_dirs_and_sees_macros_of_included_headers(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "defs.h").write_text("#define KCONST static constant constexpr const\n")
    (tmp_path / "sub" / "a.metal").write_text('#include "defs.h"\nKCONST int N = 4;\nint bad_global;\n')
    (tmp_path / "notes.txt").write_text("double\n")
    (tmp_path / "b.h").write_text("inline float f(float x) {\n  double y = x;\n  return y;\n}\n")
    got = sorted((Path(f.file).name, f.line, f.rule) for f in lint.check_paths([tmp_path]))
    assert got == [("a.metal", 3, "mutable-global"), ("b.h", 2, "double")]
    # An explicit file is linted whatever its suffix; a missing path is an error.
    assert [f.rule for f in lint.check_paths([tmp_path / "notes.txt"])] == ["double"]
    with pytest.raises(FileNotFoundError):
        lint.check_paths([tmp_path / "nope"])


def run_cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(TOOLS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "metalsim.lint", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_exit_status_and_output(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "k.metal").write_text("kernel void k(device float* o [[buffer(0)]]) {\n  goto x;\nx:\n  o[0] = 0;\n}\n")
    (bad / "h.h").write_text("#include <vector>\n")
    r = run_cli("bad", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines == [
        f"{Path('bad') / 'h.h'}:1:10: std-include: " + lines[0].split(": std-include: ", 1)[1],
        f"{Path('bad') / 'k.metal'}:2:3: goto: " + lines[1].split(": goto: ", 1)[1],
    ]
    good = tmp_path / "good"
    good.mkdir()
    (good / "k.metal").write_text(
        "#include <metal_stdlib>\nkernel void k(device float* o [[buffer(0)]]) { o[0] = 1; }\n")
    r = run_cli(str(good), cwd=tmp_path)
    assert (r.returncode, r.stdout) == (0, ""), r.stderr
    r = run_cli("--rules", cwd=tmp_path)
    assert r.returncode == 0 and "divergent-collective:" in r.stdout
    r = run_cli(str(tmp_path / "missing"), cwd=tmp_path)
    assert r.returncode == 2


# --------------------------------------------------------------------------------------------------
# The project's own kernels
# --------------------------------------------------------------------------------------------------


def test_project_kernels_exist_and_lint_clean():
    kernels = sorted((REPO / "metal").glob("*.metal"))
    assert kernels, "metal/*.metal: no kernel sources found (the Metal kernels belong in metal/)"
    findings = lint.check_paths([REPO / "metal"])
    assert findings == [], "\n".join(map(str, findings))
