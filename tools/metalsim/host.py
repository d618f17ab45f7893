"""Build driver for the Metal host-code checks on Linux.

L1, compile check: every Metal host source (csrc/metal/*.cpp) must compile with clang against metal-cpp (from
the pinned mlx-metal wheel, metal_cpp.py) plus the stub system headers in stubs/, with -Werror.

L3, fake Metal runtime: libfakemetal.so (fakemetal/: an Objective-C message-send trampoline and fake Metal
classes whose kernels run on the MSL emulator, libmslsim) lets the real host code link and run on Linux.
build_program links a test program with csrc/metal/*.cpp, libfakemetal and libmslsim.

Everything built is cached under metalsim.build.cache_root() by a hash of its inputs (sources, headers,
flags, compiler), so a second test session recompiles nothing.

    from metalsim import host
    ok, diagnostics = host.compile_check(["csrc/metal/device.cpp"])
    exe = host.build_program(["tests/metal/host/proof_main.cpp"], "typed", "proof_main")
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Sequence

from metalsim.metal_cpp import metal_cpp_dir

try:  # the emulator's build module: clang, per-mode flags, libmslsim, cache root
    from metalsim import build
except ImportError:  # L1 needs only clang; L3 reports the missing module when it is used
    build = None

__all__ = ["HOST_FLAGS", "REPO", "find_clang", "compile_check", "host_sources", "backend_dependencies", "build_fakemetal",
           "build_program",
           "build_python_module", "msl_source_cpp"]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOOLS = HERE.parent
STUBS = HERE / "stubs"
FAKEMETAL = HERE / "fakemetal"
CSRC = REPO / "csrc"

# The language and warning level of Metal host code (metal-cpp needs C++17 and clang's Blocks extension;
# unused parameters allowed, as CMakeLists.txt builds _core: the Ops interface names its unused defaults).
HOST_FLAGS = ("-std=c++17", "-fblocks", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror")  # as CMakeLists.txt
_FAKEMETAL_SOURCES = ("objc.cpp", "metal.cpp", "msgsend_x86_64.S")


def host_sources() -> list[Path]:
    """The Metal backend's host sources, csrc/metal/*.cpp, sorted."""
    return sorted((CSRC / "metal").glob("*.cpp"))


def backend_dependencies() -> list[Path]:
    """The core sources MetalOps (csrc/metal/backend.cpp) links against besides csrc/metal: the Ops base class and
    hazard tracker, weight formats, and SamplingParams."""
    return [CSRC / "backend" / "ops.cpp", CSRC / "backend" / "hazard.cpp", CSRC / "model" / "weight.cpp",
            CSRC / "runtime" / "sampler.cpp"]


def _core_headers_digest() -> str:
    """The headers of csrc/ that MetalOps includes (its own folder, the Ops interface, the model, the runtime)."""
    return _digest(*(_headers_digest(CSRC / d) for d in ("metal", "backend", "model", "runtime")))


def find_clang() -> Path:
    """The clang++ used for host code: metalsim.build's choice, else clang++-19 / clang++ on PATH."""
    if build is not None:
        found = build.find_clang()
        if found:
            return Path(found)
        raise RuntimeError("no clang++ >= 17 found (install clang-19 or set LILY_CLANGXX)")
    for name in ("clang++-19", "clang++"):
        found = shutil.which(name)
        if found:
            return Path(found)
    raise RuntimeError("clang++ not found (apt-get install clang-19)")


def _build():
    if build is None:
        raise RuntimeError("metalsim.build (the MSL emulator's build module) is missing: L3 cannot run")
    return build


def _include_flags() -> list[str]:
    # -isystem as in CMakeLists.txt (metal-cpp is a SYSTEM include there): -Werror applies to Lily's code,
    # not to Apple's headers or the stubs.
    return ["-isystem", str(STUBS), "-isystem", str(metal_cpp_dir()), "-I", str(CSRC)]


def _run_clang(cmd: Sequence[str]) -> tuple[int, str]:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def compile_check(sources: Iterable[str | os.PathLike], extra_flags: Sequence[str] = ()) -> tuple[bool, str]:
    """L1: syntax- and type-checks each source as Metal host code. Returns (all passed, clang's diagnostics)."""
    base = [str(find_clang()), *HOST_FLAGS, "-fsyntax-only", *_include_flags(), *extra_flags]
    srcs = [Path(s) for s in sources]
    with ThreadPoolExecutor(max_workers=max(1, min(len(srcs), os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda s: _run_clang([*base, str(s)]), srcs))
    ok = all(rc == 0 for rc, _ in results)
    diagnostics = "".join(f"--- {s}\n{out}" for s, (rc, out) in zip(srcs, results) if out or rc)
    return ok, diagnostics


# ------------------------------------------------------------------------------------------------------------
# L3 builds
# ------------------------------------------------------------------------------------------------------------


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _headers_digest(*dirs: Path) -> str:
    """Content hash of every header a host or fakemetal source can include from the repository."""
    parts: list[bytes | str] = []
    for d in dirs:
        for p in sorted(d.rglob("*")):
            if p.is_file() and p.suffix in ("", ".h", ".hpp"):
                parts += [p.name, p.read_bytes()]
    return _digest(*parts)


def _mode_flags(mode: str) -> list[str]:
    build = _build()
    if mode not in build.ALL_MODES:
        raise ValueError(f"mode must be one of {build.ALL_MODES}, got {mode!r}")
    # The emulator's flags for code that links libmslsim (sanitizers in asan mode), then the host language:
    # later flags win, so C++17 and Blocks apply whatever standard the emulator uses for kernels.
    return [*build.compile_flags(mode), "-std=c++17", "-fblocks", "-fPIC", "-g"]


def _link_flags(mode: str) -> list[str]:
    """Sanitizer runtime flags of this mode (libmslsim links the shared ASan runtime: so must its hosts)."""
    build = _build()
    flags = [f for f in build.compile_flags(mode) if f.startswith(("-fsanitize=", "-shared-libsan"))]
    asan = build.asan_runtime() if flags and hasattr(build, "asan_runtime") else None
    if asan:
        flags.append(f"-Wl,-rpath,{Path(asan).parent}")
    return flags


def _cache_dir(*parts: str) -> Path:
    d = Path(_build().cache_root()).joinpath("host", *parts)
    d.mkdir(parents=True, exist_ok=True)
    return d


def _atomic_output(final: Path, produce) -> Path:
    """Runs produce(tmp_path) and moves the result into place (parallel test processes may race)."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=final.suffix)
    os.close(fd)
    try:
        produce(Path(tmp))
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


def _check(cmd: Sequence[str], what: str) -> None:
    rc, out = _run_clang(cmd)
    if rc != 0:
        raise RuntimeError(f"{what} failed ({' '.join(cmd)}):\n{out}")


def _compile_objects(sources: Sequence[Path], flags: Sequence[str], key: str) -> list[Path]:
    """Compiles each source to a cached object; objects are keyed by source content + key (flags, headers)."""
    clang = str(find_clang())
    objdir = _cache_dir("obj")

    def one(src: Path) -> Path:
        obj = objdir / f"{src.stem}-{_digest(key, str(src), src.read_bytes())}.o"
        return _atomic_output(obj, lambda tmp: _check([clang, *flags, "-c", str(src), "-o", str(tmp)],
                                                       f"compiling {src}"))

    with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, sources))


def build_fakemetal(mode: str) -> Path:
    """libfakemetal.so for one emulator mode ("typed" or "asan"), linked against that mode's libmslsim."""
    flags = [*_mode_flags(mode), "-O1", "-Wall", "-Wextra", "-Werror", *_include_flags(),
             "-I", str(_build().include_dir()), f'-DFAKEMETAL_MODE="{mode}"', f'-DFAKEMETAL_TOOLS_DIR="{TOOLS}"',
             f'-DFAKEMETAL_PYTHON="{sys.executable}"']
    runtime = Path(_build().runtime_library(mode))
    key = _digest(str(find_clang()), *flags, _headers_digest(FAKEMETAL, STUBS, HERE / "include"),
                  str(runtime), runtime.read_bytes())
    objs = _compile_objects([FAKEMETAL / s for s in _FAKEMETAL_SOURCES], flags, key)
    out = _cache_dir(f"fakemetal-{mode}-{_digest(key, *map(str, objs))}") / "libfakemetal.so"
    clang = str(find_clang())
    return _atomic_output(out, lambda tmp: _check(
        [clang, "-shared", *map(str, objs), "-o", str(tmp), *_link_flags(mode), str(runtime),
         f"-Wl,-rpath,{runtime.parent}", "-ldl", "-lpthread"], "linking libfakemetal.so"))


def build_program(sources: Iterable[str | os.PathLike], mode: str, out_name: str) -> Path:
    """Links a host program: the given sources + csrc/metal/*.cpp (metal_cpp.cpp holds metal-cpp's private
    implementation) and the core files MetalOps needs (backend_dependencies) + libfakemetal + libmslsim (cached)."""
    own = [Path(s).resolve() for s in sources]
    srcs = own + [s for s in host_sources() + backend_dependencies() if s not in own]
    fake = build_fakemetal(mode)
    runtime = Path(_build().runtime_library(mode))
    flags = [*_mode_flags(mode), "-O1", "-Wall", "-Wextra", *_include_flags()]
    key = _digest(str(find_clang()), *flags, _headers_digest(STUBS), _core_headers_digest(),
                  *(_headers_digest(p.parent) for p in own))
    objs = _compile_objects(srcs, flags, key)
    link_key = _digest(*map(str, objs), str(fake), str(runtime), *_link_flags(mode))
    out = _cache_dir(f"{out_name}-{mode}-{link_key}") / out_name
    clang = str(find_clang())
    return _atomic_output(out, lambda tmp: _check(
        [clang, *map(str, objs), "-o", str(tmp), *_link_flags(mode), str(fake), str(runtime),
         f"-Wl,-rpath,{fake.parent}", f"-Wl,-rpath,{runtime.parent}", "-ldl", "-lpthread"], f"linking {out_name}"))


def msl_source_cpp() -> Path:
    """The C++ file defining lily::metal::msl_source() from metal/*.metal, as CMake generates it on macOS."""
    parts = ["// Generated from metal/*.metal by metalsim.host (CMake does the same on macOS).\n",
             '#include "metal/kernels.h"\n', "namespace lily::metal {\nconst char* msl_source() {\n  return\n"]
    for f in sorted((REPO / "metal").glob("*.metal")):
        parts.append(f'R"lilymsl(// ---- {f.name}\n{f.read_text()})lilymsl"\n')
    parts.append(";\n}\n}  // namespace lily::metal\n")
    text = "".join(parts)
    out = _cache_dir("msl") / f"metal_sources-{_digest(text)}.cpp"
    if not out.exists():
        _atomic_output(out, lambda tmp: tmp.write_text(text))
    return out


def build_python_module(mode: str = "typed") -> Path:
    """The Metal entry points of lily._core (python/bindings_metal.cpp, as built into the macOS extension) as a
    Python module `lily_metal_emu`, built against the fake Metal runtime: the macOS bindings, the host code and
    the kernels run end to end on Linux. Returns the folder holding the module (put it on sys.path)."""
    import sysconfig

    import nanobind

    nb_dir = Path(nanobind.__file__).resolve().parent
    nb_flags = ["-isystem", str(nb_dir / "include"), "-isystem", str(nb_dir / "ext" / "robin_map" / "include"),
                "-isystem", sysconfig.get_paths()["include"]]
    fake = build_fakemetal(mode)
    runtime = Path(_build().runtime_library(mode))
    # nanobind's own sources, compiled once (no -Werror: not our code).
    nb_objs = _compile_objects([nb_dir / "src" / "nb_combined.cpp"],
                               [*_mode_flags(mode), "-O1", "-fvisibility=hidden", *nb_flags],
                               _digest(str(find_clang()), nanobind.__version__, mode))
    module_init = HERE / "lily_metal_emu.cpp"
    srcs = [module_init, REPO / "python" / "bindings_metal.cpp", msl_source_cpp(), *host_sources(),
            *backend_dependencies()]
    flags = [*_mode_flags(mode), "-O1", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden",
             "-DLILY_WITH_METAL=1", *_include_flags(), *nb_flags]
    key = _digest(str(find_clang()), *flags, _headers_digest(STUBS), _core_headers_digest(), nanobind.__version__)
    objs = _compile_objects(srcs, flags, key)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    link_key = _digest(*map(str, objs), *map(str, nb_objs), str(fake), str(runtime), *_link_flags(mode), suffix)
    out = _cache_dir(f"pymodule-{mode}-{link_key}") / f"lily_metal_emu{suffix}"
    clang = str(find_clang())
    _atomic_output(out, lambda tmp: _check(
        [clang, "-shared", *map(str, objs), *map(str, nb_objs), "-o", str(tmp), *_link_flags(mode), str(fake),
         str(runtime), f"-Wl,-rpath,{fake.parent}", f"-Wl,-rpath,{runtime.parent}", "-ldl", "-lpthread"],
        "linking lily_metal_emu"))
    return out.parent


def main(argv: Sequence[str] | None = None) -> int:
    """python -m metalsim.host [FILES...]: the L1 check (default: csrc/metal/*.cpp)."""
    files = list(argv if argv is not None else sys.argv[1:]) or [str(p) for p in host_sources()]
    ok, diagnostics = compile_check(files)
    sys.stdout.write(diagnostics)
    print(f"{'ok' if ok else 'FAILED'}: {len(files)} host sources checked")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
