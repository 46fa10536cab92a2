"""The front end's thin tokenizer against transformers' own, on the same saved folders.

``ThinTokenizer`` (runtime/thin_tokenizer.py) must give what transformers' ``TokenizersBackend``
gives for every call the front end makes: the same chat prompt text byte for byte, the same ids,
the same decoded text. Each tokenizer here is loaded both ways from one folder: the fake model's,
the tiny checkpoint's, copies of the fake one with the chat templates the tests know (Qwen3's,
with Hermes tool calls), a Llama-3-style one written here, several named templates, and the default GGUF
model's from the tokenizer cache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from trio_infer.models.default_model import default_cache_dir, default_model_file
from trio_infer.models.synthetic import build_tokenizer as build_fake_tokenizer
from trio_infer.runtime.detokenizer import _backend_decode, encoder
from trio_infer.runtime.thin_tokenizer import ThinTokenizer, UnsupportedTokenizer
from trio_infer.runtime.tokenizer import load_saved_tokenizer

SMOLLM2 = default_model_file(default_cache_dir())
# Qwen3's own chat template (tests/api/test_extensions.py): tools and tool calls the Hermes way,
# reasoning, ``enable_thinking``.
QWEN3_TEMPLATE = (Path(__file__).parent.parent / "api" / "data" / "qwen3_chat_template.jinja").read_text()

# Llama 3's shape (header tokens, tools in the first user turn, ``bos_token`` from the special
# tokens), using what transformers' environment provides: namespace, loop controls, dict,
# tojson's options, raise_exception and the generation tag.
LLAMA3_STYLE_TEMPLATE = """\
{{- bos_token }}{%- set ns = namespace(system='', n=0) %}
{%- if messages[0].role == 'system' %}{%- set ns.system = messages[0].content %}{%- endif %}
<|start_header_id|>system<|end_header_id|>

Today: {{ strftime_now('%Y') | length }} digits. {{ ns.system }}<|eot_id|>
    {% if documents is none %}(no documents){% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role not in ('user', 'assistant', 'tool') %}{{ raise_exception('bad role ' + message.role) }}{% endif %}
{%- set ns.n = ns.n + 1 %}
{%- if loop.first and tools is not none and message.role == 'user' %}<|start_header_id|>user<|end_header_id|>

Tools:
{% for t in tools %}{{ t | tojson(indent=2) }}
{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls is defined %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{{ dict(name=call.function.name, parameters=call.function.arguments) | tojson }}{% break %}{% endfor %}<|eot_id|>
{%- elif message.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>

{% generation %}{{ message.content | trim }}{% endgeneration %}<|eot_id|>
{%- else %}<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

TOOL_USE_TEMPLATE = "TOOLS {{ tools | length }}{% for m in messages %}|{{ m.role }}:{{ m.content }}{% endfor %}"
DEFAULT_TEMPLATE = "DEFAULT{% for m in messages %}|{{ m.role }}:{{ m.content }}{% endfor %}"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Hi  there\n\ttabs ünïcödé 😀 <|im_end|> 你好"},
               {"role": "assistant", "content": "Hello! "},
               {"role": "user", "content": "Again?"}],
    "tool calls": [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL], "name": None},
                   {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
                   {"role": "assistant", "content": "It is 21 degrees."}],
    "reasoning": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
                  {"role": "user", "content": "3+3?"},
                  {"role": "assistant", "content": "6", "reasoning": "Three and three.",
                   "reasoning_content": None}],
    "to continue": [{"role": "user", "content": "Count to five."},
                    {"role": "assistant", "content": "1, 2, 3, "}],
}
# (conversation, apply_chat_template keywords)
CASES = [
    *[(name, {"add_generation_prompt": gen}) for name in CONVERSATIONS for gen in (True, False)],
    *[(name, {"add_generation_prompt": True, "tools": [WEATHER]}) for name in ("user", "tool calls")],
    *[(name, {"add_generation_prompt": True, "enable_thinking": think})
      for name in ("user", "reasoning") for think in (True, False)],
    ("to continue", {"continue_final_message": True}),
    ("reasoning", {"continue_final_message": True}),
    ("user", {"add_generation_prompt": True, "eos_token": "<override>", "custom": [1, {"a": None}]}),
]


def _with_template(base: Path, out: Path, template: str | dict[str, str]) -> Path:
    shutil.copytree(base, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    if isinstance(template, str):
        (out / "chat_template.jinja").write_text(template)
    else:
        (out / "additional_chat_templates").mkdir()
        for name, source in template.items():
            (out / "additional_chat_templates" / f"{name}.jinja").write_text(source)
    return out


def _word_level(out: Path) -> Path:
    """A word-level tokenizer (not BPE: decoding cleans up the spaces before punctuation)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "it", "is", "n't", ".", "'s", ",", "hello", "a", "é", "😀"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    TokenizersBackend(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>",
                      clean_up_tokenization_spaces=True, chat_template=DEFAULT_TEMPLATE,
                      ).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("thin")
    fake = root / "fake"
    build_fake_tokenizer(fake)
    thinking = root / "thinking"
    tok = build_fake_tokenizer(thinking)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(str(thinking))
    found = {
        "fake": fake,
        "tiny checkpoint": tiny_checkpoint,
        "qwen3": thinking,
        "llama3 style": _with_template(fake, root / "llama3", LLAMA3_STYLE_TEMPLATE),
        "named templates": _with_template(fake, root / "named", {
            "default": DEFAULT_TEMPLATE, "tool_use": TOOL_USE_TEMPLATE}),
        "word level": _word_level(root / "word-level"),
    }
    if SMOLLM2.exists():
        from trio_infer.runtime.tokenizer import load_gguf_tokenizer_cached
        from trio_infer.runtime.tokenizer_cache import cache_key

        load_gguf_tokenizer_cached(SMOLLM2, default_cache_dir())
        found["smollm2 gguf"] = default_cache_dir() / "tokenizers" / cache_key(SMOLLM2)
    return found


@pytest.fixture(scope="module")
def pairs(folders: dict[str, Path]) -> dict[str, tuple[ThinTokenizer, Any]]:
    return {name: (ThinTokenizer.load(f), TokenizersBackend.from_pretrained(str(f)))
            for name, f in folders.items()}


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:  # a template may refuse a conversation: both must, alike
        return "raised", type(exc).__name__


def test_every_folder_is_loaded_thin(folders: dict[str, Path]) -> None:
    for name, folder in folders.items():
        assert isinstance(load_saved_tokenizer(folder, thin=True), ThinTokenizer), name
        assert isinstance(load_saved_tokenizer(folder), TokenizersBackend), name


def test_chat_prompts_are_byte_equal(pairs: dict[str, tuple[ThinTokenizer, Any]]) -> None:
    rendered = 0
    for name, (thin, hf) in pairs.items():
        assert thin.chat_template == hf.chat_template, name
        assert thin.special_tokens_map == hf.special_tokens_map, name
        for conversation, kwargs in CASES:
            messages = CONVERSATIONS[conversation]
            got = _outcome(lambda: thin.apply_chat_template(messages, tokenize=False, **kwargs))
            want = _outcome(lambda: hf.apply_chat_template(messages, tokenize=False, **kwargs))
            assert got == want, (name, conversation, kwargs)
            if got[0] == "ok":
                rendered += 1
                ids = thin.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
                assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert rendered > len(pairs) * len(CASES) // 2  # most cases render: the comparison is of text


def test_named_templates_pick_tool_use_when_tools_are_given(
        pairs: dict[str, tuple[ThinTokenizer, Any]]) -> None:
    thin, _ = pairs["named templates"]
    messages = CONVERSATIONS["user"]
    assert thin.apply_chat_template(messages, tokenize=False, tools=[WEATHER]).startswith("TOOLS 1|")
    assert thin.apply_chat_template(messages, tokenize=False).startswith("DEFAULT|")
    assert thin.get_chat_template("tool_use") == TOOL_USE_TEMPLATE


def test_the_vocabulary_calls_agree(pairs: dict[str, tuple[ThinTokenizer, Any]]) -> None:
    for name, (thin, hf) in pairs.items():
        assert len(thin) == len(hf) and thin.get_vocab() == hf.get_vocab(), name
        for attr in ("unk_token_id", "eos_token", "eos_token_id", "bos_token", "bos_token_id",
                     "pad_token_id", "all_special_ids"):
            assert getattr(thin, attr) == getattr(hf, attr), (name, attr)
        tokens = ["<|im_end|>", "<think>", "not-a-token-at-all", "a", *list(hf.get_vocab())[:50]]
        assert thin.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens), name
        assert thin.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")
        ids = list(range(min(len(hf), 300)))
        for skip in (True, False):
            assert thin.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
                hf.convert_ids_to_tokens(ids, skip_special_tokens=skip), name
        assert thin.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)


SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]
TEXTS = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(SPECIALS),
                           st.sampled_from([" ", "  ", "\n", "\t", " 's", " .", " n't", " it", " is",
                                            "é", "😀", "你好"])),
                 max_size=8).map("".join)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(text=TEXTS)
def test_encode_and_decode_agree(pairs: dict[str, tuple[ThinTokenizer, Any]], text: str) -> None:
    for name, (thin, hf) in pairs.items():
        for add in (True, False):
            ids = thin.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), (name, text, add)
        assert encoder(thin)(text) == encoder(hf)(text) == hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            for clean in (None, True, False):
                assert thin.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean) \
                    == hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean), \
                    (name, text, skip, clean)


def test_the_detokenizer_decodes_a_thin_tokenizer_with_its_backend(
        pairs: dict[str, tuple[ThinTokenizer, Any]]) -> None:
    thin, _ = pairs["fake"]
    assert _backend_decode(thin) == thin.backend_tokenizer.decode

    class Overriding(ThinTokenizer):
        def decode(self, *args: Any, **kwargs: Any) -> str:
            return "x"

    overriding = Overriding(thin.backend_tokenizer, thin.special_tokens_map)
    assert _backend_decode(overriding) is None
    assert encoder(overriding)("hi") == thin.encode("hi", add_special_tokens=False)


def test_what_is_not_reproduced_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    def variant(name: str, **config_changes: Any) -> Path:
        out = shutil.copytree(folders["fake"], tmp_path / name)
        config = json.loads((out / "tokenizer_config.json").read_text())
        config.update(config_changes)
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        return out

    for name, changes in {"class": {"tokenizer_class": "Qwen2Tokenizer"},
                          "unknown key": {"image_token": "<image>"},
                          "split": {"split_special_tokens": True},
                          "not added": {"bos_token": "<never-added>"}}.items():
        with pytest.raises(UnsupportedTokenizer):
            ThinTokenizer.load(variant(name, **changes))
        # ... and the front end's loader falls back to transformers' class for it.
        assert not isinstance(load_saved_tokenizer(tmp_path / name, thin=True), ThinTokenizer)
    thin = ThinTokenizer.load(folders["fake"])
    with pytest.raises(NotImplementedError):
        thin.apply_chat_template(CONVERSATIONS["user"])  # a BatchEncoding
    with pytest.raises(NotImplementedError):
        thin.apply_chat_template(CONVERSATIONS["user"], tokenize=False, sanitize_control_tokens=True)
    with pytest.raises(TypeError):
        thin.apply_chat_template(CONVERSATIONS["user"], tokenize=False, tools=[len])


def test_the_reserved_template_arguments_are_transformers(
        pairs: dict[str, tuple[ThinTokenizer, Any]]) -> None:
    from trio_infer.api.plans import _reserved

    thin, hf = pairs["fake"]
    assert _reserved(thin) == _reserved(hf)
