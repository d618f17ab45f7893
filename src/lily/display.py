"""Text and HTML views of Engine, Session and Report (``__repr__`` and Jupyter's ``_repr_html_``)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from .engine import Engine, Report
    from .session import Session

__all__ = ["format_bytes", "engine_repr", "engine_html", "session_repr", "session_html", "report_html"]


def format_bytes(n: int | float) -> str:
    """``n`` bytes in binary units: 512 B, 1.5 KiB, 13.5 MiB, 19.5 GiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _quantization(engine: "Engine") -> str:
    q = engine.checkpoint.quantization
    if not q:
        return "none"
    if isinstance(q, Mapping):
        return ", ".join(f"{k} {v}" for k, v in q.items())
    return str(q)


def _engine_fields(engine: "Engine") -> dict[str, str]:
    core = engine._core.report()  # backend, device and mapped bytes only: cheap, no probe run
    return {
        "model": engine.checkpoint.path.name or str(engine.checkpoint.path),
        "format": engine.checkpoint.format,
        "quantization": _quantization(engine),
        "backend": str(core["backend"]),
        "device": str(core["device"]),
        "weights": format_bytes(sum(core["weight_bytes"].values())),
        "kv_cache_dtype": engine.kv_cache_dtype,
    }


def engine_repr(engine: "Engine") -> str:
    """``Engine(model='lily-tiny', format='mlx', quantization='default q4g64, router q8g64', ...)``."""
    return "Engine(" + ", ".join(f"{k}={v!r}" for k, v in _engine_fields(engine).items()) + ")"


def _session_fields(session: "Session") -> dict[str, Any]:
    return {
        "position": session.position,
        "max_context": session.max_context,
        "state": format_bytes(session.state_bytes),
        "kv_cache_dtype": session.kv_cache_dtype,
        "backend": session.engine.backend,
    }


def session_repr(session: "Session") -> str:
    """``Session(position=12, max_context=4096, state='1.2 MiB', kv_cache_dtype='f32', backend='cpu')``."""
    return "Session(" + ", ".join(f"{k}={v!r}" for k, v in _session_fields(session).items()) + ")"


_STYLE = "border-collapse:collapse;text-align:left;font-family:monospace"


def _rows(fields: Mapping[str, Any]) -> str:
    def cell(k: Any, v: Any) -> str:
        if str(k).endswith("bytes") and isinstance(v, int) and not isinstance(v, bool):
            return html.escape(f"{v} ({format_bytes(v)})")
        return _cell(v)

    return "".join(
        f"<tr><th style='padding:1px 8px;text-align:left'>{html.escape(str(k))}</th>"
        f"<td style='padding:1px 8px;text-align:left'>{cell(k, v)}</td></tr>"
        for k, v in fields.items()
    )


def _cell(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"<table style='{_STYLE}'>{_rows(value)}</table>" if value else "<i>none</i>"
    if isinstance(value, (list, tuple)):
        items = "".join(f"<li>{_cell(v)}</li>" for v in value)
        return f"<ul style='margin:0;padding-left:1.2em'>{items}</ul>" if value else "<i>none</i>"
    return html.escape(str(value))


def _table(title: str, fields: Mapping[str, Any]) -> str:
    return f"<table style='{_STYLE}'><caption style='text-align:left'><b>{html.escape(title)}</b></caption>" \
           f"{_rows(fields)}</table>"


def engine_html(engine: "Engine") -> str:
    return _table("lily.Engine", _engine_fields(engine))


def session_html(session: "Session") -> str:
    return _table("lily.Session", _session_fields(session))


def report_html(report: "Report") -> str:
    """The report as nested HTML tables (every value escaped)."""
    return _table("lily engine report", report)
