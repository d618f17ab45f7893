"""A CUDA prefill and decode timeline on the full-size synthetic model, from a CUPTI trace (issue 11).

    python benchmarks/trace_cuda.py --cache DIR [--prompt 512] [--context 4096] [--decode-tokens 16] [--json F]

Unlike `profile_cuda_step.py` (Nsight Compute: kernels serialised, caches flushed, graphs off), this records the
kernels as they really run, with graphs, stage branches and programmatic dependent launch, through PyTorch's
profiler (CUPTI sees every kernel of the process, Lily's driver-API launches included; PyTorch is only this
script's dependency, never the library's). For one prefill of --prompt tokens and for --decode-tokens greedy decode
steps at --context positions of KV cache it prints the wall time, the GPU's busy time (the union of the kernels'
intervals: overlap counted once) and idle time, and per kernel name the launches, the summed duration and the
mean. Under programmatic dependent launch a kernel's interval includes the time its blocks sit in
griddepcontrol.wait, so summed durations exceed the busy time: read the busy/idle split and the order, not the sums.
For decode it also prints each kernel's share of the step's critical path: kernels finish in launch order, so a
kernel holds the step for end - max(start, end of the kernel that finished before it), whatever time its blocks sat
waiting before that; grouped by kernel name, the GEMVs told apart by the kernel before them (which projection).
Then those kernels' resources from engine.report()["cuda"]["kernels"]: registers, local memory (spills), static
shared memory and, per launch shape, the blocks one multiprocessor holds (what decides whether a programmatically
launched kernel's blocks find room beside its predecessor's).

--decode-paths generator,core also times decode without the Python generator's thread handoff (the extension's
generate loop with a plain callback), untraced (medians of 3 runs) and traced, next to the report's GPU and host
time per replayed step over the same steps: wall minus GPU is the time the GPU waited for the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict


def kernel_intervals(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every GPU kernel in the trace."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return sorted(out, key=lambda r: r[1])


def summarise(label: str, rows: list[tuple[str, float, float]], wall_us: float, per: int) -> dict:
    busy, cur_s, cur_e = 0.0, None, None
    for _, s, e in rows:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (max(e for _, _, e in rows) - min(s for _, s, _ in rows)) if rows else 0.0
    # Idle gaps (no kernel running), by the kernel that ended last before each and the one that starts it.
    gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
    last_end, last_name = None, ""
    for name, s, e in rows:
        short = name.split("(")[0]
        if last_end is not None and s > last_end:
            gaps[(last_name, short)].append(s - last_end)
        if last_end is None or e >= last_end:
            last_end, last_name = e, short
    by: dict[str, list[float]] = defaultdict(list)
    for name, s, e in rows:
        by[name.split("(")[0]].append(e - s)
    print(f"\n{label}: wall {wall_us / per:.1f} µs, first kernel to last {span / per:.1f} µs, GPU busy {busy / per:.1f} µs, "
          f"idle inside the span {(span - busy) / per:.1f} µs, {len(rows) / per:.0f} kernels (per {'step' if per > 1 else 'call'})")
    print(f"{'kernel':40s} {'launches':>9s} {'summed µs':>10s} {'mean µs':>8s}")
    table = []
    for name, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        table.append({"kernel": name, "launches": len(v) / per, "summed_us": sum(v) / per, "mean_us": sum(v) / len(v)})
        print(f"{name[:40]:40s} {len(v) / per:9.1f} {sum(v) / per:10.1f} {sum(v) / len(v):8.2f}")
    gap_table = [{"after": a, "before": b, "count": len(v) / per, "idle_us": sum(v) / per, "mean_us": sum(v) / len(v)}
                 for (a, b), v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))]
    if gap_table:
        print(f"{'idle gap: after -> before':58s} {'count':>6s} {'idle µs':>8s} {'mean µs':>8s}")
        for g in gap_table[:12]:
            print(f"{(g['after'][:27] + ' -> ' + g['before'][:27]):58s} {g['count']:6.1f} {g['idle_us']:8.1f} "
                  f"{g['mean_us']:8.2f}")
    return {"wall_us": wall_us / per, "span_us": span / per, "busy_us": busy / per, "kernels": len(rows) / per,
            "by_kernel": table, "idle_gaps": gap_table}


def critical_path(rows: list[tuple[str, float, float]], per: int) -> list[dict]:
    """Per kernel (GEMVs by their predecessor): how long it held the step after the kernel before it finished."""
    by: dict[str, list[float]] = defaultdict(list)
    prev_end, prev_name = None, "start"
    for name, s, e in sorted(rows, key=lambda r: r[2]):
        short = name.split("(")[0]
        label = f"{short} after {prev_name}" if "gemv" in short else short
        by[label].append(e - (s if prev_end is None else max(s, prev_end)))
        prev_end, prev_name = e, short
    table = [{"kernel": k, "per_step": len(v) / per, "median_us": statistics.median(v), "us_per_step": sum(v) / per}
             for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1]))]
    print(f"{'critical path: kernel':64s} {'per step':>8s} {'median µs':>9s} {'µs/step':>8s}")
    for r in table[:24]:
        print(f"{r['kernel'][:64]:64s} {r['per_step']:8.1f} {r['median_us']:9.2f} {r['us_per_step']:8.1f}")
    return table


def kernel_resources(kernels: list[dict], names: set[str]) -> list[dict]:
    """The report's entries for the kernels named (every module of each), printed one line per module."""
    rows = [k for k in kernels if k["name"] in names]
    print(f"\n{'kernel (module defines)':72s} {'regs':>5s} {'local B':>7s} {'smem B':>6s}  launches: threads + dynamic "
          "smem -> blocks/SM")
    for k in sorted(rows, key=lambda k: (k["name"], k["module"])):
        shapes = ", ".join(f"{ln['threads']} + {ln['dynamic_smem']} -> {ln['blocks_per_sm']}" for ln in k["launches"])
        label = f"{k['name']} ({' '.join(k['module'].split()[1:])})"
        print(f"{label[:72]:72s} {k['registers']!s:>5s} {k['local_bytes']!s:>7s} {k['static_smem']!s:>6s}  {shapes}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=None, help="folder of the synthetic checkpoint (default: temp dir)")
    ap.add_argument("--prompt", type=int, default=512, help="tokens of the traced prefill")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="Engine prefill_chunk (default: the engine's; bench_cuda.py uses 4096)")
    ap.add_argument("--context", type=int, default=4096, help="KV positions before the traced decode steps")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--backend-options", default="{}", help="JSON for Engine backend_options")
    ap.add_argument("--decode-paths", default="generator",
                    help="comma-separated: generator (Session.generate), core (the extension's loop, no handoff)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("trace_cuda.py needs PyTorch (its profiler reads the CUPTI trace)", file=sys.stderr)
        return 2
    import numpy as np

    import lily
    from lily import bench

    path = bench.synthetic_checkpoint("full", a.cache)
    chunk = {} if a.prefill_chunk is None else {"prefill_chunk": a.prefill_chunk}
    engine = lily.Engine.from_pretrained(path, backend="cuda", kv_cache_dtype="bf16",
                                         backend_options=json.loads(a.backend_options), **chunk)
    engine.report()  # the probe step runs now
    torch.cuda.init()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, a.prompt, dtype=np.int32)
    engine.session(max_context=a.prompt + 8).prefill(ids)  # warm: modules loaded, workspace reserved
    result = {}

    s = engine.session(max_context=a.prompt + 8)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        s.prefill(ids)  # returns host logits: the work is done
        wall = (time.perf_counter() - t0) * 1e6
    result["prefill"] = summarise(f"prefill of {a.prompt} tokens", kernel_intervals(prof), wall, 1)

    s = engine.session(max_context=a.context + a.decode_tokens + 64)
    s.prefill(rng.integers(0, 1000, a.context, dtype=np.int32))
    snap = s.snapshot()
    greedy = lily.SamplingParams(temperature=0)

    def decode(path: str) -> None:
        s.restore(snap)
        if path == "generator":  # what Session.generate's callers get: a worker thread hands each token over
            list(s.generate(a.decode_tokens, greedy, stop_token_ids=[]))
        else:  # the extension's loop with a callback that only answers "go on"
            s._core.generate(a.decode_tokens, greedy.to_core(), [], lambda t, logits=None: 1, False, 0, None)

    def graph_sums() -> tuple[float, float, tuple[int, int]]:
        g = engine.report()["cuda"]["graphs"]
        n, n_gpu = g["timed_decode_steps"], g["gpu_timed_decode_steps"]
        return g["gpu_us_per_decode_step"] * n_gpu, g["host_us_per_decode_step"] * n, (n, n_gpu)

    for path in a.decode_paths.split(","):
        decode(path)  # warm: the decode graphs are captured
        walls, (g0, h0, n0) = [], graph_sums()
        for _ in range(3):
            t0 = time.perf_counter()
            decode(path)
            walls.append((time.perf_counter() - t0) * 1e6 / a.decode_tokens)
        g1, h1, n1 = graph_sums()
        untraced = {"wall_us_per_token": sorted(walls)[1], "gpu_us_per_step": (g1 - g0) / max(n1[1] - n0[1], 1),
                    "host_us_per_step": (h1 - h0) / max(n1[0] - n0[0], 1)}
        print(f"\ndecode at {a.context} context through the {path}, untraced (median of 3 calls of {a.decode_tokens} "
              f"tokens): wall {untraced['wall_us_per_token']:.1f} µs per token; replayed steps: GPU "
              f"{untraced['gpu_us_per_step']:.1f} µs, host encode + launch {untraced['host_us_per_step']:.1f} µs")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            decode(path)
            wall = (time.perf_counter() - t0) * 1e6
        key = "decode" if path == "generator" else f"decode_{path}"
        rows = kernel_intervals(prof)
        result[key] = summarise(f"decode at {a.context} context ({path})", rows, wall, a.decode_tokens)
        result[key]["critical_path"] = critical_path(rows, a.decode_tokens)
        result[key]["untraced"] = untraced
    names = {r["kernel"].split(" after ")[0] for k in result if k.startswith("decode") for r in result[k]["critical_path"]}
    result["kernel_resources"] = kernel_resources(engine.report()["cuda"]["kernels"], names)
    result["graphs"] = engine.report()["cuda"]["graphs"]
    print("\nreport graphs:", json.dumps(result["graphs"]))
    result["settings"] = vars(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
