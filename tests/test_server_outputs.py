"""lily.outputs: the reasoning split and qwen3_coder tool-call parsing, whole and piece by piece."""

import json
import random

import pytest

from lily.outputs import OutputParser, ToolCall, parse_tool_call

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "scale": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": ["array", "null"]}}}}}]

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def run(text: str, pieces: list[str] | None = None, **kw) -> list:
    p = OutputParser(**kw)
    events = []
    for piece in pieces if pieces is not None else [text]:
        events += p.feed(piece)
    events += p.finish()
    # adjacent text / reasoning events merged: how they were split is not part of the result
    out = []
    for kind, value in events:
        if out and kind != "tool_call" and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_parse_typed_parameters_from_the_schema():
    body = ("\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n 5 \n</parameter>\n"
            "<parameter=metric>\nTrue\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n"
            "<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n"
            "<parameter=free>\n42\n</parameter>\n</function>\n")
    from lily.outputs import parameter_types

    call = parse_tool_call(body, parameter_types(TOOLS))
    assert call == ToolCall("get_weather", {"city": "New York", "days": 5, "metric": True, "scale": 1.5,
                                            "opts": {"a": [1, 2]}, "tags": ["x"], "free": "42"})


def test_parse_keeps_multiline_values_and_unconvertible_strings():
    body = "<function=f>\n<parameter=code>\ndef g():\n    return 1\n\n</parameter>\n<parameter=days>\nsoon\n</parameter>\n</function>"
    call = parse_tool_call(body, {"f": {"days": "integer"}})
    assert call.arguments == {"code": "def g():\n    return 1\n", "days": "soon"}


def test_parse_json_form():
    assert parse_tool_call('\n{"name": "f", "arguments": {"x": 1}}\n') == ToolCall("f", {"x": 1})
    assert parse_tool_call('{"name": "f", "arguments": "{\\"x\\": 2}"}') == ToolCall("f", {"x": 2})


@pytest.mark.parametrize("body", [
    "", "<function=f>", "<function=>\n</function>", "<function=f>\n<parameter=x>\n1\n</function>",
    "<function=f>\nstray<parameter=x>1</parameter>\n</function>", "<function=f>\n</function> tail",
    "{not json", '{"arguments": {}}', '{"name": "f", "arguments": [1]}',
])
def test_malformed_blocks_do_not_parse(body):
    assert parse_tool_call(body) is None


def test_reasoning_split_when_the_prompt_opened_think():
    assert run("plan it\n</think>\n\nThe answer.", in_reasoning=True) == [
        ("reasoning", "plan it\n"), ("text", "The answer.")]


def test_reasoning_opened_by_the_model_and_plain_text():
    assert run("  <think>hmm</think>ok") == [("reasoning", "hmm"), ("text", "ok")]
    # <think> only opens reasoning at the start; later it is text
    assert run("a <think>b</think>") == [("text", "a <think>b</think>")]
    assert run("<thin") == [("text", "<thin")]
    # unclosed reasoning (ran out of tokens while thinking) stays reasoning
    assert run("still thinking", in_reasoning=True) == [("reasoning", "still thinking")]


def test_tool_calls_between_text():
    text = "Let me check.\n\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n"
    events = run(text, tools=TOOLS)
    assert events == [("text", "Let me check."), ("tool_call", ToolCall("get_weather", {"city": "Paris", "days": 3})),
                      ("tool_call", ToolCall("get_weather", {"city": "Oslo", "days": 3}))]


def test_tool_markup_is_text_without_tools_and_malformed_markup_is_kept():
    assert run(CALL) == [("text", CALL)]
    bad = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</function>\n</tool_call>"
    assert run("Try: " + bad, tools=TOOLS) == [("text", "Try: " + bad)]
    unclosed = "<tool_call>\n<function=f>\n<parameter=x>\n1"
    assert run(unclosed, tools=TOOLS) == [("text", unclosed)]


@pytest.mark.parametrize("seed", range(40))
def test_any_split_gives_the_same_events(seed):
    text = "step one\nstep </thi two\n</think>\n\nSure. <tool_ " + CALL + " after <tool_call>oops</tool_call> end\n"
    whole = run(text, in_reasoning=True, tools=TOOLS)
    assert whole == [("reasoning", "step one\nstep </thi two\n"), ("text", "Sure. <tool_"),
                     ("tool_call", ToolCall("get_weather", {"city": "Paris", "days": 3})),
                     ("text", "after <tool_call>oops</tool_call> end\n")]
    assert run(text, splits(text, seed), in_reasoning=True, tools=TOOLS) == whole
    # one character at a time: nothing is emitted before it is decided, nothing is lost
    assert run(text, list(text), in_reasoning=True, tools=TOOLS) == whole


def test_tags_are_held_back_until_decided():
    p = OutputParser(in_reasoning=True, tools=TOOLS)
    assert p.feed("abc</th") == [("reasoning", "abc")]
    assert p.feed("ink>Hi <tool") == [("text", "Hi")]  # the space waits: it may separate text from a call
    assert p.feed("_call>\n<function=f>\n</function>\n</tool_call>") == [("tool_call", ToolCall("f", {}))]
    assert p.finish() == []


# ---- stream_arguments: a call announced while it is written ----

def announced(text: str, pieces: list[str] | None = None, **kw) -> tuple[list, dict[int, str], list]:
    """(events without the announcements, {index: concatenated argument fragments}, [(feed no., event)])."""
    p = OutputParser(stream_arguments=True, **kw)
    plain, frags, timeline = [], {}, []
    for n, piece in enumerate((pieces if pieces is not None else [text]) + [None]):
        for kind, value in p.feed(piece) if piece is not None else p.finish():
            timeline.append((n, kind))
            if kind == "tool_call_begin":
                frags[value[0]] = ""
            elif kind == "tool_call_args":
                frags[value[0]] += value[1]
            elif plain and kind != "tool_call" and plain[-1][0] == kind:
                plain[-1] = (kind, plain[-1][1] + value)
            else:
                plain.append((kind, value))
    return plain, frags, timeline


@pytest.mark.parametrize("seed", range(20))
def test_streamed_arguments_concatenate_to_the_call_and_come_before_its_end(seed):
    text = "Sure. " + CALL + "\n" + CALL.replace("Paris", "Oslo") + ' <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    plain, frags, timeline = announced(text, list(text) if seed == 0 else splits(text, seed), tools=TOOLS)
    assert plain == run(text, tools=TOOLS)  # the same calls and text as without the option
    calls = [v for k, v in plain if k == "tool_call"]
    assert frags == {0: json.dumps(calls[0].arguments), 1: json.dumps(calls[1].arguments)}  # JSON form: not announced
    if seed == 0:  # one character at a time: the first parameter goes out before the block's end arrives
        begin = next(n for n, k in timeline if k == "tool_call_begin")
        args = [n for n, k in timeline if k == "tool_call_args"]
        end = next(n for n, k in timeline if k == "tool_call")
        assert begin < args[0] < args[1] < end and len(set(args[:2])) == 2
        assert text.index("<function=get_weather>") < begin <= text.index("<parameter=city>")
        assert args[0] == text.index("</parameter>") + len("</parameter>") - 1


def test_an_announced_call_that_turns_out_malformed_keeps_its_text():
    bad = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nstray\n</tool_call>"
    plain, frags, _ = announced("Try: " + bad, list("Try: " + bad), tools=TOOLS)
    assert plain == [("text", "Try:"), ("tool_call", ToolCall("get_weather", {"city": "Paris"})), ("text", bad)]
    assert frags == {0: '{"city": "Paris"}'}
    unclosed = "<tool_call>\n<function=f>\n<parameter=x>\n1"
    plain, frags, _ = announced(unclosed, tools=TOOLS)
    assert plain == [("tool_call", ToolCall("f", {})), ("text", unclosed)] and frags == {0: "{}"}
