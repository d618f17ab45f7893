"""Qwen3.6 output handling: the reasoning split (``<think>…</think>``) and tool calls (``<tool_call>``).

:class:`OutputParser` takes the generated text piece by piece and returns events as soon as they are
decided: ``("reasoning", text)``, ``("text", text)`` and ``("tool_call", ToolCall)``. Text that could be the
start of a tag is held back until the next pieces decide it, so a tag is never split between events and
never shown. A tool-call block is parsed when its closing tag arrives; a block that does not parse (or is
never closed) is returned as text, so nothing the model wrote is lost.

With ``stream_arguments=True`` a call in the XML form is also announced while it is written:
``("tool_call_begin", (index, name))`` once ``<function=NAME>`` is complete, then
``("tool_call_args", (index, fragment))`` as each ``</parameter>`` arrives (the fragments concatenate to
``json.dumps(arguments)``: ``{"city": "Paris"``, ``, "days": 3``, ``}``), then the ``("tool_call", ToolCall)``
event. The JSON form is decided only at its closing tag (one whole event, as without the option). A call
announced this way is committed: if the rest of its block turns out malformed (or is never closed), the call
ends with the parameters complete so far and the whole block is returned as text too, so nothing is lost.

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
_FUNCTION_OPEN = re.compile(r"\A\s*<function=([^>\n]+)>")
_PARAMETER_AT = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)  # whitespace before it only


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
        pname, value = _parameter(p, kinds)
        args[pname] = value
    if inner[end:].strip():
        return None
    return ToolCall(name, args, raw)


def _parameter(p: re.Match, kinds: dict[str, str]) -> tuple[str, Any]:
    pname, value = p.group(1).strip(), p.group(2)
    # The format puts each value on its own lines: one newline after the opening tag and one before the
    # closing tag belong to the markup.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return pname, _convert(value, kinds.get(pname))


def _json_member(first: bool, name: str, value: Any) -> str:
    # json.dumps(dict)'s own separators, so the fragments of a call concatenate to json.dumps(arguments)
    return ("{" if first else ", ") + json.dumps(name, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


@dataclass
class _OpenCall:
    """A tool call announced while its block is still being written (stream_arguments)."""

    index: int
    name: str
    pos: int  # where the next parameter may begin in the block's text
    arguments: dict[str, Any] = field(default_factory=dict)
    sent: int = 0  # parameters sent as fragments


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

    def __init__(self, *, in_reasoning: bool = False, tools: list[dict] | bool | None = None,
                 stream_arguments: bool = False):
        self._state = "reasoning" if in_reasoning else "start"
        self._tools = bool(tools)
        self._stream = bool(stream_arguments)
        self._call: _OpenCall | None = None  # the call being announced (stream_arguments)
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
            self._end_open_call(events, None)
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
            if self._stream:
                self._announce(events, buf if i < 0 else buf[:i])
            if i < 0:
                return
            body = buf[:i]
            call = parse_tool_call(body, self._types)
            if self._call is not None:  # announced: committed whatever the rest of the block is
                self._end_open_call(events, call)
                if call is None:
                    self._ws = self._pre_ws
                    self._text(events, TOOL_OPEN + body + TOOL_CLOSE, final=False)
            elif call is None:
                self._ws = self._pre_ws
                self._text(events, TOOL_OPEN + body + TOOL_CLOSE, final=False)
            else:
                self._ws = ""
                self._after_call = True
                self.tool_calls += 1
                events.append(("tool_call", call))
            self._buf = buf[i + len(TOOL_CLOSE):]
            self._state = "text"

    def _announce(self, events: list, body: str) -> None:
        """Begin a call once <function=NAME> is complete, then send each parameter as it completes."""
        if self._call is None:
            m = _FUNCTION_OPEN.match(body)
            if m is None or not m.group(1).strip():
                return
            self._call = _OpenCall(self.tool_calls, m.group(1).strip(), m.end())
            events.append(("tool_call_begin", (self._call.index, self._call.name)))
        c = self._call
        kinds = self._types.get(c.name, {})
        while (p := _PARAMETER_AT.match(body, c.pos)) is not None:
            pname, value = _parameter(p, kinds)
            events.append(("tool_call_args", (c.index, _json_member(c.sent == 0, pname, value))))
            c.arguments[pname] = value
            c.sent += 1
            c.pos = p.end()

    def _end_open_call(self, events: list, call: ToolCall | None) -> None:
        """Close the announced call: with the parsed block's arguments, or (malformed: call is None) with
        the parameters sent so far."""
        c, self._call = self._call, None
        if c is None:
            return
        if call is not None:  # the block parsed: the same parameters, in order (one regex for both)
            for pname, value in list(call.arguments.items())[c.sent:]:
                events.append(("tool_call_args", (c.index, _json_member(c.sent == 0, pname, value))))
                c.sent += 1
        else:
            call = ToolCall(c.name, dict(c.arguments), "")
        events.append(("tool_call_args", (c.index, "}" if c.sent else "{}")))
        self._ws = ""
        self._after_call = True
        self.tool_calls += 1
        events.append(("tool_call", call))

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
