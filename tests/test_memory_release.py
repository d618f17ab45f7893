"""Backend memory goes back to the system: the CPU backend maps buffers of 64 KiB and more (csrc/cpu/backend.cpp
buffer_alloc) instead of taking them from malloc, whose per-thread arenas kept freed KV caches and grew RSS by
~2 MiB per session created and closed on worker threads (benchmarks/NOTES.md, "RSS creep"). Not run under the
sanitizers (tools/sanitize.py), whose builds keep malloc for its bounds checks.
"""

import gc
import threading

import pytest

import lily


def rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status")


@pytest.fixture(scope="module")
def engine():
    with lily.Engine.from_pretrained(backend="cpu") as e:
        yield e


def test_a_kv_cache_is_resident_as_it_is_written_and_returned_on_close(engine):
    per_token = engine.report()["memory"]["kv_cache_bytes_per_token"]
    n = 32768  # a 256 MiB KV cache for lily-tiny
    gc.collect()
    before = rss()
    s = engine.session(max_context=n)
    s.prefill(engine.tokenize("def f(x):\n    return x\n"))
    held = rss() - before
    assert held < n * per_token // 8, f"{held / 2**20:.1f} MiB resident for a {n * per_token / 2**20:.0f} MiB cache"
    s.close()
    gc.collect()
    assert rss() - before < 8 << 20


def test_sessions_closed_on_threads_do_not_pile_up(engine):
    ids = engine.tokenize("import os\nimport sys\n")

    def work(k: int) -> None:
        for _ in range(k):
            with engine.session(max_context=1024) as s:  # an 8 MiB KV cache and 3 MiB of recurrent state
                s.prefill(ids)

    def burst(n: int) -> None:
        ts = [threading.Thread(target=work, args=(n // 4,)) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    burst(16)  # warm: thread stacks, arenas' own bookkeeping
    gc.collect()
    start = rss()
    for _ in range(6):
        burst(16)  # new threads each time, as a server's workers come and go
    gc.collect()
    grown = rss() - start
    print(f"\nRSS {grown / 2**20:+.1f} MiB over 96 sessions")
    # 96 sessions of 11 MiB each: +0.1-0.2 MiB; through malloc (kMapLarge off) +30 MiB (2026-12-01)
    assert grown < 12 << 20, f"RSS grew {grown / 2**20:.1f} MiB over 96 sessions"
