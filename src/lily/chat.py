"""Chat-template rendering with Hugging Face semantics, without transformers.

Templates from checkpoints are untrusted code, so they run in Jinja's immutable sandbox with the
same helpers HF exposes (``raise_exception``, ``strftime_now``, an HF-style ``tojson``), the same
whitespace settings and the same extensions (``loopcontrols``, a pass-through ``{% generation %}``).

The sandbox stops a template from touching Python, not from running forever or filling memory, so each
render also has a budget (no threads involved; the template is instrumented when compiled):

* time: ``render_timeout`` seconds of wall time (default 2 s; a 400-message, 0.5 MB Qwen3 conversation
  renders in about 30 ms), checked on every loop iteration, call, filter, operator and output piece, so one
  operation on values within the size limit (a sort, a join) runs to completion before the check;
* size: ``max_output_chars`` characters of output (default 4 Mi: four times the text of a full 262144-token
  context at about 4 characters per token). One value (a string or list built with ``*``, ``+``, ``~``,
  ``%``, ``format``, ``join``, ``replace`` or a width argument) may not exceed it either, and these are
  checked *before* they are built; everything rendered into macro and ``set`` buffers together may not
  exceed 8 times it.

Exceeding either raises ChatTemplateError. ``lipsum`` (Jinja's lorem-ipsum generator, a loop no hook sees)
is not available to templates.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import math
import re
import time
import warnings
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError

__all__ = ["render_chat", "default_chatml_template", "validate_messages", "DEFAULT_RENDER_TIMEOUT",
           "DEFAULT_MAX_OUTPUT_CHARS"]

DEFAULT_RENDER_TIMEOUT = 2.0  # seconds of wall time per render
DEFAULT_MAX_OUTPUT_CHARS = 4 << 20  # characters
_PRODUCED_FACTOR = 8  # all buffers together (macro bodies are rendered, then output again by the caller)
_MAX_INT_BITS = 4096  # ints built with * and ** (repeated squaring would otherwise take minutes)
_MAX_TEMPLATE_CHARS = 1 << 20  # template source; Qwen3 templates are ~5 KB

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


# ------------------------------------------------------------------------------------------------
# the render budget
# ------------------------------------------------------------------------------------------------


class _Budget:
    """Time and size limits of one render; the hooks below find it through a context variable, so
    concurrent renders in other threads each see their own."""

    __slots__ = ("timeout", "deadline", "max_output", "max_produced", "produced")

    def __init__(self, timeout: float, max_output: int):
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.max_output = max_output
        self.max_produced = _PRODUCED_FACTOR * max_output
        self.produced = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"chat template ran longer than render_timeout={self.timeout:g} s and was stopped"
            )

    def size(self, n: int, what: str) -> None:
        if n > self.max_output:
            raise ChatTemplateError(
                f"chat template would build {what} of {n} characters or items, more than "
                f"max_output_chars={self.max_output}"
            )

    def produce(self, n: int) -> None:
        self.produced += n
        if self.produced > self.max_produced:
            raise ChatTemplateError(
                f"chat template rendered more than {self.max_produced} characters into its buffers "
                f"({_PRODUCED_FACTOR} x max_output_chars={self.max_output})"
            )


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("lily_chat_budget", default=None)
_SIZED = (str, list, tuple, dict)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_value(b: _Budget, value: Any) -> None:
    if isinstance(value, _SIZED):
        b.size(len(value), f"a {type(value).__name__}")


def _check_int_args(b: _Budget, args: Iterable[Any], what: str) -> None:
    # Width and count arguments (center, indent, ljust, zfill, expandtabs, ...) allocate that many
    # characters; none is legitimately larger than the whole output.
    for a in args:
        if _is_int(a) and abs(a) > b.max_output:
            raise ChatTemplateError(
                f"chat template passes {a if a.bit_length() < 64 else 'a huge int'} to {what}, more than "
                f"max_output_chars={b.max_output}"
            )


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")
_DIGITS = re.compile(r"\d+")


def _check_format(b: _Budget, fmt: str, args: Any, style: str) -> None:
    """Widths and precisions in a %- or {}-format string, and '*' widths taken from the arguments."""
    pattern = _PERCENT_SPEC if style == "%" else _BRACE_FIELD
    for m in pattern.finditer(fmt):
        for run in _DIGITS.findall(m.group(0)):
            # len() first: int() of a run of more than 4300 digits raises ValueError
            if len(run) > 12 or int(run) > b.max_output:
                b.size(int(run) if len(run) <= 12 else 10**12, "a formatted field")
    values = args if isinstance(args, tuple) else args.values() if isinstance(args, Mapping) else (args,)
    _check_int_args(b, values, "a format")


def _check_replace(b: _Budget, s: str, old: Any, new: Any) -> None:
    if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        count = s.count(old) if old else len(s) + 1
        b.size(len(s) + count * (len(new) - len(old)), "a replaced string")


def _check_join(b: _Budget, sep: Any, items: Any) -> None:
    if isinstance(items, (list, tuple)):
        total = sum(len(x) if isinstance(x, str) else 0 for x in items) + len(str(sep)) * max(0, len(items) - 1)
        b.size(total, "a joined string")


def _precheck_binop(b: _Budget, op: str, left: Any, right: Any) -> None:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and _is_int(n):
                b.size(len(seq) * max(n, 0), f"a repeated {type(seq).__name__}")
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            raise ChatTemplateError(f"chat template multiplies ints beyond {_MAX_INT_BITS} bits")
    elif op == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1 \
                and (left.bit_length() - 1) * right > _MAX_INT_BITS:
            raise ChatTemplateError(f"chat template raises an int to a power beyond {_MAX_INT_BITS} bits")
    elif op == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            b.size(len(left) + len(right), f"a concatenated {type(left).__name__}")
    elif op == "%" and isinstance(left, str):
        _check_format(b, left, right, "%")


def _precheck_call(b: _Budget, obj: Any, args: tuple, kwargs: dict) -> None:
    # String methods are the amplifiers reachable through calls (sandbox-wrapped str.format included).
    target = getattr(obj, "__wrapped__", obj)
    owner = getattr(target, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(target, "__name__", "")
    _check_int_args(b, (*args, *kwargs.values()), f"str.{name}")
    if name == "format" or name == "format_map":
        _check_format(b, owner, tuple(args) + tuple(kwargs.values()), "{}")
    elif name == "replace" and len(args) >= 2:
        _check_replace(b, owner, args[0], args[1])
    elif name == "join" and args:
        _check_join(b, owner, args[0])


def _bounded_filter(name: str, f: Any) -> Any:
    """A filter that checks the budget first, prechecks its width arguments and checks its result size."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # context/env, then the value

    @functools.wraps(f)  # keeps jinja_pass_arg (pass_context / pass_eval_context), which Jinja reads
    def bounded(*args: Any, **kwargs: Any) -> Any:
        b = _BUDGET.get()
        if b is not None:
            b.tick()
            _check_int_args(b, (*args[skip:], *kwargs.values()), f"filter '{name}'")
            value = args[skip - 1] if len(args) >= skip else None
            if name == "format" and isinstance(value, str):
                _check_format(b, value, tuple(args[skip:]) + tuple(kwargs.values()), "%")
            elif name == "replace" and isinstance(value, str) and len(args) >= skip + 2:
                _check_replace(b, value, args[skip], args[skip + 1])
            elif name == "join":
                _check_join(b, args[skip] if len(args) > skip else kwargs.get("d", ""), value)
        result = f(*args, **kwargs)
        if b is not None:
            _check_value(b, result)
        return result

    return bounded


@jinja2.pass_context
def _loop_guard(context: Any, iterable: Any) -> Any:
    b = _BUDGET.get()
    return iterable if b is None else _ticking(b, iterable)


def _ticking(b: _Budget, iterable: Any) -> Any:
    for item in iterable:
        b.tick()
        yield item


@jinja2.pass_context
def _output_guard(context: Any, value: Any) -> str:
    # str() is what Jinja applies to every output piece when autoescape is off (as here); str
    # subclasses (Markup) pass unchanged so an {% autoescape %} block still sees them as safe.
    text = value if isinstance(value, str) else str(value)
    b = _BUDGET.get()
    if b is not None:
        b.tick()
        b.produce(len(text))
    return text


@jinja2.pass_context
def _concat_guard(context: Any, parts: list) -> str:
    # `a ~ b`: Jinja's str_join, with the total size checked before it is built.
    strs = [p if type(p) is str else str(p) for p in parts]
    b = _BUDGET.get()
    if b is not None:
        b.tick()
        b.size(sum(map(len, strs)), "a concatenated string")
    return "".join(strs)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus budget checks on calls and on the operators that build big values."""

    intercepted_binops = frozenset(("*", "**", "+", "%"))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        b = _BUDGET.get()
        if b is not None:
            b.tick()
            _precheck_call(b, obj, args, kwargs)
        result = super().call(context, obj, *args, **kwargs)
        if b is not None:
            _check_value(b, result)
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _BUDGET.get()
        if b is not None:
            b.tick()
            _precheck_binop(b, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        if b is not None:
            _check_value(b, result)
        return result


_GUARDS = {"lily_loop_guard": _loop_guard, "lily_output_guard": _output_guard, "lily_concat_guard": _concat_guard}


def _instrument(tree: nodes.Template, env: jinja2.Environment) -> None:
    """Route every loop, output piece and `~` of a parsed template through the budget guards."""

    def guard(name: str, node: nodes.Expr) -> nodes.Filter:
        f = nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)
        f.set_environment(env)
        return f

    for loop in list(tree.find_all(nodes.For)):
        loop.iter = guard("lily_loop_guard", loop.iter)
    for out in list(tree.find_all(nodes.Output)):
        out.nodes = [guard("lily_output_guard", child) for child in out.nodes]
    _guard_concats(tree, guard)


def _guard_concats(node: nodes.Node, guard: Any) -> None:
    # Children first, so that in `a ~ (b ~ c)` the inner concatenation is guarded inside the outer one.
    for field in node.fields:
        value = getattr(node, field, None)
        if isinstance(value, nodes.Node):
            _guard_concats(value, guard)
            if isinstance(value, nodes.Concat):
                setattr(node, field, _concat_call(value, guard))
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, nodes.Node):
                    _guard_concats(item, guard)
            setattr(node, field, [_concat_call(v, guard) if isinstance(v, nodes.Concat) else v for v in value])


def _concat_call(node: nodes.Concat, guard: Any) -> nodes.Filter:
    return guard("lily_concat_guard", nodes.List(list(node.nodes), lineno=node.lineno))


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
        # The optimizer evaluates constant expressions at compile time, outside any budget
        # (`'x'|center(10**9)` would allocate a GB while compiling); rendering is the same without it.
        optimized=False,
    )
    env.filters["tojson"] = _tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, f)
    env.filters.update(_GUARDS)
    env.globals.pop("lipsum", None)  # one call could loop for minutes where no hook sees it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Compilation dominates short renders; a chat session re-renders the same template every turn.
    if len(template) > _MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"chat template is {len(template)} characters, more than {_MAX_TEMPLATE_CHARS}")
    env = _environment()
    try:
        tree = env.parse(template)
        _instrument(tree, env)
        with warnings.catch_warnings():
            # Without the optimizer `{{ (10)[0] }}` compiles to Python `10[0]`, which CPython flags with a
            # SyntaxWarning at compile time; it is the template's runtime error, reported when rendered.
            warnings.simplefilter("ignore", SyntaxWarning)
            return env.from_string(tree)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e
    except Exception as e:  # noqa: BLE001 - e.g. RecursionError or MemoryError on absurd nesting
        raise ChatTemplateError(f"chat template cannot be compiled: {type(e).__name__}: {e}") from e


def _as_list(value: Any, what: str) -> list:
    """Any iterable as a list (generators included), but not a str, bytes or mapping: iterating those
    gives characters or keys, never what the caller meant."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{what} must be a list (or another iterable) of dicts, got {type(value).__name__}")
    return list(value)


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable) and not isinstance(content, (bytes, bytearray, Mapping)):
        pieces = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
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
    out = []
    for i, msg in enumerate(_as_list(messages, "messages")):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
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
        if tool_calls is not None:
            try:
                tool_calls = _as_list(tool_calls, f"{where}.tool_calls")
            except ValueError:
                tool_calls = None
            if tool_calls is None or not all(isinstance(c, Mapping) for c in tool_calls):
                raise ValueError(f"{where}.tool_calls must be a list of dicts")
            norm["tool_calls"] = tool_calls
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
    render_timeout: float = DEFAULT_RENDER_TIMEOUT,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    **extra: Any,
) -> str:
    """Render `messages` with a Jinja chat template, as transformers' apply_chat_template(tokenize=False).

    template None selects `default_chatml_template()` (logged once; callers should surface it).
    enable_thinking / bos_token / eos_token left as None are not defined for the template, so its
    own defaults apply. Extra keyword arguments (pad_token, documents, ...) are passed through.
    `render_timeout` (seconds) and `max_output_chars` bound the render (see the module docstring).
    Template failures, including `raise_exception(...)` and an exceeded limit, raise ChatTemplateError;
    bad messages, tools or limits raise ValueError.
    """
    global _fallback_logged
    if template is None:
        if not _fallback_logged:
            logger.warning("no chat template in checkpoint; using plain ChatML (lily.chat.default_chatml_template)")
            _fallback_logged = True
        template = default_chatml_template()
    elif not isinstance(template, str):
        raise ValueError(f"template must be a str or None, got {type(template).__name__}")

    if isinstance(render_timeout, bool) or not isinstance(render_timeout, (int, float)) \
            or not (render_timeout > 0 and math.isfinite(render_timeout)):
        raise ValueError(f"render_timeout must be a positive number of seconds, got {render_timeout!r}")
    if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int) or max_output_chars < 1:
        raise ValueError(f"max_output_chars must be a positive int, got {max_output_chars!r}")
    msgs = validate_messages(messages)
    if tools is not None:
        tools = _as_list(tools, "tools")
        if not all(isinstance(t, Mapping) for t in tools):
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
    budget = _Budget(float(render_timeout), max_output_chars)
    token = _BUDGET.set(budget)
    try:
        pieces, total = [], 0
        for piece in compiled.generate(**context):
            total += len(piece)
            if total > max_output_chars:
                raise ChatTemplateError(
                    f"chat template output exceeds max_output_chars={max_output_chars} characters"
                )
            pieces.append(piece)
        return "".join(pieces)
    except ChatTemplateError:
        raise
    except Exception as e:  # undefined names, sandbox violations, type errors inside the template
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
    finally:
        _BUDGET.reset(token)
