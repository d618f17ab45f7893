"""Time to first token when a conversation continues: a session whose last generated token is still pending
(delivered, not yet fed) prefills the next message's tokens and samples the first reply token.

Two ways to feed the pending token, timed in interleaved pairs on sessions restored from one snapshot (each
restore written before the clock, the caches flushed by a 64 MiB write before each one):
  folded    the prefill feeds it as its first chunk's row 0 (what Session.prefill does);
  separate  a decode step of its own first (forced by reading ``Session.logits``, which also downloads one row of
            logits), then the prefill: the path before the pending token joined the chunk.

    python benchmarks/bench_continue.py [--model lily-tiny | PATH | REPO] [--context 2048] [--new-tokens 18]
        [--pairs 30] [--backend auto] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
from bench_prefix_cache import first_token_ms  # session, prefill, first greedy token, timed as the prefix bench does


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint folder or repo id (default: lily-tiny)")
    ap.add_argument("--context", type=int, default=2048, help="tokens in the session before the new message")
    ap.add_argument("--new-tokens", type=int, default=18)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import lily

    engine = lily.Engine.from_pretrained(args.model, backend=args.backend, threads=args.threads)
    rep = engine.report()
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    prompt = rng.integers(0, vocab, args.context - 3).tolist()
    new = rng.integers(0, vocab, args.new_tokens).tolist()
    max_ctx = args.context + args.new_tokens + 8
    src = engine.session(max_context=max_ctx)
    src.prefill(prompt)
    list(src.generate(3, lily.SamplingParams(), stop_token_ids=[]))  # the third one stays pending
    snap = src.snapshot()
    src.close()
    flush = np.zeros((64 << 20) // 8)
    times: dict[str, list[float]] = {"folded": [], "separate": []}
    for i in range(args.pairs + 1):  # the first pair warms up
        for mode in ("folded", "separate") if i % 2 else ("separate", "folded"):
            s = engine.session(max_context=max_ctx)
            s.restore(snap)
            s.snapshot()  # the restore written before the clock; the token stays pending
            flush += 1.0
            # The separate form forces the pending token's decode step (reading the logits) before the prefill.
            ms, _ = first_token_ms(lambda: s, (lambda s: (s.logits, s.prefill(new))) if mode == "separate"
                                   else (lambda s: s.prefill(new)))
            s.close()
            if i:
                times[mode].append(ms)
    med = statistics.median
    ratio = med(f / s for f, s in zip(times["folded"], times["separate"]))
    print(f"model {rep['model']} ({rep['backend']}, {rep['device']}), context {args.context}, "
          f"{args.new_tokens} new tokens, {args.pairs} pairs")
    print(f"time to first token: folded {med(times['folded']):.2f} ms, separate {med(times['separate']):.2f} ms, "
          f"folded / separate (median of pairs) {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": rep["model"], "backend": rep["backend"], "device": rep["device"],
                       "context": args.context, "new_tokens": args.new_tokens, "pairs": args.pairs,
                       "folded_ms": times["folded"], "separate_ms": times["separate"], "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
