"""The speculative loop's pipeline (Session::generate_mtp, docs/ARCHITECTURE.md "MTP speculative decoding"): the
accept decision and the rollback to the last accepted row run on the device (ops accept_drafts and copy_rows_at),
and the next iteration's pending token is written there too, so iteration n + 1 is queued behind iteration n
before the host has read n. When the caller keeps fewer of n's tokens than n accepted (a stop token, a closed
iterator, an exception in the callback), n + 1 is waited for and dropped and n's output is rolled back on the host's
word.

Run with the packaged lily-tiny and its trained MTP head, whose drafts are accepted often but not always, so that
full, partial and no acceptance all happen inside queued iterations (the synthetic test models' random heads accept
nearly nothing). Every check is against the plain loop: the same tokens, and a state equal bit for bit to a session
that fed the prompt by prefill and the generated tokens by decode steps (the CPU verifies in the decode phase, whose
products sum each row as a one-row step does).

Breaks tried, each made tests here fail: accept_drafts counting one draft too many (every loop test);
copy_rows_at ignoring its offset (the op test, and the block's hidden in the state checks); the device's rollback
of the recurrent state left out (every loop test); the host's cut leaving the position at the accepted row (the
stop-token test); the iteration in the prefill phase instead of the decode phase (every state check: a prefill's
products round differently from the decode step's); copy_rows_at not declaring its read of the index (the
shuffled-stage test: the copy ran before accept_drafts wrote it).
"""

from __future__ import annotations

import numpy as np
import pytest

import lily
import lily._core as core

GREEDY = lily.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny():
    with lily.Engine.from_pretrained(backend="cpu", mtp="on") as e:
        yield e


@pytest.fixture(scope="module")
def prompt(tiny):
    return tiny.tokenize("The old lighthouse keeper climbed the stairs every evening, and")


@pytest.fixture(scope="module")
def base(tiny, prompt):
    s = tiny.session(max_context=256)
    s.prefill(prompt)
    return list(s.generate(40, GREEDY, stop_token_ids=[], mtp="off"))


def state(session):
    return session.snapshot()._core.to_arrays()


def assert_plain_state(engine, s, prompt, tokens):
    """s holds `tokens` with the state, bit for bit, of a session that prefilled `prompt` and stepped through the
    rest of those it fed (all but a pending last one); the MTP block's cache up to the row it has computed
    (position - 1)."""
    assert s.tokens == tokens
    x = state(s)
    pending = np.asarray(x["pending"]).ravel()
    fed = tokens[:-1] if pending.size and pending[0] >= 0 else tokens
    ref = engine.session(max_context=s.max_context)
    ref.prefill(prompt)
    for t in fed[len(prompt):]:
        ref.step(t)
    y = state(ref)
    assert x.keys() == y.keys()
    last_kv = max(int(n.split(".")[1]) for n in x if n.startswith("kv."))
    pos = len(fed)
    for name in x:
        if name == "pending":
            continue
        u, v = np.asarray(x[name]), np.asarray(y[name])
        if name == f"kv.{last_kv}":
            hd = engine.config.head_dim
            u, v = u.reshape(-1, pos, hd)[:, : pos - 1], v.reshape(-1, pos, hd)[:, : pos - 1]
        assert u.shape == v.shape and np.array_equal(u.view(np.uint8), v.view(np.uint8)), name


# ---- the ops, on the CPU oracle ----

def test_accept_drafts_counts_the_leading_agreement():
    b = core.OpBench("cpu", {"threads": 1})
    cases = [([7, 3, 4, 5], [3, 4, 5, 9], 3), ([7, 3, 4, 5], [3, 4, 6, 9], 2), ([7, 3, 4, 5], [2, 4, 5, 9], 0),
             ([7, 3], [3, 8], 1), ([7], [8], 0), ([7, 3, 4], [3, 1, 4], 1)]
    for ids, y, a in cases:
        n = len(ids)
        ti = b.tensor(np.array(ids, np.int32).reshape(n, 1), "i32")
        ty = b.tensor(np.array(y, np.int32).reshape(n, 1), "i32")
        pos = b.tensor(np.array([[41]], np.int32), "i32")
        acc, nxt, out = b.empty(1, 1, "i32"), b.empty(1, 1, "i32"), b.empty(1, 1, "i32")
        b.run("accept_drafts", ids=ti, y=ty, pos_in=pos, accepted=acc, next_id=nxt, pos_out=out)
        assert (b.read(acc)[0, 0], b.read(nxt)[0, 0], b.read(out)[0, 0]) == (a, y[a], 41 + a + 1), (ids, y)
        b.run("accept_drafts", ids=ti, y=ty, pos_in=pos, accepted=acc, next_id=nxt, pos_out=pos)  # in place
        assert b.read(pos)[0, 0] == 41 + a + 1


def test_copy_rows_at_picks_a_block_or_leaves_dst():
    b = core.OpBench("cpu", {"threads": 1})
    rng = np.random.default_rng(3)
    src = rng.normal(size=(12, 5)).astype(np.float32)
    ts = b.tensor(src)
    for index, offset, block in [(2, 0, 2), (0, 1, 1), (3, 0, 3), (3, 1, None), (-1, 0, None), (0, -1, None),
                                 (1, 2, 3), (4, 0, None)]:
        old = rng.normal(size=(3, 5)).astype(np.float32)
        dst = b.tensor(old)
        b.run("copy_rows_at", src=ts, index=b.tensor(np.array([[index]], np.int32), "i32"), offset=offset, dst=dst)
        want = old if block is None else src[3 * block: 3 * block + 3]
        assert np.array_equal(b.read(dst), want), (index, offset)
    ints = b.tensor(np.arange(8, dtype=np.int32).reshape(4, 2), "i32")
    dst = b.empty(1, 2, "i32")
    b.run("copy_rows_at", src=ints, index=b.tensor(np.array([[2]], np.int32), "i32"), offset=1, dst=dst)
    assert b.read(dst).tolist() == [[6, 7]]


def test_bad_arguments_name_the_tensor():
    b = core.OpBench("cpu", {"threads": 1})
    one = b.empty(1, 1, "i32")
    ids = b.tensor(np.zeros((3, 1), np.int32), "i32")
    with pytest.raises(ValueError, match="accept_drafts: y must be I32 \\[3, 1\\]"):
        b.run("accept_drafts", ids=ids, y=b.empty(2, 1, "i32"), pos_in=one, accepted=one, next_id=one, pos_out=one)
    with pytest.raises(ValueError, match="accept_drafts: pos_in"):
        b.run("accept_drafts", ids=ids, y=ids, pos_in=b.empty(1, 1), accepted=one, next_id=one, pos_out=one)
    src = b.empty(4, 3)
    with pytest.raises(ValueError, match="copy_rows_at: index must be I32"):
        b.run("copy_rows_at", src=src, index=b.empty(1, 1), offset=0, dst=b.empty(1, 3))
    with pytest.raises(ValueError, match="copy_rows_at: src .* and dst .* must share"):
        b.run("copy_rows_at", src=src, index=one, offset=0, dst=b.empty(1, 4))
    with pytest.raises(ValueError, match="copy_rows_at: copies 4-byte"):
        b.run("copy_rows_at", src=b.empty(4, 3, "bf16"), index=one, offset=0, dst=b.empty(1, 3, "bf16"))


# ---- the loop ----

@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_queued_iterations_give_the_plain_tokens_and_state(tiny, prompt, base, k):
    s = tiny.session(max_context=256)
    s.prefill(prompt)
    out = list(s.generate(40, GREEDY, stop_token_ids=[], mtp="on", mtp_k=k))
    assert out == base
    st = s.mtp_stats()
    # Full, partial and no acceptance all happened, and the iterations were queued behind each other.
    assert 0 < st["accepted"] < st["drafted"], st
    assert st["queued"] >= st["steps"] - 3, st
    assert "decode phase" in tiny.report()["mtp"]["loop"]
    assert_plain_state(tiny, s, prompt, prompt + out)
    # The pending token went to the device by accept_drafts: the host uploaded only the first one, and read two
    # things per forward (the accepted count, the tokens).
    t = s.stats()["generate_transfers"]
    assert t["uploads"] == 1 and t["downloads"] == 2 * st["steps"], (t, st)
    more = list(s.generate(12, GREEDY, stop_token_ids=[], mtp="on", mtp_k=k))
    ref = tiny.session(max_context=256)
    ref.prefill(prompt + out)
    assert more == list(ref.generate(12, GREEDY, stop_token_ids=[], mtp="off"))


def test_a_stop_token_inside_a_queued_run(tiny, prompt, base):
    """Every stop position of the first 24 tokens: the call ends at it, the queued iteration is dropped, and the
    state is the one after the tokens before it (the stop token pending)."""
    tried = set()
    for i, stop in enumerate(base[:24]):
        if stop in tried:
            continue
        tried.add(stop)
        cut = base[: base.index(stop) + 1]
        s = tiny.session(max_context=256)
        s.prefill(prompt)
        out = list(s.generate(40, GREEDY, stop_token_ids=[stop], mtp="on", mtp_k=4))
        assert out == cut and s.finish_reason == "stop", i
        assert_plain_state(tiny, s, prompt, prompt + out)
        assert list(s.generate(6, GREEDY, stop_token_ids=[], mtp="on", mtp_k=3)) == base[len(cut): len(cut) + 6]


def test_closing_the_iterator_inside_a_queued_run(tiny, prompt, base):
    for n in range(1, 22):
        s = tiny.session(max_context=256)
        s.prefill(prompt)
        g = s.generate(40, GREEDY, stop_token_ids=[], mtp="on", mtp_k=3)
        seen = [next(g) for _ in range(n)]
        g.close()
        assert seen == base[:n]
        assert_plain_state(tiny, s, prompt, prompt + seen)


def test_an_exception_in_the_callback_keeps_what_was_received(tiny, prompt, base):
    for n in (1, 2, 5, 9):
        s = tiny.session(max_context=256)
        s.prefill(prompt)
        got = []

        def on_token(t, logits=None):
            if len(got) == n:
                raise RuntimeError("caller failed")
            got.append(t)
            return 1

        with pytest.raises(RuntimeError, match="caller failed"):
            s._core.generate(40, GREEDY.to_core(), [], on_token, False, 4)
        assert got == base[:n]
        assert_plain_state(tiny, s, prompt, prompt + got)
        assert list(s.generate(5, GREEDY, stop_token_ids=[], mtp="on", mtp_k=2)) == base[n: n + 5]


@pytest.mark.parametrize("max_tokens,room", [(7, 256), (23, 256), (40, 9), (40, 14)])
def test_limits_with_queued_iterations(tiny, prompt, base, max_tokens, room):
    ctx = len(prompt) + room
    p = tiny.session(max_context=ctx)
    p.prefill(prompt)
    want = list(p.generate(max_tokens, GREEDY, stop_token_ids=[], mtp="off"))
    s = tiny.session(max_context=ctx)
    s.prefill(prompt)
    assert list(s.generate(max_tokens, GREEDY, stop_token_ids=[], mtp="on", mtp_k=4)) == want
    assert s.finish_reason == p.finish_reason
    assert s.tokens == p.tokens


def test_seeded_sampling_with_penalties_follows_the_plain_stream(tiny, prompt):
    """The sampler's counts and rng are rolled back on the device to the last accepted row, inside queued
    iterations: a seed gives the plain sampler's tokens."""
    s = tiny.session(max_context=256)
    s.prefill(prompt)
    snap = s.snapshot()
    accepted = 0
    for seed in range(4):
        sp = lily.SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.2, presence_penalty=0.3, seed=seed)
        s.restore(snap)
        plain = list(s.generate(30, sp, stop_token_ids=[], mtp="off"))
        s.restore(snap)
        assert list(s.generate(30, sp, stop_token_ids=[], mtp="on", mtp_k=3)) == plain, seed
        accepted += s.mtp_stats()["accepted"]
    assert accepted > 0


@pytest.mark.parametrize("seed", [1, 7])
def test_a_deferred_backend_with_shuffled_stages(prompt, base, seed):
    """The CPU backend running steps on its worker thread (so the queued iteration really runs while the host reads
    the one before) with each stage's ops in a shuffled order: a missing read or write declaration of the new ops
    (accept_drafts, copy_rows_at) would let one run before what it reads."""
    with lily.Engine.from_pretrained(backend="cpu", mtp="on",
                                     backend_options={"deferred": True, "shuffle_seed": seed}) as e:
        for k in (1, 4):
            s = e.session(max_context=256)
            s.prefill(prompt)
            assert list(s.generate(40, GREEDY, stop_token_ids=[], mtp="on", mtp_k=k)) == base
            assert s.mtp_stats()["queued"] > 0
        sp = lily.SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.2, seed=3)
        s = e.session(max_context=256)
        s.prefill(prompt)
        plain = list(s.generate(30, sp, stop_token_ids=[], mtp="off"))
        s = e.session(max_context=256)
        s.prefill(prompt)
        assert list(s.generate(30, sp, stop_token_ids=[], mtp="on", mtp_k=3)) == plain
