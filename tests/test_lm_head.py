"""The LM head's format at load (issue 14 items 5 and 4): ``Engine.from_pretrained(..., lm_head="auto" | "8bit" |
"native")``, src/lily/lm_head.py, on the CPU backend.

- The 8-bit head is lily convert's: codes, scales and biases equal, byte for byte, the ``lm_head`` tensors of
  ``lily.convert(..., bits=8)`` of the same bf16 / f32 checkpoint; quantizing slab by slab gives the bytes of one
  call on the whole matrix (slab boundaries forced), f16 included; the arrays are 16 KiB aligned (Metal wraps them
  without a copy).
- report() says the format, why (option, per-backend default), the bytes and the seconds; the core runs the
  8-bit GEMV on it (kernel names) and counts its bytes; a tied head gets its own copy and the embedding stays;
  a head the checkpoint already stores quantized is left alone; the fingerprint tells the formats apart.
- "auto": the per-backend threshold (64 MiB of bf16/f16) and the f32 rule, on every backend of lily.lm_head.AUTO.
- One head for verifier and drafter (item 4): with an MTP block and lm_head="8bit" the weights hold one head
  (the block's bytes do not change with the option), and greedy output with MTP equals greedy without it.
- Item 5's figure: perplexity of lily-tiny's bf16 export over 2048 held-out positions with the 8-bit head is
  within 0.1% of the bf16 head (and the export is within 0.1% of the MLX lily-tiny it came from).
- Bad values raise ValueError naming lm_head before any file is mapped.

Breaks tried, each made the named tests fail: scales and biases swapped in quantize_head (bytes equal convert,
slabs, logits, perplexity); a slab's last row left unwritten (the same); the engine handing the core
checkpoint.tensors unchanged (report, logits "not identical", tied, one head for MTP, perplexity); auto ignoring
min_bytes (auto threshold, small head, fingerprint); the tied copy replacing the embedding too (tied: the state
differs); the fingerprint not hashing the head (fingerprint); the export leaving the MTP norms as 1 + w, or
storing matrices in f32 (export roundtrip); the drafter's logits through the embedding matrix instead of the
model's lm_head (acceptance: 1.003 with either head).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lily
from lily import lm_head
from lily.checkpoint import SafetensorsFile
from lily.convert import convert
from lily.evaluate import export_hf, lily_logits, perplexity
from lily.quantize import bf16_to_f32, dequantize, f32_to_bf16, quantize
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

V, H = TINY_CONFIG["vocab_size"], TINY_CONFIG["hidden_size"]
HELDOUT = Path(__file__).resolve().parents[1] / "docs" / "lily-tiny" / "heldout.txt"
PROMPT = [1, 5, 9, 22, 7, 100, 3, 250, 17]


@pytest.fixture(scope="module")
def hf_bf16(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("lmh") / "hf", TINY_CONFIG, fmt="hf", seed=31,
                                      mtp_layers=1)


@pytest.fixture(scope="module")
def engines(hf_bf16):
    with lily.Engine.from_pretrained(hf_bf16, backend="cpu", lm_head="native") as n, \
            lily.Engine.from_pretrained(hf_bf16, backend="cpu", lm_head="8bit") as q:
        yield n, q


# ---- the bytes ----

@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_quantized_head_equals_lily_convert_bits_8(tmp_path, dtype):
    src = write_synthetic_checkpoint(tmp_path / "hf", TINY_CONFIG, fmt="hf", dtype=dtype, seed=32)
    convert(src, tmp_path / "q8", bits=8, progress=False)
    ref = SafetensorsFile(tmp_path / "q8" / "model.safetensors")
    with lily.Engine.from_pretrained(src, backend="cpu", lm_head="8bit") as e:
        d = e._lm_head.descriptor
        assert d["kind"] == "affine" and (d["bits"], d["group"], d["scale_dtype"]) == (8, 64, dtype)
        for part, name in (("data", "weight"), ("scales", "scales"), ("biases", "biases")):
            want = ref.array(f"language_model.lm_head.{name}")
            assert d[part].shape == want.shape and d[part].dtype.itemsize == want.dtype.itemsize, part
            assert np.array_equal(np.asarray(d[part]).view(np.uint8), want.view(np.uint8)), part
            assert d[part].ctypes.data % 16384 == 0, f"{part} is not 16 KiB aligned"
        # The checkpoint's own descriptor stays the stored dense head (nothing dequantized is kept either).
        assert e.checkpoint.tensors["lm_head"]["kind"] == "dense"
    ref.close()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, "bf16"])
def test_slabs_give_the_bytes_of_one_call(monkeypatch, dtype):
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.05, (1000, 192)).astype(np.float32)
    data = f32_to_bf16(w) if dtype == "bf16" else w.astype(dtype)
    name = "bf16" if dtype == "bf16" else {np.float16: "f16", np.float32: "f32"}[dtype]
    desc = {"kind": "dense", "dtype": name, "shape": (1000, 192), "data": data}
    monkeypatch.setattr(lm_head, "_SLAB_WEIGHTS", 192 * 7)  # slabs of 7 rows: 143 slabs, the last one of 6
    got = lm_head.quantize_head(desc)
    want = quantize(data, 64, 8, bf16=dtype == "bf16")
    for part, ref in zip(("data", "scales", "biases"), want):
        assert np.array_equal(got[part].view(np.uint8), np.ascontiguousarray(ref).view(np.uint8)), part
    back = dequantize(got["data"], got["scales"], got["biases"], 64, 8, bf16=dtype == "bf16")
    stored = bf16_to_f32(data) if dtype == "bf16" else data.astype(np.float32)
    # Half a code step, plus the scale and bias rounded to the head's dtype (bf16: up to 2^-9 of 255 steps and
    # of the bias): within 1.5 steps of the widest group's range / 255.
    assert np.abs(back - stored).max() <= 1.5 * (stored.max() - stored.min()) / 255


# ---- report, kernels, memory ----

def test_report_says_format_reason_bytes_and_seconds(engines):
    native, q8 = engines
    rn, rq = native.report(), q8.report()
    n8 = V * H + 2 * 2 * V * (H // 64)  # codes + bf16 scales and biases
    assert rq["lm_head"]["format"] == "q8g64-bf16" and rq["lm_head"]["bytes"] == n8
    assert rq["lm_head"]["status"] == "8-bit affine, quantized at load (from bf16)"
    assert rq["lm_head"]["option"] == "8bit" and rq["lm_head"]["reason"] == "lm_head='8bit'"
    assert rq["lm_head"]["quantize_seconds"] >= 0 and rq["lm_head"]["resident"].startswith("host memory")
    assert "cpu: 8-bit affine g64 for bf16/f16 heads of 64 MiB" in rq["lm_head"]["backend_default"]
    assert rq["lm_head"]["mtp_drafter"].startswith("reads this same head")
    assert rn["lm_head"]["format"] == "bf16" and rn["lm_head"]["bytes"] == 2 * V * H
    assert rn["lm_head"]["status"] == "as stored in the checkpoint" and "native" in rn["lm_head"]["reason"]
    # What the core runs and counts.
    assert rq["kernels"]["lm_head"]["format"] == "q8g64" and "q8" in rq["kernels"]["lm_head"]["decode"]
    assert rn["kernels"]["lm_head"]["format"] == "bf16" and "bf16" in rn["kernels"]["lm_head"]["decode"]
    assert rq["memory"]["weights_mapped_bytes"]["lm_head"] == n8
    assert rn["memory"]["weights_mapped_bytes"]["lm_head"] == 2 * V * H
    assert "lm_head" in str(rq) and "q8g64-bf16" in str(rq)  # the printed table shows it


def test_auto_keeps_a_small_head_and_says_why(hf_bf16):
    with lily.Engine.from_pretrained(hf_bf16, backend="cpu") as e:
        r = e.report()["lm_head"]
        assert r["option"] == "auto" and r["format"] == "bf16"
        assert "0.1 MiB, under the 64 MiB" in r["reason"], r["reason"]


def test_logits_close_to_the_bf16_head_and_not_identical(engines):
    native, q8 = engines
    a = native.session(max_context=64).prefill(PROMPT, all_logits=True)
    b = q8.session(max_context=64).prefill(PROMPT, all_logits=True)
    rel = np.linalg.norm(b - a) / np.linalg.norm(a)
    # 8-bit codes at group 64: a step of range/255 per weight; the logits move by a few 1e-3 relative.
    assert 0 < rel < 1e-2, rel
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75


def test_fingerprint_tells_the_heads_apart(engines, hf_bf16):
    native, q8 = engines
    assert native.fingerprint != q8.fingerprint
    with lily.Engine.from_pretrained(hf_bf16, backend="cpu") as auto:  # a small head: as stored, like native
        assert auto.fingerprint == native.fingerprint


def test_tied_head_gets_its_own_copy_and_the_embedding_stays(tmp_path):
    src = write_synthetic_checkpoint(tmp_path / "tied", dict(TINY_CONFIG, tie_word_embeddings=True), fmt="hf",
                                     seed=33)
    with lily.Engine.from_pretrained(src, backend="cpu", lm_head="native") as n, \
            lily.Engine.from_pretrained(src, backend="cpu", lm_head="8bit") as q:
        rn, rq = n.report(), q.report()
        assert rn["tied_embeddings"] and rq["tied_embeddings"]
        assert "reads the embedding's bytes" in rn["lm_head"]["tied"]
        assert rq["lm_head"]["tied"].startswith("own q8g64-bf16 copy")
        assert rq["kernels"]["embed_tokens"]["format"] == "bf16" and rq["kernels"]["lm_head"]["format"] == "q8g64"
        assert q.checkpoint.tensors["embed"] is q.checkpoint.tensors["lm_head"]  # the checkpoint keeps its tie
        extra = rq["memory"]["weights_total_bytes"] - rn["memory"]["weights_total_bytes"]
        assert extra == rq["lm_head"]["bytes"] == V * H + 4 * V * (H // 64)
        # The gather still reads the bf16 rows: the state after a prompt (KV, conv, recurrent) is the native
        # engine's, bit for bit; only the logits (the head's output) differ.
        sn, sq = n.session(max_context=32), q.session(max_context=32)
        sn.prefill(PROMPT)
        sq.prefill(PROMPT)
        an, aq = sn.snapshot()._core.to_arrays(), sq.snapshot()._core.to_arrays()
        assert an.keys() == aq.keys() and any(k.startswith("recurrent.") for k in an)
        for name in an:
            same = np.array_equal(np.asarray(an[name]).view(np.uint8), np.asarray(aq[name]).view(np.uint8))
            assert same == (name != "logits"), name


def test_a_quantized_head_is_left_alone():
    with lily.Engine.from_pretrained(backend="cpu", lm_head="8bit") as e:  # lily-tiny: MLX 4-bit
        r = e.report()["lm_head"]
        assert r["status"] == "already quantized in the checkpoint (q4g64-bf16)" and r["format"] == "q4g64-bf16"
        assert e._lm_head.descriptor is e.checkpoint.tensors["lm_head"] and r["quantize_seconds"] == 0


def test_bad_values_raise_naming_the_argument(tmp_path, hf_bf16):
    missing = tmp_path / "nothing"  # the option is checked before the folder is looked at
    for bad in ("4bit", "8-bit", "", None, 8, True):
        with pytest.raises(ValueError, match="lm_head must be one of"):
            lily.Engine.from_pretrained(missing, lm_head=bad)
    from lily.checkpoint import load_checkpoint

    with load_checkpoint(hf_bf16) as ck:
        with pytest.raises(ValueError, match=r"lm_head must be one of \('auto', '8bit', 'native'\), got 'fp8'"):
            lily.Engine(ck, backend="cpu", lm_head="fp8")
    with pytest.raises(ValueError, match=r"lm_head='8bit': the head \[512, 100\].*not a multiple of the group"):
        lm_head.prepare_lm_head({"lm_head": {"kind": "dense", "dtype": "bf16", "shape": (512, 100),
                                             "data": np.zeros((512, 100), np.uint16)}}, "8bit", "cpu")


# ---- "auto", per backend ----

def _dense(rows: int, cols: int, dtype: str) -> dict:
    np_dtype = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32}[dtype]
    return {"kind": "dense", "dtype": dtype, "shape": (rows, cols), "data": np.zeros((rows, cols), np_dtype)}


@pytest.mark.parametrize("backend", sorted(lm_head.AUTO))
def test_auto_threshold_and_f32_rule(backend):
    d = lm_head.AUTO[backend]
    assert d.quantize and d.min_bytes == 64 << 20 and d.reason
    at = lm_head.prepare_lm_head({"lm_head": _dense(32768, 1024, "bf16")}, "auto", backend)  # 64 MiB
    assert at.quantized_at_load and at.format == "q8g64-bf16" and "reads about half the bytes" in at.reason
    f16 = lm_head.prepare_lm_head({"lm_head": _dense(32768, 1024, "f16")}, "auto", backend)
    assert f16.format == "q8g64-f16"
    below = lm_head.prepare_lm_head({"lm_head": _dense(32767, 1024, "bf16")}, "auto", backend)
    assert not below.quantized_at_load and "under the 64 MiB" in below.reason
    f32 = lm_head.prepare_lm_head({"lm_head": _dense(16384, 1024, "f32")}, "auto", backend)  # 64 MiB of f32
    assert not f32.quantized_at_load and "f32 head exact" in f32.reason
    assert lm_head.prepare_lm_head({"lm_head": _dense(16384, 1024, "f32")}, "8bit", backend).format == "q8g64-f32"
    unknown = lm_head.prepare_lm_head({"lm_head": _dense(32768, 1024, "bf16")}, "auto", "tpu")
    assert not unknown.quantized_at_load and "no measured default" in unknown.reason


# ---- one head for verifier and drafter (issue 14 item 4) ----

def _run(engine, n, *, mtp="off", k=3, drafts=None):
    s = engine.session(max_context=96)
    s.prefill(PROMPT)
    if drafts is not None:
        s._core._draft_override(len(PROMPT), list(drafts))
    return s, list(s.generate(n, lily.SamplingParams(temperature=0), stop_token_ids=[], mtp=mtp, mtp_k=k))


def test_mtp_drafter_and_verifier_read_one_8bit_head(engines):
    native, q8 = engines
    rn, rq = native.report(), q8.report()
    # One head in the weights: the MTP block's bytes do not depend on the head's format (it has none of its own),
    # and the totals differ by exactly one bf16 head minus one 8-bit head.
    assert rq["mtp"]["present"] and rq["mtp"]["bytes"] == rn["mtp"]["bytes"] > 0
    diff = rn["memory"]["weights_total_bytes"] - rq["memory"]["weights_total_bytes"]
    assert diff == rn["lm_head"]["bytes"] - rq["lm_head"]["bytes"] > 0
    _, base = _run(q8, 24)
    corrupted = [(t + 1) % V if i % 3 == 2 else t for i, t in enumerate(base)]
    for k in (1, 2, 3, 4):
        for drafts in (None, base, corrupted):
            s, out = _run(q8, 24, mtp="on", k=k, drafts=drafts)
            assert out == base, (k, drafts is None)
        st = s.mtp_stats()
        assert 0 < st["accepted"] < st["drafted"]
        s, _ = _run(q8, 24, mtp="on", k=k, drafts=base)  # the 8-bit head's own continuation: all accepted
        assert s.mtp_stats()["accepted"] == s.mtp_stats()["drafted"] > 0


# ---- item 5's figure: lily-tiny's bf16 export ----

POSITIONS = 2048


def test_lily_tiny_bf16_export_perplexity_8bit_head_within_0_1_percent(lily_tiny_bf16):
    with lily.Engine.from_pretrained(backend="cpu") as mlx:
        ids = np.asarray(mlx.tokenize(HELDOUT.read_text()), dtype=np.int64)[: POSITIONS + 1]
        p_mlx = perplexity(lily_logits(mlx, ids), ids[1:])
    with lily.Engine.from_pretrained(lily_tiny_bf16, backend="cpu", lm_head="native") as e:
        assert e.checkpoint.format == "hf" and e.report()["lm_head"]["format"] == "bf16"
        native = lily_logits(e, ids)
    with lily.Engine.from_pretrained(lily_tiny_bf16, backend="cpu", lm_head="8bit") as e:
        assert e.report()["lm_head"]["format"] == "q8g64-bf16"
        q8 = lily_logits(e, ids)
    p_bf16, p_8 = perplexity(native, ids[1:]), perplexity(q8, ids[1:])
    print(f"lily-tiny, {POSITIONS} held-out positions: perplexity MLX 4-bit {p_mlx:.5f}, bf16 export with the bf16 "
          f"head {p_bf16:.5f}, with the 8-bit head {p_8:.5f} ({p_8 / p_bf16 - 1:+.2e})")
    assert abs(p_8 / p_bf16 - 1) < 1e-3
    assert abs(p_bf16 / p_mlx - 1) < 1e-3  # the export is the model it came from, to bf16 rounding
    assert not np.array_equal(native, q8)  # the 8-bit head really ran


def test_export_roundtrip_with_an_mtp_block(tmp_path):
    """export_hf of an MLX checkpoint with an MTP block: every canonical tensor of the export is the source's,
    dequantized and rounded to bf16 (matrices) or exactly (vectors, norms to f32 rounding of w = (1 + w) - 1)."""
    src = write_synthetic_checkpoint(tmp_path / "mlx", TINY_CONFIG, fmt="mlx", seed=34, mtp_layers=1)
    out = export_hf(src, tmp_path / "bf16")
    from lily.checkpoint import load_checkpoint
    from lily.evaluate import _dense as dense

    with load_checkpoint(src) as a, load_checkpoint(out) as b:
        assert b.format == "hf" and b.mtp_layers == a.mtp_layers == 1 and b.quantization is None
        assert a.tensors.keys() == b.tensors.keys()
        for name, ta in a.tensors.items():
            tb = b.tensors[name]
            if isinstance(ta, dict):
                assert tb["kind"] == "dense" and tb["dtype"] == "bf16", name
                want = f32_to_bf16(dense(ta))
                assert np.array_equal(np.asarray(tb["data"]), want), name
            else:
                np.testing.assert_allclose(tb, ta, rtol=0, atol=1e-6, err_msg=name)
    with pytest.raises(lily.LilyError, match="not empty"):
        export_hf(src, tmp_path / "bf16")


def test_acceptance_with_the_8bit_head_is_the_bf16_heads(lily_tiny_bf16):
    """Item 4's check (the DGX Spark study's trap: a drafter reading the low-bit head's bytes in another format
    accepts nothing): lily-tiny's bf16 export with its trained MTP head drafts as well with the 8-bit head as with
    the bf16 one, and both far above the 1.0 of a head that accepts nothing (lily-tiny's greedy acceptance is
    about 3.3 tokens per verify at k = 3, docs/lily-tiny/README.md)."""
    text = HELDOUT.read_text()
    lengths = {}
    for mode in ("native", "8bit"):
        with lily.Engine.from_pretrained(lily_tiny_bf16, backend="cpu", lm_head=mode, mtp="on") as e:
            assert e.report()["mtp"]["present"]
            ids = e.tokenize(text)
            runs = []
            for start in range(0, 6 * 200, 200):
                s = e.session(max_context=256)
                s.prefill(ids[start:start + 96])
                out = list(s.generate(64, lily.SamplingParams(temperature=0.0), stop_token_ids=[], mtp="on",
                                      mtp_k=3))
                r = e.session(max_context=256)
                r.prefill(ids[start:start + 96])
                assert out == list(r.generate(64, lily.SamplingParams(temperature=0.0), stop_token_ids=[],
                                              mtp="off"))
                runs.append(s.mtp_stats()["mean_acceptance_length"])
            lengths[mode] = float(np.mean(runs))
    print(f"lily-tiny bf16 export, k = 3: mean acceptance length {lengths['native']:.3f} with the bf16 head, "
          f"{lengths['8bit']:.3f} with the 8-bit head")
    assert lengths["native"] > 2.0 and lengths["8bit"] > 2.0
    assert abs(lengths["8bit"] - lengths["native"]) < 0.2
