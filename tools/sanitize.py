#!/usr/bin/env python3
"""Build lily._core with a sanitizer and run the engine's tests against it (docs/ARCHITECTURE.md, "Sanitizers").

    python tools/sanitize.py address            # ASan + UBSan: the session / checkpoint / sampler / pool tests
    python tools/sanitize.py thread             # TSan: the threading tests
    python tools/sanitize.py address thread     # both, one after the other (what .ci/run does)
    python tools/sanitize.py thread -- -k busy  # extra pytest arguments after --

Each kind is built with g++ (its runtime is the one preloaded below) into build/sanitize-<kind> (reused
between runs: only what changed is rebuilt), staged with a copy of src/lily in build/sanitize-<kind>/site
and tested with PYTHONPATH pointing there, so the installed lily is never touched. Python, numpy and torch
are not instrumented: the sanitizer runtime is LD_PRELOADed so that its interceptors (malloc, pthread_*) are
in place before anything else loads. Any report fails the run: the runtimes abort on the first one.
Exit status: 0 when every kind passed, otherwise the first failing step's status (1 for a build failure).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

# Left out under both sanitizers: the deferred re-run of the whole suite in a subprocess (done below in this
# process, on the chosen files), and the 3000-token single-thread prefill that shows the GIL is released
# (2 s natively, 5 min under ASan; what it checks is not memory or thread safety).
SLOW = ["test_device_step.py::test_whole_suite_passes_deferred",
        "test_device_step.py::test_gil_released_during_a_forward"]

# -fsanitize= list and the tests per kind. pytest node ids relative to tests/.
KINDS: dict[str, dict] = {
    "address": {
        "fsanitize": "address,undefined",
        # Alignment is checked too: MLX checkpoints have unpadded headers, so mapped weights sit at any byte
        # address; every scalar read of them goes through load_unaligned (model/weight.h). This run found the
        # typed loads that were there before.
        "extra": "",
        "runtime": "libasan.so",
        # The session, checkpoint, sampler and thread-pool tests, the device-step model (deferred executor,
        # sampler oracle, the speculative decode step) and the reliability cases; the parity tests against
        # transformers run through the same forward as test_session's reference comparisons.
        # A restore's state read from the snapshot until the next forward, written by the snapshot's destructor
        # when it goes first; the checkpoint reserve's tensors handed to snapshots (use after free would show).
        # The speculative loop: two parities of buffers, rows picked by a device index (copy_rows_at).
        "tests": ["test_session.py", "test_checkpoint.py", "test_cpu_runtime.py", "test_device_step.py",
                  "test_reliability.py", "test_engine_api.py", "test_kv_bf16.py", "test_parity_transformers.py",
                  "test_restore_on_first_forward.py", "test_state_capture.py", "test_mtp_pipeline.py"],
        # The deferred, shuffled, strict_alloc re-run of the engine tests, in this process instead of through
        # test_whole_suite_passes_deferred's subprocess (which would run the parity tests a second time).
        "deferred": ["test_session.py", "test_device_step.py", "test_reliability.py", "test_engine_api.py"],
        "deselect": SLOW,
    },
    "thread": {
        "fsanitize": "thread",
        "extra": "",
        "runtime": "libtsan.so",
        # The thread pool (exceptions, thread-creation failure, the allocation guard on workers), SessionBusy,
        # readers while a generate runs, the GIL released during a forward, the deferred executor thread; the
        # speculative loop's queued iteration running on that thread while the host reads the one before.
        "tests": ["test_cpu_runtime.py", "test_engine_api.py", "test_device_step.py", "test_session.py",
                  "test_mtp_pipeline.py"],
        "deferred": ["test_engine_api.py", "test_device_step.py", "test_session.py"],
        # TSan's runtime runs a background thread of its own, which takes one of the RLIMIT_NPROC slots that
        # test counts exactly.
        "deselect": [*SLOW, "test_cpu_runtime.py::test_rlimit_nproc_is_a_clean_error"],
    },
}

# Leak detection is off: Python never frees much of what it allocates at exit (interned objects, module
# state, arenas), and LeakSanitizer would report all of it, burying Lily's. Use-after-free, overflows and
# double frees are what this run is for; Lily's ownership is RAII throughout.
# allocator_may_return_null: the tests ask for sessions larger than memory and expect the clean error that
# a failed allocation gives natively; ASan would abort on the oversized request instead.
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1:halt_on_error=1:print_summary=1:allocator_may_return_null=1"
UBSAN_OPTIONS = "halt_on_error=1:print_stacktrace=1"
# report_signal_unsafe=0: Python's own signal handlers call into malloc (not Lily's code). The suppressions
# name only races inside uninstrumented CPython / numpy / torch (tools/tsan.supp says why for each one).
TSAN_OPTIONS = "halt_on_error=1:report_signal_unsafe=0:second_deadlock_stack=1"


def log(msg: str) -> None:
    print(f"[sanitize] {msg}", flush=True)


def runtime_path(name: str) -> str:
    r = subprocess.run(["g++", "-print-file-name=" + name], capture_output=True, text=True, check=True)
    p = Path(r.stdout.strip())
    if not p.is_absolute() or not p.exists():
        raise SystemExit(f"g++ has no {name} (got {r.stdout.strip()!r}); on Debian/Ubuntu it comes with gcc "
                         f"(libasan8 / libtsan2 / libubsan1)")
    return str(p.resolve())


def build(kind: str) -> Path:
    """Configure (once) and build _core into build/sanitize-<kind>; stage the package; return the stage."""
    spec = KINDS[kind]
    bdir = ROOT / "build" / f"sanitize-{kind}"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not (bdir / "CMakeCache.txt").exists():
        gen_cmd = ["cmake", "-S", str(ROOT), "-B", str(bdir), *gen, "-DCMAKE_BUILD_TYPE=Release",
                   "-DCMAKE_CXX_COMPILER=g++", f"-DLILY_SANITIZE={spec['fsanitize']}",
                   f"-DLILY_SANITIZE_EXTRA={spec['extra']}", f"-DPython_EXECUTABLE={sys.executable}"]
        subprocess.run(gen_cmd, check=True, stdout=subprocess.DEVNULL)
    else:  # the options may have changed in the cache by hand; keep them what this kind needs
        subprocess.run(["cmake", str(bdir), f"-DLILY_SANITIZE={spec['fsanitize']}",
                        f"-DLILY_SANITIZE_EXTRA={spec['extra']}"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(bdir), "-j", str(os.cpu_count() or 2)], check=True)
    so = sorted(bdir.glob("_core*.so"))
    if len(so) != 1:
        raise SystemExit(f"expected one _core*.so in {bdir}, found {so}")
    site = bdir / "site"
    shutil.rmtree(site, ignore_errors=True)
    shutil.copytree(ROOT / "src" / "lily", site / "lily",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy2(so[0], site / "lily" / so[0].name)
    return site


def expected_only(report: Path) -> bool:
    """A report file holding nothing but ASan's notes of refused oversized allocations."""
    lines = [ln for ln in report.read_text(errors="replace").splitlines() if ln.strip()]
    return bool(lines) and all("WARNING: AddressSanitizer failed to allocate" in ln for ln in lines)


def environment(kind: str, site: Path, reports: Path) -> dict:
    """Reports go to files (log_path=<reports>/<runtime>.<pid>): pytest captures fd 2, and a runtime that
    halts the process takes the captured text with it; subprocesses (the CLI tests) report there too."""
    spec = KINDS[kind]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    # libstdc++ right after the runtime: Python itself does not link it, so without this it is loaded later
    # (with torch or _core) and the runtime's __cxa_throw interceptor, resolved at its start-up, finds no real
    # __cxa_throw: the first C++ exception would abort with "CHECK failed: real___cxa_throw != 0".
    env["LD_PRELOAD"] = f"{runtime_path(spec['runtime'])}:{runtime_path('libstdc++.so.6')}"
    env.pop("LILY_CPU_DEBUG", None)
    if kind == "address":
        env["ASAN_OPTIONS"] = f"{ASAN_OPTIONS}:log_path={reports / 'asan'}"
        # No log_path for UBSan: next to ASan its file output is lost; its reports reach the console because
        # pytest captures at the sys level only (--capture=sys below) and halt with exit status 1.
        env["UBSAN_OPTIONS"] = UBSAN_OPTIONS
    else:
        env["TSAN_OPTIONS"] = (f"{TSAN_OPTIONS}:suppressions={ROOT / 'tools' / 'tsan.supp'}"
                               f":log_path={reports / 'tsan'}")
        # OpenBLAS (numpy's, scipy's) and OpenMP (torch's) pools are uninstrumented and hand work to their
        # threads by spinning on plain memory, which TSan cannot see as synchronisation: it reported numpy
        # reading a dgemm result written by an OpenBLAS worker. One thread each: those pools never start.
        env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    return env


def check_loaded(env: dict, site: Path, kind: str) -> None:
    """The staged, instrumented extension is the one imported (not the installed one)."""
    code = ("import lily._core as c, sys; print(c.__file__); "
            "print(open('/proc/self/maps').read().count('%s'))" % KINDS[kind]["runtime"].split(".")[0])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"importing the {kind}-sanitized lily._core failed:\n{r.stdout}{r.stderr}")
    path, maps = r.stdout.split()
    if not Path(path).resolve().is_relative_to(site.resolve()) or int(maps) == 0:
        raise SystemExit(f"the sanitized extension is not the one loaded ({path}; runtime mapped: {maps})")


def pytest(env: dict, files: list[str], deselect: list[str], extra: list[str], label: str) -> int:
    # --capture=sys: what the C++ code and the sanitizer runtimes write to fd 2 is not swallowed.
    cmd = [sys.executable, "-m", "pytest", "-q", "--capture=sys", "-p", "no:cacheprovider", f"--rootdir={ROOT}",
           *[str(TESTS / f) for f in files], *[f"--deselect=tests/{d}" for d in deselect], *extra]
    log(f"{label}: pytest {' '.join(files)}" + (f" ({env['LILY_CPU_DEBUG']})" if "LILY_CPU_DEBUG" in env else ""))
    t0 = time.monotonic()
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    log(f"{label}: exit {rc} in {time.monotonic() - t0:.0f}s")
    return rc


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kinds", nargs="+", choices=sorted(KINDS))
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--no-deferred", action="store_true", help="skip the deferred (executor thread) re-run")
    args = ap.parse_args(argv)
    first_rc = 0
    for kind in args.kinds:
        t0 = time.monotonic()
        try:
            site = build(kind)
        except subprocess.CalledProcessError as e:
            log(f"{kind}: build failed ({e})")
            first_rc = first_rc or 1
            continue
        log(f"{kind}: built and staged in {time.monotonic() - t0:.0f}s ({site})")
        if args.build_only:
            continue
        reports = site.parent / "reports"
        shutil.rmtree(reports, ignore_errors=True)
        reports.mkdir()
        env = environment(kind, site, reports)
        check_loaded(env, site, kind)
        spec = KINDS[kind]
        rc = pytest(env, spec["tests"], spec["deselect"], extra, kind)
        if rc == 0 and not args.no_deferred and spec.get("deferred"):
            denv = dict(env, LILY_CPU_DEBUG="deferred,strict_alloc", LILY_CPU_SHUFFLE_SEED="99")
            rc = pytest(denv, spec["deferred"], spec["deselect"], extra, f"{kind} deferred")
        # With allocator_may_return_null ASan notes each refused oversized request ("failed to allocate"):
        # that is the case the tests provoke on purpose, not a report.
        found = sorted(p for p in reports.iterdir() if p.stat().st_size and not expected_only(p))
        for p in found:  # a report anywhere (also in a subprocess whose failure a test tolerated) fails
            log(f"{kind}: sanitizer report {p.name}:")
            print(p.read_text(errors="replace")[:20000], flush=True)  # the head: the error and its stack
        if found and rc == 0:
            rc = 1
        log(f"{kind}: {'clean' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f}s")
        first_rc = first_rc or rc
    return first_rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
