"""The packaged demonstration model: offline default, generation, and numerical consistency (issue 4)."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

import lily
from lily.evaluate import evaluate


@pytest.fixture(scope="module")
def tiny():
    return lily.Engine.from_pretrained()  # no model named: the packaged lily-tiny


@pytest.fixture(scope="module")
def heldout(tiny):
    return (tiny.checkpoint.path / "heldout.txt").read_text(encoding="utf-8")


def test_default_is_packaged_4bit_lily_tiny(tiny):
    assert tiny.checkpoint.path.name == "lily-tiny"
    assert tiny.checkpoint.format == "mlx"
    assert tiny.checkpoint.quantization["default"] == "q4g64"
    assert tiny.checkpoint.quantization["router"] == "q8g64"
    weights = sum(f.stat().st_size for f in tiny.checkpoint.path.glob("*.safetensors"))
    assert weights <= 20_000_000
    assert tiny.tokenizer is not None and tiny.tokenizer.chat_template


def test_generate_offline_from_cli(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "lily", "generate", "def read_lines(path):", "--max-tokens", "24"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip()) > 10


def test_greedy_generation_is_deterministic_and_learned(tiny):
    a = tiny.generate("import os\nimport sys\n\n\ndef main():\n", max_tokens=32)
    b = tiny.generate("import os\nimport sys\n\n\ndef main():\n", max_tokens=32)
    assert a == b and len(a) > 20
    # A trained model puts real mass on its greedy choice; a random one is near uniform (1/8192).
    s = tiny.session(max_context=64)
    logits = s.prefill(tiny.tokenize("import os\nimport sys\n\n\ndef main():\n")).astype(np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    assert probs.max() > 0.5


def test_chat_stops_at_end_of_turn(tiny):
    s = tiny.session(max_context=512)
    s.prefill(tiny.apply_chat_template([{"role": "user", "content": "What does `len` do?"}]))
    toks = list(s.generate(200))
    assert s.finish_reason in ("stop", "length")
    if s.finish_reason == "stop":
        assert toks[-1] in tiny.stop_token_ids


def test_heldout_perplexity_far_below_uniform(tiny, heldout):
    ids = np.asarray(tiny.tokenize(heldout)[:257])
    logits = tiny.session(max_context=len(ids)).prefill(ids[:-1], all_logits=True).astype(np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    ppl = math.exp(-lp[np.arange(len(ids) - 1), ids[1:]].mean())
    assert ppl < tiny.config.vocab_size / 100


@pytest.mark.parametrize("reference", ["transformers", "mlx"])
def test_consistency_with_reference(tiny, heldout, reference):
    pytest.importorskip("torch" if reference == "transformers" else "mlx_lm")
    result = evaluate(tiny, heldout, positions=192, references=[reference])
    c = result["comparisons"][0]
    assert c["positions"] == 192
    assert c["top1_agreement"] >= 0.99, c
    assert abs(c["relative_perplexity_difference"]) <= 1e-3, c
