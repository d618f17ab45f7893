"""MTP speculative decoding (issue 14 items 2 and 3) on the CPU backend, the oracle: the MTP block drafts k
tokens, the model verifies k + 1 rows in one forward, the longest accepted prefix is kept and the rest is rolled
back (Session::generate_mtp, docs/ARCHITECTURE.md "MTP speculative decoding").

- Greedy output with mtp="on" is token for token the output with mtp="off", k = 1..4, several prompts, both
  on-disk formats. A random MTP head accepts almost nothing, so the drafts are also injected
  (Session._draft_override, tests only): the greedy continuation itself (every draft accepted) and a corrupted
  one (acceptance partial, at known places).
- Rollback: after a speculative generate the session's whole state (to_arrays(): position, tokens, pending, conv,
  recurrent, every KV row below the position, the MTP block's KV and hidden, logits) equals, bit for bit, that
  of a plain generate of the same tokens; snapshot / fork / session files after it continue like the plain one.
- Sampling (temperature > 0, top-k, repetition and presence penalties): the distribution of the first three
  tokens with mtp="on" and injected drafts (so that acceptance and rejection both happen) matches the exact
  distribution computed from the model's logits: a chi-square goodness-of-fit test at a false-failure rate of
  1e-4 (fixed seeds: the outcome is deterministic). The plain sampler passes the same test (the reference is
  right), and a planted bias (a rejected draft's row kept) fails it.
- Bad input: mtp not in ("off", "on"), mtp_k outside 1..4, mtp="on" without an MTP head: ValueError naming the
  argument, and the session still works.

Breaks tried, each made the named tests fail: accepting the first draft always (greedy equality, state); no
rollback of conv/recurrent (skipping the capture copies: state); the position left at the verify's end (state);
the MTP hidden of the wrong row after rollback (state); no rollback of the penalty counts (the distribution test);
and two real bugs found on the way: the block's rows at in.pos after an in-place prefill had advanced it (state,
kv.1), and KV segments holding the block's rows unshifted (prefill_snapshots, a base snapshot's row
base_position - 1 stale).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import lily
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

PROMPTS = [[1, 5, 9, 22, 7, 100, 3], [400, 2, 2, 2, 17], list(range(30, 50)), [77]]


@pytest.fixture(scope="module", params=["hf", "mlx"])
def engine(request, tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp(f"mtp-{request.param}") / "m", TINY_CONFIG,
                                      fmt=request.param, mtp_layers=1, seed=11)
    with lily.Engine.from_pretrained(str(path), backend="cpu", prefill_chunk=8, mtp="on") as e:
        yield e


@pytest.fixture(scope="module")
def hf_engine(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("mtp-hf32") / "m", TINY_CONFIG, fmt="hf",
                                      mtp_layers=1, seed=12)
    with lily.Engine.from_pretrained(str(path), backend="cpu", prefill_chunk=8, mtp="on") as e:
        yield e


@pytest.fixture(scope="module")
def plain_engine(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("nomtp") / "m", TINY_CONFIG, fmt="hf", seed=12)
    with lily.Engine.from_pretrained(str(path), backend="cpu") as e:
        yield e


def run(engine, prompt, n, *, mtp="off", k=3, drafts=None, sampling=None, max_context=96):
    s = engine.session(max_context=max_context)
    s.prefill(prompt)
    if drafts is not None:
        s._core._draft_override(len(prompt), list(drafts))
    out = list(s.generate(n, sampling, stop_token_ids=[], mtp=mtp, mtp_k=k))
    return s, out


def drafting_session(engine, prompt, drafts, max_context=96):
    """A session prefilled with `prompt` whose drafts come from `drafts` (by context position), not the head."""
    s = engine.session(max_context=max_context)
    s.prefill(prompt)
    s._core._draft_override(len(prompt), list(drafts))
    return s


def core_generate(s, n, k, on_tokens, *, stops=(), with_logits=False, singles=None):
    """The extension's generate loop with a batch callback; `singles` collects what went through on_token."""
    singles = [] if singles is None else singles

    def on_token(t, logits=None):
        singles.append((t, logits))
        return 1

    return s._core.generate(n, lily.SamplingParams(temperature=0).to_core(), list(stops), on_token, with_logits, k,
                            None, on_tokens)


def fed_state(session):
    """A session's state as host arrays (to_arrays of a snapshot) without the pending token: the fed tokens' state."""
    return session.snapshot()._core.to_arrays()


def prefilled(engine, tokens, max_context=96):
    """A plain session fed `tokens` by prefill (the CPU's prefill is bitwise independent of chunking; decode steps
    take the GEMV path, whose sums are ordered differently: equal to ~1e-6, not bit for bit)."""
    s = engine.session(max_context=max_context)
    s.prefill(tokens)
    return s


def stepped(engine, prompt, tokens, max_context=96):
    """A plain session fed `prompt` by prefill and then `tokens` by decode steps: what a plain generate feeds, and
    what the verify forward computes on the CPU (it runs in the decode phase, whose GEMV sums each row as a one-row
    step does: bit for bit)."""
    s = prefilled(engine, prompt, max_context)
    for t in tokens:
        s.step(t)
    return s


def assert_same_state(a, b, *, exact=True):
    """Every array of two sessions' states, bit for bit (exact) or to float tolerance; the MTP block's KV cache
    (the last kv.* entry) up to the row it has computed (position - 1: the last token's pair waits for the next
    token). The pending token is compared by the callers (a prefilled reference has none)."""
    x, y = fed_state(a), fed_state(b)
    assert x.keys() == y.keys()
    last_kv = max(int(n.split(".")[1]) for n in x if n.startswith("kv."))
    for name in x:
        if name == "pending":
            continue
        u, v = np.asarray(x[name]), np.asarray(y[name])
        if name == f"kv.{last_kv}":  # K then V [kv_heads, position, head_dim]: compare rows < position - 1
            pos = len(np.asarray(x["tokens"]))
            hd = TINY_CONFIG["head_dim"]
            u, v = u.reshape(-1, pos, hd)[:, : pos - 1], v.reshape(-1, pos, hd)[:, : pos - 1]
        assert u.dtype == v.dtype and u.shape == v.shape, name
        if exact or u.dtype.kind != "f":
            assert np.array_equal(u.view(np.uint8), v.view(np.uint8)), name
        else:
            np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-4, err_msg=name)


def assert_plain_state(engine, spec, prompt, generated, plain=None):
    """spec's state is, bit for bit, a plain session that fed the prompt by prefill and everything else but the
    pending token (the last generated one) by decode steps, and the plain generate's (`plain`)."""
    assert spec.tokens == prompt + generated
    ref = stepped(engine, prompt, generated[:-1])
    assert_same_state(spec, ref)
    if plain is not None:
        assert plain.tokens == spec.tokens
        # generate() feeds a received token eagerly when its next step was already in flight (a stop token
        # then is fed, not pending): compare the states where both fed the same tokens.
        if len(fed_state(plain)["tokens"]) == len(fed_state(spec)["tokens"]):
            assert_same_state(spec, plain)


# ---- greedy: token for token ----

@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_mtp_equals_greedy(engine, k):
    for prompt in PROMPTS:
        _, base = run(engine, prompt, 24)
        s, out = run(engine, prompt, 24, mtp="on", k=k)
        assert out == base, prompt
        st = s.mtp_stats()
        assert st["steps"] > 0 and st["drafted"] > 0 and st["accepted"] <= st["drafted"]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_injected_drafts_all_accepted(engine, k):
    """Drafts = the greedy continuation: every draft is accepted, k + 1 tokens per verify forward."""
    prompt = PROMPTS[0]
    _, base = run(engine, prompt, 25)
    s, out = run(engine, prompt, 25, mtp="on", k=k, drafts=base)
    assert out == base
    st = s.mtp_stats()
    assert st["accepted"] == st["drafted"] > 0
    # The first token comes from the prefill's logits, then each forward yields k + 1 (the last ones fewer).
    assert st["steps"] == -(-(len(base) - 1) // (k + 1))
    assert st["mean_acceptance_length"] > 1


def corrupted(base, every):
    """The greedy continuation with every `every`-th token replaced (a wrong draft there)."""
    return [(t + 1) % TINY_CONFIG["vocab_size"] if i % every == every - 1 else t for i, t in enumerate(base)]


@pytest.mark.parametrize("k,every", [(2, 2), (3, 3), (4, 3), (4, 5)])
def test_injected_drafts_partial_acceptance(engine, k, every):
    prompt = PROMPTS[2]
    _, base = run(engine, prompt, 30)
    s, out = run(engine, prompt, 30, mtp="on", k=k, drafts=corrupted(base, every))
    assert out == base
    st = s.mtp_stats()
    assert 0 < st["accepted"] < st["drafted"]


# ---- rollback: the state is the plain session's ----

@pytest.mark.parametrize("k,every", [(1, 2), (3, 2), (4, 3), (4, 100)])
def test_state_after_speculative_generate_is_the_plain_state(engine, k, every):
    prompt = PROMPTS[0]
    plain, base = run(engine, prompt, 21)
    spec, out = run(engine, prompt, 21, mtp="on", k=k, drafts=corrupted(base, every))
    assert out == base
    assert spec.position == plain.position == len(prompt) + len(base)
    assert_plain_state(engine, spec, prompt, base, plain)
    # And it goes on like the plain session: a prefill (which feeds the pending token as its chunk's row 0), then
    # greedy.
    ref = stepped(engine, prompt, base[:-1])
    more = [3, 14, 15, 92]
    assert np.array_equal(spec.prefill(more, all_logits=True), ref.prefill(base[-1:] + more, all_logits=True)[1:])
    assert_same_state(spec, ref)
    cont = list(spec.generate(12, stop_token_ids=[], mtp="on", mtp_k=k))
    plain.prefill(more)
    assert cont == list(plain.generate(12, stop_token_ids=[], mtp="off"))
    for t in cont[:-1]:
        ref.step(t)
    assert spec.tokens == ref.tokens + cont[-1:]
    assert_same_state(spec, ref)


def test_random_head_rolls_back_every_step(engine):
    """The synthetic head's drafts are (almost) all rejected: every forward rolls back, the state still equals."""
    prompt = PROMPTS[1]
    plain, base = run(engine, prompt, 16)
    spec, out = run(engine, prompt, 16, mtp="on", k=4)
    assert out == base
    assert spec.mtp_stats()["accepted"] < spec.mtp_stats()["drafted"]
    assert_plain_state(engine, spec, prompt, base, plain)


def test_stop_token_inside_an_accepted_run(engine):
    """A stop token among the accepted drafts ends the call there: the tokens after it never join the context."""
    prompt = PROMPTS[0]
    _, base = run(engine, prompt, 20)
    stop = base[6]
    first = base.index(stop)
    s = drafting_session(engine, prompt, base)
    out = list(s.generate(20, stop_token_ids=[stop], mtp="on", mtp_k=4))
    assert out == base[: first + 1] and s.finish_reason == "stop"
    # The iteration's handoff ends with the stop token: nothing after it is offered.
    offered = []
    c = drafting_session(engine, prompt, base)
    assert core_generate(c, 20, 4, lambda toks, logits=None: offered.extend(toks) or (len(toks), True),
                         stops=[stop]) == "stop"
    assert base[:1] + offered == out and c.tokens == s.tokens
    p = engine.session(max_context=96)
    p.prefill(prompt)
    assert list(p.generate(20, stop_token_ids=[stop], mtp="off")) == out
    assert_plain_state(engine, s, prompt, out, p)


def test_closing_the_iterator_early_keeps_only_what_was_seen(engine):
    prompt = PROMPTS[2]
    _, base = run(engine, prompt, 20)
    s = drafting_session(engine, prompt, base)
    seen = []
    for t in s.generate(20, stop_token_ids=[], mtp="on", mtp_k=4):
        seen.append(t)
        if len(seen) == 7:
            break
    assert seen == base[:7]
    assert s.tokens == prompt + seen
    p = engine.session(max_context=96)
    p.prefill(prompt)
    g = p.generate(20, stop_token_ids=[], mtp="off")
    for _ in range(7):
        next(g)
    g.close()
    assert_plain_state(engine, s, prompt, seen, p)


def test_an_iterations_tokens_go_over_in_one_handoff(engine):
    """on_tokens takes each verify forward's kept tokens in one call (one thread handoff per iteration in
    Session.generate), in order, with their logits rows; the first token still goes through on_token."""
    prompt = PROMPTS[2]
    _, base = run(engine, prompt, 18)
    s = drafting_session(engine, prompt, base)
    batches, singles = [], []

    def on_tokens(toks, logits=None):
        assert logits is not None and logits.shape == (len(toks), engine.config.vocab_size)
        batches.append((list(toks), np.array(logits)))
        return len(toks), True

    assert core_generate(s, 18, 4, on_tokens, with_logits=True, singles=singles) == "length"
    assert [t for t, _ in singles] == base[:1]
    got = [t for toks, _ in batches for t in toks]
    assert base[:1] + got == base
    assert len(batches) == s.mtp_stats()["steps"] and max(len(b) for b, _ in batches) == 5
    # Each row is the distribution its token was sampled from: the plain generate's, position by position.
    rows = np.concatenate([singles[0][1]] + [r for _, r in batches])
    plain = engine.session(max_context=96)
    plain.prefill(prompt)
    plain_rows = []
    for t in base:
        plain_rows.append(plain.logits)
        plain.step(t)
    np.testing.assert_allclose(rows, np.stack(plain_rows), rtol=1e-4, atol=1e-4)
    assert_plain_state(engine, s, prompt, base)


def test_generate_hands_each_iteration_over_once(engine, monkeypatch):
    """Session.generate's worker thread waits for its consumer once per verify forward (plus the first token and
    the end), not once per token: on a fast GPU the per-token handoffs were the iteration's bottleneck
    (benchmarks/NOTES.md, "MTP: one handoff per iteration")."""
    import queue

    import lily.session

    puts = []

    class CountingQueue(queue.SimpleQueue):
        def put(self, item, *args, **kwargs):
            puts.append(item)
            super().put(item, *args, **kwargs)

    monkeypatch.setattr(lily.session.queue, "SimpleQueue", CountingQueue)
    prompt = PROMPTS[2]
    _, base = run(engine, prompt, 20)
    assert len(puts) == len(base) + 1  # plain decoding: one handoff per token, then the end
    puts.clear()
    s, out = run(engine, prompt, 20, mtp="on", k=4, drafts=base)
    assert out == base
    assert len(puts) == 1 + s.mtp_stats()["steps"] + 1 < len(base)
    assert [t for item in puts[:-1] for t in item[0]] == base and puts[-1] is None


@pytest.mark.parametrize("received, go_on", [(2, True), (0, True), (3, False), (5, False)])
def test_a_partly_received_handoff_keeps_what_was_received(engine, received, go_on):
    """The batch callback answers how many tokens the caller received and whether it wants more: the context
    keeps exactly those (the rest are rolled back), the call ends "cancelled", and the session goes on like a
    plain one that was given the same tokens."""
    prompt = PROMPTS[0]
    _, base = run(engine, prompt, 20)
    s = drafting_session(engine, prompt, base)
    calls = []

    def on_tokens(toks, logits=None):
        calls.append(list(toks))
        return (received, go_on) if len(calls) == 2 else (len(toks), True)

    assert core_generate(s, 20, 4, on_tokens) == "cancelled"
    assert len(calls) == 2 and len(calls[1]) == 5
    seen = base[:1] + calls[0] + calls[1][:received]
    assert seen == base[: len(seen)]
    assert s.tokens == prompt + seen
    if received:  # the last received token is pending
        assert_plain_state(engine, s, prompt, seen)
    else:  # nothing of the iteration received: the pending token it fed stays fed (as a refused on_token)
        assert_same_state(s, stepped(engine, prompt, seen))
    s._core._draft_override(0, [])
    tail = list(s.generate(3, stop_token_ids=[], mtp="off"))
    p = stepped(engine, prompt, seen)
    assert tail == list(p.generate(3, stop_token_ids=[], mtp="off"))


def test_a_failing_handoff_raises_and_leaves_the_session_usable(engine):
    prompt = PROMPTS[1]
    _, base = run(engine, prompt, 12)
    s = drafting_session(engine, prompt, base)

    def on_tokens(toks, logits=None):
        raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        core_generate(s, 12, 3, on_tokens)
    assert s.tokens == prompt + base[:1]  # the first token was received; the failed batch was not
    s._core._draft_override(0, [])
    assert list(s.generate(4, stop_token_ids=[], mtp="off")) == base[1:5]


def test_max_context_and_max_tokens_limits(engine):
    prompt = PROMPTS[0]
    for n, ctx in [(5, 96), (30, len(prompt) + 9)]:
        plain = engine.session(max_context=ctx)
        plain.prefill(prompt)
        base = list(plain.generate(n, stop_token_ids=[], mtp="off"))
        spec = engine.session(max_context=ctx)
        spec.prefill(prompt)
        spec._core._draft_override(len(prompt), base)
        assert list(spec.generate(n, stop_token_ids=[], mtp="on", mtp_k=4)) == base
        assert spec.finish_reason == plain.finish_reason
        assert_plain_state(engine, spec, prompt, base, plain)


# ---- snapshot, fork, session files after speculative decoding ----

def test_snapshot_fork_and_files_after_speculative_decode(engine, tmp_path):
    prompt = PROMPTS[0]
    plain, base = run(engine, prompt, 18)
    spec, out = run(engine, prompt, 18, mtp="on", k=3, drafts=corrupted(base, 3))
    assert out == base
    snap = spec.snapshot()
    assert snap.position == plain.position
    cont = list(plain.generate(10, stop_token_ids=[], mtp="off"))
    # restore into a fresh session, fork, and a session file: each continues like the plain session did
    r = engine.session(max_context=96)
    r.restore(snap)
    assert list(r.generate(10, stop_token_ids=[], mtp="on", mtp_k=2)) == cont
    f = spec.fork()
    assert list(f.generate(10, stop_token_ids=[], mtp="off")) == cont
    spec.save(tmp_path / "s.lily")
    arrays = snap._core.to_arrays()
    assert "mtp_h" in arrays and len(arrays["mtp_h"]) == TINY_CONFIG["hidden_size"]
    loaded = engine.load_session(tmp_path / "s.lily", max_context=96)
    assert list(loaded.generate(10, stop_token_ids=[], mtp="on", mtp_k=4)) == cont
    # the snapshot saw only accepted tokens
    assert snap._core.to_arrays()["tokens"].tolist() == (prompt + base)[:-1]


# ---- sampling: the distribution is the model's ----

SAMPLING = dict(temperature=1.0, top_k=3, repetition_penalty=1.3, presence_penalty=0.5)


def reference_probs(logits, history, prompt, p):
    """The sampler's distribution (csrc/cpu/sample.cpp) in float64: repetition penalty over the context's
    tokens, presence penalty over this call's, temperature, top-k."""
    w = logits.astype(np.float64).copy()
    seen = set(prompt) | set(history)
    for t in seen:
        w[t] = w[t] / p["repetition_penalty"] if w[t] > 0 else w[t] * p["repetition_penalty"]
    for t in set(history):
        w[t] -= p["presence_penalty"]
    w /= p["temperature"]
    top = np.argsort(-w, kind="stable")[: p["top_k"]]
    e = np.exp(w[top] - w[top].max())
    return dict(zip(top.tolist(), (e / e.sum()).tolist()))


def exact_triples(engine, prompt, p):
    """P(y1, y2, y3) for every triple the sampler can produce, from the model's logits."""
    s = engine.session(max_context=64)
    out = {}
    l0 = s.prefill(prompt)
    for y1, p1 in reference_probs(l0, [], prompt, p).items():
        s.reset()
        l1 = s.prefill(prompt + [y1])
        for y2, p2 in reference_probs(l1, [y1], prompt, p).items():
            s.reset()
            l2 = s.prefill(prompt + [y1, y2])
            for y3, p3 in reference_probs(l2, [y1, y2], prompt, p).items():
                out[(y1, y2, y3)] = p1 * p2 * p3
        s.reset()
    return out


def sample_triples(engine, prompt, n, *, mtp, drafts=None, planted=False):
    s = engine.session(max_context=64)
    s.prefill(prompt)
    snap = s.snapshot()
    counts = {}
    for seed in range(n):
        s.restore(snap)
        if drafts is not None:
            s._core._draft_override(len(prompt), drafts)
        sp = lily.SamplingParams(seed=seed, **SAMPLING)
        out = tuple(s.generate(3, sp, stop_token_ids=[], mtp=mtp, mtp_k=2))
        counts[out] = counts.get(out, 0) + 1
    return counts, s


def chi_square_p(counts, probs, n):
    from scipy.stats import chi2

    assert set(counts) <= set(probs), set(counts) - set(probs)
    cells = sorted(probs, key=probs.get)
    obs, exp, o_low, e_low = [], [], 0, 0.0
    for c in cells:  # cells expecting fewer than 5 are pooled
        if probs[c] * n < 5:
            o_low += counts.get(c, 0)
            e_low += probs[c] * n
        else:
            obs.append(counts.get(c, 0))
            exp.append(probs[c] * n)
    if e_low > 0:
        obs.append(o_low)
        exp.append(e_low)
    obs, exp = np.array(obs, float), np.array(exp, float)
    stat = ((obs - exp) ** 2 / exp).sum()
    return chi2.sf(stat, len(obs) - 1)


N_SAMPLES = 3000
ALPHA = 1e-4  # false-failure rate of each goodness-of-fit test (the seeds are fixed: a failure reproduces)


@pytest.fixture(scope="module")
def exact(hf_engine):
    prompt = PROMPTS[0]
    probs = exact_triples(hf_engine, prompt, SAMPLING)
    assert abs(sum(probs.values()) - 1) < 1e-9
    # drafts: the most likely y1, then the most likely y2 after it (accepted often, rejected often)
    y1 = max({t[0] for t in probs}, key=lambda a: sum(v for t, v in probs.items() if t[0] == a))
    y2 = max({t[1] for t in probs if t[0] == y1}, key=lambda b: sum(v for t, v in probs.items() if t[:2] == (y1, b)))
    y3 = max({t[2] for t in probs if t[:2] == (y1, y2)}, key=lambda c: probs[(y1, y2, c)])
    return prompt, probs, [y1, y2, y3]


def test_sampling_reference_is_the_plain_sampler(hf_engine, exact):
    """Well-posedness: the plain sampler fits the reference distribution (else the test below means nothing)."""
    prompt, probs, _ = exact
    counts, _ = sample_triples(hf_engine, prompt, N_SAMPLES, mtp="off")
    assert chi_square_p(counts, probs, N_SAMPLES) > ALPHA


@pytest.fixture(scope="module")
def spec_counts(hf_engine, exact):
    prompt, probs, drafts = exact
    counts, _ = sample_triples(hf_engine, prompt, N_SAMPLES, mtp="on", drafts=drafts)
    return counts


def test_speculative_sampling_has_the_model_distribution(hf_engine, exact, spec_counts):
    prompt, probs, drafts = exact
    # The injected y2 draft is accepted in some calls and rejected in others (both paths are exercised).
    accepted_paths = sum(v for t, v in spec_counts.items() if t[:2] == tuple(drafts[:2]))
    assert 0.1 * N_SAMPLES < accepted_paths < 0.9 * N_SAMPLES
    assert chi_square_p(spec_counts, probs, N_SAMPLES) > ALPHA
    # the random MTP head drafting (no injection) fits too
    counts, _ = sample_triples(hf_engine, prompt, N_SAMPLES // 3, mtp="on")
    assert chi_square_p(counts, probs, N_SAMPLES // 3) > ALPHA


def test_a_biased_sampler_fails_the_test(exact, spec_counts):
    """The test has power: keeping the y2 draft when it was rejected (the output then always takes the draft
    after y1 = d1, with the most likely y3 after it) is caught."""
    prompt, probs, drafts = exact
    d1, d2, d3 = drafts
    biased = {}
    for t, v in spec_counts.items():
        key = (d1, d2, d3) if t[0] == d1 and t[1] != d2 else t
        biased[key] = biased.get(key, 0) + v
    assert chi_square_p(biased, probs, N_SAMPLES) < ALPHA


@pytest.mark.parametrize("k", [1, 2, 4])
def test_seeded_sampling_is_the_plain_seeded_output(hf_engine, k):
    """A seed gives the plain sampler's tokens, token for token, whatever k is and whichever drafts are accepted:
    a rejected row's draw is rolled back with the row, so the n-th token takes the n-th number of the seeded stream.
    (mtp="auto" picks k from timing and the acceptance so far, so without this a seeded request would not
    reproduce.) Drafts: the plain output with every third token wrong (accepts and rejects at known places), and the
    random head's own (nearly all rejected)."""
    prompt = PROMPTS[0]
    params = dict(SAMPLING, top_k=8)
    s = hf_engine.session(max_context=96)
    s.prefill(prompt)
    snap = s.snapshot()
    for seed in range(6):
        sp = lily.SamplingParams(seed=seed, **params)
        s.restore(snap)
        plain = list(s.generate(20, sp, stop_token_ids=[], mtp="off"))
        for drafts in (corrupted(plain, 3), None):
            s.restore(snap)
            if drafts is not None:
                s._core._draft_override(len(prompt), drafts)
            assert list(s.generate(20, sp, stop_token_ids=[], mtp="on", mtp_k=k)) == plain, (seed, drafts)
            st = s.mtp_stats()
            assert st["drafted"] > st["accepted"]
            if drafts is not None:
                assert st["accepted"] > 0


# ---- bad input ----

def test_bad_mtp_arguments_raise_and_leave_the_session_usable(engine, plain_engine):
    prompt = PROMPTS[0]
    s = engine.session(max_context=64)
    s.prefill(prompt)
    before = s.tokens
    for kwargs, word in [(dict(mtp="yes"), "mtp must be one of"), (dict(mtp=True), "mtp must be one of"),
                         (dict(mtp="on", mtp_k=0), "mtp_k"), (dict(mtp="on", mtp_k=5), "mtp_k"),
                         (dict(mtp="on", mtp_k=2.0), "mtp_k")]:
        with pytest.raises(ValueError, match=word):
            s.generate(4, **kwargs)
        assert s.tokens == before
    with pytest.raises(ValueError, match="mtp must be one of"):
        engine.generate(prompt, 4, mtp="yes")
    assert len(list(s.generate(4, stop_token_ids=[], mtp="on", mtp_k=2))) == 4
    p = plain_engine.session(max_context=64)
    p.prefill(prompt)
    with pytest.raises(ValueError, match="mtp='on' needs a checkpoint with an MTP head"):
        p.generate(4, mtp="on")
    assert p.tokens == prompt
    with pytest.raises(ValueError, match="mtp_k"):  # the C++ check, for callers below the Python API
        p._core.generate(4, lily.SamplingParams().to_core(), [], lambda t: 1, False, 7)
    with pytest.raises(ValueError, match="MTP head"):
        p._core.generate(4, lily.SamplingParams().to_core(), [], lambda t: 1, False, 2)
    assert len(list(p.generate(4, stop_token_ids=[], mtp="off"))) == 4
    assert plain_engine.report()["mtp"]["present"] is False and engine.report()["mtp"]["present"] is True


# ---- the block's state in prefill_snapshots, and its size ----

def test_prefill_snapshots_carry_the_blocks_state(engine):
    """Snapshots taken inside prefill chunks (StateCapture) hold the block's KV rows and hidden of that position,
    bit for bit those of a session prefilled to it (engine chunk 8: positions inside and at chunk ends)."""
    ids = list(range(60, 90))
    s = engine.session(max_context=64)
    snaps = s.prefill_snapshots(ids, [3, 8, 13, 21])
    for snap, p in zip(snaps, [3, 8, 13, 21]):
        r = engine.session(max_context=64)
        r.restore(snap)
        assert_same_state(r, prefilled(engine, ids[:p], max_context=64))
        assert "mtp_h" in snap._core.to_arrays()


def test_snapshots_on_a_base_carry_the_row_the_base_could_not_know(engine):
    """A snapshot on a base shares the base's KV rows; the block's row base_position - 1 (token base_position's
    pair) was not computed when the base was taken, so the new segment holds it (KvSegment::row0)."""
    a, b = list(range(100, 111)), [5, 6, 7, 8, 9]
    s = engine.session(max_context=64)
    s.prefill(a)
    base = s.snapshot()
    s.prefill(b)
    list(s.generate(6, stop_token_ids=[], mtp="on", mtp_k=3))
    top = s.snapshot(base=base)
    r = engine.session(max_context=64)
    r.restore(top)
    assert_same_state(r, s)
    r2 = engine.session(max_context=64)
    r2.restore(base)
    assert_same_state(r2, prefilled(engine, a, max_context=64))


def test_state_bytes_count_the_blocks_cache(engine, plain_engine):
    for e in (engine, plain_engine):
        assert e.session(max_context=40).state_bytes == e._state_bytes(40)
    one = engine.session(max_context=41).state_bytes - engine.session(max_context=40).state_bytes
    c = TINY_CONFIG
    full = c["num_hidden_layers"] // c["full_attention_interval"]
    assert one == (full + 1) * 2 * c["num_key_value_heads"] * c["head_dim"] * 4  # + 1: the block's layer
