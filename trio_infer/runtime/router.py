"""The front end's end of the protocol: uid -> session, and the messages for the worker.

Sans-IO, in the style of h11: calls and decoded messages in, a frame of bytes out; nothing here
reads a socket or awaits, so it is tested without processes (``tests/runtime/test_protocol.py``)
and runs the same over a pipe to a worker process and over the in-memory transport.

A uid is ``(request id, choice index)``; the router maps a request id to its
:class:`~trio_infer.runtime.session.Session`, which alone knows whether the choice is live. An
output or failure for a uid that is not live ended here while it was on its way, and is dropped.

**Credits bound every uid by construction.** A sequence starts with ``credits`` credits; the
worker emits an output only against a credit and pauses a sequence that has none left (its KV
cache stays); the front end returns a credit for every output its reader takes, batched into the
next frame. So the outputs of a uid that exist anywhere (in the worker's send buffer, in the pipe,
in the request's channel) never exceed its initial credits, whatever the reader does, and nothing
is ever dropped. A session out of credits for ``stall_timeout_s`` (its reader left them untaken
that long) is the front end's to abort: :meth:`Router.oldest_paused` says which and since when.

Per-request metrics are counted here, where requests start and end: requests by finish reason,
time to first token, end-to-end latency, active sessions, and the waiting count that admission
reads.
"""

from __future__ import annotations

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
    """The front end's per-request state, counted: all 0 when nothing is in flight (invariant 1)."""

    sessions: int  # open sessions
    live_uids: int  # their live choices
    waiting: int  # choices without a first output yet (what admission caps)
    paused: int  # sessions out of credits (their stall clocks run)


class Router:
    def __init__(self, metrics: Metrics, clock: Callable[[], float] = trio.current_time) -> None:
        self.metrics = metrics
        self._clock = clock
        self.num_waiting = 0  # choices without a first output yet
        self._sessions: dict[int, Session] = {}
        self._paused: dict[Session, None] = {}  # out of credits; oldest first
        self._outbox: list[ToWorker | msgspec.Raw] = []  # an Add is encoded when it is queued
        self._returned: dict[Uid, int] = {}
        self._changed = trio.Event()  # set when a session closes
        self.has_data = trio.Event()  # set when there is something to send

    # -- sessions -------------------------------------------------------------------------------

    def open(self, request_id: int, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
             credits: int) -> Session:
        """A session for ``len(prompts) * len(params)`` sequences (uid ``(request_id, j * n + i)``
        is choice i of prompt j), queued for the worker. Raises ValueError, before anything is
        queued, for what cannot go on the wire."""
        if credits < 1:
            raise ValueError("a sequence needs at least one credit")
        if request_id in self._sessions:
            raise ValueError(f"request id {request_id} is already live")
        n = len(params)
        adds = [encode_message(Add((request_id, j * n + i), prompt_ids, p, credits))
                for j, prompt_ids in enumerate(prompts) for i, p in enumerate(params)]
        session = Session(self, request_id, len(adds), credits, arrival=self._clock())
        self._sessions[request_id] = session
        self._outbox.extend(adds)
        self.num_waiting += len(adds)
        self.metrics.sessions_active.set(len(self._sessions))
        self.has_data.set()
        return session

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def live_uids(self) -> list[Uid]:
        return sorted(uid for s in self._sessions.values() for uid in s.live_uids)

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(len(self._sessions), sum(s.num_live for s in self._sessions.values()),
                                self.num_waiting, len(self._paused))

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

    # -- what sessions tell it ---------------------------------------------------------------------

    def started(self, session: Session, now: float) -> None:
        self.num_waiting -= session.num_live
        self.metrics.time_to_first_token.observe(now - session.arrival)

    def ended(self, session: Session, index: int, reason: str) -> None:
        """Choice ``index`` of ``session`` ended (``stop``, ``length``, ``abort`` or ``error``):
        credits not yet returned for it are moot."""
        self._returned.pop((session.request_id, index), None)
        self.metrics.requests_total.labels(finish_reason=reason).inc()
        if not session.started:
            self.num_waiting -= 1

    def paused(self, session: Session) -> None:
        self._paused[session] = None

    def resumed(self, session: Session) -> None:
        self._paused.pop(session, None)

    def credit(self, uid: Uid) -> None:
        self._returned[uid] = self._returned.get(uid, 0) + 1
        self.has_data.set()

    def abort(self, uid: Uid) -> None:
        self._outbox.append(Abort(uid))
        self.has_data.set()

    def closed(self, session: Session) -> None:
        if self._sessions.pop(session.request_id, None) is not None:
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
                error: type[EngineError]) -> None:
        """A step's outputs and failures: to the sessions whose choices are live (the others ended
        here while these were on their way). A failure ends its whole request with ``error``."""
        sessions, now = self._sessions, self._clock()
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
