"""The engine actor and the per-request sessions that talk to it.

One trio task (:meth:`AsyncEngine.run`) owns the :class:`~trio_infer.engine.engine.Engine`: the
scheduler, the KV cache, the batch. Each step it decides the batch on the event loop, runs the
forward pass in a worker thread (torch releases the GIL, so HTTP stays responsive), then hands
each request its outputs with ``send_nowait`` on that request's bounded memory channel.

A request lives inside :meth:`AsyncEngine.generate`, an async context manager: entering registers
a *session* (an id, a bounded channel, its sequences in the engine); leaving, for whatever reason
(finish, ``break``, client disconnect, cancellation, an exception, shutdown), aborts what is
unfinished and drops the session, synchronously, so it runs even under cancellation. There is no
global map that outlives a request and no task besides the actor.

Backpressure: before each step the actor pauses every sequence whose channel is full (the engine
keeps its KV pages but skips it) and resumes it once the reader has made room. Since a step gives
a sequence at most one output, a channel with room before the step always takes the output: the
actor never awaits a reader and never drops a token. A session paused for longer than
``stall_timeout_s`` is aborted with :class:`RequestStalled`; what it holds is bounded by the
channel capacity whatever the client does.
"""

from __future__ import annotations

import itertools
import logging
import math
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import trio

from trio_infer.engine.engine import Engine, RequestOutput
from trio_infer.engine.params import SamplingParams
from trio_infer.metrics import Metrics
from trio_infer.models.base import ModelInfo
from trio_infer.settings import Settings

log = logging.getLogger(__name__)


class EngineError(Exception):
    """Base of the errors a request can end with instead of a finish."""


class EngineUnavailable(EngineError):
    """The engine has died or is shutting down: retry elsewhere or later (503)."""


class EngineOverloaded(EngineError):
    """The waiting queue is at its cap (503 with Retry-After)."""


class RequestFailed(EngineError):
    """The engine step that carried this request raised (500)."""


class RequestStalled(EngineError):
    """The reader did not take output for ``stall_timeout_s``; the request was aborted."""


@dataclass(eq=False)
class _Session:
    request_id: int
    uids: list[tuple[int, int]]  # engine ids of its choices: (request_id, index)
    send: trio.MemorySendChannel[RequestOutput]
    arrival: float
    unfinished: set[tuple[int, int]] = field(default_factory=set)
    paused_since: float | None = None
    first_scheduled: float | None = None
    last_token: float | None = None
    error: EngineError | None = None

    def has_room(self) -> bool:
        stats = self.send.statistics()
        return stats.current_buffer_used + len(self.unfinished) <= stats.max_buffer_size


class GenerationStream:
    """What a request reads: lists of :class:`RequestOutput`, everything queued since the last
    read, so a writer that falls behind coalesces instead of queueing writes.
    ``out.uid == (request_id, choice_index)``."""

    def __init__(
        self, session: _Session, receive: trio.MemoryReceiveChannel[RequestOutput], owner: AsyncEngine
    ) -> None:
        self._session = session
        self._receive = receive
        self._owner = owner
        self.request_id = session.request_id

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        try:
            outputs = [await self._receive.receive()]
        except trio.EndOfChannel:
            if self._session.error is not None:
                raise self._session.error from None
            raise StopAsyncIteration from None
        while True:
            try:
                outputs.append(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        if self._session.paused_since is not None:
            self._owner._wake()  # the reader made room: let the actor resume the sequence
        return outputs

    def finish(self, index: int) -> None:
        """End choice ``index`` now, as a stop (a stop string matched in the text): its
        sequence stops costing compute. No-op if it already finished."""
        self._owner._finish_choice(self._session, (self.request_id, index))


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        metrics: Metrics | None = None,
        *,
        execute_in_thread: bool = True,
    ) -> None:
        # execute_in_thread=False runs each step inline: only for instant models (the fake one),
        # where it keeps tests exact under a mock clock.
        self.engine = engine
        self.execute_in_thread = execute_in_thread
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.healthy = True
        self.draining = False
        self._sessions: dict[int, _Session] = {}
        self._by_uid: dict[tuple[int, int], _Session] = {}
        self._ids = itertools.count(1)
        self._wakeup = trio.Event()
        self._sessions_changed = trio.Event()
        self._prefix_seen = (0, 0)  # scheduler counters already exported
        self.metrics.kv_pages_total.set(engine.pool.num_pages)

    @property
    def info(self) -> ModelInfo:
        return self.engine.model.info

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    # -- the request side ---------------------------------------------------------------------

    @asynccontextmanager
    async def generate(
        self, prompt_ids: list[int], params: list[SamplingParams]
    ) -> AsyncIterator[GenerationStream]:
        """Run one request with ``len(params)`` independent choices over ``prompt_ids``."""
        if not self.healthy:
            raise EngineUnavailable("the engine has stopped; the server cannot generate")
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if not params:
            raise ValueError("at least one choice is needed")
        if self.engine.num_waiting + len(params) > self.settings.max_waiting:
            raise EngineOverloaded("the waiting queue is full; retry later")
        request_id = next(self._ids)
        capacity = self.settings.channel_capacity * len(params)
        send, receive = trio.open_memory_channel[RequestOutput](capacity)
        uids = [(request_id, i) for i in range(len(params))]
        session = _Session(request_id, uids, send, arrival=trio.current_time())
        added: list[tuple[int, int]] = []
        try:
            for uid, p in zip(uids, params):
                self.engine.add_request(uid, prompt_ids, p)
                added.append(uid)
        except BaseException:
            for uid in added:
                self.engine.abort(uid)
            raise
        session.unfinished = set(uids)
        self._sessions[request_id] = session
        self._by_uid.update((uid, session) for uid in uids)
        self.metrics.sessions_active.set(len(self._sessions))
        self.metrics.prompt_tokens_total.inc(len(prompt_ids) * len(params))
        self._wake()
        try:
            with receive:
                yield GenerationStream(session, receive, self)
        finally:
            self._end_session(session, reason="abort")

    def _end_session(self, session: _Session, reason: str, error: EngineError | None = None) -> None:
        """Abort what is unfinished and drop every trace of the session. Synchronous, idempotent."""
        if error is not None and session.error is None:
            session.error = error
        for uid in session.unfinished:  # never finished: they end here, counted once
            self.engine.abort(uid)
            self.metrics.requests_total.labels(finish_reason=reason).inc()
            self._by_uid.pop(uid, None)
        session.unfinished.clear()
        session.send.close()
        if self._sessions.pop(session.request_id, None) is not None:
            self.metrics.sessions_active.set(len(self._sessions))
            self.metrics.e2e_request_latency.observe(trio.current_time() - session.arrival)
            self._sessions_changed.set()
            self._sessions_changed = trio.Event()
        self._update_gauges()
        self._wake()  # freed pages may admit waiting requests

    def _finish_choice(self, session: _Session, uid: tuple[int, int]) -> None:
        if uid not in session.unfinished:
            return
        self.engine.abort(uid)
        self.metrics.requests_total.labels(finish_reason="stop").inc()
        session.unfinished.discard(uid)
        self._by_uid.pop(uid, None)
        if not session.unfinished:
            session.paused_since = None
            session.send.close()
        self._update_gauges()
        self._wake()

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_sessions_done(self) -> None:
        """Return once no request is live (for a graceful drain)."""
        while self._sessions:
            await self._sessions_changed.wait()

    def abort_all(self, error: EngineError) -> None:
        for session in list(self._sessions.values()):
            self._end_session(session, reason="abort", error=error)

    # -- the actor ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The actor loop. Never lets an exception escape into the app's nursery: if it dies, it
        marks the engine unhealthy and fails every session, so the server answers 503 instead of
        staying up deaf."""
        task_status.started()
        try:
            while True:
                await self._step()
        except BaseException as exc:
            self.healthy = False
            self.abort_all(EngineUnavailable("the engine stopped"))
            if isinstance(exc, Exception):
                log.exception("the engine actor crashed; the server now answers 503")
                return
            raise

    async def _step(self) -> None:
        self._apply_backpressure()
        plan = self.engine.schedule()
        self._update_gauges()
        if plan is None:
            await self._idle()
            return
        now = trio.current_time()
        for it in plan.schedule.items:
            session = self._by_uid.get(it.seq.uid)
            if session is not None and session.first_scheduled is None:
                session.first_scheduled = now
                self.metrics.request_queue_time.observe(now - session.arrival)
        try:
            if self.execute_in_thread:
                result = await trio.to_thread.run_sync(self.engine.execute, plan)
            else:
                await trio.lowlevel.checkpoint()  # let requests run between steps
                result = self.engine.execute(plan)
        except Exception as exc:
            log.exception("an engine step failed; failing the requests it carried")
            error = RequestFailed(f"the engine failed while generating: {exc}")
            for uid in self.engine.fail(plan):
                session = self._by_uid.get(uid)
                if session is not None:
                    self._end_session(session, reason="error", error=error)
            return
        self._dispatch(self.engine.commit(plan, result))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = trio.current_time()
        m = self.metrics
        m.generation_tokens_total.inc(sum(len(out.token_ids) for out in outputs))  # once a step
        for out in outputs:
            session = self._by_uid.get(out.uid)
            if session is None:
                continue  # its session ended while the step ran
            if session.last_token is None:
                m.time_to_first_token.observe(now - session.arrival)
            else:
                m.inter_token_latency.observe(now - session.last_token)
            session.last_token = now
            try:
                session.send.send_nowait(out)
            except trio.WouldBlock:  # cannot happen: room was checked before the step
                self._end_session(session, "error", RequestFailed("output channel overflow"))
                continue
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._end_session(session, reason="abort")  # the reader is gone
                continue
            if out.finish_reason is not None:
                m.requests_total.labels(finish_reason=out.finish_reason).inc()
                session.unfinished.discard(out.uid)
                self._by_uid.pop(out.uid, None)
                if not session.unfinished:
                    session.send.close()  # the reader sees the end after the last output

    def _apply_backpressure(self) -> None:
        now = trio.current_time()
        for session in list(self._sessions.values()):
            if not session.unfinished:
                session.paused_since = None  # nothing left to pause: no stall deadline either
                continue
            room = session.has_room()
            if room:
                session.paused_since = None
            elif session.paused_since is None:
                session.paused_since = now
            elif now - session.paused_since >= self.settings.stall_timeout_s:
                self._end_session(
                    session,
                    reason="abort",
                    error=RequestStalled(
                        f"the client did not read its output for {self.settings.stall_timeout_s:g} s"
                    ),
                )
                continue
            for uid in session.unfinished:
                self.engine.set_ready(uid, room)

    async def _idle(self) -> None:
        """Nothing runnable: sleep until something changes or the next stall deadline."""
        deadlines = [
            s.paused_since + self.settings.stall_timeout_s
            for s in self._sessions.values()
            if s.paused_since is not None
        ]
        with trio.move_on_at(min(deadlines, default=math.inf)):
            await self._wakeup.wait()
        self._wakeup = trio.Event()

    def _wake(self) -> None:
        self._wakeup.set()

    def _update_gauges(self) -> None:
        m, e = self.metrics, self.engine
        m.requests_running.set(e.num_running)
        m.requests_waiting.set(e.num_waiting)
        m.kv_pages_used.set(e.pool.num_used)
        m.kv_pages_cached.set(e.num_cached_pages)
        queries, hits = e.scheduler.prefix_queries, e.scheduler.prefix_hits
        m.prefix_cache_queries_total.inc(queries - self._prefix_seen[0])
        m.prefix_cache_hits_total.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)


def is_instant(engine: Engine) -> bool:
    """Models whose forward is instant run inline in the actor, without a thread hop."""
    return getattr(engine.model, "instant", False)


@asynccontextmanager
async def open_engine(
    settings: Settings, engine: Engine | None = None, metrics: Metrics | None = None
) -> AsyncIterator[AsyncEngine]:
    """Load the model (in a thread), start the actor in a nursery of its own, yield the engine;
    on exit cancel the actor and wait for it.

    ``async with open_engine(settings) as engine:`` then, per request,
    ``async with engine.generate(prompt_ids, [params]) as stream: async for outs in stream: ...``
    """
    if engine is None:
        from trio_infer.runtime.loading import build_engine

        engine, _ = await trio.to_thread.run_sync(build_engine, settings)
    async_engine = AsyncEngine(
        engine, settings, metrics, execute_in_thread=not is_instant(engine)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(async_engine.run)
        try:
            yield async_engine
        finally:
            nursery.cancel_scope.cancel()
