"""The checks of the process variant: what a test sees of a worker process from the front end.

No engine internals: the outputs against the fake model's pure next-token function, how each
request ended against what its client did, the per-uid bound on every read, the stall rule as the
reader's own clock can tell it, and, after each scenario, the front end empty at once and the
worker's statistics back to idle.
"""

from __future__ import annotations

from collections import Counter

from .invariants import check_front_ends, check_outputs, check_reads_bounded, first_dead_read
from .process_runner import CAPACITY, STALL_DELAY_S, STALL_S, ProcessReport, ProcessRun
from .runner import Record, runtime_errors
from .scenario import expected_output


def check_process_report(report: ProcessReport) -> None:
    for run in report.runs:
        check_process_run(report, run)
    assert report.healthy_at_end, (
        f"the worker process is not healthy after the scenarios (the runtime's errors: "
        f"{runtime_errors()})"
    )


def check_process_run(report: ProcessReport, run: ProcessRun) -> None:
    label = run.scenario.label
    for index, rec in enumerate(run.records):
        check_process_client(report, f"{label}, request #{index}", rec)
    assert run.front_idle is None, f"{label}: left in the front end: {run.front_idle}"
    registered = sum(log.n for log in run.tap.sessions.values())
    try:
        check_front_ends_delta(run, registered)
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from None
    assert run.stats_idle, (
        f"{label}: the worker's statistics did not come back to idle: {run.stats}"
    )


def check_front_ends_delta(run: ProcessRun, registered: int) -> None:
    counted = run.ends_after - run.ends_before
    assert counted == registered, (
        f"requests_total counted {counted} ends for the {registered} sequences of the scenario"
    )


def check_process_client(report: ProcessReport, who: str, rec: Record) -> None:
    req = rec.request
    n = len(req.choices)
    who = f"{who} (id {rec.request_id}, {req.client!r}, outcome {rec.outcome})"
    assert rec.outcome is not None, f"{who}: the client ended without an outcome"
    assert rec.request_id is not None and rec.log is not None, (
        f"{who}: refused at the door: {rec.error!r} (the runtime's errors: {runtime_errors()})"
    )
    log = rec.log
    check_reads_bounded(log, CAPACITY, who)
    finished = check_outputs(who, rec.request_id, req.prompt, req.choices,
                             [outs for _, outs in rec.reads], report.max_model_len,
                             vocab=report.vocab, eos=report.eos)
    if rec.outcome == "finished":
        if rec.finished_early is not None:
            after = sum(len(outs) for ev, outs in rec.reads if ev.seq > rec.finished_early.seq)
            assert after <= CAPACITY * n, (
                f"{who}: read {after} outputs after ending every choice, more than its channel holds"
            )
        else:
            assert finished == set(range(n)), (
                f"{who}: the stream ended with choices {sorted(set(range(n)) - finished)} unfinished"
            )
    elif rec.outcome == "RequestStalled":
        # The front end aborts once a uid has had CAPACITY outputs untaken for STALL_S: the reader
        # took nothing for at least that long before the error, and what was left in the channel
        # (CAPACITY outputs of the stalled uid, never more of any) reached it first.
        # The abort came before the first read that found the session gone (or the error).
        dead = first_dead_read(log)
        live_reads = log.reads if dead is None else log.reads[:dead]
        last = live_reads[-1].event if live_reads else log.entered
        gone = log.reads[dead].event if dead is not None else log.ended
        assert gone.time - last.time >= STALL_S, (
            f"{who}: stalled by t={gone.time - log.entered.time:.3f} but it read at "
            f"t={last.time - log.entered.time:.3f} (timeout {STALL_S}; times from its admission)"
        )
        left = Counter(out.uid for read in log.reads[len(live_reads):] for out in read.outputs)
        assert CAPACITY in left.values(), (
            f"{who}: stalled, but what it read afterwards ({dict(left)}) is not the {CAPACITY} "
            f"outputs of a uid out of credits"
        )
    elif rec.outcome == "left":
        assert len(rec.reads) == req.client.k, f"{who}: left after {len(rec.reads)} reads"
    elif rec.outcome == "cancelled":
        assert req.client.kind == "cancel", f"{who}: cancelled, but nobody cancelled it"
    else:
        raise AssertionError(f"{who}: unexpected outcome {rec.error!r} (the runtime's errors: "
                             f"{runtime_errors()})")
    # Liveness of the stall: a reader that sleeps far past the timeout while a choice has more
    # outputs to come than its credits is stalled, not waited for.
    if req.client.kind == "stall" and req.client.delay >= STALL_DELAY_S:
        longest = max(len(expected_output(req.prompt, c, report.max_model_len, report.vocab,
                                          report.eos).tokens) for c in req.choices)
        if longest > CAPACITY:
            assert rec.outcome == "RequestStalled", (
                f"{who}: slept {req.client.delay} s with a choice of {longest} tokens and "
                f"{CAPACITY} credits, yet was not stalled (timeout {STALL_S})"
            )
