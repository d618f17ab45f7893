"""Streaming responses: one :class:`GenerationResponse` per generated token, and stop strings.

Built on the public token iterator :meth:`Session.generate`, which hands ids over one at a time (the
context always equals what the caller has seen, and closing it stops the C++ loop after the current
token). Text comes from the tokenizer's incremental decoder; stop strings are matched on that text
across token boundaries.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np

from .sampling import SamplingParams
from .validate import check_int

if TYPE_CHECKING:
    from .session import Session
    from .tokenizer import StreamDecoder

__all__ = ["GenerationResponse", "StopStringMatcher", "normalize_stop", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (``getrusage``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


@dataclass(frozen=True)
class GenerationResponse:
    """One step of a streamed generation (field names follow mlx-lm's ``GenerationResponse``).

    - ``text``: the text this step completed; may be ``""`` (a multi-byte character or a possible stop
      string is still incomplete, or a special token was skipped). Joined, the texts are the output.
    - ``token``: the id generated this step (it is in the session's context).
    - ``prompt_tokens``, ``prompt_tps``: tokens prefilled for this generation and their tokens/s (for
      :meth:`Session.stream`: what :meth:`Session.prefill` fed since the previous stream; 0 and 0.0 if none).
    - ``generation_tokens``, ``generation_tps``: tokens generated so far, and their rate since the
      generation started (tokens/s).
    - ``peak_memory_bytes``: the process's peak resident set size so far, in bytes.
    - ``finish_reason``: ``None`` until the last response, then ``"stop"`` (a stop token or stop string),
      ``"length"`` (max_tokens), ``"context"`` (max_context) or ``"cancelled"``.
    - ``logprob``, ``top_logprobs``: with ``stream(logprobs=k)``, the token's natural-log probability and
      the k most likely ``(token, logprob)`` pairs, most likely first (ties: lower id); else None and ().
    """

    text: str
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory_bytes: int
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()

    @property
    def peak_memory(self) -> float:
        """Peak resident memory in GB (10**9 bytes), as mlx-lm's field of the same name."""
        return self.peak_memory_bytes / 1e9


def token_logprobs(logits, tok: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """log-softmax of one logits row (float64): the token's log-probability and the top k pairs."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    order = np.lexsort((np.arange(x.size), -x))[:k]
    return float(x[tok] - lse), tuple((int(i), float(x[i] - lse)) for i in order)


def normalize_stop(stop: str | Iterable[str] | None, where: str) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (a single string is one stop string).

    Raises TypeError when it is not a string or an iterable of strings, ValueError for an empty one.
    """
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"{where}: stop must be a str, a list of str or None, got {stop!r}") from None
    for s in items:
        if not isinstance(s, str):
            raise TypeError(f"{where}: stop must be a str, a list of str or None, got an item {s!r}")
        if not s:
            raise ValueError(f"{where}: stop strings must be non-empty, got {stop!r}")
    return tuple(dict.fromkeys(items))


class StopStringMatcher:
    """Finds the first stop string in a stream of text pieces, never releasing part of one.

    :meth:`push` returns ``(text, matched)``: the text that is now safe to emit and whether a stop
    string completed. Text that could still be the start of a stop string is held back until later
    pieces decide it; on a match, the text before the earliest occurrence of any stop string is
    released and the rest (the stop string and anything after it) dropped. :meth:`flush` releases
    what is held back when the stream ends without a match.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"StopStringMatcher needs non-empty stop strings, got {stops!r}")
        self._stops = tuple(stops)
        self._held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        buf = self._held + piece
        # Emitted text never ends in a stop string's prefix, so any match starts inside buf.
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


_END = object()


def stream_responses(
    session: "Session",
    ids: Iterator[int],
    decoder: "StreamDecoder",
    *,
    max_tokens: int,
    stop_ids: Iterable[int],
    stops: tuple[str, ...],
    prompt_tokens: int,
    prompt_seconds: float,
    logprobs: int = 0,
) -> Iterator[GenerationResponse]:
    """Responses for the token iterator ``ids`` (from ``session.generate``), one per token.

    The C++ loop ends after a stop token, at ``max_tokens`` or when the context is full; on such a
    token the iterator is drained before the response is yielded, so the last response carries the
    session's finish reason (this resumes the loop only to let it return: no token is sampled). A
    completed stop string closes the iterator (the context keeps the tokens seen, including those
    that completed it) and sets ``session.finish_reason = "stop"``. No token, no response.
    """
    stop_set = frozenset(int(t) for t in stop_ids)
    matcher = StopStringMatcher(stops) if stops else None
    start = session.position
    limit = session.max_context
    prompt_tps = prompt_tokens / prompt_seconds if prompt_tokens and prompt_seconds > 0 else 0.0
    t0 = time.perf_counter()
    n = 0

    def response(text: str, tok: int, finish: str | None) -> GenerationResponse:
        dt = time.perf_counter() - t0
        lp, top = token_logprobs(session._token_logits, tok, logprobs) if logprobs else (None, ())
        return GenerationResponse(text=text, token=tok, prompt_tokens=prompt_tokens, prompt_tps=prompt_tps,
                                  generation_tokens=n, generation_tps=n / dt if dt > 0 else 0.0,
                                  peak_memory_bytes=peak_rss_bytes(), finish_reason=finish, logprob=lp,
                                  top_logprobs=top)

    def release(piece: str) -> tuple[str, bool]:
        return matcher.push(piece) if matcher is not None else (piece, False)

    try:
        tok = next(ids, _END)
        while tok is not _END:
            n += 1
            text, matched = release(decoder.push(tok))
            if matched:
                ids.close()  # the C++ loop stops after this token: the context is what was seen
                session.finish_reason = "stop"
                yield response(text, tok, "stop")
                return
            # Mirrors the C++ loop's exits (stop id, max_tokens, position >= max_context).
            ends_here = tok in stop_set or n >= max_tokens or start + n >= limit
            nxt = next(ids, _END) if ends_here else None
            if nxt is _END:
                tail, matched = release(decoder.flush())
                if matched:
                    session.finish_reason = "stop"
                elif matcher is not None:
                    tail += matcher.flush()
                yield response(text + tail, tok, session.finish_reason)
                return
            yield response(text, tok, None)
            last, tok = tok, (next(ids, _END) if nxt is None else nxt)
        if n:
            # The loop ended for a reason not visible at the token (e.g. cancelled from elsewhere): one
            # more response, repeating the last token, carries the remaining text and the reason.
            tail, matched = release(decoder.flush())
            if matched:
                session.finish_reason = "stop"
            elif matcher is not None:
                tail += matcher.flush()
            yield response(tail, last, session.finish_reason)
    finally:
        ids.close()


def check_max_tokens(max_tokens: object, where: str) -> int:
    return check_int(max_tokens, f"{where}: max_tokens")


def check_sampling(sampling: object, where: str) -> SamplingParams | None:
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(f"{where}: sampling must be a lily.SamplingParams or None, got {sampling!r}")
    return sampling


def texts(responses: Iterator[GenerationResponse]) -> Iterator[str]:
    """The non-empty texts of ``responses``; closing this closes them (and so the generation)."""
    try:
        for r in responses:
            if r.text:
                yield r.text
    finally:
        responses.close()  # type: ignore[attr-defined]
