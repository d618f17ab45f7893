"""CUDA conv_delta_norm (ops.h): the fused decode kernels (kernels/gated_delta.cu conv_delta_norm, a block per key
head, fused_delta = "narrow"; conv_delta_norm_wide, gated_delta's grid with arrival counters, "wide";
conv1d_silu + gated_delta_norm, the recurrence and the gated norm in one launch whose value heads are thread-block
clusters, "norm"; conv_delta_norm_cluster, wide's product with a key head's blocks one cluster, "cluster") against the composed three kernels (conv1d_silu, gated_delta, gated_rms_norm; fused_delta = "off")
bit for bit, and against the CPU oracle within fp32 tolerance (the composed kernels' own bound, tests/cuda/
test_gated_delta.py). T > 1, state captures and the shapes a form does not take go the composed path and the report
says why. End to end: greedy decode on a random model gives the same logits with and without the fusion, and the
decode step has 2 launches fewer per DeltaNet layer (1 for "norm")."""

from __future__ import annotations

import numpy as np
import pytest

import lily
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

from cuda_util import requires_cuda

import lily._core as core

pytestmark = requires_cuda

TOL = 1e-5
REAL = (16, 32, 128, 128)  # Hk, Hv, Dk, Dv
SHAPES = [REAL, (2, 6, 32, 48), (3, 3, 64, 64), (2, 4, 32, 32), (1, 8, 40, 24)]


FORMS = ["narrow", "wide", "norm", "cluster"]
SAVED_LAUNCHES = {"narrow": 2, "wide": 2, "norm": 1, "cluster": 2}  # per DeltaNet layer and decode step


@pytest.fixture(scope="module")
def all_benches():
    return {"cpu": core.OpBench("cpu"), "off": core.OpBench("cuda", {"fused_delta": "off"}),
            **{form: core.OpBench("cuda", {"fused_delta": form}) for form in FORMS}}


def takes(form, shape) -> bool:
    """Whether the form runs fused at this shape (norm: a value head's Dv/16 blocks are one cluster of <= 8;
    cluster: a key head's Hv/Hk · Dv/16 blocks one of <= 16, past 8 at (2, 6, 32, 48) and the real shape)."""
    Hk, Hv, _, Dv = shape
    if form == "norm":
        return Dv % 16 == 0 and Dv <= 128
    if form == "cluster":
        return Dv % 16 == 0 and Dv <= 128 and Hv // Hk * Dv // 16 <= 16
    return True


@pytest.fixture(params=FORMS)
def benches(all_benches, request):
    """(cpu, the fused form, the composed kernels)."""
    return all_benches["cpu"], all_benches[request.param], all_benches["off"]


def rel(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def make_inputs(rng, T, Hk, Hv, Dk, Dv, K=4):
    C = 2 * Hk * Dk + Hv * Dv
    f = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    return dict(
        qkv=f(T, C), z=f(T, Hv * Dv), b=f(T, Hv, scale=2.0), a=f(T, Hv), conv_w=f(C, K, scale=0.5),
        A_log=rng.uniform(np.log(0.5), np.log(16.0), (1, Hv)).astype(np.float32),
        dt_bias=rng.uniform(-7.0, -2.0, (1, Hv)).astype(np.float32),
        norm_w=(1.0 + 0.1 * rng.standard_normal((1, Dv))).astype(np.float32),
        conv_state=f(K - 1, C), rec_state=f(Hv * Dk, Dv, scale=0.3))


def run(bench, x, shape, inplace, capture=None, max_rows=8):
    """out, conv state after, recurrent state after (and the captures) from one conv_delta_norm call."""
    Hk, Hv, Dk, Dv = shape
    T, C = x["qkv"].shape
    K = x["conv_w"].shape[1]
    cfg = dict(hidden=2048, layers=4, vocab=248320, eps=1e-6, heads=16, kv_heads=2, head_dim=256, rotary_dim=64,
               rope_theta=1e7, lin_k_heads=Hk, lin_v_heads=Hv, lin_k_dim=Dk, lin_v_dim=Dv, conv_kernel=K,
               experts=256, topk=8, moe_inter=512, shared_inter=512, full_attention=[False, False, False, True])
    h = bench
    t = {k: h.tensor(v) for k, v in x.items() if k not in ("conv_state", "rec_state")}
    ci, ri = h.tensor(x["conv_state"]), h.tensor(x["rec_state"])
    co = ci if inplace else h.empty(K - 1, C)
    ro = ri if inplace else h.empty(Hv * Dk, Dv)
    out = h.empty(T, Hv * Dv)  # poisoned
    kw = {}
    if capture is not None:
        kw = dict(conv_capture=h.empty(capture[1] * (K - 1), C), rec_capture=h.empty(capture[1] * Hv * Dk, Dv),
                  capture_first=capture[0], capture_count=capture[1])
    h.run("conv_delta_norm", phase="decode" if T == 1 else "prefill", conv_in=ci, conv_out=co, rec_in=ri,
          rec_out=ro, mixed=h.empty(T, C), delta_o=h.empty(T, Hv * Dv), ws=h.workspace(cfg, max_rows, 64), out=out,
          k_heads=Hk, v_heads=Hv, k_dim=Dk, v_dim=Dv, conv_kernel=K, eps=1e-6, **t, **kw)
    return h.read(out), h.read(co), h.read(ro)


def variant(bench, phase="decode") -> str:
    return str(bench.report()["variants"].get("conv_delta_norm." + phase, ""))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("inplace", [True, False])
def test_fused_decode_is_bitwise_composed_and_near_cpu(benches, shape, inplace, request):
    cpu, fused, composed = benches
    form = request.node.callspec.params["benches"]
    rng = np.random.default_rng([*shape, int(inplace)])
    for step in range(2):  # fresh inputs each step
        x = make_inputs(rng, 1, *shape)
        got = run(fused, x, shape, inplace)
        if takes(form, shape):
            assert variant(fused).startswith("fused " + form), variant(fused)
        else:
            assert variant(fused).startswith("composed") and f"Dv={shape[3]}" in variant(fused), variant(fused)
        want = run(composed, x, shape, inplace)
        assert 'option fused_delta = "off"' in variant(composed), variant(composed)
        ref = run(cpu, x, shape, inplace)
        for name, g, w, r in zip(("out", "conv state", "recurrent state"), got, want, ref):
            assert np.isfinite(g).all(), name
            np.testing.assert_array_equal(g, w, err_msg=f"{name} fused vs composed, step {step}")
            assert rel(g, r) < TOL, (name, rel(g, r))
        np.testing.assert_array_equal(got[1], ref[1], err_msg="the conv state is a copy of inputs")


@pytest.mark.parametrize("shape", [REAL, (2, 6, 32, 48)])
def test_prefill_and_capture_take_the_composed_path(benches, shape):
    cpu, fused, composed = benches
    rng = np.random.default_rng(7)
    x = make_inputs(rng, 5, *shape)
    got = run(fused, x, shape, True)
    v = variant(fused, "prefill")
    assert v.startswith("composed") and "5 rows" in v, v
    for g, w in zip(got, run(composed, x, shape, True)):
        np.testing.assert_array_equal(g, w)
    x = make_inputs(rng, 1, *shape)
    got = run(fused, x, shape, False, capture=(0, 1))
    assert variant(fused).startswith("composed") and "capture" in variant(fused), variant(fused)
    ref = run(cpu, x, shape, False, capture=(0, 1))
    for g, r in zip(got, ref):
        assert rel(g, r) < TOL


@pytest.mark.parametrize("form", FORMS)
def test_greedy_decode_same_logits_and_fewer_launches(tmp_path, form):
    path = write_synthetic_checkpoint(tmp_path / "mlx4", TINY_CONFIG, fmt="mlx", bits=4, seed=5)
    prompt = np.random.default_rng(3).integers(0, TINY_CONFIG["vocab_size"], 24).tolist()
    runs, launches = {}, {}
    for name, opts in (("fused", {"fused_delta": form}), ("composed", {"fused_delta": "off"})):
        with lily.Engine.from_pretrained(path, backend="cuda", backend_options=opts) as gpu:
            s = gpu.session()
            logits = [s.prefill(prompt)]
            tok = int(np.argmax(logits[-1]))
            for _ in range(8):
                logits.append(s.step(tok))
                tok = int(np.argmax(logits[-1]))
            runs[name] = logits
            rep = gpu.report()
            launches[name] = rep["cuda"]["graphs"]["launches_per_decode_step"]
            v = str(rep["cuda"]["variants"].get("conv_delta_norm.decode", ""))
            assert v.startswith("fused " + form) if name == "fused" else 'option fused_delta = "off"' in v, (name, v)
    for a, b in zip(runs["fused"], runs["composed"]):
        np.testing.assert_array_equal(a, b)
    layers = TINY_CONFIG["num_hidden_layers"]
    n_delta = layers - layers // TINY_CONFIG["full_attention_interval"]  # DeltaNet layers
    assert launches["composed"] - launches["fused"] == SAVED_LAUNCHES[form] * n_delta, launches
