"""Hugging Face (bf16) -> MLX affine 4-bit conversion, byte-compatible with ``mlx_lm.convert(..., quantize=True)``
for qwen3_5_moe (MODEL.md 8b), in numpy and streamed tensor by tensor.

What mlx-lm 0.32.2 does, and what this module reproduces:

* drop vision tensors; rename to ``language_model.model.*`` / ``language_model.lm_head.*``;
* mlx-lm also drops ``mtp.*`` (the MTP block, MODEL.md 7). Lily keeps it by default, as
  ``language_model.mtp.*`` (mlx-lm's renaming rule), converted like a decoder layer (norms ``+ 1.0``,
  experts stacked into ``switch_mlp``, 8-bit ``mlp.gate`` / ``shared_expert_gate``, 4-bit elsewhere) and
  written after every decoder tensor; mlx-lm loads such a checkpoint (its sanitize drops the block), and
  ``convert(..., mtp=False)`` writes exactly what mlx-lm writes;
* split fused experts (``gate_up_proj`` rows ``:I`` gate, ``I:`` up) into ``mlp.switch_mlp.*`` stacks
  (per-expert HF tensors are stacked; mlx-lm itself only handles the fused form for this model);
* conv1d ``[C, 1, K]`` -> ``[C, K, 1]``; RMSNorm1p weights ``+ 1.0`` in the checkpoint dtype (bf16 rounding);
* cast floating tensors to the config dtype (``torch_dtype``, else ``text_config.dtype``), except ``A_log``;
* quantize every Linear / Embedding / SwitchLinear whose input dim is a multiple of the group size with
  the default bits, except ``mlp.gate`` and ``mlp.shared_expert_gate`` at 8 bits, group 64;
* write ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` past 5 GiB, split in the model's
  parameter order), always ``model.safetensors.index.json``, and ``config.json`` with identical
  ``quantization`` / ``quantization_config`` blocks.

Tensor data inside a file is laid out in sorted-name order. mx.save_safetensors uses its C++ hash-map
iteration order there, which depends on the standard library (it differs between Linux and macOS builds);
the header keys, dtypes, shapes and every tensor's bytes are identical.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from .checkpoint import SAFETENSORS_DTYPES, SafetensorsWriter, load_checkpoint
from .config import ModelConfig, read_json_file
from .errors import CheckpointError
from .quantize import bf16_to_f32, f32_to_bf16, quantize

__all__ = ["convert", "MLX_MAX_SHARD_BYTES", "TOKENIZER_FILES"]

MLX_MAX_SHARD_BYTES = 5 << 30  # mlx_lm.utils.MAX_FILE_SIZE_GB
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_GATE8 = {"group_size": 64, "bits": 8}  # mlx-lm's quant_predicate for the router and the shared gate


# ------------------------------------------------------------------------------------------------
# the MLX module plan (shared with synthetic.py)
# ------------------------------------------------------------------------------------------------


class WeightSource(Protocol):
    """Raw Hugging Face weights by decoder-relative name (``layers.0.mlp.gate.weight``)."""

    def tensor(self, rel: str) -> tuple[np.ndarray, str]: ...  # (array, safetensors dtype; BF16 as uint16)

    def dtype(self, rel: str) -> str: ...

    # [E, rows, cols] of one layer, named by its decoder-relative base ("layers.3", "mtp.layers.0")
    def experts(self, layer: str, proj: str) -> tuple[np.ndarray, str]: ...

    def experts_dtype(self, layer: str) -> str: ...


@dataclass
class MlxModule:
    path: str  # module path for linear kinds, full tensor name otherwise
    kind: str  # "linear" | "vector" | "norm1p" | "conv" | "A_log"
    shape: tuple[int, ...]  # unquantized output shape
    src_dtype: str
    fetch: Callable[[], tuple[np.ndarray, str]]
    gate8: bool = False

    def quant(self, group_size: int, bits: int) -> tuple[int, int] | None:
        """(group, bits) when mlx-lm would quantize this module, else None."""
        if self.kind != "linear" or self.shape[-1] % group_size:
            return None
        if self.gate8:
            return _GATE8["group_size"], _GATE8["bits"]
        return group_size, bits

    def out_dtype(self, target: str | None) -> str:
        # A_log keeps its source dtype (mlx-lm's cast_predicate); no target means no cast at all.
        if self.kind == "A_log" or target is None:
            return self.src_dtype
        return target

    def specs(self, target: str | None, group_size: int, bits: int) -> list[tuple[str, str, tuple[int, ...]]]:
        dt = self.out_dtype(target)
        if self.kind != "linear":
            return [(self.path, dt, self.shape)]
        q = self.quant(group_size, bits)
        if q is None:
            return [(self.path + ".weight", dt, self.shape)]
        g, b = q
        lead, cols = self.shape[:-1], self.shape[-1]
        return [
            (self.path + ".weight", "U32", (*lead, cols * b // 32)),
            (self.path + ".scales", dt, (*lead, cols // g)),
            (self.path + ".biases", dt, (*lead, cols // g)),
        ]

    def produce(self, target: str | None, group_size: int, bits: int) -> dict[str, np.ndarray]:
        arr, sdt = self.fetch()
        if sdt != self.src_dtype:
            raise CheckpointError(f"'{self.path}': source dtype changed from {self.src_dtype} to {sdt}")
        if self.kind == "norm1p":
            arr = add_one(arr, sdt)
        elif self.kind == "conv":
            arr = np.ascontiguousarray(arr).reshape(self.shape)  # [C,1,K] -> [C,K,1]: same memory order
        dt = self.out_dtype(target)
        arr = cast(arr, sdt, dt)
        if self.kind != "linear":
            return {self.path: arr}
        q = self.quant(group_size, bits)
        if q is None:
            return {self.path + ".weight": arr}
        g, b = q
        codes, scales, biases = quantize(arr, g, b, bf16=(dt == "BF16"))
        return {self.path + ".weight": codes, self.path + ".scales": scales, self.path + ".biases": biases}


def to_f32(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_to_f32(arr)
    return np.asarray(arr).astype(np.float32)


def cast(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Cast between safetensors float dtypes (bf16 as uint16 bits), rounding to nearest even."""
    if src == dst:
        return arr
    f = to_f32(arr, src)
    if dst == "BF16":
        return f32_to_bf16(f)
    if dst == "F16":
        return f.astype(np.float16)
    if dst == "F32":
        return f
    raise CheckpointError(f"cannot cast to {dst}")


def add_one(arr: np.ndarray, dtype: str) -> np.ndarray:
    """``w + 1.0`` in the tensor's own dtype, as mlx-lm's sanitize does (one rounding to that dtype)."""
    return cast(to_f32(arr, dtype) + np.float32(1.0), "F32", dtype)


def plan_mlx_modules(cfg: ModelConfig, src: WeightSource, mtp_layers: int = 0) -> list[MlxModule]:
    """The MLX model's parameters in mlx-lm's ``tree_flatten(model.parameters())`` order (decides shards),
    then, with ``mtp_layers``, the MTP block under ``language_model.mtp.`` (mlx-lm has no such module:
    it drops ``mtp.*``; the block follows the decoder's conventions, MODEL.md 8b)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out: list[MlxModule] = []

    def add(path: str, kind: str, shape: tuple[int, ...], rel: str, gate8: bool = False) -> None:
        out.append(MlxModule(path, kind, shape, src.dtype(rel), lambda rel=rel: src.tensor(rel), gate8))

    P = "language_model.model"
    add(f"{P}.embed_tokens", "linear", (V, H), "embed_tokens.weight")
    for i in range(cfg.num_hidden_layers):
        _plan_layer(cfg, src, out, add, f"{P}.layers.{i}", f"layers.{i}", cfg.is_full_attention(i))
    add(f"{P}.norm.weight", "norm1p", (H,), "norm.weight")
    if not cfg.tie_word_embeddings:
        add("language_model.lm_head", "linear", (V, H), "lm_head.weight")
    if mtp_layers:
        out += plan_mtp_modules(cfg, src, mtp_layers)
    return out


def plan_mtp_modules(cfg: ModelConfig, src: WeightSource, mtp_layers: int) -> list[MlxModule]:
    """The MTP block's modules under ``language_model.mtp.`` (after the decoder's in a converted checkpoint;
    tools/lily_tiny/package_mtp.py adds a trained block to an MLX checkpoint with these)."""
    H = cfg.hidden_size
    out: list[MlxModule] = []

    def add(path: str, kind: str, shape: tuple[int, ...], rel: str, gate8: bool = False) -> None:
        out.append(MlxModule(path, kind, shape, src.dtype(rel), lambda rel=rel: src.tensor(rel), gate8))

    T = "language_model.mtp"
    # vLLM's Qwen3_5MultiTokenPredictor registers fc, layers, norm, pre_fc_norm_embedding, pre_fc_norm_hidden.
    add(f"{T}.fc", "linear", (H, 2 * H), "mtp.fc.weight")
    for j in range(mtp_layers):
        _plan_layer(cfg, src, out, add, f"{T}.layers.{j}", f"mtp.layers.{j}", full=True)
    for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        add(f"{T}.{n}.weight", "norm1p", (H,), f"mtp.{n}.weight")
    return out


def _plan_layer(cfg: ModelConfig, src: WeightSource, out: list[MlxModule], add, L: str, R: str, full: bool) -> None:
    """One decoder layer's modules: MLX paths under ``L``, decoder-relative HF names under ``R``."""
    H = cfg.hidden_size
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, I, SI, K = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.linear_conv_kernel_dim

    def add_experts(path: str, shape: tuple[int, ...], proj: str) -> None:
        out.append(MlxModule(path, "linear", shape, src.experts_dtype(R), lambda: src.experts(R, proj)))

    if full:
        A, RA = f"{L}.self_attn", f"{R}.self_attn"
        add(f"{A}.q_proj", "linear", (nh * 2 * hd, H), f"{RA}.q_proj.weight")
        add(f"{A}.k_proj", "linear", (nkv * hd, H), f"{RA}.k_proj.weight")
        add(f"{A}.v_proj", "linear", (nkv * hd, H), f"{RA}.v_proj.weight")
        add(f"{A}.o_proj", "linear", (H, nh * hd), f"{RA}.o_proj.weight")
        add(f"{A}.q_norm.weight", "norm1p", (hd,), f"{RA}.q_norm.weight")
        add(f"{A}.k_norm.weight", "norm1p", (hd,), f"{RA}.k_norm.weight")
    else:
        D, RD = f"{L}.linear_attn", f"{R}.linear_attn"
        C = 2 * Hk * Dk + Hv * Dv
        add(f"{D}.conv1d.weight", "conv", (C, K, 1), f"{RD}.conv1d.weight")
        add(f"{D}.in_proj_qkv", "linear", (C, H), f"{RD}.in_proj_qkv.weight")
        add(f"{D}.in_proj_z", "linear", (Hv * Dv, H), f"{RD}.in_proj_z.weight")
        add(f"{D}.in_proj_b", "linear", (Hv, H), f"{RD}.in_proj_b.weight")
        add(f"{D}.in_proj_a", "linear", (Hv, H), f"{RD}.in_proj_a.weight")
        add(f"{D}.dt_bias", "vector", (Hv,), f"{RD}.dt_bias")
        add(f"{D}.A_log", "A_log", (Hv,), f"{RD}.A_log")
        add(f"{D}.norm.weight", "vector", (Dv,), f"{RD}.norm.weight")  # gated norm: never shifted
        add(f"{D}.out_proj", "linear", (H, Hv * Dv), f"{RD}.out_proj.weight")
    add(f"{L}.input_layernorm.weight", "norm1p", (H,), f"{R}.input_layernorm.weight")
    add(f"{L}.post_attention_layernorm.weight", "norm1p", (H,), f"{R}.post_attention_layernorm.weight")
    M, RM = f"{L}.mlp", f"{R}.mlp"
    add(f"{M}.gate", "linear", (E, H), f"{RM}.gate.weight", gate8=True)
    add_experts(f"{M}.switch_mlp.gate_proj", (E, I, H), "gate")
    add_experts(f"{M}.switch_mlp.up_proj", (E, I, H), "up")
    add_experts(f"{M}.switch_mlp.down_proj", (E, H, I), "down")
    # Qwen3NextMLP registers gate_proj, down_proj, up_proj in this order.
    add(f"{M}.shared_expert.gate_proj", "linear", (SI, H), f"{RM}.shared_expert.gate_proj.weight")
    add(f"{M}.shared_expert.down_proj", "linear", (H, SI), f"{RM}.shared_expert.down_proj.weight")
    add(f"{M}.shared_expert.up_proj", "linear", (SI, H), f"{RM}.shared_expert.up_proj.weight")
    add(f"{M}.shared_expert_gate", "linear", (1, H), f"{RM}.shared_expert_gate.weight", gate8=True)


def quantization_block(modules: list[MlxModule], group_size: int, bits: int) -> dict:
    """config.json ``quantization`` exactly as mlx_lm.utils.quantize_model builds it."""
    q: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for m in modules:
        if m.gate8 and m.quant(group_size, bits) is not None:
            q[m.path] = dict(_GATE8)
    return q


def _encode_nonfinite(obj):
    # mlx-lm tags non-finite floats so config.json stays valid JSON.
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: _encode_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_nonfinite(v) for v in obj]
    return obj


def mlx_config_json(raw: dict, quant: dict, generation_config: Path | None) -> str:
    """The config.json text mlx-lm writes for a converted model (same keys, order and formatting)."""
    config = json.loads(json.dumps(raw))  # deep copy
    if generation_config is not None and generation_config.is_file():
        try:
            with open(generation_config, encoding="utf-8") as f:
                gen = json.load(f)
        except (OSError, ValueError, RecursionError):  # an unreadable generation config adds nothing
            gen = {}
        eos = gen.get("eos_token_id", False) if isinstance(gen, dict) else False
        if eos:
            config["eos_token_id"] = eos
    # mlx-lm's TextModelArgs renames rope_parameters.rope_type to "type" in place (moved to the end).
    text = config["text_config"] if "text_config" in config else config
    rp = text.get("rope_parameters") if isinstance(text, dict) else None
    if rp and isinstance(rp, dict) and "type" not in rp and "rope_type" in rp:
        rp["type"] = rp.pop("rope_type")
    config["quantization"] = quant
    config["quantization_config"] = quant
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)
    config = dict(sorted(config.items()))
    return json.dumps(_encode_nonfinite(config), indent=4)


def config_target_dtype(raw: dict) -> str | None:
    """mlx-lm's rule: ``torch_dtype``, else ``text_config.dtype``; None (no cast) otherwise."""
    dtype = raw.get("torch_dtype")
    if dtype is None and isinstance(raw.get("text_config"), dict) and raw["text_config"]:
        dtype = raw["text_config"].get("dtype")
    return _CONFIG_DTYPES.get(dtype) if isinstance(dtype, str) else None


def write_mlx_weights(
    out_dir: Path,
    modules: list[MlxModule],
    *,
    target: str | None,
    group_size: int,
    bits: int,
    max_shard_bytes: int = MLX_MAX_SHARD_BYTES,
    progress: bool = False,
    desc: str = "converting",
) -> dict:
    """Write the weight files and model.safetensors.index.json the way mlx_lm.utils.save_model does."""
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    owner: dict[str, int] = {}
    for mi, m in enumerate(modules):
        for s in m.specs(target, group_size, bits):
            specs.append(s)
            owner[s[0]] = mi
    nbytes = {n: int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dt][1] for n, dt, shape in specs}
    # mlx_lm.utils.make_shards: a new shard when the next tensor would overflow the limit.
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = []
    size = 0
    for s in specs:
        if not shards or size + nbytes[s[0]] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += nbytes[s[0]]
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    writers: dict[str, SafetensorsWriter] = {}
    file_of: dict[str, str] = {}
    try:
        for fname, shard in zip(names, shards):
            w = SafetensorsWriter(out_dir / fname, shard, metadata={"format": "mlx"})
            for s in shard:
                writers[s[0]] = w
                file_of[s[0]] = fname
        total = sum(nbytes.values())
        bar = _progress(total, desc, progress)
        try:
            for m in modules:
                for name, arr in m.produce(target, group_size, bits).items():
                    writers[name].write(name, arr)
                    bar.update(nbytes[name])
        finally:
            bar.close()
        for w in {id(w): w for w in writers.values()}.values():
            w.close()
    except BaseException:
        for w in writers.values():
            try:
                w._f.close()
            except Exception:
                pass
        raise
    # mlx-lm counts parameters of leaf modules only, which leaves out the GatedDeltaNet's own
    # dt_bias and A_log arrays; the count is reproduced as is.
    total_params = sum(
        int(np.prod(m.shape, dtype=np.int64))
        for m in modules
        if not m.path.endswith(("linear_attn.dt_bias", "linear_attn.A_log"))
    )
    index = {
        "metadata": {"total_size": sum(nbytes.values()), "total_parameters": total_params},
        "weight_map": {k: file_of[k] for k in sorted(file_of)},
    }
    with open(out_dir / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)
    return index


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NullBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but a progress bar is never worth failing for
        return _NullBar()
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)


# ------------------------------------------------------------------------------------------------
# conversion from a Hugging Face checkpoint
# ------------------------------------------------------------------------------------------------


class _CheckpointSource:
    def __init__(self, ck):
        self.ck = ck
        self.raw = ck.raw
        self.E = ck.config.num_experts

    def tensor(self, rel: str) -> tuple[np.ndarray, str]:
        f, name = self.raw[rel]
        return f.array(name), f.tensors[name].dtype

    def dtype(self, rel: str) -> str:
        f, name = self.raw[rel]
        return f.tensors[name].dtype

    def _fused(self, layer: str) -> bool:
        return f"{layer}.mlp.experts.gate_up_proj" in self.raw

    def experts_dtype(self, layer: str) -> str:
        if self._fused(layer):
            return self.dtype(f"{layer}.mlp.experts.gate_up_proj")
        dts = {self.dtype(f"{layer}.mlp.experts.{e}.{p}_proj.weight")
               for e in range(self.E) for p in ("gate", "up", "down")}
        if len(dts) != 1:
            raise CheckpointError(f"{layer}: expert weights mix dtypes {sorted(dts)}")
        return dts.pop()

    def experts(self, layer: str, proj: str) -> tuple[np.ndarray, str]:
        if self._fused(layer):
            if proj == "down":
                return self.tensor(f"{layer}.mlp.experts.down_proj")
            gu, dt = self.tensor(f"{layer}.mlp.experts.gate_up_proj")
            mid = gu.shape[-2] // 2
            return (gu[:, :mid, :] if proj == "gate" else gu[:, mid:, :]), dt
        parts = [self.tensor(f"{layer}.mlp.experts.{e}.{proj}_proj.weight") for e in range(self.E)]
        return np.stack([p[0] for p in parts]), parts[0][1]


def convert(
    hf_path: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    group_size: int = 64,
    bits: int = 4,
    progress: bool = True,
    dtype: str | None = None,
    revision: str | None = None,
    max_shard_bytes: int = MLX_MAX_SHARD_BYTES,
    mtp: bool = True,
) -> Path:
    """Convert a Hugging Face qwen3_5_moe checkpoint (local folder or Hub id) to an MLX affine checkpoint.

    ``dtype`` ("bfloat16" | "float16" | "float32") overrides the cast target; by default it follows
    mlx-lm (config ``torch_dtype``, else ``text_config.dtype``, else no cast). ``max_shard_bytes`` is
    mlx-lm's 5 GiB shard limit. ``mtp``: keep the checkpoint's MTP block (``language_model.mtp.*``,
    quantized like the decoder layers, after every decoder tensor); mlx-lm drops it, so ``mtp=False``
    gives mlx-lm's output byte for byte. Returns the output folder.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits}: Lily supports 4 and 8")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size={group_size}: MLX supports 32, 64 and 128")
    from .hub import resolve_model_path

    src_dir = resolve_model_path(str(hf_path), revision=revision)
    out_dir = Path(out_path)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"output folder '{out_dir}' already exists and is not empty")

    ck = load_checkpoint(src_dir)  # validates config.json first, so the raw read below cannot fail on it
    try:
        raw_cfg = read_json_file(src_dir / "config.json")
        if ck.format != "hf":
            raise CheckpointError(f"'{src_dir}' is already an MLX checkpoint (nothing to convert)")
        if dtype is None:
            target = config_target_dtype(raw_cfg)
        else:
            if dtype not in _CONFIG_DTYPES:
                raise ValueError(f"dtype must be one of {sorted(_CONFIG_DTYPES)}, got {dtype!r}")
            target = _CONFIG_DTYPES[dtype]
        modules = plan_mlx_modules(ck.config, _CheckpointSource(ck), ck.mtp_layers if mtp else 0)
        for m in modules:
            q = m.quant(group_size, bits)
            if q is not None and m.shape[-1] % q[0]:
                raise CheckpointError(f"'{m.path}': input dim {m.shape[-1]} is not a multiple of group {q[0]}")

        tmp = out_dir.parent / (out_dir.name + ".lily-partial")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            write_mlx_weights(tmp, modules, target=target, group_size=group_size, bits=bits,
                              max_shard_bytes=max_shard_bytes, progress=progress)
            quant = quantization_block(modules, group_size, bits)
            gen = src_dir / "generation_config.json"
            (tmp / "config.json").write_text(mlx_config_json(raw_cfg, quant, gen))
            for name in TOKENIZER_FILES:
                p = src_dir / name
                if p.is_file():
                    shutil.copyfile(p, tmp / name)
            if out_dir.exists():
                out_dir.rmdir()  # empty (checked above)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        ck.close()
    return out_dir
