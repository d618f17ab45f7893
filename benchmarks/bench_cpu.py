"""CPU backend throughput on a synthetic 4-bit checkpoint: medium (the config of issue #2) or full size.

A caller of lily.bench (``python -m lily bench`` is the general sweep) that adds roofline fractions.

medium: hidden 1024, 16 layers (every 4th full attention), 16 q / 2 kv heads x 128, DeltaNet 8 key / 16 value
heads x 64, 64 experts top-8, expert and shared size 256, vocab 32768. full: Qwen3.6-35B-A3B's text config.
Both MLX affine 4-bit (8-bit router), generated on first use and cached.

Prints prefill and decode tokens/s (medians over --repeats) at 128, 512 and 2048 tokens, with the fraction
of the machine's measured memory bandwidth (decode: 4-bit weight bytes per token) and of its measured fp32
FMA peak (prefill: 2 FLOPs per active weight per token; peak: register-resident FMA chains) they reach.

    python benchmarks/bench_cpu.py [--size medium|full] [--threads N] [--repeats 3] [--decode-tokens 32]
                                   [--lengths 128,512,2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import numpy as np
from roofline import measure_bandwidth


def active_params(c: dict) -> tuple[int, int]:
    """(weights read per decoded token, of which lm_head)."""
    H = c["hidden_size"]
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    delta = H * (2 * kd + vd) + H * vd + 2 * H * c["linear_num_value_heads"] + vd * H
    qd = c["num_attention_heads"] * c["head_dim"]
    kvd = c["num_key_value_heads"] * c["head_dim"]
    attn = H * 2 * qd + 2 * H * kvd + qd * H
    moe = (c["num_experts_per_tok"] * 3 * H * c["moe_intermediate_size"] + 3 * H * c["shared_expert_intermediate_size"])
    router = c["num_experts"] * H + H
    L = c["num_hidden_layers"]
    n_full = L // c["full_attention_interval"]
    lm = c["vocab_size"] * H
    return n_full * attn + (L - n_full) * delta + L * (moe + router) + lm, lm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--size", choices=("medium", "full"), default="medium",
                    help="medium: the issue's benchmark config; full: the real model's shape (19.5 GB on disk)")
    ap.add_argument("--cache", default=None, help="where the synthetic checkpoint is kept (default: temp dir)")
    ap.add_argument("--peak-gflops", type=float, default=None,
                    help="fp32 peak in GFLOP/s (default: measured register-resident FMA rate on the same threads)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import lily
    from lily.bench import measure_decode, measure_prefill, synthetic_checkpoint
    from lily.synthetic import FULL_CONFIG, MEDIUM_CONFIG

    MEDIUM = MEDIUM_CONFIG if args.size == "medium" else FULL_CONFIG
    cache = synthetic_checkpoint(args.size, args.cache)
    engine = lily.Engine.from_pretrained(str(cache), threads=args.threads, prefill_chunk=args.chunk)
    threads = engine.report()["threads"]
    n_active, n_lm = active_params(MEDIUM)
    bytes_per_token = n_active * (0.5 + 4 / 64)  # 4-bit codes + bf16 scale and bias per 64
    flops_per_token = 2 * (n_active - n_lm)  # prefill computes the lm_head for the last position only
    bw = measure_bandwidth()
    peak = args.peak_gflops * 1e9 if args.peak_gflops else lily._core.cpu_fma_peak(threads)
    print(f"{args.size} config, checkpoint {cache}")
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    results = {"threads": threads, "active_params": n_active, "bytes_per_token": bytes_per_token,
               "bandwidth_Bps": bw, "peak_flops": peak, "prefill": {}, "decode": {}}
    print(f"threads {threads}; active params/token {n_active / 1e6:.1f} M "
          f"({bytes_per_token / 1e6:.1f} MB of 4-bit weights); copy bandwidth {bw / 1e9:.1f} GB/s; "
          f"fp32 FMA peak {peak / 1e9:.0f} GFLOP/s (measured)")
    print(f"{'tokens':>7} | {'prefill tok/s':>13} {'of peak':>8} | {'decode tok/s':>12} {'of bw':>6}")
    for n in lengths:
        # lily.bench's measurements: prefill into an empty session; decode at n tokens of context,
        # timing the forward steps after the first token.
        p = statistics.median(measure_prefill(engine, n, repeats=args.repeats, rng=rng))
        d = statistics.median(measure_decode(engine, n, tokens=args.decode_tokens, repeats=args.repeats, rng=rng))
        results["prefill"][n] = p
        results["decode"][n] = d
        print(f"{n:>7} | {p:>13.1f} {p * flops_per_token / peak:>7.1%} | {d:>12.1f} {d * bytes_per_token / bw:>5.1%}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
