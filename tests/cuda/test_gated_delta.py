"""CUDA conv1d_silu and gated_delta against the CPU oracle (csrc/cpu/gated_delta.cpp), MODEL.md section 5.

Tolerance: both backends compute in fp32 and differ only in summation order and FMA contraction. A numpy
fp32 scan of 300 tokens at Dk = Dv = 128 sits ~1e-7 (relative, norm-wise) from an fp64 one, for decays
from 5e-10 to 0.99, so 1e-5 leaves a wide margin and still catches any wrong index or update order
(those give errors of order 1). The conv's new state is a copy of input rows: compared exactly.

State captures (ops.h StateCapture, the prefix cache's checkpoint inside a chunk and MTP's per-position states):
the conv's are copies, compared exactly; the scan's slice i must equal, bit for bit, the state a GPU call over rows
0 .. first + i alone leaves (the kernel stores the same registers), and the CPU's capture within TOL.
"""

from __future__ import annotations

import numpy as np
import pytest

try:
    import lily._core as core

    _USABLE = bool(core.backends()["cuda"]["usable"]) and hasattr(core, "OpBench")
except Exception:  # no extension, or no CUDA backend in it
    _USABLE = False

pytestmark = pytest.mark.skipif(not _USABLE, reason="needs lily._core.backends()['cuda']['usable'] (and OpBench)")

TOL = 1e-5
REAL = (16, 32, 128, 128)  # Hk, Hv, Dk, Dv
SHAPES = [REAL, (2, 6, 32, 48), (3, 3, 64, 64)]


@pytest.fixture(scope="module")
def benches():
    return core.OpBench("cpu"), core.OpBench("cuda")


@pytest.fixture(scope="module")
def scan_bench():
    """The GPU with the sequential scan for every length (no chunked form): the bench whose captures and uncaptured
    calls must agree bit for bit."""
    return core.OpBench("cuda", {"delta_chunk_rows": 0})


def rel(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def phase_of(T: int) -> str:
    return "decode" if T == 1 else "prefill"


def config(Hk: int, Hv: int, Dk: int, Dv: int, K: int = 4) -> dict:
    """The real model's ModelConfig.to_core() with the DeltaNet dims replaced."""
    return dict(hidden=2048, layers=4, vocab=248320, eps=1e-6, heads=16, kv_heads=2, head_dim=256,
                rotary_dim=64, rope_theta=1e7, lin_k_heads=Hk, lin_v_heads=Hv, lin_k_dim=Dk, lin_v_dim=Dv,
                conv_kernel=K, experts=256, topk=8, moe_inter=512, shared_inter=512,
                full_attention=[False, False, False, True])


# ---- conv1d_silu ----

def run_conv(bench, mixed, w, st, inplace, row0=0, capture=None):
    T, C = mixed.shape
    # mixed as a view starting at row0 of a larger tensor (an offset the kernel must honour)
    big = np.concatenate([np.full((row0, C), 7.0, np.float32), mixed, np.full((1, C), 7.0, np.float32)])
    hm = bench.view(bench.tensor(big), row0, T)
    hs = bench.tensor(st)
    hso = hs if inplace else bench.empty(*st.shape)
    ho = bench.empty(T, C)
    kw = {}
    if capture is not None:  # (first, count): the state after rows first .. first + count - 1
        kw = dict(capture=bench.empty(capture[1] * st.shape[0], C), capture_first=capture[0],
                  capture_count=capture[1])
    bench.run("conv1d_silu", phase=phase_of(T), mixed=hm, conv_w=bench.tensor(w), state_in=hs, state_out=hso,
              out=ho, **kw)
    if capture is not None:
        return bench.read(ho), bench.read(hso), bench.read(kw["capture"])
    return bench.read(ho), bench.read(hso), bench.read(hs)


@pytest.mark.parametrize("C,K", [(8192, 4), (100, 2), (100, 5)])
@pytest.mark.parametrize("T", [1, 3, 130])
@pytest.mark.parametrize("inplace", [True, False])
def test_conv1d_silu(benches, C, K, T, inplace):
    cpu, gpu = benches
    rng = np.random.default_rng(1000 * C + 10 * K + T)
    mixed = rng.standard_normal((T, C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    st = rng.standard_normal((K - 1, C)).astype(np.float32)
    o_c, s_c, _ = run_conv(cpu, mixed, w, st, inplace, row0=T % 3)
    o_g, s_g, sin_g = run_conv(gpu, mixed, w, st, inplace, row0=T % 3)
    assert np.isfinite(o_g).all()
    assert rel(o_g, o_c) < TOL
    np.testing.assert_array_equal(s_g, s_c)
    if not inplace:
        np.testing.assert_array_equal(sin_g, st)  # state_in is only read


@pytest.mark.parametrize("C,K", [(8192, 4), (100, 5)])
@pytest.mark.parametrize("T,capture", [(3, (0, 3)), (130, (0, 1)), (130, (60, 5)), (130, (129, 1))])
@pytest.mark.parametrize("inplace", [True, False])
def test_conv1d_silu_capture(benches, C, K, T, capture, inplace):
    """Captured conv states (copies of pre-conv rows, some from the carried state) equal the CPU's exactly;
    the outputs and the final state are those of the uncaptured call."""
    cpu, gpu = benches
    rng = np.random.default_rng(7 * C + T + capture[0])
    mixed = rng.standard_normal((T, C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    st = rng.standard_normal((K - 1, C)).astype(np.float32)
    o_c, s_c, cap_c = run_conv(cpu, mixed, w, st, inplace, capture=capture)
    o_g, s_g, cap_g = run_conv(gpu, mixed, w, st, inplace, capture=capture)
    o_u, s_u, _ = run_conv(gpu, mixed, w, st, inplace)
    np.testing.assert_array_equal(cap_g, cap_c)
    np.testing.assert_array_equal(o_g, o_u)
    np.testing.assert_array_equal(s_g, s_u)


# ---- gated_delta ----

def delta_inputs(rng, T, Hk, Hv, Dk, Dv):
    qkv = rng.standard_normal((T, 2 * Hk * Dk + Hv * Dv)).astype(np.float32)
    b = (rng.standard_normal((T, Hv)) * 2.0).astype(np.float32)  # beta over (0.02, 0.98)
    a = rng.standard_normal((T, Hv)).astype(np.float32)
    # A = exp(A_log) in [0.5, 16] as the checkpoint's init; dt_bias around softplus^-1 of 0.001..0.1:
    # decays alpha from ~1e-4 to ~0.9999
    A_log = rng.uniform(np.log(0.5), np.log(16.0), (1, Hv)).astype(np.float32)
    dt_bias = rng.uniform(-7.0, -2.0, (1, Hv)).astype(np.float32)
    return qkv, b, a, A_log, dt_bias


def shape_args(Hk, Hv, Dk, Dv):
    return dict(k_heads=Hk, v_heads=Hv, k_dim=Dk, v_dim=Dv, conv_kernel=4, eps=1e-6)


class DeltaRun:
    """One bench's inputs and its two state sets (the session alternates them in decode)."""

    def __init__(self, bench, shape, state0, max_rows):
        self.b, self.shape = bench, shape
        self.ws = bench.workspace(config(*shape), max_rows, 64)
        self.states = [bench.tensor(state0), bench.empty(*state0.shape)]

    def step(self, inputs, src, dst, capture=None, phase=None):
        """The output; with capture = (first, count) also the captured states [count·Hv·Dk, Dv]. The phase is
        decode for one row and prefill for more unless given (a decode-phase forward of a few rows: MTP's verify)."""
        qkv, b, a, A_log, dt_bias = inputs
        T = qkv.shape[0]
        Hv, Dk, Dv = self.shape[1], self.shape[2], self.shape[3]
        h = self.b
        out = h.empty(T, Hv * Dv)
        kw = {}
        if capture is not None:
            kw = dict(capture=h.empty(capture[1] * Hv * Dk, Dv), capture_first=capture[0], capture_count=capture[1])
        h.run("gated_delta", phase=phase or phase_of(T), qkv=h.tensor(qkv), b=h.tensor(b), a=h.tensor(a),
              A_log=h.tensor(A_log), dt_bias=h.tensor(dt_bias), state_in=self.states[src],
              state_out=self.states[dst], ws=self.ws, out=out, **shape_args(*self.shape), **kw)
        return (h.read(out), h.read(kw["capture"])) if kw else h.read(out)

    def state(self, i):
        return self.b.read(self.states[i])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("T", [1, 2, 33, 130, 300])
@pytest.mark.parametrize("inplace", [True, False])
def test_gated_delta(benches, shape, T, inplace):
    cpu, gpu = benches
    Hk, Hv, Dk, Dv = shape
    rng = np.random.default_rng(T * 7 + Dk + Hv)
    inputs = delta_inputs(rng, T, *shape)
    state0 = (rng.standard_normal((Hv * Dk, Dv)) * 0.5).astype(np.float32)
    rc, rg = DeltaRun(cpu, shape, state0, T), DeltaRun(gpu, shape, state0, T)
    dst = 0 if inplace else 1
    o_c, o_g = rc.step(inputs, 0, dst), rg.step(inputs, 0, dst)
    assert np.isfinite(o_g).all()
    assert rel(o_g, o_c) < TOL, rel(o_g, o_c)
    s_c, s_g = rc.state(dst), rg.state(dst)
    assert np.isfinite(s_g).all()
    assert rel(s_g, s_c) < TOL, rel(s_g, s_c)
    if not inplace:
        np.testing.assert_array_equal(rg.state(0), state0)  # state_in is only read


@pytest.mark.parametrize("shape", [REAL, (2, 6, 32, 48)], ids=lambda s: "x".join(map(str, s)))
def test_gated_delta_chained(benches, shape):
    """Prefill 130 tokens in place, then 5 decode steps alternating the two state sets, as a session does;
    each bench carries its own state, and every step is compared."""
    cpu, gpu = benches
    rng = np.random.default_rng(99 + shape[2])
    state0 = (rng.standard_normal((shape[1] * shape[2], shape[3])) * 0.5).astype(np.float32)
    rc, rg = DeltaRun(cpu, shape, state0, 130), DeltaRun(gpu, shape, state0, 130)
    steps = [(130, 0, 0)] + [(1, i % 2, 1 - i % 2) for i in range(5)]
    for n, (T, src, dst) in enumerate(steps):
        inputs = delta_inputs(rng, T, *shape)
        o_c, o_g = rc.step(inputs, src, dst), rg.step(inputs, src, dst)
        assert rel(o_g, o_c) < TOL, (n, rel(o_g, o_c))
        assert rel(rg.state(dst), rc.state(dst)) < TOL, n
    rep = gpu.report()
    assert "gated_delta.decode" in str(rep) and "gated_delta.prefill" in str(rep)


def test_gated_delta_split_is_bitwise(benches):
    """A token gives the same bits in a prefill of T > 1 (prep kernel + scan) as in a decode step (the
    fused kernel): 33 tokens at once == 32 tokens then one, on the GPU alone."""
    _, gpu = benches
    shape = REAL
    rng = np.random.default_rng(5)
    inputs = delta_inputs(rng, 33, *shape)
    state0 = (rng.standard_normal((shape[1] * shape[2], shape[3])) * 0.5).astype(np.float32)
    whole, split = DeltaRun(gpu, shape, state0, 33), DeltaRun(gpu, shape, state0, 33)
    o_whole = whole.step(inputs, 0, 1)
    o_head = split.step(tuple(x[:32] if x.shape[0] == 33 else x for x in inputs), 0, 1)
    o_last = split.step(tuple(x[32:] if x.shape[0] == 33 else x for x in inputs), 1, 0)
    np.testing.assert_array_equal(o_whole[:32], o_head)
    np.testing.assert_array_equal(o_whole[32:], o_last)
    np.testing.assert_array_equal(whole.state(1), split.state(0))


@pytest.mark.parametrize("shape", [REAL, (2, 6, 32, 48)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("T", [2, 5, 8])
def test_gated_delta_decode_rows_are_decode_steps(benches, shape, T):
    """A decode-phase call of T rows (an MTP verify through the decode kernels) takes the decode entry: each row's
    output, the final state and a capture of the state after rows 0 .. T-2 are, bit for bit, those of T one-row
    decode steps, and within TOL of the CPU's."""
    cpu, gpu = benches
    Hk, Hv, Dk, Dv = shape
    rng = np.random.default_rng(T * 31 + Dv)
    inputs = delta_inputs(rng, T, *shape)
    state0 = (rng.standard_normal((Hv * Dk, Dv)) * 0.5).astype(np.float32)
    rc, rg, steps = (DeltaRun(b, shape, state0, T) for b in (cpu, gpu, gpu))
    capture = (0, T - 1)
    o_c, cap_c = rc.step(inputs, 0, 1, capture, phase="decode")
    o_g, cap_g = rg.step(inputs, 0, 1, capture, phase="decode")
    assert "a decode-phase forward's rows" in str(gpu.report()), gpu.report()
    assert rel(o_g, o_c) < TOL and rel(cap_g, cap_c) < TOL and rel(rg.state(1), rc.state(1)) < TOL
    rows, src = Hv * Dk, 0
    for t in range(T):
        o_t = steps.step(tuple(x[t:t + 1] if x.shape[0] == T else x for x in inputs), src, 1 - src)
        src = 1 - src
        np.testing.assert_array_equal(o_g[t:t + 1], o_t, err_msg=f"row {t}")
        if t < T - 1:
            np.testing.assert_array_equal(cap_g[t * rows:(t + 1) * rows], steps.state(src), err_msg=f"slice {t}")
    np.testing.assert_array_equal(rg.state(1), steps.state(src))


@pytest.mark.parametrize("shape", [REAL, (2, 6, 32, 48)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("T,capture", [(1, (0, 1)), (33, (0, 4)), (130, (64, 3)), (130, (129, 1))])
@pytest.mark.parametrize("inplace", [True, False])
def test_gated_delta_capture(benches, scan_bench, shape, T, capture, inplace):
    """Slice i of the capture is, bit for bit, the state of a GPU call over rows 0 .. first + i alone (both
    kernels: T = 1 is the decode entry), within TOL of the CPU's capture; the captured call's output and final
    state are the uncaptured call's bits. A capture always runs the sequential scan, so the calls it is compared
    with bit for bit do too (delta_chunk_rows = 0; the chunked form is held to the CPU below)."""
    cpu, _ = benches
    gpu = scan_bench
    Hk, Hv, Dk, Dv = shape
    rng = np.random.default_rng(T * 13 + Dk + capture[0])
    inputs = delta_inputs(rng, T, *shape)
    state0 = (rng.standard_normal((Hv * Dk, Dv)) * 0.5).astype(np.float32)
    dst = 0 if inplace else 1
    rc, rg, ru = (DeltaRun(b, shape, state0, T) for b in (cpu, gpu, gpu))
    o_c, cap_c = rc.step(inputs, 0, dst, capture)
    o_g, cap_g = rg.step(inputs, 0, dst, capture)
    o_u = ru.step(inputs, 0, dst)
    np.testing.assert_array_equal(o_g, o_u)
    np.testing.assert_array_equal(rg.state(dst), ru.state(dst))
    assert rel(cap_g, cap_c) < TOL, rel(cap_g, cap_c)
    first, count = capture
    rows = Hv * Dk
    for i in range(count):
        n = first + i + 1
        short = DeltaRun(gpu, shape, state0, n)
        short.step(tuple(x[:n] if x.shape[0] == T else x for x in inputs), 0, dst)
        np.testing.assert_array_equal(cap_g[i * rows:(i + 1) * rows], short.state(dst), err_msg=f"slice {i}")


# ---- the chunked (WY / UT-transform) form: T >= delta_chunk_rows without a capture ----

def strong_decay_inputs(rng, T, Hk, Hv, Dk, Dv):
    """delta_inputs with A = exp(A_log) up to ~1e4 and dt_bias up to 3: per-token decays down to exp(-1e4) (0 in
    fp32), mixed within a head with decays near 1, the case that overflows a chunk's Γ_i or its ratios if they are
    not formed from differences of log decays."""
    qkv, b, a, A_log, dt_bias = delta_inputs(rng, T, Hk, Hv, Dk, Dv)
    A_log = rng.uniform(np.log(0.5), np.log(1e4), (1, Hv)).astype(np.float32)
    dt_bias = rng.uniform(-7.0, 3.0, (1, Hv)).astype(np.float32)
    return qkv, b, a, A_log, dt_bias


@pytest.fixture(scope="module")
def fma_bench():
    """The GPU with the chunked form's products in fp32 FMAs (delta_chunk_mma off), not on the tensor cores."""
    return core.OpBench("cuda", {"delta_chunk_mma": False})


@pytest.mark.parametrize("shape", SHAPES + [(2, 4, 36, 32)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("T", [64, 65, 127, 200, 1000])
@pytest.mark.parametrize("decay", ["normal", "strong"])
@pytest.mark.parametrize("form", ["mma", "fma"])
def test_gated_delta_chunked(benches, scan_bench, fma_bench, shape, T, decay, form):
    """From delta_chunk_rows (64 by default) the GPU runs the chunked form (the report says so), its products on the
    tensor cores in 3xTF32 by default (Dk % 16 == 0; Dk = 36 says why not) or in fp32 FMAs (delta_chunk_mma off):
    output and new state within TOL of the CPU's sequential scan and of the GPU's own scan, at whole and partial last
    chunks, in place and not, for ordinary decays and for decays strong enough to underflow."""
    cpu, gpu = benches[0], (benches[1] if form == "mma" else fma_bench)
    rng = np.random.default_rng(T * 31 + shape[2] + (decay == "strong"))
    make = strong_decay_inputs if decay == "strong" else delta_inputs
    inputs = make(rng, T, *shape)
    state0 = (rng.standard_normal((shape[1] * shape[2], shape[3])) * 0.5).astype(np.float32)
    for inplace in (True, False):
        dst = 0 if inplace else 1
        rc, rg, rs = (DeltaRun(b, shape, state0, T) for b in (cpu, gpu, scan_bench))
        o_c, o_g, o_s = rc.step(inputs, 0, dst), rg.step(inputs, 0, dst), rs.step(inputs, 0, dst)
        text = gpu.report()["variants"]["gated_delta.prefill"]
        assert text.startswith("chunked"), text
        if form == "fma":
            assert "not on the tensor cores: delta_chunk_mma=False" in text, text
        elif shape[2] % 16:
            assert f"not on the tensor cores: Dk={shape[2]} (tensor cores: Dk % 16 == 0)" in text, text
        else:
            assert "products on the tensor cores (3xTF32 mma.sync m16n8k8)" in text, text
        assert "not chunked" in scan_bench.report()["variants"]["gated_delta.prefill"]
        assert np.isfinite(o_g).all() and np.isfinite(rg.state(dst)).all()
        assert rel(o_g, o_c) < TOL, rel(o_g, o_c)
        assert rel(rg.state(dst), rc.state(dst)) < TOL, rel(rg.state(dst), rc.state(dst))
        assert rel(o_g, o_s) < TOL and rel(rg.state(dst), rs.state(dst)) < TOL
        if not inplace:
            np.testing.assert_array_equal(rg.state(0), state0)  # state_in is only read


def test_gated_delta_chunked_then_decode_and_short_calls(benches):
    """A session's pattern: a chunked prefill of 300 rows in place, a short (scan) prefill of 9, then decode steps
    alternating the state sets; every output and state within TOL of the CPU carrying its own."""
    cpu, gpu = benches
    shape = REAL
    rng = np.random.default_rng(123)
    state0 = (rng.standard_normal((shape[1] * shape[2], shape[3])) * 0.5).astype(np.float32)
    rc, rg = DeltaRun(cpu, shape, state0, 300), DeltaRun(gpu, shape, state0, 300)
    steps = [(300, 0, 0), (9, 0, 0)] + [(1, i % 2, 1 - i % 2) for i in range(4)]
    for n, (T, src, dst) in enumerate(steps):
        inputs = delta_inputs(rng, T, *shape)
        o_c, o_g = rc.step(inputs, src, dst), rg.step(inputs, src, dst)
        assert rel(o_g, o_c) < TOL, (n, rel(o_g, o_c))
        assert rel(rg.state(dst), rc.state(dst)) < TOL, n


def test_delta_chunk_rows_threshold_and_bad_values():
    """delta_chunk_rows = 100: 99 rows scan (the report says why), 100 chunked; out-of-range values are refused."""
    gpu = core.OpBench("cuda", {"delta_chunk_rows": 100})
    rng = np.random.default_rng(7)
    for T, chunked in ((99, False), (100, True)):
        inputs = delta_inputs(rng, T, *REAL)
        state0 = (rng.standard_normal((REAL[1] * REAL[2], REAL[3])) * 0.5).astype(np.float32)
        DeltaRun(gpu, REAL, state0, T).step(inputs, 0, 1)
        text = gpu.report()["variants"]["gated_delta.prefill"]
        assert text.startswith("chunked") == chunked, text
        if not chunked:
            assert "99 rows < delta_chunk_rows = 100" in text, text
    for bad in (-1, (1 << 24) + 1):
        with pytest.raises(ValueError, match="delta_chunk_rows"):
            core.OpBench("cuda", {"delta_chunk_rows": bad})
