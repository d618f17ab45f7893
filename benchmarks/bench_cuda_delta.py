"""CUDA prefill DeltaNet recurrence (kernels/gated_delta.cu) at the real shape, per form: the chunked (WY) kernels on
the tensor cores (delta_chunk_mma, the default), the chunked kernels in fp32 FMAs, and the sequential scan.

Real shape (16 key heads, 32 value heads, head dims 128). Each case times the gated_delta op alone (gated_delta_prep,
then the chunk prep and scan, or the scan) through the op harness (lily._core.OpBench("cuda").time: `repeats` copies
in one step, wall time / repeats, median of `runs`) on random inputs and a random state, and prints µs per call and
per token. The model runs the op in each of its 30 DeltaNet layers, so 30 × the call is its share of a prefill.

    python benchmarks/bench_cuda_delta.py [--rows 512,4096,16384] [--repeats 5] [--runs 3] [--json F]

Not collected by pytest (benchmarks/ is outside testpaths). Under Nsight Compute, --repeats 1 --runs 1 gives one
launch of each kernel per form and row count.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import lily.engine  # noqa: F401  (NVRTC search paths)
import lily._core as core

HK, HV, DK, DV, KTAPS = 16, 32, 128, 128, 4
FORMS = {"mma": {}, "fma": {"delta_chunk_mma": False}, "scan": {"delta_chunk_rows": 0}}


def config() -> dict:
    """ModelConfig.to_core() fields the workspace needs (Qwen3.6-35B-A3B)."""
    return {"hidden": 2048, "layers": 40, "vocab": 248320, "eps": 1e-6, "heads": 16, "kv_heads": 2, "head_dim": 256,
            "rotary_dim": 64, "rope_theta": 1e7, "lin_k_heads": HK, "lin_v_heads": HV, "lin_k_dim": DK,
            "lin_v_dim": DV, "conv_kernel": KTAPS, "experts": 256, "topk": 8, "moe_inter": 512, "shared_inter": 512,
            "full_attention": [i % 4 == 3 for i in range(40)]}


def time_case(b, rng, T: int, repeats: int, runs: int) -> float:
    """Seconds per gated_delta prefill call of T rows on bench b (inputs as tests/cuda/test_gated_delta.py's)."""
    C = 2 * HK * DK + HV * DV
    qkv = b.tensor(rng.standard_normal((T, C), dtype=np.float32))
    beta = b.tensor((rng.standard_normal((T, HV)) * 2.0).astype(np.float32))
    a = b.tensor(rng.standard_normal((T, HV), dtype=np.float32))
    A_log = b.tensor(rng.uniform(np.log(0.5), np.log(16.0), (1, HV)).astype(np.float32))
    dt_bias = b.tensor(rng.uniform(-7.0, -2.0, (1, HV)).astype(np.float32))
    state = b.tensor((rng.standard_normal((HV * DK, DV)) * 0.5).astype(np.float32))
    return b.time("gated_delta", "prefill", repeats, runs, qkv=qkv, b=beta, a=a, A_log=A_log, dt_bias=dt_bias,
                  state_in=state, state_out=state, ws=b.workspace(config(), T, 4096), out=b.empty(T, HV * DV),
                  k_heads=HK, v_heads=HV, k_dim=DK, v_dim=DV, conv_kernel=KTAPS, eps=1e-6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="512,4096,16384")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    forms = args.forms.split(",")
    benches = {f: core.OpBench("cuda", FORMS[f]) for f in forms}
    print(benches[forms[0]].report()["device"])
    print(f"{'T':>6} | " + " ".join(f"{f + ' µs':>10} {'µs/tok':>7}" for f in forms))
    out = []
    for T in (int(x) for x in args.rows.split(",")):
        t = {f: time_case(benches[f], np.random.default_rng(T), T, args.repeats, args.runs) for f in forms}
        print(f"{T:>6} | " + " ".join(f"{t[f] * 1e6:>10.1f} {t[f] * 1e6 / T:>7.3f}" for f in forms))
        out.append({"rows": T, **{f"{f}_s": t[f] for f in forms}})
    for f in forms:
        print(f"{f}: {benches[f].report()['variants'].get('gated_delta.prefill', '')}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": benches[forms[0]].report()["device"], "rows": out}, fh, indent=2)


if __name__ == "__main__":
    main()
