"""Lily's Metal kernels on a real Apple GPU (macOS builds: lily._core.has_metal), against the CPU backend.

The same shapes and tolerances as the emulator tests (test_kernels.py), but through the extension's Metal
device: the embedded MSL compiled by Apple's compiler (fast math on), real buffers, a real command queue.
Skipped where the extension was built without Metal (every Linux machine); run by .github/workflows/macos.yml.
"""

from __future__ import annotations

import numpy as np
import pytest

import lily._core as core

from metal_inputs import abs_scale_qmv, affine4, signed_uniform

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not getattr(core, "has_metal", False), reason="lily._core was built without Metal"),
]


def test_device_is_named():
    assert core.metal_device_name().strip()


@pytest.mark.parametrize("rows,cols,group,scale_dtype", [
    (37, 192, 64, "bf16"), (8, 2048, 64, "bf16"), (13, 320, 32, "f16"), (5, 640, 128, "bf16"),
    (2048, 2048, 64, "bf16"),  # a real projection shape
])
def test_qmv4(rows, cols, group, scale_dtype):
    rng = np.random.default_rng(rows * 1000 + cols)
    w = affine4(rng, rows, cols, group, scale_dtype)
    x = signed_uniform(rng, cols)
    ref = np.asarray(core.cpu_matmul(x[None], w, "gemv"))[0].astype(np.float64)
    y = np.asarray(core.metal_qmv4(x, w))
    # Fast math may reassociate: allow 1e-5 of Σ|x·w| rather than the emulator's 2e-6.
    assert (np.abs(y - ref) / abs_scale_qmv(x, w)).max() <= 1e-5


@pytest.mark.parametrize("rows,cols,segment", [(3, 2048, 2048), (5, 256, 128), (2, 200, 100), (1, 33, 33)])
def test_rms_norm(rows, cols, segment):
    rng = np.random.default_rng(rows + cols + segment)
    x = signed_uniform(rng, (rows, cols)) * 3.0
    w = signed_uniform(rng, segment)
    ref = np.asarray(core.cpu_rms_norm(x, w, 1e-6)).astype(np.float64)
    y = np.asarray(core.metal_rms_norm(x, w, 1e-6))
    rel = np.abs(y - ref) / (np.abs(x) * np.abs(w[np.arange(cols) % segment]))
    assert rel.max() <= 1e-4  # rsqrt is approximate under fast math


@pytest.mark.parametrize("rows,cols", [(37, 300), (1, 5), (9, 4096), (4, 32)])
def test_row_dot(rows, cols):
    rng = np.random.default_rng(rows * 7 + cols)
    a = signed_uniform(rng, (rows, cols))
    b = signed_uniform(rng, (rows, cols))
    ref = np.asarray(core.cpu_row_dot(a, b)).astype(np.float64)
    y = np.asarray(core.metal_row_dot(a, b))
    assert (np.abs(y - ref) / (np.abs(a) * np.abs(b)).sum(axis=1)).max() <= 1e-5


def test_bad_arguments_raise_and_device_stays_usable():
    rng = np.random.default_rng(9)
    w = affine4(rng, 8, 128, 64, "bf16")
    with pytest.raises(ValueError, match="wrong length"):
        core.metal_qmv4(signed_uniform(rng, 64), w)
    with pytest.raises(ValueError, match="multiple"):
        core.metal_rms_norm(signed_uniform(rng, (2, 10)), signed_uniform(rng, 3), 1e-6)
    assert np.isfinite(core.metal_qmv4(signed_uniform(rng, 128), w)).all()
