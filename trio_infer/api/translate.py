"""Another API's request planned as the chat request it says the same as.

``/v1/responses`` (api/responses.py) and ``/v1/messages`` (api/messages.py) translate their
request into a chat completions request (a dict), and :func:`plan_as_chat` plans that one with
``plans.plan_chat``: the same chat template, tools, structured output, sampling parameters and
checks, not a copy of them. What the chat path refuses is refused in the other API's words: the
error names that API's field (``rename``), never the chat field it became.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from pydantic import ValidationError

from trio_infer.api.errors import APIError, validation_message
from trio_infer.api.plans import ModelLimits, Plan, plan_chat
from trio_infer.api.protocol import ChatCompletionRequest

Rename = Callable[[str], str]

_QUOTED = re.compile(r"'([A-Za-z_][A-Za-z0-9_.]*)'")


def plan_as_chat(body: dict[str, Any], tokenizer: Any, limits: ModelLimits, rename: Rename,
                 reasoning: str = "auto", thinking_token_budget: int | None = None,
                 max_tokens_is_cap: bool = False) -> Plan:
    """``body``, a chat completions request, planned (``reasoning``, ``thinking_token_budget``:
    the settings, as for chat; ``max_tokens_is_cap``: the other API's ``max_tokens`` is a cap,
    ``plans.capped_max_tokens``); an :class:`APIError` naming the other API's fields
    (``rename(chat field) -> field``) if it cannot be served."""
    try:
        req = ChatCompletionRequest.model_validate(body)
        return plan_chat(req, tokenizer, limits, reasoning, thinking_token_budget, max_tokens_is_cap)
    except APIError as exc:
        raise renamed(exc, rename) from None
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise renamed(APIError(400, message, param=param), rename) from None


def renamed(exc: APIError, rename: Rename) -> APIError:
    """``exc`` with its ``param`` and the field names quoted in its message renamed."""
    message = _QUOTED.sub(lambda m: "'" + rename(m.group(1)) + "'", exc.message)
    param = rename(exc.param) if exc.param else exc.param
    return APIError(exc.status, message, exc.type, param, exc.code, exc.headers)


def message_origin(origins: Sequence[str], whole: str) -> Rename:
    """A renamer for ``messages`` and ``messages.<i>...``: chat message i came from the other
    API's ``origins[i]``; ``messages`` alone is ``whole``."""

    def rename(name: str) -> str:
        if name == "messages":
            return whole
        head, _, rest = name.partition(".")
        if head == "messages":
            index = rest.partition(".")[0]
            if index.isdigit() and int(index) < len(origins):
                return origins[int(index)]
            return whole
        return name

    return rename


def function_tool(name: str, description: str | None, parameters: Any, strict: bool | None) -> dict[str, Any]:
    """A chat ``tools`` entry."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def sampling_fields(req: Any, names: Sequence[str]) -> dict[str, Any]:
    """The fields ``names`` of ``req`` that were given (not None), by the same name."""
    return {name: getattr(req, name) for name in names if getattr(req, name) is not None}


def validated(model: Any, raw: Any, where: str) -> Any:
    """``raw`` as ``model``, or a 400 naming the field at fault below ``where``. A field the model
    does not know is dropped when it is null (it asks for nothing: SDKs echo their own objects
    back with such fields), and refused otherwise."""
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if v is not None or k in model.model_fields}
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message, param = validation_message(exc)
        full = f"{where}.{param}" if param else where
        if param:
            message = message.replace(f"'{param}'", f"'{full}'").replace(f": {param}", f": {full}")
        raise APIError(400, message, param=full) from None
