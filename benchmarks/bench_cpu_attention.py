"""The CPU backend's attention op alone (csrc/cpu/attention.cpp): T query rows after `context` cached positions, the
shapes of a warm turn (a few new rows after a long prefix), a decode step (1 row) and a cold prefill chunk.

Times the op through the op harness (lily._core.OpBench("cpu").time: `repeats` copies in one step, wall time /
repeats, median of `runs`), for lily-tiny's attention shape (4 query heads, 2 kv heads, head dim 256) or the real
model's (16 / 2 / 256), f32 and bf16 caches. Prints ms per call, the FLOP rate (4 · heads · D per visible
(row, position) pair: the scores and the weighted sum) and the rate the K and V rows stream at once per call
(2 · kv_heads · (context + T) · D · element bytes over the time).

    python benchmarks/bench_cpu_attention.py [--shape tiny|real] [--rows 1,19,512] [--contexts 2048,8192,32768]
        [--caches f32,bf16] [--threads N] [--repeats 3] [--runs 5] [--json out.json]

Not collected by pytest (benchmarks/ is outside testpaths).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from bench_cuda_attention import time_case  # the same random inputs and timing, on the CPU bench

import lily._core as core

SHAPES = {"tiny": dict(heads=4, kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=1e7, eps=1e-6),
          "real": dict(heads=16, kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=1e7, eps=1e-6)}


def config(s: dict) -> dict:
    """The ModelConfig fields the attention workspace reads (the rest: small placeholders)."""
    return {"hidden": 256, "layers": 4, "vocab": 512, "eps": 1e-6, "heads": s["heads"], "kv_heads": s["kv_heads"],
            "head_dim": s["head_dim"], "rotary_dim": s["rotary_dim"], "rope_theta": s["rope_theta"],
            "lin_k_heads": 2, "lin_v_heads": 4, "lin_k_dim": 16, "lin_v_dim": 16, "conv_kernel": 4, "experts": 8,
            "topk": 2, "moe_inter": 32, "shared_inter": 32, "full_attention": [i % 4 == 3 for i in range(4)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--rows", default="1,19,512")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--caches", default="f32,bf16")
    ap.add_argument("--threads", type=int, default=0, help="0: the backend's default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    s = SHAPES[args.shape]
    H, kv, D = s["heads"], s["kv_heads"], s["head_dim"]
    b = core.OpBench("cpu", {"threads": args.threads} if args.threads else {})
    print(f"{b.report()['device']}, attention shape {args.shape} ({H} q / {kv} kv heads x {D})")
    print(f"{'cache':>5} {'T':>4} {'context':>8} | {'ms':>8} {'GFLOP/s':>8} {'KV GB/s':>8}")
    rng = np.random.default_rng(0)
    out = []
    for cache in args.caches.split(","):
        es = 2 if cache == "bf16" else 4
        for ctx in (int(x) for x in args.contexts.split(",")):
            for T in (int(x) for x in args.rows.split(",")):
                max_ctx = ctx + T
                sec = time_case(b, rng, T, ctx, cache, args.repeats, args.runs, shape=s, cfg=config(s),
                                phase="prefill" if T > 1 else "decode")
                pairs = T * ctx + T * (T + 1) // 2  # visible (row, position) pairs, causal
                flops = 4.0 * H * D * pairs
                kv_bytes = 2 * kv * max_ctx * D * es
                print(f"{cache:>5} {T:>4} {ctx:>8} | {sec * 1e3:>8.2f} {flops / sec / 1e9:>8.1f} "
                      f"{kv_bytes / sec / 1e9:>8.1f}")
                out.append({"cache": cache, "rows": T, "context": ctx, "seconds": sec, "flops": flops,
                            "kv_bytes": kv_bytes})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "rows": out}, f, indent=2)


if __name__ == "__main__":
    main()
