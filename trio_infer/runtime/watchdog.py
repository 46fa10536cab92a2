"""Forward progress of a batching worker, watched from the front end (sans IO: fed the clock).

A worker can be alive, hold its socket and make no progress (stopped by a signal, blocked in a
collective whose peer died, spinning in a kernel). Its process does not exit, so the restart
path never fires, and a load balancer that asks ``/health`` would keep sending it traffic. What
the front end can see is the worker's steps: every step, and every idle turn that has news,
sends a :class:`~trio_infer.wire.Step` frame. The watch is told when one arrives
(:meth:`ProgressWatch.stepped`) and whether work is pending (:meth:`ProgressWatch.pending`:
a session that is not paused for credits: then the worker has something to run), and says
whether the worker is making progress.

The bounds adapt to the measured step time, so that a slow worker (a long prefill chunk, a busy
machine, a big model) is never declared stuck: a worker is **stalled** once pending work has
seen no step for ``stall_bound = max(stall_s, factor x the slowest of the recent steps)``, and
**dead** once it has seen none for ``max(restart_s, 2 x stall_bound)``. The clock starts at the
later of the last step and the moment work became pending (a worker that was idle owes nothing
for the time before it had work). Step times are only measured between two steps while work was
pending (an idle gap is not a slow step).

Stalled: ``/health`` answers 503 with :meth:`problem`, the data-parallel router sends the worker
nothing new, and the stall is counted once. Dead: the front end drops the worker, which is
killed and restarted through the restart path; every request it held ends with an error. A step
that arrives while stalled ends the stall (the worker was only slow, or was continued).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class ProgressWatch:
    stall_s: float | None = 10.0  # the stall bound's floor; None: no watchdog
    factor: float = 20.0  # the stall bound in slowest recent steps
    restart_s: float | None = 60.0  # the second bound's floor; None: never restart
    window: int = 32  # recent steps measured
    stalls: int = 0  # stalls seen (each counted once, when it starts)
    _recent: deque[float] = field(default_factory=deque)
    _last_step: float | None = None
    _pending_since: float | None = None  # since when work is pending, None while none is
    _stalled: bool = False

    def stepped(self, now: float) -> None:
        """A step (or an idle turn) arrived from the worker at ``now``."""
        if self._pending_since is not None and self._last_step is not None:
            start = max(self._last_step, self._pending_since)
            self._recent.append(now - start)
            if len(self._recent) > self.window:
                self._recent.popleft()
        self._last_step = now
        self._stalled = False

    def pending(self, now: float, pending: bool) -> None:
        """Whether work is pending, as of ``now`` (called whenever it may have changed)."""
        if not pending or self.stall_s is None:
            self._pending_since = None
            self._stalled = False
        elif self._pending_since is None:
            self._pending_since = now

    def reset(self) -> None:
        """A new worker: nothing measured, nothing pending (the count of stalls stays)."""
        self._recent.clear()
        self._last_step = None
        self._pending_since = None
        self._stalled = False

    @property
    def stall_bound(self) -> float:
        if self.stall_s is None:
            return math.inf
        slowest = max(self._recent, default=0.0)
        return max(self.stall_s, self.factor * slowest)

    @property
    def restart_bound(self) -> float:
        if self.restart_s is None or self.stall_s is None:
            return math.inf
        return max(self.restart_s, 2 * self.stall_bound)

    def waited(self, now: float) -> float:
        """Seconds pending work has waited for a step (0 when none is pending)."""
        if self._pending_since is None:
            return 0.0
        start = self._pending_since
        if self._last_step is not None:
            start = max(start, self._last_step)
        return max(0.0, now - start)

    def last_step_age(self, now: float) -> float | None:
        """Seconds since the worker's last step (None before its first)."""
        return None if self._last_step is None else now - self._last_step

    def check(self, now: float) -> str:
        """``"ok"``, ``"stalled"`` or ``"dead"`` as of ``now``; counts a stall when one starts."""
        waited = self.waited(now)
        if waited >= self.restart_bound:
            return "dead"
        if waited >= self.stall_bound:
            if not self._stalled:
                self._stalled = True
                self.stalls += 1
            return "stalled"
        return "ok"

    @property
    def stalled(self) -> bool:
        """Whether the last :meth:`check` found a stall that no step has ended since."""
        return self._stalled

    def next_deadline(self) -> float:
        """When :meth:`check` may next change its answer (inf while nothing is pending)."""
        if self._pending_since is None:
            return math.inf
        start = self._pending_since
        if self._last_step is not None:
            start = max(start, self._last_step)
        if not self._stalled:
            return start + self.stall_bound
        return start + self.restart_bound

    def problem(self, now: float) -> str | None:
        """What ``/health`` and ``/v1/status`` say while stalled, else None."""
        if not self._stalled:
            return None
        return (f"no progress for {self.waited(now):.0f} s: the batching worker has not "
                f"finished a step while requests wait (stall bound {self.stall_bound:.0f} s; "
                f"it is restarted at {self.restart_bound:.0f} s)")
