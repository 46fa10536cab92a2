"""Hand-written scenarios that must reach each path the property test is meant to explore.

If a change to the engine or to the strategies makes a path unreachable (say preemption never
happens any more in pools this small), the property test would keep passing while testing less;
these fail instead. Each also passes through every invariant check.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from .invariants import check_all
from .runner import Report, run_scenario
from .scenario import Choice, Client, EngineShape, Request, Scenario, Shutdown

LONG = (Choice(max_tokens=12),)


def run(sc: Scenario) -> Report:
    report = run_scenario(sc)
    check_all(report)
    return report


def outcomes(report: Report) -> list[str | None]:
    return [rec.outcome for rec in report.records]


def test_tight_pool_preempts_a_paused_sequence_and_everyone_finishes() -> None:
    shape = EngineShape(page_size=2, num_pages=8, max_running=4, max_batched_tokens=8,
                        prefix_cache=False)
    reqs = [Request((i + 1,) * 4, LONG, client=Client("stall", delay=20.0)) if i == 0 else
            Request((i + 1,) * 4, LONG, arrival=1.0) for i in range(4)]
    report = run(Scenario(shape, tuple(reqs), channel_capacity=1, stall_timeout_s=100.0))
    st = report.engine.stats
    assert st.pauses and st.preemptions and st.preempted_paused
    assert outcomes(report) == ["finished"] * 4


def test_a_reader_that_never_reads_is_aborted_after_the_timeout() -> None:
    sc = Scenario(EngineShape(), (Request((1, 2, 3), LONG, client=Client("stall", delay=50.0)),),
                  channel_capacity=2, stall_timeout_s=5.0)
    report = run(sc)
    assert outcomes(report) == ["RequestStalled"]
    assert sum(len(outs) for _, outs in report.records[0].reads) == 2  # the buffered ones


def test_cancellation_reaches_sent_queued_prefill_and_in_flight_steps() -> None:
    # "sent": the front end has the request and the worker has not applied its Add yet.
    # "queued": the worker has it, waiting behind another request (max_running=1).
    shape = EngineShape(page_size=4, num_pages=16, max_running=1, max_batched_tokens=4)
    phases = set()
    for seed in range(3):
        for k in range(0, 12):  # a 20-token prompt, 4 tokens a step: 5 steps of prefill
            req = Request((2,) * 20, LONG, client=Client("cancel", k=k))
            report = run(Scenario(shape, (req,), sched_seed=seed))
            phases.add(report.records[0].cancel_phase)
            first = Request((1,) * 4, LONG)
            report = run(Scenario(shape, (first, replace(req, ticks=3)), sched_seed=seed))
            phases.add(report.records[1].cancel_phase)
    assert {"sent", "queued", "prefill, step in flight", "decode, step in flight"} <= phases, phases


def test_a_failing_step_fails_only_the_requests_it_carried() -> None:
    shape = EngineShape(page_size=4, num_pages=16, max_running=1, max_batched_tokens=8)
    reqs = (Request((1, 2), LONG), Request((3, 4), LONG, arrival=5.0))
    report = run(Scenario(shape, reqs, fail_steps=frozenset({3})))
    assert outcomes(report) == ["RequestFailed", "finished"]


@pytest.mark.parametrize("kind", ["drain", "cancel"])
def test_shutdown_in_the_middle_ends_every_request_once(kind: str) -> None:
    reqs = (Request((1, 2), LONG, client=Client("slow", delay=2.0)),
            Request((3, 4), LONG, arrival=10.0))
    report = run(Scenario(EngineShape(), reqs, channel_capacity=1,
                          shutdown=Shutdown(kind, at=5.0, grace=1.0)))
    assert outcomes(report) == ["EngineUnavailable", "EngineUnavailable"]
    assert report.records[1].request_id is None  # refused at the door


def test_shared_prefixes_hit_the_prefix_cache() -> None:
    base = tuple(range(1, 17))
    reqs = tuple(Request(base + (i + 20,), LONG, arrival=float(i)) for i in range(3))
    report = run(Scenario(EngineShape(page_size=4, num_pages=32), reqs))
    assert report.engine.scheduler.prefix_hits > 0
    assert outcomes(report) == ["finished"] * 3


def test_speculation_emits_several_tokens_in_one_output_within_credits() -> None:
    """A prompt whose fake continuation prompt lookup guesses two tokens of (found by search):
    one output carries three tokens, with one credit per choice and a slow reader."""
    prompt = (33, 55, 7, 35, 10, 26, 36, 4, 17, 56)
    shape = EngineShape(page_size=4, num_pages=32, max_running=2, max_batched_tokens=16,
                        speculative=True)
    reqs = (Request(prompt, LONG, client=Client("slow", delay=2.0)),
            Request(prompt, (Choice(max_tokens=12, speculative=False),)))
    report = run(Scenario(shape, reqs, channel_capacity=1))
    assert report.engine.stats.multi_token_outputs >= 1
    assert outcomes(report) == ["finished"] * 2
