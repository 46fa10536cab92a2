"""A stream's reads written where they arrive (``TextStream.handle``, server.py's change 14):
once a stream's status and first output are out, the task that delivers the worker's outputs
renders and writes each read that ends nothing, and the request's task is not woken for it.
What the client gets is what the request's task would have written (an h11 client parses it
whole), whatever part of a write the socket takes; an error met there is the stream's error
event. Over an in-process hypercorn under its own ``Config`` (the bare command), as
test_write_coalescing.py does."""

from __future__ import annotations

import json
import os
from itertools import cycle
from typing import Any

import h11
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_infer.api.events import ResponseEvents
from trio_infer.runtime.session import OutputQueue
from trio_infer.runtime.text_stream import TextStream

from .helpers import body_text, exchange, make_app, parse_sse

CHAT = "/v1/chat/completions"


def request(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            **extra}


def said(events: list) -> tuple[str, str | None, int]:
    """A parsed stream's text, its finish reason and its completion tokens; checks that the
    body is a whole SSE stream that ends with ``[DONE]``, with one finish, in its last chunk
    with choices. (How the text is cut into chunks may differ: a reader that falls behind
    takes several reads at once.)"""
    assert type(events[0]) is h11.Response and events[0].status_code == 200
    assert type(events[-1]) is h11.EndOfMessage
    parsed = parse_sse(body_text(events))
    assert parsed[-1] == "[DONE]"
    chunks = parsed[:-1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] is not None and not any(finishes[:-1])
    return text, finishes[-1], chunks[-1]["usage"]["completion_tokens"]


@pytest.fixture
def app(tokenizer: Any) -> Any:
    return make_app(tokenizer)


async def test_a_streams_reads_do_not_wake_its_task(app, monkeypatch) -> None:
    """32 tokens, one a step: the request's task reads its first output (which goes out with
    the status) and its end; the 30 reads between are written where they arrive, one write
    each."""
    reads = [0]
    receive_batch = OutputQueue.receive_batch

    async def counting(self: OutputQueue) -> Any:
        reads[0] += 1
        return await receive_batch(self)

    monkeypatch.setattr(OutputQueue, "receive_batch", counting)
    writes, events = await exchange(app, CHAT, request(32), monkeypatch)
    text, finish, tokens = said(events)
    assert tokens == 32 and finish == "length" and text
    assert reads[0] <= 3, f"the request's task read {reads[0]} times"
    middle = [w for w in writes[1:-1] if b'"content":' in w]
    assert len(middle) >= 16 and all(w.count(b"data: {") == 1 for w in middle)


async def test_the_client_gets_what_the_requests_task_would_have_written(app, monkeypatch) -> None:
    """The same requests with reads taken where they arrive and without (the handler refused):
    the same text; with a stop string too (whose streams are the task's)."""
    def run() -> Any:
        return exchange(app, CHAT, request(24), monkeypatch)

    _, events = await run()
    handled = said(events)
    stop = handled[0][len(handled[0]) // 2:][:3]
    _, events = await exchange(app, CHAT, request(24, stop=[stop]), monkeypatch)
    stopped = said(events)
    monkeypatch.setattr(TextStream, "handle", lambda self, handler, ready: False)
    _, events = await run()
    assert said(events) == handled
    _, events = await exchange(app, CHAT, request(24, stop=[stop]), monkeypatch)
    assert said(events) == stopped and stopped[1] == "stop" and stop not in stopped[0]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(takes=st.lists(st.integers(0, 100), min_size=1, max_size=10))
def test_a_write_the_socket_takes_in_part_is_finished_in_order(tokenizer, takes) -> None:
    """Each ``os.write`` of the server takes the drawn percentage of its bytes (0: the send
    buffer is full): the rest of a write made where a read arrived goes out first with the
    request's task's next write, so the body is whole and in order, the same as when every
    write is taken whole."""
    real = os.write
    pattern = cycle(takes)

    def partial(fd: int, data: Any) -> int:
        n = len(data) * next(pattern) // 100
        if n == 0:
            raise BlockingIOError
        return real(fd, data[:n])

    async def main() -> tuple[Any, Any]:
        with pytest.MonkeyPatch.context() as mp:
            _, whole = await exchange(make_app(tokenizer), CHAT, request(16), mp)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "write", partial)
            _, parts = await exchange(make_app(tokenizer), CHAT, request(16), mp)
        return whole, parts

    whole, parts = trio.run(main)
    assert said(parts) == said(whole)


async def test_an_error_in_a_read_taken_where_it_arrives_is_the_streams_error_event(
        app, monkeypatch) -> None:
    """The fourth read's events fail to render in the task that delivers it: the request's
    task raises it, and the stream ends with an error event and ``[DONE]``, as when its own
    read fails (test_lifecycle.py, trap 6)."""
    tasks: list[Any] = []
    feed = ResponseEvents.feed

    def flaky(self: ResponseEvents, deltas: Any) -> Any:
        tasks.append(trio.lowlevel.current_task())
        if len(tasks) == 4:
            raise ValueError("formatting bug")
        return feed(self, deltas)

    monkeypatch.setattr(ResponseEvents, "feed", flaky)
    _, events = await exchange(app, CHAT, request(12), monkeypatch)
    assert tasks[3] is not tasks[0]  # not the request's task: where the read arrived
    parsed = parse_sse(body_text(events))
    assert parsed[-1] == "[DONE]"
    error = parsed[-2]["error"]
    assert error["type"] == "server_error" and "formatting bug" not in error["message"]
    assert type(events[-1]) is h11.EndOfMessage
    assert len([c for c in parsed[:-2] if c["choices"]]) == 4  # the role, the first 3 reads
    assert json.dumps(parsed).count('"finish_reason":"length"') == 0
