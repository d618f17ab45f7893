"""Lily on an MLX 4-bit checkpoint written by mlx-lm's own converter.

(a) against transformers running the *dequantized* MLX weights (fp32): relative error <= 1e-4;
(b) against mlx-lm itself on the same bytes, with mlx-lm's floating parameters cast to fp32 (codes stay
    uint32). Measured: mlx-lm fp32 matches transformers-on-dequantized weights to ~3e-6, so (b) uses the
    same 1e-4 bound plus >= 95% top-1 agreement. mlx-lm's native bf16 run is reported, not asserted (bf16
    activations and bf16 router top-k move the logits of this tiny random model by tens of percent).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tiny

lily = pytest.importorskip("lily")

if not tiny.mlx_available():
    pytest.skip("mlx / mlx_lm not importable", allow_module_level=True)

REL_TOL = 1e-4
PREFILL = 40
DECODE = 8


@pytest.fixture(scope="module")
def mlx_case(tiny_factory, tmp_path_factory):
    # Source: the released layout (mlx-lm only understands fused experts for qwen3_5_moe), in bf16 like
    # the real checkpoint, with a tokenizer (the converter copies it).
    src = tiny_factory("mlx", "fused_mm", "bfloat16", tokenizer=True)
    out = tmp_path_factory.mktemp("mlx4") / "model"
    tiny.make_mlx_checkpoint(src.path, out)
    text_cfg, sd = tiny.dequantize_mlx_checkpoint(out)
    deq_model = tiny.model_from_state_dict(text_cfg, sd)
    return {"src": src, "dir": out, "ref": tiny.Reference(deq_model, "MLX 4-bit"), "refs": {}}


@pytest.fixture(scope="module")
def mlx_engine(mlx_case):
    return lily.Engine.from_pretrained(str(mlx_case["dir"]), backend="cpu")


def _mlx_ref(case, ids, float32=True):
    key = ("mlx", float32, tuple(ids))
    if key not in case["refs"]:
        case["refs"][key] = tiny.mlx_reference_logits(case["dir"], ids, float32=float32)
    return case["refs"][key]


def _run_lily(eng, ids):
    """Prefill (all positions) then DECODE greedy steps; returns (tokens, logits rows for every position)."""
    s = eng.session(max_context=128)
    rows = list(s.prefill(ids, all_logits=True))
    fed = []
    for _ in range(DECODE):
        tok = int(np.argmax(rows[-1]))
        fed.append(tok)
        rows.append(s.step(tok))
    assert list(s.tokens) == list(ids) + fed
    return list(ids) + fed, np.stack(rows)


def test_converter_output_is_the_documented_format(mlx_case):
    """Guards the meaning of the other tests: 4-bit g64 linears, 8-bit routers, bf16 norms/conv."""
    summary = tiny.mlx_tensor_summary(mlx_case["dir"])
    cfg = json.loads((mlx_case["dir"] / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
    p = "language_model.model.layers.0."
    assert summary[p + "mlp.gate"] == ("q", 8, 64)
    assert summary[p + "mlp.shared_expert_gate"] == ("q", 8, 64)
    assert summary[p + "mlp.switch_mlp.gate_proj"] == ("q", 4, 64)
    assert summary[p + "mlp.switch_mlp.down_proj"] == ("q", 4, 64)
    assert summary[p + "linear_attn.in_proj_qkv"] == ("q", 4, 64)
    assert summary["language_model.model.embed_tokens"] == ("q", 4, 64)
    assert summary["language_model.lm_head"] == ("q", 4, 64)
    assert summary[p + "linear_attn.conv1d.weight"] == ("bfloat16",)
    assert summary[p + "input_layernorm.weight"] == ("bfloat16",)
    assert summary["language_model.model.layers.1.self_attn.q_norm.weight"] == ("bfloat16",)


def test_dequantizer_matches_mlx_lm(mlx_case):
    """The numpy dequantizer feeding reference (a) reproduces mx.dequantize on every quantized tensor
    (exactly, with fp32 scales/biases) and mlx-lm's own fp32 forward."""
    import mlx.core as mx

    raw = {}
    for f in sorted(mlx_case["dir"].glob("*.safetensors")):
        raw.update(mx.load(str(f)))
    summary = tiny.mlx_tensor_summary(mlx_case["dir"])
    nq = 0
    for base, info in summary.items():
        if info[0] != "q":
            continue
        _, bits, group = info
        w, sc, bi = raw[base + ".weight"], raw[base + ".scales"], raw[base + ".biases"]
        want = mx.dequantize(w, sc.astype(mx.float32), bi.astype(mx.float32), group_size=group, bits=bits)
        got = tiny.dequantize(np.array(w), np.array(sc.astype(mx.float32)), np.array(bi.astype(mx.float32)),
                              in_dim=want.shape[-1])
        assert np.array_equal(got, np.array(want)), base
        nq += 1
    assert nq > 0
    ids = tiny.random_tokens(mlx_case["src"].vocab, PREFILL, seed=21)
    err = tiny.rel_err(_mlx_ref(mlx_case, ids), mlx_case["ref"].np(ids)).max()
    # fp32 noise level; a wrong nibble order, scale/bias or norm shift gives errors of order 1.
    assert err <= REL_TOL, f"mlx-lm fp32 vs float64 oracle on the dequantized weights: {err:.2e}"


def test_lily_vs_transformers_dequantized(mlx_case, mlx_engine):
    ids = tiny.random_tokens(mlx_case["src"].vocab, PREFILL, seed=21)
    toks, got = _run_lily(mlx_engine, ids)
    rep = mlx_case["ref"].check(got, toks, "Lily vs dequantized references", tol=REL_TOL)
    print(f"MLX 4-bit: Lily vs dequantized references {rep}")


def test_lily_vs_mlx_lm(mlx_case, mlx_engine):
    ids = tiny.random_tokens(mlx_case["src"].vocab, PREFILL, seed=21)
    toks, got = _run_lily(mlx_engine, ids)
    ref = _mlx_ref(mlx_case, toks)
    # well posed: mlx-lm fp32 itself is within fp32 noise of the float64 oracle on these weights
    mlx_noise = tiny.rel_err(ref, mlx_case["ref"].np(toks)).max()
    assert mlx_noise <= tiny.Reference.MAX_NOISE, f"mlx-lm fp32 vs float64 oracle {mlx_noise:.2e}"
    err = tiny.rel_err(got, ref)
    top1 = float(np.mean(np.argmax(got, -1) == np.argmax(ref, -1)))
    native = _mlx_ref(mlx_case, toks, float32=False)
    nerr = tiny.rel_err(got, native)
    ntop1 = float(np.mean(np.argmax(got, -1) == np.argmax(native, -1)))
    print(
        f"MLX 4-bit: Lily vs mlx-lm fp32: max rel err {err.max():.2e}, top-1 agreement {top1:.3f}; "
        f"vs mlx-lm native bf16: max rel err {nerr.max():.2e}, median {np.median(nerr):.2e}, top-1 {ntop1:.3f}"
    )
    assert top1 >= 0.95, f"top-1 agreement with mlx-lm {top1:.3f}"
    assert err.max() <= REL_TOL, f"max rel err vs mlx-lm {err.max():.3e} at position {int(np.argmax(err))}"
