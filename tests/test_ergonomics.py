"""Library ergonomics on lily-tiny: reprs and HTML views, progress bars, the mlx-lm shaped API, py.typed."""

import importlib.resources
import inspect

import numpy as np
import pytest

import lily
from lily.engine import Report

PROMPT = "import os\nimport sys\n\n\ndef main():\n"


@pytest.fixture(scope="module")
def eng():
    return lily.Engine.from_pretrained(prefill_chunk=16)


def test_engine_and_session_reprs(eng):
    r = repr(eng)
    core = eng._core.report()
    for part in ("lily-tiny", "format='mlx'", "q4g64", "router q8g64", f"backend='{core['backend']}'",
                 core["device"], "MiB"):
        assert part in r, (part, r)
    s = eng.session(max_context=128)
    s.prefill(eng.tokenize(PROMPT))
    text = repr(s)
    assert f"position={s.position}" in text and "max_context=128" in text and "backend='cpu'" in text
    assert f"{s.state_bytes / 2**20:.1f} MiB" in text
    html = s._repr_html_()
    assert "<table" in html and f"<td style='padding:1px 8px;text-align:left'>{s.position}</td>" in html
    assert "lily-tiny" in eng._repr_html_()


def test_report_renders_as_text_table_and_escaped_html(eng):
    rep = eng.report()
    html = rep._repr_html_()
    for key in rep:
        assert f">{key}</th>" in html
    assert "bytes" in html and "MiB)" in html  # byte counts also shown in binary units
    odd = Report({"a<b": "<script>", "nested": {"list": ["x&y"]}})
    h = odd._repr_html_()
    assert "<script>" not in h and "&lt;script&gt;" in h and "a&lt;b" in h and "x&amp;y" in h

    class P:
        def __init__(self):
            self.out = ""

        def text(self, t):
            self.out += t

    p = P()
    rep._repr_pretty_(p, False)
    assert p.out == str(rep) == repr(rep) and "backend: cpu" in p.out


def test_prefill_progress_bar_and_errors(eng, capsys):
    ids = eng.tokenize(PROMPT * 4)
    s = eng.session(max_context=256)
    s.prefill(ids, progress=True)
    err = capsys.readouterr().err
    assert "prefill" in err and f"{len(ids)}/{len(ids)}" in err
    assert s.position == len(ids)
    with pytest.raises(TypeError, match="Session.prefill: progress"):
        s.prefill([1], progress=5)
    assert s.position == len(ids)  # nothing ran
    s.prefill([1, 2], progress=False)
    assert s.position == len(ids) + 2 and capsys.readouterr().err == ""


def test_from_pretrained_progress_bar(capsys):
    e = lily.Engine.from_pretrained(progress=True)
    err = capsys.readouterr().err
    assert "loading lily-tiny" in err and "100%" in err
    assert e.tokenizer is not None
    with pytest.raises(TypeError, match="Engine.from_pretrained: progress"):
        lily.Engine.from_pretrained(progress=lambda done, total: None)


def test_load_generate_stream_generate_like_mlx_lm(eng, capsys):
    model, tokenizer = lily.load()
    assert isinstance(model, lily.Engine) and tokenizer is model.tokenizer
    expect = eng.generate(PROMPT, 16)
    assert lily.generate(model, tokenizer, PROMPT, max_tokens=16) == expect
    responses = list(lily.stream_generate(model, tokenizer, PROMPT, max_tokens=16))
    assert "".join(r.text for r in responses) == expect
    assert isinstance(responses[0], lily.GenerationResponse) and responses[-1].generation_tokens == len(responses)
    # mlx-lm's field names
    fields = {"text", "token", "prompt_tokens", "prompt_tps", "generation_tokens", "generation_tps",
              "peak_memory", "finish_reason"}
    assert all(hasattr(responses[-1], f) for f in fields)
    # Sampling options map to SamplingParams (temp is temperature; top_p=0 is off as in mlx-lm).
    sp = lily.SamplingParams(temperature=0.9, top_k=20, seed=5)
    want = eng.generate(PROMPT, 16, sp)
    assert lily.generate(model, tokenizer, PROMPT, max_tokens=16, temp=0.9, top_k=20, seed=5, top_p=0.0) == want
    assert lily.generate(model, None, PROMPT, max_tokens=16, sampler=sp) == want
    capsys.readouterr()
    text = lily.generate(model, tokenizer, PROMPT, max_tokens=8, verbose=True, prefill_step_size=4)
    out = capsys.readouterr().out
    assert text in out and "Prompt:" in out and "Generation: 8 tokens" in out and "Peak memory:" in out
    calls = []
    list(lily.stream_generate(model, tokenizer, PROMPT * 3, max_tokens=1, prefill_step_size=8,
                              prompt_progress_callback=lambda d, t: calls.append((d, t))))
    n = len(eng.tokenize(PROMPT * 3))
    assert calls[-1] == (n, n) and len(calls) == (n + 7) // 8


def test_api_rejects_unknown_options_by_name(eng):
    model, tokenizer = lily.load()
    with pytest.raises(TypeError, match="kv_bits"):
        lily.generate(model, tokenizer, PROMPT, kv_bits=4)
    with pytest.raises(TypeError, match="temp or temperature"):
        lily.generate(model, tokenizer, PROMPT, temp=0.5, temperature=0.5)
    with pytest.raises(TypeError, match="sampler"):
        lily.generate(model, tokenizer, PROMPT, sampler=lambda logits: 0)
    with pytest.raises(ValueError, match="tokenizer"):
        lily.generate(model, eng.tokenizer, PROMPT)
    with pytest.raises(TypeError, match="model"):
        lily.generate("not an engine", tokenizer, PROMPT)
    with pytest.raises(ValueError, match="max_tokens"):
        lily.generate(model, tokenizer, PROMPT, max_tokens=-1)


def test_public_api_is_annotated_and_typed_marker_is_installed():
    assert importlib.resources.files("lily").joinpath("py.typed").is_file()
    for fn in (lily.load, lily.generate, lily.stream_generate, lily.Engine.stream, lily.Session.stream,
               lily.Session.prefill, lily.Engine.from_pretrained):
        sig = inspect.signature(fn)
        assert sig.return_annotation is not inspect.Signature.empty, fn
        assert all(p.annotation is not inspect.Parameter.empty for name, p in sig.parameters.items()
                   if name not in ("self", "cls") and p.kind not in (p.VAR_KEYWORD,)), fn


def test_stream_logprobs_are_the_models_distribution_at_each_step():
    # mtp="off": the twin below decodes plainly, and a speculative verify forward (which mtp="auto" may choose
    # when its cost measurement on a loaded machine says drafting pays) gives the same distribution only to
    # fp32 rounding, not to the 1e-9 this test asks.
    e = lily.Engine.from_pretrained(mtp="off")
    ids = e.tokenize("def read_lines(path):")
    s = e.session(max_context=128)
    s.prefill(ids)
    rs = list(s.stream(12, lily.SamplingParams(temperature=0.9, seed=5), logprobs=4, stop_token_ids=[]))
    twin = e.session(max_context=128)
    logits = twin.prefill(ids)
    for r in rs:
        x = logits.astype(np.float64)
        lsm = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        assert r.logprob == pytest.approx(lsm[r.token], abs=1e-9)
        top = np.lexsort((np.arange(x.size), -x))[:4]
        assert [t for t, _ in r.top_logprobs] == top.tolist()
        assert [lp for _, lp in r.top_logprobs] == pytest.approx(lsm[top].tolist(), abs=1e-9)
        logits = twin.step(r.token)
    s2 = e.session(max_context=64)
    s2.prefill(ids)
    r0 = next(iter(s2.stream(3, stop_token_ids=[])))
    assert r0.logprob is None and r0.top_logprobs == ()
    with pytest.raises(ValueError, match="logprobs"):
        s2.stream(3, logprobs=-1)
