"""Lily's Metal kernels (metal/*.metal) run in the MSL emulator and checked against the CPU backend.

Each kernel runs on fresh random inputs (never zeros) at ragged sizes, in both emulator builds (typed address
spaces; erased with ASan/UBSan), with in-order and shuffled lane schedules, and must match the CPU oracle
(lily._core.cpu_matmul / cpu_rms_norm / cpu_row_dot) within float32 reordering error. Mutation tests plant
bugs in the real kernels (a removed barrier, an early return, a short buffer) and the harness must catch each.
Launch geometry mirrors the encoders in csrc/metal/{matmul,norm,reduce}.cpp.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lily._core as core

from metal_inputs import abs_scale_qmv, affine4, signed_uniform
from metalsim import emulator as emu_mod

REPO = Path(__file__).resolve().parents[2]
METAL = REPO / "metal"
SEEDS = (0, 12345)  # lane schedules: in order, shuffled


@pytest.fixture(scope="module")
def libraries(emulator):
    return {name: emulator.load(METAL / f"{name}.metal") for name in ("matmul", "norm", "reduce")}


def run_qmv4(lib, x, w, seed=0, y_extra=0, specialise=False):
    """specialise: the pipeline gets the input width as function constant 4 (as the backend builds it), and the shape
    argument a wrong width (8), so a kernel that still read the argument would give other sums."""
    rows, cols = w["shape"]
    y = np.full(rows + y_extra, np.float32(-7.0), dtype=np.float32)  # sentinel: rows past the end stay untouched
    kernel = "qmv4_bf16" if w["scale_dtype"] == "bf16" else "qmv4_f16"
    out = lib.run(kernel, threadgroups=((rows + 7) // 8, 1, 1), threads=(64, 1, 1),
                  buffers={0: w["data"], 1: w["scales"], 2: w["biases"], 3: x, 4: y,
                           5: np.array([rows, 8 if specialise else cols], dtype=np.uint32)},
                  constants={0: w["group"], **({4: cols} if specialise else {})}, shuffle_seed=seed)
    return out[4]


@pytest.mark.parametrize("rows,cols,group,scale_dtype", [
    (37, 192, 64, "bf16"),    # 24 words: fewer words than lanes; rows not a multiple of 8
    (8, 2048, 64, "bf16"),    # a hidden-size row
    (13, 320, 32, "f16"),     # 40 words: one and a bit passes of the lanes
    (5, 640, 128, "bf16"),
])
def test_qmv4_matches_cpu_backend(libraries, rows, cols, group, scale_dtype):
    rng = np.random.default_rng(rows * 1000 + cols)
    w = affine4(rng, rows, cols, group, scale_dtype)
    x = signed_uniform(rng, cols)
    ref = np.asarray(core.cpu_matmul(x[None], w, "gemv"))[0].astype(np.float64)
    scale = abs_scale_qmv(x, w)
    results = []
    for seed in SEEDS:
        y = run_qmv4(libraries["matmul"], x, w, seed=seed, y_extra=3)
        assert np.all(y[rows:] == np.float32(-7.0)), "qmv4 wrote past the last row"
        # Specialised by its width (function constant 4, as the backend runs it): the same bits.
        ys = run_qmv4(libraries["matmul"], x, w, seed=seed, y_extra=3, specialise=True)
        np.testing.assert_array_equal(ys.view(np.uint32), y.view(np.uint32))
        err = np.abs(y[:rows].astype(np.float64) - ref) / scale
        assert err.max() <= 2e-6, f"max error {err.max():.3g} of Σ|x·w| (seed {seed})"
        results.append(y)
    # simd_sum combines lanes in a fixed butterfly order: the lane schedule must not change a single bit.
    assert np.array_equal(results[0].view(np.uint32), results[1].view(np.uint32))


def rms_geometry(segment: int) -> tuple[int, int]:
    threads = min(256, (segment + 31) // 32 * 32)  # csrc/metal/norm.cpp
    return threads, threads // 32 * 4


def run_rms_norm(lib, x, w, eps, seed=0):
    rows, cols = x.shape
    seg = w.shape[0]
    threads, tg_bytes = rms_geometry(seg)
    shape = np.frombuffer(np.array([cols, seg], np.uint32).tobytes() + np.float32(eps).tobytes(), dtype=np.uint8)
    out = lib.run("rms_norm", threadgroups=(rows * (cols // seg), 1, 1), threads=(threads, 1, 1),
                  buffers={0: x, 1: w, 2: np.full_like(x, np.nan), 3: shape.copy()},
                  threadgroup_memory={0: tg_bytes}, shuffle_seed=seed)
    return out[2]


@pytest.mark.parametrize("rows,cols,segment", [
    (3, 2048, 2048),   # residual norm of a hidden-size row (256 threads, 8 per thread)
    (5, 256, 128),     # per-head q/k norm: two segments per row
    (2, 200, 100),     # 128 threads, 28 idle in the strided loop
    (1, 33, 33),       # 64 threads, the second simdgroup nearly empty
])
def test_rms_norm_matches_cpu_backend(libraries, rows, cols, segment):
    rng = np.random.default_rng(rows + cols + segment)
    x = signed_uniform(rng, (rows, cols)) * 3.0
    w = signed_uniform(rng, segment)
    eps = 1e-6
    ref = np.asarray(core.cpu_rms_norm(x, w, eps)).astype(np.float64)
    for seed in SEEDS:
        y = run_rms_norm(libraries["norm"], x, w, eps, seed=seed)
        rel = np.abs(y - ref) / (np.abs(x).astype(np.float64) * np.abs(w[np.arange(cols) % segment]) + 1e-30)
        # |x·w| / rms(x) times a relative error of the statistics; rms(x) >= 0.1 here, so 1e-5 covers both.
        assert rel.max() <= 1e-5, f"max relative error {rel.max():.3g} (seed {seed})"


def run_row_dot(lib, a, b, seed=0):
    rows, cols = a.shape
    out = lib.run("row_dot", threadgroups=((rows + 3) // 4, 1, 1), threads=(128, 1, 1),
                  buffers={0: a, 1: b, 2: np.full(rows, np.nan, np.float32), 3: np.array([rows, cols], np.uint32)},
                  shuffle_seed=seed)
    return out[2]


@pytest.mark.parametrize("rows,cols", [(37, 300), (1, 5), (9, 4096), (4, 32)])
def test_row_dot_matches_cpu_backend(libraries, rows, cols):
    rng = np.random.default_rng(rows * 7 + cols)
    a = signed_uniform(rng, (rows, cols))
    b = signed_uniform(rng, (rows, cols))
    ref = np.asarray(core.cpu_row_dot(a, b)).astype(np.float64)
    scale = (np.abs(a).astype(np.float64) * np.abs(b)).sum(axis=1)
    outs = [run_row_dot(libraries["reduce"], a, b, seed) for seed in SEEDS]
    for y in outs:
        assert (np.abs(y - ref) / scale).max() <= 2e-6
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


# ---- planted bugs in the real kernels: the harness must catch each ------------------------------------------


def mutated(name: str, old: str, new: str) -> str:
    src = (METAL / f"{name}.metal").read_text()
    assert old in src, f"mutation anchor not found in {name}.metal"
    return src.replace(old, new, 1)


def test_removed_barrier_in_rms_norm_gives_wrong_output(emulator_typed):
    lib = emulator_typed.load(mutated("norm", "threadgroup_barrier(mem_flags::mem_threadgroup);", ""))
    rng = np.random.default_rng(1)
    x = signed_uniform(rng, (2, 512))
    w = signed_uniform(rng, 512)
    ref = np.asarray(core.cpu_rms_norm(x, w, 1e-6))
    # Lanes of the first simdgroup read the other simdgroups' partials before they are written: poisoned
    # threadgroup memory (NaN) or a wrong total, with in-order and shuffled schedules alike.
    for seed in SEEDS:
        y = run_rms_norm(lib, x, w, 1e-6, seed=seed)
        assert not np.allclose(y, ref, rtol=1e-4, atol=0), "a missing barrier went unnoticed"


def test_early_return_before_barrier_in_rms_norm_is_reported(emulator_typed):
    src = mutated("norm", "  const uint n = shape.segment;\n",
                  "  const uint n = shape.segment;\n  if (tid >= n) return;\n")
    lib = emulator_typed.load(src)
    rng = np.random.default_rng(2)
    x = signed_uniform(rng, (1, 100))
    w = signed_uniform(rng, 100)
    with pytest.raises(emu_mod.KernelError, match="barrier"):
        run_rms_norm(lib, x, w, 1e-6)  # 128 threads for 100 elements: 28 lanes return early


def test_short_buffer_read_out_of_bounds_in_qmv4_is_reported(emulator_asan):
    lib = emulator_asan.load(METAL / "matmul.metal")
    rng = np.random.default_rng(3)
    w = affine4(rng, 9, 256, 64, "bf16")
    w_short = dict(w, data=np.ascontiguousarray(w["data"][:8]))  # codes of the last row missing
    with pytest.raises(emu_mod.SanitizerError, match="overflow"):
        run_qmv4(lib, signed_uniform(rng, 256), w_short)
    # The emulator is usable after the report.
    y = run_qmv4(lib, signed_uniform(rng, 256), w)
    assert np.isfinite(y).all()
