"""Python front end of the Metal emulator: compiles MSL with build.compile_library and runs kernels in a
persistent job runner process (one per Emulator) that talks over pipes.

    with Emulator(mode="typed") as emu:
        lib = emu.load("metal/norm.metal")
        out = lib.run("rms_norm", threadgroups=(rows, 1, 1), threads=(256, 1, 1), buffers={0: x, 1: w, 2: y})

A sanitizer report (asan mode) or a crash kills the runner; the call raises and the next call starts a new
runner, reloading libraries as they are used.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from . import build

__all__ = ["Emulator", "Library", "KernelError", "SanitizerError"]


class KernelError(RuntimeError):
    """A dispatch the emulator refused or stopped: divergent simd_*, early exit before a barrier, an
    unbound or undersized argument, an unknown kernel, a crash or a timeout."""


class SanitizerError(KernelError):
    """ASan / UBSan reported an error (asan mode); the report is in the message."""


_CONSTANT_DTYPES = {
    "bool": np.bool_, "char": np.int8, "uchar": np.uint8, "short": np.int16, "ushort": np.uint16,
    "int": np.int32, "uint": np.uint32, "long": np.int64, "ulong": np.uint64, "float": np.float32,
    "half": np.float16, "int8_t": np.int8, "uint8_t": np.uint8, "int16_t": np.int16, "uint16_t": np.uint16,
    "int32_t": np.int32, "uint32_t": np.uint32, "int64_t": np.int64, "uint64_t": np.uint64,
}


def _bfloat_bytes(value: float) -> bytes:
    u = int(np.array(value, dtype=np.float32).view(np.uint32))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        h = (u >> 16) | 0x40
    else:
        h = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return int(h & 0xFFFF).to_bytes(2, "little")


def _dims(v, what: str) -> tuple[int, int, int]:
    if isinstance(v, (int, np.integer)):
        v = (int(v),)
    v = tuple(int(x) for x in v)
    if not 1 <= len(v) <= 3 or any(x < 0 for x in v):
        raise ValueError(f"{what} must be 1 to 3 non-negative integers, got {v}")
    return v + (1,) * (3 - len(v))


class Library:
    """A compiled kernel library loaded in an Emulator."""

    def __init__(self, emu: "Emulator", path: Path, info: dict):
        self._emu = emu
        self.path = path
        self._info = info
        self.kernels: list[str] = [k["name"] for k in info["kernels"]]
        self.constants: list[tuple[int, str, str]] = [(c["index"], c["name"], c["type"]) for c in info["constants"]]
        # What Metal reports as staticThreadgroupMemoryLength, per kernel.
        self.static_threadgroup_bytes: dict[str, int] = {k["name"]: k["static_threadgroup_bytes"]
                                                         for k in info["kernels"]}
        # Per kernel: {buffer index: True when the kernel may write through it} (from its signature).
        self.buffer_writes: dict[str, dict[int, bool]] = {
            k["name"]: {a["index"]: bool(a["writes"]) for a in k["args"] if a["kind"] == 0} for k in info["kernels"]}
        # Per kernel: [(kind "buffer" | "threadgroup", index, name)] as the kernel declares them.
        self.bindings: dict[str, list[tuple[str, int, str]]] = {
            k["name"]: [("buffer" if a["kind"] == 0 else "threadgroup", a["index"], a["name"]) for a in k["args"]]
            for k in info["kernels"]}

    def __repr__(self) -> str:
        return f"<metalsim Library {self.path.name}: {', '.join(self.kernels)}>"

    def run(self, kernel: str, *, threadgroups=None, grid=None, threads=(32, 1, 1), buffers=None,
            threadgroup_memory=None, constants=None, shuffle_seed: int = 0, reverse: bool = False,
            threadgroup_seed: int = 0, timeout: float | None = None) -> dict:
        """Runs one dispatch; returns {buffer index: array after the run} (same dtype and shape).

        threadgroups=... is dispatchThreadgroups; grid=... is dispatchThreads (partial edge threadgroups).
        shuffle_seed shuffles lane scheduling, threadgroup_seed the order in which threadgroups start
        (0: in order), reverse reverses the threadgroup order.
        """
        if kernel not in self.kernels:
            raise KernelError(f"no kernel named '{kernel}' in {self.path.name} (has: {', '.join(self.kernels)})")
        if (threadgroups is None) == (grid is None):
            raise ValueError("give exactly one of threadgroups= (dispatchThreadgroups) or grid= (dispatchThreads)")
        tpt = _dims(threads, "threads")
        tg = _dims(threadgroups, "threadgroups") if threadgroups is not None else (0, 0, 0)
        gr = _dims(grid, "grid") if grid is not None else (0, 0, 0)
        if grid is not None and 0 in gr:
            return {i: np.array(a, copy=True) for i, a in (buffers or {}).items()}  # empty grid: nothing runs
        bufs = []
        for index, arr in sorted((buffers or {}).items()):
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"buffer {index} must be a numpy array, got {type(arr).__name__}")
            if not arr.flags["C_CONTIGUOUS"]:
                raise ValueError(f"buffer {index} must be C-contiguous")
            bufs.append((int(index), arr))
        consts = []
        by_index = {c[0]: c for c in self.constants}
        for index, value in sorted((constants or {}).items()):
            if index not in by_index:
                raise KernelError(f"{self.path.name} has no function constant with index {index}")
            ctype = by_index[index][2]
            if ctype == "bfloat":
                data = _bfloat_bytes(float(value))
            elif ctype in _CONSTANT_DTYPES:
                data = np.array(value, dtype=_CONSTANT_DTYPES[ctype]).tobytes()
            else:
                raise KernelError(f"function constant {index} has unsupported type '{ctype}'")
            consts.append((int(index), data))
        tgm = sorted((int(i), int(n)) for i, n in (threadgroup_memory or {}).items())
        return self._emu._run(self, kernel, tg, gr, tpt, bufs, tgm, consts, int(shuffle_seed), bool(reverse),
                              int(threadgroup_seed), timeout)


class Emulator:
    """A persistent runner process for one build mode ("typed" or "asan")."""

    # Device limits a runner can be given (Emulator(limits=...)) and the environment variables that carry
    # them; the fake Metal runtime reads the same variables, so one configured device serves both.
    LIMITS = {
        "max_threads_per_threadgroup": "LILY_METALSIM_MAX_THREADS_PER_THREADGROUP",
        "max_threadgroup_memory": "LILY_METALSIM_MAX_THREADGROUP_MEMORY",
    }

    def __init__(self, mode: str = "typed", workers: int = 2, timeout: float = 300.0, limits: dict | None = None):
        if mode not in build.ALL_MODES:
            raise ValueError(f"mode must be one of {build.ALL_MODES}, got {mode!r}")
        unknown = set(limits or {}) - set(self.LIMITS)
        if unknown:
            raise ValueError(f"unknown device limits {sorted(unknown)}; known: {sorted(self.LIMITS)}")
        self.limits = {k: int(v) for k, v in (limits or {}).items()}
        self.mode = mode
        self.workers = int(workers)
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._stderr = None
        self._loaded: dict[Path, int] = {}  # library path -> id in the current runner
        self._libraries: dict[Path, Library] = {}

    # ---- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> "Emulator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def close(self) -> None:
        proc, self._proc = self._proc, None
        self._loaded.clear()
        if proc is not None:
            try:
                proc.stdin.write(b"QUIT\n")
                proc.stdin.flush()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def _start(self) -> None:
        runner = build.runner_path(self.mode)
        env = dict(os.environ)
        for key, value in self.limits.items():
            env[self.LIMITS[key]] = str(value)
        if self.mode == "asan":
            # Leak checking cannot work under the fibers (and often not under ptrace); the report must
            # name kernel source lines, so point ASan at llvm-symbolizer when it exists.
            env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=0:" \
                                  "allocator_may_return_null=1:" + env.get("ASAN_OPTIONS", "")
            env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:" + env.get("UBSAN_OPTIONS", "")
            symbolizer = Path(os.path.realpath(build.find_clang())).parent / "llvm-symbolizer"
            if symbolizer.is_file():
                env.setdefault("ASAN_SYMBOLIZER_PATH", str(symbolizer))
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([str(runner)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, env=env)
        self._loaded.clear()
        self._send(f"WORKERS {self.workers}\n".encode())
        self._reply(None, "setting workers")

    def _ensure(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:
                self.close()
            self._start()

    # ---- pipe protocol ----------------------------------------------------------------------------------
    def _send(self, *parts: bytes) -> None:
        try:
            for p in parts:
                self._proc.stdin.write(p)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the runner died; _reply reports why

    def _read(self, n: int, deadline: float | None, what: str) -> bytes:
        fd = self._proc.stdout.fileno()
        chunks, left = [], n
        while left:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                    self._proc.kill()
                    self._proc.wait()
                    self.close()
                    raise KernelError(f"{what}: timed out (the runner was stopped)")
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                self._died(what)
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)

    def _read_line(self, deadline: float | None, what: str) -> str:
        out = bytearray()
        while True:
            c = self._read(1, deadline, what)
            if c == b"\n":
                return out.decode()
            out += c

    def _died(self, what: str):
        proc = self._proc
        rc = proc.wait()
        self._stderr.seek(0)
        report = self._stderr.read().decode(errors="replace").strip()
        self.close()
        if len(report) > 20000:
            report = report[:20000] + "\n... (cut)"
        if "Sanitizer" in report or "runtime error:" in report:
            raise SanitizerError(f"{what}: sanitizer report:\n{report}")
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        raise KernelError(f"{what}: the runner crashed ({how})" + (f":\n{report}" if report else ""))

    def _reply(self, deadline: float | None, what: str) -> tuple[str, str]:
        status, n = self._read_line(deadline, what).split(" ", 1)
        if status == "ERR":
            msg = self._read(int(n), deadline, what).decode(errors="replace")
            raise KernelError(msg if msg.startswith("kernel '") else f"{what}: {msg}")
        return status, n

    # ---- public API ---------------------------------------------------------------------------------------
    def load(self, path_or_source, name: str | None = None) -> Library:
        """Compiles (cached) and loads MSL given as a file path or as source text."""
        path = build.compile_library(path_or_source, self.mode, name=name)
        lib = self._libraries.get(path)
        if lib is None:
            info = self._load_in_runner(path)
            lib = Library(self, path, info)
            self._libraries[path] = lib
        return lib

    def _load_in_runner(self, path: Path) -> dict:
        self._ensure()
        raw = str(path).encode()
        self._send(f"LOAD {len(raw)}\n".encode(), raw)
        _, n = self._reply(None, f"loading {path.name}")
        info = json.loads(self._read(int(n), None, f"loading {path.name}"))
        self._loaded[path] = info["id"]
        return info

    def _run(self, lib: Library, kernel, tg, grid, tpt, bufs, tgm, consts, seed, reverse, tg_seed, timeout) -> dict:
        what = f"kernel '{kernel}'"
        self._ensure()
        if lib.path not in self._loaded:
            self._load_in_runner(lib.path)
        name = kernel.encode()
        head = (f"RUN {self._loaded[lib.path]} {len(name)} {tg[0]} {tg[1]} {tg[2]} {grid[0]} {grid[1]} {grid[2]} "
                f"{tpt[0]} {tpt[1]} {tpt[2]} {seed & 0xFFFFFFFFFFFFFFFF} {int(reverse)} {tg_seed & 0xFFFFFFFFFFFFFFFF} "
                f"{len(bufs)} {len(tgm)} "
                f"{len(consts)}\n")
        parts = [head.encode(), name]
        for index, arr in bufs:
            data = arr.tobytes()
            parts += [f"{index} {len(data)}\n".encode(), data]
        for index, n in tgm:
            parts.append(f"{index} {n}\n".encode())
        for index, data in consts:
            parts += [f"{index} {len(data)}\n".encode(), data]
        self._send(*parts)
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit if limit else None
        _, n = self._reply(deadline, what)
        out = {}
        shapes = dict(bufs)
        for _ in range(int(n)):
            index, size = (int(x) for x in self._read_line(deadline, what).split())
            data = bytearray(self._read(size, deadline, what))
            src = shapes[index]
            out[index] = np.frombuffer(data, dtype=src.dtype).reshape(src.shape)
        return out
