"""lm_head="8bit" on the CUDA backend (issue 14 item 5, src/lily/lm_head.py): a bf16 checkpoint's head quantized at
load runs through the backend's existing 8-bit GEMV/GEMM (no CUDA code of its own), so these compare the GPU with
the CPU oracle loaded with the same option, check that the host copy of the quantized head is freed once the
backend has copied it, that the MTP drafter and verifier agree on it, and item 5's perplexity bar on lily-tiny's
bf16 export. The kernel at the real model's shape is tests/cuda/test_matmul.py::test_lm_head_q8_decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lily
from lily.evaluate import lily_logits, perplexity
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

from cuda_util import rel_err, requires_cuda

pytestmark = requires_cuda

PROMPT = [1, 5, 9, 22, 7, 100, 3, 250, 17, 44, 300, 12]
HELDOUT = Path(__file__).resolve().parents[2] / "docs" / "lily-tiny" / "heldout.txt"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("lmh_cuda") / "hf", TINY_CONFIG, fmt="hf", seed=41,
                                      mtp_layers=1)


def test_8bit_head_logits_match_the_cpu_with_the_same_option(path):
    vocab = TINY_CONFIG["vocab_size"]
    with lily.Engine.from_pretrained(path, backend="cpu", lm_head="8bit") as cpu, \
            lily.Engine.from_pretrained(path, backend="cuda", lm_head="8bit") as gpu:
        r = gpu.report()
        assert r["lm_head"]["format"] == "q8g64-bf16" and r["kernels"]["lm_head"]["format"] == "q8g64"
        assert r["kernels"]["lm_head"]["decode"].startswith("gemv_q8_"), r["kernels"]["lm_head"]
        # CUDA copied the head into device memory at load (place_weights): the host arrays are gone.
        assert r["lm_head"]["resident"].startswith("device memory only")
        assert gpu._lm_head.host_copy_freed
        sc, sg = cpu.session(), gpu.session()
        lc, lg = sc.prefill(PROMPT, all_logits=True), sg.prefill(PROMPT, all_logits=True)
        assert rel_err(lg, lc) < 1e-2  # bf16 tensor-core products in prefill (test_cuda_backend.py's bound)
        for t in np.random.default_rng(42).integers(0, vocab, size=6).tolist():  # decode: fp32 GEMVs
            assert rel_err(sg.step(t), sc.step(t)) < 1e-2


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_mtp_equals_greedy_with_the_8bit_head(path, k):
    """The drafter reads the model's lm_head Weight, so with injected drafts (the greedy continuation, and a
    corrupted one) the output is the plain greedy output of the 8-bit head."""
    def run(engine, n, *, mtp="off", drafts=None):
        s = engine.session(max_context=128)
        s.prefill(PROMPT)
        if drafts is not None:
            s._core._draft_override(len(PROMPT), list(drafts))
        return s, list(s.generate(n, lily.SamplingParams(temperature=0), stop_token_ids=[], mtp=mtp, mtp_k=k))

    with lily.Engine.from_pretrained(path, backend="cuda", lm_head="8bit") as gpu:
        _, base = run(gpu, 24)
        bad = [(t + 1) % TINY_CONFIG["vocab_size"] if i % 3 == 2 else t for i, t in enumerate(base)]
        for drafts in (None, base, bad):
            _, out = run(gpu, 24, mtp="on", drafts=drafts)
            assert out == base


def test_lily_tiny_bf16_export_8bit_head_perplexity(lily_tiny_bf16):
    """Item 5's bar on the GPU: perplexity with the 8-bit head within 0.1% of the bf16 head's (both on the GPU),
    and within 0.1% of the CPU's with the same head."""
    ppl = {}
    for backend, head in (("cuda", "native"), ("cuda", "8bit"), ("cpu", "8bit")):
        with lily.Engine.from_pretrained(lily_tiny_bf16, backend=backend, lm_head=head) as e:
            ids = np.asarray(e.tokenize(HELDOUT.read_text()), dtype=np.int64)[:2049]
            ppl[backend, head] = perplexity(lily_logits(e, ids), ids[1:])
    print(f"lily-tiny bf16 export, 2048 positions: {ppl}")
    assert abs(ppl["cuda", "8bit"] / ppl["cuda", "native"] - 1) < 1e-3
    assert abs(ppl["cuda", "8bit"] / ppl["cpu", "8bit"] - 1) < 1e-3
