"""The CUDA backend's own ops (copy, fill, advance_position, add, embed) against the CPU, and the whole
model end to end on the GPU against the CPU backend: logits, chunked prefill, snapshots, sampling, the
decode loop's CUDA graphs and its one id read per token, and bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import lily
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

from cuda_util import affine_table, rel_err, requires_cuda

pytestmark = requires_cuda


def both(benches, fn):
    return [fn(b) for b in benches]


def test_copy_fill_add_advance(benches):
    rng = np.random.default_rng(1)
    for rows, cols in ((1, 1), (3, 5), (7, 1000), (130, 2048), (70000, 8)):  # rows past grid.y's 65535
        a = rng.normal(size=(rows, cols)).astype(np.float32)
        b = rng.normal(size=(rows, cols)).astype(np.float32)
        outs = []
        for bench in benches:
            ha, hb, out, cp = bench.tensor(a), bench.tensor(b), bench.empty(rows, cols), bench.empty(rows, cols)
            bench.run("add", a=ha, b=hb, out=out)
            bench.run("copy", src=ha, dst=cp)
            outs.append((bench.read(out), bench.read(cp)))
        assert np.array_equal(outs[0][0], outs[1][0])
        assert np.array_equal(outs[1][1], a)
    for dtype, value in (("f32", -2.5), ("i32", 7), ("bf16", 0.3)):
        got = []
        for bench in benches:
            h = bench.empty(3, 33, dtype)
            bench.run("fill", dst=bench.view(h, 1, 2), value=value)
            got.append(bench.read(h))
        np.testing.assert_array_equal(np.nan_to_num(got[0], nan=123), np.nan_to_num(got[1], nan=123))
        if dtype == "i32":
            assert (got[1][1:] == 7).all() and (got[1][0] == 0x7F7F7F7F).all()
    for bench in benches:
        p = bench.tensor(np.array([[41]], dtype=np.int32), "i32")
        q = bench.empty(1, 1, "i32")
        bench.run("advance_position", pos_in=p, pos_out=q, T=5)
        assert bench.read(q)[0, 0] == 46


def test_accept_drafts_and_copy_rows_at(benches):
    """The speculative loop's device-side accept decision and its rollback copy (Session::generate_mtp) against the
    CPU: every agreement length, a lone pending token, strided rows; blocks inside and outside the source."""
    rng = np.random.default_rng(4)
    for n in (1, 2, 5):
        for a in range(n):
            ids = rng.integers(0, 1000, size=(n, 1)).astype(np.int32)
            y = np.roll(ids, -1, axis=0).copy()
            y[a:] = rng.integers(1000, 2000, size=(n - a, 1))  # rows a.. disagree
            got = []
            for bench in benches:
                pos = bench.tensor(np.array([[41]], np.int32), "i32")
                outs = [bench.empty(1, 1, "i32") for _ in range(3)]
                bench.run("accept_drafts", ids=bench.tensor(ids, "i32"), y=bench.tensor(y, "i32"), pos_in=pos,
                          accepted=outs[0], next_id=outs[1], pos_out=outs[2])
                got.append([int(bench.read(t)[0, 0]) for t in outs])
            assert got[0] == got[1] == [a, int(y[a, 0]), 41 + a + 1], (n, a, got)
    src = rng.normal(size=(4 * 3, 130)).astype(np.float32)
    for index, offset in ((0, 0), (2, 1), (3, 0), (3, 1), (-1, 0), (5, -2)):
        old = rng.normal(size=(3, 130)).astype(np.float32)
        res = []
        for bench in benches:
            dst = bench.tensor(old)
            bench.run("copy_rows_at", src=bench.tensor(src), index=bench.tensor(np.array([[index]], np.int32), "i32"),
                      offset=offset, dst=dst)
            res.append(bench.read(dst))
        assert np.array_equal(res[0], res[1]), (index, offset)


def test_copy_between_kv_dtypes(benches):
    rng = np.random.default_rng(2)
    a = rng.normal(size=(9, 256)).astype(np.float32)
    res = []
    for bench in benches:
        f = bench.tensor(a)
        h = bench.empty(9, 256, "bf16")
        back = bench.empty(9, 256)
        bench.run("copy", src=f, dst=h)
        bench.run("copy", src=h, dst=back)
        res.append((bench.read(h), bench.read(back)))
    np.testing.assert_array_equal(res[0][0], res[1][0])
    np.testing.assert_array_equal(res[0][1], res[1][1])


@pytest.mark.parametrize("fmt", ["f32", "q4", "q8"])
def test_embed(benches, fmt):
    rng = np.random.default_rng(3)
    rows, cols = 300, 192
    if fmt == "f32":
        desc = {"kind": "dense", "dtype": "f32", "shape": [rows, cols],
                "data": rng.normal(size=(rows, cols)).astype(np.float32)}
    else:
        desc = affine_table(rng, rows, cols, 4 if fmt == "q4" else 8, 64)
    ids = rng.integers(0, rows, size=(37, 1)).astype(np.int32)
    got = []
    for bench in benches:
        w = bench.weight(desc)
        out = bench.empty(37, cols)
        bench.run("embed", ids=bench.tensor(ids, "i32"), table=w, out=out)
        got.append(bench.read(out))
    np.testing.assert_array_equal(got[0], got[1])


# ---- end to end ----

PROMPT_LEN = 48


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("cuda_e2e")
    return {
        "mlx4": write_synthetic_checkpoint(base / "mlx4", TINY_CONFIG, fmt="mlx", bits=4, seed=5),
        "mlx8": write_synthetic_checkpoint(base / "mlx8", TINY_CONFIG, fmt="mlx", bits=8, seed=6),
        "hf_bf16": write_synthetic_checkpoint(base / "hf", TINY_CONFIG, fmt="hf", dtype="bf16", seed=7),
        # f32 scales: a relative perturbation of the embedding is exact (test_logits_f16_within_the_models_own_spread)
        "mlx4_f32": write_synthetic_checkpoint(base / "mlx4_f32", TINY_CONFIG, fmt="mlx", bits=4, dtype="f32", seed=5),
        "mlx8_f32": write_synthetic_checkpoint(base / "mlx8_f32", TINY_CONFIG, fmt="mlx", bits=8, dtype="f32", seed=6),
    }


def _ids(vocab, n, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


# The default options, and the MoE expert GEMMs alone with x as one bf16 term (moe_x = "bf16"). The latter was a
# candidate default, but on these random models its logits leave the bf16 tolerance below (H200, 2026-12-04: 2.7%
# and 7.1% relative for mlx8 and mlx4, as x as one term everywhere does: benchmarks/NOTES.md), so it stays an
# option held to lily-tiny's bar (test_lily_tiny_teacher_forced_agreement) and to the chunking checks here.
# With it, prefill_chunk 16 (the sequential DeltaNet scan) against one 70-row call (the chunked form) differ by 9.5e-3 on
# mlx4 where the default options give 2.3e-4 (H200, 2026-12-04; 3.0e-3 with the scan in both): against a CPU 4.2e-2
# away, that bar measures the option's rounding, not the chunking, so its case keeps the scan (delta_chunk_rows 0).
OPTION_SETS = [({}, "default"), ({"prefill_x": "bf16x2"}, "x_hi_lo"),
               ({"moe_x": "bf16", "delta_chunk_rows": 0}, "moe_x_one_bf16_term")]


@pytest.mark.parametrize("name", ["mlx4", "mlx8", "hf_bf16"])
def test_logits_match_cpu(checkpoints, name):
    """With the prefill GEMMs' activations as bf16 hi + lo (~1e-5 per product) the random models' logits stay within
    1e-2 of the CPU's in prefill and decode. (Their default, one scaled f16 term, is held to these models' own
    spread below: at its rounding these models' routing flips.)"""
    path = checkpoints[name]
    ids = _ids(TINY_CONFIG["vocab_size"], PROMPT_LEN, 11)
    with lily.Engine.from_pretrained(path, backend="cpu") as cpu, \
            lily.Engine.from_pretrained(path, backend="cuda", backend_options={"prefill_x": "bf16x2"}) as gpu:
        sc, sg = cpu.session(), gpu.session()
        lc, lg = sc.prefill(ids, all_logits=True), sg.prefill(ids, all_logits=True)
        assert rel_err(lg, lc) < 1e-2
        for t in _ids(TINY_CONFIG["vocab_size"], 6, 12):  # decode: fp32 GEMVs
            a, b = sc.step(t), sg.step(t)
            assert rel_err(b, a) < 1e-2
        r = gpu.report()
        assert r["backend"] == "cuda" and r["cuda"]["compile"]["modules"] > 0
        assert r["cuda"]["memory_bytes"]["weights"] > 0


def _perturbed_embedding(src: Path, dst: Path, eps: float, seed: int) -> Path:
    """A copy of an MLX checkpoint with f32 scales whose embedding scales are multiplied by (1 + eps·N(0, 1)): each
    embedding row moves by ~eps relative, the size of one rounding of the model's input."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    rng = np.random.default_rng(seed)
    hit = 0
    for f in sorted(dst.glob("*.safetensors")):
        t = load_file(f)
        for k in [k for k in t if "embed_tokens" in k and k.endswith("scales")]:
            assert t[k].dtype == np.float32, (k, t[k].dtype)
            t[k] = (t[k] * (1 + eps * rng.standard_normal(t[k].shape))).astype(np.float32)
            hit += 1
        save_file(t, f, metadata={"format": "mlx"})
    assert hit == 1, hit
    return dst


@pytest.mark.parametrize("name", ["mlx4_f32", "mlx8_f32"])
def test_logits_f16_within_the_models_own_spread(checkpoints, tmp_path, name):
    """The default prefill_x = f16 (activations rounded to 11 significant bits at every prefill GEMM) on the random
    models. Their routing is ill-conditioned: the CPU's own logits move by 2.5-6.6% (max 17-31% for a token) when only
    the embedding moves by 2^-12 relative (measured on this machine's CPU backend, benchmarks/NOTES.md), so 1e-2 would
    measure chaos, not the kernels. Bar: the GPU within twice that spread of the CPU, over all tokens and for the
    median token; a wrong scale or a dropped term moves every token by O(1). (The kernels' own bounds per output:
    tests/cuda/test_matmul.py and test_moe.py; the trained model's bar: test_lily_tiny_teacher_forced_agreement.)"""
    path = checkpoints[name]
    ids = _ids(TINY_CONFIG["vocab_size"], PROMPT_LEN, 11)
    with lily.Engine.from_pretrained(path, backend="cpu") as cpu:
        lc = cpu.session().prefill(ids, all_logits=True)
    with lily.Engine.from_pretrained(_perturbed_embedding(path, tmp_path / "p", 2.0 ** -12, 1), backend="cpu") as cpu:
        lp = cpu.session().prefill(ids, all_logits=True)
    spread = rel_err(lp, lc)
    spread_median = float(np.median(np.linalg.norm(lp - lc, axis=1) / np.linalg.norm(lc, axis=1)))
    with lily.Engine.from_pretrained(path, backend="cuda") as gpu:
        lg = gpu.session().prefill(ids, all_logits=True)
        assert "one f16 term" in " ".join(gpu.report()["cuda"]["variants"].values())
    err = rel_err(lg, lc)
    per_token = np.linalg.norm(lg - lc, axis=1) / np.linalg.norm(lc, axis=1)
    print(f"{name}: f16 prefill logits {err:.3g} from the CPU's (median token {np.median(per_token):.3g}); the CPU's "
          f"own spread at a 2^-12 input perturbation {spread:.3g} (median token {spread_median:.3g})")
    assert err < 2 * spread
    assert np.median(per_token) < 2 * spread_median


@pytest.mark.parametrize("opts", [o for o, _ in OPTION_SETS], ids=[i for _, i in OPTION_SETS])
def test_chunked_prefill_and_snapshots(checkpoints, opts):
    path = checkpoints["mlx4"]
    ids = _ids(TINY_CONFIG["vocab_size"], 70, 13)
    with lily.Engine.from_pretrained(path, backend="cuda", prefill_chunk=16, backend_options=opts) as chunked, \
            lily.Engine.from_pretrained(path, backend="cuda", kv_cache_dtype="bf16", backend_options=opts) as whole:
        a = chunked.session().prefill(ids)
        s = whole.session()
        b = s.prefill(ids)
        assert rel_err(a, b) < 1e-2  # chunked vs whole, f32 vs bf16 KV
        snap = s.snapshot()
        x1 = s.step(5)
        fork = s.fork()
        s.restore(snap)
        x2 = s.step(5)
        np.testing.assert_array_equal(x1, x2)  # the same device computation from the same state
        np.testing.assert_array_equal(fork.step(9), s.step(9))


def test_decode_graphs_and_one_read_per_token(checkpoints):
    path = checkpoints["mlx4"]
    with lily.Engine.from_pretrained(path, backend="cuda") as gpu:
        s = gpu.session()
        s.prefill(_ids(TINY_CONFIG["vocab_size"], 20, 14))
        out = list(s.generate(24, lily.SamplingParams(temperature=0), stop_token_ids=[]))
        assert len(out) == 24
        g = gpu.report()["cuda"]["graphs"]
        # first sample of the call, the two alternating steps, and the report's probe step
        assert g["captured"] <= 4 and g["replayed"] >= 18, g
        assert g["capture_ms_per_graph"] > 0, g
        assert g["gpu_us_per_decode_step"] > 0, g
    with lily.Engine.from_pretrained(path, backend="cuda", backend_options={"replay_timing": 0}) as untimed:
        s = untimed.session()
        s.prefill(_ids(TINY_CONFIG["vocab_size"], 20, 14))
        assert list(s.generate(24, lily.SamplingParams(temperature=0), stop_token_ids=[])) == out
        g = untimed.report()["cuda"]["graphs"]
        assert g["replayed"] >= 18 and g["gpu_us_per_decode_step"] == 0 and g["host_us_per_decode_step"] > 0, g
        assert g["launches_per_decode_step"] > 0 and g["graph_nodes_per_decode_step"] >= g["launches_per_decode_step"]
        st = s.stats()
        assert st["generate_transfers"]["downloads"] == st["generate_transfers"]["steps"], st


def test_report_kernel_resources(checkpoints):
    """report()["cuda"]["kernels"] on a device: every kernel's registers, local memory and static shared memory from
    the driver, and for each launch shape the blocks one multiprocessor holds (at least one: it ran); the decode MoE
    kernels under moe_decode_minb=4 get at most 64 registers and 4 resident blocks of 256 threads."""
    path = checkpoints["mlx4"]
    for opts in ({}, {"moe_decode_minb": 4}):
        with lily.Engine.from_pretrained(path, backend="cuda", backend_options=opts) as gpu:
            s = gpu.session()
            s.prefill(_ids(TINY_CONFIG["vocab_size"], 20, 15))
            list(s.generate(4, lily.SamplingParams(temperature=0), stop_token_ids=[]))
            kernels = gpu.report()["cuda"]["kernels"]
        assert {"moe_gate_up_decode", "moe_down_decode", "matmul_gemm"} <= {k["name"] for k in kernels}, kernels
        for k in kernels:
            assert k["registers"] > 0 and k["local_bytes"] >= 0 and k["static_smem"] >= 0, k
            assert k["launches"] and all(ln["blocks_per_sm"] >= 1 for ln in k["launches"]), k
            if opts and k["name"] in ("moe_gate_up_decode", "moe_down_decode"):
                assert k["registers"] <= 64 and all(ln["blocks_per_sm"] >= 4 for ln in k["launches"]), k


def test_encode_memo_survives_reused_buffer_ids(checkpoints):
    """The decode encode memo keys ops by buffer ids; closing a session frees ids that the next session's
    tensors reuse at other addresses. The memo is dropped at every allocation and release, so sessions made
    one after another on one engine decode exactly as on a fresh engine (memo off)."""
    path = checkpoints["mlx4"]
    greedy = lily.SamplingParams(temperature=0)
    prompts = [_ids(TINY_CONFIG["vocab_size"], 12 + i, 30 + i) for i in range(3)]
    got = []
    with lily.Engine.from_pretrained(path, backend="cuda") as gpu:
        keep = gpu.session(max_context=512)  # a live session whose buffers stay put
        keep.prefill(prompts[0])
        for p in prompts:
            s = gpu.session(max_context=256 + 64 * len(got))  # other sizes: other addresses for reused ids
            s.prefill(p)
            got.append(list(s.generate(10, greedy, stop_token_ids=[])))
            s.close()
        got.append(list(keep.generate(10, greedy, stop_token_ids=[])))
        assert gpu.report()["cuda"]["graphs"]["encode_memo"]["hits"] > 0
    want = []
    with lily.Engine.from_pretrained(path, backend="cuda", backend_options={"encode_memo": False}) as ref:
        for p in prompts + [prompts[0]]:
            s = ref.session()
            s.prefill(p)
            want.append(list(s.generate(10, greedy, stop_token_ids=[])))
            s.close()
    assert got == want


def test_greedy_generation_matches_cpu(checkpoints):
    path = checkpoints["mlx8"]
    prompt = _ids(TINY_CONFIG["vocab_size"], 16, 15)
    with lily.Engine.from_pretrained(path, backend="cpu") as cpu, lily.Engine.from_pretrained(path, backend="cuda") as gpu:
        a = cpu.session()
        a.prefill(prompt)
        b = gpu.session()
        b.prefill(prompt)
        greedy = lily.SamplingParams(temperature=0)
        ta = a.generate(12, greedy, stop_token_ids=[])
        tb = b.generate(12, greedy, stop_token_ids=[])
        # Near-ties can flip a token between backends; the first tokens of a random model agree.
        assert list(ta)[:4] == list(tb)[:4]


def test_context_overflow_and_oom_are_clear(checkpoints):
    path = checkpoints["mlx4"]
    with lily.Engine.from_pretrained(path, backend="cuda") as gpu:
        s = gpu.session(max_context=32)
        with pytest.raises(lily.ContextOverflowError):
            s.prefill(list(range(40)))
        s.prefill(list(range(10)))  # still usable
        with pytest.raises(Exception, match="out of GPU memory|max_context"):
            gpu.session(max_context=1 << 31)
        assert s.step(3).shape == (TINY_CONFIG["vocab_size"],)


# lily-tiny's held-out text (docs/lily-tiny/heldout.txt): 2048 tokens, so that the few positions where the
# router's top-k has a near-tie (and the GPU's and CPU's rounding pick different experts, a legitimate
# difference) do not dominate the perplexity as they do on a 300-token text.
HELDOUT = Path(__file__).resolve().parents[2] / "docs" / "lily-tiny" / "heldout.txt"


def _perplexity(logits: np.ndarray, targets: list[int]) -> float:
    x = logits.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(targets)), targets].mean()))


# x as one bf16 term with the sequential DeltaNet scan: its logits sit ~1.1e-2 from the CPU's with either DeltaNet form,
# and that error's perplexity drift is +0.030% with the scan but +0.108% with the chunked form (H200, 2026-12-04); the
# defaults give +0.006% with both forms (benchmarks/NOTES.md, "Chunked DeltaNet prefill on CUDA, second attempt").
@pytest.mark.parametrize("opts", [{}, {"gemm_w_f16": False, "moe_w_f16": False}, {"prefill_x": "bf16x2"},
                                  {"prefill_x": "bf16", "delta_chunk_rows": 0}, {"moe_x": "bf16"}, {"moe_x_rows": False}],
                         ids=["default_x_f16", "codes_x_f16", "x_hi_lo", "x_one_bf16_term", "moe_x_one_bf16_term",
                              "moe_x_part_scales"])
def test_lily_tiny_teacher_forced_agreement(opts):
    """The issue's bar on the shipped model: top-1 agreement with the CPU >= 99%, perplexity within 0.1% (the default
    runs the chunked DeltaNet form for this 2048-token prefill, the GEMMs' activations as f16 rows scaled once per
    row, and their weights dequantized to f16); also with the integer codes in the MMAs (the f16-weight options off),
    with the activations as bf16 hi + lo, as one bf16 term (prefill_x = "bf16", not the default), with the MoE's alone
    as one bf16 term, and with the MoE's scaled per group part (moe_x_rows off)."""
    with lily.Engine.from_pretrained(backend="cpu") as cpu, \
            lily.Engine.from_pretrained(backend="cuda", backend_options=opts) as gpu:
        ids = cpu.tokenize(HELDOUT.read_text())[:2048]
        lc = cpu.session().prefill(ids, all_logits=True)[:-1]
        lg = gpu.session().prefill(ids, all_logits=True)[:-1]
        agree = float((lc.argmax(axis=1) == lg.argmax(axis=1)).mean())
        pc, pg = _perplexity(lc, ids[1:]), _perplexity(lg, ids[1:])
        print(f"lily-tiny {opts}: {len(ids)} tokens, top-1 agreement {agree:.4f}, perplexity cpu {pc:.5f} cuda {pg:.5f}")
        assert agree >= 0.99
        assert abs(pg - pc) / pc < 1e-3


def test_launch_modes_give_the_same_bits(checkpoints):
    """Graphs, stage branches and programmatic dependent launch change when kernels start, never what they
    compute (nor does one shared-memory carveout for every kernel), and the encode memo, the cp.async GEMV and the
    fused norms change nothing of what is computed: the
    same logits bit for bit with each switched off (a missing dependency would show here)."""
    path = checkpoints["mlx4"]
    ids = _ids(TINY_CONFIG["vocab_size"], 40, 16)
    runs = {}
    for name, opts in (("all", {"pdl": True}), ("pdl_decode", {}), ("no_pdl", {"pdl": False}),
                       ("no_branches", {"branches": False, "pdl": True}), ("carveout", {"smem_carveout": 100}),
                       ("plain", {"graphs": False, "branches": False, "pdl": False, "encode_memo": False,
                                  "gemv_async": False, "fused_norm": False})):
        with lily.Engine.from_pretrained(path, backend="cuda", backend_options=opts) as gpu:
            s = gpu.session()
            out = [s.prefill(ids, all_logits=True)]
            out += [s.step(t) for t in _ids(TINY_CONFIG["vocab_size"], 8, 17)]
            runs[name] = out
            opt = " ".join(gpu.report()["optimizations"])
            if name == "all" and gpu.report()["cuda"]["device"]["arch"] >= "sm_90":
                assert 'programmatic dependent launch (pdl="all")' in opt
            if name == "pdl_decode" and gpu.report()["cuda"]["device"]["arch"] >= "sm_90":
                assert 'programmatic dependent launch (pdl="decode")' in opt
                assert "routes and loads its weights before waiting" in gpu.report()["cuda"]["variants"]["moe.block.decode"]
            if name == "no_pdl":
                assert "not active: programmatic dependent launch (pdl=False" in opt
            memo = gpu.report()["cuda"]["graphs"]["encode_memo"]
            assert (memo["hits"] > 0) == (name != "plain"), (name, memo)
            fused = [v for k, v in gpu.report()["cuda"]["variants"].items() if "norm_matmuls.decode" in k]
            assert fused and all(v.startswith("one launch") != (name == "plain") for v in fused), (name, fused)
    for name in ("pdl_decode", "no_pdl", "no_branches", "carveout", "plain"):
        for a, b in zip(runs["all"], runs[name]):
            np.testing.assert_array_equal(a, b, err_msg=name)
