"""Shared by the GPU tests (a uniquely named module: several test folders have a conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

import lily.engine  # noqa: F401  (tells the extension where NVRTC is before any backend is made)
import lily._core as core


def cuda_status() -> tuple[bool, str]:
    b = core.backends().get("cuda", {})
    return bool(b.get("usable")), str(b.get("status", "no CUDA entry in backends()"))


CUDA_USABLE, CUDA_STATUS = cuda_status()
requires_cuda = pytest.mark.skipif(not CUDA_USABLE, reason=f"CUDA backend not usable here: {CUDA_STATUS}")


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), "non-finite output (an element was not written, or overflowed)"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def affine_table(rng, rows: int, cols: int, bits: int, group: int) -> dict:
    """An OpBench weight description: random bits-bit codes in the MLX layout, f32 scales (about half negative) and
    biases per group."""
    per = 32 // bits
    codes = rng.integers(0, 1 << bits, size=(rows, cols), dtype=np.uint64)
    shifts = (np.arange(per, dtype=np.uint64) * bits)[None, None, :]
    words = (codes.reshape(rows, cols // per, per) << shifts).sum(axis=2).astype(np.uint32)
    scales = (rng.uniform(0.01, 0.1, size=(rows, cols // group)) * rng.choice([-1, 1], size=(rows, cols // group)))
    biases = rng.normal(0, 0.3, size=(rows, cols // group))
    f32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)  # noqa: E731
    return {"kind": "affine", "shape": [rows, cols], "bits": bits, "group": group, "scale_dtype": "f32",
            "data": words, "scales": f32(scales), "biases": f32(biases)}
