"""Connection-level limits against a real ``python -m trio_infer serve --model fake`` process:
each limit is tripped by a raw socket while another client is served meanwhile.

The limits (README, "Connection limits"): ``keep_alive_timeout_s`` closes a connection that has
not sent a complete request head in time (idle keep-alive and header slowloris alike) but never
one whose request is being answered; ``max_header_bytes`` refuses a bigger head with 431;
``body_timeout_s`` answers 408 to a body that trickles in too slowly. hypercorn has no cap on
the number of connections: many idle ones all get in and are all closed by the timeout.

An idle keep-alive connection is closed after a response, and a ``Connection: close`` answer's
socket after it is sent, because the app sends a response's last message under a shield
(``trio_infer/api/last_send.py`` says why hypercorn's own bookkeeping needs it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from .test_worker_process import free_port, health, wait_for

KEEP_ALIVE_S = 1.0
BODY_TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 4096
IDLE_CONNECTIONS = 64
SLACK_S = 1.5  # scheduling on a busy 2-core machine


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")  # one for both servers: the second starts warm


def _serving(cache_dir: Path, *flags: str) -> Iterator[str]:
    """``serve --model fake`` with ``flags`` on a free port, until the generator is closed."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_infer", "serve", "--model", "fake", "--port", str(port),
         "--cache-dir", str(cache_dir), "--shutdown-grace-s", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_for(lambda: health(url) == 200 or proc.poll() is not None, 120, "the server")
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        yield url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def url(cache_dir: Path) -> Iterator[str]:
    yield from _serving(
        cache_dir, "--fake-step-ms", "5", "--keep-alive-timeout-s", str(KEEP_ALIVE_S),
        "--body-timeout-s", str(BODY_TIMEOUT_S), "--max-header-bytes", str(MAX_HEADER_BYTES))


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection; and when it closed."""
    start = time.monotonic()
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def served(url: str) -> None:
    """A normal request, answered in full."""
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 4},
                   timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


class Trickle(threading.Thread):
    """Sends ``pieces`` one every ``every`` seconds until the server closes the socket."""

    def __init__(self, sock: socket.socket, pieces: Iterator[bytes], every: float) -> None:
        super().__init__(daemon=True)
        self.sock, self.pieces, self.every = sock, pieces, every
        self.sent = 0

    def run(self) -> None:
        for piece in self.pieces:
            try:
                self.sock.sendall(piece)
            except OSError:
                return
            self.sent += 1
            time.sleep(self.every)


def forever(piece: bytes) -> Iterator[bytes]:
    for i in range(10_000):
        yield piece % i if b"%d" in piece else piece


def test_header_slowloris_is_closed_after_keep_alive_timeout(url: str) -> None:
    sock = connect(url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    trickle = Trickle(sock, forever(b"X-Slow-%d: y\r\n"), every=0.2)
    trickle.start()
    served(url)  # others are served meanwhile
    data, took = read_until_closed(sock, timeout=KEEP_ALIVE_S + SLACK_S + 5)
    assert took < KEEP_ALIVE_S + SLACK_S, took
    assert trickle.sent >= 3  # it was still sending when it was cut off
    assert data == b""  # no request was ever read: nothing to answer
    sock.close()
    served(url)


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_idle_keep_alive_connection_is_closed(url: str, path: str) -> None:
    """After a route quart serves (``/v1/models``) as after one the app answers before quart
    (``/health``). Without the app's shielded last send, hypercorn's idle timer is lost under
    quart-trio after every response of quart's, and that connection stays open for good."""
    sock = connect(url)
    for _ in range(2):  # keep-alive still works: a second request on the same connection
        sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
        head, body, _ = read_response(sock, timeout=5)
        assert head.startswith(b"HTTP/1.1 200") and body.startswith(b'{'), head
    data, took = read_until_closed(sock, timeout=KEEP_ALIVE_S + SLACK_S + 2)
    sock.close()
    assert data == b""
    assert KEEP_ALIVE_S - 0.3 < took < KEEP_ALIVE_S + SLACK_S, took
    served(url)


def test_a_request_longer_than_the_keep_alive_timeout_is_not_cut(url: str) -> None:
    # ~2.5 s of 5 ms steps, the client sending nothing meanwhile: only an idle connection is cut.
    body = {"model": "fake", "prompt": "hi", "max_tokens": 500, "ignore_eos": True}
    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 500
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        text = b"".join(s.iter_bytes())
    assert text.endswith(b"data: [DONE]\n\n") and b'"error"' not in text
    assert time.monotonic() - start > 2 * KEEP_ALIVE_S


def read_response(sock: socket.socket, timeout: float) -> tuple[bytes, bytes, float]:
    """One response with a Content-Length (head, body) and when it was complete."""
    start = time.monotonic()
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, data
        body += chunk
    return head, body, time.monotonic() - start


def test_body_slowloris_gets_408_after_the_body_timeout(url: str) -> None:
    sock = connect(url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{")
    trickle = Trickle(sock, forever(b" "), every=0.2)
    trickle.start()
    served(url)  # others are served meanwhile
    head, body, took = read_response(sock, timeout=BODY_TIMEOUT_S + SLACK_S + 5)
    assert took < BODY_TIMEOUT_S + SLACK_S, took
    assert trickle.sent >= 3  # it was still sending
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    sock.close()
    served(url)


@pytest.mark.parametrize("keeps_sending", [True, False])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses"])
def test_the_connection_of_a_408_is_closed(url: str, keeps_sending: bool, path: str) -> None:
    """A ``Connection: close`` answer's socket is closed once it is sent, whether the client
    keeps sending or not, on a route quart serves (``/v1/responses``) as on one the app answers
    before quart: hypercorn shuts it down from inside the app's last send."""
    sock = connect(url)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{" % path.encode())
    if keeps_sending:
        Trickle(sock, forever(b" "), every=0.2).start()
    try:
        head, _, _ = read_response(sock, timeout=BODY_TIMEOUT_S + SLACK_S + 5)
        assert head.startswith(b"HTTP/1.1 408"), head
        data, took = read_until_closed(sock, timeout=KEEP_ALIVE_S + SLACK_S + 2)
        assert data == b""
        assert took < KEEP_ALIVE_S + SLACK_S, took
    finally:
        sock.close()
    served(url)


def test_headers_over_the_limit_get_431(url: str) -> None:
    # A head that arrives in one piece: our own check (the JSON envelope).
    sock = connect(url)
    big = b"X-Big: " + b"a" * MAX_HEADER_BYTES + b"\r\n"
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
    head, body, took = read_response(sock, timeout=5)
    assert head.startswith(b"HTTP/1.1 431"), head
    assert b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "headers_too_large" and str(MAX_HEADER_BYTES) in err["message"]
    sock.close()
    # A head still incomplete past the limit: hypercorn's own 431 (h11_max_incomplete_size), and
    # the connection is closed.
    sock = connect(url)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    try:
        for _ in range(3):  # 1.5x the limit: the third piece trips it
            sock.sendall(b"X-Big: " + b"a" * (MAX_HEADER_BYTES // 2) + b"\r\n")
            time.sleep(0.05)
    except OSError:
        pass  # closed before the last piece: what the test expects; read what it sent
    data, took = read_until_closed(sock, timeout=5)
    assert data.startswith(b"HTTP/1.1 431"), data[:200]
    sock.close()
    # A head just under the limit is fine.
    r = httpx.get(url + "/health", headers={"X-Big": "a" * (MAX_HEADER_BYTES - 512)}, timeout=10)
    assert r.status_code == 200
    served(url)


def test_idle_connections_are_reclaimed(url: str) -> None:
    """Connections that send nothing all get in (there is no cap), the server serves others
    meanwhile, and every one is closed after the keep-alive timeout."""
    socks = [connect(url) for _ in range(IDLE_CONNECTIONS)]
    served(url)
    start = time.monotonic()
    for sock in socks:
        data, _ = read_until_closed(sock, timeout=KEEP_ALIVE_S + SLACK_S + 5)
        assert data == b""
        sock.close()
    assert time.monotonic() - start < KEEP_ALIVE_S + SLACK_S + 1
    served(url)
