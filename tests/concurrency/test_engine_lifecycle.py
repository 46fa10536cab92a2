"""Property: whatever the requests, clients, pool, faults and interleaving, every lifecycle
invariant holds at the end of the run (front-end sessions, protocol, worker and engine over the
in-memory transport; no HTTP)."""

from __future__ import annotations

from hypothesis import event, given

from .invariants import check_all
from .profiles import suite_settings
from .runner import Report, run_scenario
from .scenario import Scenario
from .strategies import scenarios


def report_events(report: Report) -> None:
    """Statistics for ``pytest --hypothesis-show-statistics``: which paths the examples hit."""
    st = report.engine.stats
    event(f"preempted: {'yes' if st.preemptions else 'no'}")
    event(f"preempted a paused sequence: {'yes' if st.preempted_paused else 'no'}")
    event(f"paused a sequence: {'yes' if st.pauses else 'no'}")
    event(f"most steps a sequence was in after the front end ended it: {st.steps_after_end}")
    event(f"speculative: {'multi-token outputs' if st.multi_token_outputs else 'yes' if report.scenario.engine.speculative else 'no'}")
    if report.scenario.engine.speculative and report.scenario.engine.draft:
        event("speculative with a draft model")
    if st.failed_steps:
        event("a step raised")
    if report.scenario.shutdown is not None:
        event(f"shutdown: {report.scenario.shutdown.kind}")
    if report.scenario.hold is not None:
        event(f"the worker held {report.scenario.hold.for_s:g} s"
              + (", stalled" if report.front.watch.stalls else ""))
    if report.scenario.max_queue_time_s is not None:
        event("a queue-time limit")
    if len({r.priority for r in report.scenario.requests}) > 1:
        event("mixed priorities")
    for rec in report.records:
        event(f"outcome: {rec.outcome}")
        reason = getattr(rec.error, "reason", None)
        if reason is not None:
            event(f"refused: {reason}")
        if rec.cancel_phase is not None:
            event(f"cancelled while: {rec.cancel_phase}")


@suite_settings()
@given(scenario=scenarios())
def test_lifecycle_invariants(scenario: Scenario) -> None:
    report = run_scenario(scenario)
    report_events(report)
    check_all(report)
