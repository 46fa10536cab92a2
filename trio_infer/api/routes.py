"""The HTTP routes. Handlers translate only: parse, plan (serving.py), run a session, format.

Where a request's state lives and when it dies:

* non-streaming: ``async with engine.generate(...)`` inside the handler. A client disconnect
  cancels the handler (quart-trio cancels the request's nursery), which leaves the block, which
  aborts the request in the engine (G2).
* streaming: the handler enters the session into the request's exit stack (scope.py) *before*
  returning, so admission errors (503 queue full, draining) are still real HTTP statuses; the body
  generator closes the stack when the stream ends, and the ASGI middleware closes it in every
  other case, including a disconnect before the body started.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from pydantic import BaseModel
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Quart, Response, g, make_response, request

from trio_infer.api import sse
from trio_infer.api.errors import SERVER_ERROR, APIError, error_body, from_engine_error, internal_error
from trio_infer.api.protocol import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_fields,
)
from trio_infer.api.scope import close_quietly, request_exit_stack
from trio_infer.api.state import ServerState, server_state
from trio_infer.api.serving import (
    ChunkWriter,
    Delta,
    Plan,
    chat_response,
    check_model,
    check_token_ids,
    completion_response,
    group_by_choice,
    new_choices,
    plan_chat,
    plan_completion,
    render_chat,
)
from trio_infer.runtime.engine_actor import EngineError

log = logging.getLogger(__name__)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return Response(body, status=status, headers=headers, content_type="application/json")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(model: type[BaseModel], unsupported: dict[str, tuple] | None = None) -> Any:
    """The request body as ``model``, or a 400 that says what is wrong with it."""
    raw = await request.get_data()  # already drained by before_request: cached bytes
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The request body is not valid UTF-8 (byte {exc.start}).") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise APIError(
            400, f"We could not parse the JSON body of your request: {exc}."
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    if unsupported is not None:
        data = check_fields(data, model, unsupported)
    return model.model_validate(data)


def register_routes(app: Quart) -> None:
    @app.before_request
    async def _prepare() -> Any:
        # Trap 2: read the whole body before anything can answer, so an early error (404, 405,
        # 401, 400) never leaves a half-read request on a keep-alive connection. Raises 413 past
        # MAX_CONTENT_LENGTH; the error handler then adds "Connection: close".
        await request.get_data()
        g.body_complete = True
        key = server_state(app).settings.api_key
        if key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                raise APIError(
                    401,
                    "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                )
        return None

    @app.get("/health")
    async def health() -> Response:
        state = server_state(app)
        engine = state.engine
        if engine is None:
            reason = "the model is loading"
        elif not engine.healthy:
            reason = "the engine has stopped"
        elif engine.draining:
            reason = "the server is shutting down"
        else:
            return json_response({"status": "ok"})
        return json_response(error_body(reason, SERVER_ERROR, code="service_unavailable"), 503)

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
        return await _serve(state, plan_chat(req, state.tokenizer, state.limits))

    @app.post("/v1/completions")
    async def completions() -> Response:
        state = server_state(app).ready()
        req = await parse_body(CompletionRequest, UNSUPPORTED_COMPLETION)
        return await _serve(state, plan_completion(req, state.tokenizer, state.limits))

    @app.post("/tokenize")
    async def tokenize() -> Response:
        state = server_state(app).ready()
        req: TokenizeRequest = await parse_body(TokenizeRequest)
        check_model(req.model, state.limits)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Send exactly one of 'prompt' and 'messages'.", param="prompt")
        if req.messages is not None:
            ids = render_chat(state.tokenizer, req.messages, bool(req.add_generation_prompt))
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


async def _serve(state: ServerState, plan: Plan) -> Response:
    if plan.stream:
        return await _stream(state, plan)
    return await _complete(state, plan)


async def _complete(state: ServerState, plan: Plan) -> Response:
    choices = new_choices(plan, state.tokenizer)
    async with state.engine.generate(plan.prompt_ids, plan.params) as stream:
        async for outputs in stream:
            for index, group in group_by_choice(outputs).items():
                choices[index].consume(group)
                if choices[index].finished:
                    stream.finish(index)  # a stop string may end it before the engine does
            if all(c.finished for c in choices):
                break  # a stop string can end the last choice before the engine does
    if not all(c.finished for c in choices):
        raise APIError(500, "The engine ended the request without finishing it.", SERVER_ERROR)
    build = chat_response if plan.kind == "chat" else completion_response
    return json_response(build(plan, choices, state.texts))


async def _stream(state: ServerState, plan: Plan) -> Response:
    stack = request_exit_stack()
    # Entering may raise EngineOverloaded / EngineUnavailable: still a proper HTTP status.
    stream = await stack.enter_async_context(state.engine.generate(plan.prompt_ids, plan.params))
    choices = new_choices(plan, state.tokenizer)
    writer = ChunkWriter(plan, state.texts)
    interval = state.settings.stream_interval
    single = plan.n == 1

    async def body():  # type: ignore[no-untyped-def]
        # Trap 5: no `request` in here; everything needed was captured above.
        # stream_interval > 1: a choice's text waits until it has `interval` new tokens (its first
        # token and its end go out at once), merged into one chunk.
        held: list[Delta | None] = [None] * plan.n
        sent_tokens = [0] * plan.n
        try:
            try:
                first = "".join(writer.first())
                if first:
                    yield first
                async for outputs in stream:
                    events = []
                    # One choice (the usual case): every output is choice 0's, no grouping.
                    groups = ((0, outputs),) if single else group_by_choice(outputs).items()
                    for index, group in groups:
                        choice = choices[index]
                        delta = choice.consume(group)
                        if delta is None:
                            continue  # finished earlier (a stop string): later outputs dropped
                        if choice.finish_reason is not None:
                            stream.finish(index)
                        if interval > 1:
                            if held[index] is not None:
                                delta = held[index].merge(delta)
                            sent = sent_tokens[index]
                            if (
                                sent
                                and choice.finish_reason is None
                                and choice.num_tokens - sent < interval
                            ):
                                held[index] = delta
                                continue
                            held[index] = None
                            sent_tokens[index] = choice.num_tokens
                        event = writer.delta(index, delta)
                        if event is not None:
                            events.append(event)
                    if events:
                        # One write per read of the stream, whatever it held (trio-stack §6).
                        yield events[0] if len(events) == 1 else "".join(events)
                    if all(c.finish_reason is not None for c in choices):
                        break
                if not all(c.finished for c in choices):
                    raise RuntimeError("the engine ended the request without finishing it")
                tail = sse.event(writer.usage_chunk(choices)) if plan.include_usage else ""
                tail += sse.DONE
            except EngineError as exc:
                # Trap 6: an error after the first byte becomes an event, never a cut body.
                tail = sse.error_event(from_engine_error(exc))
            except Exception:
                log.exception("error while streaming a response")
                tail = sse.error_event(internal_error())
        finally:
            # Ends the session (a no-op if it already ended). Shielded: under Cancelled or
            # GeneratorExit an unshielded await would raise at once (trap 4).
            await close_quietly(stack)
        yield tail

    response = await make_response(body(), 200, sse.HEADERS)
    response.timeout = None  # trap 1: Quart's 60 s RESPONSE_TIMEOUT would cut long streams
    return response
