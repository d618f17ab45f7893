"""Chat templates come from checkpoints, i.e. from strangers: a render is bounded in time and size
(ChatTemplateError, quickly and without a big allocation), a normal template renders exactly as Jinja
does, and messages, content parts, tool lists and token ids may be any iterable.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

import lily
from lily.chat import render_chat, validate_messages
from lily.errors import ChatTemplateError


@pytest.fixture(scope="module")
def engine():
    return lily.Engine.from_pretrained()


# ---- 3. chat templates: bounded time and size ------------------------------------------------------

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # no call, filter or output inside the loops: only the loop guard sees them
    "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
])
def test_template_time_limit(template):
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="render_timeout"):
        render_chat(template, MSGS, render_timeout=0.3)
    assert time.perf_counter() - t0 < 3.0


@pytest.mark.parametrize("template", [
    "{% for i in range(300) %}{{ 'x' * 1000000 }}{% endfor %}",                   # 300 MB of output
    "{{ 'x' * 10**9 }}",                                                           # one 1 GB string
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ (ns.s ~ ns.s) %}{% endfor %}",
    "{% macro m() %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endmacro %}{{ m()|length }}",
    "{% macro m() %}{% for i in range(100000) %}" + "z" * 1000 + "{% endfor %}{% endmacro %}{{ m()|length }}",
    "{{ 'x'|center(10**9) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ '%999999999d' % 1 }}",
    "{{ ('x' * 1000000)|replace('x', 'yyyyyyyyyy') }}",
    "{{ (range(100000)|list * 100000)|length }}",
    "{% set ns = namespace(x=3) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
])
def test_template_size_limits(template):
    """Each template builds gigabytes (or a 2**100-bit int) unchecked; the budget stops it first."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ChatTemplateError, match="max_output_chars|bits"):
            render_chat(template, MSGS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0 and peak < 200 << 20, (time.perf_counter() - t0, peak)


def test_template_limits_are_keywords():
    template = "{% for i in range(n) %}{{ 'abcd' }}{% endfor %}"
    assert render_chat(template, MSGS, n=500) == "abcd" * 500
    with pytest.raises(ChatTemplateError, match="max_output_chars=1000"):
        render_chat(template, MSGS, n=500, max_output_chars=1000)
    assert render_chat(template, MSGS, n=500, max_output_chars=2000) == "abcd" * 500
    for bad in (dict(render_timeout=0), dict(render_timeout=float("nan")), dict(max_output_chars=0),
                dict(max_output_chars=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            render_chat(template, MSGS, n=1, **bad)


def test_template_compile_failures_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="compiled|syntax"):
        render_chat("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", MSGS)
    with pytest.raises(ChatTemplateError):
        render_chat("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", MSGS)


def test_instrumented_templates_render_as_before():
    """The guards change nothing a normal template does: loops with loop.* helpers, macros, call blocks,
    set blocks, filters, `~`, `%`, `+`, `*` and string methods give Jinja's own rendering."""
    import jinja2.sandbox

    template = (
        "{% macro box(x) %}[{{ x }}]{% endmacro %}"
        "{% macro wrap() %}<{{ caller() }}>{% endmacro %}"
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ loop.index }}/{{ loop.length }}{{ '*' if loop.last }}:{{ box(m.role ~ '-' ~ m.content|upper) }}"
        "{% call wrap() %}{{ '%s=%d' % (m.role, loop.index0) }}{% endcall %}"
        "{% set block %}{{ m.content * 2 }}{% endset %}{{ block|length }}{{ ' | '.join([m.role, 'x']) }}"
        "{% endfor %}{{ ns.n }}{{ [1, 2] + [3] }}{{ '{}-{}'.format(1, 2) }}{{ none }}{{ undefined_name }}"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    reference = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    expected = reference.from_string(template).render(messages=msgs)
    assert render_chat(template, msgs) == expected


# ---- 6. iterables where the signatures promise them ------------------------------------------------


def test_chat_accepts_any_iterable():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": ("a", "b")}]
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    expected = render_chat(None, [msgs[0], {"role": "user", "content": parts}])
    gen_parts = ({"type": "text", "text": t} for t in "ab")
    assert render_chat(None, iter([msgs[0], {"role": "user", "content": gen_parts}])) == expected
    assert render_chat(None, tuple([msgs[0], {"role": "user", "content": tuple(parts)}])) == expected
    tool_template = "{% for t in tools %}{{ t.name }};{% endfor %}{{ messages[0].tool_calls|length }}"
    out = render_chat(tool_template, [{"role": "assistant", "tool_calls": iter([{"id": 1}])}],
                      tools=({"name": n} for n in "xy"))
    assert out == "x;y;1"
    for bad in ("hello", {"role": "user"}, 5):
        with pytest.raises(ValueError, match="messages"):
            validate_messages(bad)


def test_tokenizer_accepts_any_iterable(engine):
    tok = engine.tokenizer
    ids = tok.encode("def f(x): return x")
    text = tok.decode(ids)
    assert tok.decode(iter(ids)) == text
    assert tok.decode(np.array(ids, dtype=np.int64)) == text
    assert tok.decode(i for i in ids) == text
    with pytest.raises(ValueError, match="2\\*\\*32"):
        tok.decode([2**40])  # the Rust decoder raised OverflowError
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(iter(msgs), tools=iter([])) == tok.apply_chat_template(msgs)
