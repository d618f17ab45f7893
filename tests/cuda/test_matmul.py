"""CUDA matmul (csrc/cuda/matmul.cpp, kernels/matmul.cu) against the CPU oracle (csrc/cpu/matmul.cpp).

Both benches get the same weight descriptor (tests/test_cpu_matmul.py's builders: MLX affine codes with
scales of both signs, or dense rows) and the same inputs (bounded away from zero, both signs); outputs
come from `empty` (poisoned), so an unwritten element fails the comparison.

Tolerances (relative error ‖gpu − cpu‖ / ‖cpu‖):
  * decode (GEMV): fp32 FMAs on the CUDA cores, another summation order than the CPU: 1e-5 (a host
    emulation of the kernel measured 0.5-2e-7 against a float64 reference). Weights of 32 MiB and more
    (the lm_head) take the tensor-core GEMV, x as bf16 hi + lo: emulated 1.3-4e-6, also under 1e-5.
  * prefill (GEMM): tensor cores with x as two bf16 terms (hi + lo: x to ~16 bits) and W exact (codes, or
    bf16 as stored) or as hi + lo: 5e-5 (the emulation measured 1-7e-6; plain bf16 x would give ~1.5e-3,
    so a lost lo term fails this bound).
Bitwise: prefill rows do not depend on T (chunks of 7 vs one batch of 130), decode rows do not depend on T.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import lily._core as core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_cpu_matmul import _bf16_bits, make_weight, make_x  # noqa: E402


def _cuda_usable() -> tuple[bool, str]:
    try:
        st = core.backends()["cuda"]
    except Exception as e:  # an extension without the backends table
        return False, f"lily._core.backends() failed: {e}"
    if not hasattr(core, "OpBench"):
        return False, "lily._core has no OpBench harness"
    return bool(st.get("usable")), f"cuda backend not usable: {st.get('status')}"


_OK, _WHY = _cuda_usable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_WHY)]

TOL = {"decode": 1e-5, "prefill": 5e-5}
QSPECS = [f"q{b}g{g}-{sd}" for b in (4, 8) for g in (32, 64, 128) for sd in ("f32", "f16", "bf16")]
DSPECS = ["f32", "f16", "bf16"]


@pytest.fixture(scope="module")
def benches():
    # The 2-term prefill GEMM (the default is one f16 term: its own tests at the end of the file).
    return core.OpBench("cpu"), core.OpBench("cuda", {"prefill_x": "bf16x2"})


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)) / np.linalg.norm(b.astype(np.float64)))


def _run(b, desc: dict, x: np.ndarray, phase: str) -> np.ndarray:
    w = b.weight(desc)
    xh = b.tensor(x, dtype="f32")
    out = b.empty(x.shape[0], desc["shape"][0], dtype="f32")
    b.run("matmul", phase=phase, x=xh, w=w, out=out)
    return b.read(out)


def _check(benches, desc: dict, x: np.ndarray, phase: str, what: str) -> np.ndarray:
    cpu, gpu = benches
    ref, got = _run(cpu, desc, x, phase), _run(gpu, desc, x, phase)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (unwritten rows or columns?)"
    rel = _rel(got, ref)
    assert rel <= TOL[phase], f"{what} {phase}: relative error {rel:.3g} > {TOL[phase]}"
    return got


def _variants(report) -> dict:
    """The {key: variant} notes wherever the report keeps them (report["variants"] or report["cuda"][...])."""
    if isinstance(report, dict):
        if any(isinstance(k, str) and k.startswith("matmul.") for k in report):
            return report
        for v in report.values():
            found = _variants(v)
            if found:
                return found
    return {}


def _k_for(spec: str) -> int:
    return 384 if "g128" in spec else 192  # 64·3 where the group allows, else 128·3


@pytest.mark.parametrize("spec", QSPECS + DSPECS)
def test_every_format_both_phases(benches, spec):
    """Every format the CPU supports, T = 1, 2, 7 in decode and 1, 2, 7, 33, 130 in prefill, N = 100."""
    rng = np.random.default_rng(zlib.crc32(spec.encode()))
    k = _k_for(spec)
    desc, _ = make_weight(rng, spec, 100, k)
    x = make_x(rng, 130, k)
    for t in (1, 2, 7):
        _check(benches, desc, x[:t], "decode", f"{spec} T={t}")
    for t in (1, 2, 7, 33, 130):
        _check(benches, desc, x[:t], "prefill", f"{spec} T={t}")


@pytest.mark.parametrize("n,k", [(8192, 2048), (2048, 4096), (2048, 512)])
def test_real_q4_shapes(benches, n, k):
    """in_proj_qkv [8192, 2048], o_proj/out_proj [2048, 4096], shared_down [2048, 512] (q4g64, bf16)."""
    rng = np.random.default_rng(n + k)
    desc, _ = make_weight(rng, "q4g64-bf16", n, k)
    x = make_x(rng, 130, k)
    _check(benches, desc, x[:1], "decode", f"q4 [{n}, {k}]")
    _check(benches, desc, x[:4], "decode", f"q4 [{n}, {k}]")
    _check(benches, desc, x, "prefill", f"q4 [{n}, {k}]")


@pytest.mark.parametrize("n", [256, 1])
def test_router_and_shared_gate_q8(benches, n):
    """mlp.gate [256, 2048] and shared_expert_gate [1, 2048]: 8-bit, group 64."""
    rng = np.random.default_rng(n)
    desc, _ = make_weight(rng, "q8g64-bf16", n, 2048)
    x = make_x(rng, 33, 2048)
    _check(benches, desc, x[:1], "decode", f"q8 [{n}, 2048]")
    _check(benches, desc, x, "prefill", f"q8 [{n}, 2048]")


@pytest.mark.parametrize("n", [1, 3, 100, 1000])
@pytest.mark.parametrize("k", [64 * 3, 64 * 17])
def test_awkward_shapes(benches, n, k):
    """N not a multiple of any tile or row batch, K of 3 and 17 groups of 64 (partial K blocks)."""
    rng = np.random.default_rng(n * 1000 + k)
    for spec in ("q4g64-bf16", "q8g64-f16", "bf16"):
        desc, _ = make_weight(rng, spec, n, k)
        x = make_x(rng, 33, k)
        _check(benches, desc, x[:2], "decode", f"{spec} [{n}, {k}]")
        _check(benches, desc, x, "prefill", f"{spec} [{n}, {k}]")


@pytest.mark.parametrize("spec", ["f32", "f16", "bf16"])
def test_dense_odd_k(benches, spec):
    """Dense rows whose byte length is not a multiple of 16 (or of 4): partial chunks, narrower loads."""
    rng = np.random.default_rng(5)
    for k in (7, 100, 1000):
        desc, _ = make_weight(rng, spec, 40, k)
        x = make_x(rng, 9, k)
        _check(benches, desc, x[:1], "decode", f"{spec} K={k}")
        _check(benches, desc, x, "prefill", f"{spec} K={k}")


def test_lm_head_decode(benches):
    """lm_head [248320, 2048] q4g64 (bf16 scales), one decode row: the largest weight, once."""
    rng = np.random.default_rng(248320)
    n, k, g = 248320, 2048, 64
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = (rng.uniform(0.002, 0.05, (n, k // g)) * rng.choice([-1.0, 1.0], (n, k // g))).astype(np.float32)
    biases = rng.normal(0.0, 0.3, (n, k // g)).astype(np.float32)
    desc = {"kind": "affine", "bits": 4, "group": g, "data": words, "scales": _bf16_bits(scales),
            "biases": _bf16_bits(biases), "scale_dtype": "bf16", "shape": (n, k)}
    x = make_x(rng, 1, k)
    _check(benches, desc, x, "decode", "lm_head")
    notes = [v for key, v in _variants(benches[1].report()).items() if "[248320, 2048]" in key]
    assert notes and notes[0].startswith("gemv_q4_dp4a_g64_bf16s:"), notes


def test_lm_head_q8_decode(benches):
    """lm_head [248320, 2048] as lm_head="8bit" loads it (q8g64, bf16 scales: lily/lm_head.py): one decode row and
    an MTP verify window of 5 rows through the dp4a GEMV, and the
    prefill GEMM for a chunk's logits rows; the variant is pinned so a demotion shows."""
    rng = np.random.default_rng(248321)
    n, k, g = 248320, 2048, 64
    words = rng.integers(0, 2**32, size=(n, k // 4), dtype=np.uint32)
    scales = (rng.uniform(0.0002, 0.003, (n, k // g)) * rng.choice([-1.0, 1.0], (n, k // g))).astype(np.float32)
    biases = rng.normal(0.0, 0.3, (n, k // g)).astype(np.float32)
    desc = {"kind": "affine", "bits": 8, "group": g, "data": words, "scales": _bf16_bits(scales),
            "biases": _bf16_bits(biases), "scale_dtype": "bf16", "shape": (n, k)}
    x = make_x(rng, 5, k)
    _check(benches, desc, x[:1], "decode", "lm_head q8")
    _check(benches, desc, x, "decode", "lm_head q8 T=5")
    _check(benches, desc, x[:2], "prefill", "lm_head q8 prefill")
    variants = _variants(benches[1].report())
    # The shared benches also ran the q4 head of the same shape (test_lm_head_decode): pick the 8-bit notes.
    dec = [v for key, v in variants.items() if key.startswith("matmul.decode.") and "[248320, 2048]" in key
           and v.startswith("gemv_q8")]
    assert dec and dec[0].startswith("gemv_q8_dp4a_g64_bf16s:"), variants


@pytest.mark.parametrize("n,k,spec", [(65537, 2048, "q4g64-bf16"), (50001, 1536, "q4g128-f16")])
def test_large_q4_decode_tensor_core_gemv(benches, n, k, spec):
    """With gemv_dp4a=False (the dp4a GEMV takes these weights by default) weights of 32 MiB and more take
    matmul_gemv_mma for T <= 8 (x as bf16 hi + lo: within 1e-5), the CUDA-core GEMV for T = 9..16; odd N leaves a
    partial 16-row tile in some warp's range."""
    gpu = core.OpBench("cuda", {"gemv_dp4a": False})
    benches = (benches[0], gpu)
    rng = np.random.default_rng(n)
    desc, _ = make_weight(rng, spec, n, k)
    x = make_x(rng, 9, k)
    for t in (1, 3, 8, 9):
        _check(benches, desc, x[:t], "decode", f"{spec} [{n}, {k}] T={t}")
    notes = [v for key, v in _variants(gpu.report()).items() if key.startswith("matmul.decode.") and f"[{n}, {k}]" in key]
    assert notes and notes[0].startswith("gemv_q4_mma_"), notes


def test_rows_do_not_depend_on_t(benches):
    """Prefill: chunks of 7 give the bits of one batch of 130. Decode: a row alone = that row in T = 7."""
    _, gpu = benches
    rng = np.random.default_rng(17)
    desc, _ = make_weight(rng, "q4g64-bf16", 300, 1024)
    x = make_x(rng, 130, 1024)
    full = _run(gpu, desc, x, "prefill")
    chunks = np.concatenate([_run(gpu, desc, x[i:i + 7], "prefill") for i in range(0, 130, 7)])
    assert np.array_equal(full.view(np.uint32), chunks.view(np.uint32)), "prefill: chunks of 7 vs one batch"
    d7 = _run(gpu, desc, x[:7], "decode")
    for r in (0, 3, 6):
        alone = _run(gpu, desc, x[r:r + 1], "decode")
        assert np.array_equal(alone.view(np.uint32), d7[r:r + 1].view(np.uint32)), f"decode row {r} alone vs T=7"


def gemm_tile_rows(t: int, n: int, sms: int = 132) -> int:
    """matmul.cpp's tile height for a prefill GEMM of t rows and n outputs (the H200's 132 SMs)."""
    blocks = -(-t // 64) * -(-n // 128)
    return 16 if 4 * blocks <= sms else 32 if 2 * blocks <= sms else 64


SMALL_TILE_CASES = [
    # (spec, n, k): the real in_proj_z (16-row tiles up to T = 64, 64-row tiles at 130), out_proj (32-row tiles at
    # T = 130), 8-bit codes with f16 scales and 7 groups per row, group 32 with f32 scales,
    # group 128, dense bf16 with a K tail (1000 = 15 blocks of 64 + 40), dense f16 (weights as hi + lo), dense f32
    # with 4-byte loads.
    ("q4g64-bf16", 4096, 2048),
    ("q4g64-bf16", 2048, 4096),
    ("q8g64-f16", 257, 448),
    ("q4g32-f32", 300, 256),
    ("q4g128-bf16", 130, 384),
    ("bf16", 300, 1000),
    ("f16", 200, 192),
    ("f32", 100, 100),
]


@pytest.mark.parametrize("spec,n,k", SMALL_TILE_CASES)
def test_gemm_small_tiles_same_bits(benches, spec, n, k):
    """16- and 32-row GEMM tiles (grids of at most a quarter / half as many 64-row blocks as SMs) give the 64-row
    tiles' bits (gemm_small_tiles=False), so a prefill in small chunks equals one big prefill; the report names the
    tile."""
    rng = np.random.default_rng(zlib.crc32(f"tiles {spec} {n} {k}".encode()))
    desc, _ = make_weight(rng, spec, n, k)
    x = make_x(rng, 130, k)
    small, big = core.OpBench("cuda", {"prefill_x": "bf16x2"}), core.OpBench("cuda", {"prefill_x": "bf16x2",
                                                                                      "gemm_small_tiles": False})
    for t in (1, 7, 64, 130):
        ref = _check((benches[0], big), desc, x[:t], "prefill", f"{spec} T={t} 64-row tiles")
        got = _run(small, desc, x[:t], "prefill")
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=f"{spec} T={t}")
        note = next(v for key, v in _variants(small.report()).items() if key.startswith("matmul.prefill"))
        assert f"{gemm_tile_rows(t, n)}-row tiles" in note, (t, n, note)
    note = next(v for key, v in _variants(big.report()).items() if key.startswith("matmul.prefill"))
    assert "64-row tiles (gemm_small_tiles=False)" in note, note


def test_gemm_chunks_across_the_tile_switch(benches):
    """With the default switch, a 600-row prefill of a [1024, 2048] weight (64-row tiles: 80 blocks) equals
    prefills of 7 and 64 rows (16-row tiles: 8 blocks) and of 300 rows (32-row tiles: 40 blocks) bit for bit."""
    _, gpu = benches
    rng = np.random.default_rng(29)
    desc, _ = make_weight(rng, "q4g64-bf16", 1024, 2048)
    x = make_x(rng, 600, 2048)
    def note():
        return next(v for key, v in _variants(gpu.report()).items()
                    if key.startswith("matmul.prefill") and "[1024, 2048]" in key)

    full = _run(gpu, desc, x, "prefill")
    assert "64-row tiles (80 blocks" in note(), note()
    for a, b, rows in ((0, 7, 16), (7, 71, 16), (300, 600, 32)):
        part = _run(gpu, desc, x[a:b], "prefill")
        np.testing.assert_array_equal(part.view(np.uint32), full[a:b].view(np.uint32), err_msg=f"rows {a}:{b}")
        assert f"{rows}-row tiles" in note(), (a, b, note())


def test_decode_refuses_more_than_16_rows(benches):
    _, gpu = benches
    rng = np.random.default_rng(2)
    desc, _ = make_weight(rng, "q4g64-bf16", 8, 128)
    with pytest.raises(Exception, match="at most 16"):
        _run(gpu, desc, make_x(rng, 17, 128), "decode")


def test_variants_pinned_for_real_shapes(benches):
    """The fast variants for the real model's weights (STYLE.md §5): a refactor that demotes one shows."""
    _, gpu = benches
    rng = np.random.default_rng(3)
    expect = {("q4g64-bf16", 8192, 2048): "q4", ("q4g64-bf16", 512, 2048): "q4", ("q4g64-bf16", 2048, 512): "q4",
              ("q8g64-bf16", 256, 2048): "q8"}
    for (spec, n, k), kind in expect.items():
        desc, _ = make_weight(rng, spec, n, k)
        x = make_x(rng, 1, k)
        _run(gpu, desc, x, "decode")
        _run(gpu, desc, x, "prefill")
    variants = _variants(gpu.report())
    text = repr(variants)
    for (spec, n, k), kind in expect.items():
        dec = [v for key, v in variants.items() if key.startswith("matmul.decode.") and f"[{n}, {k}]" in key]
        pre = [v for key, v in variants.items() if key.startswith("matmul.prefill.") and f"[{n}, {k}]" in key]
        # x as int8 terms and dp4a (gemv_dp4a, on by default) for every aligned real weight
        assert dec and dec[0].startswith(f"gemv_{kind}_dp4a_g64_bf16s:"), f"decode [{n}, {k}]: {text}"
        # T = 1: smaller tiles where 4x / 2x the grid still fits the H200's 132 SMs
        tile = {16: "_m16", 32: "_m32", 64: ""}[gemm_tile_rows(1, n)]
        assert pre and pre[0].startswith(f"gemm_{kind}_mma_codes_g64_bf16s_x2{tile}:"), f"prefill [{n}, {k}]: {text}"


# ------------------------------------------------------------------------------------------------
# matmuls: products of one x with up to four weights, one launch in decode when they share a format
# ------------------------------------------------------------------------------------------------

GROUPS = [
    # (what, [(spec, n)], k): the real model's groups, then awkward ones (parts of 1, 3, 33 rows: every part
    # must start on a block batch and end inside one), and a mixed-format group (one launch per product).
    ("deltanet in_proj qkv|z|b|a", [("q4g64-bf16", 8192), ("q4g64-bf16", 4096), ("q4g64-bf16", 32), ("q4g64-bf16", 32)], 2048),
    ("attention q|k|v", [("q4g64-bf16", 8192), ("q4g64-bf16", 512), ("q4g64-bf16", 512)], 2048),
    ("router|shared gate", [("q8g64-bf16", 256), ("q8g64-bf16", 1)], 2048),
    ("awkward", [("q4g64-f16", 3), ("q4g64-f16", 1), ("q4g64-f16", 33), ("q4g64-f16", 100)], 64 * 3),
    ("dense", [("bf16", 7), ("bf16", 130)], 100),
    ("mixed formats", [("q4g64-bf16", 40), ("q8g64-bf16", 9)], 192),
]


def _run_group(b, descs, x, phase):
    kw = {}
    outs = []
    for i, d in enumerate(descs):
        out = b.empty(x.shape[0] + 2, d["shape"][0], dtype="f32")
        outs.append(out)
        kw[f"w{i}"] = b.weight(d)
        kw[f"out{i}"] = b.view(out, 1, x.shape[0])
    b.run("matmuls", phase=phase, x=b.tensor(x, dtype="f32"), **kw)
    return [b.read(o) for o in outs]


@pytest.mark.parametrize("what,parts,k", GROUPS, ids=[g[0] for g in GROUPS])
def test_matmuls_group(benches, what, parts, k):
    """Each part equals the CPU's product (its own output, guard rows on both sides untouched); decode runs
    a same-format group as one launch and says so, a mixed one as one launch per product."""
    rng = np.random.default_rng(zlib.crc32(what.encode()))
    descs = [make_weight(rng, spec, n, k)[0] for spec, n in parts]
    x = make_x(rng, 33, k)
    for phase, ts in (("decode", (1, 3)), ("prefill", (1, 33))):
        for t in ts:
            ref = _run_group(benches[0], descs, x[:t], phase)
            got = _run_group(benches[1], descs, x[:t], phase)
            for i, g in enumerate(got):
                assert np.isnan(g[0]).all() and np.isnan(g[-1]).all(), f"{what} part {i}: wrote outside its view"
                assert np.isfinite(g[1:-1]).all(), f"{what} part {i} {phase} T={t}: unwritten or non-finite outputs"
            # Over all parts together: a 1-element part's own relative error is one dot product's cancellation.
            rel = _rel(np.concatenate([g[1:-1] for g in got], axis=1), np.concatenate([r[1:-1] for r in ref], axis=1))
            assert rel <= TOL[phase], f"{what} {phase} T={t}: {rel:.3g}"
    notes = {k: v for k, v in _variants(benches[1].report()).items() if k.startswith("matmuls.decode.")}
    assert notes, "matmuls left no variant note"
    mixed = what == "mixed formats"
    assert any(("one launch" in v) != mixed and ("launches, one per product" in v) == mixed for v in notes.values()), notes


def test_matmuls_decode_rows_match_plain_matmul_across_T(benches):
    """A grouped decode row does not depend on T (rows 0..2 of T = 3 equal T = 1 bit for bit)."""
    rng = np.random.default_rng(5)
    descs = [make_weight(rng, "q4g64-bf16", n, 2048)[0] for n in (8192, 4096, 32, 32)]
    x = make_x(rng, 3, 2048)
    one = _run_group(benches[1], descs, x[:1], "decode")
    three = _run_group(benches[1], descs, x, "decode")
    for a, b in zip(one, three):
        np.testing.assert_array_equal(a[1].view(np.uint32), b[1].view(np.uint32))


@pytest.mark.parametrize("spec,n,k", [("q4g64-bf16", 8192, 2048), ("q4g64-bf16", 2048, 4096), ("q8g64-bf16", 257, 2048),
                                      ("q4g32-f32", 100, 192), ("q8g32-f16", 33, 192), ("q8g128-f16", 7, 384)])
def test_gemv_async_equals_register_form(benches, spec, n, k):
    """matmul_gemv_async (cp.async staging) and matmul_gemv (register double buffer) do the same arithmetic in
    the same order: the same bits, and the report names which ran."""
    rng = np.random.default_rng(zlib.crc32(f"async {spec} {n} {k}".encode()))
    desc, _ = make_weight(rng, spec, n, k)
    x = make_x(rng, 3, k)
    cpu = benches[0]
    asy = core.OpBench("cuda", {"gemv_dp4a": False})  # the fp32 forms (dp4a takes these weights by default)
    reg = core.OpBench("cuda", {"gemv_async": False, "gemv_dp4a": False})
    for t in (1, 3):
        a = _run(asy, desc, x[:t], "decode")
        assert _rel(a, _run(cpu, desc, x[:t], "decode")) <= TOL["decode"]
        b = _run(reg, desc, x[:t], "decode")
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert any("cp.async" in v for v in _variants(asy.report()).values())
    assert any("gemv_async=False" in v for v in _variants(reg.report()).values())


# ------------------------------------------------------------------------------------------------
# matmul_gemv_dp4a: x as three int8 terms per 16-byte chunk, integer dot products with the codes. Its error
# against exact arithmetic is ~1e-7 relative, the fp32 form's level: both are held to 1e-6 against float64
# here (ten times tighter than TOL; a lost third term gives ~1e-5 and fails).

DP4A_CASES = [("q4g64-bf16", 8192, 2048), ("q4g64-bf16", 2048, 4096), ("q4g64-bf16", 2048, 512),
              ("q8g64-bf16", 257, 2048), ("q4g32-f32", 100, 1088), ("q4g128-f16", 33, 384), ("q8g32-f16", 3, 192),
              ("q8g128-bf16", 1000, 384), ("q4g64-f16", 1, 192)]


def _f64(x, w64):
    return x.astype(np.float64) @ w64.T


@pytest.mark.parametrize("spec,n,k", DP4A_CASES)
def test_gemv_dp4a_matches_float64(benches, spec, n, k):
    """The dp4a GEMV (the default for these weights, and the report says so) and the fp32 form within 1e-6 of a
    float64 product, T = 1 and 3, rows 0..2 of T = 3 equal to each row alone."""
    _, gpu = benches
    rng = np.random.default_rng(zlib.crc32(f"dp4a {spec} {n} {k}".encode()))
    desc, w64 = make_weight(rng, spec, n, k)
    x = make_x(rng, 3, k)
    fp32 = core.OpBench("cuda", {"gemv_dp4a": False})
    for t in (1, 3):
        got, old = _run(gpu, desc, x[:t], "decode"), _run(fp32, desc, x[:t], "decode")
        ref = _f64(x[:t], w64)
        assert _rel(got, ref) <= 1e-6, f"dp4a {spec} [{n}, {k}] T={t}: {_rel(got, ref):.3g}"
        assert _rel(old, ref) <= 1e-6, f"fp32 form {spec} [{n}, {k}] T={t}: {_rel(old, ref):.3g}"
    three = _run(gpu, desc, x, "decode")
    for r in range(3):
        np.testing.assert_array_equal(_run(gpu, desc, x[r:r + 1], "decode").view(np.uint32), three[r:r + 1].view(np.uint32))
    notes = [v for key, v in _variants(gpu.report()).items() if key == f"matmul.decode.{spec} [{n}, {k}]"]
    assert notes and "_dp4a_" in notes[0], notes


@pytest.mark.parametrize("spec", ["q4g64-bf16", "q8g64-f16"])
def test_gemv_dp4a_dynamic_range_zeros_and_nan(benches, spec):
    """Inputs spanning six decades inside a chunk, an all-zero chunk (its scale is 0: no division by it) and a
    single huge outlier stay within 2e-6 of float64; a NaN in a row makes that row's outputs NaN (as the fp32
    form's), the other rows stay finite and unchanged."""
    _, gpu = benches
    n, k = 300, 2048
    rng = np.random.default_rng(zlib.crc32(f"dp4a range {spec}".encode()))
    desc, w64 = make_weight(rng, spec, n, k)
    x = make_x(rng, 3, k) * (10.0 ** rng.uniform(-3, 3, size=(3, k))).astype(np.float32)
    x[:, 64:96] = 0.0
    x[1, 700] = 3.0e4
    got = _run(gpu, desc, x, "decode")
    assert _rel(got, _f64(x, w64)) <= 2e-6, _rel(got, _f64(x, w64))
    bad = x.copy()
    bad[1, 5] = np.nan
    fp32 = core.OpBench("cuda", {"gemv_dp4a": False})
    for b in (gpu, fp32):
        out = _run(b, desc, bad, "decode")
        assert np.isnan(out[1]).all(), "a NaN input must reach every output of its row"
        assert np.isfinite(out[[0, 2]]).all()
    out = _run(gpu, desc, bad, "decode")
    np.testing.assert_array_equal(out[[0, 2]].view(np.uint32), got[[0, 2]].view(np.uint32))


# ------------------------------------------------------------------------------------------------
# The norm in front of a group (Ops::rms_norm_matmuls / add_rms_norm_matmuls): in decode one GEMV launch whose
# every block normalises its row (NORM in kernels/matmul.cu); the bits must be those of the norm op followed by
# matmuls on the same GPU, and close to the CPU's composed form.

NORM_GROUPS = [
    ("deltanet in_proj qkv|z|b|a", [("q4g64-bf16", 8192), ("q4g64-bf16", 4096), ("q4g64-bf16", 32), ("q4g64-bf16", 32)], 2048),
    ("attention q|k|v", [("q4g64-bf16", 8192), ("q4g64-bf16", 512), ("q4g64-bf16", 512)], 2048),
    ("router|shared gate", [("q8g64-bf16", 256), ("q8g64-bf16", 1)], 2048),
    ("awkward rows", [("q4g32-f16", 3), ("q4g32-f16", 33), ("q4g32-f16", 100)], 992),  # K % 64 != 0, > 512
    ("dense", [("bf16", 7), ("bf16", 130)], 516),
    ("short rows (warp norm)", [("q4g64-f16", 5), ("q4g64-f16", 40)], 64 * 3),  # K <= 512: norm.cu's one-warp sum
    ("odd rows (composed)", [("bf16", 5), ("bf16", 40)], 102),  # K % 4 != 0: the norm op, then matmuls
]


def _norm_group(b, descs, a, bb, w, add, fused, repeats=1):
    """Runs the op (fused) or the norm op then matmuls (not fused) `repeats` times in place (sum = a);
    returns normed, sum (= a after the runs) and the outputs of the last run."""
    T, K = a.shape
    at = b.tensor(a, dtype="f32")
    bt, wt = b.tensor(bb, dtype="f32"), b.tensor(w, dtype="f32")
    normed = b.empty(T, K, dtype="f32")
    kw, outs = {}, []
    for i, d in enumerate(descs):
        out = b.empty(T + 2, d["shape"][0], dtype="f32")
        outs.append(out)
        kw[f"w{i}"], kw[f"out{i}"] = b.weight(d), b.view(out, 1, T)
    for _ in range(repeats):
        if fused and add:
            b.run("add_rms_norm_matmuls", phase="decode", a=at, b=bt, w=wt, eps=1e-6, sum=at, normed=normed, **kw)
        elif fused:
            b.run("rms_norm_matmuls", phase="decode", x=at, w=wt, eps=1e-6, normed=normed, **kw)
        else:
            if add:
                b.run("add_rms_norm", phase="decode", a=at, b=bt, w=wt, eps=1e-6, sum=at, normed=normed)
            else:
                b.run("rms_norm", phase="decode", x=at, w=wt, eps=1e-6, out=normed)
            b.run("matmuls", phase="decode", x=normed, **kw)
    return b.read(normed), b.read(at), [b.read(o) for o in outs]


@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("what,parts,k", NORM_GROUPS, ids=[g[0] for g in NORM_GROUPS])
def test_norm_matmuls(benches, what, parts, k, add):
    """Fused = composed on the GPU bit for bit (normed, sum, every product), close to the CPU; run twice in place
    (the second run reads the first's sum: add_rms_norm_matmuls' arrival counters must be back at 0), T = 1 and
    3; guard rows untouched; the report says one launch where the norm reads whole float4s, else why not."""
    rng = np.random.default_rng(zlib.crc32(f"norm {what} {add}".encode()))
    descs = [make_weight(rng, spec, n, k)[0] for spec, n in parts]
    x, r = make_x(rng, 3, k), make_x(rng, 3, k)
    w = (rng.uniform(0.5, 1.5, size=(1, k)) * rng.choice([-1.0, 1.0], size=(1, k))).astype(np.float32)
    for t in (1, 3):
        ref = _norm_group(benches[0], descs, x[:t], r[:t], w, add, fused=True, repeats=2)
        got = _norm_group(benches[1], descs, x[:t], r[:t], w, add, fused=True, repeats=2)
        two = _norm_group(benches[1], descs, x[:t], r[:t], w, add, fused=False, repeats=2)
        for i, g in enumerate(got[2]):
            assert np.isnan(g[0]).all() and np.isnan(g[-1]).all(), f"{what} part {i}: wrote outside its view"
            assert np.isfinite(g[1:-1]).all(), f"{what} part {i} T={t}: unwritten or non-finite outputs"
        np.testing.assert_array_equal(got[1], ref[1], err_msg=f"{what} T={t}: sum (a + b, twice) differs from the CPU")
        assert _rel(got[0], ref[0]) <= 1e-5, f"{what} T={t}: normed {_rel(got[0], ref[0]):.3g}"
        rel = _rel(np.concatenate([g[1:-1] for g in got[2]], axis=1), np.concatenate([o[1:-1] for o in ref[2]], axis=1))
        assert rel <= TOL["decode"], f"{what} T={t}: products {rel:.3g}"
        np.testing.assert_array_equal(got[0].view(np.uint32), two[0].view(np.uint32), err_msg=f"{what}: normed bits")
        np.testing.assert_array_equal(got[1].view(np.uint32), two[1].view(np.uint32), err_msg=f"{what}: sum bits")
        for i, (g, o) in enumerate(zip(got[2], two[2])):
            np.testing.assert_array_equal(g[1:-1].view(np.uint32), o[1:-1].view(np.uint32),
                                          err_msg=f"{what} part {i} T={t}: fused and two-launch bits differ")
    op = "add_rms_norm_matmuls" if add else "rms_norm_matmuls"
    notes = {key: v for key, v in benches[1].report()["variants"].items() if key.startswith(op + ".decode.")}
    fused = k % 4 == 0
    assert any(v.startswith("one launch") == fused for v in notes.values()), notes


@pytest.mark.parametrize("spec,n,k", [("q4g64-bf16", 30001, 2048), ("q8g64-bf16", 5003, 2048), ("q4g64-bf16", 3, 4096)])
def test_gemv_ahead_same_bits(spec, n, k):
    """gemv_ahead = 2 (each warp's first two weight batches loaded before the wait, kernels/matmul.cu GEMV_AHEAD; the
    default) gives the bits of gemv_ahead = 1 (one batch ahead): plain products at T = 1 and 3 with 1 to ~8 batches
    per warp (odd and even counts, a warp with none), and the DeltaNet in_proj group behind its fused add + norm; the
    report says so."""
    one = core.OpBench("cuda", {"gemv_ahead": 1})
    two = core.OpBench("cuda", {"gemv_ahead": 2})
    rng = np.random.default_rng(zlib.crc32(f"ahead {spec} {n} {k}".encode()))
    desc, _ = make_weight(rng, spec, n, k)
    x = make_x(rng, 3, k)
    for t in (1, 3):
        np.testing.assert_array_equal(_run(two, desc, x[:t], "decode").view(np.uint32),
                                      _run(one, desc, x[:t], "decode").view(np.uint32), err_msg=f"T={t}")
    notes = [v for key, v in _variants(two.report()).items() if key == f"matmul.decode.{spec} [{n}, {k}]"]
    assert notes and "the first two batches loaded before the wait" in notes[0], notes
    assert any("gemv_ahead=2" in line for line in two.report()["optimizations"]), two.report()["optimizations"]
    descs = [make_weight(rng, sp, rows, 2048)[0] for sp, rows in NORM_GROUPS[0][1]]
    a, r = make_x(rng, 3, 2048), make_x(rng, 3, 2048)
    w = rng.uniform(0.5, 1.5, size=(1, 2048)).astype(np.float32)
    for t in (1, 3):
        got = _norm_group(two, descs, a[:t], r[:t], w, True, fused=True)
        want = _norm_group(one, descs, a[:t], r[:t], w, True, fused=True)
        for g, o in zip(got[2], want[2]):
            np.testing.assert_array_equal(g.view(np.uint32), o.view(np.uint32), err_msg=f"in_proj group T={t}")


# ------------------------------------------------------------------------------------------------
# prefill_x = "f16" (the default) and "bf16": the prefill GEMM takes x as one term
# ------------------------------------------------------------------------------------------------

def _scalars64(stored: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return stored.astype(np.float64)


# Relative rounding of x per form: bf16 keeps 8 significant bits, f16 (after its power-of-two scale) 11.
ONE_TERM_ULP = {"bf16": 2.0 ** -9, "f16": 2.0 ** -12}


def one_term_bound(x: np.ndarray, desc: dict, w64: np.ndarray, form: str) -> np.ndarray:
    """Per-output bound for x rounded once (|x − round(x)| ≤ u·|x|). The rounded x multiplies the weights'
    integer-code part s·q = w − b (the bias term b·Σx uses the fp32 x), or the dense weight itself;
    2e-5·Σ|x·w| covers the fp32 accumulation, a weight's hi + lo split and f16's subnormals (inputs below 2^-28 of
    their group part's max)."""
    ax = np.abs(x.astype(np.float64))
    if desc["kind"] == "affine":
        b = np.repeat(_scalars64(desc["biases"], desc["scale_dtype"]), desc["group"], axis=1)
        rounded_part = np.abs(w64 - b)
    else:
        rounded_part = np.abs(w64)
    return ONE_TERM_ULP[form] * 1.01 * (ax @ rounded_part.T) + 2e-5 * (ax @ np.abs(w64).T)


@pytest.fixture(scope="module")
def one_term():
    return {form: core.OpBench("cuda", {"prefill_x": form, "gemm_w_f16": False}) for form in ("f16", "bf16")}


def _wide_range_x(rng, t: int, k: int) -> np.ndarray:
    """Rows past f16's range and rows deep in its subnormals: row 0 × 3e5 (|x| up to ~1e6 > 65504), row 1 × 1e-9,
    row 2 with its first 32 inputs × 2e4 and the rest × 1e-3 (one group part spanning 7 decades)."""
    x = make_x(rng, t, k)
    x[0] *= 3e5
    x[1] *= 1e-9
    x[2, :32] *= 2e4
    x[2, 32:] *= 1e-3
    return x


@pytest.mark.parametrize("form", ["f16", "bf16"])
@pytest.mark.parametrize("spec,n,k", [("q4g64-bf16", 8192, 2048), ("q4g64-bf16", 2048, 4096), ("q8g64-f16", 100, 192),
                                      ("q4g32-f32", 300, 1088), ("q4g128-f16", 64, 640), ("bf16", 1000, 192),
                                      ("f32", 3, 1088), ("f16", 100, 130)])
def test_prefill_one_x_term(benches, one_term, form, spec, n, k):
    """Within the rounding bound of every output (not the 2-term tolerance: the lo term is really gone),
    deterministic, rows independent of T (chunks of 7 = one batch), decode untouched (hi + lo). f16 holds its bound
    on rows past its range and rows of subnormal size (the power-of-two scale per row and group part); on weights
    without integer codes in K-block groups it is refused, with the reason, for hi + lo."""
    cpu, gpu2 = benches
    bench = one_term[form]
    rng = np.random.default_rng(zlib.crc32(f"x1 {form} {spec} {n} {k}".encode()))
    desc, w64 = make_weight(rng, spec, n, k)
    x = _wide_range_x(rng, 130, k) if form == "f16" else make_x(rng, 130, k)
    ref = _run(cpu, desc, x, "prefill").astype(np.float64)
    got = _run(bench, desc, x, "prefill")
    notes = [v for key, v in _variants(bench.report()).items() if key.startswith("matmul.prefill.")]
    if form == "f16" and desc["kind"] != "affine":
        np.testing.assert_array_equal(got.view(np.uint32), _run(gpu2, desc, x, "prefill").view(np.uint32))
        assert any("prefill_x = f16 needs integer codes" in v for v in notes), notes
        return
    assert np.isfinite(got).all()
    err = np.abs(got.astype(np.float64) - ref)
    bound = one_term_bound(x, desc, w64, form)
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{spec} [{n}, {k}]: error {worst:.3g} of the one-term bound"
    two = _run(gpu2, desc, x, "prefill")
    assert _rel(got, ref) > 4 * _rel(two, ref), f"prefill_x = {form} did not change the GEMM (still hi + lo?)"
    again = _run(bench, desc, x, "prefill")
    assert np.array_equal(got.view(np.uint32), again.view(np.uint32)), "not deterministic"
    chunks = np.concatenate([_run(bench, desc, x[i:i + 7], "prefill") for i in range(0, 130, 7)])
    assert np.array_equal(got.view(np.uint32), chunks.view(np.uint32)), "chunks of 7 vs one batch"
    # Decode keeps x as hi + lo under this option: the 2-term bench's bits.
    d1, d2 = _run(bench, desc, x[:3], "decode"), _run(gpu2, desc, x[:3], "decode")
    assert np.array_equal(d1.view(np.uint32), d2.view(np.uint32)), f"decode changed with prefill_x = {form}"
    assert any(("_xf16" if form == "f16" else "_x1") in v for v in notes), notes


@pytest.mark.parametrize("spec,n,k", [("q4g64-bf16", 600, 2048), ("q8g32-f32", 300, 192)])
def test_prefill_f16_small_tiles_same_bits(one_term, spec, n, k):
    """With x as f16 the 16- and 32-row tiles still give the 64-row tiles' bits (each row's scale depends on its own
    inputs only), so chunked prefill equals one prefill under the default too."""
    rng = np.random.default_rng(zlib.crc32(f"f16 tiles {spec} {n} {k}".encode()))
    desc, _ = make_weight(rng, spec, n, k)
    x = _wide_range_x(rng, 130, k)
    big = core.OpBench("cuda", {"prefill_x": "f16", "gemm_w_f16": False, "gemm_small_tiles": False})
    for t in (3, 20, 130):
        ref = _run(big, desc, x[:t], "prefill")
        got = _run(one_term["f16"], desc, x[:t], "prefill")
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=f"{spec} T={t}")


# ------------------------------------------------------------------------------------------------
# gemm_frag: 4-bit codes widened per warp into B fragments, against the converted shared W tile
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["f16", "bf16x2", "bf16"])
@pytest.mark.parametrize("spec,n,k", [("q4g64-bf16", 8192, 2048), ("q4g64-bf16", 2048, 4096), ("q4g64-bf16", 32, 2048),
                                      ("q4g32-f32", 300, 1088), ("q4g128-f16", 200, 640), ("q4g64-f16", 130, 192)])
def test_gemm_frag_same_bits(form, spec, n, k):
    """The fragment path (gemm_frag; off by default until this test and an A/B have run on a GPU) feeds the MMAs the
    operands the converted W tile did, in the same order: the same bits at every tile height (T = 1 and 7: 16-row
    tiles; 64 and 130: 16, 32 or 64 rows by the grid), for each activation form; the report names the path."""
    rng = np.random.default_rng(zlib.crc32(f"frag {form} {spec} {n} {k}".encode()))
    desc, _ = make_weight(rng, spec, n, k)
    x = make_x(rng, 130, k)
    frag, tile = (core.OpBench("cuda", {"prefill_x": form, "gemm_frag": f, "gemm_w_f16": False}) for f in (True, False))
    for t in (1, 7, 64, 130):
        got, ref = _run(frag, desc, x[:t], "prefill"), _run(tile, desc, x[:t], "prefill")
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=f"{form} {spec} T={t}")
    notes = {key: v for key, v in _variants(frag.report()).items() if key.startswith("matmul.prefill")}
    assert notes and all("B fragments (gemm_frag)" in v and "_frag" in v.split(":")[0] for v in notes.values()), notes
    notes = {key: v for key, v in _variants(tile.report()).items() if key.startswith("matmul.prefill")}
    assert notes and all("converted W tile in shared memory (gemm_frag=False)" in v for v in notes.values()), notes


# ------------------------------------------------------------------------------------------------
# gemm_w_f16: the weights dequantized to f16 in the shared tile (x as one f16 term), against the CPU
# ------------------------------------------------------------------------------------------------

def w_f16_bound(x: np.ndarray, desc: dict, w64: np.ndarray) -> np.ndarray:
    """Per-output bound with both operands rounded once to f16 (ONE_TERM_ULP's u): x (after its power-of-two scale)
    multiplies the whole weight, and the weight f16(s·q + b) is off by u·|w| plus, for f32 scales and biases, their own
    rounding to f16 (u·(|s·q| + |b|)), plus 2^-25·(q + 1) where s or b is an f16 subnormal; 2e-5·Σ|x·w| for the fp32
    accumulation as in one_term_bound."""
    ax = np.abs(x.astype(np.float64))
    b = np.repeat(_scalars64(desc["biases"], desc["scale_dtype"]), desc["group"], axis=1)
    wabs = np.abs(w64)
    rounded = 2 * wabs + np.abs(w64 - b) + np.abs(b)
    u = ONE_TERM_ULP["f16"]
    return u * 1.01 * (ax @ rounded.T) + 2.0 ** -21 * ax.sum(axis=1, keepdims=True) + 2e-5 * (ax @ wabs.T)


@pytest.mark.parametrize("x_rows", [True, False], ids=["x_rows", "x_part_scales"])
@pytest.mark.parametrize("spec,n,k", [("q4g64-bf16", 8192, 2048), ("q4g64-bf16", 2048, 4096), ("q8g64-f16", 100, 192),
                                      ("q4g32-f32", 300, 1088), ("q4g128-f16", 64, 640), ("q8g128-bf16", 130, 256),
                                      ("q4g32-bf16", 77, 1056)])
def test_gemm_w_f16(benches, one_term, spec, n, k, x_rows):
    """gemm_w_f16 (on by default), with x as pre-scaled f16 rows (gemm_x_rows, the default) or scaled per group part:
    within the two-rounding bound of every output on rows past f16's range and of subnormal size (K = 1056: a half
    K block of padding), not the codes path's bits (the option took effect), deterministic, rows independent of T and
    of the tile height, decode untouched; the report names the path."""
    cpu, _ = benches
    wf = core.OpBench("cuda", {"prefill_x": "f16", "gemm_w_f16": True, "gemm_x_rows": x_rows})
    rng = np.random.default_rng(zlib.crc32(f"wf16 {spec} {n} {k}".encode()))
    desc, w64 = make_weight(rng, spec, n, k)
    x = _wide_range_x(rng, 130, k)
    ref = _run(cpu, desc, x, "prefill").astype(np.float64)
    got = _run(wf, desc, x, "prefill")
    assert np.isfinite(got).all()
    worst = float((np.abs(got.astype(np.float64) - ref) / w_f16_bound(x, desc, w64)).max())
    assert worst <= 1.0, f"{spec} [{n}, {k}]: error {worst:.3g} of the f16-weight bound"
    codes = _run(one_term["f16"], desc, x, "prefill")
    assert not np.array_equal(got.view(np.uint32), codes.view(np.uint32)), "gemm_w_f16 did not change the GEMM"
    assert np.array_equal(got.view(np.uint32), _run(wf, desc, x, "prefill").view(np.uint32)), "not deterministic"
    chunks = np.concatenate([_run(wf, desc, x[i:i + 7], "prefill") for i in range(0, 130, 7)])
    assert np.array_equal(got.view(np.uint32), chunks.view(np.uint32)), "chunks of 7 vs one batch"
    big = core.OpBench("cuda", {"prefill_x": "f16", "gemm_w_f16": True, "gemm_x_rows": x_rows,
                                "gemm_small_tiles": False})
    for t in (3, 20):
        np.testing.assert_array_equal(_run(big, desc, x[:t], "prefill").view(np.uint32),
                                      _run(wf, desc, x[:t], "prefill").view(np.uint32), err_msg=f"tile heights T={t}")
    d1, d2 = _run(wf, desc, x[:3], "decode"), _run(one_term["f16"], desc, x[:3], "decode")
    assert np.array_equal(d1.view(np.uint32), d2.view(np.uint32)), "decode changed with gemm_w_f16"
    notes = [v for key, v in _variants(wf.report()).items() if key.startswith("matmul.prefill.")]
    assert notes and all("_wf16" in v.split(":")[0] and ("_xrows" in v.split(":")[0]) == x_rows for v in notes), notes
    if x_rows:  # another x scale than the part scales': not their bits
        parts = core.OpBench("cuda", {"prefill_x": "f16", "gemm_w_f16": True, "gemm_x_rows": False})
        assert not np.array_equal(got.view(np.uint32), _run(parts, desc, x, "prefill").view(np.uint32))


@pytest.mark.parametrize("spec,n,k", [("q4g64-bf16", 8192, 2048), ("q8g64-f16", 8320, 192), ("q4g32-f32", 8200, 1056)])
def test_gemm_x_rows_tile128(benches, spec, n, k):
    """gemm_x_rows' 128-row tiles (gemm_tile128, chosen when their grid fills every SM twice: 1100 rows of >= 8192
    outputs): the 64-row tiles' bits (gemm_tile128 off), and the first 7 rows alone (16-row tiles) the same rows' bits;
    within the f16-weight bound of the CPU; the report names the height."""
    cpu, _ = benches
    rng = np.random.default_rng(zlib.crc32(f"tile128 {spec} {n} {k}".encode()))
    desc, w64 = make_weight(rng, spec, n, k)
    x = _wide_range_x(rng, 1100, k)
    t128, t64 = (core.OpBench("cuda", {"gemm_x_rows": True, "gemm_tile128": t}) for t in (True, False))
    got = _run(t128, desc, x, "prefill")
    # The report holds the variant of the shape's latest run: read it before the 7-row run replaces it.
    names = [v.split(":")[0] for key, v in _variants(t128.report()).items() if key.startswith("matmul.prefill.")]
    assert any("_m128" in nm for nm in names), names
    ref = _run(cpu, desc, x, "prefill").astype(np.float64)
    worst = float((np.abs(got.astype(np.float64) - ref) / w_f16_bound(x, desc, w64)).max())
    assert worst <= 1.0, f"{spec} [{n}, {k}]: error {worst:.3g} of the f16-weight bound"
    np.testing.assert_array_equal(got.view(np.uint32), _run(t64, desc, x, "prefill").view(np.uint32))
    np.testing.assert_array_equal(got[:7].view(np.uint32), _run(t128, desc, x[:7], "prefill").view(np.uint32))
    assert not any("_m128" in v for v in _variants(t64.report()).values())


@pytest.mark.parametrize("spec,n,k", [("q4g64-bf16", 8192, 2048), ("q8g64-f16", 8320, 192), ("q4g32-f32", 8200, 1056),
                                      ("q4g64-bf16", 300, 4096)])
def test_gemm_w_double_same_bits(spec, n, k):
    """gemm_w_double (two alternating W tiles, one barrier per K block): the single tile's bits at every tile height
    (1,100 rows of >= 8,192 outputs: 128; 130 rows: 64; 7 rows: 16), over an even (32, 64) and an odd (3, 17 with a
    partial last) number of K blocks, on rows past f16's range; the report names the form. A missing barrier or a
    tile written while another warp still reads it changes bits."""
    rng = np.random.default_rng(zlib.crc32(f"wdouble {spec} {n} {k}".encode()))
    desc, _ = make_weight(rng, spec, n, k)
    on, off = (core.OpBench("cuda", {"gemm_x_rows": True, "gemm_w_double": d}) for d in (True, False))
    for t in (1100, 130, 7):
        x = _wide_range_x(rng, t, k)
        got = _run(on, desc, x, "prefill")
        assert np.isfinite(got).all()
        names = [v.split(":")[0] for key, v in _variants(on.report()).items() if key.startswith("matmul.prefill.")]
        assert names and all(nm.endswith("_wdb") for nm in names), names
        np.testing.assert_array_equal(got.view(np.uint32), _run(off, desc, x, "prefill").view(np.uint32),
                                      err_msg=f"{spec} [{n}, {k}] T={t}")
        np.testing.assert_array_equal(got.view(np.uint32), _run(on, desc, x, "prefill").view(np.uint32))
    assert not any("_wdb" in v for v in _variants(off.report()).values())


def test_gemm_x_rows_group_and_ops():
    """One pre-pass serves every product of a matmuls group (the slot holds this op's x): each part has the bits of
    its own matmul; a following op with another x of the same shape gets its own rows, not the group's."""
    rng = np.random.default_rng(zlib.crc32(b"x rows group"))
    descs = [make_weight(rng, "q4g64-bf16", n, 2048)[0] for n in (256, 600, 1)]
    x, x2 = make_x(rng, 70, 2048), make_x(rng, 70, 2048)
    b = core.OpBench("cuda", {"gemm_x_rows": True})
    outs = _run_group(b, descs, x, "prefill")
    for d, o in zip(descs, outs):
        np.testing.assert_array_equal(o[1:71].view(np.uint32), _run(b, d, x, "prefill").view(np.uint32))
    again = _run_group(b, descs, x2, "prefill")
    for d, o in zip(descs, again):
        np.testing.assert_array_equal(o[1:71].view(np.uint32), _run(b, d, x2, "prefill").view(np.uint32))
    assert not np.array_equal(outs[0], again[0])
