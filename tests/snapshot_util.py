"""Comparing session snapshots in tests: every array a snapshot holds (``to_arrays()``), bit for bit."""

from __future__ import annotations

import numpy as np


def snapshot_arrays(snap) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in snap._core.to_arrays().items()}


def assert_same_snapshot(got, want, what: str) -> None:
    a, b = snapshot_arrays(got), snapshot_arrays(want)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: {k}")
