"""Inputs that used to crash the process or give wrong results: each now gives a clear error or the right
answer, and leaves the engine and session usable."""

from __future__ import annotations

import numpy as np
import pytest

import lily

NO_STOP: list[int] = []


@pytest.fixture(scope="module")
def eng():
    return lily.Engine.from_pretrained()


@pytest.mark.parametrize("max_context", [2**53, 2**46, 2**62])
def test_huge_max_context_is_refused_before_any_allocation(eng, max_context):
    # Used to be accepted: the KV byte count overflowed to 0 and the next prefill wrote out of bounds.
    with pytest.raises(ValueError, match="max_context"):
        eng.session(max_context=max_context)
    s = eng.session(max_context=32)  # the engine is still usable
    s.prefill(eng.tokenize("def f(x):"))
    assert s.position > 0


@pytest.mark.parametrize("temperature", [1e-9, 1e-30, 1e-45])
def test_tiny_temperature_behaves_like_greedy(eng, temperature):
    # Used to sample the least likely token: the scaled logits left float range.
    s = eng.session(max_context=64)
    s.prefill(eng.tokenize("def read_lines(path):"))
    snap = s.snapshot()
    greedy = list(s.generate(10, stop_token_ids=NO_STOP))
    s.restore(snap)
    got = list(s.generate(10, lily.SamplingParams(temperature=temperature, seed=3), stop_token_ids=NO_STOP))
    assert got == greedy


def test_engine_close_with_live_sessions_and_generators():
    import threading

    e = lily.Engine.from_pretrained()
    a, b = e.session(max_context=2048), e.session(max_context=2048)
    for s in (a, b):
        s.prefill(e.tokenize("def f(x):"))
    suspended = a.generate(1000, stop_token_ids=NO_STOP)
    next(suspended)
    got: list[int] = []

    def consume():
        for tok in b.generate(1500, stop_token_ids=NO_STOP):
            got.append(tok)

    t = threading.Thread(target=consume)
    t.start()
    while len(got) < 3:
        pass
    e.close()
    t.join(timeout=60)
    assert not t.is_alive() and b.finish_reason == "cancelled" and len(got) < 1500
    assert list(suspended) == [] and a.finish_reason == "cancelled"  # ends, yields nothing more
    for call in (lambda: a.position, lambda: b.step(1), lambda: e.session(), lambda: e.report(),
                 lambda: list(a.generate(3))):
        with pytest.raises(lily.LilyError, match="closed"):
            call()
    e.close()  # twice is fine


def test_context_managers_close():
    with lily.Engine.from_pretrained() as e:
        with e.session(max_context=64) as s:
            s.prefill(e.tokenize("x = 1"))
        with pytest.raises(lily.LilyError, match="Session is closed"):
            s.step(1)
    assert e.closed
    with pytest.raises(lily.LilyError, match="Engine is closed"):
        e.generate("x", max_tokens=1)


@pytest.mark.parametrize("bad", [2**63, 2**64, -1, 1.5, True, "8"])
def test_sizes_beyond_int64_or_of_the_wrong_type_name_the_argument(eng, bad):
    with pytest.raises(ValueError, match="max_context"):
        eng.session(max_context=bad)
    s = eng.session(max_context=64)
    s.prefill(eng.tokenize("x = 1"))
    with pytest.raises(ValueError, match="max_tokens"):
        list(s.generate(bad, stop_token_ids=NO_STOP))
    assert s.position == len(eng.tokenize("x = 1"))


def test_inputs_the_signatures_promise(eng):
    s = eng.session(max_context=64)
    ids = eng.tokenize("import os")
    a = s.prefill(iter(ids))  # any iterable of ints
    t = eng.session(max_context=64)
    assert np.array_equal(a, t.prefill(ids))
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\]"):
        list(s.generate(3, stop_token_ids=[1.7]))  # used to become 1
    with pytest.raises(TypeError, match="progress callback must return"):
        eng.session(max_context=64).prefill(ids, progress=lambda done, total: "yes")


def test_ctrl_c_during_generate_keeps_the_context_equal_to_what_was_seen():
    """SIGINT lands while the consumer waits for the next token (the loop has already produced it, and
    with the step pipelined, fed it): the context must hold only the tokens the caller received."""
    import os
    import random
    import signal
    import threading

    e = lily.Engine.from_pretrained(threads=1)
    prompt = e.tokenize("def read_lines(path):")
    rng = random.Random(0)
    extra = 0
    for trial in range(25):
        s = e.session(max_context=4096)
        s.prefill(prompt)
        seen: list[int] = []
        timer = threading.Timer(rng.uniform(0.02, 0.15), os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            for tok in s.generate(3000, stop_token_ids=NO_STOP):
                seen.append(tok)
        except KeyboardInterrupt:
            pass
        finally:
            timer.cancel()
        assert s.finish_reason in ("cancelled", "length")
        extra += len(s.tokens) - len(prompt) - len(seen)
        assert s.tokens == prompt + seen, f"trial {trial}: the context holds tokens the caller never saw"
        twin = e.session(max_context=4096)  # and the state is that of exactly those tokens
        twin.prefill(prompt)
        for t in seen:
            twin.step(t)
        if seen:
            assert np.array_equal(s.logits, twin.logits)
    assert extra == 0


def test_refused_threads_at_engine_creation_are_a_clear_error():
    """The OS refuses the CPU backend's threads (RLIMIT_NPROC): a BackendError naming the thread, not an
    abort (the pool's constructor used to terminate the process)."""
    import json
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import json, os, resource, lily
        from lily.engine import Engine
        from lily.checkpoint import load_checkpoint
        ckpt = load_checkpoint(os.path.join(os.path.dirname(lily.__file__), "models", "lily-tiny"))
        if os.getuid() == 0:  # root is exempt from RLIMIT_NPROC: become an otherwise unused user
            os.setgid(61235)
            os.setuid(61235)
        mine = len(os.listdir("/proc/self/task"))
        resource.setrlimit(resource.RLIMIT_NPROC, (mine + 2, mine + 2))
        try:
            Engine(ckpt, threads=16)
            out = {"error": None}
        except lily.BackendError as e:
            out = {"error": str(e)}
        e = Engine(ckpt, threads=1)  # the process is fine afterwards (the files were opened as root)
        s = e.session(max_context=16)
        s.prefill([1, 2, 3])
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    err = json.loads(r.stdout.strip().splitlines()[-1])["error"]
    assert err and "cannot start thread" in err and "of 16 for the CPU backend" in err


def test_a_failed_session_allocation_leaks_nothing(eng):
    before = eng.report()["memory"]["backend_buffers_bytes"]
    with pytest.raises(lily.LilyError, match="cannot allocate a session with max_context"):
        eng.session(max_context=2**34)  # the DeltaNet layers' state fits, the first KV cache does not
    assert eng.report()["memory"]["backend_buffers_bytes"] == before
    s = eng.session(max_context=32)
    s.prefill(eng.tokenize("x = 1"))


def test_reported_state_sizes_match_what_a_session_allocates(eng):
    before = eng.report()["memory"]["backend_buffers_bytes"]
    s = eng.session(max_context=100)
    assert s.state_bytes == eng._state_bytes(100)
    r = eng.report()["memory"]
    assert r["kv_cache_bytes_per_token"] * 100 + r["recurrent_state_bytes_per_session"] == s.state_bytes
    assert r["backend_buffers_bytes"] - before >= s.state_bytes  # plus scratch and the sampler's state
