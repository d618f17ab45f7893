"""lily.quantize (bit-exact vs mx.quantize) and lily.convert (byte-exact vs mlx_lm.convert).

mlx (CPU build), mlx-lm, torch and transformers are test-only references, imported with importorskip.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from lily.checkpoint import SafetensorsFile, load_checkpoint
from lily.convert import convert
from lily.errors import CheckpointError
from lily.quantize import bf16_to_f32, dequantize, f32_to_bf16, quantize
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

# ------------------------------------------------------------------------------------------------
# quantize
# ------------------------------------------------------------------------------------------------


def _special_matrix(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random rows at very different scales plus the awkward cases (constant, one-signed, zero, huge)."""
    w = rng.standard_normal(shape).astype(np.float32)
    w *= np.exp(rng.uniform(-9, 6, size=shape[:-1] + (1,))).astype(np.float32)
    flat = w.reshape(-1, shape[-1])
    flat[0] = 3.0                                # constant positive row
    flat[1] = -np.abs(flat[1])                   # negative-only row
    flat[2] = 0.0                                # zeros row
    flat[3] = np.abs(flat[3])                    # positive-only row
    flat[4] *= 1e4                               # large magnitudes
    flat[5, : shape[-1] // 2] = -7.25            # constant groups inside a row
    flat[6] = 1e-9                               # tiny constant (scale clamps to 1e-7)
    flat[7, ::3] = 0.0
    flat[8] = np.linspace(-1, 1, shape[-1])      # exact ties between min and max magnitude
    return w


def _mx_bits(a, mx) -> np.ndarray:
    """Raw bits of an mlx array as a numpy array (bf16/f16 as uint16, f32 as uint32)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    if a.dtype == mx.float16:
        return np.array(a.view(mx.uint16))
    if a.dtype == mx.float32:
        return np.array(a.view(mx.uint32))
    return np.array(a)


def _np_bits(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float16:
        return a.view(np.uint16)
    if a.dtype == np.float32:
        return a.view(np.uint32)
    return a


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["bf16", "f32", "f16"])
@pytest.mark.parametrize(
    "shape,group",
    [((16, 64), 64), ((40, 512), 64), ((3, 24, 256), 64), ((32, 256), 32), ((32, 384), 128), ((9, 1024), 64)],
)
def test_quantize_bit_identical_to_mlx(bits, dtype, shape, group):
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(hash((bits, dtype, shape, group)) % 2**32)
    w = _special_matrix(rng, shape)
    if dtype == "bf16":
        wb = f32_to_bf16(w)
        ours = quantize(wb, group, bits, bf16=True)
        ref = mx.quantize(mx.array(wb).view(mx.bfloat16), group_size=group, bits=bits)
    elif dtype == "f16":
        wh = np.clip(w, -6e4, 6e4).astype(np.float16)  # stay finite in float16
        ours = quantize(wh, group, bits)
        ref = mx.quantize(mx.array(wh), group_size=group, bits=bits)
    else:
        ours = quantize(w, group, bits)
        ref = mx.quantize(mx.array(w), group_size=group, bits=bits)
    codes, scales, biases = ours
    assert codes.dtype == np.uint32 and codes.shape == (*shape[:-1], shape[-1] * bits // 32)
    assert scales.shape == biases.shape == (*shape[:-1], shape[-1] // group)
    np.testing.assert_array_equal(codes, np.array(ref[0]))
    np.testing.assert_array_equal(_np_bits(scales), _mx_bits(ref[1], mx))
    np.testing.assert_array_equal(_np_bits(biases), _mx_bits(ref[2], mx))


def test_quantize_strided_expert_slices_match_contiguous():
    # convert.py quantizes gate_up[:, :I, :] views without copying them first.
    rng = np.random.default_rng(3)
    gu = f32_to_bf16(rng.standard_normal((4, 128, 256)).astype(np.float32))
    for half in (gu[:, :64], gu[:, 64:]):
        a = quantize(half, 64, 4, bf16=True)
        b = quantize(np.ascontiguousarray(half), 64, 4, bf16=True)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    # threads do not change the result
    a = quantize(gu, 64, 8, bf16=True, threads=1)
    b = quantize(gu, 64, 8, bf16=True, threads=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_bf16_rounding_matches_mlx():
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1 << 16) * np.exp(rng.uniform(-60, 60, 1 << 16))).astype(np.float32)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, 1.00390625, 1.01171875]  # exact ties round to even
    ref = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    np.testing.assert_array_equal(f32_to_bf16(x), ref)
    np.testing.assert_array_equal(bf16_to_f32(ref), np.array(mx.array(ref).view(mx.bfloat16).astype(mx.float32)))


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_matches_mlx(bits):
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    # float32: identical to mx.dequantize
    c, s, b = quantize(w, 64, bits)
    ref = np.array(mx.dequantize(mx.array(c), mx.array(s), mx.array(b), group_size=64, bits=bits))
    np.testing.assert_array_equal(dequantize(c, s, b, 64, bits), ref)
    # bf16: mx rounds twice to bf16; the float32 reference is within one bf16 ulp of it
    wb = f32_to_bf16(w)
    c, s, b = quantize(wb, 64, bits, bf16=True)
    ours = dequantize(c, s, b, 64, bits)
    mref = mx.dequantize(mx.array(c), mx.array(s).view(mx.bfloat16), mx.array(b).view(mx.bfloat16),
                         group_size=64, bits=bits)
    mref = np.array(mref.astype(mx.float32))
    # mx.dequantize on the CPU is bf16(bf16(scale * q) + bias) (two roundings, MODEL.md section 9) ...
    sq = bf16_to_f32(s).repeat(64, axis=1)
    bq = bf16_to_f32(b).repeat(64, axis=1)
    q = (ours - bq) / np.where(sq == 0, 1, sq)
    q = np.rint(q)
    emulated = bf16_to_f32(f32_to_bf16(bf16_to_f32(f32_to_bf16(sq * q)) + bq))
    np.testing.assert_array_equal(emulated, mref)
    # ... so the float32 reference differs by about one bf16 ulp of the larger term
    np.testing.assert_array_less(np.abs(ours - mref), 2**-7 * (np.abs(sq * q) + np.abs(bq)) + 1e-6)
    # the quantization error is half a step, up to one step where snapping the edge clips the
    # opposite extreme, plus the bf16 rounding of the scale (up to n_bins x half a bf16 ulp)
    step = np.abs(bf16_to_f32(s)).repeat(64, axis=1)
    assert np.all(np.abs(ours - bf16_to_f32(wb)) <= (1.05 + ((1 << bits) - 1) * 2**-9) * step)


def test_quantize_rejects_bad_arguments():
    w = np.zeros((4, 100), np.float32)
    with pytest.raises(ValueError, match="group_size"):
        quantize(w, 64, 4)
    with pytest.raises(ValueError, match="bits=3"):
        quantize(np.zeros((4, 128), np.float32), 64, 3)
    with pytest.raises(TypeError):
        quantize(np.zeros((4, 128), np.uint16), 64, 4)  # bf16 bits need bf16=True


# ------------------------------------------------------------------------------------------------
# convert vs mlx_lm.convert
# ------------------------------------------------------------------------------------------------


def _tiny_text_kwargs(**over):
    kw = dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    kw.update(over)
    return kw


def _write_tokenizer(folder: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(97 + i): i for i in range(26)} | {"<unk>": 26}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<unk>"})
    )
    (folder / "chat_template.jinja").write_text("{{ messages }}")


def _build_hf_checkpoint(
    folder: Path, *, nested: bool = True, dtype: str = "bfloat16", tie: bool = False, seed: int = 0,
    per_expert: bool = False, extra: bool = True, **text_over,
) -> Path:
    """A tiny HF checkpoint whose names/shapes come from transformers' Qwen3_5MoeForCausalLM.

    Experts are written fused (gate_up_proj / down_proj) like the released checkpoint, since mlx-lm
    0.32.2 only converts that form for qwen3_5_moe; ``per_expert`` writes the other form.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    cfg = transformers.Qwen3_5MoeTextConfig(**_tiny_text_kwargs(tie_word_embeddings=tie, **text_over))
    model = transformers.Qwen3_5MoeForCausalLM(cfg)
    sd = {}
    for k, v in model.state_dict().items():
        if tie and k == "lm_head.weight":
            continue
        x = torch.randn(v.shape) * 0.05
        if k.endswith("A_log"):
            x = torch.log(torch.rand(v.shape) * 15 + 1)
        elif k.endswith("linear_attn.norm.weight"):
            x = 1 + x
        x = x.to(tdtype)
        if k.startswith("model.") and nested:
            k = "model.language_model." + k[len("model."):]
        if per_expert and k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            inter = x.shape[1] // 2
            for e in range(x.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"] = x[e, :inter].contiguous()
                sd[f"{base}{e}.up_proj.weight"] = x[e, inter:].contiguous()
            continue
        if per_expert and k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(x.shape[0]):
                sd[f"{base}{e}.down_proj.weight"] = x[e].contiguous()
            continue
        sd[k] = x.contiguous()
    if extra:
        # An MTP block as the release stores it (MODEL.md 7): top-level mtp.*, one full-attention layer
        # with per-expert experts; shapes from the model's own full-attention layer.
        H = cfg.hidden_size
        sd["mtp.fc.weight"] = (torch.randn(H, 2 * H) * 0.05).to(tdtype)
        for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            sd[f"mtp.{n}.weight"] = (torch.randn(H) * 0.05).to(tdtype)
        full = cfg.layer_types.index("full_attention")
        for k, v in model.state_dict().items():
            if not k.startswith(f"model.layers.{full}."):
                continue
            name = "mtp.layers.0." + k[len(f"model.layers.{full}."):]
            x = (torch.randn(v.shape) * 0.05).to(tdtype)
            if name.endswith("mlp.experts.gate_up_proj"):
                for e in range(x.shape[0]):
                    sd[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = x[e, : x.shape[1] // 2].contiguous()
                    sd[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = x[e, x.shape[1] // 2:].contiguous()
            elif name.endswith("mlp.experts.down_proj"):
                for e in range(x.shape[0]):
                    sd[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = x[e].contiguous()
            else:
                sd[name] = x.contiguous()
        if nested:
            sd["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(12, 4).to(tdtype)
    folder.mkdir(parents=True)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    text = cfg.to_dict()
    for k in ("transformers_version", "architectures", "output_hidden_states", "return_dict",
              "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
              "_name_or_path", "output_attentions"):
        text.pop(k, None)
    text["dtype"] = dtype
    if nested:
        config = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": tie,
            "image_token_id": 248056, "_name_or_path": "tiny",
        }
    else:
        # mlx-lm 0.32.2 knows no qwen3_5_moe_text module, so a flat config says qwen3_5_moe.
        config = dict(text, model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5], "do_sample": True}))
    _write_tokenizer(folder)
    return folder


def _read_all(folder: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        f = SafetensorsFile(folder / fname)
        for name, info in f.tensors.items():
            assert index["weight_map"][name] == fname
            out[name] = (info.dtype, info.shape, f.array(name).tobytes())
        assert f.metadata == {"format": "mlx"}
    return out


def _assert_same_mlx_checkpoint(ref: Path, ours: Path) -> None:
    a, b = _read_all(ref), _read_all(ours)
    assert set(a) == set(b)
    for k in a:
        assert a[k][:2] == b[k][:2], k  # dtype and shape
        assert a[k][2] == b[k][2], f"bytes differ for {k}"
    ia = json.loads((ref / "model.safetensors.index.json").read_text())
    ib = json.loads((ours / "model.safetensors.index.json").read_text())
    assert ia == ib  # weight_map (shard of every tensor), total_size, total_parameters
    ca = json.loads((ref / "config.json").read_text())
    cb = json.loads((ours / "config.json").read_text())
    assert ca["quantization"] == cb["quantization"]
    assert ca["quantization_config"] == cb["quantization_config"]
    assert list(ca["quantization"]) == list(cb["quantization"])  # per-path entries in the same order
    assert ca == cb
    assert (ref / "config.json").read_text() == (ours / "config.json").read_text()  # same formatting
    # Same file names, same header (key order, dtypes, shapes) up to data offsets; data order in the
    # file follows mlx's hash map, ours is sorted by name.
    for fname in sorted(p.name for p in ref.glob("*.safetensors")):
        assert (ours / fname).is_file()
        ha, hb = _header(ref / fname), _header(ours / fname)
        assert list(ha) == list(hb)
        assert {k: {kk: vv for kk, vv in v.items() if kk != "data_offsets"} for k, v in ha.items()} == \
               {k: {kk: vv for kk, vv in v.items() if kk != "data_offsets"} for k, v in hb.items()}


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def _mlx_lm_convert(src: Path, dst: Path) -> None:
    mlx_lm = pytest.importorskip("mlx_lm")
    mlx_lm.convert(str(src), mlx_path=str(dst), quantize=True)


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory) -> Path:
    return _build_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny")


def test_convert_matches_mlx_lm(hf_tiny, tmp_path):
    """Multimodal config, bf16, fused experts, vision tensors dropped; the MTP block dropped with
    mtp=False (as mlx-lm does) and kept by default, the rest unchanged."""
    _mlx_lm_convert(hf_tiny, tmp_path / "ref")
    out = convert(hf_tiny, tmp_path / "ours", progress=False, mtp=False)
    assert out == tmp_path / "ours"
    _assert_same_mlx_checkpoint(tmp_path / "ref", out)
    kept = convert(hf_tiny, tmp_path / "kept", progress=False)
    ref, ours = _read_all(tmp_path / "ref"), _read_all(kept)
    assert {k: v for k, v in ours.items() if not k.startswith("language_model.mtp.")} == ref
    assert any(k.startswith("language_model.mtp.layers.0.mlp.switch_mlp.") for k in ours)
    qr = json.loads((tmp_path / "ref" / "config.json").read_text())["quantization"]
    qk = json.loads((kept / "config.json").read_text())["quantization"]
    assert {k: v for k, v in qk.items() if not k.startswith("language_model.mtp.")} == qr
    assert load_checkpoint(kept).mtp_layers == 1
    cfg = json.loads((out / "config.json").read_text())
    assert "vision_config" not in cfg and "_name_or_path" not in cfg
    assert cfg["eos_token_id"] == [3, 5]
    assert cfg["quantization"]["language_model.model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    # tokenizer files are copied as they are (mlx-lm re-saves them through transformers instead)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (hf_tiny / name).read_bytes()
    assert (out / "generation_config.json").read_bytes() == (tmp_path / "ref" / "generation_config.json").read_bytes()
    ck = load_checkpoint(out)
    assert ck.format == "mlx"
    assert ck.quantization == {"default": "q4g64", "router": "q8g64", "shared_gate": "q8g64"}
    ck.close()


def test_convert_flat_fp32_tied_unquantizable(tmp_path):
    """Flat config with text-only names, fp32 weights and no torch_dtype (mlx-lm keeps fp32 then),
    tied embeddings (no lm_head) and an expert size (96) that is not a multiple of 64, so the
    down projections stay unquantized."""
    src = _build_hf_checkpoint(tmp_path / "hf", nested=False, dtype="float32", tie=True,
                               moe_intermediate_size=96, shared_expert_intermediate_size=96)
    _mlx_lm_convert(src, tmp_path / "ref")
    out = convert(src, tmp_path / "ours", progress=False, mtp=False)
    _assert_same_mlx_checkpoint(tmp_path / "ref", out)
    hdr = _header(out / "model.safetensors")
    assert "language_model.lm_head.weight" not in hdr
    assert hdr["language_model.model.layers.0.mlp.switch_mlp.down_proj.weight"]["dtype"] == "F32"
    assert hdr["language_model.model.layers.0.mlp.switch_mlp.gate_proj.scales"]["dtype"] == "F32"
    ck = load_checkpoint(out)
    assert ck.tensors["lm_head"] is ck.tensors["embed"]
    assert ck.tensors["layers.0.moe.experts.3.down"]["kind"] == "dense"
    ck.close()


def test_convert_sharded_matches_mlx_lm(hf_tiny, tmp_path, monkeypatch):
    """Shard split (parameter order), file names and index, with a tiny shard limit on both sides."""
    import mlx_lm.utils as mu

    limit = 150_000

    class _TinyGB(int):
        def __lshift__(self, n):  # make_shards computes max_file_size_gb << 30
            return limit

    monkeypatch.setattr(mu.make_shards, "__defaults__", (_TinyGB(1),))
    _mlx_lm_convert(hf_tiny, tmp_path / "ref")
    out = convert(hf_tiny, tmp_path / "ours", progress=False, max_shard_bytes=limit, mtp=False)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    _assert_same_mlx_checkpoint(tmp_path / "ref", out)
    ck = load_checkpoint(out)
    assert len(ck.files) == len(files)
    ck.close()


def test_convert_per_expert_equals_fused(tmp_path):
    """transformers' save_pretrained writes per-expert tensors; they convert to the same bytes."""
    fused = _build_hf_checkpoint(tmp_path / "fused", seed=7)
    per = _build_hf_checkpoint(tmp_path / "per", seed=7, per_expert=True)
    a = convert(fused, tmp_path / "a", progress=False)
    b = convert(per, tmp_path / "b", progress=False)
    _assert_same_mlx_checkpoint(a, b)


def test_convert_transformers_save_pretrained(tmp_path):
    """A checkpoint written by transformers itself (per-expert keys, model.* names, flat config)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5MoeTextConfig(**_tiny_text_kwargs())
    model = transformers.Qwen3_5MoeForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "hf")
    ck = load_checkpoint(tmp_path / "hf")
    assert ck.format == "hf" and ck.config.model_type == "qwen3_5_moe_text"
    sd = model.state_dict()
    # effective norm multiplier and expert views against the in-memory model
    w = sd["model.layers.0.input_layernorm.weight"].float().numpy()
    np.testing.assert_array_equal(ck.tensors["layers.0.input_norm"], 1 + w)
    gu = sd["model.layers.1.mlp.experts.gate_up_proj"].view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ck.tensors["layers.1.moe.experts.5.up"]["data"], gu[5, 64:])
    ck.close()
    out = convert(tmp_path / "hf", tmp_path / "mlx", progress=False)
    ck = load_checkpoint(out)
    assert ck.format == "mlx"
    ck.close()


def test_convert_equals_synthetic_mlx(tmp_path):
    """synthetic(fmt="hf") converted == synthetic(fmt="mlx", quant="exact") of the same seed."""
    hf = write_synthetic_checkpoint(tmp_path / "hf", TINY_CONFIG, fmt="hf", seed=5)
    mlx = write_synthetic_checkpoint(tmp_path / "mlx", TINY_CONFIG, fmt="mlx", seed=5, quant="exact")
    out = convert(hf, tmp_path / "conv", progress=False)
    _assert_same_mlx_checkpoint(mlx, out)


def test_mlx_checkpoint_matches_hf_weights(hf_tiny, tmp_path):
    """Lily's view of an mlx-lm-converted checkpoint equals its view of the HF one up to quantization:
    norms are 1 + w in both (bf16-rounded in MLX), the gated norm and conv are never shifted."""
    _mlx_lm_convert(hf_tiny, tmp_path / "ref")
    h = load_checkpoint(hf_tiny)
    m = load_checkpoint(tmp_path / "ref")
    assert h.format == "hf" and m.format == "mlx"
    assert h.skipped == {"vision": 1}
    assert h.mtp_layers == 1 and m.mtp_layers == 0  # mlx-lm drops the MTP block
    assert {n for n in h.tensors if not n.startswith("mtp.")} == set(m.tensors)
    for name, hv in h.tensors.items():
        if name.startswith("mtp."):
            continue
        mv = m.tensors[name]
        if isinstance(hv, np.ndarray):
            np.testing.assert_allclose(mv, hv, rtol=2**-8, atol=0, err_msg=name)
            continue
        ref = bf16_to_f32(hv["data"]) if hv["dtype"] == "bf16" else hv["data"].astype(np.float32)
        assert mv["kind"] == "affine" and mv["shape"] == hv["shape"], name
        deq = dequantize(mv["data"], mv["scales"], mv["biases"], mv["group"], mv["bits"])
        step = np.abs(bf16_to_f32(mv["scales"])).repeat(mv["group"], axis=1)
        bound = (1.05 + ((1 << mv["bits"]) - 1) * 2**-9) * step + 1e-6
        assert np.all(np.abs(deq - ref) <= bound), name
    h.close()
    m.close()


def test_convert_refuses_bad_inputs(hf_tiny, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        convert(hf_tiny, tmp_path / "full", progress=False)
    mlx = write_synthetic_checkpoint(tmp_path / "mlx", TINY_CONFIG, fmt="mlx")
    with pytest.raises(CheckpointError, match="already an MLX checkpoint"):
        convert(mlx, tmp_path / "again", progress=False)
    with pytest.raises(ValueError, match="bits=3"):
        convert(hf_tiny, tmp_path / "b3", bits=3, progress=False)
    assert not (tmp_path / "again").exists() and not (tmp_path / "again.lily-partial").exists()


def test_convert_progress_bar_and_8bit(hf_tiny, tmp_path, capsys):
    out = convert(hf_tiny, tmp_path / "q8", bits=8, progress=True)
    ck = load_checkpoint(out)
    assert ck.quantization == {"default": "q8g64"}
    assert ck.tensors["layers.0.delta.qkv"]["bits"] == 8
    ck.close()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 8
    assert os.path.getsize(out / "model.safetensors") > 0


@pytest.mark.parametrize("layout,experts", [("text", "fused"), ("multimodal", "per_expert")])
def test_synthetic_hf_loads_in_transformers(tmp_path, layout, experts):
    """transformers reads synthetic HF checkpoints with no missing or unexpected weights, the two
    layouts give the same model, and the random magnitudes keep the logits finite and moderate."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    p = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="hf", layout=layout, experts=experts, seed=2)
    model, info = transformers.Qwen3_5MoeForCausalLM.from_pretrained(
        p, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.tensor([[1, 5, 9, 100, 200, 300, 7, 8] * 8])
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and 0.3 < float(logits.std()) < 10
    ck = load_checkpoint(p)
    sd = model.state_dict()
    np.testing.assert_array_equal(ck.tensors["final_norm"], 1 + sd["model.norm.weight"].numpy())
    gu = sd["model.layers.0.mlp.experts.gate_up_proj"].numpy()
    np.testing.assert_array_equal(bf16_to_f32(ck.tensors["layers.0.moe.experts.2.up"]["data"]), gu[2, 64:])
    ck.close()


@pytest.mark.parametrize("quant", ["exact", "fast"])
def test_synthetic_mlx_loads_in_mlx_lm(tmp_path, quant):
    """mlx-lm loads synthetic MLX checkpoints strictly (every name, shape and quantization setting
    as it expects) and the logits stay finite."""
    mx = pytest.importorskip("mlx.core")
    mu = pytest.importorskip("mlx_lm.utils")
    p = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="mlx", quant=quant, seed=4)
    model, _ = mu.load_model(p, strict=True)
    logits = np.array(model(mx.array([[1, 5, 9, 100, 200, 300, 7, 8] * 8])).astype(mx.float32))
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 10
