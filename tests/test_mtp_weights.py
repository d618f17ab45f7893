"""The MTP block's weights (MODEL.md section 7; issue 14 item 1): loaded from Hugging Face checkpoints in
every naming and expert layout, kept by ``lily convert`` (quantized like the decoder layers), loaded back
from the MLX output, reported by ``engine.report()["mtp"]``; a partial block is a CheckpointError naming
the missing tensor, and a checkpoint without one loads as before. The graph does not read the block yet.

numpy only, except the mlx-lm compatibility check (importorskip).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import lily
from lily.checkpoint import SafetensorsFile, SafetensorsWriter, load_checkpoint
from lily.convert import add_one, convert
from lily.errors import CheckpointError
from lily.quantize import bf16_to_f32, quantize
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

# 16 experts: stored one tensor per expert in name order, "experts.10" sorts before "experts.2", so the
# per-expert MTP experts of the release's layout are off a uniform stride and get repacked.
CFG16 = dict(TINY_CONFIG, num_experts=16)


def mtp_names(E: int, layers: int = 1) -> set[str]:
    """The MTP block's canonical names (lily/checkpoint.py docstring)."""
    names = {"mtp.fc", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"}
    for j in range(layers):
        c = f"mtp.layers.{j}"
        names |= {f"{c}.input_norm", f"{c}.post_norm", f"{c}.moe.router", f"{c}.moe.shared_gate"}
        names |= {f"{c}.attn.{k}" for k in ("q", "k", "v", "o", "q_norm", "k_norm")}
        names |= {f"{c}.moe.shared.{p}" for p in ("gate", "up", "down")}
        names |= {f"{c}.moe.experts.{e}.{p}" for e in range(E) for p in ("gate", "up", "down")}
    return names


def stored(folder: Path) -> dict[str, SafetensorsFile]:
    """Stored tensor name -> its file, over every safetensors file of the folder."""
    out = {}
    for p in sorted(folder.glob("*.safetensors")):
        f = SafetensorsFile(p)
        out |= {n: f for n in f.tensors}
    return out


def drop_tensor(folder: Path, name: str) -> None:
    """Rewrite the file holding ``name`` without it (and its index entry, if any)."""
    src = stored(folder)[name]
    keep = [n for n in src.tensors if n != name]
    arrays = {n: np.array(src.array(n)) for n in keep}
    specs = [(n, src.tensors[n].dtype, src.tensors[n].shape) for n in keep]
    path = src.path
    src.close()
    with SafetensorsWriter(path, specs, metadata=src.metadata) as w:
        for n in keep:
            w.write(n, arrays[n])
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].pop(name, None)
        index.write_text(json.dumps(data))


def edit_config(folder: Path, **text_fields) -> None:
    """Set (or, with None, remove) text-config fields of config.json."""
    raw = json.loads((folder / "config.json").read_text())
    tc = raw.get("text_config", raw)
    for k, v in text_fields.items():
        if v is None:
            tc.pop(k, None)
        else:
            tc[k] = v
    (folder / "config.json").write_text(json.dumps(raw))


# ------------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ------------------------------------------------------------------------------------------------

# (layout, decoder experts, MTP experts): the release is multimodal naming, fused decoder experts and
# per-expert MTP experts (MODEL.md 7); transformers' save_pretrained writes per-expert everywhere.
HF_LAYOUTS = [
    ("multimodal", "fused", "per_expert"),
    ("multimodal", "per_expert", "fused"),
    ("text", "fused", "fused"),
    ("text", "per_expert", "per_expert"),
]


@pytest.mark.parametrize("layout,experts,mtp_experts", HF_LAYOUTS)
def test_hf_mtp_block_loads_in_every_layout(tmp_path, layout, experts, mtp_experts):
    p = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="hf", layout=layout, experts=experts,
                                   mtp_layers=1, mtp_experts=mtp_experts, seed=3)
    ck = load_checkpoint(p)
    assert ck.mtp_layers == 1 and ck.format == "hf"
    assert {n for n in ck.tensors if n.startswith("mtp.")} == mtp_names(TINY_CONFIG["num_experts"])
    st = stored(p)
    assert all(n.startswith("mtp.") for n in st if "mtp" in n)  # top-level in both namings
    assert ck.mtp_bytes == sum(f.tensors[n].nbytes for n, f in st.items() if n.startswith("mtp."))
    assert ck.weight_bytes == sum(f.tensors[n].nbytes for n, f in st.items())  # everything is used
    assert ck.skipped == {}
    # Norms are RMSNorm1p: the effective multiplier 1 + w (HF stores w), like the decoder's.
    for canon, name in (("mtp.norm", "mtp.norm.weight"), ("mtp.pre_fc_norm_hidden", "mtp.pre_fc_norm_hidden.weight"),
                        ("mtp.layers.0.attn.q_norm", "mtp.layers.0.self_attn.q_norm.weight")):
        np.testing.assert_array_equal(ck.tensors[canon], 1 + bf16_to_f32(st[name].array(name)))
    # Matrices are views of the mapping; the fc keeps [hidden, 2 * hidden] (embedding half first).
    fc = ck.tensors["mtp.fc"]
    mapped = next(f for f in ck.files if "mtp.fc.weight" in f.tensors)
    assert fc["shape"] == (128, 256) and np.shares_memory(fc["data"], mapped.array("mtp.fc.weight"))
    up5 = ck.tensors["mtp.layers.0.moe.experts.5.up"]["data"]
    if mtp_experts == "fused":
        gu = st["mtp.layers.0.mlp.experts.gate_up_proj"].array("mtp.layers.0.mlp.experts.gate_up_proj")
        np.testing.assert_array_equal(up5, gu[5, 64:])
    else:
        name = "mtp.layers.0.mlp.experts.5.up_proj.weight"
        np.testing.assert_array_equal(up5, st[name].array(name))
    ck.close()


def test_engine_reports_the_mtp_block_and_the_decoder_is_unchanged(tmp_path):
    """report()["mtp"] says present / layers / bytes and how the block is used; the decoder's weights and
    its logits are those of the same weights without the block (the block's KV rows run in every forward,
    tests/test_mtp_decode.py, but never feed the decoder). 16 experts: the release's per-expert MTP experts
    are repacked, counted as the block's, and the decoder stays stacked in place."""
    with_mtp = write_synthetic_checkpoint(tmp_path / "a", CFG16, fmt="hf", mtp_layers=1, seed=4)
    without = write_synthetic_checkpoint(tmp_path / "b", CFG16, fmt="hf", seed=4)
    a = lily.Engine.from_pretrained(str(with_mtp), backend="cpu")
    b = lily.Engine.from_pretrained(str(without), backend="cpu")
    ra, rb = a.report(), b.report()
    m = ra["mtp"]
    assert m["present"] is True and m["layers"] == 1 and m["format"] == "bf16"
    assert m["bytes"] == a.checkpoint.mtp_bytes > 0
    assert m["status"].startswith("loaded and placed with the decoder")
    assert m["experts_layout"].startswith("repacked at load: 3 expert projections") and m["repacked_expert_bytes"] > 0
    assert ra["experts_layout"].startswith("stacked in place") and ra["memory"]["repacked_expert_bytes"] == 0
    assert ra["memory"]["weights_mapped_bytes"] == rb["memory"]["weights_mapped_bytes"]  # the decoder's only
    assert rb["mtp"] == {"present": False, "layers": 0, "bytes": 0, "status": rb["mtp"]["status"],
                         "policy": rb["mtp"]["policy"]}
    assert rb["mtp"]["policy"]["decision"] == "off: the checkpoint has no MTP head"
    assert m["policy"]["mode"] == "auto" and m["policy"]["keeps_rows"]
    assert rb["mtp"]["status"].startswith("none in this checkpoint")
    # the block's KV rows are part of every step
    assert ra["ops_per_step"]["decode_step"]["ops"] > rb["ops_per_step"]["decode_step"]["ops"]
    ids = [1, 7, 3, 200, 45, 9, 300, 2]
    la = a.session(max_context=16).prefill(ids, all_logits=True)
    lb = b.session(max_context=16).prefill(ids, all_logits=True)
    assert np.array_equal(la, lb)
    assert any("MTP" in o and "report()['mtp']" in o for o in ra["optimizations"])


def test_checkpoint_without_mtp_loads_as_before(tmp_path):
    """No mtp.* tensors: no block, nothing named mtp.*, even when config.json announces one (mlx-lm keeps
    mtp_num_hidden_layers and drops the tensors): a note says so."""
    for fmt in ("hf", "mlx"):
        p = write_synthetic_checkpoint(tmp_path / fmt, TINY_CONFIG, fmt=fmt)
        ck = load_checkpoint(p)
        assert ck.mtp_layers == 0 and ck.mtp_bytes == 0
        assert not any(n.startswith("mtp") for n in ck.tensors)
        assert ck.config.mtp_num_hidden_layers is None
        ck.close()
        edit_config(p, mtp_num_hidden_layers=1)
        ck = load_checkpoint(p)
        assert ck.mtp_layers == 0 and ck.config.mtp_num_hidden_layers == 1
        assert any("mtp_num_hidden_layers=1" in n and "no mtp.* tensors" in n for n in ck.notes)
        e = lily.Engine(ck, backend="cpu")
        assert e.report()["mtp"]["present"] is False


# Each entry: (format, MTP experts, stored tensor to delete, canonical name the error names).
PARTIAL = [
    ("hf", "per_expert", "mtp.fc.weight", "mtp.fc"),
    ("hf", "per_expert", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_embedding"),
    ("hf", "per_expert", "mtp.norm.weight", "mtp.norm"),
    ("hf", "per_expert", "mtp.layers.0.self_attn.k_proj.weight", "mtp.layers.0.attn.k"),
    ("hf", "per_expert", "mtp.layers.0.post_attention_layernorm.weight", "mtp.layers.0.post_norm"),
    ("hf", "per_expert", "mtp.layers.0.mlp.experts.5.up_proj.weight", "mtp.layers.0.moe.experts.5.up"),
    ("hf", "fused", "mtp.layers.0.mlp.experts.down_proj", "mtp.layers.0.moe.experts"),
    ("hf", "fused", "mtp.layers.0.mlp.shared_expert_gate.weight", "mtp.layers.0.moe.shared_gate"),
    ("mlx", None, "language_model.mtp.fc.weight", "mtp.fc"),
    ("mlx", None, "language_model.mtp.layers.0.mlp.switch_mlp.gate_proj.weight", "mtp.layers.0.moe.experts.0.gate"),
    ("mlx", None, "language_model.mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_hidden"),
]


@pytest.mark.parametrize("fmt,mtp_experts,name,canonical", PARTIAL)
def test_partial_mtp_block_names_the_missing_tensor(tmp_path, fmt, mtp_experts, name, canonical):
    kw = {"mtp_experts": mtp_experts} if mtp_experts else {}
    p = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt=fmt, mtp_layers=1, **kw)
    drop_tensor(p, name)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    msg = str(e.value)
    assert f"is missing tensor for '{canonical}'" in msg and f"'{name}'" in msg, msg


def test_mtp_layer_count_follows_the_config_or_the_names(tmp_path):
    p = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="hf", mtp_layers=1, mtp_experts="fused")
    # config.json says 2: layer 1 is missing, named
    edit_config(p, mtp_num_hidden_layers=2)
    with pytest.raises(CheckpointError, match=r"missing tensor for 'mtp\.layers\.1\.input_norm': looked for "
                                              r"'mtp\.layers\.1\.input_layernorm\.weight'"):
        load_checkpoint(p)
    # config.json says 0: the block's tensors are unexpected
    edit_config(p, mtp_num_hidden_layers=0)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'mtp\..*mtp_num_hidden_layers=0"):
        load_checkpoint(p)
    # no field: the layers the names mention, with a note
    edit_config(p, mtp_num_hidden_layers=None)
    ck = load_checkpoint(p)
    assert ck.mtp_layers == 1 and any("counted from the tensor names" in n for n in ck.notes)
    ck.close()
    # a second layer's tensors the config does not announce are unexpected
    two = write_synthetic_checkpoint(tmp_path / "two", TINY_CONFIG, fmt="hf", mtp_layers=2, mtp_experts="fused")
    assert load_checkpoint(two).mtp_layers == 2
    edit_config(two, mtp_num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'mtp\.layers\.1\..*config\.json says "
                                              r"mtp_num_hidden_layers=1"):
        load_checkpoint(two)
    with pytest.raises(CheckpointError, match="mtp_num_hidden_layers' must be a non-negative integer"):
        edit_config(two, mtp_num_hidden_layers=-1)
        load_checkpoint(two)


def test_mtp_under_two_names_is_refused(tmp_path):
    """``mtp.x`` and ``model.mtp.x`` are one weight: two copies are an error, not a silent choice."""
    p = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="hf", mtp_layers=1, mtp_experts="fused",
                                   extra_tensors={"model.mtp.norm.weight": np.zeros(128, np.float32)})
    with pytest.raises(CheckpointError, match="are the same weight under two names"):
        load_checkpoint(p)


# ------------------------------------------------------------------------------------------------
# lily convert: the block survives, quantized like the decoder layers
# ------------------------------------------------------------------------------------------------


def _hf_mtp(st: dict[str, SafetensorsFile], rel: str) -> np.ndarray:
    return st[rel].array(rel)


def test_convert_keeps_the_mtp_block_byte_for_byte(tmp_path):
    """The release's layout (multimodal, fused decoder experts, per-expert MTP experts) converted: every
    language_model.mtp.* tensor is lily.quantize of the HF tensor (experts stacked; 8-bit router and
    shared gate, 4-bit elsewhere), norms are bf16(1 + w); the output loads back with the same block, and
    equals lily.synthetic's MLX checkpoint of the same seed."""
    hf = write_synthetic_checkpoint(tmp_path / "hf", TINY_CONFIG, fmt="hf", mtp_layers=1, seed=6)
    out = convert(hf, tmp_path / "mlx", progress=False)
    st, ot = stored(hf), stored(out)
    T, E = "language_model.mtp.", TINY_CONFIG["num_experts"]
    mtp_out = {n for n in ot if n.startswith(T)}
    assert mtp_out and not any("mtp" in n for n in ot if not n.startswith(T))

    def check_q(out_base: str, w: np.ndarray, bits: int) -> None:
        codes, scales, biases = quantize(w, 64, bits, bf16=True)
        for part, ref in (("weight", codes), ("scales", scales), ("biases", biases)):
            got = ot[f"{out_base}.{part}"].array(f"{out_base}.{part}")
            assert got.dtype == ref.dtype and np.array_equal(got, ref), f"{out_base}.{part}"
            mtp_out.discard(f"{out_base}.{part}")

    check_q(T + "fc", _hf_mtp(st, "mtp.fc.weight"), 4)
    L, R = T + "layers.0.", "mtp.layers.0."
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        check_q(L + "self_attn." + proj, _hf_mtp(st, R + f"self_attn.{proj}.weight"), 4)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        check_q(L + "mlp.shared_expert." + proj, _hf_mtp(st, R + f"mlp.shared_expert.{proj}.weight"), 4)
        stack = np.stack([_hf_mtp(st, R + f"mlp.experts.{e}.{proj}.weight") for e in range(E)])
        check_q(L + "mlp.switch_mlp." + proj, stack, 4)
    check_q(L + "mlp.gate", _hf_mtp(st, R + "mlp.gate.weight"), 8)
    check_q(L + "mlp.shared_expert_gate", _hf_mtp(st, R + "mlp.shared_expert_gate.weight"), 8)
    for o, h in ((T + "norm.weight", "mtp.norm.weight"), (T + "pre_fc_norm_embedding.weight",
                                                         "mtp.pre_fc_norm_embedding.weight"),
                 (T + "pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_hidden.weight"),
                 (L + "input_layernorm.weight", R + "input_layernorm.weight"),
                 (L + "self_attn.k_norm.weight", R + "self_attn.k_norm.weight")):
        assert np.array_equal(ot[o].array(o), add_one(_hf_mtp(st, h), "BF16")), o
        mtp_out.discard(o)
    assert mtp_out == {L + "post_attention_layernorm.weight", L + "self_attn.q_norm.weight"}  # same rule

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"][T + "layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert cfg["quantization"][T + "layers.0.mlp.shared_expert_gate"] == {"group_size": 64, "bits": 8}
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1

    back = load_checkpoint(out)
    assert back.format == "mlx" and back.mtp_layers == 1
    assert {n for n in back.tensors if n.startswith("mtp.")} == mtp_names(E)
    assert back.quantization == {"default": "q4g64", "router": "q8g64", "shared_gate": "q8g64"}
    assert back.tensors["mtp.layers.0.moe.router"]["bits"] == 8 and back.tensors["mtp.fc"]["bits"] == 4
    # the loaded norms are the effective multipliers, as from the HF file (up to bf16 rounding of 1 + w)
    h = load_checkpoint(hf)
    np.testing.assert_allclose(back.tensors["mtp.norm"], h.tensors["mtp.norm"], rtol=2**-8, atol=0)
    h.close()
    r = lily.Engine(back, backend="cpu").report()["mtp"]
    assert r["present"] and r["layers"] == 1 and r["format"] == "q4g64"
    assert r["experts_layout"].startswith("stacked in place")  # switch_mlp stacks: no repack

    synth = write_synthetic_checkpoint(tmp_path / "synth", TINY_CONFIG, fmt="mlx", mtp_layers=1, seed=6,
                                       quant="exact")
    ss = stored(synth)
    assert set(ss) == set(ot)
    for n in ot:
        assert np.array_equal(ss[n].array(n), ot[n].array(n)), n


def test_convert_without_mtp_is_what_mlx_lm_writes(tmp_path):
    """convert(mtp=False) and the CLI's --no-mtp drop the block: the output is byte for byte the
    conversion of the same weights without one (what mlx-lm makes of both, tests/test_quantize_convert.py)."""
    a = write_synthetic_checkpoint(tmp_path / "a", TINY_CONFIG, fmt="hf", mtp_layers=1, seed=8)
    b = write_synthetic_checkpoint(tmp_path / "b", TINY_CONFIG, fmt="hf", seed=8)
    oa = convert(a, tmp_path / "oa", progress=False, mtp=False)
    ob = convert(b, tmp_path / "ob", progress=False)
    assert (oa / "model.safetensors").read_bytes() == (ob / "model.safetensors").read_bytes()
    assert (oa / "model.safetensors.index.json").read_bytes() == (ob / "model.safetensors.index.json").read_bytes()
    ca, cb = (json.loads((o / "config.json").read_text()) for o in (oa, ob))
    assert ca["quantization"] == cb["quantization"]
    ck = load_checkpoint(oa)
    assert ck.mtp_layers == 0 and any("no mtp.* tensors" in n for n in ck.notes)  # the config still says 1
    ck.close()
    from lily.cli import main

    assert main(["convert", str(a), str(tmp_path / "cli"), "--no-mtp"]) == 0
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == (ob / "model.safetensors").read_bytes()


def test_mlx_lm_loads_lilys_output_with_an_mtp_block(tmp_path):
    """mlx-lm's sanitize drops every key containing "mtp." (MODEL.md 8b), so Lily's MLX output with the
    block still loads there strictly, giving the logits of the output without it."""
    mx = pytest.importorskip("mlx.core")
    mu = pytest.importorskip("mlx_lm.utils")
    p = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="mlx", quant="exact", mtp_layers=1, seed=4)
    q = write_synthetic_checkpoint(tmp_path / "q", TINY_CONFIG, fmt="mlx", quant="exact", seed=4)
    ids = mx.array([[1, 5, 9, 100, 200, 300, 7, 8]])
    lp = np.array(mu.load_model(p, strict=True)[0](ids).astype(mx.float32))
    lq = np.array(mu.load_model(q, strict=True)[0](ids).astype(mx.float32))
    assert np.isfinite(lp).all() and np.array_equal(lp, lq)


def _cuda_dry_status() -> str:
    import lily._core as core

    if not getattr(core, "has_cuda", False):
        return "the extension was built without the CUDA backend"
    try:
        core.OpBench("cuda", {"dry_arch": 90})
    except Exception as e:  # NVRTC missing: the message says which
        return str(e)
    return ""


def test_cuda_backend_places_the_mtp_block_once(tmp_path):
    """The CUDA backend (dry mode: compile and record, no GPU) loads a checkpoint with an MTP block, places
    the block's matrices with the decoder's (the graph reads them in every forward) and no second lm_head: the
    extra device weight bytes are at most the block's stored bytes. A prefill and a speculative generate
    encode on it."""
    why = _cuda_dry_status()
    if why:
        pytest.skip(f"CUDA dry mode unavailable: {why}")
    import lily.engine  # noqa: F401  (NVRTC search paths)

    a = write_synthetic_checkpoint(tmp_path / "a", CFG16, fmt="hf", mtp_layers=1, seed=4)
    b = write_synthetic_checkpoint(tmp_path / "b", CFG16, fmt="hf", seed=4)
    mem = {}
    for name, p in (("with", a), ("without", b)):
        with lily.Engine(load_checkpoint(p), backend="cuda", prefill_chunk=16,
                         backend_options={"dry_arch": 90, "cache_dir": str(tmp_path / "cache")}) as e:
            s = e.session(max_context=16)
            s.prefill([1, 2, 3])
            if name == "with":
                list(s.generate(4, stop_token_ids=[], mtp="on", mtp_k=2))
            r = e.report()
            assert r["mtp"]["present"] is (name == "with")
            mem[name] = r["cuda"]["memory_bytes"]
    extra = mem["with"]["weights"] - mem["without"]["weights"]
    assert 0 < extra <= load_checkpoint(a).mtp_bytes
