"""Random-weight qwen3_5_moe checkpoints written with numpy only (tests and benchmarks).

Weights are deterministic per (seed, tensor name), so the same seed gives the same model in Hugging Face
and MLX form: with ``quant="exact"`` the MLX checkpoint is exactly what ``lily.convert`` (and mlx-lm)
make of the HF one. Magnitudes keep activations finite through many layers: matrices ~ N(0, 1/in),
RMSNorm1p weights w ~ N(0, 0.1) (multiplier near 1), gated-norm weights ~ 1 + N(0, 0.1),
A_log = log(U(1, 16)), dt_bias ~ U(-4, 0) (a spread of slow and fast decays), conv ~ N(0, 0.3).
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .checkpoint import SAFETENSORS_DTYPES, SafetensorsWriter
from .config import ModelConfig
from .convert import (
    MlxModule,
    _progress,
    mlx_config_json,
    plan_mlx_modules,
    quantization_block,
    write_mlx_weights,
)
from .quantize import f32_to_bf16

__all__ = ["write_synthetic_checkpoint", "TINY_CONFIG", "MEDIUM_CONFIG", "FULL_CONFIG", "text_config"]

# 4 layers (full attention at layer 3), every Linear input dim a multiple of 64.
TINY_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "full_attention_interval": 4,
}

# The benchmark's medium model (~0.9 B parameters).
MEDIUM_CONFIG = {
    "vocab_size": 32768,
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "full_attention_interval": 4,
}

# The real Qwen3.6-35B-A3B text config (MODEL.md section 1.2): 19.5 GB in MLX 4-bit.
FULL_CONFIG = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "full_attention_interval": 4,
}

_TEXT_DEFAULTS = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
}

# RMSNorm1p weights outside the decoder layers: the final norm and the MTP block's three (MODEL.md 7).
_NORM1P_TOP = ("norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")

_CHUNK = 1 << 22  # elements per random-generation work item
_TABLE = 1 << 16  # normal samples per tensor table (indexed by random uint16)
_SYNTH_MAX_SHARD = 2 << 30
# Above this many parameters, quant="auto" writes random codes directly instead of quantizing.
_AUTO_FAST_PARAMS = 100_000_000


def text_config(config: dict, dtype: str = "bf16") -> dict:
    """A complete text_config dict: ``config`` (flat, or nested under text_config) plus defaults."""
    tc = dict(config.get("text_config", config))
    for k, v in _TEXT_DEFAULTS.items():
        tc.setdefault(k, json.loads(json.dumps(v)))
    if "layer_types" not in tc:
        interval = tc.get("full_attention_interval", 4)
        tc["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(tc["num_hidden_layers"])
        ]
    tc["model_type"] = "qwen3_5_moe_text"
    tc["dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    return tc


class _Generator:
    """Deterministic random HF tensors by decoder-relative name."""

    def __init__(self, cfg: ModelConfig, seed: int, st_dtype: str, threads: int):
        self.cfg = cfg
        self.seed = seed
        self.st_dtype = st_dtype
        self.threads = threads
        self._cache: tuple[str, np.ndarray] | None = None

    def _rng(self, name: str, chunk: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode()), chunk])

    def _normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        """N(mean, std) samples already in the stored dtype (bf16 bits or float32).

        Values are drawn from a per-tensor table of 65536 normal samples with random uint16 indices:
        several times faster than drawing (and rounding) every element, which matters for the
        benchmark model, and statistically indistinguishable for weights.
        """
        n = int(np.prod(shape, dtype=np.int64))
        table = self._rng(name).standard_normal(_TABLE, dtype=np.float32) * np.float32(std) + np.float32(mean)
        table = self._store(table)
        out = np.empty(n, dtype=table.dtype)

        def work(k: int) -> None:
            a, b = k * _CHUNK, min(n, (k + 1) * _CHUNK)
            idx = self._rng(name, k + 1).integers(0, _TABLE, size=b - a, dtype=np.uint16)
            out[a:b] = table[idx]

        chunks = range((n + _CHUNK - 1) // _CHUNK)
        if self.threads > 1 and len(chunks) > 1:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(work, chunks))
        else:
            for k in chunks:
                work(k)
        return out.reshape(shape)

    def _uniform(self, name: str, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
        return self._rng(name).uniform(lo, hi, size=shape).astype(np.float32)

    def _store(self, x: np.ndarray) -> np.ndarray:
        return f32_to_bf16(x) if self.st_dtype == "BF16" else x

    def tensor(self, rel: str, shape: tuple[int, ...]) -> np.ndarray:
        """The stored HF tensor (bf16 bits or float32)."""
        if self._cache is not None and self._cache[0] == rel:
            return self._cache[1]
        cfg = self.cfg
        if rel == "embed_tokens.weight":
            out = self._normal(rel, shape, cfg.hidden_size ** -0.25)
        elif rel == "lm_head.weight":
            out = self._normal(rel, shape, 2.0 / np.sqrt(cfg.hidden_size))
        elif rel.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or rel in _NORM1P_TOP:
            out = self._normal(rel, shape, 0.1)  # HF RMSNorm1p stores w; the multiplier is 1 + w
        elif rel.endswith("linear_attn.norm.weight"):
            out = self._normal(rel, shape, 0.1, mean=1.0)
        elif rel.endswith("conv1d.weight"):
            out = self._normal(rel, shape, 0.3)
        elif rel.endswith("A_log"):
            out = self._store(np.log(self._uniform(rel, shape, 1.0, 16.0)).astype(np.float32))
        elif rel.endswith("dt_bias"):
            out = self._store(self._uniform(rel, shape, -4.0, 0.0))
        else:  # matrices [.., out, in]
            out = self._normal(rel, shape, 1.0 / np.sqrt(shape[-1]))
        # One-slot cache: expert stacks are read several times in a row (gate and up halves, or
        # once per expert when written per expert).
        self._cache = (rel, out)
        return out


def _hf_specs(cfg: ModelConfig, mtp_layers: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """HF decoder-relative names and shapes (experts fused), in transformers' state_dict order, then the
    MTP block's (top-level ``mtp.*`` names, MODEL.md 7) when ``mtp_layers`` > 0."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out = [("embed_tokens.weight", (V, H))]
    for i in range(cfg.num_hidden_layers):
        out += _hf_layer_specs(cfg, f"layers.{i}", cfg.is_full_attention(i))
    out.append(("norm.weight", (H,)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (V, H)))
    if mtp_layers:
        out.append(("mtp.fc.weight", (H, 2 * H)))
        for j in range(mtp_layers):
            out += _hf_layer_specs(cfg, f"mtp.layers.{j}", True)
        out += [(f"mtp.{n}.weight", (H,)) for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")]
    return out


def _hf_layer_specs(cfg: ModelConfig, L: str, full: bool) -> list[tuple[str, tuple[int, ...]]]:
    H = cfg.hidden_size
    Hv, Dv, C, K = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, I, SI = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    if full:
        out = [
            (f"{L}.self_attn.q_proj.weight", (nh * 2 * hd, H)),
            (f"{L}.self_attn.k_proj.weight", (nkv * hd, H)),
            (f"{L}.self_attn.v_proj.weight", (nkv * hd, H)),
            (f"{L}.self_attn.o_proj.weight", (H, nh * hd)),
            (f"{L}.self_attn.q_norm.weight", (hd,)),
            (f"{L}.self_attn.k_norm.weight", (hd,)),
        ]
    else:
        out = [
            (f"{L}.linear_attn.dt_bias", (Hv,)),
            (f"{L}.linear_attn.A_log", (Hv,)),
            (f"{L}.linear_attn.conv1d.weight", (C, 1, K)),
            (f"{L}.linear_attn.norm.weight", (Dv,)),
            (f"{L}.linear_attn.out_proj.weight", (H, Hv * Dv)),
            (f"{L}.linear_attn.in_proj_qkv.weight", (C, H)),
            (f"{L}.linear_attn.in_proj_z.weight", (Hv * Dv, H)),
            (f"{L}.linear_attn.in_proj_b.weight", (Hv, H)),
            (f"{L}.linear_attn.in_proj_a.weight", (Hv, H)),
        ]
    return out + [
        (f"{L}.mlp.gate.weight", (E, H)),
        (f"{L}.mlp.experts.gate_up_proj", (E, 2 * I, H)),
        (f"{L}.mlp.experts.down_proj", (E, H, I)),
        (f"{L}.mlp.shared_expert.gate_proj.weight", (SI, H)),
        (f"{L}.mlp.shared_expert.up_proj.weight", (SI, H)),
        (f"{L}.mlp.shared_expert.down_proj.weight", (H, SI)),
        (f"{L}.mlp.shared_expert_gate.weight", (1, H)),
        (f"{L}.input_layernorm.weight", (H,)),
        (f"{L}.post_attention_layernorm.weight", (H,)),
    ]


class _SyntheticSource:
    """convert.WeightSource over generated tensors."""

    def __init__(self, gen: _Generator, shapes: dict[str, tuple[int, ...]]):
        self.gen = gen
        self.shapes = shapes

    def tensor(self, rel: str):
        return self.gen.tensor(rel, self.shapes[rel]), self.gen.st_dtype

    def dtype(self, rel: str) -> str:
        return self.gen.st_dtype

    def experts_dtype(self, layer: str) -> str:
        return self.gen.st_dtype

    def experts(self, layer: str, proj: str):
        if proj == "down":
            return self.tensor(f"{layer}.mlp.experts.down_proj")
        gu, dt = self.tensor(f"{layer}.mlp.experts.gate_up_proj")
        mid = gu.shape[-2] // 2
        return (gu[:, :mid] if proj == "gate" else gu[:, mid:]), dt


def _shard_plan(specs, max_bytes):
    shards, size = [], 0
    for s in specs:
        nb = int(np.prod(s[2], dtype=np.int64)) * SAFETENSORS_DTYPES[s[1]][1]
        if not shards or size + nb > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += nb
    return shards


def _write_hf(folder: Path, cfg: ModelConfig, gen: _Generator, *, layout: str, experts: str,
              max_shard_bytes: int, extra: dict, progress: bool, mtp_layers: int = 0,
              mtp_experts: str = "per_expert") -> None:
    prefix = "model.language_model." if layout == "multimodal" else "model."
    dt = gen.st_dtype
    E = cfg.num_experts
    I = cfg.moe_intermediate_size
    # (stored name, dtype, shape, producer)
    entries = []
    for rel, shape in _hf_specs(cfg, mtp_layers):
        top = rel == "lm_head.weight" or rel.startswith("mtp.")  # top-level names in both layouts
        name = rel if top else prefix + rel
        per = (mtp_experts if rel.startswith("mtp.") else experts) == "per_expert"
        if per and rel.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(E):
                for k, proj in enumerate(("gate", "up")):
                    entries.append((f"{base}{e}.{proj}_proj.weight", dt, (I, shape[-1]),
                                    lambda rel=rel, shape=shape, e=e, k=k: gen.tensor(rel, shape)[e, k * I:(k + 1) * I]))
        elif per and rel.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(E):
                entries.append((f"{base}{e}.down_proj.weight", dt, shape[1:],
                                lambda rel=rel, shape=shape, e=e: gen.tensor(rel, shape)[e]))
        else:
            entries.append((name, dt, shape, lambda rel=rel, shape=shape: gen.tensor(rel, shape)))
    for name, arr in extra.items():
        st = _np_to_st(arr)
        entries.append((name, st, tuple(arr.shape), lambda arr=arr: arr))
    specs = [(n, d, s) for n, d, s, _ in entries]
    shards = _shard_plan(specs, max_shard_bytes)
    n = len(shards)
    fnames = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    writers = {}
    weight_map = {}
    for fname, shard in zip(fnames, shards):
        w = SafetensorsWriter(folder / fname, shard, metadata={"format": "pt"})
        for s in shard:
            writers[s[0]] = w
            weight_map[s[0]] = fname
    total = sum(int(np.prod(s, dtype=np.int64)) * SAFETENSORS_DTYPES[d][1] for _, d, s in specs)
    bar = _progress(total, "synthetic", progress)
    for name, d, shape, produce in entries:
        arr = produce()
        writers[name].write(name, arr)
        bar.update(arr.nbytes)
    bar.close()
    for w in {id(w): w for w in writers.values()}.values():
        w.close()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(folder / "model.safetensors.index.json", "w") as f:
            json.dump(index, f, indent=2)


def _np_to_st(arr: np.ndarray) -> str:
    m = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint32): "U32",
         np.dtype(np.uint16): "BF16", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32"}
    if arr.dtype not in m:
        raise ValueError(f"extra tensor dtype {arr.dtype} not supported")
    return m[arr.dtype]


def _fast_module(m: MlxModule, gen: _Generator, group_size: int, bits: int) -> MlxModule:
    """Replace a big quantized module's producer with random codes + plausible scales/biases."""
    q = m.quant(group_size, bits)
    if q is None:
        return m
    g, b = q

    def produce(target, group_size_, bits_, m=m, g=g, b=b):
        lead, cols = m.shape[:-1], m.shape[-1]
        rng = gen._rng(m.path + "#fast")
        n_words = int(np.prod(lead, dtype=np.int64)) * cols * b // 32
        codes = rng.integers(0, 1 << 32, size=n_words, dtype=np.uint32).reshape(*lead, cols * b // 32)
        # Uniform codes: w = s*q + b spans [-a, a] with a = sqrt(3)*std (std 1/sqrt(in)); random signs
        # give negative scales as real MLX checkpoints have.
        std = 1.0 / np.sqrt(cols)
        gshape = (*lead, cols // g)
        amp = (np.sqrt(3.0) * std * rng.uniform(0.75, 1.25, size=gshape)).astype(np.float32)
        sign = np.where(rng.random(size=gshape) < 0.5, -1.0, 1.0).astype(np.float32)
        scales = sign * 2 * amp / np.float32((1 << b) - 1)
        biases = -sign * amp
        dt = m.out_dtype(target)
        conv = f32_to_bf16 if dt == "BF16" else (lambda x: x.astype(np.float16) if dt == "F16" else x)
        return {m.path + ".weight": codes, m.path + ".scales": conv(scales), m.path + ".biases": conv(biases)}

    fast = MlxModule(m.path, m.kind, m.shape, m.src_dtype, m.fetch, m.gate8)
    fast.produce = produce  # type: ignore[method-assign]
    return fast


def write_synthetic_checkpoint(
    path: str | os.PathLike,
    config: dict,
    *,
    fmt: str = "mlx",
    dtype: str = "bf16",
    bits: int = 4,
    seed: int = 0,
    progress: bool = False,
    group_size: int = 64,
    layout: str = "multimodal",
    experts: str = "fused",
    quant: str = "auto",
    max_shard_bytes: int = _SYNTH_MAX_SHARD,
    extra_tensors: dict[str, np.ndarray] | None = None,
    threads: int | None = None,
    mtp_layers: int = 0,
    mtp_experts: str = "per_expert",
) -> Path:
    """Write a random-weight checkpoint (config.json + safetensors) to folder ``path``; returns it.

    ``config``: text-config fields (flat, or a full config with ``text_config``), e.g. TINY_CONFIG.
    ``fmt``: "mlx" (affine ``bits``, 8-bit router/shared gate, as mlx-lm) or "hf".
    ``dtype``: "bf16" or "f32" for float tensors (and MLX scales).
    HF only: ``layout`` "multimodal" (``model.language_model.*``, nested config) or "text"
    (``model.*``, flat config); ``experts`` "fused" or "per_expert".
    MLX only: ``quant`` "exact" (quantize the HF weights: the result equals converting the HF checkpoint
    of the same seed), "fast" (random codes, for big benchmark models) or "auto" (fast above 100 M params).
    ``extra_tensors``: extra stored tensors (name -> numpy array; uint16 means BF16), e.g. vision ones to
    test skipping. Sharded (index file) when larger than ``max_shard_bytes``.
    ``mtp_layers``: write an MTP block (MODEL.md 7) of that many decoder layers and say so in the config
    (``mtp_num_hidden_layers``); HF: top-level ``mtp.*`` with ``mtp_experts`` "per_expert" (as the Qwen
    release stores them) or "fused"; MLX: ``language_model.mtp.*`` as ``lily.convert`` writes it.
    """
    if fmt not in ("mlx", "hf"):
        raise ValueError(f"fmt must be 'mlx' or 'hf', got {fmt!r}")
    if dtype not in ("bf16", "f32"):
        raise ValueError(f"dtype must be 'bf16' or 'f32', got {dtype!r}")
    if layout not in ("multimodal", "text") or experts not in ("fused", "per_expert"):
        raise ValueError("layout must be 'multimodal'|'text' and experts 'fused'|'per_expert'")
    if quant not in ("auto", "exact", "fast"):
        raise ValueError(f"quant must be 'auto', 'exact' or 'fast', got {quant!r}")
    if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or mtp_layers < 0:
        raise ValueError(f"mtp_layers must be a non-negative int, got {mtp_layers!r}")
    if mtp_experts not in ("fused", "per_expert"):
        raise ValueError(f"mtp_experts must be 'fused' or 'per_expert', got {mtp_experts!r}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tc = text_config(config, dtype)
    if mtp_layers:
        tc["mtp_num_hidden_layers"] = mtp_layers
        tc["mtp_use_dedicated_embeddings"] = False
    tie = bool(tc.get("tie_word_embeddings", False))
    if fmt == "hf" and layout == "text":
        raw = dict(tc, architectures=["Qwen3_5MoeForCausalLM"])
    else:
        raw = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": tc,
            "tie_word_embeddings": tie,
        }
    cfg = ModelConfig.from_dict(raw, source=str(folder / "config.json"))
    st_dtype = "BF16" if dtype == "bf16" else "F32"
    n_threads = threads if threads is not None else min(os.cpu_count() or 1, 16)
    gen = _Generator(cfg, seed, st_dtype, n_threads)
    extra = dict(extra_tensors or {})

    if fmt == "hf":
        _write_hf(folder, cfg, gen, layout=layout, experts=experts, max_shard_bytes=max_shard_bytes,
                  extra=extra, progress=progress, mtp_layers=mtp_layers, mtp_experts=mtp_experts)
        (folder / "config.json").write_text(json.dumps(raw, indent=2))
        return folder

    shapes = dict(_hf_specs(cfg, mtp_layers))
    modules = plan_mlx_modules(cfg, _SyntheticSource(gen, shapes), mtp_layers)
    n_params = sum(int(np.prod(m.shape, dtype=np.int64)) for m in modules)
    fast = quant == "fast" or (quant == "auto" and n_params > _AUTO_FAST_PARAMS)
    if fast:
        modules = [_fast_module(m, gen, group_size, bits) for m in modules]
    write_mlx_weights(folder, modules, target=st_dtype, group_size=group_size, bits=bits,
                      max_shard_bytes=max_shard_bytes, progress=progress, desc="synthetic")
    if extra:
        _append_extra(folder, extra)
    qb = quantization_block(modules, group_size, bits)
    (folder / "config.json").write_text(mlx_config_json(raw, qb, None))
    return folder


def _append_extra(folder: Path, extra: dict[str, np.ndarray]) -> None:
    """Extra tensors in their own shard file, registered in the index (tests of skipped tensors)."""
    fname = "extra.safetensors"
    specs = [(n, _np_to_st(a), tuple(a.shape)) for n, a in extra.items()]
    with SafetensorsWriter(folder / fname, specs, metadata={"format": "mlx"}) as w:
        for n, a in extra.items():
            w.write(n, a)
    idx_path = folder / "model.safetensors.index.json"
    index = json.loads(idx_path.read_text())
    for n in extra:
        index["weight_map"][n] = fname
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    idx_path.write_text(json.dumps(index, indent=4))
