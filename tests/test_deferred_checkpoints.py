"""Deferred checkpoints (issue 13 item 7): Session.prefill_snapshots(defer=True) leaves the snapshots' KV rows and
the end-of-prompt state off the path to the first token; the session writes them after the first token (before
the second decode step overwrites the state set they come from), at the end of generate, at its next call, or
whoever reads a snapshot first does (restore into any session, to_host).

Every test compares against the eager path (defer=False) bit for bit (every array of to_arrays) and against a
cold run's tokens: reading before generation, after a whole generation, after one that stops at its first token,
after one cancelled or raised into, after closing the session at once (with and without kept session states),
and while another thread restores the snapshots as the owner generates.
"""

import threading

import pytest

import lily
from lily.prefix_cache import PrefixCache
from snapshot_util import assert_same_snapshot

TEXT = "import os\nimport sys\nimport json\nimport time\nimport math\nimport re\nimport io\n" * 3
GREEDY = lily.SamplingParams()


@pytest.fixture(scope="module")
def engine():
    with lily.Engine.from_pretrained() as e:
        yield e


@pytest.fixture(params=["off", "on"], ids=["plain", "mtp"])
def mtp(request):
    """generate's two loops: plain pipelined decode steps, and MTP speculative decoding (lily-tiny has a head)."""
    return request.param


@pytest.fixture(scope="module")
def ids(engine):
    ids = engine.tokenize(TEXT)
    assert len(ids) >= 40
    return ids


def take(engine, ids, defer, chunk=8):
    """A session with ids[:5] and a base snapshot there, then prefill_snapshots of ids[5:30] at an inner position
    (17, inside the chunk [13, 21)) and at the end (30, the last chunk's end): (session, base, snapshots)."""
    s = engine.session(max_context=128, prefill_chunk=chunk)
    s.prefill(ids[:5])
    base = s.snapshot()
    snaps = s.prefill_snapshots(ids[5:30], [17, 30], base=base, defer=defer)
    return s, base, snaps


def eager(engine, ids, mtp):
    s, base, snaps = take(engine, ids, defer=False)
    assert s.deferred_checkpoints == 0
    tokens = list(s.generate(8, GREEDY, stop_token_ids=[], mtp=mtp))
    s.close()
    return snaps, tokens


def continue_from(engine, snap, mtp, n=8):
    t = engine.session(max_context=128)
    t.restore(snap)
    out = list(t.generate(n, GREEDY, stop_token_ids=[], mtp=mtp))
    t.close()
    return out


def test_deferred_copies_are_owed_until_read_and_then_equal_the_eager_ones(engine, ids, mtp):
    want, tokens = eager(engine, ids, mtp)
    s, base, snaps = take(engine, ids, defer=True)
    # two KV segments (rows [5, 17) and [17, 30)) and the end-of-prompt state
    assert s.deferred_checkpoints == 3
    for got, ref, p in zip(snaps, want, [17, 30]):
        assert_same_snapshot(got, ref, f"position {p}")  # to_arrays settles them first
    assert s.deferred_checkpoints == 0
    assert list(s.generate(8, GREEDY, stop_token_ids=[], mtp=mtp)) == tokens
    assert continue_from(engine, snaps[1], mtp) == tokens


def test_deferred_tensors_are_allocated_when_written(engine, ids):
    """The owed copies' tensors are allocated when they are written, not inside the prefill (on CUDA each
    allocation is an alloc, a memset and a sync); their sizes are known from the start."""
    per_token = engine.report()["memory"]["kv_cache_bytes_per_token"]
    buffers = lambda: engine.report()["memory"]["backend_buffers_bytes"]  # noqa: E731
    s = engine.session(max_context=128, prefill_chunk=8)
    (base,) = s.prefill_snapshots(ids[:8], [8], defer=False)  # also sizes the session's prefill scratch
    b0 = buffers()
    reserve = engine.report()["checkpoint_reserve"]  # ready once an earlier generate refilled it
    snaps = s.prefill_snapshots(ids[8:30], [17, 30], base=base)
    own = [x.own_nbytes for x in snaps]
    # inside the prefill: only the inner snapshot's state (the capture writes it there, into the engine's
    # checkpoint reserve when that was ready: allocated before); tokens are host-side
    inner_state = own[0] - 4 * 17 - 9 * per_token
    before = reserve["bytes"] if reserve["ready"] else 0
    assert before in (0, inner_state)
    assert buffers() - b0 == inner_state - before
    assert engine.report()["checkpoint_reserve"]["taken"] == reserve["taken"] + bool(before)
    s.reset()  # writes what it owes first
    assert s.deferred_checkpoints == 0
    assert buffers() - b0 == own[0] + own[1] - 4 * (17 + 30) - before
    assert [x.own_nbytes for x in snaps] == own


@pytest.mark.parametrize("n", [1, 2, 8])
def test_generation_writes_them(engine, ids, n, mtp):
    """After generate (stopped at its first token, at the second, or later), nothing is owed and the snapshots
    hold the end-of-prompt state, not the state the decode steps went on to write."""
    want, tokens = eager(engine, ids, mtp)
    s, base, snaps = take(engine, ids, defer=True)
    assert list(s.generate(n, GREEDY, stop_token_ids=[], mtp=mtp)) == tokens[:n]
    assert s.deferred_checkpoints == 0  # written by the generation itself, not by the reads below
    for got, ref, p in zip(snaps, want, [17, 30]):
        assert_same_snapshot(got, ref, f"position {p} after generate({n})")
    assert continue_from(engine, snaps[1], mtp) == tokens


def test_a_stop_token_first_and_a_generation_raised_into(engine, ids, mtp):
    want, tokens = eager(engine, ids, mtp)
    s, base, snaps = take(engine, ids, defer=True)
    assert list(s.generate(8, GREEDY, stop_token_ids=[tokens[0]], mtp=mtp)) == tokens[:1]
    assert s.deferred_checkpoints == 0
    assert_same_snapshot(snaps[1], want[1], "after a stop at the first token")

    s, base, snaps = take(engine, ids, defer=True)
    gen = s.generate(8, GREEDY, stop_token_ids=[], mtp=mtp)
    assert next(gen) == tokens[0]
    with pytest.raises(RuntimeError, match="consumer"):
        gen.throw(RuntimeError("consumer"))
    assert s.deferred_checkpoints == 0
    assert_same_snapshot(snaps[1], want[1], "after a generation raised into")

    s, base, snaps = take(engine, ids, defer=True)
    gen = s.generate(8, GREEDY, stop_token_ids=[], mtp=mtp)
    next(gen)
    next(gen)
    gen.close()  # cancelled after the second token: the second decode step had to write them first
    assert s.deferred_checkpoints == 0
    assert_same_snapshot(snaps[1], want[1], "after a cancelled generation")
    assert_same_snapshot(snaps[0], want[0], "the inner position after a cancelled generation")


@pytest.mark.parametrize("call", ["prefill", "step", "reset", "restore", "snapshot"])
def test_the_sessions_next_call_writes_them_first(engine, ids, call, mtp):
    want, tokens = eager(engine, ids, mtp)
    s, base, snaps = take(engine, ids, defer=True)
    if call == "prefill":
        s.prefill(ids[30:36])
    elif call == "step":
        s.step(ids[30])
    elif call == "reset":
        s.reset()
    elif call == "restore":
        s.restore(base)
    else:
        s.snapshot()
    assert s.deferred_checkpoints == 0
    for got, ref, p in zip(snaps, want, [17, 30]):
        assert_same_snapshot(got, ref, f"position {p} after {call}")


@pytest.mark.parametrize("keep", [0, 1])
def test_closing_the_session_at_once(ids, keep, mtp):
    """Closed right after the prefill: the snapshots still read as the eager ones, restored into a new session
    (with keep_sessions, onto the closed session's own kept state) they continue like a cold run."""
    with lily.Engine.from_pretrained(keep_sessions=keep) as e:
        want, tokens = eager(e, ids, mtp)
        s, base, snaps = take(e, ids, defer=True)
        s.close()
        assert continue_from(e, snaps[1], mtp) == tokens
        assert_same_snapshot(snaps[1], want[1], "after close")
        assert_same_snapshot(snaps[0], want[0], "inner, after close")
        s, base, snaps = take(e, ids, defer=True)
        s.close()
        del base
        t = e.session(max_context=128)
        t.restore(snaps[0])  # the inner position: continue with the rest of the prompt
        t.prefill(ids[17:30])
        assert list(t.generate(8, GREEDY, stop_token_ids=[], mtp=mtp)) == tokens


def test_dropped_snapshots_are_not_written(engine, ids, mtp):
    """A snapshot released before its copies were written unregisters itself; the session goes on as usual."""
    want, tokens = eager(engine, ids, mtp)
    s, base, snaps = take(engine, ids, defer=True)
    inner = snaps[0]
    del snaps  # the end snapshot (state and its KV segment) goes; the inner one's segment stays owed
    assert s.deferred_checkpoints == 1
    assert list(s.generate(8, GREEDY, stop_token_ids=[], mtp=mtp)) == tokens
    assert s.deferred_checkpoints == 0
    assert_same_snapshot(inner, want[0], "inner, its sibling dropped")


def test_another_thread_restores_them_while_the_owner_generates(engine, ids, mtp):
    want, tokens = eager(engine, ids, mtp)
    for _ in range(4):
        s, base, snaps = take(engine, ids, defer=True)
        got, errors = [], []
        ready = threading.Event()

        def reader():
            try:
                ready.wait()
                got.append(continue_from(engine, snaps[1], mtp))
            except BaseException as exc:  # re-raised below
                errors.append(exc)

        th = threading.Thread(target=reader)
        th.start()
        gen = s.generate(8, GREEDY, stop_token_ids=[], mtp=mtp)
        out = [next(gen)]
        ready.set()  # the reader's restore settles the owner's copies, or the owner's second step did
        out += list(gen)
        th.join()
        assert not errors, errors
        assert out == tokens and got == [tokens]
        assert_same_snapshot(snaps[1], want[1], "after a concurrent restore")


def test_prefix_cache_eager_and_deferred_agree(engine, mtp):
    """The cache's checkpoints are the same with defer_checkpoints on or off, and warm turns give a cold run's
    tokens either way."""
    runs = {}
    for defer in (False, True):
        cache = PrefixCache(engine, max_bytes=64 << 20, defer_checkpoints=defer)
        messages = [{"role": "user", "content": "def read_lines(path):"}]
        outs = []
        for turn in range(3):
            prompt = engine.apply_chat_template(messages)
            cut = engine.apply_chat_template(messages, add_generation_prompt=False)
            s = engine.session(max_context=len(prompt) + 16)
            cache.prefill(s, prompt, checkpoints=[len(cut)])
            assert (s.deferred_checkpoints > 0) == defer  # owed until the generation writes them
            out = list(s.generate(16, GREEDY, stop_token_ids=[], mtp=mtp))
            assert s.deferred_checkpoints == 0
            cache.store(s, prompt + out)
            s.close()
            outs.append(out)
            messages += [{"role": "assistant", "content": engine.detokenize(out, skip_special_tokens=True)},
                         {"role": "user", "content": f"and turn {turn}?"}]
        runs[defer] = (outs, cache)
    assert runs[False][0] == runs[True][0]
    a, b = runs[False][1]._entries, runs[True][1]._entries
    assert a.keys() == b.keys() and len(a) >= 6
    for k in a:
        assert_same_snapshot(b[k].snapshot, a[k].snapshot, f"entry of {a[k].length} tokens")
