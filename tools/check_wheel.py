"""Build the wheel (python -m build --wheel, in a temp dir) and check what a release would ship.

The wheel must hold the compiled extension (lily/_core*.so), the typing marker (lily/py.typed), the
packaged model (lily/models/lily-tiny/: config, weights, tokenizer) and the distribution name
lily-inference. Run by .ci/run after the tests; exits 1 naming what is missing.
"""

from __future__ import annotations

import fnmatch
import pathlib
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
REQUIRED = ["lily/_core*.so", "lily/py.typed", "lily/models/lily-tiny/config.json",
            "lily/models/lily-tiny/*.safetensors", "lily/models/lily-tiny/tokenizer.json"]


def check(wheel: pathlib.Path) -> list[str]:
    """What is wrong with ``wheel`` (empty when nothing is)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        problems = [f"no file matching {pat}" for pat in REQUIRED if not fnmatch.filter(names, pat)]
        meta = [n for n in names if n.endswith(".dist-info/METADATA")]
        if len(meta) != 1:
            return problems + [f"expected one METADATA file, found {meta}"]
        headers = z.read(meta[0]).decode().split("\n\n", 1)[0].splitlines()
    if "Name: lily-inference" not in headers:
        problems.append(f"METADATA has {[h for h in headers if h.startswith('Name:')]}, not Name: lily-inference")
    return problems


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="lily-wheel-") as out:
        build = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", out, str(ROOT)],
                               capture_output=True, text=True)
        if build.returncode != 0:
            print(build.stdout[-4000:], build.stderr[-4000:], sep="\n", file=sys.stderr)
            print("wheel check: python -m build --wheel failed", file=sys.stderr)
            return 1
        wheels = list(pathlib.Path(out).glob("*.whl"))
        if len(wheels) != 1:
            print(f"wheel check: expected one wheel, got {wheels}", file=sys.stderr)
            return 1
        problems = check(wheels[0])
        for p in problems:
            print(f"wheel check: {wheels[0].name}: {p}", file=sys.stderr)
        if not problems:
            print(f"wheel check ok: {wheels[0].name} ships _core, py.typed and lily-tiny as lily-inference")
        return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
