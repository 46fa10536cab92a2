"""A lean HTTP/1.1 client for streaming benchmarks: trio sockets, h11 framing, our SSE parsing.

Why not httpx or the openai client: at 256 concurrent streams the load generator shares two CPU
cores with the server it measures, so every microsecond it spends per chunk is taken from the
server. h11 (a dependency of hypercorn, so always installed) does the HTTP framing correctly
(Content-Length, chunked, read-until-close); the rest is a socket read loop that timestamps each
read and splits server-sent events. One connection per request, plain ``http://`` only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

READ_SIZE = 65536


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    path_prefix: str  # e.g. "/v1", no trailing slash

    @classmethod
    def parse(cls, base_url: str) -> "Endpoint":
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise ValueError(f"only http:// base URLs are supported, got {base_url!r}")
        if not url.hostname:
            raise ValueError(f"no host in {base_url!r}")
        return cls(url.hostname, url.port or 80, url.path.rstrip("/"))

    def authority(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class StreamResult:
    """One streamed request, with ``time.perf_counter()`` timestamps."""

    ok: bool = False
    error: str | None = None
    status: int = 0  # the HTTP status (0: no response)
    retry_after: str | None = None  # its Retry-After header, if any
    start: float = 0.0  # request about to be sent
    end: float = 0.0  # stream over (or failed)
    # Arrival time of each token-carrying event (one whose choices carry text: a completion's
    # ``text`` or a chat ``delta``'s ``content``; a chat stream's opening role-only chunk and a
    # text-less final chunk are not token events): the time of the socket read that delivered it,
    # so events that arrived in one read share a time.
    event_times: list[float] = field(default_factory=list)
    # Arrival times of the socket reads that delivered at least one token-carrying event.
    chunk_times: list[float] = field(default_factory=list)
    # HTTP chunks (h11 Data events) that completed at least one token-carrying event: about the
    # server's writes, several of which may arrive in one socket read.
    http_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # from the final usage chunk, if the server sent one

    @property
    def ttft(self) -> float | None:
        return self.event_times[0] - self.start if self.event_times else None

    @property
    def output_tokens(self) -> int:
        """The server's ``usage.completion_tokens`` when it sent a usage chunk, else the number of
        token-carrying events (exact for a server that sends one event per token)."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.event_times)


def carries_text(choices: list[Any]) -> bool:
    """Whether an event's ``choices`` deliver output: a non-empty completion ``text`` or chat
    ``delta`` content (``content``, ``reasoning_content``, ``tool_calls``)."""
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        if ch.get("text"):
            return True
        delta = ch.get("delta")
        if delta and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
            return True
    return False


def _request_headers(ep: Endpoint, body: bytes | None, api_key: str | None, accept: str) -> list[tuple[str, str]]:
    headers = [("Host", ep.authority()), ("Accept", accept), ("Connection", "close")]
    if body is not None:
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if api_key:
        headers.append(("Authorization", f"Bearer {api_key}"))
    return headers


async def _send_request(stream: trio.SocketStream, conn: h11.Connection, method: str, target: str,
                        headers: list[tuple[str, str]], body: bytes | None) -> None:
    data = conn.send(h11.Request(method=method, target=target, headers=headers))
    if body is not None:
        data += conn.send(h11.Data(data=body))
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)


async def request(ep: Endpoint, method: str, path: str, body: Any = None,
                  api_key: str | None = None) -> tuple[int, bytes]:
    """A plain request; returns (status, body)."""
    raw = json.dumps(body).encode() if body is not None else None
    stream = await trio.open_tcp_stream(ep.host, ep.port)
    async with stream:
        conn = h11.Connection(our_role=h11.CLIENT)
        await _send_request(stream, conn, method, ep.path_prefix + path,
                            _request_headers(ep, raw, api_key, "*/*"), raw)
        status = 0
        chunks: list[bytes] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(READ_SIZE))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, b"".join(chunks)


async def stream_sse(ep: Endpoint, path: str, body: dict[str, Any], api_key: str | None = None,
                     result: StreamResult | None = None) -> StreamResult:
    """POST ``body`` and read the server-sent event stream to its end (``data: [DONE]``).

    Never raises for a failed request: it returns ``ok=False`` with the error (HTTP status, an
    ``error`` event, a connection error, a stream that ends without ``[DONE]``).
    """
    res = result or StreamResult()
    raw = json.dumps(body).encode()
    res.start = time.perf_counter()
    try:
        stream = await trio.open_tcp_stream(ep.host, ep.port)
        async with stream:
            await _read_sse(stream, ep, path, raw, api_key, res)
    except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
        res.ok = False
        res.error = f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter()
    return res


async def _read_sse(stream: trio.SocketStream, ep: Endpoint, path: str, raw: bytes,
                    api_key: str | None, res: StreamResult) -> None:
    conn = h11.Connection(our_role=h11.CLIENT)
    await _send_request(stream, conn, "POST", ep.path_prefix + path,
                        _request_headers(ep, raw, api_key, "text/event-stream"), raw)
    status = 0
    error_body: list[bytes] = []
    buf = b""
    done = False
    now = 0.0
    receive_some = stream.receive_some
    event_times = res.event_times
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await receive_some(READ_SIZE)
            now = time.perf_counter()
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Response):
            status = res.status = event.status_code
            for name, value in event.headers:
                if name == b"retry-after":
                    res.retry_after = value.decode("latin-1")
        elif isinstance(event, h11.Data):
            if status != 200:
                error_body.append(bytes(event.data))
                continue
            buf += event.data
            if b"\n\n" not in buf and b"\r\n\r\n" not in buf:
                continue
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n")
            *events, buf = buf.split(b"\n\n")
            tokens_before = len(event_times)
            for ev in events:
                for line in ev.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue  # comments, event:, id:, retry:
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    try:
                        obj = json.loads(payload)
                    except ValueError:
                        res.error = f"not JSON: {payload[:80]!r}"
                        continue
                    if obj.get("error") is not None:
                        res.error = f"error event: {json.dumps(obj['error'])[:200]}"
                        continue
                    choices = obj.get("choices")
                    if choices and carries_text(choices):
                        event_times.append(now)
                    usage = obj.get("usage")
                    if usage:
                        res.completion_tokens = usage.get("completion_tokens")
                        res.prompt_tokens = usage.get("prompt_tokens")
            # One socket read can hold several HTTP chunks (one h11 Data event each): the read,
            # not the HTTP chunk, is what the reader sees, so it counts once.
            if len(event_times) > tokens_before:
                res.http_chunks += 1
                if not res.chunk_times or res.chunk_times[-1] != now:
                    res.chunk_times.append(now)
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    if status != 200:
        res.error = f"HTTP {status}: {b''.join(error_body)[:200].decode(errors='replace')}"
    elif not done and res.error is None:
        res.error = "the stream ended without data: [DONE]"
    res.ok = res.error is None
