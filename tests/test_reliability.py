"""Inputs that used to crash the process or give wrong results: each now gives a clear error or the right
answer, and leaves the engine and session usable."""

from __future__ import annotations

import numpy as np
import pytest

import lily

NO_STOP: list[int] = []


@pytest.fixture(scope="module")
def eng():
    return lily.Engine.from_pretrained()


@pytest.mark.parametrize("max_context", [2**53, 2**46, 2**62])
def test_huge_max_context_is_refused_before_any_allocation(eng, max_context):
    # Used to be accepted: the KV byte count overflowed to 0 and the next prefill wrote out of bounds.
    with pytest.raises(ValueError, match="max_context"):
        eng.session(max_context=max_context)
    s = eng.session(max_context=32)  # the engine is still usable
    s.prefill(eng.tokenize("def f(x):"))
    assert s.position > 0


@pytest.mark.parametrize("temperature", [1e-9, 1e-30, 1e-45])
def test_tiny_temperature_behaves_like_greedy(eng, temperature):
    # Used to sample the least likely token: the scaled logits left float range.
    s = eng.session(max_context=64)
    s.prefill(eng.tokenize("def read_lines(path):"))
    snap = s.snapshot()
    greedy = list(s.generate(10, stop_token_ids=NO_STOP))
    s.restore(snap)
    got = list(s.generate(10, lily.SamplingParams(temperature=temperature, seed=3), stop_token_ids=NO_STOP))
    assert got == greedy
