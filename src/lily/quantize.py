"""MLX affine quantization in numpy (MODEL.md section 9), bit-identical to ``mlx.core.quantize`` on the CPU.

The rounding steps were checked against mlx 0.32.4 (tests/test_quantize_convert.py):

* the group minimum and maximum are taken in the input dtype and widened to float32;
* everything after that is float32: ``s = max((max - min) / n_bins, 1e-7)`` (sign chosen by which extreme
  has the larger magnitude), ``q0 = rint(edge / s)``, ``scale = edge / q0`` and ``bias = edge`` when
  ``q0 != 0``, else ``scale = s`` and ``bias = 0``;
* the codes use these **float32** scale and bias (``rint((w - bias) / scale)`` clamped to [0, n_bins]),
  not the rounded ones;
* only at the end are scales and biases rounded to the input dtype (bf16: round to nearest even).

Codes are packed LSB first into little-endian uint32 words (8 codes per word at 4 bits, 4 at 8 bits).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = [
    "SUPPORTED_BITS",
    "bf16_to_f32",
    "f32_to_bf16",
    "quantize",
    "dequantize",
    "packed_cols",
]

SUPPORTED_BITS = (4, 8)

# Groups processed per work item: 16384 groups of 64 = 1M elements (4 MB of float32 temporaries).
_GROUPS_PER_CHUNK = 1 << 14


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 data must be uint16 bit patterns, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even (NaN stays a quiet NaN)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def packed_cols(cols: int, bits: int) -> int:
    """Number of uint32 words per row of ``cols`` codes."""
    if (cols * bits) % 32:
        raise ValueError(f"{cols} columns at {bits} bits do not fill whole uint32 words")
    return cols * bits // 32


def _check_args(cols: int, group_size: int, bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported quantization bits={bits} (Lily supports {SUPPORTED_BITS})")
    if group_size <= 0 or cols % group_size:
        raise ValueError(f"last dimension {cols} is not a multiple of group_size={group_size}")
    if group_size % (32 // bits):
        raise ValueError(f"group_size={group_size} must be a multiple of {32 // bits} at {bits} bits")


def _to_f32(w: np.ndarray, bf16: bool) -> np.ndarray:
    if bf16:
        return bf16_to_f32(w)
    return w.astype(np.float32, copy=False)


def _quantize_block(w: np.ndarray, bf16: bool, group_size: int, bits: int):
    """Quantize a 2-D block [n, cols] (input dtype); returns codes uint32, scales f32, biases f32."""
    n, cols = w.shape
    g = _to_f32(w, bf16).reshape(n, cols // group_size, group_size)
    n_bins = np.float32((1 << bits) - 1)
    w_max = g.max(axis=-1)
    w_min = g.min(axis=-1)
    # Which extreme becomes the exactly representable edge: the one with the larger magnitude.
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nonzero, edge / q0, scale).astype(np.float32, copy=False)
    bias = np.where(nonzero, edge, np.float32(0)).astype(np.float32, copy=False)
    # Codes use the float32 scale and bias (not the ones rounded to the output dtype), like MLX.
    q = g - bias[..., None]
    q /= scale[..., None]
    np.rint(q, out=q)
    np.clip(q, 0, n_bins, out=q)
    q8 = q.astype(np.uint8).reshape(n, cols)
    if bits == 8:
        codes = q8.view(np.uint32)
    else:  # 4 bits: byte k holds code 2k in its low nibble and 2k+1 in its high nibble.
        codes = (q8[:, 0::2] | (q8[:, 1::2] << np.uint8(4))).view(np.uint32)
    return np.ascontiguousarray(codes), scale, bias


def _out_dtype_cast(x: np.ndarray, in_dtype: np.dtype, bf16: bool) -> np.ndarray:
    if bf16:
        return f32_to_bf16(x)
    return x.astype(in_dtype)


def quantize(
    w: np.ndarray,
    group_size: int = 64,
    bits: int = 4,
    *,
    bf16: bool = False,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Affine-quantize ``w`` along its last axis exactly like ``mx.quantize(w, group_size, bits)``.

    ``w``: float32 / float16, or uint16 bfloat16 bit patterns with ``bf16=True``; any number of leading
    dims. Returns ``(codes uint32 [..., cols*bits/32], scales [..., cols/group], biases [...])`` with
    scales and biases in the input dtype (uint16 bf16 bits when ``bf16=True``).
    """
    w = np.asarray(w)
    if bf16:
        if w.dtype != np.uint16:
            raise TypeError(f"bf16=True expects uint16 bit patterns, got {w.dtype}")
    elif w.dtype not in (np.float32, np.float16):
        raise TypeError(f"quantize expects float32/float16 (or bf16 bits with bf16=True), got {w.dtype}")
    if w.ndim < 1:
        raise ValueError("quantize needs at least one dimension")
    cols = w.shape[-1]
    _check_args(cols, group_size, bits)
    lead = w.shape[:-1]
    # View as [slabs, rows, cols] without copying strided expert slices (e.g. gate_up[:, :I, :]).
    if w.ndim == 1:
        w3 = w.reshape(1, 1, cols)
    elif w.ndim == 2:
        w3 = w[None]
    elif w.ndim == 3:
        w3 = w
    else:
        w3 = np.ascontiguousarray(w).reshape(-1, w.shape[-2], cols)
    if w3.strides[-1] != w3.itemsize:
        w3 = np.ascontiguousarray(w3)
    n_slabs, rows = w3.shape[0], w3.shape[1]
    n_groups = cols // group_size
    codes = np.empty((n_slabs, rows, cols * bits // 32), dtype=np.uint32)
    scales = np.empty((n_slabs, rows, n_groups), dtype=np.float32)
    biases = np.empty((n_slabs, rows, n_groups), dtype=np.float32)

    rows_per_chunk = max(1, _GROUPS_PER_CHUNK // max(1, n_groups))

    def work(task: tuple[int, int]) -> None:
        slab, r0 = task
        r1 = min(rows, r0 + rows_per_chunk)
        c, s, b = _quantize_block(w3[slab, r0:r1], bf16, group_size, bits)
        codes[slab, r0:r1] = c
        scales[slab, r0:r1] = s
        biases[slab, r0:r1] = b

    tasks = [(slab, r0) for slab in range(n_slabs) for r0 in range(0, rows, rows_per_chunk)]
    n_threads = threads if threads is not None else min(os.cpu_count() or 1, 16)
    if n_threads > 1 and len(tasks) > 1:
        # numpy releases the GIL inside these element-wise kernels, so threads scale.
        with ThreadPoolExecutor(max_workers=n_threads) as pool:
            list(pool.map(work, tasks))
    else:
        for t in tasks:
            work(t)

    out_s = _out_dtype_cast(scales, w.dtype, bf16)
    out_b = _out_dtype_cast(biases, w.dtype, bf16)
    return (
        codes.reshape(*lead, cols * bits // 32),
        out_s.reshape(*lead, n_groups),
        out_b.reshape(*lead, n_groups),
    )


def dequantize(
    codes: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    group_size: int = 64,
    bits: int = 4,
    *,
    bf16: bool | None = None,
) -> np.ndarray:
    """Unpack and dequantize to float32: ``w = scale * q + bias`` computed in float32.

    ``scales``/``biases`` are float32, float16 or (uint16 / ``bf16=True``) bfloat16 bits. This is the
    reference math of MODEL.md section 9; it differs from ``mx.dequantize`` on bf16 (which rounds twice
    to bf16) by at most one bf16 ulp.
    """
    codes = np.asarray(codes)
    if codes.dtype != np.uint32:
        raise TypeError(f"codes must be uint32, got {codes.dtype}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported quantization bits={bits} (Lily supports {SUPPORTED_BITS})")
    scales = np.asarray(scales)
    biases = np.asarray(biases)
    if bf16 is None:
        bf16 = scales.dtype == np.uint16
    s = bf16_to_f32(scales) if bf16 else scales.astype(np.float32)
    b = bf16_to_f32(biases) if bf16 else biases.astype(np.float32)
    lead = codes.shape[:-1]
    cols = codes.shape[-1] * 32 // bits
    if s.shape != (*lead, cols // group_size) or b.shape != s.shape:
        raise ValueError(
            f"scales/biases shape {list(s.shape)}/{list(b.shape)} do not match codes {list(codes.shape)} "
            f"at group_size={group_size}, bits={bits}"
        )
    raw = np.ascontiguousarray(codes).view(np.uint8)
    if bits == 8:
        q = raw
    else:
        q = np.empty(raw.shape[:-1] + (raw.shape[-1] * 2,), dtype=np.uint8)
        q[..., 0::2] = raw & np.uint8(0x0F)
        q[..., 1::2] = raw >> np.uint8(4)
    q = q.reshape(*lead, cols // group_size, group_size).astype(np.float32)
    w = q * s[..., None] + b[..., None]
    return w.reshape(*lead, cols)
