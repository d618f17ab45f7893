"""A long text that starts like a recently encoded one reuses that one's ids up to a shared added-token boundary
(lily.tokenizer._PrefixReuse): a chat prompt resent every turn, encoded twice by the server, costs the encoding of
its new part only. The ids must be exactly those of encoding the whole text; every test compares against the
`tokenizers` library's own encode of the full text, over related texts built to stress the cut: shared prefixes
ending inside a special token, inside a multi-byte or combining sequence, at whitespace, special-token strings
inside message content, and added tokens that could take a boundary token's characters."""

import random

import pytest
import tokenizers

import lily
from lily.tokenizer import _REUSE_MIN_CHARS, Tokenizer


@pytest.fixture(scope="module")
def tok():
    return lily.Engine.from_pretrained(backend="cpu").tokenizer


def full(tok, text):
    return tok._tok.encode(text, add_special_tokens=False).ids


PIECES = ["def main():\n", "    return 0\n", "héllo wörld ", "e\u0301", "\u00e9", "日本語のテキスト", "  \n\n", "\t",
          "<|im_end|>", "<|im_start|>user\n", "<think>", "</think>", "<|endoftext|>", "<|im_", "|>", "'s ", "123 456",
          "🙂", "\r\n", "x" * 50, " <|im_end|> ", "<<|im_end|>>", "<|im_end|><|im_start|>"]


def random_text(rng, n):
    return "".join(rng.choice(PIECES) for _ in range(n))


def test_a_conversation_resent_each_turn_reuses_and_matches(tok):
    msgs = [{"role": "system", "content": "You are a coding agent. " * 200}]
    reused = tok._reuse.stats()["reused"]
    for turn in range(6):
        msgs.append({"role": "user", "content": f"question {turn}: " + "why? " * turn})
        for gen in (True, False):  # as the server: the prompt, and the conversation without the generation prompt
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert len(text) >= _REUSE_MIN_CHARS
            assert tok.encode(text) == full(tok, text)
        msgs.append({"role": "assistant", "content": f"answer {turn} <think>no</think> done"})
    assert tok._reuse.stats()["reused"] >= reused + 10  # every encode after the first reused a recent one


@pytest.mark.parametrize("seed", range(12))
def test_related_random_texts_match_the_full_encode(tok, seed):
    """Texts that share random-length prefixes with earlier ones (cut anywhere: inside a special token, between
    a letter and its combining accent, inside a surrogate-free multi-byte run), each encoded through the reuse
    path, equal the library's encode of the whole text."""
    rng = random.Random(seed)
    base = random_text(rng, 400)
    texts = [base]
    for _ in range(25):
        src = rng.choice(texts)
        cut = rng.randrange(len(src) + 1)
        texts.append(src[:cut] + random_text(rng, rng.randrange(0, 60)))
    for text in texts:
        got = tok.encode(text)
        assert got == full(tok, text), (len(text), text[-80:])


@pytest.fixture(scope="module")
def overlapping():
    """lily-tiny's tokenizer plus added tokens that contain <|im_end|> or end with a prefix of <|im_start|>."""
    base = lily.Engine.from_pretrained(backend="cpu").tokenizer._tok
    t = tokenizers.Tokenizer.from_str(base.to_str())
    t.add_special_tokens(["ab<|im_end|>", "zz<|im_st"])
    return t


def test_boundary_tokens_exclude_ones_another_added_token_could_take(overlapping):
    """An added token containing a special token, or ending with a prefix of it, could be matched across the
    cut: that special token is then no boundary."""
    tk = Tokenizer(overlapping)
    assert "<|im_end|>" not in tk._reuse.bounds and "<|im_start|>" not in tk._reuse.bounds
    assert "<|endoftext|>" in tk._reuse.bounds


def test_reuse_stays_exact_beside_overlapping_added_tokens(overlapping):
    """Texts where those tokens take a special token's characters: exact (the exclusion above, and behind it the
    check that a text's boundary strings and boundary ids line up, each keep it so)."""
    t = overlapping
    tk = Tokenizer(t)
    rng = random.Random(5)
    texts = [("ab<|im_end|> zz<|im_start|>" + random_text(rng, 300)) for _ in range(2)]
    texts += [texts[0][:len(texts[0]) // 2] + "<|endoftext|>" + random_text(rng, 200) for _ in range(3)]
    for text in texts + [x[:-7] + "ab<|im_end|>" for x in texts]:
        assert tk.encode(text) == t.encode(text, add_special_tokens=False).ids


def test_short_texts_and_special_token_adding_bypass_it(tok):
    before = tok._reuse.stats()["encodes"]
    tok.encode("short text <|im_end|>")
    long = "word " * (_REUSE_MIN_CHARS // 4)
    tok.encode(long, add_special_tokens=True)
    assert tok._reuse.stats()["encodes"] == before
    assert tok.encode(long) == full(tok, long) and tok._reuse.stats()["encodes"] == before + 1
