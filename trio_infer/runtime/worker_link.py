"""Keeping a batching worker: connect (or spawn), handshake, serve, restart. Written once.

Two programs keep a worker: the front end (``runtime/client.py``: its own worker process, a
shared worker's socket, or an in-process task) and the supervisor of ``serve --api-workers N``
(``supervisor.py``: the shared worker's process). Both do the same thing around a different
``serve``: :meth:`WorkerLink.run` opens a connection, reads the worker's :class:`Loading` reports
until its :class:`Hello` (or its :class:`Fatal`), hands the connection to ``serve`` until the
worker is gone, and restarts it under a :class:`RestartPolicy`.

What counts as the worker's death is narrow on purpose (:data:`WORKER_DEATH`): its pipe closed or
broke, it broke the protocol, it could not start, it could not be reached. Any other exception is
a bug on this side and propagates: a front end with a bug crashes loudly instead of reporting a
worker death and restarting a healthy worker forever.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

import trio

from trio_infer.wire import Fatal, FrameDecoder, FromWorker, Hello, Loading, ProtocolError

log = logging.getLogger(__name__)


class WorkerStartError(Exception):
    """The batching worker could not start (e.g. the model failed to load)."""


# A worker's death, as opposed to a bug of ours: what WorkerLink.run survives.
WORKER_DEATH = (WorkerStartError, ProtocolError, OSError, trio.BrokenResourceError, trio.TooSlowError)


class Connection(Protocol):
    """A byte stream to a worker: ``receive_some()`` gives ``b""`` once the worker is gone."""

    async def send_all(self, data: bytes) -> None: ...

    async def receive_some(self) -> bytes: ...


Connect = Callable[[], AbstractAsyncContextManager[Connection]]
# Told of each progress report of a loading worker, then None once it is ready or gone.
OnLoading = Callable[[Loading | None], None]


class MessageStream:
    """A connection's messages from the worker, a read at a time (the frames are decoded here)."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._decoder = FrameDecoder(FromWorker)
        self._pending: list = []

    async def receive(self) -> list:
        """The messages of the next read (never empty), or [] once the worker is gone."""
        if self._pending:
            messages, self._pending = self._pending, []
            return messages
        while True:
            try:
                data = await self.connection.receive_some()
            except trio.BrokenResourceError:
                data = b""
            if not data:
                return []
            messages = self._decoder.feed(data)
            if messages:
                return messages

    async def handshake(self, on_loading: OnLoading) -> Hello:
        """Wait for the worker's hello, passing on its load progress. Raises
        :class:`WorkerStartError` if it exits or gives up first."""
        while True:
            messages = await self.receive()
            if not messages:
                raise WorkerStartError("the batching worker exited before it was ready")
            for i, message in enumerate(messages):
                if type(message) is Loading:
                    on_loading(message)
                elif type(message) is Fatal:
                    raise WorkerStartError(message.message)
                elif type(message) is Hello:
                    self._pending = messages[i + 1:]
                    return message
                else:
                    raise ProtocolError(f"{type(message).__name__} before the hello")


@dataclass
class RestartPolicy:
    """At most ``max_restarts`` restarts in a row, ``delay_s`` apart; a worker that stayed up
    ``window_s`` resets the count."""

    max_restarts: int
    window_s: float
    delay_s: float
    restarts: int = 0

    def after_exit(self, up_for: float | None) -> float | None:
        """The worker ended after ``up_for`` seconds of service (None: it never got ready): the
        delay before the next start, or None to give up."""
        if up_for is not None and up_for >= self.window_s:
            self.restarts = 0
        self.restarts += 1
        if self.restarts > self.max_restarts:
            log.error("the batching worker died %d times in a row; giving up", self.restarts)
            return None
        log.warning("restarting the batching worker (%d of at most %d)", self.restarts,
                    self.max_restarts)
        return self.delay_s


Serve = Callable[[MessageStream, Hello], Awaitable[None]]


class WorkerLink:
    """Runs ``serve`` over a worker, and restarts the worker under ``policy`` (None: never)."""

    def __init__(self, connect: Connect, policy: RestartPolicy | None,
                 on_loading: OnLoading | None = None) -> None:
        self._connect = connect
        self._policy = policy
        self._on_loading = on_loading or (lambda loading: None)

    async def run(self, serve: Serve, on_down: Callable[[], None], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, handshake, ``serve`` until the worker is gone, ``on_down()``, restart.

        ``task_status.started()`` comes after the first hello; a worker that cannot start the
        first time raises its error (nothing is serving yet: the caller decides). Returns when
        the policy gives up (or there is none)."""
        started = False
        while True:
            up_since: float | None = None
            death: BaseException | None = None
            try:
                async with self._connect() as connection:
                    stream = MessageStream(connection)
                    hello = await stream.handshake(self._on_loading)
                    up_since = trio.current_time()
                    if not started:
                        started = True
                        task_status.started()
                    await serve(stream, hello)
                    log.error("the batching worker exited")
            except* WORKER_DEATH as group:
                death = _first(group)
            finally:
                self._on_loading(None)
                on_down()
            if death is not None:
                if not started:
                    raise death
                if isinstance(death, ProtocolError):
                    log.error("the batching worker broke the protocol: %s", death)
                elif isinstance(death, WorkerStartError):
                    log.error("the batching worker failed to start again: %s", death)
                else:
                    log.error("the connection to the batching worker failed: %r", death)
            if self._policy is None:
                return
            up_for = None if up_since is None else trio.current_time() - up_since
            delay = self._policy.after_exit(up_for)
            if delay is None:
                return
            await trio.sleep(delay)


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first leaf of a group of worker deaths (nurseries wrap them)."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
