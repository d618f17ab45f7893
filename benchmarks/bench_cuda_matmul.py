"""CUDA decode GEMV (kernels/matmul.cu matmul_gemv) on Qwen3.6-35B-A3B's decode shapes, and the prefill GEMM.

Timing: through the op harness (lily._core.OpBench("cuda")). If the bench has a `time` method it is used
("in-step": `repeats` copies of the op in one step, a CUDA graph when the phase is decode, wall time of the
whole step / repeats, so launch gaps count as they do in a decode step); otherwise each case runs `b.run(...)` --repeats times in a row and divides the
wall time, which includes the per-step submit + wait overhead (a few µs): the "wall/op" column says which.
Bandwidth: weight bytes (codes + scales + biases, read once per GEMV call) / time, against a measured device
copy: `copy` of a 1 GiB f32 tensor (read + write bytes), timed the same way. Prefill: 2·T·N·K FLOP / time.

    python benchmarks/bench_cuda_matmul.py [--repeats 200] [--prefill-rows 512] [--options '{"gemv_dp4a": false}']

--options: backend options of the bench (A/B of one kernel choice); the variant column names what ran.

Not collected by pytest (no test_ prefix; benchmarks/ is outside testpaths).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import lily._core as core

# (name, N, K, bits): decode products of one token (MODEL.md §10), lm_head last.
SHAPES = [
    ("in_proj_qkv 8192x2048 q4", 8192, 2048, 4),
    ("in_proj_z 4096x2048 q4", 4096, 2048, 4),
    ("in_proj_b/a 32x2048 q4", 32, 2048, 4),
    ("out_proj / o_proj 2048x4096 q4", 2048, 4096, 4),
    ("q_proj 8192x2048 q4", 8192, 2048, 4),
    ("k/v_proj 512x2048 q4", 512, 2048, 4),
    ("shared gate/up 512x2048 q4", 512, 2048, 4),
    ("shared_down 2048x512 q4", 2048, 512, 4),
    ("router 256x2048 q8", 256, 2048, 8),
    ("shared_expert_gate 1x2048 q8", 1, 2048, 8),
    ("lm_head 248320x2048 q4", 248320, 2048, 4),
]


def bf16_bits(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def make_affine(rng, n: int, k: int, bits: int, group: int = 64) -> dict:
    words = rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32)
    ng = k // group
    scales = (rng.uniform(0.002, 0.05, (n, ng)) * rng.choice([-1.0, 1.0], (n, ng))).astype(np.float32)
    biases = rng.normal(0.0, 0.3, (n, ng)).astype(np.float32)
    return {"kind": "affine", "bits": bits, "group": group, "data": words, "scales": bf16_bits(scales),
            "biases": bf16_bits(biases), "scale_dtype": "bf16", "shape": (n, k)}


def weight_bytes(n: int, k: int, bits: int, group: int = 64) -> int:
    return n * k * bits // 8 + 2 * n * (k // group) * 2


def timed(b, repeats: int, op: str, **kw) -> tuple[float, str]:
    """Seconds per op: the harness's device timing if it has one, else wall time over `repeats` runs."""
    b.run(op, **kw)  # compile / warm
    if hasattr(b, "time"):
        try:
            return float(b.time(op, repeats=repeats, **kw)), "in-step"
        except TypeError:
            pass
    t0 = time.perf_counter()
    for _ in range(repeats):
        b.run(op, **kw)
    return (time.perf_counter() - t0) / repeats, "wall/op"


def decode_variant(b, n: int, k: int) -> str:
    """The variant name the report gives for the decode matmul of an [n, k] weight."""
    def find(d):
        if isinstance(d, dict):
            for key, v in d.items():
                if isinstance(key, str) and key.startswith("matmul.decode.") and key.endswith(f"[{n}, {k}]"):
                    return v.split(":")[0]
                got = find(v)
                if got:
                    return got
        return ""
    return find(b.report())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--prefill-rows", type=int, default=512)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--options", default="{}", help="JSON backend options, e.g. '{\"gemv_dp4a\": false}'")
    a = ap.parse_args()
    if not core.backends()["cuda"]["usable"]:
        raise SystemExit(f"cuda backend not usable: {core.backends()['cuda']['status']}")
    options = json.loads(a.options)
    b = core.OpBench("cuda", options) if options else core.OpBench("cuda")
    print(f"backend options: {options or 'defaults'}")
    rng = np.random.default_rng(0)

    n_copy = 1 << 28  # 1 GiB of f32
    src = b.tensor(np.ones((n_copy // 4096, 4096), np.float32), dtype="f32")
    dst = b.empty(n_copy // 4096, 4096, dtype="f32")
    t_copy, how = timed(b, max(5, a.repeats // 20), "copy", src=src, dst=dst)
    copy_bw = 2 * 4 * n_copy / t_copy
    print(f"device copy: {copy_bw / 1e9:.0f} GB/s ({how})")

    print(f"{'decode GEMV, T = 1':36s} {'µs':>9s} {'GB/s':>8s} {'of copy':>8s}  variant")
    for name, n, k, bits in SHAPES:
        w = b.weight(make_affine(rng, n, k, bits))
        x = b.tensor(rng.uniform(-1, 1, (1, k)).astype(np.float32), dtype="f32")
        out = b.empty(1, n, dtype="f32")
        t, how = timed(b, a.repeats, "matmul", phase="decode", x=x, w=w, out=out)
        bw = weight_bytes(n, k, bits) / t
        print(f"{name:36s} {t * 1e6:9.1f} {bw / 1e9:8.0f} {bw / copy_bw:8.1%}  ({how}) {decode_variant(b, n, k)}")
    # The DeltaNet layer's four input projections as the model runs them: one matmuls launch.
    parts = [(8192, 2048), (4096, 2048), (32, 2048), (32, 2048)]
    kw = {}
    for i, (n, k) in enumerate(parts):
        kw[f"w{i}"], kw[f"out{i}"] = b.weight(make_affine(rng, n, k, 4)), b.empty(1, n, dtype="f32")
    x = b.tensor(rng.uniform(-1, 1, (1, 2048)).astype(np.float32), dtype="f32")
    t, how = timed(b, a.repeats, "matmuls", phase="decode", x=x, **kw)
    bw = sum(weight_bytes(n, k, 4) for n, k in parts) / t
    print(f"{'in_proj qkv|z|b|a, one launch':36s} {t * 1e6:9.1f} {bw / 1e9:8.0f} {bw / copy_bw:8.1%}  ({how})")

    # The online low-bit LM head (lily.lm_head): a bf16 head as stored vs quantized at load to 8-bit affine.
    n, k = 248320, 2048
    print(f"\n{'lm_head 248320x2048, T = 1':36s} {'µs':>9s} {'GB/s':>8s} {'of copy':>8s}")
    bf16 = {"kind": "dense", "dtype": "bf16", "data": bf16_bits(rng.normal(0, 0.02, (n, k))), "shape": (n, k)}
    for name, desc, nbytes in (("bf16 (as stored)", bf16, n * k * 2),
                               ("8-bit affine g64 (quantized at load)", make_affine(rng, n, k, 8), weight_bytes(n, k, 8))):
        w = b.weight(desc)
        x = b.tensor(rng.uniform(-1, 1, (1, k)).astype(np.float32), dtype="f32")
        out = b.empty(1, n, dtype="f32")
        t, how = timed(b, a.repeats, "matmul", phase="decode", x=x, w=w, out=out)
        print(f"{name:36s} {t * 1e6:9.1f} {nbytes / t / 1e9:8.0f} {nbytes / t / copy_bw:8.1%}  ({how})")

    if a.skip_prefill:
        return
    T = a.prefill_rows
    print(f"\n{'prefill GEMM, T = ' + str(T):36s} {'µs':>9s} {'TFLOP/s':>8s}")
    for name, n, k, bits in SHAPES:
        if n < 256:
            continue
        w = b.weight(make_affine(rng, n, k, bits))
        x = b.tensor(rng.uniform(-1, 1, (T, k)).astype(np.float32), dtype="f32")
        out = b.empty(T, n, dtype="f32")
        t, how = timed(b, max(3, a.repeats // 20), "matmul", phase="prefill", x=x, w=w, out=out)
        print(f"{name:36s} {t * 1e6:9.1f} {2 * T * n * k / t / 1e12:8.1f}  ({how})")
    rep = b.report()
    print("\nreport:", {k: v for k, v in (rep.items() if isinstance(rep, dict) else [])})


if __name__ == "__main__":
    main()
