"""Rooflines of the machine a benchmark runs on (imported by the scripts in this folder)."""

import statistics
import time

import numpy as np


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large copy, counting bytes read plus bytes written: the streaming roofline."""
    a = np.ones(mib * 1024 * 1024 // 4, dtype=np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return 2 * a.nbytes / statistics.median(times)
