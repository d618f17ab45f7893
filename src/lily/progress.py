"""``progress=`` arguments: ``True`` shows a ``tqdm.auto`` bar (a widget in Jupyter, text in a terminal),
a callable is called as ``progress(done, total)``, ``None``/``False`` shows nothing."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Union

import numpy as np

ProgressCallback = Callable[[int, int], Union[bool, None]]
Progress = Union[bool, ProgressCallback, None]

__all__ = ["Progress", "ProgressCallback", "check_progress", "progress_callback", "bar"]


def check_progress(progress: object, where: str, *, callable_ok: bool = True) -> None:
    """Raise TypeError naming ``where``'s ``progress`` argument unless it is None, a bool or (when
    ``callable_ok``) a callable."""
    if progress is None or isinstance(progress, bool):
        return
    if callable_ok and callable(progress):
        return
    wanted = "True, False, None or a callable progress(done, total)" if callable_ok else "True, False or None"
    raise TypeError(f"{where}: progress must be {wanted}, got {progress!r}")


def bar(total: int, desc: str, unit: str, **kwargs: Any) -> Any:
    """A ``tqdm.auto`` bar (imported here so that importing lily stays cheap)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, **kwargs)


@contextmanager
def progress_callback(progress: Progress, *, total: int, desc: str, unit: str) -> Iterator[ProgressCallback | None]:
    """The callback to hand to the core for ``progress`` (already checked): a bar's updater for True,
    the user's callable as is, or None. A bar is closed when the block ends, however it ends."""
    if progress is True:
        b = bar(total, desc, unit)
        try:
            def update(done: int, total: int) -> None:
                b.update(done - b.n)

            yield update
        finally:
            b.close()
    elif progress is None or progress is False:
        yield None
    else:
        user = progress

        def checked(done: int, total: int) -> bool | None:
            r = user(done, total)
            if r is not None and not isinstance(r, (bool, np.bool_)):
                raise TypeError(f"progress callback must return True, False or None, got {r!r}")
            return None if r is None else bool(r)

        yield checked
