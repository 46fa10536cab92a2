"""Chat templates rendered with jinja2 as transformers renders them, without importing transformers.

A chat template is untrusted code from the model's folder: it runs in jinja2's immutable sandbox,
and sees only plain JSON data (what the API decoded: dicts, lists, strings, numbers). The rendering
must be byte for byte transformers' (5.x ``apply_chat_template(..., tokenize=False)``): the prompt
a model sees is the one it was trained on, and the worker's tokenizer (a transformers one) agrees
with the front end's. So the environment has transformers' settings and globals (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, a ``dict`` and a ``namespace`` that
cannot be used to reach Python internals), and the messages get the same preparation (keys whose
value is None dropped, reasoning copied under the names templates read, the final message left
open for ``continue_final_message``). tests/runtime/test_thin_tokenizer.py compares the two.

What transformers accepts beyond JSON data (Python functions as tools, dataclasses, pydantic
models, numpy values) is refused with a TypeError rather than rendered differently.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning goes under: the first is the one chat templates read; gpt-oss's
# templates read ``thinking``.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks the assistant's text for training masks):
    rendered as its body, which is all a prompt needs of it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """The template's ``dict``: builds dicts, and exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace``, refusing attributes that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's trick: ``namespace(self=...)`` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (compiled once per source: a template is a few ms to compile)."""
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        # Older versions have known sandbox escapes, and chat templates are untrusted code.
        raise ImportError(f"chat templates need jinja2>=3.1.6; this is {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    template = env.from_string(source)
    # jinja2 keeps a template's globals as a ChainMap over the environment's, and copies them
    # into a new dict at every render; copying a ChainMap walks both maps in Python, 8 of the 12
    # us a short chat took to render. The same names in a plain dict copy at C speed.
    template.globals = dict(template.globals)
    return template


def plain_data(value: Any) -> Any:
    """A copy of ``value`` made of exact JSON types only (subclasses of str, int and float back to
    their base type: their extra methods would be reachable from the template)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    raise TypeError(f"a chat template takes JSON data (dicts, lists, strings, numbers), not "
                    f"{type(value).__name__}")


def _messages(conversation: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages as the template sees them: plain dicts without the keys whose value is None
    (APIs send ``content: null``; templates handle a missing key, and would print "None")."""
    messages = []
    for message in conversation:
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        message = plain_data({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def _open_final_message(messages: list[dict[str, Any]], field: str, source: str) -> str:
    """Tag the end of the final message's ``field`` (so its end can be found in the rendering,
    and everything after it cut); the text it ends with."""
    if not messages:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    final = messages[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [f for f in REASONING_FIELDS if messages[-1].get(f) == final]
    if not any(f in source for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted '
                         "field in the chat_template")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:  # the last text block
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but we could not find any text to continue "
                         "in the final message!")
    for f in fields:
        messages[-1][f] = messages[-1][f] + _CONTINUE_TAG
    return final


def _cut_after_final_message(rendered: str, final: str) -> str:
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after "
            "applying the chat template! This can happen if the chat template deletes portions of "
            f"the final message.\nFinal message to continue: {final.strip()}\nRendered chat:\n{rendered}")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def render(
    source: str,
    conversation: Sequence[Any],
    *,
    tools: Sequence[Any] | None = None,
    documents: Sequence[Any] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """One conversation through the template ``source``. ``continue_final_message``: True (the
    final message's ``content``) or the name of the field to leave open; ``variables``: the other
    names the template sees (the special tokens, ``chat_template_kwargs``)."""
    template = compile_template(source)
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise TypeError("tools must be JSON schemas (dicts); functions are not converted here")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    messages = _messages(conversation)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _open_final_message(messages, field, source)
    rendered = template.render(
        messages=messages, tools=plain_data(tools), documents=plain_data(documents),
        add_generation_prompt=add_generation_prompt, **plain_data(dict(variables or {})))
    return rendered if final is None else _cut_after_final_message(rendered, final)
