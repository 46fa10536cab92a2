"""The GGUF tokenizer cache (runtime/tokenizer_cache.py): converted once, keyed by the file's
metadata (what the tokenizer is made from), written atomically. The converter is replaced by one that counts its calls (and returns
the tiny checkpoint's tokenizer), so these tests need no real GGUF file; the last one checks the
real conversion of the default model against its cached copy."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from trio_infer.models.default_model import default_cache_dir, default_model_file
from trio_infer.runtime import tokenizer, tokenizer_cache
from trio_infer.runtime.tokenizer import load_gguf_tokenizer_cached
from trio_infer.runtime.tokenizer_cache import cache_key

TEXTS = ["Hello, world!", "naïve café 123 <|im_end|>", "  spaces\tand\nlines "]


def encodings(tokenizer: Any) -> list[list[int]]:
    return [list(tokenizer.encode(t)) for t in TEXTS]


@pytest.fixture
def converter(monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Path) -> list[Path]:
    """Replace the GGUF conversion; the list it returns records the files it converted."""
    calls: list[Path] = []

    def convert(path: Path) -> Any:
        calls.append(path)
        return AutoTokenizer.from_pretrained(str(tiny_checkpoint))

    monkeypatch.setattr(tokenizer, "load_gguf_tokenizer", convert)
    return calls


def never_convert(monkeypatch: pytest.MonkeyPatch) -> None:
    def convert(path: Path) -> Any:
        raise AssertionError(f"{path} was converted again")

    monkeypatch.setattr(tokenizer, "load_gguf_tokenizer", convert)


def gguf_bytes(metadata: bytes, weights: bytes = b"") -> bytes:
    """A GGUF file with one key/value (a string of ``metadata``) and ``weights`` after it."""
    key = b"test.blob"
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IQ", 8, len(metadata)) + metadata + weights)


def gguf(tmp_path: Path, content: bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def test_a_miss_converts_and_stores_then_a_hit_does_not_convert(
    tmp_path: Path, converter: list[Path], monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Path
) -> None:
    content = gguf_bytes(os.urandom(4096).hex().encode(), os.urandom(4096))
    model, cache = gguf(tmp_path, content), tmp_path / "cache"
    want = encodings(AutoTokenizer.from_pretrained(str(tiny_checkpoint)))

    first = load_gguf_tokenizer_cached(model, cache)
    assert converter == [model]
    entry = cache / "tokenizers" / cache_key(model)
    assert (entry / "tokenizer.json").is_file()
    assert [p.name for p in (cache / "tokenizers").iterdir()] == [entry.name]  # no temp folder left
    assert encodings(first) == want

    never_convert(monkeypatch)
    second = load_gguf_tokenizer_cached(model, cache)
    assert encodings(second) == want


def test_the_key_is_the_metadata_not_the_size_the_time_or_the_weights(
    tmp_path: Path, converter: list[Path]
) -> None:
    content = gguf_bytes(os.urandom(4096).hex().encode(), os.urandom(4096))
    model, cache = gguf(tmp_path, content), tmp_path / "cache"
    load_gguf_tokenizer_cached(model, cache)
    key = cache_key(model)

    # Same bytes elsewhere, with another modification time: the same entry, no conversion.
    copy = gguf(tmp_path, content, "copy.gguf")
    os.utime(copy, (1, 1))
    assert cache_key(copy) == key
    load_gguf_tokenizer_cached(copy, cache)
    assert converter == [model]

    # The weights changed (bytes past the metadata): the same tokenizer, the same entry.
    weights = bytearray(content)
    weights[-1] ^= 0xFF
    assert cache_key(gguf(tmp_path, bytes(weights), "retrained.gguf")) == key

    # One byte of the metadata changed, same size and time: a new key, converted again.
    stat = model.stat()
    changed = bytearray(content)
    changed[100] ^= 0x01
    model.write_bytes(bytes(changed))
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert model.stat().st_size == stat.st_size and cache_key(model) != key
    load_gguf_tokenizer_cached(model, cache)
    assert converter == [model, model]
    assert len(list((cache / "tokenizers").iterdir())) == 2


def test_an_entry_another_process_stored_first_wins(tmp_path: Path, converter: list[Path]) -> None:
    """Two processes converting at once (the front end and the worker at a first start): the
    second rename finds the entry there and drops its own copy, without an error."""
    model, cache = gguf(tmp_path, gguf_bytes(os.urandom(64).hex().encode())), tmp_path / "cache"
    load_gguf_tokenizer_cached(model, cache)
    entry = cache / "tokenizers" / cache_key(model)
    tokenizer_cache.store(entry, AutoTokenizer.from_pretrained(str(entry)).save_pretrained)
    assert [p.name for p in (cache / "tokenizers").iterdir()] == [entry.name]


def test_a_read_only_cache_still_gives_the_tokenizer(tmp_path: Path, converter: list[Path]) -> None:
    model = gguf(tmp_path, gguf_bytes(os.urandom(64).hex().encode()))
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    assert encodings(load_gguf_tokenizer_cached(model, blocker))
    assert converter == [model]


def test_the_default_models_cached_tokenizer_is_the_converted_one(tmp_path: Path) -> None:
    """The real conversion (transformers, from the GGUF metadata) against what the cache gives
    back: the same ids, special tokens and chat template."""
    path = default_model_file(default_cache_dir())
    if not path.is_file():
        pytest.skip(f"the default model is not at {path}: `make venv` fetches it")
    converted = tokenizer_cache.load_gguf_tokenizer(path)
    cached = load_gguf_tokenizer_cached(path, tmp_path)  # a miss: stored, then read back
    again = load_gguf_tokenizer_cached(path, tmp_path)  # a hit
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    for tokenizer in (cached, again):
        assert encodings(tokenizer) == encodings(converted)
        assert tokenizer.all_special_tokens == converted.all_special_tokens
        assert tokenizer.eos_token_id == converted.eos_token_id
        assert tokenizer.chat_template == converted.chat_template
        assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
            converted.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert len(tokenizer) == len(converted)


def test_a_stored_folder_appears_only_whole(tmp_path: Path) -> None:
    """The fake model's tokenizer is stored this way too: with --api-workers, two front ends
    and the worker start at once on a fresh cache, and one read another's half-written
    tokenizer_config.json (a JSON error that stopped the server)."""
    entry = tmp_path / "cache" / "fake-tokenizer"

    def save(folder: str) -> None:
        (Path(folder) / "tokenizer_config.json").write_text("{}")
        assert not entry.exists()  # another process looking now finds nothing, not half
        (Path(folder) / "tokenizer.json").write_text("{}")

    tokenizer_cache.store(entry, save)
    assert sorted(p.name for p in entry.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert [p.name for p in entry.parent.iterdir()] == ["fake-tokenizer"]  # no temporary left
