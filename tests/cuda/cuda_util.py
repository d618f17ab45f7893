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
