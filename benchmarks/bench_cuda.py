"""The CUDA benchmark of issue 11: the full-size synthetic Qwen3.6-35B-A3B (MLX 4-bit) on one GPU.

    python benchmarks/bench_cuda.py [--cache DIR] [--prefill 256,...] [--decode 256,...] [--json F] [--plot F]

Writes the synthetic checkpoint on first use (random codes, sane scales, the real names and shapes), loads
it through the normal loader onto the CUDA backend (bf16 KV cache), sweeps prefill over prompt lengths and
decode over context lengths (medians of --repeats runs, via lily.bench; each prompt length first runs
--prefill-warmup untimed prefills in the timed session, as llama-bench runs a warm-up in its context, so the figures
are for a length seen before: the CUDA backend's prefill encode memo then replays the chunks' host work, ~3 ms a
chunk on an H100's host; each decode context first runs --decode-warmup untimed generations, which capture its
step graphs), and prints tokens/s, ms per
token, the decode fraction of the HBM roofline (bytes each token must read / measured device copy
bandwidth) and the prefill fraction of the bf16 tensor-core peak (FLOPs per token / peak; the peak is
measured with torch when it is importable, else the 790 TFLOP/s measured on this workplace's H200).
llama.cpp's figures on the same GPU (issue 11) are printed beside ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import lily
import lily._core as core
from lily import bench
from lily.synthetic import FULL_CONFIG

LLAMA_PREFILL = {256: 3495, 512: 5571, 1024: 5245, 2048: 5905, 4096: 6030, 8192: 6009, 16384: 5924, 32768: 5756}
LLAMA_DECODE = {256: 250, 512: 266, 1024: 254, 4096: 262, 16384: 254, 32768: 240, 65536: 211, 131072: 189}
H200_BF16_PEAK = 790e12  # KINDS.md: 8192^3 bf16 products through PyTorch on this workplace's H200


def copy_bandwidth(gib: float = 1.0, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy through the backend's copy kernel (read + write counted)."""
    b = core.OpBench("cuda")
    n = int(gib * (1 << 30)) // 4 // 4096
    src, dst = b.empty(n, 4096), b.empty(n, 4096)
    b.run("copy", src=src, dst=dst)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        b.run("copy", src=src, dst=dst)
        times.append(time.perf_counter() - t)
    return 2 * n * 4096 * 4 / statistics.median(times)


def bf16_peak() -> float:
    try:
        import torch

        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        return 10 * 2 * 8192**3 / (time.perf_counter() - t)
    except Exception:  # no torch, or no GPU for it: the recorded figure
        return H200_BF16_PEAK


def decode_bytes_per_token(c: dict, context: int, kv_bytes: int = 2) -> float:
    """Bytes one decode token must read: the active weights at 4.5 bits (8-bit router and shared gate),
    the LM head, the KV rows of every attention layer and the DeltaNet state (read and written)."""
    q4, q8 = 4.5 / 8, 8.5 / 8
    H, L = c["hidden_size"], c["num_hidden_layers"]
    n_full = L // c["full_attention_interval"]
    n_lin = L - n_full
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    qd = c["num_attention_heads"] * c["head_dim"]
    kvd = c["num_key_value_heads"] * c["head_dim"]
    delta = H * (2 * kd + vd) + H * vd + 2 * H * c["linear_num_value_heads"] + vd * H
    attn = H * 2 * qd + 2 * H * kvd + qd * H
    moe = 3 * H * c["moe_intermediate_size"] * c["num_experts_per_tok"] + 3 * H * c["shared_expert_intermediate_size"]
    weights = q4 * (n_lin * delta + n_full * attn + L * moe) + q8 * L * H * (c["num_experts"] + 1)
    lm_head = q4 * c["vocab_size"] * H
    kv = n_full * 2 * context * kvd * kv_bytes
    state = n_lin * 2 * 4 * c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
    return weights + lm_head + kv + state


def prefill_flops_per_token(c: dict, n: int) -> float:
    """Matrix FLOPs per prompt token: 2 per active weight, plus causal attention (average context n/2)."""
    H, L = c["hidden_size"], c["num_hidden_layers"]
    n_full = L // c["full_attention_interval"]
    active = decode_bytes_per_token(c, 0) / (4.5 / 8)  # weights read per token ~ active parameters
    attn = n_full * 2 * 2 * (n / 2) * c["num_attention_heads"] * c["head_dim"]
    return 2 * active + attn


def c_vocab() -> int:
    return FULL_CONFIG["vocab_size"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=None, help="folder of the synthetic checkpoint (default: temp dir)")
    ap.add_argument("--prefill", default="256,512,1K,2K,4K,8K,16K,32K,64K,128K")
    ap.add_argument("--decode", default="256,512,1K,2K,4K,8K,16K,32K,64K,128K")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-warmup", type=int, default=1, help="untimed decode runs at each context first")
    ap.add_argument("--prefill-warmup", type=int, default=1,
                    help="untimed prefills of each length in the timed session first (llama-bench's warm-up run)")
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--backend-options", default="{}",
                    help='JSON for Engine backend_options, e.g. \'{"gemv_async": false}\' (A/B of one optimization)')
    a = ap.parse_args()
    if not core.backends()["cuda"]["usable"]:
        print("CUDA backend not usable:", core.backends()["cuda"]["status"], file=sys.stderr)
        return 2
    t = time.perf_counter()
    path = bench.synthetic_checkpoint("full", a.cache)
    print(f"checkpoint ready in {time.perf_counter() - t:.1f}s: {path}", flush=True)
    t = time.perf_counter()
    engine = lily.Engine.from_pretrained(path, backend="cuda", kv_cache_dtype="bf16", prefill_chunk=a.prefill_chunk,
                                         backend_options=json.loads(a.backend_options))
    load_s = time.perf_counter() - t
    bw = copy_bandwidth()
    peak = bf16_peak()
    print(f"loaded in {load_s:.1f}s; device copy bandwidth {bw / 1e12:.2f} TB/s; bf16 peak {peak / 1e12:.0f} TFLOP/s",
          flush=True)
    # Warm-up: the first forward at a new length can compile kernel modules (NVRTC, then the disk cache).
    for n in bench.parse_lengths(a.prefill, "--prefill"):
        engine.session(max_context=n).prefill(np.random.default_rng(1).integers(0, c_vocab(), n, dtype=np.int32))
    w = engine.session(max_context=64)
    w.prefill([1, 2, 3])
    list(w.generate(4, stop_token_ids=[]))
    res = bench.run_sweep(engine, bench.parse_lengths(a.prefill, "--prefill"), bench.parse_lengths(a.decode, "--decode"),
                          repeats=a.repeats, decode_tokens=a.decode_tokens, decode_warmup=a.decode_warmup,
                          prefill_warmup=a.prefill_warmup,
                          log=lambda s: print(s, flush=True))
    c = FULL_CONFIG
    print(f"\n{'prompt':>8} {'tok/s':>10} {'llama.cpp':>10} {'x':>6} {'of bf16 peak':>13}")
    for r in res["prefill"]:
        n = r["tokens"]
        frac = r["tok_s"] * prefill_flops_per_token(c, n) / peak
        ref = LLAMA_PREFILL.get(n)
        r["bf16_peak_fraction"] = frac
        print(f"{bench._k(n):>8} {r['tok_s']:10.0f} {ref or '':>10} {r['tok_s'] / ref if ref else float('nan'):6.2f} {frac:13.1%}")
    print(f"\n{'context':>8} {'tok/s':>10} {'ms/tok':>8} {'llama.cpp':>10} {'x':>6} {'of HBM roofline':>16}")
    for r in res["decode"]:
        n = r["context"]
        frac = r["tok_s"] * decode_bytes_per_token(c, n) / bw
        ref = LLAMA_DECODE.get(n)
        r["hbm_roofline_fraction"] = frac
        print(f"{bench._k(n):>8} {r['tok_s']:10.1f} {r['ms_per_token']:8.3f} {ref or '':>10} "
              f"{r['tok_s'] / ref if ref else float('nan'):6.2f} {frac:16.1%}")
    rep = engine.report()
    res["cuda"] = rep.get("cuda", {})
    res["load_seconds"] = load_s
    res["copy_bandwidth"] = bw
    res["bf16_peak"] = peak
    print("\nlaunches per decode step:", res["cuda"].get("graphs", {}).get("launches_per_decode_step"),
          "graph nodes:", res["cuda"].get("graphs", {}).get("graph_nodes_per_decode_step"),
          "host µs per decode step:", res["cuda"].get("graphs", {}).get("host_us_per_decode_step"),
          "GPU µs per decode step:", res["cuda"].get("graphs", {}).get("gpu_us_per_decode_step"))
    print("compile:", res["cuda"].get("compile"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if a.plot:
        bench.plot(res, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
