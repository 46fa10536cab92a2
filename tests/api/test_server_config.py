"""``trio_infer/server.py``: the hypercorn configuration ``serve`` runs, and the refusal of a
connection past the cap (its behaviour against a real server: tests/runtime/test_connection_limits.py);
the listen backlog raised at the app's startup (``widen_backlogs``) and the idle timer of
change 6, under a mock clock."""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from hypercorn.config import Config

from trio_infer import server
from trio_infer.api.errors import error_body
from trio_infer.settings import Settings, Wiring


def test_the_config_comes_from_the_settings_and_the_wiring() -> None:
    settings = Settings(host="0.0.0.0", port=8123, max_connections=7, keep_alive_timeout_s=3.5,
                        max_header_bytes=4096)
    config = server.hypercorn_config(settings)
    assert isinstance(config, Config) and config.bind == ["0.0.0.0:8123"]
    assert config.max_connections == 7 and config.open_connections == 0
    assert config.keep_alive_timeout == 3.5 and config.backlog == 2048
    assert config.h11_max_incomplete_size == config.h2_max_header_list_size == 4096
    # a front end of --api-workers serves on the socket its supervisor bound
    assert server.hypercorn_config(settings, Wiring(listen_fd=9)).bind == ["fd://9"]


def test_the_refusal_is_the_503_envelope_of_every_other_503() -> None:
    head, _, body = server.REFUSAL.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"connection: close" in head and b"retry-after: 1" in head
    assert f"content-length: {len(body)}".encode() in head
    assert json.loads(body) == error_body(
        "too many open connections to this server; retry later", "server_error",
        code="too_many_connections",
    )


def test_install_is_idempotent_and_leaves_other_configs_alone() -> None:
    import hypercorn.trio.run as run_module
    from hypercorn.protocol.h11 import H11Protocol

    assert server.install() and server.install()
    patched = run_module.TCPServer
    assert patched.__name__ == "CappedTCPServer" and H11Protocol._maybe_recycle.__name__ == "_maybe_recycle"
    # The changes test for a ServerConfig; a plain hypercorn Config is served as hypercorn does.
    assert not isinstance(Config(), server.ServerConfig)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO and /proc/self/fd")
def test_widen_backlogs_raises_a_short_listen_backlog_and_never_lowers_one() -> None:
    # The bare hypercorn command listens with hypercorn's 100 before the app starts; the app's
    # startup raises it, so a burst's SYNs are not dropped (server.widen_backlogs).
    with socket.create_server(("127.0.0.1", 0), backlog=100) as short, \
            socket.create_server(("127.0.0.1", 0), backlog=server.BACKLOG + 1000) as long_, \
            socket.socket() as unbound:
        assert server._listen_backlog(short) == 100
        raised = server.widen_backlogs()
        assert short.fileno() in raised and long_.fileno() not in raised
        assert unbound.fileno() not in raised
        assert server._listen_backlog(short) == server.BACKLOG
        assert server._listen_backlog(long_) == server.BACKLOG + 1000
        # the descriptors are still their owners': the sockets still accept
        with socket.create_connection(short.getsockname()):
            conn, _ = short.accept()
            conn.close()
        assert server.widen_backlogs() == []


class _Connection:
    """What server._IdleTimer reads of hypercorn's TCPServer: its config, the worker's
    context (``terminated``), its stream and the close. The stream is None (not a socket: a
    TLS stream, say), whose timer starts at the first ``restart`` as hypercorn's does, unless a
    test gives it a socket (change 11)."""

    def __init__(self, keep_alive_timeout: float) -> None:
        from hypercorn.trio.worker_context import WorkerContext

        self.config = Config()
        self.config.keep_alive_timeout = keep_alive_timeout
        self.context = WorkerContext(None)
        self.stream: Any = None
        self.closed_at: list[float] = []

    async def _initiate_server_close(self) -> None:
        self.closed_at.append(trio.current_time())


class _TaskGroup:  # hypercorn's TaskGroup keeps its nursery as _nursery
    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery


def _run_timer(scenario: Any) -> list[float]:
    """The times the timer closed the connection (a mock clock, from 0), and the time the
    connection's task group was done."""
    async def main() -> list[float]:
        connection = _Connection(keep_alive_timeout=5.0)
        timer = server._IdleTimer(connection)
        async with trio.open_nursery() as nursery:
            await scenario(timer, _TaskGroup(nursery), connection)
            timer.end()  # whatever is left of the timer's task ends with the connection's reading
        return connection.closed_at + [trio.current_time()]

    return trio.run(main, clock=MockClock(autojump_threshold=0))


def test_the_idle_timer_closes_an_idle_connection_after_the_keep_alive_timeout() -> None:
    async def scenario(timer: Any, group: Any, connection: Any) -> None:
        await timer.restart(group, None)  # the connection opened
        await trio.sleep(4)
        await timer.stop()  # a request: not idle
        await trio.sleep(100)  # a long request is never cut
        await timer.restart(group, None)  # its response ended: idle again, from now
        await trio.sleep(10)

    assert _run_timer(scenario) == [104 + 5, 114]


def test_the_idle_timer_at_termination_closes_idle_connections_only() -> None:
    async def scenario(timer: Any, group: Any, connection: Any) -> None:
        await timer.restart(group, None)
        await timer.stop()  # a request in flight when the server terminates
        await trio.sleep(1)
        await connection.context.terminated.set()
        await trio.sleep(50)
        assert connection.closed_at == []  # hypercorn's timer was stopped: the request goes on
        await timer.restart(group, None)  # idle after termination: closed at once
        await trio.sleep(1)

    assert _run_timer(scenario) == [51, 52]


def test_the_idle_timer_ends_without_a_close_when_the_reading_ends() -> None:
    async def scenario(timer: Any, group: Any, connection: Any) -> None:
        await timer.restart(group, None)
        await trio.sleep(1)
        timer.end()  # the client closed the connection: its task ends now, not at the timeout
        await timer.restart(group, None)  # nothing starts again

    assert _run_timer(scenario) == [1]  # no close, and the task group was done at once


def _run_socket_timer(scenario: Any) -> list[float]:
    """_run_timer for a connection over a socket (change 11): the scenario also gets the
    connection's task group's nursery, to count the timer's task."""
    async def main() -> list[float]:
        connection = _Connection(keep_alive_timeout=5.0)
        ours, theirs = socket.socketpair()
        with theirs:
            connection.stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
            timer = server._IdleTimer(connection)
            async with trio.open_nursery() as nursery:
                await scenario(timer, _TaskGroup(nursery), connection, nursery)
                timer.end()
            await connection.stream.aclose()
        return connection.closed_at + [trio.current_time()]

    return trio.run(main, clock=MockClock(autojump_threshold=0))


def test_the_idle_timer_of_a_socket_starts_its_task_only_when_idle_and_its_read_waits() -> None:
    async def scenario(timer: Any, group: Any, connection: Any, nursery: trio.Nursery) -> None:
        await timer.restart(group, None)  # the connection opened, its request already in
        await trio.sleep(1)
        await timer.stop()  # the request was read: not idle
        timer.waiting(True)  # the read waits for the client's next bytes
        await trio.sleep(100)  # a long request
        assert nursery.child_tasks == set()  # no timer task so far
        await timer.restart(group, None)  # its response ended, the read waiting: idle from now
        assert len(nursery.child_tasks) == 1
        await trio.sleep(10)

    assert _run_socket_timer(scenario) == [101 + 5, 111]


def test_the_idle_timer_of_a_socket_that_is_idle_starts_when_its_read_waits() -> None:
    async def scenario(timer: Any, group: Any, connection: Any, nursery: trio.Nursery) -> None:
        await timer.restart(group, None)  # opened, nothing read yet
        await trio.sleep(2)
        timer.waiting(True)  # no bytes: the read waits, idle since 0
        assert len(nursery.child_tasks) == 1
        await trio.sleep(10)

    assert _run_socket_timer(scenario) == [5, 12]  # closed at 0 + 5, not 2 + 5


def test_the_idle_timer_of_a_closed_socket_starts_no_task() -> None:
    async def scenario(timer: Any, group: Any, connection: Any, nursery: trio.Nursery) -> None:
        timer.waiting(True)
        await connection.stream.aclose()  # a response that said Connection: close
        await timer.restart(group, None)  # change 2's restart after it
        assert nursery.child_tasks == set()

    assert _run_socket_timer(scenario) == [0]


def test_the_idle_timer_ended_before_its_task_ran_ends_at_once() -> None:
    async def scenario(timer: Any, group: Any, connection: Any, nursery: trio.Nursery) -> None:
        timer.waiting(True)
        await timer.restart(group, None)  # the task is started, not yet run
        timer.end()  # the client closed it in the same round

    assert _run_socket_timer(scenario) == [0]  # no close, no wait for the deadline


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def test_a_burst_of_connections_is_taken_in_one_round_in_the_kernels_order() -> None:
    # Change 7: the clients' connects are complete (the kernel queued them) before the server
    # accepts; the first accept waits as trio's does, the other four come back without a
    # schedule point, so serve_listeners starts all five tasks in one round.
    async def main() -> None:
        listening = _listening_socket()
        address = listening.getsockname()
        clients = [socket.create_connection(address) for _ in range(5)]
        listener = server.BurstListener(trio.SocketListener(trio.socket.from_stdlib_socket(listening)))
        try:
            streams = [await listener.accept()]
            for _ in range(4):
                with trio.testing.assert_no_checkpoints():
                    streams.append(await listener.accept())
            assert [s.socket.getpeername() for s in streams] == [c.getsockname() for c in clients]
            # each is a trio stream that works, with trio's TCP_NODELAY
            for client, stream in zip(clients, streams):
                client.sendall(b"x")
                assert await stream.receive_some(1) == b"x"
                assert stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            # the queue is empty again: the next accept waits for a new connection
            with trio.move_on_after(0.05) as waited:
                await listener.accept()
            assert waited.cancelled_caught
            for stream in streams:
                await stream.aclose()
        finally:
            await listener.aclose()
            for client in clients:
                client.close()

    trio.run(main, clock=MockClock(autojump_threshold=0))  # the 0.05 s wait jumps


def test_closing_a_burst_listener_closes_what_it_took_and_its_socket() -> None:
    async def main() -> None:
        listening = _listening_socket()
        address = listening.getsockname()
        clients = [socket.create_connection(address) for _ in range(3)]
        listener = server.BurstListener(trio.SocketListener(trio.socket.from_stdlib_socket(listening)))
        first = await listener.accept()
        assert len(listener.queue) == 2  # taken, not yet handed out
        await listener.aclose()
        await first.aclose()
        for client in clients:  # every server side is closed: each client reads end of file
            client.settimeout(5)
            assert client.recv(1) == b""
            client.close()
        with pytest.raises(OSError):
            socket.create_connection(address, timeout=1)  # nothing listens any more

    trio.run(main)


def test_hypercorn_serves_through_burst_listeners_once_installed() -> None:
    import hypercorn.trio.run as run_module

    assert server.install()
    assert run_module.trio.serve_listeners is server._serve_listeners
    assert run_module.trio.open_nursery is trio.open_nursery  # the rest is trio's own


def _http_stream(app_put: Any) -> Any:
    """A hypercorn HTTP/1.1 stream whose request was received and handed to an app whose
    receive channel is ``app_put``, as hypercorn has it when the app runs."""
    from hypercorn.protocol.http_stream import HTTPStream

    async def send(event: Any) -> None:
        pass

    stream = HTTPStream(None, Config(), None, None, False, None, None, send, 1)
    stream.scope, stream.start_time, stream.app_put = {}, 0.0, app_put
    return stream


def test_a_stream_closed_before_its_response_ends_cancels_the_registered_scope() -> None:
    """server.py change 9: the route's scope is cancelled by the close itself (no task watches
    for ``http.disconnect``), and the app still gets its ``http.disconnect``."""
    from hypercorn.protocol.events import StreamClosed

    assert server.install()

    async def main() -> None:
        put: list[Any] = []

        async def app_put(message: Any) -> None:
            put.append(message)

        stream = _http_stream(app_put)
        scope = trio.CancelScope()
        assert server.cancel_on_close(stream.app_send, scope)
        assert not scope.cancel_called
        await stream.handle(StreamClosed(stream_id=1))  # the client went away mid-response
        assert scope.cancel_called
        assert put == [{"type": "http.disconnect"}]

    trio.run(main)


def test_a_stream_closed_after_its_response_cancels_nothing() -> None:
    """hypercorn closes the stream at the end of every response, from inside the app's last
    send: that close must not cancel the route (it would cancel hypercorn's recycle too)."""
    from hypercorn.protocol.events import StreamClosed
    from hypercorn.protocol.http_stream import ASGIHTTPState

    assert server.install()

    async def main() -> None:
        async def app_put(message: Any) -> None:
            pass

        stream = _http_stream(app_put)
        scope = trio.CancelScope()
        assert server.cancel_on_close(stream.app_send, scope)
        stream.state = ASGIHTTPState.CLOSED  # the response was sent whole
        await stream.handle(StreamClosed(stream_id=1))
        assert not scope.cancel_called

    trio.run(main)


def test_cancel_on_close_of_a_closed_stream_cancels_at_once_and_of_another_server_declines() -> None:
    from hypercorn.protocol.events import StreamClosed

    assert server.install()

    async def main() -> None:
        async def app_put(message: Any) -> None:
            pass

        stream = _http_stream(app_put)
        await stream.handle(StreamClosed(stream_id=1))
        scope = trio.CancelScope()
        assert server.cancel_on_close(stream.app_send, scope)
        assert scope.cancel_called

        async def other_send(message: Any) -> None:  # another ASGI server's send
            pass

        other = trio.CancelScope()
        assert not server.cancel_on_close(other_send, other)  # the route watches receive itself
        assert not other.cancel_called

    trio.run(main)


# -- change 12: h11's header validation kept for the same headers -------------------------------

# Pairs from a small pool (so that lists share pairs and prefixes, as responses do) or drawn
# freely (valid and invalid names and values alike).
_HEADER_PAIR = st.one_of(
    st.sampled_from([(b"content-type", b"text/event-stream"), (b"Content-Length", b"12"),
                     (b"content-length", b"13"), (b"transfer-encoding", b"chunked"),
                     (b"transfer-encoding", b"gzip"), ("date", "Sat"), (b"a b", b"x"),
                     (b"x", b"a\r\nb"), (b"x", "\u00e9")]),
    st.tuples(st.binary(max_size=8), st.binary(max_size=8)),
)


def _outcome(validate: Any, headers: Any) -> tuple[str, Any]:
    import h11

    try:
        return "ok", list(validate(headers))
    except (h11.LocalProtocolError, TypeError, UnicodeError) as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.lists(_HEADER_PAIR, max_size=4), min_size=1, max_size=6),
       st.lists(st.integers(0, 5), max_size=12), st.integers(1, 4))
def test_the_header_memo_gives_what_h11_gives_every_time(
    lists: list[list[Any]], order: list[int], limit: int,
) -> None:
    import h11._headers as h11_headers

    original = _h11_validate()
    memo = server._HeaderMemo(original, h11_headers.Headers, limit=limit)
    # Every list, then some again in any order, through one memo: each answer is h11's own.
    for i in [*range(len(lists)), *(k % len(lists) for k in order)]:
        assert _outcome(memo, list(lists[i])) == _outcome(original, list(lists[i]))
        if _outcome(original, list(lists[i]))[0] == "ok":  # a parsed Headers, as h11 passes back
            parsed = original(list(lists[i]))
            assert _outcome(memo, parsed) == _outcome(original, parsed)
        assert len(memo._seen) <= limit  # bounded: forgotten, never grown past it


def test_the_header_memo_passes_through_what_it_cannot_key() -> None:
    import h11._headers as h11_headers

    calls: list[Any] = []

    def validate(headers: Any, _parsed: bool = False) -> Any:
        calls.append(headers)
        return h11_headers.Headers([])

    memo = server._HeaderMemo(validate, h11_headers.Headers)
    memo([[b"a", b"b"]])  # a list for a pair: unhashable
    memo([(b"a", bytearray(b"b"))])
    memo([(b"a", b"b")], True)  # the parser's own headers are never kept
    memo([(b"a", b"b")], True)
    memo([(b"a", b"b")])
    memo([(b"a", b"b")])  # kept from the call before
    assert len(calls) == 5


def _h11_validate() -> Any:
    """h11's own ``normalize_and_validate``, whether or not ``install`` replaced it."""
    import h11._headers as h11_headers

    found = h11_headers.normalize_and_validate
    return found._validate if isinstance(found, server._HeaderMemo) else found


# -- change 13: an ASGI message already there is taken without a schedule point ------------------

async def test_received_takes_a_waiting_message_and_says_none_otherwise() -> None:
    send, receive = trio.open_memory_channel[dict[str, Any]](2)
    assert server.received(receive.receive) is None  # nothing there yet
    send.send_nowait({"type": "http.request"})
    assert server.received(receive.receive) == {"type": "http.request"}

    async def elsewhere() -> dict[str, Any]:  # another server's receive: always awaited
        return {"type": "http.request"}

    assert server.received(elsewhere) is None
    await send.aclose()
    assert server.received(receive.receive) is None  # the end: awaiting receive() raises it


async def test_a_plain_connection_is_served_without_a_tls_handshake_attempt(tokenizer, monkeypatch) -> None:
    """Change 15: hypercorn's ``run`` calls ``do_handshake`` (in a ``fail_after``) on every
    connection and learns that it is plain TCP from the ``AttributeError``; a
    ``trio.SocketStream`` is served without the attempt, and its response is whole."""
    import h11

    from .helpers import body_text, exchange, make_app

    calls: list[Any] = []

    def do_handshake(self: Any) -> None:  # what a plain stream's missing attribute raises
        calls.append(self)
        raise AttributeError("do_handshake")

    monkeypatch.setattr(trio.SocketStream, "do_handshake", do_handshake, raising=False)
    _, events = await exchange(make_app(tokenizer), "/v1/chat/completions", {
        "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0}, monkeypatch)
    assert type(events[0]) is h11.Response and events[0].status_code == 200
    assert json.loads(body_text(events))["usage"]["completion_tokens"] == 2
    assert calls == []
