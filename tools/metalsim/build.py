"""Builds for the Metal emulator: finding clang, libmslsim + the job runner + the shim's precompiled header
per mode, and kernel libraries compiled from MSL, all cached by content hash.

Cache layout (root: $LILY_METALSIM_CACHE or ~/.cache/lily/metalsim):
    rt-<hash>/<mode>/libmslsim_<mode>.so, mslsim-runner, metal_stdlib.pch
    lib-<hash>/<name>.so (+ <name>.json: kernels and function constants)
<hash> covers the sources, the shim headers, the flags and the clang version, so editing any of them
rebuilds exactly what depends on it. Builds write to a temporary name and rename, under a file lock, so
concurrent processes (pytest workers, the fake Metal runtime's JIT) share the cache safely.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from . import msl2cpp

__all__ = [
    "ALL_MODES",
    "MODES",
    "CompileError",
    "cache_root",
    "compile_flags",
    "compile_library",
    "find_clang",
    "include_dir",
    "runner_path",
    "runtime_library",
    "asan_runtime",
    "unavailable_reason",
]

# The checking builds (every kernel test runs in both): typed keeps MSL address spaces; asan erases them, under
# ASan/UBSan.
MODES = ("typed", "asan")
# Every build: traffic is typed with every load and store of the kernels reported to libmslsim (device-memory
# traffic per dispatch, mslsim_dispatch::traffic; benchmarks/bench_metal_traffic.py).
ALL_MODES = (*MODES, "traffic")
SHIM_VERSION = "2"  # 2: the PCH carries no timestamps

_HERE = Path(__file__).resolve().parent
_SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-shared-libsan"]


class CompileError(Exception):
    """MSL that does not compile (clang diagnostics, mapped to the .metal file:line) or a failed build."""


def include_dir() -> Path:
    return _HERE / "include"


def cache_root() -> Path:
    env = os.environ.get("LILY_METALSIM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lily" / "metalsim"


def required() -> bool:
    """LILY_METALSIM_REQUIRE=1 (set by CI): where the harness cannot run, its tests fail instead of skipping, so a
    CI image that lost clang cannot turn the Metal verification silently off."""
    return os.environ.get("LILY_METALSIM_REQUIRE", "") not in ("", "0")


def unavailable_reason() -> str | None:
    """Why the harness cannot run on this machine, or None when it can. It targets Linux x86-64 (the fiber
    switch and the objc_msgSend trampoline are x86-64 assembly) and needs clang++ >= 17."""
    import platform
    import sys

    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        return f"the Metal emulation harness runs on Linux x86-64 (this is {sys.platform} {platform.machine()})"
    if find_clang() is None:
        return ("the Metal emulation harness needs clang++ >= 17 (apt-get install clang-19 libclang-rt-19-dev, "
                "or set LILY_CLANGXX)")
    return None


def _clang_major(path: str) -> int:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    m = re.search(r"clang version (\d+)", out)
    return int(m.group(1)) if m else 0


@functools.lru_cache(maxsize=None)
def find_clang() -> str | None:
    """clang++ >= 17 ($LILY_CLANGXX first, then clang++-19 and neighbours), or None."""
    env = os.environ.get("LILY_CLANGXX")
    names = [env] if env else ["clang++-19", "clang++-20", "clang++-21", "clang++-18", "clang++-17", "clang++"]
    for name in names:
        path = shutil.which(name) or (name if os.path.isfile(name) else None)
        if path and _clang_major(path) >= 17:
            return path
    return None


def _require_clang() -> str:
    clang = find_clang()
    if clang is None:
        raise CompileError("no clang++ >= 17 found (install clang-19 or set LILY_CLANGXX)")
    return clang


@functools.lru_cache(maxsize=None)
def _clang_id(clang: str) -> str:
    return subprocess.run([clang, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def _check_mode(mode: str) -> None:
    if mode not in ALL_MODES:
        raise ValueError(f"mode must be one of {ALL_MODES}, got {mode!r}")


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> tuple[str, ...]:
    # F16C converts half <-> float in one instruction (bit-identical to the libgcc calls): kernels that
    # use half run several times faster. Only when this machine has it; the flag is part of the cache key.
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    return ("-mf16c",) if re.search(r"^flags\s*:.*\bf16c\b", info, re.M) else ()


def compile_flags(mode: str) -> list[str]:
    """Flags for host C++ translation units that link libmslsim of this mode (e.g. the fake Metal runtime)."""
    _check_mode(mode)
    flags = ["-fPIC", "-g", f"-I{include_dir()}"]
    if mode == "asan":
        flags += _SANITIZE
    return flags


def _kernel_flags(mode: str) -> list[str]:
    flags = [
        "-std=c++17",
        "-fPIC",
        "-gline-tables-only",
        "-fno-exceptions",
        "-fno-rtti",
        "-fno-math-errno",
        "-ffp-contract=off",
        # half and bfloat round after every operation, as on the GPU (clang keeps float excess precision
        # within an expression by default on x86).
        "-Xclang",
        "-ffloat16-excess-precision=none",
        "-Xclang",
        "-fbfloat16-excess-precision=none",
        "-flax-vector-conversions=none",
        "-w",
        f"-I{include_dir()}",
        *_cpu_flags(),
    ]
    if mode == "asan":
        flags += ["-O1", "-DMSLSIM_ERASE_ADDRESS_SPACES=1", *_SANITIZE]
    elif mode == "traffic":
        # A call before every load and store, with its address (libmslsim keeps those inside bound buffers).
        # The callbacks exist for 1, 2, 4, 8 and 16 bytes only, so no vectorizer may form wider accesses; what
        # the kernels still do otherwise (a struct copied from device memory, an atomic read-modify-write) is
        # found in the IR and refused (_check_traffic_ir).
        flags += ["-O2", "-fno-vectorize", "-fno-slp-vectorize", "-fsanitize-coverage=edge,trace-loads,trace-stores"]
    else:
        flags += ["-O2"]
    return flags


def _hash_files(h, paths) -> None:
    for p in sorted(paths):
        h.update(str(p.relative_to(_HERE)).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")


@functools.lru_cache(maxsize=None)
def _runtime_key(mode: str) -> str:
    clang = _require_clang()
    h = hashlib.sha256()
    h.update(f"{SHIM_VERSION}|{mode}|{_clang_id(clang)}|{' '.join(_kernel_flags(mode))}".encode())
    files = [p for d in ("include", "runtime", "runner") for p in (_HERE / d).rglob("*") if p.is_file()]
    _hash_files(h, files)
    return h.hexdigest()[:20]


def _runtime_dir(mode: str) -> Path:
    return cache_root() / f"rt-{_runtime_key(mode)}" / mode


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], what: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"{what} failed:\n{r.stderr.strip() or r.stdout.strip()}")
    return r


@functools.lru_cache(maxsize=None)
def asan_runtime() -> Path | None:
    """The shared ASan runtime the asan-mode objects link to (LD_PRELOAD it into a non-ASan host)."""
    clang = _require_clang()
    out = subprocess.run([clang, "-print-file-name=libclang_rt.asan-x86_64.so"], capture_output=True, text=True)
    p = Path(out.stdout.strip())
    return p if p.is_file() else None


def _build_runtime(mode: str, d: Path) -> None:
    clang = _require_clang()
    d.mkdir(parents=True, exist_ok=True)
    san = _SANITIZE if mode == "asan" else []
    rpath = [f"-Wl,-rpath,{asan_runtime().parent}"] if mode == "asan" and asan_runtime() else []
    lib = d / f"libmslsim_{mode}.so"
    tmp = d / f".tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        _run(
            [clang, "-std=c++17", "-O2", "-g", "-fPIC", "-shared", *san, f"-I{include_dir()}",
             # Instrumenting the scheduler would leave stale stack poison behind (see mslsim.cpp).
             *(["-fno-sanitize=all", "-DMSLSIM_ASAN=1"] if mode == "asan" else []),
             str(_HERE / "runtime" / "mslsim.cpp"), str(_HERE / "runtime" / "switch_x86_64.S"),
             f"-Wl,-soname,libmslsim_{mode}.so", *rpath, "-lpthread", "-o", str(tmp / lib.name)],
            "building libmslsim",
        )
        os.replace(tmp / lib.name, lib)
        _run(
            [clang, "-std=c++17", "-O2", "-g", *san, f"-I{include_dir()}", str(_HERE / "runner" / "runner.cpp"),
             f"-L{d}", f"-lmslsim_{mode}", f"-Wl,-rpath,{d}", *rpath, "-ldl", "-lpthread", "-o", str(tmp / "runner")],
            "building the job runner",
        )
        os.replace(tmp / "runner", d / "mslsim-runner")
        _run(
            # No timestamps in the PCH: its folder is keyed by the shim's content, and a checkout or rebase that
            # rewrites the same bytes must not make every later kernel compile fail with "has been modified".
            [clang, *_kernel_flags(mode), "-Xclang", "-fno-pch-timestamp", "-x", "c++-header",
             str(include_dir() / "metal_stdlib"), "-o", str(tmp / "pch")],
            "precompiling the metal_stdlib shim",
        )
        os.replace(tmp / "pch", d / "metal_stdlib.pch")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ensure_runtime(mode: str) -> Path:
    _check_mode(mode)
    d = _runtime_dir(mode)
    if not (d / "metal_stdlib.pch").is_file():
        with _locked(d):
            if not (d / "metal_stdlib.pch").is_file():
                _build_runtime(mode, d)
    return d


def runtime_library(mode: str) -> Path:
    """libmslsim for this mode (built on first use)."""
    return _ensure_runtime(mode) / f"libmslsim_{mode}.so"


def runner_path(mode: str) -> Path:
    """The job runner executable the Python Emulator talks to."""
    return _ensure_runtime(mode) / "mslsim-runner"


def _preprocess(clang: str, source, include_dirs) -> tuple[str, str, str]:
    """(preprocessed text, display name, library name) of an MSL file path or source text."""
    is_file = isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and len(source) < 4096 and Path(source).is_file()
    )
    cmd = [
        clang, "-E", "-x", "c++", "-std=c++17", "-DMSLSIM_PREPROCESS_ONLY=1", "-D__METAL_VERSION__=310",
        "-D__METAL_MACOS__=1", "-D__HAVE_BFLOAT__=1", "-D__METAL__=1", f"-I{include_dir()}",
    ]
    cmd += [f"-I{d}" for d in include_dirs]
    if is_file:
        path = Path(source).resolve()
        r = subprocess.run(cmd + [str(path)], capture_output=True, text=True)
        display, stem = str(path), path.stem
    else:
        text = f'#line 1 "kernel_source.metal"\n{source}'
        r = subprocess.run(cmd + ["-"], input=text, capture_output=True, text=True)
        display, stem = "kernel_source.metal", "kernel_source"
    if r.returncode != 0:
        raise CompileError(r.stderr.strip())
    return r.stdout, display, stem


def compile_library(source, mode: str, name: str | None = None, include_dirs=()) -> Path:
    """Compiles MSL (a file path or the source text) into a kernel library for `mode`; returns its path.

    Raises CompileError with clang's diagnostics, which name the .metal file and line.
    """
    _check_mode(mode)
    clang = _require_clang()
    rt = _ensure_runtime(mode)
    pre, display, stem = _preprocess(clang, source, include_dirs)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name or stem)
    h = hashlib.sha256()
    h.update(f"{_runtime_key(mode)}|{msl2cpp.REWRITER_VERSION}|{name}|{display}\0".encode())
    h.update(pre.encode())
    h.update((_HERE / "msl2cpp.py").read_bytes())
    d = cache_root() / f"lib-{h.hexdigest()[:24]}"
    so = d / f"{name}.so"
    if so.is_file():
        return so
    try:
        rw = msl2cpp.rewrite(pre, display)
    except msl2cpp.RewriteError as e:
        raise CompileError(str(e)) from None
    with _locked(d):
        if so.is_file():
            return so
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d, prefix=".build-") as tmp:
            cpp = Path(tmp) / f"{name}.cpp"
            cpp.write_text(rw.cpp)
            cmd = [
                clang, *_kernel_flags(mode), "-include-pch", str(rt / "metal_stdlib.pch"), "-x", "c++", str(cpp),
                "-shared", f"-L{rt}", f"-lmslsim_{mode}", f"-Wl,-rpath,{rt}", "-o", str(Path(tmp) / so.name),
            ]
            if mode == "asan" and asan_runtime():
                cmd.append(f"-Wl,-rpath,{asan_runtime().parent}")
            if mode == "traffic":
                # Optimised and instrumented IR first, checked, then machine code from it.
                ll = Path(tmp) / f"{name}.ll"
                r = subprocess.run([*cmd[:cmd.index("-shared")], "-S", "-emit-llvm", "-o", str(ll)],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise CompileError(_clean_diagnostics(r.stderr, display))
                _check_traffic_ir(ll.read_text(), display)
                cmd = [clang, "-O2", "-fPIC", "-gline-tables-only", "-ffp-contract=off", *_cpu_flags(), "-x", "ir",
                       str(ll), *cmd[cmd.index("-shared"):]]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise CompileError(_clean_diagnostics(r.stderr, display))
            (Path(tmp) / f"{name}.json").write_text(
                json.dumps({"source": display, "kernels": rw.kernels, "constants": rw.constants}, indent=1)
            )
            os.replace(Path(tmp) / f"{name}.json", d / f"{name}.json")
            os.replace(Path(tmp) / so.name, so)
    return so


_IR_ACCESS = re.compile(r"^\s*(?:%[\w.]+ = )?(load|store)\b.*?, ptr(?: addrspace\((\d+)\))? (%[\w.]+|@[\w.$]+)")
_IR_UNCOUNTED = re.compile(r"\b(atomicrmw|cmpxchg)\b|@llvm\.mem(?:cpy|move|set)(?:\.inline)?\.p[12]|"
                           r"@llvm\.mem(?:cpy|move)(?:\.inline)?\.p\d+\.p[12]|addrspacecast \(?ptr addrspace\([12]\)")


def _check_traffic_ir(ll: str, display: str) -> None:
    """Traffic mode counts what the trace-loads/trace-stores callbacks report, so every memory access the kernels
    make must have one: each load and store outside threadgroup memory (address space 3) directly preceded by its
    __sanitizer_cov_<load|store><bytes> call on the same pointer (sizes other than 1, 2, 4, 8 and 16 bytes have no
    callback), and no atomic read-modify-write, memcpy/memset or address-space cast touching device or constant
    memory (none has a callback). Raises CompileError naming the first few accesses that would go uncounted."""
    lines = ll.splitlines()
    missed: list[str] = []
    prev = ""
    for ln in lines:
        s = ln.strip()
        if not s or s.startswith("#dbg_") or "@llvm.dbg." in s:
            continue
        m = _IR_ACCESS.match(ln)
        if m and m.group(2) != "3":
            space = f"ptr addrspace({m.group(2)})" if m.group(2) else "ptr"
            if not re.search(rf"call void @__sanitizer_cov_{m.group(1)}\d+\({re.escape(space)} {re.escape(m.group(3))}\)",
                             prev):
                missed.append(s)
        elif _IR_UNCOUNTED.search(s) and not s.startswith(("declare ", ";")):
            missed.append(s)
        prev = s
    if missed:
        shown = "\n  ".join(x[:200] for x in missed[:5])
        raise CompileError(f"compiling {display} for the traffic emulator: {len(missed)} memory accesses would go "
                           f"uncounted (no trace-loads/trace-stores callback):\n  {shown}")


def _clean_diagnostics(stderr: str, display: str) -> str:
    """clang's messages, minus the include-stack noise of the precompiled shim; capped in length."""
    lines = [ln for ln in stderr.splitlines() if not ln.startswith("In file included from <built-in>")]
    text = "\n".join(lines).strip()
    if len(text) > 8000:
        text = text[:8000] + "\n... (diagnostics cut)"
    return f"compiling {display} for the Metal emulator failed:\n{text}"
