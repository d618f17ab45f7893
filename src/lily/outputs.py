"""Qwen3.6 output handling: the reasoning split (``<think>…</think>``) and tool calls (``<tool_call>``).

:class:`OutputParser` takes the generated text piece by piece and returns events as soon as they are
decided: ``("reasoning", text)``, ``("text", text)`` and ``("tool_call", ToolCall)``. Text that could be the
start of a tag is held back until the next pieces decide it, so a tag is never split between events and
never shown. A tool-call block is parsed when its closing tag arrives; a block that does not parse (or is
never closed) is returned as text, so nothing the model wrote is lost.

Tool calls use the qwen3_coder XML form that Qwen3.6 is trained on::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

and, since Qwen3 models also write it, the JSON form ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
Parameter values are strings unless the tool's JSON schema gives the parameter another type (integer,
number, boolean, object, array, null), as vLLM's qwen3_coder parser does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OutputParser", "ToolCall", "parse_tool_call", "parameter_types"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

_FUNCTION = re.compile(r"\A\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str = field(default="", compare=False)  # the block as the model wrote it, tags included


def parameter_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    """{function name: {parameter: JSON-schema type}} from OpenAI-style tool definitions."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        types: dict[str, str] = {}
        for pname, schema in (props or {}).items():
            t = schema.get("type") if isinstance(schema, dict) else None
            if isinstance(t, list):  # ["integer", "null"]: the first non-null type decides
                t = next((x for x in t if x != "null"), None)
            if isinstance(t, str):
                types[pname] = t
        out[fn["name"]] = types
    return out


def _convert(value: str, kind: str | None) -> Any:
    # Anything that does not convert stays the string the model wrote: a wrong type is the tool's
    # business to report, a lost argument would be ours.
    if kind in (None, "string"):
        return value
    v = value.strip()
    try:
        if kind == "integer":
            return int(v)
        if kind == "number":
            f = float(v)
            return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
        if kind == "boolean":
            if v.lower() in ("true", "false"):
                return v.lower() == "true"
            return value
        if kind == "null" and v.lower() in ("null", "none"):
            return None
        return json.loads(v)
    except (ValueError, TypeError):
        return value


def parse_tool_call(body: str, types: dict[str, dict[str, str]] | None = None) -> ToolCall | None:
    """The call inside one ``<tool_call>`` block (tags excluded), or None when it is malformed."""
    raw = f"{TOOL_OPEN}{body}{TOOL_CLOSE}"
    stripped = body.strip()
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except ValueError:
            return None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], args, raw)
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    if not name:
        return None
    kinds = (types or {}).get(name, {})
    args: dict[str, Any] = {}
    end = 0
    for p in _PARAMETER.finditer(inner):
        if inner[end:p.start()].strip():  # stray text between parameters: not the format
            return None
        end = p.end()
        pname = p.group(1).strip()
        value = p.group(2)
        # The format puts each value on its own lines: one newline after the opening tag and one
        # before the closing tag belong to the markup.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        args[pname] = _convert(value, kinds.get(pname))
    if inner[end:].strip():
        return None
    return ToolCall(name, args, raw)


def _partial_tag(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``buf`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:k]):
                best = k
                break
    return best


class OutputParser:
    """Splits generated text into reasoning, text and tool calls, incrementally.

    ``in_reasoning``: the prompt ended inside ``<think>`` (Qwen3.6's template opens it when thinking is
    enabled), so the output starts as reasoning. Otherwise a ``<think>`` at the very start of the output
    opens reasoning too. ``tools``: parse ``<tool_call>`` blocks (None or False: they stay text);
    a list of OpenAI-style tool definitions also gives the parameter types.
    """

    def __init__(self, *, in_reasoning: bool = False, tools: list[dict] | bool | None = None):
        self._state = "reasoning" if in_reasoning else "start"
        self._tools = bool(tools)
        self._types = parameter_types(tools if isinstance(tools, list) else None)
        self._buf = ""  # undecided text of the current state
        self._ws = ""  # whitespace held in text: dropped if a tool call follows (the markup's separator)
        self._pre_ws = ""  # the whitespace held when the current <tool_call> opened
        self._after_call = False  # nothing but whitespace since the last tool call
        self._after_think = False  # drop the newlines the template puts after </think>
        self.tool_calls = 0

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        self._buf += piece
        events: list[tuple[str, Any]] = []
        while True:
            before = (self._state, len(self._buf))
            self._step(events, final=False)
            if (self._state, len(self._buf)) == before:
                return events

    def finish(self) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        while True:
            before = (self._state, len(self._buf))
            self._step(events, final=True)
            if (self._state, len(self._buf)) == before:
                break
        if self._state == "tool":  # never closed: the model's text, as written
            self._ws = self._pre_ws
            self._text(events, TOOL_OPEN + self._buf, final=True)
        elif self._buf:
            self._emit_plain(events, self._buf, final=True)
        self._buf = ""
        if self._ws and not self._after_call:  # trailing whitespace of text is text; after a call, markup
            events.append(("text", self._ws))
        self._ws = ""
        return _merge(events)

    # ---- states ----
    def _step(self, events: list, final: bool) -> None:
        buf = self._buf
        if self._state == "start":
            # Leading whitespace does not decide anything; a "<think>" after it still opens reasoning.
            s = buf.lstrip()
            if not s:
                return
            if s.startswith(THINK_OPEN):
                self._buf = s[len(THINK_OPEN):]
                self._state = "reasoning"
            elif THINK_OPEN.startswith(s) and not final:
                return
            else:
                self._state = "text"
            return
        if self._state == "reasoning":
            i = buf.find(THINK_CLOSE)
            if i >= 0:
                self._reasoning(events, buf[:i])
                self._buf = buf[i + len(THINK_CLOSE):]
                self._state = "text"
                self._after_think = True
                return
            keep = 0 if final else _partial_tag(buf, (THINK_CLOSE,))
            if final:
                self._reasoning(events, buf)
                self._buf = ""
            elif len(buf) > keep:
                self._reasoning(events, buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
            return
        if self._state == "text":
            if self._after_think:
                s = buf.lstrip("\n")
                if not s and not final:
                    self._buf = ""
                    return
                self._buf = buf = s
                self._after_think = False
            if self._tools:
                i = buf.find(TOOL_OPEN)
                if i >= 0:
                    self._text(events, buf[:i], final=False)
                    # Whitespace before a call separates it from the text: not content (unless the call
                    # turns out malformed, when all of it is text again).
                    self._pre_ws, self._ws = self._ws, ""
                    self._buf = buf[i + len(TOOL_OPEN):]
                    self._state = "tool"
                    return
            keep = 0 if final or not self._tools else _partial_tag(buf, (TOOL_OPEN,))
            if len(buf) > keep:
                self._text(events, buf[:len(buf) - keep], final=final)
                self._buf = buf[len(buf) - keep:]
            return
        if self._state == "tool":
            i = buf.find(TOOL_CLOSE)
            if i < 0:
                return
            body = buf[:i]
            call = parse_tool_call(body, self._types)
            if call is None:
                self._ws = self._pre_ws
                self._text(events, TOOL_OPEN + body + TOOL_CLOSE, final=False)
            else:
                self._ws = ""
                self._after_call = True
                self.tool_calls += 1
                events.append(("tool_call", call))
            self._buf = buf[i + len(TOOL_CLOSE):]
            self._state = "text"

    def _emit_plain(self, events: list, text: str, final: bool) -> None:
        if self._state == "reasoning":
            self._reasoning(events, text)
        else:
            self._text(events, text, final=final)

    def _reasoning(self, events: list, text: str) -> None:
        if text:
            events.append(("reasoning", text))

    def _text(self, events: list, text: str, final: bool) -> None:
        # Whitespace is held until something else follows it, so the newlines between two tool calls
        # (or between text and a call) never become content of their own.
        text = self._ws + text
        if self._after_call:  # the whitespace after a call separates it from what follows
            text = text.lstrip()
            if not text:
                self._ws = ""
                return
            self._after_call = False
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            events.append(("text", body))


def _merge(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for kind, value in events:
        if out and kind in ("text", "reasoning") and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out
