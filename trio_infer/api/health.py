"""``GET /health`` answered at the ASGI layer, before quart's request machinery.

Why: a load balancer's probe must be answered in milliseconds while hundreds of streams run. Through
quart, a probe waits behind every runnable task once per hop of quart's request handling (the
request's task, its body, its context, the before-request hook, the handler, the response's
send), and at 256 streams a round of the run loop is tens of milliseconds: ``/health`` p99 was
380 ms through quart (``bench frontend``). Here the probe is answered by the connection's own
app call, with two ASGI sends and nothing else.

The answer is the one quart gives (``routes.health`` uses the same :func:`health_body`): the same
status, body and headers (for ``HEAD`` too, whose body the server drops). A probe quart would treat differently (a body,
a head bigger than ``max_header_bytes``, a query string) goes to quart.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from trio_infer.api.errors import LOADING_RETRY_AFTER_S, SERVER_ERROR, error_body
from trio_infer.api.last_send import send_last
from trio_infer.api.state import ServerState

Send = Callable[[dict[str, Any]], Awaitable[None]]

_BODY_HEADERS = (b"content-length", b"transfer-encoding")


def health_problem(state: ServerState) -> str | None:
    """Why the server cannot take requests now (``/health`` answers 503 with it), or None."""
    engine = state.engine
    if engine is None:
        return "loading"
    if not engine.healthy:
        return "the batching worker is not running (it is restarting, or has stopped)"
    if engine.draining:
        return "the server is shutting down"
    return engine.stall_problem()


def health_body(state: ServerState) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """``/health``'s status, JSON body and extra headers."""
    reason = health_problem(state)
    if reason is None:
        return 200, {"status": "ok"}, None
    headers = {"Retry-After": str(LOADING_RETRY_AFTER_S)} if state.engine is None else None
    return 503, error_body(reason, SERVER_ERROR, code="service_unavailable"), headers


def is_plain_probe(scope: dict[str, Any], max_header_bytes: int) -> bool:
    """A ``GET``/``HEAD /health`` without a body or a query string, whose head quart would take
    (the size counted as ``routes._prepare`` counts it): the fast path answers exactly these."""
    if scope.get("type") != "http" or scope.get("path") != "/health" or scope.get("query_string"):
        return False
    method = scope.get("method")
    if method != "GET" and method != "HEAD":
        return False
    # routes._prepare: method + full_path ("/health?") + each header's name and value + 4.
    head = len(method) + len("/health?")
    for name, value in scope.get("headers", ()):
        if name in _BODY_HEADERS:
            return False
        head += len(name) + len(value) + 4
    return head <= max_header_bytes


async def answer(scope: dict[str, Any], send: Send, state: ServerState) -> None:
    """Send ``/health``'s response for a probe :func:`is_plain_probe` accepted."""
    status, obj, extra = health_body(state)
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if extra:
        headers.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items())
    await send({"type": "http.response.start", "status": status, "headers": headers})
    # HEAD too: the server drops a HEAD response's body, as it does quart's.
    await send_last(send, {"type": "http.response.body", "body": body, "more_body": False})
