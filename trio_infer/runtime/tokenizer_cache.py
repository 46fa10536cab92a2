"""The tokenizer of a GGUF file, converted once and cached on disk.

transformers builds a GGUF file's tokenizer from its ``tokenizer.ggml.*`` metadata in Python:
about 5 s for SmolLM2's 49k-token vocabulary on a 2-core machine, paid at every start by the front
end and again by the batching worker (it needs the tokenizer for grammars). The converted
tokenizer is saved once (``save_pretrained``: ``tokenizer.json``, its config and the chat
template) under ``<cache_dir>/tokenizers/<key>`` and loaded from there afterwards (~0.2 s).

The key is a content hash (blake2b) of what the tokenizer is made from, the file's header and
key/value metadata (``models/gguf_header.py`` finds where they end without decoding them: ~3 MB
and ~30 ms for the default model, whatever the size of the weights that follow), and the
transformers version that converted it. Hashing the whole file took 0.15 s for the default
model's 98 MB and about a second per GB, at every start. Size and modification time are not
enough: a file replaced by another of the same size within the clock's resolution, or copied
with its times kept, would get the old tokenizer.

An entry is written to a temporary folder beside it and renamed into place, so a reader never sees
half of one; when two processes convert at once (the front end and the worker at a first start),
the first rename wins and the other drops its copy. Every process loads the tokenizer from the
saved entry, even right after converting it, so the front end and the worker always tokenize with
the same files (``runtime/tokenizer.py: load_gguf_tokenizer_cached`` puts the two together).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)


def cache_key(gguf_file: Path) -> str:
    """The hash of the file's metadata (its header and key/values), with the converting
    transformers version (read from its package metadata: importing it takes ~0.8 s and ~45 MB,
    which the front end never otherwise pays)."""
    from importlib.metadata import version

    from trio_infer.models.gguf_header import metadata_end

    end = metadata_end(gguf_file)
    with open(gguf_file, "rb") as f:
        digest = hashlib.blake2b(f.read(end), digest_size=20)
    digest.update(b"\0transformers " + version("transformers").encode())
    return digest.hexdigest()


def load_gguf_tokenizer(gguf_file: Path) -> Any:
    """Convert the file's tokenizer (with the model loader's code, which imports torch: paid once
    per file, by whichever process converts it first)."""
    from trio_infer.models.gguf_loader import load_gguf_tokenizer as convert

    return convert(gguf_file)


def store(entry: Path, save: Callable[[str], Any]) -> None:
    """Make the folder ``entry`` with ``save(folder)`` so that no process ever sees it half
    written: ``save`` writes into a temporary folder beside it, renamed into place; when several
    processes store the same entry at once (a first start: the worker and each front end), the
    first rename wins and the others drop their copies."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}-")
    try:
        save(tmp)
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():  # else another process stored it first: theirs is as good
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # our copy, unless it was renamed into place
