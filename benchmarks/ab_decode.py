"""Decode (and prefill) tokens/s of several backend-option sets on one machine, interleaved round by round (an A/B).

    python benchmarks/ab_decode.py --options '{"replay_timing": 0}' '{}' [--cache DIR | --model PATH]
        [--backend cuda] [--contexts 4K,128K] [--tokens 48] [--rounds 5] [--prefill 512,4K]
        [--prefill-session new|reuse] [--json F]

--prefill: prompt lengths whose prefill into an empty session is timed too, before the decode contexts, the same
way (each round every engine in turn, medians); --contexts none skips decode. --prefill-session: "new" (default) a
new session for every prefill, as a request without kept sessions gets; "reuse" one session per engine and length,
reset before each prefill, as the sweep (lily.bench.run_sweep) and a server's kept sessions do.

One engine per option set is loaded (all resident at once), one session per engine and context is prefilled once
and snapshotted; each round restores every session and times greedy decoding of --tokens tokens after the first
(which costs no forward), engine after engine, so drift of the machine (clocks, neighbours) falls on every option
set alike. Prints per context and option set the median tokens/s over the rounds, every round's figure and the
ratio to the first option set. The default model is the full-size synthetic checkpoint (written on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

import lily
from lily import bench


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--options", nargs="+", required=True, help="one backend-options JSON per engine")
    ap.add_argument("--model", default=None, help="a checkpoint (default: the full-size synthetic one)")
    ap.add_argument("--cache", default=None, help="folder of the synthetic checkpoint")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--kv-cache-dtype", default="bf16")
    ap.add_argument("--contexts", default="4K")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill", default=None, help="prompt lengths to time prefill at (default: none)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the engines' prefill chunk (default: theirs)")
    ap.add_argument("--prefill-session", choices=("new", "reuse"), default="new",
                    help="a new session per timed prefill, or one per engine and length, reset before each")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.tokens < 2 or a.rounds < 1:
        ap.error("--tokens must be >= 2 and --rounds >= 1")
    options = [json.loads(o) for o in a.options]
    contexts = [] if a.contexts == "none" else bench.parse_lengths(a.contexts, "--contexts")
    prompts = bench.parse_lengths(a.prefill, "--prefill") if a.prefill else []
    path = a.model or bench.synthetic_checkpoint("full", a.cache)
    engines = [lily.Engine.from_pretrained(path, backend=a.backend, kv_cache_dtype=a.kv_cache_dtype, mtp="off",
                                           prefill_chunk=a.prefill_chunk, backend_options=o) for o in options]
    greedy = lily.SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    result = {"machine": bench.machine_info(), "device": engines[0].report().get("device"), "model": str(path),
              "options": a.options, "tokens": a.tokens, "rounds": a.rounds, "contexts": {}, "prefill": {}}

    def summary(title: str, rates: list[list[float]]) -> list[dict]:
        base = statistics.median(rates[0])
        print(f"\n{title} ({result['device']}):")
        rows = []
        for o, r in zip(a.options, rates):
            med = statistics.median(r)
            rows.append({"options": o, "tok_s": med, "runs": [round(x, 1) for x in r], "vs_first": med / base})
            print(f"  {o:40s} {med:9.1f} tok/s  x{med / base:.3f}  runs {rows[-1]['runs']}")
        return rows

    try:
        for n in prompts:  # a warm-up prefill per engine (modules compiled, scratch grown), then the rounds
            kept = [e.session(max_context=n) if a.prefill_session == "reuse" else None for e in engines]
            for e, s in zip(engines, kept):
                bench.measure_prefill(e, n, repeats=1, rng=rng, session=s)
            rates = [[] for _ in engines]
            for _ in range(a.rounds):
                for i, e in enumerate(engines):
                    rates[i] += bench.measure_prefill(e, n, repeats=1, rng=rng, session=kept[i])
            for s in kept:
                if s is not None:
                    s.close()
            result["prefill"][n] = summary(f"prefill of {bench._k(n)} tokens, {a.rounds} rounds, "
                                           f"{a.prefill_session} sessions", rates)
        for ctx in contexts:
            prompt = rng.integers(0, engines[0].config.vocab_size, ctx, dtype=np.int32)
            sessions = []
            for e in engines:
                s = e.session(max_context=ctx + a.tokens + 8)
                s.prefill(prompt)
                sessions.append((s, s.snapshot()))
                list(s.generate(a.tokens, greedy, stop_token_ids=[]))  # warm: graphs captured, kernels loaded
            rates: list[list[float]] = [[] for _ in engines]
            for _ in range(a.rounds):
                for i, (s, snap) in enumerate(sessions):
                    s.restore(snap)
                    rates[i].append(bench.rate_after_first(s.generate(a.tokens, greedy, stop_token_ids=[])))
            for s, _ in sessions:
                s.close()
            result["contexts"][ctx] = summary(f"decode at {bench._k(ctx)} context, {a.tokens} tokens, {a.rounds} rounds",
                                              rates)
        for o, e in zip(a.options, engines if a.backend == "cuda" and contexts else []):
            g = e.report()["cuda"]["graphs"]
            print(f"  {o:40s} report: GPU µs/step {g.get('gpu_us_per_decode_step')}, host µs/step "
                  f"{g.get('host_us_per_decode_step')}, capture ms/graph {g.get('capture_ms_per_graph')}")
    finally:
        for e in engines:
            e.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
