"""lily.outputs: the reasoning split and qwen3_coder tool-call parsing, whole and piece by piece."""

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
