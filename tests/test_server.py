"""The HTTP server on loopback, driven by the official openai and anthropic clients (and raw httpx).

Every test runs against a live uvicorn on a free port serving the packaged lily-tiny. Greedy answers are
compared with what the library itself generates for the same prompt, so the server is checked for
exactness, not only for shape. lily-tiny never writes tool calls or reasoning, so those paths are also
driven by a scripted token source (a test-only substitute for LilyServer._token_stream).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import lily  # noqa: E402
from lily.chat import render_chat  # noqa: E402
from lily.server import ServerConfig, create_app  # noqa: E402

MODEL = "lily-tiny"

# A Qwen3.6-style template (tools listed in the system turn, the qwen3_coder call format, thinking opened
# by the generation prompt when enable_thinking is true), written for these tests.
TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n# Tools\n<tools>' }}
{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
{{- '\n</tools>\nCall one with <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + m.content }}
{%- for call in m.tool_calls or [] %}
{{- '<tool_call>\n<function=' + call.function.name + '>\n' }}
{%- for k, v in call.function.arguments.items() %}{{- '<parameter=' + k + '>\n' + (v | string) + '\n</parameter>\n' }}{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\n' }}{%- else %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}]
CALL_TEXT = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


class Live:
    """uvicorn serving one app on a free loopback port, in a thread."""

    def __init__(self, engine, **config):
        self.app = create_app(engine, ServerConfig(model_name=MODEL, **config))
        self.lily = self.app.state.lily
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() - t0 < 30, "server did not start"
            time.sleep(0.01)
        self.base = f"http://127.0.0.1:{self.port}"

    def openai(self):
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=60)

    def anthropic(self):
        return anthropic.Anthropic(base_url=self.base, api_key="unused", max_retries=0, timeout=60)

    def metrics(self) -> dict:
        return httpx.get(self.base + "/metrics").json()

    def wait_idle(self, timeout: float = 5.0) -> dict:
        t0 = time.monotonic()
        while True:
            m = self.metrics()
            if m["active"] == 0 and m["queued"] == 0:
                return m
            assert time.monotonic() - t0 < timeout, f"server still busy: {m}"
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def engine():
    with lily.Engine.from_pretrained() as e:
        yield e


@pytest.fixture(scope="module")
def live(engine):
    srv = Live(engine, max_context=1024, max_concurrency=4, chat_template=TEMPLATE, prefix_cache_bytes=16 << 20)
    yield srv
    srv.stop()


def prompt_ids(engine, messages, **kw):
    tok = engine.tokenizer
    return tok.encode(render_chat(TEMPLATE, messages, add_generation_prompt=True, **kw))


def library_text(engine, ids, max_tokens, stop=None, ignore_eos=False) -> tuple[str, list[int]]:
    """What the library generates greedily for ``ids``: the text and the token ids."""
    s = engine.session(max_context=len(ids) + max_tokens)
    s.prefill(ids)
    rs = list(s.stream(max_tokens, lily.SamplingParams(), stop=stop, stop_token_ids=[] if ignore_eos else None,
                       logprobs=3))
    s.close()
    return "".join(r.text for r in rs), rs


def scripted(live, texts: list[str]):
    """Replace the model with a script: each request's output is the next text, one token per ~4 chars."""
    from lily import GenerationResponse

    script = list(texts)

    def fake(session, req):
        text = script.pop(0)
        pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield GenerationResponse(text=piece, token=1 + i % 100, prompt_tokens=len(req.ids), prompt_tps=0.0,
                                     generation_tokens=i + 1, generation_tps=0.0, peak_memory_bytes=0,
                                     finish_reason="stop" if last else None)

    live.lily._token_stream = fake


@pytest.fixture
def script(live):
    real = live.lily._token_stream
    yield lambda *texts: scripted(live, list(texts))
    live.lily._token_stream = real


GREEDY = {"temperature": 0}  # the anthropic client of this version has no temperature argument
USER = [{"role": "user", "content": "def read_lines(path):"}]


# ---------------------------------------------------------------------------------------------------
# basics
# ---------------------------------------------------------------------------------------------------

def test_models_health_metrics(live):
    assert [m.id for m in live.openai().models.list()] == [MODEL]
    assert httpx.get(live.base + "/health").json()["status"] == "ok"
    m = live.metrics()
    assert {"requests", "prompt_tokens", "completion_tokens", "active", "queued", "rss_bytes"} <= set(m)
    text = httpx.get(live.base + "/metrics", params={"format": "prometheus"}).text
    assert "# TYPE lily_requests_total counter" in text and "lily_queue_depth 0" in text


def test_chat_matches_the_library_streaming_and_not(live, engine):
    ids = prompt_ids(engine, USER)
    expected, rs = library_text(engine, ids, 40)
    client = live.openai()
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == ("length" if len(rs) == 40 else "stop")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(rs)
    assert r.choices[0].message.model_extra.get("reasoning_content") is None

    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(rs)


def test_completions_stop_sequences_and_sampling(live, engine):
    prompt = "import os\nimport sys\n"
    ids = engine.tokenize(prompt)
    full, _ = library_text(engine, ids, 48)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    expected, rs = library_text(engine, ids, 48, stop=[stop])
    assert expected == full[:full.index(stop)]
    client = live.openai()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(rs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=stop, stream=True))
    assert streamed == expected
    # token ids as the prompt; seeded sampling is reproducible and differs from greedy
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=1.0, seed=7,
                                  presence_penalty=2.0,
                                  extra_body={"top_k": 3, "min_p": 0.05, "repetition_penalty": 1.3})
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=1.0, seed=7,
                                  presence_penalty=2.0,
                                  extra_body={"top_k": 3, "min_p": 0.05, "repetition_penalty": 1.3})
    assert a.choices[0].text == b.choices[0].text
    s = engine.session(max_context=len(ids) + 24)
    s.prefill(ids)
    sampled = "".join(s.generate_text(24, lily.SamplingParams(temperature=1.0, seed=7, top_k=3, min_p=0.05,
                                                                repetition_penalty=1.3, presence_penalty=2.0)))
    assert a.choices[0].text == sampled  # every field reached the sampler


def test_logprobs_match_the_library(live, engine):
    ids = prompt_ids(engine, USER)
    _, rs = library_text(engine, ids, 12)
    r = live.openai().chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(rs)
    for got, want in zip(content, rs):
        assert got.token == engine.detokenize([want.token])
        assert got.logprob == pytest.approx(want.logprob, abs=1e-9)
        assert [t.token for t in got.top_logprobs] == [engine.detokenize([t]) for t, _ in want.top_logprobs]
        assert got.top_logprobs[0].token == got.token  # greedy picks the most likely token
    # streamed: one logprob entry per token, in order
    chunks = live.openai().chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [t.token for t in content]
    assert all(len(e.top_logprobs) == 2 for e in entries)
    # completions: tokens, token_logprobs, top_logprobs dicts
    c = live.openai().completions.create(model=MODEL, prompt="import os\n", max_tokens=6, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(max(d.values()) == pytest.approx(v) for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == c.choices[0].text


def test_anthropic_messages_match_the_library(live, engine):
    msgs = [{"role": "user", "content": "def read_lines(path):"}]
    ids = prompt_ids(engine, [{"role": "system", "content": "Be brief."}] + msgs)
    expected, rs = library_text(engine, ids, 30)
    client = live.anthropic()
    m = client.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, system="Be brief.", messages=msgs)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected
    assert m.stop_reason == ("max_tokens" if len(rs) == 30 else "end_turn")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids) and m.usage.output_tokens == len(rs)
    with client.messages.stream(model=MODEL, max_tokens=30, extra_body=GREEDY, system="Be brief.", messages=msgs) as st:
        kinds = [ev.type for ev in st]
        final = st.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == expected and final.stop_reason == m.stop_reason
    # a stop sequence is reported as such
    stop = expected[10:13]
    m = client.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, system="Be brief.", messages=msgs,
                               stop_sequences=[stop])
    assert m.content[0].text == expected[:expected.index(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_three_turns_hit_the_prefix_cache_and_match_a_cold_run(live, engine):
    # Thinking on: the template opens <think> in each prompt and drops earlier reasoning when it re-renders
    # a turn, so the end of a prompt is not what the next one shares; the end of the conversation before
    # the generation prompt is.
    kw = {"chat_template_kwargs": {"enable_thinking": True}}
    client = live.openai()
    messages: list[dict] = []
    before = live.metrics()["prefix_cache"]
    for turn, question in enumerate(["def parse_three_turns(text):", "class Reader:", "import json"]):
        messages.append({"role": "user", "content": question})
        ids = prompt_ids(engine, messages, enable_thinking=True)
        expected, rs = library_text(engine, ids, 16)  # cold: a fresh session, the whole prompt prefilled
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                           extra_body=kw)
        msg = r.choices[0].message
        assert msg.model_extra["reasoning_content"] == expected and r.usage.completion_tokens == len(rs)
        cached = r.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0
        else:  # the previous turn's conversation, up to its last user message, came from the cache
            shared = engine.tokenizer.encode(render_chat(TEMPLATE, messages[:-2], add_generation_prompt=False,
                                                         enable_thinking=True))
            assert cached == len(shared) > 0
        messages.append({"role": "assistant", "content": msg.content or "",
                         "reasoning_content": msg.model_extra["reasoning_content"]})
    after = live.metrics()["prefix_cache"]
    assert after["hits"] >= before["hits"] + 2 and after["tokens_saved"] > before["tokens_saved"]
    assert 0 < after["bytes"] <= after["max_bytes"]


def test_requests_share_a_rounded_session_shape_and_keep_states(live, engine, monkeypatch):
    # Two prompts of different lengths ask for one session shape (prompt + max_tokens rounded up to a power of
    # two), so the second can restore into the state the first left (Engine.keep_sessions, set by the server).
    assert [live.lily.session_context(n) for n in (1, 2, 33, 64, 65, 600, 5000)] == [1, 2, 64, 64, 128, 1024, 1024]
    sizes = []
    make = engine.session

    def session(max_context=4096, **kw):
        sizes.append(max_context)
        return make(max_context=max_context, **kw)

    monkeypatch.setattr(engine, "session", session)
    client = live.openai()
    for question in ["Name a colour.", "Name a colour and a number, please."]:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                       max_tokens=4, temperature=0)
    assert len(sizes) == 2 and sizes[0] == sizes[1] == 32  # prompts of ~20 and ~25 tokens, + 4
    m = live.wait_idle()
    assert m["keep_sessions"] == engine.keep_sessions == 2 and 1 <= m["kept_sessions"] <= 2
    assert engine.report()["keep_sessions"] == {"max": 2, "kept": m["kept_sessions"]}
    text = httpx.get(live.base + "/metrics", params={"format": "prometheus"}).text
    assert "lily_keep_sessions 2" in text and f"lily_kept_sessions {m['kept_sessions']}" in text


def test_a_restarted_server_finds_the_spilled_prefix_cache(engine, tmp_path):
    # A memory budget of about one checkpoint: each new conversation evicts the last one to the disk tier.
    # A second server on the same folder then answers the first conversation's next turn from a file.
    cfg = dict(max_context=512, chat_template=TEMPLATE, prefix_cache_bytes=4 << 20, prefix_cache_dir=str(tmp_path))
    first = [{"role": "user", "content": "def spill_me(path):"}]
    srv = Live(engine, **cfg)
    try:
        client = srv.openai()
        for content in (first[0]["content"], "class Other:", "import zlib"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                           max_tokens=4, temperature=0)
        assert srv.metrics()["prefix_cache"]["spilled"] >= 1
    finally:
        srv.stop()
    again = Live(engine, **cfg)
    try:
        messages = first + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more?"}]
        ids = prompt_ids(engine, messages)
        expected, _ = library_text(engine, ids, 8)
        r = again.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        shared = engine.tokenizer.encode(render_chat(TEMPLATE, first, add_generation_prompt=False))
        assert r.usage.prompt_tokens_details.cached_tokens >= len(shared) > 0
        assert r.choices[0].message.content == expected  # exactly a cold run's answer
        assert again.metrics()["prefix_cache"]["disk_hits"] == 1
    finally:
        again.stop()


# ---------------------------------------------------------------------------------------------------
# reasoning and tool calls
# ---------------------------------------------------------------------------------------------------

def test_reasoning_split_end_to_end_with_the_model(live, engine):
    # enable_thinking opens <think> in the prompt: everything lily-tiny writes (it never closes it) is reasoning
    ids = prompt_ids(engine, USER, enable_thinking=True)
    expected, _ = library_text(engine, ids, 24)
    client = live.openai()
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=24, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == expected and not msg.content
    assert r.usage.prompt_tokens == len(ids)
    m = live.anthropic().messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=USER,
                                         thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == expected
    # thinking off: the template closes <think> itself, the same tokens are plain content
    off = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=24, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == len(prompt_ids(engine, USER, enable_thinking=False))
    assert off.choices[0].message.model_extra["reasoning_content"] is None


def test_reasoning_and_tool_calls_openai(live, engine, script):
    out = "Plan: check weather.\n</think>\n\nChecking.\n" + CALL_TEXT
    script(out, out, out)
    client = live.openai()
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Plan: check weather.\n"
    assert msg.content == "Checking."
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    # the tools were rendered through the chat template
    assert r.usage.prompt_tokens == len(prompt_ids(engine, msgs, tools=TOOLS, enable_thinking=True))

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200,
                                                 stream=True, extra_body={"chat_template_kwargs": {
                                                     "enable_thinking": True}}))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert reasoning == "Plan: check weather.\n" and content == "Checking."
    # announced with its name and id, then the arguments in pieces as each parameter completes
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    pieces = [tc.function.arguments for tc in calls[1:]]
    assert len(pieces) == 3 and json.loads("".join(pieces)) == {"city": "Paris", "days": 3}  # city, days, "}"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the call and its result go back in: the template renders them (arguments as a JSON string)
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=200)
    rendered = render_chat(TEMPLATE, [msgs[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": "sunny"}], tools=TOOLS)
    assert "<parameter=city>\nParis\n</parameter>" in rendered
    assert r2.usage.prompt_tokens == len(engine.tokenizer.encode(rendered))


def test_tool_calls_anthropic_and_malformed_markup(live, script):
    bad = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    script("I will look.\n" + CALL_TEXT, "I will look.\n" + CALL_TEXT, "Oops " + bad, "Oops " + bad)
    client = live.anthropic()
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    msgs = [{"role": "user", "content": "Weather?"}]
    m = client.messages.create(model=MODEL, max_tokens=200, tools=tools, messages=msgs)
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[0].text == "I will look."
    assert m.content[1].name == "get_weather" and m.content[1].input == {"city": "Paris", "days": 3}
    assert m.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=200, tools=tools, messages=msgs) as st:
        events = list(st)
        final = st.get_final_message()
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(partial) == 3 and json.loads("".join(partial)) == {"city": "Paris", "days": 3}  # in pieces
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == m.content[1].input
    # malformed markup comes back as text, not lost, and nothing claims a tool call
    r = live.openai().chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200)
    assert r.choices[0].message.content == "Oops " + bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    m = client.messages.create(model=MODEL, max_tokens=200, tools=tools, messages=msgs)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Oops " + bad
    assert m.stop_reason == "end_turn"


def test_anthropic_history_with_tool_use_renders(live, engine):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                                              {"type": "text", "text": "Look:"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"}]}]
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    m = live.anthropic().messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, tools=tools, messages=msgs)
    rendered = render_chat(TEMPLATE, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Look:", "reasoning_content": "t",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "rain"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "",
                                                 "parameters": TOOLS[0]["function"]["parameters"]}}])
    assert "<tool_response>\nrain\n</tool_response>" in rendered
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(engine.tokenizer.encode(rendered))


# ---------------------------------------------------------------------------------------------------
# scheduling
# ---------------------------------------------------------------------------------------------------

def test_eight_concurrent_clients_all_answered_exactly(live, engine):
    prompts = [f"def function_{i}(x):" for i in range(10)]
    expected = [library_text(engine, prompt_ids(engine, [{"role": "user", "content": p}]), 24)[0] for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            c = live.openai()
            msgs = [{"role": "user", "content": prompts[i]}]
            if i % 2:
                results[i] = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True) if ch.choices)
            else:
                results[i] = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                                       temperature=0).choices[0].message.content
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert [results.get(i) for i in range(len(prompts))] == expected
    live.wait_idle()


def test_two_streams_interleave(live):
    arrivals: dict[int, list[float]] = {0: [], 1: []}

    def client(i: int) -> None:
        with httpx.stream("POST", live.base + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": f"class Thing{i}:", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    arrivals[i].append(time.monotonic())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    a, b = arrivals[0], arrivals[1]
    assert len(a) > 100 and len(b) > 100
    # Both make progress together: each stream receives tokens while the other is still running.
    overlap_start, overlap_end = max(a[0], b[0]), min(a[-1], b[-1])
    assert overlap_end > overlap_start
    assert sum(overlap_start <= t <= overlap_end for t in a) > 20
    assert sum(overlap_start <= t <= overlap_end for t in b) > 20


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_disconnect_mid_stream_cancels_the_generation(engine, path):
    # A generation long enough (16000 tokens: many seconds) that only a cancel ends it in time.
    srv = Live(engine, max_context=16384)
    try:
        with httpx.stream("POST", srv.base + path, timeout=60, json={
                "model": MODEL, "messages": USER, "max_tokens": 16000, "temperature": 0, "ignore_eos": True,
                "stream": True}) as resp:
            lines = resp.iter_lines()  # held: a discarded line iterator closes the connection
            n = 0
            while n < 5:
                n += next(lines).startswith("data: {")
            time.sleep(0.3)
            m = srv.metrics()
            assert m["active"] == 1 and m["cancelled"] == 0  # still generating while the client listens
        t0 = time.monotonic()
        after = srv.wait_idle()
        assert time.monotonic() - t0 < 2.0
        assert after["cancelled"] == 1
        assert 3 <= after["completion_tokens"] < 16000
        # the server carries on
        assert srv.openai().chat.completions.create(model=MODEL, messages=USER, max_tokens=4).choices
    finally:
        srv.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions"])
def test_disconnect_while_waiting_for_a_whole_answer_cancels(engine, path):
    srv = Live(engine, max_context=16384)
    try:
        body = {"model": MODEL, "messages": USER, "max_tokens": 16000, "temperature": 0, "ignore_eos": True}
        if path == "/v1/completions":
            body = {**body, "prompt": "import os", "messages": None}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(srv.base + path, json=body, timeout=0.8)
        t0 = time.monotonic()
        after = srv.wait_idle()
        assert time.monotonic() - t0 < 2.0
        assert after["cancelled"] == 1 and 1 <= after["completion_tokens"] < 16000
    finally:
        srv.stop()


def test_queue_limit_429_and_timeout_503(engine):
    srv = Live(engine, max_context=2048, max_concurrency=1, max_queue=0, request_timeout=30)
    try:
        with httpx.stream("POST", srv.base + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "import os", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True}) as resp:
            lines = resp.iter_lines()  # held: a discarded line iterator closes the connection
            next(lines)
            busy = httpx.post(srv.base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert busy.status_code == 429
            assert busy.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                srv.openai().completions.create(model=MODEL, prompt="x", max_tokens=2)
        srv.wait_idle()
        m = srv.metrics()
        assert m["rejected"] == 2 and m["cancelled"] == 1
    finally:
        srv.stop()
    srv = Live(engine, max_context=4096, max_concurrency=1, max_queue=4, request_timeout=0.3)
    try:
        slow = {"model": MODEL, "prompt": "import os", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.base + "/v1/completions", json=slow, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "timeout"
        r = httpx.post(srv.base + "/v1/messages", json={**slow, "messages": USER, "prompt": None}, timeout=60)
        assert r.status_code == 503 and r.json()["type"] == "error"
        srv.wait_idle()
        assert srv.metrics()["timed_out"] >= 2
        ok = httpx.post(srv.base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------------
# bad requests
# ---------------------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": USER, "max_tokens": 4}


@pytest.mark.parametrize("change, status, param", [
    ({"model": "gpt-4"}, 404, "model"),
    ({"model": None}, 400, "model"),
    ({"temperature": -1}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_k": -5}, 400, "top_k"),
    ({"min_p": 2}, 400, "min_p"),
    ({"presence_penalty": 3}, 400, "presence_penalty"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"seed": -1}, 400, "seed"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 5000}, 400, "max_tokens"),
    ({"n": 2}, 400, "n"),
    ({"stop": [1]}, 400, "stop"),
    ({"logprobs": "yes"}, 400, "logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 1500}]}, 400, "messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, 400, "chat_template_kwargs"),
])
def test_bad_chat_requests_name_the_field(live, change, status, param):
    r = httpx.post(live.base + "/v1/chat/completions", json={**CHAT, **change})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    if param not in ("model", "messages", "tools", "response_format", "tool_choice", "n", "chat_template_kwargs"):
        assert f"'{param}'" in err["message"] or f"SamplingParams.{param}" in err["message"]


def test_malformed_bodies_and_oversize_prompts(live):
    for body in (b"{bad json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(live.base + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(live.base + "/v1/completions", json={"model": MODEL, "prompt": "word " * 1500})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(live.base + "/v1/completions", json={"model": MODEL, "prompt": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(live.base + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(live.base + "/v1/messages", json={"model": MODEL, "messages": USER})  # no max_tokens
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "POST /v1/messages: 'max_tokens' is required"}}
    r = httpx.post(live.base + "/v1/messages", json={"model": "claude", "messages": USER, "max_tokens": 3})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(live.base + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        live.openai().chat.completions.create(model="gpt-4", messages=USER)
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        live.openai().chat.completions.create(model=MODEL, messages=USER, n=3)
    with pytest.raises(anthropic.BadRequestError):
        live.anthropic().messages.create(model=MODEL, max_tokens=5, messages=USER, extra_body={"temperature": -2})
    # healthy afterwards, nothing left running
    assert httpx.get(live.base + "/health").json()["status"] == "ok"
    assert live.wait_idle()["active"] == 0
    assert live.openai().completions.create(model=MODEL, prompt="x", max_tokens=3).choices[0].text is not None


# ---------------------------------------------------------------------------------------------------
# soak and the command line
# ---------------------------------------------------------------------------------------------------

def test_soak_400_requests_rss_bounded(live):
    def burst(n: int, offset: int) -> None:
        def worker(k: int) -> None:
            with httpx.Client(base_url=live.base, timeout=60) as c:
                for j in range(k, n, 8):
                    i = offset + j
                    if i % 3 == 0:
                        r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"x = {i}", "max_tokens": 6})
                    elif i % 3 == 1:
                        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 6, "stream": True,
                                                                 "messages": [{"role": "user", "content": str(i)}]})
                    else:
                        r = c.post("/v1/messages", json={"model": MODEL, "max_tokens": 6,
                                                         "messages": [{"role": "user", "content": str(i)}]})
                    assert r.status_code == 200, r.text

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)

    burst(100, 0)  # warm-up: allocator pools, caches
    start = live.wait_idle()
    t0 = time.monotonic()
    burst(400, 100)
    end = live.wait_idle()
    seconds = time.monotonic() - t0
    ok = sum(r["count"] for r in end["requests"] if r["status"] == 200) - \
        sum(r["count"] for r in start["requests"] if r["status"] == 200)
    print(f"\nsoak: 400 requests in {seconds:.1f} s; RSS {start['rss_bytes'] / 2**20:.1f} MiB at start, "
          f"{end['rss_bytes'] / 2**20:.1f} MiB at end")
    assert ok == 400
    # Bounded: +5 MiB over these 400 (2026-12-01) since the CPU backend maps its large buffers; through
    # malloc, sessions closed on many threads left their KV caches in per-thread arenas (benchmarks/NOTES.md,
    # "RSS creep"; benchmarks/rss_sessions.py measures it without the server).
    assert end["rss_bytes"] - start["rss_bytes"] < 32 * 2**20


def test_cli_serve(tmp_path):
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    proc = subprocess.Popen([sys.executable, "-m", "lily", "serve", "--port", str(port), "--max-context", "512",
                             "--chat-template", str(template), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - t0 < 60, "server did not come up"
            time.sleep(0.1)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert r.choices[0].message.model_extra["reasoning_content"]  # the --chat-template opened <think>
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["max_model_len"] == 512
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_missing_server_extra_names_it():
    import subprocess
    import sys

    code = "import sys; sys.modules['fastapi'] = None; import lily.server"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "pip install 'lily-inference[server]'" in r.stderr
