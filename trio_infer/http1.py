"""The HTTP/1.1 fast path (server.py, change 16): plain requests served on their connection's
own task, without hypercorn's protocol objects; and :class:`BodyWriter`, how a streamed response
writes its chunks.

Why: in a burst of 256 new connections, each with one short request, hypercorn's path (h11's
parser and state machine, ``ProtocolWrapper``, ``H11Protocol``, ``HTTPStream``, a task and a
memory channel for the app, the recycle at the end) was the largest part of the front end's work
per request (py-spy, docs/benchmarks.md). A prototype that parsed the head itself and called the
app in the connection's task used about 30% less CPU a request; this is that prototype made whole.

What takes this path (:func:`parse_head`): a request whose head is already read when the
connection looks for it, in the form every HTTP client sends: an upper-case method other than
HEAD, CONNECT and PRI; an origin-form target (``/...``) of visible ASCII; ``HTTP/1.1``; header
lines h11 would accept; one ``Host``; at most one ``Content-Length`` of digits; no
``Transfer-Encoding``, ``Expect`` or ``Upgrade``, and no ``upgrade`` in ``Connection``.
Everything else (a head still arriving, a chunked body, ``Expect: 100-continue``, HTTP/1.0, an
upgrade, a head h11 would refuse or one past the header limit) goes to hypercorn with the bytes
read so far, from that request on: hypercorn then serves the connection exactly as if it had
read those bytes itself (its errors, its limits, its timers, whose idle time counts from when
the fast path began to wait). Between requests the fast path waits itself, under hypercorn's
``keep_alive_timeout`` (also the time a head may take, as under hypercorn), and an idle
connection is closed at once when the server terminates (:class:`Termination`).

What the app sees is what hypercorn gives it: the same scope (h11's lower-cased headers,
hypercorn's ``path``, ``raw_path``, ``state``), the body in ``http.request`` messages, and
``http.disconnect`` once the client is gone or the response has ended. What the client sees is
what hypercorn and h11 write: the same status line (no reason phrase), the app's headers, then
``date`` and ``server``, ``Transfer-Encoding: chunked`` for a body of no declared length,
``Connection: close`` where h11 adds it, an error in the app as hypercorn's empty 500. A client
gone is learnt from a write that fails, or, while the app waits, from a task that watches the
socket (started only when the app asks: :meth:`Exchange.on_close`, or ``receive`` after the
body). A response that closes the connection before its request's body was read (413, 408)
is followed by a lingering close (:meth:`Connection._linger`).
"""

from __future__ import annotations

import functools
import os
import re
import socket
import time
from typing import Any, Callable
from urllib.parse import unquote
from wsgiref.handlers import format_date_time

import trio

from trio_infer.api.sse import NEXT_SEND_FOLLOWS

MAX_RECV = 2**16  # hypercorn's read size

# RFC 9110 token, and h11's field value made stricter (visible ASCII and obs-text only): a head
# outside these goes to hypercorn, which accepts or refuses it as it always has.
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"([A-Z]+) (/[!-~]*) HTTP/1\.1")
_FIELD = re.compile(rb"(" + _TOKEN + rb"):[ \t]*((?:[!-~\x80-\xff]+(?:[ \t]+[!-~\x80-\xff]+)*)?)[ \t]*")
_NAME = re.compile(_TOKEN)
_VALUE = re.compile(rb"[\t -~\x80-\xff]*")  # a response header's value: no CR, LF or NUL
_NOT_HERE = frozenset({b"HEAD", b"CONNECT", b"PRI"})
_HANDED_OVER = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"te"})


class Head:
    """A plain request's head (:func:`parse_head`): what the scope and the framing need."""

    __slots__ = ("method", "target", "headers", "length", "close", "size")

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                 length: int, close: bool, size: int) -> None:
        self.method = method
        self.target = target
        self.headers = headers  # h11's: names lower-cased, values stripped
        self.length = length  # the body's declared length (0 when none is declared)
        self.close = close  # the client said Connection: close
        self.size = size  # bytes of the head, its blank line included


NEED_MORE = "need more"  # parse_head: the head is not all here yet


def parse_head(data: bytes, limit: int) -> Head | str | None:
    """The plain request at the start of ``data``: a :class:`Head`; :data:`NEED_MORE` when its
    head is not all there yet (and ``data`` is within ``limit``); None when it is not a request
    this path serves (hypercorn takes it from here). Never raises."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return NEED_MORE if len(data) <= limit else None
    if end + 4 > limit:
        return None
    lines = data[:end].split(b"\r\n")
    line = _REQUEST_LINE.fullmatch(lines[0])
    if line is None or line[1] in _NOT_HERE:
        return None
    headers = []
    hosts = 0
    length = None
    close = False
    for raw in lines[1:]:
        field = _FIELD.fullmatch(raw)
        if field is None:
            return None
        name, value = field[1].lower(), field[2]
        if name in _HANDED_OVER:
            return None
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            if length is not None or not value.isdigit() or len(value) > 18:
                return None
            length = int(value)
        elif name == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"upgrade" in tokens:
                return None
            close = close or b"close" in tokens
        headers.append((name, value))
    if hosts != 1:
        return None
    return Head(line[1], line[2], headers, length or 0, close, end + 4)


@functools.lru_cache(maxsize=2)
def _date(second: int) -> bytes:
    return b"date: " + format_date_time(second).encode("ascii") + b"\r\n"


def frame_chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body, framed as h11's ``ChunkedWriter`` frames it."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class Connection:
    """One plain TCP connection's requests on the fast path. ``server`` is its hypercorn
    ``TCPServer`` (server.py's subclass): the app, the configuration, the worker's context, the
    stream, and the writes (``send_raw``, ``send_nowait``, ``rest``, ``send_lock``: changes 3
    and 14), which this path shares with hypercorn's so that a connection's bytes stay in order
    whoever writes them."""

    def __init__(self, server: Any, client: Any, address: Any) -> None:
        self.server = server
        self.client = client
        self.address = address
        self.buffer = b""  # read, not yet served
        self.served = 0
        self.exchange: Exchange | None = None  # the request being served
        self.idle_since = trio.current_time()  # when the connection began to wait for a request

    async def serve(self) -> bytes | None:
        """Serve requests while the next one is plain. Returns the bytes read and not served,
        for hypercorn to serve the connection from there (:attr:`idle_since` says since when
        the connection has waited for that request); None when the connection is done (the
        client closed it, it idled past ``keep_alive_timeout``, the server is terminating, or
        it must close after its response)."""
        config = self.server.config
        if config.server_names or config.alt_svc_headers:
            return b""  # hypercorn's checks and headers for those
        limit = config.h11_max_incomplete_size
        terminated = self.server.context.terminated
        async with trio.open_nursery() as nursery:
            while True:
                if not self.buffer:
                    data = self.read_now()
                    if data is None:
                        # Nothing yet: a round of the run loop first (under load, a round
                        # brings most clients' requests), then the idle wait.
                        await trio.lowlevel.checkpoint()
                        data = self.read_now()
                    while data is None:
                        if not await self._wait(self.idle_since + config.keep_alive_timeout):
                            return None
                        data = self.read_now()
                    if not data:
                        return None  # the client closed between requests
                    self.buffer = data
                head = parse_head(self.buffer, limit)
                if head is NEED_MORE:  # one more read without waiting; then hypercorn's
                    data = self.read_now()
                    if data:
                        self.buffer += data
                        head = parse_head(self.buffer, limit)
                if not isinstance(head, Head):
                    return self.buffer
                body = self.buffer[head.size:head.size + head.length]
                self.buffer = self.buffer[head.size + len(body):]
                self.served += 1
                exchange = self.exchange = Exchange(self, nursery, head, body)
                try:
                    await exchange.run()
                finally:
                    self.exchange = None
                if not exchange.reusable() or terminated.is_set():
                    if exchange.complete and exchange.left and not exchange.is_gone \
                            and not terminated.is_set():
                        await self._linger()
                    return None
                self.idle_since = trio.current_time()

    async def _wait(self, deadline: float) -> bool:
        """Wait for the socket to become readable: True once it is (bytes, or the client's
        close); False at ``deadline``, or when the server begins to terminate (as hypercorn's
        idle timer closes an idle connection at once then): the wait is one of
        :class:`Termination`'s idle waits, so no task waits for the termination."""
        server = self.server
        terminated = server.context.terminated
        if terminated.is_set():
            return False
        with trio.CancelScope(deadline=deadline) as idle:
            waits = terminated.idle if type(terminated) is Termination else set()
            waits.add(idle)
            try:
                await trio.lowlevel.wait_readable(server.stream.socket)
            finally:
                waits.discard(idle)
            return True
        return False

    async def _linger(self) -> None:
        """After a response that closes the connection before its request's body was all read
        (a 413 or a 408, answered with ``Connection: close``): the write side is shut (the
        client reads the response, then the end) and what the client still sends is read and
        dropped until it closes, for at most ``keep_alive_timeout``. Closing a socket with
        unread bytes would reset the connection, and the client could lose the response;
        hypercorn's path keeps such a socket open that long too (server.py, change 2)."""
        sock = self.server.stream.socket
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        deadline = trio.current_time() + self.server.config.keep_alive_timeout
        while (data := self.read_now()) != b"":
            if data is None and not await self._wait(deadline):
                return

    def read_now(self) -> bytes | None:
        """Bytes waiting on the socket, read without waiting: None when there are none yet,
        ``b""`` when the client closed (or the connection broke)."""
        try:
            return os.read(self.server.stream.socket.fileno(), MAX_RECV)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def broken(self) -> None:
        """A write found the connection broken (server.py's ``send_raw``)."""
        if self.exchange is not None:
            self.exchange.gone()


class Termination:
    """hypercorn's worker termination event (``WorkerContext.terminated``: ``set``, ``is_set``,
    ``wait``, ``clear``), which also cancels the fast path's idle waits (:attr:`idle`) when it is
    set, so that a connection idle between requests is closed at once when the server
    terminates, as hypercorn's idle timer closes its own (server.py installs it in each
    worker's context). Without it each idle wait would need a task of its own waiting for the
    termination, started and cancelled per wait: 3-4% of the front end's CPU in a burst."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.idle: set[trio.CancelScope] = set()

    async def clear(self) -> None:
        self.event = trio.Event()

    async def wait(self) -> None:
        await self.event.wait()

    async def set(self) -> None:
        self.event.set()
        for scope in list(self.idle):
            scope.cancel()

    def is_set(self) -> bool:
        return self.event.is_set()


class Exchange:
    """One request and its response on the fast path: the ASGI ``receive`` and ``send`` its app
    is called with, run in the connection's task (:meth:`run`)."""

    def __init__(self, connection: Connection, nursery: trio.Nursery, head: Head, body: bytes) -> None:
        server = connection.server
        self.connection = connection
        self.server = server
        self.nursery = nursery
        self.head = head
        path, _, query = head.target.partition(b"?")
        self.scope = {
            "type": "http", "http_version": "1.1", "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": head.method.decode("ascii"), "scheme": "http",
            "path": unquote(path.decode("ascii")), "raw_path": path, "query_string": query,
            "root_path": server.config.root_path, "headers": head.headers,
            "client": connection.client, "server": connection.address,
            "state": server.state.copy(), "extensions": {},
        }
        self.body = body  # read, not yet given to the app
        self.left = head.length - len(body)  # not yet read
        self.body_done = False  # the app has had the whole body
        self.started = False  # the status went (or is held)
        self.complete = False  # the response's last message went
        self.chunked = False
        self.no_body = False
        self.close = head.close or connection.served >= server.config.keep_alive_max_requests
        self.held = b""  # written bytes held for the next send (change 5)
        self.response: dict[str, Any] | None = None  # the app's http.response.start
        self.is_gone = False  # the client went away
        self.ended: trio.Event | None = None  # set when gone or complete, for a waiting receive
        self.on_close_scope: trio.CancelScope | None = None
        self.watch_scope: trio.CancelScope | None = None

    # -- the app's side ------------------------------------------------------------------------

    async def run(self) -> None:
        """Call the app; what hypercorn's ``_handle`` does around it: an error is logged and,
        before the status, answered with an empty 500 that closes the connection."""
        server = self.server
        start = time.time()
        try:
            await server.app(self.scope, self.receive, self.send, trio.to_thread.run_sync,
                             trio.from_thread.run)
        except trio.Cancelled:
            raise
        except BaseExceptionGroup as error:
            _, others = error.split(trio.Cancelled)
            if others is None:
                raise
            await server.config.log.exception("Error in ASGI Framework")
        except Exception:
            await server.config.log.exception("Error in ASGI Framework")
        finally:
            if self.watch_scope is not None:
                self.watch_scope.cancel()
        if not self.started and not self.is_gone:
            self.scope.pop(NEXT_SEND_FOLLOWS, None)
            await self.send({"type": "http.response.start", "status": 500,
                             "headers": [(b"content-length", b"0"), (b"connection", b"close")]})
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        elif self.held:
            data, self.held = self.held, b""
            await self._write(data)
        if server.config.log.access_logger is not None:
            await server.config.log.access(self.scope, self.response, time.time() - start)

    def reusable(self) -> bool:
        """Whether the connection can take its next request: the response went whole, the
        client is there and did not say close, and its body was all read."""
        return self.complete and not self.close and not self.is_gone and self.left == 0

    def receive_nowait(self) -> dict[str, Any] | None:
        """The next body message if it is here (change 13's ``received``), else None."""
        if self.body_done or (not self.body and self.left):
            return None
        body, self.body = self.body, b""
        self.body_done = self.left == 0
        return {"type": "http.request", "body": body, "more_body": not self.body_done}

    async def receive(self) -> dict[str, Any]:
        message = self.receive_nowait()
        if message is not None:
            return message
        if not self.body_done and not self.is_gone:
            try:
                data = await self.server.stream.receive_some(min(self.left, MAX_RECV))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if data:
                self.body, self.left = bytes(data), self.left - len(data)
                return self.receive_nowait()  # type: ignore[return-value]
            self.gone()
        if not self.is_gone and not self.complete:
            self._watch()
            if self.ended is None:
                self.ended = trio.Event()
            await self.ended.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start" and not self.started:
            data = self._head(int(message["status"]), message.get("headers", ()))  # may raise
            self.response = message
            self.started = True
            if self.scope.pop(NEXT_SEND_FOLLOWS, False) is True:
                self.held = data  # corked: it goes with the next send (change 5)
            else:
                await self._write(data)
            return
        if kind != "http.response.body" or not self.started or self.complete:
            raise RuntimeError(f"unexpected ASGI message {kind!r} (response started: "
                               f"{self.started}, complete: {self.complete})")
        body = message.get("body", b"")
        more = bool(message.get("more_body", False))
        data = self.held
        self.held = b""
        if body and not self.no_body:
            data += frame_chunk(body) if self.chunked else bytes(body)
        if more:
            if self.scope.pop(NEXT_SEND_FOLLOWS, False) is True:
                self.held = data
                return
        else:
            self.scope.pop(NEXT_SEND_FOLLOWS, None)
            if self.chunked:
                data += b"0\r\n\r\n"
            self.complete = True
            if self.ended is not None:
                self.ended.set()
        await self._write(data)

    def _head(self, status: int, headers: Any) -> bytes:
        """The status line and headers as h11 writes them for hypercorn: no reason phrase, the
        app's headers, hypercorn's ``date`` and ``server``, then what h11 sets (moved to the
        end, title-cased): ``Transfer-Encoding: chunked`` for a body of no declared length, and
        ``Connection`` with ``close`` when it knew before the response that the connection
        closes after it (the client said so, or it served ``keep_alive_max_requests``). An
        app's own ``Connection: close`` is written as the app wrote it, and closes too."""
        lines = []
        length = None
        rewrite = self.close  # h11 sets Connection itself only when it knew before the response
        tokens: set[bytes] = set()  # the app's Connection tokens
        for name, value in headers:
            name, value = bytes(name).strip(), bytes(value).strip()
            if not _NAME.fullmatch(name) or not _VALUE.fullmatch(value):
                raise ValueError(f"invalid response header {name!r}: {value!r}")
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)
            elif lower == b"transfer-encoding":
                raise ValueError("the server frames the body: no transfer-encoding from the app")
            elif lower == b"connection":
                tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
                if rewrite:  # h11 writes its own Connection header below
                    continue
            lines.append(b"%b: %b\r\n" % (name, value))
        self.close = self.close or b"close" in tokens  # (only once every header is valid)
        config = self.server.config
        if config.include_date_header:
            lines.append(_date(int(time.time())))
        if config.include_server_header:
            lines.append(b"server: hypercorn-h11\r\n")
        self.no_body = status < 200 or status in (204, 304)
        if not self.no_body and length is None:
            self.chunked = True
            lines.append(b"Transfer-Encoding: chunked\r\n")
        if rewrite:
            tokens.discard(b"keep-alive")
            tokens.add(b"close")
            lines.append(b"Connection: %b\r\n" % b", ".join(sorted(tokens)))
        return b"HTTP/1.1 %d \r\n%b\r\n" % (status, b"".join(lines))

    async def _write(self, data: bytes) -> None:
        if data and not self.is_gone:
            await self.server.send_raw(data)

    # -- a client gone -------------------------------------------------------------------------

    def gone(self) -> None:
        """The client went away (a read found the close, or a write the broken connection)."""
        if self.is_gone:
            return
        self.is_gone = True
        if self.on_close_scope is not None and not self.complete:
            self.on_close_scope.cancel()
        if self.ended is not None:
            self.ended.set()
        if self.watch_scope is not None:
            self.watch_scope.cancel()

    def on_close(self, scope: trio.CancelScope) -> bool:
        """Change 9: ``scope`` cancelled if the client goes away before the response is
        complete (at once if it has). False, registering nothing, while the body is still
        being read (the caller watches ``receive`` itself then)."""
        if self.is_gone:
            scope.cancel()
            return True
        if not self.body_done:
            return False
        self.on_close_scope = scope
        self._watch()
        return True

    def _watch(self) -> None:
        if self.watch_scope is None and not self.complete:
            self.watch_scope = trio.CancelScope()
            self.nursery.start_soon(self._watch_socket, self.watch_scope)

    async def _watch_socket(self, scope: trio.CancelScope) -> None:
        """Wait for the socket to become readable while the app runs: the client's close (or
        reset) means it is gone; bytes of a next request are kept for the connection (read
        once, then not watched further: the response's writes would find a close)."""
        if scope.cancel_called:  # the response ended before this task first ran: the
            return  # connection's task may be waiting on the socket already
        sock = self.server.stream.socket
        with scope:
            while True:
                await trio.lowlevel.wait_readable(sock)
                data = self.connection.read_now()
                if data is None:
                    continue
                if not data:
                    self.gone()
                else:
                    self.connection.buffer += data
                return

    # -- the writer of a streamed response (changes 4 and 14) ----------------------------------

    def writer(self) -> BodyWriter | None:
        """The writer of this response's chunks, once its status went (None before)."""
        return _Writer(self) if self.started and self.chunked and not self.complete else None


class BodyWriter:
    """How a streamed response writes its chunks once its status is sent: ``await
    writer(data)`` in the request's task; :meth:`write_nowait` from any task, without a
    checkpoint, where :meth:`ready` says it can (change 14). Through the ASGI send, neither is
    ever ready."""

    def __init__(self, send: Callable[..., Any]) -> None:
        self.send = send

    async def __call__(self, data: bytes) -> None:
        if data:
            await self.send({"type": "http.response.body", "body": data, "more_body": True})

    # Whether :meth:`write_nowait` can ever be called (change 14's writer), so that a stream
    # does not install a handler whose writer is never ready.
    writes_nowait = False

    def ready(self) -> bool:
        """Whether :meth:`write_nowait` may be called now."""
        return False

    def write_nowait(self, data: bytes) -> bool:
        """Write ``data`` at once: True once all of it went; False when part of it waits for
        the writer's next call (make one soon: ``await writer(b"")``)."""
        raise RuntimeError("not ready")


class SocketWriter(BodyWriter):
    """A response's chunks framed and written straight to its connection's socket (change 4),
    or from another task without a checkpoint (change 14), whenever :meth:`direct` says the
    response can take them that way; otherwise through the ASGI send. ``server`` is the
    connection's ``TCPServer`` (server.py), whose ``send_raw`` and ``send_nowait`` keep the
    connection's bytes in order. The fast path's responses (:class:`Exchange`) and hypercorn's
    HTTP/1.1 streams (server.py) each say when in their own :meth:`direct`."""

    writes_nowait = True

    def __init__(self, send: Callable[..., Any], server: Any) -> None:
        super().__init__(send)
        self.server = server

    def direct(self) -> bool:
        """Whether a chunk may go straight to the socket now."""
        raise NotImplementedError

    async def __call__(self, data: bytes) -> None:
        if not data:
            await self.server.send_raw(b"")  # nothing, or what write_nowait left
        elif self.direct():
            await self.server.send_raw(frame_chunk(data))
        else:  # corked or to cork (change 5), ended, gone: as the ASGI send does it
            await self.send({"type": "http.response.body", "body": data, "more_body": True})

    def ready(self) -> bool:
        server = self.server
        return not server.rest and not server.send_lock.locked() and self.direct()

    def write_nowait(self, data: bytes) -> bool:
        return self.server.send_nowait(frame_chunk(data)) if data else True


class _Writer(SocketWriter):
    """A fast-path response's chunks: straight to the socket unless something is held or to
    be held (change 5), or the response ended or its client left."""

    def __init__(self, exchange: Exchange) -> None:
        super().__init__(exchange.send, exchange.server)
        self.exchange = exchange

    def direct(self) -> bool:
        exchange = self.exchange
        return not exchange.held and not exchange.complete and not exchange.is_gone \
            and NEXT_SEND_FOLLOWS not in exchange.scope
