"""Teacher-forced numerical consistency: Lily against a reference implementation on the same weights.

Over held-out text, every position's next-token distribution is compared: perplexity of each engine,
their relative difference, top-1 agreement and the largest logit difference (the measurements of the
Lily write-up: perplexity delta and top-1 agreement over 192 positions).

References (test-only dependencies, imported only when asked for; `pip install "lily[test]"`):
- ``transformers``: Hugging Face's qwen3_5_moe in float32, fed the checkpoint's weights through Lily's
  canonical view (4/8-bit weights dequantized as ``scale * q + bias`` in float32);
- ``mlx``: mlx-lm on the same MLX checkpoint bytes (MLX-format checkpoints only), run in float32.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .checkpoint import Checkpoint
from .errors import LilyError
from .quantize import dequantize

REFERENCES = ("transformers", "mlx")


@dataclass
class Comparison:
    reference: str
    positions: int
    perplexity_lily: float
    perplexity_reference: float
    relative_perplexity_difference: float  # ppl_lily / ppl_ref - 1
    top1_agreement: float
    max_abs_logit_difference: float
    max_abs_reference_logit: float


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    lp = _log_softmax(logits)
    return float(math.exp(-lp[np.arange(len(targets)), targets].mean()))


def compare(name: str, lily_logits: np.ndarray, ref_logits: np.ndarray, targets: np.ndarray) -> Comparison:
    p_l, p_r = perplexity(lily_logits, targets), perplexity(ref_logits, targets)
    return Comparison(
        reference=name,
        positions=int(len(targets)),
        perplexity_lily=p_l,
        perplexity_reference=p_r,
        relative_perplexity_difference=p_l / p_r - 1.0,
        top1_agreement=float(np.mean(lily_logits.argmax(-1) == ref_logits.argmax(-1))),
        max_abs_logit_difference=float(np.abs(lily_logits.astype(np.float64) - ref_logits).max()),
        max_abs_reference_logit=float(np.abs(ref_logits).max()),
    )


def lily_logits(engine, ids: np.ndarray) -> np.ndarray:
    """Logits after each of ids[:-1] (predicting ids[1:]), one prefill from an empty context."""
    s = engine.session(max_context=len(ids))
    return s.prefill(ids[:-1], all_logits=True)


def _dense(desc) -> np.ndarray:
    """A canonical descriptor as a float32 [rows, cols] matrix (dequantized if needed)."""
    if desc["kind"] == "affine":
        bf16 = desc["scale_dtype"] == "bf16"
        return dequantize(desc["data"], desc["scales"], desc["biases"], desc["group"], desc["bits"], bf16=bf16)
    data = np.asarray(desc["data"])
    if desc["dtype"] == "bf16":
        return (data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return data.astype(np.float32)


def hf_state_dict(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """Hugging Face (text-only CausalLM) names -> float32 arrays, from Lily's canonical tensors."""
    c = ckpt.config
    t = ckpt.tensors
    sd = {"model.embed_tokens.weight": _dense(t["embed"]), "lm_head.weight": _dense(t["lm_head"]),
          "model.norm.weight": t["final_norm"] - 1.0}
    for i, kind in enumerate(c.layer_types):
        _hf_layer(sd, t, c, f"model.layers.{i}.", f"layers.{i}.", kind == "full_attention")
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}


def _hf_layer(sd: dict, t: dict, c, p: str, q: str, full: bool) -> None:
    """One decoder layer's Hugging Face tensors (stored names under ``p``) from canonical ``q`` ones."""
    sd[p + "input_layernorm.weight"] = t[q + "input_norm"] - 1.0
    sd[p + "post_attention_layernorm.weight"] = t[q + "post_norm"] - 1.0
    if full:
        for n in "qkvo":
            sd[p + f"self_attn.{n}_proj.weight"] = _dense(t[q + f"attn.{n}"])
        sd[p + "self_attn.q_norm.weight"] = t[q + "attn.q_norm"] - 1.0
        sd[p + "self_attn.k_norm.weight"] = t[q + "attn.k_norm"] - 1.0
    else:
        la = p + "linear_attn."
        for src, dst in (("qkv", "in_proj_qkv"), ("z", "in_proj_z"), ("b", "in_proj_b"), ("a", "in_proj_a"),
                         ("out", "out_proj")):
            sd[la + dst + ".weight"] = _dense(t[q + f"delta.{src}"])
        conv = np.asarray(t[q + "delta.conv"], dtype=np.float32)
        sd[la + "conv1d.weight"] = conv.reshape(conv.shape[0], 1, -1)
        sd[la + "dt_bias"] = t[q + "delta.dt_bias"]
        sd[la + "A_log"] = t[q + "delta.A_log"]
        sd[la + "norm.weight"] = t[q + "delta.norm"]
    m = p + "mlp."
    sd[m + "gate.weight"] = _dense(t[q + "moe.router"])
    sd[m + "shared_expert_gate.weight"] = _dense(t[q + "moe.shared_gate"])
    for n in ("gate", "up", "down"):
        sd[m + f"shared_expert.{n}_proj.weight"] = _dense(t[q + f"moe.shared.{n}"])
    gate = [_dense(t[q + f"moe.experts.{e}.gate"]) for e in range(c.num_experts)]
    up = [_dense(t[q + f"moe.experts.{e}.up"]) for e in range(c.num_experts)]
    sd[m + "experts.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
    sd[m + "experts.down_proj"] = np.stack([_dense(t[q + f"moe.experts.{e}.down"]) for e in range(c.num_experts)])


def export_hf(checkpoint: Checkpoint | str | os.PathLike, out: str | os.PathLike, *, dtype: str = "bf16") -> Path:
    """Write ``checkpoint`` (any format Lily loads; a folder or an open :class:`Checkpoint`) as a Hugging Face
    folder: every matrix dequantized (``scale * q + bias`` in float32) and stored in ``dtype`` ("bf16" or
    "f32") under transformers' names (``model.*``, fused experts, ``lm_head.weight``, the MTP block as
    top-level ``mtp.*`` when the checkpoint has one), vectors (norms as stored ``w``, conv taps, ``A_log``,
    ``dt_bias``) in float32; config.json without its quantization block, and the tokenizer files. Returns the
    folder. "lily-tiny (bf16 export)" is ``export_hf(<package>/models/lily-tiny, out)``: a bf16 checkpoint whose
    LM head ``Engine.from_pretrained(out, lm_head=...)`` can keep or quantize (tests/conftest.py
    ``lily_tiny_bf16``). A tied checkpoint keeps its tie (no ``lm_head.weight`` written). A config with a
    ``text_config`` (the multimodal layout of the Qwen release) gets the decoder under ``model.language_model.``."""
    from .checkpoint import load_checkpoint

    if dtype not in ("bf16", "f32"):
        raise ValueError(f"dtype must be 'bf16' or 'f32', got {dtype!r}")
    folder = Path(out)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise LilyError(f"output folder '{folder}' already exists and is not empty")
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
    try:
        _write_hf_export(ck, folder, dtype)
    finally:
        if ck is not checkpoint:
            ck.close()
    return folder


def _write_hf_export(ck: Checkpoint, folder: Path, dtype: str) -> None:
    from .checkpoint import SafetensorsWriter
    from .config import read_json_file
    from .convert import TOKENIZER_FILES
    from .quantize import f32_to_bf16

    folder.mkdir(parents=True, exist_ok=True)
    raw = read_json_file(ck.path / "config.json")
    sd = hf_state_dict(ck)
    t = ck.tensors
    if ck.config.tie_word_embeddings:
        del sd["lm_head.weight"]
    if ck.mtp_layers:
        sd["mtp.fc.weight"] = _dense(t["mtp.fc"])
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            sd[f"mtp.{n}.weight"] = t[f"mtp.{n}"] - 1.0
        for j in range(ck.mtp_layers):
            _hf_layer(sd, t, ck.config, f"mtp.layers.{j}.", f"mtp.layers.{j}.", True)
    nested = "text_config" in raw
    arrays = {}
    for name, a in sd.items():
        if nested and name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        a = np.ascontiguousarray(a, dtype=np.float32)
        # Matrices (2-D and the expert stacks) in dtype; conv taps [C, 1, K] and vectors stay float32 (exact).
        matrix = a.ndim >= 2 and not name.endswith("conv1d.weight")
        arrays[name] = ("BF16", f32_to_bf16(a)) if matrix and dtype == "bf16" else ("F32", a)
    with SafetensorsWriter(folder / "model.safetensors", [(n, d, a.shape) for n, (d, a) in arrays.items()],
                           metadata={"format": "pt"}) as w:
        for n, (_, a) in arrays.items():
            w.write(n, a)
    for key in ("quantization", "quantization_config"):
        raw.pop(key, None)
    tc = raw.get("text_config", raw)
    tc["dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    if ck.mtp_layers:
        tc["mtp_num_hidden_layers"] = ck.mtp_layers
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    for name in TOKENIZER_FILES:
        if (ck.path / name).is_file():
            shutil.copyfile(ck.path / name, folder / name)


def transformers_model(ckpt: Checkpoint, *, max_positions: int = 0):
    """transformers' ``Qwen3_5MoeForCausalLM`` (float32, eval mode) holding the checkpoint's weights as Lily
    reads them (4-bit weights dequantized). ``max_positions``: the longest sequence it will run."""
    try:
        import torch
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    except ImportError as exc:
        raise LilyError("the transformers reference needs torch and transformers (pip install 'lily[test]')") from exc
    c = ckpt.config
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads, linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim, linear_conv_kernel_dim=c.linear_conv_kernel_dim,
        num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        layer_types=list(c.layer_types), rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                         "partial_rotary_factor": c.partial_rotary_factor},
        max_position_embeddings=max(int(c.max_position_embeddings or 0), max_positions))
    model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    state = {k: torch.from_numpy(v) for k, v in hf_state_dict(ckpt).items()}
    model.load_state_dict(state, strict=True)
    return model


def transformers_logits(ckpt: Checkpoint, ids: np.ndarray) -> np.ndarray:
    model = transformers_model(ckpt, max_positions=len(ids))
    import torch  # importable: transformers_model checked

    with torch.no_grad():
        out = model(torch.from_numpy(ids[None, :-1].astype(np.int64)), use_cache=False).logits[0]
    return out.double().numpy()


def mlx_logits(path, ids: np.ndarray) -> np.ndarray:
    try:
        import mlx.core as mx
        from mlx_lm import load
    except ImportError as exc:
        raise LilyError("the mlx reference needs mlx and mlx-lm (pip install 'lily[test]')") from exc
    model, _ = load(str(path))
    model.set_dtype(mx.float32)  # codes stay uint32; scales, biases and activations become fp32
    out = model(mx.array(ids[None, :-1].astype(np.int32)))
    return np.array(out[0].astype(mx.float32)).astype(np.float64)


def evaluate(engine, text: str, *, positions: int = 192, references=("transformers",)) -> dict:
    """Compare Lily with each reference over the first ``positions`` next-token predictions of text."""
    for r in references:
        if r not in REFERENCES:
            raise ValueError(f"unknown reference {r!r} (choose from {REFERENCES})")
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(f"positions must be a positive int, got {positions!r}")
    ids = np.asarray(engine.tokenize(text), dtype=np.int64)
    if len(ids) < positions + 1:
        raise ValueError(f"the text has {len(ids)} tokens; {positions + 1} are needed for {positions} positions")
    ids = ids[: positions + 1]
    targets = ids[1:]
    ours = lily_logits(engine, ids)
    vocab = engine.config.vocab_size
    result = {
        "model": str(engine.checkpoint.path),
        "format": engine.checkpoint.format,
        "positions": positions,
        "uniform_perplexity": float(vocab),
        "perplexity_lily": perplexity(ours, targets),
        "comparisons": [],
    }
    for r in references:
        if r == "transformers":
            ref = transformers_logits(engine.checkpoint, ids)
        else:
            if engine.checkpoint.format != "mlx":
                raise LilyError("the mlx reference runs MLX-format checkpoints only")
            ref = mlx_logits(engine.checkpoint.path, ids)
        result["comparisons"].append(asdict(compare(r, ours, ref, targets)))
    return result


def format_table(result: dict) -> str:
    lines = [f"model {result['model']} ({result['format']}), {result['positions']} positions; "
             f"Lily perplexity {result['perplexity_lily']:.4f} (uniform {result['uniform_perplexity']:.0f})",
             f"{'reference':<13} {'ppl ref':>10} {'ppl lily':>10} {'rel diff':>10} {'top-1':>8} {'max|dlogit|':>12}"]
    for c in result["comparisons"]:
        lines.append(f"{c['reference']:<13} {c['perplexity_reference']:>10.4f} {c['perplexity_lily']:>10.4f} "
                     f"{c['relative_perplexity_difference']:>+10.2e} {c['top1_agreement']:>8.2%} "
                     f"{c['max_abs_logit_difference']:>12.3e}")
    return "\n".join(lines)


def save_json(result: dict, path) -> None:
    with open(os.fspath(path), "w") as f:
        json.dump(result, f, indent=2)
