"""Incremental detokenization: token ids in, text deltas out. Pure: no trio, no I/O.

Two facts about real tokenizers make "decode the new token and append it" wrong:

* A token can be part of a multi-byte UTF-8 character (byte-level BPE and SentencePiece byte
  fallback both do this). Decoded alone it gives U+FFFD. Emitting that would put a broken
  character on the wire, and the next token cannot repair text already sent.
* A token's text can depend on its neighbours. SentencePiece-style decoders (Llama, Mistral)
  turn the leading-space marker ``▁`` into a space *except* on the first token of the decoded
  run, so ``decode([▁world])`` is ``"world"`` while ``decode([▁hello, ▁world])`` is
  ``"hello world"``.

So the detokenizer decodes a short *window*: the tokens it emitted last (the prefix, which starts
and ends on character boundaries) plus the tokens not emitted yet, and emits the part of the window's text beyond the prefix's text, up to
the last token boundary where that new part does not end in U+FFFD (an unfinished character); the
tokens after it wait for the rest of their character. The state is a few integers and a window of
tokens of one request, so it lives and dies with the request's own task (gap G3).

The tokenizer is anything with Hugging Face's ``decode(ids, skip_special_tokens=...,
clean_up_tokenization_spaces=...)``. For a plain transformers fast tokenizer or the front end's
:class:`~trio_infer.runtime.thin_tokenizer.ThinTokenizer`, whose ``decode`` with
``clean_up_tokenization_spaces=False`` is exactly its ``tokenizers`` backend's ``decode``, the
backend is called directly: the same text without the Python wrapper (about 4x faster per call, and
this runs for every streamed token).
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens the first window starts with. One is enough for the leading-space rule; a
# few more leave room to start at the beginning of a character.
_PREFIX_WINDOW = 5
# Past this many held tokens the text will never become valid (the model produced invalid bytes):
# emit it as is.
_MAX_HELD_TOKENS = 8


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str: ...


def _backend_decode(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer.decode`` that ``tokenizer.decode`` wraps, or None when the
    wrapper may do more than call it (another class, or one that overrides ``decode``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    if not isinstance(backend, Tokenizer):
        return None
    cls = type(tokenizer)
    thin = _thin_class()
    if isinstance(tokenizer, thin):
        return backend.decode if cls.decode is thin.decode else None
    fast = _tokenizers_backend_class()
    if fast is None or not isinstance(tokenizer, fast):
        return None
    if cls._decode is not fast._decode or cls.decode is not fast.decode:
        return None
    return backend.decode


def _byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder is byte-level alone (GPT-2, Llama 3, Qwen, SmolLM2): its
    text of a run of tokens is their bytes joined and decoded, so where a run's bytes end on a
    character boundary the run's text is the texts of its parts joined (no leading-space rule,
    no clean-up)."""
    from tokenizers import decoders

    return type(getattr(tokenizer.backend_tokenizer, "decoder", None)) is decoders.ByteLevel


def encoder(tokenizer: Any) -> Any:
    """``text -> ids`` as ``tokenizer.encode(text, add_special_tokens=False)`` gives them; for a
    plain transformers fast tokenizer or a :class:`ThinTokenizer`, the ``tokenizers`` backend's
    own ``encode`` (the same ids without the wrapper's batch encoding objects: a few times
    cheaper, once per request)."""
    if _backend_decode(tokenizer) is not None:
        cls, thin, fast = type(tokenizer), _thin_class(), _tokenizers_backend_class()
        plain = (cls.encode is thin.encode if isinstance(tokenizer, thin)
                 else cls.encode is fast.encode and cls._encode_plus is fast._encode_plus)
        if plain:
            backend = tokenizer.backend_tokenizer
            fast_batch = getattr(backend, "encode_batch_fast", None)  # tokenizers >= 0.21
            if fast_batch is not None:  # no character offsets computed: ~20% cheaper
                return lambda text: fast_batch([text], add_special_tokens=False)[0].ids
            return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def _thin_class() -> Any:
    from trio_infer.runtime.thin_tokenizer import ThinTokenizer

    return ThinTokenizer


def _tokenizers_backend_class() -> Any:
    """transformers' ``TokenizersBackend``, or None when transformers is not imported (then no
    tokenizer is one: the front end never imports it just to ask)."""
    module = sys.modules.get("transformers.tokenization_utils_tokenizers")
    return None if module is None else module.TokenizersBackend


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta at a time.

    ``prompt_ids`` seed the window, so the first generated token is decoded in its real context
    (its leading space is kept). Prompt text itself is never emitted.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._backend = _backend_decode(tokenizer)
        self._bytewise = self._backend is not None and _byte_level(tokenizer)
        # The window starts a few tokens before the end of the prompt, at a token that begins a
        # character (a window starting inside one would decode its first bytes as U+FFFD, and
        # byte-fallback decoders then garble the whole byte run, new bytes included).
        tail = list(prompt_ids[-_PREFIX_WINDOW:])
        start, text = 0, None
        for i in range(len(tail)):
            decoded = self._decode(tail[i:])
            if not decoded.startswith(REPLACEMENT_CHAR):
                start, text = i, decoded  # the window's text: decoded once (per request)
                break
        self._ids: list[int] = tail[start:]
        self._prefix = 0  # the window: self._ids[self._prefix:]
        self._read = len(self._ids)  # tokens before this index have been emitted
        self._prefix_text = text if text is not None else self._decode(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special,
            clean_up_tokenization_spaces=False,
        )

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now final (possibly empty)."""
        if self._bytewise and token_ids and self._read == len(self._ids):
            # The usual case of a byte-level tokenizer: nothing held, and the new tokens are
            # whole characters. Their text is then exactly what the window's decode would add
            # (bytes join), and the window becomes those tokens, as _commit would leave it: one
            # decode of the new tokens instead of two of the window and the Python around them
            # (run for every streamed read: one token, or several when the front end is behind).
            piece = self._backend(token_ids, skip_special_tokens=self._skip_special)
            if REPLACEMENT_CHAR not in piece and REPLACEMENT_CHAR not in self._prefix_text:
                self._ids = list(token_ids)
                self._prefix, self._read, self._prefix_text = 0, len(self._ids), piece
                return piece
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The request is over: return whatever text is still held back, valid or not."""
        return self._advance(final=True)

    @property
    def num_held_tokens(self) -> int:
        return len(self._ids) - self._read

    def _advance(self, *, final: bool) -> str:
        n = len(self._ids)
        if self._read == n:
            return ""
        if final:
            return self._commit(n, self._decode(self._ids[self._prefix :]))
        # Commit as many tokens as give complete text: all of them, or all but the last few when
        # those end in the middle of a character. (Byte-fallback decoders turn a whole run of byte
        # tokens into U+FFFDs when its end is unfinished, so the boundary may lie several tokens
        # back; valid UTF-8 has one at least every 4 byte-tokens.)
        for end in range(n, self._read, -1):
            text = self._decode(self._ids[self._prefix : end])
            if not text.endswith(REPLACEMENT_CHAR):
                return self._commit(end, text)
        if n - self._read >= _MAX_HELD_TOKENS:
            # These bytes will never form a character (the model produced invalid UTF-8): stop
            # holding them, as a full decode would show them, as U+FFFD.
            return self._commit(n, self._decode(self._ids[self._prefix :]))
        return ""

    def _commit(self, end: int, text: str) -> str:
        """Emit the text of tokens up to ``end`` and slide the window past them."""
        # Text already emitted is never taken back: the delta is what lies beyond the prefix's
        # length (a decoder that rewrote earlier characters cannot be undone on the wire).
        delta = text[len(self._prefix_text) :]
        # The next window starts at the tokens just emitted: a character boundary, with at least
        # one token of left context for the leading-space rule. Older tokens are dropped, so the
        # state stays small however long the generation runs.
        start = self._read
        del self._ids[:start]
        self._read = end - start
        self._prefix = 0
        self._prefix_text = self._decode(self._ids[: self._read])
        return delta
