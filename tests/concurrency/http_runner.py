"""Runs an :class:`~.scenario.HttpScenario` through the whole quart-trio app, in process.

The app is the real one (``create_app(settings, loaded=(engine, tokenizer))``), whose front end
talks to the batching worker over the in-memory transport (the same ``WorkerCore`` and protocol
bytes as a worker process, in a task of the app's nursery), serving the fake model through
:class:`ProbeEngine` and the character tokenizer; clients are Quart test connections (no
sockets), one task each, all under one ``MockClock(autojump_threshold=0)``. The
:class:`~.runner.SessionTap` wraps the front end's ``generate``, which the routes call (the
streaming body enters the session itself), so every session is logged as in the engine suite. A client that leaves sends ``http.disconnect``,
which is how the app learns that a peer went away (quart-trio, or api/direct.py for chat and
completions), and then waits for the server's ASGI call
to return; only then does it leave the connection block by cancellation (the test connection's
``__aexit__`` would otherwise wait forever for a final body the cancelled app never sends; see
docs/lifecycle.md, trap 10).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing
from quart_trio.testing.connections import TestHTTPConnection

from trio_infer.app import create_app, drain
from trio_infer.api.state import server_state
from trio_infer.metrics import Metrics
from trio_infer.runtime.client import AsyncEngine

from .char_tokenizer import CharTokenizer
from .invariants import check_front_idle, check_worker_idle
from .runner import (
    CURRENT_CLIENT,
    DEADLINE_S,
    RUNTIME_ERRORS,
    Event,
    Probe,
    ProbeEngine,
    SessionTap,
    SpinGuard,
    as_assertion,
    build_engine,
    scenario_settings,
    settle,
    step_budget,
    watchdog,
)
from .scenario import HTTP_MODEL, HttpRequest, HttpScenario

# How long (virtual seconds) the server may take to end a request after the client disconnects.
DISCONNECT_NOTICE_S = 1.0


class YieldingConnection(TestHTTPConnection):
    """The test connection, but every message the app sends is a checkpoint, as a send to a real
    socket is. The stock one hands ``http.response.start`` over without yielding, which leaves
    no moment for a disconnect between the handler's return and the start of the body (where a
    streaming response has checked admission but its body has not entered the session yet)."""

    # The app's whole ASGI call, tracked (:class:`AsgiTracker`): set on a subclass per run. The
    # stock connection calls the app itself; the tracker must see every request, those the app
    # answers before quart (chat and completions, api/direct.py) included.
    tracker: Any = None

    async def __aenter__(self) -> "YieldingConnection":
        self._nursery_manager = trio.open_nursery()
        nursery = await self._nursery_manager.__aenter__()
        nursery.start_soon(self.tracker, self.scope, self._asgi_receive, self._asgi_send)
        return self

    async def _asgi_send(self, message: dict) -> None:
        await trio.lowlevel.checkpoint()
        await super()._asgi_send(message)


class AsgiTracker:
    """ASGI middleware around the whole app. For each test request it records when the server's
    ASGI call returned and whether anything of the request outlived it on the front end's side (a
    session, a per-uid entry): everything must be gone by then, not later when the garbage
    collector finalizes a forgotten generator. The worker hears of it between steps: that bound is
    the probe's (``STEPS_AFTER_END``)."""

    def __init__(self, app: Any, engine: ProbeEngine) -> None:
        self.app = app
        self.engine = engine
        self.done: dict[int, trio.Event] = {}
        self.outlived: dict[int, list] = {}
        self.live = 0

    def event(self, key: int) -> trio.Event:
        return self.done.setdefault(key, trio.Event())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = scope.get("test_client")
        token = CURRENT_CLIENT.set(key)
        self.live += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.live -= 1
            CURRENT_CLIENT.reset(token)
            if key is not None:
                left = self.alive_of(key)
                if left:
                    self.outlived[key] = left
                self.event(key).set()

    def alive_of(self, key: int) -> list:
        """What the front end still holds of test request ``key``: its open sessions, and the
        uids of its sessions it still tracks."""
        tap = self.engine.tap
        if tap is None:
            return []
        live = set(tap.ae.live_uids())
        mine = [log for log in tap.sessions.values() if log.owner == key]
        return ([f"session {log.request_id}" for log in mine if log.exited is None]
                + [u for log in mine for u in log.uids if u in live])


@dataclass
class HttpRecord:
    request: HttpRequest
    entry: Event | None = None
    end: Event | None = None
    status: int | None = None
    chunks: list[bytes] = field(default_factory=list)
    outcome: str | None = None  # complete | disconnected
    server_ended: bool = True  # after a disconnect: did the server's ASGI call return in time
    outlived: list = field(default_factory=list)  # what the front end held of it when its ASGI call returned
    max_gap: float = 0.0  # longest time the client went without reading

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class HttpReport:
    scenario: HttpScenario
    engine: ProbeEngine
    front: AsyncEngine  # the front end
    tap: SessionTap
    metrics: Metrics
    records: list[HttpRecord]
    drain_started: Event | None
    idle_error: str | None  # invariant 1 checked while the app still runs, once clients are done
    live_asgi_calls: int
    tasks_before: int
    tasks_after: int


async def _http_client(client: Any, tracker: AsgiTracker, probe: Probe, index: int,
                       req: HttpRequest, rec: HttpRecord, spawn: Any) -> None:
    await trio.sleep(req.arrival)
    for _ in range(req.ticks):
        await trio.lowlevel.checkpoint()
    kind = req.client.kind
    done = tracker.event(index)
    rec.entry = probe.now()
    with trio.CancelScope() as conn_scope:
        async with client.request(req.path, method="POST",
                                  headers={"Content-Type": "application/json"},
                                  scope_base={"test_client": index}) as conn:
            await conn.send(json.dumps(req.body()).encode())
            await conn.send_complete()
            complete = False
            with trio.CancelScope() as reader_scope:
                if kind == "cancel":
                    spawn(_disconnect_after, reader_scope, req.client.k)
                last = trio.current_time()
                if kind == "stall":
                    await trio.sleep(req.client.delay)
                while True:
                    try:
                        data = await conn.receive()
                    except trio.EndOfChannel:
                        complete = True
                        break
                    now = trio.current_time()
                    rec.max_gap, last = max(rec.max_gap, now - last), now
                    rec.chunks.append(data)
                    if kind == "leave" and len(rec.chunks) >= req.client.k:
                        break
                    if kind == "slow":
                        await trio.sleep(req.client.delay)
            rec.status = conn.status_code
            rec.end = probe.now()
            if complete:
                rec.outcome = "complete"
            else:
                rec.outcome = "disconnected"
                await conn.disconnect()
                with trio.move_on_after(DISCONNECT_NOTICE_S):
                    await done.wait()
                rec.server_ended = done.is_set()
                conn_scope.cancel()


async def _disconnect_after(reader_scope: trio.CancelScope, k: int) -> None:
    for _ in range(k):
        await trio.lowlevel.checkpoint()
    reader_scope.cancel()


class _App:
    """One app run: the app, its probe engine and what the clients saw."""

    def __init__(self, sc: HttpScenario) -> None:
        self.sc = sc
        self.probe = Probe()
        shape = sc.engine
        self.engine = build_engine(shape, sc.fail_steps, self.probe, sc.channel_capacity,
                                   name=HTTP_MODEL)
        self.engine.max_steps = step_budget(sum(
            r.n * (len(r.prompt) + (r.max_tokens or shape.max_model_len)) for r in sc.requests
        ))
        settings = scenario_settings(channel_capacity=sc.channel_capacity,
                                     stall_timeout_s=sc.stall_timeout_s,
                                     max_waiting=sc.max_waiting, served_model_name=HTTP_MODEL,
                                     max_queue_time_s=sc.max_queue_time_s)
        self.app = create_app(settings, loaded=(self.engine, CharTokenizer()))
        self.tracker = AsgiTracker(self.app, self.engine)
        self.records = [HttpRecord(req) for req in sc.requests]
        self.drain_started: Event | None = None
        self.idle_error: str | None = None
        self.live_asgi_calls = 0

    async def run(self) -> None:
        async with self.app.test_app() as test_app:
            ae = server_state(self.app).engine
            assert ae is not None and ae.connection is not None
            self.engine.ae = ae
            self.engine.core = ae.connection.core  # type: ignore[attr-defined]
            self.engine.tap = SessionTap(ae, self.probe)
            client = test_app.test_client()
            client.http_connection_class = type(
                "TrackedConnection", (YieldingConnection,), {"tracker": self.tracker})
            async with trio.open_nursery() as outer:
                outer.start_soon(watchdog, self.engine, self.waiting_clients)
                async with trio.open_nursery() as clients:
                    for index, (req, rec) in enumerate(zip(self.sc.requests, self.records)):
                        clients.start_soon(_http_client, client, self.tracker, self.probe, index,
                                           req, rec, clients.start_soon)
                    if self.sc.drain_at is not None:
                        clients.start_soon(self.drainer)
                outer.cancel_scope.cancel()  # the watchdog
            # Every client is done and the app still runs: nothing may be left of any request
            # (after the app stops, its shutdown would clean up for us and hide a leak). The
            # front end must be idle at once; the worker once it has applied the last aborts.
            try:
                check_front_idle(ae)
                assert await settle(self.engine), (
                    f"once every task waited, the worker still holds uids "
                    f"{self.engine.core.live_uids} (the engine {self.engine.num_requests} "
                    f"requests), or the front end's statistics {ae.stats} are not the engine's "
                    f"{self.engine.statistics()}"
                )
                check_worker_idle(ae, self.engine.core, self.engine)
            except AssertionError as exc:
                self.idle_error = str(exc)
            self.live_asgi_calls = self.tracker.live

    def waiting_clients(self) -> list[str]:
        return [f"#{i} ({rec.request.client!r}, status {rec.status}, {len(rec.chunks)} chunks)"
                for i, rec in enumerate(self.records) if rec.outcome is None]

    async def drainer(self) -> None:
        assert self.sc.drain_at is not None
        await trio.sleep(self.sc.drain_at)
        self.drain_started = self.probe.now()
        await drain(self.app, self.sc.drain_grace)


async def _http_main(sc: HttpScenario, guard: SpinGuard) -> HttpReport:
    tasks_before = trio.lowlevel.current_statistics().tasks_living
    run = _App(sc)
    guard.engine, guard.waiting_clients = run.engine, run.waiting_clients
    with trio.fail_after(2 * DEADLINE_S), trio.CancelScope() as run.engine.run_scope:
        await run.run()
    if run.engine.failure is not None:
        raise run.engine.failure
    assert run.engine.ae is not None and run.engine.tap is not None
    for index, rec in enumerate(run.records):
        rec.outlived = run.tracker.outlived.get(index, [])
    return HttpReport(
        scenario=sc,
        engine=run.engine,
        front=run.engine.ae,
        tap=run.engine.tap,
        metrics=server_state(run.app).metrics,
        records=run.records,
        drain_started=run.drain_started,
        idle_error=run.idle_error,
        live_asgi_calls=run.live_asgi_calls,
        tasks_before=tasks_before,
        tasks_after=trio.lowlevel.current_statistics().tasks_living,
    )


def run_http_scenario(sc: HttpScenario) -> HttpReport:
    trio._core._run._r.seed(sc.sched_seed)
    RUNTIME_ERRORS.errors.clear()
    clock = trio.testing.MockClock(autojump_threshold=0)
    guard = SpinGuard()
    with as_assertion():
        return trio.run(_http_main, sc, guard, clock=clock, instruments=[guard])
