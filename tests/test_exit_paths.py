"""Interpreter exit with a generation still alive never takes the process down.

Each case runs in a fresh interpreter: a generator left suspended in a global, one returned from a
function and dropped, ``sys.exit()`` inside ``for tok in s.generate()``, and a daemon thread still
generating. Before the fix each aborted with "Fatal Python error: PyGILState_Release" (exit code 134):
the C++ loop called back into Python while the interpreter was finalizing.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SETUP = """
import sys, threading, time
import lily
e = lily.Engine.from_pretrained()
s = e.session(max_context=4096)
s.prefill(e.tokenize("def f(x):"))
"""

CASES = {
    "global": "g = s.generate(2000, stop_token_ids=[])\nnext(g)\nnext(g)\n",
    "returned": textwrap.dedent("""
        def start():
            g = s.generate(2000, stop_token_ids=[])
            next(g)
            return g
        keep = start()
    """),
    "sys_exit": textwrap.dedent("""
        for i, tok in enumerate(s.generate(2000, stop_token_ids=[])):
            if i == 3:
                sys.exit(0)
    """),
    "daemon_thread": textwrap.dedent("""
        def consume():
            for _ in s.generate(4000, stop_token_ids=[]):
                pass
        threading.Thread(target=consume, daemon=True).start()
        time.sleep(0.3)
    """),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exit_with_a_live_generation_is_clean(case):
    r = subprocess.run([sys.executable, "-c", SETUP + CASES[case] + "\nprint('reached the end')\n"],
                       capture_output=True, text=True, timeout=300)
    assert "Fatal Python error" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    if case != "sys_exit":
        assert "reached the end" in r.stdout
