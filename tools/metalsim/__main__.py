"""Command line of the Metal emulator.

    python -m metalsim compile --mode typed|asan [-o OUT.so] INPUT.metal   # prints the library's path
    python -m metalsim runtime --mode typed|asan                           # prints libmslsim's path
    python -m metalsim flags --mode typed|asan                             # host compile flags, one line
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from . import build


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m metalsim", description="MSL emulator builds")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile an MSL file into a kernel library")
    c.add_argument("--mode", choices=build.ALL_MODES, default="typed")
    c.add_argument("-o", "--output", help="copy the library here (default: print the cached path)")
    c.add_argument("-I", dest="include", action="append", default=[], help="extra include folder")
    c.add_argument("--name", help="library name (default: the file's stem)")
    c.add_argument("input")
    for name, text in (("runtime", "print the path of libmslsim"), ("flags", "print host compile flags")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--mode", choices=build.ALL_MODES, default="typed")
    args = ap.parse_args(argv)

    if build.find_clang() is None:
        print("metalsim: no clang++ >= 17 found (install clang-19 or set LILY_CLANGXX)", file=sys.stderr)
        return 2
    try:
        if args.cmd == "compile":
            src = Path(args.input)
            if not src.is_file():
                print(f"metalsim: no such file: {src}", file=sys.stderr)
                return 2
            so = build.compile_library(src, args.mode, name=args.name, include_dirs=args.include)
            if args.output:
                out = Path(args.output)
                tmp = out.with_name(out.name + ".tmp")
                shutil.copyfile(so, tmp)
                tmp.replace(out)
                so = out.resolve()
            print(so)
        elif args.cmd == "runtime":
            print(build.runtime_library(args.mode))
        else:
            print(" ".join(build.compile_flags(args.mode)))
    except build.CompileError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
