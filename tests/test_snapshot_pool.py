"""The engine's snapshot pool (session.h SnapshotPool): destroyed snapshots' conv/recurrent tensors are reused
by the next snapshot of the same shape, without zeroing.

- A snapshot taken into reused tensors (Session.snapshot and the checkpoints of Session.prefill_snapshots)
  holds exactly what one taken into fresh tensors holds, and a session restored from it generates a cold
  run's tokens; the reused tensors held another conversation's state before (so a missed overwrite shows).
- The pool counts its hits, keeps no more than its cap (0: nothing kept, every snapshot allocates) and
  frees what it holds when the cap drops; concurrent sessions snapshotting and dropping snapshots agree
  with a sequential run.
"""

import threading

import numpy as np
import pytest

import lily

TEXT = "def f(x):\n    return x * 2\n\nclass A:\n    pass\n" * 4


@pytest.fixture(scope="module")
def engine():
    with lily.Engine.from_pretrained() as e:
        yield e


@pytest.fixture(scope="module")
def unpooled():
    with lily.Engine.from_pretrained(snapshot_pool_bytes=0) as e:
        yield e


def arrays(snap):
    return {k: np.asarray(v).copy() for k, v in snap._core.to_arrays().items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def greedy(session, n=12):
    return list(session.generate(n, lily.SamplingParams(), stop_token_ids=[]))


def cold(engine, ids, n=12):
    s = engine.session(max_context=len(ids) + n)
    s.prefill(ids)
    out = greedy(s, n)
    s.close()
    return out


def fill_pool(engine, ids):
    """Snapshots of another conversation, destroyed: the pool then holds tensors with its (nonzero) state."""
    s = engine.session(max_context=len(ids) + 4)
    s.prefill(ids[::-1])
    snaps = [s.snapshot() for _ in range(3)]
    del snaps
    s.close()


def test_pooled_snapshot_equals_a_fresh_one(engine, unpooled):
    ids = engine.tokenize(TEXT)
    fill_pool(engine, ids)
    hits0 = engine.report()["snapshot_pool"]["hits"]
    s = engine.session(max_context=len(ids) + 12)
    s.prefill(ids)
    snap = s.snapshot()
    assert engine.report()["snapshot_pool"]["hits"] > hits0  # it took reused tensors
    u = unpooled.session(max_context=len(ids) + 12)
    u.prefill(ids)
    assert_same(arrays(snap), arrays(u.snapshot()))
    r = engine.session(max_context=len(ids) + 12)
    r.restore(snap)
    assert greedy(r) == cold(unpooled, ids)


def test_pooled_prefill_checkpoints_equal_fresh_ones(engine, unpooled):
    ids = engine.tokenize(TEXT)
    at = [7, 20, len(ids)]  # one inside a chunk (StateCapture), one at the end
    got = {}
    for e in (engine, unpooled):
        fill_pool(e, ids)
        s = e.session(max_context=len(ids) + 12, prefill_chunk=16)
        snaps = s.prefill_snapshots(ids, at)
        got[e] = [arrays(x) for x in snaps]
        after = greedy(s)
        # each checkpoint restores into a session that continues as a cold run of its prefix
        for p, x in zip(at, snaps):
            r = e.session(max_context=len(ids) + 12)
            r.restore(x)
            assert greedy(r, 6) == cold(unpooled, ids[:p], 6), p
        assert after == cold(unpooled, ids)
    for a, b in zip(got[engine], got[unpooled]):
        assert_same(a, b)


def test_cap_and_counts(engine, unpooled):
    ids = engine.tokenize(TEXT)
    s = unpooled.session(max_context=len(ids))
    s.prefill(ids)
    for _ in range(3):
        s.snapshot()  # destroyed at once
    st = unpooled.report()["snapshot_pool"]
    assert st["max_bytes"] == 0 and st["bytes"] == 0 and st["hits"] == 0

    s = engine.session(max_context=len(ids))
    s.prefill(ids)
    a = s.snapshot()
    p0 = engine.report()["snapshot_pool"]["bytes"]
    del a  # its conv/recurrent tensors go to the pool (its logits and KV rows are freed)
    st = engine.report()["snapshot_pool"]
    assert p0 < st["bytes"] <= st["max_bytes"]
    before = engine.report()["memory"]["backend_buffers_bytes"]
    engine._core.set_snapshot_pool_bytes(0)  # frees what the pool holds
    assert engine.report()["snapshot_pool"]["bytes"] == 0
    assert engine.report()["memory"]["backend_buffers_bytes"] == before - st["bytes"]
    engine._core.set_snapshot_pool_bytes(256 << 20)
    with pytest.raises(ValueError):
        lily.Engine.from_pretrained(snapshot_pool_bytes=-1)


def test_concurrent_sessions_share_the_pool(engine, unpooled):
    ids = engine.tokenize(TEXT)
    prompts = [ids[i:] + ids[:i] for i in range(4)]
    want = [cold(unpooled, p) for p in prompts]
    errors, got = [], [None] * len(prompts)

    def run(i):
        try:
            p = prompts[i]
            s = engine.session(max_context=len(p) + 12)
            for _ in range(3):
                s.reset()
                snaps = s.prefill_snapshots(p, [5, len(p)])
                del snaps  # back to the pool, for whichever thread takes next
            r = engine.session(max_context=len(p) + 12)
            r.restore(s.snapshot())
            got[i] = greedy(r)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == want
