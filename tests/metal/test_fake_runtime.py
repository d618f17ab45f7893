# L3 of the Metal verification harness: the real Metal backend host code (csrc/metal), built for Linux against
# metal-cpp, runs on the fake Metal runtime (tools/metalsim/fakemetal) with the real kernels (metal/*.metal)
# executed by the MSL emulator. The proof program (tests/metal/host/proof_main.cpp) must match the CPU backend;
# a missing memory barrier, leaked or released-then-used objects and bad dispatch arguments must be reported.
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

from metalsim import build  # noqa: E402

HOST_TESTS = REPO / "tests" / "metal" / "host"
METAL_FILES = sorted((REPO / "metal").glob("*.metal"))
EPS = 1e-6

try:
    from lily import _core as core
except ImportError as e:  # the package is installed before the tests: under LILY_METALSIM_REQUIRE this fails
    if build.required():
        raise
    pytest.skip(f"lily._core is not importable ({e})", allow_module_level=True)


@pytest.fixture(scope="session")
def host(harness_unavailable):
    from metalsim import host as host_mod

    try:
        host_mod.find_clang()
    except Exception as e:  # noqa: BLE001 - no clang: this machine cannot build the fake runtime
        harness_unavailable(f"clang not available: {e}")
    return host_mod


_programs: dict[tuple[str, str], Path] = {}


def program(host, name: str, mode: str) -> Path:
    """tests/metal/host/<name>.cpp linked with csrc/metal, the fake runtime and libmslsim (built once, cached)."""
    if (name, mode) not in _programs:
        _programs[(name, mode)] = host.build_program([HOST_TESTS / f"{name}.cpp"], mode, name)
    return _programs[(name, mode)]


def run(exe: Path, args, env_extra=None, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for k in ("FAKEMETAL_REVERSE", "FAKEMETAL_SHUFFLE", "FAKEMETAL_LEAKS_FATAL", "FAKEMETAL_QUIET_LEAKS", "FAKEMETAL_SYNC",
              "FAKEMETAL_ORDER_SEED", "FAKEMETAL_ALLOW_FAST_MATH", "FAKEMETAL_HAZARDS", "FAKEMETAL_GPU_DELAY_MS",
              "LILY_METALSIM_MAX_THREADS_PER_THREADGROUP",
              "LILY_METALSIM_MAX_THREADGROUP_MEMORY", "LILY_METALSIM_MAX_BUFFER_LENGTH", "LILY_METALSIM_WORKING_SET_SIZE"):
        env.pop(k, None)
    env["ASAN_OPTIONS"] = "detect_leaks=1"  # LeakSanitizer for C++ leaks; the fake reports Metal objects
    env.update(env_extra or {})
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert r.returncode == 0, f"{exe.name} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


# ------------------------------------------------------------------------------------------------------------
# Inputs and the CPU oracle
# ------------------------------------------------------------------------------------------------------------


def signed_uniform(rng, shape) -> np.ndarray:
    """Magnitudes in [0.1, 1), both signs: zeros would hide indexing and ordering mistakes."""
    return (rng.uniform(0.1, 1.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)).astype(np.float32)


def quantized_weight(rng, out: int, cols: int, group: int, scale_dtype: str) -> dict:
    """A 4-bit affine weight made by lily.quantize (MLX layout), as cpu_matmul takes it."""
    from lily.quantize import quantize

    w = rng.normal(0.0, 0.5, size=(out, cols)).astype(np.float32)
    if scale_dtype == "bf16":
        from lily.quantize import f32_to_bf16

        codes, scales, biases = quantize(f32_to_bf16(w), group, 4, bf16=True)
    else:
        codes, scales, biases = quantize(w.astype(np.float16), group, 4)
    return {"kind": "affine", "bits": 4, "group": group, "data": codes, "scales": scales, "biases": biases,
            "scale_dtype": scale_dtype, "shape": (out, cols)}


def run_proof(host, tmp_path, mode, rows, cols, out, group, scale, skip_barrier=False, env=None, seed=0):
    rng = np.random.default_rng(seed + rows * 1000 + cols * 10 + out)
    x = signed_uniform(rng, (rows, cols)) * 2.0
    w = signed_uniform(rng, cols)
    W = quantized_weight(rng, out, cols, group, scale)
    dot_rows, dot_cols = 5, 77
    a = signed_uniform(rng, (dot_rows, dot_cols))
    b = signed_uniform(rng, (dot_rows, dot_cols))
    inp, outp = tmp_path / "in", tmp_path / "out"
    inp.mkdir(exist_ok=True)
    outp.mkdir(exist_ok=True)
    for name, arr in (("x.f32", x), ("w.f32", w), ("codes.u32", W["data"]), ("scales.u16", W["scales"]),
                      ("biases.u16", W["biases"]), ("a.f32", a), ("b.f32", b)):
        np.ascontiguousarray(arr).tofile(inp / name)
    args = ["--rows", rows, "--cols", cols, "--out", out, "--group", group, "--scale", scale, "--eps", EPS,
            "--dot-rows", dot_rows, "--dot-cols", dot_cols, "--in", inp, "--out-dir", outp, *METAL_FILES]
    if skip_barrier:
        args.insert(0, "--skip-barrier")
    r = run(program(host, "proof_main", mode), args, env)
    got = {
        "xn": np.fromfile(outp / "xn.f32", dtype=np.float32).reshape(rows, cols),
        "y": np.fromfile(outp / "y.f32", dtype=np.float32).reshape(rows, out),
        "dot": np.fromfile(outp / "dot.f32", dtype=np.float32),
    }
    return r, (x, w, W, a, b), got


def oracle(x, w, W, a, b):
    xn = np.asarray(core.cpu_rms_norm(x, w, EPS), dtype=np.float64)
    y = np.asarray(core.cpu_matmul(np.ascontiguousarray(xn, dtype=np.float32), W, "gemv"), dtype=np.float64)
    dot = np.asarray(core.cpu_row_dot(a, b), dtype=np.float64)
    return xn, y, dot


def errors(inputs, got) -> dict[str, float]:
    """Each output's worst error relative to the magnitude scale of its sum (float32 reordering error)."""
    x, w, W, a, b = inputs
    xn_ref, y_ref, dot_ref = oracle(*inputs)
    rows, cols = W["shape"]
    dense = np.stack([np.asarray(core.cpu_dequant_row(W, r), dtype=np.float64) for r in range(rows)])
    y_scale = np.abs(xn_ref) @ np.abs(dense).T
    return {
        "xn": float((np.abs(got["xn"] - xn_ref) / (np.abs(xn_ref) + 1e-30)).max()),
        "y": float((np.abs(got["y"] - y_ref) / y_scale).max()),
        "dot": float((np.abs(got["dot"] - dot_ref) / (np.abs(a) * np.abs(b)).sum(axis=1)).max()),
    }


TOL = {"xn": 1e-5, "y": 1e-5, "dot": 1e-5}

# ------------------------------------------------------------------------------------------------------------
# End to end
# ------------------------------------------------------------------------------------------------------------

CASES = [
    # mode, rows, cols, out, group, scale dtype, extra environment
    ("typed", 3, 192, 37, 64, "bf16", {}),
    ("typed", 2, 320, 37, 32, "f16", {"FAKEMETAL_SHUFFLE": "12345"}),
    ("asan", 3, 192, 37, 64, "bf16", {}),
]


@pytest.mark.parametrize("mode,rows,cols,out,group,scale,env", CASES,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}-o{c[3]}-g{c[4]}-{c[5]}" for c in CASES])
def test_proof_program_matches_cpu_backend(host, tmp_path, mode, rows, cols, out, group, scale, env):
    r, inputs, got = run_proof(host, tmp_path, mode, rows, cols, out, group, scale, env=env)
    # rms_norm and row_dot share the first stage; the barrier opens the second (every qmv4).
    assert f"dispatches={2 + rows} stages=2" in r.stdout, r.stdout
    assert "leaked" not in r.stderr, r.stderr
    err = errors(inputs, got)
    assert all(err[k] <= TOL[k] for k in TOL), err


@pytest.mark.parametrize("skip_barrier,reverse,correct", [
    (False, True, True),   # barrier present: any order within stages is fine
    (True, False, True),   # barrier missing, but recorded order happens to work: the bug hides
    (True, True, False),   # barrier missing, stage run in reverse: qmv4 reads xn before rms_norm wrote it
], ids=["barrier-reversed", "no-barrier-in-order", "no-barrier-reversed"])
def test_missing_barrier_is_caught_by_reversed_stages(host, tmp_path, skip_barrier, reverse, correct):
    # The hazard check (below) would stop the bug before anything runs; this checks the reordering on its own.
    env = {"FAKEMETAL_REVERSE": "1", "FAKEMETAL_HAZARDS": "0"} if reverse else {"FAKEMETAL_HAZARDS": "0"}
    r, inputs, got = run_proof(host, tmp_path, "typed", 3, 192, 37, 64, "bf16", skip_barrier, env, seed=7)
    assert f"stages={1 if skip_barrier else 2}" in r.stdout, r.stdout
    err = errors(inputs, got)
    assert err["xn"] <= TOL["xn"] and err["dot"] <= TOL["dot"], err  # independent of the barrier
    assert (err["y"] <= TOL["y"]) == correct, err


def test_seeded_orders_keep_barriers_and_expose_their_absence(host, tmp_path):
    # FAKEMETAL_ORDER_SEED: seeded dispatch and threadgroup orders within each stage. With the barrier every
    # seed is correct; without it (hazard check off) some seed runs a qmv4 before rms_norm wrote xn.
    wrong = 0
    for seed in (1, 2, 3):
        env = {"FAKEMETAL_ORDER_SEED": str(seed), "FAKEMETAL_HAZARDS": "0"}
        r, inputs, got = run_proof(host, tmp_path, "typed", 3, 192, 37, 64, "bf16", False, env, seed=7)
        assert errors(inputs, got)["y"] <= TOL["y"], seed
        r, inputs, got = run_proof(host, tmp_path, "typed", 3, 192, 37, 64, "bf16", True, env, seed=7)
        wrong += errors(inputs, got)["y"] > TOL["y"]
    assert wrong > 0


def test_missing_barrier_is_a_hazard_in_recorded_order(host, tmp_path):
    # No reordering needed: rms_norm writes xn and qmv4 reads it in one concurrent stage.
    with pytest.raises(AssertionError) as e:
        run_proof(host, tmp_path, "typed", 3, 192, 37, 64, "bf16", True, {}, seed=7)
    assert re.search(r"hazard in encoder 0 \(concurrent\), stage 0: command 0 \(kernel 'rms_norm'\) writes bytes "
                     r"\[0, 2304\) through buffer\(2\) and command \d \(kernel 'qmv4_bf16'\) may read bytes "
                     r"\[0, 2304\) through buffer\(3\) of buffer .* overlap with no memory barrier", str(e.value)), e.value


# ------------------------------------------------------------------------------------------------------------
# Object lifetime
# ------------------------------------------------------------------------------------------------------------


def test_clean_program_reports_nothing(host):
    for mode in ("clean", "autorelease", "encoder-retained"):
        r = run(program(host, "lifetime", "typed"), [mode], {"FAKEMETAL_LEAKS_FATAL": "1"})
        assert "fakemetal" not in r.stderr, r.stderr


def test_leaked_buffer_is_reported(host):
    exe = program(host, "lifetime", "typed")
    r = run(exe, ["leak"])
    assert re.search(r"fakemetal: 2 objects leaked.*\n\s+MTLBuffer x1", r.stderr), r.stderr
    assert "MTLDevice" in r.stderr  # a buffer keeps its device alive, as in Metal
    r = run(exe, ["leak"], {"FAKEMETAL_LEAKS_FATAL": "1"}, check=False)
    assert r.returncode == 66, (r.returncode, r.stderr)


def test_message_to_released_buffer_is_use_after_release(host):
    r = run(program(host, "lifetime", "typed"), ["release-then-message"], check=False)
    assert r.returncode != 0
    assert "use-after-release: -[MTLBuffer length] sent to released object" in r.stderr, r.stderr
    assert "length after release" not in r.stderr


def test_encoder_kept_beyond_its_autorelease_pool_must_be_retained(host):
    # Encoders are autoreleased (+0), as in Metal; the command buffer does not keep them alive for the caller.
    r = run(program(host, "lifetime", "typed"), ["encoder-after-pool"], check=False)
    assert r.returncode != 0
    assert "MTLComputeCommandEncoder" in r.stderr and "released without endEncoding" in r.stderr, r.stderr


def test_reading_contents_after_release_is_heap_use_after_free_under_asan(host):
    r = run(program(host, "lifetime", "asan"), ["release-then-read"], check=False)
    assert r.returncode != 0
    assert "AddressSanitizer: heap-use-after-free" in r.stderr, r.stderr[-3000:]
    assert "lifetime.cpp" in r.stderr  # the report points at the reading line


# ------------------------------------------------------------------------------------------------------------
# Dispatch validation
# ------------------------------------------------------------------------------------------------------------


def dispatch_cases(host, cases, metal=METAL_FILES, env=None) -> dict[str, str]:
    r = run(program(host, "dispatch_cases", "typed"), [*metal, *cases], env)
    out: dict[str, str] = {}
    key = None
    for line in r.stdout.splitlines():  # "<case>: <result>", messages may continue on further lines
        m = re.match(r"([a-z-]+): (.*)", line)
        if m and m.group(1) not in out:
            key = m.group(1)
            out[key] = m.group(2)
        elif key is not None:
            out[key] += "\n" + line
    return out


def test_bad_dispatch_fails_the_command_buffer_not_the_process(host):
    out = dispatch_cases(host, ["unbound", "short", "ok", "threads", "info"])
    assert re.fullmatch(r"error Metal command buffer failed: fakemetal: encoder 0 \(concurrent\), stage 0, "
                        r"command 0 \(kernel 'row_dot'\): \[\[buffer\(3\)\]\] 'shape' \(.*\) is not bound",
                        out["unbound"]), out
    assert re.fullmatch(r"error .*\[\[buffer\(3\)\]\] 'shape' .* is bound to 4 bytes; the kernel needs at least 8",
                        out["short"]), out
    assert out["ok"] == "ok 4", out  # after two failed command buffers the device still works
    assert out["threads"] == "ok 4", out  # dispatchThreads, partial threadgroup
    # struct and double returns (objc_msgSend_stret / _fpret), string literals, pipeline limits
    assert out["info"] == "ok max=1024x1024x1024 literal=row_dot/7 pipeline=1024/32 time=ordered", out


def test_function_constant_of_the_wrong_type_is_an_nserror(host):
    out = dispatch_cases(host, ["constant-type", "ok"])
    assert re.fullmatch(r"error specialising Metal kernel 'qmv4_bf16' failed: function constant 'qmv4_group' "
                        r"\(index 0\) has type .*uint.* but was given a value of type float", out["constant-type"]), out
    assert out["ok"] == "ok 4", out


def test_msl_compile_error_is_an_nserror_with_diagnostics(host, tmp_path):
    bad = tmp_path / "broken.metal"
    bad.write_text("#include <metal_stdlib>\nusing namespace metal;\n"
                   "[[kernel]] void broken(device float* out [[buffer(0)]]) {\n  out[0] = nope;\n}\n")
    out = dispatch_cases(host, ["ok"], metal=[bad])
    assert out["library"].startswith("error compiling Lily's Metal kernels failed: Compilation failed"), out
    assert re.search(r"\.metal:4:\d+: error: use of undeclared identifier 'nope'", out["library"]), out


@pytest.mark.parametrize("reverse", [False, True], ids=["in-order", "reversed"])
def test_serial_encoder_and_resource_barriers_order_dispatches(host, reverse):
    unordered = ["no-barrier", "wrong-resource-barrier", "texture-barrier"]
    out = dispatch_cases(host, ["serial", "resource-barrier", *unordered],
                         env={"FAKEMETAL_REVERSE": "1"} if reverse else None)
    assert out["serial"] == "ok 8 handlers=1", out  # the completed handler ran once
    assert out["resource-barrier"] == "ok 8 handlers=1", out
    for case in unordered:  # the hazard check reports them in any order
        assert re.fullmatch(r"error command buffer failed: fakemetal: hazard in encoder 0 \(concurrent\), stage 0: "
                            r"command 0 \(kernel 'row_dot'\) writes bytes \[0, 4\) through buffer\(2\) and command "
                            r"1 \(kernel 'row_dot'\) may read bytes \[0, 4\) through buffer\(0\) of buffer .*", out[case]), out
    # Without the check, reversed order shows the stale read: a barrier that orders only other resources
    # (or textures) does not order t.
    out = dispatch_cases(host, unordered, env={"FAKEMETAL_HAZARDS": "0", **({"FAKEMETAL_REVERSE": "1"} if reverse else {})})
    for case in unordered:
        assert out[case] == ("ok 0 handlers=1" if reverse else "ok 8 handlers=1"), out
