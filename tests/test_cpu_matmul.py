"""CPU matmul kernels (csrc/cpu/matmul.cpp) against a float64 numpy reference, plus bitwise determinism.

Weights are built here in the MLX affine layout (uint32 words, codes LSB first; scales/biases per group,
stored as bf16 bit patterns, float16 or float32; some scales negative) or as dense f32/f16/bf16 rows, and
dequantized here in float64, independently of lily.quantize. Each product must be within 1e-5 of the
reference (relative to the reference row's norm), and for a given path every output row must be bitwise
the same whether it is computed alone, in a chunk of 7, in a batch of 130, or with 1 or 2 threads.
"""

from __future__ import annotations

import platform
import zlib
from pathlib import Path

import numpy as np
import pytest

import lily._core as core

T_MAX = 130
PATHS = ("gemv", "gemm")


# ------------------------------------------------------------------------------------------------
# Weight builders and float64 reference
# ------------------------------------------------------------------------------------------------


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (round to nearest even; inputs are finite)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _store_scalars(a: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored array, its exact float64 value) for scales/biases or dense weights."""
    if dtype == "bf16":
        bits = _bf16_bits(a)
        return bits, _bf16_value(bits)
    if dtype == "f16":
        h = a.astype(np.float16)
        return h, h.astype(np.float64)
    f = a.astype(np.float32)
    return f, f.astype(np.float64)


def make_affine(rng, n: int, k: int, bits: int, group: int, scale_dtype: str):
    """Random codes plus random scales (about half negative) and biases in the MLX layout."""
    per = 32 // bits
    codes = rng.integers(0, 1 << bits, size=(n, k), dtype=np.uint64)
    shifts = (np.arange(per, dtype=np.uint64) * bits)[None, None, :]
    words = (codes.reshape(n, k // per, per) << shifts).sum(axis=2).astype(np.uint32)
    scales = rng.uniform(0.002, 0.05, size=(n, k // group)) * rng.choice([-1.0, 1.0], size=(n, k // group))
    biases = rng.normal(0.0, 0.3, size=(n, k // group))
    s_store, s64 = _store_scalars(scales, scale_dtype)
    b_store, b64 = _store_scalars(biases, scale_dtype)
    w64 = codes.astype(np.float64) * np.repeat(s64, group, axis=1) + np.repeat(b64, group, axis=1)
    desc = {
        "kind": "affine", "bits": bits, "group": group, "data": words, "scales": s_store, "biases": b_store,
        "scale_dtype": scale_dtype, "shape": (n, k),
    }
    return desc, w64


def make_dense(rng, n: int, k: int, dtype: str):
    data, w64 = _store_scalars(rng.normal(0.0, 0.5, size=(n, k)), dtype)
    return {"kind": "dense", "dtype": dtype, "data": data, "shape": (n, k)}, w64


def make_weight(rng, spec: str, n: int, k: int):
    """spec: 'q4g64-bf16' (affine bits/group/scale dtype) or 'f32' / 'f16' / 'bf16' (dense)."""
    if spec.startswith("q"):
        q, sd = spec.split("-")
        bits, group = q[1:].split("g")
        return make_affine(rng, n, k, int(bits), int(group), sd)
    return make_dense(rng, n, k, spec)


def make_x(rng, t: int, k: int) -> np.ndarray:
    """Inputs bounded away from zero, both signs (zeros would hide lane/permutation mistakes)."""
    mag = rng.uniform(0.1, 1.0, size=(t, k))
    return (mag * rng.choice([-1.0, 1.0], size=(t, k))).astype(np.float32)


def matmul(x: np.ndarray, w: dict, path: str, threads: int = 1) -> np.ndarray:
    y = core.cpu_matmul(np.ascontiguousarray(x, dtype=np.float32), w, path, threads)
    y = np.asarray(y)
    assert y.dtype == np.float32 and y.shape == (x.shape[0], w["shape"][0])
    return y


def assert_close(y: np.ndarray, ref: np.ndarray, what: str, abs_ref: np.ndarray | None = None) -> None:
    """‖y − ref‖ ≤ 1e-5·‖ref‖ over the whole product and, when abs_ref = |x|·|W|ᵀ is given, every element
    within 1e-5 of its own magnitude scale (a single output can cancel to near zero, so its error is
    measured against Σ|x·w| rather than against itself)."""
    err = y.astype(np.float64) - ref
    rel = float(np.linalg.norm(err) / np.linalg.norm(ref))
    assert rel <= 1e-5, f"{what}: relative error {rel:.3g} > 1e-5"
    if abs_ref is not None:
        ratio = np.abs(err) / abs_ref
        t, n = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        assert ratio[t, n] <= 1e-5, f"{what}: output [{t}, {n}] error {ratio[t, n]:.3g} of Σ|x·w|"


def assert_same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
        bad = np.argwhere(a.view(np.uint32) != b.view(np.uint32))
        t, n = bad[0]
        raise AssertionError(f"{what}: {len(bad)} outputs differ, first [{t}, {n}]: {a[t, n]!r} vs {b[t, n]!r}")


# ------------------------------------------------------------------------------------------------
# Accuracy and determinism over shapes and weight kinds
# ------------------------------------------------------------------------------------------------

# Every kind on the awkward shape grid; the less common variants on a smaller one.
MAIN_SPECS = ["q4g64-bf16", "q8g64-bf16", "bf16", "f32"]
VARIANT_SPECS = ["q4g32-bf16", "q4g128-bf16", "q8g32-bf16", "q8g128-bf16", "q4g64-f16", "q4g64-f32",
                 "q8g64-f16", "f16"]
SHAPES_N = [1, 3, 17, 255]
SHAPES_K = [64, 192, 2048]

CASES = [(s, n, k) for s in MAIN_SPECS for n in SHAPES_N for k in SHAPES_K]
CASES += [(s, n, k) for s in VARIANT_SPECS for n in (3, 255) for k in (128, 384)]
# Dense K need not be a multiple of anything: tails shorter than a vector and than a K block.
CASES += [(s, n, k) for s in ("f32", "f16", "bf16") for n in (5, 40) for k in (1, 7, 100, 1000)]


def _check_product(spec: str, n: int, k: int, path: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w, w64 = make_weight(rng, spec, n, k)
    x = make_x(rng, T_MAX, k)
    ref = x.astype(np.float64) @ w64.T
    abs_ref = np.abs(x.astype(np.float64)) @ np.abs(w64).T
    what = f"{spec} N={n} K={k} {path}"

    full = matmul(x, w, path, threads=1)
    assert_close(full, ref, what, abs_ref)
    assert_same_bits(matmul(x, w, path, threads=2), full, f"{what}: threads 2 vs 1")
    # Prefix batches: row t must not depend on how many rows follow it.
    for t in (1, 2, 7, 33):
        sub = matmul(x[:t], w, path, threads=2)
        assert_close(sub, ref[:t], f"{what} T={t}", abs_ref[:t])
        assert_same_bits(sub, full[:t], f"{what}: T={t} vs T={T_MAX}")
    # Chunks of 7 (a chunked prefill) and rows computed alone.
    chunks = np.concatenate([matmul(x[i:i + 7], w, path, threads=2) for i in range(0, T_MAX, 7)])
    assert_same_bits(chunks, full, f"{what}: chunks of 7 vs one batch")
    for r in (0, 64, T_MAX - 1):
        assert_same_bits(matmul(x[r:r + 1], w, path, threads=1), full[r:r + 1], f"{what}: row {r} alone")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("spec,n,k", CASES, ids=[f"{s}-N{n}-K{k}" for s, n, k in CASES])
def test_matmul_matches_reference_and_is_deterministic(spec, n, k, path):
    _check_product(spec, n, k, path, seed=zlib.crc32(f"{spec}/{n}/{k}".encode()))


@pytest.mark.parametrize("path", PATHS)
def test_medium_model_shapes(path):
    """The benchmark model's shapes: square-ish projections, expert up/down, with a batch of 130."""
    for n, k in ((2048, 1024), (256, 1024), (1024, 256)):
        _check_product("q4g64-bf16", n, k, path, seed=n + k)


def test_paths_agree_within_tolerance():
    """Gemv and Gemm may round differently but both approximate the same product."""
    rng = np.random.default_rng(7)
    w, w64 = make_weight(rng, "q4g64-bf16", 300, 1024)
    x = make_x(rng, 9, 1024)
    a, b = matmul(x, w, "gemv"), matmul(x, w, "gemm")
    assert_close(a, b.astype(np.float64), "gemv vs gemm")


def test_large_magnitude_and_sign_mix():
    """Scales spanning orders of magnitude and inputs of mixed scale keep fp32-accumulation accuracy."""
    rng = np.random.default_rng(11)
    n, k = 64, 1024
    w, _ = make_affine(rng, n, k, 4, 64, "bf16")
    s = _bf16_value(w["scales"]) * np.exp(rng.uniform(-6, 6, size=(n, 1)))
    w["scales"] = _bf16_bits(s.astype(np.float32))
    codes = np.stack([(w["data"] >> (4 * i)) & 15 for i in range(8)], axis=2).reshape(n, k).astype(np.float64)
    w64 = codes * np.repeat(_bf16_value(w["scales"]), 64, axis=1) + np.repeat(_bf16_value(w["biases"]), 64, axis=1)
    x = make_x(rng, 5, k) * np.exp(rng.uniform(-4, 4, size=(1, k))).astype(np.float32)
    ref = x.astype(np.float64) @ w64.T
    for path in PATHS:
        assert_close(matmul(x, w, path, threads=2), ref, f"wide range {path}")


# ------------------------------------------------------------------------------------------------
# dequant_row and variant names
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["q4g64-bf16", "q8g32-f16", "q4g128-f32", "f32", "f16", "bf16"])
def test_dequant_row(spec):
    rng = np.random.default_rng(3)
    n, k = 9, 384
    w, w64 = make_weight(rng, spec, n, k)
    for r in (0, 4, n - 1):
        row = np.asarray(core.cpu_dequant_row(w, r))
        assert row.dtype == np.float32 and row.shape == (k,)
        # fp32 evaluation of s·q + b (one rounding, or an fma): within an ulp of the exact value.
        tol = 2.0 ** -23 * (np.abs(w64[r]) + 1.0)
        np.testing.assert_array_less(np.abs(row - w64[r]), tol + 1e-30)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.parametrize("spec,kind", [("q4g64-bf16", "q4"), ("q8g64-bf16", "q8"), ("f32", "f32"),
                                       ("f16", "f16"), ("bf16", "bf16")])
def test_variant_names(spec, kind):
    rng = np.random.default_rng(0)
    w, _ = make_weight(rng, spec, 4, 64)
    for path in PATHS:
        name = core.cpu_matmul_variant(w, path)
        assert name.startswith(f"{path}_{kind}_"), name
        # CI builds with -march=native on AVX-512 machines: the SIMD kernels must be the ones taken.
        if platform.machine() in ("x86_64", "AMD64") and "avx512f" in _cpu_flags():
            assert "avx512" in name, f"{name}: expected the AVX-512 kernel on this CPU"
