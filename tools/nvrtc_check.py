"""Compile one CUDA kernel family (csrc/cuda/kernels/<family>.cu) with NVRTC, without a GPU.

    python tools/nvrtc_check.py matmul -D GROUP=64 -D BITS=4 --arch 90 [--arch 80] [--ptxas-v]

Every kernels/*.cuh is offered as an include, as the extension does. Prints the compiler's log and exits 1
on an error. NVRTC comes from the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc) or LILY_NVRTC.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "kernels"


def load_nvrtc() -> ctypes.CDLL:
    cands = [os.environ.get("LILY_NVRTC", "")]
    try:
        import nvidia  # the namespace package of NVIDIA's wheels

        for base in nvidia.__path__:
            cands += sorted(glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*")), reverse=True)
    except ImportError:
        pass
    cands += ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    for c in cands:
        if not c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    sys.exit("NVRTC not found: pip install nvidia-cuda-nvrtc (or set LILY_NVRTC)")


def compile_family(family: str, defines: list[str], arch: int, extra: list[str]) -> tuple[bool, str, int]:
    lib = load_nvrtc()
    src = (KERNELS / f"{family}.cu").read_text()
    headers = sorted(KERNELS.glob("*.cuh"))
    hsrc = (ctypes.c_char_p * len(headers))(*[h.read_bytes() for h in headers])
    hname = (ctypes.c_char_p * len(headers))(*[h.name.encode() for h in headers])
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{family}.cu".encode(), len(headers), hsrc, hname)
    assert r == 0, r
    opts = [f"--gpu-architecture=sm_{arch}", "--std=c++17", "-default-device", "--extra-device-vectorization"]
    opts += [f"-D{d}" for d in defines] + extra
    copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    r = lib.nvrtcCompileProgram(prog, len(opts), copts)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    size = ctypes.c_size_t()
    if r == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return r == 0, log.value.decode(errors="replace"), size.value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family")
    ap.add_argument("-D", dest="defines", action="append", default=[])
    ap.add_argument("--arch", type=int, action="append")
    ap.add_argument("--ptxas-v", action="store_true", help="print registers / shared memory / spills")
    a = ap.parse_args()
    ok_all = True
    for arch in a.arch or [90]:
        ok, log, size = compile_family(a.family, a.defines, arch, ["-Xptxas=-v"] if a.ptxas_v else [])
        print(f"sm_{arch}: {'ok' if ok else 'FAILED'} ({size} bytes of cubin)")
        if log.strip():
            print(log)
        ok_all &= ok
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
