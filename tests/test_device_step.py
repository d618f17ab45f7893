"""The device-resident step: what a GPU backend relies on, proven on the CPU.

* The deferred CPU mode (ops recorded, run at submit on an executor thread with each stage's ops
  shuffled, host access to in-flight buffers refused) gives the same bits as immediate execution, for
  prefill (chunked or not), decode, seeded sampling and snapshots; the whole suite also runs under it
  (``test_whole_suite_passes_deferred``).
* The decode loop reads one 4-byte id per generated token and uploads nothing.
* Sampling on the device matches the standard library's Mersenne Twister draw for draw, and its filters
  keep exactly the candidates they promise (top-k beyond the sorted prefix, top-p over the top-k).
* A cancelled prefill returns the logits it computed; reading a session from another thread while it
  generates is safe; the GIL is released while C++ runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import lily
import lily._core as core

NO_STOP: list[int] = []


@pytest.fixture(scope="module")
def ck(ckpt_small):
    return ckpt_small


def _engine(path, monkeypatch=None, deferred=False, seed=1, **kw):
    if monkeypatch is not None:
        if deferred:
            monkeypatch.setenv("LILY_CPU_DEBUG", "deferred")
            monkeypatch.setenv("LILY_CPU_SHUFFLE_SEED", str(seed))
        else:
            monkeypatch.delenv("LILY_CPU_DEBUG", raising=False)
    return lily.Engine.from_pretrained(str(path), backend="cpu", **kw)


@pytest.fixture(scope="module")
def pair(ck):
    """(immediate engine, deferred engine with shuffled stages) on the same checkpoint."""
    mp = pytest.MonkeyPatch()
    try:
        imm = _engine(ck.path, mp, deferred=False, prefill_chunk=7)
        dfr = _engine(ck.path, mp, deferred=True, seed=12345, prefill_chunk=7)
    finally:
        mp.undo()
    return imm, dfr


def test_deferred_mode_is_active_and_reported(pair):
    imm, dfr = pair
    assert any(o.startswith("debug: deferred execution") and "shuffled" in o for o in dfr.report()["optimizations"])
    assert not any(o.startswith("debug:") for o in imm.report()["optimizations"])


def test_deferred_matches_immediate_bitwise(pair, ck):
    imm, dfr = pair
    ids = ck.tokens(30, seed=5)
    outs = []
    for e in pair:
        s = e.session(max_context=96)
        rows = s.prefill(ids, all_logits=True)
        greedy = list(s.generate(12, stop_token_ids=NO_STOP))
        snap = s.snapshot()
        sampled = list(s.generate(10, lily.SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=7),
                                  stop_token_ids=NO_STOP))
        s.restore(snap)
        again = list(s.generate(10, lily.SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=7),
                                stop_token_ids=NO_STOP))
        fork = s.fork()
        outs.append((rows, greedy, sampled, again, np.array(fork.logits), s.tokens))
    a, b = outs
    assert np.array_equal(a[0], b[0]), "prefill logits differ between immediate and deferred execution"
    assert a[1] == b[1] and a[2] == b[2] and a[3] == b[3] and a[5] == b[5]
    assert a[2] == a[3], "restoring a snapshot must reproduce the seeded continuation"
    assert np.array_equal(a[4], b[4])


def test_deferred_refuses_host_access_to_in_flight_buffers():
    r = core.cpu_deferred_selftest()
    assert "while the step with fence" in r["read_while_written"]
    assert "while the step with fence" in r["write_while_read"]
    assert r["read_after_wait"] == "ok"
    assert r["read_of_buffer_only_read"] == "ok"


def test_whole_suite_passes_deferred(ck):
    """Every engine-level test again, on the deferred backend with shuffled stages, and with every op
    failing if it allocates heap memory (strict_alloc)."""
    if os.environ.get("LILY_CPU_DEBUG"):
        pytest.skip("already running deferred (this is the inner run)")
    here = Path(__file__).resolve().parent
    files = ["test_session.py", "test_engine_api.py", "test_parity_transformers.py", "test_parity_mlx.py",
             "test_kv_bf16.py", "test_lily_tiny.py", "test_checkpoint.py", "test_ergonomics.py",
             "test_reliability.py", "test_device_step.py"]
    env = dict(os.environ, LILY_CPU_DEBUG="deferred,strict_alloc", LILY_CPU_SHUFFLE_SEED="99")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        *[str(here / f) for f in files]], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout


def test_decode_loop_reads_one_id_per_token(pair, ck):
    for e in pair:
        s = e.session(max_context=128)
        s.prefill(ck.tokens(9, seed=2))
        toks = list(s.generate(20, lily.SamplingParams(temperature=0.9, seed=3), stop_token_ids=NO_STOP))
        t = s.stats()["generate_transfers"]
        assert len(toks) == 20
        assert t["steps"] == 20
        assert t["downloads"] == t["steps"] and t["download_bytes"] == 4 * t["steps"]
        assert t["uploads"] == 0


def test_generate_contract_with_a_speculative_step(ck, pair):
    """Stopping at token k leaves exactly the state of a run that stopped there, although step k + 1 was
    already submitted: same position, tokens and logits, and the next generate continues identically."""
    imm, dfr = pair
    ids = ck.tokens(12, seed=8)
    for e in pair:
        ref = e.session(max_context=64)
        ref.prefill(ids)
        full = list(ref.generate(8, stop_token_ids=NO_STOP))
        stop_at = full[4]
        s = e.session(max_context=64)
        s.prefill(ids)
        got = list(s.generate(8, stop_token_ids=[stop_at]))
        assert got == full[: full.index(stop_at) + 1] and s.finish_reason == "stop"
        assert s.position == len(ids) + len(got) and s.tokens == ids + got
        twin = e.session(max_context=64)  # the same tokens through the same kernels (decode steps)
        twin.prefill(ids)
        for t in got:
            twin.step(t)
        assert np.array_equal(s.logits, twin.logits)
        assert list(s.generate(3, stop_token_ids=NO_STOP)) == list(twin.generate(3, stop_token_ids=NO_STOP))
        # cancelled by the consumer after 3 tokens: the context is what was seen
        c = e.session(max_context=64)
        c.prefill(ids)
        seen = []
        for tok in c.generate(8, stop_token_ids=NO_STOP):
            seen.append(tok)
            if len(seen) == 3:
                break
        assert c.finish_reason == "cancelled" and c.tokens == ids + seen
        # context full: generation stops with the last token pending, as before
        f = e.session(max_context=len(ids) + 3)
        f.prefill(ids)
        out = list(f.generate(10, stop_token_ids=NO_STOP))
        assert out == full[:3] and f.finish_reason == "context" and f.position == len(ids) + 3


def test_mersenne_twister_matches_the_standard_library():
    for seed in (0, 1, 42, 2**64 - 1, 123456789):
        assert core.cpu_mt19937_matches_std(seed, 2000)


def _draws(e, ids, params_of_seed, n):
    s = e.session(max_context=len(ids) + 2)
    s.prefill(ids)
    logits = np.array(s.logits, dtype=np.float64)
    snap = s.snapshot()
    out = []
    for seed in range(n):
        s.restore(snap)
        out += list(s.generate(1, params_of_seed(seed), stop_token_ids=NO_STOP))
    return logits, out


def test_top_k_beyond_the_sorted_prefix_keeps_only_the_top_k():
    e = lily.Engine.from_pretrained()  # lily-tiny: vocab 8192, more than the 1024-candidate prefix
    ids = e.tokenize("import os\n")
    k = 1500
    logits, toks = _draws(e, ids, lambda seed: lily.SamplingParams(temperature=50.0, top_k=k, seed=seed), 200)
    order = np.lexsort((np.arange(logits.size), -logits))
    allowed = set(order[:k].tolist())
    outside = [t for t in toks if t not in allowed]
    assert not outside, f"{len(outside)} of {len(toks)} draws outside the top-{k}"
    assert len(set(toks)) > 50  # the temperature really spreads the draws (the test is not vacuous)


def test_top_p_nucleus_is_taken_over_the_top_k():
    e = lily.Engine.from_pretrained()
    ids = e.tokenize("import os\n")
    k, p, temp = 2000, 0.5, 8.0
    logits, toks = _draws(e, ids, lambda seed: lily.SamplingParams(temperature=temp, top_k=k, top_p=p, seed=seed), 200)
    order = np.lexsort((np.arange(logits.size), -logits))[:k]
    w = np.exp((logits[order] - logits[order[0]]) / temp)
    cum = np.cumsum(w / w.sum())
    nucleus = set(order[: int(np.searchsorted(cum, p) + 1)].tolist())
    outside = [t for t in toks if t not in nucleus]
    assert not outside, f"{len(outside)} draws outside the nucleus of the top-{k}"


def test_cancelled_prefill_returns_the_logits_it_computed(ck):
    e = lily.Engine.from_pretrained(str(ck.path), prefill_chunk=8)
    ids = ck.tokens(30, seed=4)
    s = e.session(max_context=64)
    last = s.prefill(ids, progress=lambda done, total: done < 8)
    rows = e.session(max_context=64).prefill(ids, all_logits=True)
    assert s.position == 8
    assert np.array_equal(last, rows[7]), "a cancelled prefill must return the last computed token's logits"
    s2 = e.session(max_context=64)
    got = s2.prefill(ids, all_logits=True, progress=lambda done, total: done < 16)
    assert got.shape == (16, ck.vocab)
    assert np.array_equal(got, rows[:16])


def test_reading_a_session_while_it_generates_is_safe():
    e = lily.Engine.from_pretrained()
    s = e.session(max_context=1024)
    s.prefill(e.tokenize("def main():\n"))
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader():
        try:
            while not stop.is_set():
                toks = s.tokens
                assert len(toks) <= s.max_context
                seen.append(s.position)
                s.stats()
        except BaseException as exc:  # re-raised by the test below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            list(s.generate(150, stop_token_ids=NO_STOP))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert len(seen) > 10 and max(seen) > min(seen)


def test_gil_released_during_a_forward():
    """While one C++ call runs (a single-chunk prefill), the main thread keeps running Python. Holding
    the GIL during the forward would leave it stalled for the whole call."""
    e = lily.Engine.from_pretrained(threads=1, prefill_chunk=4096)
    ids = (e.tokenize("import os\nimport sys\n\n\ndef main():\n    pass\n") * 400)[:3000]
    s = e.session(max_context=4096)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        span = {}

        def run():
            span["t0"] = time.perf_counter()
            s.prefill(ids)
            span["t1"] = time.perf_counter()

        t = threading.Thread(target=run)
        stamps = []
        t.start()
        while t.is_alive():
            stamps.append(time.perf_counter())
        t.join()
    finally:
        sys.setswitchinterval(old)
    inside = np.array([x for x in stamps if span["t0"] <= x <= span["t1"]])
    duration = span["t1"] - span["t0"]
    assert duration > 0.05, "the forward is too short to tell"
    gaps = np.diff(np.concatenate([[span["t0"]], inside, [span["t1"]]]))
    assert gaps.max() < 0.5 * duration, f"main thread stalled {gaps.max():.3f} s of a {duration:.3f} s forward"


def test_per_expert_tensors_off_a_uniform_stride_are_repacked_once(tiny_factory):
    """transformers' save_pretrained writes one tensor per expert in name order, so with more than ten
    experts ("experts.10" sorts before "experts.2") they do not sit at one stride: the loader repacks them
    into a stacked buffer, says so, and the model computes exactly what the fused layout of the same weights
    computes."""
    per = tiny_factory("mlx", "per_expert")  # 16 experts, fp32
    fused = tiny_factory("mlx", "fused_mm")
    a = lily.Engine.from_pretrained(str(per.path))
    b = lily.Engine.from_pretrained(str(fused.path))
    ra, rb = a.report(), b.report()
    assert ra["experts_layout"].startswith("repacked at load") and ra["memory"]["repacked_expert_bytes"] > 0
    assert rb["experts_layout"].startswith("stacked in place") and rb["memory"]["repacked_expert_bytes"] == 0
    ids = per.tokens(24, seed=9)
    got = a.session(max_context=32).prefill(ids, all_logits=True)
    assert np.array_equal(got, b.session(max_context=32).prefill(ids, all_logits=True))
    per.check(got, ids, "repacked experts")
