"""The served model's tokenizer, loaded without torch (the front end's, and the worker's too).

``AutoTokenizer`` imports transformers' model configuration code, and that imports torch: 300 MB
of a front end's memory for a class lookup. The tokenizers we save and load (a GGUF file's,
converted once into ``cache_dir/tokenizers``, and the fake model's) name their class,
``TokenizersBackend`` (transformers' fast tokenizer over the ``tokenizers`` library), in their
``tokenizer_config.json``; that class is loaded directly, with exactly what ``AutoTokenizer``
would have built, and without torch. Any other checkpoint goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trio_infer.settings import Settings

FAKE_MODEL = "fake"


def build_tokenizer(settings: Settings) -> Any:
    """The tokenizer of the model the settings name (the front end needs it; the worker for the
    grammars of its first constrained request, and for the fake model's vocabulary). A GGUF
    file's is converted once and then read from ``cache_dir/tokenizers``
    (runtime/tokenizer_cache.py)."""
    from trio_infer.runtime.tokenizer_cache import load_gguf_tokenizer_cached, store

    if settings.model == FAKE_MODEL:
        tok_dir = settings.cache_dir / "fake-tokenizer"
        if not tok_dir.is_dir():  # trained once, stored whole (several processes may race)
            from trio_infer.models.synthetic import build_tokenizer as build_fake_tokenizer

            store(tok_dir, build_fake_tokenizer)
        return load_saved_tokenizer(tok_dir)
    from trio_infer.models.paths import find_gguf, resolve_model_path

    path = resolve_model_path(settings.model, settings.cache_dir)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return load_gguf_tokenizer_cached(gguf_file, settings.cache_dir)
    return load_saved_tokenizer(path)


def load_saved_tokenizer(folder: str | Path) -> Any:
    """A tokenizer saved in ``folder`` (``save_pretrained``, or a Hugging Face checkpoint), as
    ``AutoTokenizer.from_pretrained`` loads it; without torch when the folder names the class."""
    try:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("tokenizer_class") == "TokenizersBackend":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
