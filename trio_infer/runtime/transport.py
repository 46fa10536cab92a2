"""How the front end reaches a batching worker: a child process over a socket pair, or (for tests
and programs that hold an engine object) a trio task over memory channels. Both carry the same
bytes, so everything above them is the same code.

A connection is a :class:`trio.abc.Stream`-like object: ``send_all(bytes)``, ``receive_some()``
(``b""`` once the worker is gone). Each ``open_*`` function is an async context manager that
starts the worker and, on exit for any reason, stops it and waits for it: a worker process is
always reaped, never left behind.
"""

from __future__ import annotations

import logging
import math
import socket
import sys
from contextlib import asynccontextmanager
from typing import AsyncIterator, Protocol

import trio

from trio_infer.engine.engine import Engine
from trio_infer.runtime.worker import WorkerCore
from trio_infer.settings import Settings, worker_environment

log = logging.getLogger(__name__)

# Seconds a worker gets to exit after its pipe closed before it is killed.
_EXIT_WAIT_S = 5.0
_SOCKET_BUFFER = 4 * 2**20


class Connection(Protocol):
    async def send_all(self, data: bytes) -> None: ...

    async def receive_some(self) -> bytes: ...


@asynccontextmanager
async def open_worker_process(settings: Settings) -> AsyncIterator[Connection]:
    """Start ``python -m trio_infer.runtime.worker`` on one end of a socket pair."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (ours, theirs):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "trio_infer.runtime.worker", "--fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=worker_environment(settings),
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    log.info("batching worker started (pid %d)", process.pid)
    try:
        config = settings.model_dump_json().encode()
        await stream.send_all(len(config).to_bytes(4, "big") + config)
        yield stream
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()  # EOF: the worker exits
            with trio.move_on_after(_EXIT_WAIT_S):
                await process.wait()
            if process.returncode is None:
                log.warning("the batching worker did not exit; killing it")
                process.kill()
                await process.wait()
            log.info("batching worker %d exited (%s)", process.pid, process.returncode)


@asynccontextmanager
async def open_worker_socket(path: str, timeout_s: float) -> AsyncIterator[Connection]:
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
    to_worker, inbox = trio.open_memory_channel[bytes](math.inf)
    outbox, from_worker = trio.open_memory_channel[bytes](math.inf)
    core = WorkerCore(engine)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_core, core, inbox, outbox, in_thread)
        try:
            yield MemoryConnection(core, to_worker, from_worker)
        finally:
            nursery.cancel_scope.cancel()


async def _run_core(
    core: WorkerCore,
    inbox: trio.MemoryReceiveChannel[bytes],
    outbox: trio.MemorySendChannel[bytes],
    in_thread: bool,
) -> None:
    """:func:`trio_infer.runtime.worker.serve`, as a trio task."""
    with outbox:
        outbox.send_nowait(core.hello())
        while True:
            while True:
                try:
                    core.receive_data(inbox.receive_nowait())
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    return
            plan = core.schedule()
            if plan is None:
                frame = core.idle_frame()
                if frame:
                    outbox.send_nowait(frame)
                try:
                    core.receive_data(await inbox.receive())
                except trio.EndOfChannel:
                    return
                continue
            if in_thread:
                frame = await trio.to_thread.run_sync(core.run_step, plan)
            else:
                await trio.lowlevel.checkpoint()  # let requests run between steps
                frame = core.run_step(plan)
            outbox.send_nowait(frame)
