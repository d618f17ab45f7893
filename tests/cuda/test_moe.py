"""The CUDA MoE family (csrc/cuda/kernels/moe.cu) against the CPU oracle (csrc/cpu/moe.cpp) through OpBench.

moe_route: ids must equal the CPU's exactly (random logits, and logits with exact ties, which both break
toward the lower id); the weights within 1e-6 (the GPU's softmax sum is a warp tree and its expf is within
2 ulp of libm's, so p differs by a few ulp). moe_experts, decode: fp32 accumulation in another order than
the CPU (per 16-byte vector partials, warp trees), and for 4/8-bit experts x and act as three int8 terms with
dp4a products (quant.cuh, ~1e-7): 1e-5 relative (‖gpu − cpu‖ / ‖cpu‖); the dp4a and fp32 forms within 1e-6. Prefill runs
on tensor cores (bf16 MMAs, fp32 accumulation) with the weights exact (affine codes, scales and biases
applied per group in fp32; dense bf16 as stored; dense f16/f32 as hi + lo bf16) and the activations x and
act as two bf16 terms hi + lo (residual ≤ 2^-17 relative per element): a numpy emulation of that scheme at
the real shape gives 3.9e-6 (the former f16 operands gave 4.7e-4), so prefill is asserted ≤ 2e-5 (5x
margin for the tensor cores' accumulation order and the awkward shapes' shorter sums). Prefill is also
checked bit for bit independent of T and of the tile size (the T = 7 call equals the first rows of a
T = 80 call): each output element accumulates its K steps in one order whatever the tiles.
Outputs live in poisoned tensors with a guard row on each side that must stay NaN.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import lily._core as core
from cuda_util import rel_err, requires_cuda

pytestmark = requires_cuda

REAL = dict(E=256, k=8, H=2048, I=512)


def config(E: int, k: int, H: int, I: int) -> dict:
    """ModelConfig.to_core() of Qwen3.6-35B-A3B with the MoE dims replaced (and a small vocab/depth)."""
    return {
        "hidden": H, "layers": 4, "vocab": 1024, "eps": 1e-6, "heads": 16, "kv_heads": 2, "head_dim": 256,
        "rotary_dim": 64, "rope_theta": 1e7, "lin_k_heads": 16, "lin_v_heads": 32, "lin_k_dim": 128,
        "lin_v_dim": 128, "conv_kernel": 4, "experts": E, "topk": k, "moe_inter": I, "shared_inter": I,
        "full_attention": [False, False, False, True],
    }


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def bf16_bits(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def stored(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return bf16_bits(a)
    if dtype == "f16":
        return a.astype(np.float16)
    return a.astype(np.float32)


def stacked(rng, spec: str, E: int, n: int, k: int) -> dict:
    """E matrices [n, k] back to back. spec 'q4g64-bf16' (MLX affine: random uint32 words = random codes,
    scales of both signs, biases) or 'bf16' / 'f16' / 'f32' dense."""
    if spec.startswith("q"):
        q, sd = spec.split("-")
        bits, group = (int(v) for v in q[1:].split("g"))
        words = rng.integers(0, 2**32, size=(E * n, k * bits // 32), dtype=np.uint32)
        ng = k // group
        scales = rng.uniform(0.002, 0.03, size=(E * n, ng)) * rng.choice([-1.0, 1.0], size=(E * n, ng))
        biases = rng.normal(0.0, 0.1, size=(E * n, ng))
        return {"kind": "affine", "bits": bits, "group": group, "scale_dtype": sd, "shape": (n, k),
                "experts": E, "data": words, "scales": stored(scales, sd), "biases": stored(biases, sd)}
    data = stored(rng.normal(0.0, 0.1, size=(E * n, k)), spec)
    return {"kind": "dense", "dtype": spec, "shape": (n, k), "experts": E, "data": data}


def signed(rng, t: int, n: int, lo: float = 0.1, hi: float = 1.0) -> np.ndarray:
    """Bounded away from zero, both signs (zeros hide lane and permutation mistakes)."""
    return (rng.uniform(lo, hi, size=(t, n)) * rng.choice([-1.0, 1.0], size=(t, n))).astype(np.float32)


def routing(rng, T: int, E: int, k: int):
    """ids: k distinct experts per token; expert 1 in every token, expert 0 in none (when E > k + 1)."""
    ids = np.empty((T, k), dtype=np.int32)
    for t in range(T):
        if E > k + 1:
            rest = rng.permutation(np.arange(2, E))[: k - 1]
            row = np.concatenate([[1], rest])
        else:
            row = rng.permutation(E)[:k]
        ids[t] = rng.permutation(row)
    w = rng.uniform(0.05, 1.0, size=(T, k))
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# moe_route
# ------------------------------------------------------------------------------------------------


def run_route(benches, logits: np.ndarray, k: int, E: int):
    T = logits.shape[0]
    res = []
    for b in benches:
        ids, w = b.empty(T + 2, k, "i32"), b.empty(T + 2, k)
        b.run("moe_route", phase="prefill" if T > 1 else "decode", logits=b.tensor(logits), k=k,
              ws=b.workspace(config(E, k, 2048, 512), T, 16), ids=b.view(ids, 1, T), weights=b.view(w, 1, T))
        res.append((b.read(ids), b.read(w)))
    (ci, cw), (gi, gw) = res
    assert (gi[0] == 0x7F7F7F7F).all() and (gi[-1] == 0x7F7F7F7F).all(), "moe_route wrote outside its view"
    assert np.isnan(gw[0]).all() and np.isnan(gw[-1]).all(), "moe_route wrote outside its view"
    return ci[1:-1], cw[1:-1], gi[1:-1], gw[1:-1]


@pytest.mark.parametrize("E,k", [(256, 8), (12, 3), (512, 16)])
@pytest.mark.parametrize("T", [1, 7, 130])
def test_route_random(benches, E, k, T):
    rng = np.random.default_rng(E * 1000 + T)
    # Distinct logits at least 0.6 grid steps apart (a random permutation of a jittered grid over [-6, 6]):
    # well posed, since adjacent probabilities then differ by ≥ 1.4 %, far above the GPU's few ulp in p.
    step = 12.0 / (E - 1)
    grid = np.linspace(-6.0, 6.0, E) + rng.uniform(-0.2, 0.2, size=(T, E)) * step
    logits = np.stack([rng.permutation(row) for row in grid]).astype(np.float32)
    ci, cw, gi, gw = run_route(benches, logits, k, E)
    np.testing.assert_array_equal(gi, ci, err_msg="moe_route ids differ from the CPU")
    assert rel_err(gw, cw) < 2e-6, "moe_route weights beyond fp32 rounding of the CPU's"
    np.testing.assert_allclose(gw.sum(axis=1), 1.0, atol=1e-6, err_msg="weights not renormalised (§12.13)")


@pytest.mark.parametrize("E,k", [(256, 8), (12, 3)])
@pytest.mark.parametrize("T", [1, 7, 130])
def test_route_exact_ties(benches, E, k, T):
    """Logits on a coarse grid: many exact ties across the top-k boundary and inside the top k. Both
    backends break them toward the lower id and list the slots in the same order."""
    rng = np.random.default_rng(7 * E + T)
    logits = (rng.integers(0, 5, size=(T, E)) * 0.5).astype(np.float32)
    logits[:, E // 2] = logits[:, 3]  # at least one tie pair in every row
    ci, cw, gi, gw = run_route(benches, logits, k, E)
    np.testing.assert_array_equal(gi, ci, err_msg="moe_route tie order differs from the CPU")
    assert rel_err(gw, cw) < 2e-6


# ------------------------------------------------------------------------------------------------
# moe_experts
# ------------------------------------------------------------------------------------------------


_WEIGHTS: dict = {}


def weights_for(benches, spec: str, E: int, k: int, H: int, I: int):
    """Stacked gate, up [E, I, H] and down [E, H, I], registered once per bench pair and case (the real
    q4 stack is 453 MB; the module's benches keep what they registered). The entry holds the benches themselves, so
    their ids cannot be reused by a later test's benches while it exists (a stale entry would hand those benches
    another bench's weight handles)."""
    key = (tuple(id(b) for b in benches), spec, E, k, H, I)
    if key not in _WEIGHTS:
        rng = np.random.default_rng(zlib.crc32(f"{spec} {E} {H} {I}".encode()))
        descs = (stacked(rng, spec, E, I, H), stacked(rng, spec, E, I, H), stacked(rng, spec, E, H, I))
        _WEIGHTS[key] = (tuple(benches), [tuple(b.weight(d) for d in descs) for b in benches])
    return _WEIGHTS[key][1]


def run_experts(benches, handles, phase: str, x, ids, w, E, k, H, I):
    T = x.shape[0]
    outs = []
    for b, (g, u, d) in zip(benches, handles):
        out = b.empty(T + 2, H)
        b.run("moe_experts", phase=phase, x=b.tensor(x), ids=b.tensor(ids, "i32"), weights=b.tensor(w),
              gate=g, up=u, down=d, ws=b.workspace(config(E, k, H, I), T, 16), out=b.view(out, 1, T))
        outs.append(b.read(out))
    cpu, gpu = outs
    assert np.isnan(gpu[0]).all() and np.isnan(gpu[-1]).all(), "moe_experts wrote outside its view"
    assert np.isfinite(gpu[1:-1]).all(), "moe_experts left outputs unwritten (NaN poison) or overflowed"
    return cpu[1:-1], gpu[1:-1]


def token_inputs(seed: int, E: int, k: int, H: int, T: int):
    rng = np.random.default_rng(seed)
    ids, w = routing(rng, T, E, k)
    return signed(rng, T, H), ids, w


EXPERT_CASES = [
    # (spec, E, k, H, I): the real shapes (MLX q4g64 bf16 scales; bf16 HF weights with fewer experts to
    # keep the stack small), then awkward ones a checkpoint can have (affine: H and inter multiples of the
    # group, which the CPU requires): odd E and k; H 192 / 448 (1.5 / 3.5 of the down GEMM's 128-column
    # tiles; 6 q4 vectors per row, fewer than the 32 lanes of the decode GEMV); inter 320 (5 K blocks of
    # the down GEMM); 8-bit codes with f16 scales; group 32 with f32 scales and inter 160 (a half K block);
    # dense bf16 / f16 at inter 96 (not a multiple of the 64-wide tiles: N tail of gate/up, K tail of
    # down); dense f32 at H 100, inter 36 (K tails inside a k16 step).
    ("q4g64-bf16", 256, 8, 2048, 512),
    ("bf16", 32, 8, 2048, 512),
    ("q4g64-bf16", 5, 3, 192, 320),
    ("q8g64-f16", 7, 3, 448, 192),
    ("q4g32-f32", 12, 3, 256, 160),
    ("bf16", 5, 3, 192, 96),
    ("f16", 5, 3, 192, 96),
    ("f32", 3, 1, 100, 36),
]

PREFILL_TOL = 2e-5  # see the module docstring: ~4e-6 expected
# prefill_x = "f16" (the default): x and act as one f16 term each, u = 2^-12 per rounding after the power-of-two
# scale, entering 3 times (x for gate and up, act for down).
F16_TOL = 4 * 2.0 ** -12
# The same-bits tests below run under both activation forms, each held to its own CPU tolerance.
X_FORMS = {"f16": F16_TOL, "bf16x2": PREFILL_TOL}


@pytest.mark.parametrize("spec,E,k,H,I", EXPERT_CASES)
def test_experts_decode(benches, spec, E, k, H, I):
    handles = weights_for(benches, spec, E, k, H, I)
    for T in (1, 2):
        x, ids, w = token_inputs(11 + T, E, k, H, T)
        cpu, gpu = run_experts(benches, handles, "decode", x, ids, w, E, k, H, I)
        err = rel_err(gpu, cpu)
        assert err < 1e-5, f"decode {spec} E={E} H={H} I={I} T={T}: relative error {err:.3g} (fp32 path)"


@pytest.mark.parametrize("spec,E,k,H,I", EXPERT_CASES)
def test_experts_prefill(benches, spec, E, k, H, I):
    handles = weights_for(benches, spec, E, k, H, I)
    for T in (1, 2, 33, 130):
        x, ids, w = token_inputs(23 + T, E, k, H, T)
        cpu, gpu = run_experts(benches, handles, "prefill", x, ids, w, E, k, H, I)
        err = rel_err(gpu, cpu)
        assert err < PREFILL_TOL, f"prefill {spec} E={E} H={H} I={I} T={T}: relative error {err:.3g}"


@pytest.mark.parametrize("form", list(X_FORMS))
def test_experts_prefill_tiles_and_T(form):
    """T·k/E ≥ 20 selects 32-row fragment tiles (q4, real H and inter, 16 experts, 80 tokens: 40 rows per expert),
    T = 7 16-row tiles. A token's output must not depend on the other tokens of the call or the tile size
    (chunked prefill equals one prefill bit for bit): the T = 7 call equals the first 7 rows of T = 80."""
    E, k, H, I = 16, 8, 2048, 512
    benches = core.OpBench("cpu"), core.OpBench("cuda", {"prefill_x": form, "moe_w_f16": False})
    handles = weights_for(benches, "q4g64-bf16", E, k, H, I)
    x, ids, w = token_inputs(5, E, k, H, 80)
    cpu, full = run_experts(benches, handles, "prefill", x, ids, w, E, k, H, I)
    assert rel_err(full, cpu) < X_FORMS[form]
    assert "32-row tiles" in str(benches[1].report())
    _, part = run_experts(benches, handles, "prefill", x[:7], ids[:7], w[:7], E, k, H, I)
    assert "16-row tiles" in str(benches[1].report())
    np.testing.assert_array_equal(part.view(np.uint32), full[:7].view(np.uint32))


# The affine cases above (the real shape; inter 320: 5 K blocks of the down pass, a 2-stage ring wraps; 8-bit codes
# with f16 scales and 7 groups per gate/up row: the scale words' halves alternate between rows; group 32 with f32
# scales: two group parts per K block) and group 128 (a group spans two K blocks).
RING_CASES = [c for c in EXPERT_CASES if c[0].startswith("q")] + [("q4g128-bf16", 6, 2, 256, 384)]


@pytest.mark.parametrize("form", list(X_FORMS))
@pytest.mark.parametrize("spec,E,k,H,I", RING_CASES)
def test_experts_prefill_ring_same_bits(spec, E, k, H, I, form):
    """The cp.async ring (moe_pipe 2, 3, 4 stages; 64-row tiles, T·k/E ≥ moe_tile64_rows = 32) converts and
    multiplies what the register path (moe_pipe = 0) does: the same bits, equal to the 16-row tiles' (T = 7: the
    first rows), within the prefill tolerance of the CPU, and the report names the ring."""
    benches = [core.OpBench("cpu")] + [core.OpBench("cuda", {"moe_pipe": p, "moe_tile64_rows": 32, "prefill_x": form,
                                                             "moe_w_f16": False}) for p in (0, 2, 3, 4)]
    rng = np.random.default_rng(zlib.crc32(f"ring {spec} {E} {H} {I}".encode()))
    descs = (stacked(rng, spec, E, I, H), stacked(rng, spec, E, I, H), stacked(rng, spec, E, H, I))
    handles = [tuple(b.weight(d) for d in descs) for b in benches]
    big = max(80, -(-32 * E // k))
    x, ids, w = token_inputs(41 + big, E, k, H, big)
    cpu, ref = run_experts(benches[:2], handles[:2], "prefill", x, ids, w, E, k, H, I)
    assert rel_err(ref, cpu) < X_FORMS[form], spec
    assert "64-row tiles" in str_variants_experts(benches[1].report())
    for p, b, h in zip((2, 3, 4), benches[2:], handles[2:]):
        _, gpu = run_experts((b, b), (h, h), "prefill", x, ids, w, E, k, H, I)
        np.testing.assert_array_equal(gpu.view(np.uint32), ref.view(np.uint32))
        assert f"cp.async ring of {p} K blocks" in str_variants_experts(b.report())
    assert "register prefetch one K block ahead (moe_pipe = 0)" in str_variants_experts(benches[1].report())
    # 16-row tiles (moe_frag's form or the shared bf16 tile, whatever moe_pipe says): the first 7 rows, the same bits.
    _, part = run_experts(benches[3:5], handles[3:5], "prefill", x[:7], ids[:7], w[:7], E, k, H, I)
    np.testing.assert_array_equal(part.view(np.uint32), ref[:7].view(np.uint32))
    assert "16-row tiles" in str_variants_experts(benches[4].report())


@pytest.mark.parametrize("form", list(X_FORMS))
@pytest.mark.parametrize("spec,E,k,H,I", RING_CASES)
def test_experts_prefill_frag_same_bits(spec, E, k, H, I, form):
    """moe_frag (16-row tiles, T·k/E < 32: each warp widens its 4-bit codes into B fragments in registers, the K
    blocks through a ring of 3 or 6 stages) multiplies what the shared bf16 weight tile (moe_frag = 0) does: the same
    bits, within the prefill tolerance of the CPU, at T = 1, 7 and the most 16-row tokens; 8-bit experts keep the
    shared tile, and the reports say which form ran."""
    benches = [core.OpBench("cpu")] + [core.OpBench("cuda", {"moe_frag": f, "prefill_x": form, "moe_w_f16": False})
                                       for f in (0, 3, 6)]
    rng = np.random.default_rng(zlib.crc32(f"frag {spec} {E} {H} {I}".encode()))
    descs = (stacked(rng, spec, E, I, H), stacked(rng, spec, E, I, H), stacked(rng, spec, E, H, I))
    handles = [tuple(b.weight(d) for d in descs) for b in benches]
    four_bit = spec.startswith("q4")
    for T in (1, 7, min(300, (32 * E - 1) // k)):  # the last: expert 1 (in every token) spans many 16-row tiles
        x, ids, w = token_inputs(59 + T, E, k, H, T)
        cpu, ref = run_experts(benches[:2], handles[:2], "prefill", x, ids, w, E, k, H, I)
        assert rel_err(ref, cpu) < X_FORMS[form], (spec, T)
        assert "16-row tiles" in str_variants_experts(benches[1].report())
        assert "shared bf16 weight tile, register prefetch one K block ahead (moe_frag = 0)" in \
            str_variants_experts(benches[1].report())
        for f, b, h in zip((3, 6), benches[2:], handles[2:]):
            _, gpu = run_experts((b, b), (h, h), "prefill", x, ids, w, E, k, H, I)
            np.testing.assert_array_equal(gpu.view(np.uint32), ref.view(np.uint32), err_msg=f"{spec} T={T} frag={f}")
            text = str_variants_experts(b.report())
            if four_bit:
                assert f"B fragments in registers, no bf16 weight tile; a cp.async ring of {f} K blocks" in text, text
            else:
                assert "shared bf16 weight tile, register prefetch one K block ahead (8-bit codes)" in text, text


@pytest.mark.parametrize("form", list(X_FORMS))
@pytest.mark.parametrize("spec,E,k,H,I", [c for c in RING_CASES if c[0].startswith("q4")])
def test_experts_prefill_frag32_same_bits(spec, E, k, H, I, form):
    """The fragment tiles of 32 rows (moe_frag32_rows: two m16 tiles per warp on the same widened codes, the second
    skipped when a tile has at most 16 rows) and of 64 rows (moe_frag64_rows: four, the idle ones skipped) multiply
    what the 16-row fragment tiles, the shared bf16 tile and the 64-row shared tiles do: the same bits, within the
    prefill tolerance of the CPU. Expert 1 is in every token, so it spans several 32 / 64-row tiles with a short last
    one; the others hold 1-16, 17-32 or 33-64 rows by T. The reports name the height."""
    opts = {"frag16": {"moe_frag32_rows": 1024}, "frag32": {"moe_frag32_rows": 1}, "shared16": {"moe_frag": 0},
            "tile64": {"moe_tile64_rows": 1}, "frag64": {"moe_frag64_rows": 1}}
    benches = [core.OpBench("cpu")] + [core.OpBench("cuda", {**o, "prefill_x": form, "moe_w_f16": False})
                                       for o in opts.values()]
    rng = np.random.default_rng(zlib.crc32(f"frag32 {spec} {E} {H} {I}".encode()))
    descs = (stacked(rng, spec, E, I, H), stacked(rng, spec, E, I, H), stacked(rng, spec, E, H, I))
    handles = [tuple(b.weight(d) for d in descs) for b in benches]
    for T in (1, 20, 45, min(300, (32 * E - 1) // k)):
        x, ids, w = token_inputs(83 + T, E, k, H, T)
        counts = np.bincount(ids.ravel(), minlength=E)
        cpu, ref = run_experts(benches[:2], handles[:2], "prefill", x, ids, w, E, k, H, I)
        assert rel_err(ref, cpu) < X_FORMS[form], (spec, T)
        assert "16-row tiles" in str_variants_experts(benches[1].report())
        for name, b, h in zip(list(opts)[1:], benches[2:], handles[2:]):
            _, gpu = run_experts((b, b), (h, h), "prefill", x, ids, w, E, k, H, I)
            np.testing.assert_array_equal(gpu.view(np.uint32), ref.view(np.uint32),
                                          err_msg=f"{spec} T={T} {name} rows per expert {counts.tolist()}")
        if T * k >= E:  # T·k/E ≥ 1: the options' thresholds
            text = str_variants_experts(benches[2].report())
            assert "32-row tiles (T·k/E ≥ 1: a second m16 tile" in text, text
            assert "64-row tiles (T·k/E ≥ 1, moe_tile64_rows)" in str_variants_experts(benches[4].report())
            text = str_variants_experts(benches[5].report())
            assert "64-row tiles (T·k/E ≥ 1, moe_frag64_rows: four m16 tiles" in text, text
            assert "B fragments in registers" in text and "2 blocks per SM" in text, text
        else:
            assert "16-row tiles" in str_variants_experts(benches[2].report())
    with pytest.raises(ValueError, match="moe_frag32_rows"):
        core.OpBench("cuda", {"moe_frag32_rows": 0})
    for bad in (-1, (1 << 20) + 1, 2.5):
        with pytest.raises(ValueError, match="moe_frag64_rows"):
            core.OpBench("cuda", {"moe_frag64_rows": bad})


@pytest.mark.parametrize("spec,E,k,H,I", [c for c in RING_CASES if c[0].startswith("q4")])
def test_experts_prefill_frag64_f16_forms_same_bits(spec, E, k, H, I):
    """The default f16 forms (moe_w_f16, moe_x_rows: the weights dequantized in registers, x and act as pre-scaled f16
    rows, each row's 2^-e in the epilogue) on 64-row fragment tiles: the bits of the 32-row tiles, at heights that
    leave 1, 2, 3 and 4 of a tile's m16 tiles holding rows; the report names the height."""
    pair = [core.OpBench("cuda", {"moe_frag32_rows": 1, "moe_frag64_rows": r}) for r in (0, 1)]
    rng = np.random.default_rng(zlib.crc32(f"frag64 {spec} {E} {H} {I}".encode()))
    descs = (stacked(rng, spec, E, I, H), stacked(rng, spec, E, I, H), stacked(rng, spec, E, H, I))
    handles = [tuple(b.weight(d) for d in descs) for b in pair]
    for T in (9, 40, 61, 150):
        x, ids, w = token_inputs(91 + T, E, k, H, T)  # expert 1 in every token: 64-row tiles holding 1-4 m16 tiles
        outs = [run_experts((b, b), (h, h), "prefill", x, ids, w, E, k, H, I)[1] for b, h in zip(pair, handles)]
        np.testing.assert_array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32), err_msg=f"{spec} T={T}")
        if T * k >= E:
            assert "32-row tiles" in str_variants_experts(pair[0].report())
            text = str_variants_experts(pair[1].report())
            assert "64-row tiles (T·k/E ≥ 1, moe_frag64_rows" in text and "x and act as f16 rows" in text, text


W_F16_TOL = 8 * 2.0 ** -12  # x, act and the three weights each rounded once to f16


@pytest.mark.parametrize("x_rows", [False, True], ids=["x_part_scales", "x_rows"])
@pytest.mark.parametrize("spec,E,k,H,I", [c for c in EXPERT_CASES if c[0] in ("q4g64-bf16", "q4g32-f32")])
def test_experts_prefill_w_f16(one_term_benches, spec, E, k, H, I, x_rows):
    """moe_w_f16 (on by default): the fragment tiles with the experts'
    weights dequantized to f16 in registers stay within the tolerance of their roundings (x, act and the weights each
    rounded once) on tokens past f16's range and of subnormal size, are not the codes path's bits (the option took
    effect), are deterministic, and give a token the same bits whatever the call (T = 7 = the first 7 rows of T = 80).
    The same with the GEMMs' x and act as f16 rows scaled once per row (moe_x_rows, the default), which are not the
    part scales' bits."""
    pair = (one_term_benches["f16"][0],
            core.OpBench("cuda", {"prefill_x": "f16", "moe_w_f16": True, "moe_x_rows": x_rows}))
    handles = weights_for(pair, spec, E, k, H, I)
    x, ids, w = token_inputs(37, E, k, H, 80)
    x[0] *= 3e5
    x[1] *= 1e-9
    cpu, gpu = run_experts(pair, handles, "prefill", x, ids, w, E, k, H, I)
    text = str_variants_experts(pair[1].report())
    assert "the experts' weights dequantized to f16 (s·q + b) in registers" in text, text
    assert ("x and act as f16 rows scaled by 2^e per row by pre-passes" in text) == x_rows, text
    if x_rows:
        parts = (pair[0], core.OpBench("cuda", {"prefill_x": "f16", "moe_w_f16": True, "moe_x_rows": False}))
        _, by_part = run_experts(parts, weights_for(parts, spec, E, k, H, I), "prefill", x, ids, w, E, k, H, I)
        assert not np.array_equal(gpu.view(np.uint32), by_part.view(np.uint32)), "moe_x_rows did not change the GEMM"
    err = rel_err(gpu, cpu)
    assert err < W_F16_TOL, f"moe_w_f16 {spec} E={E}: relative error {err:.3g}"
    for t in (0, 1):
        assert rel_err(gpu[t], cpu[t]) < W_F16_TOL, (t, rel_err(gpu[t], cpu[t]))
    codes_pair = one_term_benches["f16"]
    _, codes = run_experts(codes_pair, weights_for(codes_pair, spec, E, k, H, I), "prefill", x, ids, w, E, k, H, I)
    assert not np.array_equal(gpu.view(np.uint32), codes.view(np.uint32)), "moe_w_f16 did not change the GEMMs"
    _, again = run_experts(pair, handles, "prefill", x, ids, w, E, k, H, I)
    np.testing.assert_array_equal(again.view(np.uint32), gpu.view(np.uint32))
    _, part = run_experts(pair, handles, "prefill", x[:7], ids[:7], w[:7], E, k, H, I)
    np.testing.assert_array_equal(part.view(np.uint32), gpu[:7].view(np.uint32))


def str_variants_experts(report) -> str:
    if isinstance(report, dict):
        if "moe.experts.prefill" in report:
            return report["moe.experts.prefill"]
        for v in report.values():
            found = str_variants_experts(v)
            if found:
                return found
    return ""


@pytest.fixture(scope="module")
def fp32_benches():
    return core.OpBench("cpu"), core.OpBench("cuda", {"gemv_dp4a": False})


@pytest.mark.parametrize("spec,E,k,H,I", [c for c in EXPERT_CASES if c[0].startswith("q")])
def test_experts_decode_dp4a_matches_the_fp32_form(benches, fp32_benches, spec, E, k, H, I):
    """Decode's default for 4/8-bit experts takes x and act as three int8 terms with dp4a dot products
    (quant.cuh): within 1e-6 of the fp32 form (each is ~1e-7 from exact; a lost third term gives ~1e-5), and the
    report names which ran."""
    dp, fp = weights_for(benches, spec, E, k, H, I), weights_for(fp32_benches, spec, E, k, H, I)
    for T in (1, 2):
        x, ids, w = token_inputs(31 + T, E, k, H, T)
        _, got = run_experts(benches, dp, "decode", x, ids, w, E, k, H, I)
        _, ref = run_experts(fp32_benches, fp, "decode", x, ids, w, E, k, H, I)
        err = rel_err(got, ref)
        assert err < 1e-6, f"decode dp4a vs fp32 {spec} E={E} H={H} I={I} T={T}: {err:.3g}"
    assert "three int8 terms per 16-byte vector, dp4a" in str(benches[1].report())
    assert "fp32 x and act (gemv_dp4a=False)" in str(fp32_benches[1].report())


@pytest.mark.parametrize("spec,E,k,H,I,T", [("q4g64-bf16", 5, 3, 192, 320, 1500), ("q4g64-bf16", 256, 8, 192, 320, 300),
                                            ("q8g64-f16", 7, 3, 448, 192, 342), ("q4g32-f32", 12, 3, 256, 160, 700)])
def test_experts_prefill_group_blocks_same_bits(spec, E, k, H, I, T):
    """moe_group_blocks splits the prefill grouping of more than 1024 (token, expert) pairs over a block per 1024-pair
    chunk: the same tile map and row order as the single block, so the experts' output is its bit for bit (expert 1
    is in every token, so its rows cross every chunk; 342 x 3 leaves a last chunk of 2 pairs), near the CPU's, and
    the report says which ran."""
    cpu = core.OpBench("cpu")
    split = (cpu, core.OpBench("cuda", {"moe_group_blocks": True}))
    single = (cpu, core.OpBench("cuda", {"moe_group_blocks": False}))
    x, ids, w = token_inputs(91 + T, E, k, H, T)
    ref_cpu, got = run_experts(split, weights_for(split, spec, E, k, H, I), "prefill", x, ids, w, E, k, H, I)
    _, ref = run_experts(single, weights_for(single, spec, E, k, H, I), "prefill", x, ids, w, E, k, H, I)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert rel_err(got, ref_cpu) < 1e-2, rel_err(got, ref_cpu)  # garbage check; the tolerances are the tests' above
    chunks = -(-T * k // 1024)
    assert f"{chunks} chunks; moe_group_blocks" in str_variants_experts(split[1].report())
    assert "moe_group_blocks" not in str_variants_experts(single[1].report())


def test_experts_variants_reported(benches):
    E, k, H, I = 5, 3, 192, 320
    handles = weights_for(benches, "q4g64-bf16", E, k, H, I)
    x, ids, w = token_inputs(9, E, k, H, 1)
    run_experts(benches, handles, "decode", x, ids, w, E, k, H, I)
    run_experts(benches, handles, "prefill", x, ids, w, E, k, H, I)
    rep = str(benches[1].report())
    assert "moe_gate_up_decode" in rep and "moe_down_decode" in rep, rep
    assert "moe_gate_up_mma" in rep and "16-byte loads" in rep, rep
    assert "x as hi + lo bf16" in rep and "exact codes" in rep, rep


# ------------------------------------------------------------------------------------------------
# swiglu, moe_combine
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,C", [(1, 512), (7, 96), (130, 2048), (3, 37)])
def test_swiglu(benches, T, C):
    rng = np.random.default_rng(T * C)
    g, u = signed(rng, T + 1, C, 0.1, 6.0), signed(rng, T + 1, C)
    res = []
    for b in benches:
        out = b.empty(T + 2, C)
        # Views one row in: C = 37 also leaves the rows unaligned for float4 (the scalar variant).
        b.run("swiglu", gate=b.view(b.tensor(g), 1, T), up=b.view(b.tensor(u), 1, T), out=b.view(out, 1, T))
        res.append(b.read(out))
    cpu, gpu = res
    assert np.isnan(gpu[0]).all() and np.isnan(gpu[-1]).all()
    assert rel_err(gpu[1:-1], cpu[1:-1]) < 1e-6, "swiglu beyond expf's few-ulp difference"


@pytest.mark.parametrize("T,C", [(1, 2048), (7, 96), (130, 2048), (3, 37)])
def test_moe_combine(benches, T, C):
    rng = np.random.default_rng(T + C)
    r, s, h0 = signed(rng, T, C), signed(rng, T, C), signed(rng, T + 2, C)
    sg = rng.normal(0.0, 2.0, size=(T, 1)).astype(np.float32)
    res = []
    for b in benches:
        h = b.tensor(h0)
        b.run("moe_combine", routed=b.tensor(r), shared=b.tensor(s), shared_gate_logit=b.tensor(sg),
              h=b.view(h, 1, T))
        res.append(b.read(h))
    cpu, gpu = res
    np.testing.assert_array_equal(gpu[0], h0[0])
    np.testing.assert_array_equal(gpu[-1], h0[-1])
    assert rel_err(gpu, cpu) < 1e-6


# ------------------------------------------------------------------------------------------------
# moe: the whole block after the router product (fused in decode: routing in-kernel, the shared expert as
# one more slot, the combine and the residual in the down pass)
# ------------------------------------------------------------------------------------------------


def run_block(benches, handles, shared_handles, phase, x, logits, sg, h0, E, k, H, I, Ish):
    T = x.shape[0]
    res = []
    for b, (g, u, d), (sgp, su, sd) in zip(benches, handles, shared_handles):
        h = b.tensor(h0)
        ids, wts = b.empty(T, k, "i32"), b.empty(T, k)
        b.run("moe", phase=phase, x=b.tensor(x), router_logits=b.tensor(logits), shared_gate_logit=b.tensor(sg), k=k,
              gate=g, up=u, down=d, shared_gate_proj=sgp, shared_up=su, shared_down=sd,
              ids=ids, weights=wts, routed=b.empty(T, H), shared_g=b.empty(T, Ish), shared_u=b.empty(T, Ish),
              shared_act=b.empty(T, Ish), shared=b.empty(T, H), ws=b.workspace(config(E, k, H, I), T, 16),
              h=b.view(h, 1, T))
        res.append((b.read(h), b.read(ids), b.read(wts)))
    return res


BLOCK_CASES = [
    # (spec, E, k, H, I, shared inter): the real shapes (fused in decode), awkward fused ones, and a shared
    # expert wider than the routed ones (composed in decode too, reported).
    ("q4g64-bf16", 256, 8, 2048, 512, 512),
    ("q4g64-bf16", 5, 3, 192, 320, 320),
    ("q8g64-f16", 7, 3, 448, 192, 192),
    ("bf16", 12, 4, 192, 96, 96),
    ("q4g64-bf16", 12, 3, 256, 128, 192),
]


@pytest.mark.parametrize("spec,E,k,H,I,Ish", BLOCK_CASES)
def test_moe_block(benches, spec, E, k, H, I, Ish):
    handles = weights_for(benches, spec, E, k, H, I)
    rng = np.random.default_rng(zlib.crc32(f"block {spec} {E} {Ish}".encode()))
    sdescs = (stacked(rng, spec, 1, Ish, H), stacked(rng, spec, 1, Ish, H), stacked(rng, spec, 1, H, Ish))
    for dsc in sdescs:
        dsc.pop("experts")
    shared = [tuple(b.weight(dsc) for dsc in sdescs) for b in benches]
    for phase, ts in (("decode", (1, 2)), ("prefill", (1, 33))):
        for T in ts:
            x = signed(rng, T, H)
            step = 12.0 / (E - 1)  # distinct logits, well separated (see test_route_random)
            grid = np.linspace(-6.0, 6.0, E) + rng.uniform(-0.2, 0.2, size=(T, E)) * step
            logits = np.stack([rng.permutation(row) for row in grid]).astype(np.float32)
            sg = rng.normal(0.0, 2.0, size=(T, 1)).astype(np.float32)
            h0 = signed(rng, T + 2, H)
            (ch, ci, cw), (gh, gi, gw) = run_block(benches, handles, shared, phase, x, logits, sg, h0, E, k, H, I, Ish)
            np.testing.assert_array_equal(gh[0], h0[0])
            np.testing.assert_array_equal(gh[-1], h0[-1])
            np.testing.assert_array_equal(gi, ci, err_msg="routing differs from the CPU")
            assert rel_err(gw, cw) < 2e-6
            tol = 1e-5 if phase == "decode" else PREFILL_TOL
            # The block's own contribution (h - h0), not h: the residual would hide an error in it.
            err = rel_err(gh[1:-1] - h0[1:-1], ch[1:-1] - h0[1:-1])
            assert err < tol, f"moe {phase} {spec} E={E} T={T}: relative error {err:.3g}"
    rep = {k: v for k, v in str_variants(benches[1].report()).items() if k.startswith("moe.block.decode")}
    fused = Ish == I
    assert rep and ("fused, 2 launches" in rep["moe.block.decode"]) == fused, rep


def block_weights(benches, rng, spec, E, H, I, Ish):
    """The same random routed (gate, up, down) and shared-expert weights registered on every bench."""
    descs = (stacked(rng, spec, E, I, H), stacked(rng, spec, E, I, H), stacked(rng, spec, E, H, I))
    handles = [tuple(b.weight(d) for d in descs) for b in benches]
    sdescs = (stacked(rng, spec, 1, Ish, H), stacked(rng, spec, 1, Ish, H), stacked(rng, spec, 1, H, Ish))
    for dsc in sdescs:
        dsc.pop("experts")
    return handles, [tuple(b.weight(dsc) for dsc in sdescs) for b in benches]


@pytest.mark.parametrize("spec,E,k,H,I,Ish", [c for c in BLOCK_CASES if c[4] == c[5]])
def test_moe_block_pdl_decode_same_bits(spec, E, k, H, I, Ish):
    """Under pdl="decode" the fused down pass routes its token itself from the logits before it waits (PREROUTE):
    the block's output, ids and weights equal the plain launch's bit for bit, with exact ties in the logits too
    (both passes must pick the same experts)."""
    benches = (core.OpBench("cuda", {"pdl": False}), core.OpBench("cuda", {"pdl": "decode"}))
    rng = np.random.default_rng(zlib.crc32(f"block pdl {spec} {E}".encode()))
    handles, shared = block_weights(benches, rng, spec, E, H, I, Ish)
    for T in (1, 2):
        x = signed(rng, T, H)
        logits = np.round(rng.normal(0.0, 2.0, size=(T, E)) * 2.0).astype(np.float32) / 2.0  # many exact ties
        sg = rng.normal(0.0, 2.0, size=(T, 1)).astype(np.float32)
        h0 = signed(rng, T + 2, H)
        (ah, ai, aw), (bh, bi, bw) = run_block(benches, handles, shared, "decode", x, logits, sg, h0, E, k, H, I, Ish)
        np.testing.assert_array_equal(bi, ai)
        np.testing.assert_array_equal(bw.view(np.uint32), aw.view(np.uint32))
        np.testing.assert_array_equal(bh.view(np.uint32), ah.view(np.uint32))
    rep = str_variants(benches[1].report())
    on = 'programmatic dependent launch (pdl="decode")' in " ".join(benches[1].report()["optimizations"])
    assert ("routes and loads its weights before waiting" in rep["moe.block.decode"]) == on, rep


@pytest.mark.parametrize("spec,E,k,H,I,Ish", [c for c in BLOCK_CASES if c[4] == c[5]])
def test_moe_block_decode_geometry_same_bits(spec, E, k, H, I, Ish):
    """moe_rows_g / moe_rows_d (gate/up rows per warp, down rows per block) move work between threads and blocks,
    moe_decode_minb caps registers, moe_early_loads moves gate/up's weight loads, never the
    order of a sum: the fused decode block's output equals the default geometry's bit for bit, and the variant names
    the geometry and the load order in use."""
    geometries = ({}, {"moe_rows_g": 1, "moe_rows_d": 1}, {"moe_rows_g": 4, "moe_rows_d": 16}, {"moe_rows_d": 64},
                  {"moe_decode_minb": 4}, {"moe_decode_minb": 8, "moe_rows_g": 4}, {"moe_early_loads": False},
                  {"moe_early_loads": False, "moe_rows_g": 1}, {"moe_rows_g": 1, "moe_decode_minb": 3})
    benches = tuple(core.OpBench("cuda", g) for g in geometries)
    rng = np.random.default_rng(zlib.crc32(f"block geometry {spec} {E}".encode()))
    handles, shared = block_weights(benches, rng, spec, E, H, I, Ish)
    for T in (1, 3):
        x = signed(rng, T, H)
        logits = rng.normal(0.0, 2.0, size=(T, E)).astype(np.float32)
        sg = rng.normal(0.0, 2.0, size=(T, 1)).astype(np.float32)
        h0 = signed(rng, T + 2, H)
        out = run_block(benches, handles, shared, "decode", x, logits, sg, h0, E, k, H, I, Ish)
        for (bh, bi, bw), g in zip(out[1:], geometries[1:]):
            np.testing.assert_array_equal(bi, out[0][1], err_msg=str(g))
            np.testing.assert_array_equal(bh.view(np.uint32), out[0][0].view(np.uint32), err_msg=str(g))
    for b, g in zip(benches, geometries):
        text = str_variants(b.report())["moe.block.decode"]
        assert f"{g.get('moe_rows_d', 8)} rows per block" in text, (g, text)
        if "moe_rows_g" in g:
            assert f"({g['moe_rows_g']} gate+up rows per warp)" in text, (g, text)
        cpv = {"q4": 32, "q8": 16}.get(spec[:2], 8)  # inputs per 16-byte vector
        nit = -(-(H // cpv) // 32)  # a lane's vectors per row
        rows_g = g.get("moe_rows_g") or max(1, min(4, 4 // nit))
        early = g.get("moe_early_loads", True) and g.get("moe_decode_minb", 0) <= 3 and rows_g * nit <= 4
        assert ("gate/up weight loads in flight while x is staged" in text) == early, (g, text)


def str_variants(report) -> dict:
    if isinstance(report, dict):
        if "moe.block.decode" in report or "moe.block.prefill" in report:
            return report
        for v in report.values():
            found = str_variants(v)
            if found:
                return found
    return {}


# ------------------------------------------------------------------------------------------------
# prefill_x = "f16" (the default) and "bf16": the MoE GEMMs take the activations as one term
# ------------------------------------------------------------------------------------------------

ONE_TERM_TOL = {"bf16": 4 * 2.0 ** -9, "f16": F16_TOL}  # u per rounding, entering 3 times


@pytest.fixture(scope="module")
def one_term_benches():
    return {form: (core.OpBench("cpu"), core.OpBench("cuda", {"prefill_x": form, "moe_w_f16": False}))
            for form in ("f16", "bf16")}


@pytest.mark.parametrize("form", ["f16", "bf16"])
@pytest.mark.parametrize("spec,E,k,H,I", [c for c in EXPERT_CASES if c[0] in ("q4g64-bf16", "f16", "q4g32-f32",
                                                                             "q8g64-f16")])
def test_experts_prefill_one_x_term(benches, one_term_benches, form, spec, E, k, H, I):
    """Within the one-term tolerance and clearly outside the 2-term one (the lo term is gone); deterministic; a
    token's output independent of the call (T = 7 = the first 7 rows of T = 80); decode unchanged (fp32). f16 on
    activations past its range (a token × 3e5) and of subnormal size (a token × 1e-9): its power-of-two scale per row
    and group part keeps them finite and precise. Dense experts refuse f16 for hi + lo, and say why."""
    pair = one_term_benches[form]
    handles = weights_for(pair, spec, E, k, H, I)
    x, ids, w = token_inputs(31, E, k, H, 80)
    if form == "f16":
        x[0] *= 3e5
        x[1] *= 1e-9
    cpu, gpu = run_experts(pair, handles, "prefill", x, ids, w, E, k, H, I)
    text = str_variants_experts(pair[1].report())
    if form == "f16" and not spec.startswith("q"):
        _, two = run_experts(benches, weights_for(benches, spec, E, k, H, I), "prefill", x, ids, w, E, k, H, I)
        np.testing.assert_array_equal(gpu.view(np.uint32), two.view(np.uint32))
        assert "hi + lo bf16 (f16 x needs affine codes)" in text, text
        return
    err = rel_err(gpu, cpu)
    assert PREFILL_TOL < err < ONE_TERM_TOL[form], f"prefill one-term {form} {spec} E={E}: relative error {err:.3g}"
    for t in (0, 1) if form == "f16" else ():  # the scaled tokens alone, each within the tolerance
        assert rel_err(gpu[t], cpu[t]) < ONE_TERM_TOL[form], (t, rel_err(gpu[t], cpu[t]))
    _, again = run_experts(pair, handles, "prefill", x, ids, w, E, k, H, I)
    np.testing.assert_array_equal(again.view(np.uint32), gpu.view(np.uint32))
    _, part = run_experts(pair, handles, "prefill", x[:7], ids[:7], w[:7], E, k, H, I)
    np.testing.assert_array_equal(part.view(np.uint32), gpu[:7].view(np.uint32))
    cpu_d, gpu_d = run_experts(pair, handles, "decode", x[:1], ids[:1], w[:1], E, k, H, I)
    assert rel_err(gpu_d, cpu_d) < 1e-5, f"decode must stay fp32 under prefill_x = {form}"
    want = ("one f16 term scaled by 2^e per row and group part (prefill_x or moe_x = f16)" if form == "f16"
            else "one bf16 term (prefill_x or moe_x = bf16)")
    assert want in text, text
