"""Fetches Apple's metal-cpp headers for Linux builds, never vendored into the repository.

On Linux the only reachable copy is inside the macOS wheel of ``mlx-metal`` on PyPI (Apache-2.0, the same
headers as Apple's metal-cpp_26 zip). The wheel is pinned by version and sha256; only
``mlx/include/metal_cpp/**`` is extracted into the metalsim cache, and the wheel itself is deleted afterwards.

    python -m metalsim.metal_cpp          # prints the folder to pass as -I (fetches on first use)

Environment:
    LILY_METAL_CPP_DIR     use this metal-cpp folder as is (e.g. Apple's zip unpacked on a Mac)
    LILY_METAL_CPP_WHEEL   use this already downloaded wheel instead of calling pip (still hash-checked)
    LILY_METALSIM_CACHE    cache root (default ~/.cache/lily/metalsim, or metalsim.build.cache_root())
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["VERSION", "SHA256", "WHEEL_NAME", "MetalCppError", "metal_cpp_dir", "verify_sha256", "extract"]

VERSION = "0.32.4"
WHEEL_NAME = f"mlx_metal-{VERSION}-py3-none-macosx_14_0_arm64.whl"
SHA256 = "8019b2db622599267d66cc168b2f0dbf5af929790a6c3b3913e00eabc42a7947"
PREFIX = "mlx/include/metal_cpp/"
# What a complete extraction contains (checked before reusing a cached copy).
TOP_LEVEL = ("Foundation", "Metal", "MetalFX", "QuartzCore", "SingleHeader", "LICENSE.txt", "README.md")
_MARKER = ".lily-metal-cpp"


class MetalCppError(RuntimeError):
    """metal-cpp could not be obtained or failed verification."""


def _cache_root() -> Path:
    try:  # the emulator's build module owns the cache layout when present
        from metalsim import build

        return Path(build.cache_root())
    except (ImportError, AttributeError):
        env = os.environ.get("LILY_METALSIM_CACHE")
        return Path(env) if env else Path.home() / ".cache" / "lily" / "metalsim"


def verify_sha256(path: Path, expected: str = SHA256) -> None:
    """Raises MetalCppError unless the file's sha256 is ``expected`` (a truncated or tampered wheel)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    got = h.hexdigest()
    if got != expected:
        raise MetalCppError(f"{path}: sha256 {got} does not match the pinned {expected} (mlx-metal {VERSION})")


def extract(wheel: Path, dest: Path) -> None:
    """Extracts only mlx/include/metal_cpp/** of the wheel into dest (dest/Foundation, dest/Metal, ...)."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if not info.filename.startswith(PREFIX) or info.is_dir():
                continue
            rel = Path(info.filename[len(PREFIX):])
            if rel.is_absolute() or ".." in rel.parts:  # never write outside dest
                raise MetalCppError(f"{wheel}: unsafe member {info.filename}")
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
    missing = [t for t in TOP_LEVEL if not (dest / t).exists()]
    if missing:
        raise MetalCppError(f"{wheel}: metal_cpp folder lacks {', '.join(missing)}")


def _download(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"mlx-metal=={VERSION}", "--no-deps", "--only-binary=:all:",
           "--platform", "macosx_14_0_arm64", "--python-version", "3.11", "--disable-pip-version-check",
           "-q", "-d", str(into)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheel = into / WHEEL_NAME
    if r.returncode != 0 or not wheel.exists():
        raise MetalCppError(f"pip download of mlx-metal {VERSION} failed:\n{r.stdout}{r.stderr}")
    return wheel


def _complete(d: Path) -> bool:
    return (d / _MARKER).is_file() and (d / _MARKER).read_text().strip() == SHA256 and all(
        (d / t).exists() for t in TOP_LEVEL)


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # concurrent test processes fetch once
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def metal_cpp_dir() -> Path:
    """The metal-cpp include folder (contains Foundation/, Metal/); fetched and verified on first use."""
    override = os.environ.get("LILY_METAL_CPP_DIR")
    if override:
        d = Path(override)
        if not (d / "Metal" / "Metal.hpp").is_file():
            raise MetalCppError(f"LILY_METAL_CPP_DIR={override} has no Metal/Metal.hpp")
        return d
    root = _cache_root() / "metal-cpp"
    dest = root / f"mlx-metal-{VERSION}"
    if _complete(dest):
        return dest
    with _lock(root / ".lock"):
        if _complete(dest):
            return dest
        with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
            tmp = Path(tmp)
            given = os.environ.get("LILY_METAL_CPP_WHEEL")
            wheel = Path(given) if given else _download(tmp)
            verify_sha256(wheel)
            staging = tmp / "metal_cpp"
            extract(wheel, staging)
            (staging / _MARKER).write_text(SHA256 + "\n")
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)  # atomic: a reader sees a complete folder or none
    return dest


def main() -> int:
    try:
        print(metal_cpp_dir())
    except MetalCppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
