"""server.py's change 16, ``trio_infer/http1.py``: plain HTTP/1.1 requests served on their
connection's own task. What it must keep: it takes only what h11 reads the same way (the rest
is hypercorn's, from that request on); the client reads what hypercorn would have written; a
kept-alive connection goes on (pipelined or idle), is closed after ``keep_alive_timeout`` idle
and at once when the server terminates; a client gone mid-request frees everything; an error in
the app is hypercorn's empty 500. Over an in-process hypercorn under its own ``Config`` (the
bare command), which gets the change from the app's startup as ``serve`` does."""

from __future__ import annotations

import json
import re
from typing import Any

import h11
import pytest
import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st
from trio.testing import wait_all_tasks_blocked

from trio_infer import http1
from trio_infer.http1 import NEED_MORE, Head, parse_head

from .helpers import StepGate, all_zero, counts, make_app, served

LIMIT = 16 * 1024


# -- which heads the fast path takes --------------------------------------------------------

_LINES = st.sampled_from([
    b"host: x", b"Host:  example.com ", b"content-length: 5", b"Content-Length: 007",
    b"content-length: 5, 5", b"content-length: -1", b"transfer-encoding: chunked",
    b"connection: close", b"Connection: keep-alive, Close", b"connection: upgrade",
    b"upgrade: h2c", b"expect: 100-continue", b"te: trailers", b"x-a: \xe9t\xe9", b"x-b:",
    b"x-c: a\tb", b"x-d: a\x00b", b"x-e: a\x01b", b"bad name: v", b": v", b"x-f : v",
    b" x-g: folded", b"x-h: v\r", b"accept: */*", b"authorization: Bearer k",
])
_REQUEST_LINES = st.sampled_from([
    b"GET / HTTP/1.1", b"POST /v1/chat/completions HTTP/1.1", b"GET /health?x=1&y=%20 HTTP/1.1",
    b"OPTIONS /v1/completions HTTP/1.1", b"HEAD / HTTP/1.1", b"get / HTTP/1.1", b"GET / HTTP/1.0",
    b"GET http://x/ HTTP/1.1", b"GET * HTTP/1.1", b"PRI * HTTP/2.0", b"GET /a b HTTP/1.1",
    b"GET /%e9 HTTP/1.1", b"GET  / HTTP/1.1", b"GET /\xe9 HTTP/1.1", b"CONNECT x:1 HTTP/1.1",
])


@settings(max_examples=400, deadline=None, derandomize=True)
@given(line=_REQUEST_LINES, fields=st.lists(_LINES, max_size=6), body=st.binary(max_size=8))
@example(line=b"POST / HTTP/1.1", fields=[b"host: x", b"content-length: 5"], body=b"hello")
def test_a_head_the_fast_path_takes_is_one_h11_reads_the_same_way(line, fields, body) -> None:
    """Whatever :func:`parse_head` takes, h11 (hypercorn's parser) reads as the same request:
    the same method, target, headers and body length, and whether the client said close."""
    data = b"\r\n".join([line, *fields]) + b"\r\n\r\n" + body
    head = parse_head(data, LIMIT)
    assert head is not NEED_MORE  # the blank line is there
    if head is None:
        return  # hypercorn's: it accepts or refuses it as it always has
    assert isinstance(head, Head)
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    request = server.next_event()
    assert type(request) is h11.Request
    assert (request.method, request.target) == (head.method, head.target)
    assert list(request.headers) == head.headers
    assert request.http_version == b"1.1"
    said = [t.strip().lower() for n, v in request.headers if n == b"connection" for t in v.split(b",")]
    assert head.close == (b"close" in said)
    length = 0
    while type(event := server.next_event()) is h11.Data:
        length += len(event.data)
    assert length == min(head.length, len(body))
    assert head.size == data.index(b"\r\n\r\n") + 4


def test_an_unfinished_head_needs_more_within_the_limit_only() -> None:
    assert parse_head(b"GET / HTTP/1.1\r\nhost: x\r\n", LIMIT) is NEED_MORE
    assert parse_head(b"", LIMIT) is NEED_MORE
    assert parse_head(b"GET / HTTP/1.1\r\nx-a: " + b"a" * LIMIT, LIMIT) is None
    whole = b"GET / HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * LIMIT + b"\r\n\r\n"
    assert parse_head(whole, LIMIT) is None  # past the header limit: hypercorn's 431


# -- what the client reads ---------------------------------------------------------------------

@pytest.fixture
def exchanges(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The target of every request the fast path serves from now on."""
    seen: list[str] = []
    run = http1.Exchange.run

    async def counting(self: http1.Exchange) -> None:
        seen.append(self.head.target.decode())
        await run(self)

    monkeypatch.setattr(http1.Exchange, "run", counting)
    return seen


async def read_response(stream: trio.SocketStream, client: h11.Connection) -> tuple[h11.Response, bytes]:
    """The next whole response on ``stream`` as ``client`` parses it."""
    response, body = None, b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some())
        elif type(event) is h11.Response:
            response = event
        elif type(event) is h11.Data:
            body += event.data
        elif type(event) is h11.EndOfMessage:
            assert response is not None
            return response, body


def _without_date(raw: bytes) -> bytes:
    return re.sub(rb"date: [^\r]*\r\n", b"", raw)


async def _raw_answer(port: int, request: bytes) -> bytes:
    """Everything the server writes for ``request`` on a new connection, up to its close."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        received = b""
        while data := await stream.receive_some():
            received += data
    return received


@pytest.mark.parametrize("request_line,body", [
    (b"GET /health", b""),
    (b"GET /v1/nope", b""),  # quart's 404
    (b"POST /v1/chat/completions", b"{not json"),  # the hot route's 400
    (b"POST /v1/completions", json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 1,
                                           "temperature": 0, "stream": True}).encode()),
])
async def test_the_client_reads_what_hypercorn_would_have_written(
        tokenizer, exchanges, request_line, body) -> None:
    """The same request on the fast path and through hypercorn (a ``TE`` header, which h11
    ignores, sends it there): the same bytes but for the date and a completion's id and time."""
    app = make_app(tokenizer)
    head = request_line + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n" % len(body)
    with trio.fail_after(30):
        async with served(app) as (port, _):
            fast = await _raw_answer(port, head + b"\r\n" + body)
            assert len(exchanges) == 1
            slow = await _raw_answer(port, head + b"te: trailers\r\n\r\n" + body)
            assert len(exchanges) == 1
    unstable = rb'"(id|created)":("[^"]*"|\d+)'
    fast, slow = (re.sub(unstable, b"", _without_date(raw)) for raw in (fast, slow))
    assert fast == slow and fast.startswith(b"HTTP/1.1 ")


async def test_a_kept_alive_connection_is_served_pipelined_and_after_idling(tokenizer, exchanges) -> None:
    """Two requests in one write are answered in order; a third, sent once the connection idles,
    too; all on the fast path."""
    app = make_app(tokenizer)
    probe = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    models = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
    with trio.fail_after(30):
        async with served(app) as (port, _):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                client = h11.Connection(h11.CLIENT)
                await stream.send_all(probe + models)
                answers = []
                for target in ("/health", "/v1/models"):
                    client.send(h11.Request(method="GET", target=target, headers=[("host", "x")]))
                    client.send(h11.EndOfMessage())
                    answers.append(await read_response(stream, client))
                    client.start_next_cycle()
                await wait_all_tasks_blocked()
                await stream.send_all(probe)
                client.send(h11.Request(method="GET", target="/health", headers=[("host", "x")]))
                client.send(h11.EndOfMessage())
                answers.append(await read_response(stream, client))
    assert [r.status_code for r, _ in answers] == [200, 200, 200]
    assert json.loads(answers[1][1])["data"][0]["id"] == "fake"
    assert exchanges == ["/health", "/v1/models", "/health"]


async def test_a_body_that_comes_after_its_head_is_read(tokenizer, exchanges) -> None:
    app = make_app(tokenizer)
    body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()
    with trio.fail_after(30):
        async with served(app) as (port, _):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                      b"content-length: %d\r\n\r\n%s" % (len(body), body[:5]))
                await wait_all_tasks_blocked()
                await stream.send_all(body[5:])
                client = h11.Connection(h11.CLIENT)
                client.send(h11.Request(method="POST", target="/v1/completions",
                                        headers=[("host", "x"), ("content-length", str(len(body)))]))
                client.send(h11.Data(data=body))
                client.send(h11.EndOfMessage())
                response, answer = await read_response(stream, client)
    assert response.status_code == 200
    assert json.loads(answer)["usage"]["completion_tokens"] == 2
    assert exchanges == ["/v1/completions"]


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(
        tokenizer, exchanges, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with served(app, keep_alive_timeout=7) as (port, _):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = await stream.receive_some()
            assert answer.startswith(b"HTTP/1.1 200")
            idle_from = trio.current_time()
            assert await stream.receive_some() == b""  # the server closed it
            assert trio.current_time() - idle_from == pytest.approx(7, abs=0.1)
    assert exchanges == ["/health"]


async def test_an_idle_connection_is_closed_at_once_when_the_server_terminates(
        tokenizer, exchanges, autojump_clock) -> None:
    """Without it, the connection would wait for hypercorn's ``graceful_timeout`` (here 30 s)."""
    app = make_app(tokenizer)
    async with served(app, keep_alive_timeout=60, graceful_timeout=30) as (port, shutdown):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await stream.receive_some()).startswith(b"HTTP/1.1 200")
            await wait_all_tasks_blocked()
            t0 = trio.current_time()
            shutdown.set()
            assert await stream.receive_some() == b""
            assert trio.current_time() == t0
    assert exchanges == ["/health"]


async def test_a_client_gone_before_its_first_token_frees_everything(tokenizer, exchanges) -> None:
    """A stream still queued when its client closes the connection: the socket's watcher
    cancels the route (change 9), which aborts the request."""
    app = make_app(tokenizer)
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 50, "stream": True}).encode()
    with trio.fail_after(30):
        async with served(app) as (port, _):
            gate = StepGate(app)
            gate.hold()
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
            while counts(app)["sessions"] != 1:
                await wait_all_tasks_blocked()
            await stream.aclose()
            while not all_zero(app):
                await wait_all_tasks_blocked()
            gate.allow()
            assert all_zero(app), counts(app)
    assert exchanges == ["/v1/chat/completions"]


async def _both_ways(http: Any) -> tuple[bytes, bytes]:
    """What a client reads for ``GET /x`` from an app whose HTTP requests ``http`` answers (the
    changes installed, as the app's startup would): on the fast path, and through hypercorn."""
    from trio_infer import server

    assert server.install()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await http(scope, receive, send)
        while (message := await receive())["type"] != "lifespan.shutdown":
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    request = b"GET /x HTTP/1.1\r\nhost: x\r\n"
    with trio.fail_after(30):
        async with served(app) as (port, _):
            fast = await _raw_answer(port, request + b"\r\n")
            slow = await _raw_answer(port, request + b"te: trailers\r\n\r\n")
    return fast, slow


async def test_an_error_in_the_app_is_hypercorns_empty_500_and_a_close(exchanges) -> None:
    async def failing(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("a bug")

    fast, slow = await _both_ways(failing)
    assert _without_date(fast) == _without_date(slow)
    assert fast.startswith(b"HTTP/1.1 500 \r\n") and b"connection: close\r\n" in fast
    assert exchanges == ["/x"]


async def test_a_head_still_arriving_goes_to_hypercorn_within_the_same_idle_time(
        tokenizer, exchanges, autojump_clock) -> None:
    """A head that is not all there goes to hypercorn, whose idle timer counts from when the
    connection opened, not from the hand-over: a slow head is cut ``keep_alive_timeout`` after
    the connection opened (header slowloris), not later."""
    app = make_app(tokenizer)
    async with served(app, keep_alive_timeout=7) as (port, _):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        opened = trio.current_time()
        async with stream:
            await trio.sleep(3)
            await stream.send_all(b"GET /health HTTP/1.1\r\nho")
            assert await stream.receive_some() == b""  # closed without an answer
            assert trio.current_time() - opened == pytest.approx(7, abs=0.1)
    assert exchanges == []


async def test_a_refusal_before_the_body_is_read_is_read_whole_by_the_client(
        tokenizer, exchanges, autojump_clock) -> None:
    """A 413 answered before the body was read closes the connection; the server reads and
    drops what the client goes on sending until the client closes (closing with unread bytes
    would reset the connection, which can lose the answer), for ``keep_alive_timeout`` at most."""
    app = make_app(tokenizer, max_body_bytes=1024)
    async with served(app, keep_alive_timeout=7) as (port, _):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                  b"content-length: 100000\r\n\r\n" + b"x" * 500)
            client = h11.Connection(h11.CLIENT)
            client.send(h11.Request(method="POST", target="/v1/completions",
                                    headers=[("host", "x"), ("content-length", "100000")]))
            response, body = await read_response(stream, client)
            assert response.status_code == 413 and (b"connection", b"close") in response.headers
            assert json.loads(body)["error"]["type"] == "invalid_request_error"
            for _ in range(4):  # the server still reads: no reset
                await stream.send_all(b"x" * 4000)
                await wait_all_tasks_blocked()
            assert await stream.receive_some() == b""  # the server's end of the response
            t0 = trio.current_time()
            with trio.move_on_after(60):  # the server stops reading after keep_alive_timeout
                try:
                    while True:
                        await stream.send_all(b"x" * 4000)
                        await trio.sleep(1)
                except trio.BrokenResourceError:  # the server closed: the next send is reset
                    pass
            assert trio.current_time() - t0 <= 9
    assert exchanges == ["/v1/completions"]


_COMPLETION = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 1, "temperature": 0}).encode()
_REQUESTS = {  # name: (request bytes, taken by the fast path)
    "probe": (b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", True),
    "probe via hypercorn": (b"GET /health HTTP/1.1\r\nhost: x\r\nte: trailers\r\n\r\n", False),
    "completion": (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                   % (len(_COMPLETION), _COMPLETION), True),
    "chunked completion": (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked"
                           b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(_COMPLETION), _COMPLETION), False),
    "head": (b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n", False),
}


@settings(max_examples=25, deadline=None, derandomize=True)
@given(names=st.lists(st.sampled_from(sorted(_REQUESTS)), min_size=1, max_size=5),
       cuts=st.lists(st.integers(1, 400), max_size=6))
def test_any_mix_of_requests_on_one_connection_is_answered_in_order(tokenizer, names, cuts) -> None:
    """Requests of both kinds, pipelined on one connection and sent in pieces cut anywhere:
    each is answered, in order; the fast path serves plain ones until the first it does not
    take, and hypercorn serves the rest; the server then serves a new connection."""
    data = b"".join(_REQUESTS[n][0] for n in names)
    pieces, at = [], 0
    for cut in cuts:
        pieces.append(data[at:at + cut])
        at += cut
    pieces.append(data[at:])
    fast = 0
    for name in names:
        if not _REQUESTS[name][1]:
            break
        fast += 1

    async def main() -> None:
        seen: list[str] = []
        run = http1.Exchange.run

        async def counting(self: http1.Exchange) -> None:
            seen.append(self.head.target.decode())
            await run(self)

        app = make_app(tokenizer)
        with pytest.MonkeyPatch.context() as patch, trio.fail_after(30):
            patch.setattr(http1.Exchange, "run", counting)
            async with served(app) as (port, _):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    for piece in pieces:
                        if piece:
                            await stream.send_all(piece)
                            await wait_all_tasks_blocked()
                    client = h11.Connection(h11.CLIENT)
                    for name in names:
                        method = b"HEAD" if name == "head" else b"GET" if "probe" in name else b"POST"
                        target = "/health" if method != b"POST" else "/v1/completions"
                        client.send(h11.Request(method=method, target=target,
                                                headers=[("host", "x"), ("transfer-encoding", "chunked")]
                                                if method == b"POST" else [("host", "x")]))
                        if method == b"POST":
                            client.send(h11.Data(data=_COMPLETION))
                        client.send(h11.EndOfMessage())
                        response, body = await read_response(stream, client)
                        assert response.status_code == 200, (name, body)
                        if method == b"POST":
                            assert json.loads(body)["usage"]["completion_tokens"] == 1
                        elif method == b"GET":
                            assert json.loads(body) == {"status": "ok"}
                        client.start_next_cycle()
                # The fast path serves plain requests up to the first it does not take (one
                # not plain, or a head cut short): never one after it.
                assert len(seen) <= fast
                if fast and b"\r\n\r\n" in pieces[0]:
                    assert seen  # the first head came whole: the fast path took it
                assert (await _raw_answer(port, _REQUESTS["probe"][0][:-2] +
                                          b"connection: close\r\n\r\n")).startswith(b"HTTP/1.1 200")

    trio.run(main)


async def test_a_response_header_the_server_refuses_is_hypercorns_500(exchanges) -> None:
    """An app that sends a header with a line break in it: the start is refused (the app sees
    the error), and the client gets hypercorn's empty 500, as through hypercorn."""
    async def injecting(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"connection", b"close"), (b"x-a", b"b\r\nx-injected: 1")]})

    fast, slow = await _both_ways(injecting)
    assert _without_date(fast) == _without_date(slow)
    assert fast.startswith(b"HTTP/1.1 500 \r\n") and b"injected" not in fast
    assert exchanges == ["/x"]
