"""LILY_METALSIM_REQUIRE (set by .ci/run): on a machine where the harness cannot run, its tests fail instead of
skipping, so a CI image that lost clang cannot turn the Metal verification silently off. Shown by running a few
harness tests in a subprocess with the toolchain taken away (LILY_CLANGXX naming a missing compiler), once with the
switch and once without. This file needs no harness itself.

Break tried: conftest's unavailable() skipping whatever the switch says made test_the_switch_fails_what_would_skip
fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# One test of each way a harness test reaches the toolchain: a harness-only file (marked at collection) and the
# host compile check's fixtures.
SELECTED = [str(HERE / "test_harness.py"), str(HERE / "test_host_compile.py") + "::test_metal_bindings_compile_with_werror"]


def run_without_clang(require: bool) -> tuple[int, str]:
    env = dict(os.environ, LILY_CLANGXX=str(HERE / "no-such-clang++"))
    env.pop("LILY_METALSIM_REQUIRE", None)
    if require:
        env["LILY_METALSIM_REQUIRE"] = "1"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs",
                        f"--rootdir={HERE.parents[1]}", *SELECTED], env=env, capture_output=True, text=True,
                       timeout=600, cwd=HERE.parents[1])
    return r.returncode, r.stdout + r.stderr


def counts(out: str) -> dict[str, int]:
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}


@pytest.fixture(scope="module")
def unrequired():
    return run_without_clang(False)


def test_without_the_switch_the_harness_tests_skip(unrequired):
    rc, out = unrequired
    c = counts(out)
    assert rc == 0, out
    assert c.get("skipped", 0) >= 2 and not c.get("failed") and not c.get("passed"), out
    assert "clang++ >= 17" in out


def test_the_switch_fails_what_would_skip(unrequired):
    rc, out = run_without_clang(True)
    c = counts(out)
    assert rc == 1, out
    assert c.get("failed", 0) + c.get("error", 0) == counts(unrequired[1])["skipped"] and not c.get("skipped"), out
    assert "LILY_METALSIM_REQUIRE=1 but" in out
