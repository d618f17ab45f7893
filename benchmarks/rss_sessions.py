"""Where resident memory goes when threads create and close sessions: a leak, or glibc's free lists?

Runs --requests session lifecycles (create, prefill --prompt random tokens, generate --tokens greedy, close)
spread over --threads threads, the way the server runs requests, and prints every --every requests:
  rss       VmRSS from /proc/self/status;
  in use    glibc mallinfo2().uordblks: bytes malloc has handed out and not had back (a leak grows this);
  free      mallinfo2().fordblks: bytes freed but kept in malloc's arenas (fragmentation grows this);
  arenas    mallinfo2().arena + hblkhd: bytes malloc holds from the system (heap + mmapped chunks);
  backend   the engine's backend buffers (report()["memory"]["backend_buffers_bytes"]; must return to its start);
  py heap   tracemalloc's traced bytes (Python objects).
At the end it calls malloc_trim(0), which returns free pages at the top of and inside the arenas, and
prints the RSS after it, then tracemalloc's largest growth by line.

    python benchmarks/rss_sessions.py [--requests 400] [--threads 4] [--every 50] [--prompt 64] [--tokens 8]
Run it with MALLOC_ARENA_MAX=1 (or 2) in the environment to see what per-thread arenas contribute.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import threading
import tracemalloc


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_libc.mallinfo2.restype = _Mallinfo2
_libc.malloc_trim.argtypes = [ctypes.c_size_t]


def vm_rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=1024)
    args = ap.parse_args()

    import numpy as np

    import lily

    engine = lily.Engine.from_pretrained()
    vocab = engine.config.vocab_size
    lock = threading.Lock()
    done = [0]

    def one(seed: int) -> None:
        ids = np.random.default_rng(seed).integers(0, vocab, args.prompt).tolist()
        with engine.session(max_context=args.max_context) as s:
            s.prefill(ids)
            for _ in s.generate(args.tokens, lily.SamplingParams(), stop_token_ids=[]):
                pass

    def worker(k: int, n: int) -> None:
        for i in range(n):
            one(k * 1_000_003 + i)
            with lock:
                done[0] += 1

    def row(label: str) -> dict:
        mi = _libc.mallinfo2()
        r = {"rss": vm_rss(), "in_use": mi.uordblks, "free": mi.fordblks, "arenas": mi.arena + mi.hblkhd,
             "backend": engine.report()["memory"]["backend_buffers_bytes"], "py": tracemalloc.get_traced_memory()[0]}
        print(f"{label:>10} " + " ".join(f"{r[k] / 2**20:>9.2f}" for k in ("rss", "in_use", "free", "arenas",
                                                                            "backend", "py")), flush=True)
        return r

    one(0)  # warm: scratch, thread pools and tokenizer caches exist before the first row
    tracemalloc.start(10)
    before = tracemalloc.take_snapshot()
    print(f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')}, {args.threads} threads, "
          f"{args.requests} requests (prompt {args.prompt}, {args.tokens} generated, max_context {args.max_context})")
    print(f"{'requests':>10} {'rss MiB':>9} {'in use':>9} {'free':>9} {'arenas':>9} {'backend':>9} {'py heap':>9}")
    first = row("0")
    per_round = args.every
    while done[0] < args.requests:
        n = min(per_round, args.requests - done[0])
        shares = [n // args.threads + (1 if k < n % args.threads else 0) for k in range(args.threads)]
        ts = [threading.Thread(target=worker, args=(k + done[0] * 7, m)) for k, m in enumerate(shares) if m]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        last = row(str(done[0]))
    after = tracemalloc.take_snapshot()
    _libc.malloc_trim(0)
    trimmed = row("trimmed")
    print(f"growth over {args.requests} requests: rss {(last['rss'] - first['rss']) / 2**20:+.2f} MiB, "
          f"malloc in use {(last['in_use'] - first['in_use']) / 2**20:+.2f} MiB, "
          f"malloc free lists {(last['free'] - first['free']) / 2**20:+.2f} MiB, "
          f"backend buffers {(last['backend'] - first['backend']) / 2**20:+.2f} MiB, "
          f"Python heap {(last['py'] - first['py']) / 2**20:+.2f} MiB; "
          f"after malloc_trim rss {(trimmed['rss'] - first['rss']) / 2**20:+.2f} MiB")
    print("largest Python heap growth by line:")
    for stat in after.compare_to(before, "lineno")[:5]:
        print(f"  {stat.size_diff / 1024:+9.1f} KiB  {stat.traceback[0]}")


if __name__ == "__main__":
    main()
