"""The checks every API request passes, whichever layer answers it (quart's ``before_request``
hook in ``routes.py``, or ``direct.py`` before quart): the size of the request's head, the API
key, and the JSON body parsed into its request model. Plain functions of the request's data, so
both layers run the same code and answer the same errors."""

from __future__ import annotations

import hmac
import json
import re
from typing import Any, Iterable

from pydantic import BaseModel

from trio_infer.api.errors import APIError
from trio_infer.api.jsondepth import MAX_JSON_DEPTH, json_depth
from trio_infer.api.protocol import check_fields


def check_head(size: int, limit: int) -> None:
    """431 when the request line and headers (``size``, counted as quart counts them: method,
    path, "?", query, each header's name and value + 4) exceed ``max_header_bytes``.

    Why ours: hypercorn's h11_max_incomplete_size only bounds a head still incomplete after a
    read, so a bigger head that arrives in one read (up to 64 KiB) got in."""
    if size > limit:
        raise APIError(
            431, f"The request line and headers hold {size} bytes; this server takes at most "
            f"{limit}.", code="headers_too_large",
        )


def head_size(method: str, full_path: str, headers: Iterable[tuple[str, str]]) -> int:
    """The size :func:`check_head` checks."""
    return len(method) + len(full_path) + sum(len(k) + len(v) + 4 for k, v in headers)


def check_api_key(key: str, authorization: str | None, x_api_key: str | None) -> None:
    """401 unless the request carries ``key`` (nothing to check when ``key`` is empty), as
    ``Authorization: Bearer <key>`` or (Anthropic's clients, accepted on every route)
    ``x-api-key``. Compared in constant time."""
    if not key:
        return
    scheme, _, token = (authorization or "").partition(" ")
    ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
    if not ok and x_api_key is not None:
        ok = hmac.compare_digest(x_api_key.strip().encode(), key.encode())
    if not ok:
        raise APIError(
            401,
            "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
        )


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where (a dotted path, "" for the top) a string of ``value`` holds a lone surrogate, or None.
    Recursion is bounded: the body's depth was checked before it was parsed."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        sub = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _lone_surrogate(key) is not None:
            return path
        found = _lone_surrogate(item, sub)
        if found is not None:
            return found
    return None


def _too_deep() -> APIError:
    return APIError(
        400, f"The JSON body of your request is nested too deeply (more than {MAX_JSON_DEPTH} levels).",
        code="json_too_deep",
    )


def parse_json(raw: bytes, model: type[BaseModel], unsupported: dict[str, tuple] | None,
               unknown_fields: str) -> Any:
    """The request body ``raw`` as ``model``, or a 400 that says what is wrong with it (a
    pydantic ``ValidationError`` for a field's value: the error handlers name the field)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The request body is not valid UTF-8 (byte {exc.start}).") from None
    # A deeply nested body made json.loads raise RecursionError (a 500): bound the depth first.
    if json_depth(text) > MAX_JSON_DEPTH:
        raise _too_deep()
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise APIError(
            400, f"We could not parse the JSON body of your request: {exc}."
        ) from None
    except RecursionError:  # not reachable below MAX_JSON_DEPTH; never a 500 if it were
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    # JSON may escape a lone UTF-16 surrogate ("\ud800"): json.loads gives a str that is no text
    # (it cannot be encoded), and the tokenizer raised TypeError on it (a 500). Only an escape
    # can make one (UTF-8 cannot encode surrogates), so look only when the text has one.
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate(data)
        if where is not None:
            raise APIError(
                400, "The request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                "without its pair), which is not text"
                + (f", in '{where}'." if where else "."),
                param=where or None,
            )
    data = check_fields(data, model, unsupported or {}, unknown_fields)
    return model.model_validate(data)
