"""Incremental detokenization: never a broken character, leading-space markers kept."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from trio_infer.models.synthetic import build_tokenizer
from trio_infer.runtime.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXTS = ["hello wörld 日本 again", "the harbour town, 1 2 3!", "ünïcödé — ✓ 🙂 end", " hello world"]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    """GPT-2/Qwen style: byte-level BPE, 'Ġ' leading-space marker, multi-byte chars split."""
    return build_tokenizer(tmp_path_factory.mktemp("bytelevel"))


@pytest.fixture(scope="module")
def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama-2 style: '▁' marker that the decoder strips on the first token, and byte-fallback
    tokens ``<0xNN>`` (ordinary vocabulary entries) for characters outside the vocabulary."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>"], show_progress=False)
    trained.train_from_iterator(["hello world this is a test of the tokenizer again"] * 5, trainer=trainer)
    spec = json.loads(trained.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.pre_tokenizer = trained.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def stream(tokenizer, prompt_ids: list[int], ids: list[int], step: int = 1) -> list[str]:
    d = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [d.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(d.flush())
    return deltas


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_full_decode_and_are_never_broken(request, kind, text) -> None:
    tok = request.getfixturevalue(kind)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, [], ids)
    assert "".join(deltas) == tok.decode(ids)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_naive_per_token_decoding_would_be_wrong(sentencepiece_like) -> None:
    """Guard for the test itself: the tokenizer really has both problems."""
    tok = sentencepiece_like
    ids = tok.encode("hello wörld", add_special_tokens=False)
    naive = "".join(tok.decode([i]) for i in ids)
    assert naive != "hello wörld" and REPLACEMENT_CHAR in naive


def test_leading_space_of_the_first_generated_token_is_kept(sentencepiece_like) -> None:
    tok = sentencepiece_like
    prompt = tok.encode("hello", add_special_tokens=False)
    full = tok.encode("hello world again", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    deltas = stream(tok, prompt, full[len(prompt) :])
    assert "".join(deltas) == " world again"


def test_special_tokens_are_skipped(byte_level) -> None:
    tok = byte_level
    ids = tok.encode("hi", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(stream(tok, [], ids)) == "hi"


def test_bytes_that_never_form_a_character_are_emitted_eventually(byte_level) -> None:
    """Invalid UTF-8 from a model must not be held forever (memory bound, no lost text)."""
    tok = byte_level
    lone = tok.encode("日", add_special_tokens=False)[:1]  # a lead byte alone
    d = IncrementalDetokenizer(tok)
    out = [d.add(lone) for _ in range(20)]
    assert "".join(out)  # released after a bounded number of held tokens
    assert d.num_held_tokens < 8


def test_state_stays_small_for_long_generations(byte_level) -> None:
    tok = byte_level
    ids = tok.encode("the harbour town " * 200, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    text = "".join(d.add([i]) for i in ids) + d.flush()
    assert text == tok.decode(ids)
    assert len(d._ids) <= 16  # a window, not the whole sequence


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40), step=st.integers(1, 4), prompt_len=st.integers(0, 5))
def test_any_text_streams_exactly(byte_level, text, step, prompt_len) -> None:
    tok = byte_level
    ids = tok.encode(text, add_special_tokens=False)
    prompt, gen = ids[:prompt_len], ids[prompt_len:]
    deltas = stream(tok, prompt, gen, step)
    assert "".join(deltas) == tok.decode(ids)[len(tok.decode(prompt)) :]
    if REPLACEMENT_CHAR not in text:
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=30), step=st.integers(1, 4))
def test_any_text_streams_exactly_with_byte_fallback(sentencepiece_like, text, step) -> None:
    tok = sentencepiece_like
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, [], ids, step)
    assert "".join(deltas) == tok.decode(ids)
    if REPLACEMENT_CHAR not in text:
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
@pytest.mark.parametrize("text", TEXTS)
def test_backend_fast_path_gives_the_wrappers_deltas(request, kind, text) -> None:
    tok = request.getfixturevalue(kind)
    ids = tok.encode(text, add_special_tokens=False)
    fast = IncrementalDetokenizer(tok, ids[:2])
    slow = IncrementalDetokenizer(tok, ids[:2])
    assert fast._backend is not None
    slow._backend, slow._bytewise = None, False  # through tokenizer.decode, window by window
    for i in range(2, len(ids)):
        assert fast.add(ids[i : i + 1]) == slow.add(ids[i : i + 1])
    assert fast.flush() == slow.flush()


@settings(max_examples=80, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_the_byte_level_shortcut_gives_the_windows_deltas(byte_level, data, skip) -> None:
    """Any ids of the vocabulary (special tokens, lone bytes of a character, invalid runs), added
    one at a time or several at once (a read that found more than one token): the shortcut of a
    byte-level decoder says exactly what the window says."""
    tok = byte_level
    vocab = len(tok)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=24), label="ids")
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=4), label="prompt")
    fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    slow = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    assert fast._bytewise
    slow._bytewise = False
    at = 0
    while at < len(ids):
        run = ids[at:at + data.draw(st.integers(1, 4), label="run")]
        at += len(run)
        assert fast.add(run) == slow.add(run)
        assert fast.num_held_tokens == slow.num_held_tokens  # the same tokens wait
    assert fast.flush() == slow.flush()


def test_the_shortcut_is_taken_only_for_a_byte_level_decoder(byte_level, sentencepiece_like) -> None:
    assert IncrementalDetokenizer(byte_level)._bytewise
    assert not IncrementalDetokenizer(sentencepiece_like)._bytewise
