"""The served model's tokenizer, loaded without torch; the front end's without transformers too.

``AutoTokenizer`` imports transformers' model configuration code, and that imports torch: 300 MB
of a front end's memory for a class lookup. The tokenizers we save and load (a GGUF file's,
converted once into ``cache_dir/tokenizers``, and the fake model's) name their class,
``TokenizersBackend`` (transformers' fast tokenizer over the ``tokenizers`` library), in their
``tokenizer_config.json``; that class is loaded directly, with exactly what ``AutoTokenizer``
would have built, and without torch. Any other checkpoint goes through ``AutoTokenizer``.

The two processes want different things of it. The worker needs transformers' own tokenizer
(llguidance builds grammars from it): :func:`build_tokenizer`. The front end only encodes,
decodes and renders chat templates, and importing transformers for that costs it ~45 MB: its
:func:`build_served_tokenizer` gets a :class:`~trio_infer.runtime.thin_tokenizer.ThinTokenizer`
(the ``tokenizers`` library and jinja2 alone) for a saved ``TokenizersBackend`` folder, and
transformers' class for any folder the thin one does not reproduce exactly.
:func:`load_saved_tokenizer` is the one place that decides.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from trio_infer.runtime.tokenizer_cache import cache_key, load_gguf_tokenizer, store
from trio_infer.settings import Settings

log = logging.getLogger(__name__)

FAKE_MODEL = "fake"


def build_served_tokenizer(settings: Settings) -> Any:
    """The front end's tokenizer of the model the settings name: :func:`build_tokenizer`'s, thin
    where it can be (no transformers import)."""
    return build_tokenizer(settings, thin=True)


def build_tokenizer(settings: Settings, *, thin: bool = False) -> Any:
    """The tokenizer of the model the settings name (the worker's, for the grammars of its first
    constrained request and the fake model's vocabulary; ``thin``: the front end's). A GGUF
    file's is converted once and then read from ``cache_dir/tokenizers``
    (runtime/tokenizer_cache.py)."""
    if settings.model == FAKE_MODEL:
        tok_dir = settings.cache_dir / "fake-tokenizer"
        if not tok_dir.is_dir():  # trained once, stored whole (several processes may race)
            from trio_infer.models.synthetic import build_tokenizer as build_fake_tokenizer

            store(tok_dir, build_fake_tokenizer)
        return load_saved_tokenizer(tok_dir, thin=thin)
    from trio_infer.models.paths import find_gguf, resolve_model_path

    path = resolve_model_path(settings.model, settings.cache_dir)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return load_gguf_tokenizer_cached(gguf_file, settings.cache_dir, thin=thin)
    return load_saved_tokenizer(path, thin=thin)


def load_saved_tokenizer(folder: str | Path, *, thin: bool = False) -> Any:
    """A tokenizer saved in ``folder`` (``save_pretrained``, or a Hugging Face checkpoint), as
    ``AutoTokenizer.from_pretrained`` loads it; without torch when the folder names the class.
    ``thin``: a :class:`ThinTokenizer` (without transformers) when it reproduces the folder."""
    if thin:
        from trio_infer.runtime.thin_tokenizer import ThinTokenizer, UnsupportedTokenizer

        try:
            return ThinTokenizer.load(folder)
        except UnsupportedTokenizer as exc:
            log.info("the tokenizer in %s is loaded with transformers: %s", folder, exc)
    try:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("tokenizer_class") == "TokenizersBackend":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def load_gguf_tokenizer_cached(gguf_file: Path, cache_dir: Path, *, thin: bool = False) -> Any:
    """The tokenizer of ``gguf_file``, from ``cache_dir`` (its ``tokenizers`` folder) when it was
    converted before, else converted now and stored there (``thin``: see
    :func:`load_saved_tokenizer`)."""
    entry = cache_dir / "tokenizers" / cache_key(gguf_file)
    if not entry.is_dir():
        log.info("converting the tokenizer of %s (cached for later starts in %s)", gguf_file, entry)
        tokenizer = load_gguf_tokenizer(gguf_file)
        try:
            store(entry, tokenizer.save_pretrained)
        except OSError as exc:  # a read-only cache: serve anyway, convert again next time
            log.warning("could not cache the tokenizer in %s: %s", entry, exc)
            return tokenizer
    return load_saved_tokenizer(entry, thin=thin)
