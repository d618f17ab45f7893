"""The last token a generate call delivers is pending: in the context, not yet fed (a final token costs no forward
unless the context continues). When it continues with a prefill, the pending token is that prefill's first chunk's
row 0, not a decode step of its own before the chunk (on a GPU a decode step reads every weight once: the whole of
a warm turn's first forward for one token).

Compared bit for bit, on the CPU backend, with a session fed the same context by step() and prefill(); the step
counts come from the engine's count of submitted steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_restore_on_first_forward import GREEDY, engine, ids, steps  # noqa: F401  (the CPU engine with MTP, its ids)


def generated(engine, ids, chunk=64):
    """A session at ids[:16] and three generated tokens, the last one pending; and a twin fed the same context with
    the three tokens by step() (no pending token), the one the generated session is compared with."""
    s = engine.session(max_context=128, prefill_chunk=chunk)
    s.prefill(ids[:16])
    gen = list(s.generate(3, GREEDY, stop_token_ids=[], mtp="off"))
    assert s.position == 19 and s.tokens[-1] == gen[-1]
    r = engine.session(max_context=128, prefill_chunk=chunk)
    r.prefill(ids[:16])
    r.step(gen[0])
    r.step(gen[1])  # gen[2] is the pending one: r feeds it with the rest, as a prefill row
    return s, r, gen


def test_the_pending_token_rides_the_next_prefill(engine, ids):
    s, r, gen = generated(engine, ids)
    before = steps(engine)
    got = s.prefill(ids[16:24])
    assert steps(engine) - before == 1  # one chunk: no decode step for the pending token
    assert s.position == 27 and s.tokens[16:] == gen + ids[16:24]
    np.testing.assert_array_equal(got, r.prefill([gen[2]] + ids[16:24]))
    np.testing.assert_array_equal(s.logits, r.logits)
    assert list(s.generate(6, GREEDY, stop_token_ids=[])) == list(r.generate(6, GREEDY, stop_token_ids=[]))


def test_all_logits_cover_the_ids_only(engine, ids):
    s, r, gen = generated(engine, ids)
    got = s.prefill(ids[16:24], all_logits=True)
    want = r.prefill([gen[2]] + ids[16:24], all_logits=True)
    assert got.shape == (8, engine.config.vocab_size)
    np.testing.assert_array_equal(got, want[1:])  # row i: the logits after ids[16 + i]


def test_chunks_count_the_pending_row_and_progress_counts_ids(engine, ids):
    s, r, gen = generated(engine, ids, chunk=4)
    calls = []
    before = steps(engine)
    got = s.prefill(ids[16:23], progress=lambda done, total: calls.append((done, total)))
    assert steps(engine) - before == 2  # 8 rows in chunks of 4: [pending, 3 ids], [4 ids]
    assert calls == [(3, 7), (7, 7)]
    np.testing.assert_array_equal(got, r.prefill([gen[2]] + ids[16:23]))
    s, r, gen = generated(engine, ids, chunk=4)
    got = s.prefill(ids[16:23], all_logits=True)  # the rows of the first chunk after its pending row, then the second's
    np.testing.assert_array_equal(got, r.prefill([gen[2]] + ids[16:23], all_logits=True)[1:])


def test_chunks_of_one_row_feed_the_pending_token_alone_first(engine, ids):
    s, r, gen = generated(engine, ids, chunk=1)
    before = steps(engine)
    got = s.prefill(ids[16:19])
    assert steps(engine) - before == 4 and s.tokens[16:] == gen + ids[16:19]
    np.testing.assert_array_equal(got, r.prefill([gen[2]] + ids[16:19]))
    s, r, gen = generated(engine, ids, chunk=1)
    snaps = s.prefill_snapshots(ids[16:19], [21, 22])
    assert [x.position for x in snaps] == [21, 22] and s.tokens[16:] == gen + ids[16:19]


def test_a_prefill_cancelled_after_the_first_chunk_keeps_the_pending_row(engine, ids):
    s, _, gen = generated(engine, ids, chunk=4)
    got = s.prefill(ids[16:23], all_logits=True, progress=lambda done, total: False)
    assert got.shape[0] == 3 and s.position == 22 and s.tokens[16:] == gen + ids[16:19]
    s.prefill(ids[19:23])  # no pending token now: an ordinary prefill
    assert s.position == 26


def test_a_refused_prefill_leaves_the_token_pending(engine, ids):
    s, r, gen = generated(engine, ids)
    with pytest.raises(ValueError):
        s.prefill([ids[16], engine.config.vocab_size])  # an id past the vocabulary: refused before any forward
    assert s.position == 19 and s.tokens[-1] == gen[-1]
    before = steps(engine)
    got = s.prefill(ids[16:24])
    assert steps(engine) - before == 1
    np.testing.assert_array_equal(got, r.prefill([gen[2]] + ids[16:24]))


def test_snapshots_taken_in_the_chunk_with_the_pending_row(engine, ids):
    """prefill_snapshots: a position inside the first chunk (whose row 0 is the pending token) and one at its end."""
    s, r, gen = generated(engine, ids)
    before = steps(engine)
    snaps = s.prefill_snapshots(ids[16:24], [20, 27])
    assert steps(engine) - before == 1
    assert s.deferred_checkpoints == 3  # both KV segments and the end state wait for after the first token, as ever
    assert [x.position for x in snaps] == [20, 27]
    assert s.tokens[16:] == gen + ids[16:24]
    for snap, p in zip(snaps, [20, 27]):
        t = engine.session(max_context=128)
        t.restore(snap)
        w = engine.session(max_context=128)
        w.prefill(ids[:16])
        w.step(gen[0])
        w.step(gen[1])
        w.prefill([gen[2]] + ids[16:16 + p - 19])  # position p: ids[:16], the 3 generated, p - 19 more ids
        np.testing.assert_array_equal(t.logits, w.logits, err_msg=f"position {p}")
        assert t.tokens == w.tokens
