"""CUDA RMSNorm family against the CPU oracle (csrc/cpu/norm.cpp).

Tolerance: both sides accumulate the sum of squares in fp32, in different orders (the CPU's 16-lane tree,
the GPU's per-thread then warp/block tree), then apply the same formula; the relative difference of the
outputs is a few fp32 ulps (~1e-7 per element, ~3e-7 in the norm). 2e-6 catches any real mistake: a wrong
segment length changes the scale by O(1), a missing eps by ~1e-3 at these magnitudes, a dropped
__syncthreads or lane by O(1). silu (gated) adds expf's 1-2 ulp difference on each side.
"""

from __future__ import annotations

import numpy as np
import pytest

import lily._core as core

from cuda_util import affine_table

pytestmark = pytest.mark.skipif(
    not core.backends().get("cuda", {}).get("usable", False), reason="CUDA backend not usable (core.backends()['cuda'])"
)
TOL = 2e-6


@pytest.fixture(scope="module")
def benches():
    return core.OpBench("cpu"), core.OpBench("cuda")


def signed(rng, rows, cols, scale=1.0):
    """Random values of both signs bounded away from zero (zeros hide lane mistakes)."""
    mag = rng.uniform(0.25, 1.0, (rows, cols)) * scale
    return (mag * rng.choice([-1.0, 1.0], (rows, cols))).astype(np.float32)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_both(benches, op, inputs, outputs, **scalars):
    """inputs: name -> array; outputs: name -> shape (poisoned on both benches). Returns (cpu, gpu) dicts."""
    res = []
    for b in benches:
        hs = {k: b.tensor(v) for k, v in inputs.items()}
        outs = {k: b.empty(*s) for k, s in outputs.items()}
        b.run(op, phase="prefill", **hs, **outs, **scalars)
        res.append({k: b.read(h) for k, h in {**outs, **hs}.items()})
    return res


@pytest.mark.parametrize("T", [1, 7, 130])
@pytest.mark.parametrize("seg,n", [(2048, 1), (256, 16), (128, 32), (100, 3), (33, 5), (1, 7)])
def test_rms_norm(benches, T, seg, n):
    rng = np.random.default_rng(T * 1000 + seg)
    x = signed(rng, T, seg * n, 3.0)
    w = signed(rng, 1, seg)
    c, g = run_both(benches, "rms_norm", {"x": x, "w": w}, {"out": (T, seg * n)}, eps=1e-6)
    assert np.isfinite(g["out"]).all(), "unwritten (poisoned) outputs"
    assert rel(g["out"], c["out"]) < TOL


@pytest.mark.parametrize("T", [1, 7, 130])
@pytest.mark.parametrize("seg,n", [(2048, 1), (256, 2), (100, 2), (33, 3)])
@pytest.mark.parametrize("alias", [False, True])
def test_add_rms_norm(benches, T, seg, n, alias):
    rng = np.random.default_rng(T * 7 + seg + alias)
    a = signed(rng, T, seg * n, 2.0)
    bb = signed(rng, T, seg * n, 2.0)
    w = signed(rng, 1, seg)
    res = []
    for b in benches:
        ha, hb, hw = b.tensor(a), b.tensor(bb), b.tensor(w)
        hs = ha if alias else b.empty(T, seg * n)
        hn = b.empty(T, seg * n)
        b.run("add_rms_norm", phase="prefill", a=ha, b=hb, w=hw, eps=1e-6, sum=hs, normed=hn)
        res.append((b.read(hs), b.read(hn)))
    (cs, cn), (gs, gn) = res
    np.testing.assert_array_equal(gs, cs)  # one fp32 add: bit-identical
    np.testing.assert_array_equal(gs, a + bb)
    assert rel(gn, cn) < TOL


def test_rms_norm_row_views(benches):
    """A rows_view (nonzero offset) in the decode phase, per-head segments of 256."""
    rng = np.random.default_rng(5)
    big = signed(rng, 9, 2048 * 2)
    w = signed(rng, 1, 256)
    res = []
    for b in benches:
        hx = b.view(b.tensor(big), 1, 7)
        ho = b.empty(7, 2048 * 2)
        b.run("rms_norm", phase="decode", x=hx, w=b.tensor(w), out=ho, eps=1e-5)
        res.append(b.read(ho))
    assert rel(res[1], res[0]) < TOL


@pytest.mark.parametrize("T", [1, 7, 130])
@pytest.mark.parametrize("heads,dv", [(32, 128), (3, 100), (5, 33)])
def test_gated_rms_norm(benches, T, heads, dv):
    rng = np.random.default_rng(T + heads + dv)
    o = signed(rng, T, heads * dv, 0.5)
    z = signed(rng, T, heads * dv, 4.0)
    w = signed(rng, 1, dv)
    c, g = run_both(benches, "gated_rms_norm", {"o": o, "z": z, "w": w}, {"out": (T, heads * dv)}, eps=1e-6)
    assert np.isfinite(g["out"]).all()
    assert rel(g["out"], c["out"]) < 4e-6


def _table(rng, fmt, rows, cols):
    if fmt == "f32":
        return {"kind": "dense", "dtype": "f32", "shape": [rows, cols],
                "data": rng.normal(size=(rows, cols)).astype(np.float32)}
    if fmt == "bf16":
        return {"kind": "dense", "dtype": "bf16", "shape": [rows, cols],
                "data": (rng.normal(size=(rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)}
    return affine_table(rng, rows, cols, *((4, 64) if fmt == "q4" else (8, 32)))


@pytest.mark.parametrize("T,phase", [(1, "decode"), (5, "decode"), (33, "prefill")])
@pytest.mark.parametrize("fmt,H", [("q4", 2048), ("q8", 256), ("bf16", 192), ("f32", 100)])
def test_mtp_input(benches, T, phase, fmt, H):
    """The MTP block's input row in one launch: within TOL of the CPU's composed form (embed, then the two norms),
    and the same bits as the GPU's own composed form (embed_rows + two rms_norm, the norm's geometry for H: one
    block per row from 513 columns, else one warp; 16-byte loads unless H % 4 != 0). An id outside the table
    gives NaN in its half only, as embed_rows does."""
    rng = np.random.default_rng(T * 100 + H)
    desc = _table(rng, fmt, 300, H)
    ids = rng.integers(0, 300, size=(T, 1)).astype(np.int32)
    h = signed(rng, T, H, 2.0)
    w_e, w_h = signed(rng, 1, H), signed(rng, 1, H)
    got = []
    for b in benches:
        table = b.weight(desc)
        out = b.empty(T, 2 * H)
        b.run("mtp_input", phase=phase, ids=b.tensor(ids, "i32"), table=table, h=b.tensor(h), w_e=b.tensor(w_e),
              w_h=b.tensor(w_h), eps=1e-6, e=b.empty(T, H), normed=b.empty(T, H), out=out)
        got.append(b.read(out))
    cpu, gpu = got
    assert np.isfinite(gpu).all(), "unwritten (poisoned) outputs"
    assert rel(gpu, cpu) < TOL, rel(gpu, cpu)
    assert "mtp_input" in str(benches[1].report())
    g = benches[1]  # the GPU's composed form
    e, left, right = g.empty(T, H), g.empty(T, H), g.empty(T, H)
    g.run("embed", phase=phase, ids=g.tensor(ids, "i32"), table=g.weight(desc), out=e)
    g.run("rms_norm", phase=phase, x=e, w=g.tensor(w_e), out=left, eps=1e-6)
    g.run("rms_norm", phase=phase, x=g.tensor(h), w=g.tensor(w_h), out=right, eps=1e-6)
    np.testing.assert_array_equal(gpu, np.concatenate([g.read(left), g.read(right)], axis=1))
    bad = ids.copy()
    bad[0, 0] = 300
    b = benches[1]
    out = b.empty(T, 2 * H)
    b.run("mtp_input", phase=phase, ids=b.tensor(bad, "i32"), table=b.weight(desc), h=b.tensor(h), w_e=b.tensor(w_e),
          w_h=b.tensor(w_h), eps=1e-6, e=b.empty(T, H), normed=b.empty(T, H), out=out)
    o = b.read(out)
    assert np.isnan(o[0, :H]).all() and np.isfinite(o[0, H:]).all() and np.isfinite(o[1:]).all()
