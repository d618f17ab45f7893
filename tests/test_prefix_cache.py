"""lily.prefix_cache and the snapshots it is built on.

- Snapshots with ``base=`` share KV rows: they allocate only their state and the rows after the base (the
  backend's buffer bytes grow by exactly that), restore bitwise like a full copy, and outlive their base.
- PrefixCache: warm prefills give a cold run's tokens; longest-prefix lookup; the byte budget evicts least
  recently used leaves and never a checkpoint others are built on; bytes count shared rows once.
- The disk tier: evicted checkpoints spill to files, a hit reloads them (same tokens as a cold run), a new
  cache on the folder finds them, and a corrupt or missing file is a miss, never an error.
"""

import os

import numpy as np
import pytest

import lily
from lily.prefix_cache import PrefixCache

TEXT = "import os\nimport sys\nimport json\nimport time\nimport math\nimport re\nimport io\n" * 3


@pytest.fixture(scope="module")
def engine():
    with lily.Engine.from_pretrained() as e:
        yield e


def greedy(session, n=24):
    return list(session.generate(n, lily.SamplingParams(), stop_token_ids=[]))


def cold(engine, ids, n=24):
    s = engine.session(max_context=len(ids) + n)
    logits = s.prefill(ids)
    out = greedy(s, n)
    s.close()
    return logits, out


def buffer_bytes(engine):
    return engine.report()["memory"]["backend_buffers_bytes"]


# ---- snapshots that share KV rows ----

def test_snapshot_with_base_copies_only_the_new_rows(engine):
    ids = engine.tokenize(TEXT)
    per_token = engine.report()["memory"]["kv_cache_bytes_per_token"]
    s = engine.session(max_context=128)
    s.prefill(ids[:10])
    a = s.snapshot()
    s.prefill(ids[10:30])
    before = buffer_bytes(engine)
    b = s.snapshot(base=a)
    grown = buffer_bytes(engine) - before
    full = s.snapshot()
    same = s.snapshot(base=b)  # nothing new after b: shares every row
    assert b.base_position == 10 and same.base_position == 30 and full.base_position == 0
    # device memory: b's state plus rows [10, 30) only (tokens are host-side; tensors here are 64-byte multiples)
    assert grown == b.own_nbytes - 4 * 30
    assert b.own_nbytes - same.own_nbytes == 20 * per_token
    assert full.own_nbytes == full.nbytes == b.nbytes
    assert b.nbytes == b.own_nbytes + 10 * per_token  # it reaches a's rows [0, 10) too
    # the host copy gathers the shared rows in place: identical to a full copy's
    arr, ref = b._core.to_arrays(), full._core.to_arrays()
    assert arr.keys() == ref.keys() and all(np.array_equal(arr[k], ref[k]) for k in ref)
    ref = engine.session(max_context=128)
    ref.restore(full)
    next_logits = ref.step(ids[30]).copy()  # reads every KV row [0, 31)
    expect = greedy(s, 8)
    del a, full  # b still holds rows [0, 10) through the core's reference
    t = engine.session(max_context=128)
    t.prefill(engine.tokenize("class Something(object):\n    pass\n" * 3))  # other rows in t's cache first
    t.restore(b)
    assert t.tokens == ids[:30]
    assert np.array_equal(t.step(ids[30]), next_logits)  # bitwise: rows [0, 10) came from a's segment
    t.restore(same)
    assert greedy(t, 8) == expect


def test_snapshot_base_must_be_a_prefix(engine):
    ids = engine.tokenize(TEXT)
    s = engine.session(max_context=128)
    s.prefill(ids[:12])
    other = engine.session(max_context=128)
    other.prefill(ids[:5] + ids[6:9])
    with pytest.raises(ValueError, match="base.*not a prefix"):
        s.snapshot(base=other.snapshot())
    longer = engine.session(max_context=128)
    longer.prefill(ids[:20])
    with pytest.raises(ValueError, match="base.*not a prefix"):
        s.snapshot(base=longer.snapshot())
    with pytest.raises(TypeError, match="base must be a Snapshot"):
        s.snapshot(base="x")
    with lily.Engine.from_pretrained() as e2:
        t = e2.session(max_context=128)
        t.prefill(ids[:4])
        with pytest.raises(ValueError, match="base is a snapshot of another engine"):
            s.snapshot(base=t.snapshot())
    assert s.tokens == ids[:12]  # the session is untouched


# ---- the cache ----

def test_warm_turns_match_a_cold_run(engine):
    cache = PrefixCache(engine, max_bytes=64 << 20)
    messages = [{"role": "user", "content": "def read_lines(path):"}]
    shared = 0  # the previous turn's conversation before its generation prompt
    for turn in range(3):
        ids = engine.apply_chat_template(messages)
        base = engine.apply_chat_template(messages, add_generation_prompt=False)
        s = engine.session(max_context=len(ids) + 24)
        cached = cache.prefill(s, ids, checkpoints=[len(base)])
        warm_logits = s.logits
        out = greedy(s)
        cold_logits, cold_out = cold(engine, ids)
        assert out == cold_out  # exactly the tokens of a cold run
        np.testing.assert_allclose(warm_logits, cold_logits, rtol=1e-4, atol=1e-4)
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= shared > 0  # at least the previous turn's conversation came from the cache
        assert cache.store(s, ids + out)  # the end of the generation
        s.close()
        messages += [{"role": "assistant", "content": engine.detokenize(out, skip_special_tokens=True)},
                     {"role": "user", "content": f"and turn {turn}?"}]
        shared = len(base)
    st = cache.stats()
    assert st["hits"] == 2 and st["misses"] == 1 and st["tokens_saved"] > 0 and st["entries"] >= 3
    # shared rows counted once: the entries' own bytes, less than their standalone sizes together
    entries = list(cache._entries.values())
    assert st["bytes"] == sum(e.snapshot.own_nbytes for e in entries)
    assert st["bytes"] < sum(e.snapshot.nbytes for e in entries)
    assert sum(e.parent is not None for e in entries) >= len(entries) - 1


def test_longest_prefix_and_lookup(engine):
    ids = engine.tokenize(TEXT)
    assert len(ids) > 12
    s = engine.session(max_context=128)
    cache = PrefixCache(engine, max_bytes=64 << 20)
    s.prefill(ids[:4])
    assert cache.store(s, ids[:4])
    assert not cache.store(s, ids[:4])  # already there
    assert not cache.store(s, ids[:5])  # the session is not at that context
    assert not cache.store(s, ids[:3] + [ids[4]])  # same length, other tokens
    s.prefill(ids[4:8])
    assert cache.store(s, ids[:8])
    assert cache.lookup(ids)[0] == 8  # the longest one
    assert cache.lookup(ids[:8])[0] == 4  # never the whole prompt: its last token is always prefilled
    assert cache.lookup(engine.tokenize("class X:"))[0] == 0
    n, snap = cache.lookup(ids)
    assert snap.base_position == 4  # built on the 4-token checkpoint
    t = engine.session(max_context=128)
    t.restore(snap)
    assert t.tokens == s.tokens and greedy(t, 8) == greedy(s, 8)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(engine, max_bytes=-1)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        PrefixCache(engine, checkpoint_interval=1.5)
    assert not PrefixCache(engine, max_bytes=10).store(t, t.tokens)  # larger than the whole budget


def test_lookup_tells_apart_prefixes_of_one_length_and_one_ending(engine):
    """The index finds a prefix by its length and last tokens, then compares it whole: two cached sequences of
    the same length ending in the same tokens are told apart by their first token."""
    rng = np.random.default_rng(3)
    tail = [int(x) for x in rng.integers(1, engine.config.vocab_size, 20)]
    a, b = [5] + tail, [6] + tail
    cache = PrefixCache(engine, max_bytes=64 << 20)
    for ids in (a, b):
        s = engine.session(max_context=64)
        s.prefill(ids)
        assert cache.store(s, ids)
        s.close()
    for ids in (a, b):
        n, snap = cache.lookup(ids + [7, 8])
        t = engine.session(max_context=64)
        t.restore(snap)
        assert n == len(ids) and t.tokens == ids
        t.close()
    assert cache.lookup([4] + tail + [7])[0] == 0  # same ending, other start: no prefix of it is cached
    assert cache.lookup(a[:-1] + [a[-1] + 1, 7])[0] == 0
    n, _ = cache.lookup(b + [9])
    assert n == len(b)


def test_budget_evicts_least_recently_used_leaves_only(engine):
    ids = engine.tokenize(TEXT)
    other = engine.tokenize("class Point:\n    x: int\n")

    def build(cache):
        s = engine.session(max_context=128)
        cache.prefill(s, ids[:12])                    # R: a root
        cache.prefill(s, ids[:20])                    # A: built on R
        t = engine.session(max_context=128)
        n, snap = cache.lookup(ids[:12] + other)
        assert n == 12
        assert cache.lookup(ids[:21])[0] == 20        # touches A: R is now the least recently used
        t.restore(snap)
        t.prefill(other)
        assert cache.store(t, ids[:12] + other)       # B: built on R too
        return t

    probe = PrefixCache(engine, max_bytes=1 << 30)
    build(probe)
    sizes = {k: e.nbytes for k, e in probe._entries.items()}
    assert probe.stats()["entries"] == 3 and probe.stats()["evictions"] == 0
    # room for R and two children less one byte: the third store evicts; R is the least recently used
    # entry but has children, so the least recently used leaf (A) goes (B, the newest, stays).
    cache = PrefixCache(engine, max_bytes=sum(sizes.values()) - 1)
    t = build(cache)
    st = cache.stats()
    assert st["evictions"] == 1 and st["entries"] == 2 and st["bytes"] <= st["max_bytes"]
    assert cache.lookup(ids)[0] == 12  # A is gone, R is not
    n, snap = cache.lookup(ids[:12] + other + [5])
    assert n == 12 + len(other) and snap.base_position == 12
    u = engine.session(max_context=128)
    u.restore(snap)
    assert greedy(u, 8) == greedy(t, 8)  # B's rows [0, 12) are R's, still there


def test_checkpoint_interval(engine):
    ids = engine.tokenize(TEXT * 2)
    cache = PrefixCache(engine, checkpoint_interval=16)
    s = engine.session(max_context=len(ids) + 8)
    cache.prefill(s, ids)
    keys = sorted(e.length for e in cache._entries.values())
    assert keys == list(range(16, len(ids), 16)) + [len(ids)]
    assert greedy(s, 8) == cold(engine, ids, 8)[1]


# ---- the disk tier ----

def test_disk_tier_spills_reloads_and_survives_a_restart(engine, tmp_path, ckpt_small):
    ids = engine.tokenize(TEXT * 2)
    first, other = ids[:30], engine.tokenize("class Point:\n    x: int\n    y: int\n")
    probe = engine.session(max_context=128)
    probe.prefill(first)
    one = probe.snapshot().nbytes
    cache = PrefixCache(engine, max_bytes=int(one * 1.5), disk_dir=tmp_path)
    s = engine.session(max_context=128)
    cache.prefill(s, first)
    cache.prefill(s, other)  # evicts the first checkpoint: written to disk
    st = cache.stats()
    assert st["spilled"] == 1 and st["disk_entries"] == 1 and st["entries"] == 1
    files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(files) == 1 and st["disk_bytes"] == os.path.getsize(tmp_path / files[0])
    # a hit on the file: restored through host memory, the same tokens as a cold run
    t = engine.session(max_context=len(ids) + 24)
    assert cache.prefill(t, ids) == len(first)
    assert greedy(t) == cold(engine, ids)[1]
    assert cache.stats()["disk_hits"] == 1
    # a new cache on the folder (a restarted server) finds the files of this model
    again = PrefixCache(engine, max_bytes=int(one * 1.5), disk_dir=tmp_path)
    assert again.stats()["disk_entries"] >= 1
    n, snap = again.lookup(ids)
    assert n >= len(first) and not snap.on_device
    u = engine.session(max_context=len(ids) + 24)
    u.restore(snap)
    u.prefill(ids[n:])
    assert greedy(u) == cold(engine, ids)[1]
    # the disk budget: the oldest files go
    small = PrefixCache(engine, max_bytes=int(one * 1.5), disk_dir=tmp_path,
                        disk_bytes=max(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path)))
    assert small.stats()["disk_entries"] == 1 and len(os.listdir(tmp_path)) == 1
    # another model's cache files and unrelated files are left alone
    (tmp_path / "notes.txt").write_text("mine")
    with lily.Engine.from_pretrained(str(ckpt_small.path)) as other_model:
        v = other_model.session(max_context=16)
        v.prefill([1, 2, 3])
        foreign = PrefixCache(other_model, max_bytes=int(v.snapshot().nbytes * 1.5), disk_dir=tmp_path)
        foreign.prefill(v, [1, 2, 3])
        foreign.prefill(v, [4, 5, 6])  # evicts [1, 2, 3]: spilled
        assert foreign.stats()["disk_entries"] == 1
    mine = PrefixCache(engine, disk_dir=tmp_path)
    assert mine.stats()["disk_entries"] == 1 and len(os.listdir(tmp_path)) == 3
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_disk_tier_corrupt_or_missing_file_is_a_miss(engine, tmp_path):
    ids = engine.tokenize(TEXT)
    probe = engine.session(max_context=128)
    probe.prefill(ids[:20])
    one = probe.snapshot().nbytes
    cache = PrefixCache(engine, max_bytes=int(one * 1.5), disk_dir=tmp_path)
    s = engine.session(max_context=128)
    cache.prefill(s, ids[:20])
    cache.prefill(s, engine.tokenize("class Point:\n    x: int\n"))  # spills ids[:20]
    (path,) = [tmp_path / f for f in os.listdir(tmp_path)]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # a bit of state data (token ids sit at the end): only the checksum sees it
    path.write_bytes(bytes(raw))
    fresh = PrefixCache(engine, disk_dir=tmp_path)  # the header still reads: indexed
    assert fresh.stats()["disk_entries"] == 1
    assert fresh.lookup(ids) == (0, None)
    st = fresh.stats()
    assert st["disk_errors"] == 1 and st["misses"] == 1 and st["disk_entries"] == 0 and not path.exists()
    # a file deleted behind the cache's back
    cache.prefill(s, ids[:20])  # back in memory... and the class prompt spilled in turn
    (path,) = [tmp_path / f for f in os.listdir(tmp_path)]
    path.unlink()
    t = engine.session(max_context=128)
    assert cache.prefill(t, engine.tokenize("class Point:\n    x: int\n    y: int\n")) == 0
    assert cache.stats()["disk_errors"] == 1
    # a truncated file (header unreadable) is dropped when a cache indexes the folder
    cache.prefill(t, ids[:20])
    (path,) = [tmp_path / f for f in os.listdir(tmp_path)]
    path.write_bytes(path.read_bytes()[:5])
    assert PrefixCache(engine, disk_dir=tmp_path).stats()["disk_entries"] == 0 and not path.exists()


def test_threads_sharing_one_cache_keep_it_consistent(engine, tmp_path):
    import threading

    system = engine.tokenize(TEXT)
    probe = engine.session(max_context=256)
    probe.prefill(system)
    cache = PrefixCache(engine, max_bytes=int(probe.snapshot().nbytes * 3), disk_dir=tmp_path, disk_bytes=64 << 20)
    prompts = {k: [system + engine.tokenize(f"# worker {k} turn {t}\n") * (t + 1) for t in range(3)] for k in range(4)}
    got: dict = {}
    errors: list = []

    def worker(k: int) -> None:
        try:
            for t, ids in enumerate(prompts[k]):
                s = engine.session(max_context=len(ids) + 8)
                cache.prefill(s, ids, checkpoints=[len(system)])
                got[k, t] = greedy(s, 8)
                cache.store(s, ids + got[k, t])
                s.close()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for (k, t), out in got.items():
        assert out == cold(engine, prompts[k][t], 8)[1], (k, t)
    # the index: bytes are the entries' own bytes, every parent is held, children counts match
    entries = list(cache._entries.values())
    st = cache.stats()
    assert st["bytes"] == sum(e.nbytes for e in entries) <= st["max_bytes"]
    assert all(e.parent is None or cache._entries.get(e.parent.tokens) is e.parent for e in entries)
    assert all(e.children == sum(c.parent is e for c in entries) for e in entries)
    assert st["evictions"] > 0 and st["spilled"] > 0 and st["hits"] > 0
