"""Model configuration of the Qwen3.5/3.6-MoE text decoder (`qwen3_5_moe`), read from config.json.

MODEL.md section 1: the multimodal config nests every decoder field in ``text_config``; a flat config
(text-only ``Qwen3_5MoeForCausalLM`` saves, or mlx-lm style) is accepted too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES", "LAYER_TYPES"]

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")

# transformers' default when the config has no rope_theta (mlx-lm would use 100000; MODEL.md 1.2).
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_PARTIAL_ROTARY = 0.25
_DEFAULT_FULL_ATTENTION_INTERVAL = 4  # transformers' Qwen3_5MoeTextConfig default

# Every count read from config.json has an upper bound, checked before anything is built from it (a
# `num_hidden_layers: 10**10` would otherwise build a list of 10**10 layer types). The bounds admit the real
# model (MODEL.md 1.2: hidden 2048, 40 layers, vocab 248320, 16/2 heads of 256, 16/32 linear heads of
# 128, conv 4, 256 experts top-8, intermediate 512) with a wide margin.
INT_LIMITS: dict[str, int] = {
    "hidden_size": 65536,
    "num_hidden_layers": 4096,
    "vocab_size": 1 << 24,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 65536,
    "linear_num_key_heads": 4096,
    "linear_num_value_heads": 4096,
    "linear_key_head_dim": 65536,
    "linear_value_head_dim": 65536,
    "linear_conv_kernel_dim": 1024,
    "num_experts": 65536,
    "num_experts_per_tok": 65536,
    "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20,
    "max_position_embeddings": (1 << 31) - 1,
    "full_attention_interval": 4096,
    "mtp_num_hidden_layers": 64,
}
_REQUIRED_INTS = tuple(k for k in INT_LIMITS
                       if k not in ("max_position_embeddings", "full_attention_interval", "mtp_num_hidden_layers"))
# Sizes derived from the counts above (matrix rows, per-session state) must fit a C++ int32 index; the
# real model's largest is 2*16*128 + 32*128 = 8192 (conv_dim) rows and 32*128*128 = 524288 state floats.
_MAX_DERIVED = (1 << 31) - 1
# Expert matrices (layers x experts): each becomes a descriptor; the real model has 40 x 256 = 10240.
_MAX_LAYER_EXPERTS = 1 << 20
# A config.json is a few KB; more than this is not a config (json.load would read it all into memory).
MAX_JSON_BYTES = 16 << 20


def brief(value: Any, limit: int = 60) -> str:
    """repr() for error messages, cut short: the value may be a huge list, or an int too long for str()."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<int of {value.bit_length()} bits>"
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails (e.g. a deeply nested list) still gets a message
        return f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def read_json_file(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file from a checkpoint; every failure is a CheckpointError naming the file."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"cannot read '{path}': {e}") from e
    if size > max_bytes:
        raise CheckpointError(f"'{path}' is {size} bytes, more than the {max_bytes} a JSON config may have")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except RecursionError:
        raise CheckpointError(f"'{path}' is not valid JSON: nested too deeply") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, ints > 4300 digits
        raise CheckpointError(f"'{path}' is not valid JSON: {e}") from e


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _check_derived(vals: dict[str, int], err, name) -> None:
    """Bound the sizes Lily computes from several fields (matrix rows, per-session state), each within its
    own bound, before a loader or the core allocates or indexes with them."""
    hd = vals["head_dim"]
    Hk, Hv = vals["linear_num_key_heads"], vals["linear_num_value_heads"]
    Dk, Dv = vals["linear_key_head_dim"], vals["linear_value_head_dim"]
    conv_dim = 2 * Hk * Dk + Hv * Dv
    derived = (  # (field to name, what it gives, value)
        ("num_attention_heads", "num_attention_heads x 2 x head_dim (q_proj rows)", vals["num_attention_heads"] * 2 * hd),
        ("num_key_value_heads", "num_key_value_heads x head_dim (k_proj rows)", vals["num_key_value_heads"] * hd),
        ("linear_num_key_heads", "2 x linear_num_key_heads x linear_key_head_dim + linear_num_value_heads x "
         "linear_value_head_dim (conv channels)", conv_dim),
        ("linear_conv_kernel_dim", "(linear_conv_kernel_dim - 1) x conv channels (conv state)",
         (vals["linear_conv_kernel_dim"] - 1) * conv_dim),
        ("linear_num_value_heads", "linear_num_value_heads x linear_key_head_dim x linear_value_head_dim "
         "(recurrent state)", Hv * Dk * Dv),
        ("num_experts", "num_experts x 2 x moe_intermediate_size (fused gate_up rows)",
         vals["num_experts"] * 2 * vals["moe_intermediate_size"]),
    )
    for field_name, what, v in derived:
        if v > _MAX_DERIVED:
            raise err(name(field_name), f"gives {what} = {v}, more than Lily's bound of {_MAX_DERIVED}")
    n = vals["num_hidden_layers"] * vals["num_experts"]
    if n > _MAX_LAYER_EXPERTS:
        raise err(name("num_experts"), f"x num_hidden_layers = {n} expert blocks, more than Lily's bound of "
                                      f"{_MAX_LAYER_EXPERTS}")


@dataclass
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rotary_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    layer_types: list[str]
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    model_type: str = "qwen3_5_moe"
    # The `quantization` (or `quantization_config`) block of an MLX checkpoint, else None.
    quantization: dict | None = None
    # MTP blocks config.json announces (MODEL.md section 7; the release says 1), None when it says nothing.
    # What the checkpoint holds is Checkpoint.mtp_layers: mlx-lm keeps this field but drops the tensors.
    mtp_num_hidden_layers: int | None = None
    # Where each defaulted or derived value came from (e.g. the rope_theta source).
    notes: list[str] = field(default_factory=list)
    source: str = "config.json"

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read ``path`` (a config.json, or a folder holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise CheckpointError(f"config file '{p}' does not exist")
        d = read_json_file(p)
        if not isinstance(d, dict):
            raise CheckpointError(f"'{p}' must hold a JSON object, got {type(d).__name__}")
        return cls.from_dict(d, source=str(p))

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: the config must be a JSON object, got {type(d).__name__}")
        notes: list[str] = []

        def err(field_name: str, msg: str) -> CheckpointError:
            return CheckpointError(f"{source}: field '{field_name}' {msg}")

        model_type = d.get("model_type")
        if model_type is None:
            raise err("model_type", "is missing (Lily runs qwen3_5_moe)")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported model_type {brief(model_type)} in {source} (Lily runs qwen3_5_moe)"
            )

        if "text_config" in d and d["text_config"] is not None:
            tc = d["text_config"]
            if not isinstance(tc, dict):
                raise err("text_config", f"must be an object, got {type(tc).__name__}")
            prefix = "text_config."
            inner_type = tc.get("model_type")
            if inner_type is not None and inner_type not in SUPPORTED_MODEL_TYPES:
                raise CheckpointError(
                    f"unsupported model_type {brief(inner_type)} (field 'text_config.model_type') in {source} "
                    "(Lily runs qwen3_5_moe)"
                )
        else:
            tc = d
            prefix = ""

        def name(k: str) -> str:
            return prefix + k

        def get_int(k: str, default: Any = None, required: bool = True) -> int:
            if k not in tc or tc[k] is None:
                if required and default is None:
                    raise err(name(k), "is missing")
                return default
            v = tc[k]
            if isinstance(v, bool) or not isinstance(v, int):
                if isinstance(v, float) and v.is_integer():
                    v = int(v)
                else:
                    raise err(name(k), f"must be a positive integer, got {brief(v)}")
            if v <= 0:
                raise err(name(k), f"must be a positive integer, got {brief(v)}")
            if v > INT_LIMITS[k]:
                raise err(name(k), f"is {brief(v)}, more than Lily's bound of {INT_LIMITS[k]}")
            return v

        vals = {k: get_int(k) for k in _REQUIRED_INTS}

        eps = tc.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
            raise err(name("rms_norm_eps"), f"must be a small positive number, got {brief(eps)}")
        if "rms_norm_eps" not in tc:
            notes.append("rms_norm_eps missing; using 1e-6")

        max_pos = get_int("max_position_embeddings", default=32768, required=False)
        mtp_layers = tc.get("mtp_num_hidden_layers")
        if mtp_layers is not None:  # 0 is allowed (no MTP block), unlike the counts above
            if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or mtp_layers < 0:
                raise err(name("mtp_num_hidden_layers"), f"must be a non-negative integer, got {brief(mtp_layers)}")
            if mtp_layers > INT_LIMITS["mtp_num_hidden_layers"]:
                raise err(name("mtp_num_hidden_layers"), f"is {brief(mtp_layers)}, more than Lily's bound of "
                                                         f"{INT_LIMITS['mtp_num_hidden_layers']}")

        # ---- RoPE ----
        rope_params = tc.get("rope_parameters")
        if rope_params is not None and not isinstance(rope_params, dict):
            raise err(name("rope_parameters"), f"must be an object, got {type(rope_params).__name__}")
        rope_params = rope_params or {}
        for key, block in (("rope_parameters", rope_params), ("rope_scaling", tc.get("rope_scaling"))):
            if block is None:
                continue
            if not isinstance(block, dict):
                raise err(name(key), f"must be an object, got {type(block).__name__}")
            rtype = block.get("rope_type", block.get("type", "default"))
            # "mrope" is transformers' legacy alias of default RoPE; for text it is plain RoPE (MODEL.md 1.4).
            if rtype not in ("default", "mrope", None):
                raise err(
                    name(key) + ".rope_type",
                    f"is {brief(rtype)}: RoPE scaling is not supported (Lily supports rope_type 'default')",
                )
        if "rope_theta" in rope_params:
            theta = rope_params["rope_theta"]
            theta_field = name("rope_parameters.rope_theta")
            notes.append(f"rope_theta={brief(theta)} from {theta_field}")
        elif "rope_theta" in tc:
            theta = tc["rope_theta"]
            theta_field = name("rope_theta")
            notes.append(f"rope_theta={brief(theta)} from {theta_field}")
        else:
            theta = _DEFAULT_ROPE_THETA
            theta_field = name("rope_parameters.rope_theta")
            notes.append(
                f"rope_theta missing; using transformers' default {_DEFAULT_ROPE_THETA:g} "
                "(mlx-lm would use 100000)"
            )
        # float(): an int beyond the float range would make math.isfinite raise OverflowError.
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not _finite(theta) or not theta > 0:
            raise err(theta_field, f"must be a positive finite number, got {brief(theta)}")

        if "partial_rotary_factor" in rope_params:
            prf, prf_field = rope_params["partial_rotary_factor"], name("rope_parameters.partial_rotary_factor")
        elif "partial_rotary_factor" in tc:
            prf, prf_field = tc["partial_rotary_factor"], name("partial_rotary_factor")
        else:
            prf, prf_field = _DEFAULT_PARTIAL_ROTARY, name("partial_rotary_factor")
            notes.append(f"partial_rotary_factor missing; using {_DEFAULT_PARTIAL_ROTARY}")
        if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not (0 < prf <= 1):
            raise err(prf_field, f"must be in (0, 1], got {brief(prf)}")
        rotary_dim = int(vals["head_dim"] * prf)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise err(prf_field, f"gives rotary_dim={rotary_dim} (head_dim {vals['head_dim']} x {prf}); it must be even and > 0")

        # ---- layer schedule ----
        n_layers = vals["num_hidden_layers"]
        layer_types = tc.get("layer_types")
        if layer_types is None:
            interval = get_int("full_attention_interval", default=_DEFAULT_FULL_ATTENTION_INTERVAL, required=False)
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
            ]
            notes.append(f"layer_types derived from full_attention_interval={interval}")
        else:
            if not isinstance(layer_types, list):
                raise err(name("layer_types"), f"must be a list, got {type(layer_types).__name__}")
            if len(layer_types) != n_layers:
                raise err(
                    name("layer_types"),
                    f"has {len(layer_types)} entries but num_hidden_layers is {n_layers}",
                )
            for i, t in enumerate(layer_types):
                if not isinstance(t, str) or t not in LAYER_TYPES:
                    raise err(name("layer_types") + f"[{i}]", f"is {brief(t)}; expected one of {list(LAYER_TYPES)}")
            layer_types = list(layer_types)

        # ---- consistency ----
        if vals["num_attention_heads"] % vals["num_key_value_heads"]:
            raise err(
                name("num_key_value_heads"),
                f"({vals['num_key_value_heads']}) must divide num_attention_heads ({vals['num_attention_heads']})",
            )
        if vals["linear_num_value_heads"] % vals["linear_num_key_heads"]:
            raise err(
                name("linear_num_key_heads"),
                f"({vals['linear_num_key_heads']}) must divide linear_num_value_heads "
                f"({vals['linear_num_value_heads']})",
            )
        if vals["num_experts_per_tok"] > vals["num_experts"]:
            raise err(
                name("num_experts_per_tok"),
                f"({vals['num_experts_per_tok']}) exceeds num_experts ({vals['num_experts']})",
            )
        bias = tc.get("attention_bias", False)
        if bias is not None and not isinstance(bias, bool):
            raise err(name("attention_bias"), f"must be true or false, got {brief(bias)}")
        if bias:
            raise err(name("attention_bias"), "is true: attention biases are not supported (qwen3_5_moe has none)")
        _check_derived(vals, err, name)

        # ---- tied embeddings: text_config wins (mlx-lm reads it there), else the top level ----
        if "tie_word_embeddings" in tc:
            tie, tie_field = tc["tie_word_embeddings"], name("tie_word_embeddings")
        else:
            tie, tie_field = d.get("tie_word_embeddings", False), "tie_word_embeddings"
        if not isinstance(tie, bool):
            raise err(tie_field, f"must be true or false, got {brief(tie)}")

        quant = d.get("quantization")
        if quant is None:
            quant = d.get("quantization_config")
        if quant is None and prefix:
            quant = tc.get("quantization", tc.get("quantization_config"))
        if quant is not None and not isinstance(quant, dict):
            raise err("quantization", f"must be an object, got {type(quant).__name__}")

        return cls(
            hidden_size=vals["hidden_size"],
            num_hidden_layers=n_layers,
            vocab_size=vals["vocab_size"],
            rms_norm_eps=float(eps),
            num_attention_heads=vals["num_attention_heads"],
            num_key_value_heads=vals["num_key_value_heads"],
            head_dim=vals["head_dim"],
            rope_theta=float(theta),
            partial_rotary_factor=float(prf),
            rotary_dim=rotary_dim,
            linear_num_key_heads=vals["linear_num_key_heads"],
            linear_num_value_heads=vals["linear_num_value_heads"],
            linear_key_head_dim=vals["linear_key_head_dim"],
            linear_value_head_dim=vals["linear_value_head_dim"],
            linear_conv_kernel_dim=vals["linear_conv_kernel_dim"],
            num_experts=vals["num_experts"],
            num_experts_per_tok=vals["num_experts_per_tok"],
            moe_intermediate_size=vals["moe_intermediate_size"],
            shared_expert_intermediate_size=vals["shared_expert_intermediate_size"],
            layer_types=layer_types,
            tie_word_embeddings=tie,
            max_position_embeddings=max_pos,
            model_type=model_type,
            quantization=quant,
            mtp_num_hidden_layers=mtp_layers,
            notes=notes,
            source=source,
        )

    # ---- contract with the C++ core ------------------------------------------------------------
    def to_core(self) -> dict:
        return {
            "hidden": self.hidden_size,
            "layers": self.num_hidden_layers,
            "vocab": self.vocab_size,
            "eps": self.rms_norm_eps,
            "heads": self.num_attention_heads,
            "kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rotary_dim": self.rotary_dim,
            "rope_theta": self.rope_theta,
            "lin_k_heads": self.linear_num_key_heads,
            "lin_v_heads": self.linear_num_value_heads,
            "lin_k_dim": self.linear_key_head_dim,
            "lin_v_dim": self.linear_value_head_dim,
            "conv_kernel": self.linear_conv_kernel_dim,
            "experts": self.num_experts,
            "topk": self.num_experts_per_tok,
            "moe_inter": self.moe_intermediate_size,
            "shared_inter": self.shared_expert_intermediate_size,
            "full_attention": [t == "full_attention" for t in self.layer_types],
        }
