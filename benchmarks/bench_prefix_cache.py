"""Warm vs cold time to first token over a multi-turn, agent-style conversation (issue 13, item 7).

A long shared prefix (a system prompt listing tools, --prefix-tokens long) and --turns turns: each turn adds a
user message, renders the whole conversation with the model's chat template and generates --reply-tokens
greedy tokens, which join the conversation as the assistant's reply (as an agent resends everything).

Per turn it measures, in milliseconds to the first generated token:
  cold    a new session (created inside the timing, as the server creates one per request) prefills the
          whole prompt;
  warm    a new session (likewise) goes through lily.prefix_cache.PrefixCache.prefill (restore the longest cached
          prefix, prefill the rest, checkpoint where the conversation ends before its generation prompt, at
          the end of the prompt and at the end of the reply); the checkpoints' KV rows and end-of-prompt
          state are copied after the first token (PrefixCache defer_checkpoints; --eager-checkpoints copies
          them inside the prefill, as before);
  new     the floor the warm turn is held to: a session already holding the cached prefix (created and
          restored before the clock starts) prefills only the new tokens.
The conversation is replayed --repeats times with a fresh cache; within a turn cold, warm and new-only run
back to back. Medians are printed, with the cache's bytes (checkpoints sharing KV rows) next to what
the same checkpoints would hold as independent copies.

    python benchmarks/bench_prefix_cache.py [--model lily-tiny | PATH | REPO]
        [--prefix-tokens 2048] [--turns 10] [--reply-tokens 16] [--repeats 3] [--threads N] [--backend B]
        [--keep-sessions N] [--eager-checkpoints] [--backend-options JSON] [--json out.json]

The step-by-step line times the last warm turn's steps one by one; "deferred copies" is what the checkpoints
left for after the first token (written when the generation ends), off the first-token path.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository and return its text, with line numbers.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "description": "path relative to the repository root"},
        "start": {"type": "integer", "description": "first line (1-based)"},
        "end": {"type": "integer", "description": "last line, inclusive"}}, "required": ["path"]}}}
QUESTIONS = ["Read src/main.py and tell me what it does.", "Which function parses the arguments?",
             "Is there a test for it?", "Add a --verbose flag.", "What does the config loader return?",
             "Rename load to read_config.", "Where is the logging set up?", "Make the timeout configurable.",
             "Summarise the changes so far.", "Write the commit message."]


def system_prompt(engine, n_tokens: int) -> str:
    """Agent-style instructions plus tool descriptions, repeated until the text is about n_tokens long."""
    parts, i = [], 0
    base = ("You are a coding agent working in a git repository. Think step by step, call tools to read "
            "files before you change them, and keep answers short.\n")
    while len(engine.tokenize(base + "".join(parts))) < n_tokens:
        t = json.loads(json.dumps(TOOL))
        t["function"]["name"] = f"tool_{i}"
        parts.append(f"## tool_{i}\n{json.dumps(t)}\n")
        i += 1
    return base + "".join(parts)


def first_token_ms(make_session, prefill):
    """Milliseconds from creating the session (as the server does per request) through prefill(session) to
    the first generated token (greedy); returns (ms, the session)."""
    import lily

    t0 = time.perf_counter()
    session = make_session()
    prefill(session)
    gen = session.generate(1, lily.SamplingParams(), stop_token_ids=[])
    next(gen)
    ms = (time.perf_counter() - t0) * 1e3
    gen.close()
    return ms, session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint folder or repo id (default: lily-tiny)")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backend", default="auto", help="auto, cpu, cuda or metal")
    ap.add_argument("--backend-options", default="{}", help="the backend's options as JSON, e.g. for an A/B")
    ap.add_argument("--keep-sessions", type=int, default=0,
                    help="Engine(keep_sessions=N): closed sessions' state kept for the next session of the same shape")
    ap.add_argument("--eager-checkpoints", action="store_true",
                    help="take the checkpoints' copies inside the prefill (the path before deferred checkpoints)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import lily
    from lily.prefix_cache import PrefixCache

    # A checkpoint with a tokenizer and chat template (lily.synthetic's random checkpoints have neither).
    engine = lily.Engine.from_pretrained(args.model, threads=args.threads, backend=args.backend,
                                         keep_sessions=args.keep_sessions,
                                         backend_options=json.loads(args.backend_options))
    rep = engine.report()
    system = system_prompt(engine, args.prefix_tokens)

    # The conversation, fixed once: the replies are the model's greedy ones (warm turns give a cold run's
    # tokens exactly, tests/test_prefix_cache.py), so every replay renders the same prompts.
    conv: list[tuple[list[int], list[int]]] = []  # (prompt ids, ids of the conversation before its generation prompt)
    messages = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        ids = engine.apply_chat_template(messages)
        base = engine.apply_chat_template(messages, add_generation_prompt=False)
        s = engine.session(max_context=len(ids) + args.reply_tokens)
        s.prefill(ids)
        reply = list(s.generate(args.reply_tokens, lily.SamplingParams(), stop_token_ids=[]))
        s.close()
        conv.append((ids, base if ids[:len(base)] == base else []))
        messages.append({"role": "assistant", "content": engine.detokenize(reply, skip_special_tokens=True)})
    max_ctx = len(conv[-1][0]) + args.reply_tokens

    cold = [[] for _ in conv]
    warm = [[] for _ in conv]
    new = [[] for _ in conv]
    cached = [0] * len(conv)
    cache_bytes = copies_bytes = entries = 0
    breakdown: dict[str, float] = {}
    for rep_i in range(args.repeats):
        cache = PrefixCache(engine, max_bytes=1 << 40, defer_checkpoints=not args.eager_checkpoints)
        # cold, warm and new-only of one turn back to back, so a change in the machine's load shifts all three
        for t, (ids, base) in enumerate(conv):
            new_session = lambda: engine.session(max_context=max_ctx)  # noqa: E731
            ms, s = first_token_ms(new_session, lambda s: s.prefill(ids))
            cold[t].append(ms)
            s.close()
            got = {}
            ms, s = first_token_ms(new_session, lambda s: got.setdefault(
                "n", cache.prefill(s, ids, checkpoints=[len(base)] if base else [])))
            warm[t].append(ms)
            cached[t] = got["n"]
            for _ in s.generate(args.reply_tokens - 1, lily.SamplingParams(), stop_token_ids=[]):
                pass
            cache.store(s, list(s.tokens))  # the end of the reply, as the server stores it
            s.close()
            # the floor: the prefix the warm turn restored already in the session, only the rest prefilled
            n, snap = cache.lookup(ids[:cached[t] + 1])
            assert n == cached[t]
            f = new_session()
            if snap is not None:
                f.restore(snap)
                # A restore is written by the next forward or reader of the state: here, before the clock starts.
                # A snapshot reads it and leaves a pending token pending (logits would feed it: the warm turn
                # feeds it inside its clock, so must the floor).
                f.snapshot()
            ms, f = first_token_ms(lambda: f, lambda f: f.prefill(ids[n:]))
            new[t].append(ms)
            f.close()
        if rep_i == args.repeats - 1:  # where the last warm turn's time goes: its steps timed one by one
            ids, base = conv[-1]
            steps, t0 = {}, time.perf_counter()

            def lap(name: str) -> None:
                nonlocal t0
                now = time.perf_counter()
                steps[name] = steps.get(name, 0.0) + (now - t0) * 1e3
                t0 = now

            s = engine.session(max_context=max_ctx)
            lap("session")
            n, snap = cache.lookup(ids[:cached[-1] + 1])
            lap("lookup")
            s.restore(snap)
            lap("restore")
            cuts = [c for c in (len(base),) if n < c < len(ids)] + [len(ids)]
            # PrefixCache.prefill's forward; the snapshots kept (as the cache keeps them) until the end
            taken = s.prefill_snapshots(ids[n:], cuts, base=snap, defer=cache.defer_checkpoints)
            lap(f"prefill {len(ids) - n} + {len(cuts)} checkpoints")
            owed = s.deferred_checkpoints
            gen = s.generate(1, lily.SamplingParams(), stop_token_ids=[])
            next(gen)
            lap("first token")
            gen.close()  # the generation ends: what the checkpoints deferred is written by now
            assert s.deferred_checkpoints == 0
            lap(f"after it: {owed} deferred copies")
            del taken
            s.close()
            breakdown = steps
        st = cache.stats()
        cache_bytes, entries = st["bytes"], st["entries"]
        copies_bytes = sum(e.snapshot.nbytes for e in cache._entries.values())

    med = statistics.median
    print(f"model {rep['model']} ({rep['backend']}, {rep['device']}, {rep['threads']} threads), "
          f"first prompt {len(conv[0][0])} tokens (system + tools + question), {args.turns} turns, {args.reply_tokens} reply tokens, "
          f"keep_sessions {args.keep_sessions}, checkpoints {'eager' if args.eager_checkpoints else 'deferred'}, "
          f"medians of {args.repeats}")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'new':>5} | {'cold ms':>9} {'warm ms':>9} {'new-only ms':>11} "
          f"| {'cold/warm':>9} {'warm/new-only':>13}")
    rows = []
    for t, (ids, _) in enumerate(conv):
        c, w, n = med(cold[t]), med(warm[t]), med(new[t])
        rows.append({"turn": t + 1, "prompt_tokens": len(ids), "cached_tokens": cached[t], "cold_ms": c,
                     "warm_ms": w, "new_only_ms": n})
        print(f"{t + 1:>4} {len(ids):>7} {cached[t]:>7} {len(ids) - cached[t]:>5} | {c:>9.1f} {w:>9.1f} {n:>11.1f} "
              f"| {c / w:>8.1f}x {w / n:>12.2f}x")
    warm_turns = rows[1:]
    verdict = None
    if warm_turns:
        print(f"turns 2-{len(rows)}: median cold {med(r['cold_ms'] for r in warm_turns):.1f} ms, "
              f"warm {med(r['warm_ms'] for r in warm_turns):.1f} ms, "
              f"new-only {med(r['new_only_ms'] for r in warm_turns):.1f} ms")
        # issue 13 item 7: "the warm turn must cost no more than prefilling the new tokens"
        ratio = med(r["warm_ms"] / r["new_only_ms"] for r in warm_turns)
        verdict = {"median_warm_over_new_only": ratio, "met": ratio <= 1.0}
        print(f"warm / new-only, median of turns 2-{len(rows)}: {ratio:.2f}x: "
              f"{'<= 1.0, met' if ratio <= 1.0 else 'NO, above 1.0'}")
    print("last warm turn, step by step (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in breakdown.items()))
    print(f"cache: {entries} checkpoints, {cache_bytes / 2**20:.1f} MiB with shared KV rows "
          f"({copies_bytes / 2**20:.1f} MiB as independent copies)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "breakdown_ms": breakdown, "verdict": verdict,
                                                       "eager_checkpoints": args.eager_checkpoints,
                                                       "cache_bytes": cache_bytes,
                                                       "copies_bytes": copies_bytes, "entries": entries}, indent=2))


if __name__ == "__main__":
    main()
