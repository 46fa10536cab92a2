"""Bugs this suite found in engine/runtime code that are not fixed yet.

While a flag is False the strategies steer around that bug, so ``make test`` stays green and the
property tests keep testing everything else, and a strict xfail test in ``test_known_bugs.py``
reproduces it. Once the fix lands that test passes, which a strict xfail reports as a failure:
then set the flag to True (the strategies stop steering around it) and drop the xfail marker.
"""

# FIXED: finishing the last live choice of a paused session (GenerationStream.finish, used by the
# HTTP layer when a stop string matches) must clear its pause, or the front end keeps a stall
# deadline for a session that waits for nothing and, once it has passed, spins on it. Today
# ``Session.finish`` (runtime/session.py) resumes the session when every live choice (none left)
# has credits, which takes it out of ``Router.oldest_paused``.
# Steering: a client that ends choices itself (engine suite: Client("finish"); HTTP suite: stop
# strings) drains its stream promptly afterwards.
FINISH_CHOICE_SPIN_FIXED = True

# FIXED (runtime/client.py: ``AsyncEngine._abort_stalled`` compares ``paused_since +
# stall_timeout_s`` with now, the same expression the receive loop's deadline is). The old bug:
# the receive loop woke at ``since + stall_timeout_s``; ``_abort_stalled`` then aborted only if
# ``since <= now - stall_timeout_s``. In floats ``(since + T) - T`` can be less than ``since``
# (since=1.360999553995268, T=30), so at the deadline nothing is aborted, the next deadline is the
# same instant, already past, and the loop spins without waiting. Under a MockClock the clock
# never moves again (a hang, which SpinGuard turns into a Livelock failure); on a real clock it is
# a spin of a few microseconds, until the clock has moved past the rounding. Found while writing
# the suite for the worker boundary, not by the property: its times are sums of halves and whole
# seconds, which are exact. Steering: none needed (scenario times are exact binary fractions).
# Reproduced by test_a_stall_deadline_that_does_not_round_trip_does_not_spin.
STALL_DEADLINE_ROUNDING_FIXED = True
