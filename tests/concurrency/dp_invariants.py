"""The checks of the data-parallel variant (:mod:`.dp_runner`): what must hold of every run,
whatever the requests, the clients, the routing, the interleaving and the instant a worker is
lost."""

from __future__ import annotations

from trio_infer.runtime.router import RouterStatistics

from .dp_runner import DPReport
from .invariants import check_outputs, check_reads_bounded
from .runner import runtime_errors

# How a client may end, whatever its worker did: its tokens (finished), or what it did itself.
OWN_OUTCOMES = ("finished", "left", "cancelled", "RequestStalled", "RequestFailed")


def check_dp_report(report: DPReport) -> None:
    for index, rec in enumerate(report.records):
        check_dp_client(report, index)
    check_dp_group(report)


def check_dp_client(report: DPReport, index: int) -> None:
    """Every request ends exactly once (one outcome; its tokens exact as far as they go, within
    the per-uid bound), and an error from the lost worker only for a request that was on it."""
    sc, rec = report.scenario, report.records[index]
    req = rec.request
    who = f"request #{index} ({req.client!r}, outcome {rec.outcome}, worker {report.routed.get(index)})"
    assert rec.outcome is not None, f"{who}: ended without an outcome"
    assert rec.log is not None and rec.request_id is not None, (
        f"{who}: refused at the door: {rec.error!r} (the runtime's errors: {runtime_errors()})")
    check_reads_bounded(rec.log, sc.channel_capacity, who)
    finished = check_outputs(who, rec.request_id, req.prompt, req.choices,
                             [outs for _, outs in rec.reads], report.max_model_len)
    if rec.outcome == "finished" and rec.finished_early is None:
        assert finished == set(range(len(req.choices))), f"{who}: finished with choices unfinished"
    if rec.outcome == "RequestFailed":
        assert len(req.prompt) >= report.max_model_len, f"{who}: failed: {rec.error!r}"
    if rec.outcome == "EngineUnavailable":
        assert report.lost is not None and sc.loss is not None, f"{who}: no worker was lost"
        assert report.routed.get(index) == sc.loss.worker, (
            f"{who}: failed by the loss of worker {sc.loss.worker}, but it was on another")
        # The front end knows of a loss when it reads the worker's EOF (as with a process): a
        # request admitted after that never goes to the lost worker.
        assert report.noticed is not None and rec.log.entered.seq < report.noticed.seq, (
            f"{who}: failed, but it was admitted after the front end knew of the loss")
    elif rec.outcome == "RequestTimeout":  # the strategies draw deadlines
        t0, timeout = rec.log.entered.time, req.timeout
        assert timeout is not None, f"{who}: timed out without a deadline"
        assert rec.error_event is not None and rec.error_event.time >= t0 + timeout - 1e-9, (
            f"{who}: RequestTimeout at t={rec.error_event.time} before its deadline "
            f"({timeout} s after t={t0})")
    else:
        assert rec.outcome in OWN_OUTCOMES, f"{who}: unexpected {rec.error!r}"


def check_dp_group(report: DPReport) -> None:
    """The group after the clients: nothing left of any request, its gauges back to 0, the lost
    worker restarted alone, and every worker serving exact tokens again."""
    assert report.idle_after_clients == RouterStatistics(), (
        f"left in the group once every client was done: {report.idle_after_clients}")
    assert report.sessions_gauge == 0, "sessions_active is not 0 once every client was done"
    assert all(report.healthy_after), f"workers not back after the restart delay: {report.healthy_after}"
    lost = report.scenario.loss.worker if report.lost is not None else None  # type: ignore[union-attr]
    assert report.starts == [2 if i == lost else 1 for i in range(report.scenario.workers)], (
        f"starts per worker {report.starts}, worker {lost} lost: only it restarts, once")
    for worker, got, expected in report.again:
        assert got == expected, f"after the loss, worker {worker} wrote {got}, expected {expected}"
    served = {worker for worker, _, _ in report.again}
    assert served == set(range(report.scenario.workers)), (
        f"the second round reached workers {sorted(served)} only")
    g = report.gauges_after
    for name in ("trio_infer_requests_running", "trio_infer_requests_waiting",
                 "trio_infer_sessions_active", "vllm:num_requests_running",
                 "vllm:num_requests_waiting"):
        assert g[name] == 0, f"{name} is {g[name]} once everything settled"
    for used, cached in report.pages_after:
        assert used == cached, f"a worker holds {used} pages, {cached} of them cached: a leak"
