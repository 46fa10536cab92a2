"""How a plan becomes an answer, whichever layer sends it: the JSON body of a whole response
(:func:`complete`) or the chunks of a stream (:func:`open_stream`), and the request's deadline
(:func:`request_timeout`).

Two layers send them: quart (``routes.py``: the Responses and Anthropic APIs) and the ASGI layer
before quart (``direct.py``: chat and completions, the hot routes). Both take the request's data
as arguments (its timeout header) rather than from quart's request context,
so the route logic exists once.
"""

from __future__ import annotations

import logging
import math
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from trio_infer.api.errors import APIError, from_engine_error, internal_error
from trio_infer.api.plans import Plan
from trio_infer.api.render import Serializer, TokenText, serializer
from trio_infer.api.response_events import ResponseEvents
from trio_infer.api.state import ServerState
from trio_infer.runtime.errors import EngineError
from trio_infer.runtime.text_stream import (
    ChoiceDelta,
    TextOptions,
    open_batch_text_stream,
)

log = logging.getLogger(__name__)

# A serializer for a plan: ``render.serializer`` picks chat's or completions'; the other APIs
# (api/responses.py, api/messages.py) pass their own.
MakeSerializer = Callable[[Plan, TokenText], Serializer]

TIMEOUT_HEADER = "X-Request-Timeout"


def request_timeout(plan: Plan, header: str | None) -> float | None:
    """The request's deadline in seconds: its ``timeout`` field, else its ``X-Request-Timeout``
    header (``header``, checked as the field is), else None (the runtime applies
    ``request_timeout_s``)."""
    if plan.timeout_s is not None:
        return plan.timeout_s
    if header is None:
        return None
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not 0 < value <= 7 * 86400:  # NaN fails too
        raise APIError(400, f"The {TIMEOUT_HEADER} header must be a number of seconds in "
                       f"(0, 604800] (got {header[:40]!r}).", param=TIMEOUT_HEADER, code="invalid_timeout")
    return value


def _options(plan: Plan) -> TextOptions:
    return TextOptions(plan.skip_special_tokens, plan.include_stop_str)


def _queued_tokens(plan: Plan) -> int:
    return sum(len(p) for p in plan.prompts) * plan.n


async def complete(state: ServerState, plan: Plan, make: MakeSerializer = serializer,
                   timeout_s: float | None = None) -> dict[str, Any]:
    """The whole response's JSON body. The session lives inside this call: a caller cancelled
    (a client gone) leaves the block, which aborts the request in the engine (G2)."""
    async with open_batch_text_stream(
        state.engine, state.tokenizer, plan.prompts, plan.params, plan.stop, options=_options(plan),
        timeout_s=timeout_s,
    ) as text:
        async for _ in text:
            pass
    said = ResponseEvents(plan)
    return make(plan, state.texts).response(text.choices, [said.whole(c) for c in text.choices])


async def _resumed(first: str, rest: Any) -> Any:
    """``first``, then the rest of the started body ``rest``, closed whatever happens."""
    async with aclosing(rest):
        if first:
            yield first
        async for chunk in rest:
            yield chunk


async def open_stream(state: ServerState, plan: Plan, make: MakeSerializer = serializer,
                      timeout_s: float | None = None) -> AsyncIterator[str]:
    """A stream's body (an async generator of SSE text: close it), once admission said yes.

    Admission before the response starts: a full queue or a draining server is still a real
    HTTP status (429, 503), raised here, not an error event. The session itself is entered in
    the body, so a client that leaves before the body starts leaves nothing behind.

    With a queue-time limit, the status waits for the worker to start the request: this runs
    the body up to its first chunk, which it yields only once the request was scheduled; a
    refusal (429), a deadline (504) or a failure before that leaves the body with its session
    closed and is raised here. The body is then suspended inside the session; if it is dropped
    unsent (a client gone right then), trio's finalizer of unfinished async generators closes
    it, and the session with it.

    Without a queue-time limit the status is decided (200: the request was admitted) but goes
    out with the stream's first output, not before: the opening chunk (chat's role, the other
    APIs' start events) is held and joins the first chunk the model gives. llama-server, too,
    sends its status with the first output. Why: one write a stream before its first token
    instead of two; in a burst of new streams each of those writes is work the front end does
    before it reads the next request. An error before the first output is still an event after
    the status."""
    state.engine.check_admission(plan.num_choices, _queued_tokens(plan))
    engine, tokenizer, interval = state.engine, state.tokenizer, state.settings.stream_interval
    events = ResponseEvents(plan)
    writer = make(plan, state.texts)
    hold = state.settings.max_queue_time_s is not None
    first = writer.first()

    async def body():  # type: ignore[no-untyped-def]
        # Trap 5: no request context in here; everything needed was captured above.
        sent = not hold  # whether the status is decided (an error is an event from then on)
        held = "" if hold else first  # the opening chunk, waiting for the first output
        try:
            async with open_batch_text_stream(
                engine, tokenizer, plan.prompts, plan.params, plan.stop, interval, _options(plan),
                timeout_s,
            ) as text:
                if hold:
                    await text.admitted()
                    sent = True
                    yield first  # the caller's: it starts the response now
                counts = text.choices if plan.continuous_usage else None

                def render(deltas: list[ChoiceDelta]) -> str | None:
                    # One write per read of the stream, whatever it held: each write is an ASGI
                    # send, which costs far more than joining strings (sse.py).
                    said = events.feed(deltas)
                    # With continuous_usage_stats (chat, completions) the chunks carry usage.
                    return writer.write(said) if counts is None else writer.write(said, counts)

                async for deltas in text:
                    chunks = render(deltas)
                    if chunks is not None:
                        if held:
                            chunks, held = held + chunks, ""
                        yield chunks
            tail = writer.end(text.choices)
        except EngineError as exc:
            if not sent:
                raise  # still before the status
            # Trap 6: an error after the first byte becomes an event, never a cut body.
            tail = writer.failed(from_engine_error(exc))
        except Exception:
            if not sent:
                raise
            log.exception("error while streaming a response")
            tail = writer.failed(internal_error())
        yield held + tail

    content = body()
    if hold:
        content = _resumed(await content.__anext__(), content)
    return content
