"""The lifecycle invariants of BRIEF.md section 4, checked on a finished run.

Each check raises ``AssertionError`` with a message that names the request and what it saw, so a
shrunk counterexample reads as a story.
"""

from __future__ import annotations

from trio_infer.engine.engine import Engine, RequestOutput
from trio_infer.runtime.engine_actor import AsyncEngine

from trio_infer.metrics import Metrics

from .runner import ProbeEngine, Record, Report, actor_errors
from .scenario import Scenario, expected_output


def check_all(report: Report) -> None:
    check_nothing_left(report)
    check_ended_exactly_once(report)
    for index, rec in enumerate(report.records):
        check_client(report, index, rec)


def check_nothing_left(report: Report) -> None:
    """Invariant 1, and no task left behind."""
    check_idle(report.actor, report.engine)
    assert report.tasks_after == report.tasks_before, (
        f"{report.tasks_after - report.tasks_before} task(s) still alive after the scenario"
    )
    assert report.children_after == 0, "the main task still has children"


def check_idle(ae: AsyncEngine, e: Engine) -> None:
    """Invariant 1: sessions, per-uid maps, queues and pages back to zero (bar the prefix
    cache's own pages). Only true once every client is done."""
    assert ae.num_sessions == 0, f"live sessions left: {list(ae._sessions)}"
    assert not ae._by_uid, f"per-uid entries left: {list(ae._by_uid)}"
    assert not e._seqs, f"engine still holds requests: {list(e._seqs)}"
    assert not e.scheduler.running, f"running left: {[s.uid for s in e.scheduler.running]}"
    assert not e.scheduler.waiting, f"waiting left: {[s.uid for s in e.scheduler.waiting]}"
    check_pages_idle(e)
    assert ae.metrics.sessions_active._value.get() == 0, "sessions_active gauge is not 0"


def check_pages_idle(e: Engine) -> None:
    """With nothing running, a page is either free or held by the prefix cache alone."""
    pool = e.pool
    used = {p for p in range(pool.num_pages) if pool.refcount(p) > 0}
    assert len(used) == pool.num_used, "the pool's free list and its reference counts disagree"
    cache = e.prefix_cache
    cached = {node.page for node in cache._lru.values()} if cache is not None else set()
    assert used == cached, (
        f"KV pages in use with no request running: {sorted(used - cached)} not held by the "
        f"prefix cache (which holds {len(cached)})"
    )
    shared = {p: pool.refcount(p) for p in used if pool.refcount(p) != 1}
    assert not shared, f"idle pages with more than the cache's reference: {shared}"


def check_ended_exactly_once(report: Report) -> None:
    """Invariant 3, engine side: every admitted sequence ended once (finish or abort), and the
    metrics counted each end once."""
    check_engine_ends(report.engine, report.actor.metrics)


def check_engine_ends(e: ProbeEngine, metrics: Metrics) -> None:
    twice = {uid: n for uid, n in e.ends.items() if n != 1}
    assert not twice, f"sequences that ended more than once: {twice}"
    never = e.admitted - set(e.ends)
    assert not never, f"sequences that never ended: {sorted(never)}"
    counted = sum(
        metrics.requests_total.labels(finish_reason=r)._value.get()
        for r in ("stop", "length", "abort", "error")
    )
    assert counted == len(e.admitted), (
        f"requests_total counts {counted} ends for {len(e.admitted)} sequences"
    )


def _who(index: int, rec: Record) -> str:
    r = rec.request
    return (f"request #{index} (id {rec.request_id}, prompt len {len(r.prompt)}, "
            f"n={len(r.choices)}, {r.client!r}, outcome {rec.outcome})")


def check_client(report: Report, index: int, rec: Record) -> None:
    sc: Scenario = report.scenario
    req = rec.request
    who = _who(index, rec)
    n = len(req.choices)
    assert rec.outcome is not None, f"{who}: the client ended without an outcome"

    if rec.request_id is None:  # refused at the door
        _check_refusal(report, who, rec)
        return

    # Invariant 2: only its own tokens, in order, no gap or duplicate; one finish, last.
    per_choice: dict[int, list[RequestOutput]] = {i: [] for i in range(n)}
    for _, outs in rec.reads:
        assert outs, f"{who}: an empty read"
        for out in outs:
            assert out.uid[0] == rec.request_id and out.uid[1] in per_choice, (
                f"{who}: got an output of {out.uid}"
            )
            per_choice[out.uid[1]].append(out)
    finished = set()
    for i, outs in per_choice.items():
        exp = expected_output(req.prompt, req.choices[i], sc.engine.max_model_len)
        tokens = [t for o in outs for t in o.token_ids]
        for j, o in enumerate(outs):
            assert o.num_prompt_tokens == len(req.prompt), f"{who} choice {i}: prompt count"
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
            assert finished == set(per_choice), (
                f"{who}: the stream ended with choices {sorted(set(per_choice) - finished)} "
                f"unfinished"
            )
    elif rec.outcome == "RequestStalled":
        _check_stall(report, who, rec, finished)
    elif rec.outcome == "RequestFailed":
        uids = {(rec.request_id, i) for i in range(n)}
        assert uids & report.engine.failed_uids, f"{who}: failed, but no step carrying it raised"
    elif rec.outcome == "EngineUnavailable":
        sd = report.shutdown.started
        assert sd is not None and rec.error_event.seq > sd.seq, (
            f"{who}: EngineUnavailable without a shutdown (the actor's errors: {actor_errors()})"
        )
    elif rec.outcome in ("left", "cancelled"):
        if rec.outcome == "left":
            assert len(rec.reads) == req.client.k, f"{who}: left after {len(rec.reads)} reads"
        else:
            assert req.client.kind == "cancel", f"{who}: cancelled, but nobody cancelled it"
    else:
        raise AssertionError(f"{who}: unexpected outcome (the actor's errors: {actor_errors()})")


def _check_refusal(report: Report, who: str, rec: Record) -> None:
    sc, req = report.scenario, rec.request
    if rec.outcome == "rejected":
        assert len(req.prompt) >= sc.engine.max_model_len, f"{who}: a fitting prompt was refused"
    elif rec.outcome == "EngineOverloaded":
        assert rec.waiting_at_entry + len(req.choices) > sc.max_waiting, (
            f"{who}: overloaded with {rec.waiting_at_entry} waiting of {sc.max_waiting}"
        )
    elif rec.outcome == "EngineUnavailable":
        sd = report.shutdown.started
        assert sd is not None and rec.entry.seq > sd.seq, (
            f"{who}: refused without a shutdown (the actor's errors: {actor_errors()})"
        )
    else:
        raise AssertionError(f"{who}: not admitted, yet the outcome is {rec.outcome}")
    assert not rec.reads


def _check_stall(report: Report, who: str, rec: Record, finished: set[int]) -> None:
    """A stall abort is legitimate only if, when it came, the channel was full and the reader had
    not read for ``stall_timeout_s``."""
    sc = report.scenario
    uids = [(rec.request_id, i) for i in range(len(rec.request.choices))]
    aborted = [report.engine.end_event[(rec.request_id, i)] for i in range(len(uids))
               if i not in finished]
    assert aborted, f"{who}: stalled, but every choice had finished"
    abort = min(aborted, key=lambda ev: ev.seq)
    before = [ev for ev, _ in rec.reads if ev.seq < abort.seq]
    last = before[-1] if before else rec.admitted_event
    assert abort.time - last.time >= sc.stall_timeout_s, (
        f"{who}: stalled at t={abort.time} but it read at t={last.time} "
        f"(timeout {sc.stall_timeout_s})"
    )
    buffered = sum(len(outs) for ev, outs in rec.reads if ev.seq > abort.seq)
    unfinished_then = len(uids) - sum(1 for u in uids if u in report.engine.end_event
                                      and report.engine.end_event[u].seq < abort.seq)
    capacity = sc.channel_capacity * len(uids)
    assert buffered + unfinished_then > capacity, (
        f"{who}: stalled with only {buffered} outputs buffered of {capacity}"
    )
