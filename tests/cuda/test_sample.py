"""CUDA sample op against the CPU oracle (csrc/cpu/sample.cpp): identical ids and identical sampler state.

Each case runs 50 consecutive draws (12 at vocab 248320, where the CPU's full sorts dominate the time) on
both benches from the same state (seeded mt19937_64 words, a random repetition `seen` mask, random starting
counts), logits fresh per draw with exact ties (copied values, a tied maximum at a higher id) and -inf
entries, and after every draw compares the id, counts, seen, the rng words, the ring and ring_count exactly.
What it protects: the candidate order (logit descending, ties by lower id), the CPU's penalty arithmetic, the
top-k/top-p/min-p cuts and the draw's fixed-point sums, the twister (state regeneration every 312 draws is
crossed: cases share no state, so the test also starts from a state whose index is near 312), and the
bookkeeping.
The ids are equal by construction, not up to rounding: both samplers compute the same float weights (one
explicit exp sequence), sum them as exact fixed-point integers (so the device's descents over the whole
vocabulary, its sorted prefix and the CPU's loops agree whatever the order), and cut min-p on the same
float x = fmaf(work, 1/T, -top) against the same host-computed bound. The cases that reach past the device's
2048 sorted candidates (top_k5000, combined_wide, and at vocab 248320 top_p09, min_p, temperature) test
those descents.
"""

from __future__ import annotations

import numpy as np
import pytest

import lily._core as core

pytestmark = pytest.mark.skipif(
    not core.backends().get("cuda", {}).get("usable", False), reason="CUDA backend not usable (core.backends()['cuda'])"
)

MASK64 = (1 << 64) - 1
RING = 16
DRAWS = 50
DRAWS_BIG = 12  # vocab 248320


def mt_words(seed: int, advance_to: int = 312) -> np.ndarray:
    """runtime/mt19937.h's seed(): 312 64-bit values as (low, high) int32 pairs, then the index."""
    s = [seed & MASK64]
    for i in range(1, 312):
        p = s[-1]
        s.append((6364136223846793005 * (p ^ (p >> 62)) + i) & MASK64)
    w = np.zeros(626, dtype=np.uint32)
    for i, v in enumerate(s):
        w[2 * i], w[2 * i + 1] = v & 0xFFFFFFFF, v >> 32
    w[624] = advance_to  # 312: the first draw regenerates; less: draws straight from the seeded words
    return w.view(np.int32)


def config(vocab: int) -> dict:
    return {
        "hidden": 2048, "layers": 40, "vocab": vocab, "eps": 1e-6, "heads": 16, "kv_heads": 2, "head_dim": 256,
        "rotary_dim": 64, "rope_theta": 1e7, "lin_k_heads": 16, "lin_v_heads": 32, "lin_k_dim": 128,
        "lin_v_dim": 128, "conv_kernel": 4, "experts": 256, "topk": 8, "moe_inter": 512, "shared_inter": 512,
        "full_attention": [i % 4 == 3 for i in range(40)],
    }


def logits_for(rng, vocab: int, scale: float) -> np.ndarray:
    x = (rng.standard_normal(vocab) * scale).astype(np.float32)
    if vocab >= 7:
        k = max(1, vocab // 50)
        src = rng.integers(0, vocab, k)
        dst = rng.integers(0, vocab, k)
        x[dst] = x[src]  # exact ties
        m = int(np.argmax(x))
        x[rng.integers(0, vocab)] = x[m]  # a tied maximum (the lower id must win)
        x[rng.integers(0, vocab, max(1, vocab // 100))] = -np.inf
        if x.max() == -np.inf:
            x[0] = 1.0
    return x.reshape(1, vocab)


CASES = {
    "greedy": dict(temperature=0.0),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
    "temperature": dict(temperature=0.8),
    "top_k1": dict(temperature=1.0, top_k=1),
    "top_k40": dict(temperature=0.7, top_k=40),
    "top_k2000": dict(temperature=1.2, top_k=2000),
    "top_k5000": dict(temperature=1.0, top_k=5000),  # past the device's sorted prefix (2048)
    "top_p09": dict(temperature=1.0, top_p=0.9),
    "top_p05": dict(temperature=0.5, top_p=0.5),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "repetition": dict(temperature=1.0, top_k=50, repetition_penalty=1.5),
    "presence": dict(temperature=1.0, top_p=0.8, presence_penalty=1.0),
    "frequency": dict(temperature=0.9, top_k=100, frequency_penalty=0.7),
    "combined": dict(temperature=0.8, top_k=200, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                     presence_penalty=0.3, frequency_penalty=0.2),
    "combined_wide": dict(temperature=1.5, top_k=100000, top_p=0.95, min_p=0.01),
}


@pytest.fixture(scope="module")
def benches():
    return core.OpBench("cpu"), core.OpBench("cuda")


@pytest.mark.parametrize("vocab", [248320, 1000, 7])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sample_matches_cpu(benches, vocab, case):
    params = CASES[case]
    seed = 1234 + vocab + len(case)
    rng = np.random.default_rng(seed)
    seen = (rng.random((1, vocab)) < 0.05).astype(np.int32)
    counts = (rng.random((1, vocab)) < 0.01).astype(np.int32) * rng.integers(1, 4, (1, vocab)).astype(np.int32)
    # Start draws / 2 numbers before a regeneration on the peaked cases, at a regeneration on the others.
    draws = DRAWS_BIG if vocab > 100000 else DRAWS
    words = mt_words(seed, advance_to=312 - draws // 2 if "top_k" in case else 312).reshape(1, 626)
    # Peaked logits (scale 4) make top-p/min-p nuclei small; flat ones (scale 1) make them huge.
    scale = 1.0 if case in ("top_p09", "temperature", "min_p") else 4.0
    state = []
    for b in benches:
        state.append(dict(
            counts=b.tensor(counts, dtype="i32"), seen=b.tensor(seen, dtype="i32"),
            rng=b.tensor(words, dtype="i32"), ring=b.tensor(np.zeros((RING, 1), np.int32), dtype="i32"),
            ring_count=b.tensor(np.zeros((1, 1), np.int32), dtype="i32"),
            ws=b.workspace(config(vocab), 1, 64),
        ))
    for draw in range(draws):
        x = logits_for(rng, vocab, scale)
        got = []
        for b, st in zip(benches, state):
            nid = b.empty(1, 1, dtype="i32")
            b.run("sample", phase="decode", logits=b.tensor(x), next_id=nid, **st, **params, seed=seed)
            got.append({"id": b.read(nid)} | {k: b.read(st[k]) for k in ("counts", "seen", "rng", "ring", "ring_count")})
        c, g = got
        for k in c:
            np.testing.assert_array_equal(g[k], c[k], err_msg=f"{case} vocab {vocab} draw {draw}: {k}")
        assert 0 <= int(c["id"][0, 0]) < vocab


@pytest.mark.parametrize("vocab", [248320, 1000])
@pytest.mark.parametrize("T", [2, 5, 8])
@pytest.mark.parametrize("case", ["greedy", "greedy_penalties", "temperature"])
def test_sample_rows_match_cpu(benches, vocab, T, case):
    """sample over logits [T, vocab] (an MTP verify's rows): T one-row calls in order on the CPU; on the GPU greedy
    rows without penalties in one pass (prep over (blocks, rows) + one block taking the rows in order), the rest row
    by row. The same ids and sampler state as the CPU's, exactly."""
    params = CASES[case]
    seed = 77 + vocab + T + len(case)
    rng = np.random.default_rng(seed)
    seen = (rng.random((1, vocab)) < 0.05).astype(np.int32)
    counts = (rng.random((1, vocab)) < 0.01).astype(np.int32)
    x = np.concatenate([logits_for(rng, vocab, 4.0) for _ in range(T)])
    x[:, 5] = x.max(axis=1) + 1.0  # one id wins every row: the penalties' rows then differ from each other
    got = []
    for b in benches:
        st = dict(counts=b.tensor(counts, dtype="i32"), seen=b.tensor(seen, dtype="i32"),
                  rng=b.tensor(mt_words(seed).reshape(1, 626), dtype="i32"),
                  ring=b.tensor(np.zeros((RING, 1), np.int32), dtype="i32"),
                  ring_count=b.tensor(np.full((1, 1), 3, np.int32), dtype="i32"), ws=b.workspace(config(vocab), T, 64))
        nid = b.empty(T, 1, dtype="i32")
        b.run("sample", phase="decode", logits=b.tensor(x), next_id=nid, **st, **params, seed=seed)
        got.append({"id": b.read(nid)} | {k: b.read(st[k]) for k in ("counts", "seen", "rng", "ring", "ring_count")})
    c, g = got
    for k in c:
        np.testing.assert_array_equal(g[k], c[k], err_msg=f"{case} vocab {vocab} T {T}: {k}")
    assert int(c["ring_count"][0, 0]) == 3 + T
    if case == "greedy":
        assert "sample.greedy_rows" in str(benches[1].report())
