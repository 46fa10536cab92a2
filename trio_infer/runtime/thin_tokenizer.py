"""The front end's tokenizer: a saved ``TokenizersBackend`` folder without importing transformers.

The front end (the HTTP process) tokenizes prompts, renders chat templates and detokenizes the
output; transformers' tokenizer class does that with the ``tokenizers`` library and jinja2, but
importing transformers costs ~45 MB of RSS and ~0.8 s of CPU (the ``tokenizers`` library and
jinja2's sandbox, ~15 MB). :class:`ThinTokenizer` is the part of ``TokenizersBackend`` the front
end uses, over the same ``tokenizer.json``, giving the same ids, text and prompts (the worker
process keeps transformers' tokenizer: llguidance builds grammars from it, and it must agree with
this one; tests/runtime/test_thin_tokenizer.py compares them).

It loads only what it reproduces exactly: a folder whose ``tokenizer_config.json`` names
``TokenizersBackend`` (what ``save_pretrained`` writes for the GGUF tokenizer cache and the fake
model) with the usual keys, special tokens that ``tokenizer.json`` already holds as special added
tokens, no legacy ``special_tokens_map.json`` / ``added_tokens.json``. Anything else (a key whose
meaning transformers would apply at load, a Mistral folder that transformers patches) raises
:class:`UnsupportedTokenizer` naming the reason, and runtime/tokenizer.py loads transformers'
class instead. Likewise a call with an option it does not implement raises rather than doing less.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer, processors

from trio_infer.runtime.chat_template import render as render_template

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# tokenizer_config.json keys whose effect is reproduced here (or that have none on a saved
# TokenizersBackend: bookkeeping, limits transformers only warns about, ``add_*_token``, which
# transformers ignores when the folder has a tokenizer.json).
_KNOWN_KEYS = frozenset({
    *SPECIAL_TOKEN_NAMES, "extra_special_tokens", "additional_special_tokens", "backend",
    "tokenizer_class", "is_local", "local_files_only", "name_or_path", "model_max_length",
    "chat_template", "clean_up_tokenization_spaces", "split_special_tokens", "add_bos_token",
    "add_eos_token", "add_prefix_space", "padding_side", "truncation_side", "model_input_names",
    "added_tokens_decoder",
})
_LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
_TEMPLATE_FILE, _TEMPLATE_DIR = "chat_template.jinja", "additional_chat_templates"


class UnsupportedTokenizer(ValueError):
    """The folder asks for something :class:`ThinTokenizer` does not reproduce."""


def _token_text(value: Any) -> str:
    """A special token as the config stores it: a string, or a serialized ``AddedToken``."""
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, str):
        return value
    raise UnsupportedTokenizer(f"a special token of unknown form: {value!r}")


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The folder's chat template(s) as transformers finds them: ``chat_template.jinja`` and
    ``additional_chat_templates/*.jinja`` before the config's ``chat_template``; several make a
    dict of named templates (the file's is ``default``)."""
    found: dict[str, str] = {}
    if (folder / _TEMPLATE_FILE).is_file():
        found["default"] = (folder / _TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / _TEMPLATE_DIR).is_dir():
        for path in (folder / _TEMPLATE_DIR).glob("*.jinja"):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if len(found) == 1 and "default" in found:
        return found["default"]
    if found:
        return found
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {t["name"]: t["template"] for t in template}
    return template


def _check_mistral(folder: Path, backend: Tokenizer) -> None:
    """transformers may rewrite the pre-tokenizer of a large-vocabulary Mistral folder (its regex
    fix), deciding from the folder's config.json: not reproduced, so such a folder is refused."""
    if backend.get_vocab_size() > 100_000 and backend.pre_tokenizer is not None \
            and (folder / "config.json").is_file():
        raise UnsupportedTokenizer("a large-vocabulary folder with a model config.json (transformers "
                                   "may patch a Mistral tokenizer's regex)")


class ThinTokenizer:
    """A ``tokenizers.Tokenizer`` with its special tokens and chat template: the calls of
    transformers' ``TokenizersBackend`` the front end makes, with the same results."""

    def __init__(self, backend: Tokenizer, special_tokens: Mapping[str, str],
                 extra_special_tokens: Sequence[str] = (),
                 chat_template: str | dict[str, str] | None = None,
                 clean_up_tokenization_spaces: bool = False) -> None:
        self._backend = backend
        self._special = {n: special_tokens[n] for n in SPECIAL_TOKEN_NAMES
                         if special_tokens.get(n) is not None}
        self._extra_special = list(extra_special_tokens)
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        # The special tokens' ids, for decode's and convert_ids_to_tokens' skipping.
        self.all_special_tokens = list(dict.fromkeys([*self._special.values(), *self._extra_special]))
        self.all_special_ids = self.convert_tokens_to_ids(self.all_special_tokens)

    @classmethod
    def load(cls, folder: str | Path) -> ThinTokenizer:
        """The tokenizer saved in ``folder``; :class:`UnsupportedTokenizer` when transformers would
        load it with anything not reproduced here."""
        folder = Path(folder)
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UnsupportedTokenizer(f"no readable tokenizer_config.json: {exc}") from None
        if config.get("tokenizer_class") != "TokenizersBackend":
            raise UnsupportedTokenizer(f"tokenizer_class is {config.get('tokenizer_class')!r}")
        unknown = sorted(set(config) - _KNOWN_KEYS)
        if unknown:
            raise UnsupportedTokenizer(f"tokenizer_config.json keys not reproduced: {unknown}")
        for option in ("split_special_tokens", "added_tokens_decoder"):
            if config.get(option):
                raise UnsupportedTokenizer(f"{option} is set")
        legacy = [name for name in _LEGACY_FILES if (folder / name).exists()]
        if legacy or not (folder / "tokenizer.json").is_file():
            raise UnsupportedTokenizer(f"legacy files {legacy}" if legacy else "no tokenizer.json")
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        _check_mistral(folder, backend)

        special = {n: _token_text(config[n]) for n in SPECIAL_TOKEN_NAMES if config.get(n) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if not isinstance(extra, list):
            raise UnsupportedTokenizer("extra_special_tokens is not a list")
        extra = [_token_text(t) for t in extra]
        # transformers adds a special token the backend lacks (or holds as a plain added token),
        # which changes how text splits around it: only a folder that already has them is read.
        added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
        for token in [*special.values(), *extra]:
            if token not in added or not added[token].special:
                raise UnsupportedTokenizer(f"special token {token!r} is not a special added token "
                                           "of tokenizer.json")
        # What TokenizersBackend's constructor and encode do to the backend: its own padding and
        # truncation off (encode neither pads nor truncates unless asked), special tokens matched
        # in text, and an empty post-processor where the file has none.
        backend.no_padding()
        backend.no_truncation()
        backend.encode_special_tokens = False
        if backend.post_processor is None:
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])
        return cls(backend, special, extra, _chat_templates(folder, config),
                   bool(config.get("clean_up_tokenization_spaces", False)))

    # -- the vocabulary -------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The ``tokenizers`` backend (runtime/detokenizer.py decodes with it directly)."""
        return self._backend

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (``bos_token``...) that are set; every chat template sees them."""
        return dict(self._special)

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self._extra_special)

    def _special_token(self, name: str) -> str | None:
        return self._special.get(name)

    def _special_id(self, name: str) -> int | None:
        token = self._special.get(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    bos_token = property(lambda self: self._special_token("bos_token"))
    eos_token = property(lambda self: self._special_token("eos_token"))
    unk_token = property(lambda self: self._special_token("unk_token"))
    pad_token = property(lambda self: self._special_token("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    @property
    def unk_token_id(self) -> int | None:
        token = self._special.get("unk_token")
        return None if token is None else self._backend.token_to_id(token)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """A token's id (the unknown token's id, or None without one, for a token not in the
        vocabulary); a list for a list."""
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # -- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes one string, not {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """The ids' text. The clean-up of spaces before punctuation (the config's
        ``clean_up_tokenization_spaces`` unless given) is skipped for BPE models, as transformers
        does: it would remove real spaces."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        if clean_up_tokenization_spaces and type(self._backend.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)
        return text

    # -- chat -------------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template to render: of several named ones, ``chat_template`` (a name), else
        ``tool_use`` when tools are given and there is one, else ``default``."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError("This model has multiple chat templates with no default specified! "
                                 f"Available template names are {sorted(templates)}.")
            return chat_template
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set "
                             "and no template argument was passed!")
        return templates

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        tools: list[dict] | None = None,
        documents: list[dict[str, str]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        sanitize_control_tokens: bool = False,
        padding: bool | str = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_dict: bool = True,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``apply_chat_template``, for text (``tokenize=False``) or a plain list of
        ids (``tokenize=True, return_dict=False``). The named parameters are transformers' (the
        API refuses ``chat_template_kwargs`` that would set one: api/plans.py ``_reserved``);
        padding, truncation, tensors, dicts, masks and control-token sanitizing are refused."""
        if tokenize and return_dict:
            raise NotImplementedError("apply_chat_template returns text (tokenize=False) or a list of "
                                      "ids (return_dict=False) here, not a BatchEncoding")
        unsupported = {"sanitize_control_tokens": sanitize_control_tokens, "padding": padding,
                       "truncation": truncation, "max_length": max_length is not None,
                       "return_tensors": return_tensors is not None,
                       "return_assistant_tokens_mask": return_assistant_tokens_mask,
                       "tokenizer_kwargs": bool(tokenizer_kwargs)}
        asked = [name for name, value in unsupported.items() if value]
        if asked:
            raise NotImplementedError(f"apply_chat_template does not implement {asked} here")
        source = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. "
                             "Provide at least one message.")
        batched = isinstance(conversation[0], (list, tuple))
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
        variables = {**self._special, **kwargs}  # the caller's names win over the special tokens'
        rendered = [
            render_template(source, chat, tools=tools, documents=documents,
                                 add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message, variables=variables)
            for chat in (conversation if batched else [conversation])
        ]
        if tokenize:
            rendered = [self.encode(text, add_special_tokens=False) for text in rendered]
        return rendered if batched else rendered[0]


def _clean_up_tokenization(text: str) -> str:
    """The space clean-up of WordPiece-era tokenizers: no space before punctuation and English
    contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                           (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                           (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text
