"""The HTTP routes. Handlers only validate (plans.py) and render (render.py); a request's text
comes from its :class:`~trio_infer.runtime.text_stream.TextStream`, and what the text says (its
content, tool calls, finish) from :class:`~trio_infer.api.events.ResponseEvents`.

Where a request's state lives and when it dies:

* non-streaming: ``async with open_batch_text_stream(...)`` inside the handler. A client
  disconnect cancels the handler (quart-trio cancels the request's nursery), which leaves the
  block, which aborts the request in the engine (G2).
* a completions batch (several prompts) is one session whose sequences are every choice of every
  prompt, read by the handler's own task: leaving the block ends all of them at once, exactly as
  for one prompt.
* streaming: the handler checks admission before the response starts (503 and 429 are still
  statuses), and the body generator enters the session: leaving the generator for any reason (end,
  disconnect, cancellation) leaves the block. A client gone before the body started never
  entered a session, so there is nothing to clean up.

The chat page (``GET /`` and ``/static/<name>``, files of ``api/static/``) is the only thing
served without the API key; it calls the API like any client (``/v1/models``, ``/v1/status``,
``/v1/chat/completions``) and sends the key it asks for.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any, Callable

import trio
from pydantic import BaseModel
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Quart, Response, current_app, g, make_response, request

from trio_infer.api import sse
from trio_infer.api.errors import (
    APIError,
    from_engine_error,
    internal_error,
)
from trio_infer.api.jsondepth import MAX_JSON_DEPTH, json_depth
from trio_infer.api.protocol import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_fields,
)
from trio_infer.api.plans import (
    Plan,
    check_model,
    check_token_ids,
    plan_chat,
    plan_completion,
    render_chat,
)
from trio_infer.api.events import ResponseEvents
from trio_infer.api.health import health_body, health_problem
from trio_infer.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from trio_infer.api.messages import MessagesSerializer, count_message_tokens, plan_messages
from trio_infer.api.responses import make_serializer as responses_serializer
from trio_infer.api.responses import plan_responses
from trio_infer.api.responses_protocol import ResponsesRequest
from trio_infer.api.render import Serializer, TokenText, serializer
from trio_infer.api.state import ServerState, server_state
from trio_infer.runtime.errors import EngineError
from trio_infer.runtime.text_stream import TextOptions, open_batch_text_stream

log = logging.getLogger(__name__)

# The chat page: plain files shipped in the package (package data), read once when the routes are
# registered. The page asks the browser to run nothing but these files and to talk to nothing but
# this server.
STATIC_DIR = Path(__file__).with_name("static")
_ASSET_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
_ASSET_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
_PAGE_HEADERS = {
    **_ASSET_HEADERS,
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}
# Endpoints served without the API key: the page and its files (they hold no data; everything
# the page shows comes from API routes that need the key).
_PUBLIC_ENDPOINTS = frozenset({"chat_page", "static_asset"})


def load_assets(directory: Path = STATIC_DIR) -> dict[str, tuple[bytes, str]]:
    """``{file name: (bytes, content type)}`` of the page's files."""
    return {
        path.name: (path.read_bytes(), _ASSET_TYPES[path.suffix])
        for path in sorted(directory.iterdir())
        if path.is_file() and path.suffix in _ASSET_TYPES
    }


def live_tasks() -> int:
    """Tasks alive in this process's trio run (the root task and every task of every nursery
    under it): what a request, a connection or a background loop left behind shows up here."""
    count = 0
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


def status_body(state: ServerState) -> dict[str, Any]:
    """What ``GET /v1/status`` answers: health, how far a load got (while the model loads or the
    worker restarts), the engine's gauges, the token counters (a client derives rates from two
    readings and their ``time``), the overload refusals and deadlines, and the front end's live
    tasks."""
    values = state.metrics.snapshot()
    count = lambda name: int(values.get("trio_infer_" + name, 0))  # noqa: E731
    problem = health_problem(state)
    loading = state.loading
    return {
        "healthy": problem is None,
        "problem": problem,
        "loading": None if loading is None else {
            "phase": loading.phase, "done": loading.done, "total": loading.total},
        "model": state.limits.name if state.limits is not None else None,
        "tensor_parallel": state.settings.tensor_parallel,  # ranks of the batching worker
        "time": time.time(),
        "requests": {
            "running": count("requests_running"),
            "waiting": count("requests_waiting"),
            "sessions": count("sessions_active"),
        },
        "kv_pages": {
            "used": count("kv_pages_used"),
            "cached": count("kv_pages_cached"),
            "total": count("kv_pages_total"),
        },
        "tokens": {
            "prompt": count("prompt_tokens_total"),
            "generated": count("generation_tokens_total"),
        },
        "overload": {
            "refused": state.metrics.refusals(),  # 429s by reason, since start
            "timeouts": count("request_timeouts_total"),  # deadlines that passed
        },
        "tasks": live_tasks(),
        "compute": compute_body(state),
    }


def compute_body(state: ServerState) -> dict[str, Any] | None:
    """Which kernels serve, why a slower path stands in (None when none does), the KV dtype."""
    info = state.engine.info if state.engine is not None else None
    if info is None:
        return None
    return {"kernels": info.kernels, "problem": info.kernels_problem,
            "kv_cache_dtype": info.kv_cache_dtype}


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return Response(body, status=status, headers=headers, content_type="application/json")


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


async def parse_body(model: type[BaseModel], unsupported: dict[str, tuple] | None = None) -> Any:
    """The request body as ``model``, or a 400 that says what is wrong with it."""
    raw = await request.get_data()  # already drained by before_request: cached bytes
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
    data = check_fields(data, model, unsupported or {}, server_state(current_app).settings.unknown_fields)
    return model.model_validate(data)


def register_routes(app: Quart) -> None:
    @app.before_request
    async def _prepare() -> Any:
        # max_header_bytes, exactly: hypercorn's h11_max_incomplete_size only bounds a head still
        # incomplete after a read, so a bigger head that arrives in one read (up to 64 KiB) got in.
        limit = server_state(app).settings.max_header_bytes
        head = len(request.method) + len(request.full_path) + sum(
            len(k) + len(v) + 4 for k, v in request.headers.items()
        )
        if head > limit:
            raise APIError(
                431, f"The request line and headers hold {head} bytes; this server takes at most "
                f"{limit}.", code="headers_too_large",
            )
        # Trap 2: read the whole body before anything can answer, so an early error (404, 405,
        # 401, 400) never leaves a half-read request on a keep-alive connection. Raises 413 past
        # MAX_CONTENT_LENGTH; the error handler then adds "Connection: close".
        await request.get_data()
        g.body_complete = True
        key = server_state(app).settings.api_key
        if key and request.path != "/health" and request.endpoint not in _PUBLIC_ENDPOINTS:
            given = request.headers.get("Authorization", "")
            scheme, _, token = given.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
            # Anthropic's clients send the key as 'x-api-key' (accepted on every route).
            other = request.headers.get("x-api-key")
            if not ok and other is not None:
                ok = hmac.compare_digest(other.strip().encode(), key.encode())
            if not ok:
                raise APIError(
                    401,
                    "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                )
        return None

    assets = load_assets()

    @app.get("/")
    async def chat_page() -> Response:
        body, content_type = assets["index.html"]
        return Response(body, content_type=content_type, headers=_PAGE_HEADERS)

    @app.get("/static/<name>")
    async def static_asset(name: str) -> Response:
        if name not in assets:
            raise APIError(404, f"No such file: /static/{name}", code="not_found")
        body, content_type = assets[name]
        return Response(body, content_type=content_type, headers=_ASSET_HEADERS)

    @app.get("/health")
    async def health() -> Response:
        # Answered by api/health.py before quart unless the probe is unusual (a body, a query).
        status, body, headers = health_body(server_state(app))
        return json_response(body, status, headers)

    @app.get("/v1/status")
    async def status() -> Response:
        return json_response(status_body(server_state(app)))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server_state(app).metrics.render(), content_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        state = server_state(app)
        limits = state.ready().limits
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": limits.name,
                        "object": "model",
                        "created": state.started_at,
                        "owned_by": "trio-infer",
                        "max_model_len": limits.max_model_len,
                    }
                ],
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        state = server_state(app).ready()
        req = await parse_body(ChatCompletionRequest, UNSUPPORTED_CHAT)
        return await _serve(state, plan_chat(
            req, state.tokenizer, state.limits, state.settings.reasoning,
            state.settings.thinking_token_budget,
        ))

    @app.post("/v1/completions")
    async def completions() -> Response:
        state = server_state(app).ready()
        req = await parse_body(CompletionRequest, UNSUPPORTED_COMPLETION)
        return await _serve(state, plan_completion(req, state.tokenizer, state.limits))

    @app.post("/v1/responses")
    async def responses() -> Response:
        state = server_state(app).ready()
        req = await parse_body(ResponsesRequest)
        plan, echo = plan_responses(req, state.tokenizer, state.limits, state.settings.reasoning,
                                    state.settings.thinking_token_budget)
        return await _serve(state, plan, responses_serializer(echo))

    @app.post("/v1/messages")
    async def messages() -> Response:
        state = server_state(app).ready()
        req = await parse_body(MessagesRequest)
        return await _serve(state, plan_messages(req, state.tokenizer, state.limits,
                                                 state.settings.reasoning,
                                                 state.settings.thinking_token_budget), MessagesSerializer)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        state = server_state(app).ready()
        req = await parse_body(CountTokensRequest)
        return json_response({"input_tokens": count_message_tokens(req, state.tokenizer, state.limits)})

    @app.post("/tokenize")
    async def tokenize() -> Response:
        state = server_state(app).ready()
        req: TokenizeRequest = await parse_body(TokenizeRequest)
        check_model(req.model, state.limits)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Send exactly one of 'prompt' and 'messages'.", param="prompt")
        if req.messages is not None:
            ids = render_chat(state.tokenizer, req.messages, bool(req.add_generation_prompt),
                              template_kwargs=req.chat_template_kwargs,
                              continue_final_message=bool(req.continue_final_message))
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = list(state.tokenizer.encode(req.prompt, add_special_tokens=add))
        return json_response(
            {"count": len(ids), "max_model_len": state.limits.max_model_len, "tokens": ids}
        )

    @app.post("/detokenize")
    async def detokenize() -> Response:
        state = server_state(app).ready()
        req: DetokenizeRequest = await parse_body(DetokenizeRequest)
        check_model(req.model, state.limits)
        check_token_ids(req.tokens, state.limits.vocab_size, "tokens")
        return json_response({"prompt": state.tokenizer.decode(req.tokens)})


def _options(plan: Plan) -> TextOptions:
    return TextOptions(plan.skip_special_tokens, plan.include_stop_str)


# A serializer for a plan: ``render.serializer`` picks chat's or completions'; the other APIs
# (api/responses.py, api/messages.py) pass their own.
MakeSerializer = Callable[[Plan, TokenText], Serializer]


TIMEOUT_HEADER = "X-Request-Timeout"


def request_timeout(plan: Plan) -> float | None:
    """The request's deadline in seconds: its ``timeout`` field, else its ``X-Request-Timeout``
    header (checked as the field is), else None (the runtime applies ``request_timeout_s``)."""
    if plan.timeout_s is not None:
        return plan.timeout_s
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 7 * 86400:  # NaN fails too
        raise APIError(400, f"The {TIMEOUT_HEADER} header must be a number of seconds in "
                       f"(0, 604800] (got {raw[:40]!r}).", param=TIMEOUT_HEADER, code="invalid_timeout")
    return value


async def _serve(state: ServerState, plan: Plan, make: MakeSerializer = serializer) -> Response:
    timeout_s = request_timeout(plan)
    if plan.stream:
        return await _stream(state, plan, make, timeout_s)
    return await _complete(state, plan, make, timeout_s)


async def _resumed(first: str, rest: Any) -> Any:
    """``first``, then the rest of the started body ``rest``, closed whatever happens."""
    async with aclosing(rest):
        if first:
            yield first
        async for chunk in rest:
            yield chunk


def _queued_tokens(plan: Plan) -> int:
    return sum(len(p) for p in plan.prompts) * plan.n


async def _complete(state: ServerState, plan: Plan, make: MakeSerializer = serializer,
                    timeout_s: float | None = None) -> Response:
    async with open_batch_text_stream(
        state.engine, state.tokenizer, plan.prompts, plan.params, plan.stop, options=_options(plan),
        timeout_s=timeout_s,
    ) as text:
        async for _ in text:
            pass
    said = ResponseEvents(plan)
    body = make(plan, state.texts).response(text.choices, [said.whole(c) for c in text.choices])
    request.scope[sse.NEXT_SEND_FOLLOWS] = True  # the body is bytes: headers and body in one write
    return json_response(body)


async def _stream(state: ServerState, plan: Plan, make: MakeSerializer = serializer,
                  timeout_s: float | None = None) -> Response:
    # Admission before the response starts: a full queue or a draining server is still a real
    # HTTP status (429, 503), not an error event. The session itself is entered in the body, so
    # a client that leaves before the body starts leaves nothing behind.
    #
    # With a queue-time limit, the status waits for the worker to start the request: the handler
    # runs the body up to its first chunk, which it yields only once the request was scheduled;
    # a refusal (429), a deadline (504) or a failure before that leaves the body with its
    # session closed and becomes the status. The body is then suspended inside the session; if
    # the response is dropped unsent (a client gone right then), trio's finalizer of unfinished
    # async generators closes it, and the session with it.
    state.engine.check_admission(plan.num_choices, _queued_tokens(plan))
    engine, tokenizer, interval = state.engine, state.tokenizer, state.settings.stream_interval
    events = ResponseEvents(plan)
    writer = make(plan, state.texts)
    hold = state.settings.max_queue_time_s is not None
    first = writer.first()
    scope = request.scope
    if first:
        # The first chunk is ready: it is the body's first message (with hold too), so the server
        # writes the headers and it in one write (server.py, change 5). A stream whose first
        # chunk waits for the model (completions) gets its headers at once.
        scope[sse.NEXT_SEND_FOLLOWS] = True

    async def body():  # type: ignore[no-untyped-def]
        # Trap 5: no `request` in here; everything needed was captured above.
        sent = not hold  # whether the status is gone (an error is an event from then on)
        try:
            if not hold and first:
                yield first
            async with open_batch_text_stream(
                engine, tokenizer, plan.prompts, plan.params, plan.stop, interval, _options(plan),
                timeout_s,
            ) as text:
                if hold:
                    await text.admitted()
                    sent = True
                    yield first  # the handler's: it returns the response now
                counts = text.choices if plan.continuous_usage else None
                async for deltas in text:
                    # One write per read of the stream, whatever it held: each write is an ASGI
                    # send, which costs far more than joining strings (sse.py).
                    said = events.feed(deltas)
                    # With continuous_usage_stats (chat, completions) the chunks carry usage.
                    chunks = writer.write(said) if counts is None else writer.write(said, counts)
                    if chunks is not None:
                        yield chunks
            tail = writer.end(text.choices)
        except EngineError as exc:
            if not sent:
                raise  # still in the handler: a status
            # Trap 6: an error after the first byte becomes an event, never a cut body.
            tail = writer.failed(from_engine_error(exc))
        except Exception:
            if not sent:
                raise
            log.exception("error while streaming a response")
            tail = writer.failed(internal_error())
        scope[sse.NEXT_SEND_FOLLOWS] = True  # the end of the body follows: one write for both
        yield tail

    content = body()
    if hold:
        content = _resumed(await content.__anext__(), content)
    response = await make_response(content, 200, sse.HEADERS)
    response.timeout = None  # trap 1: Quart's 60 s RESPONSE_TIMEOUT would cut long streams
    return response
