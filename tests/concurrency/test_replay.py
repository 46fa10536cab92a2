"""A scenario is a complete description of its run: running it twice gives the same run, event
for event. That is what makes a shrunk counterexample (or a Scenario(...) pasted from one) replay."""

from __future__ import annotations

from hypothesis import given

from .profiles import suite_settings
from .runner import Report, run_scenario
from .scenario import Scenario
from .strategies import scenarios


def fingerprint(report: Report) -> tuple:
    e = report.engine
    return (
        e.stats.steps,
        e.stats.preemptions,
        e.stats.pauses,
        sorted((uid, ev.seq, ev.time) for uid, ev in e.end_event.items()),
        [
            (rec.outcome, rec.request_id, rec.cancel_phase,
             [(ev.seq, ev.time, [(o.uid, o.token_ids, o.finish_reason) for o in outs])
              for ev, outs in rec.reads])
            for rec in report.records
        ],
    )


@suite_settings(scale=0.05)
@given(scenario=scenarios(max_requests=12))
def test_a_scenario_replays_exactly(scenario: Scenario) -> None:
    assert fingerprint(run_scenario(scenario)) == fingerprint(run_scenario(scenario))
