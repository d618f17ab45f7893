"""Where a CUDA decode step's GPU time goes, kernel by kernel (issue 11), on the full-size synthetic model.

Two commands on the GPU machine: the run under Nsight Compute, then the parse of its CSV.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base --log-file OUT.csv \\
        python benchmarks/profile_cuda_step.py --cache DIR --mark OUT.json
    python benchmarks/profile_cuda_step.py --parse OUT.csv --mark OUT.json

The run loads the model with CUDA graphs off (each launch is a kernel ncu sees), takes the report once (its probe
step runs then), prefills --prompt tokens at --context positions of KV cache and decodes --steps steps; --mark gets
the launches of one decode step from the report. The parse takes that many kernels from the end of ncu's CSV (the
last decode step) and prints GPU time per kernel name: launches, total, mean, share. ncu serialises kernels and
flushes caches between them, so its sum runs above a replayed graph's GPU time (~15% on this model before): read
the shares and the order, not the sum as the step's time.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict


def run(a: argparse.Namespace) -> int:
    import numpy as np

    import lily
    from lily import bench

    path = bench.synthetic_checkpoint("full", a.cache)
    engine = lily.Engine.from_pretrained(path, backend="cuda", kv_cache_dtype="bf16",
                                         backend_options={"graphs": False})
    engine.report()  # the probe step runs now, not inside the profiled tail
    s = engine.session(max_context=a.context + a.steps + 8)
    s.prefill(np.random.default_rng(0).integers(0, 1000, a.prompt, dtype=np.int32))
    for t in range(a.steps):
        s.step(t + 1)
    g = engine.report()["cuda"]["graphs"]
    with open(a.mark, "w") as f:
        json.dump({"launches_per_decode_step": g["launches_per_decode_step"], "steps": a.steps}, f)
    print(f"decode step: {g['launches_per_decode_step']} launches", file=sys.stderr)
    return 0


def kernel_rows(csv_path: str) -> list[tuple[str, float]]:
    """(kernel name, ns) per profiled kernel, in launch order, from ncu's --csv output (one row per kernel and
    metric; lines before the header are ncu's own messages)."""
    with open(csv_path, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows: dict[int, tuple[str, float]] = {}
    for r in csv.DictReader(lines[start:]):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}.get(
            r.get("Metric Unit", "nsecond"), 1.0)
        rows[int(r["ID"])] = (r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale)
    return [rows[i] for i in sorted(rows)]


def parse(a: argparse.Namespace) -> int:
    with open(a.mark) as f:
        n = int(json.load(f)["launches_per_decode_step"])
    rows = kernel_rows(a.parse)
    if len(rows) < n:
        print(f"{a.parse}: {len(rows)} kernels profiled, fewer than one decode step's {n}", file=sys.stderr)
        return 1
    step = rows[-n:]
    by: dict[str, list[float]] = defaultdict(list)
    for name, ns in step:
        by[name.split("(")[0]].append(ns)
    total = sum(ns for _, ns in step)
    print(f"last decode step: {n} kernels, {total / 1e3:.1f} µs summed under ncu")
    print(f"{'kernel':36s} {'launches':>8s} {'total µs':>9s} {'mean µs':>8s} {'share':>6s}")
    for name, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name[:36]:36s} {len(v):8d} {sum(v) / 1e3:9.1f} {sum(v) / len(v) / 1e3:8.2f} {sum(v) / total:6.1%}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=None, help="folder of the synthetic checkpoint (default: temp dir)")
    ap.add_argument("--context", type=int, default=4096, help="max_context of the session (the steps run at position --prompt)")
    ap.add_argument("--prompt", type=int, default=8, help="tokens prefilled before the decode steps")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mark", required=True, help="JSON with the launches of one decode step (written by the run)")
    ap.add_argument("--parse", default=None, help="ncu's CSV: print the last decode step's kernels instead of running")
    a = ap.parse_args()
    return parse(a) if a.parse else run(a)


if __name__ == "__main__":
    sys.exit(main())
