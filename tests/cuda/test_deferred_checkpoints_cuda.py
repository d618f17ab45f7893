"""Deferred checkpoints (Session.prefill_snapshots defer=True, tests/test_deferred_checkpoints.py on the CPU) on the
CUDA backend with lily-tiny: the snapshots equal the eager path's bit for bit (the same device computation; only
where and when the copies run differs) after a whole generation, after one that stops at its first token, when
read before any generation, and when another thread restores them while the owner generates; the state after them
matches the CPU backend's; a PrefixCache with defer_checkpoints on and off keeps the same checkpoints."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import lily
from lily.prefix_cache import PrefixCache
from snapshot_util import assert_same_snapshot, snapshot_arrays

from cuda_util import rel_err, requires_cuda

pytestmark = requires_cuda

TEXT = "import os\nimport sys\nimport json\nimport time\nimport math\nimport re\nimport io\n" * 3
GREEDY = lily.SamplingParams()


@pytest.fixture(scope="module")
def gpu():
    with lily.Engine.from_pretrained(backend="cuda") as e:
        yield e


def take(engine, ids, defer):
    s = engine.session(max_context=128, prefill_chunk=8)
    s.prefill(ids[:5])
    base = s.snapshot()
    return s, base, s.prefill_snapshots(ids[5:30], [17, 30], base=base, defer=defer)


@pytest.mark.parametrize("mtp", ["off", "on"], ids=["plain", "mtp"])
@pytest.mark.parametrize("n", [1, 8, 0], ids=["stop-at-first", "eight", "read-before"])
def test_deferred_equal_eager_on_the_gpu(gpu, mtp, n):
    ids = gpu.tokenize(TEXT)
    s, base, want = take(gpu, ids, defer=False)
    tokens = list(s.generate(8, GREEDY, stop_token_ids=[], mtp=mtp))
    s, base, got = take(gpu, ids, defer=True)
    assert s.deferred_checkpoints == 3
    if n:
        assert list(s.generate(n, GREEDY, stop_token_ids=[], mtp=mtp)) == tokens[:n]
        assert s.deferred_checkpoints == 0  # the generation wrote them
    for g, w, p in zip(got, want, [17, 30]):
        assert_same_snapshot(g, w, f"position {p}, generate({n}, mtp={mtp})")
    t = gpu.session(max_context=128)
    t.restore(got[1])
    assert list(t.generate(8, GREEDY, stop_token_ids=[], mtp=mtp)) == tokens


def test_state_matches_the_cpu(gpu):
    ids = gpu.tokenize(TEXT)
    s, base, snaps = take(gpu, ids, defer=True)
    list(s.generate(8, GREEDY, stop_token_ids=[], mtp="off"))
    with lily.Engine.from_pretrained(backend="cpu") as cpu:
        c = cpu.session(max_context=128)
        c.prefill(ids[:30])
        ref = snapshot_arrays(c.snapshot())
    got = snapshot_arrays(snaps[1])
    for k in ref:
        if np.issubdtype(ref[k].dtype, np.floating) and ref[k].size:
            assert rel_err(got[k], ref[k]) < 5e-2, k  # a wrong set or row reads as ~1
        else:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_concurrent_restore_while_the_owner_generates(gpu):
    ids = gpu.tokenize(TEXT)
    s, base, want = take(gpu, ids, defer=False)
    tokens = list(s.generate(8, GREEDY, stop_token_ids=[], mtp="off"))
    for _ in range(4):
        s, base, snaps = take(gpu, ids, defer=True)
        got, errors, ready = [], [], threading.Event()

        def reader():
            try:
                ready.wait()
                t = gpu.session(max_context=128)
                t.restore(snaps[1])
                got.append(list(t.generate(8, GREEDY, stop_token_ids=[], mtp="off")))
                t.close()
            except BaseException as exc:
                errors.append(exc)

        th = threading.Thread(target=reader)
        th.start()
        gen = s.generate(8, GREEDY, stop_token_ids=[], mtp="off")
        out = [next(gen)]
        ready.set()
        out += list(gen)
        th.join()
        assert not errors, errors
        assert out == tokens and got == [tokens]
        assert_same_snapshot(snaps[1], want[1], "after a concurrent restore")


def test_prefix_cache_defer_on_and_off(gpu):
    keys = {}
    for defer in (False, True):
        cache = PrefixCache(gpu, max_bytes=64 << 20, defer_checkpoints=defer)
        messages = [{"role": "user", "content": "def read_lines(path):"}]
        for turn in range(3):
            prompt = gpu.apply_chat_template(messages)
            cut = gpu.apply_chat_template(messages, add_generation_prompt=False)
            s = gpu.session(max_context=len(prompt) + 16)
            cache.prefill(s, prompt, checkpoints=[len(cut)])
            out = list(s.generate(16, GREEDY, stop_token_ids=[], mtp="off"))
            cache.store(s, prompt + out)
            s.close()
            messages += [{"role": "assistant", "content": gpu.detokenize(out, skip_special_tokens=True)},
                         {"role": "user", "content": f"and turn {turn}?"}]
        keys[defer] = cache._entries
    a, b = keys[False], keys[True]
    assert a.keys() == b.keys() and len(a) >= 6
    for k in a:
        assert_same_snapshot(b[k].snapshot, a[k].snapshot, f"entry of {len(k)} tokens")
