"""The HTTP server of ``python -m trio_infer serve``: hypercorn's configuration, and every change
this project makes to hypercorn 0.18, with why each exists.

:func:`hypercorn_config` builds the :class:`ServerConfig` ``serve`` runs hypercorn with: every
option that differs from hypercorn's defaults is set there, next to its reason.

:func:`install` changes two hypercorn classes (it must replace them: hypercorn has no hook for
any of the sixteen changes below). Change 16 is the largest: a plain HTTP/1.1 request (what
every client sends) is served by ``http1.py`` on its connection's own task, without hypercorn's
protocol objects; hypercorn serves the rest (a head it must judge, a chunked body, an upgrade,
TLS), from the first such request of a connection on. Changes 2 to 14 are what hypercorn's own
path keeps; the fast path shares their writes (changes 3, 5 and 14: ``send_raw``,
``send_nowait``) and their hooks (changes 4, 9 and 13: :func:`body_writer`,
:func:`cancel_on_close`, :func:`received`), and does the rest its own way, said there.

Changes 1 and 2 apply only to connections served under a
:class:`ServerConfig`; under any other configuration (``hypercorn trio_infer.app:app`` on the
command line, or another app in the same process) they are hypercorn's own behaviour. Changes
3, 4 and 5 write the same bytes under the same lock, only faster, changes 6 and 11 keep
hypercorn's idle timeout with less work, changes 7, 8 and 10 accept and read the same
connections sooner, change 9 tells the route of a client gone without a task of its own, and
changes 12 and 13 do hypercorn's and h11's same work with less of it, and change 14 lets a
stream's chunks be written from the task that delivers them, so they apply to every
connection once installed (and change 15 skips hypercorn's TLS handshake attempt on a plain
TCP connection, and change 16 serves plain requests without hypercorn's protocol objects):
``serve`` installs all sixteen before it
starts hypercorn, and the app installs them from its lifespan startup (``app.py``), which is
how the bare ``hypercorn trio_infer.app:app`` command gets changes 3 to 16: hypercorn looks ``TCPServer`` and
``trio.serve_listeners`` up in ``hypercorn.trio.run`` when it starts serving, after the app's
startup has run. (Changes 1 and 2 stay off there: the cap and the
timeouts are ``serve``'s settings, which a bare hypercorn's own ``Config`` does not carry.)

1. **A cap on concurrent connections**, which hypercorn lacks (``max_connections``). A connection
   past the cap is accepted, answered 503 in the OpenAI envelope with ``Connection: close``
   (:data:`REFUSAL`, built by ``api/errors.py`` like every other error) and closed at once,
   before hypercorn reads from it: accepting and closing is how a flood is refused fast, where
   leaving connections in the listen backlog would let them pile up until file descriptors run
   out. (A wrapper around the ASGI app could not do it: it sees requests, never connections.)

2. **The keep-alive timer after a response.** After a response, hypercorn's HTTP/1.1 protocol
   ends the request (``H11Protocol._maybe_recycle``): it first sends the app ``http.disconnect``,
   then restarts the connection's idle timer (``TCPServer.protocol_send(Updated(idle=True))`` ->
   ``TrioSingleTask.restart`` -> ``nursery.start``). Both run inside the app's own task (the ASGI
   ``send`` of the last body chunk). quart-trio answers the ``http.disconnect`` by cancelling the
   request's nursery, which cancelled that ``nursery.start`` half-way: the new timer task was
   cancelled as it started. So an idle keep-alive connection was never closed by the server after
   its first response, and a client could hold any number of connections open by sending one
   request on each. The timer is now :class:`_IdleTimer` (change 6), whose restart does not wait
   and so cannot be cancelled half-way; the end of the request is shielded from the app's
   cancellation (hypercorn's recycle must not stop half-way either).

   And a response that says ``Connection: close`` (ours does when it is sent before the
   request's body was read: 408, 413, 431) leaves h11 in ``MUST_CLOSE``, where hypercorn neither
   closes the socket nor starts the idle timer: a client that kept sending, or just kept the
   socket, held the connection for good. The timer is started there too, so such a connection is
   closed ``keep_alive_timeout`` after the response, which leaves the client that long to read it.

3. **A write the socket takes at once skips trio's per-call machinery.** Every token of every
   stream is one write (an SSE event), and hypercorn's write (``TCPServer.protocol_send``: the
   send lock, a shielded cancel scope, ``SocketStream.send_all`` with its conflict detector, the
   socket wrapper's ``_try_sync`` and checkpoints) cost a third of the front end's CPU at 256
   streams (py-spy). When no other task holds the send lock, the bytes go to the socket with
   one ``os.write`` (which does not yield, so no other write can come in between: the lock need
   not be taken for it); only what the socket does not take (a full send buffer: a slow client)
   goes through hypercorn's path, under the lock and shielded as there. A write while another
   task holds the lock takes hypercorn's path whole. Measured with ``bench frontend --compare``
   (256 streams x 20 ms, medians of 3): server CPU per token 106 -> 88 us, gap p99 194 -> 77 ms
   (docs/benchmarks.md).
   Under any configuration (see above), so under bare ``hypercorn`` too.

4. **A streamed chunk skips hypercorn's per-event layers.** Each chunk of a streamed response
   went through hypercorn's ``HTTPStream.app_send`` (its chain of message checks, a copy of the
   body, a ``Body`` event), ``H11Protocol.stream_send``, ``_send_h11_event`` and h11's
   ``Connection.send`` (its state machine, which a body chunk never moves, and the chunked
   writer: ``%x\r\n`` + data + ``\r\n``) before the write: five awaited layers, a tenth of the
   front end's CPU at 256 streams (py-spy). When the response is past its headers (h11 in
   ``SEND_BODY`` with its chunked writer) and the chunk is non-empty bytes with more to come,
   the same framed bytes are handed straight to the connection's write (change 3, its
   ``send_raw``, skipping ``protocol_send`` too; through ``protocol_send`` while the connection
   is corked, change 5); anything
   else (the first and last messages, a HEAD or a fixed-length body, HTTP/2) goes through
   hypercorn's own path. Same bytes, same order, same lock. Like change 3, it applies to every
   connection once installed. The streamed routes go one step further through
   :func:`body_writer`: the connection is found once a response, after its status, and each
   chunk after that is framed and written without the ASGI send and its message at all (a
   chunk to cork, change 5, or a connection no longer sending its body still goes through it).

5. **Two sends that follow each other in one write, and no empty writes.** hypercorn writes
   the headers when the app sends ``http.response.start``, then each body message, then the end
   of the body (``0\r\n\r\n`` for a chunked body, an empty write for a fixed-length one): three
   writes (three syscalls, each through the layers of change 4) for a JSON response, two before
   a stream's first chunk and two for its last chunk and its end. When the app marks the
   request's scope with ``sse.NEXT_SEND_FOLLOWS`` right before a send (the routes do before a
   JSON answer's start, before a stream's start, whose headers go out with its first output:
   ``respond.open_stream`` says why, and before a stream's last chunk), what hypercorn
   writes for that send is held (the connection is *corked*) until it has handled the next send,
   and goes out with it in one write; anything the connection sends that is not bytes (the
   idle timer, a close) writes what is held first. Without the mark everything is written at
   once, as hypercorn does. An empty write is never made. Same bytes, same order, same lock,
   under any configuration.

6. **One idle timer per connection, moved rather than restarted.** hypercorn's idle timer
   (``TrioSingleTask``) starts a new task with ``nursery.start`` each time a connection becomes
   idle (when it opens, after each response) and cancels it when a request starts: per request
   two task starts, each a handshake of two rounds of the run loop under a lock, and one task's
   exit. In a burst of 256 new connections the end of a request (hypercorn's recycle, the
   timer, the close) went from 21% to 15% of the front end's samples without it (py-spy,
   docs/benchmarks.md, issue 21 round 5), and the handshake held each new connection back from
   reading its request for those rounds. :class:`_IdleTimer` has the same two methods: the
   connection's first ``restart`` starts one task (``start_soon``, no handshake) that waits for
   the server's termination under a cancel scope whose deadline is the timer; ``restart`` moves
   the deadline to ``keep_alive_timeout`` from now and ``stop`` to never, without waiting. When
   the deadline passes, or the server terminates while the connection is idle, the task closes
   the connection as hypercorn's ``_idle_timeout`` does (a request in flight at termination goes
   on, as under hypercorn's stopped timer). Under any configuration: the same timeout, the same
   close. (It reaches into hypercorn as ``TrioSingleTask`` does: the task group's nursery, and
   ``TCPServer._initiate_server_close`` for the close.)

   And when the connection's reading ends (the client closed it), the timer's task ends at
   once: hypercorn's went on waiting for its timeout, and the connection's task (which waits
   for its task group) with it, so a connection the client had closed still counted against
   ``max_connections`` for up to ``keep_alive_timeout``: four bursts of 256 short requests
   within 5 s had the fourth's last 24 refused 503 at the cap of 1,000.

7. **A burst of new connections accepted in one round of the run loop**
   (:class:`BurstListener`). trio accepts one connection per round, and under load a round is
   long: 256 chat streams arriving at once had their connections' tasks started over 0.6-1.1 s
   on a 2-core machine, where uvicorn takes the whole accept queue at once. The listener takes
   every connection already queued in the kernel in the round that finds the first. Under any
   configuration: the same connections, the same order, only sooner.

8. **Bytes already waiting are read without a schedule point** (``CappedTCPServer._read_loop``,
   hypercorn's ``_read_data`` otherwise). trio's ``receive_some`` yields after every read, so a
   new connection's task spent a round of the run loop between reading its request (nearly
   always there when the task starts) and parsing it. One ``os.read`` that does not yield is
   tried first, after a read that waited; a client that keeps sending still meets a schedule
   point every other read. With change 7 and the body read that stops at its declared length
   (``api/direct.py``), a ``/health`` probe under 256 streams went from 52-58 to 33-34 ms p50.

9. **The route of a client gone cancelled by the close itself** (:func:`cancel_on_close`).
   A hot route (``api/direct.py``) must stop when its client goes away: the session's block
   is left, which aborts the request in the engine. It learnt of it from a task per request
   that waited on ASGI ``receive`` for ``http.disconnect`` (quart-trio does the same), in a
   nursery of its own: a task's start, three steps and its exit, and a nursery, per request.
   hypercorn puts ``http.disconnect`` when the request's stream closes (``HTTPStream.handle``
   of ``StreamClosed``); the route's cancel scope is now cancelled right there, where hypercorn
   learns it, when the response is not complete yet. The end of every response closes the
   stream too, from inside the app's last send: that close cancels nothing (it would cancel
   hypercorn's recycle of the connection half-way, change 2's bug again). Under any
   configuration; elsewhere (another ASGI server, the tests' in-process app) the route keeps
   its watching task.

10. **No cancel scope around a read without a deadline.** hypercorn wraps every read in
    ``fail_after(read_timeout or inf)``: a cancel scope entered and left per read for a
    deadline that never comes (``serve`` leaves ``read_timeout`` unset, see
    :func:`hypercorn_config`). With no read timeout the read is awaited bare.

11. **The idle timer's task only for a connection that idles** (:class:`_IdleTimer`). Change
    6's task was still started once per connection, when it opened. A connection over a socket
    now starts it only when it is idle *and* its read waits for bytes (``waiting``): until
    then its read is not blocked, so nothing can outlast the deadline unseen. A connection
    whose request was already in when its task started, answered and closed (every connection
    of a burst of new clients, and every client that sends ``Connection: close``) never starts
    it; a kept-alive connection starts it when its first response ends, as before. A timer
    whose connection ended before its task first ran returns at once. Other streams (TLS)
    start it at the first ``restart``, as change 6 did.

12. **h11's validation of a response's headers done once per distinct headers**
    (:class:`_HeaderMemo`). h11 validates every header of a response against two regular
    expressions when the event is built, and ``Connection.send`` builds it four more times
    while it sets the framing headers: 45 of the 60 us that sending a stream's head took. The
    result is kept, keyed by the headers, for the same headers again (the same ``Headers``;
    headers h11 refuses are refused every time, never kept). Under any configuration: h11's own
    function of the same values.

13. **A request's way to its app and a connection's close without schedule points that never
    wait.** hypercorn hands a request's body, the end of it and the disconnect to the app
    through a memory channel whose ``send`` yields each time, the app's ``receive`` yields for a
    message already there, and closing a connection (``send_eof`` then ``aclose``, run twice for
    a connection the response closes) yields four times: sixteen steps of the two tasks per
    short request in a burst of 256, eight now (the same calls, without the yields: a message
    put while the queue has room, taken while it has one, :func:`received`; a socket shut and
    closed at once). Measured at the fourteenth stop (docs/benchmarks.md): with change 12,
    0.94-0.96x the front end's CPU a request in 20 paired bursts, under ``serve`` and under the
    bare command.

14. **A chunk written from another task, without a checkpoint** (:class:`BodyWriter`'s
    ``ready`` and ``write_nowait``; ``CappedTCPServer.send_nowait``). A stream's reads are
    written by the task that delivers the worker's outputs, not by the request's own task
    (``TextStream.handle``, ``respond.open_stream``): trio's wake of a task and the async
    layers of its read were a third of the front end's CPU a token at 256 streams. Such a write
    is one ``os.write`` of the framed chunk, made only while change 4 would write that chunk
    directly and nothing else is being written or held; what the socket does not take (a full
    send buffer, a broken connection) is kept as the connection's rest, and every later write
    of the connection (``send_raw``, and any other event after it) sends the rest first, so
    the bytes stay in order; the request's task is then woken to send it. Same bytes, same
    order, under any configuration (tests/api/test_reads_where_they_arrive.py).

15. **A plain TCP connection starts without a TLS handshake attempt.** hypercorn's
    ``TCPServer.run`` begins every connection by calling ``do_handshake`` inside
    ``fail_after(ssl_handshake_timeout)`` and learns that the connection is plain from the
    ``AttributeError`` a ``trio.SocketStream`` raises: a cancel scope with a deadline, and an
    exception thrown through two context managers, for every connection. For a
    ``trio.SocketStream`` the rest of hypercorn's ``run`` is run as it is (the same protocol
    objects, ``ssl`` false, ALPN ``http/1.1``, the same close); a TLS stream goes through
    hypercorn's own. A burst of 256 new connections used 5-8% less CPU a request
    (``bench burst``, paired, two runs; docs/benchmarks.md, the sixteenth stop). Under any
    configuration.

16. **A plain request served on its connection's task, without hypercorn's protocol objects**
    (``http1.py``: :class:`~trio_infer.http1.Connection`, whose module docstring says what
    "plain" is and what the app and the client see). In a burst of 256 new connections,
    hypercorn's path for each request (h11's parser and state machine, ``ProtocolWrapper``,
    ``H11Protocol``, ``HTTPStream``, a task and a memory channel for the app, its recycle) was
    the largest part of the front end's work a request. ``CappedTCPServer._serve`` hands a
    plain TCP connection to the fast path first; the first request it does not take (and the
    bytes read so far) goes to hypercorn, which serves the connection from there as if it had
    read them itself. The fast path answers what hypercorn answers, byte for byte but the date
    (tests/api/test_http1.py), keeps a kept-alive connection's idle timeout, and closes an idle
    connection at once when the server terminates: the worker's termination event is replaced
    by :class:`~trio_infer.http1.Termination`, which cancels the fast path's idle waits when it
    is set (no task per idle wait). A burst of 256 new connections used 22-24% less CPU a
    request, under ``serve`` and under the bare command (``bench burst``, paired;
    docs/benchmarks.md, the seventeenth stop). Under any configuration.

``tests/runtime/test_connection_limits.py`` proves changes 1 and 2 against a real server (and
fails without them); every streaming test goes through change 3; ``tests/api/test_http1.py``
proves change 16.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
import stat
import struct
import types
from typing import Any, Callable

import trio
from hypercorn.config import Config

from trio_infer.api.errors import RETRY_AFTER_S, SERVER_ERROR, error_body
from trio_infer.api.sse import NEXT_SEND_FOLLOWS, dumps
from trio_infer.http1 import BodyWriter, Connection, Exchange, SocketWriter, Termination, frame_chunk
from trio_infer.settings import Settings, Wiring

log = logging.getLogger(__name__)


class ServerConfig(Config):
    """hypercorn's configuration, plus what our changes to it read: the connection cap."""

    def __init__(self, max_connections: int) -> None:
        super().__init__()
        self.max_connections = max_connections
        self.open_connections = 0  # connections being served now, under this configuration


def hypercorn_config(settings: Settings, wiring: Wiring = Wiring()) -> ServerConfig:
    """The configuration ``serve`` runs hypercorn with."""
    config = ServerConfig(settings.max_connections)
    # serve --api-workers: the supervisor hands each front end the listening socket it bound.
    if wiring.listen_fd is not None:
        config.bind = [f"fd://{wiring.listen_fd}"]
    else:
        config.bind = [f"{settings.host}:{settings.port}"]
    # Our own drain has ended every request by the time hypercorn is told to stop; this only
    # bounds the wait for connections to close.
    config.graceful_timeout = 2.0
    # hypercorn's default listen backlog (100) drops the SYNs of a burst of new connections, which
    # clients retry only after a second: 256 clients arriving at once waited 1-2 s for a first
    # token (the bare hypercorn command gets it from widen_backlogs()).
    config.backlog = BACKLOG
    # Connection limits (README, "Connection limits"). keep_alive_timeout also bounds the time to
    # send a request's headers (hypercorn counts a connection idle until its headers are in).
    # hypercorn's read_timeout is left unset: it is a per-read idle timeout on the socket, which
    # would also cut any request the client waits on longer than it without sending anything.
    config.keep_alive_timeout = settings.keep_alive_timeout_s
    config.h11_max_incomplete_size = settings.max_header_bytes
    config.h2_max_header_list_size = settings.max_header_bytes
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # through our logging setup, once
    return config


# The listen backlog of every listening TCP socket this server serves on: uvicorn's default; the
# kernel caps it at net.core.somaxconn.
BACKLOG = 2048

# struct tcp_info (linux/tcp.h): 8 bytes of u8 fields, then u32 rto, ato, snd_mss, rcv_mss,
# unacked, sacked. On a listening socket the kernel reports its accept queue's limit (the
# backlog that listen() set, after the somaxconn cap) in tcpi_sacked.
_TCP_INFO_SACKED = struct.Struct("=28xI")


def _listen_backlog(sock: socket.socket) -> int | None:
    """The accept queue's limit of a listening TCP socket (Linux), or None where not known."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 64)
    except OSError:
        return None
    if len(info) < _TCP_INFO_SACKED.size:
        return None
    return _TCP_INFO_SACKED.unpack_from(info)[0]


def widen_backlogs(backlog: int = BACKLOG) -> list[int]:
    """Raise the listen backlog of every listening TCP socket of this process to ``backlog``
    (never lower it); returns the file descriptors raised. Linux only (elsewhere: nothing).

    Why: under the bare ``hypercorn trio_infer.app:app`` command hypercorn's own ``Config`` sets
    the backlog, 100 unless the user passes ``--backlog``, and a burst of new connections past
    it has its SYNs dropped: the kernel retries them after a second, which was that command's
    TTFT p99 for a burst of 256 streams (1.3 s, against 0.38 s under ``serve``, which sets
    :data:`BACKLOG` in its own configuration) and most of its lost keep-up. hypercorn creates
    and listens on its sockets before it loads the app (``hypercorn.run.run`` ->
    ``trio_worker``), so at the app's lifespan startup (``app.py``, where this is called) they
    are already this process's; hypercorn has no hook to reach them and keeps them in locals,
    so they are found by file descriptor: a socket in the listening state
    (``SO_ACCEPTCONN``) whose accept queue's limit (``TCP_INFO``) is below ``backlog``. Linux
    lets ``listen()`` be called again on a listening socket: it only changes that limit, and
    connections already queued stay queued. A backlog the user set higher is left as it is;
    one set lower (``--backlog 50``) is raised, which the README says. Unix-domain sockets
    are left alone (their limit cannot be read back)."""
    if not os.path.isdir("/proc/self/fd") or not hasattr(socket, "SO_ACCEPTCONN"):
        return []
    raised = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)  # detached below: the descriptor stays its owner's
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                    or sock.type != socket.SOCK_STREAM \
                    or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            current = _listen_backlog(sock)
            if current is not None and current < backlog:
                sock.listen(backlog)
                raised.append(fd)
                log.debug("listen backlog of fd %d raised from %d to %d", fd, current, backlog)
        except OSError:
            continue
        finally:
            sock.detach()
    return raised


# What a connection past the cap reads: a whole HTTP/1.1 response, then the close.
_REFUSAL_BODY = dumps(error_body(
    "too many open connections to this server; retry later", SERVER_ERROR,
    code="too_many_connections",
)).encode()
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: " + str(RETRY_AFTER_S).encode() + b"\r\nconnection: close\r\n"
    b"content-length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY
)


async def _refuse(stream: Any) -> None:
    with trio.move_on_after(1):  # a client that does not read gets the close without it
        try:
            await stream.send_all(REFUSAL)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await trio.aclose_forcefully(stream)


class _IdleTimer:
    """Change 6: a connection's idle timer, hypercorn's ``TrioSingleTask`` interface (``restart``,
    ``stop``) as one task per connection whose cancel scope's deadline is moved (the module's
    docstring says why). It closes the connection as hypercorn's ``_idle_timeout`` does: when
    the connection has been idle for ``keep_alive_timeout``, or at once when the server
    terminates while it is idle; never while a request is in flight (hypercorn's timer is
    stopped then, and a request that ends after the server terminated closes its connection
    itself)."""

    def __init__(self, server: Any) -> None:
        self._server = server  # the connection's TCPServer
        self._idle = False
        self._deadline = math.inf
        self._scope: trio.CancelScope | None = None
        self._task_group: Any = None
        self._waiting = False  # change 11: the connection's read waits for bytes
        self._started = False
        self._ended = False

    async def restart(self, task_group: Any, action: Any, since: float | None = None) -> None:
        """The connection is idle: closed ``keep_alive_timeout`` from now (from ``since``, when
        it has been idle since then: change 16's fast path waited first) unless a request
        starts first (at once if the server is terminating). (``action`` is hypercorn's
        ``_idle_timeout``, whose work :meth:`_run` does.) Does not wait, so it cannot be
        cancelled half-way (change 2)."""
        self._idle = True
        if self._server.context.terminated.is_set():
            self._set(-math.inf)
        else:
            start = trio.current_time() if since is None else since
            self._set(start + self._server.config.keep_alive_timeout)
        self._task_group = task_group
        if self._waiting or not isinstance(self._server.stream, trio.SocketStream):
            self._start()

    def waiting(self, now: bool) -> None:
        """Change 11: the connection's read is about to wait for bytes (``now``), or has its
        bytes. The timer's task starts only once the connection is idle and its read waits:
        until then the read is not blocked, so nothing can outlast the deadline unseen, and a
        connection whose request was already in when its task started (every one of a burst)
        never needs the task at all."""
        self._waiting = now
        if now and self._idle:
            self._start()

    def _start(self) -> None:
        if self._started or self._ended:
            return
        stream = self._server.stream
        if isinstance(stream, trio.SocketStream) and stream.socket.fileno() == -1:
            return  # already closed (a response that said Connection: close): nothing to time
        self._started = True
        # The connection's task group, as TrioSingleTask uses it (its nursery, which
        # hypercorn's TaskGroup keeps there).
        self._task_group._nursery.start_soon(self._run)

    async def stop(self) -> None:
        """A request started: the connection is not idle."""
        self._idle = False
        self._set(math.inf)

    def end(self) -> None:
        """The connection's reading has ended (the client closed it, or it broke): the timer
        has nothing left to close (the connection's own task closes the socket), so its task
        ends now instead of holding the connection's task group open until the deadline."""
        self._ended = True
        if self._scope is not None:
            self._scope.cancel()

    def _set(self, deadline: float) -> None:
        self._deadline = deadline
        if self._scope is not None:
            self._scope.deadline = deadline

    async def _run(self) -> None:
        terminated = self._server.context.terminated
        while True:
            if self._ended:  # ended between start_soon and this task's first step
                return
            with trio.CancelScope(deadline=self._deadline) as self._scope:
                if terminated.is_set():  # terminating while a request is in flight: wait
                    await trio.sleep_forever()
                else:
                    await terminated.wait()
            self._scope = None
            if self._ended:
                return
            if self._idle:  # the deadline passed, or the server terminates, while idle
                break
        with trio.CancelScope(shield=True):  # as hypercorn's _idle_timeout closes
            await self._server._initiate_server_close()


class _HeaderMemo:
    """Change 12: h11's header validation of a response, remembered.

    h11 validates a response's headers (two regular expressions a header, ``normalize_and_validate``)
    each time it builds the event, and ``Connection.send`` builds it again for every header it
    sets (``Content-Length`` removed, ``Transfer-Encoding: chunked``, ``Connection: close``):
    five passes over the same few headers per response, 45 of the 60 us that sending a stream's
    head took (one request's whole work in the front end is a few hundred). The headers of our
    responses repeat (the date changes once a second), so the result is kept, keyed by the
    headers themselves, and given back for equal headers: the same function of the same values,
    so the same ``Headers`` or the same exception (an exception is never kept). What the parser
    produced (``_parsed``: a request's headers, already checked by the parser's own expressions)
    is passed through unchanged, as is anything that cannot be a key (a header that is not a
    tuple of bytes or str). At most ``limit`` results are kept; then they are all forgotten."""

    def __init__(self, validate: Callable[..., Any], headers_type: type, limit: int = 1024) -> None:
        self._validate = validate
        self._headers_type = headers_type
        self._limit = limit
        self._seen: dict[tuple[Any, ...], Any] = {}

    def __call__(self, headers: Any, _parsed: bool = False) -> Any:
        if _parsed:
            return self._validate(headers, _parsed)
        try:
            if type(headers) is list:
                key: tuple[Any, ...] = tuple(headers)
            elif type(headers) is self._headers_type:
                key = (self._headers_type, tuple(headers._full_items))
            else:
                return self._validate(headers)
            found = self._seen.get(key)
        except TypeError:  # unhashable: a list for a pair, a bytearray
            return self._validate(headers)
        if found is None:
            found = self._validate(headers)
            if len(self._seen) >= self._limit:
                self._seen.clear()
            self._seen[key] = found
        return found


_INSTALLED = False
_chunk_writer: Callable[[Any], BodyWriter | None] | None = None  # install()
_on_close: Callable[[Any, trio.CancelScope], bool] | None = None  # install()


def install() -> bool:
    """Install the sixteen changes (idempotent). Returns False, changing nothing, if hypercorn is
    not the 0.18 layout they were written for."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import h11
        import h11._events as h11_events
        import h11._headers as h11_headers
        import hypercorn.trio.run as run_module
        from hypercorn.events import Closed, RawData, Updated
        from hypercorn.protocol.events import StreamClosed
        from h11._writers import ChunkedWriter
        from hypercorn.protocol.h11 import H11Protocol
        from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
        from hypercorn.trio.task_group import TaskGroup
        from hypercorn.trio.worker_context import EventWrapper
        from hypercorn.protocol import ProtocolWrapper
        from hypercorn.typing import ConnectionState
        from hypercorn.utils import parse_socket_addr
        from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
    except ImportError:
        return False
    if getattr(run_module, "TCPServer", None) is not TCPServer or not hasattr(TCPServer, "protocol_send") \
            or not hasattr(TCPServer, "_initiate_server_close") \
            or not hasattr(TCPServer, "_read_data") \
            or not hasattr(H11Protocol, "_maybe_recycle") or not hasattr(HTTPStream, "app_send") \
            or not hasattr(h11.Connection(h11.SERVER), "_writer") \
            or not hasattr(TaskGroup, "spawn_app") or not hasattr(TCPServer, "_close") \
            or getattr(h11_events, "normalize_and_validate", None) is not h11_headers.normalize_and_validate \
            or "_full_items" not in getattr(h11_headers.Headers, "__slots__", ()):
        return False

    # Change 12: every name h11 calls its header validation by (set_comma_header calls it by
    # _headers' own global).
    memo = _HeaderMemo(h11_headers.normalize_and_validate, h11_headers.Headers)
    h11_headers.normalize_and_validate = memo  # type: ignore[assignment]
    h11_events.normalize_and_validate = memo  # type: ignore[attr-defined]

    class CappedTCPServer(TCPServer):
        """Change 1 (the cap), change 3 (a write in one ``os.write``), change 5's cork and
        change 6 (the idle timer, ended with the connection's reading)."""

        # Change 5: while not None, the bytes hypercorn writes are kept here, to go out in one
        # write at uncork() (or before any event that is not bytes).
        corked: list[bytes] | None = None
        # Change 14: what send_nowait's write left unwritten (a full send buffer), written
        # before anything else the connection writes.
        rest: bytes = b""
        # Change 16: the connection's fast path while it serves the connection.
        fast: Connection | None = None

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.idle_task = _IdleTimer(self)  # change 6
            # Change 16: the worker's termination event, replaced (once, before any
            # connection waits on it) by one that also ends the fast path's idle waits.
            context = self.context
            if type(context.terminated) is EventWrapper and not context.terminated.is_set():
                context.terminated = Termination()

        def cork(self) -> None:
            self.corked = []

        async def uncork(self) -> None:
            data = b"".join(self.corked or ())
            self.corked = None
            await self.send_raw(data)

        async def run(self) -> None:
            config = self.config
            if not isinstance(config, ServerConfig):
                return await self._serve()
            if config.open_connections >= config.max_connections:
                return await _refuse(self.stream)
            config.open_connections += 1
            try:
                await self._serve()
            finally:
                config.open_connections -= 1

        async def _serve(self) -> None:
            """Change 16: a plain TCP connection's plain requests on the fast path
            (``http1.py``), then, from the first request it does not take, hypercorn's ``run``
            with change 15: without its TLS handshake attempt (the module's docstring says
            why)."""
            if type(self.stream) is not trio.SocketStream:
                return await TCPServer.run(self)
            sock = self.stream.socket
            try:
                client = parse_socket_addr(sock.family, sock.getpeername())
                server = parse_socket_addr(sock.family, sock.getsockname())
                self.fast = Connection(self, client, server)
                try:
                    rest = await self.fast.serve()
                    idle_since = self.fast.idle_since
                finally:
                    self.fast = None
                if rest is None:
                    return
                async with TaskGroup() as task_group:
                    self._task_group = task_group
                    self.protocol = ProtocolWrapper(
                        self.app, self.config, self.context, task_group,
                        ConnectionState(self.state), False, client, server, self.protocol_send,
                        "http/1.1")
                    await self.protocol.initiate()
                    # The idle time (the time to send a head) counts from when the fast path
                    # began to wait for this request, as it would have under hypercorn alone.
                    await self.idle_task.restart(self._task_group, self._idle_timeout,
                                                 since=idle_since)
                    if rest:  # read by the fast path: hypercorn serves them as if it had
                        await self.protocol.handle(RawData(rest))
                    await self._read_data()
            except OSError:
                pass
            finally:
                await self._close()

        async def _read_data(self) -> None:
            try:
                await self._read_loop()
            finally:
                self.idle_task.end()  # change 6

        async def _read_loop(self) -> None:
            """hypercorn's ``_read_data``, with change 8: bytes already waiting on the socket
            are read with one ``os.read`` that does not yield, where trio's ``receive_some``
            yields after every read. A new connection's request is nearly always there when its
            task starts, so hypercorn parses it and starts the app in that same round of the run
            loop. Only a read after one that waited is tried that way: a client that keeps
            sending still meets a schedule point every other read."""
            # The descriptor is asked for at each read, never kept: once another task closed the
            # stream (the idle timer) it is -1 (EBADF), never a number reused by a new connection.
            sock = self.stream.socket if type(self.stream) is trio.SocketStream else None
            timeout = self.config.read_timeout or math.inf
            idle = self.idle_task
            waited = True
            while True:
                data: bytes | None = None
                if sock is not None and waited:
                    try:
                        data = os.read(sock.fileno(), MAX_RECV)
                    except BlockingIOError:
                        pass
                    except OSError:
                        break  # reset by the peer: as receive_some's BrokenResourceError
                if data is None:
                    idle.waiting(True)  # change 11
                    try:
                        if timeout == math.inf:  # change 10: no cancel scope for no deadline
                            data = bytes(await self.stream.receive_some(MAX_RECV))
                        else:
                            with trio.fail_after(timeout):
                                data = bytes(await self.stream.receive_some(MAX_RECV))
                    except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                        break
                    idle.waiting(False)
                    waited = True
                else:
                    waited = False
                await self.protocol.handle(RawData(data))
                if data == b"":
                    break
            await self.protocol.handle(Closed())

        async def _close(self) -> None:
            """Change 13: the close of a plain TCP connection without schedule points.
            hypercorn's (``send_eof`` then ``aclose``) yields twice, and it runs twice for a
            connection the response closes (from the app's task, then from the connection's
            own as it ends): four rounds of the run loop per connection for calls that never
            block. The same calls, in the same order: the write side shut down unless a write
            is in progress (``send_eof``'s conflict), then the socket closed (trio's close,
            which wakes any task waiting on it); a second close does nothing."""
            stream = self.stream
            if type(stream) is not trio.SocketStream:
                return await super()._close()
            sock = stream.socket
            if sock.fileno() == -1:
                return
            if not self.send_lock.locked() and not sock.did_shutdown_SHUT_WR:
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # already gone
            sock.close()

        async def protocol_send(self, event: Any) -> None:
            if type(event) is RawData and isinstance(self.stream, trio.SocketStream):
                if self.corked is not None:  # change 5
                    self.corked.append(event.data)
                    return
                await self.send_raw(event.data)  # change 3: under any configuration
                return
            if self.corked is not None:  # a close, a timer: what was written goes first
                await self.uncork()
            if self.rest:  # change 14: likewise
                await self.send_raw(b"")
            await super().protocol_send(event)  # Updated: the idle timer (change 6)

        def send_nowait(self, data: bytes) -> bool:
            """Change 14: ``data`` written now, from whatever task calls (no checkpoint), when
            nothing else is being written and nothing is held (corked, or left over by an
            earlier call): True once the socket took all of it. False when the socket took part
            (or it is broken): the rest is kept (``rest``) and goes out first with the
            connection's next write, which the caller should make soon (an empty one will
            do). Call only when nothing is corked, left over or holding the send lock
            (``SocketWriter.ready``)."""
            try:
                sent = os.write(self.stream.socket.fileno(), data)
            except OSError:  # full (BlockingIOError) or broken: send_raw meets it again
                sent = 0
            if sent == len(data):
                return True
            self.rest = data[sent:]
            return False

        async def send_raw(self, data: bytes) -> None:
            """Change 3: the bytes written at once when the socket takes them, as hypercorn's
            own path does it (never interleaved with another task's write, never cancelled
            half-way) but without trio's per-call machinery for a write that cannot block.
            Nothing to write is no write (change 5: h11 ends a fixed-length body with no
            bytes)."""
            if self.rest:  # change 14: what send_nowait left goes first
                data, self.rest = self.rest + data, b""
            if not data:
                return
            lock = self.send_lock
            if lock.locked():  # another task is writing: wait in hypercorn's own path
                return await super().protocol_send(RawData(data))
            # The lock is free and the write below does not yield, so no other task can write
            # in between: the lock is only taken for what the socket did not take at once (a
            # full send buffer), whose rest is awaited (round 4: a write that the socket takes
            # whole skips the lock's bookkeeping, 1-2% of the front end at 256 streams).
            broken = False
            try:
                sent = os.write(self.stream.socket.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:
                sent, broken = 0, True
            if not broken and sent < len(data):
                lock.acquire_nowait()  # free: nothing yielded since locked() said so
                try:
                    with trio.CancelScope(shield=True):
                        await self.stream.send_all(data[sent:])
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    broken = True
                finally:
                    lock.release()
            if broken:
                if self.fast is not None:
                    self.fast.broken()
                else:
                    await self.protocol.handle(Closed())

    run_module.TCPServer = CappedTCPServer  # type: ignore[misc]
    run_module.trio = _TrioForHypercorn()  # change 7: what worker_serve calls serve_listeners by

    recycle = H11Protocol._maybe_recycle

    async def _maybe_recycle(self: Any) -> None:
        """Change 2: the end of a request shielded, and the idle timer started after a
        ``Connection: close`` response too."""
        if not isinstance(self.config, ServerConfig):
            return await recycle(self)
        # This runs in the app's task, which quart-trio cancels on the http.disconnect that
        # recycle() sends first: shield it (bookkeeping, no waiting; bounded all the same).
        with trio.CancelScope(shield=True, deadline=trio.current_time() + 1):
            await recycle(self)
            if self.connection.our_state is h11.MUST_CLOSE and not self.context.terminated.is_set():
                await self.send(Updated(idle=True))

    H11Protocol._maybe_recycle = _maybe_recycle  # type: ignore[method-assign]

    app_send = HTTPStream.app_send
    send_body = ASGIHTTPState.RESPONSE
    h11_send_body = h11.SEND_BODY

    async def _app_send(self: Any, message: Any) -> None:
        """Change 5 around change 4: a marked send corks the connection until the next one."""
        corked = self.__dict__.pop("_trio_infer_corked", None)
        if corked is not None:  # the previous send was marked: this one goes out with it
            try:
                await _send_message(self, message)
            finally:
                await corked.uncork()
            return
        if message is not None and self.scope.pop(NEXT_SEND_FOLLOWS, False) is True:
            protocol = getattr(self.send, "__self__", None)
            server = getattr(getattr(protocol, "send", None), "__self__", None)
            if type(protocol) is H11Protocol and type(server) is CappedTCPServer \
                    and server.corked is None and isinstance(server.stream, trio.SocketStream):
                server.cork()
                self._trio_infer_corked = server
                try:
                    await _send_message(self, message)
                except BaseException:
                    del self._trio_infer_corked
                    await server.uncork()
                    raise
                return
        await _send_message(self, message)

    def _chunked(stream: Any) -> tuple[Any, Any] | None:
        """Change 4's test: the (H11Protocol, our TCP server or None) that ``stream``'s body
        chunks are framed for and written to directly, or None when its response is not an
        HTTP/1.1 chunked body being sent (hypercorn's own path then)."""
        protocol = getattr(stream.send, "__self__", None)  # the H11Protocol whose stream this is
        if type(protocol) is not H11Protocol:
            return None
        connection = protocol.connection
        if connection.our_state is not h11.SEND_BODY or type(connection._writer) is not ChunkedWriter:
            return None
        server = getattr(protocol.send, "__self__", None)  # the connection's TCPServer
        if type(server) is not CappedTCPServer or not isinstance(server.stream, trio.SocketStream):
            server = None
        return protocol, server

    async def _send_message(self: Any, message: Any) -> None:
        """Change 4: a chunk of a chunked HTTP/1.1 body, framed as h11 frames it, written at once."""
        if message is not None and self.state is send_body and message["type"] == "http.response.body":
            data = message.get("body")
            found = _chunked(self) if data and type(data) is bytes and message.get("more_body") else None
            if found is not None:
                protocol, server = found
                if server is not None and server.corked is None:
                    return await server.send_raw(frame_chunk(data))  # what protocol_send would do
                return await protocol.send(RawData(frame_chunk(data)))
        return await app_send(self, message)

    HTTPStream.app_send = _app_send  # type: ignore[method-assign]

    stream_handle = HTTPStream.handle
    response_sent = ASGIHTTPState.CLOSED

    async def _stream_handle(self: Any, event: Any) -> None:
        """Change 9: the scope registered by :func:`cancel_on_close` is cancelled when the
        stream closes before its response is complete (the client went away), as the app's
        ``http.disconnect`` (put right after) would have it cancelled a round later."""
        if type(event) is StreamClosed and not self.closed:
            scope = self.__dict__.pop("_trio_infer_on_close", None)
            if scope is not None and self.state is not response_sent:
                scope.cancel()
        await stream_handle(self, event)

    HTTPStream.handle = _stream_handle  # type: ignore[method-assign]

    spawn_app = TaskGroup.spawn_app

    async def _spawn_app(self: Any, *args: Any) -> Any:
        """Change 13: a request's messages to its app (its body, the end of it, the
        disconnect) put on the app's queue without a schedule point when the queue has room
        (the queue and its bound are hypercorn's), where ``MemorySendChannel.send`` yields
        each time: three rounds of the run loop per request on the way to the app."""
        put = await spawn_app(self, *args)
        channel = getattr(put, "__self__", None)
        if type(channel) is not trio.MemorySendChannel:
            return put

        async def put_now(message: Any) -> None:
            try:
                channel.send_nowait(message)
            except trio.WouldBlock:  # full: wait for the app as hypercorn does
                await channel.send(message)

        return put_now

    TaskGroup.spawn_app = _spawn_app  # type: ignore[method-assign]

    def on_close(send: Any, scope: trio.CancelScope) -> bool:
        stream = getattr(send, "__self__", None)
        if type(stream) is not HTTPStream:
            return False
        if stream.closed:  # already gone
            scope.cancel()
        else:
            stream._trio_infer_on_close = scope
        return True

    def chunk_writer(send: Any) -> BodyWriter | None:
        """Change 4 for a whole response: what _send_message finds out about the connection
        for each chunk (_chunked), found once, after the status went out; per chunk only what
        can change is looked at again."""
        stream = getattr(send, "__self__", None)
        if type(stream) is not HTTPStream or stream.state is not send_body:
            return None
        found = _chunked(stream)
        if found is None or found[1] is None:
            return None
        return _DirectWriter(send, stream, found[0].connection, found[1])

    class _DirectWriter(SocketWriter):
        """Change 4's writer of one hypercorn HTTP/1.1 response's chunks, and change 14's
        ``write_nowait``: straight to the socket while h11 is sending the body and nothing is
        corked or to cork."""

        def __init__(self, send: Any, stream: Any, connection: Any, server: Any) -> None:
            super().__init__(send, server)
            self.stream, self.connection = stream, connection
            self.scope = stream.scope

        def direct(self) -> bool:
            return self.server.corked is None and self.stream.state is send_body \
                and self.connection.our_state is h11_send_body and NEXT_SEND_FOLLOWS not in self.scope

    global _chunk_writer, _on_close
    _chunk_writer = chunk_writer
    _on_close = on_close
    _INSTALLED = True
    return True


class BurstListener(trio.abc.Listener[trio.SocketStream]):
    """Change 7: a listener that takes every connection waiting in the kernel's accept queue in
    the round of the run loop that finds the first one.

    ``trio.SocketListener.accept`` returns one connection and then yields (a schedule point), so
    ``trio.serve_listeners`` starts one connection's task per round of the run loop. Under load a
    round is long (every stream with a token to write runs in it), so a burst of N new
    connections waited N rounds to be started: in a burst of 256 chat streams on a 2-core AMD
    EPYC (Zen 3) the last connection's task started 0.6-1.1 s after the first, while every
    client's connect had finished within 75 ms (the kernel had them all queued), and those
    requests' first bytes came that much later (docs/benchmarks.md, the seventh stop). uvicorn
    (uvloop) accepts the whole queue on one readiness event, as this does.

    ``accept`` waits until the listening socket is readable (trio's own wait, on the inner
    listener's socket), then calls ``accept(2)`` without blocking on a second file object of the
    same socket (a ``dup``: same queue, same non-blocking flag) until the queue is empty or
    :data:`BURST_MAX` were taken, and returns the first without another schedule point; the next
    calls return the rest without one, so ``serve_listeners`` starts all their tasks in the same
    round. Errors are trio's: a connection aborted while queued is skipped; any other error (out
    of file descriptors) is raised when nothing was taken, else ends the burst, to be met again
    by the next call. The inner listener owns the socket: closing this closes it."""

    def __init__(self, inner: trio.SocketListener) -> None:
        self.inner = inner
        self.queue: list[trio.SocketStream] = []  # taken, not yet returned; next one last
        self._raw = socket.socket(fileno=os.dup(inner.socket.fileno()))

    async def accept(self) -> trio.SocketStream:
        while not self.queue:
            await trio.lowlevel.wait_readable(self.inner.socket)
            self._take_queued()
        return self.queue.pop()  # no schedule point: the burst starts in one round

    def _take_queued(self) -> None:
        taken: list[trio.SocketStream] = []
        while len(taken) < BURST_MAX:
            try:
                raw, _ = self._raw.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in _ABORTED_ACCEPTS:
                    continue
                if exc.errno in _CLOSED and not taken:
                    raise trio.ClosedResourceError from None
                if not taken:
                    raise
                break
            taken.append(trio.SocketStream(trio.socket.from_stdlib_socket(raw)))
        taken.reverse()  # pop() from the end returns them in the kernel's order
        self.queue = taken

    async def aclose(self) -> None:
        queued, self.queue = self.queue, []
        try:
            for stream in queued:
                await stream.aclose()
        finally:
            self._raw.close()
            await self.inner.aclose()


# What trio.SocketListener.accept skips (a connection gone before it was taken), and how many
# connections one burst takes at most (a round of the run loop starts that many tasks).
_ABORTED_ACCEPTS = frozenset(getattr(errno, name) for name in ("ECONNABORTED", "EPERM", "EPROTO")
                             if hasattr(errno, name))
_CLOSED = frozenset({errno.EBADF, errno.ENOTSOCK})  # the listener was closed
BURST_MAX = 1024


async def _serve_listeners(handler: Any, listeners: list[Any], **kwargs: Any) -> Any:
    """``trio.serve_listeners`` with each plain TCP listener taking bursts whole (change 7)."""
    burst = [BurstListener(lis) if type(lis) is trio.SocketListener else lis for lis in listeners]
    return await trio.serve_listeners(handler, burst, **kwargs)


class _TrioForHypercorn(types.ModuleType):
    """The ``trio`` that ``hypercorn.trio.run`` sees (change 7): trio itself but for
    ``serve_listeners``, the one call through which hypercorn accepts connections (it has no
    hook for it). Installed as that module's ``trio`` name, looked up when it starts serving,
    after the app's startup, like change 1's ``TCPServer``."""

    serve_listeners = staticmethod(_serve_listeners)

    def __init__(self) -> None:
        super().__init__("trio")

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)


def body_writer(send: Any) -> BodyWriter:
    """How a streamed response writes its chunks once its status is sent (``send``: the
    request's ASGI send): straight to the connection (change 4, looked up once) where the
    changes are installed and the connection is hypercorn's HTTP/1.1 over a socket, or the
    request is on the fast path (change 16), else through ``send``."""
    owner = getattr(send, "__self__", None)
    if type(owner) is Exchange:
        direct = owner.writer()
    else:
        direct = _chunk_writer(send) if _chunk_writer is not None else None
    return direct if direct is not None else BodyWriter(send)


def received(receive: Any) -> dict[str, Any] | None:
    """Change 13 for the app's side: the next ASGI message if hypercorn has already put it on
    the request's queue (taken without a schedule point), else None (nothing there yet, or
    another server's ``receive``: await it)."""
    channel = getattr(receive, "__self__", None)
    if type(channel) is Exchange:  # the fast path (change 16)
        return channel.receive_nowait()
    if type(channel) is not trio.MemoryReceiveChannel:
        return None
    try:
        return channel.receive_nowait()  # type: ignore[no-any-return]
    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
        return None  # awaiting receive() says the same, or waits


def cancel_on_close(send: Any, scope: trio.CancelScope) -> bool:
    """Have ``scope`` cancelled when the connection of the request whose ASGI send is ``send``
    closes before its response is complete (change 9; at once if it already has). False,
    registering nothing, where the changes are not installed or the server is not hypercorn's
    HTTP/1.1: the caller then watches ``receive`` for ``http.disconnect`` itself."""
    owner = getattr(send, "__self__", None)
    if type(owner) is Exchange:  # the fast path (change 16)
        return owner.on_close(scope)
    return _on_close is not None and _on_close(send, scope)


def configure(settings: Settings, wiring: Wiring = Wiring()) -> ServerConfig:
    """:func:`install`, then :func:`hypercorn_config`: what ``serve`` calls."""
    if not install():
        log.warning("hypercorn is not 0.18: idle keep-alive connections may never be closed, "
                    "and max_connections is not enforced")
    return hypercorn_config(settings, wiring)
