"""Runs a :class:`~.scenario.Scenario` across the worker boundary: the front end's sessions
(:class:`~trio_infer.runtime.client.AsyncEngine`), the protocol's bytes, and the batching worker
(:class:`~trio_infer.runtime.worker.WorkerCore`) over the in-memory transport, on the real engine.

``open_engine(settings, in_process(probe))`` runs the worker as a trio task of the test's own
``trio.run`` (``in_process.open_worker_task``: the same ``WorkerCore`` and the same frames as a
worker process, carried by memory channels), with the fake model's steps inline, so everything
runs under one ``MockClock(autojump_threshold=0)``: sleeps, slow readers and stall timeouts cost
no wall time, and a deadlock jumps straight to the :func:`watchdog`'s deadline instead of hanging.

Three probes watch the run; none changes what it watches:

* :class:`ProbeEngine`, a subclass of the real :class:`~trio_infer.engine.engine.Engine`, sees
  every call the worker makes (which uids each step carries, which end and how often, every output
  it emits and when) and raises in ``execute`` on the steps the scenario marks as faulty.
* :class:`SessionTap` wraps the front end's public session entry point (``generate_batch``,
  which ``generate`` delegates to, where it exists, else ``generate``; the HTTP routes reach it
  the same way) and records, per session, every read its reader makes
  (what it took, when, which of its uids the front end still tracked), every ``finish(i)`` call and
  when the session ended. The reader's takes are what return credits, so the tap knows how many
  outputs of each uid the reader has taken at every moment.
* :class:`SpinGuard`, a trio instrument, fails a run whose tasks keep running at one virtual
  instant without any engine activity (a front-end spin: under the autojump clock it would hang).

Only the public surface of the front end is read: ``num_sessions``, ``live_uids()``, ``stats``,
``metrics`` and ``connection.core.live_uids`` (the worker's per-uid credit entries); the engine
is the :class:`ProbeEngine` the test built (``connection.core.engine``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections import Counter
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Hashable, Iterator

import msgspec
import numpy as np
import trio
import trio.testing

from trio_infer.engine.engine import Engine, EngineConfig, RequestOutput, StepPlan
from trio_infer.engine.grammar import Grammars
from trio_infer.engine.kv_cache import KVCache
from trio_infer.engine.sequence import Sequence, Status
from trio_infer.metrics import Metrics
from trio_infer.models.fake import FakeModel
from trio_infer.runtime.in_process import in_process
from trio_infer.runtime.client import AsyncEngine, GenerationStream, open_engine
from trio_infer.runtime.errors import EngineError, EngineUnavailable
from trio_infer.runtime.worker import WorkerCore
from trio_infer.settings import Settings
from trio_infer.wire import RequestOutput as Output, Uid

from .char_tokenizer import ll_tokenizer
from .scenario import EOS, VOCAB, Request, Scenario, Stats

# Virtual seconds a scenario may take before it counts as a deadlock (costs no wall time).
DEADLINE_S = 1e6
# Engine steps a scenario may take before it counts as a livelock (this one costs wall time):
# this many times the tokens it could ever compute without preemption (measured: at most about
# 1x over hundreds of examples), and never more than MAX_STEPS.
STEPS_PER_TOKEN = 20
MAX_STEPS = 20_000
# Times the worker may find nothing to run at one same virtual instant before it counts as spinning.
MAX_IDLE_SPINS = 1_000
# Rounds of trio's run loop at one virtual instant without any engine call before the run counts
# as a front-end spin (a task that never blocks, say a stall deadline in the past: the mock clock
# only moves when every task waits, so without this it would hang). A legitimate instant without
# an engine call takes a few rounds per checkpoint a client waits (tens).
MAX_IDLE_ROUNDS = 20_000
# Steps that may still carry a sequence after the front end ended it. The front end's Abort is a
# message, and the worker applies messages between steps only: the session ends in some task
# while the worker task may have scheduled its next step already (1), and the front end's send
# loop runs one scheduling round later, after which the worker may schedule once more before it
# drains its inbox (2). After that the abort has been applied.
STEPS_AFTER_END = 2


def step_budget(work: int) -> int:
    return min(MAX_STEPS, STEPS_PER_TOKEN * work + 200)


# Which client (HTTP suite: which test request) the current task works for; sessions opened
# through the tap are labelled with it, so a check can ask "is anything of request #3 still alive?".
CURRENT_CLIENT: ContextVar[int | None] = ContextVar("concurrency_current_client", default=None)


class InjectedFault(RuntimeError):
    """Raised by a step the scenario marked as faulty."""


class ProbeFailure(Exception):
    """A probe saw an invariant break mid-run. It is not raised where it is seen (inside the
    worker it would become a failed step, and from a quart-trio background task it corrupts the
    test app's nurseries): the probe records it and cancels the whole run, which then raises it.
    :func:`as_assertion` turns it into an ``AssertionError`` with the same message, which
    hypothesis shrinks."""


class Violation(ProbeFailure):
    """The worker or the front end did something it must never do."""


class Livelock(ProbeFailure):
    """The run kept going without finishing."""


class Deadlock(ProbeFailure):
    """Nothing happened until the virtual deadline: some client waits for something that never
    comes."""


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


# -- the front end's side: what each reader took -----------------------------------------------


@dataclass
class Read:
    event: Event
    outputs: list[Output]
    live: frozenset[Uid]  # the session's uids the front end still tracked at this read


@dataclass
class SessionLog:
    """One session, as its reader saw it."""

    request_id: int
    n: int
    owner: int | None  # CURRENT_CLIENT when it was opened
    entered: Event
    reads: list[Read] = field(default_factory=list)
    finishes: list[tuple[Event, int]] = field(default_factory=list)  # stream.finish(i) calls
    ended: Event | None = None  # the stream stopped (StopAsyncIteration or an error)
    error: BaseException | None = None  # the error it raised, if any
    exited: Event | None = None  # the generate block was left: the session is gone

    @property
    def uids(self) -> list[Uid]:
        return [(self.request_id, i) for i in range(self.n)]


class TappedStream:
    """A :class:`GenerationStream` that logs what its reader takes (same interface)."""

    def __init__(self, stream: GenerationStream, log: SessionLog, tap: SessionTap) -> None:
        self._stream = stream
        self._log = log
        self._tap = tap
        self.request_id = stream.request_id

    def __aiter__(self) -> TappedStream:
        return self

    async def __anext__(self) -> list[Output]:
        log = self._log
        try:
            outputs = await self._stream.__anext__()
        except StopAsyncIteration:
            log.ended = self._tap.probe.now()
            raise
        except EngineError as exc:
            log.ended, log.error = self._tap.probe.now(), exc
            raise
        self._tap.took(log, outputs)
        return outputs

    def finish(self, index: int) -> None:
        self._log.finishes.append((self._tap.probe.now(), index))
        self._stream.finish(index)

    async def admitted(self) -> None:
        """What a held stream waits for (``GenerationStream.admitted``); an error there is the
        session's end, as from a read."""
        try:
            await self._stream.admitted()
        except EngineError as exc:
            self._log.ended, self._log.error = self._tap.probe.now(), exc
            raise


class SessionTap:
    """Wraps the front end's session entry point and keeps a :class:`SessionLog` per session. An
    instance attribute shadows the method, so the HTTP routes' calls go through it too. With
    ``generate_batch`` (several prompts in one session; ``generate`` delegates to it) that is what
    is wrapped, else ``generate``."""

    def __init__(self, ae: AsyncEngine, probe: Probe) -> None:
        self.ae = ae
        self.probe = probe
        self.sessions: dict[int, SessionLog] = {}
        self.taken: Counter[Uid] = Counter()  # outputs of each uid its reader has taken
        self._name = "generate_batch" if hasattr(ae, "generate_batch") else "generate"
        self._inner = getattr(ae, self._name)
        setattr(ae, self._name, self._tapped)

    def generate(self, prompt_ids: list[int], params: list, timeout_s: float | None = None):
        """``ae.generate``, tapped (what the engine suite's clients call)."""
        return self.ae.generate(prompt_ids, params, timeout_s)

    def _tapped(self, *args, **kwargs):
        if self._name == "generate_batch":
            prompts, params = args[0], args[1]
            n = len(prompts) * len(params)
        else:
            n = len(args[1])
        return self._session(self._inner(*args, **kwargs), n)

    @asynccontextmanager
    async def _session(self, inner, n: int) -> AsyncIterator[TappedStream]:
        owner = CURRENT_CLIENT.get()
        log: SessionLog | None = None
        try:
            async with inner as stream:
                log = SessionLog(stream.request_id, n, owner, self.probe.now())
                self.sessions[stream.request_id] = log
                yield TappedStream(stream, log, self)
        finally:
            if log is not None:
                log.exited = self.probe.now()

    def detach(self) -> None:
        """Give the front end its own entry point back."""
        self.ae.__dict__.pop(self._name, None)

    def took(self, log: SessionLog, outputs: list[Output]) -> None:
        live = set(self.ae.live_uids())
        log.reads.append(Read(self.probe.now(), outputs,
                              frozenset(u for u in log.uids if u in live)))
        for out in outputs:
            self.taken[out.uid] += 1


# -- the worker's side: what the engine did ------------------------------------------------------


def describe_stuck(engine: Engine, ae: AsyncEngine | None, core: WorkerCore | None,
                   waiting_clients: list[str]) -> str:
    """What a stuck run looks like: who still waits, what each side of the protocol holds."""
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
    if core is not None:
        lines.append(f"worker's live uids (credit entries): {core.live_uids}")
    if ae is not None:
        lines.append(f"front end: healthy={ae.healthy} draining={ae.draining}, "
                     f"{ae.num_sessions} sessions, live uids {ae.live_uids()}, last stats {ae.stats}")
    return "\n  ".join(lines)


@functools.lru_cache(maxsize=1)
def _grammars() -> Grammars:
    """One compiler for every scenario's engine: the character tokenizer's llguidance tables and
    the one grammar of constrained choices are built once per test process."""
    return Grammars(ll_tokenizer(), VOCAB)


class ProbeEngine(Engine):
    """The real engine, watched from inside the worker. A violation stops the run at once (see
    :class:`ProbeFailure`), with the step and the uid in its message."""

    def __init__(self, model: FakeModel, config: EngineConfig, fail_steps: frozenset[int],
                 probe: Probe, capacity: int, draft_model: FakeModel | None = None) -> None:
        super().__init__(model, config, grammars=_grammars(), draft_model=draft_model)
        self.probe = probe
        self.fail_steps = fail_steps
        self.capacity = capacity  # channel_capacity: the credits each uid starts with
        self.max_steps = MAX_STEPS  # the runner lowers it to the scenario's step_budget
        self.ae: AsyncEngine | None = None  # the front end, once it is up
        self.core: WorkerCore | None = None  # the worker's end of the protocol
        self.tap: SessionTap | None = None
        self.held = False  # the scenario's Hold: the worker schedules nothing meanwhile
        self.held_during: tuple[float, float] | None = None  # (from, until), virtual seconds
        self.nudge: Callable[[], None] = lambda: None  # wakes an idle worker (in_process)
        self.failure: ProbeFailure | None = None
        self.run_scope: trio.CancelScope | None = None  # cancelled on the first failure
        self.stats = Stats()
        self.calls = 0  # every engine call the worker made (the spin guard's notion of progress)
        self.ends: Counter[Hashable] = Counter()  # uid -> times it ended (finish or abort)
        self.end_event: dict[Hashable, Event] = {}
        self.abort_event: dict[Hashable, Event] = {}  # uids ended by an abort (not a finish)
        self.admitted: set[Hashable] = set()
        self.sequences: list[Sequence] = []  # every sequence admitted: ended, each holds no grammar state
        self.emitted: Counter[Hashable] = Counter()  # outputs each uid produced
        self.emissions: dict[Hashable, list[tuple[Event, bool]]] = {}  # uid -> (when, final?)
        self.after_end: Counter[Hashable] = Counter()  # steps a uid was in after the front end ended it
        self.failed_uids: set[Hashable] = set()  # uids carried by a step that raised
        self.in_flight: set[Hashable] = set()  # uids of the plan between schedule and commit
        self.first_scheduled: dict[Hashable, Event] = {}  # uid -> the step that first carried it
        self._step_of_plan = 0
        self._idle_at, self._idle_spins = -1.0, 0

    def add_request(self, uid, prompt_ids, params) -> None:
        self.calls += 1
        super().add_request(uid, prompt_ids, params)
        self.admitted.add(uid)
        self.sequences.append(self._seqs[uid])

    def abort(self, uid: Hashable) -> bool:
        self.calls += 1
        aborted = super().abort(uid)
        if aborted:
            self.abort_event.setdefault(uid, self.probe.now())
            self._ended(uid)
        return aborted

    def set_ready(self, uid: Hashable, ready: bool) -> None:
        self.calls += 1
        seq = self._seqs.get(uid)
        if seq is not None and seq.ready and not ready:
            self.stats.pauses += 1
        super().set_ready(uid, ready)

    def schedule(self) -> StepPlan | None:
        self.calls += 1
        if self.held:
            return None
        waiting_before = list(self.scheduler.waiting)
        running_before = set(self.scheduler.running)
        plan = super().schedule()
        self._check_priorities(waiting_before, running_before)
        if plan is None:
            # Nothing to run: the worker now waits for a frame from the front end. If it comes
            # back again and again at the same virtual time, it spins.
            now = trio.current_time()
            if now != self._idle_at:
                self._idle_at, self._idle_spins = now, 0
            self._idle_spins += 1
            if self._idle_spins == MAX_IDLE_SPINS:
                self._probe_failed(Livelock(
                    f"the worker woke {MAX_IDLE_SPINS} times at t={now} with nothing to run:\n  "
                    + describe_stuck(self, self.ae, self.core, [])
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
        front = set(self.ae.live_uids()) if self.ae is not None else None
        for it in sched.items:
            uid = it.seq.uid
            if uid in self.ends:
                self.violation(f"step {self.stats.steps}: {uid} scheduled after it ended")
            if front is not None and uid not in front:
                # Invariant 4: a request the front end ended stops costing within STEPS_AFTER_END.
                self.after_end[uid] += 1
                self.stats.steps_after_end = max(self.stats.steps_after_end, self.after_end[uid])
                if self.after_end[uid] > STEPS_AFTER_END:
                    self.violation(
                        f"step {self.stats.steps}: {uid} is in step number {self.after_end[uid]} "
                        f"since the front end ended it (its abort should reach the worker within "
                        f"{STEPS_AFTER_END})"
                    )
            if not it.seq.ready:
                self.violation(f"step {self.stats.steps}: paused {uid} was scheduled")
        for seq in sched.preempted:
            if seq.pages:
                self.violation(f"step {self.stats.steps}: preempted {seq.uid} kept pages")
            if getattr(seq.proposer, "pages", None):
                self.violation(f"step {self.stats.steps}: preempted {seq.uid} kept draft pages")
        self.in_flight = {it.seq.uid for it in sched.items}
        now = self.probe.now()
        for it in sched.items:
            self.first_scheduled.setdefault(it.seq.uid, now)
        return plan

    def _check_priorities(self, waiting_before: list[Sequence], running_before: set[Sequence]) -> None:
        """Priority order at this admission: no sequence that was waiting (and ready) and is
        still waiting comes before, by (priority, arrival), one this step admitted; and a ready
        sequence preempted this step is of the lowest priority (and then the youngest) of those
        still running after it (paused ones go first, whatever their priority)."""
        sched = self.scheduler
        admitted = [s for s in waiting_before if s.status is Status.RUNNING]
        left = [s for s in waiting_before if s.status is Status.WAITING and s.ready]
        if admitted and left:
            last, first_left = max(s.queue_key for s in admitted), min(left, key=lambda s: s.queue_key)
            if first_left.queue_key < last:
                self.violation(
                    f"step {self.stats.steps + 1}: admitted a sequence of (priority, arrival) "
                    f"{last} while {first_left.uid} {first_left.queue_key} was still waiting")
        preempted = [s for s in running_before if s.status is Status.WAITING and s.ready]
        for victim in preempted:
            above = [s for s in sched.running if s.queue_key > victim.queue_key]
            if above:
                self.violation(
                    f"step {self.stats.steps + 1}: preempted {victim.uid} {victim.queue_key} while "
                    f"{above[0].uid} {above[0].queue_key} of a lower priority (or younger) ran on")

    def execute(self, plan: StepPlan):
        self.calls += 1
        if self._step_of_plan in self.fail_steps:
            self.stats.failed_steps += 1
            self.failed_uids |= {it.seq.uid for it in plan.schedule.items}
            self.in_flight = set()
            raise InjectedFault(f"injected fault in step {self._step_of_plan}")
        return super().execute(plan)

    def commit(self, plan: StepPlan, result) -> list[RequestOutput]:
        self.calls += 1
        ended_before = set(self.ends)
        outputs = super().commit(plan, result)
        self.in_flight = set()
        taken = self.tap.taken if self.tap is not None else Counter()
        for out in outputs:
            uid = out.uid
            if len(out.token_ids) > 1:
                self.stats.multi_token_outputs += 1
            if uid in ended_before:
                self.violation(f"step {self.stats.steps}: output for ended {uid}")
            final = out.finish_reason is not None
            if final:
                self._ended(uid)
            self.emitted[uid] += 1
            self.emissions.setdefault(uid, []).append((self.probe.now(), final))
            # Invariant 5: the outputs of a uid that exist anywhere (this step's frame, in transit,
            # in the request's channel) never exceed its credits: emitted - taken <= capacity.
            # At every delivery the front end holds at most what the worker emitted, so this
            # bounds what a request's channel holds, untaken, per uid.
            held = self.emitted[uid] - taken[uid]
            if held > self.capacity:
                self.violation(
                    f"step {self.stats.steps}: {uid} emitted output #{self.emitted[uid]} with "
                    f"{taken[uid]} taken by its reader: {held} of its outputs exist, more than "
                    f"its {self.capacity} credits"
                )
        return outputs

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


class SpinGuard(trio.abc.Instrument):
    """Counts rounds of trio's run loop at one virtual instant with no engine call in between; too
    many is a spin (see :data:`MAX_IDLE_ROUNDS`)."""

    def __init__(self) -> None:
        self.engine: ProbeEngine | None = None  # set once the run has built it
        self.waiting_clients: Callable[[], list[str]] = list
        self._key: tuple[float, int] | None = None
        self._rounds = 0

    def before_io_wait(self, timeout: float) -> None:
        if self.engine is None:
            return
        key = (trio.current_time(), self.engine.calls)
        if key != self._key:
            self._key, self._rounds = key, 0
            return
        self._rounds += 1
        if self._rounds == MAX_IDLE_ROUNDS and self.engine.run_scope is not None:
            self.engine._probe_failed(Livelock(
                f"{MAX_IDLE_ROUNDS} rounds of the event loop at t={key[0]} without any engine "
                f"call (a task that never waits):\n  "
                + describe_stuck(self.engine, self.engine.ae, self.engine.core,
                                 self.waiting_clients())
            ))


async def watchdog(engine: ProbeEngine, waiting_clients: Callable[[], list[str]]) -> None:
    """Fail the run as a deadlock if it is still going at the virtual deadline. Under the
    autojump clock a run where every task waits for something that never comes jumps straight
    here, and the state is described *before* the cancellation unwinds it."""
    await trio.sleep(DEADLINE_S)
    engine._probe_failed(Deadlock(
        f"nothing happened for {DEADLINE_S:g} virtual seconds:\n  "
        + describe_stuck(engine, engine.ae, engine.core, waiting_clients())
    ))


async def settle(engine: ProbeEngine) -> bool:
    """Wait until every task waits (``wait_all_tasks_blocked``: the worker has applied everything
    the front end sent and gone idle, the front end has taken every frame the worker sent; under
    the autojump clock this returns before the clock moves), then say whether the worker holds
    nothing and the front end's statistics are the engine's current ones."""
    await trio.testing.wait_all_tasks_blocked()
    ae, core = engine.ae, engine.core
    return (core is not None and not core.live_uids and not engine.num_requests
            and ae is not None and ae.stats is not None
            and engine.statistics() == ae.stats)


def stats_idle(ae: AsyncEngine) -> bool:
    """The worker's last statistics, as the front end holds them: nothing running or waiting, and
    every page in use held by the prefix cache."""
    s = ae.stats
    return s is None or (s.running == 0 and s.waiting == 0 and s.pages_used == s.pages_cached)


# -- the scenario --------------------------------------------------------------------------------


@dataclass
class Record:
    """What one client saw."""

    request: Request
    entry: Event | None = None
    live_at_entry: int = 0  # uids the front end tracked when it asked to be admitted
    request_id: int | None = None  # set once admitted
    log: SessionLog | None = None
    outcome: str | None = None  # finished | left | cancelled | <error class name> | rejected
    error: BaseException | None = None
    error_event: Event | None = None
    admitted_event: Event | None = None
    cancel_phase: str | None = None
    finished_early: Event | None = None  # when the client called stream.finish() on every choice

    @property
    def reads(self) -> list[tuple[Event, list[Output]]]:
        return [(r.event, r.outputs) for r in self.log.reads] if self.log is not None else []


@dataclass
class ShutdownRecord:
    started: Event | None = None
    settled: bool = True  # drain: the worker applied every abort before it was stopped


@dataclass
class Report:
    scenario: Scenario
    engine: ProbeEngine
    front: AsyncEngine  # the front end
    core: WorkerCore
    tap: SessionTap
    records: list[Record]
    shutdown: ShutdownRecord
    settled: bool  # once every client was done, the worker held nothing (no shutdown)
    tasks_before: int
    tasks_after: int
    children_after: int

    @property
    def hard_stop(self) -> bool:
        """The worker was cancelled, not drained: it may leave state behind, as a killed
        process would (restart=False: the engine is never used again)."""
        sd = self.scenario.shutdown
        return sd is not None and sd.kind == "cancel" and self.shutdown.started is not None


def phase_of(engine: ProbeEngine, uids: list[Uid]) -> str:
    """Where a request's sequences are right now (the most advanced one), and whether a step
    carrying it is in flight (the fake model's steps run inline, so other tasks only run while a
    step is in flight or the worker is idle). ``sent``: the worker has not applied its Add yet."""
    order = ["prefill", "decode", "preempted", "queued", "sent", "ended"]
    phases, flying = set(), False
    for uid in uids:
        seq = engine._seqs.get(uid)
        flying |= uid in engine.in_flight
        if seq is None:
            phases.add("ended" if uid in engine.admitted else "sent")
        elif seq.status is Status.WAITING:
            phases.add("queued" if seq.num_output_tokens == 0 else "preempted")
        elif seq.num_output_tokens == 0:
            phases.add("prefill")
        else:
            phases.add("decode")
    phase = next(p for p in order if p in phases)
    return f"{phase}, step in flight" if flying else phase


async def run_client(tap: SessionTap, index: int, req: Request, rec: Record, spawn: Callable,
                     phase: Callable[[list[Uid]], str] | None = None) -> None:
    """Client #``index`` of a scenario: arrive, open a session, read as ``req.client`` says,
    record. ``phase`` says where a request is when a canceller fires (engine suite only)."""
    CURRENT_CLIENT.set(index)  # this task's own context: labels its session in the tap
    probe = tap.probe
    await trio.sleep(req.arrival)
    for _ in range(req.ticks):
        await trio.lowlevel.checkpoint()
    client = req.client
    params = [c.params(req.priority) for c in req.choices]
    rec.live_at_entry = len(tap.ae.live_uids())
    rec.entry = probe.now()
    try:
        with trio.CancelScope() as cs:
            async with tap.generate(list(req.prompt), params, req.timeout) as stream:
                rec.request_id = stream.request_id
                rec.log = tap.sessions[stream.request_id]
                rec.admitted_event = probe.now()
                if client.kind == "cancel":
                    # A sibling task cancels this scope k ticks from now, wherever the request
                    # is by then (no-op if it has already ended).
                    spawn(_canceller, phase, cs, client, rec.log.uids, rec)
                if client.kind == "stall":
                    await trio.sleep(client.delay)
                reads = 0
                async for _ in stream:
                    reads += 1
                    if client.kind == "leave" and reads >= client.k:
                        rec.outcome = "left"
                        break
                    if client.kind == "finish" and reads == client.k:
                        for i in range(len(params)):
                            stream.finish(i)
                        rec.finished_early = rec.log.reads[-1].event
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
    except ValueError as exc:  # not expected any more: the worker refuses with RequestFailed
        rec.outcome = "rejected"
        rec.error = exc
        rec.error_event = probe.now()


async def _canceller(phase: Callable[[list[Uid]], str] | None, cs: trio.CancelScope,
                     client, uids: list, rec: Record) -> None:
    if client.delay:
        await trio.sleep(client.delay)
    for _ in range(client.k):
        await trio.lowlevel.checkpoint()
    if rec.outcome is None:
        rec.cancel_phase = phase(uids) if phase is not None else "unknown"
        cs.cancel()


@functools.lru_cache(maxsize=256)
def _settings(items: tuple) -> Settings:
    return Settings(**dict(items))


def scenario_settings(**kw) -> Settings:
    """``Settings(**kw)``, built once per distinct value (pydantic-settings reads the environment
    at every construction: a few ms, per scenario). Nothing mutates them."""
    return _settings(tuple(sorted(kw.items())))


class WrongDraft(FakeModel):
    """The fake model as a draft model, wrong (its argmax moved to the next id) at every
    position divisible by 3: drafts are kept, cut and rolled back."""

    def forward(self, batch, k_caches, v_caches):  # type: ignore[no-untyped-def]
        logits = super().forward(batch, k_caches, v_caches)
        wrong = np.flatnonzero(batch.positions[batch.logits_indices] % 3 == 0)
        logits[wrong] = np.roll(logits[wrong], 1, axis=-1)
        return logits


def build_engine(shape, fail_steps: frozenset[int], probe: Probe, capacity: int,
                 name: str = "fake") -> ProbeEngine:
    draft = shape.speculative and shape.draft
    return ProbeEngine(
        FakeModel(vocab_size=VOCAB, eos_token_id=EOS, name=name),
        EngineConfig(page_size=shape.page_size, num_pages=shape.num_pages,
                     max_running=shape.max_running, max_batched_tokens=shape.max_batched_tokens,
                     enable_prefix_cache=shape.prefix_cache,
                     # Every step may speculate, and no sequence ever stops proposing: the most
                     # drafts (pages reserved ahead, rollbacks) the scenario can have.
                     speculative=("draft" if draft else "ngram") if shape.speculative else "off",
                     speculative_max_batch=max(1, shape.max_running),
                     speculative_min_acceptance=0.0, speculative_payoff=False,
                     # the draft pool: draft_pages pages of the fake model's (one float64 each)
                     speculative_draft_kv_bytes=(shape.draft_pages * KVCache.bytes_per_page(
                         1, shape.page_size, 1, 1, "float64") if draft else 0)),
        fail_steps,
        probe,
        capacity,
        WrongDraft(vocab_size=VOCAB, eos_token_id=EOS) if draft else None,
    )



async def _main(sc: Scenario, guard: SpinGuard) -> Report:
    tasks_before = trio.lowlevel.current_statistics().tasks_living
    probe = Probe()
    shape = sc.engine
    engine = build_engine(shape, sc.fail_steps, probe, sc.channel_capacity)
    engine.max_steps = step_budget(sum(
        len(r.prompt) + (c.max_tokens or shape.max_model_len) for r in sc.requests for c in r.choices
    ))
    settings = scenario_settings(channel_capacity=sc.channel_capacity,
                                 stall_timeout_s=sc.stall_timeout_s, max_waiting=sc.max_waiting,
                                 max_waiting_tokens=sc.max_waiting_tokens,
                                 max_queue_time_s=sc.max_queue_time_s)
    records = [Record(req) for req in sc.requests]
    sd_rec = ShutdownRecord()
    engine_scope = trio.CancelScope()

    async def serve(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with engine_scope:
            async with open_engine(settings, in_process(engine), metrics=Metrics()) as ae:
                engine.ae = ae
                engine.core = ae.connection.core  # type: ignore[union-attr]
                engine.nudge = ae.connection.nudge  # type: ignore[union-attr]
                engine.tap = SessionTap(ae, probe)
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
            # The aborts are messages: let them reach the worker before it is stopped, so the
            # end of the run can check that a drain leaves the engine empty.
            sd_rec.settled = await settle(engine)
        engine_scope.cancel()

    async def hold(ae: AsyncEngine) -> None:
        h = sc.hold
        assert h is not None
        await trio.sleep(h.at)
        engine.held, start = True, trio.current_time()
        await trio.sleep(h.for_s)
        engine.held, engine.held_during = False, (start, trio.current_time())
        try:
            engine.nudge()  # the worker may be idle, waiting for a frame
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # a shutdown stopped the worker meanwhile

    def waiting_clients() -> list[str]:
        return [f"#{i} (id {rec.request_id}, {rec.request.client!r}, read {len(rec.reads)})"
                for i, rec in enumerate(records) if rec.outcome is None]

    guard.engine, guard.waiting_clients = engine, waiting_clients
    settled = True
    with trio.fail_after(2 * DEADLINE_S), trio.CancelScope() as engine.run_scope:
        async with trio.open_nursery() as root:
            root.start_soon(watchdog, engine, waiting_clients)
            ae: AsyncEngine = await root.start(serve)
            async with trio.open_nursery() as clients:
                for index, (req, rec) in enumerate(zip(sc.requests, records)):
                    clients.start_soon(run_client, engine.tap, index, req, rec,
                                       clients.start_soon, lambda uids: phase_of(engine, uids))
                if sc.shutdown is not None:
                    clients.start_soon(shutdown, ae)
                if sc.hold is not None:
                    clients.start_soon(hold, ae)
            if sd_rec.started is None:
                settled = await settle(engine)
            root.cancel_scope.cancel()  # the engine (front end and worker) and the watchdog
    if engine.failure is not None:
        raise engine.failure
    me = trio.lowlevel.current_task()
    assert engine.core is not None and engine.tap is not None
    return Report(
        scenario=sc,
        engine=engine,
        front=ae,
        core=engine.core,
        tap=engine.tap,
        records=records,
        shutdown=sd_rec,
        settled=settled,
        tasks_before=tasks_before,
        tasks_after=trio.lowlevel.current_statistics().tasks_living,
        children_after=sum(len(n.child_tasks) for n in me.child_nurseries),
    )


class _RuntimeLogFilter(logging.Filter):
    """The worker logs every failed step with a traceback, the front end a broken protocol or a
    lost worker. The injected faults are expected: drop them. Anything else is kept, and
    remembered for the failure message."""

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


RUNTIME_ERRORS = _RuntimeLogFilter()
for _name in ("trio_infer.runtime.worker", "trio_infer.runtime.client"):
    logging.getLogger(_name).addFilter(RUNTIME_ERRORS)


def _leaves(exc: BaseException) -> list[BaseException]:
    inner = getattr(exc, "exceptions", None)
    return [leaf for e in inner for leaf in _leaves(e)] if inner else [exc]


def runtime_errors() -> str:
    """The unexpected errors the worker and the front end logged during the current run (the
    leaves of exception groups)."""
    return "; ".join(f"{type(e).__name__}: {e}" for exc in RUNTIME_ERRORS.errors
                     for e in _leaves(exc)) or "none"


def run_scenario(sc: Scenario) -> Report:
    """One scenario in a fresh ``trio.run`` with a fresh mock clock and a seeded scheduler."""
    # trio orders each batch of runnable tasks with this Random (a shuffle under hypothesis, a
    # coin flip otherwise); seeding it from the scenario makes the interleaving part of the
    # example, so hypothesis explores interleavings and replays the one that failed.
    trio._core._run._r.seed(sc.sched_seed)
    RUNTIME_ERRORS.errors.clear()
    clock = trio.testing.MockClock(autojump_threshold=0)
    guard = SpinGuard()
    with as_assertion():
        return trio.run(_main, sc, guard, clock=clock, instruments=[guard])


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
