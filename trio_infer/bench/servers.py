"""Start and stop the servers a bench measures: each in its own session (process group), its
output to a log file, waited for until ``GET /health`` answers 200, stopped with SIGINT to the
whole group and SIGKILL to what is left of it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class System:
    """A server to measure: ours (an argv) or a compared one (a shell command with ``{port}``)."""

    name: str
    command: list[str] | str
    env: dict[str, str]
    model: str | None  # for the load generator; None = the first id of GET /v1/models

    def argv(self, port: int) -> list[str]:
        if isinstance(self.command, str):
            shell = shutil.which("bash") or "/bin/sh"
            return [shell, "-c", self.command.replace("{port}", str(port))]
        return [part.replace("{port}", str(port)) for part in self.command]

    def display(self) -> str:
        if isinstance(self.command, str):
            return self.command
        return " ".join(self.command)


def start_server(system: System, port: int, log: Path) -> subprocess.Popen:
    """Start ``system`` on ``port`` in a new session (its own process group, led by the
    returned process), output to ``log``."""
    with open(log, "wb") as log_file:
        return subprocess.Popen(system.argv(port), env=system.env, stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_server(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGINT to the server's whole process group, then SIGKILL to whatever is left of the group
    (the leader or any process it started) after ``timeout`` seconds."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    deadline = time.monotonic() + timeout
    if proc.poll() is None:
        try:
            os.killpg(pgid, signal.SIGINT)
        except ProcessLookupError:
            pass
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, so that only live processes keep the group alive
        if not _group_alive(pgid):
            break
        time.sleep(0.05)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 5.0  # SIGKILL takes effect asynchronously
        while time.monotonic() < deadline:
            proc.poll()
            if not _group_alive(pgid):
                break
            time.sleep(0.02)
    proc.wait()


def log_tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-4000:]
    except OSError:
        return "(no log)"


async def wait_healthy(ep: Any, proc: subprocess.Popen, timeout: float, log: Path,
                        name: str = "ours") -> None:
    import trio

    from trio_infer.bench.client import request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server {name!r} exited with {proc.returncode}; its log:\n"
                             + log_tail(log))
        try:
            status, _ = await request(ep, "GET", "/health")
            if status == 200:
                return
        except OSError:
            pass
        await trio.sleep(0.2)
    raise SystemExit(f"error: the server {name!r} did not become healthy in {timeout:g} s; "
                     f"its log:\n{log_tail(log)}")
