"""The Metal backend (csrc/metal: MetalOps) against the CPU backend, op by op and end to end, on the fake Metal
runtime with the real kernels in the MSL emulator (docs/METAL_VERIFICATION.md, L3).

tests/metal/host/backend_main.cpp links MetalOps and CpuOps (and the model, loader and Session) into one program:
`ops` runs every op of csrc/backend/ops.h on fresh random inputs at real-model-like and awkward shapes on both
backends and compares (fp32 reordering tolerances, exact for ids, positions, copies and the sampler state);
`model` loads a tiny random Qwen3.6 into both and compares chunked-prefill logits, greedy decode through the real
decode loop (two command buffers in flight), snapshot/restore and a fork mid-generation. The same runs repeat with the stage order
reversed or seeded, shuffled lanes, small device limits and leak checks, and planted bugs (a dropped barrier,
a wrong head mapping, a missing renormalisation, a position off by one) must make them fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

METAL = REPO / "metal"
METAL_FILES = sorted(METAL.glob("*.metal"))
CSRC = REPO / "csrc"
# Everything the program links besides csrc/metal (which build_program adds): the oracle and the model.
SOURCES = ([REPO / "tests" / "metal" / "host" / "backend_main.cpp"] + sorted((CSRC / "cpu").glob("*.cpp"))
           + sorted((CSRC / "backend").glob("*.cpp")) + sorted((CSRC / "model").glob("*.cpp"))
           + [CSRC / "runtime" / "session.cpp", CSRC / "runtime" / "sampler.cpp"])
FAKE_ENV = ("FAKEMETAL_REVERSE", "FAKEMETAL_SHUFFLE", "FAKEMETAL_LEAKS_FATAL", "FAKEMETAL_QUIET_LEAKS", "FAKEMETAL_SYNC",
            "FAKEMETAL_ORDER_SEED", "FAKEMETAL_ALLOW_FAST_MATH", "FAKEMETAL_HAZARDS", "FAKEMETAL_GPU_DELAY_MS",
            "LILY_METALSIM_MAX_THREADS_PER_THREADGROUP", "LILY_METALSIM_MAX_THREADGROUP_MEMORY",
            "LILY_METALSIM_MAX_BUFFER_LENGTH", "LILY_METALSIM_WORKING_SET_SIZE", "LILY_METAL_DROP_BARRIERS",
            "LILY_METAL_GROUP_MATMULS", "LILY_METAL_SPLIT_ATTENTION_MIN", "LILY_METAL_SPLIT_ATTENTION_BLOCK",
            "LILY_METAL_MOE_MMA", "LILY_METAL_MOE_TILE_ROWS")


def _build(mode: str) -> Path:
    from metalsim import host

    try:
        host.find_clang()
    except Exception as e:  # noqa: BLE001 - no clang: the harness cannot run here
        from conftest import unavailable

        unavailable(f"clang not available: {e}")
    return host.build_program(SOURCES, mode, "backend_main")


@pytest.fixture(scope="session")
def program():
    """The typed build: address spaces checked, buffers double-mapped (in-flight protection)."""
    return _build("typed")


@pytest.fixture(scope="session")
def program_asan():
    """Address spaces erased, everything under ASan/UBSan (out-of-bounds kernel reads, leaks, use after free)."""
    return _build("asan")


def run(exe: Path, args, env_extra=None, files=METAL_FILES) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in FAKE_ENV}
    env["FAKEMETAL_GPU_DELAY_MS"] = "5"  # in-flight windows stay real but short
    env.update(env_extra or {})
    return subprocess.run([str(exe), *map(str, args), *map(str, files)], capture_output=True, text=True, env=env,
                          timeout=300)


def passed(r: subprocess.CompletedProcess) -> bool:
    return r.returncode == 0 and "PASSED: 0 failures" in r.stdout


ORDERS = {
    "recorded": {},
    "reversed": {"FAKEMETAL_REVERSE": "1"},
    "seeded-shuffled-lanes": {"FAKEMETAL_ORDER_SEED": "7", "FAKEMETAL_SHUFFLE": "12345"},
}


@pytest.mark.parametrize("order", list(ORDERS), ids=list(ORDERS))
def test_every_op_matches_cpu_backend(program, order):
    r = run(program, ["ops"], {**ORDERS[order], "FAKEMETAL_LEAKS_FATAL": "1"})
    assert passed(r), r.stdout + r.stderr
    # Every op of ops.h was compared (the names the program prints), none skipped.
    ops = set(re.findall(r"^op (\w+) ", r.stdout, re.M))
    assert ops == {"matmul", "embed", "rms_norm", "add", "add_rms_norm", "gated_rms_norm", "swiglu", "moe_combine",
                   "attn_qk_prep", "kv_append", "attention", "conv1d_silu", "gated_delta", "moe_route", "moe_experts",
                   "copy", "fill", "advance_position", "sample", "matmuls", "moe", "conv_delta_norm", "accept_drafts",
                   "copy_rows_at", "mtp_input", "attn_qk_prep_append"}, ops
    # The sampler over three rows in one op (an MTP verify's): every case, the CPU's ids.
    assert len(re.findall(r"^op sample .+ rows ids: 0 of 3 differ ok$", r.stdout, re.M)) == 7, r.stdout
    # The fused DeltaNet decode kernel ran where it applies, and the composed path took the rest, with its reason.
    paths = dict(re.findall(r"^op conv_delta_norm (.+?): path (\w+)", r.stdout, re.M))
    assert paths["Hk=4 Hv=8 Dk=128 Dv=128 K=4 T=1 in-place"] == "fused", paths
    assert paths["Hk=3 Hv=6 Dk=48 Dv=40 K=4 T=1"] == "fused", paths
    assert paths["Hk=2 Hv=4 Dk=32 Dv=32 K=4 T=3 in-place capture"] == "composed", paths
    assert "path composed (3 rows (the fused kernel takes one decode row))" in r.stdout, r.stdout
    # Prefill calls of >= 64 rows without a capture take the chunked DeltaNet form, shorter ones when it is forced.
    for case in ["Hk=2 Hv=4 Dk=16 Dv=24 T=70 auto", "Hk=1 Hv=2 Dk=128 Dv=128 T=64 in-place auto",
                 "Hk=1 Hv=1 Dk=48 Dv=40 T=130 auto", "Hk=2 Hv=2 Dk=200 Dv=30 T=67 in-place auto",
                 "Hk=3 Hv=3 Dk=32 Dv=32 T=5 chunked", "Hk=2 Hv=4 Dk=16 Dv=24 T=80 in-place auto strong-decay"]:
        assert f"op gated_delta {case}: path chunked" in r.stdout, (case, r.stdout)
    # A MatmulGroup's products of one kind share a dispatch (qmv4_multi for a decode row's 4-bit products,
    # matmul_rows_multi for the rest), bit for bit the separate kernels; a product alone in its kind runs alone.
    for case, path, n in [("delta [2048] T=1", "grouped", 1), ("attention [320] T=1", "grouped", 1),
                          ("ragged [192] T=1", "grouped", 1), ("pair [256] T=1", "grouped", 1),
                          ("mixed [192] T=1", "split", 3), ("scales [192] T=1", "split", 2),
                          ("router [192] T=1", "grouped", 1), ("dense [96] T=1", "split", 2),
                          ("kinds [192] T=1", "composed", 2), ("prefill [192] T=5", "grouped", 1),
                          ("prefill-mixed [192] T=3", "grouped", 2)]:
        assert f"op matmuls {case}: path {path}, {n} dispatches" in r.stdout, (case, r.stdout)
        assert f"op matmuls {case}: grouped == separate: 0 words differ ok" in r.stdout, (case, r.stdout)
    # The MoE block: decode rows end in moe_down_combine (one dispatch fewer than moe_down + moe_combine) with the
    # unfused order's bits; prefill rows keep moe_combine.
    for case in ["T=1 E=40 k=8 H=128 I=64 q4g64-bf16 decode", "T=1 E=256 k=8 H=2048 I=512 q4g64-bf16 decode",
                 "T=3 E=12 k=5 H=100 I=40 bf16 decode", "T=1 E=9 k=3 H=84 I=32 f16 decode"]:
        assert f"op moe {case}: path fused, 6 dispatches" in r.stdout, (case, r.stdout)
        assert re.search(rf"op moe {case} unfused: 7 dispatches; fused vs unfused metal: 0 of \d+ differ ok", r.stdout), \
            (case, r.stdout)
    assert "op moe T=7 E=16 k=4 H=128 I=64 q4g64-f16 prefill: path composed (7 prefill rows (experts grouped on the " \
           "GPU)), 9 dispatches" in r.stdout, r.stdout
    check_moe_tiles(r.stdout)
    # The no-copy path, the copied mapping and the misaligned parts (one dense weight, two 4-bit weights' codes,
    # scales and biases) were each taken.
    assert "mappings wrapped 1 copied 1; parts copied 7" in r.stdout, r.stdout
    # Every 4-bit decode row ran qmv4, those at odd offsets in the checkpoint too (their parts copied at load), and
    # the report names the kernel that ran.
    ran = re.findall(r"^op matmul (\S+) \[\d+x\d+\] T=\d+ (decode|prefill)([\w -]*) ran (\w+) (\w+)", r.stdout, re.M)
    assert len(ran) == 12, ran
    for fmt, phase, extra, kernel, variant in ran:
        assert kernel == ("qmv4" if fmt.startswith("q4") and phase == "decode" else "matmul_rows"), (fmt, phase, kernel)
        assert variant.startswith(kernel), (fmt, phase, extra, kernel, variant)
    assert sum(1 for f, p, e, k, v in ran if "misaligned-part" in e and k == "qmv4") == 2, ran
    assert "leaked" not in r.stderr, r.stderr


# The grouped prefill experts' tile cases (tests/metal/host/backend_main.cpp, "grouped prefill tiles") and the path
# each setting must take at the default device limits: forced R, the rule (32 from 24 rows per expert), mma off.
TILE_CASES = {"edges T=72 E=9 k=3 H=100 I=40 bf16": 32, "q4 T=40 E=6 k=2 H=192 I=128 q4g64-bf16": 16,
              "q8 T=9 E=5 k=3 H=96 I=64 q8g32-f16": 16, "f16 T=11 E=4 k=2 H=48 I=36 f16": 16,
              "f32 T=5 E=3 k=2 H=70 I=24 f32": 16, "real T=6 E=256 k=8 H=2048 I=512 q4g64-bf16": None}


def check_moe_tiles(out: str, expect=None, same_bits=True) -> None:
    """Every tile case ran each setting on the path `expect(case, setting)` names (default: the setting's own), was
    compared with the CPU (the check lines are "ok" or the run failed), and R = 16 and R = 32 gave the same bits."""
    for case, auto in TILE_CASES.items():
        settings = {"R=16": "mma R=16", "R=32": "mma R=32"}
        if auto:
            settings |= {"auto": f"mma R={auto}", "mma off": "lane-dot tiles (LILY_METAL_MOE_MMA=0)"}
        for setting, path in settings.items():
            want = expect(case, setting, path) if expect else path
            assert re.search(rf"^op moe_experts tiles {re.escape(case)} {setting}: path {re.escape(want)}$", out, re.M), \
                (case, setting, want, out)
            assert re.search(rf"^op moe_experts tiles {re.escape(case)} {setting}: max_err \S+ tol 1e-05 ok$", out, re.M), \
                (case, setting, out)
        verdict = "bitwise ok" if same_bits else "not compared (a fallback ran)"
        assert f"op moe_experts tiles {case} R=16 == R=32: {verdict}" in out, (case, out)
    # The 8-row lane-dot tiles (the fallback) keep the per-pair kernels' bits.
    assert out.count("lane-dot tiles == per-pair: bitwise ok") == 3, out


def test_every_op_under_asan(program_asan):
    # Out-of-bounds reads and writes of the kernels and host code (the typed build's mapped buffers can hide a
    # read past the end), undefined behaviour and C++ leaks. (The model runs in the typed build only: its few
    # thousand dispatches take minutes under ASan's fiber stacks.)
    r = run(program_asan, ["ops"], {"ASAN_OPTIONS": "detect_leaks=1", "FAKEMETAL_LEAKS_FATAL": "1"})
    assert passed(r), r.stdout + r.stderr[-4000:]
    assert "AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-4000:]


def test_ops_within_small_device_limits(program):
    # 256 threads per threadgroup, 16 KB of threadgroup memory and buffers of at most 1 MiB: every kernel still
    # fits, and the 12 MiB weight mapping becomes overlapping windows (each weight inside one of them).
    r = run(program, ["ops"], {"LILY_METALSIM_MAX_THREADS_PER_THREADGROUP": "256",
                               "LILY_METALSIM_MAX_THREADGROUP_MEMORY": "16384",
                               "LILY_METALSIM_MAX_BUFFER_LENGTH": str(1 << 20)})
    assert passed(r), r.stdout + r.stderr
    assert re.search(r"mapping buffers (\d+)", r.stdout) and int(re.search(r"mapping buffers (\d+)", r.stdout)[1]) > 2, \
        r.stdout
    # The simdgroup-matrix expert tiles fit (at most 128 threads and 12.1 KB of threadgroup memory): no fallback.
    check_moe_tiles(r.stdout)
    # The chunked DeltaNet kernels need 24 KB of threadgroup memory: their calls take the simdgroup scan.
    assert "op gated_delta Hk=2 Hv=4 Dk=16 Dv=24 T=70 auto: path scan" in r.stdout, r.stdout
    # 512 threads for one key head's four value heads do not fit in 256: that call composes the three kernels.
    assert "op conv_delta_norm Hk=1 Hv=4 Dk=32 Dv=128 K=3 T=1 in-place: path composed (512 threads per key head " \
           "above the pipeline's 256)" in r.stdout, r.stdout


def test_moe_tiles_fall_back_where_threadgroup_memory_is_short(program):
    # 11 KB of threadgroup memory: the 16-row tiles fit (gate/up 10.1 KB), the 32-row ones do not (12.1 KB). The rule's
    # 32 becomes 16 and a forced 32 the 8-row lane-dot tiles, each with its reason; the results still match the CPU.
    r = run(program, ["ops", "--only", "moe_experts"], {"LILY_METALSIM_MAX_THREADGROUP_MEMORY": "11264"})
    assert passed(r), r.stdout + r.stderr
    why = "moe_gate_up_mma_r32 needs 12416 bytes of threadgroup memory, the device allows 11264"

    def expect(case, setting, path):
        if setting == "R=32":
            return f"lane-dot tiles ({why})"
        return f"mma R=16 ({why})" if path == "mma R=32" else path
    check_moe_tiles(r.stdout, expect, same_bits=False)


@pytest.mark.parametrize("spec,order", [("mixed", "recorded"), ("mixed", "reversed"), ("wide", "seeded-shuffled-lanes")])
def test_tiny_model_matches_cpu_backend_end_to_end(program, spec, order):
    r = run(program, ["model", "--spec", spec], {**ORDERS[order], "FAKEMETAL_LEAKS_FATAL": "1"})
    assert passed(r), r.stdout + r.stderr
    assert re.search(r"greedy tokens: cpu( \d+){32} \| metal( \d+){32} same", r.stdout), r.stdout
    assert re.search(r"seeded tokens: .* same", r.stdout), r.stdout
    # Pipelines are built once and cached: once warm, decode steps build none.
    m = re.search(r"pipelines: (\d+) built in all, the 4 steps after the restore built (\d+) and took (\d+) from the "
                  r"cache", r.stdout)
    assert m and int(m[1]) > 0 and int(m[2]) == 0 and int(m[3]) > 0, r.stdout
    assert "continuation identical" in r.stdout, r.stdout
    # The decode loop kept two command buffers in flight (the CPU encodes step n+1 while step n runs).
    assert "max in flight 2" in r.stdout, r.stdout
    # Decode rows ran the fused DeltaNet kernel; the prefill chunks composed the three kernels.
    m = re.search(r"metal active: fused conv \+ recurrent update \+ gated norm .*; (\d+) calls fused, (\d+) composed .* the last "
                  r"for (\d+) rows", r.stdout)
    assert m and int(m[1]) > 0 and int(m[2]) > 0 and int(m[3]) > 1, r.stdout
    # The prefill chunks' composed scans took one state column per simdgroup.
    m = re.search(r"metal active: register-resident DeltaNet scan with one state column per simdgroup .*; (\d+) calls; "
                  r"(\d+) calls with one column per thread", r.stdout)
    assert m and int(m[1]) > 0, r.stdout
    # Decode rows ran each layer's 4-bit projections as one qmv4_multi; prefill chunks as one matmul_rows_multi.
    m = re.search(r"metal active: one dispatch per MatmulGroup .*; (\d+) calls grouped, (\d+) products in (\d+) qmv4_multi "
                  r"and (\d+) matmul_rows_multi dispatches", r.stdout)
    assert m and int(m[1]) > 0 and int(m[2]) >= 2 * (int(m[3]) + int(m[4])) and int(m[3]) > 0 and int(m[4]) > 0, r.stdout
    # Decode rows ended each MoE in moe_down_combine; prefill chunks ran moe_combine.
    m = re.search(r"metal active: fused expert down \+ routing weight \+ gated shared expert \+ residual .*; (\d+) calls "
                  r"fused, (\d+) with moe_combine after the down pass, the last for (\d+) prefill rows", r.stdout)
    assert m and int(m[1]) > 0 and int(m[2]) > 0 and int(m[3]) > 1, r.stdout
    # Prefill chunks ran the grouped experts on the simdgroup-matrix tiles, never on the 8-row lane-dot fallback.
    m = re.search(r"metal active: grouped expert GEMM on simdgroup matrices .*; (\d+) chunks with 16-row tiles, (\d+) "
                  r"with 32-row tiles, (\d+) on the 8-row lane-dot tiles", r.stdout)
    assert m and int(m[1]) + int(m[2]) > 0 and int(m[3]) == 0, r.stdout
    # A fork mid-generation: parent and child each equal a fresh session of their tokens and continue as alone.
    assert "fork: parent same as a fresh session of its tokens, child same" in r.stdout, r.stdout
    assert "fork: parent continuation unchanged, child continuation unchanged" in r.stdout, r.stdout
    assert "leaked" not in r.stderr, r.stderr


def test_matmul_groups_can_be_turned_off(program):
    # LILY_METAL_GROUP_MATMULS=0 (the A/B switch for a Mac): every product its own dispatch, the same results.
    r = run(program, ["ops", "--only", "matmuls"], {"LILY_METAL_GROUP_MATMULS": "0"})
    assert passed(r), r.stdout + r.stderr
    assert "op matmuls delta [2048] T=1: path composed, 4 dispatches" in r.stdout, r.stdout
    assert "op matmuls attention [320] T=1: path composed, 3 dispatches" in r.stdout, r.stdout
    assert "op matmuls prefill [192] T=5: path composed, 3 dispatches" in r.stdout, r.stdout
    assert "path grouped" not in r.stdout and "path split" not in r.stdout, r.stdout


def test_moe_combine_fusion_can_be_turned_off(program):
    # LILY_METAL_FUSE_MOE_COMBINE=0 (the A/B switch for a Mac): decode rows run moe_down, then moe_combine; the
    # same results.
    r = run(program, ["ops", "--only", "moe"], {"LILY_METAL_FUSE_MOE_COMBINE": "0"})
    assert passed(r), r.stdout + r.stderr
    assert "op moe T=1 E=256 k=8 H=2048 I=512 q4g64-bf16 decode: path composed (LILY_METAL_FUSE_MOE_COMBINE=0), " \
           "7 dispatches" in r.stdout, r.stdout
    assert "path fused" not in r.stdout, r.stdout
    # The tiny model's decode step: one dispatch and one stage fewer per layer with the fusion.
    steps = {}
    for env in ("1", "0"):
        r = run(program, ["model", "--spec", "mixed"], {"LILY_METAL_FUSE_MOE_COMBINE": env})
        assert passed(r), r.stdout + r.stderr
        m = re.search(r"metal decode step: .* last command buffer: (\d+) dispatches, (\d+) barriers", r.stdout)
        assert m, r.stdout
        steps[env] = (int(m[1]), int(m[2]))
    layers = 4  # model_config("mixed") in tests/metal/host/backend_main.cpp
    assert steps["0"] == (steps["1"][0] + layers, steps["1"][1] + layers), steps


@pytest.mark.parametrize("order", ["recorded", "seeded-shuffled-lanes"])
def test_tiny_model_with_split_attention_matches_cpu_backend(program, order):
    # The split path through the real decode loop (position on the GPU, two command buffers in flight): contexts from
    # 8 rows split into blocks of 4, so every decode step of the 12-token prompt splits into 4 to 6 blocks.
    r = run(program, ["model"], {**ORDERS[order], "FAKEMETAL_LEAKS_FATAL": "1", "LILY_METAL_SPLIT_ATTENTION_MIN": "8",
                                 "LILY_METAL_SPLIT_ATTENTION_BLOCK": "4"})
    assert passed(r), r.stdout + r.stderr
    assert re.search(r"greedy tokens: .* same", r.stdout), r.stdout
    assert "continuation identical" in r.stdout, r.stdout
    m = re.search(r"metal active: split decode attention for long contexts \(.*blocks of 4 rows once the context "
                  r"reaches 8 rows.*; (\d+) calls encoded split, (\d+) decode calls not", r.stdout)
    assert m and int(m[1]) > 0 and int(m[2]) == 0, r.stdout
    # By default (32768) the tiny model's contexts never split, and the report says why.
    d = run(program, ["model"])
    assert passed(d), d.stdout + d.stderr
    assert re.search(r"metal inactive: split decode attention .* 0 calls encoded split, [1-9]\d* decode calls not, "
                     r"the last for max_ctx \d+ below 32768 rows", d.stdout), d.stdout


def test_dropped_barriers_are_caught_by_the_hazard_check(program):
    r = run(program, ["model"], {"LILY_METAL_DROP_BARRIERS": "1"})
    assert r.returncode != 0
    assert re.search(r"hazard in encoder 0 \(concurrent\), stage 0: command \d+ \(kernel '\w+'\) writes", r.stdout + r.stderr), \
        r.stdout + r.stderr


# Planted kernel bugs (STYLE.md §7, "break it once"): each mutated file is run with only the ops it serves.
MUTATIONS = [
    ("attention.metal", "kvh = h / (s.heads / s.kv_heads)", "kvh = h % s.kv_heads", "attention"),  # §12.6
    ("attention.metal", "const int at = pos[0] + int(t);", "const int at = pos[0] + int(t) + 1;", "attention"),
    # The split path's reduce adds the blocks' accumulators without the log-sum-exp rescale to the common maximum.
    ("attention.metal", "o += p0[ulong(b) * stride + 2 + e] * exp(p0[ulong(b) * stride] - M);",
     "o += p0[ulong(b) * stride + 2 + e];", "attention"),
    # The split path's blocks each stop one row short (the last row of every block never scored).
    ("attention.metal", "const uint j1 = split ? min(j0 + s.block, n) : n;",
     "const uint j1 = split ? min(j0 + s.block - 1, n) : n;", "attention"),
    ("gated_delta.metal", "kh = j / (s.v_heads / s.k_heads)", "kh = j % s.k_heads", "gated_delta"),  # §12.6
    ("gated_delta.metal", "S[i] = S[i] * alpha;\n      m += (k[i] * rk) * S[i];",
     "m += (k[i] * rk) * S[i];\n      S[i] = S[i] * alpha;", "gated_delta"),  # §12.9: decay after the read
    ("moe.metal", "weights[ulong(t) * s.ld_w + r] = prob[r] / total;", "weights[ulong(t) * s.ld_w + r] = prob[r];",
     "moe_route"),  # §12.13
    # State captures (ops.h StateCapture) one row off: the scan's after the next token, the conv's window one row
    # early (early, not late: a late window reads one row past x, which the harness reports as a fault instead;
    # test_kernel_reading_past_a_buffer_is_named).
    ("gated_delta.metal", "if (t - s.cap_first < s.cap_count)", "if (t - 1 - s.cap_first < s.cap_count)",
     "gated_delta"),
    ("gated_delta.metal", "int(s.cap_first + i + r + 1) - int(S)", "int(s.cap_first + i + r) - int(S)",
     "conv1d_silu"),
    # The simdgroup scan (prefill rows): value heads mapped to key heads modulo, the decay after the read, the read
    # m = Sᵀk̂ left as each lane's partial (no simd_sum: the lanes never exchange), captures one row late.
    ("gated_delta.metal", "kh = j / group", "kh = j % s.k_heads", "gated_delta"),
    ("gated_delta.metal", "S[p] = S[p] * alpha;\n      m += (kv[p] * rk) * S[p];",
     "m += (kv[p] * rk) * S[p];\n      S[p] = S[p] * alpha;", "gated_delta"),
    ("gated_delta.metal", "const float delta = beta * (v - simd_sum(m));", "const float delta = beta * (v - m);",
     "gated_delta"),
    ("gated_delta.metal", "if (t >= s.cap_first && t < s.cap_first + s.cap_count)",
     "if (t > s.cap_first && t <= s.cap_first + s.cap_count)", "gated_delta"),
    # The chunked (WY) form: A without β (the prep), and the chunk's decay of the carried state forgotten (the scan).
    ("gated_delta.metal", "if (jj < i) av = sBeta[i] * dec * (sRk[i] * sRk[jj] * kk);",
     "if (jj < i) av = dec * (sRk[i] * sRk[jj] * kk);", "gated_delta"),
    ("gated_delta.metal", "float acc = gl * sS[e];", "float acc = sS[e];", "gated_delta"),
    # The fused DeltaNet decode kernel normalises every value head with the first head's sum of squares.
    ("gated_delta.metal", "partials[h * per_head + lane]", "partials[lane]", "conv_delta_norm"),
    # The grouped prefill experts lose every partial tile (an expert's last rows when its count is not a multiple of 8).
    ("matmul.metal", "tile_run += (c + int(s.tile_rows) - 1) / int(s.tile_rows);", "tile_run += c / int(s.tile_rows);",
     "moe_experts"),
    # The simdgroup-matrix expert GEMM: no barrier between staging the x rows and weight blocks and the 8x8 products
    # (a simdgroup loads elements other simdgroups have not staged yet: poisoned threadgroup memory).
    ("matmul.metal", "    threadgroup_barrier(mem_flags::mem_threadgroup);  // every staged element is written before "
     "any simdgroup loads\n", "", "moe_experts"),
    # ... and a tile's row mask off by one: the last row of every tile of the down product is never written.
    ("matmul.metal", "if (j < rows && n < w.N) y[ulong(first + j) * w.N + n] = xs[i];",
     "if (j + 1 < rows && n < w.N) y[ulong(first + j) * w.N + n] = xs[i];", "moe_experts"),
    # One dispatch per MatmulGroup: a threadgroup forgets its product's first threadgroup (rows from the grid's start).
    ("matmul.metal", "const uint row0 = ((group_id - start) * 2 + simdgroup) * 4;",
     "const uint row0 = (group_id * 2 + simdgroup) * 4;", "matmuls"),
    # matmul_rows_multi stores every product with the first product's row stride (right only for products as wide).
    ("matmul.metal", "y[ulong(t) * ldy + row0 + r] = total;", "y[ulong(t) * s.ldy0 + row0 + r] = total;", "matmuls"),
    # The decode MoE's last dispatch adds the shared expert without its sigmoid gate.
    ("matmul.metal", "h[i] += o[r] + g * shared[ulong(t) * s.ld_shared + row0 + r];",
     "h[i] += o[r] + shared[ulong(t) * s.ld_shared + row0 + r];", "moe"),
]
# The other kernel files each op's run needs besides the mutated one.
NEEDS = {"moe_experts": ["moe.metal"], "moe": ["moe.metal"], "conv_delta_norm": ["norm.metal"]}  # its composed path: gated_rms_norm


@pytest.mark.parametrize("name,old,new,op", MUTATIONS, ids=[f"{m[3]}-{i}" for i, m in enumerate(MUTATIONS)])
def test_planted_kernel_bug_fails_its_op(program, tmp_path, name, old, new, op):
    text = (METAL / name).read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {name}"
    mutated = tmp_path / name
    mutated.write_text(text.replace(old, new))
    others = [METAL / f for f in NEEDS.get(op, [])]
    clean = run(program, ["ops", "--only", op], files=[METAL / name, *others])
    assert passed(clean), clean.stdout + clean.stderr
    r = run(program, ["ops", "--only", op], files=[mutated, *others])
    assert r.returncode == 1 and f"op {op} " in r.stdout and "FAIL" in r.stdout, r.stdout + r.stderr


def test_kernel_reading_past_a_buffer_is_named(program, tmp_path):
    """A kernel that reads one row past its input always faults (each buffer is followed by an inaccessible page),
    and the fault names the dispatch: not a bare SIGSEGV, and not a crash in one run of many."""
    name, old = "gated_delta.metal", "int(s.cap_first + i + r + 1) - int(S)"
    text = (METAL / name).read_text()
    assert text.count(old) == 1
    mutated = tmp_path / name
    mutated.write_text(text.replace(old, "int(s.cap_first + i + r + 2) - int(S)"))  # the last captured row: x[T]
    for _ in range(3):
        r = run(program, ["ops", "--only", "conv1d_silu"], files=[mutated])
        assert r.returncode != 0, r.stdout + r.stderr
        assert re.search(r"fakemetal: SIGSEGV while running a dispatch: .*kernel 'conv1d_silu'.* touched memory "
                         r"outside its buffers", r.stderr), r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------------------
# lily-tiny, the packaged 4-bit model: the real checkpoint bytes through both backends
# ------------------------------------------------------------------------------------------------------------

LILY_TINY = REPO / "src" / "lily" / "models" / "lily-tiny"
TEACHER_TOKENS = 64  # 2 prefill chunks of 32


def write_manifest(out: Path) -> None:
    """The canonical weights of lily-tiny as byte offsets into its safetensors file (the program maps the file
    itself), the small float vectors, the config and the token ids of the held-out text (manifest format:
    run_checkpoint in tests/metal/host/backend_main.cpp)."""
    import numpy as np
    from metal_inputs import write_checkpoint_manifest
    from tokenizers import Tokenizer

    from lily.checkpoint import load_checkpoint

    ck = load_checkpoint(LILY_TINY)
    write_checkpoint_manifest(ck, out)
    tok = Tokenizer.from_file(str(LILY_TINY / "tokenizer.json"))
    ids = tok.encode((LILY_TINY / "heldout.txt").read_text()).ids
    assert len(ids) >= TEACHER_TOKENS + 16, len(ids)
    np.asarray(ids[:TEACHER_TOKENS], dtype=np.int32).tofile(out / "teacher.i32")
    np.asarray(ids[TEACHER_TOKENS:TEACHER_TOKENS + 16], dtype=np.int32).tofile(out / "prompt.i32")
    ck.close()


@pytest.mark.parametrize("order", list(ORDERS), ids=list(ORDERS))
def test_lily_tiny_through_metal_matches_cpu(program, tmp_path, order):
    # The packaged model, its real 4-bit bytes mapped once and wrapped without a copy: teacher-forced top-1
    # agreement with the CPU backend over 64 held-out tokens (prefilled in chunks of 32) of at least 99% (all 64), logits
    # within 1e-4 of the largest, and the same 32 greedy tokens through the decode loop; in every stage order the
    # op tests use (dispatches and threadgroups reversed, lanes shuffled: an order dependence the tiny random models
    # miss at the real model's shapes shows here).
    write_manifest(tmp_path / "tiny")
    r = run(program, ["checkpoint", "--dir", tmp_path / "tiny"], {**ORDERS[order], "FAKEMETAL_LEAKS_FATAL": "1"})
    assert passed(r), r.stdout + r.stderr
    assert "greedy 32 tokens: identical" in r.stdout, r.stdout
    # The same 64 rows as one prefill call: every DeltaNet layer in the chunked (WY) form, the same bars.
    chunked = re.search(r"checkpoint one 64-row chunk: (\d+) chunked DeltaNet calls", r.stdout)
    assert chunked and int(chunked[1]) > 0, r.stdout
    assert re.search(r"mappings wrapped 1 \(\d+ bytes\), copied 0", r.stdout), r.stdout


# The project's random test models (tests/conftest.py SPECS) through the same checkpoint program
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["single_fa", "multi_fa", "mlx"])
def test_random_test_configs_through_metal_match_cpu(program, tmp_path, tiny_factory, spec):
    # The random models every other backend is tested on, as Hugging Face bf16 checkpoints (single_fa: GQA 2 and one
    # attention layer; multi_fa: attention in the first, middle and last layers, GQA 3, head dim 16, widths that are
    # not multiples of 64; mlx: the widths MLX quantizes): teacher-forced top-1 agreement with the CPU backend over 64
    # random tokens (chunks of 32, then one 64-row call in the chunked DeltaNet form) of at least 99%, logits within
    # 1e-4 of the largest, and the same 32 greedy tokens through the decode loop (run_checkpoint).
    import numpy as np
    from metal_inputs import write_checkpoint_manifest

    from lily.checkpoint import load_checkpoint

    ck = tiny_factory(spec, "per_expert", "bfloat16")
    out = tmp_path / spec
    out.mkdir()
    loaded = load_checkpoint(ck.path)
    write_checkpoint_manifest(loaded, out)
    loaded.close()
    np.asarray(ck.tokens(64, seed=3), dtype=np.int32).tofile(out / "teacher.i32")
    np.asarray(ck.tokens(16, seed=4), dtype=np.int32).tofile(out / "prompt.i32")
    r = run(program, ["checkpoint", "--dir", out], {"FAKEMETAL_LEAKS_FATAL": "1"})
    assert passed(r), r.stdout + r.stderr
    assert "greedy 32 tokens: identical" in r.stdout, r.stdout
    chunked = re.search(r"checkpoint one 64-row chunk: (\d+) chunked DeltaNet calls", r.stdout)
    assert chunked and int(chunked[1]) > 0, r.stdout
