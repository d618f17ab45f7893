"""python -m lily bench: lengths, the CLI on a tiny synthetic checkpoint, JSON and plot output."""

import json
import os
import subprocess
import sys

import pytest

from lily import bench


def test_lengths_parse_and_sweep():
    assert bench.sweep_lengths(4096) == [256, 512, 1024, 2048, 4096]
    assert bench.sweep_lengths(3000) == [256, 512, 1024, 2048]
    assert bench.parse_lengths("256, 1K,4k", "--prefill-lengths") == [256, 1024, 4096]
    with pytest.raises(ValueError, match="--prefill-lengths"):
        bench.parse_lengths("256,abc", "--prefill-lengths")
    with pytest.raises(ValueError, match="--decode-contexts"):
        bench.parse_lengths("0", "--decode-contexts")
    with pytest.raises(ValueError, match="--max-length"):
        bench.sweep_lengths(100)


def _bench(*args, cwd):
    return subprocess.run([sys.executable, "-m", "lily", "bench", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def test_cli_sweep_writes_table_and_json(tmp_path):
    out = _bench("--synthetic", "tiny", "--cache", str(tmp_path / "ckpt"), "--max-length", "512",
                 "--decode-contexts", "256", "--repeats", "1", "--decode-tokens", "3",
                 "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    assert [p["tokens"] for p in r["prefill"]] == [256, 512]
    assert [d["context"] for d in r["decode"]] == [256]
    assert all(p["tok_s"] > 0 and len(p["runs"]) == 1 for p in r["prefill"])
    d = r["decode"][0]
    assert d["ms_per_token"] == pytest.approx(1e3 / d["tok_s"])
    assert r["backend"] == "cpu" and r["report"]["backend"] == "cpu" and r["model"] == "synthetic-tiny"
    assert r["machine"]["cpu_count"] == os.cpu_count() and r["settings"]["decode_tokens"] == 3
    lines = out.stdout.splitlines()
    assert any(line.split("|")[0].strip() == "512" for line in lines)  # a prefill row per length
    assert "ms/token" in out.stdout


def test_cli_bad_flags_fail_before_work(tmp_path):
    bad = _bench("--max-length", "100", cwd=tmp_path)
    assert bad.returncode == 2 and "--max-length" in bad.stderr
    bad = _bench("--backend", "nope", "--max-length", "256", "--repeats", "1", cwd=tmp_path)
    assert bad.returncode == 2 and "backend" in bad.stderr


def test_plot_writes_png_or_says_what_is_missing(tmp_path, monkeypatch):
    result = {"prefill": [{"tokens": 256, "tok_s": 10.0}, {"tokens": 512, "tok_s": 8.0}],
              "decode": [{"context": 256, "tok_s": 3.0}], "report": {"backend": "cpu"}}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(Exception, match="matplotlib"):
            bench.plot(result, tmp_path / "p.png")
    else:
        bench.plot(result, tmp_path / "p.png")
        assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
        with pytest.raises(Exception, match="bench"):
            bench.plot(result, tmp_path / "q.png")


def test_trace_summary_counts_overlapping_kernels_once(capsys):
    """benchmarks/trace_cuda.py's busy time is the union of kernel intervals (programmatic dependent launch makes
    them overlap), idle time the gaps inside the span; per-kernel sums are per step."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "trace_cuda", Path(__file__).resolve().parents[1] / "benchmarks" / "trace_cuda.py")
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    rows = [("a(int)", 0.0, 10.0), ("b", 5.0, 12.0), ("a(int)", 20.0, 30.0), ("c", 21.0, 22.0)]
    s = trace.summarise("t", rows, wall_us=40.0, per=2)
    assert s["busy_us"] == (12.0 + 10.0) / 2 and s["span_us"] == 15.0 and s["wall_us"] == 20.0
    assert s["kernels"] == 2
    top = s["by_kernel"][0]
    assert top["kernel"] == "a" and top["launches"] == 1 and top["summed_us"] == 10.0 and top["mean_us"] == 10.0
    assert "idle inside the span 4.0 µs" in capsys.readouterr().out
    assert s["idle_gaps"] == [{"after": "b", "before": "a", "count": 0.5, "idle_us": 4.0, "mean_us": 8.0}]


def test_decode_warmup_runs_come_before_the_timed_runs(ckpt_small, monkeypatch):
    import numpy as np

    import lily

    engine = lily.Engine.from_pretrained(ckpt_small.path, backend="cpu")
    calls = []
    real = bench.rate_after_first
    monkeypatch.setattr(bench, "rate_after_first", lambda tokens: calls.append(1) or real(tokens))
    runs = bench.measure_decode(engine, 8, tokens=3, repeats=2, rng=np.random.default_rng(0), warmup=2)
    assert len(runs) == 2 and all(r > 0 for r in runs)
    assert len(calls) == 4  # two untimed, two timed
    res = bench.run_sweep(engine, [], [8], repeats=1, decode_tokens=3, decode_warmup=1)
    assert res["settings"]["decode_warmup"] == 1 and len(res["decode"][0]["runs"]) == 1
    assert len(calls) == 6
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="warm-up"):
            bench.measure_decode(engine, 8, tokens=3, repeats=1, rng=np.random.default_rng(0), warmup=bad)
        with pytest.raises(ValueError, match="warm-up"):
            bench.measure_prefill(engine, 8, repeats=1, rng=np.random.default_rng(0), warmup=bad)


def test_prefill_warmup_runs_in_the_timed_session(ckpt_small):
    import numpy as np

    import lily

    engine = lily.Engine.from_pretrained(ckpt_small.path, backend="cpu")
    session = engine.session(max_context=16)
    prefills = []
    real = session.prefill
    session.prefill = lambda ids, *a, **k: prefills.append(len(ids)) or real(ids, *a, **k)
    runs = bench.measure_prefill(engine, 8, repeats=2, rng=np.random.default_rng(0), session=session, warmup=3)
    assert len(runs) == 2 and all(r > 0 for r in runs) and prefills == [8] * 5, (runs, prefills)
    res = bench.run_sweep(engine, [8], [], repeats=2, prefill_warmup=1)
    assert res["settings"]["prefill_warmup"] == 1 and len(res["prefill"][0]["runs"]) == 2
