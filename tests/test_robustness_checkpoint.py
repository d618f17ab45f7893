"""Hostile checkpoint files reach a CheckpointError naming the file and the field or tensor, never a raw
Python exception (RecursionError, TypeError, OverflowError, numpy's "array is too big"), and counts read
from config.json are bounded before anything is built from them (a `num_hidden_layers: 10**10` used to
build a list of 10**10 layer types). tests/test_robustness_fuzz.py mutates the same files at random.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest

from lily.checkpoint import SafetensorsFile, load_checkpoint
from lily.config import INT_LIMITS, ModelConfig
from tiny import checkpoint_error, rewrite_header
from lily.synthetic import TINY_CONFIG, text_config, write_synthetic_checkpoint

# ---- helpers ---------------------------------------------------------------------------------------


def write_raw_safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return path


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.fixture
def hf(tmp_path) -> Path:
    return write_synthetic_checkpoint(tmp_path / "hf", TINY_CONFIG, fmt="hf", seed=1)


@pytest.fixture
def sharded(tmp_path) -> Path:
    return write_synthetic_checkpoint(tmp_path / "sh", TINY_CONFIG, fmt="hf", seed=1, max_shard_bytes=200_000)


def first_tensor(path: Path) -> str:
    f = SafetensorsFile(path)
    name = sorted(f.tensors)[0]
    f.close()
    return name


# ---- 1. checkpoint parsing: every failure is a CheckpointError naming file and field ---------------


def test_deeply_nested_safetensors_header(tmp_path):
    p = write_raw_safetensors(tmp_path / "model.safetensors", ('{"x": ' + deep_json(100_000) + "}").encode())
    checkpoint_error(lambda: SafetensorsFile(p), "model.safetensors", "nested too deeply")


def test_not_a_regular_file(tmp_path):
    """A directory opened fine and then raised IsADirectoryError from pread; a FIFO blocked in open."""
    import os

    (tmp_path / "dir.safetensors").mkdir()
    checkpoint_error(lambda: SafetensorsFile(tmp_path / "dir.safetensors"), "dir.safetensors", "not a regular file")
    os.mkfifo(tmp_path / "fifo.safetensors")
    checkpoint_error(lambda: SafetensorsFile(tmp_path / "fifo.safetensors"), "fifo.safetensors", "not a regular file")


def test_deeply_nested_config_and_index(hf):
    cfg = hf / "config.json"
    good = cfg.read_text()
    cfg.write_text('{"text_config": ' + deep_json(100_000) + "}")
    checkpoint_error(lambda: load_checkpoint(hf), "config.json", "nested too deeply")
    cfg.write_text(good)
    (hf / "model.safetensors.index.json").write_text('{"weight_map": ' + deep_json(100_000) + "}")
    checkpoint_error(lambda: load_checkpoint(hf), "model.safetensors.index.json", "nested too deeply")


def test_convert_reads_config_through_the_checked_path(hf, tmp_path):
    from lily.convert import convert

    (hf / "generation_config.json").write_text(deep_json(100_000))  # ignored, as before, but no RecursionError
    (hf / "config.json").write_text('{"text_config": ' + deep_json(100_000) + "}")
    checkpoint_error(lambda: convert(hf, tmp_path / "out"), "config.json", "nested too deeply")


def test_int_literal_too_long_for_python(hf):
    # json.loads raises ValueError (not JSONDecodeError) for ints of more than 4300 digits.
    (hf / "config.json").write_text('{"model_type": "qwen3_5_moe", "hidden_size": ' + "9" * 5000 + "}")
    checkpoint_error(lambda: load_checkpoint(hf), "config.json", "not valid JSON")


@pytest.mark.parametrize("value", [["BF16"], 7, None, {"a": 1}])
def test_non_string_dtype_in_header(hf, value):
    p = hf / "model.safetensors"
    name = first_tensor(p)
    rewrite_header(p, lambda h: h[name].update(dtype=value))
    checkpoint_error(lambda: load_checkpoint(hf), "model.safetensors", name, "'dtype'")


@pytest.mark.parametrize("shape", [[10**30, 0], [0, 2**62], [0] * 40, [1.5], [True, 2], "12", [-1]])
def test_absurd_shapes_in_header(hf, shape):
    """A huge dim overflowed np.prod (OverflowError) or numpy's size arithmetic ("array is too big")."""
    p = hf / "model.safetensors"
    name = first_tensor(p)

    def f(h):
        h[name]["shape"] = shape
        h[name]["data_offsets"] = [0, 0]
    rewrite_header(p, f)
    checkpoint_error(lambda: load_checkpoint(hf), "model.safetensors", name, "'shape'")


def test_metadata_must_map_strings_to_strings(hf):
    p = hf / "model.safetensors"
    rewrite_header(p, lambda h: h.update(__metadata__={"format": 3}))
    checkpoint_error(lambda: load_checkpoint(hf), "model.safetensors", "__metadata__.format")
    rewrite_header(p, lambda h: h.update(__metadata__=[1]))
    checkpoint_error(lambda: load_checkpoint(hf), "model.safetensors", "__metadata__")


@pytest.mark.parametrize("offsets", [[0, 2**70], [-5, 0], [0], "0,4", [0.0, 4.0]])
def test_bad_data_offsets(hf, offsets):
    p = hf / "model.safetensors"
    name = first_tensor(p)
    rewrite_header(p, lambda h: h[name].update(data_offsets=offsets))
    checkpoint_error(lambda: load_checkpoint(hf), "model.safetensors", name, "data_offsets")


@pytest.mark.parametrize("target", [7, None, ["a"], "a\x00b", "\ud800.safetensors", "..", ""])
def test_index_weight_map_values(sharded, target):
    idx = sharded / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = target
    idx.write_text(json.dumps(index))
    checkpoint_error(lambda: load_checkpoint(sharded), "model.safetensors.index.json")


@pytest.mark.parametrize("data", [[], "x", {"weight_map": []}, {"weight_map": "a"}])
def test_index_structure(sharded, data):
    (sharded / "model.safetensors.index.json").write_text(json.dumps(data))
    checkpoint_error(lambda: load_checkpoint(sharded), "model.safetensors.index.json")


def tiny_text_config(**changes) -> dict:
    tc = text_config(TINY_CONFIG)
    tc.update(changes)
    return {"model_type": "qwen3_5_moe", "text_config": tc}


@pytest.mark.parametrize("value", [10**400, float("inf"), float("nan"), "1e7", True])
def test_rope_theta_values(value):
    """A huge int made math.isfinite raise OverflowError."""
    cfg = tiny_text_config()
    cfg["text_config"]["rope_parameters"]["rope_theta"] = value
    checkpoint_error(lambda: ModelConfig.from_dict(cfg), "rope_theta")


@pytest.mark.parametrize("value", ["false", 0, [1]])
def test_attention_bias_must_be_bool(value):
    checkpoint_error(lambda: ModelConfig.from_dict(tiny_text_config(attention_bias=value)), "attention_bias")


# ---- 2. counts are bounded before anything is built from them ------------------------------------


@pytest.mark.parametrize("field", sorted(k for k in INT_LIMITS if k != "max_position_embeddings"))
def test_each_count_has_an_upper_bound(field):
    cfg = tiny_text_config(**{field: INT_LIMITS[field] + 1})
    if field == "full_attention_interval":
        cfg["text_config"].pop("layer_types", None)
    checkpoint_error(lambda: ModelConfig.from_dict(cfg), f"text_config.{field}", str(INT_LIMITS[field]))


def test_bounds_admit_the_real_model():
    """MODEL.md 1.2: the Qwen3.6-35B-A3B text config parses with every bound in place."""
    real = dict(TINY_CONFIG, vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_expert_intermediate_size=512)
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text_config(real)})
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.vocab_size, cfg.head_dim) == (40, 256, 248320, 256)


@pytest.mark.parametrize("changes", [
    {"num_hidden_layers": 10**10, "layer_types": None},
    {"num_experts": 10**12},
    {"head_dim": 10**30},
    {"vocab_size": 2**64},
])
def test_huge_counts_fail_fast(changes):
    """Before the bounds, `num_hidden_layers: 10**10` built a list of 10**10 layer types (minutes, GBs)."""
    cfg = tiny_text_config(**changes)
    cfg["text_config"] = {k: v for k, v in cfg["text_config"].items() if v is not None}
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        checkpoint_error(lambda: ModelConfig.from_dict(cfg), "more than Lily's bound")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 1.0 and peak < 10 << 20


def test_derived_state_size_is_bounded():
    # Each count within its bound, but the recurrent state per layer (Hv x Dk x Dv floats) is 2**40.
    cfg = tiny_text_config(linear_num_key_heads=256, linear_num_value_heads=256, linear_key_head_dim=65536,
                           linear_value_head_dim=65536)
    checkpoint_error(lambda: ModelConfig.from_dict(cfg), "recurrent state")


def test_layer_types_longer_than_the_bound():
    cfg = tiny_text_config(num_hidden_layers=4097)
    cfg["text_config"]["layer_types"] = ["linear_attention"] * 4097
    checkpoint_error(lambda: ModelConfig.from_dict(cfg), "num_hidden_layers", "4096")
