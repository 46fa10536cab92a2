"""Helpers for the HTTP tests: fake-model apps under the Quart test client, a step gate, SSE parsing.

In-process tests run the app on the fake model (instant, exact outputs) with the engine steps
inline on the event loop, so ``autojump_clock`` and ``wait_all_tasks_blocked`` make them exact:
no sleeps as synchronisation, virtual time for timeouts.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator

import h11
import trio

from trio_infer.app import create_app
from trio_infer.api.state import ServerState, server_state
from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.models.fake import FakeModel
from trio_infer.models.fake import expected_next_token
from trio_infer.models.synthetic import IM_END
from trio_infer.settings import Settings


def fake_engine(
    tokenizer: Any,
    *,
    model: FakeModel | None = None,
    max_model_len: int = 4096,
    num_pages: int | None = 512,
    page_size: int = 16,
    max_running: int = 8,
    max_batched_tokens: int = 256,
) -> Engine:
    if model is None:
        model = FakeModel(
            vocab_size=len(tokenizer),
            max_model_len=max_model_len,
            eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        )
    config = EngineConfig(
        page_size=page_size,
        num_pages=num_pages,
        max_running=max_running,
        max_batched_tokens=max_batched_tokens,
    )
    return Engine(model, config)


def expected(tokenizer: Any, prompt: list[int], n: int) -> list[int]:
    """The fake model's first ``n`` tokens after ``prompt`` (its EOS is the template's IM_END)."""
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(expected_next_token(seq, len(tokenizer), eos))
        seq.append(out[-1])
    return out


def make_app(tokenizer: Any, engine: Engine | None = None, **settings: Any):  # type: ignore[no-untyped-def]
    settings = {"model": "fake", "cache_dir": Path("/nonexistent-unused"), **settings}
    return create_app(Settings(**settings), loaded=(engine or fake_engine(tokenizer), tokenizer))


@asynccontextmanager
async def running(app) -> AsyncIterator[Any]:  # type: ignore[no-untyped-def]
    """The app started (``before_serving`` ran) and its test client."""
    async with app.test_app() as test_app:
        yield test_app.test_client()


def state(app) -> ServerState:  # type: ignore[no-untyped-def]
    return server_state(app)


class StepGate:
    """Lets the test decide how many engine steps may run: ``hold()`` then ``allow(n)``.

    While held, the engine finds nothing to schedule and idles, so ``wait_all_tasks_blocked``
    returns with every request exactly where it was.
    """

    def __init__(self, app) -> None:  # type: ignore[no-untyped-def]
        self.connection = state(app).engine.connection  # the in-process worker
        engine = self.connection.core.engine
        self._schedule = engine.schedule
        self.budget: float = math.inf
        self.steps = 0
        engine.schedule = self._gated  # type: ignore[method-assign]

    def _gated(self):  # type: ignore[no-untyped-def]
        if self.budget <= 0:
            return None
        plan = self._schedule()
        if plan is not None:
            self.budget -= 1
            self.steps += 1
        return plan

    def hold(self) -> None:
        self.budget = 0

    def allow(self, n: float = math.inf) -> None:
        self.budget = n
        self.connection.nudge()


def counts(app) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """What must be zero when nothing is in flight (lifecycle invariant 1, docs/testing.md), from the engine and from
    the /metrics gauges' underlying values. KV pages kept by the prefix cache are not counted."""
    st = state(app)
    ae, m = st.engine, st.metrics
    e = ae.connection.core.engine
    return {
        "sessions": ae.num_sessions,
        "live_uids": len(ae.live_uids()),
        "engine_requests": e.num_requests,
        "running": e.num_running,
        "waiting": e.num_waiting,
        "request_pages": e.num_request_pages,  # pages not merely kept by the prefix cache
        "gauge_sessions": int(m.sessions_active._value.get()),
        "gauge_running": int(m.requests_running._value.get()),
        "gauge_waiting": int(m.requests_waiting._value.get()),
    }


def all_zero(app) -> bool:  # type: ignore[no-untyped-def]
    return not any(counts(app).values())


def metric(text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus text: ``metric(text, "trio_infer_requests_total", 'finish_reason="abort"')``."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.M)
    assert found, f"{name}{{{labels}}} not in metrics"
    return float(found.group(1))


def parse_sse(raw: str) -> list[Any]:
    """Events of an SSE body: JSON objects, and the string "[DONE]". Checks the framing."""
    assert raw.endswith("\n\n"), raw[-80:]
    out: list[Any] = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def chat_body(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **kw}


async def read_until(conn, predicate, limit: int = 10_000) -> str:  # type: ignore[no-untyped-def]
    """Receive body chunks from a test-client connection until ``predicate(text so far)``."""
    text = ""
    for _ in range(limit):
        text += (await conn.receive()).decode()
        if predicate(text):
            return text
    raise AssertionError("predicate never held")


@asynccontextmanager
async def open_request(client, path: str, body: dict[str, Any]):  # type: ignore[no-untyped-def]
    """A test-client request we can disconnect. Leaving the block disconnects the client.

    Trap 10: ``TestHTTPConnection.__aexit__`` waits forever for a final body chunk that a
    cancelled app never sends, so the block is left by cancellation (the workaround of
    docs/lifecycle.md, trap 10). An exception from the block is re-raised after that cancellation,
    so it cannot be swallowed by it.
    """
    error: BaseException | None = None
    with trio.CancelScope() as cs:
        async with client.request(
            path, method="POST", headers={"Content-Type": "application/json"}
        ) as conn:
            await conn.send(json.dumps(body).encode())
            await conn.send_complete()
            try:
                yield conn
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = exc
            # Shielded: under a cancellation (a test's fail_after) the disconnect would raise
            # Cancelled, and so would the connection's __aexit__ before it closes its nursery:
            # trio then reports "Nursery stack corrupted" instead of the timeout.
            with trio.CancelScope(shield=True):
                await conn.disconnect()
            cs.cancel()
    if error is not None:
        raise error


async def post_stream(client, path: str, body: dict[str, Any]) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """POST and read the body as it comes (``client.post`` reads only once the app has finished,
    and its transport buffers 10 chunks: a longer stream would stall on backpressure)."""
    async with client.request(path, method="POST", headers={"Content-Type": "application/json"}) as conn:
        await conn.send(json.dumps(body).encode())
        await conn.send_complete()
        text = ""
        while True:
            try:
                text += (await conn.receive()).decode()
            except trio.EndOfChannel:
                break
    return conn.status_code, text


@asynccontextmanager
async def served(app: Any, **config: Any) -> AsyncIterator[tuple[int, trio.Event]]:
    """``app`` served in process by hypercorn's own trio server under its own ``Config`` (what
    the bare ``hypercorn trio_infer.app:app`` command runs; ``config``: options set on it), on
    a free loopback port; yields the port and the shutdown trigger, set when the block ends."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    cfg = Config()
    cfg.bind = ["127.0.0.1:0"]
    cfg.accesslog = cfg.errorlog = None
    for name, value in config.items():
        setattr(cfg, name, value)
    async with trio.open_nursery() as nursery:
        shutdown = trio.Event()
        binds = await nursery.start(partial(serve, app, cfg, shutdown_trigger=shutdown.wait))
        try:
            yield int(binds[0].rsplit(":", 1)[1]), shutdown
        finally:
            shutdown.set()


@asynccontextmanager
async def hypercorn_connection(app) -> AsyncIterator[trio.SocketStream]:  # type: ignore[no-untyped-def]
    """A connection to ``app`` :func:`served` in process; the server shuts down when the block
    ends."""
    async with served(app) as (port, _):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            yield stream


async def exchange(app: Any, path: str, payload: dict) -> list:
    """One request on a fresh connection of an in-process hypercorn: the h11 events the client
    parsed from the response, up to its end."""
    body = json.dumps(payload).encode()
    request = (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target=path,
                            headers=[("host", "x"), ("content-length", str(len(body)))]))
    client.send(h11.Data(data=body))
    client.send(h11.EndOfMessage())
    events: list = []
    with trio.fail_after(30):
        async with hypercorn_connection(app) as stream:
            await stream.send_all(request)
            while not events or type(events[-1]) is not h11.EndOfMessage:
                data = await stream.receive_some()
                assert data, "the server closed the connection before the response ended"
                client.receive_data(data)
                while (event := client.next_event()) is not h11.NEED_DATA:
                    events.append(event)
                    if type(event) is h11.EndOfMessage:
                        break
    return events


def body_text(events: list) -> str:
    return b"".join(e.data for e in events if type(e) is h11.Data).decode()
