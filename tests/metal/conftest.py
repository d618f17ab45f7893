"""Fixtures for the Metal emulator tests: <repo>/tools on sys.path, one persistent Emulator per build mode
for the whole session, and a skip (with the reason) of the harness tests where the harness cannot run (not Linux x86-64, or no clang++ >= 17)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

from metalsim import build  # noqa: E402
from metalsim import emulator as emulator_module  # noqa: E402

SKIP_REASON = build.unavailable_reason() or ""
REQUIRE = build.required()  # LILY_METALSIM_REQUIRE=1: a harness skip is a failure (tests/metal/test_require_switch.py)
# Test files that need the harness's toolchain; the lint and the real-GPU tests do not.
NEEDS_HARNESS = {"test_emulator.py", "test_kernels.py", "test_host_compile.py", "test_fake_runtime.py",
                 "test_harness.py", "test_fake_async.py", "test_backend.py", "test_traffic.py"}


def unavailable(reason: str):
    """Skips the running test because the harness cannot run here, or fails it under LILY_METALSIM_REQUIRE=1."""
    if REQUIRE:
        pytest.fail(f"LILY_METALSIM_REQUIRE=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    if not SKIP_REASON:
        return
    mark = (pytest.mark.usefixtures("_harness_required") if REQUIRE else pytest.mark.skip(reason=SKIP_REASON))
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.parent == HERE and path.name in NEEDS_HARNESS:
            item.add_marker(mark)


@pytest.fixture
def _harness_required():
    unavailable(SKIP_REASON)


@pytest.fixture(scope="session")
def harness_unavailable():
    """unavailable() for the test modules' own checks (a missing tool or package found inside a test or fixture)."""
    return unavailable


def _emulator(mode: str):
    if SKIP_REASON:
        unavailable(SKIP_REASON)
    emu = emulator_module.Emulator(mode=mode, workers=2)
    yield emu
    emu.close()


@pytest.fixture(scope="session")
def emulator_typed():
    yield from _emulator("typed")


@pytest.fixture(scope="session")
def emulator_asan():
    yield from _emulator("asan")


@pytest.fixture(scope="session", params=build.MODES)
def emulator(request):
    """Each test using it runs once per build mode."""
    return request.getfixturevalue(f"emulator_{request.param}")
