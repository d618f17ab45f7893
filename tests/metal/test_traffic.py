"""The emulator's device-memory traffic count (the traffic build: every kernel load and store reported, distinct
bytes per dispatch) and benchmarks/bench_metal_traffic.py's figures, on the tiny synthetic model.

What each test protects: the IR check refuses a library with an access the count would miss; the count is exact
on a kernel whose bytes are known (one embedding row read, one hidden row written); every weight byte a step needs
is read at least once (an access the instrumentation missed would leave the moved bytes under the floor); a decode
step routes exactly top-k experts per layer and reads one embedding row (the floor's routed weights are right);
the dispatch and stage counts MetalOps reports (engine.report()) equal what the fake runtime executed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))

PROMPT = 8


def test_ir_check_refuses_accesses_the_count_would_miss():
    from metalsim import build

    counted = ("  call void @__sanitizer_cov_load4(ptr addrspace(1) %7)\n"
               "  %8 = load float, ptr addrspace(1) %7, align 4, !tbaa !5\n"
               "  %9 = load float, ptr addrspace(3) %2, align 4\n")  # threadgroup memory: not device traffic
    build._check_traffic_ir(counted, "ok.metal")
    missed = [
        "  %8 = load float, ptr addrspace(1) %7, align 4\n",  # no callback
        "  call void @__sanitizer_cov_load4(ptr addrspace(1) %6)\n  %8 = load float, ptr addrspace(1) %7, align 4\n",
        "  %8 = load <3 x float>, ptr %7, align 16\n",  # 12 bytes: no callback of that size exists
        "  call void @llvm.memcpy.p0.p1.i64(ptr %a, ptr addrspace(1) %b, i64 48, i1 false)\n",
        "  %r = atomicrmw add ptr addrspace(1) %p, i32 1 monotonic, align 4\n",
    ]
    for ir in missed:
        with pytest.raises(build.CompileError, match="would go uncounted"):
            build._check_traffic_ir(ir, "bad.metal")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import bench_metal_traffic as bench

    try:
        from metalsim import host

        host.find_clang()
    except Exception as e:  # noqa: BLE001
        from conftest import unavailable

        unavailable(f"clang not available: {e}")
    exe = bench.build_program()
    ck = bench.checkpoint("tiny", str(tmp_path_factory.mktemp("ck") / "tiny-q4"))
    work = tmp_path_factory.mktemp("run")
    record, out = bench.run_program(exe, ck, PROMPT, work)
    w = bench.Weights(ck)
    max_ctx = PROMPT + bench.STEPS + 8
    prompt = np.fromfile(work / "prompt.i32", dtype=np.int32)
    return {"record": record, "out": out, "w": w, "prompt": prompt,
            "prefill": bench.analyse(record, "lily prefill chunk", w, 0, PROMPT, max_ctx),
            "decode": bench.analyse(record, "lily decode step", w, PROMPT, PROMPT + 1, max_ctx)}


def test_count_is_exact_on_the_embedding_row(tiny):
    cfg = tiny["w"].config.to_core()
    cb = max((x for x in tiny["record"] if x["type"] == "command_buffer" and x["label"] == "lily decode step"),
             key=lambda x: x["dispatches"])
    (d,) = [x for x in tiny["record"] if x["type"] == "dispatch" and x["cb"] == cb["cb"] and x["kernel"] == "embed_rows"]
    # One row of the 4-bit table: H/2 bytes of codes + H/64 bf16 scales + as many biases; the token id (4 bytes).
    H = cfg["hidden"]
    weights = sum(b["read"] for b in d["bindings"] if b["buffer"].startswith("checkpoint file"))
    assert weights == H // 2 + 2 * (H // 64) * 2, d
    assert d["read"] == weights + 4, d
    assert d["written"] == H * 4, d  # the f32 hidden row
    assert d["accessed_read"] >= d["read"] and d["accessed_written"] >= d["written"], d


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_every_needed_byte_is_counted_at_least_once(tiny, phase):
    s = tiny[phase]
    fp, moved = s["floor_parts"], s["by_category"]
    assert moved["weights"] >= fp["weights"], (moved, fp)
    assert moved["state"] >= fp["state"], (moved, fp)
    assert moved["kv"] >= fp["kv"] > 0, (moved, fp)
    assert 1.0 <= s["ratio"] < 3.0, s["ratio"]
    for d in tiny["record"]:
        if d["type"] == "dispatch":
            assert d["accessed_read"] >= d["read"] and d["accessed_written"] >= d["written"], d


def test_floor_routes_top_k_experts_and_the_step_tokens(tiny):
    cfg = tiny["w"].config.to_core()
    dec, pre = tiny["decode"]["routed"], tiny["prefill"]["routed"]
    assert dec["experts_per_layer"] == {layer: cfg["topk"] for layer in range(cfg["layers"])}, dec
    assert dec["embed_rows"] == 1, dec
    assert pre["embed_rows"] == len(set(tiny["prompt"].tolist())), pre
    assert all(cfg["topk"] <= n <= cfg["experts"] for n in pre["experts_per_layer"].values()), pre


def test_metal_counters_match_what_ran(tiny):
    # MetalOps::counters() (engine.report()'s decode_step / prefill_chunk) against the fake runtime's record.
    out = tiny["out"]
    m = re.search(r"traffic prefill chunk: .* (\d+) dispatches, (\d+) stages \(metal\)", out)
    assert m and (int(m[1]), int(m[2])) == (tiny["prefill"]["dispatches"], tiny["prefill"]["stages"]), out
    m = re.search(r"traffic decode step: .* (\d+) dispatches, (\d+) stages \(metal\)", out)
    assert m and (int(m[1]), int(m[2])) == (tiny["decode"]["dispatches"], tiny["decode"]["stages"]), out
    assert tiny["decode"]["stages"] < tiny["decode"]["dispatches"], tiny["decode"]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_per_layer_counts_rebuild_the_step(tiny, phase):
    # The full-size extrapolation in benchmarks/NOTES.md multiplies these per-layer counts: applied to the tiny
    # model's own layers they must give back exactly what ran.
    import bench_metal_traffic as bench

    cfg = tiny["w"].config.to_core()
    s = tiny[phase]
    assert set(s["layers"]) == {"deltanet", "attention", "fixed"}, s["layers"]
    assert bench.extrapolate(s, cfg["layers"], sum(cfg["full_attention"])) == \
        {"dispatches": s["dispatches"], "stages": s["stages"]}, s["layers"]
    # The per-layer bytes (the full-width run's scaling to 40 layers) rebuild the step's bytes, kind by kind.
    n_attn = sum(cfg["full_attention"])
    y = bench.extrapolate_bytes(s, cfg["layers"], n_attn, s["floor_parts"]["kv"] / n_attn)
    assert y is not None, s["layers"]
    assert y["moved"] == pytest.approx(s["moved"], rel=1e-12), (y, s["moved"])
    for c in ("weights", "state", "kv"):
        assert y["bytes"][c] == pytest.approx(s["by_category"].get(c, 0), rel=1e-12), c
    if phase == "decode":  # a decode step's layers of a kind move the same bytes
        assert all(v["moved_range"][0] == v["moved_range"][1] for k, v in s["layers"].items() if k != "fixed")
