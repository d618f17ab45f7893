"""Engine/Session API behaviour that users rely on: report, streaming, threading, CLI (on lily-tiny)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import lily
import lily.engine
from lily.errors import LilyError


@pytest.fixture(scope="module")
def eng():
    return lily.Engine.from_pretrained(prefill_chunk=16)


PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def test_report_lists_backend_memory_kernels_and_optimizations(eng):
    r = eng.report()
    assert r["backend"] == "cpu" and r["threads"] >= 1
    assert r["prefill_chunk"] == 16
    mem = r["memory"]["weights_mapped_bytes"]
    assert set(mem) >= {"embed_tokens", "lm_head", "attention", "deltanet", "experts", "shared_expert", "router"}
    assert r["memory"]["weights_total_bytes"] == sum(mem.values())
    assert r["memory"]["kv_cache_bytes_per_token"] > 0
    assert r["kernels"]["experts.gate_proj"]["format"] == "q4g64"
    assert r["kernels"]["router"]["format"] == "q8g64"
    assert "q4" in r["kernels"]["experts.gate_proj"]["decode"]
    step = r["ops_per_step"]["decode_step"]
    assert 0 < step["stages"] <= step["ops"]
    layers = eng.config.num_hidden_layers
    assert step["op_counts"]["moe"] == layers
    # Per layer: the input norm with the mixer's input projections as one op, and the residual add and the
    # post-attention norm with the router and the shared gate as another; the final norm with the LM head as one
    # more, so no norm of the decoder runs on its own. An MTP head (lily-tiny's, once packaged) adds its KV rows to
    # every step: the q/k/v projections with their input norm as one op, a norm of its own (h after the final
    # norm) and its input row (the embedding and h, each normalised: mtp_input).
    mtp = eng.checkpoint.mtp_layers
    assert step["op_counts"]["norm_matmuls"] == 2 * layers + 1 + mtp
    assert "matmuls" not in step["op_counts"] and "add_rms_norm" not in step["op_counts"]
    assert step["op_counts"].get("rms_norm", 0) == mtp
    assert step["op_counts"].get("mtp_input", 0) == mtp
    assert any(o.startswith("active:") for o in r["optimizations"])
    assert any(o.startswith("inactive:") for o in r["optimizations"])
    assert "backend: cpu" in str(r)
    assert set(r["backends"]) == {"cpu", "metal", "cuda"}
    assert r["backends"]["cpu"] == "built and usable"
    # CUDA: built on Linux, usable where a GPU and NVRTC are present; otherwise the status says why not.
    cuda = lily.engine.backends()["cuda"]
    assert cuda["usable"] or cuda["status"].startswith(("not built", "built, but not usable here: "))
    assert r["backends"]["cuda"] == cuda["status"]
    assert r["experts_layout"].startswith("stacked") or r["experts_layout"].startswith("repacked")


def test_backend_choice_auto_and_unbuilt_backends_raise_clearly(ckpt_small):
    from lily.engine import backends

    known = backends()
    assert list(known) == ["cuda", "metal", "cpu"]  # the order "auto" prefers
    assert known["cpu"]["usable"]
    auto = lily.Engine.from_pretrained(str(ckpt_small.path), backend="auto")
    assert auto.backend == next(n for n, b in known.items() if b["usable"])  # the first usable one
    for name in ("cuda", "metal"):
        if known[name]["usable"]:
            continue
        # The error is the backend's status: why it is not built, or why it is built but not usable here.
        with pytest.raises(LilyError, match=f"backend '{name}' is (not built|built, but not usable here)"):
            lily.Engine.from_pretrained(str(ckpt_small.path), backend=name)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        lily.Engine.from_pretrained(str(ckpt_small.path), backend="tpu")


def test_prefill_chunk_default_and_bad_values(ckpt_small):
    """prefill_chunk=None (the default) takes the backend's: 512 on the CPU; anything but a positive int or None is
    refused naming the field."""
    cpu = lily.Engine.from_pretrained(str(ckpt_small.path), backend="cpu")
    assert cpu.prefill_chunk == 512 == lily.engine.default_prefill_chunk("cpu")
    assert cpu.session(max_context=32).prefill_chunk == 512
    for bad in (0, -1, 1.5, True, "512"):
        with pytest.raises(ValueError, match="prefill_chunk"):
            lily.Engine.from_pretrained(str(ckpt_small.path), backend="cpu", prefill_chunk=bad)


def test_profile_times_every_op_of_a_step(eng):
    s = eng.session(max_context=64)
    s.prefill(eng.tokenize(PROMPT))
    eng.set_profiling(True)
    s.step(1)
    prof = eng.profile()
    eng.set_profiling(False)
    assert set(prof) == set(s.stats()["decode_step"]["op_counts"])
    assert all(v > 0 for v in prof.values())


def test_progress_callback_per_chunk_and_cancel(eng):
    ids = eng.tokenize(PROMPT * 6)
    assert len(ids) > 40
    calls = []
    s = eng.session(max_context=256)
    s.prefill(ids, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(min(16 * (i + 1), len(ids)), len(ids)) for i in range((len(ids) + 15) // 16)]
    s2 = eng.session(max_context=256)
    s2.prefill(ids, progress=lambda done, total: done < 32)  # stop after the second chunk
    assert s2.position == 32 and s2.tokens == ids[:32]
    ref = eng.session(max_context=256)
    np.testing.assert_array_equal(s2.logits, ref.prefill(ids[:32]))


def test_progress_exception_propagates_and_session_stays_usable(eng):
    ids = eng.tokenize(PROMPT * 6)
    s = eng.session(max_context=256)

    def boom(done, total):
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        s.prefill(ids, progress=boom)
    assert s.position == 16  # the first chunk was computed before the callback raised
    s.prefill(ids[16:])
    np.testing.assert_array_equal(s.logits, eng.session(max_context=256).prefill(ids))


def test_generate_text_streams_pieces_equal_to_detokenized_ids(eng):
    s = eng.session(max_context=256)
    s.prefill(eng.tokenize(PROMPT))
    snap = s.snapshot()
    pieces = list(s.generate_text(30, skip_special_tokens=False))
    s.restore(snap)
    ids = list(s.generate(30))
    assert "".join(pieces) == eng.detokenize(ids)
    assert len(pieces) > 1


def test_closing_the_iterator_keeps_exactly_the_seen_tokens(eng):
    s = eng.session(max_context=256)
    s.prefill(eng.tokenize(PROMPT))
    start = s.position
    seen = []
    gen = s.generate(50, stop_token_ids=[])
    for tok in gen:
        seen.append(tok)
        if len(seen) == 5:
            break
    gen.close()
    assert s.position == start + 5 and s.tokens[-5:] == seen


def test_session_used_from_two_threads_raises_busy(eng):
    s = eng.session(max_context=256)
    s.prefill(eng.tokenize(PROMPT))
    with pytest.raises(lily.SessionBusyError):
        for _ in s.generate(5, stop_token_ids=[]):
            s.step(1)  # the generation loop holds the session in its own thread
    assert s.finish_reason is None or s.finish_reason == "cancelled"
    s.step(1)  # usable again afterwards


def test_engine_generate_and_chat(eng):
    text = eng.generate(PROMPT, max_tokens=16)
    assert isinstance(text, str) and text
    assert "".join(eng.generate(PROMPT, max_tokens=16, stream=True)) == text
    reply = eng.chat([{"role": "user", "content": "What does `len` do?"}], max_tokens=24)
    assert isinstance(reply, str)
    with pytest.raises(ValueError, match="role"):
        eng.chat([{"content": "no role"}])


def test_bad_arguments_name_the_field(eng):
    with pytest.raises(ValueError, match="max_context"):
        eng.session(max_context=0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        eng.session(prefill_chunk=0)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.session().generate(-1)
    empty = eng.session()
    with pytest.raises(lily.LilyError, match="prefill"):
        empty.generate(4)
    with pytest.raises(lily.LilyError, match="empty"):
        empty.logits
    empty.prefill([1, 2, 3])  # still usable
    assert empty.position == 3
    with pytest.raises(ValueError, match="threads"):
        lily.Engine.from_pretrained(threads=0)
    with pytest.raises(lily.CheckpointError, match="no-such-folder"):
        lily.Engine.from_pretrained(os.path.join("no-such-folder", "x"))


def test_token_ids_fast_path_agrees_with_numpy(eng):
    """Lists and tuples of ints take one C++ pass (lily._core.token_ids); whatever it declines goes through numpy,
    so every input gives the array, or the error naming the bad id, that numpy's path gives."""
    vocab = eng.config.vocab_size
    rng = np.random.default_rng(7)
    ids = [int(x) for x in rng.integers(0, vocab, 1000)]
    for seq in (ids, tuple(ids), [0], [vocab - 1]):
        fast = eng._validate_ids(seq)
        assert fast.dtype == np.int32 and fast.flags.c_contiguous
        np.testing.assert_array_equal(fast, np.asarray(seq, dtype=np.int64))
    assert lily._core.token_ids(ids, vocab) is not None  # the fast path really ran for a plain list
    # Items it declines (not exact ints, out of range, past a C long) still convert or fail as numpy says.
    np.testing.assert_array_equal(eng._validate_ids([np.int64(5), 6]), [5, 6])
    np.testing.assert_array_equal(eng._validate_ids([True, 3]), [1, 3])
    for bad, message in (([1, vocab], f"token id {vocab} at position 1 is outside"),
                         ([4, 5, -1], "token id -1 at position 2 is outside"),
                         ([1, 2**70], "outside|integers|int"), ([1.0, 2.0], "must be integers"),
                         ([], "non-empty"), ((), "non-empty")):
        assert lily._core.token_ids(bad, vocab) is None
        with pytest.raises((ValueError, OverflowError), match=message):
            eng._validate_ids(bad)
    s = eng.session()
    with pytest.raises(ValueError, match=f"token id {vocab} at position 2"):
        s.prefill([1, 2, vocab])
    s.prefill(ids[:40])  # still usable, and fed what the fast path read
    assert s.tokens == ids[:40]


@pytest.mark.parametrize("options, message", [
    ({"thread": 2}, "unknown backend option 'thread' for the cpu backend .*threads"),  # a misspelt name
    ({"graphs": False}, "unknown backend option 'graphs' for the cpu backend"),  # another backend's option
    ({"threads": "two"}, "wrong type"),
])
def test_backend_options_are_checked_by_name_and_type(options, message):
    """A backend option the backend does not read is refused by name (a misspelt option must not leave the default
    in place silently), as a ValueError about backend_options, not a fault of the checkpoint."""
    with pytest.raises(ValueError, match="backend_options: .*" + message) as got:
        lily.Engine.from_pretrained(backend="cpu", backend_options=options)
    assert not isinstance(got.value, lily.CheckpointError)
    with lily.Engine.from_pretrained(backend="cpu", backend_options={"threads": 1}) as e:  # a known one is taken
        assert e.report()["threads"] == 1


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "lily", *args], input=stdin, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def test_cli_info_chat_and_errors(tmp_path):
    info = _cli("info")
    assert info.returncode == 0, info.stderr
    assert "backend: cpu" in info.stdout and "optimizations" in info.stdout
    chat = _cli("chat", "--max-tokens", "8", stdin="What is a dict?\nAnd a list?\n\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("> ") >= 2
    bad = _cli("generate", "x", "--model", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "error:" in bad.stderr
    bad_temp = _cli("generate", "x", "--temperature", "-1")
    assert bad_temp.returncode == 2 and "temperature" in bad_temp.stderr


def test_cli_convert_writes_a_loadable_mlx_checkpoint(tmp_path):
    from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

    src, dst = tmp_path / "hf", tmp_path / "mlx"
    write_synthetic_checkpoint(src, TINY_CONFIG, fmt="hf", dtype="bf16", seed=3)
    out = _cli("convert", str(src), str(dst))
    assert out.returncode == 0, out.stderr
    from lily.convert import convert

    convert(src, tmp_path / "direct", progress=False)
    assert (dst / "model.safetensors").read_bytes() == (tmp_path / "direct" / "model.safetensors").read_bytes()
    q4 = lily.Engine.from_pretrained(str(dst))
    assert q4.checkpoint.format == "mlx" and q4.checkpoint.quantization["router"] == "q8g64"
    assert np.isfinite(q4.session(max_context=32).prefill(np.arange(1, 20))).all()
    bad = _cli("convert", str(tmp_path / "nothing-here"), str(tmp_path / "out"))
    assert bad.returncode == 2 and "nothing-here" in bad.stderr


def test_session_load_in_place(eng, tmp_path):
    a = eng.session(max_context=128)
    a.prefill(eng.tokenize(PROMPT))
    a.save(tmp_path / "a.lily")
    expect = a.step(5)
    b = eng.session(max_context=128)
    b.prefill([1, 2, 3])
    b.load(tmp_path / "a.lily")
    assert b.tokens == a.tokens[:-1]
    np.testing.assert_array_equal(b.step(5), expect)
    small = eng.session(max_context=4)
    small.prefill([7])
    with pytest.raises(lily.ContextOverflowError):
        small.load(tmp_path / "a.lily")
    assert small.tokens == [7]  # unchanged
    (tmp_path / "junk.lily").write_bytes(b"not a session")
    with pytest.raises(lily.CheckpointError, match="junk.lily"):
        small.load(tmp_path / "junk.lily")
