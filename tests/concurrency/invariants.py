"""The lifecycle invariants (docs/testing.md), checked on a finished run.

Each check raises ``AssertionError`` with a message that names the request and what it saw, so a
shrunk counterexample reads as a story. The checks of a session's reads (:func:`check_session`)
and of the front end's state (:func:`check_front_idle`) use only what a test can see from outside
the front end; the process variant (``test_process_lifecycle.py``) uses them too.
"""

from __future__ import annotations

import math

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable

from trio_infer.engine.engine import Engine
from trio_infer.metrics import Metrics
from trio_infer.runtime.client import AsyncEngine
from trio_infer.runtime.errors import EngineOverloaded, RequestFailed, RequestStalled, RequestTimeout
from trio_infer.runtime.router import RouterStatistics
from trio_infer.runtime.worker import WorkerCore
from trio_infer.wire import RequestOutput as Output, Uid

from .runner import ProbeEngine, Record, Report, SessionLog, runtime_errors, stats_idle
from .scenario import Scenario, expected_output

EPS = 1e-6  # virtual times are sums of exact binary fractions; this only absorbs float rounding


def check_all(report: Report) -> None:
    check_nothing_left(report)
    check_ended_exactly_once(report)
    sc = report.scenario
    for log in report.tap.sessions.values():
        check_session(log, sc.channel_capacity, sc.stall_timeout_s, report.engine)
    for index, rec in enumerate(report.records):
        check_client(report, index, rec)
    check_overload(report)
    check_watchdog(report)


# -- invariant 1: nothing left -------------------------------------------------------------------


def check_nothing_left(report: Report) -> None:
    """Invariant 1 on both sides of the protocol, and no task left behind. After a hard stop the
    worker is gone (a killed process keeps nothing either): only the front end is checked."""
    check_front_idle(report.front)
    if not report.hard_stop:
        assert report.shutdown.settled and report.settled, (
            f"{'after the drain' if not report.shutdown.settled else 'at the end'}, once every "
            f"task waited, the worker still holds uids {report.core.live_uids} (the engine "
            f"{report.engine.num_requests} requests), or the front end's statistics "
            f"{report.front.stats} are not the engine's {report.engine.statistics()}"
        )
        check_worker_idle(report.front, report.core, report.engine)
    assert report.tasks_after == report.tasks_before, (
        f"{report.tasks_after - report.tasks_before} task(s) still alive after the scenario"
    )
    assert report.children_after == 0, "the main task still has children"


def check_front_idle(ae: AsyncEngine) -> None:
    """The front end: no session, no per-uid entry, nothing counted as waiting or paused, the
    sessions gauge at 0."""
    assert ae.num_sessions == 0, f"{ae.num_sessions} live session(s) left in the front end"
    assert ae.live_uids() == [], f"per-uid entries left in the front end: {ae.live_uids()}"
    assert ae.statistics() == RouterStatistics(), f"front end not idle: {ae.statistics()}"
    assert ae.metrics.sessions_active._value.get() == 0, "sessions_active gauge is not 0"


def check_worker_idle(ae: AsyncEngine, core: WorkerCore, e: Engine) -> None:
    """The worker: no per-uid credit entry, no sequence, empty queues, no page but the prefix
    cache's; and the statistics it last sent to the front end say so."""
    assert core.live_uids == [], f"per-uid entries left in the worker: {core.live_uids}"
    assert e.num_requests == 0, f"the engine still holds {e.num_requests} request(s)"
    assert not e.scheduler.running, f"running left: {[s.uid for s in e.scheduler.running]}"
    assert not e.scheduler.waiting, f"waiting left: {[s.uid for s in e.scheduler.waiting]}"
    check_pages_idle(e)
    check_grammar_state_released(e)
    assert stats_idle(ae), f"the front end's last statistics from the worker are not idle: {ae.stats}"


def check_grammar_state_released(e: Engine) -> None:
    """Every sequence that ended (finish, abort, failed step, shutdown) let go of its grammar
    state, and the engine holds none (engine/grammar.py)."""
    assert e.num_matchers == 0, f"the engine still holds {e.num_matchers} grammar matcher(s)"
    held = [s.uid for s in getattr(e, "sequences", ()) if s.matcher is not None]
    assert not held, f"ended sequences still hold grammar state: {held}"


def check_pages_idle(e: Engine) -> None:
    """With nothing running, a page is either free or held by the prefix cache alone."""
    pool = e.pool
    refs = [pool.refcount(p) for p in range(pool.num_pages)]
    used = sum(1 for r in refs if r > 0)
    assert used == pool.num_used, "the pool's free list and its reference counts disagree"
    assert e.num_request_pages == 0, (
        f"{e.num_request_pages} KV page(s) in use with no request running (pool: {pool.num_used} "
        f"used, the prefix cache holds {e.num_cached_pages})"
    )
    cached = e.num_cached_pages
    assert used == cached, f"{used} pages in use, the prefix cache holds {cached}"
    shared = sum(1 for r in refs if r > 1)
    assert not shared, f"{shared} idle page(s) with more than the cache's reference"
    # The draft model's pool (speculative=draft) keeps no cache: every page is free when idle.
    stats = e.statistics()
    assert e.num_draft_pages == stats.draft_pages_used == 0, (
        f"{stats.draft_pages_used} draft-model KV page(s) in use with no request running")
    held = [s.uid for s in getattr(e, "sequences", ()) if getattr(s.proposer, "pages", None)]
    assert not held, f"ended sequences still hold draft pages: {held}"


# -- invariant 3: ended exactly once -------------------------------------------------------------


def check_ended_exactly_once(report: Report) -> None:
    registered = sum(log.n for log in report.tap.sessions.values())
    check_engine_ends(report.engine, report.front.metrics, registered, report.hard_stop)


def check_engine_ends(e: ProbeEngine, metrics: Metrics, registered: int,
                      hard_stop: bool = False) -> None:
    """Invariant 3: in the worker, every sequence it admitted ended once (finish or abort; never
    twice, and never not at all unless the worker was stopped hard); in the front end,
    ``requests_total`` counted each of its uids' ends once."""
    twice = {uid: n for uid, n in e.ends.items() if n != 1}
    assert not twice, f"sequences that ended more than once in the worker: {twice}"
    if not hard_stop:
        never = e.admitted - set(e.ends)
        assert not never, f"sequences that never ended in the worker: {sorted(never)}"
    check_front_ends(metrics, registered)


def check_front_ends(metrics: Metrics, registered: int) -> None:
    counted = sum(
        metrics.requests_total.labels(finish_reason=r)._value.get()
        for r in ("stop", "length", "abort", "error")
    )
    assert counted == registered, (
        f"requests_total counts {counted} ends for the {registered} sequences the front end "
        f"registered"
    )


# -- a session's reads: the per-uid bound and the stall, as the front end measures it -----------


@dataclass
class Pauses:
    """When a session was *paused* in the front end's sense: some unfinished uid of it had
    ``capacity`` outputs delivered and not taken by the reader (0 credits). The front end's stall
    clock runs from the delivery that made it so until the reader's next read (which takes
    everything in the channel), the end of its last unfinished choice, or a stall abort at
    ``since + stall_timeout_s``."""

    closed: list[tuple[float, float]] = field(default_factory=list)  # (since, until)
    open_since: float | None = None  # still paused when the timeline stopped
    unfinished: set[Uid] = field(default_factory=set)
    emitted: Counter = field(default_factory=Counter)
    taken: Counter = field(default_factory=Counter)


def pause_timeline(log: SessionLog, emissions: dict[Hashable, list], capacity: int,
                   until_seq: float) -> Pauses:
    """Replay a session's events (the worker's emissions for its uids, its reader's reads and
    ``finish`` calls) in the order they happened, up to ``until_seq``. An emission stands for its
    delivery: under the mock clock both happen at the same virtual instant."""
    events: list[tuple[int, int, float, object]] = []
    for uid in log.uids:
        for ev, final in emissions.get(uid, ()):
            events.append((ev.seq, 0, ev.time, (uid, final)))
    for read in log.reads:
        events.append((read.event.seq, 1, read.event.time, read))
    for ev, index in log.finishes:
        events.append((ev.seq, 2, ev.time, (log.request_id, index)))
    events.sort(key=lambda e: e[0])
    p = Pauses(unfinished=set(log.uids))

    def close(t: float) -> None:
        if p.open_since is not None:
            p.closed.append((p.open_since, t))
            p.open_since = None

    for seq, kind, t, what in events:
        if seq >= until_seq:
            break
        if kind == 0:  # the worker emitted an output (the front end drops those of ended uids)
            uid, final = what  # type: ignore[misc]
            if uid not in p.unfinished:
                continue
            p.emitted[uid] += 1
            if final:
                p.unfinished.discard(uid)
                if not p.unfinished:
                    close(t)
            elif p.open_since is None and p.emitted[uid] - p.taken[uid] >= capacity:
                p.open_since = t
        elif kind == 1:  # a read takes everything delivered; what is still in transit stays
            for out in what.outputs:  # type: ignore[attr-defined]
                p.taken[out.uid] += 1
            close(t)
            if any(p.emitted[u] - p.taken[u] >= capacity for u in p.unfinished):
                p.open_since = t
        else:  # stream.finish(i): the front end forgets the uid
            p.unfinished.discard(what)  # type: ignore[arg-type]
            if not p.unfinished:
                close(t)
    return p


def check_reads_bounded(log: SessionLog, capacity: int, who: str) -> None:
    """The per-uid bound from the reader's side: one read takes everything the channel holds, so
    no read may take more than ``capacity`` outputs of one uid."""
    for read in log.reads:
        per_uid = Counter(out.uid for out in read.outputs)
        over = {uid: k for uid, k in per_uid.items() if k > capacity}
        assert not over, (
            f"{who}: one read at t={read.event.time} took {over} outputs, more than the "
            f"{capacity} credits of a uid"
        )


def first_dead_read(log: SessionLog) -> int | None:
    """Index of the first read after which the front end no longer tracked any uid of a session
    that still had unfinished choices: the session had ended on the front end's side (stall
    abort, failure, shutdown) and the reader was taking what was left in its channel."""
    finished: set[Uid] = set()
    for i, read in enumerate(log.reads):
        finished |= {out.uid for out in read.outputs if out.finish_reason is not None}
        finished |= {(log.request_id, idx) for ev, idx in log.finishes if ev.seq < read.event.seq}
        if not read.live and set(log.uids) - finished:
            return i
    return None


def check_session(log: SessionLog, capacity: int, timeout: float, engine: ProbeEngine,
                  who: str | None = None) -> None:
    """Invariant 5 (the per-uid bound) and the stall rule, for one session, against the worker's
    emissions: a session is aborted as stalled exactly ``stall_timeout_s`` after it paused (some
    uid at 0 credits) if its reader takes nothing meanwhile, and never otherwise; the outputs of
    the stalled uid that were in its channel all reach the reader first (none dropped)."""
    who = who or f"request #{log.owner}'s session {log.request_id}"
    check_reads_bounded(log, capacity, who)
    dead = first_dead_read(log)
    if dead is not None:
        split = log.reads[dead].event.seq
    elif log.error is not None:
        split = log.ended.seq  # type: ignore[union-attr]
    else:
        split = float("inf")
    p = pause_timeline(log, engine.emissions, capacity, split)
    for since, until in p.closed:
        assert until - since <= timeout + EPS, (
            f"{who}: its reader left {capacity} outputs of a choice untaken from t={since} to "
            f"t={until}, longer than the stall timeout ({timeout}), and it was not aborted"
        )
    if isinstance(log.error, RequestStalled):
        assert p.open_since is not None, (
            f"{who}: stalled, but no choice had {capacity} outputs untaken when it was aborted "
            f"(untaken: { {u: p.emitted[u] - p.taken[u] for u in sorted(p.unfinished)} }, "
            f"reads at {[r.event.time for r in log.reads]})"
        )
        aborts = [engine.abort_event[u] for u in p.unfinished if u in engine.abort_event]
        if aborts:
            at = min(ev.time for ev in aborts)
            assert abs(at - (p.open_since + timeout)) <= EPS, (
                f"{who}: stalled at t={at}, but its reader left {capacity} outputs untaken from "
                f"t={p.open_since}: the stall abort is due at t={p.open_since + timeout} "
                f"(timeout {timeout})"
            )
        # The stalled uid's outputs were all delivered (it had no credit left to be sent more):
        # the reader must get every one of them before the error.
        full = [u for u in p.unfinished if p.emitted[u] - p.taken[u] >= capacity]
        got = Counter(out.uid for read in log.reads for out in read.outputs)
        assert any(got[u] == p.emitted[u] for u in full), (
            f"{who}: stalled with {capacity} outputs of {full} in its channel, but the reader got "
            f"{ {u: got[u] for u in full} } of their { {u: p.emitted[u] for u in full} }"
        )
    elif p.open_since is not None and log.error is None and dead is None and log.exited is not None:
        assert log.exited.time - p.open_since <= timeout + EPS, (
            f"{who}: its reader left {capacity} outputs of a choice untaken from "
            f"t={p.open_since} until it left at t={log.exited.time}, longer than the stall "
            f"timeout ({timeout}), and it was not aborted"
        )


# -- each client ---------------------------------------------------------------------------------


def _who(index: int, rec: Record) -> str:
    r = rec.request
    return (f"request #{index} (id {rec.request_id}, prompt len {len(r.prompt)}, "
            f"n={len(r.choices)}, {r.client!r}, outcome {rec.outcome})")


def check_outputs(who: str, request_id: int, prompt, choices, reads: list[list[Output]],
                  max_model_len: int, vocab: int | None = None, eos: int | None = None) -> set[int]:
    """Invariant 2: each choice gets only its own tokens, in order, without gap or duplicate, one
    finish and nothing after it; a finished choice exactly the expected tokens, an unfinished one
    a proper prefix. Returns the finished choices."""
    n = len(choices)
    kw = {} if vocab is None else {"vocab": vocab, "eos": eos}
    per_choice: dict[int, list[Output]] = {i: [] for i in range(n)}
    for outs in reads:
        assert outs, f"{who}: an empty read"
        for out in outs:
            assert out.uid[0] == request_id and out.uid[1] in per_choice, (
                f"{who}: got an output of {out.uid}"
            )
            per_choice[out.uid[1]].append(out)
    finished = set()
    for i, outs in per_choice.items():
        exp = expected_output(prompt, choices[i], max_model_len, **kw)
        tokens = [t for o in outs for t in o.token_ids]
        for j, o in enumerate(outs):
            assert o.num_prompt_tokens == len(prompt), f"{who} choice {i}: prompt count"
            assert o.num_output_tokens == len([t for p in outs[: j + 1] for t in p.token_ids]), (
                f"{who} choice {i}: output #{j} claims {o.num_output_tokens} tokens so far"
            )
            if o.finish_reason is not None:
                assert j == len(outs) - 1, f"{who} choice {i}: output after its finish"
        if outs and outs[-1].finish_reason is not None:
            finished.add(i)
            last = outs[-1]
            assert tuple(tokens) == exp.tokens, (
                f"{who} choice {i}: got {tokens}, expected {list(exp.tokens)}"
            )
            assert last.finish_reason == exp.finish_reason, (
                f"{who} choice {i}: finish {last.finish_reason!r}, expected {exp.finish_reason!r}"
            )
            want_stop = exp.tokens[-1] if exp.finish_reason == "stop" else None
            assert last.stop_token_id == want_stop, f"{who} choice {i}: stop_token_id"
        else:
            assert tuple(tokens) == exp.tokens[: len(tokens)] and len(tokens) < len(exp.tokens), (
                f"{who} choice {i}: unfinished with {tokens}, which is not a proper prefix of "
                f"{list(exp.tokens)}"
            )
    return finished


def check_client(report: Report, index: int, rec: Record) -> None:
    sc: Scenario = report.scenario
    req = rec.request
    who = _who(index, rec)
    n = len(req.choices)
    assert rec.outcome is not None, f"{who}: the client ended without an outcome"

    if rec.request_id is None:  # refused at the door
        _check_refusal(report, who, rec)
        return

    finished = check_outputs(who, rec.request_id, req.prompt, req.choices,
                             [outs for _, outs in rec.reads], sc.engine.max_model_len)
    too_long = len(req.prompt) >= sc.engine.max_model_len
    refused = isinstance(rec.error, RequestFailed) and "refused" in str(rec.error)
    if too_long:
        # The front end does not know the context; the worker refuses the Add (RequestFailed).
        assert not rec.reads and rec.outcome in ("RequestFailed", "EngineUnavailable", "cancelled"), (
            f"{who}: a prompt too long for the context ({sc.engine.max_model_len}) was not refused"
        )
    assert not refused or too_long, f"{who}: a fitting prompt was refused: {rec.error}"

    # Invariant 3, client side: a stream that ends without an error has finished every choice
    # (never silence); an error is one the scenario can explain.
    if rec.outcome == "finished":
        if rec.finished_early is not None:
            # It ended every choice itself: afterwards it may only read what was buffered.
            after = sum(len(outs) for ev, outs in rec.reads if ev.seq > rec.finished_early.seq)
            assert after <= sc.channel_capacity * n, (
                f"{who}: read {after} outputs after ending every choice, more than its channel holds"
            )
        else:
            assert finished == set(range(n)), (
                f"{who}: the stream ended with choices {sorted(set(range(n)) - finished)} "
                f"unfinished"
            )
    elif rec.outcome == "RequestStalled":
        pass  # check_session checked the stall against the reads and the emissions
    elif rec.outcome == "RequestFailed":
        uids = {(rec.request_id, i) for i in range(n)}
        assert refused or uids & report.engine.failed_uids, (
            f"{who}: failed, but no step carrying it raised ({rec.error})"
        )
    elif rec.outcome == "EngineUnavailable":
        sd = report.shutdown.started
        assert sd is not None and rec.error_event.seq > sd.seq, (
            f"{who}: EngineUnavailable without a shutdown (the runtime's errors: "
            f"{runtime_errors()})"
        )
    elif rec.outcome in ("RequestTimeout", "EngineOverloaded"):
        pass  # check_overload checked the deadline and the queue time against the worker's steps
    elif rec.outcome in ("left", "cancelled"):
        if rec.outcome == "left":
            assert len(rec.reads) == req.client.k, f"{who}: left after {len(rec.reads)} reads"
        else:
            assert req.client.kind == "cancel", f"{who}: cancelled, but nobody cancelled it"
    else:
        raise AssertionError(f"{who}: unexpected outcome {rec.error!r} (the runtime's errors: "
                             f"{runtime_errors()})")


def _check_refusal(report: Report, who: str, rec: Record) -> None:
    sc, req = report.scenario, rec.request
    if rec.outcome == "EngineOverloaded":
        # The front end counts the sequences the worker has not scheduled yet; all it can be is
        # at most the uids it tracks. The token bound refuses only while something waits.
        reason = rec.error.reason  # type: ignore[union-attr]
        if reason == "queue_full":
            assert rec.live_at_entry + len(req.choices) > sc.max_waiting, (
                f"{who}: overloaded with {rec.live_at_entry} live sequences of {sc.max_waiting}"
            )
        else:
            assert reason == "queue_tokens" and sc.max_waiting_tokens is not None, (
                f"{who}: refused at the door for {reason!r}")
            assert rec.live_at_entry > 0 and len(req.prompt) * len(req.choices) > 0, (
                f"{who}: refused for queued tokens with nothing queued")
        assert rec.error.retry_after_s >= 1, f"{who}: Retry-After {rec.error.retry_after_s}"  # type: ignore[union-attr]
    elif rec.outcome == "EngineUnavailable" and "no progress" in str(rec.error):
        assert _while_stalled(report, rec.entry.time), (
            f"{who}: refused as stalled at t={rec.entry.time:g} (the hold: "
            f"{report.engine.held_during or report.scenario.hold})")
    elif rec.outcome == "EngineUnavailable":
        sd = report.shutdown.started
        assert sd is not None and rec.entry.seq > sd.seq, (
            f"{who}: refused without a shutdown (the runtime's errors: {runtime_errors()})"
        )
    else:
        raise AssertionError(f"{who}: not admitted, yet the outcome is {rec.outcome}: {rec.error!r}")
    assert not rec.reads


# -- the forward-progress watchdog -----------------------------------------------------------------

STALL_BOUND_S = 10.0  # the default watchdog_stall_s; the fake model's steps take no time


def _while_stalled(report: Report, t: float) -> bool:
    """Whether ``t`` falls where the worker was held past the stall bound (a hold that a shutdown
    cut short has no end: it lasts to the end of the run)."""
    hold = report.scenario.hold
    if hold is None:
        return False
    start, until = report.engine.held_during or (hold.at, math.inf)
    return start + STALL_BOUND_S <= t <= until


def check_watchdog(report: Report) -> None:
    """A worker that steps whenever it has work is never stalled, whatever its clients do (slow,
    stalled, gone); a held one is stalled once, if held past the bound, and never given up (the
    holds stay below the restart bound); after the hold it is healthy again."""
    ae, hold = report.front, report.scenario.hold
    assert ae.watchdog_restarts == 0, "the watchdog gave up a worker that was only held"
    if hold is None or hold.for_s < STALL_BOUND_S:
        assert ae.watch.stalls == 0, (
            f"a worker that was never held {STALL_BOUND_S:g} s was declared stalled "
            f"({ae.watchdog_status()})")
    else:
        assert ae.watch.stalls <= 1, f"one hold counted {ae.watch.stalls} stalls"
    if report.shutdown.started is None:
        assert not ae.stalled, "still stalled after the hold ended"


# -- overload: deadlines, the queue-time limit, refusals -------------------------------------------


def check_overload(report: Report) -> None:
    """For every request that got a session (it entered at ``t0``, the same virtual instant as
    its session opened):

    * with a ``timeout`` T: every one of its sequences the worker had ended there by ``t0 + T``
      (an engine step of the fake model takes no virtual time, so "plus one engine step" is the
      same instant; invariant 4 bounds the steps after the end), and a ``RequestTimeout`` came no
      earlier than ``t0 + T``;
    * with ``max_queue_time_s`` L: the worker first scheduled one of its sequences by ``t0 + L``;
      a request refused for its queue time (``EngineOverloaded`` ``queue_time``) was refused at
      ``t0 + L`` exactly and had not been scheduled before (a step at that same instant may
      have started it: the refusal aborts it then, as a disconnect would).

    And a request refused at the door never reached the worker: every uid the engine was given
    belongs to a session."""
    sc, e = report.scenario, report.engine
    sessions = set(report.tap.sessions)
    strangers = sorted(uid for uid in e.admitted if uid[0] not in sessions)  # type: ignore[index]
    assert not strangers, f"the worker got sequences of requests refused at the door: {strangers}"
    limit = sc.max_queue_time_s
    for index, rec in enumerate(report.records):
        if rec.log is None:
            continue
        who, t0 = _who(index, rec), rec.log.entered.time
        uids = [u for u in rec.log.uids if u in e.admitted]
        timeout = rec.request.timeout
        if timeout is not None and not report.hard_stop:
            late = {u: e.end_event[u].time for u in uids if u in e.end_event
                    and e.end_event[u].time > t0 + timeout + EPS}
            never = [u for u in uids if u not in e.end_event]
            assert not late and not never, (
                f"{who}: deadline t={t0 + timeout}, but its sequences ended in the worker at "
                f"{late}, or never: {never}")
        if isinstance(rec.error, RequestTimeout):
            assert timeout is not None and rec.error_event.time >= t0 + timeout - EPS, (  # type: ignore[union-attr]
                f"{who}: RequestTimeout at t={rec.error_event.time} before its deadline "  # type: ignore[union-attr]
                f"({timeout} s after t={t0})")
        first = [e.first_scheduled[u].time for u in uids if u in e.first_scheduled]
        if isinstance(rec.error, EngineOverloaded):
            assert rec.error.reason == "queue_time" and limit is not None, (
                f"{who}: refused with {rec.error.reason!r} after its session opened")
            aborts = [e.abort_event[u].time for u in uids if u in e.abort_event]
            assert all(abs(t - (t0 + limit)) <= EPS for t in aborts), (
                f"{who}: refused for its queue time; its sequences were aborted at {aborts}, "
                f"the limit is t={t0 + limit}")
            assert all(t >= t0 + limit - EPS for t in first), (
                f"{who}: refused for its queue time (limit t={t0 + limit}), but the worker "
                f"had scheduled it at t={min(first)}")
        elif limit is not None and first:
            assert min(first) <= t0 + limit + EPS, (
                f"{who}: first scheduled at t={min(first)}, past its queue-time limit "
                f"t={t0 + limit}, and not refused")
