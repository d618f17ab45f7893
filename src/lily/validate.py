"""Argument checks shared by the public API: each error names the argument and says what was expected,
before any work starts (and before a value reaches the C++ core, which takes 64-bit integers)."""

from __future__ import annotations

from typing import Iterable

import numpy as np

INT64_MAX = 2**63 - 1


def check_int(value: object, name: str, *, minimum: int = 0, maximum: int = INT64_MAX) -> int:
    """``value`` as an int in [minimum, maximum] (numpy integers accepted, bools refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    v = int(value)
    if not minimum <= v <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {v}")
    return v


def check_token_ids(ids: Iterable[object], name: str) -> list[int]:
    """A list of token ids from any iterable of integers; floats (even integral ones) are refused rather
    than truncated."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} must be an iterable of ints, got {ids!r}")
    try:
        items = list(ids)
    except TypeError:
        raise ValueError(f"{name} must be an iterable of ints, got {ids!r}") from None
    return [check_int(t, f"{name}[{i}]", minimum=0, maximum=2**31 - 1) for i, t in enumerate(items)]


MTP_MODES = ("auto", "on", "off")
MTP_MAX_K = 4


def check_mtp(mtp: object, mtp_k: object, name: str, *, has_head: bool, default: str = "off") -> tuple[str, int | None]:
    """(mode, k) a generate call runs with: ``mtp`` None takes the engine's policy (``default``); ``mtp_k`` None
    lets the mode choose (3 for "on", 1..4 per iteration for "auto"). Without an MTP head "auto" is "off".
    Raises ValueError naming ``mtp`` / ``mtp_k`` (an unknown mode, k out of range, "on" without an MTP head)."""
    mode = default if mtp is None else mtp
    if not isinstance(mode, str) or mode not in MTP_MODES:
        raise ValueError(f"{name}: mtp must be one of {MTP_MODES} or None (the engine's policy), got {mtp!r}")
    k = None if mtp_k is None else check_int(mtp_k, f"{name}: mtp_k", minimum=1, maximum=MTP_MAX_K)
    if mode == "on" and not has_head:
        raise ValueError(f"{name}: mtp='on' needs a checkpoint with an MTP head, and this one has none "
                         "(report()['mtp']; mlx-lm conversions drop it, lily convert keeps it)")
    return (mode if has_head else "off"), k
