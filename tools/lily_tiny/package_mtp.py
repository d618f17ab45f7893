#!/usr/bin/env python3
"""Add a trained MTP head (``mtp.safetensors`` from train_mtp.py) to the packaged lily-tiny (MLX 4-bit).

The block is quantized exactly as ``lily convert`` quantizes a checkpoint's MTP block (the same module
plan, lily.convert.plan_mtp_modules, and writer): every Linear 4-bit group 64, ``mlp.gate`` and
``mlp.shared_expert_gate`` 8-bit, norms stored as 1 + w in bf16, experts stacked as ``switch_mlp``,
names ``language_model.mtp.*``. The decoder's tensors are copied byte for byte. config.json gets
``mtp_num_hidden_layers: 1`` (and ``mtp_use_dedicated_embeddings: false``, as the Qwen release) and the
block's 8-bit entries in ``quantization`` / ``quantization_config``; model.safetensors.index.json its new
size, parameter count and names; the model card a line about the head. Running it again replaces the
head. The 20 MB weight budget of package.py is checked.

    python tools/lily_tiny/package_mtp.py OUT/mtp.safetensors src/lily/models/lily-tiny
    python tools/lily_tiny/package_mtp.py OUT/mtp.safetensors src/lily/models/lily-tiny --out /tmp/tiny-mtp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
try:
    import lily.convert  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parents[1] / "src"))

from lily.checkpoint import SafetensorsFile, load_checkpoint  # noqa: E402
from lily.convert import (MlxModule, _CheckpointSource, plan_mtp_modules, quantization_block,  # noqa: E402
                          write_mlx_weights)
from lily.errors import CheckpointError  # noqa: E402

MAX_BYTES = 20_000_000  # package.py's budget
GROUP, BITS = 64, 4
CARD_LINE = ("MTP head: one multi-token-prediction block (`language_model.mtp.*`, same quantization), trained "
             "on the frozen model by `tools/lily_tiny/train_mtp.py`; `generate(mtp=\"on\")` drafts with it.")


class _MtpSource(_CheckpointSource):
    """lily.convert's WeightSource over the ``mtp.*`` tensors of one safetensors file (per-expert or fused
    experts, as for a whole checkpoint); records which tensors the plan read."""

    def __init__(self, path: Path, num_experts: int):
        self.file = SafetensorsFile(path)
        super().__init__(types.SimpleNamespace(raw={n: (self.file, n) for n in self.file.tensors},
                                               config=types.SimpleNamespace(num_experts=num_experts)))
        self.used: set[str] = set()
        bad = sorted(n for n in self.raw if not n.startswith("mtp."))
        if bad:
            raise CheckpointError(f"'{path}': not an MTP head file (tensor '{bad[0]}' is outside mtp.*)")
        dts = sorted({self.file.tensors[n].dtype for n in self.raw})
        if dts != ["BF16"]:
            raise CheckpointError(f"'{path}': MTP tensors must be BF16 (the checkpoint dtype), found {dts}")

    def tensor(self, rel: str):
        if rel not in self.raw:
            raise CheckpointError(f"'{self.file.path}': MTP tensor '{rel}' is missing")
        self.used.add(rel)
        return super().tensor(rel)

    def dtype(self, rel: str) -> str:
        if rel not in self.raw:
            raise CheckpointError(f"'{self.file.path}': MTP tensor '{rel}' is missing")
        return super().dtype(rel)


def add_mtp(mtp_file: str | os.PathLike, model_dir: str | os.PathLike) -> dict:
    """Adds (or replaces) the MTP block of the MLX checkpoint in model_dir, in place. Returns a summary."""
    model_dir, mtp_file = Path(model_dir), Path(mtp_file)
    ck = load_checkpoint(model_dir)
    try:
        if ck.format != "mlx":
            raise CheckpointError(f"'{model_dir}' is not an MLX checkpoint (package it with package.py first)")
        cfg = ck.config
        weight_files = sorted({f.path for f in ck.files})
    finally:
        ck.close()
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())

    src = _MtpSource(mtp_file, cfg.num_experts)
    mtp = plan_mtp_modules(cfg, src, 1)
    for m in mtp:
        arr, _ = m.fetch()
        if tuple(arr.shape) != tuple(m.shape):
            raise CheckpointError(f"'{mtp_file}': {m.path} has shape {tuple(arr.shape)}, expected {tuple(m.shape)}")
    extra = sorted(set(src.raw) - src.used)
    if extra:
        raise CheckpointError(f"'{mtp_file}': unexpected tensor '{extra[0]}' (not part of an MTP block)")

    keep: list[MlxModule] = []
    files = [SafetensorsFile(p) for p in weight_files]
    replacing = False
    for f in files:
        for name, info in f.tensors.items():
            if name.startswith("language_model.mtp."):
                replacing = True  # an earlier head: dropped, the new one takes its place
                continue
            keep.append(MlxModule(name, "vector", info.shape, info.dtype,
                                  lambda f=f, name=name: (f.array(name), f.tensors[name].dtype)))
    mtp_params = sum(_prod(m.shape) for m in mtp)
    old_mtp_params = mtp_params if replacing else 0  # same config, same shapes
    raw_cfg = json.loads((model_dir / "config.json").read_text())
    text = raw_cfg.get("text_config", raw_cfg)

    tmp = model_dir.parent / (model_dir.name + ".mtp-partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        # target None: every tensor keeps its dtype (the decoder's bytes as they are; the head is BF16, what
        # lily convert casts to for this checkpoint's dtype bfloat16).
        new_index = write_mlx_weights(tmp, keep + mtp, target=None, group_size=GROUP, bits=BITS)
        new_index["metadata"]["total_parameters"] = (
            index["metadata"]["total_parameters"] - old_mtp_params + mtp_params)
        (tmp / "model.safetensors.index.json").write_text(json.dumps(new_index, indent=4))
        for f in files:
            f.close()
        src.file.close()

        text["mtp_num_hidden_layers"] = 1
        text["mtp_use_dedicated_embeddings"] = False
        q8 = {k: v for k, v in quantization_block(mtp, GROUP, BITS).items() if k.startswith("language_model.mtp.")}
        for key in ("quantization", "quantization_config"):
            if key in raw_cfg:
                block = {k: v for k, v in raw_cfg[key].items() if not k.startswith("language_model.mtp.")}
                block.update(q8)
                raw_cfg[key] = block
        (tmp / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")

        for p in weight_files:
            p.unlink()
        for name in ("model.safetensors.index.json", "config.json"):
            os.replace(tmp / name, model_dir / name)
        for p in tmp.glob("*.safetensors"):
            os.replace(p, model_dir / p.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    card = model_dir / "README.md"
    if card.is_file() and CARD_LINE not in card.read_text():
        card.write_text(card.read_text().rstrip("\n") + "\n\n" + CARD_LINE + "\n")

    ck = load_checkpoint(model_dir)
    try:
        if ck.mtp_layers != 1:
            raise CheckpointError(f"'{model_dir}': the written checkpoint has {ck.mtp_layers} MTP layers, not 1")
        summary = {"mtp_bytes": ck.mtp_bytes, "mtp_params": mtp_params,
                   "weights_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))}
    finally:
        ck.close()
    return summary


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mtp_file", help="mtp.safetensors written by train_mtp.py")
    ap.add_argument("model_dir", help="the packaged MLX lily-tiny folder")
    ap.add_argument("--out", help="write a copy here instead of changing model_dir")
    args = ap.parse_args()
    target = Path(args.model_dir)
    if args.out:
        out = Path(args.out)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(target, out)
        target = out
    s = add_mtp(args.mtp_file, target)
    print(f"{target}: MTP block {s['mtp_params']:,} params, {s['mtp_bytes'] / 1e6:.2f} MB; "
          f"{s['weights_bytes'] / 1e6:.2f} MB of weights in all")
    if s["weights_bytes"] > MAX_BYTES:
        print(f"error: weights exceed the {MAX_BYTES / 1e6:.0f} MB budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
