"""The MTP block of Qwen3.5/3.6-MoE (MODEL.md section 7) as a torch module, with the semantics Lily runs.

Lily follows vLLM (csrc/model/qwen36.cpp, the comment above ``mtp_block``): the block's row for the pair
(token t+1, h_t) runs at RoPE position t, where h_t is the main model's hidden after its final norm::

    e  = RMSNorm1p(embed(tok[t+1]), pre_fc_norm_embedding)
    hn = RMSNorm1p(h_t, pre_fc_norm_hidden)
    x  = fc([e | hn])                      # fc [H, 2H], no bias, embedding half first
    x  = DecoderLayer(x) at position t     # a full-attention layer: causal over the block's own rows
    g  = RMSNorm1p(x, mtp.norm)            # the block's hidden: a chained draft feeds it back as h
    logits = lm_head(g)                    # the MAIN model's lm_head; predicts tok[t+2]

The parts are transformers' own classes (``Qwen3_5MoeRMSNorm``: (1+w) with zero init,
``Qwen3_5MoeDecoderLayer`` with a full-attention layer type, rotary from the main model's
``rotary_emb``), so the block computes exactly what a transformers decoder layer computes. Used by
tools/lily_tiny/train_mtp.py (training) and tests/test_mtp_reference.py (Lily's drafts against it).

Checkpoint names are those of the Qwen release and of Lily's HF loader: ``mtp.fc.weight``,
``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight``,
``mtp.layers.0.<decoder layer names>`` with per-expert ``mlp.experts.E.{gate,up,down}_proj.weight``
(``hf_state_dict`` writes these; ``load_hf_state_dict`` also takes fused experts).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm


def full_attention_index(config) -> int:
    """The last full-attention layer of the main model: the MTP layer is built with its layer type."""
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    if not full:
        raise ValueError("config.layer_types has no full_attention layer: the MTP block needs one")
    return full[-1]


class KVStore:
    """The minimal cache protocol Qwen3_5MoeAttention uses (``update``): keeps the K/V of earlier calls and
    returns them followed by the new rows, so later rows (chained drafts) attend to earlier ones."""

    def __init__(self):
        self.k = self.v = None

    def update(self, k, v, layer_idx=None, *args, **kwargs):
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class MtpBlock(nn.Module):
    """One MTP block (``mtp_num_hidden_layers`` = 1, as in Qwen3.6) on a frozen main model's config.

    ``config`` is the main model's config object (shared, so the experts and attention implementations
    chosen for the main model apply here too)."""

    def __init__(self, config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(H, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(config, full_attention_index(config))])
        self.norm = Qwen3_5MoeRMSNorm(H, eps=eps)

    def forward(self, emb, h, positions, rotary_emb, *, attention_mask=None, cache=None):
        """Block hidden g [B, T, H] (after mtp.norm) for rows (emb[:, i] = embed(token), h[:, i]) at
        ``positions`` [B, T]. ``attention_mask``: None for plain causal rows (SDPA's is_causal), else a
        bool [1 or B, 1, T, keys] mask (True: attend); ``cache``: a KVStore holding earlier rows."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(h)], dim=-1))
        pe = rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, position_embeddings=pe, attention_mask=attention_mask, position_ids=positions, cache=cache)
        return self.norm(x)

    # ---- initialisation ----

    @torch.no_grad()
    def init_from_main(self, model) -> None:
        """Start from the main model: the decoder layer is a copy of its last full-attention layer (trained
        attention, balanced router, experts in the right scale), mtp.norm a copy of the final norm (the
        lm_head was trained on its output), and fc = [I | I], so x = e + hn: the token's identity plus the
        context (the pre-fc norms start at 0, i.e. scale 1). Everything then trains."""
        main = model.model
        self.layers[0].load_state_dict(main.layers[full_attention_index(self.config)].state_dict())
        self.norm.weight.copy_(main.norm.weight)
        H = self.config.hidden_size
        eye = torch.eye(H, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
        self.fc.weight.copy_(torch.cat([eye, eye], dim=1))
        self.pre_fc_norm_embedding.weight.zero_()
        self.pre_fc_norm_hidden.weight.zero_()

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """transformers' own initialisation (normal(0, initializer_range) matrices, zero norms)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)

    # ---- checkpoint names ----

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """``mtp.*`` tensors under the Qwen release's names, per-expert experts (as transformers saves)."""
        out = {}
        for name, t in self.state_dict().items():
            if name.endswith("mlp.experts.gate_up_proj"):
                base = "mtp." + name[: -len("gate_up_proj")]
                mid = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = t[e, :mid].contiguous()
                    out[f"{base}{e}.up_proj.weight"] = t[e, mid:].contiguous()
            elif name.endswith("mlp.experts.down_proj"):
                base = "mtp." + name[: -len("down_proj")]
                for e in range(t.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
            else:
                out["mtp." + name] = t.contiguous()
        return out

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load ``mtp.*`` tensors (other names ignored); experts per expert or fused. Strict: every
        parameter must be there, and nothing under ``mtp.`` may be left over."""
        own = self.state_dict()
        mtp = {k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")}
        sd, used = {}, set()
        for name, ref in own.items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) and name not in mtp:
                base, proj = name.rsplit(".", 1)
                E = ref.shape[0]
                if proj == "gate_up_proj":
                    keys = [[f"{base}.{e}.gate_proj.weight", f"{base}.{e}.up_proj.weight"] for e in range(E)]
                    parts = [torch.cat([mtp[g], mtp[u]]) for g, u in _require(mtp, keys)]
                else:
                    keys = [[f"{base}.{e}.down_proj.weight"] for e in range(E)]
                    parts = [mtp[d] for (d,) in _require(mtp, keys)]
                used.update(k for ks in keys for k in ks)
                sd[name] = torch.stack(parts)
            else:
                if name not in mtp:
                    raise KeyError(f"MTP tensor 'mtp.{name}' is missing")
                sd[name] = mtp[name]
                used.add(name)
        extra = sorted(set(mtp) - used)
        if extra:
            raise KeyError(f"unexpected MTP tensors: {['mtp.' + k for k in extra[:5]]}")
        for name, t in sd.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise ValueError(f"MTP tensor 'mtp.{name}': shape {tuple(t.shape)}, expected {tuple(own[name].shape)}")
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=True)


def _require(mtp: dict, keys: list[list[str]]) -> list[list[str]]:
    for ks in keys:
        for k in ks:
            if k not in mtp:
                raise KeyError(f"MTP tensor 'mtp.{k}' is missing")
    return keys


def block_logits(model, g: torch.Tensor) -> torch.Tensor:
    """Logits of block hiddens g through the main model's lm_head (no copy of its weights)."""
    return F.linear(g, model.lm_head.weight)


def draft_chain(model, block: MtpBlock, ids: torch.Tensor, h: torch.Tensor, token: int, k: int) -> torch.Tensor:
    """Reference of Lily's drafting from a context of n tokens ``ids`` [n] whose main-model hiddens (after
    the final norm) are ``h`` [n, H], with ``token`` the pending token after them: k chained greedy draft
    logits [k, vocab]. Row 0 is the block at position n-1 on (token, h[n-1]), after the block's rows for
    the context pairs (ids[t+1], h[t]) at positions t < n-1 (its KV, as Lily keeps it in every forward);
    row j > 0 feeds the argmax of row j-1 with the block's own hidden at position n-1+j."""
    n = ids.shape[0]
    toks = torch.cat([ids[1:], torch.tensor([token], dtype=ids.dtype, device=ids.device)])
    emb_w = model.model.embed_tokens
    hs = h
    out = []
    for j in range(k):
        pos = torch.arange(n + j, device=ids.device)[None]
        g = block(emb_w(toks)[None], hs[None], pos, model.model.rotary_emb)[0]
        logits = block_logits(model, g[-1])
        out.append(logits)
        toks = torch.cat([toks, logits.argmax().view(1).to(toks.dtype)])
        hs = torch.cat([hs, g[-1:]])
    return torch.stack(out)
