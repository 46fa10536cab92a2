"""``/v1/chat/completions`` and ``/v1/completions``, answered at the ASGI layer, before quart.

Why: these two routes carry nearly all of the load, and quart's machinery around a request
cost more than the request's own work. Profiled in a burst of 256 short chat streams, the front end spent ~2.3 ms of CPU per request, of which quart's
dispatch (request context, hooks, the handler's call) ~380 us and quart's ``_send_response``
around the writes ~700 us; every awaited hop of quart's is also a round of the run loop that
each of 256 streams waits behind. Here a request is read from ASGI ``receive`` and answered with
ASGI ``send`` by the connection's own app call: the same checks and route code as every other
route (``checks.py``, ``plans.py``, ``respond.py``), without a request object, context or
response object. The other routes (Responses, Anthropic's, models, status, metrics, the page)
stay on quart: they are not where the time goes, and quart's routing serves them well.

What this path does that quart did, in quart's order, with quart's answers (the same status,
envelope and headers: ``tests/api/test_direct_routes.py``):

1. the head's size (431, ``Connection: close``), counted as quart counts it (quart adds a
   ``Remote-Addr`` header, and ``Host`` when there is none);
2. the whole body read before anything is answered (trap 2), at most ``max_body_bytes`` (413)
   within ``body_timeout_s`` (408); an answer sent before the body was read says ``Connection:
   close``. A client gone while its body arrives gets nothing;
3. the API key (401);
4. the method: ``POST`` (``OPTIONS`` answered as quart answers it, anything else 405 with
   ``Allow``);
5. the route, in a cancel scope that is cancelled when the client goes away (quart-trio does
   the same): a task waits for ``http.disconnect`` and cancels it, so a client gone mid-request
   or mid-stream leaves the session's block, which aborts it in the engine. hypercorn also
   sends ``http.disconnect`` once the response is complete; by then the route has finished.

Errors become :func:`errors.error_of`'s answers before the response starts and events after
(``respond.open_stream``), as on quart.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, Awaitable, Callable

import trio
from werkzeug.exceptions import MethodNotAllowed, RequestEntityTooLarge, RequestTimeout

from trio_infer.api import sse
from trio_infer.api.checks import check_api_key, check_head, head_size, parse_json
from trio_infer.api.errors import APIError, error_bytes, error_of
from trio_infer.api.last_send import send_last
from trio_infer.api.plans import plan_chat, plan_completion
from trio_infer.api.protocol import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
)
from trio_infer.api.respond import TIMEOUT_HEADER, complete, open_stream, request_timeout
from trio_infer.api.state import ServerState

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

_SSE_HEADERS = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in sse.HEADERS.items()]
_JSON = (b"content-type", b"application/json")
_ALLOW = "OPTIONS, POST"  # what quart's 405 and OPTIONS said for a POST route
_TIMEOUT_KEY = TIMEOUT_HEADER.lower()


def route_path(scope: dict[str, Any]) -> str | None:
    """The hot route ``scope`` asks for (its path under the ASGI ``root_path``, as quart strips
    it), or None: quart serves it."""
    if scope.get("type") != "http":
        return None
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root:
        if not path.startswith(root):
            return None
        path = path[len(root):]
    return path if path in PATHS else None


def _headers(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """The request's headers by lower-case name (the first of repeated ones, as quart's
    ``headers.get`` gives)."""
    out: dict[str, str] = {}
    for name, value in pairs:
        out.setdefault(name.lower(), value)
    return out


def _quart_head_size(scope: dict[str, Any], path: str, pairs: list[tuple[str, str]]) -> int:
    """The head's size as quart's ``before_request`` counted it: its request.headers are the
    scope's ``pairs``, plus Remote-Addr, plus Host when absent."""
    query = scope.get("query_string", b"").decode("utf-8", "replace")
    extra = [("Remote-Addr", (scope.get("client") or ["<local>"])[0])]
    if not any(n.lower() == "host" for n, _ in pairs):
        extra.append(("Host", ""))
    return head_size(scope.get("method", ""), f"{path}?{query}", pairs + extra)


async def _read_body(receive: Receive, declared: str | None, limit: int,
                     timeout_s: float | None) -> bytes | None:
    """The whole body, or None when the client left before it was in. Raises 413 past
    ``limit`` (at once when the declared length says so) and 408 past ``timeout_s``.

    A body of a declared length is whole once that many bytes are in: the server's message that
    says so (``more_body`` false, empty) is not waited for. hypercorn sends it right after the
    last bytes, each message a round of the run loop apart, and under load a round is long
    (every stream with a token to write runs in it); the disconnect watcher takes it later."""
    expected = int(declared) if declared is not None and declared.isdigit() else None
    if expected is not None and expected > limit:
        raise RequestEntityTooLarge()
    parts: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout_s if timeout_s is not None else float("inf")) as waited:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise RequestEntityTooLarge()
                parts.append(chunk)
            if not message.get("more_body", False) or size == expected:
                return parts[0] if len(parts) == 1 else b"".join(parts)
    assert waited.cancelled_caught
    raise RequestTimeout()


async def _send_error(send: Send, err: APIError, close: bool) -> None:
    body = error_bytes(err)
    headers = [_JSON, (b"content-length", str(len(body)).encode())]
    headers.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items())
    if close:  # trap 2: answered before the body was read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send_last(send, {"type": "http.response.body", "body": body, "more_body": False})


async def serve(path: str, scope: dict[str, Any], receive: Receive, send: Send,
                state: ServerState) -> None:
    """Answer one request for the hot route ``path`` (:func:`route_path`)."""
    settings = state.settings
    pairs = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope.get("headers", ())]
    headers = _headers(pairs)
    body_read = False
    try:
        check_head(_quart_head_size(scope, path, pairs), settings.max_header_bytes)
        raw = await _read_body(receive, headers.get("content-length"), settings.max_body_bytes,
                               settings.body_timeout_s)
        if raw is None:
            return  # the client left: nobody to answer
        body_read = True
        check_api_key(settings.api_key, headers.get("authorization"), headers.get("x-api-key"))
        method = scope.get("method")
        if method == "OPTIONS":
            return await _send_options(send)
        if method != "POST":
            raise MethodNotAllowed(valid_methods=_ALLOW.split(", "))
    except Exception as exc:  # noqa: BLE001 - every error is an answer
        return await _send_error(send, error_of(exc), close=not body_read)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
        try:
            await _route(path, raw, headers, send, state)
        finally:
            nursery.cancel_scope.cancel()


async def _send_options(send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"allow", _ALLOW.encode()), (b"content-type", b"text/html; charset=utf-8"),
        (b"content-length", b"0")]})
    await send_last(send, {"type": "http.response.body", "body": b"", "more_body": False})


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _route(path: str, raw: bytes, headers: dict[str, str], send: Send,
                 state: ServerState) -> None:
    started = False
    try:
        state = state.ready()
        if path == "/v1/chat/completions":
            req = parse_json(raw, ChatCompletionRequest, UNSUPPORTED_CHAT,
                             state.settings.unknown_fields)
            plan = plan_chat(req, state.tokenizer, state.limits, state.settings.reasoning,
                             state.settings.thinking_token_budget)
        else:
            req = parse_json(raw, CompletionRequest, UNSUPPORTED_COMPLETION,
                             state.settings.unknown_fields)
            plan = plan_completion(req, state.tokenizer, state.limits)
        timeout_s = request_timeout(plan, headers.get(_TIMEOUT_KEY))
        if not plan.stream:
            obj = await complete(state, plan, timeout_s=timeout_s)
            body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [
                _JSON, (b"content-length", str(len(body)).encode())]})
            started = True
            await send_last(send, {"type": "http.response.body", "body": body, "more_body": False})
            return
        content = await open_stream(state, plan, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - before the status: every error is an answer
        if started:
            raise
        return await _send_error(send, error_of(exc), close=False)
    async with aclosing(content):
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        async for chunk in content:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
    await send_last(send, {"type": "http.response.body", "body": b"", "more_body": False})
