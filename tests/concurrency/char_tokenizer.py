"""A character-level tokenizer for the fake model, so the HTTP suite knows every byte in advance.

Token 0 is the EOS (a special token, empty text when skipped); token ``i >= 1`` is the single
character ``ALPHABET[i - 1]``. Text is then exactly the concatenation of the tokens' characters,
so the expected text of a choice, where a stop string cuts it and how many tokens it took, follow
from the fake model's token ids with no tokenizer subtleties in the way.

It implements the part of the Hugging Face tokenizer interface the server uses: ``encode``,
``decode``, ``convert_ids_to_tokens``, ``chat_template`` and ``apply_chat_template``.
"""

from __future__ import annotations

from typing import Any, Sequence

from .scenario import EOS, VOCAB

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,:;!?\n"
assert len(ALPHABET) == VOCAB - 1 and EOS == 0
EOS_TEXT = "<eos>"
# Characters a chat message may use (the template's own markers use the rest freely).
MESSAGE_CHARS = ALPHABET[:27]  # lowercase and the space


class CharTokenizer:
    chat_template = "char-level: '<R>: <content>\\n' per message, then 'A: '"
    eos_token_id = EOS

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ALPHABET.index(c) + 1 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return "".join(self.text_of(i, skip_special_tokens) for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.text_of(token_id, False)

    def apply_chat_template(self, conversation: list[dict[str, str]],
                            add_generation_prompt: bool = True, tokenize: bool = False) -> str:
        assert not tokenize
        text = "".join(f"{m['role'][0].upper()}: {m['content']}\n" for m in conversation)
        return text + ("A: " if add_generation_prompt else "")

    @staticmethod
    def text_of(token_id: int, skip_special: bool) -> str:
        if token_id == EOS:
            return "" if skip_special else EOS_TEXT
        return ALPHABET[token_id - 1]


def ll_tokenizer() -> Any:
    """llguidance's view of this tokenizer (constrained choices of the suite): token 0 is the
    special EOS, token i the byte of ``ALPHABET[i - 1]``."""
    import llguidance

    class Wrapped:
        eos_token_id = EOS
        bos_token_id = None
        special_token_ids = [EOS]
        tokens = [b"<eos>"] + [c.encode() for c in ALPHABET]

        def __call__(self, text: bytes) -> list[int]:
            return [ALPHABET.index(chr(b)) + 1 for b in text]

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), n_vocab=VOCAB)


def any_text_grammar() -> str:
    """A grammar that allows every text of the alphabet and the EOS anywhere: a constrained
    choice then writes exactly what the fake model writes (its expected output), while its grammar
    state is created, advanced and released like any other."""
    import re

    import llguidance

    return llguidance.LLMatcher.grammar_from_regex("[" + re.escape(ALPHABET) + "]*")
