"""Lily against mlx-lm on the same MLX 4-bit checkpoint: the published sweep (shared BRIEF.md §7), for a Mac.

    python benchmarks/bench_vs_mlx.py [--model DIR | --synthetic full] [--backend metal] [--json F] [--plot F]

The published Lily result is measured this way: the same checkpoint bytes in both engines, one request at a
time, the engines alternated each round (Lily first on even rounds, mlx-lm first on odd ones, so drift of the
machine's clocks and temperature falls on both), 10 prompt lengths for prefill and 10 context lengths for
decode from 256 to 128K, medians of --repeats rounds. mlx-lm runs its direct path: the prompt in chunks of
--prefill-chunk through the model with its KV cache (as its generate_step does), then greedy steps of one
token, each evaluated before the next (the "first token" is not timed in either engine). Prints both
engines' tokens/s and the ratio per length and the average ratios (the published figures: 1.23x prefill,
1.35x decode on an M5 Max); writes JSON and a plot on request.

Nobody here has a Mac: this script has only been run on Linux against mlx's CPU build on tiny synthetic
models (tests/test_bench_vs_mlx.py), which proves the procedure, not any speed. Metal speed is unmeasured
until someone runs this on Apple silicon: `--synthetic full --backend metal` (a 19.5 GB checkpoint, written
once and cached under --cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

PUBLISHED = {"prefill_ratio": 1.23, "decode_ratio": 1.35, "at_4k": {"lily_prefill": 5749.9, "lily_decode": 186.6,
                                                                   "mlx_prefill": 4737.5, "mlx_decode": 140.9}}
DEFAULT_LENGTHS = "256,512,1K,2K,4K,8K,16K,32K,64K,128K"


class LilyRunner:
    """One Lily engine; prefill / decode timings in tokens/s."""

    name = "lily"

    def __init__(self, path: Path, backend: str, chunk: int) -> None:
        import lily

        self.engine = lily.Engine.from_pretrained(str(path), backend=backend, prefill_chunk=chunk)
        self.vocab = self.engine.config.vocab_size

    def prefill(self, ids: np.ndarray) -> float:
        session = self.engine.session(max_context=len(ids))
        t = time.perf_counter()
        session.prefill(ids)
        dt = time.perf_counter() - t
        session.close()
        return len(ids) / dt

    def decode(self, ids: np.ndarray, tokens: int) -> float:
        session = self.engine.session(max_context=len(ids) + tokens)
        session.prefill(ids)
        from lily import bench

        rate = bench.rate_after_first(session.generate(tokens, stop_token_ids=[], mtp="off"))
        session.close()
        return rate


class MlxRunner:
    """mlx-lm's model and KV cache driven directly (its fastest generation path, not its server)."""

    name = "mlx-lm"

    def __init__(self, path: Path, chunk: int) -> None:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        self.mx, self.make_cache = mx, make_prompt_cache
        self.model, _ = load(str(path))
        self.chunk = chunk

    def _prefill(self, ids: np.ndarray):
        mx, cache = self.mx, self.make_cache(self.model)
        x = mx.array(ids.astype(np.int32))[None]
        logits = None
        for s in range(0, x.shape[1], self.chunk):
            logits = self.model(x[:, s:s + self.chunk], cache=cache)
            mx.eval(logits, [c.state for c in cache])
        return logits, cache

    def prefill(self, ids: np.ndarray) -> float:
        t = time.perf_counter()
        self._prefill(ids)
        return len(ids) / (time.perf_counter() - t)

    def decode(self, ids: np.ndarray, tokens: int) -> float:
        mx = self.mx
        logits, cache = self._prefill(ids)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
        t = time.perf_counter()
        for _ in range(tokens - 1):
            logits = self.model(y[:, None], cache=cache)
            y = mx.argmax(logits[:, -1, :], axis=-1)
            mx.eval(y)
        return (tokens - 1) / (time.perf_counter() - t)


def alternate(runners: list, measure, rounds: int) -> dict[str, list[float]]:
    """``rounds`` measurements per runner, the order of the runners reversed every other round."""
    runs: dict[str, list[float]] = {r.name: [] for r in runners}
    for i in range(rounds):
        for r in (runners if i % 2 == 0 else runners[::-1]):
            runs[r.name].append(measure(r))
    return runs


def sweep(lily_runner, mlx_runner, prefill: list[int], decode: list[int], *, repeats: int, decode_tokens: int,
          seed: int, log=print) -> dict:
    rng = np.random.default_rng(seed)
    vocab = lily_runner.vocab
    runners = [lily_runner, mlx_runner]
    out: dict = {"prefill": [], "decode": []}
    for n in prefill:
        ids = rng.integers(0, vocab, n, dtype=np.int32)  # one prompt per length, the same for both engines
        for r in runners:
            r.prefill(ids)  # warm-up: compiled kernels, allocations
        runs = alternate(runners, lambda r: r.prefill(ids), repeats)
        row = {"tokens": n, "lily": statistics.median(runs["lily"]), "mlx": statistics.median(runs["mlx-lm"]),
               "runs": runs}
        row["ratio"] = row["lily"] / row["mlx"]
        out["prefill"].append(row)
        log(f"prefill {n:>7}: lily {row['lily']:10.1f}  mlx-lm {row['mlx']:10.1f} tok/s  {row['ratio']:.2f}x")
    for c in decode:
        ids = rng.integers(0, vocab, c, dtype=np.int32)
        for r in runners:
            r.decode(ids, 2)
        runs = alternate(runners, lambda r: r.decode(ids, decode_tokens), repeats)
        row = {"context": c, "lily": statistics.median(runs["lily"]), "mlx": statistics.median(runs["mlx-lm"]),
               "runs": runs}
        row["ratio"] = row["lily"] / row["mlx"]
        out["decode"].append(row)
        log(f"decode  {c:>7}: lily {row['lily']:10.1f}  mlx-lm {row['mlx']:10.1f} tok/s  {row['ratio']:.2f}x")
    for key in ("prefill", "decode"):
        if out[key]:
            out[f"{key}_mean_ratio"] = statistics.mean(r["ratio"] for r in out[key])
    return out


def table(res: dict) -> str:
    def k(n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)

    lines = []
    for key, col in (("prefill", "tokens"), ("decode", "context")):
        if not res[key]:
            continue
        lines += [f"| {'prompt' if key == 'prefill' else 'context'} | Lily tok/s | mlx-lm tok/s | Lily / mlx-lm |",
                  "|---:|---:|---:|---:|"]
        lines += [f"| {k(r[col])} | {r['lily']:.1f} | {r['mlx']:.1f} | {r['ratio']:.2f} |" for r in res[key]]
        lines += [f"| mean | | | {res[key + '_mean_ratio']:.2f} (published {PUBLISHED[key + '_ratio']}) |", ""]
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    from lily.bench import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, col in ((axes[0], "prefill", "tokens"), (axes[1], "decode", "context")):
        rows = res[key]
        xs = [r[col] for r in rows]
        for eng, label in (("lily", "Lily"), ("mlx", "mlx-lm")):
            ax.plot(xs, [r[eng] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length" if key == "prefill" else "context length")
        ax.set_ylabel("tokens/s")
        ax.set_title(key)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from lily import bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="an MLX 4-bit checkpoint folder (mlx-lm must load it too)")
    src.add_argument("--synthetic", choices=("tiny", "medium", "full"), default="full",
                     help="a random-weight MLX 4-bit checkpoint of this size, written once (default full)")
    ap.add_argument("--cache", default=None, help="folder of the synthetic checkpoint (default: temp dir)")
    ap.add_argument("--backend", default="auto", help="Lily's backend (default auto: metal on a Mac)")
    ap.add_argument("--prefill", default=DEFAULT_LENGTHS, help="prompt lengths (K = 1024)")
    ap.add_argument("--decode", default=DEFAULT_LENGTHS, help="context lengths (K = 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per length (engines alternate each round)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens per decode run (>= 2)")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per forward, both engines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.decode_tokens < 2 or a.prefill_chunk < 1:
        ap.error("--repeats >= 1, --decode-tokens >= 2 and --prefill-chunk >= 1 are required")
    prefill = bench.parse_lengths(a.prefill, "--prefill")
    decode = bench.parse_lengths(a.decode, "--decode")
    path = Path(a.model) if a.model else bench.synthetic_checkpoint(a.synthetic, a.cache)
    lily_runner = LilyRunner(path, a.backend, a.prefill_chunk)
    mlx_runner = MlxRunner(path, a.prefill_chunk)
    res = sweep(lily_runner, mlx_runner, prefill, decode, repeats=a.repeats, decode_tokens=a.decode_tokens,
                seed=a.seed)
    res["settings"] = vars(a) | {"checkpoint": str(path)}
    res["machine"] = bench.machine_info()
    res["lily"] = bench.report_summary(lily_runner.engine)
    print()
    print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    if a.plot:
        plot(res, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
