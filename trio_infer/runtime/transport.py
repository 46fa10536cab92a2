"""How a batching worker is reached: a child process over a socket pair, or a shared worker's Unix
socket (an engine this process holds is served in a task over memory channels instead:
``runtime/in_process.py``, on the worker's side). All carry the same bytes, so everything above
them is the same code.

Each ``open_*`` function is an async context manager giving a
:class:`~trio_infer.runtime.worker_link.Connection`: it starts (or reaches) the worker and, on
exit for any reason, stops it and waits for it: a worker process is always reaped, never left
behind. :class:`~trio_infer.runtime.worker_link.WorkerLink` does the rest (handshake, restarts).

Nothing here imports the engine: a front end that spawns a worker process never loads torch.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio

from trio_infer.runtime.spawn import spawn_worker
from trio_infer.settings import Settings

log = logging.getLogger(__name__)

# Seconds a worker gets to exit after its pipe closed before it is killed.
_EXIT_WAIT_S = 5.0


class WorkerProcess:
    """A batching worker process (started by :func:`~trio_infer.runtime.spawn.spawn_worker`,
    already told its settings) and the front end's end of its socket pair, as a trio stream
    (:attr:`stream`). :meth:`aclose` closes the pipe (the worker exits on EOF, at once if it is
    still loading) and reaps it; it is idempotent.

    A process already started can be handed in (``serve`` starts its worker before it imports
    trio: runtime/spawn.py says why); :meth:`start` starts one (the restarts, the supervisor's
    shared worker, the data-parallel workers)."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.process = process
        self.stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self._closed = False

    @classmethod
    async def start(
        cls, settings: Settings, *, log_level: str | None = None, listen: str | None = None,
        ports: int = 1,
    ) -> "WorkerProcess":
        """:func:`~trio_infer.runtime.spawn.spawn_worker` (a fork and exec: a few milliseconds of
        this thread, as trio's own ``open_process`` spends them in another)."""
        return cls(*spawn_worker(settings, log_level=log_level, listen=listen, ports=ports))

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
                await _wait(process)
            if process.returncode is None:
                if exit_wait_s:
                    log.warning("the batching worker did not exit; killing it")
                process.kill()
                await _wait(process)
            log.info("batching worker %d exited (%s)", process.pid, process.returncode)


async def _wait(process: subprocess.Popen[bytes]) -> None:
    """Wait for ``process`` to exit, without blocking trio: its pidfd (Linux) becomes readable
    then; elsewhere a thread waits (abandoned if cancelled: the process is killed next)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
        return
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)
    process.wait()


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
