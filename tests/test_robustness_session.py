"""Session files (lily-session/2): anything but an intact session file of this format is a CheckpointError
naming the file and the field or tensor (a model shard, metadata that is not a decimal int, an old format,
float token ids), flipped bytes are caught by the checksum, and a failed load leaves the session as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import lily

from tiny import checkpoint_error, rewrite_header

TINY_MODEL = Path(lily.__file__).parent / "models" / "lily-tiny"


# ---- 5. session files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return lily.Engine.from_pretrained()


@pytest.fixture
def saved(engine, tmp_path):
    s = engine.session(max_context=64)
    s.prefill(engine.tokenize("def f(x):"))
    path = tmp_path / "a.lily"
    s.save(path)
    return s, path


def reseal(path: Path, fn) -> None:
    """Edit the header and recompute the checksum, as a careful forger (or a buggy writer) would."""
    from lily.session import _session_checksum

    def edit(h):
        fn(h)
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        data = raw[8 + n:]
        meta = h.setdefault("__metadata__", {})
        entries = []
        for name, e in h.items():
            if name == "__metadata__":
                continue
            a, b = e["data_offsets"]
            entries.append((name, e["dtype"], e["shape"], np.frombuffer(data[a:b], dtype=np.uint8)))
        meta["checksum"] = _session_checksum(meta, entries)
    rewrite_header(path, edit)


def test_model_shard_as_session_file(engine, saved, tmp_path):
    """A BF16 shard made safetensors' numpy reader raise TypeError before the format was even checked."""
    s, _ = saved
    shard = tmp_path / "model.safetensors"
    shutil.copy(TINY_MODEL / "model.safetensors", shard)
    before = (s.tokens, s.position, s.logits.copy())
    checkpoint_error(lambda: engine.load_session(shard), "model.safetensors", "not a Lily session file")
    checkpoint_error(lambda: s.load(shard), "model.safetensors", "not a Lily session file")
    assert (s.tokens, s.position) == before[:2] and np.array_equal(s.logits, before[2])
    s.step(1)  # still usable
    checkpoint_error(lambda: engine.load_session(tmp_path), "not a regular file")


def test_empty_session_round_trip(engine, tmp_path):
    s = engine.session(max_context=16)
    s.save(tmp_path / "empty.lily")
    loaded = engine.load_session(tmp_path / "empty.lily")
    assert (loaded.position, loaded.max_context, loaded.tokens) == (0, 16, [])


@pytest.mark.parametrize("field,value", [("max_context", "abc"), ("max_context", str(2**70)),
                                         ("max_context", "-1"), ("max_context", "0"), ("max_context", " 64"),
                                         ("max_context", "6_4"), ("position", "1.5"), ("position", "99"),
                                         ("position", "2")])
def test_session_metadata_fields(engine, saved, field, value):
    s, path = saved
    reseal(path, lambda h: h["__metadata__"].update({field: value}))
    before = s.tokens
    checkpoint_error(lambda: engine.load_session(path), path.name, f"'{field}'")
    checkpoint_error(lambda: s.load(path), path.name, f"'{field}'")
    assert s.tokens == before


def test_flipped_data_byte_is_detected(engine, saved):
    s, path = saved
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # inside the last tensor's data: the header still parses
    path.write_bytes(bytes(raw))
    checkpoint_error(lambda: engine.load_session(path), path.name, "corrupt: checksum mismatch")


def test_old_and_foreign_formats(engine, saved):
    _, path = saved
    reseal(path, lambda h: h["__metadata__"].update(format="lily-session/1"))
    checkpoint_error(lambda: engine.load_session(path), "lily-session/1", "lily-session/2")
    reseal(path, lambda h: h["__metadata__"].pop("format"))
    checkpoint_error(lambda: engine.load_session(path), "not a Lily session file")


def test_float_token_ids_are_rejected(engine, saved):
    """from_arrays would truncate float32 token ids to ints silently."""
    s, path = saved
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + n])
    a, b = header["tokens"]["data_offsets"]
    ids = np.frombuffer(raw[8 + n + a: 8 + n + b], dtype=np.int32)
    floats = (ids.astype(np.float32) + np.float32(0.25)).tobytes()
    path.write_bytes(raw[: 8 + n + a] + floats + raw[8 + n + b:])  # same byte count
    reseal(path, lambda h: h["tokens"].update(dtype="F32"))
    checkpoint_error(lambda: engine.load_session(path), "'tokens'", "I32")


def test_missing_checksum_and_save_round_trip(engine, saved):
    s, path = saved
    s2 = engine.load_session(path)
    assert s2.tokens == s.tokens and np.array_equal(s2.logits, s.logits)
    rewrite_header(path, lambda h: h["__metadata__"].pop("checksum"))
    checkpoint_error(lambda: engine.load_session(path), "checksum mismatch")
