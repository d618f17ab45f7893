"""Lily: a local inference engine for Qwen3.6-35B-A3B (qwen3_5_moe).

    import lily
    engine = lily.Engine.from_pretrained()          # packaged demo model, or a path / Hub repo id
    print(engine.generate("Once upon a time", max_tokens=32))

    model, tokenizer = lily.load()                  # mlx-lm style: lily.generate / lily.stream_generate
"""

from .errors import (BackendError, ChatTemplateError, CheckpointError, ContextOverflowError, LilyError,
                     SessionBusyError)
from .api import generate, load, stream_generate
from .sampling import SamplingParams
from .streaming import GenerationResponse

__version__ = "0.1.0"


def __getattr__(name: str):
    # The compiled engine loads on first use, so the pure-Python modules (tokenizer, chat, checkpoint,
    # convert) stay importable where the extension is not built.
    if name in ("Engine", "Report"):
        from . import engine

        return getattr(engine, name)
    if name in ("Session", "Snapshot"):
        from . import session

        return getattr(session, name)
    raise AttributeError(f"module 'lily' has no attribute {name!r}")


__all__ = ["Engine", "Session", "Snapshot", "SamplingParams", "GenerationResponse", "load", "generate",
           "stream_generate", "LilyError", "CheckpointError",
           "ContextOverflowError", "ChatTemplateError", "SessionBusyError", "BackendError", "__version__"]
