"""The same lifecycle through a real batching worker process (``open_engine(Settings(model=
"fake"))``), in real time: a few fixed scenarios on one worker, checked from the front end."""

from __future__ import annotations

from .process_invariants import check_process_report
from .process_runner import run_process_scenarios


def test_lifecycle_across_a_worker_process() -> None:
    report = run_process_scenarios(seed=0, count=4)
    check_process_report(report)
    assert len(report.runs) == 4
