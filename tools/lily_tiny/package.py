#!/usr/bin/env python3
"""Package a trained lily-tiny Hugging Face checkpoint as the library's embedded default model.

Converts it to the MLX 4-bit format (8-bit router) with Lily's own converter, nests the config the way
the multimodal Qwen3.5/3.6 release does (mlx-lm loads `qwen3_5_moe`, not the flat `qwen3_5_moe_text`),
adds a held-out text sample for `python -m lily eval`, and checks the 20 MB budget.

    python tools/lily_tiny/package.py HF_DIR src/lily/models/lily-tiny --heldout docs/lily-tiny/heldout.txt
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

MAX_BYTES = 20_000_000
HELDOUT_SAMPLE_CHARS = 6000  # several hundred tokens: more than the 192 positions the eval needs

MODEL_CARD = """# lily-tiny

A small **demonstration model** with the exact Qwen3.5/3.6-MoE text architecture (Gated DeltaNet and
gated attention in the 3:1 pattern, routed + shared experts, partial RoPE, untied LM head), trained from
scratch for Lily's offline default and its numerical-consistency tests. It is **not Qwen** and knows
only what its small training corpus taught it. Training, corpus and licence: `docs/lily-tiny/README.md`
in the Lily repository.

Format: MLX affine 4-bit (group 64), router and shared-expert gate 8-bit, written by `lily convert`.
`heldout.txt` is a sample of held-out text for `python -m lily eval`.
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--heldout", required=True, help="held-out text file (a sample of it is shipped)")
    args = ap.parse_args()

    from lily.convert import convert

    out = pathlib.Path(args.out_dir)
    if out.exists():
        shutil.rmtree(out)
    convert(args.hf_dir, out, group_size=64, bits=4, progress=True)

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if "text_config" not in cfg:
        quant = {k: cfg.pop(k) for k in ("quantization", "quantization_config") if k in cfg}
        text = dict(cfg, model_type="qwen3_5_moe_text")
        text.pop("architectures", None)
        cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": text, "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)), **quant}
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")

    text = pathlib.Path(args.heldout).read_text(encoding="utf-8")
    cut = text[:HELDOUT_SAMPLE_CHARS]
    (out / "heldout.txt").write_text(cut[: cut.rfind("\n") + 1] or cut, encoding="utf-8")
    (out / "README.md").write_text(MODEL_CARD)

    total = sum(f.stat().st_size for f in out.iterdir())
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{out}: {weights / 1e6:.2f} MB of weights, {total / 1e6:.2f} MB in all")
    if weights > MAX_BYTES:
        print(f"error: weights exceed the {MAX_BYTES / 1e6:.0f} MB budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
