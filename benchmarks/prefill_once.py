"""One prefill of --tokens tokens on the full-size synthetic model, after a warm-up prefill of the same length (so
every kernel module is compiled before it): the target for Nsight Compute on a prefill chunk's kernels, e.g.

    ncu -k regex:moe_gate_up_mma --launch-skip 50 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/prefill_once.py --cache DIR --tokens 512

(skip the warm-up's 40 layers and 10 more). Options as bench_cuda.py's --backend-options.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import lily
from lily import bench


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=None, help="folder of the synthetic checkpoint (default: temp dir)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--backend-options", default="{}")
    a = ap.parse_args()
    path = bench.synthetic_checkpoint("full", a.cache)
    engine = lily.Engine.from_pretrained(path, backend="cuda", kv_cache_dtype="bf16", prefill_chunk=max(a.tokens, 16),
                                         backend_options=json.loads(a.backend_options))
    ids = np.random.default_rng(0).integers(0, 1000, a.tokens, dtype=np.int32)
    for _ in range(2):  # the warm-up, then the profiled one
        engine.session(max_context=a.tokens + 8).prefill(ids)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
