"""Bugs this suite found in engine/runtime code that are not fixed yet.

While a flag is False the strategies steer around that bug, so ``make test`` stays green and the
property tests keep testing everything else, and a strict xfail test in ``test_known_bugs.py``
reproduces it. Once the fix lands that test passes, which a strict xfail reports as a failure:
then set the flag to True (the strategies stop steering around it) and drop the xfail marker.
"""

# FIXED (engine_actor.py: a session with no unfinished choice has no stall deadline).
# AsyncEngine._finish_choice (GenerationStream.finish, used by the HTTP layer when a stop string
# matches) ends the session's last unfinished choice without clearing ``paused_since``. The session
# stays registered until its reader is done, ``_apply_backpressure`` skips it (no unfinished
# choice), and ``_idle`` keeps a stall deadline for it; once that deadline has passed, the actor
# spins: ``move_on_at(past)`` returns at once, every time, and the event loop never idles.
# Steering: a client that ends choices itself (engine suite: Client("finish"); HTTP suite: stop
# strings) drains its stream promptly afterwards.
FINISH_CHOICE_SPIN_FIXED = True
