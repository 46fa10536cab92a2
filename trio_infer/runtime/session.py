"""One request on the front end: its uids, its bounded channel, its credits and its pause clock.

A :class:`Session` is created when a request enters ``AsyncEngine.generate`` and closed when it
leaves, for whatever reason (finish, ``break``, client disconnect, cancellation, an exception,
shutdown, the worker's death). Everything the front end knows about a request's sequences is here,
and only here:

* which choices are still *live* (the keys of its credit table: a uid is live exactly while it has
  an entry; nothing else in the front end tracks it);
* how many outputs the worker may still send for each (its credits, see ``runtime/router.py``);
* the queue its reader takes outputs from (``outputs``, an :class:`OutputQueue` with room for every
  credit), so a delivery never waits;
* since when it has been out of credits (its reader stopped reading), for the stall timeout;
* which choices the worker has not scheduled yet (still queued: their prompt tokens count
  against ``max_waiting_tokens``), when it first scheduled one (the end of its queue time, for
  ``max_queue_time_s``), and its deadline (``timeout``), if any.

The session talks to the :class:`~trio_infer.runtime.router.Router` that made it through the
methods :class:`SessionOwner` names (queue an abort or a credit, say it paused or ended), stated
here so that the router imports the session and not the other way round; the reader talks to the
session through :class:`GenerationStream`. All methods are synchronous: closing runs even under
cancellation, and nothing waits.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import trio

from trio_infer.runtime.errors import EngineError
from trio_infer.wire import ProtocolError, RequestOutput, Uid


class SessionOwner(Protocol):
    """What a session tells the router that made it (``router.py: Router``)."""

    def started(self, session: Session, now: float) -> None: ...

    def left_queue(self, session: Session, tokens: int, admitted: bool, first: bool,
                   now: float | None) -> None: ...

    def ended(self, session: Session, index: int, reason: str) -> None: ...

    def paused(self, session: Session) -> None: ...

    def resumed(self, session: Session) -> None: ...

    def credit(self, uid: Uid, n: int = 1) -> None: ...

    def abort(self, uid: Uid) -> None: ...

    def closed(self, session: Session) -> None: ...


class Session:
    def __init__(self, router: SessionOwner, request_id: int, prompt_tokens: Sequence[int], credits: int,
                 arrival: float, timeout_s: float | None = None) -> None:
        """``prompt_tokens``: each choice's prompt length (a choice per entry). With
        ``timeout_s`` the request's deadline is ``arrival + timeout_s``."""
        num_choices = len(prompt_tokens)
        self.request_id = request_id
        self.uids: list[Uid] = [(request_id, i) for i in range(num_choices)]
        self.arrival = arrival
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else arrival + timeout_s
        self.started = False  # has produced its first output
        self.admitted_at: float | None = None  # when the worker first scheduled one of its choices
        self.scheduled = trio.Event()  # set at the first scheduling, or when the session ends
        self.error: EngineError | None = None  # what the reader gets after the last output
        self.paused_since: float | None = None  # a live choice has no credit left since then
        self._router = router
        self._credits: dict[int, int] = dict.fromkeys(range(num_choices), credits)
        # Credits the reader freed and the worker has not been given back yet: they go back a
        # quarter of the window at a time (one message for several outputs), and at once when
        # the worker holds fewer than that, so it never runs dry (pauses) on credits the reader
        # already freed: a choice owed credits always has ``_batch`` at least.
        self._owed: dict[int, int] = {}
        self._batch = max(1, credits // 4)
        self._queued: dict[int, int] = dict(enumerate(prompt_tokens))  # not yet scheduled
        self.outputs = OutputQueue()  # written here, read by the request (GenerationStream)

    # -- what it knows ------------------------------------------------------------------------

    def is_live(self, index: int) -> bool:
        return index in self._credits

    def credits(self, index: int) -> int:
        """What the worker may still send for choice ``index`` (0 once it ended)."""
        return self._credits.get(index, 0)

    @property
    def live_uids(self) -> list[Uid]:
        return [(self.request_id, i) for i in self._credits]

    @property
    def num_live(self) -> int:
        return len(self._credits)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of its choices the worker has not scheduled yet."""
        return sum(self._queued.values())

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    # -- the worker's side (called by the router) -----------------------------------------------

    def deliver(self, out: RequestOutput, now: float) -> None:
        """An output of a live choice arrived: spend its credit, hand it to the reader. The
        channel has a slot per credit, so this never blocks; an output beyond the credits is the
        worker's bug (:class:`ProtocolError`)."""
        index = out.uid[1]
        left = self._credits[index]
        if left <= 0:
            raise ProtocolError(f"output for {out.uid} without a credit")
        if not self.started:
            self._router.started(self, now)
            self.started = True
        if out.finish_reason is None:
            left -= 1
            if left < self._batch and index in self._owed:
                # Credits are held back only while the worker has plenty: never let it run dry
                # (pause) on credits the reader already freed.
                n = self._owed.pop(index)
                left += n
                self._router.credit(out.uid, n)
            self._credits[index] = left
            if left == 0 and self.paused_since is None:
                self.paused_since = now
                self._router.paused(self)
            # Last, once the books above are done: the reader may take it as soon as it is sent.
            self.outputs.send_nowait(out)
        else:
            self.outputs.send_nowait(out)
            self._end(index, out.finish_reason)
            self._resume_if_ready()

    def admit(self, index: int, now: float) -> None:
        """The worker scheduled choice ``index`` for the first time: it left the queue."""
        tokens = self._queued.pop(index, None)
        if tokens is not None:
            first = self.admitted_at is None
            if first:
                self.admitted_at = now
                self.scheduled.set()
            self._router.left_queue(self, tokens, admitted=True, first=first, now=now)

    def fail(self, index: int, error: EngineError) -> None:
        """The worker ended choice ``index`` with an error: the whole request ends with it."""
        if self.is_live(index):
            self.close(error, reason="error")

    # -- the reader's side -------------------------------------------------------------------

    def take(self, outputs: Sequence[RequestOutput]) -> None:
        """The reader took ``outputs``: the worker may send as many more (of the live choices),
        given back in batches (``_owed``)."""
        credits, owed, batch = self._credits, self._owed, self._batch
        for out in outputs:
            index = out.uid[1]
            if out.finish_reason is None and index in credits:
                n = owed.pop(index, 0) + 1
                if n < batch and credits[index] >= batch:
                    owed[index] = n
                    continue
                credits[index] += n
                self._router.credit(out.uid, n)
        self._resume_if_ready()

    def finish(self, index: int) -> None:
        """End choice ``index`` here, as a stop (a stop string matched in its text): its sequence
        stops costing compute. No-op if it already ended."""
        if self.is_live(index):
            self._end(index, "stop")
            self._router.abort((self.request_id, index))
            self._resume_if_ready()  # the choice that was out of credits may be this one

    def close(self, error: EngineError | None = None, reason: str = "abort") -> None:
        """End the request: abort what is unfinished (counted as ``reason``), close the channel,
        leave the router. Idempotent; ``error`` (the first one given) is what the reader gets
        after its outputs."""
        if error is not None and self.error is None:
            self.error = error
        for index in list(self._credits):  # never finished: they end here, counted once
            self._end(index, reason)
            self._router.abort((self.request_id, index))
        self.outputs.close()
        self.scheduled.set()
        self._resume_if_ready()
        self._router.closed(self)

    # -- internals --------------------------------------------------------------------------

    def _end(self, index: int, reason: str) -> None:
        del self._credits[index]
        self._owed.pop(index, None)
        tokens = self._queued.pop(index, None)
        if tokens is not None:  # it ends without ever being scheduled
            self._router.left_queue(self, tokens, admitted=False, first=False, now=None)
        self._router.ended(self, index, reason)
        if not self._credits:
            self.outputs.close()  # the reader sees the end after the last output

    def _resume_if_ready(self) -> None:
        if self.paused_since is not None and all(self._credits.values()):
            self.paused_since = None
            self._router.resumed(self)


class OutputQueue:
    """A session's outputs on their way to its reader: a trio memory channel's behaviour for
    one writer (the session, which never waits: a slot per credit is its bound, see
    ``router.py``) and one reader, plus :meth:`receive_batch`, which takes everything queued in
    one wait.

    Why not a memory channel: the reader of a stream wants all that is queued at each wake,
    and a channel gives that as ``receive()`` (two checkpoints when something is queued) then
    ``receive_nowait()`` until it raises ``WouldBlock``: at 256 streams x 20 ms steps the read,
    with the credits it gives back, was ~11% of the front end's CPU, ~8% with this queue
    (py-spy). Here a delivery appends to a list and wakes
    the parked reader, which takes the whole list: one wait, no exception per read.

    As a channel: :meth:`send_nowait` and :meth:`close` are the writer's (after ``close`` the
    reader gets what is queued, then ``trio.EndOfChannel``); the reader's side is
    :meth:`receive_nowait`, :meth:`receive_batch` and ``with queue:`` (leaving it closes the reader's side: a later ``send_nowait`` raises
    ``trio.BrokenResourceError``).
    """

    __slots__ = ("_items", "_ended", "_reader_gone", "_waiter")

    def __init__(self) -> None:
        self._items: list[RequestOutput] = []
        self._ended = False  # the writer closed it
        self._reader_gone = False
        self._waiter: trio.lowlevel.Task | None = None

    def __enter__(self) -> OutputQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader_gone = True
        self._items = []

    def send_nowait(self, out: RequestOutput) -> None:
        """Queue ``out`` and wake the reader."""
        if self._ended:
            raise trio.ClosedResourceError("the session's outputs already ended")
        if self._reader_gone:
            raise trio.BrokenResourceError("the reader left")
        self._items.append(out)
        self._wake()

    def close(self) -> None:
        """The writer's end: the reader gets what is queued, then ``trio.EndOfChannel``."""
        self._ended = True
        self._wake()

    def receive_nowait(self) -> RequestOutput:
        if self._items:
            return self._items.pop(0)
        if self._ended:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive_batch(self) -> list[RequestOutput]:
        """Everything queued, waiting for the first if nothing is (one checkpoint either way);
        ``trio.EndOfChannel`` once the writer closed it and all was taken."""
        if self._reader_gone:
            raise trio.ClosedResourceError("the reader's side is closed")
        if self._items or self._ended:
            await trio.lowlevel.checkpoint()
        else:
            self._waiter = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self._waiter = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        items = self._items
        if not items:
            raise trio.EndOfChannel  # woken only by a delivery or the end
        self._items = []
        return items

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter)


class GenerationStream:
    """What a request reads: lists of outputs, everything queued since the last read, so a
    reader that falls behind gets fewer, larger batches. ``out.uid == (request_id, index)``."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self.request_id = session.request_id

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        try:
            outputs = await self._session.outputs.receive_batch()
        except trio.EndOfChannel:
            if self._session.error is not None:
                raise self._session.error from None
            raise StopAsyncIteration from None
        self._session.take(outputs)
        return outputs

    def finish(self, index: int) -> None:
        """End choice ``index`` now, as a stop (a stop string matched in the text): its
        sequence stops costing compute. No-op if it already finished."""
        self._session.finish(index)

    async def admitted(self) -> None:
        """Return once the worker has scheduled one of the request's sequences (its prefill
        started), or raise the error the request ended with before that (a queue-time refusal,
        its deadline, a failure): what a streamed response waits for before its status."""
        session = self._session
        await session.scheduled.wait()
        if session.admitted_at is None and session.error is not None:
            raise session.error
