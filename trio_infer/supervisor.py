"""``python -m trio_infer serve --api-workers N``: N front ends, one batching worker.

With one front end (the default) the front end starts its own worker (``runtime/transport.py``,
kept by ``runtime/worker_link.py``).
With N, a supervisor process (this module) owns everything: it binds the listening socket, starts
one *shared* worker listening on a private Unix socket, then N front-end processes (the ordinary
``serve``, each inheriting the listening socket and connecting to the worker on a pipe of its
own: vLLM's ``--api-server-count``). The kernel spreads new connections over the front ends.

Lifecycle:

* the worker dies: every front end sees its pipe close, fails its live requests, answers 503 and
  reconnects; the supervisor restarts the worker (the same ``WorkerLink`` and restart policy as a
  single front end's: bounded, logged);
* SIGTERM or SIGINT: forwarded to the front ends, which drain gracefully and exit; then the
  supervisor closes the worker's control pipe, which ends it, and reaps it;
* a front end dies on its own: the others are stopped as on SIGTERM, then the worker; exit 1.

``--data-parallel N`` (several workers behind one front end, ``runtime/data_parallel.py``) is
refused with ``--api-workers N`` at startup (``Settings``): the shared worker is one.

The worker and the front ends never outlive the supervisor's pipe to them: a worker exits when
its control pipe closes, a front end's worker connection closes when the worker exits.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Callable

import trio

from trio_infer.runtime.transport import open_worker_process
from trio_infer.runtime.worker_link import WORKER_DEATH, MessageStream, RestartPolicy, WorkerLink
from trio_infer.settings import Settings
from trio_infer.wire import Fatal, Hello

log = logging.getLogger("trio_infer.supervisor")


async def supervise(settings: Settings, log_level: str) -> int:
    n = settings.api_workers
    listener = socket.create_server((settings.host, settings.port), backlog=2048, reuse_port=False)
    listener.set_inheritable(True)
    folder = tempfile.mkdtemp(prefix="trio-infer-")
    address = os.path.join(folder, "worker.sock")
    front_ends: list[trio.Process] = []
    failed = False

    def give_up() -> None:  # the worker cannot run: stop the front ends too
        nonlocal failed
        failed = True
        _signal_all(front_ends, signal.SIGTERM)

    try:
        async with trio.open_nursery() as nursery:
            worker_scope = trio.CancelScope()
            nursery.start_soon(_run_worker, settings, log_level, address, n, worker_scope, give_up)
            env = {**os.environ, **_settings_env(settings), "TRIO_INFER_API_WORKERS": "1"}
            if settings.responses_store == "memory":
                # One store for every front end, or a response would be found only by the front
                # end that answered it: a SQLite file that lives as long as this process.
                env["TRIO_INFER_RESPONSES_STORE"] = os.path.join(folder, "responses.sqlite")
                log.info("the %d front ends share their stored responses in a temporary SQLite "
                         "file (--responses-store PATH keeps them across restarts)", n)
            for _ in range(n):
                front_ends.append(await trio.lowlevel.open_process(
                    [sys.executable, "-m", "trio_infer", "serve", "--log-level", log_level,
                     "--listen-fd", str(listener.fileno()), "--worker-address", address],
                    env=env, pass_fds=(listener.fileno(),),
                ))
            log.info("%d front ends (pids %s) on %s:%d, one batching worker", n,
                     ", ".join(str(p.pid) for p in front_ends), settings.host, settings.port)
            code = await _watch(front_ends)
            worker_scope.cancel()
        return 1 if failed else code
    finally:
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)  # the worker's socket, the responses file


async def _watch(front_ends: list[trio.Process]) -> int:
    """Forward SIGTERM/SIGINT to the front ends; return once all have exited."""
    code = 0
    async with trio.open_nursery() as nursery:

        stopping = False

        async def forward_signals() -> None:
            nonlocal stopping
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    # The first signal drains; a second one ends the running requests now.
                    log.info("%s: stopping the front ends", signal.Signals(signum).name)
                    stopping = True
                    _signal_all(front_ends, signal.SIGTERM)

        async def wait_one(proc: trio.Process) -> None:
            nonlocal code
            status = await proc.wait()
            if stopping and status == -signal.SIGTERM:
                return  # a second SIGTERM after it had stopped listening for signals
            if status != 0 and code == 0:
                code = 1
                log.error("front end %d exited with %s; stopping the others", proc.pid, status)
                _signal_all(front_ends, signal.SIGTERM)

        nursery.start_soon(forward_signals)
        async with trio.open_nursery() as waiting:
            for proc in front_ends:
                waiting.start_soon(wait_one, proc)
        nursery.cancel_scope.cancel()
    return code


def _signal_all(procs: list[trio.Process], signum: int) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signum)


async def _run_worker(
    settings: Settings, log_level: str, address: str, ports: int, scope: trio.CancelScope,
    give_up: Callable[[], None],
) -> None:
    """Run the shared worker until ``scope`` is cancelled; restart it when it dies. Calls
    ``give_up`` if it cannot load the model the first time, or died too often."""
    link = WorkerLink(
        lambda: open_worker_process(settings, log_level=log_level, listen=address, ports=ports),
        RestartPolicy(settings.worker_max_restarts, settings.worker_restart_window_s,
                      settings.worker_restart_delay_s),
    )
    with scope:
        try:
            await link.run(_wait_for_exit, on_down=lambda: None)
        except WORKER_DEATH as exc:
            log.error("the batching worker cannot start: %s", exc)
        give_up()


async def _wait_for_exit(stream: MessageStream, hello: Hello) -> None:
    """Serve a shared worker's control pipe: nothing to do but notice that it exited."""
    log.info("the batching worker is ready (%s), serving %d front ends", hello.name, hello.id_stride)
    while messages := await stream.receive():
        for message in messages:
            if isinstance(message, Fatal):
                log.error("the batching worker failed: %s", message.message)


def _settings_env(settings: Settings) -> dict[str, str]:
    """The settings as the environment variables a front end reads them from."""
    env = {}
    for name, value in settings.model_dump(exclude_none=True).items():
        env[f"TRIO_INFER_{name.upper()}"] = str(value)
    return env


def run(settings: Settings, log_level: str) -> int:
    return trio.run(supervise, settings, log_level)


