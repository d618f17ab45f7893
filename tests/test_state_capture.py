"""DeltaNet state captured at a row inside a prefill chunk (ops.h StateCapture; issue 13 item 7, the base of MTP
rollback in issue 14) on the CPU backend, the oracle.

- conv1d_silu / gated_delta with a capture: slice i holds, bit for bit, the state_out of the same op called on rows
  0 .. first + i alone, and the captured call's own outputs are the uncaptured call's, bit for bit. (Remove the
  capture from either kernel and the slices keep the poison OpBench.empty fills them with.)
- Session.prefill_snapshots: each snapshot equals snapshot() of a session prefilled to exactly that position
  (every array of to_arrays(), bit for bit: the CPU backend's prefill does not depend on chunking), at positions
  inside chunks, at chunk ends, two in one chunk, after a pending token, on a base.
- PrefixCache.prefill takes its checkpoints through one prefill_snapshots call, never a prefill per cut.
"""

import numpy as np
import pytest

import lily
import lily._core as core
from lily.prefix_cache import PrefixCache
from snapshot_util import assert_same_snapshot

TEXT = "import os\nimport sys\nimport json\nimport time\nimport math\nimport re\nimport io\n" * 3


@pytest.fixture(scope="module")
def bench():
    return core.OpBench("cpu")


@pytest.fixture(scope="module")
def engine():
    with lily.Engine.from_pretrained() as e:
        yield e


# ---- the ops ----

def conv(bench, mixed, w, st, inplace, capture=None):
    """(out, state_out, captured slices or None) of conv1d_silu on the CPU bench."""
    T, C = mixed.shape
    hs = bench.tensor(st)
    hso = hs if inplace else bench.empty(*st.shape)
    ho = bench.empty(T, C)
    kw = {}
    if capture is not None:
        first, count = capture
        hc = bench.empty(count * st.shape[0], C)
        kw = dict(capture=hc, capture_first=first, capture_count=count)
    bench.run("conv1d_silu", mixed=bench.tensor(mixed), conv_w=bench.tensor(w), state_in=hs, state_out=hso, out=ho,
              **kw)
    return bench.read(ho), bench.read(hso), bench.read(kw["capture"]) if kw else None


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("capture", [(0, 9), (2, 3), (8, 1)], ids=["every-row", "middle", "last"])
def test_conv1d_silu_capture_is_the_state_of_the_shorter_call(bench, inplace, capture):
    rng = np.random.default_rng(3)
    T, C, K = 9, 70, 4  # rows 0 and 1 keep rows of the carried state in theirs
    mixed = rng.standard_normal((T, C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    st = rng.standard_normal((K - 1, C)).astype(np.float32)
    out, state, cap = conv(bench, mixed, w, st, inplace, capture)
    ref_out, ref_state, _ = conv(bench, mixed, w, st, inplace)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(state, ref_state)
    first, count = capture
    for i in range(count):
        _, short_state, _ = conv(bench, mixed[:first + i + 1], w, st, inplace)
        np.testing.assert_array_equal(cap[i * (K - 1):(i + 1) * (K - 1)], short_state, err_msg=f"slice {i}")


def delta_inputs(rng, T, Hk, Hv, Dk, Dv):
    qkv = rng.standard_normal((T, 2 * Hk * Dk + Hv * Dv)).astype(np.float32)
    b = (rng.standard_normal((T, Hv)) * 2.0).astype(np.float32)
    a = rng.standard_normal((T, Hv)).astype(np.float32)
    A_log = rng.uniform(np.log(0.5), np.log(16.0), (1, Hv)).astype(np.float32)
    dt_bias = rng.uniform(-7.0, -2.0, (1, Hv)).astype(np.float32)
    return qkv, b, a, A_log, dt_bias


SHAPE = (2, 4, 16, 24)  # Hk, Hv, Dk, Dv: two value heads per key head, Dk != Dv


def delta(bench, inputs, state0, inplace, capture=None):
    Hk, Hv, Dk, Dv = SHAPE
    qkv, b, a, A_log, dt_bias = inputs
    T = qkv.shape[0]
    cfg = dict(hidden=64, layers=1, vocab=16, eps=1e-6, heads=2, kv_heads=1, head_dim=32, rotary_dim=16,
               rope_theta=1e7, lin_k_heads=Hk, lin_v_heads=Hv, lin_k_dim=Dk, lin_v_dim=Dv, conv_kernel=4, experts=4,
               topk=2, moe_inter=32, shared_inter=32, full_attention=[False])
    hs = bench.tensor(state0)
    hso = hs if inplace else bench.empty(*state0.shape)
    out = bench.empty(T, Hv * Dv)
    kw = {}
    if capture is not None:
        first, count = capture
        kw = dict(capture=bench.empty(count * Hv * Dk, Dv), capture_first=first, capture_count=count)
    bench.run("gated_delta", qkv=bench.tensor(qkv), b=bench.tensor(b), a=bench.tensor(a), A_log=bench.tensor(A_log),
              dt_bias=bench.tensor(dt_bias), state_in=hs, state_out=hso, ws=bench.workspace(cfg, T, 16), out=out,
              k_heads=Hk, v_heads=Hv, k_dim=Dk, v_dim=Dv, conv_kernel=4, eps=1e-6, **kw)
    return bench.read(out), bench.read(hso), bench.read(kw["capture"]) if kw else None


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("capture", [(0, 7), (3, 2), (6, 1)], ids=["every-row", "middle", "last"])
def test_gated_delta_capture_is_the_state_of_the_shorter_call(bench, inplace, capture):
    Hk, Hv, Dk, Dv = SHAPE
    rng = np.random.default_rng(11)
    T = 7
    inputs = delta_inputs(rng, T, *SHAPE)
    state0 = (rng.standard_normal((Hv * Dk, Dv)) * 0.5).astype(np.float32)
    out, state, cap = delta(bench, inputs, state0, inplace, capture)
    ref_out, ref_state, _ = delta(bench, inputs, state0, inplace)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(state, ref_state)
    first, count = capture
    rows = Hv * Dk
    for i in range(count):
        _, short_state, _ = delta(bench, tuple(x[:first + i + 1] if x.shape[0] == T else x for x in inputs), state0,
                                  inplace)
        np.testing.assert_array_equal(cap[i * rows:(i + 1) * rows], short_state, err_msg=f"slice {i}")
    assert not np.array_equal(cap[:rows], state0)  # well posed: the state moved


def test_capture_outside_the_call_or_misshapen_is_refused(bench):
    rng = np.random.default_rng(0)
    mixed = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    st = rng.standard_normal((3, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"conv1d_silu: capture rows \[3, 5\)"):
        conv(bench, mixed, w, st, True, capture=(3, 2))
    hs = bench.tensor(st)
    with pytest.raises(ValueError, match="conv1d_silu: capture tensor must be F32"):
        bench.run("conv1d_silu", mixed=bench.tensor(mixed), conv_w=bench.tensor(w), state_in=hs, state_out=hs,
                  out=bench.empty(4, 8), capture=bench.empty(3, 7), capture_first=0, capture_count=1)


# ---- the session ----


def reference(engine, ids, n):
    """snapshot() of a session prefilled to exactly ids[:n] (its own chunking)."""
    r = engine.session(max_context=128)
    r.prefill(ids[:n])
    snap = r.snapshot()
    r.close()
    return snap


def test_prefill_snapshots_equal_snapshots_taken_there(engine):
    ids = engine.tokenize(TEXT)
    assert len(ids) >= 40
    s = engine.session(max_context=128, prefill_chunk=8)
    s.prefill(ids[:5])
    base = s.snapshot()
    # chunks of 8 from 5: 6 inside [5, 13); 9 as well, so that chunk ends at 9 (one capture per chunk); 12 inside
    # [9, 17), 16 then ends it; 17 inside [16, 24); 24 a chunk's end; 30 inside [24, 32); 40 the end.
    at = [6, 9, 12, 16, 17, 24, 30, 40]
    snaps = s.prefill_snapshots(ids[5:40], at, base=base)
    assert [x.position for x in snaps] == at
    assert [x.base_position for x in snaps] == [5] + at[:-1]  # each shares the rows of the one before
    for p, snap in zip(at, snaps):
        assert_same_snapshot(snap, reference(engine, ids, p), f"position {p}")
    assert s.tokens == ids[:40]
    r = engine.session(max_context=128)
    r.prefill(ids[:40])
    np.testing.assert_array_equal(s.logits, r.logits)
    t = engine.session(max_context=128)
    t.restore(snaps[2])  # a captured state continues like the real one
    t.prefill(ids[12:40])
    assert list(t.generate(8, lily.SamplingParams(), stop_token_ids=[])) == \
        list(r.generate(8, lily.SamplingParams(), stop_token_ids=[]))


def test_inner_checkpoints_take_the_engines_reserve_written_after_generate():
    """A checkpoint inside a chunk is captured into the engine's CheckpointReserve (state tensors allocated and
    written ahead, so no allocation or first-touch page fault on the path to the first token): the first one finds
    it empty and asks for it, the generate call after it fills it, the next inner checkpoint takes it. Each such
    snapshot equals snapshot() taken there, whichever memory it got. (Without the refill `taken` stays 0.)"""
    with lily.Engine.from_pretrained(backend="cpu") as engine:
        ids = engine.tokenize(TEXT)
        assert engine.report()["checkpoint_reserve"] == {"bytes": 0, "ready": False, "taken": 0, "refilled": 0}
        for turn, (start, at) in enumerate([(0, [10, 12]), (12, [20, 24]), (24, [33, 36])]):
            s = engine.session(max_context=128)
            if start:
                s.prefill(ids[:start])
            snaps = s.prefill_snapshots(ids[start:at[-1]], at)
            for p, snap in zip(at, snaps):
                assert_same_snapshot(snap, reference(engine, ids, p), f"turn {turn}, position {p}")
            r = engine.report()["checkpoint_reserve"]
            assert r["taken"] == turn and not r["ready"]
            list(s.generate(2, lily.SamplingParams(), stop_token_ids=[]))
            r = engine.report()["checkpoint_reserve"]
            assert r["ready"] and r["refilled"] == turn + 1
            s.close()
        # a checkpoint's own state: conv and recurrent per DeltaNet layer (plus logits and the MTP input)
        state = sum(a.nbytes for k, a in snaps[0]._core.to_arrays().items() if k.startswith(("conv", "recurrent")))
        mtp_input = 4 * engine.config.hidden_size if engine.report()["mtp"]["present"] else 0
        assert state > 0 and r["bytes"] == state + 4 * engine.config.vocab_size + mtp_input


def test_prefill_snapshots_after_a_pending_token_and_errors(engine):
    ids = engine.tokenize(TEXT)
    s = engine.session(max_context=128, prefill_chunk=16)
    s.prefill(ids[:10])
    (tok,) = list(s.generate(1, lily.SamplingParams(), stop_token_ids=[]))  # fed lazily: pending
    assert s.position == 11
    ctx = ids[:10] + [tok] + ids[10:30]
    with pytest.raises(ValueError, match=r"at must ascend strictly within \(11, 31\], got 11"):
        s.prefill_snapshots(ids[10:30], [11])
    with pytest.raises(ValueError, match="got 13 at index 1"):
        s.prefill_snapshots(ids[10:30], [14, 13])
    other = engine.session(max_context=128)
    other.prefill(ids[1:5])
    with pytest.raises(ValueError, match="not a prefix"):
        s.prefill_snapshots(ids[10:30], [14], base=other.snapshot())
    assert s.position == 11  # nothing was fed
    snaps = s.prefill_snapshots(ids[10:30], [12, 31])
    assert s.tokens == ctx
    for snap, p in zip(snaps, [12, 31]):
        r = engine.session(max_context=128)  # the same path: the pending token is the first chunk's row 0
        r.prefill(ids[:10])
        r.prefill(ctx[10:p])
        assert_same_snapshot(snap, r.snapshot(), f"position {p}")


def test_prefix_cache_takes_its_checkpoints_in_one_prefill(engine, monkeypatch):
    from lily.session import Session

    calls = []
    real = Session.prefill_snapshots

    def spy(self, ids, at, **kw):
        calls.append((len(ids), list(at)))
        return real(self, ids, at, **kw)

    def no_prefill(self, *a, **kw):
        raise AssertionError("PrefixCache.prefill split the new tokens into prefills")

    monkeypatch.setattr(Session, "prefill_snapshots", spy)
    monkeypatch.setattr(Session, "prefill", no_prefill)
    ids = engine.tokenize(TEXT)
    cache = PrefixCache(engine)
    s = engine.session(max_context=128)
    cache.prefill(s, ids[:20], checkpoints=[17])
    cache.prefill(s, ids[:36], checkpoints=[33])
    assert calls == [(20, [17, 20]), (16, [33, 36])]
    assert sorted(e.length for e in cache._entries.values()) == [17, 20, 33, 36]
    assert cache._entries[cache._key(ids[:33])].parent is cache._entries[cache._key(ids[:20])]
    assert cache._entries[cache._key(ids[:33])].snapshot.base_position == 20


# ---- kept session states (Engine(keep_sessions=N)) ----

def test_kept_sessions_restore_without_copying_held_rows_and_give_cold_tokens():
    """A conversation through PrefixCache with a new session per turn, as the server runs it: the restore moves
    the session onto the kept state already holding the checkpoint's KV rows (held_kv_rows_of), and every
    turn still gives exactly the tokens of a cold run on a fresh engine state."""
    with lily.Engine.from_pretrained(keep_sessions=2) as e:
        cache = PrefixCache(e)
        messages = [{"role": "user", "content": "def read_lines(path):"}]
        for turn in range(3):
            ids = e.apply_chat_template(messages)
            base = e.apply_chat_template(messages, add_generation_prompt=False)
            s = e.session(max_context=256)
            cached, snap = cache.lookup(ids)
            if turn:
                # some kept state holds rows of the checkpoint this turn restores; the new session holds none
                assert s._core.held_kv_rows_of(snap._core) == 0
                assert max(c.held_kv_rows_of(snap._core) for c in e._idle) > 0
            fresh = s._core
            assert cache.prefill(s, ids, checkpoints=[len(base)]) == cached
            if turn:
                assert s._core is not fresh  # moved onto the kept state
                kv_rows = len(snap._core.to_arrays()["tokens"])  # its position less a pending token
                assert s._core.held_kv_rows_of(snap._core) == kv_rows  # all of them: none was copied
            out = list(s.generate(12, lily.SamplingParams(), stop_token_ids=[]))
            c = e.session(max_context=len(ids) + 12)  # a blank kept state or a new one
            c.prefill(ids)
            assert out == list(c.generate(12, lily.SamplingParams(), stop_token_ids=[]))
            c.close()
            cache.store(s, ids + out)
            s.close()
            messages += [{"role": "assistant", "content": e.detokenize(out, skip_special_tokens=True)},
                         {"role": "user", "content": f"and turn {turn}?"}]
        assert len(e._idle) <= 2
    with pytest.raises(ValueError, match="keep_sessions"):
        lily.Engine.from_pretrained(keep_sessions=-1)


class _StateWaitingForTheEngineLock:
    """Stands in for a kept core state whose held_kv_rows waits for the engine lock (as the real one does while
    another thread's forward holds it) until `free` is set."""

    def __init__(self, max_context, chunk, free):
        self.max_context, self.chunk, self._free = max_context, chunk, free

    @property
    def held_kv_rows(self):
        assert self._free.wait(10)
        return 0

    def held_kv_rows_of(self, snapshot_core):
        assert self._free.wait(10)
        return 0

    def reset(self):  # what _keep_idle calls first (the real one only takes the engine lock for a moment)
        pass


@pytest.mark.parametrize("entry", ["keep", "take"])
def test_kept_states_lock_is_never_held_while_waiting_for_the_engine(entry):
    """Choosing which kept state to evict (a session closed past keep_sessions) or to reuse (a new session) asks
    each state for its held KV rows, which waits for the engine lock; _idle_lock must not be held meanwhile, or
    kept_sessions() (the server's /metrics) and Engine.close() wait behind a whole forward: the hang once seen
    in the server tests' teardown. (Choose under the lock again and kept_sessions() below times out.)"""
    import threading

    with lily.Engine.from_pretrained(keep_sessions=1) as e:
        free = threading.Event()
        e._idle.append(_StateWaitingForTheEngineLock(64, 32, free))
        if entry == "keep":
            chooser = threading.Thread(target=e._keep_idle, args=(_StateWaitingForTheEngineLock(64, 32, free),))
        else:
            chooser = threading.Thread(target=e._take_idle, args=(64, 32))
        chooser.start()
        try:
            counted = []
            reader = threading.Thread(target=lambda: counted.append(e.kept_sessions()), daemon=True)
            reader.start()
            reader.join(2)
            assert counted, "kept_sessions() waited behind a state's held_kv_rows"
            assert chooser.is_alive()  # the chooser was still waiting when the count came back
        finally:
            free.set()
            chooser.join(10)
        assert not chooser.is_alive()
        assert len(e._idle) <= 1
        e._idle.clear()
