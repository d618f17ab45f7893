"""Tokenizer loading and incremental detokenization for Hugging Face style checkpoints.

Reads ``tokenizer.json`` with the `tokenizers` library (never transformers), plus the optional
``tokenizer_config.json``, ``generation_config.json`` and ``chat_template.jinja`` next to it.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import tokenizers

from .config import brief
from .errors import CheckpointError

__all__ = ["Tokenizer", "StreamDecoder"]

_REPLACEMENT = "\ufffd"


def _read_json_object(path: Path) -> dict:
    # Optional config files: absent -> {}; unreadable or not a JSON object -> CheckpointError naming the file.
    if not path.is_file():
        return {}
    try:
        with open(path, "r", encoding="utf-8") as f:
            value = json.load(f)
    except RecursionError:
        raise CheckpointError(f"{path}: cannot parse JSON (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, ints > 4300 digits
        raise CheckpointError(f"{path}: cannot parse JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def _token_content(value: Any, path: Path, field: str) -> str | None:
    # tokenizer_config stores special tokens either as plain strings or as serialized AddedToken dicts.
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise CheckpointError(f"{path}: field '{field}' must be a string or an object with 'content', "
                              f"got {brief(value)}")
    try:
        value.encode("utf-8")  # a lone surrogate (JSON "\ud800") cannot reach the Rust tokenizer
    except UnicodeEncodeError:
        raise CheckpointError(f"{path}: field '{field}' is not valid Unicode text: {brief(value)}") from None
    return value


def _id_list(value: Any, path: Path, field: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    out = []
    for v in items:
        # bool is an int subclass; a `true` here is a broken config, not token 1. Ids reach the core as
        # int32 stop tokens.
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**31:
            raise CheckpointError(
                f"{path}: field '{field}' must be an int in [0, 2**31) or a list of them, got {brief(value)}"
            )
        out.append(v)
    return out


# Texts shorter than this are encoded whole (a prefix lookup would cost more than it saves).
_REUSE_MIN_CHARS = 2048
_REUSE_KEEP = 8  # recent encodings kept for reuse


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of a and b: compared in growing slices (C memcmp), then narrowed by halves."""
    n = min(len(a), len(b))
    i, step = 0, 4096
    while i < n:
        j = min(n, i + step)
        if a[i:j] != b[i:j]:
            while j - i > 64:
                mid = (i + j) // 2
                if a[i:mid] == b[i:mid]:
                    i = mid
                else:
                    j = mid
            while a[i] == b[i]:
                i += 1
            return i
        i, step = j, step * 2
    return n


class _PrefixReuse:
    """Encodes a text that starts like a recently encoded one by reusing that one's ids up to a shared boundary.

    A chat prompt is resent whole every turn (and the server encodes it twice: with and without the generation
    prompt), so most of it was encoded before: ~1 ms per 1K tokens on the CPU, on the path to the first token. The
    `tokenizers` pipeline cuts the text at added tokens first and encodes the pieces between them independently
    (normalizer, pre-tokenizer and model all act per piece), so the ids of a text cut right after an added token T
    are the ids of the part before the cut followed by those of the part after it, provided T is matched at that
    place in both texts: T is neither stripped nor normalized, and no other added token could take its characters
    (none contains T, none ends with a proper prefix of T). Such boundaries are found from the text (each T's end)
    and checked against the ids (the k-th T in the text is the k-th T id; otherwise the text gets none).
    Thread-safe: one lock for the list of recent encodings; encoding runs outside it."""

    def __init__(self, tok: tokenizers.Tokenizer):
        added = tok.get_added_tokens_decoder()
        contents = [t.content for t in added.values()]

        def overlaps(t: str, u: str) -> bool:  # could u, matched first, take some of t's characters?
            return t in u or any(u.endswith(t[:k]) for k in range(1, len(t)))

        self.bounds = {t.content: i for i, t in added.items()
                       if t.special and not t.normalized and not t.lstrip and not t.rstrip and not t.single_word
                       and t.content and not any(overlaps(t.content, u) for u in contents if u != t.content)}
        self._id_set = frozenset(self.bounds.values())
        self._lock = threading.Lock()
        self._recent: list[tuple[str, list[int], list[int], list[int]]] = []  # text, ids, ends, counts; newest last
        self.encodes = 0   # texts encoded through here
        self.reused = 0    # of them, those that reused a recent encoding
        self.reused_ids = 0

    def _boundaries(self, text: str, ids: list[int], base_chars: int = 0, base_ids: int = 0):
        """(char ends, id counts) after each boundary token of text, shifted by the bases; empty if the text's
        boundary tokens and its ids do not line up."""
        found = []
        for t in self.bounds:
            at = text.find(t)
            while at >= 0:
                found.append((at + len(t), self.bounds[t]))
                at = text.find(t, at + len(t))
        found.sort()
        arr = np.asarray(ids, dtype=np.int64)
        where = np.flatnonzero(np.isin(arr, list(self._id_set))) if self._id_set else np.zeros(0, dtype=np.int64)
        if len(where) != len(found) or any(int(arr[w]) != i for w, (_, i) in zip(where, found)):
            return [], []
        return [base_chars + e for e, _ in found], [base_ids + int(w) + 1 for w in where]

    def encode(self, tok: tokenizers.Tokenizer, text: str) -> list[int]:
        with self._lock:
            recent = list(self._recent)
        best_end, best_count, best_ids, best_j, best_entry = 0, 0, None, -1, None
        for entry in recent:
            old, ids, ends, counts = entry
            j = bisect.bisect_right(ends, _common_prefix(text, old)) - 1  # the last boundary both texts share
            if j >= 0 and ends[j] > best_end:
                best_end, best_count, best_ids, best_j, best_entry = ends[j], counts[j], ids, j, entry
        if best_ids is None:
            ids = tok.encode(text, add_special_tokens=False).ids
            ends, counts = self._boundaries(text, ids)
        else:
            tail = tok.encode(text[best_end:], add_special_tokens=False).ids
            ids = best_ids[:best_count] + tail
            more_ends, more_counts = self._boundaries(text[best_end:], tail, best_end, best_count)
            ends = best_entry[2][:best_j + 1] + more_ends  # (a tail whose boundaries do not line up adds none)
            counts = best_entry[3][:best_j + 1] + more_counts
        with self._lock:
            self.encodes += 1
            if best_ids is not None:
                self.reused += 1
                self.reused_ids += best_count
            self._recent = [r for r in self._recent if r[0] != text][-(_REUSE_KEEP - 1):] + [(text, ids, ends, counts)]
        return list(ids)

    def stats(self) -> dict:
        with self._lock:
            return {"boundary_tokens": sorted(self.bounds), "encodes": self.encodes, "reused": self.reused,
                    "reused_ids": self.reused_ids}


class Tokenizer:
    """A byte-level BPE (or any `tokenizers`-supported) tokenizer plus the checkpoint's special-token metadata."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        chat_templates: dict[str, str] | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        generation_eos_ids: Iterable[int] = (),
        generation_bos_id: int | None = None,
        extra_special_ids: Iterable[int] = (),
        source: str | None = None,
    ):
        self._tok = tok
        # Long texts that start like a recent one reuse its ids (chat prompts resent every turn): see _PrefixReuse.
        self._reuse = _PrefixReuse(tok)
        self.source = source
        self.chat_template = chat_template
        # Named templates (old list-style tokenizer_config "chat_template"); "default" mirrors chat_template.
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.add_bos_token = bool(add_bos_token)

        self.bos_token_id = self._lookup(bos_token)
        if self.bos_token_id is None and generation_bos_id is not None:
            self.bos_token_id = generation_bos_id
        self.eos_token_id = self._lookup(eos_token)
        self.pad_token_id = self._lookup(pad_token)

        # Generation config is the model authors' statement of what ends a turn; the tokenizer's eos follows.
        stop: list[int] = []
        for i in list(generation_eos_ids) + ([self.eos_token_id] if self.eos_token_id is not None else []):
            if i not in stop:
                stop.append(i)
        self._stop_token_ids = stop

        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        special.update(extra_special_ids)
        special.update(i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id) if i is not None)
        self._special_ids = frozenset(special)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load from a checkpoint folder holding tokenizer.json (+ optional configs / chat_template.jinja)."""
        root = Path(path)
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            raise CheckpointError(f"{tok_path}: tokenizer file not found")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise CheckpointError(f"{tok_path}: cannot load tokenizer ({e})") from e

        cfg_path = root / "tokenizer_config.json"
        cfg = _read_json_object(cfg_path)

        gen_path = root / "generation_config.json"
        gen = _read_json_object(gen_path)

        # Chat template: chat_template.jinja (newer HF layout) wins over the tokenizer_config field.
        templates: dict[str, str] = {}
        raw = cfg.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            for entry in raw:
                if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                        and isinstance(entry.get("template"), str)):
                    raise CheckpointError(f"{cfg_path}: 'chat_template' list entries need 'name' and 'template' strings")
                templates[entry["name"]] = entry["template"]
        elif raw is not None:
            raise CheckpointError(f"{cfg_path}: 'chat_template' must be a string or a list, got {type(raw).__name__}")
        jinja_path = root / "chat_template.jinja"
        if jinja_path.is_file():
            try:
                templates["default"] = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{jinja_path}: cannot read chat template ({e})") from e
        for tname, text in templates.items():
            _token_content(text, cfg_path, f"chat_template[{tname!r}]")  # rendered text goes to the Rust encoder
        chat_template = templates.get("default")
        if chat_template is None and len(templates) == 1:
            chat_template = next(iter(templates.values()))

        # added_tokens_decoder: make sure the ids the config promises exist and learn which are special.
        extra_special: set[int] = set()
        decoder = cfg.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise CheckpointError(f"{cfg_path}: 'added_tokens_decoder' must be an object")
        for key, spec in decoder.items():
            try:
                tid = int(key)
            except ValueError:
                raise CheckpointError(f"{cfg_path}: added_tokens_decoder key {brief(key)} is not a token id") from None
            content = _token_content(spec, cfg_path, f"added_tokens_decoder[{key}]")
            if content is None:
                raise CheckpointError(f"{cfg_path}: field 'added_tokens_decoder[{key}]' must be a string or an "
                                      "object with 'content', got None")
            existing = tok.token_to_id(content)
            if existing is None:
                # HF adds config-only tokens to the vocabulary at load; do the same, and insist the id matches.
                is_special = bool(spec.get("special", True)) if isinstance(spec, dict) else True
                added = tokenizers.AddedToken(content, special=is_special)
                (tok.add_special_tokens if is_special else tok.add_tokens)([added])
                existing = tok.token_to_id(content)
            if existing != tid:
                raise CheckpointError(
                    f"{cfg_path}: added_tokens_decoder says {content!r} is id {tid}, tokenizer.json has {existing}"
                )
            if isinstance(spec, dict) and spec.get("special"):
                extra_special.add(tid)

        bos = _token_content(cfg.get("bos_token"), cfg_path, "bos_token")
        eos = _token_content(cfg.get("eos_token"), cfg_path, "eos_token")
        pad = _token_content(cfg.get("pad_token"), cfg_path, "pad_token")
        gen_bos = _id_list(gen.get("bos_token_id"), gen_path, "bos_token_id")
        return cls(
            tok,
            chat_template=chat_template,
            chat_templates=templates,
            bos_token=bos,
            eos_token=eos,
            pad_token=pad,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            generation_eos_ids=_id_list(gen.get("eos_token_id"), gen_path, "eos_token_id"),
            generation_bos_id=gen_bos[0] if gen_bos else None,
            extra_special_ids=extra_special,
            source=str(root),
        )

    # ------------------------------------------------------------------ vocabulary
    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (not the model's lm_head rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def stop_token_ids(self) -> list[int]:
        """generation_config eos ids, then the tokenizer_config eos token; deduplicated, order kept."""
        return list(self._stop_token_ids)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Added tokens flagged special (tokenizer.json or tokenizer_config) plus the bos/eos/pad ids."""
        return self._special_ids

    def get_chat_template(self, tools: Any = None) -> str | None:
        """The template to render with; a named "tool_use" template wins when tools are given (as in HF)."""
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        return self.chat_template

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`. Special-token strings inside `text` (e.g. <|im_start|>) map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        if not add_special_tokens and len(text) >= _REUSE_MIN_CHARS and self._reuse.bounds:
            ids = self._reuse.encode(self._tok, text)
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def _decode_ids(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        # Filter ourselves so decode() and StreamDecoder agree on what "special" means
        # (tokenizers' own flag misses tokens only tokenizer_config marks special).
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._decode_ids([_check_id(i) for i in ids], skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    @property
    def uses_default_chat_template(self) -> bool:
        """True when the checkpoint has no chat template and chat falls back to plain ChatML."""
        return self.chat_template is None

    def special_tokens_map(self) -> dict[str, str]:
        """The special-token strings templates may reference (only those the checkpoint defines)."""
        out = {}
        for name in ("bos_token", "eos_token", "pad_token"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
        tokenize: bool = True,
        **extra: Any,
    ) -> list[int] | str:
        """Render `messages` with this checkpoint's template (ChatML fallback) and optionally tokenize."""
        from .chat import _as_list, render_chat  # local import: chat does not need the tokenizer at import time

        if tools is not None:
            tools = _as_list(tools, "tools")  # a generator would be consumed by the tool_use choice below

        kwargs = {**self.special_tokens_map(), **extra}
        text = render_chat(
            self.get_chat_template(tools),
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            enable_thinking=enable_thinking,
            **kwargs,
        )
        # The rendered prompt already carries every control token; adding bos again would duplicate it.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, stop_token_ids={self._stop_token_ids})"


def _check_id(token_id: Any) -> int:
    # numpy ints are welcome; negatives, non-integers and ids past u32 would crash, wrap or raise
    # OverflowError inside the Rust decoder (unknown ids below 2**32 decode to nothing, as in HF).
    try:
        i = int(token_id)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"token id must be an int, got {token_id!r}") from None
    if i != token_id or isinstance(token_id, (bool, np.bool_)) or not 0 <= i < 2**32:
        raise ValueError(f"token id must be an int in [0, 2**32), got {token_id!r}")
    return i


class StreamDecoder:
    """Incremental detokenizer: push ids one at a time, get back only completed text.

    Keeps two offsets into a short id window: text up to ``read`` has been emitted, and
    ``prefix..read`` is re-decoded as context so that decoders whose output depends on the
    neighbouring token (byte-level merges, leading-space rules) produce the same characters as a
    full decode. A push decodes ``prefix..end`` and emits the part past ``decode(prefix..read)``;
    if that ends in U+FFFD the last token split a multi-byte character, so nothing is emitted
    until a later token completes it. Cost per push is O(window), not O(tokens so far).
    (A literal U+FFFD at the very end of the text looks the same, so it waits for the next push
    or flush.)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # window: ids from the prefix offset on
        self._read = 0  # index into _ids: everything before it has been emitted
        self._prefix_text = ""  # decode(_ids[:_read]), cached

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer._decode_ids(ids, False)

    def push(self, token_id: int) -> str:
        """Add one token id; return the text it completed ("" while a character is still partial)."""
        tid = _check_id(token_id)
        if self._skip and tid in self._tokenizer._special_ids:
            # Dropping the id up front is what decode(skip_special_tokens=True) does to the whole list.
            return ""
        self._ids.append(tid)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        new = text[len(self._prefix_text):]
        # Slide the window: the just-emitted span becomes the context for the next push.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new

    def flush(self) -> str:
        """Emit whatever is held back (may end in U+FFFD if the stream stopped mid-character) and reset."""
        text = self._decode(self._ids)
        out = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        self._ids = []
        self._read = 0
        self._prefix_text = ""
        return out

    @property
    def pending(self) -> int:
        """Number of pushed ids whose text has not been emitted yet."""
        return len(self._ids) - self._read
