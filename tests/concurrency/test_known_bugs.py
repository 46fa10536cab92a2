"""Each bug of known_bugs.py, reproduced by one fixed scenario (strict xfail until it is fixed)."""

from __future__ import annotations

import pytest

from . import known_bugs
from .invariants import check_all
from .runner import run_scenario
from .scenario import Choice, Client, EngineShape, Request, Scenario


@pytest.mark.xfail(
    not known_bugs.FINISH_CHOICE_SPIN_FIXED,
    strict=True,
    raises=AssertionError,
    reason="engine_actor.py AsyncEngine._finish_choice leaves paused_since set: the actor spins "
    "in _idle once the stall deadline has passed (see known_bugs.py)",
)
def test_finishing_the_last_choice_of_a_paused_session_does_not_spin_the_actor() -> None:
    # A slow reader (4 s per chunk) lets its channel (capacity 1) fill, so the session is paused
    # at t=0; at t=4 it reads its second chunk and at once ends the choice (as a stop string
    # would), then takes another 4 s: past the stall deadline (t=5) it is still in the session.
    req = Request(prompt=(1, 2, 3), choices=(Choice(max_tokens=20),),
                  client=Client("finish", k=2, delay=4.0))
    check_all(run_scenario(Scenario(EngineShape(), (req,), channel_capacity=1,
                                    stall_timeout_s=5.0)))
