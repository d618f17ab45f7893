"""``python -m lily bench``: the published sweep of prefill and decode throughput.

Prefill: a prompt of N random tokens into an empty session, tokens/s. Decode: a context of C random
tokens (prefilled, not timed), then D greedy tokens; the rate counts the D - 1 forward steps after the
first token (which is sampled from the prefill's logits and costs no forward), tokens/s and ms/token.
Every figure is the median over ``repeats`` runs. Lengths default to the powers of two from 256 up to
``--max-length`` (K = 1024), on any backend and any checkpoint, or a synthetic one of a named size.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from .errors import LilyError

if TYPE_CHECKING:
    from .engine import Engine
    from .session import Session

__all__ = ["parse_lengths", "sweep_lengths", "synthetic_checkpoint", "measure_prefill", "measure_decode",
           "run_sweep", "format_table", "plot", "machine_info", "add_arguments", "main"]

MIN_LENGTH = 256


def parse_lengths(text: str, what: str) -> list[int]:
    """``"256,512,1K,4k"`` -> [256, 512, 1024, 4096]; raises ValueError naming ``what``."""
    out = []
    for item in text.split(","):
        item = item.strip()
        scale = 1024 if item[-1:] in ("k", "K") else 1
        try:
            n = int(item[:-1] if scale > 1 else item) * scale
        except ValueError:
            raise ValueError(f"{what} must be comma-separated positive ints (K = 1024 allowed), got {text!r}") from None
        if n < 1:
            raise ValueError(f"{what} must be positive, got {item!r} in {text!r}")
        out.append(n)
    return out


def sweep_lengths(max_length: int) -> list[int]:
    """256, 512, 1024, ... up to and including ``max_length`` (powers of two)."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < MIN_LENGTH:
        raise ValueError(f"--max-length must be an int >= {MIN_LENGTH}, got {max_length!r}")
    out, n = [], MIN_LENGTH
    while n <= max_length:
        out.append(n)
        n *= 2
    return out


def synthetic_checkpoint(size: str, cache: str | os.PathLike | None = None, *, progress: bool = True,
                         log: Callable[[str], None] = print, mtp_layers: int = 0) -> pathlib.Path:
    """The folder of a random-weight MLX 4-bit checkpoint of ``size`` ("tiny", "medium" or "full"),
    written on first use and kept in ``cache`` (default: the temp dir); ``mtp_layers`` > 0 adds a random MTP
    head (MODEL.md section 7)."""
    from .synthetic import FULL_CONFIG, MEDIUM_CONFIG, TINY_CONFIG, write_synthetic_checkpoint

    configs = {"tiny": TINY_CONFIG, "medium": MEDIUM_CONFIG, "full": FULL_CONFIG}
    if size not in configs:
        raise ValueError(f"--synthetic must be one of {tuple(configs)}, got {size!r}")
    suffix = f"-mtp{mtp_layers}" if mtp_layers else ""
    folder = pathlib.Path(cache or os.path.join(tempfile.gettempdir(), f"lily-bench-{size}-q4{suffix}"))
    if not (folder / "config.json").is_file():
        t = time.perf_counter()
        write_synthetic_checkpoint(folder, configs[size], fmt="mlx", bits=4, seed=0, progress=progress,
                                   **({"mtp_layers": mtp_layers} if mtp_layers else {}))
        log(f"wrote synthetic checkpoint to {folder} in {time.perf_counter() - t:.1f}s")
    return folder


def _tokens(engine: "Engine", n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, engine.config.vocab_size, size=n, dtype=np.int32)


def _check_warmup(runs: object, what: str) -> None:
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 0:
        raise ValueError(f"{what} warm-up runs must be an int >= 0, got {runs!r}")


def measure_prefill(engine: "Engine", n: int, *, repeats: int, rng: np.random.Generator,
                    session: "Session | None" = None, warmup: int = 0) -> list[float]:
    """Tokens/s of ``repeats`` prefills of ``n`` random tokens into an empty session: ``session`` reset before each
    (default: a new one of max_context ``n``), after ``warmup`` untimed ones in it (as llama-bench repeats a prompt
    length in one context after a warm-up run: a length seen before, whose host work a backend may replay)."""
    _check_warmup(warmup, "prefill")
    session = session or engine.session(max_context=n)
    for _ in range(warmup):
        session.reset()
        session.prefill(_tokens(engine, n, rng))
    rates = []
    for _ in range(repeats):
        ids = _tokens(engine, n, rng)
        session.reset()
        t = time.perf_counter()
        session.prefill(ids)
        rates.append(n / (time.perf_counter() - t))
    return rates


def rate_after_first(tokens: Iterator[int]) -> float:
    """Tokens/s of a generation's tokens after its first, which costs no forward (it is sampled from the
    prompt's last logits): the decode steps alone."""
    next(tokens)
    t = time.perf_counter()
    n = sum(1 for _ in tokens)
    return n / (time.perf_counter() - t)


def measure_decode(engine: "Engine", context: int, *, tokens: int, repeats: int, rng: np.random.Generator,
                   warmup: int = 0) -> list[float]:
    """Tokens/s of greedy decoding at ``context`` tokens of context (``tokens`` >= 2 generated per run;
    the ``tokens - 1`` forward steps after the first token are timed). The context is prefilled once
    and restored from a snapshot before each run. ``warmup`` untimed runs come first (on a GPU the first
    run at a new context length captures its step graphs and may compile kernels for its split count)."""
    if tokens < 2:
        raise ValueError(f"--decode-tokens must be >= 2 (the first token costs no forward), got {tokens}")
    _check_warmup(warmup, "decode")
    session = engine.session(max_context=context + tokens)
    session.prefill(_tokens(engine, context, rng))
    snap = session.snapshot()
    for _ in range(warmup):
        session.restore(snap)
        rate_after_first(session.generate(tokens, stop_token_ids=[], mtp="off"))
    rates = []
    for _ in range(repeats):
        session.restore(snap)
        # plain decoding (bench_mtp.py: MTP)
        rates.append(rate_after_first(session.generate(tokens, stop_token_ids=[], mtp="off")))
    return rates


def machine_info() -> dict[str, Any]:
    from . import __version__

    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "lily": __version__}


def report_summary(engine: "Engine") -> dict[str, Any]:
    """The engine report's fields that identify a run (backend, device, model, formats, memory)."""
    r = engine.report()
    return {k: r[k] for k in ("model", "format", "quantization", "backend", "device", "threads", "prefill_chunk",
                              "kv_cache_dtype")} | {"weights_total_bytes": r["memory"]["weights_total_bytes"],
                                                    "lm_head": r["lm_head"]["format"],
                                                    "optimizations": r["optimizations"]}


def run_sweep(engine: "Engine", prefill_lengths: list[int], decode_contexts: list[int], *, repeats: int = 3,
              decode_tokens: int = 32, decode_warmup: int = 0, prefill_warmup: int = 0, seed: int = 0,
              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every length; returns {"prefill": [{tokens, tok_s, ms, runs}], "decode": [{context, tok_s,
    ms_per_token, runs}], "settings": {...}} with medians over ``repeats`` (each after ``prefill_warmup`` /
    ``decode_warmup`` untimed runs in the same session)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"--repeats must be an int >= 1, got {repeats!r}")
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"settings": {"repeats": repeats, "decode_tokens": decode_tokens,
                                        "decode_warmup": decode_warmup, "prefill_warmup": prefill_warmup,
                                        "seed": seed},
                           "prefill": [], "decode": []}
    for n in prefill_lengths:
        runs = measure_prefill(engine, n, repeats=repeats, rng=rng, warmup=prefill_warmup)
        med = statistics.median(runs)
        out["prefill"].append({"tokens": n, "tok_s": med, "ms": 1e3 * n / med, "runs": runs})
        if log:
            log(f"prefill {n:>7} tokens: {med:10.1f} tok/s")
    for c in decode_contexts:
        runs = measure_decode(engine, c, tokens=decode_tokens, repeats=repeats, rng=rng, warmup=decode_warmup)
        med = statistics.median(runs)
        out["decode"].append({"context": c, "tok_s": med, "ms_per_token": 1e3 / med, "runs": runs})
        if log:
            log(f"decode at {c:>7} context: {med:10.1f} tok/s")
    return out


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def format_table(result: dict[str, Any]) -> str:
    """Prefill and decode rows as an aligned text table."""
    lines = [f"{'prefill tokens':>14} | {'tok/s':>10} | {'ms':>10}"]
    lines += [f"{_k(r['tokens']):>14} | {r['tok_s']:>10.1f} | {r['ms']:>10.1f}" for r in result["prefill"]]
    lines += ["", f"{'decode context':>14} | {'tok/s':>10} | {'ms/token':>10}"]
    lines += [f"{_k(r['context']):>14} | {r['tok_s']:>10.1f} | {r['ms_per_token']:>10.2f}" for r in result["decode"]]
    return "\n".join(lines)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise LilyError("--plot needs matplotlib (the 'bench' extra of lily-inference)") from exc
    return plt


def plot(result: dict[str, Any], path: str | os.PathLike) -> None:
    """A PNG of prefill tok/s by prompt length and decode tok/s by context length.

    Raises LilyError when matplotlib is not installed."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    title = result.get("report", {}).get("backend", "")
    for ax, key, x, label in ((axes[0], "prefill", "tokens", "prompt length (tokens)"),
                              (axes[1], "decode", "context", "context length (tokens)")):
        rows = result[key]
        if rows:
            xs = [r[x] for r in rows]
            ax.plot(xs, [r["tok_s"] for r in rows], marker="o")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [_k(v) for v in xs])
        ax.set_xlabel(label)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{key} ({title})" if title else key)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", default=None,
                     help="checkpoint folder, Hugging Face repo id, or 'lily-tiny' (default: the packaged lily-tiny)")
    src.add_argument("--synthetic", choices=("tiny", "medium", "full"), default=None,
                     help="a random-weight MLX 4-bit checkpoint of this size (written once, cached)")
    p.add_argument("--cache", default=None, help="folder of the synthetic checkpoint (default: temp dir)")
    p.add_argument("--backend", default="cpu", help="backend passed to Engine.from_pretrained (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="tokens per prefill chunk (default: the engine's, 4096 on CUDA, 512 elsewhere)")
    p.add_argument("--kv-cache-dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--lm-head", choices=("auto", "8bit", "native"), default="auto",
                   help="LM head format of a bf16/f16/f32 checkpoint (Engine.from_pretrained's lm_head)")
    p.add_argument("--max-length", default="4K", help="longest prompt and context of the default sweep (default 4K)")
    p.add_argument("--prefill-lengths", default=None, help="comma-separated prompt lengths (default: 256..max)")
    p.add_argument("--decode-contexts", default=None, help="comma-separated context lengths (default: 256..max)")
    p.add_argument("--repeats", type=int, default=3, help="runs per length; medians are reported (default 3)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens per decode run (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default=None, help="write the results (with machine info and report summary)")
    p.add_argument("--plot", default=None, help="write a PNG of the sweep (needs matplotlib)")


def main(args: argparse.Namespace) -> int:
    from .engine import Engine

    [max_length] = parse_lengths(args.max_length, "--max-length")
    default = sweep_lengths(max_length)
    prefill = parse_lengths(args.prefill_lengths, "--prefill-lengths") if args.prefill_lengths else default
    decode = parse_lengths(args.decode_contexts, "--decode-contexts") if args.decode_contexts else default
    if args.decode_tokens < 2:
        raise ValueError(f"--decode-tokens must be >= 2 (the first token costs no forward), got {args.decode_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.plot:
        _pyplot()  # fail before the sweep, not after it
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress lines, not results
    model = synthetic_checkpoint(args.synthetic, args.cache, log=log) if args.synthetic else args.model
    engine = Engine.from_pretrained(model, backend=args.backend, threads=args.threads,
                                    prefill_chunk=args.prefill_chunk, kv_cache_dtype=args.kv_cache_dtype,
                                    lm_head=args.lm_head)
    summary = report_summary(engine)
    q = summary["quantization"]
    quant = ", ".join(f"{k} {v}" for k, v in q.items()) if isinstance(q, dict) else q
    print(f"model {summary['model']} ({summary['format']}, quantization {quant}); "
          f"backend {summary['backend']} on {summary['device']}; {args.repeats} repeats, medians")
    result = run_sweep(engine, prefill, decode, repeats=args.repeats, decode_tokens=args.decode_tokens,
                       seed=args.seed, log=log)
    name = f"synthetic-{args.synthetic}" if args.synthetic else str(summary["model"])
    result = {"machine": machine_info(), "backend": summary["backend"], "model": name, "report": summary, **result}
    print(format_table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
