"""The CPU oracle's attention in row tiles (csrc/cpu/attention.cpp): the query rows of a tile (up to 16, fewer where
their scores would pass 2 MiB per thread) share each cached K and V row's load. Each row's arithmetic is the one a
row alone would do, so a call of T rows gives, bit for bit, what T one-row calls give (the property chunked prefill
and the GPU tests lean on), whatever the tile holds: full tiles, a partial last tile, tiles cut short by a long
max_ctx or by the thread count (tiles x kv heads cover the threads). And it is attention: within fp32 rounding of a float64 reference. Cache rows past the live positions are
NaN, so a tile that reads past its causal limit fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import lily._core as core

SHAPES = {
    "4x2x32": dict(heads=4, kv_heads=2, head_dim=32, rotary_dim=8, rope_theta=1e7, eps=1e-6),
    "6x3x64": dict(heads=6, kv_heads=3, head_dim=64, rotary_dim=16, rope_theta=1e4, eps=1e-6),
    "4x1x40": dict(heads=4, kv_heads=1, head_dim=40, rotary_dim=8, rope_theta=1e6, eps=1e-5),
}


def _config(s: dict) -> dict:
    return {"hidden": 64, "layers": 4, "vocab": 512, "eps": s["eps"], "heads": s["heads"], "kv_heads": s["kv_heads"],
            "head_dim": s["head_dim"], "rotary_dim": s["rotary_dim"], "rope_theta": s["rope_theta"],
            "lin_k_heads": 2, "lin_v_heads": 4, "lin_k_dim": 16, "lin_v_dim": 16, "conv_kernel": 4,
            "experts": 8, "topk": 2, "moe_inter": 32, "shared_inter": 32,
            "full_attention": [i % 4 == 3 for i in range(4)]}


def _attention(b, s, q, gate, kc, vc, pos0, max_ctx, cache_dtype, ws_rows):
    T = q.shape[0]
    out = b.empty(T, s["heads"] * s["head_dim"], dtype="f32")
    b.run("attention", phase="prefill" if T > 1 else "decode", q=b.tensor(q), gate=b.tensor(gate),
          k_cache=kc, v_cache=vc, pos=b.tensor(np.array([[pos0]], dtype=np.int32), dtype="i32"), max_ctx=max_ctx,
          ws=b.workspace(_config(s), ws_rows, max_ctx), out=out, **s)
    return b.read(out)


def _reference(s, q, gate, kc, vc, pos0, max_ctx):
    """Causal attention in float64 over the caches' values as the bench holds them."""
    H, kv, D = s["heads"], s["kv_heads"], s["head_dim"]
    G = H // kv
    scale = np.float64(np.float32(1.0) / np.sqrt(np.float32(D)))
    out = np.empty((q.shape[0], H, D))
    for t in range(q.shape[0]):
        n = pos0 + t + 1
        qh = q[t].reshape(H, D).astype(np.float64)
        for kvh in range(kv):
            K = kc[kvh * max_ctx:kvh * max_ctx + n].astype(np.float64)
            V = vc[kvh * max_ctx:kvh * max_ctx + n].astype(np.float64)
            sc = K @ qh[kvh * G:(kvh + 1) * G].T * scale
            p = np.exp(sc - sc.max(axis=0))
            out[t, kvh * G:(kvh + 1) * G] = (p.T @ V) / p.sum(axis=0)[:, None]
    g = gate.reshape(-1, H, D).astype(np.float64)
    return (out / (1.0 + np.exp(-g))).reshape(q.shape[0], H * D)


@pytest.mark.parametrize("threads", [0, 7], ids=["default-threads", "7-threads"])  # 7: smaller tiles, more items
@pytest.mark.parametrize("cache_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("T, pos0, max_ctx", [
    (5, 0, 64),          # one partial tile from position 0
    (16, 300, 400),      # one full tile
    (40, 37, 100),       # tiles of 16, 16, 8
    (33, 3000, 20000),   # tiles cut by the 2 MiB score budget: 13 rows at G 2, 6 at G 4
])
def test_rows_in_tiles_equal_rows_alone(shape, cache_dtype, T, pos0, max_ctx, threads):
    s = SHAPES[shape]
    rng = np.random.default_rng(T * 1000 + pos0)
    H, kv, D = s["heads"], s["kv_heads"], s["head_dim"]
    live = pos0 + T
    q = (rng.standard_normal((T, H * D)) * 1.5).astype(np.float32)
    gate = rng.standard_normal((T, H * D)).astype(np.float32)
    caches = []
    for _ in range(2):
        c = rng.standard_normal((kv * max_ctx, D)).astype(np.float32)
        for h in range(kv):
            c[h * max_ctx + live:(h + 1) * max_ctx] = np.nan  # never to be read
        caches.append(c)
    b = core.OpBench("cpu", {"threads": threads} if threads else {})
    kc, vc = (b.tensor(c, dtype=cache_dtype) for c in caches)
    whole = _attention(b, s, q, gate, kc, vc, pos0, max_ctx, cache_dtype, T)
    assert np.all(np.isfinite(whole))
    alone = np.concatenate([_attention(b, s, q[t:t + 1], gate[t:t + 1], kc, vc, pos0 + t, max_ctx, cache_dtype, 1)
                            for t in range(T)])
    assert np.array_equal(whole, alone)
    held = [b.read(kc), b.read(vc)]  # the caches' values as the bench holds them (bf16 rounded once)
    ref = _reference(s, q, gate, held[0], held[1], pos0, max_ctx)
    err = np.linalg.norm(whole - ref) / np.linalg.norm(ref)
    assert err < 2e-6, err
