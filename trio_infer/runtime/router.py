"""The front end's end of the protocol: uid -> session, and the messages for the worker.

Sans-IO, in the style of h11: calls and decoded messages in, a frame of bytes out; nothing here
reads a socket or awaits, so it is tested without processes (``tests/runtime/test_protocol.py``)
and runs the same over a pipe to a worker process and over the in-memory transport.

A uid is ``(request id, choice index)``; the router maps a request id to its
:class:`~trio_infer.runtime.session.Session`, which alone knows whether the choice is live. An
output or failure for a uid that is not live ended here while it was on its way, and is dropped.

**Credits bound every uid by construction.** A sequence starts with ``credits`` credits; the
worker emits an output only against a credit and pauses a sequence that has none left (its KV
cache stays); the front end returns a credit for every output its reader takes (a session gives
them back a quarter of its window at a time, and at once when the worker holds fewer than that),
batched into the next frame. So the outputs of a uid that exist anywhere (in the worker's send
buffer, in the pipe, in the request's channel) never exceed its initial credits, whatever the
reader does, and nothing is ever dropped. A session out of credits for ``stall_timeout_s`` (its
reader left them untaken
that long) is the front end's to abort: :meth:`Router.oldest_paused` says which and since when.

**The queue.** A sequence is *waiting* from its ``Add`` until the worker first schedules it
(``Step.admitted``) or it ends: the router counts the waiting sequences and their prompt tokens
(what admission caps), keeps the sessions none of whose sequences was scheduled yet in arrival
order (:meth:`Router.oldest_queued`: the queue-time limit's clock), the sessions with a deadline
(:meth:`Router.next_deadline`), and the times of recent admissions, from which
:meth:`Router.retry_after` computes how long a queue takes to drain.

Per-request metrics are counted here, where requests start and end: requests by finish reason,
time to first token, queue time, end-to-end latency, active sessions.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec
import trio

from trio_infer.metrics import Metrics
from trio_infer.runtime.errors import EngineError
from trio_infer.runtime.session import Session
from trio_infer.wire import (
    Abort,
    Add,
    Credit,
    Failed,
    RequestOutput,
    SamplingParams,
    ToWorker,
    Uid,
    encode,
    encode_message,
)


@dataclass(frozen=True)
class RouterStatistics:
    """The front end's per-request state, counted: all 0 (``RouterStatistics()``) when nothing is
    in flight (invariant 1)."""

    sessions: int = 0  # open sessions
    live_uids: int = 0  # their live choices
    waiting: int = 0  # choices the worker has not scheduled yet (what admission caps)
    waiting_tokens: int = 0  # their prompt tokens
    paused: int = 0  # sessions out of credits (their stall clocks run)
    queued: int = 0  # sessions none of whose choices was scheduled yet (queue-time clocks run)
    deadlines: int = 0  # sessions with a deadline


# Admissions counted for the drain rate: those of the last DRAIN_WINDOW_S seconds.
DRAIN_WINDOW_S = 30.0
# A Retry-After when nothing was scheduled while requests waited in the window.
IDLE_RETRY_AFTER_S = int(DRAIN_WINDOW_S)
MAX_RETRY_AFTER_S = 3600


class Router:
    def __init__(self, metrics: Metrics, clock: Callable[[], float] = trio.current_time) -> None:
        self.metrics = metrics
        self._clock = clock
        self.num_waiting = 0  # choices not scheduled yet
        self.waiting_tokens = 0  # their prompt tokens
        self._sessions: dict[int, Session] = {}
        self._paused: dict[Session, None] = {}  # out of credits; oldest first
        self._queued: dict[Session, None] = {}  # nothing scheduled yet; oldest first
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, request id)
        # The admissions of the drain window: (when, seconds the queue waited for it), where the
        # wait counts from the previous admission or from when the queue last became non-empty,
        # whichever is later: idle time is no drain.
        self._admissions: deque[tuple[float, float]] = deque()
        self._last_admission = -math.inf
        self._queue_since = 0.0  # when num_waiting last went from 0 to positive
        self._outbox: list[ToWorker | msgspec.Raw] = []  # an Add is encoded when it is queued
        self._returned: dict[Uid, int] = {}
        self._changed = trio.Event()  # set when a session closes
        self.has_data = trio.Event()  # set when there is something to send

    # -- sessions -------------------------------------------------------------------------------

    def open(self, request_id: int, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
             credits: int, timeout_s: float | None = None) -> Session:
        """A session for ``len(prompts) * len(params)`` sequences (uid ``(request_id, j * n + i)``
        is choice i of prompt j), queued for the worker, with a deadline ``timeout_s`` from now
        if given. Raises ValueError, before anything is queued, for what cannot go on the wire."""
        if credits < 1:
            raise ValueError("a sequence needs at least one credit")
        if request_id in self._sessions:
            raise ValueError(f"request id {request_id} is already live")
        n = len(params)
        adds = [encode_message(Add((request_id, j * n + i), prompt_ids, p, credits))
                for j, prompt_ids in enumerate(prompts) for i, p in enumerate(params)]
        tokens = [len(prompt_ids) for prompt_ids in prompts for _ in params]
        session = Session(self, request_id, tokens, credits, self._clock(), timeout_s)
        self._sessions[request_id] = session
        self._queued[session] = None
        if session.deadline is not None:
            heapq.heappush(self._deadlines, (session.deadline, request_id))
        self._outbox.extend(adds)
        if not self.num_waiting:
            self._queue_since = session.arrival
        self.num_waiting += len(adds)
        self.waiting_tokens += sum(tokens)
        self.metrics.sessions_active.set(len(self._sessions))
        self.has_data.set()
        return session

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def owes_step(self) -> bool:
        """Whether the worker owes this front end a step: a session with a sequence still live
        that is not out of credits. A paused session, or one whose sequences are done and whose
        client has not read them yet, leaves the worker nothing to do."""
        return any(s.num_live and s not in self._paused for s in self._sessions.values())

    def live_uids(self) -> list[Uid]:
        return sorted(uid for s in self._sessions.values() for uid in s.live_uids)

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(len(self._sessions), sum(s.num_live for s in self._sessions.values()),
                                self.num_waiting, self.waiting_tokens, len(self._paused),
                                len(self._queued), len(self._deadlines))

    async def wait_closed(self) -> None:
        """Return once no session is open."""
        while self._sessions:
            await self._changed.wait()

    def close_all(self, error: EngineError) -> None:
        for session in list(self._sessions.values()):
            session.close(error)

    def oldest_paused(self) -> Session | None:
        """The session that has been out of credits longest (its stall deadline is first)."""
        return next(iter(self._paused), None)

    def oldest_queued(self) -> Session | None:
        """The oldest session none of whose choices the worker has scheduled yet (with one
        ``max_queue_time_s`` for all, its queue-time deadline is first)."""
        return next(iter(self._queued), None)

    def next_deadline(self) -> Session | None:
        """The open session whose deadline is first."""
        return self._sessions[self._deadlines[0][1]] if self._deadlines else None

    def retry_after(self, ahead: int) -> int:
        """Seconds until ``ahead`` waiting sequences should have been scheduled, at the drain rate
        measured over the admissions of the last ``DRAIN_WINDOW_S`` seconds: their number over
        the time the queue was waiting for them (idle time is not counted, so a burst after a
        quiet minute is not told to wait for the quiet minute's rate). At least 1, at most
        ``MAX_RETRY_AFTER_S``; ``IDLE_RETRY_AFTER_S`` when nothing was scheduled in the window
        (the queue is not draining at all)."""
        now, window = self._clock(), self._admissions
        while window and window[0][0] <= now - DRAIN_WINDOW_S:
            window.popleft()
        if not window:
            return IDLE_RETRY_AFTER_S
        waited = sum(dt for _, dt in window)
        seconds = ahead * waited / len(window)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))

    def started(self, session: Session, now: float) -> None:
        self.metrics.time_to_first_token.observe(now - session.arrival)

    def left_queue(self, session: Session, tokens: int, admitted: bool, first: bool,
                   now: float | None) -> None:
        """A choice of ``session`` holding ``tokens`` prompt tokens stopped waiting: the worker
        scheduled it (``admitted``; ``first`` of its session: the session's queue time ends) or
        it ended unscheduled."""
        self.num_waiting -= 1
        self.waiting_tokens -= tokens
        if admitted:
            assert now is not None
            self._admissions.append((now, now - max(self._last_admission, self._queue_since)))
            self._last_admission = now
        if first:
            self.metrics.request_queue_time.observe(now - session.arrival)  # type: ignore[operator]
        if first or session.num_queued == 0:
            self._queued.pop(session, None)

    def ended(self, session: Session, index: int, reason: str) -> None:
        """Choice ``index`` of ``session`` ended (``stop``, ``length``, ``abort`` or ``error``):
        credits not yet returned for it are moot."""
        self._returned.pop((session.request_id, index), None)
        self.metrics.requests_total.labels(finish_reason=reason).inc()

    def paused(self, session: Session) -> None:
        self._paused[session] = None

    def resumed(self, session: Session) -> None:
        self._paused.pop(session, None)

    def credit(self, uid: Uid, n: int = 1) -> None:
        self._returned[uid] = self._returned.get(uid, 0) + n
        self.has_data.set()

    def abort(self, uid: Uid) -> None:
        self._outbox.append(Abort(uid))
        self.has_data.set()

    def closed(self, session: Session) -> None:
        self._queued.pop(session, None)
        if self._sessions.pop(session.request_id, None) is not None:
            if session.deadline is not None:  # O(sessions with a deadline): nothing stays behind
                self._deadlines.remove((session.deadline, session.request_id))
                heapq.heapify(self._deadlines)
            m = self.metrics
            m.sessions_active.set(len(self._sessions))
            m.e2e_request_latency.observe(self._clock() - session.arrival)
            self._changed.set()
            self._changed = trio.Event()

    # -- the wire -------------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """Everything queued since the last call, as one frame (b"" if nothing)."""
        self.has_data = trio.Event()
        if not self._outbox and not self._returned:
            return b""
        messages: list[ToWorker | msgspec.Raw] = self._outbox
        messages.extend(Credit(uid, n) for uid, n in self._returned.items())
        self._outbox, self._returned = [], {}
        return encode(messages)

    def deliver(self, outputs: Sequence[RequestOutput], failed: Sequence[Failed],
                error: type[EngineError], admitted: Sequence[Uid] = ()) -> None:
        """A step's admissions, outputs and failures: to the sessions whose choices are live (the
        others ended here while these were on their way). A failure ends its whole request with
        ``error``."""
        sessions, now = self._sessions, self._clock()
        for uid in admitted:
            session = sessions.get(uid[0])
            if session is not None:
                session.admit(uid[1], now)
        for out in outputs:
            session = sessions.get(out.uid[0])
            if session is not None and session.is_live(out.uid[1]):
                session.deliver(out, now)
        for f in failed:
            session = sessions.get(f.uid[0])
            if session is not None:
                session.fail(f.uid[1], error(f.message))

    def reset(self, error: EngineError) -> None:
        """The worker is gone: every session ends with ``error``; nothing queued is sent."""
        self.close_all(error)
        self._outbox.clear()
        self._returned.clear()
        self._deadlines.clear()
