"""lily.prefix_cache: warm prefills give a cold run's tokens; longest-prefix lookup; the byte budget (LRU)."""

import numpy as np
import pytest

import lily
from lily.prefix_cache import PrefixCache


@pytest.fixture(scope="module")
def engine():
    with lily.Engine.from_pretrained() as e:
        yield e


def greedy(session, n=24):
    return list(session.generate(n, lily.SamplingParams(), stop_token_ids=[]))


def cold(engine, ids, n=24):
    s = engine.session(max_context=len(ids) + n)
    logits = s.prefill(ids)
    out = greedy(s, n)
    s.close()
    return logits, out


def test_warm_turns_match_a_cold_run(engine):
    cache = PrefixCache(engine, max_bytes=64 << 20)
    messages = [{"role": "user", "content": "def read_lines(path):"}]
    shared = 0  # the previous turn's conversation before its generation prompt
    for turn in range(3):
        ids = engine.apply_chat_template(messages)
        base = engine.apply_chat_template(messages, add_generation_prompt=False)
        s = engine.session(max_context=len(ids) + 24)
        cached = cache.prefill(s, ids, checkpoints=[len(base)])
        warm_logits = s.logits
        out = greedy(s)
        cold_logits, cold_out = cold(engine, ids)
        assert out == cold_out  # exactly the tokens of a cold run
        np.testing.assert_allclose(warm_logits, cold_logits, rtol=1e-4, atol=1e-4)
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= shared > 0  # at least the previous turn's conversation came from the cache
        assert cache.store(s, ids + out)  # the end of the generation
        s.close()
        messages += [{"role": "assistant", "content": engine.detokenize(out, skip_special_tokens=True)},
                     {"role": "user", "content": f"and turn {turn}?"}]
        shared = len(base)
    st = cache.stats()
    assert st["hits"] == 2 and st["misses"] == 1 and st["tokens_saved"] > 0 and st["entries"] >= 3


def test_longest_prefix_and_lru_budget(engine):
    ids = engine.tokenize("import os\nimport sys\nimport json\nimport time\nimport math\n")
    assert len(ids) > 12
    s = engine.session(max_context=64)
    s.prefill(ids[:4])
    probe = s.snapshot().nbytes
    cache = PrefixCache(engine, max_bytes=int(probe * 2.5))  # room for two checkpoints of this size
    assert cache.store(s, ids[:4])
    assert not cache.store(s, ids[:4])  # already there
    assert not cache.store(s, ids[:5])  # the session is not at that context
    s.prefill(ids[4:8])
    assert cache.store(s, ids[:8])
    assert cache.lookup(ids)[0] == 8  # the longest one
    assert cache.lookup(ids[:8])[0] == 4  # never the whole prompt: its last token is always prefilled
    assert cache.lookup(engine.tokenize("class X:"))[0] == 0
    cache.lookup(ids[:6])  # touches the 4-token entry: now the 8-token one is least recently used
    s.prefill(ids[8:10])
    assert cache.store(s, ids[:10])
    st = cache.stats()
    assert st["entries"] == 2 and st["evictions"] == 1 and st["bytes"] <= st["max_bytes"]
    assert cache.lookup(ids)[0] == 10 and cache.lookup(ids[:9])[0] == 4  # 8 was evicted
    # a restored prefix continues exactly like the session it was taken from
    n, snap = cache.lookup(ids)
    t = engine.session(max_context=64)
    t.restore(snap)
    assert t.tokens == s.tokens and greedy(t, 8) == greedy(s, 8)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(engine, max_bytes=-1)
    assert not PrefixCache(engine, max_bytes=10).store(t, t.tokens)  # larger than the whole budget
