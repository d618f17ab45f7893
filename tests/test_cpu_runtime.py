"""CPU runtime: the thread pool (exceptions from loop bodies, refused threads), the allocation guard, and
matmul scratch that a reserved MatmulArena makes allocation-free.

Pool tests run in a child interpreter: the failures they guard against (an exception escaping a worker, a
joinable std::thread destroyed while unwinding) call std::terminate, which would take pytest down with it.
The child reports in JSON; the parent checks that it exited normally.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lily._core as core
from lily.errors import LilyError
from test_cpu_matmul import make_weight, make_x


def run_child(code: str) -> dict:
    """Runs `code` in a fresh interpreter; it must print one JSON object as its last line."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"child exited with {p.returncode} (negative: killed by that signal)\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# ThreadPool: exceptions thrown by a parallel_for body
# ------------------------------------------------------------------------------------------------

REPEATS = 1000


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("where", ["any", "caller", "worker", "all"])
def test_parallel_for_body_exception(where, threads):
    # Each of the REPEATS calls throws from the body, on the caller ("caller"), on a worker ("worker"),
    # on whichever thread gets index 40 ("any") or on every range ("all"). The C++ side checks after each
    # call that the exception reached the caller, that no thread was still inside the body when it did,
    # and that the next plain loop on the same pool visits every index exactly once.
    r = run_child(f"""
        import json, lily._core as core
        print(json.dumps(core.cpu_parallel_for_throw_test({threads}, 64, 40, "{where}", {REPEATS})))
    """)
    assert r["caller_threw"] + r["worker_threw"] >= REPEATS
    if where == "caller":
        assert r["caller_threw"] == REPEATS
        # The worker was inside its range when the caller threw: parallel_for waited for it to finish.
        assert r["workers_overlapped"] == REPEATS
    if where == "worker":
        assert r["worker_threw"] == REPEATS and r["caller_threw"] == 0
    if where == "any":
        assert r["caller_threw"] + r["worker_threw"] == REPEATS


@pytest.mark.parametrize("where,thread", [("worker", r"[1-9]\d*"), ("caller", "0")])
def test_parallel_for_exception_reaches_python(where, thread):
    r = run_child(f"""
        import json, lily._core as core
        try:
            core.cpu_parallel_for_throw_test(2, 64, 40, "{where}", 1, propagate=True)
            msg = None
        except RuntimeError as e:
            msg = str(e)
        after = core.cpu_parallel_for_throw_test(2, 64, 40, "any", 10)  # pools keep working
        print(json.dumps({{"msg": msg, "after": after}}))
    """)
    assert r["msg"] is not None and re.fullmatch(rf"parallel_for body failed at index \d+ on thread {thread}", r["msg"])
    assert r["after"]["caller_threw"] + r["after"]["worker_threw"] == 10


# ------------------------------------------------------------------------------------------------
# ThreadPool: the OS refuses a thread
# ------------------------------------------------------------------------------------------------


def test_refused_thread_is_a_clean_error():
    # The test hook makes starting worker 3 fail exactly as the OS does (std::system_error, EAGAIN); workers
    # 1 and 2 are already running and must be stopped and joined before the constructor throws.
    r = run_child("""
        import json, lily._core as core
        try:
            core.cpu_thread_pool_test(8, refuse_at=3)
            msg = None
        except RuntimeError as e:
            msg = str(e)
        print(json.dumps({"msg": msg, "after": core.cpu_thread_pool_test(8)}))
    """)
    assert r["msg"] == "cannot start thread 3 of 8 for the CPU backend: Resource temporarily unavailable"
    assert r["after"] == 8


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_NPROC counting threads is Linux's")
def test_rlimit_nproc_is_a_clean_error():
    # The real thing: RLIMIT_NPROC (ulimit -u) counts the threads of a user. Root is exempt, so as root the
    # child first becomes an otherwise unused user; then it is the only process of that user and two more
    # threads fit under the limit.
    r = run_child("""
        import json, os, resource, lily._core as core
        exact = False
        if os.getuid() == 0:
            try:
                os.setgid(61234)
                os.setuid(61234)
                exact = True
            except OSError as e:
                print(json.dumps({"skip": f"cannot drop root: {e}"}))
                raise SystemExit(0)
        mine = len(os.listdir("/proc/self/task"))
        limit = mine + 2 if exact else 1
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        try:
            core.cpu_thread_pool_test(16)
            msg = None
        except RuntimeError as e:
            msg = str(e)
        print(json.dumps({"msg": msg, "exact": exact}))
    """)
    if "skip" in r:
        pytest.skip(r["skip"])
    assert r["msg"] is not None, "the pool started 16 threads under RLIMIT_NPROC"
    m = re.fullmatch(r"cannot start thread (\d+) of 16 for the CPU backend: Resource temporarily unavailable", r["msg"])
    assert m, r["msg"]
    if r["exact"]:
        assert m.group(1) == "3"


# ------------------------------------------------------------------------------------------------
# Allocation guard
# ------------------------------------------------------------------------------------------------

needs_guard = pytest.mark.skipif(not core.cpu_alloc_guard_available(), reason="allocation guard not in this build")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard is built on Linux only")
def test_alloc_guard_is_built_on_linux():
    # Linux builds must link the wrappers: a lost link option would otherwise skip every guard test below.
    assert core.cpu_alloc_guard_available()


@needs_guard
@pytest.mark.parametrize("kind", ["new_caller", "vector_caller", "nested_inner"])
def test_alloc_guard_counts_on_the_caller(kind):
    assert core.cpu_alloc_guard_test(kind) == 1


@needs_guard
def test_alloc_guard_nested_scope_counts_in_outer_too():
    assert core.cpu_alloc_guard_test("nested_outer") == 2


@needs_guard
@pytest.mark.parametrize("threads", [2, 4])
def test_alloc_guard_counts_on_pool_workers(threads):
    # Only a worker allocates; the count arrives in the caller's scope.
    assert core.cpu_alloc_guard_test("vector_worker", threads) >= 1
    assert core.cpu_alloc_guard_test("worker_active", threads) >= 1


@needs_guard
def test_alloc_guard_leaves_workers_after_the_job():
    assert core.cpu_alloc_guard_test("worker_inactive_after", 2) == 0


@needs_guard
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_parallel_for_does_not_allocate(threads):
    # 100 calls whose body captures several references (a std::function would allocate for each).
    assert core.cpu_alloc_guard_test("parallel_for", threads) == 0


@needs_guard
def test_alloc_guard_check_names_the_step():
    with pytest.raises(LilyError, match=r"^allocation inside a step: 1 heap allocation\(s\) \(first: 4000 bytes\) in check$"):
        core.cpu_alloc_guard_test("check")


# ------------------------------------------------------------------------------------------------
# Matmul scratch: a reserved arena makes products allocation-free
# ------------------------------------------------------------------------------------------------

MATMUL_CASES = [
    (spec, path, t)
    for spec in ("q4g64-bf16", "q8g32-f16", "bf16")
    for path, t in (("gemv", 1), ("gemv", 3), ("gemm", 37))
]


@needs_guard
@pytest.mark.parametrize("threads", [0, 1, 2, 4])  # 0: matmul_serial
@pytest.mark.parametrize("spec,path,t", MATMUL_CASES)
def test_reserved_matmul_does_not_allocate(spec, path, t, threads):
    rng = np.random.default_rng(7)
    n, k = 300, 1024
    w, _ = make_weight(rng, spec, n, k)
    x = make_x(rng, t, k)
    y, counts = core.cpu_matmul_guarded(x, w, path, threads, True, 2)
    assert list(counts) == [0, 0]
    # Same kernels, same bits as the plain entry point (which grows its scratch lazily).
    ref = np.asarray(core.cpu_matmul(x, w, path, max(threads, 1)))
    assert np.array_equal(np.asarray(y).view(np.uint32), ref.view(np.uint32))


@needs_guard
@pytest.mark.parametrize("threads", [0, 1, 2])
@pytest.mark.parametrize("spec,path,t", [("q4g64-bf16", "gemv", 1), ("bf16", "gemm", 37)])
def test_unreserved_matmul_allocates_once(spec, path, t, threads):
    # Without reserve the first product grows the scratch (and the guard sees it); the buffers then stay,
    # so with one thread the second product allocates nothing.
    rng = np.random.default_rng(8)
    w, _ = make_weight(rng, spec, 300, 1024)
    x = make_x(rng, t, 1024)
    _, counts = core.cpu_matmul_guarded(x, w, path, threads, False, 2)
    assert counts[0] > 0
    if threads <= 1:
        assert counts[1] == 0
