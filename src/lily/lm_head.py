"""The LM head's format at load: ``Engine.from_pretrained(..., lm_head="auto" | "8bit" | "native")`` (issue 14
item 5).

The head ``lm_head [vocab, hidden]`` is the largest single matrix a decode step reads: 248320 x 2048 in
Qwen3.6-35B-A3B, 1017 MB in bf16, 540 MB as 8-bit affine with group 64 and bf16 scales and biases
(1 + 2·2/64 = 1.0625 bytes per weight). A head the checkpoint stores dense (Hugging Face bf16 / f16 / f32) is
quantized once at load by :func:`lily.quantize.quantize`, the quantizer ``lily convert`` uses: the codes, scales
and biases are the bytes ``lily convert --bits 8`` writes for it (scales and biases in the head's dtype), in
MLX's 8-bit affine layout, which every backend's 8-bit GEMV/GEMM already runs (the routers use it). No
dequantized copy is made; the dense head stays in the mapped file only. A head the checkpoint already stores
quantized (MLX checkpoints) is left as it is, whatever the option.

A tied head (``tie_word_embeddings``: the head is the embedding) gets its own 8-bit copy: the embedding keeps
its stored bf16 rows for the per-token row gather, and the head, read whole every token, reads the copy. That
costs the copy's bytes on top of the embedding (``report()["lm_head"]["tied"]`` says how many).

The MTP drafter has no head of its own: ``csrc/model/qwen36.cpp`` hands it the model's ``lm_head`` Weight (the
one built from the descriptor made here), so drafts and verification always read the same bytes.

``"auto"`` picks 8-bit where it is faster: :data:`AUTO`, one entry per backend, holds that decision, its
reason and the measurement it rests on. It applies to bf16 and f16 heads; an f32 head stays exact under
``"auto"`` (f32 checkpoints are Lily's precise reference: the parity tests compare them with float64 at 1e-4),
and ``lm_head="8bit"`` quantizes it too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .quantize import quantize

__all__ = ["LM_HEAD_OPTIONS", "AUTO", "BITS", "GROUP", "LmHead", "check_lm_head", "prepare_lm_head"]

LM_HEAD_OPTIONS = ("auto", "8bit", "native")
BITS, GROUP = 8, 64  # the routers' format (MLX affine 8-bit, group 64): every backend has kernels for it

_MIB = 1 << 20
# Quantized at load in slabs of about this many weights (lily.quantize threads over each slab's groups), so
# the float32 temporaries stay small whatever the vocabulary.
_SLAB_WEIGHTS = 1 << 24
# Metal wraps host memory without a copy only at Apple silicon's 16 KiB page alignment, in whole pages
# (csrc/metal/backend.cpp kNoCopyAlignment); the mapped checkpoint files already are.
_PAGE = 16384


@dataclass(frozen=True)
class BackendDefault:
    """What ``lm_head="auto"`` does on one backend."""

    quantize: bool  # 8-bit for bf16/f16 heads of at least min_bytes (as stored); else the stored head
    min_bytes: int
    reason: str
    # Whether the backend reads the weights from host memory after load (CPU: in place; Metal: the same pages,
    # wrapped). False: it copied them into device memory (CUDA, place_weights), so the host copy is freed.
    reads_host_memory: bool


# The one place the per-backend default lives. Figures: benchmarks/NOTES.md, "LM head: bf16 vs 8-bit"
# (benchmarks/bench_matmul.py --lm-head on the 2-vCPU AVX-512 machine, 2026-12-02).
AUTO: dict[str, BackendDefault] = {
    "cpu": BackendDefault(
        True, 64 * _MIB,
        "measured: the 8-bit GEMV is 1.4-2.4x faster once the head streams from DRAM ([32768, 1024] and larger); "
        "a cache-resident head (32 MiB and less) is no faster in 8-bit", True),
    "cuda": BackendDefault(
        True, 64 * _MIB,
        "the decode GEMV is bandwidth bound, 8-bit reads 1.0625 instead of 2 bytes per weight (the H200 "
        "measurement is pending); the CPU's threshold, so that a small model's logits have one format on both",
        False),
    "metal": BackendDefault(
        True, 64 * _MIB, "the reasoning of CUDA (bandwidth-bound GEMV, half the bytes), unmeasured", True),
}


def check_lm_head(value: object, name: str = "lm_head") -> str:
    """``value`` if it is one of :data:`LM_HEAD_OPTIONS`, else ValueError naming the argument."""
    if not isinstance(value, str) or value not in LM_HEAD_OPTIONS:
        raise ValueError(f"{name} must be one of {LM_HEAD_OPTIONS}, got {value!r}")
    return value


def describe(desc: dict) -> str:
    """A descriptor's format as the core names it, with the scales' dtype: "bf16", "q8g64-bf16"."""
    if desc["kind"] == "affine":
        return f"q{desc['bits']}g{desc['group']}-{desc['scale_dtype']}"
    return str(desc["dtype"])


def descriptor_bytes(desc: dict) -> int:
    return sum(int(np.asarray(desc[k]).nbytes) for k in ("data", "scales", "biases") if k in desc)


@dataclass
class LmHead:
    """The head an Engine loads, and why (``report()["lm_head"]``)."""

    option: str  # the lm_head argument
    backend: str
    descriptor: dict  # what the core is given for "lm_head"
    status: str  # "as stored in the checkpoint" | "8-bit affine, quantized at load" | "already quantized ..."
    reason: str
    stored_format: str
    quantize_seconds: float = 0.0
    tied: bool = False
    mtp: bool = False  # the checkpoint has an MTP block (its drafter reads this head)
    host_copy_freed: bool = False
    _default: BackendDefault | None = field(default=None, repr=False)

    @property
    def quantized_at_load(self) -> bool:
        return self.status.startswith("8-bit affine, quantized at load")

    @property
    def format(self) -> str:
        return describe(self.descriptor)

    @property
    def bytes(self) -> int:
        return descriptor_bytes(self.descriptor)

    def drop_host_copy(self, core_tensors: dict, stored: dict) -> None:
        """After the core has loaded ``core_tensors``: where the backend copied the weights into device memory,
        the quantized head's host arrays are freed (``core_tensors`` is the dict the core keeps alive; it gets
        the stored descriptor back, whose arrays are views of the mapped file)."""
        if self.quantized_at_load and self._default is not None and not self._default.reads_host_memory:
            core_tensors["lm_head"] = stored
            self.host_copy_freed = True

    def report(self) -> dict:
        d = self._default
        out = {
            "format": self.format,
            "status": self.status,
            "reason": self.reason,
            "option": self.option,
            "backend_default": ("none for this backend: the stored head" if d is None else
                                f"{self.backend}: 8-bit affine g{GROUP} for bf16/f16 heads of "
                                f"{d.min_bytes // _MIB} MiB and more ({d.reason})"),
            "bytes": self.bytes,
            "quantize_seconds": round(self.quantize_seconds, 4),
            "stored_format": self.stored_format,
        }
        if self.mtp:
            out["mtp_drafter"] = "reads this same head (the model's one lm_head Weight), as the verifier does"
        if self.quantized_at_load:
            out["resident"] = ("device memory only (the backend copied it; the host copy was freed)"
                               if self.host_copy_freed else "host memory, read in place by the backend")
        if self.tied:
            out["tied"] = (f"own {self.format} copy, {self.bytes:,} bytes on top of the embedding, which keeps its "
                           "stored rows for the row gather" if self.quantized_at_load else
                           "the head reads the embedding's bytes (no copy)")
        return out


def _page_aligned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array at a 16 KiB boundary, its allocation padded to whole 16 KiB pages."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(-(-nbytes // _PAGE) * _PAGE + _PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % _PAGE
    return raw[off:off + nbytes].view(dtype).reshape(shape)


_SCALE_DTYPES = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32}


def quantize_head(desc: dict) -> dict:
    """An 8-bit affine group-64 descriptor of the dense head ``desc`` (lily.quantize, slab by slab: the bytes
    of one call on the whole matrix, since groups never cross rows). Scales and biases keep the head's dtype."""
    rows, cols = (int(d) for d in desc["shape"])
    dt = desc["dtype"]
    data = desc["data"]
    codes = _page_aligned((rows, cols * BITS // 32), np.uint32)
    scales = _page_aligned((rows, cols // GROUP), _SCALE_DTYPES[dt])
    biases = _page_aligned((rows, cols // GROUP), _SCALE_DTYPES[dt])
    step = max(1, _SLAB_WEIGHTS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        c, s, b = quantize(data[r0:r1], GROUP, BITS, bf16=(dt == "bf16"))
        codes[r0:r1], scales[r0:r1], biases[r0:r1] = c, s, b
    return {"kind": "affine", "bits": BITS, "group": GROUP, "data": codes, "scales": scales, "biases": biases,
            "scale_dtype": dt, "shape": (rows, cols), "source": f"{desc.get('source', 'lm_head')} (8-bit at load)"}


def prepare_lm_head(tensors: dict, option: str, backend: str, *, tied: bool = False, mtp: bool = False) -> LmHead:
    """The head the core loads for ``option`` on ``backend``, quantized here when that is the choice.

    ``tensors``: the checkpoint's canonical descriptors (``tensors["lm_head"]``; for a tied head the same
    object as ``tensors["embed"]``, which is never changed). Raises ValueError naming ``lm_head`` for a bad
    option, or for ``lm_head="8bit"`` on a head whose hidden size is not a multiple of 64."""
    check_lm_head(option)
    stored = tensors["lm_head"]
    default = AUTO.get(backend)
    head = LmHead(option=option, backend=backend, descriptor=stored, status="as stored in the checkpoint",
                  reason="", stored_format=describe(stored), tied=tied, mtp=mtp, _default=default)
    rows, cols = (int(d) for d in stored["shape"])
    if stored["kind"] == "affine":
        head.status = f"already quantized in the checkpoint ({describe(stored)})"
        head.reason = f"lm_head={option!r}: a head the checkpoint stores quantized is left as it is"
        return head
    if option == "native":
        head.reason = "lm_head='native': the head as the checkpoint stores it"
        return head
    if cols % GROUP:
        if option == "8bit":
            raise ValueError(f"lm_head='8bit': the head [{rows}, {cols}] ({stored.get('source', 'lm_head')}) has "
                             f"{cols} columns, not a multiple of the group size {GROUP}")
        head.reason = f"lm_head='auto': {cols} columns are not a multiple of the group size {GROUP}"
        return head
    if option == "auto":
        size = descriptor_bytes(stored)
        if default is None:
            head.reason = f"lm_head='auto': no measured default for backend {backend!r}, so the stored head"
            return head
        if stored["dtype"] == "f32":
            head.reason = ("lm_head='auto' keeps an f32 head exact (f32 checkpoints are the precise reference); "
                           "lm_head='8bit' quantizes it")
            return head
        if not default.quantize or size < default.min_bytes:
            head.reason = (f"lm_head='auto' on {backend}: this {stored['dtype']} head is {size / _MIB:.1f} MiB, under "
                           f"the {default.min_bytes // _MIB} MiB from which 8-bit is faster, so it stays as stored")
            return head
        head.reason = (f"lm_head='auto' on {backend}: a {stored['dtype']} head of {size / _MIB:.0f} MiB (at least "
                       f"{default.min_bytes // _MIB} MiB) reads about half the bytes in 8-bit")
    else:
        head.reason = "lm_head='8bit'"
    t0 = time.perf_counter()
    head.descriptor = quantize_head(stored)
    head.quantize_seconds = time.perf_counter() - t0
    head.status = f"8-bit affine, quantized at load (from {describe(stored)})"
    return head
