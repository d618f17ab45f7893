"""The MSL emulator (tools/metalsim): kernels from tests/metal/kernels run on the CPU with threadgroup and
simdgroup semantics. Each test checks one behaviour against numpy or a Python model of the GPU's order of
operations, and the planted-bug kernels check that the emulator reports what the GPU would silently get
wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from metalsim import build
from metalsim.emulator import KernelError, SanitizerError

REPO = Path(__file__).resolve().parents[2]
KERNELS = Path(__file__).resolve().parent / "kernels"
BASIC = KERNELS / "emu_basic.metal"


@pytest.fixture
def basic(emulator):
    return emulator.load(BASIC)


@pytest.fixture
def basic_typed(emulator_typed):
    return emulator_typed.load(BASIC)


def butterfly(v: np.ndarray, op, group: int = 32) -> np.ndarray:
    """The GPU's reduction order: lane i combines with lane i ^ offset, offsets group/2 ... 1."""
    v = v.copy()
    idx = np.arange(len(v))
    off = group // 2
    while off:
        v = op(v, v[idx ^ off])
        off //= 2
    return v


def scan(v: np.ndarray) -> np.ndarray:
    """Inclusive prefix sum in log steps (lane i adds lane i - offset), as the emulator defines it."""
    v = v.copy()
    off = 1
    while off < len(v):
        nv = v.copy()
        nv[off:] = v[:-off] + v[off:]
        v = nv
        off *= 2
    return v


# ---- barriers and threadgroup memory --------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["tg_tree_reduce", "simd_reduce"])
def test_threadgroup_reduction_ragged(basic, kernel):
    rng = np.random.default_rng(1)
    for threads in (1, 7, 32, 33, 100, 256):
        for n in (1, 50, 1000):
            groups = 3
            x = rng.standard_normal(groups * n).astype(np.float32)
            sizes = np.array([n, 0], np.uint32)
            out = basic.run(kernel, threadgroups=groups, threads=threads,
                            buffers={0: x, 1: np.zeros(groups, np.float32), 2: sizes},
                            threadgroup_memory={0: threads * 4})[1]
            want = x.reshape(groups, n).astype(np.float64).sum(axis=1)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4, err_msg=f"{kernel} threads={threads} n={n}")


def test_missing_barrier_is_caught(basic):
    x = np.arange(64, dtype=np.float32)
    want = np.concatenate([np.roll(x[:32], -1), np.roll(x[32:], -1)])
    for seed in (0, 7):
        good = basic.run("rotate_barrier", threadgroups=2, threads=32, buffers={0: x, 1: np.zeros(64, np.float32)},
                         shuffle_seed=seed)[1]
        np.testing.assert_array_equal(good, want)
    # Without the barrier lanes read their neighbour's slot before it is written: poison (NaN) or stale.
    bad = basic.run("rotate_no_barrier", threadgroups=2, threads=32, buffers={0: x, 1: np.zeros(64, np.float32)})[1]
    assert np.isnan(bad).sum() >= 32, bad


def test_threadgroup_memory_poisoned_per_threadgroup(basic):
    # Later threadgroups run on a worker after one that filled the memory: the poison is renewed for
    # declared arrays and for [[threadgroup(i)]] memory alike.
    x = np.arange(32 * 8, dtype=np.float32)
    bad = basic.run("rotate_no_barrier", threadgroups=8, threads=32, buffers={0: x, 1: np.zeros(256, np.float32)})[1]
    assert np.isnan(bad.reshape(8, 32)[:, :-1]).all()
    res = basic.run("tg_param_peek", threadgroups=8, threads=32, threadgroup_memory={0: 128},
                    buffers={0: np.zeros(256, np.float32), 1: np.zeros(256, np.int32)})
    assert np.isnan(res[0]).all() and (res[1] == -1).all()


def test_address_space_overloads(emulator_typed):
    src = """#include <metal_stdlib>
using namespace metal;
inline float origin(const device float* p) { return 1.0f; }
inline float origin(const threadgroup float* p) { return 2.0f; }
kernel void which(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup float t[4];
  out[i] = origin(out) * 10.0f + origin(t);
}
"""
    out = emulator_typed.load(src).run("which", grid=4, threads=4, buffers={0: np.zeros(4, np.float32)})[0]
    np.testing.assert_array_equal(out, np.full(4, 12.0))


def test_early_exit_before_barrier(basic):
    x = np.ones(64, np.float32)
    with pytest.raises(KernelError) as e:
        basic.run("early_exit_barrier", threadgroups=2, threads=32, buffers={0: x, 1: np.zeros(64, np.float32),
                                                                            2: np.array([40], np.uint32)})
    msg = str(e.value)
    assert "early_exit_barrier" in msg and "threadgroup_barrier" in msg and "early exit" in msg
    assert "emu_basic.metal:" in msg
    # The same kernel with every thread in range is fine.
    out = basic.run("early_exit_barrier", threadgroups=2, threads=32,
                    buffers={0: x, 1: np.zeros(64, np.float32), 2: np.array([64], np.uint32)})[1]
    np.testing.assert_array_equal(out, x)


# ---- simdgroup collectives -------------------------------------------------------------------------------


def simd_inputs():
    # Wide dynamic range, so that the order of summation changes the float32 result.
    rng = np.random.default_rng(3)
    return (rng.standard_normal(32) * 10.0 ** rng.integers(-4, 6, 32)).astype(np.float32)


def test_simd_sum_butterfly_order_bitwise(basic):
    x = simd_inputs()
    out = basic.run("simd_ops", threadgroups=1, threads=32,
                    buffers={0: x, 1: np.zeros(16 * 32, np.float32), 2: np.zeros(6 * 32, np.uint32)})[1]
    model = butterfly(x, np.add)
    sequential = np.float32(0)
    for v in x:
        sequential = np.float32(sequential + v)
    assert np.all(model == model[0])
    assert model[0] != sequential, "inputs must make the order visible"
    sums = out[0:32]
    assert np.all(sums.view(np.uint32) == sums[0].view(np.uint32)), "every lane gets the identical sum"
    assert sums[0].view(np.uint32) == model[0].view(np.uint32)


def test_simd_ops_vs_models(basic):
    x = simd_inputs()
    x[5] = 0.995  # simd_any(v > 0.99)
    bufs = {0: x, 1: np.zeros(16 * 32, np.float32), 2: np.zeros(6 * 32, np.uint32)}
    res = basic.run("simd_ops", threadgroups=1, threads=32, buffers=bufs)
    out, bits = res[1].reshape(16, 32), res[2].reshape(6, 32)
    lane = np.arange(32)
    np.testing.assert_array_equal(out[1], scan(x))
    np.testing.assert_allclose(out[1], np.cumsum(x.astype(np.float64)), rtol=1e-4, atol=1e-3 * np.abs(x).max())
    np.testing.assert_array_equal(out[2], scan(np.concatenate([[0], x[:-1]]).astype(np.float32)))
    np.testing.assert_array_equal(out[3], x[(lane * 7 + 3) % 32])
    np.testing.assert_array_equal(out[4], np.where(lane >= 3, x[np.maximum(lane - 3, 0)], x))
    np.testing.assert_array_equal(out[5], np.where(lane + 5 < 32, x[np.minimum(lane + 5, 31)], x))
    np.testing.assert_array_equal(out[6], x[lane ^ 6])
    np.testing.assert_array_equal(out[7], np.full(32, x[9]))
    np.testing.assert_array_equal(out[8], np.full(32, x.max()))
    np.testing.assert_array_equal(out[9], np.full(32, x.min()))
    np.testing.assert_array_equal(out[10], np.full(32, np.prod(np.where(x > 0, 1.0, -1.0))))
    np.testing.assert_array_equal(out[11], np.full(32, x[0]))
    np.testing.assert_array_equal(out[12], np.concatenate([butterfly(q, np.add, 4) for q in x.reshape(8, 4)]))
    np.testing.assert_array_equal(out[13], x[(lane & ~3) | 2])
    np.testing.assert_array_equal(out[14], np.full(32, 496.0))
    np.testing.assert_array_equal(out[15], np.full(32, 32.0))
    ballot = sum(1 << i for i in range(32) if x[i] > 0.5)
    np.testing.assert_array_equal(bits[0], np.full(32, ballot & 0xFFFFFFFF))
    np.testing.assert_array_equal(bits[1], np.ones(32))
    np.testing.assert_array_equal(bits[2], np.full(32, int(np.all(x >= 0))))
    np.testing.assert_array_equal(bits[3], (lane == 0).astype(np.uint32))
    np.testing.assert_array_equal(bits[4], np.full(32, 0xFFFFFFFF))
    np.testing.assert_array_equal(bits[5], np.full(32, 93))


def test_shuffled_lane_order_same_results(basic):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(4 * 300).astype(np.float32)
    runs = []
    for seed, reverse in ((0, False), (1, False), (987654321, False), (3, True)):
        out = basic.run("tg_tree_reduce", threadgroups=4, threads=100, shuffle_seed=seed, reverse=reverse,
                        buffers={0: x, 1: np.zeros(4, np.float32), 2: np.array([300, 0], np.uint32)},
                        threadgroup_memory={0: 400})[1]
        ops = basic.run("simd_ops", threadgroups=1, threads=32, shuffle_seed=seed, reverse=reverse,
                        buffers={0: x[:32].copy(), 1: np.zeros(16 * 32, np.float32), 2: np.zeros(6 * 32, np.uint32)})
        runs.append((out, ops[1], ops[2]))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def test_shuffled_lane_order_changes_a_racy_result(basic):
    # The missing-barrier kernel depends on the schedule; some seed must change which reads see poison.
    x = np.arange(32, dtype=np.float32)
    results = set()
    for seed in range(6):
        out = basic.run("rotate_no_barrier", threadgroups=1, threads=32, shuffle_seed=seed,
                        buffers={0: x, 1: np.zeros(32, np.float32)})[1]
        results.add(tuple(np.isnan(out)))
    assert len(results) > 1


def test_divergent_simd_is_an_error(basic):
    x = np.ones(32, np.float32)
    with pytest.raises(KernelError) as e:
        basic.run("divergent_simd", threadgroups=1, threads=32, buffers={0: x, 1: np.zeros(32, np.float32)})
    msg = str(e.value)
    assert "divergent_simd" in msg and "divergent simd" in msg and msg.count("simd_sum at") == 2, msg
    src = BASIC.read_text().splitlines()
    start = next(i for i, ln in enumerate(src) if "void divergent_simd(" in ln)
    lines = [i + 1 for i, ln in enumerate(src) if i > start and "s = simd_sum(" in ln][:2]
    assert all(f"emu_basic.metal:{n}" in msg for n in lines), msg


def test_simd_after_early_return_is_valid(basic):
    x = np.arange(64, dtype=np.float32)
    out = basic.run("simd_after_return", threadgroups=1, threads=64,
                    buffers={0: x, 1: np.zeros(2, np.float32), 2: np.array([40], np.uint32)})[1]
    np.testing.assert_array_equal(out, [x[:32].sum(), x[32:40].sum()])


# ---- sanitizers and address spaces -------------------------------------------------------------------------


def test_out_of_bounds_read_asan(emulator_asan):
    lib = emulator_asan.load(BASIC)
    x = np.ones(32, np.float32)
    with pytest.raises(SanitizerError) as e:
        lib.run("read_past_end", threadgroups=1, threads=32, buffers={0: x, 1: np.zeros(32, np.float32)})
    assert "heap-buffer-overflow" in str(e.value) and "emu_basic.metal" in str(e.value)
    # The runner restarts: the emulator keeps working.
    out = lib.run("read_past_end", threadgroups=1, threads=31, buffers={0: x, 1: np.zeros(32, np.float32)})[1]
    np.testing.assert_array_equal(out[:31], np.ones(31))


def test_address_space_mismatch_is_a_compile_error():
    src = KERNELS / "emu_addrspace.metal"
    with pytest.raises(build.CompileError) as e:
        build.compile_library(src, "typed")
    msg = str(e.value)
    assert "emu_addrspace.metal:9" in msg and "address space" in msg, msg
    assert build.compile_library(src, "asan").is_file()  # erased address spaces: only the typed build can tell


def test_compile_error_names_the_source_line(emulator_typed):
    src = "#include <metal_stdlib>\nusing namespace metal;\n\nkernel void k(device float* x [[buffer(0)]]) {\n  x[0] = undefined_name;\n}\n"
    with pytest.raises(build.CompileError) as e:
        emulator_typed.load(src)
    assert "kernel_source.metal:5" in str(e.value)


# ---- arguments, constants, dispatch shapes ------------------------------------------------------------------


def test_argument_validation(basic):
    x = np.ones(32, np.float32)
    with pytest.raises(KernelError, match=r"buffer\(1\) 'out'.*not bound"):
        basic.run("read_past_end", threadgroups=1, threads=31, buffers={0: x})
    with pytest.raises(KernelError, match=r"buffer\(2\) 'sz'.*needs at least 8"):
        basic.run("simd_reduce", threadgroups=1, threads=32, buffers={0: x, 1: x, 2: np.zeros(1, np.uint32)})
    with pytest.raises(KernelError, match=r"threadgroup\(0\) 'scratch'"):
        basic.run("tg_tree_reduce", threadgroups=1, threads=32,
                  buffers={0: x, 1: x, 2: np.array([32, 0], np.uint32)})
    with pytest.raises(KernelError, match="no kernel named"):
        basic.run("nope", threadgroups=1, buffers={})


def test_function_constants(basic):
    assert basic.constants == [(0, "use_scale", "bool"), (1, "scale", "float"), (2, "offset_fc", "int")]
    x = np.arange(8, dtype=np.float32)
    bias = np.full(8, 0.5, np.float32)
    y = np.zeros(8, np.float32)
    scaled = basic.run("fc_apply", grid=8, threads=8, buffers={0: x, 1: y, 2: bias},
                       constants={0: True, 1: 2.0, 2: 5})[1]
    np.testing.assert_array_equal(scaled, x * 2 + 0.5 + 1000 + 5)
    scaled3 = basic.run("fc_apply", grid=8, threads=8, buffers={0: x, 1: y, 2: bias},
                        constants={0: True, 1: 3.0, 2: 5})[1]
    np.testing.assert_array_equal(scaled3, x * 3 + 0.5 + 1000 + 5)
    # use_scale false: the bias argument is not used and may stay unbound; `scale` undefined.
    plain = basic.run("fc_apply", grid=8, threads=8, buffers={0: x, 1: y}, constants={0: False, 2: 0})[1]
    np.testing.assert_array_equal(plain, x)
    with pytest.raises(KernelError, match="bias.*not bound"):
        basic.run("fc_apply", grid=8, threads=8, buffers={0: x, 1: y}, constants={0: True, 1: 1.0})


def test_dispatch_threads_partial_edge_groups(basic):
    w, h = 37, 5
    pos = np.zeros(w * h, np.uint32)
    sizes = np.zeros(4 * w * h, np.uint32)
    res = basic.run("grid_ids", grid=(w, h), threads=(16, 4),
                    buffers={0: pos, 1: sizes, 2: np.array([w, h], np.uint32)})
    yy, xx = np.mgrid[0:h, 0:w]
    np.testing.assert_array_equal(res[0], (xx | (yy << 16)).reshape(-1))
    s = res[1].reshape(h, w, 4)
    tx = np.where(xx >= 32, 5, 16)
    ty = np.where(yy >= 4, 1, 4)
    np.testing.assert_array_equal(s[..., 0], tx | (ty << 16))
    np.testing.assert_array_equal(s[..., 1], np.full((h, w), w | (h << 16)))
    np.testing.assert_array_equal(s[..., 2], np.full((h, w), 16 | (4 << 16)))
    np.testing.assert_array_equal(s[..., 3], (tx * ty + 31) // 32)


def test_templated_host_name_kernels(basic):
    assert {"axpby_f32", "axpby_f16", "axpby_bf16"} <= set(basic.kernels)
    a, b = np.array([2.0], np.float32), np.array([0.5], np.float32)
    x = np.linspace(-2, 2, 16, dtype=np.float32)
    y = np.linspace(1, 3, 16, dtype=np.float32)
    out = basic.run("axpby_f32", grid=16, threads=16, buffers={0: x, 1: y, 2: a, 3: b})[1]
    np.testing.assert_array_equal(out, 2 * x + 0.5 * y)
    out16 = basic.run("axpby_f16", grid=16, threads=16, buffers={0: x.astype(np.float16), 1: y.astype(np.float16),
                                                                   2: a, 3: b})[1]
    want16 = (2 * x.astype(np.float16).astype(np.float32) + 0.5 * y.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(out16, want16.astype(np.float16))
    bf = lambda v: (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact for these values
    outbf = basic.run("axpby_bf16", grid=16, threads=16, buffers={0: bf(x), 1: bf(y), 2: a, 3: b})[1]
    got = (outbf.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_allclose(got, 2 * x + 0.5 * y, rtol=1e-2, atol=1e-2)


def test_atomics_across_threadgroups(basic):
    n = 64 * 40
    x = np.full(n, 0.25, np.float32)
    res = basic.run("atomic_count", threadgroups=40, threads=64,
                    buffers={0: np.zeros(2, np.uint32), 1: np.zeros(1, np.float32), 2: x})
    np.testing.assert_array_equal(res[0], [n, n - 1])
    assert res[1][0] == n * 0.25


# ---- numerics ------------------------------------------------------------------------------------------------


def test_half_rounds_per_operation(basic):
    a = np.array([2048, 1, 0.1, -3], np.float16)
    b = np.array([1, 2 ** -11, 0.2, 0.001], np.float16)
    res = basic.run("half_steps", grid=4, threads=4,
                    buffers={0: a, 1: b, 2: np.zeros(8, np.float16), 3: np.zeros(4, np.uint16)})
    want = (a + b) + b  # numpy float16 rounds each operation
    np.testing.assert_array_equal(res[2][:4], want)
    assert res[2][0] == 2048  # one rounding at the end would give 2050
    np.testing.assert_array_equal(res[2][4:], a * np.float16(0.5) + np.float16(1))
    bout = (res[3].astype(np.uint32) << 16).view(np.float32)
    assert bout[0] == 256.0  # 256 + 1 is a tie that rounds to even (256), twice; one final rounding gives 258
    np.testing.assert_allclose(bout[1:], a[1:].astype(np.float32) / 8 + 2, rtol=1e-2)


def test_simdgroup_matrix_multiply_accumulate(basic):
    rng = np.random.default_rng(11)
    a = rng.standard_normal((16, 16)).astype(np.float32)
    b = rng.standard_normal((16, 16)).astype(np.float16)
    c = rng.standard_normal((16, 16)).astype(np.float32)
    d = basic.run("mma_16", threadgroups=(2, 2), threads=32,
                  buffers={0: a, 1: b, 2: c, 3: np.zeros((16, 16), np.float32)})[3]
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5)


def test_thread_elements_lane_mapping(basic):
    out = basic.run("lane_map", threadgroups=1, threads=32, buffers={0: np.zeros(192, np.float32)})[0]
    m = np.full((8, 8), np.nan, np.float32)
    for lane in range(32):  # Apple's map, as documented in MLX steel/gemm/mma.h
        q = lane // 4
        fm = (q & 4) + (lane // 2) % 4
        fn = (q & 2) * 2 + (lane % 2) * 2
        m[fm, fn], m[fm, fn + 1] = lane, lane + 0.5
    assert not np.isnan(m).any()
    np.testing.assert_array_equal(out[:64].reshape(8, 8), m)
    np.testing.assert_array_equal(out[64:128].reshape(8, 8), 3 * m)
    np.testing.assert_array_equal(out[128:].reshape(8, 8), m.T)


def test_vectors_math_and_conversions(basic_typed):
    x = np.array([[0.3, 0.6, 1.5, 4.0], [0.9, 0.2, -0.5, 0.25]], np.float32)
    res = basic_typed.run("misc_ops", grid=2, threads=2,
                          buffers={0: x, 1: np.zeros(32, np.float32), 2: np.zeros(8, np.uint32)})
    o, u = res[1].reshape(2, 16), res[2].reshape(2, 4)
    for i, v in enumerate(x):
        np.testing.assert_allclose(o[i, 0], np.float32(np.float16(v[0])))
        assert o[i, 1] == np.float32(7 + v[0])
        np.testing.assert_allclose(o[i, 2], 2 * v.sum(), rtol=1e-6)
        np.testing.assert_allclose(o[i, 3], np.linalg.norm(v[:3]), rtol=1e-6)
        assert o[i, 4] == np.clip(v[0], 0.25, 0.75)
        np.testing.assert_allclose(o[i, 5], v[0] + (v[1] - v[0]) * 0.25, rtol=1e-6)
        np.testing.assert_allclose(o[i, 6], np.exp(v[2]) + np.sqrt(v[3]), rtol=1e-6)
        assert o[i, 7] == (v[1] if v[0] > v[1] else v[0])
        assert o[i, 8] == max(v[0], 0.5)
        assert o[i, 9] == 16  # float3 occupies 16 bytes, as in MSL
        assert o[i, 10] == np.trunc(v[1] * 10)  # static_cast<float4>(int4) converts, not a bit cast
        np.testing.assert_allclose(o[i, 11], 1 / np.sqrt(v[3] + 1), rtol=1e-6)
        assert o[i, 12] == 65504 and o[i, 13] == 1 and o[i, 14] == 4
        np.testing.assert_allclose(o[i, 15], v[0] * v[1] + v[2], rtol=1e-6)
        assert u[i, 0] == v[0:1].view(np.uint32)[0]
        assert u[i, 1] == bin(int(u[i, 0])).count("1") | (31 << 8) | (3 << 16)
        assert u[i, 2] == 0xD12 and u[i, 3] == 3


# ---- entry points ------------------------------------------------------------------------------------------


def test_cli_compile(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "tools"))
    out = tmp_path / "basic.so"
    r = subprocess.run([sys.executable, "-m", "metalsim", "compile", "--mode", "typed", "-o", str(out), str(BASIC)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and out.is_file()
    r = subprocess.run([sys.executable, "-m", "metalsim", "compile", "--mode", "typed",
                        str(KERNELS / "emu_addrspace.metal")], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "emu_addrspace.metal:9" in r.stderr
