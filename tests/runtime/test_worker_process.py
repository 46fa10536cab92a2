"""The batching worker as a real process: killed, restarted, shut down, orphaned. Nothing may be
left behind: no request hanging, no child process, no zombie."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> set[int]:
    """The live (non-zombie) child processes of ``pid``."""
    found: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
    except FileNotFoundError:
        return set()
    return {c for c in found if _state(c) not in (None, "Z")}


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def wait_for(predicate, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` (a real process is on the other side: no virtual time here); return the
    seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - start


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


@contextmanager
def serving_fake(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m trio_infer serve --model fake ARGS`` on a free port, once /health says 200;
    killed on exit if still running."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_infer", "serve", "--model", "fake", "--port", str(port),
         "--cache-dir", str(tmp_path), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_for(lambda: health(url) == 200 or proc.poll() is not None, 120, "the server")
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    with serving_fake(tmp_path, "--fake-step-ms", "5", "--max-running", "64",
                      "--worker-restart-delay-s", "0.1", "--shutdown-grace-s", "1") as served:
        yield served


def stream_events(url: str, body: dict, started: threading.Barrier) -> list:  # type: ignore[type-arg]
    # Split on the SSE event separator only: the fake model's text may hold characters that
    # str.splitlines (and so httpx's iter_lines) would take for line breaks.
    events, buffer = [], b""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            buffer += chunk
            *blocks, buffer = buffer.split(b"\n\n")
            for block in blocks:
                payload = block.decode()[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if len(events) == 1:
                    started.wait(timeout=60)
    assert buffer == b""
    return events


def test_kill_9_of_the_worker_during_64_streams(server) -> None:  # type: ignore[no-untyped-def]
    proc, url = server
    [worker] = children(proc.pid)
    body = {"model": "fake", "prompt": "hello", "max_tokens": 100_000 // 50, "ignore_eos": True,
            "stream": True}
    started = threading.Barrier(65)
    results: list = [None] * 64

    def run(i: int) -> None:
        try:
            results[i] = stream_events(url, body, started)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    started.wait(timeout=60)  # every stream has its first event
    os.kill(worker, signal.SIGKILL)
    took = wait_for(lambda: health(url) == 503, 5, "/health to say 503")
    assert took < 1.0, f"/health said 503 only after {took:.2f} s"
    for t in threads:
        t.join(timeout=60)
    for events in results:
        assert isinstance(events, list), events
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "service_unavailable", events[-2]

    wait_for(lambda: health(url) == 200, 60, "the restarted worker")
    [restarted] = children(proc.pid)
    assert restarted != worker and not alive(worker)  # the dead one was reaped
    r = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 5}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    metrics = httpx.get(url + "/metrics").text
    assert "trio_infer_sessions_active 0.0" in metrics
    assert "trio_infer_requests_running 0.0" in metrics

    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output[-3000:]
    assert "restarting the batching worker (1 of at most" in output
    assert not alive(restarted), "the worker outlived its server"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_no_child_left_after_a_graceful_stop(server, signum) -> None:  # type: ignore[no-untyped-def]
    proc, url = server
    [worker] = children(proc.pid)
    proc.send_signal(signum)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    wait_for(lambda: not alive(worker), 10, "the worker to exit")


def test_the_worker_exits_when_its_front_end_is_killed(server) -> None:  # type: ignore[no-untyped-def]
    proc, url = server
    [worker] = children(proc.pid)
    proc.kill()  # no cleanup at all on the front end's side
    proc.wait()
    wait_for(lambda: not alive(worker), 10, "the orphaned worker to exit")


def test_a_model_that_cannot_load_fails_the_start_with_its_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "trio_infer", "serve", "--model", str(tmp_path / "missing"),
         "--port", str(free_port()), "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "missing" in out.stdout + out.stderr


# -- the forward-progress watchdog: a worker stopped by SIGSTOP (alive, holding its socket) -------


def start_streams(url: str, n: int, max_tokens: int, model: str = "fake",
                  prompt: str = "hello") -> tuple[list, list[threading.Thread]]:
    """``n`` streams of ``max_tokens``, returned once every one has its first event."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    started = threading.Barrier(n + 1)
    results: list = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = stream_events(url, body, started)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions of the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    return results, threads


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_sigstop_of_the_worker_is_a_stall_and_sigcont_ends_it(tmp_path: Path) -> None:
    with serving_fake(tmp_path, "--fake-step-ms", "5", "--watchdog-stall-s", "1.5",
                      "--watchdog-restart-s", "60") as (proc, url):
        [worker] = children(proc.pid)
        results, threads = start_streams(url, 8, 600)  # 3 s of steps
        os.kill(worker, signal.SIGSTOP)
        try:
            took = wait_for(lambda: health(url) == 503, 20, "/health to say 503")
            assert took >= 1.0, f"stalled after {took:.2f} s, before the 1.5 s bound"
            status = httpx.get(url + "/v1/status").json()
            assert "no progress for" in status["problem"], status
            assert status["watchdog"]["stalled"] is True
            assert "no progress" in httpx.get(url + "/health").text
        finally:
            os.kill(worker, signal.SIGCONT)
        wait_for(lambda: health(url) == 200, 20, "/health to say 200 again")
        for t in threads:
            t.join(timeout=60)
        for events in results:
            assert isinstance(events, list), events
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert children(proc.pid) == {worker}  # the same worker went on
        assert metric(url, "trio_infer_worker_stalls_total") == 1
        assert metric(url, "trio_infer_worker_watchdog_restarts_total") == 0


def test_sigstop_past_the_restart_bound_replaces_the_worker(tmp_path: Path) -> None:
    with serving_fake(tmp_path, "--fake-step-ms", "5", "--watchdog-stall-s", "1",
                      "--watchdog-restart-s", "3", "--worker-restart-delay-s", "0.1") as (proc, url):
        [worker] = children(proc.pid)
        results, threads = start_streams(url, 8, 100_000 // 50)
        os.kill(worker, signal.SIGSTOP)
        for t in threads:
            t.join(timeout=60)
        for events in results:  # each ends once, with an error event
            assert isinstance(events, list), events
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "service_unavailable", events[-2]
            assert "no progress for" in events[-2]["error"]["message"]
            assert sum("error" in e for e in events[:-1]) == 1
        wait_for(lambda: health(url) == 200, 60, "the replacement worker")
        assert worker not in children(proc.pid) and not alive(worker)  # killed and reaped
        assert metric(url, "trio_infer_worker_watchdog_restarts_total") == 1
        for gauge in ("sessions_active", "requests_running", "worker_stalled"):
            assert metric(url, "trio_infer_" + gauge) == 0
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi",
                                                       "max_tokens": 5}, timeout=60)
        assert r.status_code == 200
