"""A Session holds one conversation's state (KV cache, DeltaNet recurrent and conv state) on the engine."""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np

from .errors import CheckpointError, ContextOverflowError, LilyError
from .progress import check_progress, progress_callback
from .sampling import SamplingParams
from .validate import check_int, check_mtp, check_token_ids

if TYPE_CHECKING:
    from .engine import Engine
    from .streaming import GenerationResponse

# /2: a sha256 checksum over metadata, tensor names, dtypes, shapes and bytes (metadata 'checksum').
_SESSION_FORMAT = "lily-session/2"

# Generation loops still running (a suspended generator, one abandoned in a global, a daemon thread's).
# At interpreter exit they are cancelled and joined while Python still runs normally: a C++ loop that
# called back into Python during finalization would take the process down.
_LIVE_GENERATIONS: set = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_live_generations() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE_GENERATIONS)
    for cancelled, resume, worker in live:
        cancelled.set()
        resume.release()
    for _, _, worker in live:
        worker.join(timeout=30)


class _ClosedHandle:
    """Stands in for a released core object: any use raises a LilyError saying what was closed."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name: str):
        raise LilyError(f"{self._what} is closed")


def closed_handle(what: str) -> _ClosedHandle:
    return _ClosedHandle(what)


class Snapshot:
    """A copy of a session's state, held by the backend (restoring it never leaves the device); restore
    it into any session of the same model. Snapshots read from session files are host copies.

    A snapshot taken with ``base=`` shares the KV rows of the base's positions with it (and with the base's
    own base, and so on) and holds only its own conv/recurrent state, logits and the KV rows after the
    base: ``own_nbytes`` of them; ``nbytes`` counts everything it keeps alive, shared rows included."""

    def __init__(self, core_snapshot, fingerprint: str):
        self._core = core_snapshot
        self.fingerprint = fingerprint

    @property
    def position(self) -> int:
        return self._core.position

    @property
    def nbytes(self) -> int:
        """Bytes this snapshot keeps alive: its state and all the KV rows up to its position."""
        return self._core.nbytes

    @property
    def own_nbytes(self) -> int:
        """Bytes only this snapshot added: its conv/recurrent state, logits and tokens, and the KV rows from
        ``base_position`` to its position (all of them for a snapshot without a base or a host copy)."""
        return getattr(self._core, "own_nbytes", self._core.nbytes)

    @property
    def base_position(self) -> int:
        """Position of the base whose KV rows it shares (0: none shared)."""
        return getattr(self._core, "base_position", 0)

    @property
    def on_device(self) -> bool:
        """True for a backend snapshot (Session.snapshot), False for a host copy read from a file."""
        return hasattr(self._core, "own_nbytes")

    def __repr__(self) -> str:
        return f"Snapshot(position={self.position}, nbytes={self.nbytes}, own_nbytes={self.own_nbytes})"


class Session:
    """Prefill, step and generate on one context. Created by :meth:`Engine.session`."""

    def __init__(self, engine: "Engine", core_session):
        self._engine = engine
        self._core = core_session
        self.finish_reason: str | None = None
        self._live: tuple | None = None  # (cancelled, resume, worker) of a running generation
        self._prompt_stats = (0, 0.0)  # (tokens, seconds) prefilled since the last stream(): its prompt_tps
        self._token_logits = None  # logits [1, vocab] of the token being yielded (stream with logprobs)

    # ---- lifetime ----
    def close(self) -> None:
        """Release this session's state (KV cache, recurrent state), or hand it to the engine for a later
        session of the same shape (``Engine(keep_sessions=N)``). A running generation is cancelled first;
        later calls raise :class:`LilyError`. Also what ``with`` does."""
        self._close("this Session")

    def _close(self, why: str) -> None:
        live = self._live
        reusable = why == "this Session" and not isinstance(self._core, _ClosedHandle)
        if live is not None:
            cancelled, resume, worker = live
            cancelled.set()
            resume.release()
            if worker is not threading.current_thread():
                worker.join()
            else:
                reusable = False  # closed from its own generation's thread: the core is still in use
        what = "this Session" if why == "this Session" else f"this Session ({why})"
        core, self._core = self._core, closed_handle(what)
        if reusable:
            self._engine._keep_idle(core)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        from .display import session_repr

        return session_repr(self)

    def _repr_html_(self) -> str:
        from .display import session_html

        return session_html(self)

    # ---- state ----
    @property
    def engine(self) -> "Engine":
        return self._engine

    @property
    def position(self) -> int:
        """Tokens in the context (a sampled token not yet fed through the model counts)."""
        return self._core.position

    @property
    def max_context(self) -> int:
        return self._core.max_context

    @property
    def prefill_chunk(self) -> int:
        return self._core.chunk

    @property
    def kv_cache_dtype(self) -> str:
        return self._core.kv_dtype

    @property
    def state_bytes(self) -> int:
        """Bytes of this session's KV cache (all of max_context) and recurrent state."""
        return self._core.state_bytes

    @property
    def tokens(self) -> list[int]:
        return self._core.tokens()

    @property
    def logits(self) -> np.ndarray:
        """Logits (float32 [vocab]) predicting the token after the context."""
        return self._core.logits()[0]

    def stats(self) -> dict:
        """Ops and barrier-separated stages of the last decode step and the last prefill chunk, and the
        host transfers of the last generate call's decode loop (``steps`` ids read, one download each)."""
        return {"decode_step": self._core.decode_stats(), "prefill_chunk": self._core.prefill_stats(),
                "generate_transfers": self._core.generate_transfers(), "mtp": self.mtp_stats()}

    def mtp_stats(self) -> dict:
        """What the last speculative generate call (``mtp`` "on", or "auto" when it drafted) did: ``steps``
        (verify forwards), ``drafted`` and ``accepted`` draft tokens, ``trials`` (drafts compared: the accepted
        ones and each forward's first rejected one), ``acceptance_rate`` (accepted / drafted),
        ``mean_acceptance_length`` (tokens per verify forward: (accepted + steps) / steps, 1.0 when nothing is
        accepted), ``mean_k`` (drafts per forward, chosen per forward under "auto"), ``plain_tokens``
        (tokens "auto" decoded without drafting after it found drafting no longer paid) and ``queued`` (verify
        forwards queued on the device behind the previous one before the host had read it: the accept decision
        runs on the device, so the host's reading overlaps the next forward). All zero after a call
        that did not draft. The engine-wide decision: ``engine.report()["mtp"]["policy"]``."""
        m = dict(self._core.last_mtp_stats())
        m["acceptance_rate"] = m["accepted"] / m["drafted"] if m["drafted"] else 0.0
        m["mean_acceptance_length"] = (m["accepted"] + m["steps"]) / m["steps"] if m["steps"] else 0.0
        m["mean_k"] = m.pop("k_sum") / m["steps"] if m["steps"] else 0.0
        return m

    @property
    def mtp_cache_valid(self) -> bool:
        """Whether the MTP block's cache covers this session's context, so it can draft (False without an MTP
        head, or once tokens were fed while the engine did not keep the cache; a reset or a restore of a
        snapshot that had it makes it True again)."""
        return self._core.mtp_cache_valid()

    # ---- running the model ----
    def prefill(
        self,
        ids: Iterable[int] | np.ndarray,
        *,
        all_logits: bool = False,
        progress: bool | Callable[[int, int], bool | None] | None = None,
    ) -> np.ndarray:
        """Feed tokens through the model in chunks of ``prefill_chunk``.

        Returns the logits of the last token fed (float32 [vocab]) or, with ``all_logits=True``, of every
        token fed ([n, vocab]). ``progress=True`` shows a ``tqdm.auto`` bar (a widget in Jupyter); a
        callable ``progress(done, total)`` runs after each chunk, and returning False stops between
        chunks: what was computed stays in the context, and the result covers exactly those tokens (the
        last one's logits, or ``done`` rows). Raises TypeError for any other ``progress``.
        """
        check_progress(progress, "Session.prefill")
        arr = self._engine._validate_ids(ids)
        before, t = self.position, time.perf_counter()
        try:
            with progress_callback(progress, total=len(arr), desc="prefill", unit="tok") as callback:
                out, done = self._core.prefill(arr, bool(all_logits), callback)
        finally:
            tokens, seconds = self._prompt_stats
            self._prompt_stats = (tokens + self.position - before, seconds + time.perf_counter() - t)
        return out[:done] if all_logits else out[0]

    def prefill_snapshots(
        self,
        ids: Iterable[int] | np.ndarray,
        at: Iterable[int],
        *,
        base: Snapshot | None = None,
        progress: bool | Callable[[int, int], bool | None] | None = None,
        defer: bool = True,
    ) -> list[Snapshot]:
        """Feed tokens as :meth:`prefill` does and return a snapshot of the state at each position in ``at``
        (strictly ascending session positions, each after the current one and at most the position after
        ``ids``): what :meth:`snapshot` taken at that position would hold. Snapshot 0 shares KV rows with
        ``base`` (as ``snapshot(base=...)`` would there), each later one with the one before.

        No position costs a forward of its own: the prefill chunk that reaches it also keeps the DeltaNet state
        after that row (one forward serves a checkpoint inside the chunk and the end of the prompt; a chunk
        holding two such positions ends at the second). ``progress`` as in :meth:`prefill`; if it stops the
        prefill, the snapshots of the positions reached are returned. Raises ValueError (naming ``at`` or
        ``base``) for positions out of range or a base that cannot be shared, TypeError for a non-Snapshot base.

        ``defer`` (default True) leaves the copies that do not need the chunk's scratch off the path to the first
        token: the snapshots' KV rows, and the end-of-prompt snapshot's state when that position ends the prefill.
        The session writes them at its next call that could overwrite them (generate's second decode step or its
        end, prefill, step, restore, reset, ...), or whoever reads the snapshot first does (a restore into any
        session, ``to_host``): a snapshot always reads as the eager one would. ``deferred_checkpoints`` counts
        the copies still owed; ``defer=False`` takes them inside the prefill, as before.
        """
        check_progress(progress, "Session.prefill_snapshots")
        arr = self._engine._validate_ids(ids)
        positions = [check_int(p, "Session.prefill_snapshots: at[]") for p in at]
        core_base = None
        if base is not None:
            if not isinstance(base, Snapshot):
                raise TypeError(f"Session.prefill_snapshots: base must be a Snapshot, got {type(base).__name__}")
            if not base.on_device or base.fingerprint != self._engine.fingerprint:
                raise ValueError("Session.prefill_snapshots: base must be a snapshot taken on this model by "
                                 "Session.snapshot (not a host copy read from a file)")
            core_base = base._core
        start = self.position
        for i, p in enumerate(positions):
            if not start < p <= start + len(arr) or (i and p <= positions[i - 1]):
                raise ValueError(f"Session.prefill_snapshots: at must ascend strictly within ({start}, "
                                 f"{start + len(arr)}], got {p} at index {i}")
        before, t = self.position, time.perf_counter()
        try:
            with progress_callback(progress, total=len(arr), desc="prefill", unit="tok") as callback:
                cores = self._core.prefill_snapshots(arr, positions, core_base, callback, bool(defer))
        except ValueError as exc:
            raise ValueError(f"Session.prefill_snapshots: {exc}") from None
        finally:
            tokens, seconds = self._prompt_stats
            self._prompt_stats = (tokens + self.position - before, seconds + time.perf_counter() - t)
        return [Snapshot(c, self._engine.fingerprint) for c in cores]

    @property
    def deferred_checkpoints(self) -> int:
        """KV segments and snapshot states this session still owes to snapshots from
        :meth:`prefill_snapshots` (``defer=True``); 0 once written."""
        return self._core.deferred_checkpoints

    def step(self, token: int) -> np.ndarray:
        """Feed one token; returns the logits that follow it (float32 [vocab])."""
        arr = self._engine._validate_ids([token])
        return self._core.step(int(arr[0]))[0]

    def generate(
        self,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop_token_ids: Iterable[int] | None = None,
        *,
        mtp: str | None = None,
        mtp_k: int | None = None,
    ) -> Iterator[int]:
        """Sample up to ``max_tokens`` tokens, yielding each id as soon as it is chosen.

        The loop runs in C++ without the GIL; every yielded token joins the context (so the next
        prefill/generate continues after it). Stops after a stop token (the tokenizer's by default;
        pass ``[]`` for none), at ``max_tokens``, at ``max_context``, or when the iterator is closed.
        The reason is left in ``session.finish_reason``.

        ``mtp``: speculative decoding with the checkpoint's MTP head (None: the engine's policy,
        ``Engine.from_pretrained(mtp=...)``, "auto" by default). "on": ``mtp_k`` (1..4, default 3) drafts per
        forward of the model; "auto": drafts only while the measured cost and the acceptance so far say it pays,
        choosing k per forward (up to ``mtp_k``, default 4; lily.mtp); "off": none. The output is the model's:
        token for token when greedy, in distribution when sampling (every transform of ``sampling``
        included); :meth:`mtp_stats` says what was drafted and accepted. Raises ValueError naming ``mtp`` /
        ``mtp_k`` (an unknown mode, k outside 1..4, "on" without an MTP head or in a session whose MTP cache
        was not kept: see ``mtp_cache_valid``).
        """
        return self._generate(max_tokens, sampling, stop_token_ids, with_logits=False, mtp=mtp, mtp_k=mtp_k)

    def _generate(self, max_tokens, sampling, stop_token_ids, *, with_logits: bool, mtp: str | None = None,
                  mtp_k: int | None = None) -> Iterator[int]:
        """:meth:`generate`; with ``with_logits`` each token's logits (float32 [vocab], the distribution
        it was sampled from, before penalties) are in ``self._token_logits`` while it is yielded."""
        max_tokens = check_int(max_tokens, "max_tokens")
        engine = self._engine
        mode, mtp_k = check_mtp(mtp, mtp_k, "Session.generate", has_head=engine.checkpoint.mtp_layers > 0,
                                default=engine.mtp)
        if self.position == 0:
            raise LilyError("generate() needs a context: prefill a prompt first")
        if mode == "on" and not self._core.mtp_cache_valid():
            raise ValueError("Session.generate: mtp='on' needs the MTP block's cache over this session's context, "
                             "and it was not kept (tokens were fed while the engine's mtp policy was 'off' or "
                             "'auto' had turned it off); use a new or reset session of an engine with mtp='on'")
        try:  # under "auto" the engine's first call may measure its iteration costs here (lily.mtp)
            k, policy = engine._mtp.plan(self, mode, mtp_k)
        except KeyboardInterrupt:  # Ctrl-C before the first token: nothing was generated
            self.finish_reason = "cancelled"
            raise
        params = (sampling if sampling is not None else SamplingParams()).to_core()
        stops = self._engine.stop_token_ids if stop_token_ids is None else check_token_ids(stop_token_ids, "stop_token_ids")
        self.finish_reason = None
        return self._run_generation(max_tokens, params, stops, with_logits, k, policy, auto=mode == "auto")

    def _run_generation(self, max_tokens: int, params: dict, stops: list[int], with_logits: bool,
                        mtp_k: int = 0, policy: dict | None = None, auto: bool = False) -> Iterator[int]:
        # Tokens are handed over one at a time (an MTP iteration's in one handoff, yielded one at a time): the C++
        # loop waits until the consumer asks for the token after them, so the context always equals exactly what
        # the caller has seen.
        handoff: queue.SimpleQueue = queue.SimpleQueue()
        resume = threading.Semaphore(0)
        cancelled = threading.Event()
        outcome: dict = {}

        # The consumer marks each token as it hands it to the caller; a token still in the queue when the
        # consumer stops (Ctrl-C while it waited, close(), exit) was never seen and must not join the context.
        taken = [0]  # tokens the consumer has handed to the caller

        def on_token(tok: int, logits=None) -> int:
            seq = taken[0]
            handoff.put(([tok], logits))
            resume.acquire()
            if taken[0] == seq:
                return -1  # not received
            return 0 if cancelled.is_set() else 1

        # An MTP iteration's tokens in one handoff (logits [n, vocab] or None): the worker waits once per verify
        # forward, not once per token. Answers how many the consumer received and whether it wants more.
        def on_tokens(toks: list[int], logits=None) -> tuple[int, bool]:
            seq = taken[0]
            handoff.put((toks, logits))
            resume.acquire()
            return taken[0] - seq, not cancelled.is_set()

        def run() -> None:
            try:
                outcome["reason"] = self._core.generate(max_tokens, params, stops, on_token, with_logits, mtp_k,
                                                        policy, on_tokens)
                if auto:  # the engine's acceptance estimate learns from this call
                    self._engine._mtp.observe(self._core.last_mtp_stats(), speculative=mtp_k > 0)
            except BaseException as exc:  # re-raised in the consumer's thread
                outcome["error"] = exc
            handoff.put(None)

        worker = threading.Thread(target=run, name="lily-generate", daemon=True)
        entry = (cancelled, resume, worker)
        self._live = entry
        with _LIVE_LOCK:
            _LIVE_GENERATIONS.add(entry)
        worker.start()
        try:
            while True:
                item = handoff.get()
                if item is None or cancelled.is_set():  # finished, or cancelled by close() / exit
                    break
                toks, logits = item
                try:
                    for i, tok in enumerate(toks):
                        if i and cancelled.is_set():  # close() / exit from another thread: the rest is not received
                            break
                        self._token_logits = None if logits is None else logits[i:i + 1]
                        consumed = False
                        taken[0] += 1
                        try:
                            yield tok
                            consumed = True
                        finally:
                            if not consumed:  # closed or thrown into: the C++ loop stops after this token
                                cancelled.set()
                finally:
                    resume.release()
        finally:
            cancelled.set()
            resume.release()
            worker.join()
            with _LIVE_LOCK:
                _LIVE_GENERATIONS.discard(entry)
            self._live = None
            # Also when the consumer closed the iterator early (break, close(), garbage collection).
            self.finish_reason = outcome.get("reason", "cancelled") if "error" not in outcome else None
        if "error" in outcome:
            raise outcome["error"]

    def stream(
        self,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        *,
        stop: str | Iterable[str] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = True,
        logprobs: int = 0,
        mtp: str | None = None,
        mtp_k: int | None = None,
    ) -> Iterator["GenerationResponse"]:
        """Generate like :meth:`generate`, yielding one :class:`lily.GenerationResponse` per token.

        ``logprobs=k`` (k >= 1) adds each token's log-probability and the k most likely tokens with theirs
        (``response.logprob``, ``response.top_logprobs``), from the model's distribution at that step
        (log-softmax of the logits, before sampling penalties and temperature): one extra [vocab] download
        per token.

        ``stop``: stop strings (a str or a list), matched on the text across token boundaries. Text that
        could be the start of a stop string is held back until it is decided, so no part of a stop
        string is ever emitted; when one completes the stream ends with ``finish_reason="stop"`` and
        ``session.finish_reason == "stop"``. The returned text excludes the stop string (and anything
        after it in the same token); the context includes the token(s) that completed it, as in mlx-lm
        and llama-cpp-python. The last response carries the finish reason ("stop", "length",
        "context"; "cancelled" on an external cancel); earlier ones have None. No token, no response.

        ``prompt_tokens``/``prompt_tps`` count what :meth:`prefill` fed since the previous stream.
        Raises ValueError/TypeError naming the argument, LilyError without a context or tokenizer.
        """
        from .streaming import check_max_tokens, check_sampling, normalize_stop, stream_responses

        check_max_tokens(max_tokens, "Session.stream")
        check_sampling(sampling, "Session.stream")
        stops = normalize_stop(stop, "Session.stream")
        decoder = self._engine._need_tokenizer().stream_decoder(skip_special_tokens=bool(skip_special_tokens))
        stop_ids = (self._engine.stop_token_ids if stop_token_ids is None
                    else check_token_ids(stop_token_ids, "Session.stream: stop_token_ids"))
        logprobs = check_int(logprobs, "Session.stream: logprobs", maximum=self._engine.config.vocab_size)
        ids = self._generate(max_tokens, sampling, stop_ids, with_logits=logprobs > 0, mtp=mtp, mtp_k=mtp_k)
        (prompt_tokens, prompt_seconds), self._prompt_stats = self._prompt_stats, (0, 0.0)
        return stream_responses(self, ids, decoder, max_tokens=max_tokens, stop_ids=stop_ids, stops=stops,
                                prompt_tokens=prompt_tokens, prompt_seconds=prompt_seconds, logprobs=logprobs)

    def generate_text(
        self,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop_token_ids: Iterable[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        stop: str | Iterable[str] | None = None,
        mtp: str | None = None,
        mtp_k: int | None = None,
    ) -> Iterator[str]:
        """Like :meth:`generate`, yielding text pieces that never split a multi-byte character (the
        non-empty texts of :meth:`stream`; ``stop`` strings and ``mtp`` as there)."""
        from .streaming import texts

        return texts(self.stream(max_tokens, sampling, stop=stop, stop_token_ids=stop_token_ids,
                                 skip_special_tokens=skip_special_tokens, mtp=mtp, mtp_k=mtp_k))

    # ---- state handles ----
    def snapshot(self, *, base: Snapshot | None = None) -> Snapshot:
        """A copy of this session's state (device tensors). With ``base``, an earlier snapshot of this
        model whose tokens are a prefix of this session's context, the KV rows of the base's positions are
        shared with it rather than copied (only the rows after them are): a conversation's checkpoints then
        hold each KV row once. Raises TypeError / ValueError naming ``base`` when it cannot be shared (a
        host copy, another model or engine, another KV dtype, or tokens that are not a prefix)."""
        if base is None:
            return Snapshot(self._core.snapshot(), self._engine.fingerprint)
        if not isinstance(base, Snapshot):
            raise TypeError(f"Session.snapshot: base must be a Snapshot, got {type(base).__name__}")
        if not base.on_device:
            raise ValueError("Session.snapshot: base is a host copy (read from a file); only a snapshot taken "
                             "by Session.snapshot can share its KV rows")
        if base.fingerprint != self._engine.fingerprint:
            raise ValueError("Session.snapshot: base was taken on a different model")
        try:
            core = self._core.snapshot(base._core)
        except ValueError as exc:
            raise ValueError(f"Session.snapshot: {exc}") from None
        return Snapshot(core, self._engine.fingerprint)

    def restore(self, snapshot: Snapshot) -> None:
        """Make this session's state the snapshot's (its context at once). A device snapshot is not copied here:
        the next forward reads its state in the same step (a warm turn pays no step for the restore), and any
        other read of the state writes it first; the snapshot may be dropped at any time."""
        if not isinstance(snapshot, Snapshot):
            raise TypeError("restore() takes a Snapshot from Session.snapshot() or Engine.load_session()")
        if snapshot.fingerprint != self._engine.fingerprint:
            raise LilyError("snapshot was taken on a different model; it cannot be restored here")
        if snapshot.on_device and self._live is None and not isinstance(self._core, _ClosedHandle):
            # A kept session state already holding more of the snapshot's KV rows takes this one's place
            # (Engine(keep_sessions=N)): the restore replaces the whole state, and copies fewer rows there.
            better = self._engine._swap_for_restore(self._core, snapshot._core)
            if better is not None:
                mine, self._core = self._core, better
                try:
                    better.restore(snapshot._core)
                except BaseException:  # refused before touching the state: this session is as it was
                    self._core = self._engine._swap_back(better, mine)
                    raise
                return
        self._core.restore(snapshot._core)

    def fork(self, max_context: int | None = None) -> "Session":
        """A new, independent session continuing from this one's state."""
        child = self._engine.session(max_context=max_context or self.max_context, prefill_chunk=self.prefill_chunk)
        child.restore(self.snapshot())
        return child

    def load(self, path: str | os.PathLike) -> None:
        """Replace this session's state with one saved by :meth:`save` (same model; it must fit
        max_context). On any error the session is left as it was."""
        snap, _ = read_session_file(path, self._engine.fingerprint)
        self._restore_from_file(snap, path)

    def _restore_from_file(self, snap: Snapshot, path) -> None:
        try:
            self.restore(snap)
        except ContextOverflowError:
            raise
        except ValueError as exc:
            raise CheckpointError(f"session file '{path}' does not fit this model: {exc}") from exc

    def reset(self) -> None:
        """Empty the context (position 0)."""
        self._core.reset()

    def save(self, path: str | os.PathLike) -> None:
        """Write the session state to a safetensors file (load it with Engine.load_session or load)."""
        snap = self._core.snapshot()
        write_session_file(path, snap.to_arrays(), fingerprint=self._engine.fingerprint,
                           max_context=self.max_context, position=snap.position)


def write_session_file(path: str | os.PathLike, arrays: dict, *, fingerprint: str, max_context: int, position: int,
                       extra: dict[str, str] | None = None) -> None:
    """Write a snapshot's host arrays (``to_arrays()``) as a session file: safetensors, metadata ``format``,
    ``fingerprint``, ``max_context``, ``position`` (and ``extra``), and a sha256 ``checksum`` over all of it.
    Written to a temporary name and renamed, so a half-written file never appears under ``path``."""
    from .checkpoint import SafetensorsWriter

    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    specs = [(name, _session_dtype(name, a), a.shape) for name, a in arrays.items()]
    meta = {**(extra or {}), "format": _SESSION_FORMAT, "fingerprint": fingerprint,
            "max_context": str(max_context), "position": str(position)}
    meta["checksum"] = _session_checksum(meta, ((n, dt, shp, arrays[n]) for n, dt, shp in specs))
    tmp = f"{os.fspath(path)}.{os.getpid()}.{threading.get_ident()}.tmp"  # one per writer thread
    try:
        with SafetensorsWriter(tmp, specs, metadata=meta) as w:
            for name, a in arrays.items():
                w.write(name, a)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)  # never leaves a half-written file under the real name


# A session file's own max_context claim is bounded before Engine.load_session allocates a KV cache for
# it: 2**24 tokens is 64x the real model's max_position_embeddings (262144, MODEL.md 1.2).
_SESSION_MAX_CONTEXT = 1 << 24

# numpy dtype -> safetensors dtype of the arrays a snapshot may hold (bf16 travels as uint16 bits).
_NUMPY_TO_SAFETENSORS = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8", np.dtype("<u2"): "U16",
    np.dtype("<i2"): "I16", np.dtype("<f2"): "F16", np.dtype("<u4"): "U32", np.dtype("<i4"): "I32",
    np.dtype("<f4"): "F32", np.dtype("<u8"): "U64", np.dtype("<i8"): "I64", np.dtype("<f8"): "F64",
}
# Token ids are the arrays whose dtype Lily checks itself: a float array would be truncated silently.
_INT32_ARRAYS = ("tokens", "pending")


def _session_dtype(name: str, a: np.ndarray) -> str:
    dt = _NUMPY_TO_SAFETENSORS.get(a.dtype)
    if dt is None:
        raise ValueError(f"snapshot array '{name}' has dtype {a.dtype}, which a session file cannot store")
    return dt


def _session_checksum(meta: dict[str, str], tensors: Iterable[tuple[str, str, tuple, np.ndarray]]) -> str:
    """sha256 over the metadata (but the checksum itself), then each tensor's name, dtype, shape and bytes
    in name order; the JSON line per tensor fixes how many bytes follow it."""
    import hashlib

    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    for name, dtype, shape, a in sorted(tensors, key=lambda t: t[0]):
        h.update(json.dumps([name, dtype, [int(d) for d in shape]]).encode())
        if a.size:
            h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return "sha256:" + h.hexdigest()


def _meta_int(meta: dict[str, str], key: str, path, lo: int, hi: int) -> int:
    v = meta.get(key)
    # ASCII digits only: int() would also take " 64", "+64", "6_4" and other scripts' digits.
    if not isinstance(v, str) or not (v.isascii() and v.isdigit() and len(v) <= 20):
        shown = "missing" if v is None else f"{v[:40]!r}"
        raise CheckpointError(f"session file '{path}': metadata field '{key}' must be a decimal integer, got {shown}")
    n = int(v)
    if not lo <= n <= hi:
        raise CheckpointError(f"session file '{path}': metadata field '{key}' is {n}, outside [{lo}, {hi}]")
    return n


def read_session_file(path: str | os.PathLike, fingerprint: str) -> tuple[Snapshot, dict]:
    """The snapshot and metadata of a saved session, checked against the engine's model fingerprint.

    Raises CheckpointError (naming the file and the field or tensor) for anything that is not an intact
    session file of this format, LilyError for a session of another model."""
    from . import _core
    from .checkpoint import SafetensorsFile

    try:
        f = SafetensorsFile(path)  # validates the header: dtypes, shapes, offsets inside the file
    except CheckpointError as exc:
        raise CheckpointError(f"cannot read session file '{path}': {exc}") from None
    arrays: dict[str, np.ndarray] = {}
    try:
        meta = dict(f.metadata)
        fmt = meta.get("format")
        if fmt != _SESSION_FORMAT:
            if isinstance(fmt, str) and fmt.startswith("lily-session/"):
                raise CheckpointError(f"session file '{path}' has format {fmt[:40]!r}; this Lily reads "
                                      f"{_SESSION_FORMAT!r} (save the session again with this version)")
            raise CheckpointError(f"'{path}' is not a Lily session file (format {json.dumps(fmt)[:40]})")
        max_context = _meta_int(meta, "max_context", path, 1, _SESSION_MAX_CONTEXT)
        position = _meta_int(meta, "position", path, 0, max_context)
        if meta.get("fingerprint") != fingerprint:
            raise LilyError(f"session file '{path}' was saved on a different model; it cannot be loaded here")
        for name in _INT32_ARRAYS:
            info = f.tensors.get(name)
            if info is None:
                raise CheckpointError(f"session file '{path}' has no tensor '{name}'")
            if info.dtype != "I32" or len(info.shape) != 1:
                raise CheckpointError(f"session file '{path}': tensor '{name}' must be a 1-D I32 array of token "
                                      f"ids, got {info.dtype} {list(info.shape)}")
        n_pending = f.tensors["pending"].shape[0]
        if n_pending > 1:
            raise CheckpointError(f"session file '{path}': tensor 'pending' holds {n_pending} ids, at most 1")
        arrays = {name: f.array(name) for name in f.tensors}  # views into the map, no copy
        has_pending = n_pending == 1 and int(arrays["pending"][0]) >= 0
        if f.tensors["tokens"].shape[0] + has_pending != position:
            raise CheckpointError(f"session file '{path}': metadata field 'position' is {position} but the file "
                                  f"holds {f.tensors['tokens'].shape[0]} tokens"
                                  + (" and a pending one" if has_pending else ""))
        expected = meta.get("checksum")
        actual = _session_checksum(meta, ((n, t.dtype, t.shape, arrays[n]) for n, t in f.tensors.items()))
        if expected != actual:
            raise CheckpointError(f"session file '{path}' is corrupt: checksum mismatch")
        try:
            snap = _core.HostSnapshot.from_arrays(arrays)
        except (ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: nanobind's failed casts
            raise CheckpointError(f"session file '{path}' is malformed: {exc}") from exc
    finally:
        arrays.clear()  # drop the views so the map can close now
        f.close()
    return Snapshot(snap, fingerprint), meta
