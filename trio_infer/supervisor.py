"""``python -m trio_infer serve --api-workers N``: N front ends, one batching worker.

With one front end (the default) the front end starts its own worker (``runtime/transport.py``).
With N, a supervisor process (this module) owns everything: it binds the listening socket, starts
one *shared* worker listening on a private Unix socket, then N front-end processes (the ordinary
``serve``, each inheriting the listening socket and connecting to the worker on a pipe of its
own: vLLM's ``--api-server-count``). The kernel spreads new connections over the front ends.

Lifecycle:

* the worker dies: every front end sees its pipe close, fails its live requests, answers 503 and
  reconnects; the supervisor restarts the worker (bounded, logged);
* SIGTERM or SIGINT: forwarded to the front ends, which drain gracefully and exit; then the
  supervisor closes the worker's control pipe, which ends it, and reaps it;
* a front end dies on its own: the others are stopped as on SIGTERM, then the worker; exit 1.

The worker and the front ends never outlive the supervisor's pipe to them: a worker exits when
its control pipe closes, a front end's worker connection closes when the worker exits.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
from typing import Callable
import trio

from trio_infer.runtime.protocol import Fatal, FrameDecoder, FromWorker
from trio_infer.settings import Settings, worker_environment

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
            nursery.start_soon(_run_worker, settings, address, n, worker_scope, give_up)
            env = {**os.environ, **_settings_env(settings), "TRIO_INFER_API_WORKERS": "1"}
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
        try:
            os.unlink(address)
        except FileNotFoundError:
            pass
        os.rmdir(folder)


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
    settings: Settings, address: str, ports: int, scope: trio.CancelScope, give_up: Callable[[], None]
) -> None:
    """Run the shared worker until ``scope`` is cancelled; restart it when it dies."""
    restarts = 0
    with scope:
        while True:
            started = trio.current_time()
            if not await _one_worker(settings, address, ports):
                give_up()
                return
            if trio.current_time() - started >= settings.worker_restart_window_s:
                restarts = 0
            restarts += 1
            if restarts > settings.worker_max_restarts:
                log.error("the batching worker died %d times in a row; giving up", restarts)
                give_up()
                return
            log.warning("restarting the batching worker (%d of at most %d)", restarts,
                        settings.worker_max_restarts)
            await trio.sleep(settings.worker_restart_delay_s)


async def _one_worker(settings: Settings, address: str, ports: int) -> bool:
    """Run one worker process until it exits; False if it could not load the model."""
    ours, theirs = socket.socketpair()
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "trio_infer.runtime.worker", "--fd", str(theirs.fileno()),
             "--listen", address, "--ports", str(ports)],
            pass_fds=(theirs.fileno(),),
            env=worker_environment(settings),
        )
    finally:
        theirs.close()
    control = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    try:
        config = settings.model_dump_json().encode()
        await control.send_all(len(config).to_bytes(4, "big") + config)
        decoder = FrameDecoder(FromWorker)
        fatal = False
        while True:  # the worker says nothing here unless it could not load the model
            data = await control.receive_some()
            if not data:
                break
            for message in decoder.feed(data):
                if isinstance(message, Fatal):
                    fatal = True
                    log.error("the batching worker cannot start: %s", message.message)
        status = await process.wait()
        log.error("the batching worker exited (%s)", status)
        return not fatal
    finally:
        with trio.CancelScope(shield=True):
            await control.aclose()  # the worker's signal to exit
            with trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


def _settings_env(settings: Settings) -> dict[str, str]:
    """The settings as the environment variables a front end reads them from."""
    env = {}
    for name, value in settings.model_dump(exclude_none=True).items():
        env[f"TRIO_INFER_{name.upper()}"] = str(value)
    return env


def run(settings: Settings, log_level: str) -> int:
    return trio.run(supervise, settings, log_level)


