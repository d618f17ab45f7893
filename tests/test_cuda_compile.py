"""CI's CUDA check (no GPU needed): every kernel the model uses is compiled by NVRTC for sm_80 and sm_90.

The CUDA backend has a dry mode (options={"dry_arch": N}): no device, kernels compiled for sm_N and every
launch recorded, nothing run. Running whole models through it compiles exactly the modules a real load
would (the families derive their compile-time constants from each op's arguments); op calls at the real
Qwen3.6-35B-A3B shapes cover the specialisations the full model needs. Skipped, naming why, where the
extension was built without CUDA or NVRTC is absent (pip install nvidia-cuda-nvrtc)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lily
import lily._core as core
import lily.engine  # noqa: F401  (NVRTC search paths)
from lily.synthetic import FULL_CONFIG, TINY_CONFIG, text_config, write_synthetic_checkpoint


def _nvrtc_status() -> str:
    if not getattr(core, "has_cuda", False):
        return "the extension was built without the CUDA backend"
    try:
        core.OpBench("cuda", {"dry_arch": 90})
        core.cuda_compile("backend", [], 90)
    except Exception as e:  # NVRTC missing or too old: the message says which
        return str(e)
    return ""


WHY = _nvrtc_status()
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"CUDA compile check unavailable: {WHY}")
ARCHES = (80, 90)
CUDA_KERNELS = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "kernels"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("cuda_dry")
    return {
        "mlx4": write_synthetic_checkpoint(base / "mlx4", TINY_CONFIG, fmt="mlx", bits=4, seed=1),
        "mlx8": write_synthetic_checkpoint(base / "mlx8", TINY_CONFIG, fmt="mlx", bits=8, seed=2),
        "hf_bf16": write_synthetic_checkpoint(base / "hf", TINY_CONFIG, fmt="hf", dtype="bf16", seed=3),
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cuda_cache"))


def _dry_engine(path, arch, cache):
    return lily.Engine(lily.engine.load_checkpoint(path), backend="cuda", prefill_chunk=16,
                       backend_options={"dry_arch": arch, "cache_dir": cache})


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", ["mlx4", "mlx8", "hf_bf16"])
def test_model_compiles_dry(checkpoints, name, arch, cache):
    with _dry_engine(checkpoints[name], arch, cache) as e:
        for kv in ("f32",):
            s = e.session(max_context=256)
            s.prefill(list(range(40)))        # chunks of 16 and a tail of 8: prefill kernels
            s.step(3)                         # decode kernels
            list(s.generate(3, lily.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                                                   repetition_penalty=1.1, seed=1), stop_token_ids=[]))
            list(s.generate(2, lily.SamplingParams(temperature=0), stop_token_ids=[]))
            snap = s.snapshot()
            s.restore(snap)
            s.fork()
        r = e.report()["cuda"]
        assert r["compile"]["modules"] >= 5 and r["compile"]["compiled"] + r["compile"]["cache_hits"] == r["compile"]["modules"]
        assert r["graphs"]["launches_per_decode_step"] > 0


@pytest.mark.parametrize("verify_decode", [False, True])
@pytest.mark.parametrize("arch", ARCHES)
def test_speculative_loop_compiles_dry(tmp_path, arch, cache, verify_decode):
    """mtp="on" through the CUDA host code: drafts, the verify forward (the prefill path, or with mtp_verify_decode
    the decode kernels over k + 1 rows), the device-side accept decision and its rollback copies
    (kernels/backend.cu accept_drafts, copy_rows_at) compiled and launched, iterations queued; the report's
    decode-step figures stay those of plain decode steps."""
    path = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="mlx", bits=4, mtp_layers=1, seed=4)
    with lily.Engine(lily.engine.load_checkpoint(path), backend="cuda", prefill_chunk=16, mtp="on",
                     backend_options={"dry_arch": arch, "cache_dir": cache, "mtp_verify_decode": verify_decode}) as e:
        s = e.session(max_context=128)
        s.prefill(list(range(20)))
        list(s.generate(4, lily.SamplingParams(temperature=0), stop_token_ids=[], mtp="off"))
        plain_launches = e.report()["cuda"]["graphs"]["launches_per_decode_step"]
        for sp in (lily.SamplingParams(temperature=0), lily.SamplingParams(temperature=0.7, repetition_penalty=1.1,
                                                                           seed=2)):
            list(s.generate(12, sp, stop_token_ids=[], mtp="on", mtp_k=3))
            st = s.mtp_stats()
            assert st["steps"] > 0 and st["queued"] > 0, st
        rep = e.report()["cuda"]
        assert rep["graphs"]["launches_per_decode_step"] == plain_launches
        said = [o for o in e.report()["optimizations"] if "MTP verify" in o or "verify their k + 1 rows" in o]
        assert len(said) == 1 and said[0].startswith("not active") != verify_decode, said
        assert ("decode phase" if verify_decode else "prefill phase") in e.report()["mtp"]["loop"]
    # Dry launches do not look kernels up by name: the compiled module (in the disk cache) must define them.
    cubins = [f.read_bytes() for f in Path(cache).rglob("*.cubin")]
    for name in (b"accept_drafts", b"copy_rows_at"):
        assert any(name in c for c in cubins), name


def test_speculative_iteration_launch_counts(tmp_path, cache):
    """graphs.launches_per_speculative_iteration: the verify through the decode kernels takes fewer launches than
    the prefill path's, each draft adds the same number, and a plain decode step's count is untouched (the H200's
    decode step is launch bound: benchmarks/NOTES.md, "MTP: the accept decision on the device")."""
    path = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="mlx", bits=4, mtp_layers=1, seed=4)
    counts = {}
    for verify_decode in (False, True):
        with lily.Engine(lily.engine.load_checkpoint(path), backend="cuda", prefill_chunk=16, mtp="on",
                         backend_options={"dry_arch": 90, "cache_dir": cache,
                                          "mtp_verify_decode": verify_decode}) as e:
            s = e.session(max_context=256)
            s.prefill(list(range(30)))
            list(s.generate(4, lily.SamplingParams(temperature=0), stop_token_ids=[], mtp="off"))
            plain = e.report()["cuda"]["graphs"]["launches_per_decode_step"]
            per_k = []
            for k in (1, 2, 3):
                got = []
                # Stopped by the caller after 10 tokens: the last iteration submitted (queued) has all k drafts.
                s._core.generate(40, lily.SamplingParams(temperature=0).to_core(), [],
                                 lambda t, logits=None: (got.append(t), 0 if len(got) >= 10 else 1)[1], False, k)
                per_k.append(e.report()["cuda"]["graphs"]["launches_per_speculative_iteration"])
            assert e.report()["cuda"]["graphs"]["launches_per_decode_step"] == plain
            counts[verify_decode] = (plain, per_k)
    for plain, per_k in counts.values():
        assert per_k[0] > plain and per_k[2] - per_k[1] == per_k[1] - per_k[0] > 0, counts
    assert counts[True][1][0] < counts[False][1][0], counts


def test_a_decode_step_that_writes_a_restore_is_not_memoised(checkpoints, cache):
    """The decode step that feeds a restored snapshot's pending token also copies the restore and reads the
    snapshot's state (Session::restore writes nothing itself): a step that never recurs, begun with `once`, so the
    CUDA backend neither memoises its ops nor would capture it as a graph; the next plain step is memoised as
    always. (Without `once` the restoring step misses the encode memo once per op.)"""
    with _dry_engine(checkpoints["mlx4"], 90, cache) as e:
        memo = lambda: dict(e.report()["cuda"]["graphs"]["encode_memo"])  # noqa: E731
        s = e.session(max_context=64)
        s.prefill(list(range(20)))
        list(s.generate(3, lily.SamplingParams(), stop_token_ids=[]))  # the last id is pending
        snap = s.snapshot()
        t = e.session(max_context=64)
        t.step(5)  # t's own decode ops memoised once
        t.restore(snap)
        before = memo()
        t.logits  # the pending token's decode step (the restore's); a prefill would feed it as its chunk's row 0
        assert memo() == before
        t.step(4)  # a plain decode step: memoised
        after = memo()
        assert after["hits"] + after["misses"] > before["hits"] + before["misses"]


def _prefill_memo_run(path, cache, memo: bool):
    """Digests of every step so far after each call of a varied prefill sequence, and the prefill memo's counts."""
    greedy = lily.SamplingParams(temperature=0)
    digests = []
    with lily.Engine(lily.engine.load_checkpoint(path), backend="cuda", prefill_chunk=16,
                     backend_options={"dry_arch": 90, "cache_dir": cache, "prefill_memo": memo}) as e:
        mark = lambda: digests.append(e.report()["cuda"]["graphs"]["steps_digest"])  # noqa: E731
        counts = lambda: dict(e.report()["cuda"]["graphs"]["prefill_memo"])  # noqa: E731
        after = [counts()]  # (the first report's probe session allocates, which empties the memos: before any prefill)
        s = e.session(max_context=256)
        for n in (40, 40, 7, 16, 40):  # chunks of 16 and tails; repeats of one length
            s.reset()
            s.prefill(list(range(1, n + 1)))
            mark()
            after.append(counts())
        s.prefill(list(range(5, 12)))  # the same length, later in the context
        mark()
        list(s.generate(3, greedy, stop_token_ids=[]))  # a pending token rides the next prefill's first chunk
        mark()
        snap = s.snapshot()
        s.prefill(list(range(9)))
        mark()
        s.restore(snap)  # the next chunk reads the snapshot's state
        s.prefill(list(range(9)))
        mark()
        snaps = s.prefill_snapshots(list(range(30)), at=[s.position + 5, s.position + 30])  # captures in a chunk
        mark()
        t = e.session(max_context=256)  # another session's state and scratch
        t.prefill(list(range(40)))
        t.restore(snaps[0])
        t.prefill(list(range(40)))
        mark()
        after.append(counts())
        said = [o for o in e.report()["optimizations"] if "prefill encode memo" in o]
    return digests, after, said


def test_prefill_memo_replays_the_same_launches(checkpoints, cache):
    """The prefill encode memo (prefill_memo) changes no launch: after every call of a varied sequence (repeated and
    new chunk lengths, continuation, a pending token, a restore read by the first chunk, state captures inside a
    chunk, a second session) the digest of all steps' launches (kernel, geometry, stage, op number, argument bytes)
    equals the one with the memo off; and the repeated chunks were replayed from it."""
    on, on_counts, on_said = _prefill_memo_run(checkpoints["mlx4"], cache, True)
    off, off_counts, off_said = _prefill_memo_run(checkpoints["mlx4"], cache, False)
    assert on == off and len(set(on)) == len(on), (on, off)
    assert off_counts[-1] == {"hits": 0, "misses": 0}, off_counts
    # The 40-token prompt (16 + 16 + 8) three times (calls 1, 2 and 5): an op is recorded at its second sighting
    # (chunk 2 records what chunk 1 saw first) and replayed from its third; the third time every op replays.
    before, first, second, fourth, fifth = on_counts[0], on_counts[1], on_counts[2], on_counts[4], on_counts[5]
    ops = first["hits"] + first["misses"] - before["hits"] - before["misses"]
    assert first["hits"] == before["hits"] and second["hits"] > first["hits"], on_counts
    assert fifth["misses"] == fourth["misses"] and fifth["hits"] == fourth["hits"] + ops, on_counts
    assert on_counts[-1]["misses"] > second["misses"], on_counts  # new lengths, states and sessions: encoded
    assert len(on_said) == 1 and not on_said[0].startswith("not active"), on_said
    assert len(off_said) == 1 and off_said[0].startswith("not active"), off_said


def test_disk_cache_serves_a_second_load(checkpoints, tmp_path):
    """The first load compiles every module and writes the cache; the next load compiles nothing."""
    counts = []
    for _ in range(2):
        with _dry_engine(checkpoints["mlx4"], 90, str(tmp_path)) as e:
            s = e.session(max_context=64)
            s.prefill(list(range(20)))
            s.step(1)
            counts.append(e.report()["cuda"]["compile"])
    assert counts[0]["compiled"] == counts[0]["modules"] > 0 and counts[0]["cache_hits"] == 0
    assert counts[1]["compiled"] == 0 and counts[1]["cache_hits"] == counts[0]["modules"]
    files = list(tmp_path.rglob("*.cubin"))
    assert len(files) == counts[0]["modules"]
    # A damaged cache file is a miss (recompiled and rewritten), never a wrong kernel.
    files[0].write_bytes(files[0].read_bytes()[:100])
    with _dry_engine(checkpoints["mlx4"], 90, str(tmp_path)) as e:
        s = e.session(max_context=64)
        s.prefill(list(range(20)))
        s.step(1)
        assert e.report()["cuda"]["compile"]["compiled"] == 1


def _zeros_weight(rows, cols, fmt, experts=0):
    n = max(experts, 1)
    if fmt == "bf16":
        return {"kind": "dense", "dtype": "bf16", "shape": [rows, cols], "data": np.zeros((n * rows, cols), np.uint16),
                **({"experts": experts} if experts else {})}
    bits = 4 if fmt == "q4" else 8
    return {"kind": "affine", "shape": [rows, cols], "bits": bits, "group": 64, "scale_dtype": "bf16",
            "data": np.zeros((n * rows, cols * bits // 32), np.uint32),
            "scales": np.zeros((n * rows, cols // 64), np.uint16), "biases": np.zeros((n * rows, cols // 64), np.uint16),
            **({"experts": experts} if experts else {})}


def _full_q4_experts(b):
    """The real model's core config, its (hidden, experts, top-k, expert width), and zero 4-bit stacked gate, up and
    down weights registered on bench b."""
    c = lily.config.ModelConfig.from_dict(text_config(FULL_CONFIG) | {"model_type": "qwen3_5_moe"},
                                          source="FULL_CONFIG").to_core()
    H, E, K, I = c["hidden"], c["experts"], c["topk"], c["moe_inter"]
    return c, (H, E, K, I), (b.weight(_zeros_weight(I, H, "q4", E)), b.weight(_zeros_weight(I, H, "q4", E)),
                             b.weight(_zeros_weight(H, I, "q4", E)))


@pytest.mark.parametrize("arch", ARCHES)
def test_full_model_shapes_compile_dry(arch, cache):
    """The real model's op shapes (dry: zero-filled host arrays are only registered, never read)."""
    c = lily.config.ModelConfig.from_dict(text_config(FULL_CONFIG) | {"model_type": "qwen3_5_moe"},
                                          source="FULL_CONFIG").to_core()
    H, E, K, I = c["hidden"], c["experts"], c["topk"], c["moe_inter"]
    bench = core.OpBench("cuda", {"dry_arch": arch, "cache_dir": cache, "fused_delta": True, "attn_prefill_split": True})

    class Dry:  # outputs need no poison: nothing runs
        def __getattr__(self, name):
            return getattr(bench, name)

        def empty(self, rows, cols, dtype="f32"):
            return bench.empty(rows, cols, dtype, poison=False)

    b = Dry()
    for T, phase in ((1, "decode"), (512, "prefill"), (7, "prefill")):
        ws = b.workspace(c, T, 131072)
        x = b.empty(T, H)
        for fmt in ("q4", "q8", "bf16"):
            for n, k in ((c["lin_k_heads"] * c["lin_k_dim"] * 2 + c["lin_v_heads"] * c["lin_v_dim"], H),
                         (32, H), (1, H), (H, 4096), (H, 512), (256, H)):
                w = b.weight(_zeros_weight(n, k, fmt))
                b.run("matmul", phase, x=b.empty(T, k), w=w, out=b.empty(T, n))
        lm = b.weight(_zeros_weight(c["vocab"], H, "q4"))
        b.run("matmul", phase, x=x, w=lm, out=b.empty(T, c["vocab"]))
        for fmt in ("q4", "bf16"):
            g, u = b.weight(_zeros_weight(I, H, fmt, E)), b.weight(_zeros_weight(I, H, fmt, E))
            d = b.weight(_zeros_weight(H, I, fmt, E))
            ids, wts = b.empty(T, K, "i32"), b.empty(T, K)
            b.run("moe_route", phase, logits=b.empty(T, E), k=K, ws=ws, ids=ids, weights=wts)
            b.run("moe_experts", phase, x=x, ids=ids, weights=wts, gate=g, up=u, down=d, ws=ws, out=b.empty(T, H))
            sgp, su, sd = (b.weight(_zeros_weight(I, H, fmt)), b.weight(_zeros_weight(I, H, fmt)),
                           b.weight(_zeros_weight(H, I, fmt)))
            b.run("moe", phase, x=x, router_logits=b.empty(T, E), shared_gate_logit=b.empty(T, 1), k=K, gate=g, up=u,
                  down=d, shared_gate_proj=sgp, shared_up=su, shared_down=sd, ids=ids, weights=wts,
                  routed=b.empty(T, H), shared_g=b.empty(T, I), shared_u=b.empty(T, I), shared_act=b.empty(T, I),
                  shared=b.empty(T, H), ws=ws, h=x)
        for fmt in ("q4", "q8"):  # the grouped input projections and the router with the shared gate
            parts = ((c["lin_k_heads"] * c["lin_k_dim"] * 2 + c["lin_v_heads"] * c["lin_v_dim"], 4096, 32, 32)
                     if fmt == "q4" else (E, 1))
            kw = {}
            for i, n in enumerate(parts):
                kw[f"w{i}"], kw[f"out{i}"] = b.weight(_zeros_weight(n, H, fmt)), b.empty(T, n)
            b.run("matmuls", phase, x=x, **kw)
            # The same groups behind their norms (the model's input norm, and the residual add with the
            # post-attention norm): in decode one GEMV module with the norm compiled in (NORM 1 / 2).
            b.run("rms_norm_matmuls", phase, x=x, w=b.empty(1, H), normed=b.empty(T, H), **kw)
            b.run("add_rms_norm_matmuls", phase, a=x, b=b.empty(T, H), w=b.empty(1, H), sum=x, normed=b.empty(T, H),
                  **kw)
        shape = dict(heads=c["heads"], kv_heads=c["kv_heads"], head_dim=c["head_dim"], rotary_dim=c["rotary_dim"],
                     rope_theta=c["rope_theta"], eps=1e-6)
        hd, qh, kvh = c["head_dim"], c["heads"], c["kv_heads"]
        pos = b.empty(1, 1, "i32")
        for kv in ("f32", "bf16"):
            kc, vc = b.empty(kvh * 131072, hd, kv), b.empty(kvh * 131072, hd, kv)
            q, gate, kr = b.empty(T, qh * hd), b.empty(T, qh * hd), b.empty(T, kvh * hd)
            b.run("attn_qk_prep", phase, qg=b.empty(T, 2 * qh * hd), k=b.empty(T, kvh * hd), q_norm=b.empty(1, hd),
                  k_norm=b.empty(1, hd), pos=pos, q_out=q, gate_out=gate, k_out=kr, **shape)
            b.run("kv_append", phase, k=kr, v=b.empty(T, kvh * hd), pos=pos, k_cache=kc, v_cache=vc, max_ctx=131072, **shape)
            b.run("attn_qk_prep_append", phase, qg=b.empty(T, 2 * qh * hd), k=b.empty(T, kvh * hd),
                  v=b.empty(T, kvh * hd), q_norm=b.empty(1, hd), k_norm=b.empty(1, hd), pos=pos, q_out=q, gate_out=gate,
                  k_out=kr, k_cache=kc, v_cache=vc, max_ctx=131072, **shape)
            b.run("attention", phase, q=q, gate=gate, k_cache=kc, v_cache=vc, pos=pos, max_ctx=131072, ws=ws,
                  out=b.empty(T, qh * hd), **shape)
            if T == 7:  # few rows over a long cache: the split-KV prefill and its reduce (PF_SPLIT)
                assert "split-KV for 7 rows" in b.report()["variants"].get("attention.prefill_split", ""), kv
        dshape = dict(k_heads=c["lin_k_heads"], v_heads=c["lin_v_heads"], k_dim=c["lin_k_dim"], v_dim=c["lin_v_dim"],
                      conv_kernel=c["conv_kernel"], eps=1e-6)
        C = 2 * c["lin_k_heads"] * c["lin_k_dim"] + c["lin_v_heads"] * c["lin_v_dim"]
        VD = c["lin_v_heads"] * c["lin_v_dim"]
        st = b.empty(c["lin_v_heads"] * c["lin_k_dim"], c["lin_v_dim"])
        conv = b.empty(c["conv_kernel"] - 1, C)
        mixed = b.empty(T, C)
        b.run("conv1d_silu", phase, mixed=b.empty(T, C), conv_w=b.empty(C, c["conv_kernel"]), state_in=conv,
              state_out=conv, out=mixed)
        b.run("gated_delta", phase, qkv=mixed, b=b.empty(T, c["lin_v_heads"]), a=b.empty(T, c["lin_v_heads"]),
              A_log=b.empty(1, c["lin_v_heads"]), dt_bias=b.empty(1, c["lin_v_heads"]), state_in=st, state_out=st,
              ws=ws, out=b.empty(T, VD), **dshape)
        b.run("gated_rms_norm", phase, o=b.empty(T, VD), z=b.empty(T, VD), w=b.empty(1, c["lin_v_dim"]),
              out=b.empty(T, VD))
        # The layer's recurrence as one op: in decode the fused kernel (its own module), else the three above.
        b.run("conv_delta_norm", phase, qkv=b.empty(T, C), z=b.empty(T, VD), b=b.empty(T, c["lin_v_heads"]),
              a=b.empty(T, c["lin_v_heads"]), conv_w=b.empty(C, c["conv_kernel"]), A_log=b.empty(1, c["lin_v_heads"]),
              dt_bias=b.empty(1, c["lin_v_heads"]), norm_w=b.empty(1, c["lin_v_dim"]), conv_in=conv, conv_out=conv,
              rec_in=st, rec_out=st, mixed=mixed, delta_o=b.empty(T, VD), ws=ws, out=b.empty(T, VD), **dshape)
        if T == 1:
            v = b.report()["variants"]
            assert v.get("conv_delta_norm.decode", "").startswith("fused"), {k: x for k, x in v.items() if "delta" in k}
        b.run("rms_norm", phase, x=x, w=b.empty(1, H), out=b.empty(T, H))
        b.run("add_rms_norm", phase, a=x, b=b.empty(T, H), w=b.empty(1, H), sum=x, normed=b.empty(T, H))
        b.run("swiglu", phase, gate=b.empty(T, I), up=b.empty(T, I), out=b.empty(T, I))
        b.run("moe_combine", phase, routed=b.empty(T, H), shared=b.empty(T, H), shared_gate_logit=b.empty(T, 1), h=x)
    assert b.report()["compile"]["modules"] >= 8
    fused = {k: v for k, v in b.report()["variants"].items() if "norm_matmuls.decode" in k}
    assert len(fused) == 4 and all(v.startswith("one launch") for v in fused.values()), fused


@pytest.mark.parametrize("opts,dense_want,experts_want", [
    ({}, "f16 rows scaled by 2^e per row by a pre-pass (matmul_x_rows, once per op and x)",
     "one f16 term scaled by 2^e per row and group part (prefill_x or moe_x = f16)"),
    ({"gemm_x_rows": False}, "one f16 term scaled by 2^e per row and group part (prefill_x = f16) (gemm_x_rows=False)",
     "one f16 term scaled by 2^e per row and group part (prefill_x or moe_x = f16)"),
    ({"prefill_x": "bf16x2", "moe_x": "bf16"}, "bf16 hi+lo (prefill_x = bf16x2)",
     "one bf16 term (prefill_x or moe_x = bf16)"),
    ({"prefill_x": "bf16", "moe_x": "bf16x2"}, "one bf16 term (prefill_x = bf16)",
     "hi + lo bf16 (prefill_x or moe_x = bf16x2)"),
    ({"moe_x": "prefill", "prefill_x": "bf16"}, "one bf16 term (prefill_x = bf16)",
     "one bf16 term (prefill_x or moe_x = bf16)"),
], ids=["default_x_rows", "part_scales", "moe_bf16", "dense_bf16", "follow"])
def test_prefill_x_options_reach_their_gemms(cache, opts, dense_want, experts_want):
    """prefill_x sets the dense prefill GEMMs' activation form and moe_x the expert GEMMs' ("prefill": follow
    prefill_x); each form compiles for the real shapes, and the report names it. A dense bf16 weight refuses f16 for hi
    + lo with the reason. Bad values are refused naming the option."""
    c = lily.config.ModelConfig.from_dict(text_config(FULL_CONFIG) | {"model_type": "qwen3_5_moe"},
                                          source="FULL_CONFIG").to_core()
    H, E, K, I = c["hidden"], c["experts"], c["topk"], c["moe_inter"]
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, **opts})
    T = 64
    x = b.empty(T, H, poison=False)
    b.run("matmul", "prefill", x=x, w=b.weight(_zeros_weight(2048, H, "q4")), out=b.empty(T, 2048, poison=False))
    g, u, d = (b.weight(_zeros_weight(I, H, "q4", E)), b.weight(_zeros_weight(I, H, "q4", E)),
               b.weight(_zeros_weight(H, I, "q4", E)))
    ws = b.workspace(c, T, 4096)
    ids, wts = b.empty(T, K, "i32", poison=False), b.empty(T, K, poison=False)
    b.run("moe_route", "prefill", logits=b.empty(T, E, poison=False), k=K, ws=ws, ids=ids, weights=wts)
    b.run("moe_experts", "prefill", x=x, ids=ids, weights=wts, gate=g, up=u, down=d, ws=ws,
          out=b.empty(T, H, poison=False))
    v = b.report()["variants"]
    experts = " ".join(t for k, t in v.items() if k.startswith("moe.experts"))
    dense = " ".join(t for k, t in v.items() if k.startswith("matmul."))
    assert experts_want in experts, v
    assert dense_want in dense, v
    if not opts:  # a dense bf16 weight under the default: hi + lo, and why
        b.run("matmul", "prefill", x=x, w=b.weight(_zeros_weight(256, H, "bf16")), out=b.empty(T, 256, poison=False))
        dense_bf16 = [t for k, t in b.report()["variants"].items() if k.startswith("matmul.prefill") and "bf16 weights" in t]
        assert dense_bf16 and "prefill_x = f16 needs integer codes" in dense_bf16[0], b.report()["variants"]
    for key, bad in (("prefill_x", "f32"), ("prefill_x", 2), ("prefill_x", "prefill"), ("moe_x", "fp16")):
        with pytest.raises(ValueError, match=key):
            core.OpBench("cuda", {"dry_arch": 90, key: bad})
    for old, new in (("prefill_x_terms", "prefill_x"), ("moe_x_terms", "moe_x")):  # the replaced options, by name
        with pytest.raises(ValueError, match=f"{old} was replaced by {new}"):
            core.OpBench("cuda", {"dry_arch": 90, old: 1})
    for unknown in ("gemm_fragg", "prefill_xx", "moe_x_form"):  # misspelt: refused, not ignored
        with pytest.raises(ValueError, match=f"unknown backend option '{unknown}' for the cuda backend"):
            core.OpBench("cuda", {"dry_arch": 90, unknown: True})


@pytest.mark.parametrize("arch", ARCHES)
def test_gemm_w_double_compiles_and_reports(cache, arch):
    """gemm_w_double (on by default): the x-rows prefill GEMM with two alternating W tiles compiles at every tile
    height the real shapes take (128 rows at 4,096 x 8,192 outputs, 64 at 256 rows, 16 for a small grid) and the
    variants and the optimizations list say so; without gemm_x_rows it is not active and says why."""
    for opts, on in (({}, True), ({"gemm_w_double": False}, False),
                     ({"gemm_w_double": True, "gemm_x_rows": False}, False)):
        b = core.OpBench("cuda", {"dry_arch": arch, "cache_dir": cache, **opts})
        heights = []
        for T, N, K in ((4096, 8192, 2048), (256, 2048, 4096), (64, 256, 2048)):
            before = set(b.report()["variants"])
            b.run("matmul", "prefill", x=b.empty(T, K, poison=False), w=b.weight(_zeros_weight(N, K, "q4")),
                  out=b.empty(T, N, poison=False))
            (name, text), = (v.split(":", 1) for k, v in b.report()["variants"].items()
                             if k.startswith("matmul.prefill") and k not in before)
            assert name.endswith("_wdb") == on and ("(gemm_w_double)" in text) == on, (opts, name, text)
            heights.append(int(name.split("_m")[-1].split("_")[0]) if "_m1" in name else 64)
        if "gemm_x_rows" not in opts:
            assert heights == [128, 64, 16], heights
        said = [o for o in b.report()["optimizations"] if "gemm_w_double" in o and not o.startswith("matmul.")]
        assert len(said) == 1 and said[0].startswith("not active") != on, said
        if "gemm_x_rows" in opts:
            assert "gemm_w_double needs x as f16 rows" in said[0], said


def test_replay_timing_option(tmp_path, cache):
    """replay_timing: events around one decode replay in N (1 by default, 0 none), said in the report; anything but
    an int >= 0 is refused naming the option."""
    path = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="mlx", bits=4, seed=4)
    for opts, said in (({}, "every replayed step"), ({"replay_timing": 8}, "one replayed step in 8"),
                       ({"replay_timing": 0}, "not measured (replay_timing=0)")):
        with lily.Engine(lily.engine.load_checkpoint(path), backend="cuda",
                         backend_options={"dry_arch": 90, "cache_dir": cache, **opts}) as e:
            assert any("decode GPU time" in o and said in o for o in e.report()["optimizations"]), opts
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="replay_timing"):
            core.OpBench("cuda", {"dry_arch": 90, "replay_timing": bad})


def test_smem_carveout_option(tmp_path, cache):
    """smem_carveout: one preferred shared-memory carveout for every kernel (percent), said in the report, or -1 (the
    default: the driver's choice per kernel); anything but an int from -1 to 100 is refused naming the option."""
    path = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="mlx", bits=4, seed=4)
    for opts, said in (({}, "not active: a common shared-memory carveout (smem_carveout=-1)"),
                       ({"smem_carveout": 100}, "one shared-memory carveout for every kernel: 100%"),
                       ({"smem_carveout": 0}, "one shared-memory carveout for every kernel: 0%")):
        with lily.Engine(lily.engine.load_checkpoint(path), backend="cuda",
                         backend_options={"dry_arch": 90, "cache_dir": cache, **opts}) as e:
            s = e.session(max_context=64)
            s.prefill(list(range(10)))
            s.step(3)
            assert sum(said in o for o in e.report()["optimizations"]) == 1, (opts, e.report()["optimizations"])
    for bad in (-2, 101, 1.5, True, "50"):
        with pytest.raises(ValueError, match="smem_carveout"):
            core.OpBench("cuda", {"dry_arch": 90, "smem_carveout": bad})


def test_cuda_engine_prefills_in_chunks_of_4096_by_default(tmp_path, cache):
    """An Engine on CUDA given no prefill_chunk takes 4096 prompt tokens per forward (the CPU's default is 512); a
    session's own prefill_chunk still wins, and the engine reports the chunk it uses."""
    path = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="mlx", bits=4, seed=4)
    with lily.Engine(lily.engine.load_checkpoint(path), backend="cuda",
                     backend_options={"dry_arch": 90, "cache_dir": cache}) as e:
        assert e.prefill_chunk == 4096 == lily.engine.default_prefill_chunk("cuda")
        assert e.session(max_context=64).prefill_chunk == 4096
        assert e.session(max_context=64, prefill_chunk=32).prefill_chunk == 32
        assert e.report()["prefill_chunk"] == 4096


def test_report_lists_kernels_and_launch_shapes(tmp_path, cache):
    """report()["cuda"]["kernels"]: every kernel a prefill and a decode step loaded, with its module (family and
    defines) and each launch shape it ran with, once; registers, spills and blocks per SM need a device (None in a
    dry run: never a made-up figure)."""
    path = write_synthetic_checkpoint(tmp_path / "m", TINY_CONFIG, fmt="mlx", bits=4, seed=4)
    with lily.Engine(lily.engine.load_checkpoint(path), backend="cuda",
                     backend_options={"dry_arch": 90, "cache_dir": cache}) as e:
        s = e.session(max_context=64)
        s.prefill(list(range(10)))
        for t in (3, 4, 5):
            s.step(t)
        kernels = e.report()["cuda"]["kernels"]
    names = {k["name"] for k in kernels}
    assert {"matmul_gemm", "moe_gate_up_decode", "moe_down_decode", "attn_decode_reduce"} <= names, names
    for k in kernels:
        assert k["module"].split()[0] + ".cu" in {p.name for p in CUDA_KERNELS.glob("*.cu")}, k
        assert k["registers"] is None and k["local_bytes"] is None and k["static_smem"] is None, k
        shapes = [(ln["threads"], ln["dynamic_smem"]) for ln in k["launches"]]
        assert shapes and len(shapes) == len(set(shapes)), k  # each shape once, however many launches
        assert all(0 < t <= 1024 and ln["blocks_per_sm"] is None for (t, _), ln in zip(shapes, k["launches"])), k
    (moe,) = [k for k in kernels if k["name"] == "moe_gate_up_decode"]
    assert [ln["threads"] for ln in moe["launches"]] == [256], moe


@pytest.mark.parametrize("small", [None, False])
def test_gemm_small_tiles_compile_and_report(cache, small):
    """The real model's prefill GEMMs whose 64-row grid uses at most a quarter / half of the SMs (132 in a dry run:
    the small-N ones at T <= 512, out_proj at T = 256) compile and run 16 / 32-row tiles (unless
    gemm_small_tiles=False), the others 64-row tiles; the report says which and why."""
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache,
                              **({} if small is None else {"gemm_small_tiles": small})})
    for T, n, k, fmt, rows in ((64, 512, 2048, "q4", 16), (512, 32, 2048, "q4", 16), (512, 256, 2048, "q8", 16),
                               (512, 512, 2048, "q4", 16), (256, 2048, 4096, "q4", 32), (64, 8192, 2048, "q4", 32),
                               (512, 2048, 4096, "q4", 64), (512, 4096, 2048, "q4", 64),
                               (64, 2048, 4096, "bf16", 16), (64, 300, 100, "bf16", 16)):
        w = b.weight(_zeros_weight(n, k, fmt))
        b.run("matmul", "prefill", x=b.empty(T, k, poison=False), w=w, out=b.empty(T, n, poison=False))
        text = next(v for key, v in b.report()["variants"].items()
                    if key.startswith("matmul.prefill") and f"[{n}, {k}]" in key)
        blocks = -(-T // 64) * -(-n // 128)
        if small is False:
            assert "64-row tiles (gemm_small_tiles=False)" in text and "_m16" not in text and "_m32" not in text, text
        elif rows == 16:
            assert f"16-row tiles (the 64-row grid, {blocks} blocks, is at most a quarter of the SMs" in text, text
            assert "_m16" in text.split(":")[0], text
        elif rows == 32:
            assert f"32-row tiles (the 64-row grid, {blocks} blocks, is at most half the SMs" in text, text
            assert "_m32" in text.split(":")[0], text
        else:
            assert f"64-row tiles ({blocks} blocks, over half the SMs)" in text, text


def _prefill_gemm_variants(b):
    """The real model's prefill GEMMs at each tile height (q4 at T 64 / 256 / 512, q8, dense bf16) run on bench b:
    (format, variant name, variant text) of each."""
    for T, n, k, fmt in ((64, 512, 2048, "q4"), (256, 2048, 4096, "q4"), (512, 8192, 2048, "q4"),
                         (512, 256, 2048, "q8"), (64, 2048, 4096, "bf16")):
        b.run("matmul", "prefill", x=b.empty(T, k, poison=False), w=b.weight(_zeros_weight(n, k, fmt)),
              out=b.empty(T, n, poison=False))
        text = next(v for key, v in b.report()["variants"].items()
                    if key.startswith("matmul.prefill") and f"[{n}, {k}]" in key)
        yield fmt, text.split(":")[0], text


@pytest.mark.parametrize("frag", [None, True])
def test_gemm_frag_compiles_and_reports(cache, frag):
    """gemm_frag (off by default: measured slower on the H200): the real model's 4-bit prefill GEMMs of integer codes
    (gemm_w_f16 off) at every tile height compile with each warp widening its codes into B fragments, under each
    activation form; 8-bit and dense weights keep the converted tile; report() says which, and lists the option among
    the optimizations either way."""
    for form in ("f16", "bf16x2"):
        b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, "prefill_x": form, "gemm_w_f16": False,
                                  **({} if frag is None else {"gemm_frag": frag})})
        for fmt, name, text in _prefill_gemm_variants(b):
            if fmt == "q4" and frag:
                assert "B fragments (gemm_frag)" in text and "_frag" in name, text
            elif fmt == "q4":
                assert "a converted W tile in shared memory (gemm_frag=False)" in text and "_frag" not in name, text
            else:
                assert "B fragments" not in text and "_frag" not in name, text
        opt = " ".join(b.report()["optimizations"])
        assert ("prefill GEMMs of 4-bit codes: each warp widens" in opt) == bool(frag), opt
        assert ("not active: prefill GEMM fragment widening (gemm_frag=False" in opt) != bool(frag), opt


@pytest.mark.parametrize("option", [None, False])
def test_gemm_w_f16_compiles_and_reports(cache, option):
    """gemm_w_f16 (on by default): the real model's affine prefill GEMMs at every tile height compile with the weights
    dequantized to f16 in the shared tile when x is one f16 term; with x as bf16 hi + lo, and for dense weights, the
    codes path stays and the variant says why; report() lists the option either way."""
    wf16 = option is None
    for form in ("f16", "bf16x2"):
        b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, "prefill_x": form,
                                  **({} if option is None else {"gemm_w_f16": option})})
        for fmt, name, text in _prefill_gemm_variants(b):
            if wf16 and fmt != "bf16" and form == "f16":
                assert "weights dequantized to f16 (s·q + b) in the shared tile" in text and "_wf16" in name, text
            else:
                assert "dequantized to f16" not in text and "_wf16" not in name, text
                if wf16 and fmt != "bf16":
                    assert "(no f16 weight tile: x is not one f16 term)" in text, text
        opt = " ".join(b.report()["optimizations"])
        assert ("the weights dequantized to f16 (s·q + b) in the shared tile" in opt) == bool(wf16), opt
        assert ("not active: f16 weight tiles in the prefill GEMMs (gemm_w_f16=False)" in opt) != bool(wf16), opt


@pytest.mark.parametrize("opts,applied", [({}, True), ({"moe_w_f16": False}, False),
                                          ({"prefill_x": "bf16x2"}, False), ({"moe_frag": 0}, False),
                                          ({"moe_x_rows": False}, True)])
def test_moe_w_f16_compiles_and_reports(cache, opts, applied):
    """moe_w_f16 (on by default): the real model's MoE prefill fragment tiles of 16 and 32 rows
    compile with the experts' weights dequantized to f16 in registers when x is one f16 term; without the fragment
    tiles or with x as bf16 hi + lo the codes path stays and the variant says why; report() lists the option. The
    same for moe_x_rows (on by default: the GEMMs' x and act as f16 rows scaled once per row, with their pre-passes),
    which needs them."""
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, **opts})
    c, (H, E, K, I), (g, u, d) = _full_q4_experts(b)
    for T in (64, 1024):
        b.run("moe_experts", "prefill", x=b.empty(T, H, poison=False), ids=b.empty(T, K, "i32", poison=False),
              weights=b.empty(T, K, poison=False), gate=g, up=u, down=d, ws=b.workspace(c, T, 4096),
              out=b.empty(T, H, poison=False))
        text = b.report()["variants"]["moe.experts.prefill"]
        assert ("the experts' weights dequantized to f16 (s·q + b) in registers" in text) == applied, text
        option = opts.get("moe_w_f16", True)
        assert ("moe_w_f16 not applied: it needs the fragment tiles and x as one f16 term" in text) == \
            (option and not applied), text
        x_rows = opts.get("moe_x_rows", True) and applied
        assert ("x and act as f16 rows scaled by 2^e per row by pre-passes" in text) == x_rows, text
    opt = " ".join(b.report()["optimizations"])
    assert ("the experts' weights dequantized to f16 (s·q + b) in registers, each group part" in opt) == option, opt
    assert ("not active: f16 expert weights in the MoE prefill GEMMs (moe_w_f16=False)" in opt) != option, opt
    assert ("MoE prefill GEMMs with f16 expert weights take x and act as f16 rows" in opt) == \
        (option and opts.get("moe_x_rows", True)), opt


@pytest.mark.parametrize("pipe", [None, 0, 2, 4])
def test_moe_pipe_option_compiles_and_reports(cache, pipe):
    """moe_pipe: the MoE prefill GEMMs of the real shapes with 64-row tiles (T = 1024) stage their K blocks through
    a cp.async ring of that many stages (default 3, fitted to the device's shared memory), or, 0, through registers
    one block ahead; 16-row tiles (T = 64) keep the registers (the ring measured slower there); the report says which
    and why; decode is untouched; bad values are refused naming the option."""
    c = lily.config.ModelConfig.from_dict(text_config(FULL_CONFIG) | {"model_type": "qwen3_5_moe"},
                                          source="FULL_CONFIG").to_core()
    H, E, K, I = c["hidden"], c["experts"], c["topk"], c["moe_inter"]
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, "moe_tile64_rows": 32,
                              **({} if pipe is None else {"moe_pipe": pipe})})
    for T, bm in ((64, 16), (1024, 64)):
        x = b.empty(T, H, poison=False)
        g, u, d = (b.weight(_zeros_weight(I, H, "q4", E)), b.weight(_zeros_weight(I, H, "q4", E)),
                   b.weight(_zeros_weight(H, I, "q4", E)))
        ws = b.workspace(c, T, 4096)
        ids, wts = b.empty(T, K, "i32", poison=False), b.empty(T, K, poison=False)
        b.run("moe_experts", "prefill", x=x, ids=ids, weights=wts, gate=g, up=u, down=d, ws=ws,
              out=b.empty(T, H, poison=False))
        text = b.report()["variants"]["moe.experts.prefill"]
        assert f"{bm}-row tiles" in text, text
        stages = 3 if pipe is None else pipe
        if bm == 16:  # moe_frag's form, whatever moe_pipe says (test_moe_frag_option_compiles_and_reports)
            assert "each warp's weight codes widened to B fragments in registers" in text, text
        elif stages:
            stage = bm * 64 * 4 + 128 * 32 + 2 * 128 * 4  # A rows f32, q4 codes, scale and bias words
            assert f"cp.async ring of {stages} K blocks ({stages * stage} bytes of shared memory)" in text, text
        else:
            assert "register prefetch one K block ahead (moe_pipe = 0)" in text, text
        b.run("moe_experts", "decode", x=b.empty(1, H, poison=False), ids=b.empty(1, K, "i32", poison=False),
              weights=b.empty(1, K, poison=False), gate=g, up=u, down=d, ws=ws, out=b.empty(1, H, poison=False))
        assert "ring" not in b.report()["variants"]["moe.experts.decode"]
    # Dense bf16 experts keep the register path (the ring is for affine codes), and say so.
    g, u, d = (b.weight(_zeros_weight(I, H, "bf16", E)), b.weight(_zeros_weight(I, H, "bf16", E)),
               b.weight(_zeros_weight(H, I, "bf16", E)))
    T = 64
    ws = b.workspace(c, T, 4096)
    b.run("moe_experts", "prefill", x=b.empty(T, H, poison=False), ids=b.empty(T, K, "i32", poison=False),
          weights=b.empty(T, K, poison=False), gate=g, up=u, down=d, ws=ws, out=b.empty(T, H, poison=False))
    text = b.report()["variants"]["moe.experts.prefill"]
    assert "a shared bf16 weight tile, register prefetch one K block ahead (dense weights)" in text, text
    for bad in (1, 5, -1):
        with pytest.raises(ValueError, match="moe_pipe"):
            core.OpBench("cuda", {"dry_arch": 90, "moe_pipe": bad})


@pytest.mark.parametrize("frag", [None, 0, 4, 6])
def test_moe_frag_option_compiles_and_reports(cache, frag):
    """moe_frag: the MoE prefill GEMMs of the real shapes with 16-row tiles (T = 64, T·k/E < 32) widen each warp's
    4-bit codes into B fragments in registers, their K blocks through a cp.async ring of that many stages (default 3);
    0 keeps the shared bf16 weight tile; 8-bit experts keep it too, and the report says why; bad values are refused."""
    c = lily.config.ModelConfig.from_dict(text_config(FULL_CONFIG) | {"model_type": "qwen3_5_moe"},
                                          source="FULL_CONFIG").to_core()
    H, E, K, I = c["hidden"], c["experts"], c["topk"], c["moe_inter"]
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, **({} if frag is None else {"moe_frag": frag})})
    T = 64
    for kind in ("q4", "q8"):
        g, u, d = (b.weight(_zeros_weight(I, H, kind, E)), b.weight(_zeros_weight(I, H, kind, E)),
                   b.weight(_zeros_weight(H, I, kind, E)))
        ws = b.workspace(c, T, 4096)
        b.run("moe_experts", "prefill", x=b.empty(T, H, poison=False), ids=b.empty(T, K, "i32", poison=False),
              weights=b.empty(T, K, poison=False), gate=g, up=u, down=d, ws=ws, out=b.empty(T, H, poison=False))
        text = b.report()["variants"]["moe.experts.prefill"]
        assert "16-row tiles" in text, text
        stages = 3 if frag is None else frag
        if kind == "q4" and stages:
            stage = 16 * 64 * 4 + 256 * 48 + 2 * 256 * 4  # x rows f32, codes at a 48-byte pitch, scale and bias words
            per_sm = 3 if stages == 3 else 2  # 3 blocks' shared memory fits an H100's 228 KB with 3 stages only
            assert (f"each warp's weight codes widened to B fragments in registers, no bf16 weight tile; a cp.async "
                    f"ring of {stages} K blocks ({stages * stage} bytes of shared memory, {per_sm} blocks per SM)"
                    ) in text, text
        else:
            why = "8-bit codes" if stages else "moe_frag = 0"
            assert f"a shared bf16 weight tile, register prefetch one K block ahead ({why})" in text, text
    for bad in (1, 2, 7, -1):
        with pytest.raises(ValueError, match="moe_frag"):
            core.OpBench("cuda", {"dry_arch": 90, "moe_frag": bad})


@pytest.mark.parametrize("on", [False, True])
def test_moe_group_blocks_compiles_and_reports(cache, on):
    """moe_group_blocks: the real model's prefill grouping split over a block per 1024-pair chunk compiles and is
    named with its chunk count where there is more than one chunk (128 tokens x 8 experts: one, the single block);
    report() lists the option either way."""
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, "moe_group_blocks": on})
    c, (H, E, K, I), (g, u, d) = _full_q4_experts(b)
    for T, chunks in ((1024, 8), (128, 1)):
        b.run("moe_experts", "prefill", x=b.empty(T, H, poison=False), ids=b.empty(T, K, "i32", poison=False),
              weights=b.empty(T, K, poison=False), gate=g, up=u, down=d, ws=b.workspace(c, T, 4096),
              out=b.empty(T, H, poison=False))
        text = b.report()["variants"]["moe.experts.prefill"]
        assert (f"{chunks} chunks; moe_group_blocks" in text) == (on and chunks > 1), text
    opt = " ".join(b.report()["optimizations"])
    assert ("MoE prefill grouping split over a block per 1024-pair chunk (moe_group_blocks)" in opt) == on, opt
    assert ("not active: MoE prefill grouping across blocks (moe_group_blocks=False)" in opt) != on, opt


@pytest.mark.parametrize("opts,text", [({}, "(2 gate+up rows per warp)"), ({"moe_rows_g": 4}, "(4 gate+up rows per warp)"),
                                       ({"moe_rows_g": 1, "moe_rows_d": 64}, "64 rows per block"),
                                       ({"moe_rows_d": 16}, "16 rows per block"),
                                       ({"moe_decode_minb": 4}, "registers capped for 4 blocks per SM (moe_decode_minb)"),
                                       ({"moe_early_loads": False}, "gate/up weight loads after x is staged "
                                                                    "(moe_early_loads=False)"),
                                       ({"moe_early_loads": True}, "gate/up weight loads in flight while x is staged")])
def test_moe_decode_geometry_compiles_and_reports(cache, opts, text):
    """moe_rows_g / moe_rows_d / moe_decode_minb: the fused decode MoE of the real shapes compiles at each geometry and
    register cap, the variant names it (the default: 2 gate/up rows per warp, 8 down rows per block, no cap), and values
    outside the kernels' range are refused."""
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, **opts})
    c, (H, E, K, I), (g, u, d) = _full_q4_experts(b)
    sg, su, sd = (b.weight(_zeros_weight(I, H, "q4")), b.weight(_zeros_weight(I, H, "q4")),
                  b.weight(_zeros_weight(H, I, "q4")))
    e = lambda r, n, dt="f32": b.empty(r, n, dt, poison=False)  # noqa: E731
    h = e(1, H)
    b.run("moe", "decode", x=e(1, H), router_logits=e(1, E), shared_gate_logit=e(1, 1), k=K, gate=g, up=u, down=d,
          shared_gate_proj=sg, shared_up=su, shared_down=sd, ids=e(1, K, "i32"), weights=e(1, K), routed=e(1, H),
          shared_g=e(1, I), shared_u=e(1, I), shared_act=e(1, I), shared=e(1, H), ws=b.workspace(c, 1, 4096), h=h)
    variant = b.report()["variants"]["moe.block.decode"]
    assert "fused, 2 launches" in variant and text in variant, variant
    if "moe_rows_d" not in opts:
        assert "8 rows per block" in variant, variant
    if "moe_decode_minb" not in opts:
        assert "registers capped" not in variant, variant
    said = [o for o in b.report()["optimizations"] if "moe_decode_minb" in o and not o.startswith("moe.")]
    assert said == ([f"decode MoE kernels' registers capped for {opts['moe_decode_minb']} blocks per SM (moe_decode_minb)"]
                    if "moe_decode_minb" in opts else
                    ["not active: a register cap on the decode MoE kernels (moe_decode_minb=0): the compiler's choice"
                     + (", but 3 blocks per SM for gate/up's early loads" if opts.get("moe_early_loads", True) else "")]), said
    early = "gate/up weight loads in flight while x is staged (the shared expert's before the wait)" in variant
    assert early == (opts.get("moe_rows_g") != 4 and opts.get("moe_decode_minb", 0) <= 3
                     and opts.get("moe_early_loads", True)), variant
    for bad in ({"moe_rows_g": 3}, {"moe_rows_g": -1}, {"moe_rows_d": 0}, {"moe_rows_d": 65}, {"moe_decode_minb": 9},
                {"moe_decode_minb": -1}, {"moe_decode_minb": 2.0}, {"moe_decode_minb": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            core.OpBench("cuda", {"dry_arch": 90, **bad})


@pytest.mark.parametrize("opts,heights", [({}, (16, 16, 32, 64)), ({"moe_frag32_rows": 1}, (32, 32, 32, 64)),
                                          ({"moe_frag32_rows": 1 << 20}, (16, 16, 16, 64)),
                                          ({"moe_frag64_rows": 0}, (16, 16, 32, 32)),
                                          ({"moe_tile64_rows": 1}, (64, 64, 64, 64)),
                                          ({"moe_tile64_rows": 32}, (16, 16, 64, 64)),
                                          ({"moe_frag": 0}, (16, 16, 64, 64)),
                                          ({"moe_frag64_rows": 1}, (64, 64, 64, 64))])
def test_moe_tile_heights_compile_and_report(cache, opts, heights):
    """The MoE prefill tile height by the expected rows per expert T·k/E (2, 16, 32, 128 at T = 64, 512, 1K, 4K for the
    real shapes): 4-bit fragment tiles of 16 rows below moe_frag32_rows (default 20), of 32 rows from it (128 weight
    rows per block, a 15,360-byte ring stage) and of 64 rows from moe_frag64_rows (default 64; 128 weight rows per
    block, 2 blocks per SM; 0: never), and, by default, no 64-row shared tiles (moe_tile64_rows = 0: 32 rows per
    expert and up only for experts without fragment tiles, e.g. moe_frag = 0). Each compiles and the report says which
    and why; values out of range are refused naming the options."""
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, **opts})
    c, (H, E, K, I), (g, u, d) = _full_q4_experts(b)
    for T, bm in zip((64, 512, 1024, 4096), heights):
        ws = b.workspace(c, T, 4096)
        b.run("moe_experts", "prefill", x=b.empty(T, H, poison=False), ids=b.empty(T, K, "i32", poison=False),
              weights=b.empty(T, K, poison=False), gate=g, up=u, down=d, ws=ws, out=b.empty(T, H, poison=False))
        text = b.report()["variants"]["moe.experts.prefill"]
        assert f", {bm}-row tiles (" in text, (T, text)
        frag = opts.get("moe_frag", 3) != 0 and (bm != 64 or "moe_tile64_rows" not in opts)
        frag64 = frag and bm == 64
        assert ("each warp's weight codes widened to B fragments in registers" in text) == frag, text
        if bm == 32:
            assert f"32-row tiles (T·k/E ≥ {opts.get('moe_frag32_rows', 20)}: a second m16 tile" in text, text
            assert "a cp.async ring of 3 K blocks (46080 bytes of shared memory, 3 blocks per SM)" in text, text
        if frag64:  # 3 stages of 64 x rows (f32) + 128 weight rows of 48 bytes + their scale and bias words
            f64 = opts.get("moe_frag64_rows", 64)
            assert f"64-row tiles (T·k/E ≥ {f64}, moe_frag64_rows: four m16 tiles" in text, text
            assert "a cp.async ring of 3 K blocks (70656 bytes of shared memory, 2 blocks per SM)" in text, text
        elif bm == 64:
            t64 = opts.get("moe_tile64_rows", 0)
            assert (f"64-row tiles (T·k/E ≥ {t64}, moe_tile64_rows)" if t64 else "64-row tiles (T·k/E ≥ 32)") in text
            assert "cp.async ring of 3 K blocks" in text, text
    for bad in ({"moe_frag32_rows": 0}, {"moe_tile64_rows": -3}, {"moe_frag32_rows": (1 << 20) + 1}):
        with pytest.raises(ValueError, match="moe_frag32_rows and moe_tile64_rows"):
            core.OpBench("cuda", {"dry_arch": 90, **bad})


@pytest.mark.parametrize("mode", [None, "decode", "all", True, "off", False])
def test_pdl_modes_compile_and_report(checkpoints, cache, mode):
    """pdl = "decode" (the default; or "all" / True) builds the decode step's programmatic forms (the MoE down pass routing and
    loading its weights before it waits: PREROUTE) and the report says which launches get it; "off" / False
    neither. On sm_80 it is reported not active, naming why."""
    for arch in ARCHES:
        with lily.Engine(lily.engine.load_checkpoint(checkpoints["mlx4"]), backend="cuda", prefill_chunk=16,
                         backend_options={"dry_arch": arch, "cache_dir": cache,
                                          **({} if mode is None else {"pdl": mode})}) as e:
            s = e.session(max_context=64)
            s.prefill(list(range(20)))
            s.step(1)
            opt = " ".join(e.report()["optimizations"])
            moe = e.report()["cuda"]["variants"]["moe.block.decode"]
            on = mode not in ("off", False) and arch >= 90
            assert ("routes and loads its weights before waiting" in moe) == on, (arch, mode, moe)
            if on:
                label = "all" if mode in ("all", True) else "decode"
                assert f'programmatic dependent launch (pdl="{label}")' in opt, opt
                assert ("prefill launches without it" in opt) == (label == "decode"), opt
            elif mode in ("off", False):
                assert "not active: programmatic dependent launch (pdl=False" in opt, opt
            else:
                assert "not active: programmatic dependent launch (needs sm_90 or newer)" in opt, opt


@pytest.mark.parametrize("bad", ["sometimes", "", 2, 1.0])
def test_pdl_option_refuses_other_values(bad):
    with pytest.raises(ValueError, match="backend option pdl must be"):
        core.OpBench("cuda", {"dry_arch": 90, "pdl": bad})



@pytest.mark.parametrize("form,arch", [("narrow", 90), ("wide", 90), ("norm", 90), ("norm", 80), ("cluster", 90),
                                       ("cluster", 80)])
def test_fused_delta_forms_compile_for_the_real_shape(cache, form, arch):
    """The fused DeltaNet decode forms build for the real shape and the report names the form; "norm" and "cluster"
    (thread-block clusters) say why they compose the three kernels on sm_80; bad values of the option are refused
    naming it."""
    c = lily.config.ModelConfig.from_dict(text_config(FULL_CONFIG) | {"model_type": "qwen3_5_moe"},
                                          source="FULL_CONFIG").to_core()
    b = core.OpBench("cuda", {"dry_arch": arch, "cache_dir": cache, "fused_delta": form})
    e = lambda r, k, dt="f32": b.empty(r, k, dt, poison=False)  # noqa: E731
    Hk, Hv, Dk, Dv, K = c["lin_k_heads"], c["lin_v_heads"], c["lin_k_dim"], c["lin_v_dim"], c["conv_kernel"]
    C, VD = 2 * Hk * Dk + Hv * Dv, Hv * Dv
    conv, st = e(K - 1, C), e(Hv * Dk, Dv)
    b.run("conv_delta_norm", "decode", qkv=e(1, C), z=e(1, VD), b=e(1, Hv), a=e(1, Hv), conv_w=e(C, K),
          A_log=e(1, Hv), dt_bias=e(1, Hv), norm_w=e(1, Dv), conv_in=conv, conv_out=conv, rec_in=st, rec_out=st,
          mixed=e(1, C), delta_o=e(1, VD), ws=b.workspace(c, 1, 64), out=e(1, VD), k_heads=Hk, v_heads=Hv, k_dim=Dk,
          v_dim=Dv, conv_kernel=K, eps=1e-6)
    v = b.report()["variants"]["conv_delta_norm.decode"]
    said = [o for o in b.report()["optimizations"] if f'fused_delta="{form}"' in o]
    if arch >= 90:
        assert v.startswith("fused " + form), v
        assert len(said) == 1 and said[0].startswith("decode DeltaNet layers fused"), said
    else:
        assert v.startswith("composed") and "clusters (sm_90; this device is sm_80)" in v, v
        assert len(said) == 1 and said[0].startswith("not active"), said
    for bad in ("both", 2):
        with pytest.raises(ValueError, match="backend option fused_delta must be"):
            core.OpBench("cuda", {"dry_arch": 90, "fused_delta": bad})


@pytest.mark.parametrize("arch", ARCHES)
def test_gemv_ahead_compiles_and_reports(cache, arch):
    """gemv_ahead = 2: the dp4a decode GEMV with two weight batches loaded before its wait builds for the real
    projections (4- and 8-bit, K 2048 and 4096) and the variant says so; the default's variant does not."""
    for ahead in (1, 2):
        b = core.OpBench("cuda", {"dry_arch": arch, "cache_dir": cache, "gemv_ahead": ahead})
        for fmt, n, k in (("q4", 8192, 2048), ("q4", 2048, 4096), ("q8", 256, 2048)):
            w = b.weight(_zeros_weight(n, k, fmt))
            b.run("matmul", "decode", x=b.empty(1, k, poison=False), w=w, out=b.empty(1, n, poison=False))
        notes = [v for key, v in b.report()["variants"].items() if key.startswith("matmul.decode.")]
        assert len(notes) == 3 and all("_dp4a_" in v for v in notes), notes
        assert all(("the first two batches loaded before the wait" in v) == (ahead == 2) for v in notes), notes


@pytest.mark.parametrize("keys", [None, 16, 32])
def test_attn_prefill_keys_option_compiles_and_reports(cache, keys):
    """attn_prefill_keys: the tensor-core prefill attention of the real shape (bf16 caches) compiles with K/V tiles of
    16 keys (the default: 101 KB of shared memory, two blocks per SM) or 32 (135 KB), and the report says which;
    other values are refused naming the option."""
    c = lily.config.ModelConfig.from_dict(text_config(FULL_CONFIG) | {"model_type": "qwen3_5_moe"},
                                          source="FULL_CONFIG").to_core()
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, **({} if keys is None else {"attn_prefill_keys": keys})})
    shape = dict(heads=c["heads"], kv_heads=c["kv_heads"], head_dim=c["head_dim"], rotary_dim=c["rotary_dim"],
                 rope_theta=c["rope_theta"], eps=1e-6)
    hd, qh, kvh, T = c["head_dim"], c["heads"], c["kv_heads"], 96  # past the split-KV prefill's 64 rows
    kc, vc = b.empty(kvh * 4096, hd, "bf16", poison=False), b.empty(kvh * 4096, hd, "bf16", poison=False)
    b.run("attention", "prefill", q=b.empty(T, qh * hd, poison=False), gate=b.empty(T, qh * hd, poison=False),
          k_cache=kc, v_cache=vc, pos=b.empty(1, 1, "i32", poison=False), max_ctx=4096,
          ws=b.workspace(c, T, 4096), out=b.empty(T, qh * hd, poison=False), **shape)
    n = 16 if keys is None else keys
    text = b.report()["variants"]["attention.prefill"]
    assert f"K/V tiles of {n} rows via cp.async (2 stages, {(2 * 64 + 4 * n) * (hd * 2 + 16)} bytes" in text, text
    for bad in (8, 64, 0):
        with pytest.raises(ValueError, match="attn_prefill_keys"):
            core.OpBench("cuda", {"dry_arch": 90, "attn_prefill_keys": bad})


@pytest.mark.parametrize("opts", [{}, {"delta_chunk_rows": 0}, {"delta_chunk_rows": 513}, {"delta_chunk_mma": False},
                                  {"dry_arch": 80}])
def test_delta_chunked_form_compiles_and_reports(cache, opts):
    """The chunked (WY) DeltaNet form compiles for the real shapes (gated_delta_chunk_prep_mma / _scan_mma on the
    tensor cores by default, gated_delta_chunk_prep / _scan with delta_chunk_mma off; sm_90 and sm_80) and is chosen
    for prefill calls of at least delta_chunk_rows rows (default 64) without a state capture; every other call
    reports the sequential scan and why. Values out of range are refused naming the option."""
    c = lily.config.ModelConfig.from_dict(text_config(FULL_CONFIG) | {"model_type": "qwen3_5_moe"},
                                          source="FULL_CONFIG").to_core()
    Hk, Hv, Dk, Dv = c["lin_k_heads"], c["lin_v_heads"], c["lin_k_dim"], c["lin_v_dim"]
    b = core.OpBench("cuda", {"dry_arch": 90, "cache_dir": cache, **opts})
    dshape = dict(k_heads=Hk, v_heads=Hv, k_dim=Dk, v_dim=Dv, conv_kernel=c["conv_kernel"], eps=1e-6)
    threshold = opts.get("delta_chunk_rows", 64)
    mma = opts.get("delta_chunk_mma", True)
    suffix = "_mma" if mma else ""
    for T, capture in ((63, None), (64, None), (512, None), (512, (100, 2))):
        ws = b.workspace(c, T, 4096)
        st = b.empty(Hv * Dk, Dv, poison=False)
        kw = {}
        if capture:
            kw = dict(capture=b.empty(capture[1] * Hv * Dk, Dv, poison=False), capture_first=capture[0],
                      capture_count=capture[1])
        b.run("gated_delta", "prefill", qkv=b.empty(T, 2 * Hk * Dk + Hv * Dv, poison=False),
              b=b.empty(T, Hv, poison=False), a=b.empty(T, Hv, poison=False), A_log=b.empty(1, Hv, poison=False),
              dt_bias=b.empty(1, Hv, poison=False), state_in=st, state_out=st, ws=ws,
              out=b.empty(T, Hv * Dv, poison=False), **dshape, **kw)
        text = b.report()["variants"]["gated_delta.prefill"]
        chunked = threshold > 0 and T >= threshold and capture is None
        assert text.startswith("chunked") == chunked, (T, capture, text)
        if chunked:
            assert f"gated_delta_chunk_prep{suffix} over ({(T + 63) // 64} chunks of 64, {Hv} heads)" in text, text
            assert f"gated_delta_chunk_scan{suffix} over ({Hv}, {Dv // 32})" in text, text
            assert ("products on the tensor cores (3xTF32" in text) == mma, text
            assert ("not on the tensor cores: delta_chunk_mma=False" in text) != mma, text
        elif threshold == 0:
            assert "not chunked: delta_chunk_rows = 0" in text, text
        elif capture and T >= threshold:
            assert "not chunked: a state capture" in text, text
        else:
            assert f"not chunked: {T} rows < delta_chunk_rows = {threshold}" in text, text
    opt = " ".join(b.report()["optimizations"])
    assert ("chunked DeltaNet prefill on the tensor cores (delta_chunk_mma)" in opt) == mma, opt
    assert ("not active: the chunked DeltaNet's products on the tensor cores (delta_chunk_mma=False)" in opt) != mma
    for bad in (-1, (1 << 24) + 1):
        with pytest.raises(ValueError, match="delta_chunk_rows"):
            core.OpBench("cuda", {"dry_arch": 90, "delta_chunk_rows": bad})
