"""MTP speculative decoding on the CUDA backend (issue 14 items 2 and 3): the MTP block runs through the existing
kernels (no CUDA code of its own), so these compare the GPU against itself (mtp on vs off: greedy token for token,
state after rollback) and against the CPU oracle (the block's KV rows and hidden, to the tolerance of
test_cuda_backend.py). Drafts are injected (Session._core._draft_override, tests only) so that acceptance is full
or partial at known places: a random synthetic head accepts almost nothing."""

from __future__ import annotations

import numpy as np
import pytest

import lily
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

from cuda_util import rel_err, requires_cuda

pytestmark = requires_cuda

PROMPT = [1, 5, 9, 22, 7, 100, 3, 250, 17, 44, 300, 12]


@pytest.fixture(scope="module", params=["mlx", "hf"])
def path(request, tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp(f"mtp_cuda_{request.param}") / "m", TINY_CONFIG,
                                      fmt=request.param, mtp_layers=1, seed=21)


@pytest.fixture(params=[False, True], ids=["verify-prefill", "verify-decode"])
def opts(request):
    """The verify forward through the prefill path or the decode kernels (mtp_verify_decode, the default)."""
    return {"mtp_verify_decode": request.param}


def run(engine, n, *, mtp="off", k=3, drafts=None):
    s = engine.session(max_context=128)
    s.prefill(PROMPT)
    if drafts is not None:
        s._core._draft_override(len(PROMPT), list(drafts))
    return s, list(s.generate(n, lily.SamplingParams(temperature=0), stop_token_ids=[], mtp=mtp, mtp_k=k))


def corrupted(base, every):
    return [(t + 1) % TINY_CONFIG["vocab_size"] if i % every == every - 1 else t for i, t in enumerate(base)]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_mtp_equals_greedy_on_the_gpu(path, k, opts):
    with lily.Engine.from_pretrained(path, backend="cuda", mtp="on", backend_options=opts) as gpu:
        _, base = run(gpu, 24)
        for drafts in (None, base, corrupted(base, 3)):
            s, out = run(gpu, 24, mtp="on", k=k, drafts=drafts)
            assert out == base
        st = s.mtp_stats()
        assert 0 < st["accepted"] < st["drafted"]


def test_state_after_rollback_matches_a_prefilled_session(path, opts):
    """After partial acceptance the GPU session's state is that of a GPU session prefilled with the same tokens
    (to bf16 tensor-core tolerance: prefill chunks and verify forwards have other row counts), and the block's
    KV/hidden agree with the CPU oracle's."""
    with lily.Engine.from_pretrained(path, backend="cuda", mtp="on", backend_options=opts) as gpu, \
            lily.Engine.from_pretrained(path, backend="cpu", mtp="on") as cpu:
        _, base = run(gpu, 20)
        spec, out = run(gpu, 20, mtp="on", k=4, drafts=corrupted(base, 3))
        assert out == base
        ref = gpu.session(max_context=128)
        ref.prefill(PROMPT + base[:-1])
        oracle = cpu.session(max_context=128)
        oracle.prefill(PROMPT + base[:-1])
        x = spec.snapshot()._core.to_arrays()
        for other in (ref, oracle):
            y = other.snapshot()._core.to_arrays()
            assert x.keys() == y.keys()
            assert np.array_equal(x["tokens"], y["tokens"])
            pos = len(x["tokens"])
            last_kv = max(int(n.split(".")[1]) for n in x if n.startswith("kv."))
            for name in x:
                if name in ("tokens", "pending"):
                    continue
                u, v = np.asarray(x[name], np.float32), np.asarray(y[name], np.float32)
                if name == f"kv.{last_kv}":  # the block's row position - 1 waits for the next token
                    hd = TINY_CONFIG["head_dim"]
                    u, v = u.reshape(-1, pos, hd)[:, : pos - 1], v.reshape(-1, pos, hd)[:, : pos - 1]
                assert rel_err(u, v) < 1e-2, name
        cont = list(spec.generate(8, lily.SamplingParams(temperature=0), stop_token_ids=[], mtp="on", mtp_k=2))
        ref.step(base[-1])
        assert cont[:4] == list(ref.generate(8, lily.SamplingParams(temperature=0), stop_token_ids=[], mtp="off"))[:4]


def test_seeded_sampling_follows_the_plain_stream_on_the_gpu(path, opts):
    """Rejected rows' draws are rolled back on the GPU too: with a seed, speculative sampling follows the plain
    sampler's tokens. The verify forward's logits differ from the decode step's by bf16 rounding, which can flip a
    draw that lands near a boundary, so this asks for long common prefixes rather than equality; without the
    rollback the two part at the first rejected draft (the random head's drafts are nearly all rejected)."""
    with lily.Engine.from_pretrained(path, backend="cuda", mtp="on", backend_options=opts) as gpu:
        s = gpu.session(max_context=128)
        s.prefill(PROMPT)
        snap = s.snapshot()
        agree = []
        for seed in range(8):
            sp = lily.SamplingParams(temperature=1.0, top_k=8, seed=seed)
            s.restore(snap)
            plain = list(s.generate(20, sp, stop_token_ids=[], mtp="off"))
            s.restore(snap)
            spec = list(s.generate(20, sp, stop_token_ids=[], mtp="on", mtp_k=3))
            assert s.mtp_stats()["drafted"] > s.mtp_stats()["accepted"]
            agree.append(next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), len(plain)))
        assert np.median(agree) >= 15, agree
