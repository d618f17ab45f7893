"""tools/lily_tiny/package_mtp.py: a trained MTP head added to an MLX checkpoint is what `lily convert` writes.

A random HF checkpoint with an MTP block is converted twice, with the block (`lily convert`) and without it;
package_mtp then adds the block's `mtp.*` tensors (a head file as train_mtp.py writes it: per-expert names,
bf16) to the second. Both must be the same checkpoint: every tensor's name, dtype, shape and bytes, the
config (mtp_num_hidden_layers, the 8-bit entries of the quantization block) and the index. The torch block's
names (mtp_torch.MtpBlock.hf_state_dict, what train_mtp.py saves) are the release's names.

Breaks tried, each made a test fail: the block's 8-bit entries left out of config.json's quantization
block, the index's parameter count not updated. (The quantization itself is lily.convert's plan, shared by
both sides: tests/test_quantize_convert.py and tests/test_mtp_weights.py guard it.)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import lily
from lily.checkpoint import SafetensorsFile, load_checkpoint
from lily.convert import convert
from lily.errors import CheckpointError
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "lily_tiny"))
from mtp_torch import MtpBlock  # noqa: E402
from package_mtp import add_mtp  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-pkg")
    hf = write_synthetic_checkpoint(root / "hf", TINY_CONFIG, fmt="hf", mtp_layers=1, seed=5)
    full = convert(hf, root / "full", progress=False)
    head = {}
    for f in sorted(hf.glob("*.safetensors")):
        head.update({k: v for k, v in load_file(str(f)).items() if k.startswith("mtp.")})
    save_file(head, str(root / "mtp.safetensors"), metadata={"format": "pt"})
    return root, hf, full, head


def tensors(folder: Path) -> dict:
    out = {}
    for p in sorted(folder.glob("*.safetensors")):
        f = SafetensorsFile(p)
        out.update({n: (i.dtype, tuple(i.shape), bytes(np.asarray(f.array(n)).tobytes())) for n, i in f.tensors.items()})
        f.close()
    return out


def same_checkpoint(a: Path, b: Path):
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for n in ta:
        assert ta[n] == tb[n], n
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    assert json.loads((a / "model.safetensors.index.json").read_text()) == \
        json.loads((b / "model.safetensors.index.json").read_text())


def test_packaged_head_equals_convert(made, tmp_path):
    root, hf, full, _ = made
    base = convert(hf, tmp_path / "base", progress=False, mtp=False)
    assert load_checkpoint(base).mtp_layers == 0
    other = {k: (v.float() * 0.5).to(torch.bfloat16) for k, v in made[3].items()}
    save_file(other, str(tmp_path / "other.safetensors"))
    add_mtp(tmp_path / "other.safetensors", base)  # an earlier head, then the real one replaces it
    assert tensors(base) != tensors(full)
    add_mtp(root / "mtp.safetensors", base)
    same_checkpoint(base, full)
    with lily.Engine.from_pretrained(str(base), backend="cpu") as e:
        assert e.report()["mtp"]["present"] is True
        s = e.session(max_context=64)
        s.prefill([3, 1, 4, 1, 5, 9, 2, 6])
        spec = list(s.generate(10, stop_token_ids=[], mtp="on", mtp_k=3))
        s2 = e.session(max_context=64)
        s2.prefill([3, 1, 4, 1, 5, 9, 2, 6])
        assert spec == list(s2.generate(10, stop_token_ids=[]))


def test_torch_block_saves_the_release_names(made):
    _, hf, _, head = made
    ck = load_checkpoint(hf)
    from lily.evaluate import transformers_model

    block = MtpBlock(transformers_model(ck).config)
    ck.close()
    saved = block.hf_state_dict()
    assert saved.keys() == head.keys()
    assert all(tuple(saved[k].shape) == tuple(head[k].shape) for k in head)
    block.load_hf_state_dict(head)  # and back: per-expert tensors into the fused experts
    again = block.hf_state_dict()
    assert all(torch.equal(again[k], head[k].float()) for k in head)


def test_bad_head_files_are_named(made, tmp_path):
    root, hf, _, head = made
    base = convert(hf, tmp_path / "base", progress=False, mtp=False)
    missing = {k: v for k, v in head.items() if k != "mtp.layers.0.mlp.experts.3.up_proj.weight"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.mlp\.experts\.3\.up_proj\.weight"):
        add_mtp(tmp_path / "missing.safetensors", base)
    extra = dict(head, **{"mtp.layers.0.bogus.weight": head["mtp.norm.weight"].clone()})
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="bogus"):
        add_mtp(tmp_path / "extra.safetensors", base)
    f32 = {k: v.float() for k, v in head.items()}
    save_file(f32, str(tmp_path / "f32.safetensors"))
    with pytest.raises(CheckpointError, match="BF16"):
        add_mtp(tmp_path / "f32.safetensors", base)
    assert load_checkpoint(base).mtp_layers == 0  # a failed add leaves the folder as it was
    shutil.rmtree(base)
