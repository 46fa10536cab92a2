"""Background responses (``background: true`` on ``/v1/responses``): a response that runs in the
server's nursery after its request has returned, as OpenAI's do.

A :class:`BackgroundRun` is owned by a cancel scope like every request: its task reads the
response's stream (api/respond.py: ``open_stream``, so admission, deadlines and the engine
session are a streamed request's) and keeps every event it writes, in order, so that
``GET /v1/responses/{id}?stream=true&starting_after=N`` replays the events after sequence number
``N`` and then follows the live ones. ``POST /v1/responses/{id}/cancel`` cancels the scope:
leaving the stream closes the session, which aborts the sequence before the worker's next step.

The run ends exactly once, and its end is what the store keeps: ``completed``, ``incomplete`` or
``failed`` (the serializer's last event stores it, api/responses.py), or ``cancelled`` (here, with
the output said so far). The events of the last ``keep`` finished runs stay for a resumed stream;
a running one is never dropped (admission bounds how many run).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import aclosing
from typing import AsyncIterator, Callable

import trio

log = logging.getLogger(__name__)


class BackgroundRun:
    """One background response: its events (the index is the sequence number) and its end."""

    def __init__(self, response_id: str) -> None:
        self.id = response_id
        self.scope = trio.CancelScope()
        self.events: list[str] = []
        self.status = "queued"
        self.done = trio.Event()
        self._changed = trio.Event()

    def append(self, chunk: str) -> None:
        """A chunk of the stream: SSE events, each ending with a blank line."""
        self.events.extend(event + "\n\n" for event in chunk.split("\n\n") if event)
        self._wake()

    def finish(self, status: str) -> None:
        """The run is over: "ended" (its stream's last event), "cancelled" or "failed"."""
        self.status = status
        self.done.set()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number ``after``, then each new one until the run ends."""
        sent = after + 1
        while True:
            if sent < len(self.events):
                chunk, sent = "".join(self.events[sent:]), len(self.events)
                yield chunk
                continue
            if self.done.is_set():
                return
            await self._changed.wait()


class BackgroundRuns:
    """The background responses running, and the last ``keep`` finished ones."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._runs: OrderedDict[str, BackgroundRun] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    @property
    def running(self) -> int:
        return sum(not run.done.is_set() for run in self._runs.values())

    def start(self, nursery: trio.Nursery, response_id: str, content: AsyncIterator[str],
              on_start: Callable[[], None], on_stop: Callable[[str], None]) -> BackgroundRun:
        """Run the stream ``content`` in ``nursery``. ``on_start`` once its first events are in
        (the request was admitted and started); ``on_stop("cancelled")`` if it is cancelled
        before its stream ends (a cancel, the server's shutdown), ``on_stop("failed")`` if the
        stream raised (logged): what the store keeps then."""
        run = BackgroundRun(response_id)
        self._runs[response_id] = run
        nursery.start_soon(self._run, run, content, on_start, on_stop)
        return run

    async def _run(self, run: BackgroundRun, content: AsyncIterator[str],
                   on_start: Callable[[], None], on_stop: Callable[[str], None]) -> None:
        end = "cancelled"
        try:
            with run.scope:
                async with aclosing(content):  # type: ignore[type-var]
                    async for chunk in content:
                        if run.status == "queued":
                            run.status = "in_progress"
                            on_start()
                        run.append(chunk)
                end = "ended"  # the stream's last event said how, and the serializer stored it
        except Exception:  # the stream turns errors into events: this is a bug, not the client's
            log.exception("background response %s failed", run.id)
            end = "failed"
        finally:
            if end != "ended":
                on_stop(end)
            run.finish(end)
            self._finished[run.id] = None
            while len(self._finished) > self.keep:
                old, _ = self._finished.popitem(last=False)
                self._runs.pop(old, None)

    def forget(self, response_id: str) -> None:
        """Drop a finished run's events (its response was deleted)."""
        run = self._runs.get(response_id)
        if run is not None and run.done.is_set():
            del self._runs[response_id]
            self._finished.pop(response_id, None)
