"""GPU tests of the CUDA backend: each kernel family against the CPU oracle through lily._core.OpBench,
and the whole model end to end. They skip cleanly (naming why) where no usable NVIDIA GPU is present."""

from __future__ import annotations

import pytest

import lily._core as core
from cuda_util import CUDA_STATUS, CUDA_USABLE, rel_err, requires_cuda  # noqa: F401


@pytest.fixture(scope="module")
def benches():
    """(cpu, gpu) OpBenches: build the same inputs on both, run one op on each, compare."""
    return core.OpBench("cpu", {"threads": 1}), core.OpBench("cuda", {"prefill_x": "bf16x2"})
