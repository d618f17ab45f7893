"""Tests for lily.tokenizer (loading, encode/decode, streaming detokenization) and lily.chat (templates).

A tiny Qwen-style byte-level BPE is trained here with `tokenizers`; transformers is used only as a
reference in the tests that import it via importorskip.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime

import pytest
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizersTokenizer

from lily.chat import default_chatml_template, render_chat, validate_messages
from lily.errors import ChatTemplateError, CheckpointError
from lily.tokenizer import StreamDecoder, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Qwen2-family pre-tokenizer split: letters with an optional leading non-letter, single digits,
# punctuation runs, newline runs, whitespace.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve façade, jalapeño, Ærøskøbing, smörgåsbord.",
    "日本語のテキストです。中文文本测试，你好世界！한국어 문장입니다.",
    "Emoji: 😀 😃 🎉 👍🏽 👨‍👩‍👧 🇯🇵 and more 🚀🔥",
    "def f(x):\n    return x * 2\n\n\nprint(f(21))\t# tabs\tand  spaces",
    "Numbers 12345 and 3.14159; symbols @#$%^&*()[]{}<>",
] * 20

# A Qwen3-style ChatML template with thinking and tool calls (written for these tests).
QWEN3_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nFunctions you can call are listed in <tools></tools>, one JSON schema per line:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call one, reply with <tool_call></tool_call> around {"name": ..., "arguments": {...}}.<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('the system message must be the first message') }}
        {%- endif %}
    {%- elif m.role == 'user' %}
        {{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set content = m.content if m.content is string else '' %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- if m.tool_calls %}
            {%- for call in m.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- if not loop.first or content %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
                {%- if fn.arguments is string %}
                    {{- fn.arguments }}
                {%- else %}
                    {{- fn.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown role: ' + m.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city <with> 'quotes' & ünïcödé",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hi there"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn_reasoning": [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Second question, 日本語 😀"},
        {"role": "assistant", "content": "<think>\ninline thoughts\n</think>\n\nSecond answer"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "I should call the tool twice.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 4}"},
    ],
}


def _build_tokenizer() -> HFTokenizersTokenizer:
    tok = HFTokenizersTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS],
        # Full byte alphabet, so any UTF-8 text encodes; small vocab, so many characters span tokens.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def raw_tokenizer() -> HFTokenizersTokenizer:
    return _build_tokenizer()


def _write_checkpoint(path, raw, *, config=None, generation=None, jinja=None):
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return path


def _qwen_config(raw, **overrides):
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": QWEN3_TEMPLATE,
        "added_tokens_decoder": {
            str(raw.token_to_id(s)): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False}
            for s in SPECIALS
        },
    }
    cfg.update(overrides)
    return cfg


@pytest.fixture
def ckpt(tmp_path, raw_tokenizer):
    return _write_checkpoint(
        tmp_path / "ckpt", raw_tokenizer,
        config=_qwen_config(raw_tokenizer),
        generation={"eos_token_id": [raw_tokenizer.token_to_id("<|endoftext|>"),
                                     raw_tokenizer.token_to_id("<|im_end|>")]},
    )


@pytest.fixture
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_dir(ckpt)


# Text that stresses streaming: multi-byte characters the tiny vocab splits across tokens,
# combining marks, ZWJ sequences, flags, skin tones, tabs/newlines, and a literal U+FFFD.
STREAM_TEXTS = [
    "Hello world! The quick brown fox.",
    "Café crème brûlée — naïve façade.",
    "e\u0301 combining acute, A\u030a ring",
    "日本語のテキストです。中文文本测试，你好世界！",
    "한국어 문장입니다. Ελληνικά κείμενο. Кириллица текст.",
    "😀🎉 family 👨‍👩‍👧‍👦 flag 🇯🇵 thumbs 👍🏽 rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "  leading spaces\n\n\ttabs\tand\r\nCRLF  \n  trailing  ",
    "mixed: a😀b日c\né\n\n🚀",
    "literal replacement \ufffd in the middle \ufffd",
    "end with emoji 🔥",
]


# ---------------------------------------------------------------------------------------- loading


def test_missing_tokenizer_json_names_path(tmp_path):
    with pytest.raises(CheckpointError) as ei:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(ei.value)
    # CheckpointError is also a ValueError, so generic handlers still catch it.
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("bad_file", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_corrupt_json_names_file(tmp_path, raw_tokenizer, bad_file):
    path = _write_checkpoint(tmp_path / "c", raw_tokenizer, config=_qwen_config(raw_tokenizer),
                             generation={"eos_token_id": 1})
    (path / bad_file).write_text("{ this is not json", encoding="utf-8")
    with pytest.raises(CheckpointError) as ei:
        Tokenizer.from_dir(path)
    assert str(path / bad_file) in str(ei.value)


def test_bad_generation_eos_type_is_checkpoint_error(tmp_path, raw_tokenizer):
    path = _write_checkpoint(tmp_path / "c", raw_tokenizer, generation={"eos_token_id": "<|im_end|>"})
    with pytest.raises(CheckpointError, match="eos_token_id"):
        Tokenizer.from_dir(path)


@pytest.mark.parametrize("bad_file", ["tokenizer_config.json", "generation_config.json"])
@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"eos_token_id": ' + "7" * 5000 + "}"])
def test_hostile_json_is_checkpoint_error(tmp_path, raw_tokenizer, bad_file, text):
    """Deep nesting raised RecursionError and a 5000-digit int ValueError, past the JSON error handler."""
    path = _write_checkpoint(tmp_path / "c", raw_tokenizer, generation={"eos_token_id": 1})
    (path / bad_file).write_text(text, encoding="utf-8")
    with pytest.raises(CheckpointError, match=bad_file):
        Tokenizer.from_dir(path)


@pytest.mark.parametrize("eos", [2**31, 2**70, [1, -1]])
def test_generation_eos_ids_fit_int32(tmp_path, raw_tokenizer, eos):
    # Stop ids go to the core as int32; 2**70 used to pass and fail later in a C++ cast.
    path = _write_checkpoint(tmp_path / "c", raw_tokenizer, generation={"eos_token_id": eos})
    with pytest.raises(CheckpointError, match="eos_token_id"):
        Tokenizer.from_dir(path)


@pytest.mark.parametrize("config", [{"pad_token": "\ud800"}, {"added_tokens_decoder": {"5": None}},
                                    {"added_tokens_decoder": {"5": "\ud800x"}}, {"chat_template": "{{ '\ud800' }}"}])
def test_unusable_token_strings_are_checkpoint_errors(tmp_path, raw_tokenizer, config):
    """Found by tests/test_robustness_fuzz.py: a lone surrogate raised UnicodeEncodeError in the Rust
    lookup, a None added token TypeError."""
    path = _write_checkpoint(tmp_path / "c", raw_tokenizer, config=config)
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_dir(path)


def test_tokenizer_json_only(tmp_path, raw_tokenizer):
    t = Tokenizer.from_dir(_write_checkpoint(tmp_path / "bare", raw_tokenizer))
    assert t.chat_template is None and t.uses_default_chat_template
    assert t.stop_token_ids == []
    assert t.eos_token is None and t.bos_token_id is None
    # Special flags still come from tokenizer.json's added tokens.
    assert {raw_tokenizer.token_to_id(s) for s in SPECIALS} <= t.special_token_ids


def test_vocab_and_lookup(tok, raw_tokenizer):
    vocab = raw_tokenizer.get_vocab(with_added_tokens=True)
    assert tok.vocab_size == len(vocab) == max(vocab.values()) + 1
    assert len(tok) == tok.vocab_size
    for s in SPECIALS:
        i = tok.token_to_id(s)
        assert isinstance(i, int) and tok.id_to_token(i) == s
    assert tok.token_to_id("<|definitely-not-a-token|>") is None
    assert tok.id_to_token(tok.vocab_size + 10) is None


def test_stop_token_ids_order_and_dedup(tok):
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    # generation_config first ([eot, im_end]); tokenizer_config's eos (im_end) is already there.
    assert tok.stop_token_ids == [eot, im_end]
    assert tok.eos_token_id == im_end and tok.pad_token_id == eot


def test_stop_token_ids_int_form_then_config_eos(tmp_path, raw_tokenizer):
    eot, im_end = raw_tokenizer.token_to_id("<|endoftext|>"), raw_tokenizer.token_to_id("<|im_end|>")
    path = _write_checkpoint(tmp_path / "c", raw_tokenizer, config=_qwen_config(raw_tokenizer),
                             generation={"eos_token_id": eot, "bos_token_id": eot})
    t = Tokenizer.from_dir(path)
    assert t.stop_token_ids == [eot, im_end]
    # The returned list is a copy; callers can't corrupt the tokenizer's state.
    t.stop_token_ids.append(99)
    assert t.stop_token_ids == [eot, im_end]


def test_eos_token_as_added_token_dict(tmp_path, raw_tokenizer):
    cfg = _qwen_config(raw_tokenizer, eos_token={"__type": "AddedToken", "content": "<|endoftext|>", "special": True})
    t = Tokenizer.from_dir(_write_checkpoint(tmp_path / "c", raw_tokenizer, config=cfg))
    assert t.eos_token == "<|endoftext|>"
    assert t.stop_token_ids == [raw_tokenizer.token_to_id("<|endoftext|>")]


def test_chat_template_jinja_takes_precedence(tmp_path, raw_tokenizer):
    jinja = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    path = _write_checkpoint(tmp_path / "c", raw_tokenizer, config=_qwen_config(raw_tokenizer), jinja=jinja)
    t = Tokenizer.from_dir(path)
    assert t.chat_template == jinja
    assert t.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[user]x"


def test_list_style_chat_templates(tmp_path, raw_tokenizer):
    cfg = _qwen_config(raw_tokenizer, chat_template=[
        {"name": "default", "template": "D:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T:{{ tools[0].function.name }}"},
    ])
    t = Tokenizer.from_dir(_write_checkpoint(tmp_path / "c", raw_tokenizer, config=cfg))
    msgs = [{"role": "user", "content": "q"}]
    assert t.apply_chat_template(msgs, tokenize=False) == "D:q"
    assert t.apply_chat_template(msgs, tools=[WEATHER_TOOL], tokenize=False) == "T:get_weather"


def test_added_tokens_decoder_id_mismatch(tmp_path, raw_tokenizer):
    cfg = _qwen_config(raw_tokenizer)
    cfg["added_tokens_decoder"] = {"3": {"content": "<|im_end|>", "special": True}}
    assert raw_tokenizer.token_to_id("<|im_end|>") != 3
    with pytest.raises(CheckpointError, match="added_tokens_decoder"):
        Tokenizer.from_dir(_write_checkpoint(tmp_path / "c", raw_tokenizer, config=cfg))


def test_config_only_added_token_is_added(tmp_path, raw_tokenizer):
    n = raw_tokenizer.get_vocab_size(with_added_tokens=True)
    cfg = _qwen_config(raw_tokenizer)
    cfg["added_tokens_decoder"][str(n)] = {"content": "<|tool_marker|>", "special": True}
    t = Tokenizer.from_dir(_write_checkpoint(tmp_path / "c", raw_tokenizer, config=cfg))
    assert t.token_to_id("<|tool_marker|>") == n and t.vocab_size == n + 1
    assert n in t.special_token_ids
    assert t.encode("a<|tool_marker|>b").count(n) == 1


# ---------------------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    # NFC normalization is the only change a round trip may make.
    import unicodedata
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_special_tokens_in_text_and_skip(tok):
    text = "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n\nok<|endoftext|>"
    ids = tok.encode(text)
    for s in ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"]:
        assert tok.token_to_id(s) in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n\nhmm\n\n\nok"
    specials = {tok.token_to_id(s) for s in SPECIALS}
    assert specials <= tok.special_token_ids
    assert not (set(tok.encode("plain words only")) & tok.special_token_ids)


def test_add_bos_token(tmp_path, raw_tokenizer):
    eot = raw_tokenizer.token_to_id("<|endoftext|>")
    cfg = _qwen_config(raw_tokenizer, bos_token="<|endoftext|>", add_bos_token=True)
    t = Tokenizer.from_dir(_write_checkpoint(tmp_path / "bos", raw_tokenizer, config=cfg))
    plain = t.encode("hello")
    assert eot not in plain
    assert t.encode("hello", add_special_tokens=True) == [eot] + plain
    cfg["add_bos_token"] = False
    t2 = Tokenizer.from_dir(_write_checkpoint(tmp_path / "nobos", raw_tokenizer, config=cfg))
    assert t2.encode("hello", add_special_tokens=True) == plain


def test_decode_rejects_negative_ids(tok):
    with pytest.raises(ValueError):
        tok.decode([1, -2])
    with pytest.raises(ValueError):
        tok.stream_decoder().push(-1)


# ---------------------------------------------------------------------------------------- streaming


def _stream(tok, ids, skip=False):
    sd = tok.stream_decoder(skip_special_tokens=skip)
    pieces = [sd.push(i) for i in ids]
    return pieces, sd.flush()


def test_test_texts_actually_split_characters(tok):
    # Guard: the streaming tests only mean something if some tokens carry partial UTF-8 characters.
    split = [i for text in STREAM_TEXTS for i in tok.encode(text) if "\ufffd" in tok.decode([i])]
    assert len(split) > 10


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_matches_full_decode(tok, text):
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids)
    # Well-formed text is all emitted by push, except a literal trailing U+FFFD, which is
    # indistinguishable from a partial character until the next token or flush.
    assert tail == ("\ufffd" if text.endswith("\ufffd") else "")
    # No piece may carry a broken character; the only U+FFFD allowed are literal ones in the text.
    assert sum(p.count("\ufffd") for p in pieces) + tail.count("\ufffd") == text.count("\ufffd")
    for p in pieces:
        p.encode("utf-8")  # would fail on lone surrogates


def test_stream_holds_partial_characters(tok):
    # An emoji the tiny vocab cannot hold in one token: its first byte-tokens must yield "".
    text = "𓀀"
    ids = tok.encode(text)
    assert len(ids) > 1
    pieces, tail = _stream(tok, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == text and tail == ""


def test_stream_truncated_mid_character_flushes_replacement(tok):
    ids = tok.encode("ok 𓀀")
    cut = ids[:-1]  # drop the token that completes the character
    sd = tok.stream_decoder()
    pieces = [sd.push(i) for i in cut]
    assert "".join(pieces) == "ok "
    assert sd.pending > 0
    tail = sd.flush()
    assert tail.endswith("\ufffd")
    assert "".join(pieces) + tail == tok.decode(cut)
    # flush resets: the decoder is reusable.
    assert "".join(sd.push(i) for i in tok.encode("again")) + sd.flush() == "again"


@pytest.mark.parametrize("skip", [False, True])
def test_stream_with_special_tokens(tok, skip):
    text = "<|im_start|>assistant\n<think>\n思考 😀\n</think>\n\nDone é<|im_end|>\n<|endoftext|>"
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids, skip=skip)
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is (not skip)


def test_stream_long_sequence_bounded_window(tok, monkeypatch):
    text = "".join(STREAM_TEXTS) * 8
    ids = tok.encode(text)
    assert len(ids) > 2000
    longest = []
    original = tok._decode_ids

    def spy(window, skip):
        longest.append(len(window))
        return original(window, skip)

    monkeypatch.setattr(tok, "_decode_ids", spy)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == original(ids, False)
    # Each push decodes a few tokens of context, never the whole history.
    assert max(longest) <= 12


def test_stream_random_ids_match_decode(tok):
    # Arbitrary id sequences (stray UTF-8 fragments, specials, ids past the vocab) must still agree
    # with a full decode once flushed.
    import random
    rng = random.Random(1234)
    for _ in range(400):
        ids = [rng.randrange(tok.vocab_size + 3) for _ in range(rng.randrange(1, 40))]
        for skip in (False, True):
            pieces, tail = _stream(tok, ids, skip=skip)
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_stream_decoder_type(tok):
    assert isinstance(tok.stream_decoder(), StreamDecoder)


# ---------------------------------------------------------------------------------------- chat: basics


def test_default_chatml_fallback_exact():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(None, msgs) == expected
    assert render_chat(default_chatml_template(), msgs) == expected
    assert render_chat(None, msgs, add_generation_prompt=False) == expected[: -len("<|im_start|>assistant\n")]


def test_fallback_is_logged(caplog):
    import lily.chat as chat_mod
    chat_mod._fallback_logged = False
    with caplog.at_level(logging.WARNING, logger="lily.chat"):
        render_chat(None, [{"role": "user", "content": "x"}])
    assert any("ChatML" in r.getMessage() for r in caplog.records)


def test_fallback_refuses_tools():
    with pytest.raises(ChatTemplateError, match="tools"):
        render_chat(None, [{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])


def test_enable_thinking_generation_prompt():
    msgs = [{"role": "user", "content": "hi"}]
    off = render_chat(QWEN3_TEMPLATE, msgs, enable_thinking=False)
    on = render_chat(QWEN3_TEMPLATE, msgs, enable_thinking=True)
    default = render_chat(QWEN3_TEMPLATE, msgs)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n") and on == default
    assert render_chat("{{ enable_thinking is defined }}", msgs) == "False"
    assert render_chat("{{ enable_thinking }}", msgs, enable_thinking=False) == "False"


def test_list_content_parts_joined():
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]
    a = render_chat(QWEN3_TEMPLATE, [{"role": "user", "content": parts}])
    b = render_chat(QWEN3_TEMPLATE, [{"role": "user", "content": "Hello world"}])
    assert a == b and "Hello world" in a


def test_reasoning_aliases_and_none_keys():
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "r1", "name": None},
    ]
    out = render_chat(QWEN3_TEMPLATE, msgs, add_generation_prompt=False)
    assert out.endswith("<|im_start|>assistant\n<think>\nr1\n</think>\n\na<|im_end|>\n")
    assert render_chat("{{ messages[1].name is defined }}", msgs) == "False"
    # Assistant turns with only tool calls may carry content=None (OpenAI style).
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}
    out = render_chat(QWEN3_TEMPLATE, [{"role": "user", "content": "q"}, call], add_generation_prompt=False)
    assert out.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n')


def test_caller_messages_not_mutated():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "x"}]},
            {"role": "assistant", "content": "y", "thinking": "t"}]
    snapshot = json.dumps(msgs)
    render_chat(QWEN3_TEMPLATE, msgs)
    assert json.dumps(msgs) == snapshot


def test_special_tokens_and_extra_kwargs_reach_template():
    tpl = "{{ bos_token if bos_token is defined else '-' }}|{{ eos_token }}|{{ pad_token }}|{{ custom }}|{{ documents }}"
    out = render_chat(tpl, [{"role": "user", "content": "x"}], eos_token="</s>", pad_token="<pad>", custom=7)
    assert out == "-|</s>|<pad>|7|None"
    assert render_chat("{{ bos_token }}", [{"role": "user", "content": "x"}], bos_token="<s>") == "<s>"


# ---------------------------------------------------------------------------------------- chat: helpers


def test_tojson_hf_semantics():
    data = {"b": "<tag> & 'q' ünï 😀", "a": [1, 2.5, None, True]}
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat("{{ d | tojson }}", msgs, d=data) == json.dumps(data, ensure_ascii=False)
    assert render_chat("{{ d | tojson(indent=2) }}", msgs, d=data) == json.dumps(data, ensure_ascii=False, indent=2)
    assert render_chat("{{ d | tojson(sort_keys=true) }}", msgs, d=data) == json.dumps(
        data, ensure_ascii=False, sort_keys=True)
    assert render_chat("{{ d | tojson(ensure_ascii=true) }}", msgs, d=data) == json.dumps(data)
    assert render_chat("{{ d | tojson(separators=(',', ':')) }}", msgs, d=data) == json.dumps(
        data, ensure_ascii=False, separators=(",", ":"))


def test_strftime_now():
    before = datetime.now().strftime("%Y-%m-%d")
    out = render_chat("{{ strftime_now('%Y-%m-%d') }}", [{"role": "user", "content": "x"}])
    after = datetime.now().strftime("%Y-%m-%d")
    assert out in (before, after)


def test_raise_exception_and_template_errors():
    msgs = [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]
    with pytest.raises(ChatTemplateError, match="system message must be the first"):
        render_chat(QWEN3_TEMPLATE, msgs)
    with pytest.raises(ChatTemplateError, match="unknown role: narrator"):
        render_chat(QWEN3_TEMPLATE, [{"role": "narrator", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ undefined_thing.attr }}", [{"role": "user", "content": "x"}])


def test_loopcontrols_and_generation_tag():
    msgs = [{"role": "user", "content": c} for c in "abcd"]
    tpl = "{% for m in messages %}{% if m.content == 'c' %}{% break %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert render_chat(tpl, msgs) == "ab"


def test_sandbox_blocks_escapes_and_mutation():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__ }}", msgs)
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.append({'role': 'user', 'content': 'injected'}) }}", msgs)
    assert msgs == [{"role": "user", "content": "x"}]


# ---------------------------------------------------------------------------------------- chat: validation


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ("hello", "messages must be a list"),
        ([{"role": "user", "content": "a"}, "oops"], "messages[1] must be a dict"),
        ([{"content": "a"}], "messages[0].role"),
        ([{"role": 3, "content": "a"}], "messages[0].role"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1].content is missing"),
        ([{"role": "user", "content": None}], "messages[0].content is missing"),
        ([{"role": "user", "content": 42}], "messages[0].content must be"),
        ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}], "messages[0].content[1] must be a dict"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
        ([{"role": "assistant", "content": "a", "tool_calls": "nope"}], "messages[0].tool_calls"),
    ],
)
def test_message_validation(messages, fragment):
    with pytest.raises(ValueError) as ei:
        render_chat(QWEN3_TEMPLATE, messages)
    assert fragment in str(ei.value)
    assert not isinstance(ei.value, ChatTemplateError)


def test_tools_validation():
    with pytest.raises(ValueError, match="tools"):
        render_chat(QWEN3_TEMPLATE, [{"role": "user", "content": "x"}], tools=["get_weather"])


def test_validate_messages_normalizes():
    out = validate_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                              "name": None}])
    assert out == [{"role": "user", "content": "ab"}]


# ---------------------------------------------------------------------------------------- Tokenizer + chat


def test_apply_chat_template_tokenizes_rendering(tok):
    msgs = CONVERSATIONS["multi_turn_reasoning"]
    text = tok.apply_chat_template(msgs, enable_thinking=False, tokenize=False)
    assert text == render_chat(QWEN3_TEMPLATE, msgs, enable_thinking=False, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
    ids = tok.apply_chat_template(msgs, enable_thinking=False)
    assert ids == tok.encode(text)
    assert ids.count(tok.token_to_id("<|im_start|>")) == text.count("<|im_start|>") == 6
    assert tok.decode(ids) == text


# ---------------------------------------------------------------------------------------- transformers parity


@pytest.fixture
def hf_tok(ckpt):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(ckpt))


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("enable_thinking", [None, False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_render_matches_transformers(hf_tok, tok, name, enable_thinking, add_generation_prompt, with_tools):
    msgs = CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if with_tools else None
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ref = hf_tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                                     tokenize=False, **kw)
    ours = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                                   enable_thinking=enable_thinking, tokenize=False)
    assert ours == ref
    ref_ids = hf_tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=True, return_dict=False, **kw)
    assert tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                                   enable_thinking=enable_thinking) == list(ref_ids)


def test_list_content_matches_transformers_string(hf_tok, tok):
    parts = [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]
    ours = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    ref = hf_tok.apply_chat_template([{"role": "user", "content": "Part one. Part two."}],
                                     add_generation_prompt=True, tokenize=False)
    assert ours == ref


def test_tokenizer_matches_transformers(hf_tok, tok):
    assert tok.vocab_size == len(hf_tok)
    for text in STREAM_TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf_tok.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.eos_token_id == hf_tok.eos_token_id
    assert tok.chat_template == hf_tok.chat_template
