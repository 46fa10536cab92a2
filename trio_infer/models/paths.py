"""Which file or folder a ``--model`` setting means. Torch-free: the front end resolves the model
to load its tokenizer, and must not pay for the engine's imports to do so."""

from __future__ import annotations

from pathlib import Path

from trio_infer.models.default_model import DEFAULT_MODEL_NAME, require_default_model
from trio_infer.models.embedded import TINY_MODEL_NAME, ensure_tiny_model


class GGUFError(ValueError):
    """A GGUF file that cannot be served: unreadable, or a model or tensor type not supported."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` stands for, or None if it is not a GGUF checkpoint.

    A ``.gguf`` file is itself; a folder without ``config.json`` that holds exactly one ``.gguf``
    is that file (several are an error: which one is meant is not ours to guess). A Hugging Face
    folder (with ``config.json``) is never taken for a GGUF one, even if a ``.gguf`` lies in it.
    """
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(files) > 1:
        raise GGUFError(
            f"{path} holds {len(files)} GGUF files ({', '.join(p.name for p in files)}); "
            f"pass the path of the one to serve"
        )
    return files[0] if files else None




def resolve_model_path(name_or_path: str | None, cache_dir: Path) -> Path:
    """Turn the ``--model`` setting into a checkpoint folder or GGUF file.

    ``None`` (or ``smollm2-135m-instruct``) -> the default model's GGUF file in
    ``cache_dir/models`` (fetched by ``make venv``; a clear error if absent); ``trio-infer-tiny``
    -> the tiny random model, built into ``cache_dir`` on first use; a ``.gguf`` file -> itself; a
    folder without ``config.json`` holding exactly one ``.gguf`` -> that file; any other existing
    folder -> itself; anything else is taken as a hub id and looked up in the local Hugging Face
    cache only.
    """
    if name_or_path is None or name_or_path == DEFAULT_MODEL_NAME:
        return require_default_model(cache_dir)
    path = Path(name_or_path).expanduser()
    if path.exists():
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return gguf_file
        if path.is_dir():
            return path
        raise ValueError(f"{path} is neither a checkpoint folder nor a .gguf file")
    if name_or_path == TINY_MODEL_NAME:
        return ensure_tiny_model(cache_dir)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception as exc:  # not cached, or not even a valid repo id
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a folder nor a hub id in the local Hugging Face "
            f"cache. This server never downloads: fetch it first (e.g. `hf download "
            f"{name_or_path}`) or pass the path of a checkpoint folder."
        ) from exc


