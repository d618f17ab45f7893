"""A restore (and a reset) costs no step of its own (issue 13 item 7): Session.restore records the snapshot; the
session's next forward reads the DeltaNet state straight from it and copies the KV rows the cache lacks in that
forward's step; any other reader of the state (logits, generate, snapshot, draft_logits) writes it first, and so
does the snapshot's destructor when the snapshot goes before the session has run a forward.

Every result is compared bit for bit with a session that never restored (the state computed in place) on the CPU
backend, where chunking changes no bit; the step counts come from the engine's count of submitted steps.
"""

import gc

import numpy as np
import pytest

import lily
from snapshot_util import assert_same_snapshot

TEXT = "def main():\n    args = parse()\n    run(args)\n    return 0\n" * 4
GREEDY = lily.SamplingParams()


@pytest.fixture(scope="module")
def engine():
    # mtp="on": every forward runs the MTP block's rows too, which read the restored MTP input (mtp_h)
    with lily.Engine.from_pretrained(backend="cpu", mtp="on") as e:
        yield e


@pytest.fixture(scope="module")
def ids(engine):
    ids = engine.tokenize(TEXT)
    assert len(ids) >= 48
    return ids


def steps(engine) -> int:
    return engine._core.steps_submitted()


def source(engine, ids, n=32, pending=False):
    """A session at ids[:n] (with a sampled token pending after it when `pending`) and its snapshot."""
    s = engine.session(max_context=128)
    s.prefill(ids[:n])
    if pending:
        list(s.generate(3, GREEDY, stop_token_ids=[], mtp="off"))  # the last one is pending
    return s, s.snapshot()


def test_restore_then_prefill_costs_the_prefill_steps_only(engine, ids):
    s, snap = source(engine, ids)
    ref = engine.session(max_context=128)
    ref.prefill(ids[:32])
    before = steps(engine)
    ref_logits = ref.prefill(ids[32:40])
    plain = steps(engine) - before

    t = engine.session(max_context=128)
    before = steps(engine)
    t.restore(snap)
    assert steps(engine) == before and t._core.restore_pending  # nothing written yet
    assert t.position == 32 and t.tokens == ids[:32]  # the context is the snapshot's at once
    logits = t.prefill(ids[32:40])
    assert steps(engine) - before == plain and not t._core.restore_pending
    np.testing.assert_array_equal(logits, ref_logits)
    assert_same_snapshot(t.snapshot(), ref.snapshot(), "after restore + prefill")
    assert t._core.held_kv_rows == 32  # the snapshot's rows were copied, and are known to be
    assert list(t.generate(8, GREEDY, stop_token_ids=[], mtp="on")) == \
        list(ref.generate(8, GREEDY, stop_token_ids=[], mtp="on"))


@pytest.mark.parametrize("reader", ["logits", "generate", "generate_mtp", "snapshot", "step", "prefill_snapshots",
                                    "draft_logits"])
def test_every_reader_sees_the_restored_state(engine, ids, reader):
    s, snap = source(engine, ids)
    t = engine.session(max_context=128)
    t.restore(snap)

    def read(x):
        if reader == "logits":
            return x.logits.copy()
        if reader == "generate":
            return list(x.generate(6, GREEDY, stop_token_ids=[], mtp="off"))
        if reader == "generate_mtp":
            return list(x.generate(6, GREEDY, stop_token_ids=[], mtp="on"))
        if reader == "snapshot":
            return x.snapshot()
        if reader == "step":
            return x.step(ids[32]).copy()
        if reader == "prefill_snapshots":
            return x.prefill_snapshots(ids[32:40], [36, 40])
        return x._core._draft_logits(ids[32], 3)

    got, want = read(t), read(s)
    assert not t._core.restore_pending
    if reader == "snapshot":
        assert_same_snapshot(got, want, reader)
    elif reader == "prefill_snapshots":
        for a, b in zip(got, want):
            assert_same_snapshot(a, b, reader)
    elif isinstance(got, list):
        assert got == want
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_pending_token_is_fed_by_the_restoring_step(engine, ids):
    """A snapshot taken after generate holds a sampled token not yet fed: the chunk that feeds it (as its row 0)
    reads the snapshot."""
    s, snap = source(engine, ids, pending=True)
    assert snap.position == 35
    t = engine.session(max_context=128)
    before = steps(engine)
    t.restore(snap)
    got = t.prefill(ids[32:40])
    assert steps(engine) - before == 1  # one chunk: the pending token and the ids; nothing for the restore
    np.testing.assert_array_equal(got, s.prefill(ids[32:40]))
    assert_same_snapshot(t.snapshot(), s.snapshot(), "pending token fed")


def test_a_snapshot_dropped_before_the_first_forward_writes_the_state_first(engine, ids):
    """Two sessions restored from one snapshot that is then dropped: its destructor writes both states."""
    s, snap = source(engine, ids)
    t, u = engine.session(max_context=128), engine.session(max_context=128)
    t.restore(snap)
    u.restore(snap)
    before = steps(engine)
    del snap
    gc.collect()
    assert steps(engine) - before == 2  # one write each
    assert not t._core.restore_pending and not u._core.restore_pending
    want = list(s.generate(8, GREEDY, stop_token_ids=[], mtp="off"))
    for x in (t, u):
        assert list(x.generate(8, GREEDY, stop_token_ids=[], mtp="off")) == want


def test_a_restore_replaced_before_it_is_written_is_forgotten(engine, ids):
    a_src, a = source(engine, ids, n=24)
    b_src, b = source(engine, ids, n=32)
    t = engine.session(max_context=128)
    t.restore(a)
    t.restore(b)  # replaces a: a no longer knows t
    before = steps(engine)
    del a
    gc.collect()
    assert steps(engine) == before and t._core.restore_pending
    np.testing.assert_array_equal(t.prefill(ids[32:36]), b_src.prefill(ids[32:36]))


def test_reset_is_written_by_the_next_forward(engine, ids):
    s, _ = source(engine, ids)
    before = steps(engine)
    s.reset()
    assert steps(engine) == before and s._core.restore_pending and s.position == 0
    fresh = engine.session(max_context=128)
    np.testing.assert_array_equal(s.prefill(ids[:16]), fresh.prefill(ids[:16]))
    assert steps(engine) - before == 2 and not s._core.restore_pending
    assert_same_snapshot(s.snapshot(), fresh.snapshot(), "reset then prefill")
    # a restore after a reset replaces the zeros; a reset after a restore replaces the restore
    _, snap = source(engine, ids)
    s.reset()
    s.restore(snap)
    s.reset()
    np.testing.assert_array_equal(s.prefill(ids[:16]), engine.session(max_context=128).prefill(ids[:16]))


def test_a_host_snapshot_is_written_at_once(engine, ids, tmp_path):
    s, snap = source(engine, ids)
    path = tmp_path / "s.safetensors"
    s.save(path)
    t = engine.session(max_context=128)
    t.load(path)  # staged in device tensors that live only for the call: written before it returns
    assert not t._core.restore_pending
    assert list(t.generate(6, GREEDY, stop_token_ids=[], mtp="off")) == \
        list(s.generate(6, GREEDY, stop_token_ids=[], mtp="off"))


def test_a_failed_first_forward_leaves_the_restore_owed(engine, ids):
    """A prefill refused before its step (an id outside the vocabulary) leaves the restore as it was."""
    s, snap = source(engine, ids)
    t = engine.session(max_context=128)
    t.restore(snap)
    with pytest.raises(ValueError):
        t.prefill([engine.config.vocab_size + 5])
    assert t._core.restore_pending and t.position == 32
    np.testing.assert_array_equal(t.prefill(ids[32:40]), s.prefill(ids[32:40]))


def test_a_closed_session_kept_for_reuse_forgets_its_unwritten_restore(ids):
    """Engine(keep_sessions=N): closing a session whose restore no forward has written drops it, so dropping the
    snapshot later writes nothing into the kept state (a step on whatever thread evicts the snapshot)."""
    with lily.Engine.from_pretrained(backend="cpu", keep_sessions=2) as engine:
        _, snap = source(engine, ids)
        t = engine.session(max_context=128)
        t.restore(snap)
        t.close()
        assert engine.kept_sessions() >= 1
        before = steps(engine)
        del snap
        gc.collect()
        assert steps(engine) == before
