"""Lily's Metal kernels through the extension's Metal entry points (python/bindings_metal.cpp), against the CPU
backend, on two devices:

- "device": a real Apple GPU (macOS builds, lily._core.has_metal): the embedded MSL compiled by Apple's compiler
  with safe math (fast math off, MathModeSafe, as csrc/metal/device.cpp asks), real buffers, a real command queue;
  run by .github/workflows/macos.yml. Skipped elsewhere.
- "emulated": the same binding, host and kernel code built on Linux x86-64 against the fake Metal runtime
  (metalsim.host.build_python_module), its kernels running in the MSL emulator. Where the harness cannot run it
  skips, or fails under LILY_METALSIM_REQUIRE=1 (as CI sets it), like every harness test.

The tolerances are a real GPU's (its own rsqrt, exp and summation order, even with safe math), looser than the
emulator-only tests in test_kernels.py.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest

import lily._core as core

from metal_inputs import abs_scale_qmv, affine4, signed_uniform

@pytest.fixture(scope="module", params=[pytest.param("device", marks=pytest.mark.gpu), "emulated"])
def metal(request):
    if request.param == "device":
        if not getattr(core, "has_metal", False):
            pytest.skip("lily._core was built without Metal (macOS only)")
        return core
    from metalsim import build, host

    if build.unavailable_reason():
        from conftest import unavailable

        unavailable(build.unavailable_reason())

    # The bindings keep their device until exit on purpose; its objects are not leaks.
    os.environ["FAKEMETAL_QUIET_LEAKS"] = "1"
    path = str(host.build_python_module("typed"))
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module("lily_metal_emu")


def test_device_is_named(metal):
    assert metal.metal_device_name().strip()


@pytest.mark.parametrize("rows,cols,group,scale_dtype", [
    (37, 192, 64, "bf16"), (8, 2048, 64, "bf16"), (13, 320, 32, "f16"), (5, 640, 128, "bf16"),
    (2048, 2048, 64, "bf16"),  # a real projection shape
])
def test_qmv4(metal, rows, cols, group, scale_dtype):
    rng = np.random.default_rng(rows * 1000 + cols)
    w = affine4(rng, rows, cols, group, scale_dtype)
    x = signed_uniform(rng, cols)
    ref = np.asarray(core.cpu_matmul(x[None], w, "gemv"))[0].astype(np.float64)
    y = np.asarray(metal.metal_qmv4(x, w))
    # Fast math may reassociate: allow 1e-5 of Σ|x·w| rather than the emulator's 2e-6.
    assert (np.abs(y - ref) / abs_scale_qmv(x, w)).max() <= 1e-5


@pytest.mark.parametrize("rows,cols,segment", [(3, 2048, 2048), (5, 256, 128), (2, 200, 100), (1, 33, 33)])
def test_rms_norm(metal, rows, cols, segment):
    rng = np.random.default_rng(rows + cols + segment)
    x = signed_uniform(rng, (rows, cols)) * 3.0
    w = signed_uniform(rng, segment)
    ref = np.asarray(core.cpu_rms_norm(x, w, 1e-6)).astype(np.float64)
    y = np.asarray(metal.metal_rms_norm(x, w, 1e-6))
    rel = np.abs(y - ref) / (np.abs(x) * np.abs(w[np.arange(cols) % segment]))
    assert rel.max() <= 1e-4  # a GPU's rsqrt need not round like the CPU's


@pytest.mark.parametrize("rows,cols", [(37, 300), (1, 5), (9, 4096), (4, 32)])
def test_row_dot(metal, rows, cols):
    rng = np.random.default_rng(rows * 7 + cols)
    a = signed_uniform(rng, (rows, cols))
    b = signed_uniform(rng, (rows, cols))
    ref = np.asarray(core.cpu_row_dot(a, b)).astype(np.float64)
    y = np.asarray(metal.metal_row_dot(a, b))
    assert (np.abs(y - ref) / (np.abs(a) * np.abs(b)).sum(axis=1)).max() <= 1e-5


def test_bad_arguments_raise_and_device_stays_usable(metal):
    rng = np.random.default_rng(9)
    w = affine4(rng, 8, 128, 64, "bf16")
    with pytest.raises(ValueError, match="wrong length"):
        metal.metal_qmv4(signed_uniform(rng, 64), w)
    with pytest.raises(ValueError, match="multiple"):
        metal.metal_rms_norm(signed_uniform(rng, (2, 10)), signed_uniform(rng, 3), 1e-6)
    assert np.isfinite(metal.metal_qmv4(signed_uniform(rng, 128), w)).all()
