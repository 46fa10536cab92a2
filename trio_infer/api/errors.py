"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Every path that can answer with an error goes through here, including Quart's own (404 route,
405 method, 413 body too large) and pydantic's validation errors, so a client never sees an HTML
page or FastAPI-style ``detail`` list. A 503 is always of type ``server_error`` (its ``code`` says
why). Overload refusals are 429 of type ``rate_limit_error`` with ``Retry-After`` (the code names
the limit: ``queue_full``, ``queue_tokens``, ``queue_time``); a request's deadline is 504
``timeout`` (param ``timeout``). Nothing internal (tracebacks, exception reprs of unexpected
errors) is leaked; the log gets the details.

Anthropic's ``/v1/messages`` answers the same errors in Anthropic's envelope
(:func:`anthropic_error_body`): ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ValidationError
from quart import Quart, g, has_request_context, request
from werkzeug.exceptions import HTTPException

from trio_infer.runtime.errors import (
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    RequestFailed,
    RequestStalled,
    RequestTimeout,
)

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RATE_LIMIT_ERROR = "rate_limit_error"
# Seconds a client is told to wait after a 503 while the model loads (seconds to minutes: no point
# asking every second). The queue's 429s compute theirs from the measured drain rate
# (runtime/router.py: Router.retry_after).
LOADING_RETRY_AFTER_S = 5


class APIError(Exception):
    """An error with its HTTP status and OpenAI envelope fields; raise it from a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- Anthropic's envelope (/v1/messages, api/messages.py) -------------------------------------------

# Requests under this path are Anthropic's: their errors are ``{"type": "error", "error": {"type",
# "message"}}``, the same statuses, and the field at fault named at the start of the message
# (Anthropic's envelope has no ``param``).
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def anthropic_error_body(status: int, message: str, param: str | None = None,
                         code: str | None = None) -> dict[str, Any]:
    if status in _ANTHROPIC_TYPES:
        kind = _ANTHROPIC_TYPES[status]
    elif status < 500:
        kind = "invalid_request_error"
    else:  # 503 for a full queue is Anthropic's overloaded_error (their 529)
        kind = "overloaded_error" if code == "overloaded" else "api_error"
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def _envelope(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (OpenAI's envelope) as the API of the current request has its errors."""
    if has_request_context() and (request.path == ANTHROPIC_PATH or request.path.startswith(ANTHROPIC_PATH + "/")):
        e = body["error"]
        return anthropic_error_body(status, e["message"], e.get("param"), e.get("code"))
    return body


def from_engine_error(exc: EngineError) -> APIError:
    """The HTTP answer for an error the runtime raised (before or during a request)."""
    if isinstance(exc, EngineOverloaded):
        return APIError(
            429, str(exc), RATE_LIMIT_ERROR, code=exc.reason,
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, RequestTimeout):
        return APIError(504, str(exc), SERVER_ERROR, param="timeout", code="timeout")
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), SERVER_ERROR, code="service_unavailable")
    if isinstance(exc, RequestStalled):
        return APIError(500, str(exc), SERVER_ERROR, code="stalled")
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc), SERVER_ERROR, code="engine_error")
    return APIError(500, str(exc), SERVER_ERROR)


def internal_error() -> APIError:
    return APIError(500, "The server had an error while processing your request.", SERVER_ERROR)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member an error came from in its ``loc`` (``'list[str]'``)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part.startswith("function-"))


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One readable line and the ``param`` for the problem pydantic found."""
    errors = exc.errors(include_url=False)
    clean = [[str(p) for p in e.get("loc", ()) if not _is_union_tag(p)] for e in errors]
    tags = [next((p for p in reversed(e.get("loc", ())) if _is_union_tag(p)), None) for e in errors]
    # A value that matches no member of a union: say which types are accepted.
    if len(errors) > 1 and all(t is not None and c == clean[0] for t, c in zip(tags, clean)) and all(
        len(e["loc"]) and _is_union_tag(e["loc"][-1]) for e in errors
    ):
        param = ".".join(clean[0]) or None
        accepted = " or ".join(dict.fromkeys(t for t in tags if t))
        return f"Invalid type for '{param}': expected {accepted} (got {_short(errors[0].get('input'))}).", param
    # Otherwise the deepest problem is the most specific one (inside a union's matching member).
    i = max(range(len(errors)), key=lambda k: len(errors[k].get("loc", ())))
    first, param = errors[i], ".".join(clean[i]) or None
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if first.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param
    msg = first.get("msg", "invalid value")
    if param:
        return f"Invalid value for '{param}': {msg} (got {_short(first.get('input'))}).", param
    return msg, None


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _close_unless_body_read(headers: dict[str, str]) -> dict[str, str]:
    # Trap 2 (docs/lifecycle.md): an answer sent before the request body was fully received
    # leaves the keep-alive connection deaf to the next request. Ask the client to close it.
    if not getattr(g, "body_complete", False):
        headers = {**headers, "Connection": "close"}
    return headers


def http_error(exc: HTTPException) -> APIError:
    """A werkzeug/quart HTTP exception (404, 405, 408, 413) in our envelope."""
    status = exc.code or 500
    kind = INVALID_REQUEST if status < 500 else SERVER_ERROR
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    headers = {k: v for k, v in exc.get_headers() if k.lower() == "allow"}
    return APIError(status, exc.description or exc.name, kind, code=code, headers=headers)


def error_of(exc: Exception) -> APIError:
    """The answer for any exception raised while handling a request: an :class:`APIError` as it
    is, pydantic's errors as a 400 naming the field, the runtime's as
    :func:`from_engine_error`, HTTP exceptions as :func:`http_error`, and anything else as a
    500 that leaks nothing (logged with its traceback)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        message, param = validation_message(exc)
        return APIError(400, message, param=param)
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    if isinstance(exc, HTTPException):
        return http_error(exc)
    log.error("unhandled error in a request handler", exc_info=exc)
    return internal_error()


def error_bytes(err: APIError) -> bytes:
    """An error's body as quart's ``jsonify`` writes it (keys sorted, ASCII, a final newline),
    for a layer that answers without quart (``direct.py``): the same bytes either way."""
    return (json.dumps(err.body(), sort_keys=True, separators=(",", ":")) + "\n").encode()


def register_error_handlers(app: Quart) -> None:
    @app.errorhandler(APIError)
    async def _api_error(exc: APIError):  # type: ignore[no-untyped-def]
        return _envelope(exc.status, exc.body()), exc.status, _close_unless_body_read(exc.headers)

    @app.errorhandler(ValidationError)
    async def _validation_error(exc: ValidationError):  # type: ignore[no-untyped-def]
        err = error_of(exc)
        return _envelope(400, err.body()), 400, _close_unless_body_read({})

    @app.errorhandler(EngineError)
    async def _engine_error(exc: EngineError):  # type: ignore[no-untyped-def]
        err = from_engine_error(exc)
        return _envelope(err.status, err.body()), err.status, _close_unless_body_read(err.headers)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException):  # type: ignore[no-untyped-def]
        err = http_error(exc)
        return _envelope(err.status, err.body()), err.status, _close_unless_body_read(err.headers)

    @app.errorhandler(Exception)
    async def _unhandled(exc: Exception):  # type: ignore[no-untyped-def]
        err = error_of(exc)
        return _envelope(err.status, err.body()), err.status, _close_unless_body_read({})
