"""Random inputs for the Metal kernel tests (emulated and on a real GPU) and their error scales."""

from __future__ import annotations

import numpy as np

import lily._core as core


def bf16_bits(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def signed_uniform(rng, shape) -> np.ndarray:
    """Magnitudes in [0.1, 1), both signs: zeros would hide indexing and lane-order mistakes."""
    return (rng.uniform(0.1, 1.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)).astype(np.float32)


def affine4(rng, rows: int, cols: int, group: int, scale_dtype: str) -> dict:
    codes = rng.integers(0, 16, size=(rows, cols), dtype=np.uint64)
    words = (codes.reshape(rows, cols // 8, 8) << (np.arange(8, dtype=np.uint64) * 4)).sum(axis=2).astype(np.uint32)
    scales = rng.uniform(0.002, 0.05, size=(rows, cols // group)) * rng.choice([-1.0, 1.0], size=(rows, cols // group))
    biases = rng.normal(0.0, 0.3, size=(rows, cols // group))
    store = bf16_bits if scale_dtype == "bf16" else (lambda a: a.astype(np.float16))
    return {"kind": "affine", "bits": 4, "group": group, "data": np.ascontiguousarray(words),
            "scales": store(scales), "biases": store(biases), "scale_dtype": scale_dtype, "shape": (rows, cols)}


def abs_scale_qmv(x: np.ndarray, w: dict) -> np.ndarray:
    """Σ|x·w| per output row (the scale a float32 reordering error is measured against)."""
    rows, cols = w["shape"]
    row = np.stack([core.cpu_dequant_row(w, r) for r in range(rows)]).astype(np.float64)
    return np.abs(row) @ np.abs(x.astype(np.float64))


def write_checkpoint_manifest(ck, out) -> None:
    """A loaded checkpoint (lily.checkpoint.load_checkpoint) as tests/metal/host/backend_main.cpp reads it: the
    canonical weights as byte offsets into its safetensors files (the program maps the files itself), the small
    float vectors (out/vectors.f32) and the config (manifest format: ManifestSource in backend_main.cpp)."""
    from pathlib import Path

    out = Path(out)
    bases = [np.frombuffer(f._mm, dtype=np.uint8).ctypes.data for f in ck.files]
    sizes = [len(f._mm) for f in ck.files]

    def where(a: np.ndarray) -> tuple[int, int]:
        p = a.__array_interface__["data"][0]
        for i, (b, n) in enumerate(zip(bases, sizes)):
            if b <= p < b + n:
                return i, p - b
        raise AssertionError("a weight lies outside the checkpoint's files")

    core_cfg = ck.config.to_core()
    lines = [f"config {k} {v}" for k, v in core_cfg.items() if k != "full_attention"]
    lines.append("full_attention " + " ".join(str(int(b)) for b in core_cfg["full_attention"]))
    lines += [f"file {f.path}" for f in ck.files]
    vectors: list[np.ndarray] = []
    offset = 0
    for name, t in ck.tensors.items():
        if isinstance(t, dict):
            rows, cols = t["shape"]
            fi, d = where(t["data"])
            if t["kind"] == "affine":
                _, sc = where(t["scales"])
                _, bi = where(t["biases"])
                lines.append(f"matrix {name} {fi} affine {t['bits']} {t['group']} {t['scale_dtype']} {rows} {cols} "
                             f"{d} {sc} {bi}")
            else:
                lines.append(f"matrix {name} {fi} dense {t['dtype']} {rows} {cols} {d}")
        else:
            v = np.ascontiguousarray(t, dtype=np.float32).ravel()
            lines.append(f"vector {name} {v.size} {offset}")
            vectors.append(v)
            offset += v.size
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.txt").write_text("\n".join(lines) + "\n")
    np.concatenate(vectors).tofile(out / "vectors.f32")
