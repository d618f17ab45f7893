"""Streaming responses and stop strings (Session.stream, generate_text, Engine.generate/stream/chat) on lily-tiny."""

import os

import pytest

import lily
from lily.streaming import StopStringMatcher

PROMPT = "import os\nimport sys\n\n\ndef main():\n"


@pytest.fixture(scope="module")
def eng():
    return lily.Engine.from_pretrained(prefill_chunk=16)


def fresh(eng, max_context=256):
    s = eng.session(max_context=max_context)
    s.prefill(eng.tokenize(PROMPT))
    return s


def greedy_ids(eng, n):
    return list(fresh(eng).generate(n, stop_token_ids=[]))


def test_matcher_holds_back_prefixes_and_cuts_at_the_earliest_stop():
    m = StopStringMatcher(["###", "\n\n"])
    assert m.push("ab#") == ("ab", False)  # "#" may start "###"
    assert m.push("#x") == ("##x", False)  # decided: not a stop string
    assert m.push("y\n") == ("y", False)
    assert m.push("\nz###") == ("", True)  # "\n\n" completes first; the text before it was already out
    m = StopStringMatcher(["bcd", "abcde"])
    assert m.push("xabc") == ("x", False)  # "abc" could start either stop string
    assert m.push("d") == ("a", True)  # "bcd" is complete: the text before its first occurrence
    m = StopStringMatcher(["END"])
    assert m.push("EN") == ("", False)
    assert m.flush() == "EN"  # the stream ended undecided: held text is released
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_stream_matches_generate_and_reports_counts(eng):
    ids = greedy_ids(eng, 24)
    s = fresh(eng)
    prompt_tokens = s.position
    responses = list(s.stream(24, stop_token_ids=[]))
    assert [r.token for r in responses] == ids
    assert [r.generation_tokens for r in responses] == list(range(1, 25))
    assert "".join(r.text for r in responses) == eng.detokenize(ids, skip_special_tokens=True)
    assert all(r.prompt_tokens == prompt_tokens and r.prompt_tps > 0 for r in responses)
    assert all(r.generation_tps > 0 for r in responses)
    assert [r.finish_reason for r in responses] == [None] * 23 + ["length"]
    assert s.finish_reason == "length" and s.tokens[prompt_tokens:] == ids
    # Peak RSS is in bytes: at least the resident size now (statm counts pages).
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert responses[-1].peak_memory_bytes >= rss * 0.9
    assert responses[-1].peak_memory == responses[-1].peak_memory_bytes / 1e9
    with pytest.raises(AttributeError):
        responses[0].text = "x"  # frozen
    # A second stream without a new prefill has no prompt of its own.
    assert next(iter(s.stream(1))).prompt_tokens == 0


def test_last_response_carries_stop_token_and_context_reasons(eng):
    ids = greedy_ids(eng, 12)
    stop_id = ids[5]
    s = fresh(eng)
    out = list(s.stream(40, stop_token_ids=[stop_id]))
    k = ids.index(stop_id)
    assert [r.token for r in out] == ids[: k + 1]
    assert out[-1].finish_reason == "stop" == s.finish_reason
    assert all(r.finish_reason is None for r in out[:-1])
    s = fresh(eng)
    s = fresh(eng, max_context=s.position + 4)
    out = list(s.stream(40, stop_token_ids=[]))
    assert len(out) == 4 and out[-1].finish_reason == "context" == s.finish_reason


def test_closing_the_stream_keeps_exactly_the_seen_tokens(eng):
    s = fresh(eng)
    start = s.position
    stream = s.stream(30, stop_token_ids=[])
    seen = [next(stream).token for _ in range(3)]
    stream.close()
    assert s.tokens[start:] == seen and s.position == start + 3


def _boundary_stop(eng, n=40):
    """A stop string made of the last 2 characters of one token's text and the first 2 of the next."""
    ids = greedy_ids(eng, n)
    pieces = [eng.detokenize(ids[: i + 1]) for i in range(n)]
    full = pieces[-1]
    for k in range(n - 1):
        a, b = pieces[k], pieces[k + 1]
        if len(a) >= 2 and len(b) >= len(a) + 2 and full.startswith(b):
            stop = a[-2:] + b[len(a): len(a) + 2]
            if full.find(stop) == len(a) - 2:
                return ids, full, stop, k
    pytest.fail("no token boundary with two characters on each side in the greedy output")


def test_stop_string_across_token_boundary(eng):
    ids, full, stop, k = _boundary_stop(eng)
    idx = full.find(stop)
    s = fresh(eng)
    start = s.position
    out = list(s.stream(40, stop=[stop], stop_token_ids=[]))
    text = "".join(r.text for r in out)
    assert text == full[:idx]
    assert out[-1].finish_reason == "stop" == s.finish_reason
    # The context holds the tokens seen, including the one that completed the stop string.
    assert [r.token for r in out] == ids[: k + 2] == s.tokens[start:]
    # No response ever released part of the stop string.
    emitted = ""
    for r in out:
        emitted += r.text
        assert full[:idx].startswith(emitted)
    # The same through the other entry points.
    s = fresh(eng)
    assert "".join(s.generate_text(40, stop=stop, stop_token_ids=[])) == full[:idx]
    assert s.finish_reason == "stop"
    assert eng.generate(PROMPT, 40, stop=[stop], stop_token_ids=[]) == full[:idx]
    assert "".join(eng.generate(PROMPT, 40, stop=stop, stream=True, stop_token_ids=[])) == full[:idx]
    assert "".join(r.text for r in eng.stream(PROMPT, 40, stop=stop, stop_token_ids=[])) == full[:idx]


def test_stop_string_that_never_occurs_changes_nothing(eng):
    ids = greedy_ids(eng, 20)
    full = eng.detokenize(ids)
    stop = "\x00never\x00"
    assert eng.generate(PROMPT, 20, stop=[stop], stop_token_ids=[]) == full
    # A stop string sharing a prefix with the text is released once it cannot match.
    s = fresh(eng)
    out = list(s.stream(20, stop=full[:1] + "\x00", stop_token_ids=[]))
    assert "".join(r.text for r in out) == full and out[-1].finish_reason == "length"


def test_chat_with_stop(eng):
    messages = [{"role": "user", "content": "What does `len` do?"}]
    reply = eng.chat(messages, max_tokens=24)
    if len(reply) < 4:
        pytest.skip("reply too short to cut")
    stop = reply[2:4]
    assert eng.chat(messages, max_tokens=24, stop=[stop]) == reply[: reply.find(stop)]


def test_stream_arguments_are_checked_before_any_work(eng):
    s = fresh(eng)
    pos = s.position
    with pytest.raises(ValueError, match="Session.stream: max_tokens"):
        s.stream(-1)
    with pytest.raises(TypeError, match="stop"):
        s.stream(4, stop=[1])
    with pytest.raises(ValueError, match="stop"):
        s.stream(4, stop=[""])
    with pytest.raises(TypeError, match="sampling"):
        s.stream(4, sampling={"temperature": 1})
    with pytest.raises(lily.LilyError, match="prefill"):
        eng.session().stream(4)
    with pytest.raises(ValueError, match="Engine.stream: max_tokens"):
        eng.stream(PROMPT, -2)
    with pytest.raises(TypeError, match="Engine.generate: stop"):
        eng.generate(PROMPT, 4, stop=3)
    assert s.position == pos
