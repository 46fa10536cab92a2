"""Bugs the concurrency suite found in the front end, each reproduced by one fixed scenario.

Both are fixed; these are their regression tests (docs/testing.md, "Bugs the suite found"). A
bug found and not fixed yet gets a test here marked ``xfail(strict=True)`` until its fix lands.
"""

from __future__ import annotations

from .invariants import check_all
from .runner import run_scenario
from .scenario import Choice, Client, EngineShape, Request, Scenario


def test_finishing_the_last_choice_of_a_paused_session_does_not_spin() -> None:
    """The bug: ending a paused session's last unfinished choice early (as a stop string does)
    left the session with a stall deadline although it had nothing left to pause; once that
    deadline had passed, the front end's loop woke at a past deadline every round and spun (a
    ``Livelock`` under the mock clock). A session with no unfinished choice has no deadline."""
    # A slow reader (4 s per chunk) lets its channel (capacity 1) fill, so the session is paused
    # at t=0; at t=4 it reads its second chunk and at once ends the choice (as a stop string
    # would), then takes another 4 s: past the stall deadline (t=5) it is still in the session.
    req = Request(prompt=(1, 2, 3), choices=(Choice(max_tokens=20),),
                  client=Client("finish", k=2, delay=4.0))
    check_all(run_scenario(Scenario(EngineShape(), (req,), channel_capacity=1,
                                    stall_timeout_s=5.0)))


def test_a_stall_deadline_that_does_not_round_trip_does_not_spin() -> None:
    """The bug: the front end woke at ``since + stall_timeout_s`` but aborted only if
    ``since <= now - stall_timeout_s``; in floats ``(since + T) - T`` can be less than
    ``since``, so at the deadline nothing was aborted and the next deadline was the same
    instant, already past: a spin. Both compare the same expression."""
    # The request's first output arrives at t=1.360999553995268 and is never taken (capacity 1):
    # the session pauses then, and its stall deadline is 31.360999553995267, where
    # 31.360999553995267 - 30 < 1.360999553995268. Fixed, it ends RequestStalled at that time;
    # unfixed, the front end spins there and SpinGuard fails the run as a Livelock.
    since = 1.360999553995268
    assert (since + 30.0) - 30.0 < since
    req = Request(prompt=(1, 2), choices=(Choice(max_tokens=5),), arrival=since,
                  client=Client("stall", delay=100.0))
    report = run_scenario(Scenario(EngineShape(), (req,), channel_capacity=1, stall_timeout_s=30.0))
    check_all(report)
    assert [rec.outcome for rec in report.records] == ["RequestStalled"]
