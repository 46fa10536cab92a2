"""Each bug of known_bugs.py, reproduced by one fixed scenario (a strict xfail while unfixed;
a plain regression test once fixed)."""

from __future__ import annotations

from .invariants import check_all
from .runner import run_scenario
from .scenario import Choice, Client, EngineShape, Request, Scenario


def test_finishing_the_last_choice_of_a_paused_session_does_not_spin_the_actor() -> None:
    # A slow reader (4 s per chunk) lets its channel (capacity 1) fill, so the session is paused
    # at t=0; at t=4 it reads its second chunk and at once ends the choice (as a stop string
    # would), then takes another 4 s: past the stall deadline (t=5) it is still in the session.
    req = Request(prompt=(1, 2, 3), choices=(Choice(max_tokens=20),),
                  client=Client("finish", k=2, delay=4.0))
    check_all(run_scenario(Scenario(EngineShape(), (req,), channel_capacity=1,
                                    stall_timeout_s=5.0)))
