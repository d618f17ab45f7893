"""Device-memory traffic and shape of the Metal backend's decode step and prefill chunk, counted in the emulator.

No Mac is needed and no time is measured: the whole Metal backend (csrc/metal, metal/*.metal) runs under the
verification harness (docs/METAL_VERIFICATION.md) in its traffic build, where every load and store of every
kernel is reported to the emulator. Per dispatch it counts the DISTINCT bytes of device buffers read and written
(a byte read by many threads of one dispatch counts once: within a dispatch those re-reads are served by the
GPU's caches, across dispatches a weight read again comes from memory again), and the bytes of all accesses.

Per step (one prefill chunk, one decode step) it prints: dispatches, barrier-separated stages, bytes moved (the
sum over dispatches of distinct bytes read + written) ÷ the floor, and per kernel the same. The floor:
  weights read once  every matrix the step needs, whole (data + scales + biases), the routed experts only (the
                     experts any token of the step was routed to, found from the bytes read: a decode step must
                     show exactly top-k per layer, which is checked), the embedding rows of the step's tokens, and
                     the float vectors (norms, conv taps, A_log, dt_bias);
  + recurrent state  each DeltaNet layer's conv and recurrent state, read once and written once;
  + KV read once     each full-attention layer's K and V rows 0 .. position (the cache's dtype).
Activations, logits, routing scratch and the sampler's state are not in the floor: they are the overhead.

    python benchmarks/bench_metal_traffic.py [--size medium|tiny|full] [--layers N] [--prompt 16] [--cache DIR]
                                             [--json out.json]

--size full --layers 4 runs the real widths (vocabulary, hidden, heads, 256 experts) with one group of 3 DeltaNet
layers and 1 attention layer; the full model's step is then those measured per-layer figures times 30 and 10 plus
the fixed part (embedding, final norm, LM head, sampling), exact for a decode step, whose layers of a kind are
alike.

These are emulator traffic counts, not speed (benchmarks/NOTES.md, "Metal traffic").
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for p in (REPO / "tools", REPO / "tests" / "metal"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

CSRC = REPO / "csrc"
METAL_FILES = sorted((REPO / "metal").glob("*.metal"))
# The program of tests/metal/test_backend.py (its `traffic` mode): MetalOps + the model, loader and Session.
SOURCES = ([REPO / "tests" / "metal" / "host" / "backend_main.cpp"] + sorted((CSRC / "cpu").glob("*.cpp"))
           + sorted((CSRC / "backend").glob("*.cpp")) + sorted((CSRC / "model").glob("*.cpp"))
           + [CSRC / "runtime" / "session.cpp", CSRC / "runtime" / "sampler.cpp"])
WINDOW = re.compile(r"^checkpoint file (\d+)@(\d+)")
# Tokens generated after the prefill: the first comes from the prefill's logits (a sampling-only step), the second
# is the first decode step that runs the model (the one measured; the decode steps are all alike).
STEPS = 2


def build_program() -> Path:
    from metalsim import host

    return host.build_program(SOURCES, "traffic", "backend_main")


def checkpoint(size: str, cache: str | None, layers: int | None = None) -> Path:
    """The synthetic checkpoint of `size`; with `layers`, that config's widths with only that many layers (written
    once into `cache`, default a temp folder named by both)."""
    from lily.bench import synthetic_checkpoint

    if layers is None:
        return synthetic_checkpoint(size, cache, progress=False, log=lambda m: print(m, file=sys.stderr))
    from lily.synthetic import FULL_CONFIG, MEDIUM_CONFIG, TINY_CONFIG, write_synthetic_checkpoint

    config = dict({"tiny": TINY_CONFIG, "medium": MEDIUM_CONFIG, "full": FULL_CONFIG}[size], num_hidden_layers=layers)
    every = config.get("full_attention_interval", 4)
    if layers < every or layers % every:
        raise SystemExit(f"--layers must be a positive multiple of the full-attention interval ({every}), got {layers}")
    folder = Path(cache or Path(tempfile.gettempdir()) / f"lily-traffic-{size}-{layers}l-q4")
    if not (folder / "config.json").is_file():
        write_synthetic_checkpoint(folder, config, fmt="mlx", bits=4, seed=0)
    return folder


def run_program(exe: Path, ck_dir: Path, prompt: int, work: Path, seed: int = 0) -> tuple[list[dict], str]:
    """Runs one prefill chunk of `prompt` random tokens and STEPS greedy tokens; returns the traffic record and the
    program's output."""
    from metal_inputs import write_checkpoint_manifest

    from lily.checkpoint import load_checkpoint

    ck = load_checkpoint(ck_dir)
    write_checkpoint_manifest(ck, work)
    rng = np.random.default_rng(seed)
    rng.integers(0, ck.config.vocab_size, size=prompt, dtype=np.int32).tofile(work / "prompt.i32")
    ck.close()
    record = work / "traffic.jsonl"
    record.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEMETAL_")}
    env.update({"FAKEMETAL_TRAFFIC": str(record), "FAKEMETAL_GPU_DELAY_MS": "5"})
    r = subprocess.run([str(exe), "traffic", "--dir", str(work), "--steps", str(STEPS), *map(str, METAL_FILES)],
                       capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0 or "PASSED" not in r.stdout:
        raise RuntimeError(f"the traffic run failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}")
    return [json.loads(ln) for ln in record.read_text().splitlines()], r.stdout


class Weights:
    """The checkpoint's matrices as byte ranges of its files, and its float vectors."""

    def __init__(self, ck_dir: Path):
        from lily.checkpoint import load_checkpoint

        ck = load_checkpoint(ck_dir)
        self.config = ck.config
        bases = [np.frombuffer(f._mm, dtype=np.uint8).ctypes.data for f in ck.files]
        sizes = [len(f._mm) for f in ck.files]

        def where(a: np.ndarray) -> tuple[int, int, int]:
            p = a.__array_interface__["data"][0]
            for i, (b, n) in enumerate(zip(bases, sizes)):
                if b <= p < b + n:
                    return i, p - b, p - b + a.nbytes
            raise AssertionError("a weight lies outside the checkpoint's files")

        # name -> [(file, begin, end)] for data, scales, biases; rows
        self.parts: dict[str, list[tuple[int, int, int]]] = {}
        self.rows: dict[str, int] = {}
        self.vector_bytes = 0
        self.vector_names: set[str] = set()
        for name, t in ck.tensors.items():
            if name.startswith("mtp."):
                continue  # the MTP block (MODEL.md 7): no prefill chunk or decode step reads it
            if isinstance(t, dict):
                arrays = [t["data"]] + ([t["scales"], t["biases"]] if t["kind"] == "affine" else [])
                self.parts[name] = [where(a) for a in arrays]
                self.rows[name] = t["shape"][0]
            else:
                self.vector_bytes += np.asarray(t).size * 4
                self.vector_names.add(name)
        ck.close()

    @staticmethod
    def is_expert(name: str) -> bool:
        return ".moe.experts." in name

    def needed(self, read: dict[int, list[tuple[int, int]]]) -> tuple[int, dict]:
        """Bytes of the weights a step needs once, given the file ranges it read; and what was routed."""
        def touched(f: int, b: int, e: int) -> list[tuple[int, int]]:
            rs = read.get(f, [])
            i = max(0, bisect.bisect_right(rs, (b, 1 << 62)) - 1)
            out = []
            while i < len(rs) and rs[i][0] < e:
                if rs[i][1] > b:
                    out.append((max(b, rs[i][0]), min(e, rs[i][1])))
                i += 1
            return out

        total = 0
        experts: dict[int, set[int]] = defaultdict(set)
        embed_rows = 0
        tied = "lm_head" not in self.parts
        for name, parts in self.parts.items():
            size = sum(e - b for _, b, e in parts)
            if self.is_expert(name):
                if any(touched(*p) for p in parts):
                    total += size
                    layer, expert = re.match(r"layers\.(\d+)\.moe\.experts\.(\d+)\.", name).groups()
                    experts[int(layer)].add(int(expert))
            elif name == "embed" and not tied:
                f, b, e = parts[0]
                row = (e - b) // self.rows[name]
                rows = {r for x, y in touched(f, b, e) for r in range((x - b) // row, (y - 1 - b) // row + 1)}
                embed_rows = len(rows)
                total += embed_rows * size // self.rows[name]
            else:
                total += size
        return total + self.vector_bytes, {"experts_per_layer": {k: len(v) for k, v in sorted(experts.items())},
                                           "embed_rows": embed_rows}


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b, e in sorted(ranges):
        if out and b <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((b, e))
    return out


def category(label: str, vectors: set[str]) -> str:
    if WINDOW.match(label) or label in vectors:
        return "weights"
    if label in ("conv_state", "recurrent_state"):
        return "state"
    if label == "kv_cache":
        return "kv"
    return "other"


def analyse(record: list[dict], label: str, w: Weights, position: int, rows_read: int, max_ctx: int) -> dict:
    """The step's figures from its command buffer (the one labelled `label` with the most dispatches)."""
    cbs = [x for x in record if x["type"] == "command_buffer" and x["label"] == label]
    cb = max(cbs, key=lambda x: x["dispatches"])
    dispatches = [x for x in record if x["type"] == "dispatch" and x["cb"] == cb["cb"]]
    cfg = w.config.to_core()
    # The floor.
    read_files: dict[int, list[tuple[int, int]]] = defaultdict(list)
    kv_length = 0
    for b in cb["buffers"]:
        m = WINDOW.match(b["buffer"])
        if m:
            f, off = int(m[1]), int(m[2])
            read_files[f] += [(off + x, off + y) for x, y in b["read"]]
        if b["buffer"] == "kv_cache":
            kv_length = b["length"]
    read_files = {f: merge(r) for f, r in read_files.items()}
    weights, routed = w.needed(read_files)
    L = cfg["layers"]
    full = [bool(x) for x in cfg["full_attention"]]
    n_attn = sum(full)
    conv_dim = 2 * cfg["lin_k_heads"] * cfg["lin_k_dim"] + cfg["lin_v_heads"] * cfg["lin_v_dim"]
    state = (L - n_attn) * 2 * 4 * ((cfg["conv_kernel"] - 1) * conv_dim
                                    + cfg["lin_v_heads"] * cfg["lin_k_dim"] * cfg["lin_v_dim"])
    row = cfg["kv_heads"] * cfg["head_dim"]
    es = kv_length // (max_ctx * row) if kv_length else 4
    kv = n_attn * 2 * rows_read * row * es
    floor = weights + state + kv
    # What moved.
    per_kernel: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    per_category: dict[str, int] = defaultdict(int)
    for d in dispatches:
        k = per_kernel[d["kernel"]]
        k["dispatches"] += 1
        k["read"] += d["read"]
        k["written"] += d["written"]
        k["accessed"] += d["accessed_read"] + d["accessed_written"]
        for b in d["bindings"]:
            c = category(b["buffer"], w.vector_names)
            per_category[c] += b["read"] + b["written"]
            if c == "weights":
                k["weights"] += b["read"]
    moved = sum(d["read"] + d["written"] for d in dispatches)
    layers = per_layer(dispatches, full, w.vector_names)
    return {"layers": layers, "label": label, "position": position, "dispatches": cb["dispatches"], "stages": cb["stages"],
            "moved": moved, "floor": floor, "ratio": moved / floor,
            "floor_parts": {"weights": weights, "state": state, "kv": kv, "kv_bytes_per_element": es},
            "routed": routed, "by_category": dict(per_category),
            "accessed": sum(d["accessed_read"] + d["accessed_written"] for d in dispatches),
            "kernels": {k: dict(v) for k, v in sorted(per_kernel.items(), key=lambda kv: -(kv[1]["read"] + kv[1]["written"]))}}


CATEGORIES = ("weights", "state", "kv", "other")


def dispatch_bytes(d: dict, vectors: set[str]) -> dict[str, int]:
    """Distinct bytes a dispatch moved (read + written), by kind of buffer."""
    out = dict.fromkeys(CATEGORIES, 0)
    for b in d["bindings"]:
        out[category(b["buffer"], vectors)] += b["read"] + b["written"]
    return out


def per_layer(dispatches: list[dict], full: list[bool], vectors: set[str] | None = None) -> dict:
    """Dispatches and stages per layer, by kind of layer, in recorded order: a layer runs from the dispatch after the
    previous layer's MoE end (the first: after the embedding) to its own: moe_combine, or in decode the routed
    down pass that adds the shared expert and the residual itself (moe_down_combine); its stages are those it opens.
    The rest (embedding, final norm, LM head, sampling, position) is "fixed". With `vectors` (the checkpoint's float
    vectors, for the buffer kinds), also the bytes each kind of layer moved by kind of buffer: the mean over its
    layers ("bytes"), and the smallest and largest layer total ("moved_range"; in a decode step the layers of a kind
    move the same bytes, in a prefill chunk their routed experts differ)."""
    order = sorted(dispatches, key=lambda d: d["command"])
    ends = [i for i, d in enumerate(order) if d["kernel"] in ("moe_combine", "moe_down_combine")]
    if len(ends) != len(full):
        return {}
    kinds: dict[str, set[tuple[int, int]]] = defaultdict(set)
    moved: dict[str, list[dict[str, int]]] = defaultdict(list)
    first = next((i for i, d in enumerate(order) if d["kernel"] == "embed_rows"), None)
    if first is None:
        return {}
    start, stage0 = first + 1, order[first]["stage"]  # the first layer starts after the embedding
    in_layer = set()
    for layer, end in enumerate(ends):
        stage = order[end]["stage"]
        kind = "attention" if full[layer] else "deltanet"
        kinds[kind].add((end + 1 - start, stage - stage0))
        if vectors is not None:
            total = dict.fromkeys(CATEGORIES, 0)
            for d in order[start:end + 1]:
                for c, n in dispatch_bytes(d, vectors).items():
                    total[c] += n
            moved[kind].append(total)
        in_layer.update(range(start, end + 1))
        start, stage0 = end + 1, stage
    out = {k: {"dispatches": v[0], "stages": v[1]} for k, (v,) in ((k, tuple(v)) for k, v in kinds.items() if len(v) == 1)}
    if len(out) != len(kinds):
        return {}  # layers of one kind differ: no per-kind figure
    for kind, totals in moved.items():
        out[kind]["bytes"] = {c: sum(t[c] for t in totals) / len(totals) for c in CATEGORIES}
        sums = [sum(t.values()) for t in totals]
        out[kind]["moved_range"] = [min(sums), max(sums)]
    n_attn = sum(full)
    out["fixed"] = {"dispatches": len(order) - sum(out[k]["dispatches"] * n for k, n in
                                                 (("attention", n_attn), ("deltanet", len(full) - n_attn)) if k in out),
                    "stages": order[-1]["stage"] + 1 - sum(out[k]["stages"] * n for k, n in
                                                           (("attention", n_attn), ("deltanet", len(full) - n_attn))
                                                           if k in out)}
    if vectors is not None:
        fixed = dict.fromkeys(CATEGORIES, 0)
        for i, d in enumerate(order):
            if i not in in_layer:
                for c, n in dispatch_bytes(d, vectors).items():
                    fixed[c] += n
        out["fixed"]["bytes"] = fixed
    return out


def extrapolate(step: dict, layers: int, attention_layers: int) -> dict | None:
    """Dispatches and stages of the same step with `layers` layers of which `attention_layers` full attention,
    from the per-layer counts (an extrapolation: it assumes each kind of layer runs the same kernels at that size)."""
    per = step.get("layers")
    if not per or "attention" not in per or "deltanet" not in per:
        return None
    n = {"attention": attention_layers, "deltanet": layers - attention_layers, "fixed": 1}
    return {k: sum(per[kind][k] * n[kind] for kind in n) for k in ("dispatches", "stages")}


def extrapolate_bytes(step: dict, layers: int, attention_layers: int, kv_floor_per_layer: float) -> dict | None:
    """The bytes the same step moves with `layers` layers (`attention_layers` full attention) by kind of buffer, from
    the per-layer means, and its ratio to the floor: the weights and state as moved (every weight and state byte is
    read once: the floor, checked per step by the tests) plus the KV floor (`kv_floor_per_layer` per attention
    layer). Exact for a decode step, whose layers of a kind move the same bytes."""
    per = step.get("layers")
    if not per or any("bytes" not in per.get(k, {}) for k in ("attention", "deltanet", "fixed")):
        return None
    n = {"attention": attention_layers, "deltanet": layers - attention_layers, "fixed": 1}
    by = {c: sum(per[kind]["bytes"][c] * n[kind] for kind in n) for c in CATEGORIES}
    floor = by["weights"] + by["state"] + kv_floor_per_layer * attention_layers
    return {"bytes": by, "moved": sum(by.values()), "floor": floor, "ratio": sum(by.values()) / floor}


def report(step: dict, out=sys.stdout) -> None:
    mb = 1e6
    fp = step["floor_parts"]
    print(f"\n{step['label']} (position {step['position']}): {step['dispatches']} dispatches, {step['stages']} stages; "
          f"{step['moved'] / mb:.2f} MB moved / floor {step['floor'] / mb:.2f} MB = {step['ratio']:.3f}x", file=out)
    print(f"  floor: weights {fp['weights'] / mb:.2f} MB + state r/w {fp['state'] / mb:.2f} MB + KV read "
          f"{fp['kv'] / mb:.3f} MB; routed experts per layer {sorted(set(step['routed']['experts_per_layer'].values()))}, "
          f"embedding rows {step['routed']['embed_rows']}", file=out)
    cats = ", ".join(f"{k} {v / mb:.2f} MB" for k, v in sorted(step["by_category"].items()))
    print(f"  moved by kind of buffer: {cats}; bytes of all accesses (cache-level) {step['accessed'] / mb:.1f} MB",
          file=out)
    if step.get("layers"):
        per = ", ".join(f"{k} {v['dispatches']} dispatches / {v['stages']} stages" for k, v in step["layers"].items())
        print(f"  per layer: {per}", file=out)
        for k, v in step["layers"].items():
            if "bytes" in v:
                by = ", ".join(f"{c} {v['bytes'][c] / mb:.3f}" for c in CATEGORIES)
                spread = (f" (layers {v['moved_range'][0] / mb:.3f}-{v['moved_range'][1] / mb:.3f} MB)"
                          if "moved_range" in v else "")
                print(f"  {k} moved, MB{' per layer' if k != 'fixed' else ''}: {by}{spread}", file=out)
    print(f"  {'kernel':<28}{'disp':>6}{'read MB':>10}{'write MB':>10}{'weights MB':>12}{'÷ floor':>9}"
          f"{'access/distinct':>17}", file=out)
    for name, k in step["kernels"].items():
        moved = k["read"] + k["written"]
        print(f"  {name:<28}{k['dispatches']:>6}{k['read'] / mb:>10.3f}{k['written'] / mb:>10.3f}"
              f"{k.get('weights', 0) / mb:>12.3f}{moved / step['floor']:>9.3f}{k['accessed'] / max(moved, 1):>17.1f}",
              file=out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "medium", "full"), default="medium",
                    help="the synthetic config; full: the real widths with --layers layers (all 40 do not fit this "
                         "harness: see benchmarks/NOTES.md)")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of the synthetic model (default: the config's; --size full: 4, one full-attention "
                         "group); a multiple of the full-attention interval")
    ap.add_argument("--prompt", type=int, default=16, help="tokens of the prefill chunk (the decode step follows)")
    ap.add_argument("--cache", default=None, help="where the synthetic checkpoint is kept (default: temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    exe = build_program()
    layers = args.layers if args.layers is not None else (4 if args.size == "full" else None)
    ck = checkpoint(args.size, args.cache, layers)
    w = Weights(ck)
    with tempfile.TemporaryDirectory(prefix="lily-metal-traffic-") as tmp:
        record, out = run_program(exe, ck, args.prompt, Path(tmp))
    max_ctx = args.prompt + STEPS + 8  # run_traffic in backend_main.cpp: prompt + decode steps + 8
    prefill = analyse(record, "lily prefill chunk", w, 0, args.prompt, max_ctx)
    decode = analyse(record, "lily decode step", w, args.prompt, args.prompt + 1, max_ctx)
    print(f"Metal backend under the emulator (traffic counts, not speed), synthetic {args.size}, MLX 4-bit; "
          f"prefill chunk of {args.prompt} tokens, then one decode step ({time.perf_counter() - t0:.0f} s)")
    for ln in out.splitlines():
        if ln.startswith("traffic "):
            print("  " + ln)
    report(prefill)
    report(decode)
    from lily.synthetic import FULL_CONFIG

    L, every = FULL_CONFIG["num_hidden_layers"], FULL_CONFIG["full_attention_interval"]
    full_width = args.size == "full"
    for step in (prefill, decode):
        x = extrapolate(step, L, L // every)
        if x:
            step["full_size_extrapolation"] = x
            how = ("SCALED from the measured per-layer figures of the real widths" if full_width
                   else "EXTRAPOLATED (not run) from another size's per-layer counts")
            print(f"\n{how} to the full model's {L} layers ({L // every} full attention): "
                  f"{step['label']}: {x['dispatches']} dispatches, {x['stages']} stages "
                  f"(= fixed + {L - L // every} x deltanet + {L // every} x attention, per-layer counts above)")
        if full_width:
            n_attn = sum(w.config.to_core()["full_attention"])
            y = extrapolate_bytes(step, L, L // every, step["floor_parts"]["kv"] / max(n_attn, 1))
            if y:
                step["full_size_bytes"] = y
                by = ", ".join(f"{c} {y['bytes'][c] / 1e6:.1f}" for c in CATEGORIES)
                print(f"  moved {y['moved'] / 1e6:.1f} MB ({by} MB) / floor {y['floor'] / 1e6:.1f} MB = "
                      f"{y['ratio']:.4f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "layers": layers, "prompt": args.prompt,
                                               "prefill": prefill, "decode": decode}, indent=1))


if __name__ == "__main__":
    main()
