"""server.py's change 5, seen at the socket: a response's headers go out with its first body
message when the route marks that the two follow each other (a JSON answer; a stream, whose
status goes with its first output), a stream's last chunk with the end of the body, and no
write is empty. Every response is still valid HTTP/1.1 that an h11 client parses whole. Under
hypercorn's own ``Config`` (the bare command), which gets the change from the app's startup as
``serve`` does."""

from __future__ import annotations

import json
import re
from typing import Any

import h11
import pytest

from .helpers import body_text, exchange, make_app


@pytest.fixture
def app(tokenizer: Any) -> Any:
    return make_app(tokenizer)


async def test_a_chat_stream_starts_and_ends_in_one_write_each(app, monkeypatch) -> None:
    writes, events = await exchange(app, "/v1/chat/completions", {
        "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "stream": True, "stream_options": {"include_usage": True}}, monkeypatch)
    assert type(events[0]) is h11.Response and events[0].status_code == 200
    # The headers, the role chunk and the first token's text: one write.
    assert writes[0].startswith(b"HTTP/1.1 200") and b'"role":"assistant"' in writes[0]
    assert writes[0].count(b"data: {") >= 2
    assert writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and b'"usage":{' in writes[-1]
    assert all(writes)
    text = body_text(events)
    assert text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(x[len("data: "):]) for x in text.split("\n\n") if x.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_a_json_answer_is_one_write(app, monkeypatch) -> None:
    writes, events = await exchange(app, "/v1/chat/completions", {
        "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        monkeypatch)
    assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200")
    assert json.loads(body_text(events))["usage"]["completion_tokens"] == 3


async def test_a_completions_streams_headers_go_out_with_its_first_text(app, monkeypatch) -> None:
    """Completions have nothing to say before the first token: the headers wait for it (as
    llama-server's status does), not a write of their own."""
    writes, events = await exchange(app, "/v1/completions", {
        "model": "fake", "prompt": "hi", "max_tokens": 2, "stream": True}, monkeypatch)
    assert writes[0].startswith(b"HTTP/1.1 200") and b'data: {' in writes[0]
    assert b'"text":"' in writes[0]
    assert writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and all(writes)
    assert body_text(events).endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("path,payload,joined", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
    ("/v1/completions", {"prompt": "hi"}, False),
])
async def test_with_a_queue_time_limit_only_a_ready_first_chunk_joins_the_headers(
        tokenizer, monkeypatch, path, payload, joined) -> None:
    """With ``max_queue_time_s`` the status waits for the request's scheduling, and then the
    headers go with the first chunk only when there is one (chat's role chunk); a completions
    stream's headers do not wait for its first token."""
    app = make_app(tokenizer, max_queue_time_s=30)
    writes, events = await exchange(app, path, {"model": "fake", "max_tokens": 2, "stream": True,
                                                **payload}, monkeypatch)
    assert type(events[0]) is h11.Response and events[0].status_code == 200
    assert writes[0].startswith(b"HTTP/1.1 200")
    assert (b"data:" in writes[0]) is joined
    assert writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and all(writes)


async def test_a_streams_middle_chunks_go_straight_to_the_connection(app, monkeypatch) -> None:
    """server.py's change 4 for a whole response (``body_writer``): once the status is out, each
    chunk but the first and the last is framed and written without the ASGI send; the bytes are
    hypercorn's (an h11 client parses the response whole), one write a chunk. (The request is
    plain, so it is served on the fast path, change 16, whose ASGI send is counted.)"""
    from trio_infer.http1 import Exchange

    bodies: list[bytes] = []
    app_send = Exchange.send

    async def counting(self: Any, message: Any) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message.get("body", b""))
        await app_send(self, message)

    monkeypatch.setattr(Exchange, "send", counting)
    writes, events = await exchange(app, "/v1/chat/completions", {
        "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}, monkeypatch)
    text = body_text(events)
    chunks = [json.loads(x[len("data: "):]) for x in text.split("\n\n") if x.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and text.endswith("data: [DONE]\n\n")
    # Through the ASGI send: the role chunk (with the headers), the last chunk, the end.
    assert len(bodies) == 3 and bodies[-1] == b"" and b"[DONE]" in bodies[1]
    # Each middle write is whole chunks: a frame's size line, SSE events, the frame's end. (Not
    # each a token's text: the finish's chunk has none when the last token is a special token,
    # whose text is empty; sampled text met that about once in 340 runs.)
    middle = writes[1:-1]
    assert middle
    assert [w for w in middle if not re.fullmatch(rb"[0-9a-f]+\r\n(data: \{[^\n]*\}\n\n)+\r\n", w)] == []
    assert len(writes) == len(middle) + 2
