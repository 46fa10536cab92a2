"""An engine object this process holds, served behind the wire protocol in a trio task over
memory channels: the in-process batching worker of tests and of programs that embed the server.

On the worker's side of the wire: the front end never imports it. Whoever holds the engine (the
app given ``loaded``, a test) builds the connection here with :func:`in_process` and hands the
front end (``runtime/client.py: open_engine``) its ``connect``, as for a worker process.
"""

from __future__ import annotations

import logging
import math
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import trio

if TYPE_CHECKING:
    from trio_infer.engine.engine import Engine
    from trio_infer.runtime.worker import WorkerCore

log = logging.getLogger(__name__)


def is_instant(engine: Engine) -> bool:
    """Models whose forward is instant run inline in the worker task, without a thread hop."""
    return getattr(engine.model, "instant", False)


def in_process(engine: Engine) -> Callable[[], AbstractAsyncContextManager[Any]]:
    """The ``connect`` of ``engine`` served in a task of this process (:func:`open_worker_task`;
    each step in a worker thread unless the model is instant)."""
    in_thread = not is_instant(engine)
    return lambda: open_worker_task(engine, in_thread=in_thread)


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
    from trio_infer.runtime.worker import WorkerCore, serve_task  # the engine's imports: torch

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
