"""The HTTP routes served through quart. Handlers only validate (plans.py) and render
(render.py); a request's text comes from its :class:`~trio_infer.runtime.text_stream.TextStream`,
and what the text says (its content, tool calls, finish) from
:class:`~trio_infer.api.response_events.ResponseEvents`; respond.py turns a plan into the answer.

The two hot routes, ``POST /v1/chat/completions`` and ``/v1/completions``, are not here: they are
answered before quart (direct.py says why), with the same checks (checks.py) and the same
respond.py.

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

import json
import time
from pathlib import Path
from typing import Any

import trio
from pydantic import BaseModel
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Quart, Response, current_app, g, make_response, request

from trio_infer.api import sse
from trio_infer.api.checks import check_api_key, check_head, head_size, parse_json
from trio_infer.api.errors import APIError
from trio_infer.api.protocol import DetokenizeRequest, TokenizeRequest
from trio_infer.api.plans import Plan, check_model, check_token_ids, render_chat
from trio_infer.api.health import health_body, health_problem
from trio_infer.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from trio_infer.api.messages import MessagesSerializer, count_message_tokens, plan_messages
from trio_infer.api.response_store import StoredResponse
from trio_infer.api.responses import input_items, input_items_page, plan_responses, stored_record
from trio_infer.api.responses import make_serializer as responses_serializer
from trio_infer.api.responses_protocol import ResponsesRequest
from trio_infer.api.render import serializer
from trio_infer.api.respond import (
    TIMEOUT_HEADER,
    MakeSerializer,
    complete,
    open_stream,
    request_timeout,
)
from trio_infer.api.state import ServerState, server_state

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
        # The forward-progress watchdog (one entry per worker with --data-parallel).
        "watchdog": state.engine.watchdog_status() if state.engine is not None else None,
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


async def parse_body(model: type[BaseModel], unsupported: dict[str, tuple] | None = None) -> Any:
    """The request body as ``model``, or a 400 that says what is wrong with it."""
    raw = await request.get_data()  # already drained by before_request: cached bytes
    return parse_json(raw, model, unsupported, server_state(current_app).settings.unknown_fields)


def register_routes(app: Quart) -> None:
    @app.before_request
    async def _prepare() -> Any:
        # max_header_bytes, exactly (checks.py). The hot routes never get here (direct.py).
        settings = server_state(app).settings
        check_head(head_size(request.method, request.full_path, request.headers.items()),
                   settings.max_header_bytes)
        # Trap 2: read the whole body before anything can answer, so an early error (404, 405,
        # 401, 400) never leaves a half-read request on a keep-alive connection. Raises 413 past
        # MAX_CONTENT_LENGTH; the error handler then adds "Connection: close".
        await request.get_data()
        g.body_complete = True
        if request.path != "/health" and request.endpoint not in _PUBLIC_ENDPOINTS:
            check_api_key(settings.api_key, request.headers.get("Authorization"),
                          request.headers.get("x-api-key"))
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

    # POST /v1/chat/completions and /v1/completions: answered before quart (direct.py).

    @app.post("/v1/responses")
    async def responses() -> Response:
        state = server_state(app).ready()
        req = await parse_body(ResponsesRequest)
        store = state.store
        plan, echo = plan_responses(req, state.tokenizer, state.limits, state.settings.reasoning,
                                    state.settings.thinking_token_budget, store,
                                    state.settings.hosted_tools)
        keep, items = None, []
        if echo["store"]:  # (a background response is always stored: plan_responses checks)
            assert store is not None
            items = input_items(req)
            keep = lambda response: store.put(stored_record(req, response, items))  # noqa: E731
        make = responses_serializer(echo, keep, req.include or ())
        if req.background:
            if state.wiring.worker_address is not None:  # one of several front ends
                raise APIError(400, "'background': true is not served with --api-workers > 1: "
                               "the response would run in one front end process, and its cancel "
                               "or resumed stream may reach another. Send it without 'background' "
                               "(or 'stream': true), or serve with one front end.",
                               param="background", code="unsupported_parameter")
            return await _background(state, plan, make, req, items)
        return await _serve(state, plan, make)

    @app.post("/v1/responses/input_tokens")
    async def response_input_tokens() -> Response:
        # The prompt a create with this body would run: the same plan, nothing generated.
        state = server_state(app).ready()
        req = await parse_body(ResponsesRequest)
        plan, _ = plan_responses(req, state.tokenizer, state.limits, state.settings.reasoning,
                                 state.settings.thinking_token_budget, state.store,
                                 state.settings.hosted_tools)
        return json_response({"object": "response.input_tokens", "input_tokens": len(plan.prompts[0])})

    @app.get("/v1/responses/<response_id>")
    async def retrieve_response(response_id: str) -> Response:
        state = server_state(app)
        stream, after = _retrieve_query(request.args)
        if not stream:
            return json_response(_stored(state, response_id).response)
        run = state.background.get(response_id)
        if run is None:
            _stored(state, response_id)  # a 404 if it is not stored at all
            raise APIError(400, f"The events of response '{response_id[:100]}' are not kept: only "
                           "a background response's are, while it runs and for a while after. "
                           "Retrieve it without 'stream'.", param="stream")
        response = await make_response(run.follow(after), 200, sse.HEADERS)
        response.timeout = None  # trap 1
        return response

    @app.post("/v1/responses/<response_id>/cancel")
    async def cancel_response(response_id: str) -> Response:
        state = server_state(app)
        run = state.background.get(response_id)
        if run is None:
            record = _stored(state, response_id)
            if not record.response.get("background"):
                raise APIError(400, "Only background responses can be cancelled.",
                               param="response_id")
            return json_response(record.response)  # it ended long ago
        run.scope.cancel()  # leaving its stream aborts its sequence before the next step
        await run.done.wait()
        return json_response(_stored(state, response_id).response)

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        state = server_state(app)
        run = state.background.get(response_id)
        if run is not None:  # a running one stops first, then goes
            run.scope.cancel()
            await run.done.wait()
            state.background.forget(response_id)
        store = state.store
        if store is None or not store.delete(response_id):
            raise _no_response(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/<response_id>/input_items")
    async def response_input_items(response_id: str) -> Response:
        page = input_items_page(request.args)
        record = _stored(server_state(app), response_id)
        return json_response(page(record.input_items))

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


def _retrieve_query(args: Any) -> tuple[bool, int]:
    """``stream`` and ``starting_after`` of ``GET /v1/responses/{id}``, checked."""
    for name in args:
        if name not in ("stream", "starting_after", "include"):
            raise APIError(400, f"Unknown query parameter: {name!r}.", param=name)
    if args.getlist("include"):
        raise APIError(400, "'include' is not supported on retrieve by this server.",
                       param="include", code="unsupported_parameter")
    raw = args.get("stream", "false")
    if raw not in ("true", "false"):
        raise APIError(400, f"'stream' must be true or false (got {raw[:20]!r}).", param="stream")
    stream = raw == "true"
    after = args.get("starting_after")
    if after is not None and not stream:
        raise APIError(400, "'starting_after' goes with 'stream=true'.", param="starting_after")
    if after is not None and not after.isdigit():
        raise APIError(400, f"'starting_after' must be a sequence number (got {after[:20]!r}).",
                       param="starting_after")
    return stream, int(after) if after is not None else -1


async def _background(state: ServerState, plan: Plan, make: MakeSerializer,
                      req: ResponsesRequest, items: list[dict[str, Any]]) -> Response:
    """Start a background response in the server's nursery (api/background.py); answer it
    queued, or (``stream``) follow its events. Admission is checked here, as for a stream: a full
    queue is still a 429."""
    writers: list[Any] = []

    def made(plan: Plan, texts: Any) -> Any:
        writers.append(make(plan, texts))
        return writers[0]

    store = state.store
    assert store is not None  # plan_responses refuses background without a store
    content = await open_stream(state, plan, made, request_timeout(plan, request.headers.get(TIMEOUT_HEADER)))
    [writer] = writers
    queued = writer.queued()
    store.put(stored_record(req, queued, items))
    run = state.background.start(
        current_app.nursery, plan.id, content,
        on_start=lambda: store.put(stored_record(req, writer.queued("in_progress"), items)),
        on_stop=lambda status: writer.snapshot(status, None if status == "cancelled" else
                                               {"code": "server_error", "message": "internal error"}))
    if not plan.stream:
        return json_response(queued)
    response = await make_response(run.follow(), 200, sse.HEADERS)
    response.timeout = None  # trap 1
    return response


def _no_response(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id[:100]}' not found.", param="response_id",
                    code="not_found")


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    record = state.store.get(response_id) if state.store is not None else None
    if record is None:
        raise _no_response(response_id)
    return record


async def _serve(state: ServerState, plan: Plan, make: MakeSerializer = serializer) -> Response:
    """The answer for ``plan`` through quart (the hot routes send theirs in direct.py; both run
    respond.py's code)."""
    timeout_s = request_timeout(plan, request.headers.get(TIMEOUT_HEADER))
    if not plan.stream:
        body = await complete(state, plan, make, timeout_s)
        return json_response(body)
    content = await open_stream(state, plan, make, timeout_s)
    response = await make_response(content, 200, sse.HEADERS)
    response.timeout = None  # trap 1: Quart's 60 s RESPONSE_TIMEOUT would cut long streams
    return response
