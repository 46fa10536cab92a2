"""The front end's engine: per-request sessions over a batching worker.

:class:`AsyncEngine` is what the server and library programs use. It owns one task
(:meth:`AsyncEngine.run`, in the app's nursery) that starts the worker (a child process, see
``transport.py``), reads its frames and writes the front end's, and restarts it if it dies.
Everything else is synchronous bookkeeping on the event loop.

A request lives inside :meth:`AsyncEngine.generate`, an async context manager: entering registers
a *session* (its uids, a bounded channel) and queues the sequences for the worker; leaving, for
whatever reason (finish, ``break``, client disconnect, cancellation, an exception, shutdown),
aborts what is unfinished and drops the session, synchronously, so it runs even under
cancellation. There is no per-uid structure that outlives its request.

Flow control (see ``protocol.py``): a uid starts with ``channel_capacity`` credits and the worker
sends an output only against one, so the session's channel (capacity ``channel_capacity x n``)
always has room for what arrives: the reader task never waits on a request, and a request holds
at most that many outputs whatever its client does. The reader returns a credit for every output
it takes. A uid out of credits is paused in the worker (its KV cache stays); if its reader does
not take anything for ``stall_timeout_s``, the request is aborted with :class:`RequestStalled`.

Metrics are updated once per worker step (token counter, inter-token latency = the gap between
steps), once per request (time to first token, queue time, end-to-end) and from the step's
statistics (gauges), never per token.
"""

from __future__ import annotations

import itertools
import logging
import math
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import trio

from trio_infer.engine.engine import Engine
from trio_infer.engine.params import SamplingParams
from trio_infer.metrics import Metrics
from trio_infer.runtime.errors import (
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    RequestFailed,
    RequestStalled,
)
from trio_infer.runtime.protocol import (
    ClientProtocol,
    Delivery,
    Hello,
    Loading,
    Output,
    ProtocolError,
    Stats,
    Uid,
)
from trio_infer.runtime.transport import (
    Connection,
    open_worker_process,
    open_worker_socket,
    open_worker_task,
)
from trio_infer.settings import Settings, Wiring

log = logging.getLogger(__name__)

Connect = Callable[[], AbstractAsyncContextManager[Connection]]
# Told of each progress report of a loading worker, then None once it is ready or gone.
OnLoading = Callable[[Loading | None], None]


class WorkerStartError(Exception):
    """The batching worker could not start (e.g. the model failed to load)."""


@dataclass(eq=False)
class _Session:
    request_id: int
    uids: list[Uid]
    send: trio.MemorySendChannel[Output]
    arrival: float
    unfinished: set[Uid] = field(default_factory=set)
    started: bool = False  # has produced its first output
    error: EngineError | None = None


class GenerationStream:
    """What a request reads: lists of outputs, everything queued since the last read, so a
    reader that falls behind gets fewer, larger batches. ``out.uid == (request_id, index)``."""

    def __init__(
        self, session: _Session, receive: trio.MemoryReceiveChannel[Output], owner: AsyncEngine
    ) -> None:
        self._session = session
        self._receive = receive
        self._owner = owner
        self.request_id = session.request_id

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> list[Output]:
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
        self._owner._taken(self._session, outputs)
        return outputs

    def finish(self, index: int) -> None:
        """End choice ``index`` now, as a stop (a stop string matched in the text): its
        sequence stops costing compute. No-op if it already finished."""
        self._owner._finish_choice(self._session, self._session.uids[index])


class AsyncEngine:
    def __init__(
        self, settings: Settings, connect: Connect, metrics: Metrics | None = None, *,
        restart: bool = True, on_loading: OnLoading | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._connect = connect
        self._restart = restart
        self._on_loading = on_loading or (lambda loading: None)
        self.healthy = False  # a worker is connected and ready
        self.draining = False
        self.info: Hello | None = None
        self.stats: Stats | None = None
        self.connection: Connection | None = None
        self._protocol = ClientProtocol()
        self._sessions: dict[int, _Session] = {}
        self._by_uid: dict[Uid, _Session] = {}
        self._paused: dict[_Session, float] = {}  # out of credits since; oldest first
        self._num_waiting = 0  # sequences without a first output yet
        self._ids = itertools.count(1)  # request k gets id id_offset + k * id_stride
        self._send_wakeup = trio.Event()
        self._sessions_changed = trio.Event()
        self._last_step: float | None = None
        self._prefix_seen = (0, 0)

    @property
    def max_model_len(self) -> int:
        assert self.info is not None
        return self.info.max_model_len

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def live_uids(self) -> list[Uid]:
        """Uids the front end still tracks (empty when nothing is in flight)."""
        return sorted(self._by_uid)

    # -- the request side ---------------------------------------------------------------------

    def check_admission(self, n: int) -> None:
        """Raise what :meth:`generate` would raise for ``n`` new choices right now."""
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if not self.healthy:
            raise EngineUnavailable("the engine is not running (starting or restarting); retry shortly")
        if n < 1:
            raise ValueError("at least one choice is needed")
        if self._num_waiting + n > self.settings.max_waiting:
            raise EngineOverloaded("the waiting queue is full; retry later")

    def generate(
        self, prompt_ids: list[int], params: list[SamplingParams]
    ) -> AbstractAsyncContextManager[GenerationStream]:
        """Run one request with ``len(params)`` independent choices over ``prompt_ids``."""
        return self.generate_batch([prompt_ids], params)

    @asynccontextmanager
    async def generate_batch(
        self, prompts: list[list[int]], params: list[SamplingParams]
    ) -> AsyncIterator[GenerationStream]:
        """Run one request over several prompts, each with ``len(params)`` choices: uid
        ``(request_id, j * len(params) + i)`` is choice i of prompt j, its own sequence in the
        engine. One session, one channel: leaving the block ends every one of them."""
        n = len(params)
        self.check_admission(len(prompts) * n)
        assert self.info is not None
        request_id = self.info.id_offset + next(self._ids) * self.info.id_stride
        credits = self.settings.channel_capacity
        send, receive = trio.open_memory_channel[Output](credits * len(prompts) * n)
        uids = [(request_id, i) for i in range(len(prompts) * n)]
        session = _Session(request_id, uids, send, arrival=trio.current_time(), unfinished=set(uids))
        try:
            for j, prompt_ids in enumerate(prompts):
                for i, p in enumerate(params):
                    uid = uids[j * n + i]
                    self._protocol.add(uid, prompt_ids, p, credits)  # may refuse (ValueError)
                    self._by_uid[uid] = session
        except BaseException:
            for uid in uids:
                if self._by_uid.pop(uid, None) is not None:
                    self._protocol.abort(uid)
            raise
        self._sessions[request_id] = session
        self._num_waiting += len(uids)
        self.metrics.sessions_active.set(len(self._sessions))
        self.metrics.prompt_tokens_total.inc(sum(len(p) for p in prompts) * n)
        self._send_wakeup.set()
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
            self._drop_uid(session, uid, reason)
            self._protocol.abort(uid)
        session.unfinished.clear()
        session.send.close()
        self._paused.pop(session, None)
        if self._sessions.pop(session.request_id, None) is not None:
            self.metrics.sessions_active.set(len(self._sessions))
            self.metrics.e2e_request_latency.observe(trio.current_time() - session.arrival)
            self._sessions_changed.set()
            self._sessions_changed = trio.Event()
        self._send_wakeup.set()

    def _drop_uid(self, session: _Session, uid: Uid, reason: str) -> None:
        self.metrics.requests_total.labels(finish_reason=reason).inc()
        del self._by_uid[uid]
        if not session.started:
            self._num_waiting -= 1

    def _finish_choice(self, session: _Session, uid: Uid) -> None:
        if uid not in session.unfinished:
            return
        self._drop_uid(session, uid, "stop")
        self._protocol.abort(uid)
        session.unfinished.discard(uid)
        if not session.unfinished:
            session.send.close()
        self._unpause_if_ready(session)  # the choice that was out of credits may be this one
        self._send_wakeup.set()

    def _unpause_if_ready(self, session: _Session) -> None:
        if session in self._paused and all(self._protocol.credits(u) for u in session.unfinished):
            del self._paused[session]

    def _taken(self, session: _Session, outputs: list[Output]) -> None:
        """The reader took ``outputs``: return their credits."""
        for out in outputs:
            if out.finish_reason is None:
                self._protocol.give_credit(out.uid)
        self._unpause_if_ready(session)
        self._send_wakeup.set()

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_sessions_done(self) -> None:
        """Return once no request is live (for a graceful drain)."""
        while self._sessions:
            await self._sessions_changed.wait()

    def abort_all(self, error: EngineError) -> None:
        for session in list(self._sessions.values()):
            self._end_session(session, reason="abort", error=error)

    # -- the task that talks to the worker ----------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the worker, serve it, restart it when it dies. Never lets an exception escape
        into the app's nursery (a dead task there would leave the server up but deaf): it fails
        the live requests, answers 503 meanwhile, and gives up after ``worker_max_restarts``
        restarts in a row that did not stay up ``worker_restart_window_s``."""
        started = False
        restarts = 0
        try:
            while True:
                up_since: float | None = None
                try:
                    async with self._connect() as connection:
                        await self._handshake(connection)
                        up_since = trio.current_time()
                        if not started:
                            started = True
                            task_status.started()
                        await self._serve(connection)
                        log.error("the batching worker exited; failing its requests")
                except WorkerStartError:
                    if not started:
                        raise
                    log.error("the batching worker failed to start again")
                except Exception:
                    if not started:
                        raise
                    log.exception("the connection to the batching worker failed")
                finally:
                    self._on_loading(None)
                    self.healthy = False
                    self.connection = None
                    self._forget_worker(EngineUnavailable("the batching worker stopped; retry shortly"))
                if not self._restart:
                    return
                if up_since is not None and trio.current_time() - up_since >= self.settings.worker_restart_window_s:
                    restarts = 0
                restarts += 1
                if restarts > self.settings.worker_max_restarts:
                    log.error("the batching worker died %d times in a row; giving up (503 from now on)",
                              restarts)
                    return
                log.warning("restarting the batching worker (%d of at most %d)", restarts,
                            self.settings.worker_max_restarts)
                await trio.sleep(self.settings.worker_restart_delay_s)
        finally:
            self.healthy = False

    async def _handshake(self, connection: Connection) -> None:
        while True:
            data = await connection.receive_some()
            if not data:
                raise WorkerStartError("the batching worker exited before it was ready")
            delivery = self._protocol.receive_data(data)
            if delivery.fatal is not None:
                raise WorkerStartError(delivery.fatal.message)
            if delivery.loading is not None:
                self._on_loading(delivery.loading)
            if delivery.hello is not None:
                self._on_loading(None)
                self.info = delivery.hello
                self.metrics.kv_pages_total.set(delivery.hello.num_pages)
                self.connection = connection
                self.healthy = True
                hello = delivery.hello
                log.info("batching worker ready: %s, context %d tokens, %d KV pages (%s), %s",
                         hello.name, hello.max_model_len, hello.num_pages, hello.kv_cache_dtype,
                         hello.kernels)
                if hello.kernels_problem:
                    log.warning("slow path: %s", hello.kernels_problem)
                return

    async def _serve(self, connection: Connection) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_loop, connection)
            await self._receive_loop(connection)
            nursery.cancel_scope.cancel()

    async def _send_loop(self, connection: Connection) -> None:
        while True:
            await self._send_wakeup.wait()
            self._send_wakeup = trio.Event()
            data = self._protocol.data_to_send()
            if data:
                try:
                    await connection.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the worker is gone; the receive loop sees EOF

    async def _receive_loop(self, connection: Connection) -> None:
        while True:
            deadline = math.inf
            if self._paused:
                deadline = next(iter(self._paused.values())) + self.settings.stall_timeout_s
            with trio.move_on_at(deadline):
                try:
                    data = await connection.receive_some()
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    return
                try:
                    delivery = self._protocol.receive_data(data)
                except ProtocolError:
                    log.exception("the batching worker broke the protocol; restarting it")
                    return
                self._handle(delivery)
                continue
            self._abort_stalled()

    def _handle(self, delivery: Delivery) -> None:
        now = trio.current_time()
        m = self.metrics
        outputs = delivery.outputs
        if outputs:
            m.generation_tokens_total.inc(sum(len(out.token_ids) for out in outputs))
            if self._last_step is not None:
                m.inter_token_latency.observe(now - self._last_step)
            self._last_step = now
        by_uid, protocol = self._by_uid, self._protocol
        for out in outputs:
            session = by_uid[out.uid]
            if not session.started:
                session.started = True
                self._num_waiting -= len(session.unfinished)
                m.time_to_first_token.observe(now - session.arrival)
            session.send.send_nowait(out)  # room guaranteed: one slot per credit
            if out.finish_reason is not None:
                m.requests_total.labels(finish_reason=out.finish_reason).inc()
                del by_uid[out.uid]
                session.unfinished.discard(out.uid)
                if not session.unfinished:
                    session.send.close()  # the reader sees the end after the last output
                self._unpause_if_ready(session)
            elif session not in self._paused and not protocol.credits(out.uid):
                self._paused[session] = now
        for failed in delivery.failed:
            session = by_uid.get(failed.uid)
            if session is not None:
                session.unfinished.discard(failed.uid)
                self._drop_uid(session, failed.uid, "error")
                self._end_session(session, reason="error", error=RequestFailed(failed.message))
        if delivery.stats is not None:
            self._update_gauges(delivery.stats)

    def _abort_stalled(self) -> None:
        now, timeout = trio.current_time(), self.settings.stall_timeout_s
        while self._paused:
            session, since = next(iter(self._paused.items()))
            if since + timeout > now:  # the deadline exactly as the receive loop computed it
                return
            self._end_session(session, reason="abort", error=RequestStalled(
                f"the client did not read its output for {self.settings.stall_timeout_s:g} s"))

    def _forget_worker(self, error: EngineError) -> None:
        """The worker is gone: every live request ends with ``error``, and its uids with it."""
        self.abort_all(error)
        self._protocol.reset()
        self._last_step = None
        self._prefix_seen = (0, 0)
        m = self.metrics
        for gauge in (m.requests_running, m.requests_waiting, m.kv_pages_used, m.kv_pages_cached):
            gauge.set(0)

    def _update_gauges(self, s: Stats) -> None:
        self.stats = s
        m = self.metrics
        m.requests_running.set(s.running)
        m.requests_waiting.set(s.waiting)
        m.kv_pages_used.set(s.pages_used)
        m.kv_pages_cached.set(s.pages_cached)
        m.prefix_cache_queries_total.inc(s.prefix_queries - self._prefix_seen[0])
        m.prefix_cache_hits_total.inc(s.prefix_hits - self._prefix_seen[1])
        self._prefix_seen = (s.prefix_queries, s.prefix_hits)


def is_instant(engine: Engine) -> bool:
    """Models whose forward is instant run inline in the worker task, without a thread hop."""
    return getattr(engine.model, "instant", False)


@asynccontextmanager
async def open_engine(
    settings: Settings, engine: Engine | None = None, metrics: Metrics | None = None, *,
    on_loading: OnLoading | None = None, wiring: Wiring = Wiring(),
) -> AsyncIterator[AsyncEngine]:
    """Start a batching worker for ``settings`` (a child process that loads the model), yield the
    engine once it is ready; on exit stop the worker and wait for it. ``on_loading`` hears the
    worker's progress reports while it loads (at every restart too), then None.

    With ``engine`` (an :class:`~trio_infer.engine.engine.Engine` this program built), the worker
    is a task of this process over the same protocol instead (tests, embedding). With
    ``wiring.worker_address`` (a front end of ``serve --api-workers``), it is the supervisor's
    shared worker, connected to (and reconnected to) on that socket.

    ``async with open_engine(settings) as engine:`` then, per request,
    ``async with engine.generate(prompt_ids, [params]) as stream: async for outs in stream: ...``
    """
    if engine is None and wiring.worker_address is not None:
        # A shared worker that a supervisor runs (and restarts): connect, and reconnect.
        address, timeout = wiring.worker_address, wiring.worker_connect_timeout_s
        connect: Connect = lambda: open_worker_socket(address, timeout)  # noqa: E731
        restart = True
    elif engine is None:
        connect = lambda: open_worker_process(settings)  # noqa: E731
        restart = True
    else:
        in_thread = not is_instant(engine)
        connect = lambda: open_worker_task(engine, in_thread=in_thread)  # noqa: E731
        restart = False
    async_engine = AsyncEngine(settings, connect, metrics, restart=restart, on_loading=on_loading)
    async with trio.open_nursery() as nursery:
        await nursery.start(async_engine.run)
        try:
            yield async_engine
        finally:
            nursery.cancel_scope.cancel()
