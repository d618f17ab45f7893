"""Checkpoint loading: safetensors parsing (memory-mapped, zero-copy), format detection and the canonical
weight set handed to the C++ core (MODEL.md sections 8 and 9).

Canonical names (the contract with ``lily._core``)::

    embed, lm_head, final_norm
    layers.{i}.input_norm, layers.{i}.post_norm
    layers.{i}.delta.{qkv,z,b,a,out,conv,dt_bias,A_log,norm}        (linear-attention layers)
    layers.{i}.attn.{q,k,v,o,q_norm,k_norm}                          (full-attention layers)
    layers.{i}.moe.{router,shared_gate}, layers.{i}.moe.shared.{gate,up,down}
    layers.{i}.moe.experts.{e}.{gate,up,down}
    mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm      (the MTP block, MODEL.md 7)
    mtp.layers.{j}.*                  (full-attention decoder layers: the names of layers.{i} above)

The MTP block is optional: a checkpoint without ``mtp.*`` tensors has none (``Checkpoint.mtp_layers``
is 0; mlx-lm conversions drop them), one with some must hold all of them.

Matrices are descriptors (dicts) whose arrays are read-only views into the memory-mapped files; vectors
are small float32 arrays (RMSNorm1p weights already turned into their effective multiplier ``1 + w``).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .config import ModelConfig, brief, read_json_file
from .errors import CheckpointError
from .quantize import bf16_to_f32

__all__ = [
    "Checkpoint",
    "SafetensorsFile",
    "SafetensorsWriter",
    "TensorInfo",
    "load_checkpoint",
    "list_weight_files",
    "SAFETENSORS_DTYPES",
]

# safetensors dtype -> (numpy dtype used for the view, itemsize). bf16 is viewed as uint16 bits and the
# float8 kinds as uint8 bytes (Lily rejects them later, but a file holding them is still well-formed).
SAFETENSORS_DTYPES: dict[str, tuple[np.dtype, int]] = {
    "BOOL": (np.dtype(np.bool_), 1),
    "U8": (np.dtype(np.uint8), 1),
    "I8": (np.dtype(np.int8), 1),
    "F8_E4M3": (np.dtype(np.uint8), 1),
    "F8_E5M2": (np.dtype(np.uint8), 1),
    "U16": (np.dtype("<u2"), 2),
    "I16": (np.dtype("<i2"), 2),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "U32": (np.dtype("<u4"), 4),
    "I32": (np.dtype("<i4"), 4),
    "F32": (np.dtype("<f4"), 4),
    "U64": (np.dtype("<u8"), 8),
    "I64": (np.dtype("<i8"), 8),
    "F64": (np.dtype("<f8"), 8),
}
_FLOAT_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}

# A header is a few MB even for 100k tensors; more than this is a corrupt length field.
_MAX_HEADER_BYTES = 256 << 20
# numpy 1.x arrays have at most 32 dimensions. A dim above 2**48 can only belong to an empty tensor (a
# non-empty one must fit in the file) and would overflow numpy's size arithmetic.
_MAX_NDIM = 32
_MAX_DIM = 1 << 48
# model.safetensors.index.json of the real model is ~4 MB (about 30k per-expert names).
_MAX_INDEX_BYTES = 256 << 20

# Supported by MLX's affine mode; Lily's kernels take bits 4 and 8.
_AFFINE_BITS_KNOWN = (2, 3, 4, 5, 6, 8)
_AFFINE_BITS_SUPPORTED = (4, 8)
_AFFINE_GROUPS = (32, 64, 128)


# ------------------------------------------------------------------------------------------------
# safetensors reading
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One safetensors file, validated and memory-mapped read-only. Arrays are views (never copies)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = self.path.name
        self._mm: mmap.mmap | None = None
        try:
            # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (no effect on files).
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise CheckpointError(f"safetensors file '{self.path}' does not exist") from None
        except OSError as e:
            raise CheckpointError(f"cannot open safetensors file '{self.path}': {e}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"'{self.path}' is not a regular file (a safetensors file was expected)")
            size = st.st_size
            if size < 8:
                raise CheckpointError(f"'{self.name}' is too short ({size} bytes) to be a safetensors file")
            head = os.pread(fd, 8, 0)
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise CheckpointError(
                    f"'{self.name}': header length {n} exceeds the file size ({size} bytes); "
                    "the file is truncated or not a safetensors file"
                )
            if n > _MAX_HEADER_BYTES:
                raise CheckpointError(f"'{self.name}': header length {n} is absurd (corrupt file)")
            raw = os.pread(fd, n, 8)
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise CheckpointError(f"cannot read safetensors file '{self.path}': {e}") from e
        finally:
            os.close(fd)  # the map keeps its own reference to the file
        self.size = size
        self.data_start = 8 + n
        self.metadata, self.tensors = self._parse_header(raw, n)

    def _parse_header(self, raw: bytes, n: int) -> tuple[dict, dict[str, TensorInfo]]:
        try:
            header = json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise CheckpointError(f"'{self.name}': the safetensors header is not valid JSON (nested too deeply)") from None
        except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, ints of > 4300 digits
            raise CheckpointError(f"'{self.name}': the safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(
                f"'{self.name}': the safetensors header must be a JSON object, got {type(header).__name__}"
            )
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata
        # The format defines __metadata__ as an optional string -> string map (the safetensors library
        # rejects anything else).
        if not isinstance(metadata, dict):
            raise CheckpointError(
                f"'{self.name}': header field '__metadata__' must be an object, got {type(metadata).__name__}"
            )
        for key, value in metadata.items():
            if not isinstance(value, str):
                raise CheckpointError(
                    f"'{self.name}': header field '__metadata__.{key}' must be a string, got {type(value).__name__}"
                )
        data_len = self.size - self.data_start
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            where = f"tensor '{name}' in '{self.name}'"
            if not isinstance(entry, dict):
                raise CheckpointError(f"{where}: header entry must be an object, got {type(entry).__name__}")
            dtype = entry.get("dtype")
            if not isinstance(dtype, str):
                raise CheckpointError(
                    f"{where}: header field 'dtype' must be a string, got {type(dtype).__name__} {brief(dtype)}"
                )
            if dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{where} has unknown dtype {brief(dtype)}")
            shape = entry.get("shape")
            if (
                not isinstance(shape, list)
                or len(shape) > _MAX_NDIM
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_DIM for d in shape)
            ):
                raise CheckpointError(
                    f"{where}: header field 'shape' must be a list of at most {_MAX_NDIM} ints in "
                    f"[0, {_MAX_DIM}], got {brief(shape)}"
                )
            offs = entry.get("data_offsets")
            if (
                not isinstance(offs, list)
                or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            ):
                raise CheckpointError(f"{where}: header field 'data_offsets' must be two ints, got {brief(offs)}")
            begin, end = offs
            if not (0 <= begin <= end <= data_len):
                raise CheckpointError(
                    f"{where}: data_offsets [{brief(begin)}, {brief(end)}] are outside the data section "
                    f"({data_len} bytes; the file is truncated or corrupt)"
                )
            itemsize = SAFETENSORS_DTYPES[dtype][1]
            # Python ints: the product of 32 dims of up to 2**48 cannot overflow (np.prod in int64 could).
            expected = math.prod(shape) * itemsize
            if end - begin != expected:
                raise CheckpointError(
                    f"{where}: data span {end - begin} bytes does not match shape {shape} x {itemsize} "
                    f"bytes ({brief(expected)}); the file is truncated or corrupt"
                )
            tensors[name] = TensorInfo(name, dtype, tuple(shape), self.data_start + begin, self.data_start + end)
        spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.end > t.start)
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise CheckpointError(f"'{self.name}': tensors '{n0}' and '{n1}' overlap in the data section")
        return metadata, tensors

    def array(self, name: str) -> np.ndarray:
        """Read-only view of tensor ``name`` (bf16 as uint16 bits)."""
        info = self.tensors[name]
        if self._mm is None:
            raise CheckpointError(f"'{self.name}' is closed")
        dt, itemsize = SAFETENSORS_DTYPES[info.dtype]
        count = info.nbytes // itemsize
        if count == 0:
            return np.empty(info.shape, dtype=dt)
        arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=info.start)
        return arr.reshape(info.shape)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views are still alive somewhere; the map is freed when they go
            self._mm = None

    def __repr__(self) -> str:
        return f"SafetensorsFile('{self.path}', {len(self.tensors)} tensors)"


def list_weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """The safetensors files of a checkpoint folder: ``(files, weight_map or None, index path or None)``.

    Uses ``model.safetensors.index.json`` when present, else ``model.safetensors``, else every
    ``*.safetensors`` in the folder.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json_file(index, _MAX_INDEX_BYTES)
        if not isinstance(data, dict):
            raise CheckpointError(f"'{index.name}' must hold a JSON object, got {type(data).__name__}")
        wm = data.get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(
                f"'{index.name}': field 'weight_map' must be an object (tensor name -> file name), "
                f"got {type(wm).__name__}"
            )
        for k, v in wm.items():
            if not isinstance(v, str):
                raise CheckpointError(
                    f"'{index.name}': field 'weight_map' entry '{k}' must be a file name string, got {brief(v)}"
                )
        names = sorted(set(wm.values()))
        for n in names:
            # A NUL byte or a lone surrogate cannot name a file (os.stat raises ValueError on them).
            if Path(n).name != n or n in ("", ".", "..") or not n.isprintable():
                raise CheckpointError(f"'{index.name}' points to {brief(n)}, which is not a file in the folder")
            if not (folder / n).is_file():
                raise CheckpointError(f"'{index.name}' points to {brief(n)}, which does not exist in '{folder}'")
        return [folder / n for n in names], wm, index
    single = folder / "model.safetensors"
    if single.is_file():
        return [single], None, None
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"no *.safetensors files in '{folder}'")
    return files, None, None


# ------------------------------------------------------------------------------------------------
# safetensors writing (shared by convert.py and synthetic.py)
# ------------------------------------------------------------------------------------------------


class SafetensorsWriter:
    """Write a safetensors file whose layout is fixed up front, then fill tensors one at a time.

    The header is the compact, key-sorted JSON that ``mx.save_safetensors`` writes (no padding). Data is
    laid out in ``data_order`` (default: sorted by name); tensors may be written in any order since each
    goes straight to its offset, so a converter never holds more than the tensor it is producing.
    """

    def __init__(
        self,
        path: str | Path,
        specs: Iterable[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        data_order: list[str] | None = None,
    ):
        self.path = Path(path)
        self.specs = {name: (dtype, tuple(int(d) for d in shape)) for name, dtype, shape in specs}
        for name, (dtype, _) in self.specs.items():
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"unknown safetensors dtype {dtype!r} for '{name}'")
        order = list(data_order) if data_order is not None else sorted(self.specs)
        if sorted(order) != sorted(self.specs):
            raise ValueError("data_order must list every tensor exactly once")
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name in order:
            dtype, shape = self.specs[name]
            nbytes = int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dtype][1]
            self.offsets[name] = (off, off + nbytes)
            off += nbytes
        for name in self.specs:
            dtype, shape = self.specs[name]
            header[name] = {"data_offsets": list(self.offsets[name]), "dtype": dtype, "shape": list(shape)}
        hbytes = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        self.data_start = 8 + len(hbytes)
        self.total_bytes = off
        self._written: set[str] = set()
        self._f = open(self.path, "wb")
        self._f.write(len(hbytes).to_bytes(8, "little"))
        self._f.write(hbytes)
        self._f.truncate(self.data_start + off)
        self._f.flush()

    def write(self, name: str, array: np.ndarray) -> None:
        dtype, shape = self.specs[name]
        a = np.ascontiguousarray(array)
        if tuple(a.shape) != shape:
            raise ValueError(f"'{name}': shape {list(a.shape)} != planned {list(shape)}")
        if a.dtype.itemsize != SAFETENSORS_DTYPES[dtype][1] or a.dtype.kind not in ("f", "u", "i", "b"):
            raise ValueError(f"'{name}': numpy dtype {a.dtype} cannot be stored as {dtype}")
        if dtype in ("F32", "F16") and a.dtype.kind != "f":
            raise ValueError(f"'{name}': numpy dtype {a.dtype} cannot be stored as {dtype}")
        begin, end = self.offsets[name]
        buf = a.view(np.uint8).reshape(-1) if a.size else b""
        if len(buf) != end - begin:
            raise ValueError(f"'{name}': {len(buf)} bytes != planned {end - begin}")
        if a.dtype.byteorder == ">":
            raise ValueError(f"'{name}': big-endian data")
        pos = self.data_start + begin
        mv = memoryview(buf)
        while len(mv):
            n = os.pwrite(self._f.fileno(), mv[: 1 << 30], pos)
            mv = mv[n:]
            pos += n
        self._written.add(name)

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.close()
        missing = set(self.specs) - self._written
        if missing:
            raise ValueError(f"'{self.path.name}': tensors never written: {sorted(missing)[:5]}")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._f.close()


# ------------------------------------------------------------------------------------------------
# name mapping
# ------------------------------------------------------------------------------------------------

_SKIP_VISION = ("model.visual.", "vision_tower.", "model.vision_tower", "language_model.vision_tower", "visual.")
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_LEGACY = re.compile(r"layers\.\d+\.linear_attn\.in_proj_(qkvz|ba)\.")
# The MTP block: top-level ``mtp.`` in Hugging Face checkpoints (multimodal and text-only alike, MODEL.md 7);
# ``language_model.mtp.`` in Lily's MLX output (mlx-lm's renaming rule, MODEL.md 8b step 2, applied to it).
_MTP = re.compile(r"^((?:model\.|language_model\.){0,2})mtp\.")


def _classify(name: str) -> tuple[str, str]:
    """('skip', reason) | ('rel', decoder-relative name) | ('mtp', 'mtp.' + name in the block) |
    ('unknown', name)."""
    m = _MTP.match(name)
    if m:
        return "mtp", name[len(m.group(1)):]
    if ".mtp." in name:
        return "skip", "mtp"
    if name.startswith(_SKIP_VISION):
        return "skip", "vision"
    for p in _PREFIXES:
        if name.startswith(p):
            return "rel", name[len(p):]
    if name.startswith("language_model.lm_head."):
        return "rel", name[len("language_model."):]
    if name.startswith("lm_head."):
        return "rel", name
    return "unknown", name


def _fmt_shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


# ------------------------------------------------------------------------------------------------
# the checkpoint
# ------------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    format: str  # "hf" | "mlx"
    tensors: dict[str, Any]
    skipped: dict[str, int]
    quantization: dict[str, str] | None
    weight_bytes: int
    files: list[SafetensorsFile]
    notes: list[str] = field(default_factory=list)
    # decoder-relative name (e.g. "layers.0.mlp.gate.weight", "lm_head.weight") -> (file, stored tensor
    # name) for every tensor that was not skipped; convert.py reads the raw stored values through it.
    raw: dict[str, tuple[SafetensorsFile, str]] = field(default_factory=dict)
    # The MTP block (MODEL.md section 7): decoder layers it holds (0: the checkpoint has none) and the
    # bytes of its tensors (part of weight_bytes).
    mtp_layers: int = 0
    mtp_bytes: int = 0

    def close(self) -> None:
        """Drop the descriptors and unmap the files (maps still viewed elsewhere close when freed)."""
        self.tensors = {}
        for f in self.files:
            f.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Checkpoint('{self.path}', format={self.format}, {len(self.tensors)} tensors, "
            f"{self.weight_bytes / 2**30:.2f} GiB, quantization={self.quantization})"
        )


@dataclass
class _Src:
    name: str  # original tensor name
    file: SafetensorsFile

    @property
    def info(self) -> TensorInfo:
        return self.file.tensors[self.name]

    def where(self) -> str:
        return f"tensor '{self.name}' in '{self.file.name}'"


class _Builder:
    def __init__(self, folder: Path, config: ModelConfig, srcs: dict[str, _Src], fmt: str, prefix: str):
        self.folder = folder
        self.cfg = config
        self.srcs = srcs
        self.fmt = fmt
        self.prefix = prefix  # most common prefix, only for naming missing tensors
        self.used: set[str] = set()
        self.used_bytes: dict[tuple[str, str], int] = {}
        self.tensors: dict[str, Any] = {}
        self.roles: dict[str, Counter] = {}
        self.notes: list[str] = []
        q = config.quantization if isinstance(config.quantization, dict) else None
        self.quant_cfg = q
        self.norms_shifted = fmt == "mlx"

    # ---- lookup helpers ----
    def get(self, rel: str) -> _Src | None:
        return self.srcs.get(rel)

    def take(self, rel: str) -> _Src:
        s = self.srcs[rel]
        self.used.add(rel)
        self.used_bytes[(s.file.name, s.name)] = s.info.nbytes
        return s

    def missing(self, canonical: str, rels: list[str]) -> CheckpointError:
        looked = " or ".join(f"'{self.prefix}{r}'" for r in rels)
        return CheckpointError(
            f"checkpoint '{self.folder}' is missing tensor for '{canonical}': looked for {looked}"
        )

    def _float(self, s: _Src, what: str = "") -> str:
        dt = s.info.dtype
        if dt not in _FLOAT_DTYPES:
            raise CheckpointError(f"{s.where()} has dtype {dt}, expected a floating dtype (F32, F16 or BF16){what}")
        return _FLOAT_DTYPES[dt]

    def _check_shape(self, s: _Src, expected: tuple[int, ...]) -> None:
        if tuple(s.info.shape) != tuple(expected):
            raise CheckpointError(
                f"{s.where()} has shape {_fmt_shape(s.info.shape)}, expected {_fmt_shape(expected)}"
            )

    # ---- matrices ----
    def matrices(
        self,
        canonicals: list[str],
        rel_base: str,
        lead: tuple[int, ...],
        rows: int,
        cols: int,
        role: str,
        weight_rel: str | None = None,
        row_slices: list[slice] | None = None,
    ) -> None:
        """Descriptors for the module at ``rel_base`` (weight [*lead, rows, cols], optionally quantized).

        With ``lead == (E,)`` the stack is split into E per-expert views; ``row_slices`` splits the row
        axis further (fused gate_up). ``canonicals`` lists the names in (expert, slice) order.
        """
        wrel = weight_rel if weight_rel is not None else rel_base + ".weight"
        w = self.take(wrel)
        srel, brel = rel_base + ".scales", rel_base + ".biases"
        sc, bi = self.get(srel), self.get(brel)
        full_rows = rows if row_slices is None else sum(sl.stop - sl.start for sl in row_slices)
        mpath = w.name[: -len(".weight")] if w.name.endswith(".weight") else w.name
        if sc is None and bi is None:
            dt = self._float(w)
            self._check_shape(w, (*lead, full_rows, cols))
            arr = w.file.array(w.name)
            desc_proto = {"kind": "dense", "dtype": dt}
            fmt = dt
            parts = {"data": arr}
        else:
            if sc is None or bi is None:
                present, absent = (srel, brel) if sc is not None else (brel, srel)
                raise CheckpointError(
                    f"{self.srcs[present].where()} has no matching '{self.prefix}{absent}' "
                    "(affine quantization needs both scales and biases)"
                )
            if row_slices is not None:
                raise CheckpointError(f"{w.where()}: a fused gate_up tensor cannot be quantized")
            sc, bi = self.take(srel), self.take(brel)
            if w.info.dtype != "U32":
                raise CheckpointError(f"{w.where()} has dtype {w.info.dtype}, expected U32 (packed codes)")
            wshape = w.info.shape
            if len(wshape) != len(lead) + 2 or tuple(wshape[:-1]) != (*lead, rows):
                raise CheckpointError(
                    f"{w.where()} has shape {_fmt_shape(wshape)}, expected {_fmt_shape((*lead, rows))} + "
                    f"[{cols} * bits / 32]"
                )
            packed = wshape[-1]
            if (packed * 32) % cols or (packed * 32) // cols not in _AFFINE_BITS_KNOWN:
                raise CheckpointError(
                    f"{w.where()} has shape {_fmt_shape(wshape)}: {packed} words per row do not pack "
                    f"{cols} inputs at any of bits {_AFFINE_BITS_KNOWN}"
                )
            bits = packed * 32 // cols
            if bits not in _AFFINE_BITS_SUPPORTED:
                raise CheckpointError(
                    f"{w.where()}: unsupported quantization bits={bits} (Lily supports 4 and 8)"
                )
            for s in (sc, bi):
                if s.info.dtype not in _FLOAT_DTYPES:
                    raise CheckpointError(
                        f"{s.where()} has dtype {s.info.dtype}, expected F32, F16 or BF16 "
                        "(only MLX affine quantization is supported)"
                    )
            if sc.info.dtype != bi.info.dtype:
                raise CheckpointError(
                    f"{bi.where()} has dtype {bi.info.dtype} but its scales are {sc.info.dtype}"
                )
            sshape = sc.info.shape
            if len(sshape) != len(lead) + 2 or tuple(sshape[:-1]) != (*lead, rows) or sshape[-1] == 0:
                raise CheckpointError(
                    f"{sc.where()} has shape {_fmt_shape(sshape)}, expected {_fmt_shape((*lead, rows))} + [groups]"
                )
            if cols % sshape[-1]:
                raise CheckpointError(
                    f"{sc.where()} has shape {_fmt_shape(sshape)}: {sshape[-1]} groups do not divide {cols} inputs"
                )
            group = cols // sshape[-1]
            if group not in _AFFINE_GROUPS:
                raise CheckpointError(
                    f"{sc.where()}: unsupported quantization group size {group} (MLX uses {_AFFINE_GROUPS})"
                )
            if tuple(bi.info.shape) != tuple(sshape):
                raise CheckpointError(
                    f"{bi.where()} has shape {_fmt_shape(bi.info.shape)}, expected {_fmt_shape(sshape)} "
                    "(same as its scales)"
                )
            self._cross_check(mpath, w, bits, group)
            desc_proto = {"kind": "affine", "bits": bits, "group": group, "scale_dtype": _FLOAT_DTYPES[sc.info.dtype]}
            fmt = f"q{bits}g{group}"
            parts = {"data": w.file.array(w.name), "scales": sc.file.array(sc.name), "biases": bi.file.array(bi.name)}

        self.roles.setdefault(role, Counter())[fmt] += len(canonicals)
        n_lead = lead[0] if lead else 1
        slices = row_slices if row_slices is not None else [None]
        k = 0
        for e in range(n_lead):
            for sl in slices:
                d = dict(desc_proto)
                src = f"{w.file.name}:{w.name}" + (f"[{e}]" if lead else "")
                for key, arr in parts.items():
                    v = arr[e] if lead else arr
                    if sl is not None:
                        v = v[sl]
                    d[key] = v
                if sl is not None:
                    src += f"[{sl.start}:{sl.stop}]"
                    d["shape"] = (sl.stop - sl.start, cols)
                else:
                    d["shape"] = (rows, cols)
                d["source"] = src
                # order keys like the documented descriptor
                self.tensors[canonicals[k]] = _order_desc(d)
                k += 1

    def _cross_check(self, mpath: str, w: _Src, bits: int, group: int) -> None:
        q = self.quant_cfg
        if not q:
            return
        entry = q.get(mpath)
        if isinstance(entry, dict):
            eb, eg = entry.get("bits"), entry.get("group_size")
            if (eb is not None and eb != bits) or (eg is not None and eg != group):
                raise CheckpointError(
                    f"{w.where()} is packed as bits={bits}, group_size={group} but config.json "
                    f"'quantization' says bits={brief(eb)}, group_size={brief(eg)} for '{mpath}'"
                )
        elif entry is False:
            raise CheckpointError(f"{w.where()} is quantized but config.json 'quantization' says '{mpath}': false")
        else:
            db, dg = q.get("bits"), q.get("group_size")
            if (db is not None and db != bits) or (dg is not None and dg != group):
                note = f"{mpath}: packed as q{bits}g{group}, config default is q{brief(db)}g{brief(dg)} (inferred from shapes)"
                if len(self.notes) < 50:
                    self.notes.append(note)

    # ---- vectors ----
    def vector(self, canonical: str, rel: str, shape: tuple[int, ...], norm1p: bool) -> None:
        s = self.get(rel)
        if s is None:
            raise self.missing(canonical, [rel])
        self.take(rel)
        self._float(s)
        self._check_shape(s, shape)
        v = _as_f32(s)
        if norm1p and not self.norms_shifted:
            v = v + np.float32(1.0)  # HF stores w for RMSNorm1p; the effective multiplier is 1 + w
        self.tensors[canonical] = np.ascontiguousarray(v, dtype=np.float32)

    def conv(self, canonical: str, rel: str, channels: int, k: int) -> None:
        s = self.get(rel)
        if s is None:
            raise self.missing(canonical, [rel])
        self.take(rel)
        self._float(s)
        shp = tuple(s.info.shape)
        if shp not in ((channels, 1, k), (channels, k, 1)):
            expected = (channels, k, 1) if self.fmt == "mlx" else (channels, 1, k)
            raise CheckpointError(f"{s.where()} has shape {_fmt_shape(shp)}, expected {_fmt_shape(expected)}")
        # [C,1,K] (HF) and [C,K,1] (MLX) have the same memory order: tap j of channel c at c*K + j.
        self.tensors[canonical] = np.ascontiguousarray(_as_f32(s).reshape(channels, k), dtype=np.float32)


def _order_desc(d: dict) -> dict:
    keys = ("kind", "dtype", "bits", "group", "data", "scales", "biases", "scale_dtype", "shape", "source")
    return {k: d[k] for k in keys if k in d}


def _as_f32(s: _Src) -> np.ndarray:
    a = s.file.array(s.name)
    if s.info.dtype == "BF16":
        return bf16_to_f32(a)
    return a.astype(np.float32)


def _open_files(folder: Path, progress: bool = False) -> tuple[list[SafetensorsFile], dict[str, SafetensorsFile]]:
    paths, weight_map, index = list_weight_files(folder)
    files: list[SafetensorsFile] = []
    bar = None
    if progress:
        from .progress import bar as make_bar

        bar = make_bar(sum(p.stat().st_size for p in paths), f"loading {folder.name}", "B", unit_scale=True)
    try:
        for p in paths:
            files.append(SafetensorsFile(p))
            if bar is not None:
                bar.update(files[-1].size)
    except Exception:
        for f in files:
            f.close()
        raise
    finally:
        if bar is not None:
            bar.close()
    by_name = {f.name: f for f in files}
    located: dict[str, SafetensorsFile] = {}
    if weight_map is not None:
        for tname, fname in weight_map.items():
            f = by_name[fname]
            if tname not in f.tensors:
                raise CheckpointError(
                    f"tensor '{tname}' is listed in '{index.name}' for '{fname}' but is absent from that file"
                )
            located[tname] = f
    for f in files:
        for tname in f.tensors:
            prev = located.get(tname)
            if prev is None:
                located[tname] = f
            elif prev is not f and (weight_map is None or tname not in weight_map):
                raise CheckpointError(f"tensor '{tname}' appears in both '{prev.name}' and '{f.name}'")
    return files, located


def load_checkpoint(path: str | Path, *, progress: bool = False) -> Checkpoint:
    """Open a checkpoint folder (HF bf16/fp32 or MLX affine) and build the canonical weight set.

    ``progress=True`` shows a ``tqdm.auto`` bar (bytes) as the weight files are opened and mapped."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder '{folder}' does not exist")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"checkpoint folder '{folder}' has no config.json")
    config = ModelConfig.from_file(folder / "config.json")
    q = config.quantization
    if isinstance(q, dict) and "quant_method" in q and "bits" not in q:
        raise CheckpointError(
            f"{config.source}: unsupported quantization method {brief(q.get('quant_method'))} "
            "(Lily loads bf16/fp16/fp32 Hugging Face weights or MLX affine 4/8-bit)"
        )
    files, located = _open_files(folder, progress)
    try:
        return _build(folder, config, files, located)
    except BaseException:
        for f in files:
            f.close()
        raise


def _build(folder: Path, cfg: ModelConfig, files: list[SafetensorsFile], located: dict[str, SafetensorsFile]) -> Checkpoint:
    skipped: Counter = Counter()
    srcs: dict[str, _Src] = {}
    prefixes: Counter = Counter()
    mtp_prefixes: Counter = Counter()
    for tname, f in located.items():
        kind, rel = _classify(tname)
        if kind == "skip":
            skipped[rel] += 1
            continue
        if kind == "unknown":
            raise CheckpointError(f"unexpected tensor '{tname}' in '{f.name}'")
        if rel in srcs:
            other = srcs[rel]
            raise CheckpointError(
                f"tensors '{other.name}' ('{other.file.name}') and '{tname}' ('{f.name}') are the same weight "
                "under two names"
            )
        srcs[rel] = _Src(tname, f)
        if kind == "mtp":
            mtp_prefixes[tname[: len(tname) - len(rel)]] += 1
        elif not rel.startswith("lm_head."):
            prefixes[tname[: len(tname) - len(rel)]] += 1

    for rel, s in srcs.items():
        if _LEGACY.search(rel):
            raise CheckpointError(
                f"{s.where()}: legacy qwen3_next layout (fused in_proj_qkvz / in_proj_ba) is not supported; "
                "Lily expects the Qwen3.5/3.6 split projections in_proj_qkv, in_proj_z, in_proj_b, in_proj_a"
            )

    # Format: MLX if anything is quantized or a conv1d weight is [C, K, 1] (MODEL.md 8b).
    K = cfg.linear_conv_kernel_dim
    conv_shapes = [s.info.shape for r, s in srcs.items() if r.endswith("linear_attn.conv1d.weight")]
    mlx_conv = any(len(sh) == 3 and sh[-1] == 1 and K != 1 for sh in conv_shapes)
    fmt = "mlx" if (mlx_conv or any(r.endswith(".scales") for r in srcs)) else "hf"
    prefix = prefixes.most_common(1)[0][0] if prefixes else ("language_model.model." if fmt == "mlx" else "model.language_model.")

    b = _Builder(folder, cfg, srcs, fmt, prefix)
    # RMSNorm1p weights are stored shifted (1 + w) exactly when the conv weights are in MLX layout;
    # mlx-lm keys its +1 on the conv layout too. Without a usable conv (K == 1 or no DeltaNet layer),
    # fall back to the naming format.
    if conv_shapes and K != 1:
        b.norms_shifted = mlx_conv
    H = cfg.hidden_size
    V = cfg.vocab_size

    _mat(b, "embed", "embed_tokens", V, H, "embed")
    for i in range(cfg.num_hidden_layers):
        _layer(b, f"layers.{i}", f"layers.{i}", cfg.is_full_attention(i))
    b.vector("final_norm", "norm.weight", (H,), norm1p=True)
    if cfg.tie_word_embeddings:
        b.tensors["lm_head"] = b.tensors["embed"]
        for r in ("lm_head.weight", "lm_head.scales", "lm_head.biases"):
            if r in srcs:  # transformers ties over a stored lm_head too; ignore it
                b.used.add(r)
                skipped["tied lm_head"] += 1
    else:
        if b.get("lm_head.weight") is None:
            raise CheckpointError(
                f"checkpoint '{folder}' is missing tensor for 'lm_head': looked for 'lm_head.weight' or "
                "'language_model.lm_head.weight' (tie_word_embeddings is false)"
            )
        b.matrices(["lm_head"], "lm_head", (), V, H, "lm_head")
    mtp_layers = _mtp(b, mtp_prefixes)

    leftovers = [r for r in srcs if r not in b.used]
    if leftovers:
        s = srcs[leftovers[0]]
        hint = ""
        m = re.match(r"layers\.(\d{1,9})\.(self_attn|linear_attn)\.", leftovers[0])
        if m and int(m.group(1)) < cfg.num_hidden_layers:
            hint = f" (layer {m.group(1)} is {cfg.layer_types[int(m.group(1))]} per config.json)"
        if leftovers[0].startswith("mtp."):
            hint = f" (the MTP block has {mtp_layers} decoder layer{'s' if mtp_layers != 1 else ''}" + (
                f": config.json says mtp_num_hidden_layers={cfg.mtp_num_hidden_layers})"
                if cfg.mtp_num_hidden_layers is not None else ")")
        more = f" and {len(leftovers) - 1} more" if len(leftovers) > 1 else ""
        raise CheckpointError(f"unexpected tensor '{s.name}' in '{s.file.name}'{hint}{more}")

    return Checkpoint(
        path=folder,
        config=cfg,
        format=fmt,
        tensors=b.tensors,  # canonical order: embed, layers in order, final_norm, lm_head, the MTP block
        skipped=dict(skipped),
        quantization=_summary(b.roles),
        weight_bytes=sum(b.used_bytes.values()),
        files=files,
        notes=list(cfg.notes) + b.notes,
        raw={rel: (src.file, src.name) for rel, src in srcs.items()},
        mtp_layers=mtp_layers,
        mtp_bytes=sum(srcs[r].info.nbytes for r in b.used if r.startswith("mtp.")),
    )


def _mat(b: _Builder, canonical: str, rel_base: str, rows: int, cols: int, role: str) -> None:
    if b.get(rel_base + ".weight") is None:
        raise b.missing(canonical, [rel_base + ".weight"])
    b.matrices([canonical], rel_base, (), rows, cols, role)


def _layer(b: _Builder, c: str, L: str, full: bool) -> None:
    """One decoder layer (MODEL.md section 2): canonical names under ``c``, stored ones under ``L``."""
    cfg = b.cfg
    H, K = cfg.hidden_size, cfg.linear_conv_kernel_dim
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, I, SI = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    b.vector(f"{c}.input_norm", f"{L}.input_layernorm.weight", (H,), norm1p=True)
    b.vector(f"{c}.post_norm", f"{L}.post_attention_layernorm.weight", (H,), norm1p=True)
    if full:
        A = f"{L}.self_attn"
        _mat(b, f"{c}.attn.q", f"{A}.q_proj", nh * 2 * hd, H, "attn")
        _mat(b, f"{c}.attn.k", f"{A}.k_proj", nkv * hd, H, "attn")
        _mat(b, f"{c}.attn.v", f"{A}.v_proj", nkv * hd, H, "attn")
        _mat(b, f"{c}.attn.o", f"{A}.o_proj", H, nh * hd, "attn")
        b.vector(f"{c}.attn.q_norm", f"{A}.q_norm.weight", (hd,), norm1p=True)
        b.vector(f"{c}.attn.k_norm", f"{A}.k_norm.weight", (hd,), norm1p=True)
    else:
        D = f"{L}.linear_attn"
        _mat(b, f"{c}.delta.qkv", f"{D}.in_proj_qkv", 2 * Hk * Dk + Hv * Dv, H, "delta")
        _mat(b, f"{c}.delta.z", f"{D}.in_proj_z", Hv * Dv, H, "delta")
        _mat(b, f"{c}.delta.b", f"{D}.in_proj_b", Hv, H, "delta")
        _mat(b, f"{c}.delta.a", f"{D}.in_proj_a", Hv, H, "delta")
        _mat(b, f"{c}.delta.out", f"{D}.out_proj", H, Hv * Dv, "delta")
        b.conv(f"{c}.delta.conv", f"{D}.conv1d.weight", cfg.conv_dim, K)
        b.vector(f"{c}.delta.dt_bias", f"{D}.dt_bias", (Hv,), norm1p=False)
        b.vector(f"{c}.delta.A_log", f"{D}.A_log", (Hv,), norm1p=False)
        b.vector(f"{c}.delta.norm", f"{D}.norm.weight", (Dv,), norm1p=False)  # plain w, never 1 + w
    M = f"{L}.mlp"
    _mat(b, f"{c}.moe.router", f"{M}.gate", E, H, "router")
    _mat(b, f"{c}.moe.shared_gate", f"{M}.shared_expert_gate", 1, H, "shared_gate")
    _mat(b, f"{c}.moe.shared.gate", f"{M}.shared_expert.gate_proj", SI, H, "shared")
    _mat(b, f"{c}.moe.shared.up", f"{M}.shared_expert.up_proj", SI, H, "shared")
    _mat(b, f"{c}.moe.shared.down", f"{M}.shared_expert.down_proj", H, SI, "shared")
    _experts(b, c, M, E, I, H)


def _mtp(b: _Builder, prefixes: Counter) -> int:
    """The MTP block (MODEL.md section 7), when the checkpoint has any ``mtp.*`` tensor; returns its number
    of decoder layers (0: none). Every tensor of the block must be there: a partial block names the first
    one missing. Norms follow the checkpoint's convention (stored w in HF files, 1 + w in MLX ones), like
    the decoder's; experts may be fused, per expert or MLX stacks, independently of the decoder's."""
    cfg = b.cfg
    rels = [r for r in b.srcs if r.startswith("mtp.")]
    if not rels:
        if cfg.mtp_num_hidden_layers:
            b.notes.append(f"config.json announces mtp_num_hidden_layers={cfg.mtp_num_hidden_layers} but the "
                           "checkpoint has no mtp.* tensors (mlx-lm drops them): no MTP block")
        return 0
    n = cfg.mtp_num_hidden_layers
    if n is None:  # no config field: the layers the names mention (at least one: an MTP block has a layer)
        found = [int(m.group(1)) for r in rels if (m := re.match(r"mtp\.layers\.(\d{1,9})\.", r))]
        n = max(found, default=0) + 1
        b.notes.append(f"MTP block with {n} decoder layer(s) (counted from the tensor names; config.json has "
                       "no mtp_num_hidden_layers)")
    if n == 0:
        return 0  # config.json says none: every mtp.* tensor is reported as unexpected
    H = cfg.hidden_size
    saved = b.prefix
    b.prefix = prefixes.most_common(1)[0][0]  # names the missing tensors as this checkpoint stores mtp.*
    try:
        _mat(b, "mtp.fc", "mtp.fc", H, 2 * H, "mtp")  # [e | hn] -> hidden: embedding half first
        b.vector("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_embedding.weight", (H,), norm1p=True)
        b.vector("mtp.pre_fc_norm_hidden", "mtp.pre_fc_norm_hidden.weight", (H,), norm1p=True)
        for j in range(n):
            _layer(b, f"mtp.layers.{j}", f"mtp.layers.{j}", full=True)
        b.vector("mtp.norm", "mtp.norm.weight", (H,), norm1p=True)
    finally:
        b.prefix = saved
    return n


def _experts(b: _Builder, c: str, M: str, E: int, I: int, H: int) -> None:
    names = lambda proj: [f"{c}.moe.experts.{e}.{proj}" for e in range(E)]  # noqa: E731
    fused_gu, fused_d = f"{M}.experts.gate_up_proj", f"{M}.experts.down_proj"
    sw = f"{M}.switch_mlp"
    if b.get(fused_gu) is not None or b.get(fused_d) is not None:
        # HF fused: gate_up_proj [E, 2I, H] (rows :I gate, I: up), down_proj [E, H, I], no ".weight".
        for r in (fused_gu, fused_d):
            if b.get(r) is None:
                raise b.missing(f"{c}.moe.experts", [r])
        gate_up = []
        for e in range(E):
            gate_up += [f"{c}.moe.experts.{e}.gate", f"{c}.moe.experts.{e}.up"]
        b.matrices(gate_up, fused_gu, (E,), I, H, "experts", weight_rel=fused_gu,
                   row_slices=[slice(0, I), slice(I, 2 * I)])
        b.matrices(names("down"), fused_d, (E,), H, I, "experts", weight_rel=fused_d)
    elif b.get(f"{sw}.gate_proj.weight") is not None or b.get(f"{sw}.up_proj.weight") is not None \
            or b.get(f"{sw}.down_proj.weight") is not None:
        for proj, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
            r = f"{sw}.{proj}_proj"
            if b.get(r + ".weight") is None:
                raise b.missing(f"{c}.moe.experts.0.{proj}", [r + ".weight"])
            b.matrices(names(proj), r, (E,), rows, cols, "experts")
    else:
        for e in range(E):
            for proj, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
                r = f"{M}.experts.{e}.{proj}_proj"
                if b.get(r + ".weight") is None:
                    raise b.missing(
                        f"{c}.moe.experts.{e}.{proj}",
                        [fused_gu if proj != "down" else fused_d, f"{sw}.{proj}_proj.weight", r + ".weight"],
                    )
                b.matrices([f"{c}.moe.experts.{e}.{proj}"], r, (), rows, cols, "experts")


def _summary(roles: dict[str, Counter]) -> dict[str, str] | None:
    if not any(f.startswith("q") for cnt in roles.values() for f in cnt):
        return None
    total: Counter = Counter()
    for cnt in roles.values():
        total.update(cnt)
    default = total.most_common(1)[0][0]
    out = {"default": default}
    for role, cnt in roles.items():
        fmts = sorted(cnt)
        if fmts != [default]:
            out[role] = fmts[0] if len(fmts) == 1 else "mixed:" + ",".join(fmts)
    return out
