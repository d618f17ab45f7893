"""Lily's MTP drafts (CPU backend) against an independent torch reference (issue 14 items 2 and 6).

The reference is tools/lily_tiny/mtp_torch.py, the module lily-tiny's MTP head is trained with: transformers'
own RMSNorm and decoder layer on the main model's hidden after the final norm, vLLM's positions (the pair
(token t+1, h_t) at position t), the main model's lm_head. The main model is transformers'
Qwen3_5MoeForCausalLM holding the checkpoint's weights (lily.evaluate.transformers_model); the MTP weights
come straight from the checkpoint's safetensors files (per-expert names, as the Qwen release stores them), not
through Lily's loader. Checkpoint: a random synthetic one, float32 weights, so both sides compute in float32 on
the same numbers; prompts of awkward lengths (not a multiple of the prefill chunk, 8), so the block's KV rows
cross chunk boundaries.

Compared: Session._draft_logits(token, k) (tests only: k chained greedy draft rows from the session's current
state, as generate(mtp="on") computes them) for k = 2: row 0 (the pending token with the model's hidden) and
row 1 (the chained draft: row 0's argmax with the block's own hidden), and a chain of 4. Tolerance: float32
with different summation orders through 4 decoder layers, the block and an lm_head: |lily - ref| <=
3e-5 * max|ref| + 1e-6 per row set (measured: at most 2e-6 of max|ref|), and the same argmax.

Breaks tried, each made these tests fail: the first draft at position P instead of P - 1 (shift j instead of
j - 1), the chained draft fed the model's hidden instead of the block's, the reference's block without
pre_fc_norm_hidden, and feeding [hn | e] instead of [e | hn].
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import lily
from lily.evaluate import transformers_model
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "lily_tiny"))
from mtp_torch import MtpBlock, draft_chain  # noqa: E402

PROMPTS = [[5, 9, 22, 7, 100, 3, 250, 17, 301, 44, 2, 8, 61], list(range(30, 49)), [77, 400]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("mtp-ref") / "m", TINY_CONFIG, fmt="hf",
                                      dtype="f32", mtp_layers=1, seed=21)
    engine = lily.Engine.from_pretrained(str(path), backend="cpu", prefill_chunk=8)
    model = transformers_model(engine.checkpoint, max_positions=64)
    block = MtpBlock(model.config).float().eval()
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(str(f)).items() if k.startswith("mtp.")})
    block.load_hf_state_dict(tensors)
    yield engine, model, block
    engine.close()


def reference(model, block, prompt, token, k):
    ids = torch.tensor(prompt, dtype=torch.long)
    with torch.no_grad():
        h = model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        return draft_chain(model, block, ids, h, token, k).double().numpy()


def check_close(lily_rows, ref_rows):
    err = np.abs(lily_rows.astype(np.float64) - ref_rows)
    tol = 3e-5 * np.abs(ref_rows).max() + 1e-6
    assert err.max() <= tol, (err.max(), tol)
    assert (lily_rows.argmax(-1) == ref_rows.argmax(-1)).all()


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
def test_first_and_chained_draft_match_the_torch_block(setup, prompt):
    engine, model, block = setup
    s = engine.session(max_context=64)
    x = int(np.argmax(s.prefill(prompt)))  # the pending token generate() would deliver first
    rows = s._core._draft_logits(x, 2)
    assert rows.shape == (2, TINY_CONFIG["vocab_size"])
    ref = reference(model, block, prompt, x, 2)
    check_close(rows, ref)
    # The chained row is not the first row again, nor a first draft from the drafted token with the model's
    # hidden: it depends on the block's own hidden (what the reference feeds back).
    assert np.abs(ref[1] - ref[0]).max() > 1e-2


def test_chain_of_four_and_a_token_other_than_greedy(setup):
    engine, model, block = setup
    prompt = PROMPTS[0]
    s = engine.session(max_context=64)
    s.prefill(prompt)
    check_close(s._core._draft_logits(123, 4), reference(model, block, prompt, 123, 4))


def test_draft_logits_leave_the_session_unchanged(setup):
    """The hook reads the state: the session's state (a snapshot's arrays, the block's valid KV rows included)
    is the same before and after, its drafts are repeatable, and it generates what a fresh session generates.
    The block's cache row P - 1 is not valid at position P (it needs token P; docs/ARCHITECTURE.md): drafts
    write it, as generate(mtp="on") does, and the next forward rewrites it before it is read."""
    engine, _, _ = setup
    prompt = PROMPTS[1]
    P = len(prompt)
    a = engine.session(max_context=64)
    a.prefill(prompt)
    before = a.snapshot()._core.to_arrays()
    first = a._core._draft_logits(11, 3)
    after = a.snapshot()._core.to_arrays()
    assert before.keys() == after.keys()
    block_kv = f"kv.{sum(t == 'full_attention' for t in engine.config.layer_types)}"  # after the decoder's
    c = engine.config
    for name in before:
        x, y = before[name], after[name]
        if name == block_kv:  # [K|V, kv_heads, P, head_dim]: rows 0 .. P-2 are the valid ones
            x, y = (t.reshape(2, c.num_key_value_heads, P, c.head_dim)[:, :, : P - 1] for t in (x, y))
        np.testing.assert_array_equal(x, y, err_msg=name)
    np.testing.assert_array_equal(a._core._draft_logits(11, 3), first)
    b = engine.session(max_context=64)
    b.prefill(prompt)
    assert list(a.generate(12, stop_token_ids=[], mtp="on", mtp_k=3)) == list(b.generate(12, stop_token_ids=[]))


def test_draft_logits_bad_arguments(setup):
    engine, _, _ = setup
    s = engine.session(max_context=64)
    with pytest.raises(ValueError, match="at least one token"):
        s._core._draft_logits(1, 1)
    s.prefill([1, 2, 3])
    for k in (0, 5):
        with pytest.raises(ValueError, match="k must be in 1..4"):
            s._core._draft_logits(1, k)
    with pytest.raises(ValueError):
        s._core._draft_logits(TINY_CONFIG["vocab_size"], 1)
