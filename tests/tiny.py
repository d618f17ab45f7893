"""Tiny Qwen3.5/3.6-MoE (``qwen3_5_moe``) checkpoints and reference logits for Lily's tests.

Everything here is generated locally (nothing is downloaded):

* :func:`make_hf_checkpoint` builds a ``transformers.Qwen3_5MoeForCausalLM`` from a tiny
  ``Qwen3_5MoeTextConfig``, randomises every parameter non-trivially and writes it either as
  transformers' own ``save_pretrained`` output (text-only ``model.layers.*`` names, per-expert keys) or
  in the layout of the released checkpoint (``model.language_model.*`` names, fused
  ``mlp.experts.gate_up_proj`` / ``down_proj``, nested multimodal ``config.json``, sharded with an index).
* :func:`reference_logits` runs transformers (fp32, eager attention) on a full token sequence.
* :func:`make_mlx_checkpoint` converts a checkpoint with mlx-lm's own converter (4-bit, group 64,
  8-bit router and shared-expert gate); :func:`dequantize_mlx_checkpoint` turns the MLX bytes back into an
  HF-named fp32 state dict (numpy re-implementation of MODEL.md section 9) so transformers can run the
  very same quantized weights; :func:`mlx_reference_logits` runs mlx-lm itself.

The import of mlx / mlx_lm is lazy: only the MLX helpers need them.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------

ROPE_THETA = 1.0e7


@dataclass(frozen=True)
class TinySpec:
    """Hyper-parameters of one tiny model (keyword arguments of :func:`make_hf_checkpoint`)."""

    layers: int
    full_attention_layers: tuple[int, ...]
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    lin_k_heads: int = 2
    lin_v_heads: int = 4
    lin_k_dim: int = 32
    lin_v_dim: int = 32
    experts: int = 8
    topk: int = 2
    moe_inter: int = 64
    shared_inter: int = 64
    vocab: int = 256
    seed: int = 0

    def kwargs(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @property
    def layer_types(self) -> list[str]:
        return layer_types(self.layers, self.full_attention_layers)

    @property
    def interval(self) -> int | None:
        return attention_interval(self.layers, self.full_attention_layers)


def layer_types(layers: int, full_attention_layers: Sequence[int]) -> list[str]:
    fa = set(int(i) for i in full_attention_layers)
    if not fa or not all(0 <= i < layers for i in fa):
        raise ValueError(f"full_attention_layers {sorted(fa)} must be a non-empty subset of range({layers})")
    return ["full_attention" if i in fa else "linear_attention" for i in range(layers)]


def attention_interval(layers: int, full_attention_layers: Sequence[int]) -> int | None:
    """The ``full_attention_interval`` n for which the layer schedule is ``(i+1) % n == 0``, else None.

    mlx-lm ignores ``layer_types`` and always uses the interval rule, so only schedules with an
    interval can be compared against mlx-lm.
    """
    fa = sorted(set(full_attention_layers))
    for n in range(1, layers + 1):
        if [i for i in range(layers) if (i + 1) % n == 0] == fa:
            return n
    return None


def text_config_dict(
    *,
    layers,
    full_attention_layers,
    hidden,
    heads,
    kv_heads,
    head_dim,
    lin_k_heads,
    lin_v_heads,
    lin_k_dim,
    lin_v_dim,
    experts,
    topk,
    moe_inter,
    shared_inter,
    vocab,
    dtype="float32",
) -> dict:
    rot = int(head_dim * 0.25)
    if rot % 2:
        raise ValueError(f"head_dim {head_dim}: rotary dim {rot} must be even")
    n = rot // 2
    mrope = [n - 2 * (n // 3), n // 3, n // 3]
    interval = attention_interval(layers, full_attention_layers)
    return {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attn_output_gate": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096,
        "linear_num_key_heads": lin_k_heads,
        "linear_num_value_heads": lin_v_heads,
        "linear_key_head_dim": lin_k_dim,
        "linear_value_head_dim": lin_v_dim,
        "linear_conv_kernel_dim": 4,
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "moe_intermediate_size": moe_inter,
        "shared_expert_intermediate_size": shared_inter,
        # mlx-lm derives the schedule from the interval; transformers and Lily trust layer_types.
        "full_attention_interval": interval if interval is not None else 4,
        "layer_types": layer_types(layers, full_attention_layers),
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": dtype,
    }


# --------------------------------------------------------------------------------------------------
# Building and randomising the transformers model
# --------------------------------------------------------------------------------------------------

_NORM1P_SUFFIXES = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


def build_model(text_cfg: dict, seed: int):
    """A randomised fp32 ``Qwen3_5MoeForCausalLM`` (eager attention, eval mode)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg_kwargs = {k: v for k, v in text_cfg.items() if k not in ("model_type", "dtype")}
    config = Qwen3_5MoeTextConfig(**cfg_kwargs)
    assert config.layer_types == text_cfg["layer_types"]
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(config)
    model.config._attn_implementation = "eager"
    model = model.to(torch.float32).eval()
    randomize_(model, seed)
    return model


def randomize_(model, seed: int) -> None:
    """Give every parameter a non-trivial random value (norm offsets, gates, conv, decay included)."""
    g = torch.Generator().manual_seed(seed * 7919 + 17)

    def randn(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float64) * std + mean

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = tuple(p.shape)
            if name.endswith("embed_tokens.weight"):
                v = randn(shape, 1.0)
                # Every 4th token has a tiny embedding (rms 0.03): at those positions the first
                # RMSNorm's eps matters (1e-6 vs 1e-5 moves the logits by ~1e-2).
                v[::4] *= 0.03
            elif name == "model.norm.weight" or name.endswith(_NORM1P_SUFFIXES):
                v = randn(shape, 0.1)  # applied as (1 + w); starts at 0 in transformers
            elif name.endswith("linear_attn.norm.weight"):
                v = randn(shape, 0.1, 1.0)  # applied as plain w; starts at 1
            elif name.endswith("A_log"):
                # decay exp(-A * softplus(.)) spans roughly 0.2 .. 0.97
                v = torch.log(torch.rand(shape, generator=g, dtype=torch.float64) * 1.45 + 0.05)
            elif name.endswith("dt_bias"):
                v = randn(shape, 0.5)
            elif name.endswith("conv1d.weight"):
                v = randn(shape, 0.5)
            elif name.endswith("mlp.gate.weight"):
                v = randn(shape, 3.0 / math.sqrt(shape[-1]))  # peaked, non-uniform routing
            elif name.endswith("experts.gate_up_proj"):
                v = randn(shape, 1.0 / math.sqrt(shape[-1]))
            elif name.endswith("experts.down_proj"):
                v = randn(shape, 1.0 / math.sqrt(shape[-1]))
            elif name.endswith("lm_head.weight"):
                v = randn(shape, 2.0 / math.sqrt(shape[-1]))
            elif name.endswith("linear_attn.in_proj_qkv.weight"):
                v = randn(shape, 1.0 / math.sqrt(shape[-1]))
                # Key head 0's q and k rows are tiny, so sum(x^2) of that head is ~1e-4 and the
                # L2-norm eps (added to the *sum*, MODEL.md 3.3) is visible in the logits.
                cfg = model.config
                dk, key_dim = cfg.linear_key_head_dim, cfg.linear_key_head_dim * cfg.linear_num_key_heads
                v[:dk] *= 4e-3
                v[key_dim : key_dim + dk] *= 4e-3
            elif len(shape) == 2:
                v = randn(shape, 1.0 / math.sqrt(shape[-1]))
            else:
                raise AssertionError(f"randomize_: no rule for parameter {name} {shape}")
            p.copy_(v.to(p.dtype))


# --------------------------------------------------------------------------------------------------
# Writing checkpoints
# --------------------------------------------------------------------------------------------------


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def write_tokenizer(dir: Path, vocab: int) -> None:
    """A trivial word-level tokenizer ("w0 w1 ..." <-> ids); mlx-lm's converter needs one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(dir / "tokenizer.json"))
    (dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "w1",
                "eos_token": "w2",
                "model_max_length": 4096,
            }
        )
    )


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Text-only names (``model.layers.*``), fused experts, exactly as the in-memory model holds them."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _to_multimodal_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model.") :]
        out[k] = v
    return out


def _save_sharded(sd: dict[str, torch.Tensor], dir: Path, shards: int = 2) -> None:
    from safetensors.torch import save_file

    keys = sorted(sd)
    per = math.ceil(len(keys) / shards)
    weight_map = {}
    total = 0
    for s in range(shards):
        part = keys[s * per : (s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, str(dir / fname), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += sd[k].numel() * sd[k].element_size()
    (dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )


def make_hf_checkpoint(
    dir,
    *,
    layers,
    full_attention_layers,
    hidden,
    heads,
    kv_heads,
    head_dim,
    lin_k_heads,
    lin_v_heads,
    lin_k_dim,
    lin_v_dim,
    experts,
    topk,
    moe_inter,
    shared_inter,
    vocab,
    dtype=torch.float32,
    fused_experts=False,
    multimodal_prefix=False,
    seed,
    tokenizer=False,
    verify=True,
):
    """Build, randomise and save a tiny checkpoint; return the in-memory fp32 transformers model.

    * ``fused_experts=False, multimodal_prefix=False``: transformers' ``save_pretrained`` output (flat
      ``qwen3_5_moe_text`` config, ``model.layers.*``, per-expert ``mlp.experts.{e}.*_proj.weight``).
    * ``fused_experts=True, multimodal_prefix=True``: the released layout (``model.language_model.*``,
      fused experts, nested ``text_config``, two shards + index, one ignorable ``model.visual`` tensor).
    * Other combinations are written by hand too (fused text-only or per-expert multimodal names).

    With ``dtype=torch.bfloat16`` the saved weights are bf16; the returned model then holds the
    bf16-rounded weights in fp32 (what an fp32 engine computes with).
    With ``verify`` the folder is reloaded with transformers and its logits must equal the returned
    model's.
    """
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tdtype = _torch_dtype(dtype)
    text_cfg = text_config_dict(
        layers=layers,
        full_attention_layers=full_attention_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        lin_k_heads=lin_k_heads,
        lin_v_heads=lin_v_heads,
        lin_k_dim=lin_k_dim,
        lin_v_dim=lin_v_dim,
        experts=experts,
        topk=topk,
        moe_inter=moe_inter,
        shared_inter=shared_inter,
        vocab=vocab,
        dtype=_dtype_name(tdtype),
    )
    model = build_model(text_cfg, seed)
    if tdtype != torch.float32:
        # Round every weight to the storage dtype so the returned fp32 model is what the file holds.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(tdtype).to(torch.float32))

    if not fused_experts and not multimodal_prefix:
        m = copy.deepcopy(model).to(tdtype)
        m.save_pretrained(str(dir), safe_serialization=True)
        del m
        cfg = json.loads((dir / "config.json").read_text())
        # save_pretrained must have produced what MODEL.md 8a documents; fail loudly if that changes.
        from safetensors import safe_open

        with safe_open(str(next(dir.glob("*.safetensors"))), "pt") as f:
            keys = set(f.keys())
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys, sorted(keys)[:20]
        assert cfg["model_type"] == "qwen3_5_moe_text", cfg["model_type"]
    else:
        sd = {k: v.to(tdtype) for k, v in hf_state_dict(model).items()}
        if not fused_experts:
            sd = split_experts(sd)
        if multimodal_prefix:
            sd = _to_multimodal_names(sd)
            # The released checkpoint carries a vision tower; every loader must skip it.
            g = torch.Generator().manual_seed(seed + 1)
            sd["model.visual.patch_embed.proj.weight"] = torch.randn((8, 3, 2, 2, 2), generator=g).to(tdtype)
            config = {
                "model_type": "qwen3_5_moe",
                "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "text_config": text_cfg,
                "tie_word_embeddings": False,
                "image_token_id": vocab - 4,
                "video_token_id": vocab - 3,
                "vision_start_token_id": vocab - 2,
                "vision_end_token_id": vocab - 1,
                "transformers_version": "5.24.0",
            }
        else:
            config = dict(text_cfg, architectures=["Qwen3_5MoeForCausalLM"])
        _save_sharded(sd, dir)
        (dir / "config.json").write_text(json.dumps(config, indent=1))

    if tokenizer:
        write_tokenizer(dir, vocab)

    if verify:
        ids = torch.arange(0, 23) * 7 % vocab
        ref = reference_logits(model, ids.tolist())
        loaded = load_hf(dir)
        got = reference_logits(loaded, ids.tolist())
        # Equal up to fp32 GEMM reassociation (torch picks kernels by memory alignment).
        err = rel_err(got, ref).max()
        assert err < 1e-5, f"transformers reloads {dir} with different logits (rel err {err:.2e})"
    return model


def split_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused ``experts.gate_up_proj``/``down_proj`` -> per-expert ``experts.{e}.{gate,up,down}_proj.weight``."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :inter].clone()
                out[f"{pre}{e}.up_proj.weight"] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v
    return out


def load_hf(dir):
    """Load a checkpoint folder (either layout) into an fp32 eager ``Qwen3_5MoeForCausalLM``."""
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(str(dir), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def model_from_state_dict(text_cfg: dict, sd: dict[str, np.ndarray]):
    """An fp32 transformers model holding exactly ``sd`` (text-only HF names, fused experts)."""
    model = build_model(text_cfg, seed=0)
    want = model.state_dict()
    missing = set(want) - set(sd)
    extra = set(sd) - set(want)
    assert not missing and not extra, (sorted(missing)[:10], sorted(extra)[:10])
    with torch.no_grad():
        for k, p in model.state_dict().items():
            v = torch.from_numpy(np.ascontiguousarray(sd[k], dtype=np.float32))
            assert tuple(v.shape) == tuple(p.shape), (k, v.shape, p.shape)
            p.copy_(v)
    return model


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_logits(model, ids: Sequence[int], *, with_margin: bool = False):
    """transformers fp32 forward over the whole sequence (no cache): float64 ``[T, V]``.

    For a causal model, row i is also the reference for a decode step that feeds ``ids[i]``.
    With ``with_margin`` also returns the routing margin of this forward (see :func:`routing_margin`).
    """
    gaps = []
    k = model.config.num_experts_per_tok

    def hook(mod, inp, out):
        top = torch.topk(out[0].to(torch.float64), k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())

    handles = []
    if with_margin:
        handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
        logits = model(input_ids=x, use_cache=False).logits[0].to(torch.float64).numpy()
    finally:
        for h in handles:
            h.remove()
    return (logits, float(min(gaps))) if with_margin else logits


def routing_margin(model, ids: Sequence[int]) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit over all tokens and layers.

    A tiny gap would make expert choice (and so any parity test) depend on rounding.
    """
    return reference_logits(model, ids, with_margin=True)[1]


class Reference:
    """Cached references for one set of weights: transformers fp32, the float64 oracle, routing margin."""

    MIN_MARGIN = 5e-5  # router-logit gap; fp32 noise in router logits is ~1e-6
    MAX_NOISE = 5e-5  # transformers fp32 vs float64 oracle, relative; half the parity tolerance

    def __init__(self, model, name: str = ""):
        self.model = model
        self.name = name
        self._hf: dict = {}
        self._np: dict = {}

    def hf(self, ids) -> np.ndarray:
        key = tuple(int(i) for i in ids)
        if key not in self._hf:
            self._hf[key] = reference_logits(self.model, key, with_margin=True)
        return self._hf[key][0]

    def margin(self, ids) -> float:
        self.hf(ids)
        return self._hf[tuple(int(i) for i in ids)][1]

    def np(self, ids) -> np.ndarray:
        key = tuple(int(i) for i in ids)
        if key not in self._np:
            self._np[key] = numpy_reference_logits(self.model, key)
        return self._np[key]

    def check(self, got, ids, what: str, rows: slice = slice(None), tol: float = 1e-4) -> dict:
        """Lily's ``got`` (rows ``rows`` of the sequence ``ids``) against both references.

        First asserts the comparison is well posed for this exact sequence (routing margin, and
        transformers within MAX_NOISE of the oracle), then :func:`assert_parity`.
        """
        what = f"{self.name} {what}".strip()
        ref_hf, ref_np, margin = self.hf(ids), self.np(ids), self.margin(ids)
        assert margin > self.MIN_MARGIN, f"{what}: ill-posed, routing margin {margin:.2e} (pick other tokens)"
        noise = rel_err(ref_hf, ref_np).max()
        assert noise <= self.MAX_NOISE, f"{what}: ill-posed, transformers vs float64 oracle {noise:.2e}"
        rep = assert_parity(got, ref_hf[rows], ref_np[rows], what, tol)
        rep["routing_margin"] = margin
        return rep


def _np_weights(model) -> dict[str, np.ndarray]:
    return {k: v.detach().to(torch.float64).numpy() for k, v in model.state_dict().items()}


def numpy_reference_logits(model, ids: Sequence[int], *, return_hidden: bool = False, noise: dict | None = None):
    """Independent float64 numpy forward written from MODEL.md (sections 2 to 6), no chunking.

    Same weights as ``model`` (a transformers model, only its state dict and config are read). Used to
    tell whether a disagreement with transformers' fp32 forward is Lily's error or fp32 noise in the
    reference, and to localise a divergence (``return_hidden`` also returns the residual stream after
    every layer, ``[layers + 1, T, H]``, and each layer's mixer and MoE outputs).

    ``noise`` (diagnosis only): ``{(layer, stage): relative size}`` multiplies that intermediate by
    ``1 + size * N(0, 1)``; stages "mix" (mixer output), "router" (router logits), "moe" (MoE output),
    "dn_qk" (DeltaNet q/k after conv), "dn_state_out" (DeltaNet o). Measures how strongly fp32-sized
    rounding at one place moves the logits (the conditioning of a position).
    """
    rng = np.random.default_rng(1234)
    noise = noise or {}
    cur = [None]

    def jitter(stage, x):
        size = noise.get((cur[0], stage), 0.0)
        return x * (1.0 + size * rng.standard_normal(x.shape)) if size else x

    cfg = model.config
    W = _np_weights(model)
    eps = cfg.rms_norm_eps
    ids = np.asarray(ids, dtype=np.int64)
    T = len(ids)

    def rms1p(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    def attention(u, p):
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = (u @ W[p + "q_proj.weight"].T).reshape(T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
        k = (u @ W[p + "k_proj.weight"].T).reshape(T, nkv, hd)
        v = (u @ W[p + "v_proj.weight"].T).reshape(T, nkv, hd)
        q = rms1p(q, W[p + "q_norm.weight"])
        k = rms1p(k, W[p + "k_norm.weight"])
        rot = int(hd * cfg.rope_parameters.get("partial_rotary_factor", 0.25))
        theta = cfg.rope_parameters["rope_theta"]
        inv = theta ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

        def rope(x):
            x = x.copy()
            x1, x2 = x[..., : rot // 2].copy(), x[..., rot // 2 : rot].copy()
            x[..., : rot // 2] = x1 * cos - x2 * sin
            x[..., rot // 2 : rot] = x2 * cos + x1 * sin
            return x

        q, k = rope(q), rope(k)
        grp = nh // nkv
        kk = np.repeat(k, grp, axis=1)  # head h uses kv head h // grp
        vv = np.repeat(v, grp, axis=1)
        s = np.einsum("thd,shd->hts", q, kk) / math.sqrt(hd)
        s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, vv).reshape(T, nh * hd)
        return (o * sigmoid(gate)) @ W[p + "o_proj.weight"].T

    def deltanet(u, p):
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        K = cfg.linear_conv_kernel_dim
        mixed = u @ W[p + "in_proj_qkv.weight"].T
        wc = W[p + "conv1d.weight"][:, 0, :]  # [C, K]; tap K-1 is the current token
        padded = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed])
        conv = sum(wc[:, j][None] * padded[j : j + T] for j in range(K))
        x = jitter("dn_qk", silu(conv))
        q = x[:, : Hk * Dk].reshape(T, Hk, Dk)
        k = x[:, Hk * Dk : 2 * Hk * Dk].reshape(T, Hk, Dk)
        v = x[:, 2 * Hk * Dk :].reshape(T, Hv, Dv)
        z = (u @ W[p + "in_proj_z.weight"].T).reshape(T, Hv, Dv)
        beta = sigmoid(u @ W[p + "in_proj_b.weight"].T)
        a = u @ W[p + "in_proj_a.weight"].T + W[p + "dt_bias"]
        g = -np.exp(W[p + "A_log"]) * np.logaddexp(0.0, a)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / math.sqrt(Dk)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        r = Hv // Hk
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)  # value head j uses key head j // r
        S = np.zeros((Hv, Dk, Dv))
        o = np.zeros((T, Hv, Dv))
        for t in range(T):
            S *= np.exp(g[t])[:, None, None]
            m = np.einsum("hkv,hk->hv", S, k[t])
            delta = beta[t][:, None] * (v[t] - m)
            S += k[t][:, :, None] * delta[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", S, q[t])
        o = jitter("dn_state_out", o)
        n = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps)
        y = W[p + "norm.weight"] * n * silu(z)
        return y.reshape(T, Hv * Dv) @ W[p + "out_proj.weight"].T

    def moe(u, p):
        E, topk = cfg.num_experts, cfg.num_experts_per_tok
        r = jitter("router", u @ W[p + "gate.weight"].T)
        pr = np.exp(r - r.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        gu, dn = W[p + "experts.gate_up_proj"], W[p + "experts.down_proj"]
        inter = gu.shape[1] // 2
        out = np.zeros_like(u)
        for t in range(T):
            top = np.argsort(-pr[t], kind="stable")[:topk]
            w = pr[t, top] / pr[t, top].sum()
            for e, we in zip(top, w):
                hgu = gu[e] @ u[t]
                out[t] += we * (dn[e] @ (silu(hgu[:inter]) * hgu[inter:]))
        sh = (silu(u @ W[p + "shared_expert.gate_proj.weight"].T) * (u @ W[p + "shared_expert.up_proj.weight"].T))
        sh = sh @ W[p + "shared_expert.down_proj.weight"].T
        return out + sigmoid(u @ W[p + "shared_expert_gate.weight"].T) * sh

    h = W["model.embed_tokens.weight"][ids]
    hidden, parts = [h], []
    for l, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{l}."
        cur[0] = l
        u = rms1p(h, W[p + "input_layernorm.weight"])
        mix = attention(u, p + "self_attn.") if kind == "full_attention" else deltanet(u, p + "linear_attn.")
        mix = jitter("mix", mix)
        h = h + mix
        m = jitter("moe", moe(rms1p(h, W[p + "post_attention_layernorm.weight"]), p + "mlp."))
        h = h + m
        hidden.append(h)
        parts.append((mix, m))
    logits = rms1p(h, W["model.norm.weight"]) @ W["lm_head.weight"].T
    if return_hidden:
        return logits, np.stack(hidden), parts
    return logits


def random_tokens(vocab: int, n: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token sequence (same for every run)."""
    return [int(x) for x in np.random.default_rng(seed).integers(0, vocab, n)]


def rel_err(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per-row ``max|got - ref| / max|ref|`` (rows = positions)."""
    got = np.atleast_2d(np.asarray(got, dtype=np.float64))
    ref = np.atleast_2d(np.asarray(ref, dtype=np.float64))
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return np.abs(got - ref).max(-1) / np.abs(ref).max(-1)


def assert_parity(got, ref_hf, ref_np, what: str, tol: float = 1e-4) -> dict:
    """Lily's logits rows against transformers fp32 (``ref_hf``) and the float64 oracle (``ref_np``).

    Both ``max|got - ref| <= tol * max|ref|`` per row must hold. The oracle separates Lily's own error
    from the fp32 rounding noise of transformers (``hf_noise`` = transformers vs oracle); the message
    gives all three so a failure says which side is off and where.
    """
    got = np.atleast_2d(np.asarray(got))
    e_hf, e_np, noise = rel_err(got, ref_hf), rel_err(got, ref_np), rel_err(ref_hf, ref_np)
    rep = {"vs_transformers": float(e_hf.max()), "vs_float64": float(e_np.max()), "hf_noise": float(noise.max())}
    bad = np.nonzero((e_hf > tol) | (e_np > tol))[0]
    assert bad.size == 0, (
        f"{what}: Lily vs transformers {e_hf.max():.3e} (row {int(e_hf.argmax())}), vs float64 oracle "
        f"{e_np.max():.3e} (row {int(e_np.argmax())}), transformers' own fp32 noise {noise.max():.3e}; "
        f"tolerance {tol:.0e}; rows over: {bad.tolist()[:20]}; argmax agreement "
        f"{np.mean(np.argmax(got, -1) == np.argmax(ref_np, -1)):.3f}"
    )
    return rep


# --------------------------------------------------------------------------------------------------
# MLX
# --------------------------------------------------------------------------------------------------


def mlx_available() -> bool:
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except Exception:
        return False
    return True


def make_mlx_checkpoint(hf_dir, out_dir) -> Path:
    """``mlx_lm.convert(hf_dir, out_dir, quantize=True)`` with mlx-lm's defaults for this model:
    4-bit affine group 64, router and shared-expert gate 8-bit, bf16 scales/biases/norms/conv.

    The source must be the fused multimodal layout (mlx-lm 0.32.2's qwen3_5_moe sanitize only
    understands fused experts) and must carry a tokenizer (the converter copies it).
    """
    import contextlib
    import io

    from mlx_lm import convert

    out_dir = Path(out_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(hf_dir), mlx_path=str(out_dir), quantize=True, q_group_size=64, q_bits=4, dtype="bfloat16")
    return out_dir


def _mlx_load_arrays(dir) -> dict[str, np.ndarray]:
    """All tensors of an MLX checkpoint as numpy (bf16 -> float32 exactly, uint32 kept)."""
    import mlx.core as mx

    out = {}
    for f in sorted(Path(dir).glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            if v.dtype == mx.bfloat16 or v.dtype == mx.float16:
                v = v.astype(mx.float32)
            out[k] = np.array(v)
    return out


def unpack_codes(wq: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words -> integer codes, element j of a row in bits ``bits*(j % (32/bits))`` of word
    ``j // (32/bits)`` (LSB first, MODEL.md section 9). bits in (2, 4, 8)."""
    assert wq.dtype == np.uint32 and 32 % bits == 0
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    q = (wq[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(*wq.shape[:-1], wq.shape[-1] * per)


def dequantize(wq: np.ndarray, scales: np.ndarray, biases: np.ndarray, in_dim: int | None = None) -> np.ndarray:
    """``w = scale_g * q + bias_g`` in float64 (returned as float32; exact for bf16 scales)."""
    groups = scales.shape[-1]
    if in_dim is None:
        # bits from shapes needs in_dim; infer it from the group size 64 convention if absent.
        in_dim = groups * 64
    bits = 32 * wq.shape[-1] // in_dim
    assert bits in (2, 4, 8), (wq.shape, in_dim)
    q = unpack_codes(wq, bits).astype(np.float64)
    assert q.shape[-1] == in_dim, (q.shape, in_dim)
    gs = in_dim // groups
    q = q.reshape(*q.shape[:-1], groups, gs)
    w = q * scales.astype(np.float64)[..., None] + biases.astype(np.float64)[..., None]
    w = w.reshape(*w.shape[:-2], in_dim)
    w32 = w.astype(np.float32)
    assert np.array_equal(w32.astype(np.float64), w), "dequantized weight not exact in fp32"
    return w32


def _in_dim_of(name: str, text_cfg: dict) -> int:
    """Input dim of a quantized module (needed to infer bits from the packed width)."""
    leaf = name.split(".")[-1]
    if leaf == "down_proj":
        if "switch_mlp" in name:
            return text_cfg["moe_intermediate_size"]
        return text_cfg["shared_expert_intermediate_size"]
    if leaf == "out_proj":
        return text_cfg["linear_num_value_heads"] * text_cfg["linear_value_head_dim"]
    if leaf == "o_proj":
        return text_cfg["num_attention_heads"] * text_cfg["head_dim"]
    return text_cfg["hidden_size"]  # embed_tokens, lm_head, q/k/v, in_proj_*, gate/up, routers


_MLX_NORM1P = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


def dequantize_mlx_checkpoint(mlx_dir) -> tuple[dict, dict[str, np.ndarray]]:
    """MLX checkpoint -> (text_config dict, fp32 HF-named state dict with fused experts).

    Undoes every mlx-lm conversion step: quantization (affine, bits/group inferred from shapes),
    the ``+1`` on RMSNorm1p weights, the conv1d ``[C, K, 1]`` layout, ``switch_mlp`` stacks and the
    ``language_model.`` prefix.
    """
    mlx_dir = Path(mlx_dir)
    cfg = json.loads((mlx_dir / "config.json").read_text())
    text_cfg = dict(cfg.get("text_config", cfg))
    text_cfg.pop("quantization", None)
    text_cfg.pop("quantization_config", None)
    arrays = _mlx_load_arrays(mlx_dir)

    sd: dict[str, np.ndarray] = {}
    for k in list(arrays):
        if k.endswith(".scales") or k.endswith(".biases"):
            continue
        v = arrays[k]
        base = k[: -len(".weight")] if k.endswith(".weight") else k
        if v.dtype == np.uint32:
            v = dequantize(v, arrays[base + ".scales"], arrays[base + ".biases"], _in_dim_of(base, text_cfg))
        else:
            v = v.astype(np.float32)
        name = k
        assert name.startswith("language_model."), name
        name = name[len("language_model.") :]
        if name.endswith(_MLX_NORM1P) and v.ndim == 1:
            v = (v.astype(np.float64) - 1.0).astype(np.float32)  # stored 1+w (bf16); exact
        if "conv1d.weight" in name:
            assert v.shape[-1] == 1, v.shape
            v = np.ascontiguousarray(np.moveaxis(v, 2, 1))  # [C,K,1] -> [C,1,K]
        sd[name] = v

    # switch_mlp stacks -> fused HF experts
    out: dict[str, np.ndarray] = {}
    for name, v in sd.items():
        if ".mlp.switch_mlp." in name:
            continue
        out[name] = v
    for l in range(text_cfg["num_hidden_layers"]):
        p = f"model.layers.{l}.mlp."
        g = sd[p + "switch_mlp.gate_proj.weight"]
        u = sd[p + "switch_mlp.up_proj.weight"]
        out[p + "experts.gate_up_proj"] = np.concatenate([g, u], axis=1)
        out[p + "experts.down_proj"] = sd[p + "switch_mlp.down_proj.weight"]
    return text_cfg, out


def mlx_tensor_summary(mlx_dir) -> dict[str, tuple]:
    """``{key: ("q", bits, group)}`` for quantized modules and ``{key: (dtype name,)}`` for the rest."""
    import mlx.core as mx

    mlx_dir = Path(mlx_dir)
    cfg = json.loads((mlx_dir / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    raw = {}
    for f in sorted(mlx_dir.glob("*.safetensors")):
        raw.update(mx.load(str(f)))
    out = {}
    for k, v in raw.items():
        if k.endswith(".scales") or k.endswith(".biases"):
            continue
        if v.dtype == mx.uint32:
            base = k[: -len(".weight")]
            in_dim = _in_dim_of(base, text_cfg)
            out[base] = ("q", 32 * v.shape[-1] // in_dim, in_dim // raw[base + ".scales"].shape[-1])
        else:
            out[k] = (str(v.dtype).split(".")[-1],)
    return out


def mlx_reference_logits(mlx_dir, ids: Sequence[int], *, float32: bool = True) -> np.ndarray:
    """mlx-lm's own forward over the full sequence (no cache), float64 ``[T, V]``.

    With ``float32`` every floating parameter (norms, conv, scales, biases) is cast to fp32 while the
    packed codes stay uint32, so the remaining differences to an fp32 engine are mlx-lm's own choices
    (bf16 router softmax/top-k inside ``softmax(precise=True)``, its rms_norm rounding, ...).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(mlx_dir))
    if float32:
        model.set_dtype(mx.float32)  # floating parameters only: packed codes stay uint32
        for k, v in tree_flatten(model.parameters()):
            assert v.dtype in (mx.float32, mx.uint32), (k, v.dtype)
    x = mx.array(np.asarray(ids, dtype=np.int32))[None]
    logits = model(x)
    mx.eval(logits)
    return np.array(logits[0].astype(mx.float32)).astype(np.float64)


# --------------------------------------------------------------------------------------------------
# safetensors files
# --------------------------------------------------------------------------------------------------


def rewrite_header(path: Path, fn) -> None:
    """Apply ``fn`` to the parsed header and write it back; data offsets are relative to the end of the
    header, so the header may change length."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + n])
    fn(header)
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + raw[8 + n:])


def checkpoint_error(fn, *needles: str) -> str:
    """Runs fn, which must raise lily.CheckpointError whose message holds every needle; returns it."""
    import pytest

    from lily.errors import CheckpointError

    with pytest.raises(CheckpointError) as ei:
        fn()
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg
