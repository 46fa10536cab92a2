"""Property: the same lifecycle invariants through the quart-trio app (in process, no sockets),
including quart-trio's own disconnect handling, for fewer and smaller scenarios."""

from __future__ import annotations

from hypothesis import event, given

from .http_invariants import check_http_all
from .http_runner import HttpReport, run_http_scenario
from .profiles import suite_settings
from .scenario import HttpScenario
from .strategies import http_scenarios


@suite_settings(scale=0.5)
@given(scenario=http_scenarios())
def test_http_lifecycle_invariants(scenario: HttpScenario) -> None:
    report = run_http_scenario(scenario)
    report_events(report)
    check_http_all(report)


def report_events(report: HttpReport) -> None:
    """Statistics for ``pytest --hypothesis-show-statistics``: which paths the examples hit."""
    st = report.engine.stats
    event(f"preempted: {'yes' if st.preemptions else 'no'}")
    event(f"paused a sequence: {'yes' if st.pauses else 'no'}")
    if report.drain_started is not None:
        event("drained")
    for rec in report.records:
        kind = "stream" if rec.request.stream else "json"
        event(f"outcome: {kind} {rec.outcome} {rec.status}")
        if b'"error"' in rec.body:
            code = rec.body.split(b'"code":"', 1)[-1].split(b'"', 1)[0].decode()
            event(f"error: {code}")
