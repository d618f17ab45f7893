"""A prefix cache over session checkpoints: a new prompt that starts like an earlier one restores the state
saved at the end of that prefix and prefills only the rest.

**What is kept, and where.** Recurrent (DeltaNet) state cannot be trimmed back to an earlier position, so the
cache keeps whole states at the positions a later prompt is likely to share: the end of each prompt's
prefill, every ``checkpoint_interval`` tokens of a long prefill, positions the caller names (the server
names where a chat ends before its generation prompt: Qwen3.6's template re-renders earlier turns without
their reasoning, so the end of a prompt, inside ``<think>``, is not shared by the next one) and the end of
each generation (the prompt plus the reply, hit when the next turn renders the reply exactly as generated).
A lookup takes the longest cached token sequence that is a prefix of the new prompt and shorter than it (at
least one token is always prefilled, so the last position's logits are computed fresh).

**Checkpoints share KV rows.** A checkpoint is a :meth:`Session.snapshot` taken with ``base=`` the longest
cached checkpoint that is a prefix of it: it holds its own conv/recurrent state and logits (about 63 MB for
the real model) and only the KV rows after its base; the rows before are the base's (and its base's, ...).
The checkpoints of a conversation are thus a tree, each KV row held once. An entry's bytes are its
``own_nbytes``; the byte budget (``max_bytes``) evicts the least recently used **leaf** (a checkpoint no other
checkpoint is built on), so the rows a live checkpoint needs are never evicted; once a leaf goes its parent
may become one. (The core also refcounts the rows, so a snapshot restored elsewhere outlives its entry.)

**Disk tier** (``disk_dir``): an evicted checkpoint is written there as a session file (the format of
:meth:`Session.save`: safetensors, sha256-checksummed, tagged with the model's fingerprint; all its KV rows,
since the file stands alone), within ``disk_bytes`` (least recently used file deleted first). Lookups
consider those files too; a hit on one is read back (checksum verified), restored through host memory and
checkpointed in memory again. A cache created on an existing folder finds the files of the same model there,
so a restarted server keeps its cache. A file that is missing, corrupt or of another shape counts as a miss
(``disk_errors``) and is deleted; it never fails the request. Only files named ``lily-prefix-*.safetensors``
are ever read or deleted. Spilling runs in the thread that caused the eviction (a download of the
checkpoint and a file write), outside the cache's lock.

Restoring then prefilling the rest gives the state a cold prefill of the whole prompt gives, up to the
floating-point effect of where prefill chunks begin (the rest is one chunk sequence starting at the cached
position instead of at 0); on the CPU backend chunking does not change any bit.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .errors import LilyError

if TYPE_CHECKING:
    from .session import Session, Snapshot

__all__ = ["PrefixCache"]

_DISK_PREFIX, _DISK_SUFFIX = "lily-prefix-", ".safetensors"

# A token sequence's key: its ids as little-endian int32 bytes, 4 bytes a token. A bytes object hashes once and
# slices by memcpy, so a lookup costs microseconds where tuples of Python ints cost ~1 ms per warm turn at 8K
# tokens (building them and hashing each prefix tried; the cache only ever needs equality of whole prefixes).
_TOKEN = 4
_KEY_DTYPE = np.dtype("<i4")


def _tokens(key: bytes) -> int:
    return len(key) // _TOKEN


def _key_of(arr: np.ndarray) -> bytes:
    return arr.astype(_KEY_DTYPE, copy=False).tobytes()


_TAIL = 8  # tokens of a prefix's end that index it (PrefixCache._by_len)


def _tail(key: bytes, n: int) -> bytes:
    """The last (up to) _TAIL tokens of key's first n tokens."""
    return key[max(0, n - _TAIL) * _TOKEN:n * _TOKEN]


@dataclass(eq=False)
class _Entry:
    tokens: bytes  # the key (_key_of)
    snapshot: "Snapshot"
    nbytes: int  # what evicting it frees: its own state and the KV rows after its parent's position
    parent: "_Entry | None"
    children: int = 0  # entries built on it, and stores in progress that will be: not evicted while > 0

    @property
    def length(self) -> int:  # tokens
        return _tokens(self.tokens)


@dataclass(eq=False)
class _DiskEntry:
    tokens: bytes
    path: str
    nbytes: int


def _check_bytes(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"PrefixCache: {name} must be an int >= 0, got {value!r}")
    return value


class PrefixCache:
    """Session checkpoints keyed by their token sequence, within ``max_bytes`` (LRU eviction of leaves),
    optionally spilled to ``disk_dir`` within ``disk_bytes``; ``checkpoint_interval`` > 0 adds a checkpoint
    every that many tokens of a prefill.

    Thread-safe: any number of sessions (each used by one thread) may call :meth:`prefill`, :meth:`lookup`
    and :meth:`store` at once. One lock guards the index and counters; snapshots, restores, file reads and
    writes happen outside it. Snapshots are immutable, so one entry may be restored into several sessions.
    """

    def __init__(self, engine, max_bytes: int = 1 << 30, *, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = 4 << 30, checkpoint_interval: int = 0, defer_checkpoints: bool = True):
        self.engine = engine
        # prefill's checkpoints written after the first token (Session.prefill_snapshots defer=): off for an A/B
        self.defer_checkpoints = bool(defer_checkpoints)
        self.max_bytes = _check_bytes(max_bytes, "max_bytes")
        self.disk_bytes = _check_bytes(disk_bytes, "disk_bytes")
        self.checkpoint_interval = _check_bytes(checkpoint_interval, "checkpoint_interval")
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._disk: OrderedDict[bytes, _DiskEntry] = OrderedDict()  # least recently used first
        # length in tokens -> the keys of that length in either tier, by their last _TAIL tokens (_tail)
        self._by_len: dict[int, dict[bytes, set[bytes]]] = {}
        self.bytes = 0
        self.disk_used = 0
        self.hits = 0
        self.misses = 0
        self.disk_hits = 0
        self.disk_errors = 0
        self.spilled = 0
        self.tokens_saved = 0
        self.evictions = 0
        self.disk_dir: str | None = None
        if disk_dir is not None:
            self.disk_dir = os.fspath(disk_dir)
            try:
                os.makedirs(self.disk_dir, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"PrefixCache: disk_dir '{self.disk_dir}' cannot be used: {exc}") from None
            self._scan_disk()

    def _key(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """The key of a token sequence, checked as a prefill checks it (ValueError naming a bad id)."""
        return _key_of(self.engine._validate_ids(ids))

    # ---- index helpers (lock held) ----
    def _index(self, key: bytes) -> None:
        n = _tokens(key)
        self._by_len.setdefault(n, {}).setdefault(_tail(key, n), set()).add(key)

    def _unindex(self, key: bytes) -> None:
        if key in self._entries or key in self._disk:
            return
        n = _tokens(key)
        tails = self._by_len.get(n)
        keys = tails.get(_tail(key, n)) if tails is not None else None
        if keys is not None:
            keys.discard(key)
            if not keys:
                del tails[_tail(key, n)]
                if not tails:
                    del self._by_len[n]

    def _find_locked(self, ids: bytes, n: int) -> bytes | None:
        """The indexed key (either tier) equal to ids' first n tokens, or None; no copy of the prefix is made."""
        tails = self._by_len.get(n)
        keys = tails.get(_tail(ids, n)) if tails is not None else None
        return next((k for k in keys if ids.startswith(k)), None) if keys else None

    def _best_locked(self, ids: bytes, *, below: int, kv_dtype: str | None = None):
        """The longest memory entry and the longest disk entry that are prefixes of ids (a key) shorter than below
        tokens. Cached lengths are tried longest first, each by the ids' last tokens before that length (a short
        slice hashed) and then a whole-prefix comparison (memcmp) of the few keys that end so; the search stops once
        both are found. A warm turn's hit is usually among the first lengths tried; slicing and hashing the whole
        prefix per length tried cost ~8 us per 8K tokens, comparing ids with every key ~0.5 ms a lookup."""
        mem: _Entry | None = None
        disk: _DiskEntry | None = None
        for n in sorted(self._by_len, reverse=True):
            if n >= min(below, _tokens(ids) + 1):
                continue
            key = self._find_locked(ids, n)
            if key is None:
                continue
            e = self._entries.get(key) if mem is None else None
            if e is not None and (kv_dtype is None or e.snapshot._core.kv_dtype == kv_dtype):
                mem = e
            if disk is None:
                disk = self._disk.get(key)
            if mem is not None and (disk is not None or not self._disk):
                break
        return mem, disk

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "tokens_saved": self.tokens_saved,
                    "evictions": self.evictions, "disk_entries": len(self._disk), "disk_bytes": self.disk_used,
                    "max_disk_bytes": self.disk_bytes if self.disk_dir else 0, "disk_hits": self.disk_hits,
                    "disk_errors": self.disk_errors, "spilled": self.spilled}

    # ---- lookups ----
    def lookup(self, ids: Sequence[int]) -> tuple[int, "Snapshot | None"]:
        """The longest cached prefix of ``ids`` shorter than ``ids``: (its length, its snapshot), or (0, None).
        A prefix found only on disk is read back (a host snapshot); an unreadable file is dropped and the
        next best prefix is taken."""
        ids = list(ids) if not isinstance(ids, (np.ndarray, list, tuple)) else ids
        if len(ids) == 0:
            with self._lock:
                self.misses += 1
            return 0, None
        n, snap, _ = self._lookup(self._key(ids))
        return n, snap

    def _lookup(self, ids: bytes) -> tuple[int, "Snapshot | None", bool]:
        while True:
            with self._lock:
                mem, disk = self._best_locked(ids, below=_tokens(ids))
                if disk is not None and (mem is None or len(disk.tokens) > len(mem.tokens)):
                    self._disk.move_to_end(disk.tokens)
                else:
                    disk = None
                    if mem is None:
                        self.misses += 1
                        return 0, None, False
                    self._entries.move_to_end(mem.tokens)
                    self.hits += 1
                    self.tokens_saved += _tokens(mem.tokens)
                    return _tokens(mem.tokens), mem.snapshot, False
            snap = self._read_disk(disk)  # outside the lock: a file read and checksum
            with self._lock:
                if snap is None:
                    self.disk_errors += 1
                    if self._disk.get(disk.tokens) is disk:
                        del self._disk[disk.tokens]
                        self.disk_used -= disk.nbytes
                        self._unindex(disk.tokens)
                    continue  # the next best prefix
                self.hits += 1
                self.disk_hits += 1
                self.tokens_saved += _tokens(disk.tokens)
            return _tokens(disk.tokens), snap, True

    def prefill(self, session: "Session", ids: Sequence[int], *, checkpoints: Sequence[int] = (),
                progress: Callable[[int, int], bool | None] | None = None) -> int:
        """Bring ``session`` to the state after ``ids``: restore the longest cached prefix, prefill the rest,
        and checkpoint the end of the prompt, every ``checkpoint_interval`` tokens and every position in
        ``checkpoints`` passed on the way (for a chat, where the conversation without the generation prompt
        ends: the next turn shares that much). Returns the number of tokens that came from the cache.

        The rest is one :meth:`Session.prefill_snapshots`: each checkpoint is taken inside the prefill chunk
        that reaches it, so a warm turn costs the forward of its new tokens and no more; the checkpoints' copies
        that can wait (KV rows, the end-of-prompt state) are written after the first generated token
        (``defer_checkpoints``), or first by whoever reads them. The session's previous
        context is replaced. If ``progress`` stops the prefill early, only the checkpoints reached are stored.
        Bad ids raise ValueError before the session is touched."""
        arr = self.engine._validate_ids(ids)
        key, n = _key_of(arr), len(arr)
        cached, snap, from_disk = self._lookup(key)
        if snap is not None:
            session.restore(snap)
            if from_disk:  # back into memory, sharing KV rows with the longest cached prefix there
                self._store(session, key[:cached * _TOKEN])
        else:
            session.reset()
        cuts = {int(c) for c in checkpoints}
        if self.checkpoint_interval:
            cuts.update(range(self.checkpoint_interval, n, self.checkpoint_interval))
        with self._lock:
            # One prefill of the rest that also snapshots every cut on the way (Session.prefill_snapshots: no
            # extra forward per cut); cuts already cached (the same prompt again) are not taken twice.
            at = [c for c in sorted(cuts | {n}) if cached < c <= n and self._find_locked(key, c) not in self._entries]
            parent = None
            if at:
                parent, _ = self._best_locked(key, below=at[0], kv_dtype=session.kv_cache_dtype)
                if parent is not None:
                    parent.children += 1  # pinned while the snapshots are taken; then the first one's link
        try:
            snaps = session.prefill_snapshots(arr[cached:], at, base=parent.snapshot if parent is not None else None,
                                              progress=progress, defer=self.defer_checkpoints)
        except BaseException:
            if parent is not None:
                with self._lock:
                    parent.children -= 1
            raise
        self._add_chain(snaps, key, parent)
        return cached

    def _add_chain(self, snaps: list["Snapshot"], ids: bytes, parent: "_Entry | None") -> None:
        """Index snapshots each built on the one before (the first on ``parent``, pinned by the caller): stops at
        the first one that is already cached (a concurrent store) or larger than the budget, since the ones
        after it share its KV rows; evicts once all are in."""
        with self._lock:
            for snap in snaps:
                key = ids[:snap.position * _TOKEN]
                nbytes = int(snap.own_nbytes)
                if key in self._entries or nbytes > self.max_bytes:
                    break
                entry = _Entry(key, snap, nbytes, parent)
                self._entries[key] = entry
                self._index(key)
                self.bytes += nbytes
                parent = entry
                parent.children += 1  # the next one's link (released below for the last)
            if parent is not None:
                parent.children -= 1
            evicted = self._evict_locked()
        self._spill(evicted)

    # ---- storing and evicting ----
    def store(self, session: "Session", tokens: Sequence[int]) -> bool:
        """Checkpoint ``session``, whose context is exactly ``tokens``, sharing KV rows with the longest
        cached checkpoint that is a prefix of it. Returns whether it was kept (not when it is already cached,
        larger than the budget, or the session's context is not ``tokens``)."""
        tokens = list(tokens) if not isinstance(tokens, (np.ndarray, list, tuple)) else tokens
        if len(tokens) == 0 or session.position != len(tokens):
            return False
        try:
            key = self._key(tokens)
        except ValueError:  # an id outside the vocabulary: not the session's context
            return False
        return self._store(session, key)

    def _store(self, session: "Session", key: bytes) -> bool:
        if session.position != _tokens(key) or _key_of(np.asarray(session.tokens, dtype=np.int64)) != key:
            return False
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return False
            parent, _ = self._best_locked(key, below=_tokens(key), kv_dtype=session.kv_cache_dtype)
            if parent is not None:
                parent.children += 1  # pinned while the snapshot is taken; then the new entry's link
        try:
            # A device copy of the rows after the parent's position; outside the lock (it waits for the engine).
            snap = session.snapshot(base=parent.snapshot if parent is not None else None)
        except BaseException:
            if parent is not None:
                with self._lock:
                    parent.children -= 1
            raise
        nbytes = int(snap.own_nbytes)
        with self._lock:
            if key in self._entries or nbytes > self.max_bytes:
                if parent is not None:
                    parent.children -= 1
                return False
            entry = _Entry(key, snap, nbytes, parent)
            self._entries[key] = entry
            self._index(key)
            self.bytes += nbytes
            evicted = self._evict_locked()
            kept = self._entries.get(key) is entry
        self._spill(evicted)
        return kept

    def _evict_locked(self) -> list[_Entry]:
        out = []
        while self.bytes > self.max_bytes:
            # The least recently used leaf; entries with children hold rows their children need.
            victim = next((e for e in self._entries.values() if e.children == 0), None)
            if victim is None:
                break  # every entry is pinned by a store in progress: over budget until it finishes
            del self._entries[victim.tokens]
            self._unindex(victim.tokens)
            if victim.parent is not None:
                victim.parent.children -= 1
            self.bytes -= victim.nbytes
            self.evictions += 1
            out.append(victim)
        return out

    def clear(self, *, disk: bool = False) -> None:
        """Drop every checkpoint held in memory; with ``disk=True`` delete the spilled files too."""
        with self._lock:
            self._entries.clear()
            self.bytes = 0
            victims = list(self._disk.values()) if disk else []
            if disk:
                self._disk.clear()
                self.disk_used = 0
            self._by_len = {}
            for key in self._disk:
                self._index(key)
        for d in victims:
            _remove(d.path)

    # ---- the disk tier ----
    def _disk_path(self, key: bytes) -> str:
        h = hashlib.sha256(self.engine.fingerprint.encode())
        h.update(key)  # the ids as little-endian int32, as files written before keys were bytes
        assert self.disk_dir is not None
        return os.path.join(self.disk_dir, f"{_DISK_PREFIX}{h.hexdigest()[:40]}{_DISK_SUFFIX}")

    def _spill(self, evicted: list[_Entry]) -> None:
        if self.disk_dir is None:
            return
        from .session import write_session_file

        for e in evicted:
            with self._lock:
                if e.tokens in self._disk:
                    self._disk.move_to_end(e.tokens)
                    continue
            path = self._disk_path(e.tokens)
            try:
                arrays = e.snapshot._core.to_arrays()
                write_session_file(path, arrays, fingerprint=self.engine.fingerprint,
                                   max_context=max(1, _tokens(e.tokens)), position=_tokens(e.tokens),
                                   extra={"lily_prefix_cache": "1"})
                nbytes = os.path.getsize(path)
            except (OSError, ValueError, LilyError):  # a full disk, an unwritable folder: not kept
                continue
            if nbytes > self.disk_bytes:  # larger than the whole disk budget
                _remove(path)
                continue
            with self._lock:
                old = self._disk.pop(e.tokens, None)
                if old is not None:
                    self.disk_used -= old.nbytes
                self._disk[e.tokens] = _DiskEntry(e.tokens, path, nbytes)
                self._index(e.tokens)
                self.disk_used += nbytes
                self.spilled += 1
                gone = []
                while self.disk_used > self.disk_bytes and self._disk:
                    _, d = self._disk.popitem(last=False)
                    self.disk_used -= d.nbytes
                    self._unindex(d.tokens)
                    gone.append(d)
            for d in gone:
                _remove(d.path)

    def _read_disk(self, d: _DiskEntry) -> "Snapshot | None":
        """The checkpoint in d's file, or None (and the file deleted) when it is missing or not intact."""
        from .session import read_session_file

        try:
            snap, _ = read_session_file(d.path, self.engine.fingerprint)
            arrays = snap._core.to_arrays()
            pending = np.asarray(arrays["pending"]).astype(np.int64).ravel()
            held = np.concatenate([np.asarray(arrays["tokens"]).astype(np.int64).ravel(), pending[pending >= 0]])
            if _key_of(held) != d.tokens:
                raise LilyError("holds other tokens than its index entry")
            try:
                os.utime(d.path)  # most recently used, for the order a restarted cache finds
            except OSError:
                pass
            return snap
        except (OSError, ValueError, LilyError):  # CheckpointError is a LilyError
            _remove(d.path)
            return None

    def _scan_disk(self) -> None:
        """Index the files a previous cache of this model left in disk_dir (oldest use first)."""
        from .checkpoint import SafetensorsFile
        from .session import _SESSION_FORMAT

        assert self.disk_dir is not None
        found = []
        for name in os.listdir(self.disk_dir):
            if not (name.startswith(_DISK_PREFIX) and name.endswith(_DISK_SUFFIX)):
                continue
            path = os.path.join(self.disk_dir, name)
            try:
                f = SafetensorsFile(path)
                try:
                    meta = dict(f.metadata)
                    if meta.get("format") != _SESSION_FORMAT or meta.get("fingerprint") != self.engine.fingerprint:
                        continue  # another model's (or another version's): left alone
                    tokens = np.asarray(f.array("tokens")).astype(np.int64).ravel()
                    pending = np.asarray(f.array("pending")).astype(np.int64).ravel()
                finally:
                    f.close()
                st = os.stat(path)
            except (OSError, ValueError, KeyError, LilyError):  # unreadable: one of ours, but broken
                _remove(path)
                continue
            key = _key_of(np.concatenate([tokens, pending[pending >= 0]]))
            if key:
                found.append((st.st_mtime, key, path, st.st_size))
        found.sort()
        for _, key, path, size in found:
            self._disk[key] = _DiskEntry(key, path, size)
            self.disk_used += size
            self._index(key)
        while self.disk_used > self.disk_bytes and self._disk:
            _, d = self._disk.popitem(last=False)
            self.disk_used -= d.nbytes
            self._unindex(d.tokens)
            _remove(d.path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
