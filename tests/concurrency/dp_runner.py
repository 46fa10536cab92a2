"""Runs a :class:`DPScenario` through a data-parallel group (``runtime/data_parallel.py``): N
front-end engines, each over its own in-process worker (the same ``WorkerCore`` and frames as a
worker process, over memory channels), under one ``MockClock(autojump_threshold=0)`` and a
seeded scheduler, like :mod:`.runner`.

A worker can be *lost* mid-run: :class:`KillableWorker` gives each worker a connection that the
scenario closes at a chosen instant, which the front end sees exactly as a worker process's
death (EOF on its pipe; a send fails). The worker's :class:`AsyncEngine` then fails its own live
requests and restarts it (a fresh engine, as a fresh process would load) after the restart delay.

What a run records, for :mod:`.dp_invariants`: each client's reads and outcome (the
:class:`~.runner.SessionTap` on the group), which worker served each request (a tap on each
worker's ``generate_batch``), when the worker was lost, and, once every client is done, the
group's state, its gauges, and a second round of requests sent after the lost worker is back.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import trio
import trio.testing

from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.metrics import Metrics
from trio_infer.models.fake import FakeModel
from trio_infer.runtime.data_parallel import DataParallelEngine, open_data_parallel
from trio_infer.runtime.router import RouterStatistics
from trio_infer.runtime.in_process import MemoryConnection, open_worker_task
from trio_infer.wire import SamplingParams

from .runner import (
    CURRENT_CLIENT,
    RUNTIME_ERRORS,
    Event,
    Probe,
    Record,
    SessionTap,
    _grammars,
    as_assertion,
    run_client,
    scenario_settings,
)
from .scenario import EOS, VOCAB, EngineShape, Request

# Virtual seconds the scenario's clients may take, and the restarted worker to come back.
DEADLINE_S = 1e5
RESTART_DELAY_S = 1.0


@dataclass(frozen=True)
class Loss:
    """Worker ``worker`` is lost at ``at`` virtual seconds, ``ticks`` checkpoints later."""

    worker: int
    at: float
    ticks: int = 0


@dataclass(frozen=True)
class DPScenario:
    workers: int
    engine: EngineShape
    requests: tuple[Request, ...]
    routing: str = "affinity"
    channel_capacity: int = 4
    stall_timeout_s: float = 10.0
    loss: Loss | None = None
    sched_seed: int = 0


class _KilledConnection:
    """A worker connection that :meth:`kill` turns into a dead pipe: reads give EOF, sends fail.
    ``on_eof`` hears when the front end reads that EOF: from then on it knows the worker is gone
    (a process's death, too, is only known when its pipe is read)."""

    def __init__(self, inner: MemoryConnection, on_eof: Any) -> None:
        self._inner = inner
        self._on_eof = on_eof
        self.killed = False
        self._reading: trio.CancelScope | None = None

    async def send_all(self, data: bytes) -> None:
        if self.killed:
            raise trio.BrokenResourceError("the worker is gone")
        await self._inner.send_all(data)

    async def receive_some(self) -> bytes:
        if not self.killed:
            with trio.CancelScope() as self._reading:
                return await self._inner.receive_some()
        self._on_eof()  # killed before or while waiting
        return b""

    def kill(self) -> None:
        self.killed = True
        if self._reading is not None:
            self._reading.cancel()


class KillableWorker:
    """One data-parallel worker's ``Connect``: a fresh engine on every (re)start."""

    def __init__(self, shape: EngineShape, on_eof: Any) -> None:
        self._shape = shape
        self._on_eof = on_eof
        self.engine: Engine | None = None
        self.connection: _KilledConnection | None = None
        self.starts = 0

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[_KilledConnection]:
        s = self._shape
        self.engine = Engine(
            FakeModel(vocab_size=VOCAB, eos_token_id=EOS),
            EngineConfig(page_size=s.page_size, num_pages=s.num_pages, max_running=s.max_running,
                         max_batched_tokens=s.max_batched_tokens, enable_prefix_cache=s.prefix_cache),
            grammars=_grammars())  # constrained choices, as in the engine suite
        self.starts += 1
        async with open_worker_task(self.engine, in_thread=False) as inner:
            self.connection = _KilledConnection(inner, self._on_eof)
            yield self.connection


@dataclass
class DPReport:
    scenario: DPScenario
    records: list[Record]
    routed: dict[int, int]  # client index -> the worker that served it
    lost: Event | None  # when the worker was lost (None: no loss)
    noticed: Event | None  # when the front end read the lost worker's EOF
    idle_after_clients: RouterStatistics  # the group, once every client was done
    sessions_gauge: float
    healthy_after: list[bool]  # each worker, once the restart delay has passed
    again: list[tuple[int, list[int], list[int]]]  # the second round: (worker, got, expected)
    gauges_after: dict[str, float]  # once everything settled
    pages_after: list[tuple[int, int]]  # each worker's (pages used, pages cached)
    starts: list[int]  # how many times each worker was started
    max_model_len: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


async def _main(sc: DPScenario) -> DPReport:
    probe = Probe()
    shape = sc.engine
    noticed: list[Event] = []

    def on_eof() -> None:
        if not noticed:
            noticed.append(probe.now())

    workers = [KillableWorker(shape, on_eof) for _ in range(sc.workers)]
    settings = scenario_settings(
        channel_capacity=sc.channel_capacity, stall_timeout_s=sc.stall_timeout_s,
        page_size=shape.page_size, max_running=shape.max_running,
        max_batched_tokens=shape.max_batched_tokens, data_parallel=sc.workers,
        dp_routing=sc.routing, worker_max_restarts=3, worker_restart_delay_s=RESTART_DELAY_S)
    metrics = Metrics()
    records = [Record(req) for req in sc.requests]
    routed: dict[int, int] = {}
    lost: list[Event] = []

    async def lose(loss: Loss) -> None:
        await trio.sleep(loss.at)
        for _ in range(loss.ticks):
            await trio.lowlevel.checkpoint()
        connection = workers[loss.worker].connection
        assert connection is not None
        lost.append(probe.now())
        connection.kill()

    with trio.fail_after(DEADLINE_S):
        async with open_data_parallel(settings, metrics, connects=[w.connect for w in workers],
                                      restart=True) as group:
            _tap_workers(group, routed)
            tap = SessionTap(group, probe)
            async with trio.open_nursery() as clients:
                for index, (req, rec) in enumerate(zip(sc.requests, records)):
                    clients.start_soon(run_client, tap, index, req, rec, clients.start_soon)
                if sc.loss is not None:
                    clients.start_soon(lose, sc.loss)
            tap.detach()
            idle = group.statistics()
            sessions_gauge = metrics.sessions_active._value.get()
            # The lost worker comes back after the restart delay (virtual time).
            await trio.sleep(2 * RESTART_DELAY_S)
            healthy = [w.healthy for w in group.workers]
            again = await _second_round(group, sc, routed)
            await trio.testing.wait_all_tasks_blocked()
            values = metrics.snapshot()
            pages = [(w.engine.statistics().pages_used, w.engine.statistics().pages_cached)
                     for w in workers if w.engine is not None]
            max_model_len = group.max_model_len
    return DPReport(sc, records, routed, lost[0] if lost else None,
                    noticed[0] if noticed else None, idle, sessions_gauge, healthy,
                    again, values, pages, [w.starts for w in workers], max_model_len)


def _tap_workers(group: DataParallelEngine, routed: dict[int, int]) -> None:
    """Record which worker each client's request went to (an instance attribute shadows the
    worker's method, as :class:`~.runner.SessionTap` does on the group)."""
    for i, worker in enumerate(group.workers):
        inner = worker.generate_batch

        def tapped(*args: Any, _inner: Any = inner, _i: int = i, **kwargs: Any) -> Any:
            client = CURRENT_CLIENT.get()
            if client is not None:
                routed[client] = _i
            return _inner(*args, **kwargs)

        worker.generate_batch = tapped  # type: ignore[method-assign]


async def _second_round(group: DataParallelEngine, sc: DPScenario,
                        routed: dict[int, int]) -> list[tuple[int, list[int], list[int]]]:
    """2 x workers new requests at once, each a prompt of its own: with every worker back, the
    least loaded fallback spreads them over all of them, and each must finish exactly."""
    from .scenario import continuation

    results: list[tuple[int, list[int], list[int]]] = []
    base = len(sc.requests)

    async def one(k: int) -> None:
        CURRENT_CLIENT.set(base + k)
        prompt = [1 + (k * 7 + j) % (VOCAB - 1) for j in range(3 + k)]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        got: list[int] = []
        async with group.generate(prompt, [params]) as stream:
            async for outs in stream:
                got.extend(t for out in outs for t in out.token_ids)
        results.append((routed[base + k], got, continuation(prompt, 4)))

    async with trio.open_nursery() as nursery:
        for k in range(2 * sc.workers):
            nursery.start_soon(one, k)
    return results


def run_dp_scenario(sc: DPScenario) -> DPReport:
    """One scenario in a fresh ``trio.run`` with a fresh mock clock and a seeded scheduler."""
    trio._core._run._r.seed(sc.sched_seed)
    RUNTIME_ERRORS.errors.clear()
    clock = trio.testing.MockClock(autojump_threshold=0)
    with as_assertion():
        return trio.run(_main, sc, clock=clock)
