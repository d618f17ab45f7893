"""Chat-template rendering with Hugging Face semantics, without transformers.

Templates from checkpoints are untrusted code, so they run in Jinja's immutable sandbox with the
same helpers HF exposes (``raise_exception``, ``strftime_now``, an HF-style ``tojson``), the same
whitespace settings and the same extensions (``loopcontrols``, a pass-through ``{% generation %}``).
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError

__all__ = ["render_chat", "default_chatml_template", "validate_messages"]

logger = logging.getLogger(__name__)

# Plain ChatML, used only when a checkpoint ships no template. It refuses tools rather than dropping
# them, since a model-specific tool format cannot be guessed.
_CHATML = (
    "{%- if tools %}{{ raise_exception('tools need the checkpoint chat template; "
    "the plain ChatML fallback has no tool format') }}{% endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content if message.content is string else '') "
    "+ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Older names for a message's reasoning; templates read `reasoning_content`.
_REASONING_ALIASES = ("reasoning_content", "thinking", "reasoning")

_fallback_logged = False


def default_chatml_template() -> str:
    """The plain ChatML template used when a checkpoint has none (callers should report that it is in use)."""
    return _CHATML


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and ' and sorts keys; HF templates expect neither.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Compilation dominates short renders; a chat session re-renders the same template every turn.
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise ValueError(f"{where}.content[{j}] must be a dict, got {type(part).__name__}")
            if part.get("type") != "text":
                raise ValueError(f"{where}.content[{j}].type must be 'text', got {part.get('type')!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{j}].text must be a str, got {type(text).__name__}")
            pieces.append(text)
        # Qwen templates concatenate text parts with no separator; do the same.
        return "".join(pieces)
    raise ValueError(f"{where}.content must be a str or a list of text parts, got {type(content).__name__}")


def validate_messages(messages: Any) -> list[dict]:
    """Check messages and return normalized copies (text parts joined, None-valued keys dropped).

    Each message needs a str `role` and a `content` that is a str or a list of
    {"type": "text", "text": str} parts. An assistant message carrying `tool_calls` may omit
    content (OpenAI clients send `content: null` there). Other keys pass through to the template.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty str, got {role!r}")
        # Like HF: drop None-valued keys, since templates test for presence, not for None.
        norm = {k: v for k, v in msg.items() if v is not None}
        if "content" in norm:
            norm["content"] = _content_text(norm["content"], where)
        elif not msg.get("tool_calls"):
            raise ValueError(f"{where}.content is missing (only a message with tool_calls may omit it)")
        tool_calls = norm.get("tool_calls")
        if tool_calls is not None and not (isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls)):
            raise ValueError(f"{where}.tool_calls must be a list of dicts")
        # Fill reasoning_content from older names so templates that read it see the reasoning.
        reasoning = next((norm[k] for k in _REASONING_ALIASES if norm.get(k) is not None), None)
        if reasoning is not None:
            norm = {"thinking": reasoning, **norm, "reasoning_content": reasoning}
        out.append(norm)
    return out


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    enable_thinking: bool | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """Render `messages` with a Jinja chat template, as transformers' apply_chat_template(tokenize=False).

    template None selects `default_chatml_template()` (logged once; callers should surface it).
    enable_thinking / bos_token / eos_token left as None are not defined for the template, so its
    own defaults apply. Extra keyword arguments (pad_token, documents, ...) are passed through.
    Template failures, including `raise_exception(...)`, raise ChatTemplateError; bad messages or
    tools raise ValueError.
    """
    global _fallback_logged
    if template is None:
        if not _fallback_logged:
            logger.warning("no chat template in checkpoint; using plain ChatML (lily.chat.default_chatml_template)")
            _fallback_logged = True
        template = default_chatml_template()
    elif not isinstance(template, str):
        raise ValueError(f"template must be a str or None, got {type(template).__name__}")

    msgs = validate_messages(messages)
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be a list of JSON-schema dicts")
        tools = [dict(t) for t in tools]

    context: dict[str, Any] = {"documents": None}
    if bos_token is not None:
        context["bos_token"] = bos_token
    if eos_token is not None:
        context["eos_token"] = eos_token
    context.update(extra)
    context.update(messages=msgs, tools=tools, add_generation_prompt=bool(add_generation_prompt))
    if enable_thinking is not None:
        context["enable_thinking"] = bool(enable_thinking)

    compiled = _compile(template)
    try:
        return compiled.render(**context)
    except ChatTemplateError:
        raise
    except Exception as e:  # undefined names, sandbox violations, type errors inside the template
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
