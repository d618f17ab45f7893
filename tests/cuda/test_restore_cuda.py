"""A restore without a step of its own (Session.restore, tests/test_restore_on_first_forward.py on the CPU) on the
CUDA backend with lily-tiny: the next forward reads the snapshot's state in place of the session's, through the
prefill kernels (a chunk, whose row 0 is a pending token when the snapshot has one) or the decode kernels (a pending
token's step before a generate, begun with `once`: neither memoised nor captured as a graph). Bit for bit what a restore written first gives (the same kernels on the same values, only the
tensors they read from differ); the restored state matches the CPU backend's; the checkpoint reserve's tensors
hold what a fresh allocation would."""

from __future__ import annotations

import numpy as np
import pytest

import lily
from snapshot_util import assert_same_snapshot
from test_restore_on_first_forward import GREEDY, TEXT  # the CPU twin's prompt

from cuda_util import rel_err, requires_cuda

pytestmark = requires_cuda


@pytest.fixture(scope="module")
def gpu():
    with lily.Engine.from_pretrained(backend="cuda", mtp="on") as e:
        yield e


def source(engine, ids, pending):
    s = engine.session(max_context=128)
    s.prefill(ids[:32])
    if pending:
        list(s.generate(3, GREEDY, stop_token_ids=[], mtp="off"))  # the last id is pending
    return s.snapshot()


def written_first(engine, snap):
    """A session holding snap's state written before any forward (a snapshot reads it, keeping a pending token)."""
    t = engine.session(max_context=128)
    t.restore(snap)
    t.snapshot()
    assert not t._core.restore_pending
    return t


@pytest.mark.parametrize("pending, first", [(False, "prefill"), (True, "prefill"), (True, "generate")],
                         ids=["chunk-reads-it", "chunk-with-the-pending-token-reads-it", "pending-token-step-reads-it"])
def test_first_forward_reads_the_snapshot_bit_for_bit(gpu, pending, first):
    ids = gpu.tokenize(TEXT)
    snap = source(gpu, ids, pending)
    ref = written_first(gpu, snap)
    forward = (lambda s: s.prefill(ids[32:40])) if first == "prefill" else \
        (lambda s: np.asarray(list(s.generate(1, GREEDY, stop_token_ids=[], mtp="off"))))
    want = forward(ref)
    captured = gpu.report()["cuda"]["graphs"]["captured"]
    t = gpu.session(max_context=128)
    t.restore(snap)
    assert t._core.restore_pending
    np.testing.assert_array_equal(forward(t), want)
    assert gpu.report()["cuda"]["graphs"]["captured"] == captured  # the restoring decode step was not captured
    assert_same_snapshot(t.snapshot(), ref.snapshot(), "after the first forward")
    assert list(t.generate(8, GREEDY, stop_token_ids=[], mtp="on")) == \
        list(ref.generate(8, GREEDY, stop_token_ids=[], mtp="on"))


def test_restored_state_matches_the_cpu(gpu):
    ids = gpu.tokenize(TEXT)
    with lily.Engine.from_pretrained(backend="cpu", mtp="on") as cpu:
        got, want = [], []
        for engine, out in ((gpu, got), (cpu, want)):
            t = engine.session(max_context=128)
            t.restore(source(engine, ids, pending=True))
            out.append(t.prefill(ids[32:40]))
        assert rel_err(got[0], want[0]) < 5e-2  # a wrong set or row reads as ~1 (as test_deferred_checkpoints_cuda)


def test_reserve_tensors_capture_like_fresh_ones():
    """The same prefill_snapshots call twice on equal sessions of a fresh engine: the first inner checkpoint gets
    fresh tensors (the reserve is empty), the second the reserve the first call's generate refilled; the same
    computation, so the same bits."""
    with lily.Engine.from_pretrained(backend="cuda", mtp="on") as e:
        ids = e.tokenize(TEXT)
        got = []
        for turn in range(2):
            s = e.session(max_context=128)
            s.prefill(ids[:12])
            snaps = s.prefill_snapshots(ids[12:24], [21, 24])
            got.append(snaps[0])
            assert e.report()["checkpoint_reserve"]["taken"] == turn
            list(s.generate(2, GREEDY, stop_token_ids=[], mtp="off"))
            assert e.report()["checkpoint_reserve"]["ready"]
        assert_same_snapshot(got[1], got[0], "inner checkpoint in the reserve's tensors")
