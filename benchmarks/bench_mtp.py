"""MTP speculative decoding, measured (issue 14 item 8): decode tokens/s with mtp off, on (k = 1..4) and auto.

    python benchmarks/bench_mtp.py [--model lily-tiny | PATH | --synthetic full] [--backend cpu|cuda]
                                   [--prompts N] [--prompt-tokens 128] [--tokens 128] [--repeats 3] [--json F]

Each configuration decodes greedily from the same prompts (lily-tiny: held-out text of docs/lily-tiny/heldout.txt,
so its MTP head sees the kind of text it was trained on; a synthetic checkpoint: random ids) and reports the median
tokens/s over prompts x repeats, the mean acceptance length (tokens per verify forward) and for auto what it
decided. Each engine decodes in one session, reset for each prompt, so the timings are the steady state: on a GPU
the graphs captured in the warm-up are replayed, not captured again per prompt. "off" runs on an engine with mtp="off" (the MTP block's rows not run at all: the true baseline), "on" on
an engine with mtp="on", "auto" on one with mtp="auto" after one untimed call (its cost measurement, cached on
disk afterwards). Also printed: the measured cost of a speculative iteration with k drafts in plain decode steps
(lily.mtp.measure_costs) and the speedup that cost implies at mean acceptance lengths 1.5 .. 3.9.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import numpy as np

import lily
from lily import bench
from lily import mtp as mtp_policy

ROOT = pathlib.Path(__file__).resolve().parents[1]
ACCEPTANCE_LENGTHS = (1.5, 2.0, 2.5, 3.0, 3.5, 3.9)


def prompts(engine, n: int, length: int, synthetic: bool) -> list[list[int]]:
    rng = np.random.default_rng(0)
    if synthetic or engine.tokenizer is None:
        return [rng.integers(0, engine.config.vocab_size, length).tolist() for _ in range(n)]
    text = (ROOT / "docs" / "lily-tiny" / "heldout.txt").read_text()
    docs = [d for d in text.split("<|endoftext|>") if len(d) > 4 * length]
    out = []
    for d in docs[:: max(1, len(docs) // n)][:n]:
        out.append(engine.tokenize(d)[:length])
    return out


def decode_rate(s, prompt: list[int], tokens: int, mtp: str, k: int | None) -> tuple[float, dict]:
    """Tokens/s of the tokens after the first (which costs no forward), and the call's MTP stats. `s` is the
    engine's one session, reset for each prompt: its buffers stay, so a GPU backend replays the graphs it
    captured in the warm-up instead of capturing new ones inside the timing (a new session's decode steps and
    iterations are new graphs: on CUDA a capture per graph, ~1 ms each for lily-tiny)."""
    s.reset()
    s.prefill(prompt)
    rate = bench.rate_after_first(s.generate(tokens, lily.SamplingParams(temperature=0.0), stop_token_ids=[],
                                             mtp=mtp, mtp_k=k))
    return rate, s.mtp_stats()


def run_config(s, ps, tokens: int, repeats: int, mtp: str, k: int | None) -> dict:
    rates, lengths, plain = [], [], 0
    for _ in range(repeats):
        for p in ps:
            r, st = decode_rate(s, p, tokens, mtp, k)
            rates.append(r)
            if st["steps"]:
                lengths.append(st["mean_acceptance_length"])
            plain += st["plain_tokens"]
    return {"tok_s": statistics.median(rates), "runs": len(rates),
            "mean_acceptance_length": statistics.mean(lengths) if lengths else None, "plain_tokens": plain}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="lily-tiny")
    ap.add_argument("--synthetic", default=None, help="a synthetic checkpoint with an MTP head: tiny, medium, full")
    ap.add_argument("--cache", default=None, help="folder of the synthetic checkpoint")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default="f32")
    ap.add_argument("--backend-options", default="{}", help="JSON, e.g. '{\"speculative_graphs\": false}'")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    options = json.loads(a.backend_options)

    path = (bench.synthetic_checkpoint(a.synthetic, a.cache, mtp_layers=1) if a.synthetic else a.model)
    result = {"machine": bench.machine_info(), "model": str(path), "tokens": a.tokens, "prompts": a.prompts,
              "prompt_tokens": a.prompt_tokens, "repeats": a.repeats, "backend_options": a.backend_options,
              "configs": {}}

    def load(mode):
        return lily.Engine.from_pretrained(path, backend=a.backend, mtp=mode, kv_cache_dtype=a.kv_cache_dtype,
                                           backend_options=options)

    # All three engines at once and the configurations interleaved repeat by repeat, so that drift of the
    # machine (clocks, neighbours) falls on every configuration alike.
    with load("off") as off, load("on") as on, load("auto") as auto:
        if off.checkpoint.mtp_layers == 0:
            print(f"{path} has no MTP head", file=sys.stderr)
            return 2
        result["backend"] = off.backend
        result["device"] = off.report().get("device")
        ps = prompts(off, a.prompts, a.prompt_tokens, a.synthetic is not None)
        configs = [("off", off, "off", None)] + [(f"on k={k}", on, "on", k) for k in range(1, mtp_policy.MAX_K + 1)]
        configs.append(("auto", auto, "auto", None))
        ctx = max(len(p) for p in ps) + a.tokens + 8
        sessions = {id(e): e.session(max_context=ctx) for e in (off, on, auto)}
        for _, e, mode, k in configs:  # warm-up (graphs, kernels); auto's first call measures its costs
            run_config(sessions[id(e)], ps[:1], a.tokens, 1, mode, k)
        cost = mtp_policy.measure_costs(on)
        result["iteration_cost"] = cost
        runs: dict = {name: [] for name, *_ in configs}
        for _ in range(a.repeats):
            for name, e, mode, k in configs:
                runs[name].append(run_config(sessions[id(e)], ps, a.tokens, 1, mode, k))
        for s in sessions.values():
            s.close()
        for name, rs in runs.items():
            lengths = [r["mean_acceptance_length"] for r in rs if r["mean_acceptance_length"] is not None]
            result["configs"][name] = {"tok_s": statistics.median(r["tok_s"] for r in rs),
                                       "tok_s_per_repeat": [round(r["tok_s"], 2) for r in rs],
                                       "mean_acceptance_length": statistics.mean(lengths) if lengths else None,
                                       "plain_tokens": sum(r["plain_tokens"] for r in rs)}
        result["auto_policy"] = auto.report()["mtp"]["policy"]
        if off.backend == "cuda":
            result["cuda_graphs_on_engine"] = on.report().get("cuda", {}).get("graphs")

    base = result["configs"]["off"]["tok_s"]
    print(f"{result['model']} on {result['backend']} ({result['device']}), {a.prompts} prompts x {a.repeats}, "
          f"{a.tokens} tokens after {a.prompt_tokens}-token prompts, greedy")
    print(f"{'config':10} {'tok/s':>9} {'vs off':>7} {'accept len':>10}")
    for name, c in result["configs"].items():
        L = c["mean_acceptance_length"]
        print(f"{name:10} {c['tok_s']:9.1f} {c['tok_s'] / base:7.3f} {L if L is None else round(L, 2)!s:>10}")
    print("auto:", result["auto_policy"]["decision"])
    print("iteration cost in plain steps (k: cost):",
          ", ".join(f"{k}: {c:.2f}" for k, c in enumerate(cost["cost"], 1)), f"(plain step {cost['plain_ms']} ms)")
    implied = {}
    for L in ACCEPTANCE_LENGTHS:
        row = {k: round(L / c, 3) for k, c in enumerate(cost["cost"], 1) if L <= k + 1}
        implied[L] = row
        print(f"  acceptance length {L}: implied speedup " + ", ".join(f"k={k} {s:.2f}x" for k, s in row.items()))
    result["implied_speedup"] = implied
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
