"""benchmarks/bench_vs_mlx.py, the Lily vs mlx-lm sweep for a Mac (issue 12 item 6), run here on the CPU
backend against mlx's CPU build on an MLX 4-bit checkpoint written by mlx-lm's own converter: the procedure
(alternated rounds, the same prompt for both engines, medians, the table and JSON), not any speed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import tiny

pytest.importorskip("lily")
if not tiny.mlx_available():
    pytest.skip("mlx / mlx_lm not importable", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_mlx.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_mlx", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mlx_dir(tiny_factory, tmp_path_factory):
    src = tiny_factory("mlx", "fused_mm", "bfloat16", tokenizer=True)
    out = tmp_path_factory.mktemp("mlx4-bench") / "model"
    tiny.make_mlx_checkpoint(src.path, out)
    return out


def test_engines_alternate_each_round(bench):
    order = []

    class Fake:
        def __init__(self, name):
            self.name = name

    runners = [Fake("lily"), Fake("mlx-lm")]
    runs = bench.alternate(runners, lambda r: order.append(r.name) or len(order), 4)
    assert order == ["lily", "mlx-lm", "mlx-lm", "lily", "lily", "mlx-lm", "mlx-lm", "lily"]
    assert runs == {"lily": [1, 4, 5, 8], "mlx-lm": [2, 3, 6, 7]}


def test_sweep_runs_both_engines_on_one_checkpoint(bench, mlx_dir, tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = bench.main(["--model", str(mlx_dir), "--backend", "cpu", "--prefill", "16,40", "--decode", "24",
                     "--repeats", "2", "--decode-tokens", "4", "--prefill-chunk", "16", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["tokens"] for r in res["prefill"]] == [16, 40]
    assert [r["context"] for r in res["decode"]] == [24]
    for row in res["prefill"] + res["decode"]:
        assert len(row["runs"]["lily"]) == 2 and len(row["runs"]["mlx-lm"]) == 2
        assert row["lily"] > 0 and row["mlx"] > 0
        assert row["ratio"] == pytest.approx(row["lily"] / row["mlx"])
    assert res["lily"]["backend"] == "cpu"
    printed = capsys.readouterr().out
    assert "| 40 |" in printed and "Lily / mlx-lm" in printed and "published 1.35" in printed


def test_bad_arguments_are_refused(bench, mlx_dir):
    with pytest.raises(SystemExit):
        bench.main(["--model", str(mlx_dir), "--decode-tokens", "1"])
    with pytest.raises(ValueError, match="--prefill"):
        bench.main(["--model", str(mlx_dir), "--backend", "cpu", "--prefill", "abc"])
