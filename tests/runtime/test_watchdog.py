"""The forward-progress watchdog: the sans-IO watch alone, then a front end over an in-process
worker that stops stepping (held, as a SIGSTOP holds a process), under a mock clock. The real
SIGSTOP/SIGCONT of a worker process is in test_worker_process.py."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing
from hypothesis import given, settings as hsettings, strategies as st

from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.metrics import Metrics
from trio_infer.models.fake import FakeModel
from trio_infer.runtime.client import open_engine
from trio_infer.runtime.data_parallel import open_data_parallel
from trio_infer.runtime.errors import EngineUnavailable
from trio_infer.runtime.in_process import in_process
from trio_infer.runtime.watchdog import ProgressWatch
from trio_infer.settings import Settings
from trio_infer.wire import SamplingParams

LONG = SamplingParams(temperature=0, ignore_eos=True, max_tokens=30)


# -- the watch alone -------------------------------------------------------------------------


def test_idle_time_is_not_a_stall() -> None:
    watch = ProgressWatch(stall_s=10, factor=20, restart_s=60)
    watch.stepped(0.0)
    assert watch.check(1000.0) == "ok"  # nothing pending: the worker owes nothing
    watch.pending(1000.0, True)  # work arrives after a long idle time: its clock starts now
    assert watch.check(1009.0) == "ok"
    assert watch.check(1010.0) == "stalled"
    assert watch.next_deadline() == 1060.0
    assert watch.check(1060.0) == "dead"


def test_a_stall_is_counted_once_and_a_step_ends_it() -> None:
    watch = ProgressWatch(stall_s=10, factor=20, restart_s=60)
    watch.pending(0.0, True)
    for t in (10.0, 11.0, 30.0):
        assert watch.check(t) == "stalled"
    assert watch.stalls == 1 and watch.problem(30.0) is not None
    watch.stepped(31.0)
    assert not watch.stalled and watch.problem(31.0) is None
    assert watch.check(40.0) == "ok"
    assert watch.check(41.0) == "stalled" and watch.stalls == 2


def test_the_bound_follows_the_slowest_recent_step() -> None:
    watch = ProgressWatch(stall_s=10, factor=20, restart_s=60)
    watch.pending(0.0, True)
    watch.stepped(0.0)
    watch.stepped(2.0)  # a 2 s step (a long prefill chunk)
    assert watch.stall_bound == 40.0 and watch.restart_bound == 80.0
    assert watch.check(2.0 + 39.0) == "ok"
    assert watch.check(2.0 + 40.0) == "stalled"


@hsettings(max_examples=200, derandomize=True, deadline=None)
@given(base=st.floats(0.001, 1.0), slowdowns=st.lists(st.floats(1.0, 20.0), min_size=1,
                                                      max_size=60),
       idle=st.lists(st.floats(0.0, 1000.0), min_size=1, max_size=60))
def test_a_slow_but_progressing_worker_is_never_stuck(base: float, slowdowns: list[float],
                                                      idle: list[float]) -> None:
    """Steps that each take up to 20x the one before (a busy machine, growing prefill chunks),
    with idle gaps between bursts of work, never make the watch say stalled at any instant
    before the next step arrives."""
    watch = ProgressWatch(stall_s=10, factor=20, restart_s=60)
    now, step = 0.0, base
    watch.stepped(now)
    for i, slowdown in enumerate(slowdowns):
        now += idle[i % len(idle)]
        watch.pending(now, True)
        step = min(step * slowdown, 1e6)
        step = min(step, watch.stall_bound * 0.999)  # what "progressing" means for the next one
        assert watch.check(now + step * 0.5) == "ok"
        assert watch.check(now + step) == "ok"
        now += step
        watch.stepped(now)
        watch.pending(now, False)
    assert watch.stalls == 0


def test_no_watchdog_when_turned_off() -> None:
    watch = ProgressWatch(stall_s=None)
    watch.pending(0.0, True)
    assert watch.check(1e9) == "ok" and watch.next_deadline() == math.inf


# -- a front end over a worker that stops stepping --------------------------------------------


class Gate:
    """An in-process engine whose scheduler can be held: the worker idles, alive, with work
    pending, as a stopped process looks from its socket."""

    def __init__(self, engine: Engine) -> None:
        self.held = False
        self.armed = False  # hold at the first stream's third token (before the work is done)
        self.held_at = math.nan
        self._schedule = engine.schedule
        engine.schedule = self._gated  # type: ignore[method-assign]

    def trip(self) -> None:
        if self.armed:
            self.armed, self.held, self.held_at = False, True, trio.current_time()

    def _gated(self):  # type: ignore[no-untyped-def]
        return None if self.held else self._schedule()


def make_engine() -> Engine:
    return Engine(FakeModel(vocab_size=101), EngineConfig(page_size=4, num_pages=64,
                                                          max_running=8, max_batched_tokens=16))


def watch_settings(**kw) -> Settings:  # type: ignore[no-untyped-def]
    return Settings(**{"channel_capacity": 64, "watchdog_stall_s": 10.0,
                       "watchdog_restart_s": 60.0, **kw})


async def read_all(ae, prompt: list[int], out: dict, gate: Gate | None = None) -> None:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    try:
        async with ae.generate(prompt, [LONG]) as stream:
            async for outs in stream:
                for o in outs:
                    tokens += o.token_ids
                if gate is not None and len(tokens) >= 3:
                    gate.trip()
        out[tuple(prompt)] = ("done", len(tokens))
    except EngineUnavailable as exc:
        out[tuple(prompt)] = ("error", str(exc))


async def test_held_worker_is_stalled_then_continues(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """Held with streams running: stalled at the stall bound (health problem, new requests
    refused, counted once); released before the restart bound: healthy again and every stream
    gets all its tokens."""
    engine = make_engine()
    gate = Gate(engine)
    async with open_engine(watch_settings(), in_process(engine)) as ae:
        out: dict = {}
        gate.armed = True
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(read_all, ae, [1, 2, i], out, gate)
            await trio.testing.wait_all_tasks_blocked()
            assert gate.held and len(out) == 0
            start = gate.held_at
            while ae.stall_problem() is None:
                await trio.sleep(0.5)
            assert 10.0 <= trio.current_time() - start <= 11.0
            assert "no progress for 10 s" in ae.stall_problem()
            with pytest.raises(EngineUnavailable, match="no progress"):
                ae.check_admission(1)
            await trio.sleep(20)  # still stalled, counted once
            assert ae.stalled and ae.metrics.worker_stalls_total._value.get() == 1
            assert ae.metrics.worker_stalled._value.get() == 1
            gate.held = False
            ae.connection.nudge()
        assert out == {(1, 2, i): ("done", 30) for i in range(4)}
        assert ae.stall_problem() is None and ae.metrics.worker_stalled._value.get() == 0
        assert ae.watchdog_status()["stalls"] == 1 and ae.watchdog_status()["restarts"] == 0


async def test_held_past_the_restart_bound_every_stream_ends_once_with_an_error(
        autojump_clock) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    gate = Gate(engine)
    async with open_engine(watch_settings(), in_process(engine)) as ae:
        out: dict = {}
        gate.armed = True
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(read_all, ae, [1, 2, i], out, gate)
        start = gate.held_at
        assert 60.0 <= trio.current_time() - start <= 61.0
        assert set(out) == {(1, 2, i) for i in range(4)}
        assert all(kind == "error" and "no progress for 60 s" in msg for kind, msg in out.values())
        assert ae.num_sessions == 0 and not ae.live_uids()
        m = ae.metrics
        assert m.worker_watchdog_restarts_total._value.get() == 1
        for gauge in (m.requests_running, m.requests_waiting, m.kv_pages_used, m.worker_stalled):
            assert gauge._value.get() == 0


async def test_a_client_that_does_not_read_is_not_a_stall(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A session out of credits (its client reads nothing) leaves the worker nothing to do: no
    stall, however long (the request's own stall timeout ends it)."""
    engine = make_engine()
    async with open_engine(watch_settings(channel_capacity=2, stall_timeout_s=300.0),
                           in_process(engine)) as ae:
        async with ae.generate([1, 2, 3], [LONG]):
            await trio.sleep(200)  # never reads: paused after two outputs
            assert ae.stall_problem() is None and ae.watch.stalls == 0


async def test_data_parallel_routes_around_a_stalled_worker(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """One of two workers held: once stalled, new requests go to the other one and the group
    stays healthy; past the restart bound only the held worker's own request fails."""
    engines = [make_engine(), make_engine()]
    gates = [Gate(e) for e in engines]
    s = watch_settings(data_parallel=2, dp_routing="round_robin")
    async with open_data_parallel(s, Metrics(), connects=[in_process(e) for e in engines],
                                  restart=False) as group:
        out: dict = {}
        async with trio.open_nursery() as nursery:
            gates[0].held = True
            nursery.start_soon(read_all, group, [7, 7, 0], out)  # round robin: worker 0
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(11)
            assert group.workers[0].stalled and group.stall_problem() is None
            for i in range(1, 4):  # all to worker 1, while worker 0 is stalled
                nursery.start_soon(read_all, group, [7, 7, i], out)
        assert out[(7, 7, 0)][0] == "error"
        assert all(out[(7, 7, i)] == ("done", 30) for i in range(1, 4))


async def test_a_finished_stream_its_client_has_not_read_is_not_a_stall(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """Every token written and buffered for a client that reads nothing yet: the worker owes
    nothing, so no stall."""
    engine = make_engine()
    short = SamplingParams(temperature=0, ignore_eos=True, max_tokens=2)
    async with open_engine(watch_settings(channel_capacity=8, stall_timeout_s=300.0),
                           in_process(engine)) as ae:
        async with ae.generate([1, 2, 3], [short]) as stream:
            await trio.sleep(200)
            assert ae.stall_problem() is None and ae.watch.stalls == 0
            tokens = [t async for outs in stream for o in outs for t in o.token_ids]
        assert len(tokens) == 2
