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


@pytest.mark.parametrize("n", [1, 3])
def test_mtp_input_is_the_two_normalised_halves(n):
    """mtp_input (the MTP block's fc input, one op) = [rms_norm(table[ids]) * w_e | rms_norm(h) * w_h], against
    numpy in float64: one row (the norms write out's halves) and several (through `normed` and copies)."""
    H, rows = 96, 50
    rng = np.random.default_rng(n)
    table = rng.normal(size=(rows, H)).astype(np.float32)
    ids = rng.integers(0, rows, size=(n, 1)).astype(np.int32)
    h = rng.normal(size=(n, H)).astype(np.float32) * 3
    w_e, w_h = rng.uniform(0.5, 1.5, (1, H)).astype(np.float32), rng.uniform(0.5, 1.5, (1, H)).astype(np.float32)
    b = core.OpBench("cpu", {"threads": 1})
    out = b.tensor(np.full((n, 2 * H), 7.0, np.float32))
    b.run("mtp_input", ids=b.tensor(ids, "i32"), table=b.weight({"kind": "dense", "dtype": "f32", "shape": [rows, H],
                                                                 "data": table}),
          h=b.tensor(h), w_e=b.tensor(w_e), w_h=b.tensor(w_h), eps=1e-6, e=b.empty(n, H), normed=b.empty(n, H),
          out=out)

    def norm(x, w):
        x = x.astype(np.float64)
        return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * w

    want = np.concatenate([norm(table[ids[:, 0]], w_e), norm(h, w_h)], axis=1)
    np.testing.assert_allclose(b.read(out), want, rtol=1e-5, atol=1e-6)


def sampler_state(b, vocab, rng, seed_words):
    return dict(counts=b.tensor(rng.integers(0, 3, (1, vocab)).astype(np.int32), "i32"),
                seen=b.tensor((rng.random((1, vocab)) < 0.1).astype(np.int32), "i32"),
                rng=b.tensor(seed_words, "i32"), ring=b.tensor(np.zeros((8, 1), np.int32), "i32"),
                ring_count=b.tensor(np.array([[5]], np.int32), "i32"))


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.3,
                                                                   presence_penalty=0.5, frequency_penalty=0.4),
                                    dict(temperature=0.9, top_k=20, seed=11)], ids=["greedy", "penalties", "seeded"])
def test_sample_over_rows_is_one_call_per_row(params):
    """sample over logits [T, vocab] (the verify's rows in one op) = T one-row calls in row order: the same ids,
    and the same counts, seen mask, rng words and ring after them."""
    vocab, T = 300, 5
    rng = np.random.default_rng(8)
    logits = (rng.normal(size=(T, vocab)) * 3).astype(np.float32)
    logits[:, 17] = logits.max(axis=1) + 0.5  # every row's maximum at one id: the penalties' counts then matter
    words = rng.integers(-2**31, 2**31 - 1, (1, 626), dtype=np.int64).astype(np.int32)
    words[0, 624] = 312
    got = []
    for rows_at_once in (True, False):
        b = core.OpBench("cpu", {"threads": 1})
        st = sampler_state(b, vocab, np.random.default_rng(9), words)
        ws = b.workspace(dict(hidden=64, layers=1, vocab=vocab, eps=1e-6, heads=2, kv_heads=1, head_dim=32,
                              rotary_dim=16, rope_theta=1e4, lin_k_heads=1, lin_v_heads=1, lin_k_dim=32,
                              lin_v_dim=32, conv_kernel=4, experts=4, topk=2, moe_inter=32, shared_inter=32,
                              full_attention=[True]), T, 64)
        ids = b.empty(T, 1, "i32")
        if rows_at_once:
            b.run("sample", phase="decode", logits=b.tensor(logits), next_id=ids, ws=ws, **st, **params)
        else:
            for r in range(T):
                b.run("sample", phase="decode", logits=b.view(b.tensor(logits), r, 1), next_id=b.view(ids, r, 1),
                      ws=ws, **st, **params)
        got.append([b.read(ids)] + [b.read(st[k]) for k in ("counts", "seen", "rng", "ring", "ring_count")])
    for u, v in zip(*got):
        np.testing.assert_array_equal(u, v)
    assert got[0][5][0, 0] == 5 + T
    if "repetition_penalty" in params:  # the rows saw the penalties the rows before them added
        assert len(set(got[0][0].ravel().tolist())) > 1


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
    st = dict(counts=b.empty(1, 10, "i32"), seen=b.empty(1, 10, "i32"), rng=b.empty(1, 626, "i32"),
              ring=b.empty(4, 1, "i32"), ring_count=one, ws=b.empty(1, 4096))
    with pytest.raises(ValueError, match="sample: logits .* and next_id .* must have the same number of rows"):
        b.run("sample", phase="decode", logits=b.empty(3, 10), next_id=b.empty(2, 1, "i32"), **st)
    table = b.weight({"kind": "dense", "dtype": "f32", "shape": [5, 8], "data": np.ones((5, 8), np.float32)})
    args = dict(ids=b.empty(2, 1, "i32"), table=table, h=b.empty(2, 8), w_e=b.empty(1, 8), w_h=b.empty(1, 8),
                e=b.empty(2, 8), normed=b.empty(2, 8), out=b.empty(2, 16))
    with pytest.raises(ValueError, match="mtp_input: out must be F32 \\[2, 16\\]"):
        b.run("mtp_input", **(args | {"out": b.empty(2, 8)}))
    with pytest.raises(ValueError, match="mtp_input: w_h must be F32"):
        b.run("mtp_input", **(args | {"w_h": b.empty(1, 7)}))
    with pytest.raises(ValueError, match="mtp_input: the embedding table"):
        b.run("mtp_input", **(args | {"h": b.empty(2, 9), "e": b.empty(2, 9), "normed": b.empty(2, 9),
                                     "w_e": b.empty(1, 9), "w_h": b.empty(1, 9), "out": b.empty(2, 18)}))


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
