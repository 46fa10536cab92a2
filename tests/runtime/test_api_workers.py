"""``serve --api-workers 2``: two front ends on one listening socket, one shared batching worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from .test_worker_process import alive, children, free_port, health, wait_for


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


class _Output:
    """The supervisor's output (its front ends' and worker's logs too), read as it comes: how a
    test knows that each front end is ready, which /health cannot say (both answer on one
    listening socket, and the kernel picks which accepts a connection)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self.lines.append(line)

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def text(self) -> str:
        """All of it, once the process has exited."""
        self._reader.join(timeout=60)
        return "".join(self.lines)


def _start(tmp_path: Path) -> tuple[subprocess.Popen, str, _Output]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_infer", "serve", "--model", "fake", "--api-workers", "2",
         "--port", str(port), "--cache-dir", str(tmp_path), "--worker-restart-delay-s", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
    )
    output = _Output(proc)
    # Each front end listens at once and answers 503 (loading) until it has its tokenizer and
    # its pipe to the worker, then logs "serving".
    wait_for(lambda: output.count("serving fake") == 2 or proc.poll() is not None, 120,
             "both front ends ready")
    assert proc.poll() is None, output.text()[-3000:]
    return proc, url, output


def _processes(supervisor: int) -> tuple[int, list[int]]:
    kids = children(supervisor)
    workers = [p for p in kids if "trio_infer.runtime.worker" in _cmdline(p)]
    assert len(kids) == 3 and len(workers) == 1, [_cmdline(p) for p in kids]
    return workers[0], sorted(kids - set(workers))


def test_two_front_ends_share_one_worker_and_survive_its_death(tmp_path: Path) -> None:
    proc, url, output = _start(tmp_path)
    try:
        worker, front_ends = _processes(proc.pid)
        body = {"model": "fake", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
        for _ in range(40):
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)  # a new connection each
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
        # Stored responses are shared: each is found whichever front end takes the retrieve.
        ids = [httpx.post(url + "/v1/responses", json={"model": "fake", "input": "hi",
                                                        "max_output_tokens": 2}, timeout=30).json()["id"]
               for _ in range(8)]
        for rid in ids * 2:
            assert httpx.get(f"{url}/v1/responses/{rid}", timeout=30).json()["id"] == rid
        assert output.count("share their stored responses in a temporary SQLite file") == 1
        r = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "hi", "background": True},
                       timeout=30)  # its cancel could reach another front end: refused by name
        assert r.status_code == 400 and r.json()["error"]["param"] == "background"

        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: health(url) == 503, 5, "503 while the worker is gone")
        # Each front end says so at every hello of a worker: twice at the start, twice again now.
        wait_for(lambda: output.count("batching worker ready") == 4, 60, "both front ends back")
        restarted, same_front_ends = _processes(proc.pid)
        assert restarted != worker and same_front_ends == front_ends and not alive(worker)
        for _ in range(10):
            assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole group
        proc.wait(timeout=60)
    text = output.text()
    assert proc.returncode == 0, text[-3000:]
    assert "front end connected on port 0" in text and "front end connected on port 1" in text
    assert "restarting the batching worker (1 of at most" in text
    for pid in [restarted, *front_ends]:
        assert not alive(pid), f"{_cmdline(pid)} outlived its supervisor"


def test_sigterm_to_the_supervisor_stops_everything(tmp_path: Path) -> None:
    proc, url, output = _start(tmp_path)
    worker, front_ends = _processes(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    text = output.text()
    assert proc.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for pid in [worker, *front_ends]:
        wait_for(lambda: not alive(pid), 10, f"{pid} to exit")
