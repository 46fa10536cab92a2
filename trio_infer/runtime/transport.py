"""How a batching worker is reached: a child process over a socket pair, a shared worker's Unix
socket, or (for tests and programs that hold an engine object) a trio task over memory channels.
All carry the same bytes, so everything above them is the same code.

Each ``open_*`` function is an async context manager giving a
:class:`~trio_infer.runtime.worker_link.Connection`: it starts (or reaches) the worker and, on
exit for any reason, stops it and waits for it: a worker process is always reaped, never left
behind. :class:`~trio_infer.runtime.worker_link.WorkerLink` does the rest (handshake, restarts).

Nothing here imports the engine at module level: a front end that spawns a worker process never
loads torch; only :func:`open_worker_task` (the caller already holds an engine) reaches for it.
"""

from __future__ import annotations

import logging
import math
import socket
import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator

import trio

from trio_infer.settings import Settings, worker_environment
from trio_infer.wire import Start, encode

if TYPE_CHECKING:
    from trio_infer.engine.engine import Engine
    from trio_infer.runtime.worker import WorkerCore

log = logging.getLogger(__name__)

# Seconds a worker gets to exit after its pipe closed before it is killed.
_EXIT_WAIT_S = 5.0
_SOCKET_BUFFER = 4 * 2**20


def start_message(settings: Settings, log_level: str | None = None) -> Start:
    """What a new worker is told first: the settings (less the API key) and the log level
    (default: this process's, so ``serve --log-level`` reaches the worker)."""
    if log_level is None:
        log_level = logging.getLevelName(logging.getLogger("trio_infer").getEffectiveLevel())
    return Start(settings.model_dump_json(exclude={"api_key"}), str(log_level).upper())


class WorkerProcess:
    """A batching worker process, started and told its settings, and the front end's end of its
    socket pair (:attr:`stream`). :meth:`aclose` closes the pipe (the worker exits on EOF, at
    once if it is still loading) and reaps it; it is idempotent.

    Started on its own (:meth:`start`) rather than only inside :func:`open_worker_process` so
    that ``serve`` can start it before it imports the rest of the front end: the worker's own
    imports (torch, a second or more) then run on the other core while this process imports
    hypercorn, quart and the app, and the server is healthy that much sooner."""

    def __init__(self, process: trio.Process, stream: trio.SocketStream) -> None:
        self.process = process
        self.stream = stream
        self._closed = False

    @classmethod
    async def start(
        cls, settings: Settings, *, log_level: str | None = None, listen: str | None = None,
        ports: int = 1,
    ) -> "WorkerProcess":
        """Start ``python -m trio_infer.runtime.worker`` on one end of a socket pair and send it
        :class:`~trio_infer.wire.Start`. With ``listen`` it is a shared worker that serves
        ``ports`` front ends connecting to that Unix socket, and the pair is its control pipe."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        argv = [sys.executable, "-m", "trio_infer.runtime.worker", "--fd", str(theirs.fileno())]
        if listen is not None:
            argv += ["--listen", listen, "--ports", str(ports)]
        try:
            process = await trio.lowlevel.open_process(
                argv, pass_fds=(theirs.fileno(),), env=worker_environment(settings))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        worker = cls(process, trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
        log.info("batching worker started (pid %d)", process.pid)
        try:
            await worker.stream.send_all(encode([start_message(settings, log_level)]))
        except BaseException:
            await worker.aclose()
            raise
        return worker

    async def aclose(self, exit_wait_s: float = _EXIT_WAIT_S) -> None:
        """Close the pipe and reap the worker, killing it if it has not exited ``exit_wait_s``
        seconds later (0: a worker nobody used, which has nothing to finish)."""
        if self._closed:
            return
        self._closed = True
        process = self.process
        with trio.CancelScope(shield=True):
            await self.stream.aclose()  # EOF: the worker exits
            with trio.move_on_after(exit_wait_s):
                await process.wait()
            if process.returncode is None:
                if exit_wait_s:
                    log.warning("the batching worker did not exit; killing it")
                process.kill()
                await process.wait()
            log.info("batching worker %d exited (%s)", process.pid, process.returncode)


@asynccontextmanager
async def open_worker_process(
    settings: Settings, *, log_level: str | None = None, listen: str | None = None, ports: int = 1,
    started: WorkerProcess | None = None,
) -> AsyncIterator[trio.SocketStream]:
    """A worker process's stream (:meth:`WorkerProcess.start`; or ``started``, one already
    started), reaped on exit."""
    worker = started or await WorkerProcess.start(
        settings, log_level=log_level, listen=listen, ports=ports)
    try:
        yield worker.stream
    finally:
        await worker.aclose()


@asynccontextmanager
async def open_worker_socket(path: str, timeout_s: float) -> AsyncIterator[trio.SocketStream]:
    """Connect to a shared worker listening on the Unix socket ``path`` (``serve --api-workers``),
    waiting up to ``timeout_s`` for it to appear (it may be loading the model, or restarting)."""
    with trio.fail_after(timeout_s):
        while True:
            try:
                stream = await trio.open_unix_socket(path)
                break
            except OSError:
                await trio.sleep(0.1)
    try:
        yield stream
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


class MemoryConnection:
    """The front end's end of an in-process worker."""

    def __init__(
        self,
        core: WorkerCore,
        send: trio.MemorySendChannel[bytes],
        receive: trio.MemoryReceiveChannel[bytes],
    ) -> None:
        self.core = core
        self._send = send
        self._receive = receive

    async def send_all(self, data: bytes) -> None:
        try:
            self._send.send_nowait(data)
        except trio.ClosedResourceError:
            raise trio.BrokenResourceError("the worker is gone") from None

    async def receive_some(self) -> bytes:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            return b""

    def nudge(self) -> None:
        """Make an idle worker look at its engine again (tests that gate ``schedule``)."""
        self._send.send_nowait(b"")


@asynccontextmanager
async def open_worker_task(engine: Engine, *, in_thread: bool) -> AsyncIterator[MemoryConnection]:
    """Run ``engine`` behind the protocol in a task of this process: each step inline on the event
    loop (instant models: exact under a mock clock) or in a worker thread (``in_thread``)."""
    from trio_infer.runtime.worker import WorkerCore, serve_task

    to_worker, inbox = trio.open_memory_channel[bytes](math.inf)
    outbox, from_worker = trio.open_memory_channel[bytes](math.inf)
    core = WorkerCore(engine)

    async def worker() -> None:
        # As a worker process would: a crash is logged and closes the pipe (serve_task closes its
        # outbox), and the front end sees a worker death, not an exception of its own.
        try:
            await serve_task(core, inbox, outbox, in_thread)
        except Exception:
            log.exception("the in-process batching worker crashed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        try:
            yield MemoryConnection(core, to_worker, from_worker)
        finally:
            nursery.cancel_scope.cancel()
