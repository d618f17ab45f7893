"""Lily (CPU backend, fp32 weights) against transformers 5.24's Qwen3_5MoeForCausalLM.

Tolerance: for every position, ``max|lily - ref| <= 1e-4 * max|ref|`` against transformers (fp32,
eager) and against a float64 numpy oracle of the same weights (tiny.numpy_reference_logits), which
separates Lily's error from transformers' own fp32 noise. Every comparison first checks that it is
well posed for its exact token sequence (tiny.Reference.check): transformers agrees with the oracle
to half the tolerance, and the routing margin (gap between the k-th and (k+1)-th router logit) is far
above fp32 noise, so a failure is a real divergence, not an expert-choice tie.

The tiny models are randomised so that common mistakes show up far above the tolerance (measured
with transformers patched to make each mistake: GQA/DeltaNet head mapping by modulo 0.4-1.8, RoPE
theta 1e4 0.2-0.7, attention scale 0.3-1.4, no top-k renormalisation 0.5, RMSNorm eps 1e-5 instead
of 1e-6 0.1-0.2, L2-norm eps on the mean instead of the sum 0.3-0.5, L2-norm without eps 0.2-0.3).
"""

from __future__ import annotations

import numpy as np
import pytest

import tiny

lily = pytest.importorskip("lily")

REL_TOL = 1e-4
PREFILL = 40
DECODE = 32

CASES = [
    ("single_fa", "per_expert"),
    ("single_fa", "fused_mm"),
    ("multi_fa", "per_expert"),
    ("multi_fa", "fused_mm"),
    ("single_fa", "fused_text"),
    ("multi_fa", "per_expert_mm"),
]


@pytest.fixture(scope="module")
def engines():
    cache = {}

    def get(ck, **kw):
        key = (str(ck.path), tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = lily.Engine.from_pretrained(str(ck.path), backend="cpu", **kw)
        return cache[key]

    return get


@pytest.fixture(scope="module", params=CASES, ids=["/".join(c) for c in CASES])
def case(request, tiny_factory, engines):
    ck = tiny_factory(*request.param)
    return ck, engines(ck)


def test_config(case):
    ck, eng = case
    cfg = eng.config
    s = ck.spec
    assert cfg.vocab_size == s.vocab
    assert cfg.hidden_size == s.hidden
    # Field names beyond vocab_size / hidden_size follow the HF config where the engine exposes them.
    for field, want in (
        ("num_hidden_layers", s.layers),
        ("num_experts", s.experts),
        ("num_experts_per_tok", s.topk),
        ("num_attention_heads", s.heads),
        ("num_key_value_heads", s.kv_heads),
        ("linear_num_value_heads", s.lin_v_heads),
    ):
        if hasattr(cfg, field):
            assert getattr(cfg, field) == want, field
    if hasattr(cfg, "layer_types"):
        assert list(cfg.layer_types) == s.layer_types


def test_prefill_all_logits(case):
    ck, eng = case
    ids = tiny.random_tokens(ck.vocab, PREFILL, seed=11)
    s = eng.session(max_context=256)
    out = s.prefill(ids, all_logits=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert out.shape == (PREFILL, ck.vocab)
    print(f"{ck.name}: prefill {ck.check(out, ids, 'prefill')}")
    assert s.position == PREFILL
    assert list(s.tokens) == ids
    assert np.array_equal(s.logits, out[-1])

    # Last-position only (the default) and numpy input of another int dtype.
    s2 = eng.session(max_context=256)
    last = s2.prefill(np.asarray(ids, dtype=np.int32))
    assert last.shape == (ck.vocab,) and last.dtype == np.float32
    ck.check(last, ids, "prefill last", rows=slice(-1, None))


def test_decode_steps(case):
    """Prefill, then 32 greedy decode steps; step i is compared with the full-sequence reference."""
    ck, eng = case
    ids = tiny.random_tokens(ck.vocab, PREFILL, seed=12)
    s = eng.session(max_context=256)
    logits = [s.prefill(ids)]
    fed = []
    for _ in range(DECODE):
        tok = int(np.argmax(logits[-1]))
        fed.append(tok)
        out = s.step(tok)
        assert out.shape == (ck.vocab,) and out.dtype == np.float32
        assert np.array_equal(out, s.logits)
        logits.append(out)
    assert s.position == PREFILL + DECODE
    assert list(s.tokens) == ids + fed
    rep = ck.check(np.stack(logits), ids + fed, "decode", rows=slice(PREFILL - 1, None))
    print(f"{ck.name}: decode {rep}")


def test_decode_fixed_tokens_after_short_prefill(case):
    """Mostly decode (1-token prefill then 40 steps of a fixed random sequence): the recurrent path from
    a near-empty state, attention over a growing cache."""
    ck, eng = case
    ids = tiny.random_tokens(ck.vocab, 41, seed=13)
    s = eng.session(max_context=64)
    rows = [s.prefill(ids[:1])]
    for t in ids[1:]:
        rows.append(s.step(t))
    ck.check(np.stack(rows), ids, "step-only")


def test_chunked_prefill_is_bitwise_invariant(tiny_factory, engines):
    for name in ("single_fa", "multi_fa"):
        ck = tiny_factory(name, "fused_mm")
        ids = tiny.random_tokens(ck.vocab, 50, seed=14)
        small = engines(ck, prefill_chunk=16)
        big = engines(ck, prefill_chunk=512)
        calls = []
        s1 = small.session(max_context=128)
        a = s1.prefill(ids, all_logits=True, progress=lambda done, total: calls.append((done, total)))
        b = big.session(max_context=128).prefill(ids, all_logits=True)
        assert a.shape == b.shape == (50, ck.vocab)
        diff = np.abs(a.astype(np.float64) - b).max()
        assert np.array_equal(a, b), f"{name}: chunk 16 vs 512 differ by up to {diff:.3e}"
        ck.check(a, ids, "chunked prefill")
        # progress(done, total) once per chunk, monotonically, ending at (50, 50)
        assert len(calls) == 4, calls
        assert calls[-1] == (50, 50), calls
        assert all(t == 50 for _, t in calls)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
        # Decode continues identically from both.
        tok = int(np.argmax(a[-1]))
        s2 = big.session(max_context=128)
        s2.prefill(ids)
        assert np.array_equal(s1.step(tok), s2.step(tok))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint(tiny_factory, engines, dtype):
    """A bf16 (released layout) or fp16 checkpoint against transformers in fp32 on the rounded weights."""
    ck = tiny_factory("single_fa", "fused_mm", dtype)
    eng = engines(ck)
    ids = tiny.random_tokens(ck.vocab, PREFILL, seed=15)
    s = eng.session(max_context=128)
    rows = list(s.prefill(ids, all_logits=True))
    fed = []
    for _ in range(8):
        tok = int(np.argmax(rows[-1]))
        fed.append(tok)
        rows.append(s.step(tok))
    print(f"{ck.name}: {dtype} checkpoint {ck.check(np.stack(rows), ids + fed, dtype)}")
    # The rounded weights really differ from the fp32 ones (otherwise this test proves nothing).
    f32 = tiny_factory("single_fa", "fused_mm")
    assert tiny.rel_err(f32.ref(ids), ck.ref(ids)).max() > 10 * REL_TOL


@pytest.mark.parametrize("name", ["single_fa", "multi_fa"])
def test_long_prefill_chunk_and_thread_invariance(tiny_factory, engines, name):
    """150 tokens (several 64-token DeltaNet blocks): any prefill chunk size and any thread count give
    the same bits (the CPU backend is the oracle for the GPU backends, so it must be deterministic),
    and they match transformers."""
    ck = tiny_factory(name, "per_expert")
    ids = tiny.random_tokens(ck.vocab, 150, seed=16)
    base = engines(ck).session(max_context=160).prefill(ids, all_logits=True)
    ck.check(base, ids, "150-token prefill")
    for kw in ({"prefill_chunk": 37}, {"prefill_chunk": 1}, {"prefill_chunk": 64, "threads": 1}):
        got = engines(ck, **kw).session(max_context=160).prefill(ids, all_logits=True)
        diff = np.abs(got.astype(np.float64) - base).max()
        assert np.array_equal(got, base), f"{ck.name} {kw}: differs from the default engine by up to {diff:.3e}"
