"""SamplingParams: values beyond what the core's int64/uint64/float32 hold are rejected in Python with the
field named; numpy integer and float scalars are accepted and stored as Python numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

import lily


# ---- 4. SamplingParams -----------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(top_k=2**63), dict(top_k=2**80), dict(seed=2**64), dict(seed=-1),
                                dict(temperature=10**400), dict(temperature=1e39), dict(top_k=np.float32(3)),
                                dict(top_k=np.bool_(True)), dict(temperature=np.bool_(True)),
                                dict(temperature=np.complex64(1)), dict(top_p=np.str_("0.5")),
                                dict(seed=np.float64(3.0))])
def test_sampling_params_out_of_range_or_wrong_kind(kw):
    field = next(iter(kw))
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        lily.SamplingParams(**kw)


def test_sampling_params_accept_numpy_scalars():
    sp = lily.SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float64(0.9),
                             min_p=np.float16(0.25), repetition_penalty=np.int32(1), seed=np.uint64(2**64 - 1))
    assert sp.top_k == 5 and type(sp.top_k) is int
    assert sp.seed == 2**64 - 1 and type(sp.seed) is int
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        assert type(getattr(sp, name)) is float, name
    assert sp.temperature == 0.5 and sp.min_p == 0.25
    assert lily.SamplingParams(top_k=2**63 - 1).top_k == 2**63 - 1  # >= vocab keeps every token


def test_sampling_params_large_top_k_reach_the_core():
    e = lily.Engine.from_pretrained()
    s = e.session(max_context=32)
    s.prefill(e.tokenize("def f(x):"))
    toks = list(s.generate(3, lily.SamplingParams(temperature=0.8, top_k=np.int64(2**63 - 1), seed=np.uint64(7)),
                           stop_token_ids=[]))
    assert len(toks) == 3
