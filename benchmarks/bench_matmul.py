"""CPU matmul kernels (csrc/cpu/matmul.cpp) on the medium benchmark model's 4-bit shapes.

Shapes (hidden 1024, MLX affine q4, group 64, bf16 scales): [2048x1024] and [4096x1024] projections, expert
[256x1024] (gate/up) and [1024x256] (down), lm_head [32768x1024]; T = 1, 128, 512 rows; both paths.

For each product: median time over --repeats, GFLOP/s (2·T·N·K) with the fraction of the fp32 FMA peak,
and GB/s of weight bytes (codes + scales + biases, read once per call) with the fraction of the measured
copy bandwidth. Rooflines:
  * bandwidth: a 256 MiB numpy copy (read + write bytes counted), larger than the last-level cache;
  * peak: threads x FLOP/cycle/core x clock. Zen 4 issues one 512-bit (or two 256-bit) FMA per cycle:
    32 fp32 FLOP/cycle/core (--flop-per-cycle); the clock is --ghz (default: the highest "cpu MHz" in
    /proc/cpuinfo, which under a hypervisor is often the base clock, below the real boost clock).
    numpy's float32 matmul (BLAS, 2048^3) is timed too, as a measured compute roofline ("of BLAS").
lily._core.cpu_matmul builds a new thread pool per call (tens of µs with 2 threads): that fixed cost is
measured on a tiny product and subtracted ("kernel" columns); raw times are printed too.

    python benchmarks/bench_matmul.py [--threads N] [--repeats 5] [--json out.json]

``--lm-head``: instead, the LM head question of issue 14 item 5 (which format ``lm_head="auto"`` picks on the
CPU, src/lily/lm_head.py): one bf16 head [N, K] and the same head quantized by lily.quantize to 8-bit affine,
group 64, bf16 scales (what ``lm_head="8bit"`` loads), for lily-tiny [8192, 256], the medium model
[32768, 1024], [65536, 2048] and the real model [248320, 2048]; decode GEMV at T = 1 and T = 5 (an MTP verify
window, k = 4), and the prefill GEMM at T = 1 (a prompt's last-row logits). Weight GB/s and the speedup of
8-bit over bf16. Bytes per weight: bf16 2, q8g64 with bf16 scales and biases 1 + 4/64 = 1.0625.

    python benchmarks/bench_matmul.py --lm-head [--threads N] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
from roofline import measure_bandwidth

import lily._core as core
from lily.quantize import f32_to_bf16, quantize

LM_HEADS = [("lily-tiny", 8192, 256), ("medium", 32768, 1024), ("65536x2048", 65536, 2048),
            ("real 248320x2048", 248320, 2048)]
SHAPES = [("proj 2048x1024", 2048, 1024), ("proj 4096x1024", 4096, 1024), ("expert up 256x1024", 256, 1024),
          ("expert down 1024x256", 1024, 256), ("lm_head 32768x1024", 32768, 1024)]
TS = (1, 128, 512)


def make_q4(rng: np.random.Generator, n: int, k: int, group: int = 64) -> dict:
    ng = k // group
    scales = (rng.uniform(0.002, 0.05, (n, ng)) * rng.choice([-1.0, 1.0], (n, ng))).astype(np.float32)
    biases = rng.normal(0, 0.3, (n, ng)).astype(np.float32)
    return {
        "kind": "affine", "bits": 4, "group": group, "shape": (n, k),
        "data": rng.integers(0, 1 << 32, (n, k // 8), dtype=np.uint64).astype(np.uint32),
        "scales": (scales.view(np.uint32) >> 16).astype(np.uint16),  # bf16 bit patterns (truncated)
        "biases": (biases.view(np.uint32) >> 16).astype(np.uint16),
        "scale_dtype": "bf16",
    }


def weight_bytes(w: dict) -> int:
    return w["data"].nbytes + w["scales"].nbytes + w["biases"].nbytes


def measure_numpy_sgemm() -> float:
    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    a @ a
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t)
    return 2 * 2048**3 / min(times)


def cpu_ghz() -> tuple[float, str]:
    """The clock for the peak estimate and where it came from (a hypervisor often reports only the base
    clock in /proc/cpuinfo, below the boost clock the cores really run at: pass --ghz then)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            return int(f.read()) / 1e6, "cpufreq max"
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
        if mhz:
            return max(mhz) / 1000, "/proc/cpuinfo, may be the base clock"
    except OSError:
        pass
    return 3.0, "guessed"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: page in the weights, size the scratch buffers
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def make_bf16_head(rng: np.random.Generator, n: int, k: int) -> dict:
    """A dense bf16 head ~ N(0, 1/k) (the scale of a trained head's rows barely matters to the kernels)."""
    w = np.empty((n, k), np.uint16)
    for r0 in range(0, n, 8192):  # in slabs: the real head is 0.5 G weights
        r1 = min(n, r0 + 8192)
        w[r0:r1] = f32_to_bf16(rng.standard_normal((r1 - r0, k), dtype=np.float32) * np.float32(k ** -0.5))
    return {"kind": "dense", "dtype": "bf16", "shape": (n, k), "data": w}


def lm_head_main(args, threads: int, overhead: float, bw: float) -> list[dict]:
    """bf16 vs 8-bit affine g64 for LM-head shapes: decode GEMV T = 1, 5, prefill GEMM T = 1."""
    rng = np.random.default_rng(1)
    hdr = (f"{'head [N x K]':<18} {'path':<5} {'T':>2} {'bf16 ms':>8} {'GB/s':>6} {'q8 ms':>8} {'GB/s':>6} "
           f"{'q8 speedup':>10}  variants")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for name, n, k in LM_HEADS:
        dense = make_bf16_head(rng, n, k)
        t0 = time.perf_counter()
        codes, scales, biases = quantize(dense["data"], 64, 8, bf16=True)
        qsec = time.perf_counter() - t0
        q8 = {"kind": "affine", "bits": 8, "group": 64, "shape": (n, k), "data": codes, "scales": scales,
              "biases": biases, "scale_dtype": "bf16"}
        for path, t in (("gemv", 1), ("gemv", 5), ("gemm", 1)):
            x = rng.uniform(-1, 1, (t, k)).astype(np.float32)
            res = {}
            for label, w in (("bf16", dense), ("q8", q8)):
                wb = w["data"].nbytes + (w["scales"].nbytes + w["biases"].nbytes if label == "q8" else 0)
                reps = max(3, min(args.repeats * 8, int(args.repeats * 2e8 / max(wb, 1)) + 1))
                kern = max(timed(lambda: core.cpu_matmul(x, w, path, threads), reps) - overhead, 1e-9)
                res[label] = (kern, wb / kern / 1e9, core.cpu_matmul_variant(w, path))
            speed = res["bf16"][0] / res["q8"][0]
            print(f"{name + f' [{n}x{k}]':<18} {path:<5} {t:>2} {res['bf16'][0] * 1e3:>8.3f} {res['bf16'][1]:>6.1f} "
                  f"{res['q8'][0] * 1e3:>8.3f} {res['q8'][1]:>6.1f} {speed:>9.2f}x  {res['bf16'][2]}, {res['q8'][2]}")
            rows.append({"head": name, "n": n, "k": k, "path": path, "t": t, "bf16_s": res["bf16"][0],
                         "bf16_gbps": res["bf16"][1], "q8_s": res["q8"][0], "q8_gbps": res["q8"][1],
                         "q8_speedup": speed, "quantize_s": qsec})
        print(f"{'':<18} quantize (lily.quantize, {n * k / 1e6:.0f} M weights): {qsec:.2f} s")
        del dense, q8, codes, scales, biases
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ghz", type=float, default=None, help="clock for the FMA peak (default: /proc/cpuinfo)")
    ap.add_argument("--flop-per-cycle", type=float, default=32.0,
                    help="fp32 FLOP per cycle per core (Zen 4 / AVX2 with 2 FMA pipes: 32)")
    ap.add_argument("--peak-gflops", type=float, default=None, help="override the computed peak")
    ap.add_argument("--json", default=None)
    ap.add_argument("--lm-head", action="store_true", help="bf16 vs 8-bit LM head instead of the q4 sweep")
    args = ap.parse_args()

    threads = args.threads
    ghz, ghz_src = (args.ghz, "--ghz") if args.ghz else cpu_ghz()
    peak = (args.peak_gflops or threads * args.flop_per_cycle * ghz) * 1e9
    bw = measure_bandwidth()
    blas = measure_numpy_sgemm()
    rng = np.random.default_rng(0)

    tiny_w = make_q4(rng, 1, 64)
    tiny_x = np.ones((1, 64), np.float32)
    overhead = timed(lambda: core.cpu_matmul(tiny_x, tiny_w, "gemv", threads), 200)

    print(f"threads {threads}; copy bandwidth {bw / 1e9:.1f} GB/s; fp32 peak {peak / 1e9:.0f} GFLOP/s "
          f"({threads} x {args.flop_per_cycle:g} FLOP/cycle x {ghz:.2f} GHz from {ghz_src}); numpy sgemm "
          f"2048^3 {blas / 1e9:.0f} GFLOP/s (its own thread count); per-call overhead {overhead * 1e6:.1f} us "
          f"(subtracted)")
    if args.lm_head:
        rows = lm_head_main(args, threads, overhead, bw)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"threads": threads, "bandwidth_Bps": bw, "overhead_s": overhead, "lm_head": rows}, f,
                          indent=1)
        return
    hdr = (f"{'shape':<21} {'T':>4} {'kernel':<21} {'raw ms':>8} {'kern ms':>8} {'GFLOP/s':>8} {'of peak':>7} "
           f"{'of BLAS':>7} {'W GB/s':>7} {'of bw':>6}")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for name, n, k in SHAPES:
        w = make_q4(rng, n, k)
        wb = weight_bytes(w)
        for t in TS:
            x = rng.uniform(-1, 1, (t, k)).astype(np.float32)
            for path in ("gemv", "gemm"):
                flop = 2.0 * t * n * k
                reps = max(2, min(args.repeats * 4, int(args.repeats * 2e8 / max(flop, 1.0)) + 1))
                raw = timed(lambda: core.cpu_matmul(x, w, path, threads), reps)
                kern = max(raw - overhead, 1e-9)
                gflops, gbps = flop / kern / 1e9, wb / kern / 1e9
                variant = core.cpu_matmul_variant(w, path)
                print(f"{name:<21} {t:>4} {variant:<21} {raw * 1e3:>8.3f} {kern * 1e3:>8.3f} {gflops:>8.1f} "
                      f"{gflops * 1e9 / peak:>7.1%} {gflops * 1e9 / blas:>7.1%} {gbps:>7.1f} {gbps * 1e9 / bw:>6.1%}")
                rows.append({"shape": name, "n": n, "k": k, "t": t, "path": path, "variant": variant,
                             "raw_s": raw, "kernel_s": kern, "gflops": gflops, "weight_gbps": gbps})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": threads, "bandwidth_Bps": bw, "peak_flops": peak, "numpy_sgemm_flops": blas,
                       "overhead_s": overhead, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
