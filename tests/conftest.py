"""Shared fixtures: tiny generated checkpoints (built once per test session) and the `gpu` marker.

Checkpoints are created lazily by :func:`tiny_factory` the first time a test asks for one and are
cached for the whole session (each costs about a second). Reference logits are cached per
checkpoint too (``ckpt.ref(ids)``).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Tiny model zoo
# --------------------------------------------------------------------------------------------------

SPECS: dict[str, tiny.TinySpec] = {
    # One full-attention layer (the interval-4 schedule, like the real model), GQA group 2,
    # DeltaNet value/key head ratio 2 (like the real model), 8 experts top-2.
    "single_fa": tiny.TinySpec(
        layers=4,
        full_attention_layers=(3,),
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=32,
        lin_k_heads=2,
        lin_v_heads=4,
        lin_k_dim=32,
        lin_v_dim=32,
        experts=8,
        topk=2,
        moe_inter=64,
        shared_inter=64,
        vocab=256,
        seed=1,
    ),
    # Several full-attention layers in a schedule no interval rule produces (first and last layer
    # included: Lily must trust layer_types), GQA group 3, DeltaNet ratio 1 with key dim != value
    # dim, 6 experts top-3, sizes that are not multiples of 64.
    "multi_fa": tiny.TinySpec(
        layers=5,
        full_attention_layers=(0, 2, 4),
        hidden=96,
        heads=6,
        kv_heads=2,
        head_dim=16,
        lin_k_heads=3,
        lin_v_heads=3,
        lin_k_dim=16,
        lin_v_dim=24,
        experts=6,
        topk=3,
        moe_inter=48,
        shared_inter=80,
        vocab=320,
        seed=2,
    ),
    # The MLX model: interval-2 schedule (mlx-lm ignores layer_types), two full-attention layers,
    # GQA group 4, DeltaNet ratio 2, 16 experts top-4; every input dim a multiple of 64 so every
    # linear is quantized, hidden 128 so each row has two quantization groups.
    "mlx": tiny.TinySpec(
        layers=4,
        full_attention_layers=(1, 3),
        hidden=128,
        heads=4,
        kv_heads=1,
        head_dim=32,
        lin_k_heads=2,
        lin_v_heads=4,
        lin_k_dim=32,
        lin_v_dim=32,
        experts=16,
        topk=4,
        moe_inter=64,
        shared_inter=128,
        vocab=384,
        seed=3,
    ),
}

LAYOUTS = {
    # transformers' own save_pretrained: model.layers.*, per-expert keys, flat qwen3_5_moe_text config
    "per_expert": dict(fused_experts=False, multimodal_prefix=False),
    # the released checkpoint: model.language_model.*, fused experts, nested text_config, sharded
    "fused_mm": dict(fused_experts=True, multimodal_prefix=True),
    # the two mixed forms (written by hand): fused experts under text-only names, per-expert keys under
    # the multimodal prefix
    "fused_text": dict(fused_experts=True, multimodal_prefix=False),
    "per_expert_mm": dict(fused_experts=False, multimodal_prefix=True),
}


@dataclass
class TinyCkpt:
    """A generated checkpoint folder plus the fp32 transformers model holding exactly its weights."""

    name: str
    path: Path
    spec: tiny.TinySpec
    model: object  # transformers Qwen3_5MoeForCausalLM (fp32, eager)
    refs: tiny.Reference  # cached references, shared by checkpoints with the same weights

    @property
    def vocab(self) -> int:
        return self.spec.vocab

    def ref(self, ids) -> np.ndarray:
        """transformers fp32 logits ``[T, V]`` (float64), cached."""
        return self.refs.hf(ids)

    def ref_np(self, ids) -> np.ndarray:
        """Float64 numpy oracle (same weights) ``[T, V]``, cached."""
        return self.refs.np(ids)

    def check(self, got, ids, what: str, rows: slice = slice(None), tol: float = 1e-4) -> dict:
        """``tiny.Reference.check``: well-posedness, then parity against both references."""
        return self.refs.check(got, ids, f"{self.name} {what}", rows, tol)

    def tokens(self, n: int, seed: int = 0) -> list[int]:
        return tiny.random_tokens(self.vocab, n, seed)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """``get(spec_name, layout="per_expert", dtype="float32") -> TinyCkpt`` (built once, cached)."""
    import torch

    cache: dict = {}
    refs: dict = {}  # shared by the layouts of one (spec, dtype): same weights, same references
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

    def get(spec_name: str, layout: str = "per_expert", dtype: str = "float32", tokenizer: bool = False) -> TinyCkpt:
        key = (spec_name, layout, dtype, tokenizer)
        if key not in cache:
            spec = SPECS[spec_name]
            d = tmp_path_factory.mktemp(f"{spec_name}-{layout}-{dtype}")
            model = tiny.make_hf_checkpoint(
                d, **spec.kwargs(), dtype=dtypes[dtype], tokenizer=tokenizer, **LAYOUTS[layout]
            )
            shared = refs.setdefault((spec_name, dtype), tiny.Reference(model))
            cache[key] = TinyCkpt(f"{spec_name}/{layout}/{dtype}", d, spec, model, shared)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def ckpt_small(tiny_factory) -> TinyCkpt:
    """The default fp32 checkpoint for session/API tests."""
    return tiny_factory("single_fa", "per_expert")


@pytest.fixture(scope="session")
def lily_tiny_bf16(tmp_path_factory) -> Path:
    """"lily-tiny (bf16 export)": the packaged MLX 4-bit lily-tiny as a Hugging Face bf16 folder (dequantized
    matrices in bf16, its config without the quantization block, its tokenizer; lily.evaluate.export_hf), so a
    test can load it with ``lm_head="native"`` or ``"8bit"``. Its MTP block comes along once lily-tiny has one."""
    import lily
    from lily.evaluate import export_hf

    src = Path(lily.__file__).resolve().parent / "models" / "lily-tiny"
    if not (src / "config.json").is_file():
        pytest.skip("the packaged lily-tiny is not installed with this build")
    return export_hf(src, tmp_path_factory.mktemp("lily-tiny-bf16") / "lily-tiny-bf16")


# --------------------------------------------------------------------------------------------------
# GPU marker plumbing
# --------------------------------------------------------------------------------------------------


def _gpu_present() -> bool:
    if os.environ.get("LILY_TEST_GPU") is not None:
        return os.environ["LILY_TEST_GPU"] not in ("", "0", "false", "no")
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return True  # Apple silicon: Metal
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            return out.returncode == 0 and "GPU" in out.stdout
        except Exception:
            return False
    return False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU backend (skipped when none is present)")
    config.addinivalue_line("markers", "slow: long-running")


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if _gpu_present():
        return
    skip = pytest.mark.skip(reason="no GPU present (set LILY_TEST_GPU=1 to force)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
