"""Runs a :class:`~.scenario.Scenario` against the real engine, actor and sessions.

The only stand-ins are the fake model (instant, output known in advance) and :class:`ProbeEngine`,
a subclass of the real :class:`~trio_infer.engine.engine.Engine` that changes nothing it does: it
watches every call the actor makes (which uids are scheduled, which end and how often, what each
step hands to which channel) and raises in ``execute`` on the steps the scenario marks as faulty.

Everything runs in one ``trio.run`` with a fresh ``MockClock(autojump_threshold=0)``: sleeps,
slow readers and stall timeouts cost no wall time, and a deadlock jumps straight to the
:func:`watchdog`'s deadline (and a ``fail_after`` behind it) instead of hanging.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

import trio
import trio.testing

from trio_infer.engine.engine import Engine, EngineConfig, RequestOutput, StepPlan
from trio_infer.engine.sequence import Status
from trio_infer.metrics import Metrics
from trio_infer.models.fake import FakeModel
from trio_infer.runtime.engine_actor import (
    AsyncEngine,
    EngineError,
    EngineUnavailable,
    open_engine,
)
from trio_infer.settings import Settings

from .scenario import EOS, VOCAB, Request, Scenario, Stats

# Virtual seconds a scenario may take before it counts as a deadlock (costs no wall time).
DEADLINE_S = 1e6


async def watchdog(engine: ProbeEngine, waiting_clients) -> None:
    """Fail the run as a deadlock if it is still going at the virtual deadline. Under the
    autojump clock a run where every task waits for something that never comes jumps straight
    here, and the state is described *before* the cancellation unwinds it."""
    await trio.sleep(DEADLINE_S)
    engine._probe_failed(Deadlock(
        f"nothing happened for {DEADLINE_S:g} virtual seconds:\n  "
        + describe_stuck(engine, engine.actor, waiting_clients())
    ))
# Engine steps a scenario may take before it counts as a livelock (this one costs wall time):
# this many times the tokens it could ever compute without preemption (measured: at most about
# 1x over hundreds of examples), and never more than MAX_STEPS.
STEPS_PER_TOKEN = 20
MAX_STEPS = 20_000
# Times the actor may find nothing to run at one same virtual instant before it counts as spinning.
MAX_IDLE_SPINS = 1_000


def step_budget(work: int) -> int:
    return min(MAX_STEPS, STEPS_PER_TOKEN * work + 200)


# Which client (HTTP suite: which test request) the current task works for; sequences added to
# the engine are labelled with it, so a check can ask "is anything of request #3 still alive?".
CURRENT_CLIENT: ContextVar[int | None] = ContextVar("concurrency_current_client", default=None)


class InjectedFault(RuntimeError):
    """Raised by a step the scenario marked as faulty."""


class ProbeFailure(Exception):
    """A probe saw an invariant break mid-run. It is not raised where it is seen (inside the
    actor it would become a failed step or a crash, and from a quart-trio background task it
    corrupts the test app's nurseries): the probe records it and cancels the whole run, which
    then raises it. :func:`as_assertion` turns it into an ``AssertionError`` with the same
    message, which hypothesis shrinks."""


class Violation(ProbeFailure):
    """The engine did something it must never do (stepped a paused sequence, ...)."""


class Livelock(ProbeFailure):
    """The engine kept stepping without finishing."""


class Deadlock(ProbeFailure):
    """Nothing happened until the virtual deadline: some client waits for something that never
    comes."""


def describe_stuck(engine: Engine, actor: AsyncEngine | None, waiting_clients: list[str]) -> str:
    """What a deadlocked run looks like: who still waits, and what the engine holds."""
    def seq(s) -> str:
        return (f"{s.uid}: {'ready' if s.ready else 'PAUSED'}, {len(s.pages)} pages, "
                f"{s.num_computed}/{len(s.token_ids)} computed")

    sched = engine.scheduler
    lines = [
        f"clients still waiting: {waiting_clients}",
        f"engine running: {[seq(s) for s in sched.running]}",
        f"engine waiting: {[seq(s) for s in sched.waiting]}",
        f"pool: {engine.pool.num_free}/{engine.pool.num_pages} pages free",
    ]
    if actor is not None:
        lines.append(f"actor healthy={actor.healthy} draining={actor.draining}, sessions: " + str({
            rid: {"unfinished": sorted(ss.unfinished), "paused_since": ss.paused_since,
                  "buffered": ss.send.statistics().current_buffer_used}
            for rid, ss in actor._sessions.items()
        }))
    return "\n  ".join(lines)


@dataclass
class Event:
    seq: int  # global order of everything the probes saw (virtual time alone has ties)
    time: float


class Probe:
    """The shared event counter of one run."""

    def __init__(self) -> None:
        self._n = itertools.count()

    def now(self) -> Event:
        return Event(next(self._n), trio.current_time())


class ProbeEngine(Engine):
    """The real engine, watched. A violation stops the run at once (see :class:`ProbeFailure`),
    with the step and the uid in its message."""

    def __init__(self, model: FakeModel, config: EngineConfig, fail_steps: frozenset[int],
                 probe: Probe) -> None:
        super().__init__(model, config)
        self.probe = probe
        self.fail_steps = fail_steps
        self.max_steps = MAX_STEPS  # the runner lowers it to the scenario's step_budget
        self.actor: AsyncEngine | None = None
        self.failure: ProbeFailure | None = None
        self.run_scope: trio.CancelScope | None = None  # cancelled on the first failure
        self.stats = Stats()
        self.ends: Counter[Hashable] = Counter()  # uid -> times it ended (finish or abort)
        self.end_event: dict[Hashable, Event] = {}
        self.admitted: set[Hashable] = set()
        self.owner: dict[Hashable, int | None] = {}  # uid -> CURRENT_CLIENT when it was added
        self.failed_uids: set[Hashable] = set()  # uids carried by a step that raised
        self.in_flight: set[Hashable] = set()  # uids of the plan between schedule and commit
        self._step_of_plan = 0
        self._idle_at, self._idle_spins = -1.0, 0

    def add_request(self, uid, prompt_ids, params) -> None:
        super().add_request(uid, prompt_ids, params)
        self.admitted.add(uid)
        self.owner[uid] = CURRENT_CLIENT.get()

    def abort(self, uid: Hashable) -> bool:
        aborted = super().abort(uid)
        if aborted:
            self._ended(uid)
        return aborted

    def set_ready(self, uid: Hashable, ready: bool) -> None:
        seq = self._seqs.get(uid)
        if seq is not None and seq.ready and not ready:
            self.stats.pauses += 1
        super().set_ready(uid, ready)

    def schedule(self) -> StepPlan | None:
        plan = super().schedule()
        if plan is None:
            # Nothing to run: the actor should now sleep until something happens. If it comes
            # back again and again at the same virtual time, it spins (and the mock clock,
            # which only moves when every task sleeps, never moves again: a hang, not a failure).
            now = trio.current_time()
            if now != self._idle_at:
                self._idle_at, self._idle_spins = now, 0
            self._idle_spins += 1
            if self._idle_spins == MAX_IDLE_SPINS:
                self._probe_failed(Livelock(
                    f"the actor woke {MAX_IDLE_SPINS} times at t={now} with nothing to run:\n  "
                    + describe_stuck(self, self.actor, [])
                ))
            return None
        self.stats.steps += 1
        if self.stats.steps > self.max_steps:
            self._probe_failed(Livelock(f"{self.max_steps} engine steps and still not done"))
            return None
        self._step_of_plan = self.stats.steps
        sched = plan.schedule
        self.stats.preemptions += len(sched.preempted)
        self.stats.preempted_paused += sum(1 for s in sched.preempted if not s.ready)
        sessions = self.actor._sessions if self.actor is not None else None
        for it in sched.items:
            uid = it.seq.uid
            if uid in self.ends:
                self.violation(f"step {self.stats.steps}: {uid} scheduled after it ended")
            if sessions is not None and uid[0] not in sessions:
                # Invariant 4: a request whose session is gone costs no further step.
                self.violation(f"step {self.stats.steps}: {uid} scheduled after its session ended")
            if not it.seq.ready:
                self.violation(f"step {self.stats.steps}: paused {uid} was scheduled")
        for seq in sched.preempted:
            if seq.pages:
                self.violation(f"step {self.stats.steps}: preempted {seq.uid} kept pages")
        self.in_flight = {it.seq.uid for it in sched.items}
        return plan

    def execute(self, plan: StepPlan):
        if self._step_of_plan in self.fail_steps:
            self.stats.failed_steps += 1
            self.failed_uids |= {it.seq.uid for it in plan.schedule.items}
            self.in_flight = set()
            raise InjectedFault(f"injected fault in step {self._step_of_plan}")
        return super().execute(plan)

    def commit(self, plan: StepPlan, result) -> list[RequestOutput]:
        ended_before = set(self.ends)
        outputs = super().commit(plan, result)
        self.in_flight = set()
        per_session: Counter[int] = Counter()
        for out in outputs:
            if out.uid in ended_before:
                self.violation(f"step {self.stats.steps}: output for ended {out.uid}")
            if out.finish_reason is not None:
                self._ended(out.uid)
            per_session[out.uid[0]] += 1
        # What the actor is about to hand each session must fit in its channel now: a sequence
        # whose channel was full must have been paused, not stepped.
        assert self.actor is not None
        for request_id, count in per_session.items():
            session = self.actor._sessions.get(request_id)
            if session is None:
                continue
            st = session.send.statistics()
            if st.current_buffer_used + count > st.max_buffer_size:
                self.violation(
                    f"step {self.stats.steps}: request {request_id} got {count} outputs with "
                    f"{st.current_buffer_used}/{st.max_buffer_size} of its channel used"
                )
        return outputs

    def alive_of(self, client: int) -> list[Hashable]:
        """The uids of ``client`` the engine or the actor still holds."""
        sessions = self.actor._sessions if self.actor is not None else {}
        return [uid for uid, owner in self.owner.items()
                if owner == client and (uid in self._seqs or uid[0] in sessions)]

    def violation(self, message: str) -> None:
        self._probe_failed(Violation(message))

    def _probe_failed(self, failure: ProbeFailure) -> None:
        if self.failure is None:
            self.failure = failure
        assert self.run_scope is not None
        self.run_scope.cancel()

    def _ended(self, uid: Hashable) -> None:
        self.ends[uid] += 1
        self.end_event.setdefault(uid, self.probe.now())


@dataclass
class Record:
    """What one client saw."""

    request: Request
    entry: Event | None = None
    waiting_at_entry: int = 0
    request_id: int | None = None  # set once admitted
    reads: list[tuple[Event, list[RequestOutput]]] = field(default_factory=list)
    outcome: str | None = None  # finished | left | cancelled | <error class name> | rejected
    error: BaseException | None = None
    error_event: Event | None = None
    admitted_event: Event | None = None
    cancel_phase: str | None = None
    finished_early: Event | None = None  # when the client called stream.finish() on every choice


@dataclass
class ShutdownRecord:
    started: Event | None = None


@dataclass
class Report:
    scenario: Scenario
    engine: ProbeEngine
    actor: AsyncEngine
    records: list[Record]
    shutdown: ShutdownRecord
    tasks_before: int
    tasks_after: int
    children_after: int


def phase_of(engine: ProbeEngine, uids: list[Hashable]) -> str:
    """Where a request's sequences are right now (the most advanced one), and whether a step
    carrying it is in flight (the fake model's steps run inline, so other tasks only ever run
    while a step is in flight or the engine is idle)."""
    order = ["prefill", "decode", "preempted", "queued", "ended"]
    phases, flying = set(), False
    for uid in uids:
        seq = engine._seqs.get(uid)
        flying |= uid in engine.in_flight
        if seq is None:
            phases.add("ended")
        elif seq.status is Status.WAITING:
            phases.add("queued" if seq.num_output_tokens == 0 else "preempted")
        elif seq.num_output_tokens == 0:
            phases.add("prefill")
        else:
            phases.add("decode")
    phase = next(p for p in order if p in phases)
    return f"{phase}, step in flight" if flying else phase


async def _client(ae: AsyncEngine, engine: ProbeEngine, probe: Probe, req: Request,
                  rec: Record, spawn) -> None:
    await trio.sleep(req.arrival)
    for _ in range(req.ticks):
        await trio.lowlevel.checkpoint()
    client = req.client
    params = [c.params() for c in req.choices]
    rec.waiting_at_entry = engine.num_waiting
    rec.entry = probe.now()
    try:
        with trio.CancelScope() as cs:
            async with ae.generate(list(req.prompt), params) as stream:
                rec.request_id = stream.request_id
                rec.admitted_event = probe.now()
                if client.kind == "cancel":
                    # A sibling task cancels this scope k ticks from now, wherever the request
                    # is by then (no-op if it has already ended).
                    uids = [(stream.request_id, i) for i in range(len(params))]
                    spawn(_canceller, engine, cs, client.k, uids, rec)
                if client.kind == "stall":
                    await trio.sleep(client.delay)
                async for outs in stream:
                    rec.reads.append((probe.now(), outs))
                    if client.kind == "leave" and len(rec.reads) >= client.k:
                        rec.outcome = "left"
                        break
                    if client.kind == "finish" and len(rec.reads) == client.k:
                        for i in range(len(params)):
                            stream.finish(i)
                        rec.finished_early = rec.reads[-1][0]
                    if client.kind in ("slow", "finish"):
                        await trio.sleep(client.delay)
                else:
                    rec.outcome = "finished"
        if cs.cancelled_caught:
            rec.outcome = "cancelled"
    except EngineError as exc:
        rec.outcome = type(exc).__name__
        rec.error = exc
        rec.error_event = probe.now()
    except ValueError as exc:  # the engine refuses the prompt (too long for the context)
        rec.outcome = "rejected"
        rec.error = exc
        rec.error_event = probe.now()


async def _canceller(engine: ProbeEngine, cs: trio.CancelScope, k: int, uids: list,
                     rec: Record) -> None:
    for _ in range(k):
        await trio.lowlevel.checkpoint()
    if rec.outcome is None:
        rec.cancel_phase = phase_of(engine, uids)
        cs.cancel()


async def _main(sc: Scenario) -> Report:
    tasks_before = trio.lowlevel.current_statistics().tasks_living
    probe = Probe()
    shape = sc.engine
    model = FakeModel(vocab_size=VOCAB, eos_token_id=EOS)
    engine = ProbeEngine(
        model,
        EngineConfig(page_size=shape.page_size, num_pages=shape.num_pages,
                     max_running=shape.max_running, max_batched_tokens=shape.max_batched_tokens,
                     enable_prefix_cache=shape.prefix_cache),
        sc.fail_steps,
        probe,
    )
    engine.max_steps = step_budget(sum(
        len(r.prompt) + (c.max_tokens or shape.max_model_len) for r in sc.requests for c in r.choices
    ))
    settings = Settings(channel_capacity=sc.channel_capacity, stall_timeout_s=sc.stall_timeout_s,
                        max_waiting=sc.max_waiting)
    records = [Record(req) for req in sc.requests]
    sd_rec = ShutdownRecord()
    actor_scope = trio.CancelScope()

    async def serve(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with actor_scope:
            async with open_engine(settings, engine=engine, metrics=Metrics()) as ae:
                engine.actor = ae
                task_status.started(ae)
                await trio.sleep_forever()

    async def shutdown(ae: AsyncEngine) -> None:
        sd = sc.shutdown
        assert sd is not None
        await trio.sleep(sd.at)
        for _ in range(sd.ticks):
            await trio.lowlevel.checkpoint()
        sd_rec.started = probe.now()
        if sd.kind == "drain":
            ae.begin_drain()
            await trio.sleep(sd.grace)
            ae.abort_all(EngineUnavailable("the server is shutting down"))
        actor_scope.cancel()

    def waiting_clients() -> list[str]:
        return [f"#{i} (id {rec.request_id}, {rec.request.client!r}, read {len(rec.reads)})"
                for i, rec in enumerate(records) if rec.outcome is None]

    with trio.fail_after(2 * DEADLINE_S), trio.CancelScope() as engine.run_scope:
        async with trio.open_nursery() as root:
            root.start_soon(watchdog, engine, waiting_clients)
            ae: AsyncEngine = await root.start(serve)
            async with trio.open_nursery() as clients:
                for req, rec in zip(sc.requests, records):
                    clients.start_soon(_client, ae, engine, probe, req, rec, clients.start_soon)
                if sc.shutdown is not None:
                    clients.start_soon(shutdown, ae)
            root.cancel_scope.cancel()  # the actor and the watchdog
    if engine.failure is not None:
        raise engine.failure
    me = trio.lowlevel.current_task()
    return Report(
        scenario=sc,
        engine=engine,
        actor=ae,
        records=records,
        shutdown=sd_rec,
        tasks_before=tasks_before,
        tasks_after=trio.lowlevel.current_statistics().tasks_living,
        children_after=sum(len(n.child_tasks) for n in me.child_nurseries),
    )


class _ActorLogFilter(logging.Filter):
    """The actor logs every failed step and its own crash with a traceback. The injected faults
    are expected: drop them. Anything else is kept, and remembered for the failure message."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[BaseException] = []

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, InjectedFault):
            return False
        if exc is not None:
            self.errors.append(exc)
        return True


ACTOR_ERRORS = _ActorLogFilter()
logging.getLogger("trio_infer.runtime.engine_actor").addFilter(ACTOR_ERRORS)


def actor_errors() -> str:
    """The unexpected errors the actor logged during the current run, for failure messages."""
    return "; ".join(f"{type(e).__name__}: {e}" for e in ACTOR_ERRORS.errors) or "none"


def run_scenario(sc: Scenario) -> Report:
    """One scenario in a fresh ``trio.run`` with a fresh mock clock and a seeded scheduler."""
    # trio orders each batch of runnable tasks with this Random (a shuffle under hypothesis, a
    # coin flip otherwise); seeding it from the scenario makes the interleaving part of the
    # example, so hypothesis explores interleavings and replays the one that failed.
    trio._core._run._r.seed(sc.sched_seed)
    ACTOR_ERRORS.errors.clear()
    clock = trio.testing.MockClock(autojump_threshold=0)
    with as_assertion():
        return trio.run(_main, sc, clock=clock)


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    if isinstance(exc, kind):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _find(inner, kind)
        if found is not None:
            return found
    return None


@contextmanager
def as_assertion() -> Iterator[None]:
    """Turn a probe failure (possibly inside exception groups) into a plain AssertionError."""
    try:
        yield
    except BaseException as exc:
        found = _find(exc, ProbeFailure)
        if found is None:
            raise
        raise AssertionError(f"{type(found).__name__}: {found}") from None

