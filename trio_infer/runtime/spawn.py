"""Starting a batching worker process, without trio or anything else heavy.

``serve`` starts its worker first thing, before it imports trio and the web stack (0.1 s and
0.3 s of its start-up here): the worker's own imports (torch, about a second) then run on the
other core meanwhile, and the server is healthy that much sooner. So the start is plain
``subprocess`` and ``socket``; ``runtime/transport.py`` (``WorkerProcess``) wraps what this
returns for trio, and is how every worker is started, the first and the restarts alike.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

from trio_infer.settings import Settings, worker_environment
from trio_infer.wire import Start, encode

log = logging.getLogger(__name__)

# Both ends' socket buffers: a step's frame for many sequences goes out in one write.
SOCKET_BUFFER = 4 * 2**20


def start_message(settings: Settings, log_level: str | None = None) -> Start:
    """What a new worker is told first: the settings (less the API key) and the log level
    (default: this process's, so ``serve --log-level`` reaches the worker)."""
    if log_level is None:
        log_level = logging.getLevelName(logging.getLogger("trio_infer").getEffectiveLevel())
    return Start(settings.model_dump_json(exclude={"api_key"}), str(log_level).upper())


def spawn_worker(
    settings: Settings, *, log_level: str | None = None, listen: str | None = None, ports: int = 1,
) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start ``python -m trio_infer.runtime.worker`` on one end of a socket pair and send it
    :class:`~trio_infer.wire.Start`; returns the process and this side's end. With ``listen`` it
    is a shared worker that serves ``ports`` front ends connecting to that Unix socket, and the
    pair is its control pipe. The caller owns both (closing the socket ends the worker)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (ours, theirs):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    argv = [sys.executable, "-m", "trio_infer.runtime.worker", "--fd", str(theirs.fileno())]
    if listen is not None:
        argv += ["--listen", listen, "--ports", str(ports)]
    try:
        process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),),
                                   env=worker_environment(settings))
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    try:
        ours.sendall(encode([start_message(settings, log_level)]))  # far below the buffer's size
    except BaseException:
        ours.close()
        process.kill()
        process.wait()
        raise
    log.info("batching worker started (pid %d)", process.pid)
    return process, ours
