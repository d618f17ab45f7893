"""mlx-lm shaped conveniences: ``lily.load``, ``lily.generate``, ``lily.stream_generate``.

Code written for ``from mlx_lm import load, generate, stream_generate`` ports by changing the import::

    model, tokenizer = lily.load()                 # (Engine, Tokenizer)
    text = lily.generate(model, tokenizer, "def f(x):", max_tokens=32, verbose=True)
    for r in lily.stream_generate(model, tokenizer, "def f(x):", max_tokens=32):
        print(r.text, end="")

Sampling options map to :class:`lily.SamplingParams` (``temp`` is ``temperature``; ``top_p=0`` means
off, as in mlx-lm's ``make_sampler``); ``sampler=`` takes a SamplingParams. ``stop=`` adds stop strings.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from .progress import check_progress
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine
    from .streaming import GenerationResponse
    from .tokenizer import Tokenizer

__all__ = ["load", "generate", "stream_generate"]

_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed")


def load(path_or_hf_repo: str | os.PathLike | None = None, *, revision: str | None = None,
         backend: str = "cpu", threads: int | None = None, prefill_chunk: int | None = None,
         kv_cache_dtype: str = "f32", progress: bool | None = None,
         lm_head: str = "auto") -> tuple["Engine", "Tokenizer"]:
    """Load a model like ``mlx_lm.load``: returns ``(engine, engine.tokenizer)``.

    ``path_or_hf_repo``: a folder, a Hugging Face repo id, or None for the packaged lily-tiny. The other
    options are :meth:`lily.Engine.from_pretrained`'s. Raises CheckpointError (also when the checkpoint
    has no tokenizer.json: generation from text needs one).
    """
    from .engine import Engine
    from .errors import CheckpointError

    engine = Engine.from_pretrained(path_or_hf_repo, revision=revision, backend=backend, threads=threads,
                                    prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype, progress=progress,
                                    lm_head=lm_head)
    if engine.tokenizer is None:
        raise CheckpointError(f"lily.load: checkpoint '{engine.checkpoint.path}' has no tokenizer.json")
    return engine, engine.tokenizer


def _sampling(where: str, kwargs: dict[str, Any]) -> SamplingParams | None:
    sampler = kwargs.pop("sampler", None)
    if "temp" in kwargs:
        if "temperature" in kwargs:
            raise TypeError(f"{where}: pass temp or temperature, not both")
        kwargs["temperature"] = kwargs.pop("temp")
    if kwargs.get("top_p") == 0:
        kwargs["top_p"] = 1.0  # mlx-lm's make_sampler: 0 disables top-p
    fields = {k: kwargs.pop(k) for k in _SAMPLING_KEYS if k in kwargs}
    if sampler is not None:
        if not isinstance(sampler, SamplingParams):
            raise TypeError(f"{where}: sampler must be a lily.SamplingParams (mlx-lm sampler callables do not "
                            f"run in Lily's C++ loop), got {sampler!r}")
        if fields:
            raise TypeError(f"{where}: pass sampler= or sampling options ({', '.join(fields)}), not both")
        return sampler
    return SamplingParams(**fields) if fields else None


def stream_generate(model: "Engine", tokenizer: "Tokenizer | None", prompt: str | Iterable[int],
                    max_tokens: int = 256, **kwargs: Any) -> Iterator["GenerationResponse"]:
    """Yield a :class:`lily.GenerationResponse` per generated token, like ``mlx_lm.stream_generate``.

    ``model``: a :class:`lily.Engine`; ``tokenizer``: the one :func:`load` returned (or None).
    ``prompt``: text or token ids. Keyword options: ``sampler`` (SamplingParams) or the sampling fields
    (``temp``/``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
    ``presence_penalty``, ``frequency_penalty``, ``seed``), ``stop`` (stop strings), ``stop_token_ids``,
    ``prefill_step_size`` (the prefill chunk), ``prompt_progress_callback(done, total)``.
    Raises TypeError for any other option (naming it), ValueError for bad values.
    """
    from .engine import Engine

    where = "lily.stream_generate"
    if not isinstance(model, Engine):
        raise TypeError(f"{where}: model must be a lily.Engine (from lily.load), got {type(model).__name__}")
    if tokenizer is not None and tokenizer is not model.tokenizer:
        raise ValueError(f"{where}: tokenizer must be the one lily.load returned with this model (or None)")
    kwargs = dict(kwargs)
    sampling = _sampling(where, kwargs)
    stop = kwargs.pop("stop", None)
    stop_token_ids = kwargs.pop("stop_token_ids", None)
    chunk = kwargs.pop("prefill_step_size", None)
    progress = kwargs.pop("prompt_progress_callback", None)
    if kwargs:
        raise TypeError(f"{where}: unsupported option(s) {', '.join(map(repr, kwargs))}")
    check_progress(progress, where)
    session = model._prompt_session(prompt, max_tokens, where, sampling=sampling, stop=stop, progress=progress,
                                    prefill_chunk=chunk)
    return session.stream(max_tokens, sampling, stop=stop, stop_token_ids=stop_token_ids)


def generate(model: "Engine", tokenizer: "Tokenizer | None", prompt: str | Iterable[int],
             verbose: bool = False, **kwargs: Any) -> str:
    """The whole completion as text, like ``mlx_lm.generate``; options as :func:`stream_generate`
    (``max_tokens`` included). ``verbose=True`` prints the text as it streams, then prompt and
    generation tokens/s and peak memory."""
    text = []
    last = None
    if verbose:
        print("=" * 10)
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(last.text, end="", flush=True)
        text.append(last.text)
    if verbose:
        print()
        print("=" * 10)
        if last is None:
            print("No text generated for this prompt")
        else:
            print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
            print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
            print(f"Peak memory: {last.peak_memory:.3f} GB")
    return "".join(text)
