"""The Engine: a loaded model on a backend, its tokenizer and chat template, and factory of Sessions."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
import threading
import weakref
from typing import Callable, Iterable, Iterator

import numpy as np

from . import _core
from .chat import render_chat
from .checkpoint import Checkpoint, load_checkpoint
from .errors import CheckpointError, LilyError
from .hub import resolve_model_path
from .lm_head import check_lm_head, prepare_lm_head
from .progress import check_progress
from .sampling import SamplingParams
from .session import Session, closed_handle, read_session_file
from .streaming import GenerationResponse, check_max_tokens, check_sampling, normalize_stop
from .tokenizer import Tokenizer
from .mtp import MtpController
from .mtp import check_mode as check_mtp_mode
from .validate import check_int, check_mtp

DEFAULT_MODEL = "lily-tiny"
# What the CPU backend's debug modes read from the environment (comma-separated): "deferred" (record ops,
# run them at submit on an executor thread, stage order shuffled, host access to in-flight buffers fails)
# and "strict_alloc" (an op that allocates heap memory fails). `LILY_CPU_SHUFFLE_SEED` picks the order.
DEBUG_ENV = "LILY_CPU_DEBUG"


def _nvrtc_candidates() -> list[str]:
    """Where libnvrtc may be, newest first: NVIDIA's nvidia-cuda-nvrtc wheels (the ``lily-inference[cuda]``
    extra; PyTorch's CUDA builds bring them too), then CUDA_HOME / CUDA_PATH and /usr/local/cuda."""
    found: list[str] = []
    try:
        import nvidia  # namespace package of NVIDIA's wheels; absent on most machines

        for base in getattr(nvidia, "__path__", []):
            for sub in ("cu13", "cuda_nvrtc", "cu12"):
                found += sorted(glob.glob(os.path.join(base, sub, "lib", "libnvrtc.so*")), reverse=True)
    except ImportError:
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            found += sorted(glob.glob(os.path.join(os.environ[env], "lib64", "libnvrtc.so*")), reverse=True)
    found += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"), reverse=True)
    # Real libraries only (not libnvrtc-builtins), each once.
    return list(dict.fromkeys(p for p in found if os.path.basename(p).startswith("libnvrtc.so")))


if getattr(_core, "has_cuda", False):
    _core.cuda_set_nvrtc_paths(_nvrtc_candidates())


def backends() -> dict[str, dict]:
    """Every backend this build knows, in the order ``backend="auto"`` prefers them:
    ``{name: {"built": bool, "usable": bool, "status": str}}``."""
    return {k: dict(v) for k, v in _core.backends().items()}


# Prompt tokens per forward when the caller gives none (Engine's prefill_chunk=None), by backend.
_PREFILL_CHUNK = {"cuda": 4096}


def default_prefill_chunk(backend: str) -> int:
    """The prefill chunk an Engine on ``backend`` ("cpu", "cuda", "metal") uses when given none."""
    return _PREFILL_CHUNK.get(backend, 512)


def _choose_backend(backend: str) -> str:
    known = backends()
    if not isinstance(backend, str) or (backend != "auto" and backend not in known):
        raise ValueError(f"backend must be 'auto' or one of {tuple(known)}, got {backend!r}")
    if backend == "auto":
        return next(name for name, b in known.items() if b["usable"])
    if not known[backend]["usable"]:
        raise LilyError(f"backend {backend!r} is {known[backend]['status']}")
    return backend


def _debug_options() -> dict:
    words = {w.strip() for w in os.environ.get(DEBUG_ENV, "").split(",") if w.strip()}
    unknown = words - {"deferred", "strict_alloc"}
    if unknown:
        raise ValueError(f"{DEBUG_ENV} holds unknown words {sorted(unknown)} (known: deferred, strict_alloc)")
    opts: dict = {"deferred": "deferred" in words, "strict_alloc": "strict_alloc" in words}
    if opts["deferred"]:
        seed = os.environ.get("LILY_CPU_SHUFFLE_SEED", "1")
        if not seed.isdigit():
            raise ValueError(f"LILY_CPU_SHUFFLE_SEED must be a non-negative integer, got {seed!r}")
        opts["shuffle_seed"] = int(seed)
    return opts


def _packaged_model_path(name: str) -> pathlib.Path | None:
    path = pathlib.Path(__file__).parent / "models" / name
    return path if (path / "config.json").is_file() else None


class Report(dict):
    """engine.report(): a dict that prints as an aligned text table."""

    def __str__(self) -> str:
        lines: list[str] = []

        def emit(key: str, value, indent: int = 0) -> None:
            pad = "  " * indent
            if isinstance(value, dict):
                lines.append(f"{pad}{key}:")
                for k, v in value.items():
                    emit(str(k), v, indent + 1)
            elif isinstance(value, list):
                lines.append(f"{pad}{key}:")
                for v in value:
                    lines.append(f"{pad}  - {v}")
            else:
                lines.append(f"{pad}{key}: {value}")

        for k, v in self.items():
            emit(k, v)
        return "\n".join(lines)

    def __repr__(self) -> str:  # the REPL shows the table, not the raw dict (it is still a plain dict)
        return str(self)

    def _repr_pretty_(self, p, cycle: bool) -> None:  # IPython's text view, likewise
        p.text(str(self))

    def _repr_html_(self) -> str:
        from .display import report_html

        return report_html(self)


class Engine:
    """A Qwen3.6 (qwen3_5_moe) model loaded for inference.

    Create it with :meth:`from_pretrained`; open conversations with :meth:`session`.
    """

    def __init__(self, checkpoint: Checkpoint, *, backend: str = "auto", threads: int | None = None,
                 prefill_chunk: int | None = None, kv_cache_dtype: str = "f32", tokenizer: Tokenizer | None = None,
                 backend_options: dict | None = None, keep_sessions: int = 0, lm_head: str = "auto",
                 mtp: str = "auto"):
        check_lm_head(lm_head)
        mtp = check_mtp_mode(mtp, "Engine")
        if mtp == "on" and checkpoint.mtp_layers == 0:
            raise ValueError(f"Engine: mtp='on' needs a checkpoint with an MTP head, and {checkpoint.path} has none")
        if backend_options is not None and not isinstance(backend_options, dict):
            raise ValueError(f"backend_options must be a dict or None, got {type(backend_options).__name__}")
        backend_options = dict(backend_options or {})
        # CUDA's dry mode (compile and record, no device: the CI's compile check) needs no GPU.
        backend = "cuda" if backend == "cuda" and backend_options.get("dry_arch") else _choose_backend(backend)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(backend)
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")
        if kv_cache_dtype not in ("f32", "bf16"):
            raise ValueError(f"kv_cache_dtype must be 'f32' or 'bf16', got {kv_cache_dtype!r}")
        self.keep_sessions = check_int(keep_sessions, "keep_sessions", maximum=1 << 16)
        self.kv_cache_dtype = kv_cache_dtype
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.backend = backend
        self.prefill_chunk = prefill_chunk
        self.tokenizer = tokenizer
        options = {"threads": threads or 0, **_debug_options(), **backend_options}
        try:  # before any weight is touched, and not reported as the checkpoint's fault
            _core.check_backend_options(backend, options)
        except ValueError as exc:
            raise ValueError(f"backend_options: {exc}") from None
        # Each mapped file is handed over whole: the backend registers it once and weights are offsets in it.
        files = [(np.frombuffer(f._mm, dtype=np.uint8), f.name) for f in checkpoint.files if f._mm is not None]
        # The head's format (lily/lm_head.py): a dense head may be quantized here; checkpoint.tensors is kept as
        # the checkpoint has it (the embedding of a tied head too), the core gets the head chosen.
        self._lm_head = prepare_lm_head(checkpoint.tensors, lm_head, backend, tied=self.config.tie_word_embeddings,
                                        mtp=checkpoint.mtp_layers > 0)
        core_tensors = checkpoint.tensors
        if self._lm_head.descriptor is not checkpoint.tensors["lm_head"]:
            core_tensors = dict(checkpoint.tensors, lm_head=self._lm_head.descriptor)
        try:
            # mtp_layers: what the checkpoint holds (not to_core(), which is the model's fingerprint).
            core_config = dict(self.config.to_core(), mtp_layers=checkpoint.mtp_layers)
            self._core = _core.Engine(core_config, core_tensors, files, backend, options)
        except ValueError as exc:
            raise CheckpointError(f"{checkpoint.path}: {exc}") from exc
        self._lm_head.drop_host_copy(core_tensors, checkpoint.tensors["lm_head"])
        self._fingerprint: str | None = None
        self._probe_stats: dict | None = None
        self._sessions: weakref.WeakSet = weakref.WeakSet()
        self._idle: list = []  # closed sessions' core state kept for reuse (keep_sessions at most)
        self._idle_lock = threading.Lock()
        self._closed = False
        self._mtp = MtpController(self, mtp, has_head=checkpoint.mtp_layers > 0)

    @property
    def mtp(self) -> str:
        """The engine's MTP policy ("auto", "on" or "off"): what generate calls do by default."""
        return self._mtp.mode

    def _state_bytes(self, max_context: int) -> int:
        cfg = self.config
        # KV caches: the full-attention layers' and the MTP block's (its layers are full attention).
        caches = sum(t == "full_attention" for t in cfg.layer_types) + self.checkpoint.mtp_layers
        kv = caches * 2 * cfg.num_key_value_heads * cfg.head_dim * (2 if self.kv_cache_dtype == "bf16" else 4)
        n_lin = sum(t == "linear_attention" for t in cfg.layer_types)
        # Two sets of recurrent and conv state: a decode step writes the other set (undoable speculation).
        rec = 2 * n_lin * (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
                           + (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim) * 4
        return kv * max_context + rec

    # ---- lifetime ----
    def close(self) -> None:
        """Release the model and every session's state. Generations still running are cancelled first
        (their iterators end with ``finish_reason == "cancelled"``); afterwards every call on this engine
        or its sessions raises :class:`LilyError`. Safe to call twice; also what ``with`` does."""
        if self._closed:
            return
        self._closed = True
        for s in list(self._sessions):
            s._close("its Engine was closed")
        with self._idle_lock:
            idle, self._idle = self._idle, []
        del idle  # freed outside _idle_lock: a state's destructor waits for the engine lock
        # The C++ engine goes with the last reference: sessions and snapshots hold one until they go.
        self._core = closed_handle("this Engine")

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        from .display import engine_repr

        return engine_repr(self)

    def _repr_html_(self) -> str:
        from .display import engine_html

        return engine_html(self)

    # ---- construction ----
    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, backend: str = "auto",
                        threads: int | None = None, prefill_chunk: int | None = None, kv_cache_dtype: str = "f32",
                        revision: str | None = None, progress: bool | None = None,
                        backend_options: dict | None = None, keep_sessions: int = 0,
                        lm_head: str = "auto", mtp: str = "auto") -> "Engine":
        """Load a checkpoint: a local folder, a Hugging Face repo id (cached or downloaded; honours
        HF_HUB_OFFLINE), or the packaged demonstration model ``"lily-tiny"`` (the default).

        ``backend``: ``"auto"`` (the first usable of :func:`lily.engine.backends`, in the order CUDA, Metal,
        CPU), ``"cpu"``, ``"cuda"`` or ``"metal"``; a backend this build lacks, or whose device is absent,
        raises :class:`LilyError` saying which.

        ``prefill_chunk``: the most prompt tokens one forward takes (a longer prompt runs in chunks; scratch grows
        to the largest chunk a session has run). None: :func:`default_prefill_chunk` of the backend, 4096 on CUDA
        (a GPU's GEMMs need the rows: a 4K prompt in chunks of 512 took ~1.8x the time of one chunk on an H100,
        benchmarks/NOTES.md) and 512 elsewhere.

        ``kv_cache_dtype="bf16"`` halves the KV cache (long contexts) at bf16 precision for K and V;
        the default ``"f32"`` keeps the CPU backend an exact fp32 oracle. ``progress=True`` shows a
        ``tqdm.auto`` bar over mapping the checkpoint's weight files (a Hub download shows
        huggingface_hub's own bars); anything but True/False/None raises TypeError.

        ``keep_sessions``: how many closed sessions' state (KV cache, recurrent state, scratch) the engine keeps
        for later sessions of the same ``max_context`` and ``prefill_chunk`` (default 0: none). A kept cache's
        KV rows that equal a snapshot's (it restored them, or the snapshot was taken from it) need no copy when
        that snapshot is restored: :meth:`Session.restore` then moves the session onto the kept state holding
        the most of them, so the next turn of a conversation through :class:`lily.prefix_cache.PrefixCache`
        copies only the rows it lacks; a new session takes a kept state only if it holds no such rows. The
        kept state stays allocated until it is reused, evicted (the one holding the fewest such rows first) or
        the engine is closed.

        ``lm_head``: the LM head's format (:mod:`lily.lm_head`). ``"8bit"`` quantizes a head the checkpoint stores
        dense (Hugging Face bf16/f16/f32) at load to 8-bit affine, group 64 (the bytes ``lily convert --bits 8``
        writes; about half the bytes a decode step reads for it); ``"native"`` keeps it as stored; ``"auto"``
        (default) takes 8-bit where the backend's measured default says it is faster (``lily.lm_head.AUTO``: on
        every backend for bf16/f16 heads of 64 MiB and more, e.g. Qwen3.6's [248320, 2048]; f32 heads stay
        exact). A head the checkpoint already stores quantized (MLX) is left alone; a tied head gets its own
        8-bit copy (the embedding keeps its rows). The MTP drafter reads the same head. ``report()["lm_head"]``
        says which format, why, its bytes and the quantization's seconds; another value raises ValueError.

        ``mtp``: the MTP policy for checkpoints with an MTP head (lily.mtp): ``"auto"`` (default) drafts only
        where and while it pays, measured on this machine (the cost of a speculative iteration, cached on disk)
        and learnt from the acceptance; ``"on"`` always drafts; ``"off"`` never does and skips the MTP block's
        per-token rows. Generate calls take it as their default; ``report()["mtp"]["policy"]`` says what was
        measured and decided.

        ``backend_options``: backend settings (a name the backend does not read is refused, naming the ones it
        does: ValueError). CPU: ``threads``; CUDA: ``device`` (ordinal, default 0),
        ``graphs`` (replay decode steps as CUDA graphs, default True), ``speculative_graphs`` (MTP iterations
        memoised and replayed as graphs too, default True), ``mtp_verify_decode`` (MTP iterations verify their
        rows through the decode kernels instead of the prefill path; default True: on an H100 with lily-tiny an
        iteration cost 1.3-2.1 plain steps this way against 4-6 through the prefill path),
        ``branches`` (independent launches
        side by side, default True), ``replay_timing`` (GPU time of one replayed decode step in N from events
        around it, for the report; default 1, 0 none), ``pdl`` (programmatic dependent launch on sm_90+: ``"off"`` /
        False, ``"decode"`` (decode steps only; their
        GEMVs and MoE down pass load weights before waiting for the kernel before them) or ``"all"`` / True
        (prefill too: measured slower); default ``"decode"``: +16% decode at 4K on the H200), ``encode_memo``
        (reuse the launches of a decode op whose arguments were seen before, skipping its host code; default
        True), ``prefill_memo`` (the same for prefill ops, each recorded at its second sighting: a chunk of a
        length already prefilled twice in the same session state replays its launches; an H100's host spent ~3 ms
        encoding a chunk of the real model; default True), ``gemv_async`` (decode GEMV weights staged through shared
        memory by cp.async; default True),
        ``gemv_ahead`` (warp batches of the dp4a decode GEMV whose weight loads go out before it waits for the
        kernel before it, 1 or 2; the same bits; default 2: +0.7% decode at 4K on the H100), ``gemv_dp4a`` (decode GEMVs
        of 4/8-bit weights with x as three int8 terms and integer dot products,
        ~1e-7 relative error, the lm_head included; default True; False: fp32 x, the lm_head on the tensor cores),
        ``smem_carveout`` (the preferred shared-memory carveout of every kernel, percent 0-100; default -1: the
        driver's choice per kernel), ``fused_norm`` (decode: each layer's RMSNorms done inside the projection GEMV that
        follows them, one
        launch instead of two; default True), ``fused_delta`` (decode: a DeltaNet layer's conv, recurrent update
        and gated norm in one launch: ``"narrow"`` / True a block per key head, ``"wide"`` 256 blocks with arrival
        counters, both measured slower on the H200; ``"norm"`` the conv's launch, then the recurrence and the norm in
        one launch whose value heads are thread-block clusters (sm_90; Dv % 16 == 0, Dv <= 128; elsewhere the three
        kernels, and the report says why): +1.2% decode at 4K on the H100; ``"cluster"`` (the default) the wide
        form with a key head's blocks one thread-block cluster instead of arrival counters (sm_90; Dv % 16 == 0,
        Dv <= 128, Hv/Hk · Dv/16 <= 16; elsewhere the three kernels, and the report says why): +0.7% over
        ``"norm"``; ``"off"`` / False the three kernels), ``prefill_x`` (how
        prefill GEMMs take the activations: ``"f16"`` one fp16 term scaled by a power of two per row and weight group,
        ~2.4e-4 relative error per product, for affine weights (others take ``"bf16x2"`` and say so); ``"bf16x2"``
        hi + lo bf16, ~1e-5, twice the MMAs; ``"bf16"`` one bf16 term, ~2e-3; default ``"f16"``), ``moe_x`` (the
        same for the MoE expert GEMMs alone, or ``"prefill"`` to follow ``prefill_x``; default ``"prefill"``),
        ``moe_pipe`` (MoE prefill GEMMs of affine experts with 64-row tiles: K blocks staged by cp.async in a ring of
        2-4 stages, or 0 = registers one block ahead; default 3),
        ``gemm_small_tiles`` (prefill GEMMs whose grid would use at most a quarter (half) of the SMs run 16-row
        (32-row) tiles, the same bits; default True), ``gemm_frag`` (prefill GEMMs of 4-bit weights: each warp widens
        its columns' codes into tensor-core fragments instead of reading a converted weight tile, the same bits; default
        False: the same bits, measured 2% slower at 4K and 16K on the H200), ``gemm_w_f16`` (prefill GEMMs of
        affine weights with f16 x: the weights dequantized to f16 in the shared tile, no per-group fold; another
        rounding (the weight's, 2^-11 relative); default True: +5% prefill at 4K on the H100), ``moe_w_f16`` (the same
        for the MoE prefill GEMMs' 4-bit fragment tiles; default True: +4% more), ``moe_x_rows`` (with
        ``moe_w_f16``: the MoE GEMMs' x and act as f16 rows scaled once per row by pre-passes, no per-part fold;
        default True: +9.3% prefill at 4K on the H100), ``moe_group_blocks`` (the MoE prefill grouping of more
        than 1024 (token, expert) pairs split over a block per 1024-pair chunk, the same row order; default True:
        +2.6% prefill at 4K on the H100), ``gemm_x_rows`` (with ``gemm_w_f16``: x as f16 rows scaled once per row by a
        pre-pass,
        the MMAs accumulating without a per-group fold; default True: +15% prefill at 4K on the H100),
        ``gemm_tile128`` (with ``gemm_x_rows``: 128-row tiles for GEMMs whose grid still fills every SM twice, the
        same bits; default True: +6% at 4K), ``gemm_w_double`` (with ``gemm_x_rows``: the GEMM's W tile alternates
        between two shared arrays, one barrier per K block instead of two, the same bits; default True: +1.2% at
        4K on the H100), ``moe_frag`` (MoE prefill GEMMs of 4-bit experts with 16-row
        tiles: each warp widens its own columns' codes into tensor-core fragments in registers, the K blocks through
        a cp.async ring of 3-6 stages, the same bits; 0 = a shared bf16 weight tile; default 3),
        ``moe_frag32_rows`` / ``moe_tile64_rows`` (the MoE prefill tile height by the expected rows per expert
        T·k/E: from the first the fragment tiles take 32 rows, default 20; from the second the tiles take 64, default
        0 = by format: from 32 for experts without fragment tiles, never for 4-bit ones; the same bits at any height),
        ``moe_frag64_rows`` (from this expected rows per expert the fragment tiles take 64 rows, four m16 tiles per
        warp on each widened fragment; 0 = never; default 64: +1.5% at 4K on the H100; the same bits),
        ``moe_rows_g`` / ``moe_rows_d`` (the decode MoE's geometry: gate/up rows per warp, 1, 2 or 4, default 0 =
        by shape; output rows per down-pass block, 1-64, default 8; the same bits at any setting),
        ``moe_decode_minb`` (blocks per SM the decode MoE kernels' registers must allow, 0-8; default 0 = the
        compiler's choice; the same bits), ``moe_early_loads`` (the decode MoE's gate/up pass issues its weight
        loads while x is staged, the shared expert's before its wait; the same bits; default True: +2% decode at
        4K on the H100),
        ``attn_prefill_keys`` (prefill attention on tensor cores: K/V tiles of 16 or 32 keys; default 16),
        ``attn_prefill_split`` (prefill attention for at most 64 rows whose grid leaves SMs idle, e.g. a warm turn's
        new tokens after a long context: the keys split over more blocks, the partials merged; default True),
        ``qk_prep_append`` (attention's q/k norm + RoPE and the KV cache append in one launch, the same values;
        False: two launches; default True),
        ``attn_decode_early`` (decode attention on tensor cores: each warp's first K/V tile, less the step's new
        row, loaded before the wait for the kernel before it; the same bits; default True),
        ``delta_chunk_rows`` (prefill DeltaNet calls of at least this many rows without a state capture take the
        chunked (WY) form, 64-token chunks; shorter ones and 0 the sequential scan; default 64),
        ``delta_chunk_mma`` (the chunked form's products on the tensor cores in 3xTF32, fp32's error level, where the
        key head dim is a multiple of 16; False: fp32 FMAs on the CUDA cores; default True: the op 1,330 -> 794 µs
        a layer at 4K on the H100),
        ``cache_dir`` (compiled kernels;
        default ``$LILY_CACHE_DIR/cuda`` or ``~/.cache/lily/cuda``), ``dry_arch`` (compile for sm_N and run
        nothing: a compile check without a GPU)."""
        check_progress(progress, "Engine.from_pretrained", callable_ok=False)
        check_lm_head(lm_head)  # before any file is mapped
        name = DEFAULT_MODEL if model is None else model
        path = _packaged_model_path(str(name)) if isinstance(name, str) else None
        if path is None:
            if str(name) == DEFAULT_MODEL:
                raise CheckpointError(f"the packaged model '{DEFAULT_MODEL}' is not installed with this build")
            path = resolve_model_path(name, revision=revision)
        checkpoint = load_checkpoint(path, progress=bool(progress))
        tokenizer = Tokenizer.from_dir(path) if (pathlib.Path(path) / "tokenizer.json").is_file() else None
        return cls(checkpoint, backend=backend, threads=threads, prefill_chunk=prefill_chunk,
                   kv_cache_dtype=kv_cache_dtype, tokenizer=tokenizer, backend_options=backend_options,
                   keep_sessions=keep_sessions, lm_head=lm_head, mtp=mtp)

    # ---- tokens ----
    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise LilyError(f"checkpoint '{self.checkpoint.path}' has no tokenizer.json; pass token ids instead")
        return self.tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._need_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._need_tokenizer().decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.tokenizer.stop_token_ids) if self.tokenizer is not None else []

    def _validate_ids(self, ids) -> np.ndarray:
        if isinstance(ids, (list, tuple)):
            # One C++ pass for the common case; None (an item not an int in range) leaves it to the path below,
            # which names the bad id.
            fast = _core.token_ids(ids, self.config.vocab_size)
            if fast is not None:
                return fast
        elif not isinstance(ids, np.ndarray):
            ids = list(ids)  # any iterable of ints (a generator, a range, a deque)
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"token ids must be a non-empty 1-D sequence of ints, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= self.config.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"token id {int(arr[i])} at position {i} is outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        return np.ascontiguousarray(arr, dtype=np.int32)

    # ---- sessions ----
    def session(self, max_context: int = 4096, *, prefill_chunk: int | None = None) -> Session:
        """A new conversation with room for ``max_context`` tokens (KV cache allocated up front)."""
        # 2**40 tokens is far beyond any KV cache a machine holds; the core checks the bytes precisely.
        max_context = check_int(max_context, "max_context", minimum=1, maximum=2**40)
        chunk = self.prefill_chunk if prefill_chunk is None else prefill_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int, got {chunk!r}")
        if self._closed:
            raise LilyError("this Engine is closed")
        core = self._take_idle(max_context, chunk)
        try:
            if core is not None:
                core.reset()  # position 0; its KV rows stay, known by the snapshots they equal
            else:
                core = _core.Session(self._core, max_context, chunk, self.kv_cache_dtype)
        except MemoryError:
            raise LilyError(f"cannot allocate a session with max_context={max_context}: its KV cache and "
                            f"recurrent state need {self._state_bytes(max_context):,} bytes") from None
        s = Session(self, core)
        self._sessions.add(s)
        return s

    def kept_sessions(self) -> int:
        """How many closed sessions' states are kept for reuse now (``keep_sessions`` at most)."""
        with self._idle_lock:
            return len(self._idle)

    # _idle_lock is a leaf lock: nothing under it calls into the core (held_kv_rows and a state's destructor
    # wait for the engine lock, which a generation holds for a whole forward), so a reader such as
    # kept_sessions() or close() never waits behind a forward. Choices are made on a copy of the list and
    # applied only if the chosen state is still there.
    def _take_idle(self, max_context: int, chunk: int):
        """A kept session state of this shape whose KV rows no live snapshot shares (those are kept for the
        restores that can use them, _swap_for_restore); or None."""
        with self._idle_lock:
            fits = [c for c in self._idle if c.max_context == max_context and c.chunk == chunk]
        for c in fits:
            if c.held_kv_rows == 0:
                with self._idle_lock:
                    if any(k is c for k in self._idle):
                        self._idle.remove(c)
                        return c
        return None

    def _swap_for_restore(self, core, snapshot_core):
        """The kept session state of core's shape holding more of snapshot_core's KV rows than core does (the
        restore replaces the whole state, so which buffers hold it does not matter), core kept in its place;
        or None."""
        if not self._idle:
            return None
        with self._idle_lock:
            fits = [c for c in self._idle if c.max_context == core.max_context and c.chunk == core.chunk]
        if not fits:
            return None
        held = [c.held_kv_rows_of(snapshot_core) for c in fits]
        best_rows = max(held)
        if best_rows <= core.held_kv_rows_of(snapshot_core):
            return None
        best = fits[held.index(best_rows)]
        with self._idle_lock:
            if not any(k is best for k in self._idle):
                return None  # taken meanwhile by another session
            self._idle.remove(best)
            self._idle.append(core)
        return best

    def _swap_back(self, taken, mine):
        """Undoes _swap_for_restore: taken goes back to the kept states, mine (kept by it) comes back."""
        with self._idle_lock:
            if any(k is mine for k in self._idle):
                self._idle.remove(mine)
            self._idle.append(taken)
        return mine

    def _keep_idle(self, core) -> None:
        """Keeps a closed session's state for reuse (keep_sessions at most: the one holding the fewest rows that
        equal live snapshots' goes first)."""
        if self.keep_sessions == 0 or self._closed:
            return
        try:
            # A restore the session never ran a forward on is dropped here (reset writes nothing), so the snapshot
            # does not write into a kept state when it goes; its KV rows were not copied, so none are held.
            core.reset()
        except Exception:  # not reusable after all: freed with the handle
            return
        with self._idle_lock:
            self._idle.append(core)
            kept = list(self._idle)
        while len(kept) > self.keep_sessions:
            drop = min(kept, key=lambda c: c.held_kv_rows)
            with self._idle_lock:
                if any(k is drop for k in self._idle):
                    self._idle.remove(drop)
                kept = list(self._idle)
            del drop  # freed here, outside the lock (its destructor takes the engine's lock)

    def load_session(self, path: str | os.PathLike, max_context: int | None = None) -> Session:
        """Recreate a session saved with :meth:`Session.save`."""
        snap, meta = read_session_file(path, self.fingerprint)
        s = self.session(max_context=max_context or int(meta.get("max_context", 4096)))
        s._restore_from_file(snap, path)
        return s

    @property
    def fingerprint(self) -> str:
        """Identifies the model's config and weights (sessions can only move between equal models)."""
        if self._fingerprint is None:
            h = hashlib.sha256(json.dumps(self.config.to_core(), sort_keys=True).encode())
            if self._lm_head.quantized_at_load:  # its logits (kept in snapshots) differ from the stored head's
                h.update(f"lm_head:{self._lm_head.format}".encode())
            for name in sorted(self.checkpoint.tensors):
                t = self.checkpoint.tensors[name]
                if isinstance(t, dict):
                    h.update(f"{name}:{t['kind']}:{t['shape']}:{t.get('bits')}".encode())
                    h.update(np.asarray(t["data"]).reshape(-1).view(np.uint8)[:64].tobytes())
                else:
                    h.update(name.encode())
                    h.update(np.asarray(t, dtype=np.float32).tobytes())
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    # ---- one-call generation ----
    def _prompt_session(self, prompt: str | Iterable[int], max_tokens: int, where: str, *,
                        sampling: SamplingParams | None = None, stop: str | Iterable[str] | None = None,
                        progress: bool | Callable[[int, int], bool | None] | None = None,
                        prefill_chunk: int | None = None) -> Session:
        """A session sized for ``prompt`` + ``max_tokens`` with the prompt prefilled (arguments checked first)."""
        check_max_tokens(max_tokens, where)
        check_sampling(sampling, where)
        normalize_stop(stop, where)
        check_progress(progress, where)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        s = self.session(max_context=max(1, len(ids) + max_tokens), prefill_chunk=prefill_chunk)
        s.prefill(ids, progress=progress)
        return s

    def generate(self, prompt: str | Iterable[int], max_tokens: int = 256,
                 sampling: SamplingParams | None = None, *, stream: bool = False,
                 stop_token_ids: Iterable[int] | None = None,
                 stop: str | Iterable[str] | None = None, mtp: str | None = None,
                 mtp_k: int | None = None) -> str | Iterator[str]:
        """Complete a prompt (text or token ids). Returns the text, or an iterator of pieces when
        ``stream=True``. ``stop``: stop strings, excluded from the text (see :meth:`Session.stream`);
        ``mtp``/``mtp_k``: speculative decoding with the MTP head (see :meth:`Session.generate`)."""
        check_mtp(mtp, mtp_k, "Engine.generate", has_head=self.checkpoint.mtp_layers > 0, default=self.mtp)
        s = self._prompt_session(prompt, max_tokens, "Engine.generate", sampling=sampling, stop=stop)
        pieces = s.generate_text(max_tokens, sampling, stop_token_ids, stop=stop, mtp=mtp, mtp_k=mtp_k)
        return pieces if stream else "".join(pieces)

    def stream(self, prompt: str | Iterable[int], max_tokens: int = 256, sampling: SamplingParams | None = None,
               *, stop: str | Iterable[str] | None = None, stop_token_ids: Iterable[int] | None = None,
               progress: bool | Callable[[int, int], bool | None] | None = None,
               mtp: str | None = None, mtp_k: int | None = None,
               ) -> Iterator[GenerationResponse]:
        """Complete a prompt in a new session, yielding a :class:`lily.GenerationResponse` per token
        (text piece, token id, prompt and generation tokens/s, peak memory, finish reason on the last;
        ``stop`` strings as in :meth:`Session.stream`). ``progress`` applies to the prompt's prefill
        (as in :meth:`Session.prefill`). Raises ValueError/TypeError naming the argument before any work."""
        check_mtp(mtp, mtp_k, "Engine.stream", has_head=self.checkpoint.mtp_layers > 0, default=self.mtp)
        s = self._prompt_session(prompt, max_tokens, "Engine.stream", sampling=sampling, stop=stop,
                                 progress=progress)
        return s.stream(max_tokens, sampling, stop=stop, stop_token_ids=stop_token_ids, mtp=mtp, mtp_k=mtp_k)

    def chat(self, messages: list[dict], max_tokens: int = 512, sampling: SamplingParams | None = None, *,
             stream: bool = False, stop: str | Iterable[str] | None = None,
             **template_kwargs) -> str | Iterator[str]:
        """Answer a conversation rendered with the checkpoint's chat template (``stop`` strings as in
        :meth:`generate`)."""
        return self.generate(self.apply_chat_template(messages, **template_kwargs), max_tokens, sampling,
                             stream=stream, stop=stop)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        tok = self._need_tokenizer()
        text = render_chat(tok.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=tok.bos_token, eos_token=tok.eos_token, **template_kwargs)
        return tok.encode(text)

    # ---- introspection ----
    def set_profiling(self, enabled: bool) -> None:
        """Time every op by name from now on (and clear earlier timings); see :meth:`profile`."""
        self._core.set_profiling(bool(enabled))

    def profile(self) -> dict[str, float]:
        """Seconds spent per op name since profiling was switched on (host wall time: exact for the CPU
        backend, which runs each op synchronously)."""
        return dict(self._core.profile())

    def report(self) -> Report:
        """Backend, memory per component, chunk size, kernels, every optimization (active or not) and the LM
        head's format (``"lm_head"``: format, status, reason, option, the backend's default, bytes, seconds)."""
        if self._probe_stats is None:
            # Ops and stages are measured on a real decode step and prefill chunk of a scratch session.
            probe = self.session(max_context=3, prefill_chunk=2)
            probe.prefill([0, 0])
            prefill = probe.stats()["prefill_chunk"]
            probe.step(0)
            self._probe_stats = {"decode_step": probe.stats()["decode_step"], "prefill_chunk_2_tokens": prefill,
                                 "host_transfers_per_generated_token": "1 download (the 4-byte id), 0 uploads"}
            del probe
        core = self._core.report()
        rec = self._state_bytes(0)
        kv_per_token = self._state_bytes(1) - rec
        tok = self.tokenizer
        return Report({
            "model": str(self.checkpoint.path),
            "format": self.checkpoint.format,
            "quantization": self.checkpoint.quantization or "none",
            "backend": core["backend"],
            "device": core["device"],
            "threads": core["threads"],
            "prefill_chunk": self.prefill_chunk,
            "kv_cache_dtype": self.kv_cache_dtype,
            "memory": {
                "weights_mapped_bytes": dict(core["weight_bytes"]),
                "weights_total_bytes": sum(core["weight_bytes"].values()),
                "kv_cache_bytes_per_token": kv_per_token,
                "recurrent_state_bytes_per_session": rec,
                "backend_buffers_bytes": core["backend_buffer_bytes"],
                "mapped_regions": core["mappings"],
                "repacked_expert_bytes": core["repacked_expert_bytes"],
            },
            "experts_layout": ("stacked in place (one base + a stride per projection)"
                               if core["repacked_expert_projections"] == 0 else
                               f"repacked at load: {core['repacked_expert_projections']} expert projections "
                               "stored one tensor per expert were copied into stacked buffers"),
            "kernels": dict(core["kernels"]),
            "ops_per_step": self._probe_stats,
            "optimizations": list(core["optimizations"]),
            # The checkpoint's tie (the core's own flag says whether the head reads the embedding's bytes: not
            # when lm_head gave a tied head its own 8-bit copy, which "lm_head" reports).
            "tied_embeddings": self.config.tie_word_embeddings,
            "lm_head": self._lm_head.report(),
            "mtp": dict(_mtp_report(core["mtp"], self.checkpoint.mtp_bytes), policy=self._mtp.report()),
            # Closed sessions' state kept for reuse (a warm prefix-cache turn restores into one holding its rows).
            "keep_sessions": {"max": self.keep_sessions, "kept": self.kept_sessions()},
            # A checkpoint captured inside a prefill chunk (a prefix-cache turn's) writes into state tensors
            # allocated and written ahead, refilled after the generation that took them (none until one is taken).
            "checkpoint_reserve": dict(core["checkpoint_reserve"]),
            "skipped_tensors": dict(self.checkpoint.skipped),
            "tokenizer": "none" if tok is None else f"{tok.vocab_size} tokens, stop ids {tok.stop_token_ids}",
            # Long texts starting like a recent one reuse its ids up to a shared added-token boundary.
            "tokenizer_prefix_reuse": None if tok is None else tok._reuse.stats(),
            "backends": {name: b["status"] for name, b in backends().items()},
            "chat_template": "none" if tok is None else (
                "ChatML fallback (checkpoint has none)" if tok.chat_template is None else "from checkpoint"),
            # The backend's own figures (CUDA: device, kernel variants, compile and cache counts, graphs,
            # launches per decode step, memory by kind).
            **({core["backend"]: dict(core[core["backend"]])} if core["backend"] in core else {}),
        })


def _mtp_report(core: dict, stored_bytes: int) -> dict:
    """report()["mtp"]: whether the checkpoint has an MTP head (MODEL.md section 7) and what it costs
    (``bytes``: every tensor of the block as stored in the checkpoint, norms included)."""
    if not core["present"]:
        return {"present": False, "layers": 0, "bytes": 0,
                "status": "none in this checkpoint (mlx-lm conversions drop it; lily convert keeps it)"}
    out = {"present": True, "layers": core["layers"], "bytes": stored_bytes, "format": core["format"],
           "status": "loaded and placed with the decoder; while the engine's mtp policy keeps it (policy.keeps_rows) "
                     "its KV rows run in every forward so the block's cache covers the context; drafting in "
                     "generate(mtp='auto' or 'on', mtp_k=1..4)"}
    rows = core["decode_rows"]
    out["loop"] = ("each iteration's drafts, verify forward, accept decision and rollback run on the device, and the "
                   "next iteration is queued before the host reads this one; the verify runs in the decode phase "
                   f"(each row as a plain decode step computes it) for up to {rows} rows" if rows > 1 else
                   "each iteration's drafts, verify forward, accept decision and rollback run on the device, and the "
                   "next iteration is queued before the host reads this one; the verify runs in the prefill phase "
                   "(this backend's decode kernels take one row)")
    if core["repacked_expert_projections"]:
        out["repacked_expert_bytes"] = core["repacked_expert_bytes"]
        out["experts_layout"] = (f"repacked at load: {core['repacked_expert_projections']} expert projections "
                                 "stored one tensor per expert were copied into stacked buffers")
    else:
        out["experts_layout"] = "stacked in place (one base + a stride per projection)"
    return out
