"""Resolve a model name to a local folder: a local path, or a Hugging Face Hub repo (downloaded or cached)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError

__all__ = ["resolve_model_path", "ALLOW_PATTERNS"]

ALLOW_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
]


def _truthy(v: str | None) -> bool:
    return (v or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _looks_like_path(name: str) -> bool:
    # A Hub id is "name" or "org/name"; anything else that does not exist locally was meant as a path.
    return (
        name in (".", "..")
        or name.startswith(("/", "./", "../", "~"))
        or "\\" in name
        or name.count("/") > 1
    )


def resolve_model_path(name_or_path: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder holding config.json, or the snapshot folder of Hub repo ``name_or_path``.

    Hub look-ups go through ``huggingface_hub.snapshot_download`` (it uses the local cache and honours
    HF_HUB_OFFLINE). The environment is read at call time, so HF_HUB_CACHE / HF_HUB_OFFLINE set after
    huggingface_hub was imported still apply.
    """
    name = os.fspath(name_or_path)
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"'{p}' is a file; expected a model folder with config.json")
        if not (p / "config.json").is_file():
            raise CheckpointError(f"model folder '{p}' has no config.json")
        return p
    if _looks_like_path(name):
        raise CheckpointError(f"model folder '{p}' does not exist")

    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise CheckpointError(f"'{name}' is not a local folder and huggingface_hub is not installed") from e

    offline = _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        folder = snapshot_download(
            repo_id=name,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            cache_dir=cache_dir,
            local_files_only=offline,
        )
    except Exception as e:  # huggingface_hub raises many kinds (validation, HTTP, offline, cache)
        kind = type(e).__name__
        rev = f" (revision '{revision}')" if revision else ""
        if offline or kind in ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "IncompleteSnapshotError"):
            msg = (
                f"'{name}'{rev} is not a local folder and not in the Hugging Face cache (offline): {kind}: {e}"
            )
        elif kind == "HFValidationError":
            msg = f"'{name}' is neither a local folder nor a valid Hugging Face repo id: {e}"
        elif kind in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
            msg = f"'{name}'{rev} is not a local folder and the Hub refused it: {kind}: {e}"
        else:
            msg = f"'{name}'{rev} is not a local folder and could not be fetched from the Hub: {kind}: {e}"
        raise CheckpointError(msg) from e
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"Hub snapshot '{path}' of '{name}'{' @ ' + revision if revision else ''} has no config.json")
    return path
