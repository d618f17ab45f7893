"""lily.config, lily.checkpoint, lily.synthetic and lily.hub: loading, canonical names, zero-copy views
and a clear CheckpointError (naming the file and the tensor or field) for every kind of bad input.

numpy only: checkpoints come from lily.synthetic.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest

from lily.checkpoint import SafetensorsFile, SafetensorsWriter, load_checkpoint
from lily.config import ModelConfig
from lily.errors import CheckpointError
from lily.hub import resolve_model_path
from lily.quantize import bf16_to_f32, dequantize, f32_to_bf16
from lily.synthetic import MEDIUM_CONFIG, TINY_CONFIG, text_config, write_synthetic_checkpoint

P_HF = "model.language_model."
P_MLX = "language_model.model."


def expected_names(cfg: ModelConfig) -> set[str]:
    names = {"embed", "lm_head", "final_norm"}
    for i in range(cfg.num_hidden_layers):
        c = f"layers.{i}"
        names |= {f"{c}.input_norm", f"{c}.post_norm"}
        if cfg.is_full_attention(i):
            names |= {f"{c}.attn.{k}" for k in ("q", "k", "v", "o", "q_norm", "k_norm")}
        else:
            names |= {f"{c}.delta.{k}" for k in ("qkv", "z", "b", "a", "out", "conv", "dt_bias", "A_log", "norm")}
        names |= {f"{c}.moe.router", f"{c}.moe.shared_gate"}
        names |= {f"{c}.moe.shared.{p}" for p in ("gate", "up", "down")}
        names |= {f"{c}.moe.experts.{e}.{p}" for e in range(cfg.num_experts) for p in ("gate", "up", "down")}
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, V = cfg.hidden_size, cfg.vocab_size
    Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    out = {"embed": (V, H), "lm_head": (V, H), "final_norm": (H,)}
    for i in range(cfg.num_hidden_layers):
        c = f"layers.{i}"
        out[f"{c}.input_norm"] = out[f"{c}.post_norm"] = (H,)
        if cfg.is_full_attention(i):
            hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
            out.update({f"{c}.attn.q": (nh * 2 * hd, H), f"{c}.attn.k": (nkv * hd, H), f"{c}.attn.v": (nkv * hd, H),
                        f"{c}.attn.o": (H, nh * hd), f"{c}.attn.q_norm": (hd,), f"{c}.attn.k_norm": (hd,)})
        else:
            out.update({f"{c}.delta.qkv": (cfg.conv_dim, H), f"{c}.delta.z": (Hv * Dv, H), f"{c}.delta.b": (Hv, H),
                        f"{c}.delta.a": (Hv, H), f"{c}.delta.out": (H, Hv * Dv),
                        f"{c}.delta.conv": (cfg.conv_dim, cfg.linear_conv_kernel_dim),
                        f"{c}.delta.dt_bias": (Hv,), f"{c}.delta.A_log": (Hv,), f"{c}.delta.norm": (Dv,)})
        E, I, SI = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        out.update({f"{c}.moe.router": (E, H), f"{c}.moe.shared_gate": (1, H), f"{c}.moe.shared.gate": (SI, H),
                    f"{c}.moe.shared.up": (SI, H), f"{c}.moe.shared.down": (H, SI)})
        for e in range(E):
            out.update({f"{c}.moe.experts.{e}.gate": (I, H), f"{c}.moe.experts.{e}.up": (I, H),
                        f"{c}.moe.experts.{e}.down": (H, I)})
    return out


def dense_f32(desc: dict) -> np.ndarray:
    if desc["kind"] == "affine":
        return dequantize(desc["data"], desc["scales"], desc["biases"], desc["group"], desc["bits"])
    return bf16_to_f32(desc["data"]) if desc["dtype"] == "bf16" else desc["data"].astype(np.float32)


# ---- file surgery helpers --------------------------------------------------------------------------


def read_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    f = SafetensorsFile(path)
    out = {n: (t.dtype, f.array(n).copy()) for n, t in f.tensors.items()}
    f.close()
    return out


def write_tensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    specs = [(n, dt, a.shape) for n, (dt, a) in tensors.items()]
    with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as w:
        for n, (_, a) in tensors.items():
            w.write(n, a)


def edit(folder: Path, fn, fname: str = "model.safetensors") -> None:
    t = read_tensors(folder / fname)
    fn(t)
    write_tensors(folder / fname, t)
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        index = json.loads(idx.read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != fname or k in t}
        index["weight_map"].update({k: fname for k in t})
        idx.write_text(json.dumps(index))


def edit_config(folder: Path, fn) -> None:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def raises(folder: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(folder)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


@pytest.fixture
def hf(tmp_path) -> Path:
    return write_synthetic_checkpoint(tmp_path / "hf", TINY_CONFIG, fmt="hf", seed=1)


@pytest.fixture
def mlx(tmp_path) -> Path:
    return write_synthetic_checkpoint(tmp_path / "mlx", TINY_CONFIG, fmt="mlx", seed=1)


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------


def test_config_nested_and_flat_agree():
    tc = text_config(TINY_CONFIG)
    nested = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": tc})
    flat = ModelConfig.from_dict(dict(tc))
    assert nested.to_core() == flat.to_core()
    core = nested.to_core()
    assert set(core) == {"hidden", "layers", "vocab", "eps", "heads", "kv_heads", "head_dim", "rotary_dim",
                         "rope_theta", "lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim", "conv_kernel",
                         "experts", "topk", "moe_inter", "shared_inter", "full_attention"}
    assert core["full_attention"] == [False, False, False, True]
    assert core["rotary_dim"] == 16 and core["rope_theta"] == 1e7
    assert nested.conv_dim == 2 * 2 * 32 + 4 * 32


def test_config_rope_theta_sources_and_defaults():
    tc = text_config(TINY_CONFIG)
    c = ModelConfig.from_dict(dict(tc))
    assert c.rope_theta == 1e7 and any("rope_parameters.rope_theta" in n for n in c.notes)
    tc2 = dict(tc)
    tc2.pop("rope_parameters")
    tc2["rope_theta"] = 5e5
    tc2["partial_rotary_factor"] = 0.5
    c = ModelConfig.from_dict(tc2)
    assert c.rope_theta == 5e5 and c.rotary_dim == 32 and any("from rope_theta" in n for n in c.notes)
    tc2.pop("rope_theta")
    tc2.pop("partial_rotary_factor")
    c = ModelConfig.from_dict(tc2)
    assert c.rope_theta == 10000.0 and c.partial_rotary_factor == 0.25
    assert any("transformers' default" in n for n in c.notes)


def test_config_accepts_mrope_and_default_rope_blocks():
    # "mrope" is transformers' legacy alias of default RoPE; for text it is plain RoPE (MODEL.md 1.4)
    tc = text_config(TINY_CONFIG)
    tc["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert ModelConfig.from_dict(tc).rotary_dim == 16
    tc["rope_scaling"] = None
    tc["rope_parameters"]["rope_type"] = "default"
    assert ModelConfig.from_dict(tc).rope_theta == 1e7


def test_config_layer_types_from_interval():
    tc = text_config(dict(TINY_CONFIG, num_hidden_layers=8))
    tc.pop("layer_types")
    tc["full_attention_interval"] = 4
    c = ModelConfig.from_dict(tc)
    assert c.full_attention_layers == [3, 7]
    tc.pop("full_attention_interval")
    assert ModelConfig.from_dict(tc).full_attention_layers == [3, 7]  # transformers' default interval 4


def test_config_tie_word_embeddings():
    tc = text_config(TINY_CONFIG)
    tc.pop("tie_word_embeddings")
    assert ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": tc, "tie_word_embeddings": True}).tie_word_embeddings
    assert not ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": tc}).tie_word_embeddings


@pytest.mark.parametrize(
    "mutate,needles",
    [
        (lambda d: d.update(model_type="llama"), ["unsupported model_type 'llama'", "config.json", "qwen3_5_moe"]),
        (lambda d: d.pop("model_type"), ["model_type", "config.json"]),
        (lambda d: d["text_config"].pop("hidden_size"), ["text_config.hidden_size", "missing", "config.json"]),
        (lambda d: d["text_config"].update(num_experts=0), ["text_config.num_experts", "positive"]),
        (lambda d: d["text_config"].update(head_dim="64"), ["text_config.head_dim"]),
        (lambda d: d["text_config"].update(num_key_value_heads=3), ["num_key_value_heads", "divide"]),
        (lambda d: d["text_config"].update(linear_num_key_heads=3), ["linear_num_key_heads", "divide"]),
        (lambda d: d["text_config"].update(num_experts_per_tok=9), ["num_experts_per_tok", "exceeds"]),
        (lambda d: d["text_config"].update(layer_types=["linear_attention"] * 3), ["text_config.layer_types", "3 entries"]),
        (lambda d: d["text_config"]["layer_types"].__setitem__(1, "sliding"), ["text_config.layer_types[1]", "sliding"]),
        (lambda d: d["text_config"]["rope_parameters"].update(rope_type="yarn"), ["rope_parameters", "yarn", "not supported"]),
        (lambda d: d["text_config"].update(rope_scaling={"type": "linear", "factor": 2}), ["rope_scaling", "linear"]),
        (lambda d: d["text_config"]["rope_parameters"].update(partial_rotary_factor=0.3), ["partial_rotary_factor", "even"]),
        (lambda d: d["text_config"].update(tie_word_embeddings="yes"), ["tie_word_embeddings"]),
        (lambda d: d["text_config"].update(model_type="qwen3_next"), ["unsupported model_type 'qwen3_next'"]),
    ],
)
def test_config_errors_name_field_and_file(tmp_path, mutate, needles):
    d = {"model_type": "qwen3_5_moe", "text_config": text_config(TINY_CONFIG)}
    mutate(d)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as ei:
        ModelConfig.from_file(tmp_path)
    for n in needles:
        assert n in str(ei.value)


def test_config_file_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json.*not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        ModelConfig.from_file(tmp_path)


# ------------------------------------------------------------------------------------------------
# loading both formats
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["hf", "mlx"])
def test_load_canonical_names_kinds_shapes(tmp_path, fmt):
    p = write_synthetic_checkpoint(tmp_path / fmt, TINY_CONFIG, fmt=fmt)
    ck = load_checkpoint(p)
    cfg = ck.config
    assert ck.format == fmt
    assert set(ck.tensors) == expected_names(cfg)
    assert list(ck.tensors)[0] == "embed" and list(ck.tensors)[-2:] == ["final_norm", "lm_head"]
    shapes = expected_shapes(cfg)
    for name, t in ck.tensors.items():
        if isinstance(t, np.ndarray):
            assert t.dtype == np.float32 and t.shape == shapes[name], name
            continue
        assert t["shape"] == shapes[name], name
        assert t["source"].startswith("model.safetensors:"), t["source"]
        if fmt == "hf":
            assert t["kind"] == "dense" and t["dtype"] == "bf16" and t["data"].dtype == np.uint16
            assert t["data"].shape == shapes[name] and t["data"].flags.c_contiguous
        else:
            assert t["kind"] == "affine" and t["scale_dtype"] == "bf16"
            bits = 8 if name.endswith(("moe.router", "moe.shared_gate")) else 4
            assert (t["bits"], t["group"]) == (bits, 64), name
            rows, cols = shapes[name]
            assert t["data"].dtype == np.uint32 and t["data"].shape == (rows, cols * bits // 32)
            assert t["scales"].shape == t["biases"].shape == (rows, cols // 64)
            assert t["data"].flags.c_contiguous and t["scales"].flags.c_contiguous
    if fmt == "mlx":
        assert ck.quantization == {"default": "q4g64", "router": "q8g64", "shared_gate": "q8g64"}
    else:
        assert ck.quantization is None
    assert ck.skipped == {}
    assert ck.weight_bytes == sum(t.nbytes for f in ck.files for t in f.tensors.values())
    ck.close()


def test_hf_and_mlx_same_seed_describe_the_same_model(hf, mlx):
    """The MLX file stores 1 + w (bf16) for RMSNorm1p weights, HF stores w: both load as 1 + w.
    The gated DeltaNet norm is never shifted; the conv is [C, K] in both."""
    h, m = load_checkpoint(hf), load_checkpoint(mlx)
    for name, hv in h.tensors.items():
        mv = m.tensors[name]
        if isinstance(hv, np.ndarray):
            np.testing.assert_allclose(mv, hv, rtol=2**-8, atol=0, err_msg=name)
        else:
            ref, deq = dense_f32(hv), dense_f32(mv)
            step = np.abs(bf16_to_f32(mv["scales"])).repeat(mv["group"], axis=1)
            assert np.all(np.abs(deq - ref) <= (1.05 + ((1 << mv["bits"]) - 1) * 2**-9) * step + 1e-6), name
    raw = bf16_to_f32(h.files[0].array(P_HF + "layers.0.input_layernorm.weight"))
    np.testing.assert_array_equal(h.tensors["layers.0.input_norm"], 1 + raw)
    np.testing.assert_array_equal(h.tensors["layers.0.delta.norm"],
                                  bf16_to_f32(h.files[0].array(P_HF + "layers.0.linear_attn.norm.weight")))
    np.testing.assert_array_equal(h.tensors["layers.0.delta.conv"], m.tensors["layers.0.delta.conv"])
    np.testing.assert_array_equal(h.tensors["layers.0.delta.norm"], m.tensors["layers.0.delta.norm"])
    mraw = bf16_to_f32(m.files[0].array(P_MLX + "layers.3.self_attn.q_norm.weight"))
    np.testing.assert_array_equal(m.tensors["layers.3.attn.q_norm"], mraw)
    h.close()
    m.close()


def test_hf_multimodal_and_text_prefix_identical(tmp_path):
    a = load_checkpoint(write_synthetic_checkpoint(tmp_path / "mm", TINY_CONFIG, fmt="hf", layout="multimodal"))
    b = load_checkpoint(write_synthetic_checkpoint(tmp_path / "txt", TINY_CONFIG, fmt="hf", layout="text"))
    assert "model.layers.0.mlp.gate.weight" in b.files[0].tensors
    assert json.loads((tmp_path / "txt" / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    assert set(a.tensors) == set(b.tensors)
    for k, v in a.tensors.items():
        w = b.tensors[k]
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(v, w)
        else:
            np.testing.assert_array_equal(v["data"], w["data"])


def test_fused_and_per_expert_identical(tmp_path):
    a = load_checkpoint(write_synthetic_checkpoint(tmp_path / "f", TINY_CONFIG, fmt="hf", experts="fused"))
    b = load_checkpoint(write_synthetic_checkpoint(tmp_path / "p", TINY_CONFIG, fmt="hf", experts="per_expert"))
    assert P_HF + "layers.0.mlp.experts.gate_up_proj" in a.files[0].tensors
    assert P_HF + "layers.0.mlp.experts.7.down_proj.weight" in b.files[0].tensors
    E = a.config.num_experts
    for i in range(a.config.num_hidden_layers):
        for e in range(E):
            for p in ("gate", "up", "down"):
                n = f"layers.{i}.moe.experts.{e}.{p}"
                assert a.tensors[n]["data"].tobytes() == b.tensors[n]["data"].tobytes()
    gu = a.files[0].array(P_HF + "layers.2.mlp.experts.gate_up_proj")
    I = a.config.moe_intermediate_size
    np.testing.assert_array_equal(a.tensors["layers.2.moe.experts.5.gate"]["data"], gu[5, :I])
    np.testing.assert_array_equal(a.tensors["layers.2.moe.experts.5.up"]["data"], gu[5, I:])
    assert a.tensors["layers.2.moe.experts.5.up"]["source"].endswith("gate_up_proj[5][64:128]")


@pytest.mark.parametrize("fmt", ["hf", "mlx"])
def test_tied_embeddings(tmp_path, fmt):
    p = write_synthetic_checkpoint(tmp_path / fmt, dict(TINY_CONFIG, tie_word_embeddings=True), fmt=fmt)
    ck = load_checkpoint(p)
    assert ck.config.tie_word_embeddings
    assert ck.tensors["lm_head"] is ck.tensors["embed"]
    assert not any("lm_head" in n for f in ck.files for n in f.tensors)
    ck.close()
    if fmt == "hf":  # a stored lm_head in a tied checkpoint is ignored, like transformers does
        edit(p, lambda t: t.__setitem__("lm_head.weight", t[P_HF + "embed_tokens.weight"]))
        ck = load_checkpoint(p)
        assert ck.skipped == {"tied lm_head": 1} and ck.tensors["lm_head"] is ck.tensors["embed"]


@pytest.mark.parametrize("fmt", ["hf", "mlx"])
def test_sharded_with_index(tmp_path, fmt):
    one = load_checkpoint(write_synthetic_checkpoint(tmp_path / "one", TINY_CONFIG, fmt=fmt, seed=3))
    p = write_synthetic_checkpoint(tmp_path / "many", TINY_CONFIG, fmt=fmt, seed=3, max_shard_bytes=200_000)
    files = sorted(x.name for x in p.glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((p / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    many = load_checkpoint(p)
    assert len(many.files) == len(files)
    assert {t["source"].split(":")[0] for t in many.tensors.values() if isinstance(t, dict)} == set(files)
    for k, v in one.tensors.items():
        w = many.tensors[k]
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(v, w)
        else:
            for part in ("data", "scales", "biases"):
                if part in v:
                    np.testing.assert_array_equal(v[part], w[part])


def test_unindexed_multi_file_folder(tmp_path):
    """No index and no model.safetensors: every *.safetensors in the folder is read."""
    p = write_synthetic_checkpoint(tmp_path / "x", TINY_CONFIG, fmt="hf", max_shard_bytes=200_000)
    (p / "model.safetensors.index.json").unlink()
    ck = load_checkpoint(p)
    assert len(ck.files) >= 3 and set(ck.tensors) == expected_names(ck.config)


def test_zero_copy_views(hf, mlx):
    for p in (hf, mlx):
        ck = load_checkpoint(p)
        for name in ("embed", "layers.0.delta.qkv", "layers.1.moe.experts.3.up", "layers.3.attn.o"):
            d = ck.tensors[name]
            for part in ("data", "scales", "biases"):
                if part not in d:
                    continue
                arr = d[part]
                assert not arr.flags.owndata and not arr.flags.writeable
                base = arr
                while isinstance(base, np.ndarray) and base.base is not None:
                    base = base.base
                if isinstance(base, memoryview):  # np.frombuffer keeps a memoryview of the map
                    base = base.obj
                assert isinstance(base, mmap.mmap), type(base)
        stored = ck.files[0]
        name = (P_HF + "layers.1.mlp.experts.gate_up_proj") if ck.format == "hf" else \
            (P_MLX + "layers.1.mlp.switch_mlp.up_proj.weight")
        assert np.shares_memory(ck.tensors["layers.1.moe.experts.3.up"]["data"], stored.array(name))
        ck.close()


def test_skipped_vision(tmp_path):
    """Vision tensors are skipped and counted (the MTP block is loaded: tests/test_mtp_weights.py)."""
    bf = lambda *s: f32_to_bf16(np.ones(s, np.float32))  # noqa: E731
    extra = {"model.visual.blocks.0.attn.qkv.weight": bf(8, 8), "model.visual.merger.fc.weight": bf(4, 4)}
    ck = load_checkpoint(write_synthetic_checkpoint(tmp_path / "hf", TINY_CONFIG, fmt="hf", extra_tensors=extra))
    assert ck.skipped == {"vision": 2} and ck.mtp_layers == 0
    extra = {"vision_tower.blocks.0.w": bf(4, 4)}
    ck = load_checkpoint(write_synthetic_checkpoint(tmp_path / "mlx", TINY_CONFIG, fmt="mlx", extra_tensors=extra))
    assert ck.skipped == {"vision": 1}
    assert ck.weight_bytes < sum(t.nbytes for f in ck.files for t in f.tensors.values())


def test_f32_hf_and_f32_mlx(tmp_path):
    h = load_checkpoint(write_synthetic_checkpoint(tmp_path / "h", TINY_CONFIG, fmt="hf", dtype="f32"))
    assert h.tensors["embed"]["dtype"] == "f32" and h.tensors["embed"]["data"].dtype == np.float32
    m = load_checkpoint(write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="mlx", dtype="f32"))
    assert m.tensors["embed"]["scale_dtype"] == "f32" and m.tensors["embed"]["scales"].dtype == np.float32


def test_mlx_8bit_and_unquantized_modules(tmp_path):
    ck = load_checkpoint(write_synthetic_checkpoint(tmp_path / "q8", TINY_CONFIG, fmt="mlx", bits=8))
    assert ck.quantization == {"default": "q8g64"}
    # input dims that are not a multiple of the group stay dense bf16, as mlx-lm leaves them
    cfg = dict(TINY_CONFIG, moe_intermediate_size=96)
    ck = load_checkpoint(write_synthetic_checkpoint(tmp_path / "mix", cfg, fmt="mlx"))
    assert ck.tensors["layers.0.moe.experts.0.down"]["kind"] == "dense"
    assert ck.tensors["layers.0.moe.experts.0.gate"]["kind"] == "affine"
    assert ck.quantization["experts"] == "mixed:bf16,q4g64"


def test_mlx_fast_mode_and_medium_config_speed(tmp_path):
    """The benchmark's medium model (~0.9 B params) is written in seconds and loads."""
    t0 = time.perf_counter()
    p = write_synthetic_checkpoint(tmp_path / "med", MEDIUM_CONFIG, fmt="mlx")
    elapsed = time.perf_counter() - t0
    ck = load_checkpoint(p)
    assert ck.config.num_experts == 64 and ck.config.full_attention_layers == [3, 7, 11, 15]
    assert ck.quantization == {"default": "q4g64", "router": "q8g64", "shared_gate": "q8g64"}
    w = dense_f32(ck.tensors["layers.5.moe.experts.17.gate"])
    assert np.isfinite(w).all() and 0.5 / 32 < w.std() < 2 / 32  # ~ 1/sqrt(1024)
    assert (bf16_to_f32(ck.tensors["layers.5.moe.experts.17.gate"]["scales"]) < 0).any()
    assert elapsed < 60, elapsed
    ck.close()


# ------------------------------------------------------------------------------------------------
# bad inputs: every error names the file and the tensor or field
# ------------------------------------------------------------------------------------------------


def test_missing_tensor(hf, mlx):
    edit(hf, lambda t: t.pop(P_HF + "layers.0.linear_attn.in_proj_z.weight"))
    raises(hf, "layers.0.delta.z", P_HF + "layers.0.linear_attn.in_proj_z.weight")
    edit(mlx, lambda t: t.pop(P_MLX + "layers.3.self_attn.k_norm.weight"))
    raises(mlx, "layers.3.attn.k_norm", P_MLX + "layers.3.self_attn.k_norm.weight")


def test_missing_lm_head_and_experts(tmp_path):
    p = write_synthetic_checkpoint(tmp_path / "a", TINY_CONFIG, fmt="hf")
    edit(p, lambda t: t.pop("lm_head.weight"))
    raises(p, "lm_head", "tie_word_embeddings")
    p = write_synthetic_checkpoint(tmp_path / "b", TINY_CONFIG, fmt="hf")
    edit(p, lambda t: t.pop(P_HF + "layers.1.mlp.experts.down_proj"))
    raises(p, "layers.1.moe.experts", "experts.down_proj")
    p = write_synthetic_checkpoint(tmp_path / "c", TINY_CONFIG, fmt="hf", experts="per_expert")
    edit(p, lambda t: t.pop(P_HF + "layers.2.mlp.experts.6.up_proj.weight"))
    raises(p, "layers.2.moe.experts.6.up", "experts.6.up_proj.weight")


def test_extra_tensor(hf, mlx):
    edit(hf, lambda t: t.__setitem__(P_HF + "layers.0.mlp.foo.weight", ("BF16", np.zeros((2, 2), np.uint16))))
    raises(hf, "unexpected tensor", P_HF + "layers.0.mlp.foo.weight", "model.safetensors")
    edit(mlx, lambda t: t.__setitem__("something_else", ("F32", np.zeros(3, np.float32))))
    raises(mlx, "unexpected tensor 'something_else'", "model.safetensors")


def test_tensor_of_wrong_layer_kind(hf):
    edit(hf, lambda t: t.__setitem__(P_HF + "layers.0.self_attn.q_proj.weight", ("BF16", np.zeros((256, 128), np.uint16))))
    raises(hf, P_HF + "layers.0.self_attn.q_proj.weight", "linear_attention")


def test_wrong_shape(hf, mlx):
    edit(hf, lambda t: t.__setitem__(P_HF + "layers.0.mlp.gate.weight", ("BF16", np.zeros((8, 63), np.uint16))))
    raises(hf, f"tensor '{P_HF}layers.0.mlp.gate.weight' in 'model.safetensors' has shape [8, 63], expected [8, 128]")
    edit(mlx, lambda t: t.__setitem__(P_MLX + "layers.1.linear_attn.conv1d.weight", ("BF16", np.zeros((256, 3, 1), np.uint16))))
    raises(mlx, P_MLX + "layers.1.linear_attn.conv1d.weight", "[256, 3, 1]", "expected [256, 4, 1]")


def test_wrong_shape_quantized(mlx):
    def f(t):
        t[P_MLX + "layers.0.mlp.shared_expert.up_proj.scales"] = ("BF16", np.zeros((64, 3), np.uint16))
    edit(mlx, f)
    raises(mlx, P_MLX + "layers.0.mlp.shared_expert.up_proj", "model.safetensors")


def test_scales_biases_mismatch(mlx):
    edit(mlx, lambda t: t.__setitem__(P_MLX + "layers.0.mlp.gate.biases", ("F16", np.zeros((8, 2), np.float16))))
    raises(mlx, P_MLX + "layers.0.mlp.gate.biases", "F16", "BF16")


def test_scales_without_biases(mlx):
    edit(mlx, lambda t: t.pop(P_MLX + "layers.0.mlp.gate.biases"))
    raises(mlx, P_MLX + "layers.0.mlp.gate.scales", "biases")


def test_wrong_dtype(hf, mlx):
    edit(hf, lambda t: t.__setitem__(P_HF + "layers.1.linear_attn.A_log", ("I32", np.zeros(4, np.int32))))
    raises(hf, P_HF + "layers.1.linear_attn.A_log", "I32", "model.safetensors")
    edit(mlx, lambda t: t.__setitem__(P_MLX + "embed_tokens.weight", ("F32", np.zeros((512, 16), np.float32))))
    raises(mlx, P_MLX + "embed_tokens.weight", "F32", "U32")


def test_unsupported_bits(mlx):
    # 3-bit codes: 128 inputs pack into 12 words per row
    edit(mlx, lambda t: t.__setitem__(P_MLX + "layers.0.linear_attn.in_proj_z.weight", ("U32", np.zeros((128, 12), np.uint32))))
    raises(mlx, "unsupported quantization bits=3", P_MLX + "layers.0.linear_attn.in_proj_z.weight", "model.safetensors")


def test_unsupported_group(mlx):
    def f(t):
        for part in ("scales", "biases"):
            t[P_MLX + f"layers.0.mlp.gate.{part}"] = ("BF16", np.zeros((8, 8), np.uint16))  # group 16
    edit(mlx, f)
    raises(mlx, "group size 16", P_MLX + "layers.0.mlp.gate.scales")


def test_config_quantization_cross_check(mlx):
    edit_config(mlx, lambda c: c["quantization"][P_MLX + "layers.0.mlp.gate"].update(bits=4))
    raises(mlx, P_MLX + "layers.0.mlp.gate", "bits=8", "config.json")


def test_legacy_qwen3_next_layout(hf):
    def f(t):
        t[P_HF + "layers.0.linear_attn.in_proj_qkvz.weight"] = t.pop(P_HF + "layers.0.linear_attn.in_proj_qkv.weight")
    edit(hf, f)
    raises(hf, "legacy qwen3_next layout", "in_proj_qkvz", "model.safetensors")


def test_unsupported_model_type(hf):
    edit_config(hf, lambda c: c.update(model_type="qwen3_next"))
    raises(hf, "unsupported model_type 'qwen3_next'", "config.json")


def test_missing_config_field(hf):
    edit_config(hf, lambda c: c["text_config"].pop("num_experts"))
    raises(hf, "text_config.num_experts", "config.json")


def test_bad_layer_types(hf):
    edit_config(hf, lambda c: c["text_config"].update(layer_types=["full_attention", "linear_attention", "x", "full_attention"]))
    raises(hf, "text_config.layer_types[2]", "config.json")


def test_foreign_quantization_method(hf):
    edit_config(hf, lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    raises(hf, "unsupported quantization method 'fp8'", "config.json")


def test_no_config_or_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path / "empty")


def test_no_weight_files(hf):
    (hf / "model.safetensors").unlink()
    raises(hf, "no *.safetensors")


def test_truncated_file(hf):
    p = hf / "model.safetensors"
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size - 100)
    msg = raises(hf, "model.safetensors", "truncated")
    assert "tensor '" in msg


def test_corrupt_header_length(hf):
    p = hf / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")
    p.write_bytes(bytes(data))
    raises(hf, "model.safetensors", "header length 1000000000000")
    p.write_bytes(b"\x01\x02")
    raises(hf, "model.safetensors", "too short")


def test_header_not_json(hf):
    p = hf / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[8:20] = b"#not json!!#"
    p.write_bytes(bytes(data))
    raises(hf, "model.safetensors", "not valid JSON")


def test_header_not_object(hf):
    p = hf / "model.safetensors"
    data = bytearray(p.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8: 8 + n] = (b"[1, 2, 3]" + b" " * n)[:n]
    p.write_bytes(bytes(data))
    raises(hf, "model.safetensors", "JSON object")


def _rewrite_header(path: Path, fn) -> None:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + n])
    fn(header)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (n - len(h)) if len(h) <= n else b""
    assert len(h) == n, "test helper keeps the header length"
    path.write_bytes(data[:8] + h + data[8 + n:])


def test_unknown_dtype_in_header(hf):
    name = P_HF + "layers.0.mlp.gate.weight"
    _rewrite_header(hf / "model.safetensors", lambda h: h[name].update(dtype="BF7"))
    raises(hf, name, "unknown dtype 'BF7'", "model.safetensors")


def test_overlapping_offsets(hf):
    a, b = P_HF + "layers.0.mlp.gate.weight", P_HF + "layers.1.mlp.gate.weight"

    def f(h):
        h[b]["data_offsets"] = list(h[a]["data_offsets"])
    _rewrite_header(hf / "model.safetensors", f)
    raises(hf, "overlap", "model.safetensors", "mlp.gate.weight")


def test_span_mismatch(hf):
    name = P_HF + "layers.0.mlp.gate.weight"
    _rewrite_header(hf / "model.safetensors", lambda h: h[name].update(shape=[8, 127]))
    raises(hf, name, "does not match shape", "model.safetensors")


def test_index_points_to_missing_shard(tmp_path):
    p = write_synthetic_checkpoint(tmp_path / "s", TINY_CONFIG, fmt="hf", max_shard_bytes=200_000)
    victim = sorted(p.glob("model-*.safetensors"))[1]
    victim.unlink()
    raises(p, "model.safetensors.index.json", victim.name, "does not exist")


def test_index_lists_tensor_absent_from_shard(tmp_path):
    p = write_synthetic_checkpoint(tmp_path / "s", TINY_CONFIG, fmt="hf", max_shard_bytes=200_000)
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    name = P_HF + "layers.2.mlp.gate.weight"
    wrong = next(f for f in sorted(set(idx["weight_map"].values())) if f != idx["weight_map"][name])
    idx["weight_map"][name] = wrong
    (p / "model.safetensors.index.json").write_text(json.dumps(idx))
    raises(p, name, wrong, "model.safetensors.index.json", "absent")


def test_close_releases_maps(hf):
    ck = load_checkpoint(hf)
    f = ck.files[0]
    ck.close()
    assert ck.tensors == {} and f._mm is None
    with pytest.raises(CheckpointError, match="closed"):
        f.array(next(iter(f.tensors)))


# ------------------------------------------------------------------------------------------------
# hub
# ------------------------------------------------------------------------------------------------


def _fake_hub_cache(cache: Path, repo: str, files: dict[str, bytes], sha: str = "a" * 40) -> Path:
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    snap = root / "snapshots" / sha
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(sha)
    for fname, data in files.items():
        (snap / fname).write_bytes(data)
    return snap


def test_hub_resolution_offline(tmp_path, monkeypatch, hf):
    cache = tmp_path / "cache"
    files = {p.name: p.read_bytes() for p in hf.iterdir()}
    snap = _fake_hub_cache(cache, "lily-test/tiny", files)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = resolve_model_path("lily-test/tiny")
    assert got.resolve() == snap.resolve()
    assert resolve_model_path("lily-test/tiny", revision="a" * 40).resolve() == snap.resolve()
    ck = load_checkpoint(got)
    assert ck.format == "hf"
    ck.close()
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        resolve_model_path("lily-test/missing")
    with pytest.raises(CheckpointError, match="lily-test/tiny"):
        resolve_model_path("lily-test/tiny", revision="other-branch")


def test_hub_local_paths(tmp_path, hf):
    assert resolve_model_path(hf) == hf
    assert resolve_model_path(str(hf)) == hf
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(CheckpointError, match="noconfig.*config.json"):
        resolve_model_path(tmp_path / "noconfig")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path(str(tmp_path / "a" / "b" / "c"))
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_model_path(hf / "config.json")


def test_hub_invalid_repo_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError):
        resolve_model_path("not a valid repo id!!")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
