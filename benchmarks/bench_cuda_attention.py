"""CUDA prefill attention for few rows after a long context (kernels/attention.cu, PF_SPLIT), with and without the
split-KV form: a warm turn's new tokens after a cached prefix, an MTP verify window, a small trailing chunk.

Real shape (16 query heads, 2 kv heads, head dim 256), bf16 and f32 caches. Each case times the attention op alone
through the op harness (lily._core.OpBench("cuda").time: `repeats` copies in one step, wall time / repeats, median of
`runs`), once with attn_prefill_split on (the default) and once off. Bandwidth: the K and V rows read
(2 · kv_heads · (pos0 + T) · 256 · element bytes) over the time, against the device's copy rate.

    python benchmarks/bench_cuda_attention.py [--rows 1,4,16,64] [--contexts 1024,8192,32768,131072] [--repeats 20]

Not collected by pytest (benchmarks/ is outside testpaths).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import lily.engine  # noqa: F401  (NVRTC search paths)
import lily._core as core

SHAPE = dict(heads=16, kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=1e7, eps=1e-6)


def config() -> dict:
    """ModelConfig.to_core() fields the workspace needs (Qwen3.6-35B-A3B)."""
    return {"hidden": 2048, "layers": 40, "vocab": 248320, "eps": 1e-6, "heads": 16, "kv_heads": 2, "head_dim": 256,
            "rotary_dim": 64, "rope_theta": 1e7, "lin_k_heads": 16, "lin_v_heads": 32, "lin_k_dim": 128,
            "lin_v_dim": 128, "conv_kernel": 4, "experts": 256, "topk": 8, "moe_inter": 512, "shared_inter": 512,
            "full_attention": [i % 4 == 3 for i in range(40)]}


def time_case(b, rng, T: int, pos0: int, cache: str, repeats: int, runs: int, shape: dict = SHAPE,
              cfg: dict | None = None, phase: str = "prefill") -> float:
    """Seconds per attention call of T rows after pos0 cached positions (random q, gate and caches) on bench b."""
    D, kv, H = shape["head_dim"], shape["kv_heads"], shape["heads"]
    max_ctx = pos0 + T
    kc = b.tensor(rng.standard_normal((kv * max_ctx, D), dtype=np.float32), dtype=cache)
    vc = b.tensor(rng.standard_normal((kv * max_ctx, D), dtype=np.float32), dtype=cache)
    q = b.tensor(rng.standard_normal((T, H * D), dtype=np.float32))
    gate = b.tensor(rng.standard_normal((T, H * D), dtype=np.float32))
    pos = b.tensor(np.array([[pos0]], dtype=np.int32), dtype="i32")
    return b.time("attention", phase, repeats, runs, q=q, gate=gate, k_cache=kc, v_cache=vc, pos=pos,
                  max_ctx=max_ctx, ws=b.workspace(cfg or config(), T, max_ctx), out=b.empty(T, H * D), **shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--contexts", default="1024,8192,32768,131072")
    ap.add_argument("--caches", default="bf16,f32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    benches = {True: core.OpBench("cuda"), False: core.OpBench("cuda", {"attn_prefill_split": False})}
    # The device's copy rate (read + write bytes of a 1 GiB f32 copy), as bench_cuda_matmul.py measures it.
    b = benches[True]
    n = (1 << 30) // 4 // 4096
    src, dst = b.empty(n, 4096, poison=False), b.empty(n, 4096, poison=False)
    copy_s = b.time("copy", "prefill", 5, 3, src=src, dst=dst)
    copy_bw = 2 * n * 4096 * 4 / copy_s
    print(f"{b.report()['device']}: device copy {copy_bw / 1e12:.2f} TB/s")
    print(f"{'cache':>5} {'T':>4} {'context':>8} | {'split us':>9} {'whole us':>9} {'speedup':>7} | "
          f"{'split TB/s':>10} {'of copy':>7}")
    out = []
    rng = np.random.default_rng(0)
    for cache in args.caches.split(","):
        es = 2 if cache == "bf16" else 4
        for pos0 in contexts:
            for T in rows:
                t = {on: time_case(benches[on], rng, T, pos0, cache, args.repeats, args.runs) for on in (True, False)}
                kv_bytes = 2 * SHAPE["kv_heads"] * (pos0 + T) * SHAPE["head_dim"] * es
                bw = kv_bytes / t[True]
                print(f"{cache:>5} {T:>4} {pos0:>8} | {t[True] * 1e6:>9.1f} {t[False] * 1e6:>9.1f} "
                      f"{t[False] / t[True]:>6.2f}x | {bw / 1e12:>10.2f} {bw / copy_bw:>6.0%}")
                out.append({"cache": cache, "rows": T, "context": pos0, "split_s": t[True], "whole_s": t[False],
                            "kv_bytes": kv_bytes})
    variants = benches[True].report()["variants"]
    print("variants:", {k: v for k, v in variants.items() if k.startswith("attention.prefill")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": copy_bw, "rows": out}, f, indent=2)


if __name__ == "__main__":
    main()
