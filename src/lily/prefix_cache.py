"""A prefix cache over session snapshots: a new prompt that starts like an earlier one restores the state
saved at the end of that prefix and prefills only the rest.

Recurrent (DeltaNet) state cannot be trimmed back to an earlier position, so the cache keeps whole states
at the positions a later prompt is likely to share: the end of each prompt's prefill (the next turn's prompt
re-renders the conversation so far, so it shares at least this much when the template re-renders earlier
turns unchanged, and this is what stays useful when the template drops earlier reasoning) and the end of each
generation (the prompt plus the reply, hit when the next turn renders the reply exactly as it was
generated). A lookup takes the longest cached token sequence that is a prefix of the new prompt and shorter
than it (at least one token is always prefilled, so the last position's logits are computed fresh).

**Checkpoints are copies**: each one is a :meth:`Session.snapshot`, which copies the KV rows up to its
position plus the recurrent and conv state. Checkpoints of one conversation therefore hold the shared KV
rows once each, not once in all (sharing them needs the core to reference KV rows across snapshots). The
byte budget (``max_bytes``, least recently used evicted first) counts every copy.

Restoring then prefilling the rest gives the state a cold prefill of the whole prompt gives, up to the
floating-point effect of where prefill chunks begin (the rest is one chunk sequence starting at the cached
position instead of at 0).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from .session import Session, Snapshot

__all__ = ["PrefixCache"]


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    snapshot: "Snapshot"
    nbytes: int


class PrefixCache:
    """Session checkpoints keyed by their token sequence, within ``max_bytes`` (LRU eviction).

    Thread-safe: any number of sessions (each used by one thread) may call :meth:`prefill` and
    :meth:`store` at once; snapshots are immutable, so one entry may be restored into several sessions.
    """

    def __init__(self, engine, max_bytes: int = 1 << 30):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"PrefixCache: max_bytes must be an int >= 0, got {max_bytes!r}")
        self.engine = engine
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # least recently used first
        self._by_first: dict[int, set[tuple[int, ...]]] = {}  # first token -> keys: lookups scan only these
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0
        self.evictions = 0

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "tokens_saved": self.tokens_saved,
                    "evictions": self.evictions}

    def lookup(self, ids: Sequence[int]) -> tuple[int, "Snapshot | None"]:
        """The longest cached prefix of ``ids`` shorter than ``ids``: (its length, its snapshot), or (0, None)."""
        ids = tuple(int(t) for t in ids)
        with self._lock:
            best: _Entry | None = None
            for key in self._by_first.get(ids[0], ()) if ids else ():
                n = len(key)
                if n < len(ids) and (best is None or n > len(best.tokens)) and ids[:n] == key:
                    best = self._entries[key]
            if best is None:
                self.misses += 1
                return 0, None
            self._entries.move_to_end(best.tokens)
            self.hits += 1
            self.tokens_saved += len(best.tokens)
            return len(best.tokens), best.snapshot

    def prefill(self, session: "Session", ids: Sequence[int], *, checkpoints: Sequence[int] = (),
                progress: Callable[[int, int], bool | None] | None = None) -> int:
        """Bring ``session`` to the state after ``ids``: restore the longest cached prefix, prefill the rest,
        and checkpoint the end of the prompt and every position in ``checkpoints`` passed on the way (for a
        chat, where the conversation without the generation prompt ends: the next turn shares that much).
        Returns the number of tokens that came from the cache.

        The session's previous context is replaced. If ``progress`` stops the prefill early, nothing more
        is stored."""
        ids = [int(t) for t in ids]
        cached, snap = self.lookup(ids)
        if snap is not None:
            session.restore(snap)
        else:
            session.reset()
        cuts = sorted({int(c) for c in checkpoints if cached < int(c) < len(ids)}) + [len(ids)]
        done = cached
        for cut in cuts:
            before = session.position

            def part_progress(d: int, t: int, _base=done - cached) -> bool | None:
                return progress(_base + d, len(ids) - cached) if progress is not None else None

            session.prefill(ids[done:cut], progress=part_progress if progress is not None else None)
            if session.position - before != cut - done:
                return cached  # stopped by progress
            self.store(session, ids[:cut])
            done = cut
        return cached

    def store(self, session: "Session", tokens: Sequence[int]) -> bool:
        """Checkpoint ``session``, whose context is exactly ``tokens``. Returns whether it was kept (not when
        it is already cached, larger than the budget, or the session's position disagrees with ``tokens``)."""
        key = tuple(int(t) for t in tokens)
        if not key or session.position != len(key):
            return False
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return False
        snap = session.snapshot()  # a device copy; taken outside the lock (it waits for the engine)
        nbytes = int(snap.nbytes)
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            if key in self._entries:
                return False
            self._entries[key] = _Entry(key, snap, nbytes)
            self._by_first.setdefault(key[0], set()).add(key)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                old_key, old = self._entries.popitem(last=False)
                self._by_first[old_key[0]].discard(old_key)
                if not self._by_first[old_key[0]]:
                    del self._by_first[old_key[0]]
                self.bytes -= old.nbytes
                self.evictions += 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_first.clear()
            self.bytes = 0
