"""The front end's engine: per-request sessions over a batching worker.

:class:`AsyncEngine` is what the server and library programs use. It admits requests, opens a
:class:`~trio_infer.runtime.session.Session` for each (``runtime/session.py``: its uids, channel,
credits, pause clock), and owns one task (:meth:`AsyncEngine.run`, in the app's nursery) that
keeps the worker through a :class:`~trio_infer.runtime.worker_link.WorkerLink` (spawn, handshake,
restarts) and, while it is up, runs the two loops: frames out (what the
:class:`~trio_infer.runtime.router.Router` queued) and frames in (to the sessions). Everything
else is synchronous bookkeeping on the event loop.

A request lives inside :meth:`AsyncEngine.generate`, an async context manager: entering opens the
session and queues its sequences for the worker; leaving, for whatever reason (finish, ``break``,
client disconnect, cancellation, an exception, shutdown), closes it: what is unfinished is aborted
and the session leaves the router, synchronously, so it runs even under cancellation. There is no
per-uid structure that outlives its request.

Flow control (see ``router.py``): a uid starts with ``channel_capacity`` credits and the worker
sends an output only against one, so the session's channel (capacity ``channel_capacity x n``)
always has room for what arrives: the receive loop never waits on a request, and a request holds
at most that many outputs whatever its client does. A session out of credits for
``stall_timeout_s`` is aborted with :class:`RequestStalled`.

Overload (docs/lifecycle.md, "Overload and deadlines"): a request that would take the waiting
queue past ``max_waiting`` sequences or ``max_waiting_tokens`` prompt tokens is refused at once
(:class:`EngineOverloaded`, 429); one the worker has not scheduled ``max_queue_time_s`` after
its arrival is closed with the same error (it never started its prefill); one whose deadline
(``timeout_s``) passes is closed with :class:`RequestTimeout`. A refusal carries the seconds to
retry after, from the measured drain rate (``Router.retry_after``). The clocks are one: the
receive loop waits for
the next frame inside a cancel scope whose deadline is the earliest of every session's stall,
queue-time and request deadline, so a request ends at its deadline whatever its own task is
doing (reading, writing to a slow client, or nothing), and its abort is queued at once.

Metrics are updated once per worker step here (token counter, inter-token latency = the gap
between steps, the gauges from the step's statistics), and once per request by the router, never
per token.
"""

from __future__ import annotations

import itertools
import logging
import math
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import AsyncIterator

import trio

from trio_infer.metrics import Metrics
from trio_infer.runtime.errors import (
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    RequestFailed,
    RequestStalled,
    RequestTimeout,
)
from trio_infer.runtime.router import Router, RouterStatistics
from trio_infer.runtime.session import GenerationStream
from trio_infer.runtime.watchdog import ProgressWatch
from trio_infer.runtime.transport import (
    WorkerProcess,
    open_worker_process,
    open_worker_socket,
)
from trio_infer.runtime.worker_link import (
    Connect,
    Connection,
    MessageStream,
    OnLoading,
    RestartPolicy,
    WorkerLink,
    WorkerStartError,
)
from trio_infer.settings import Settings, Wiring
from trio_infer.wire import EngineStatistics, Fatal, Hello, ProtocolError, SamplingParams, Step, Uid

__all__ = ["AsyncEngine", "GenerationStream", "WorkerStartError", "open_engine"]

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(
        self, settings: Settings, connect: Connect, metrics: Metrics | None = None, *,
        restart: bool = True, on_loading: OnLoading | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        policy = RestartPolicy(settings.worker_max_restarts, settings.worker_restart_window_s,
                               settings.worker_restart_delay_s) if restart else None
        self._link = WorkerLink(connect, policy, on_loading)
        self.healthy = False  # a worker is connected and ready
        self.draining = False
        self.info: Hello | None = None
        self.stats: EngineStatistics | None = None
        self.connection: Connection | None = None
        self._router = Router(self.metrics)
        self._ids = itertools.count(1)  # request k gets id id_offset + k * id_stride
        self._last_step: float | None = None
        self._prefix_seen = (0, 0)
        self._spec_seen = (0, 0)  # spec_proposed, spec_accepted already counted
        self.watch = ProgressWatch(settings.watchdog_stall_s, settings.watchdog_step_factor,
                                   settings.watchdog_restart_s)
        # The receive loop's wait, whose deadline moves earlier when a request brings one.
        self._wait: trio.CancelScope | None = None
        self.watchdog_restarts = 0
        self.metrics.watch_step_age(self._step_age)
        self._down_reason = "the batching worker stopped; retry shortly"

    @property
    def max_model_len(self) -> int:
        assert self.info is not None
        return self.info.max_model_len

    @property
    def num_sessions(self) -> int:
        return self._router.num_sessions

    def live_uids(self) -> list[Uid]:
        """Uids the front end still tracks (empty when nothing is in flight)."""
        return self._router.live_uids()

    def statistics(self) -> RouterStatistics:
        """The front end's per-request state, counted (sessions, live uids, waiting, paused)."""
        return self._router.statistics()

    # -- the request side ---------------------------------------------------------------------

    def check_admission(self, n: int, tokens: int = 0) -> None:
        """Raise what :meth:`generate` would raise for ``n`` new choices holding ``tokens`` prompt
        tokens in all, right now: 503 reasons first, then the queue's bounds (429). The token
        bound refuses only when something is queued already: a request alone always gets in
        (its size is the context's business, checked before)."""
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if not self.healthy:
            raise EngineUnavailable("the engine is not running (starting or restarting); retry shortly")
        if (problem := self.stall_problem()) is not None:
            raise EngineUnavailable(problem)
        if n < 1:
            raise ValueError("at least one choice is needed")
        router, settings = self._router, self.settings
        if router.num_waiting + n > settings.max_waiting:
            self._refuse("queue_full", f"the waiting queue holds {router.num_waiting} sequences "
                         f"(max_waiting {settings.max_waiting}); retry later", n)
        cap = settings.max_waiting_tokens
        if cap is not None and router.waiting_tokens and router.waiting_tokens + tokens > cap:
            self._refuse("queue_tokens", f"the waiting queue holds {router.waiting_tokens} prompt "
                         f"tokens (max_waiting_tokens {cap}); retry later", n)

    @property
    def stalled(self) -> bool:
        """The worker has pending work and no step for longer than the stall bound
        (``runtime/watchdog.py``): ``/health`` says so and no new request is sent to it."""
        return self.watch.stalled

    def stall_problem(self) -> str | None:
        """Why the worker counts as stuck (``/health``'s and ``/v1/status``'s reason), or None."""
        return self.watch.problem(trio.current_time())

    def _step_age(self) -> float | None:
        try:
            now = trio.current_time()
        except RuntimeError:  # read outside trio (a metrics render with no run): no age
            return None
        return self.watch.last_step_age(now)

    def watchdog_status(self) -> dict[str, float | int | bool | None]:
        """The watchdog's state for ``/v1/status``."""
        now, watch = trio.current_time(), self.watch
        age = watch.last_step_age(now)
        return {"stalled": watch.stalled,
                "last_step_age_s": None if age is None else round(age, 3),
                "waiting_for_step_s": round(watch.waited(now), 3),
                "stall_bound_s": None if watch.stall_s is None else round(watch.stall_bound, 3),
                "restart_bound_s": None if watch.restart_s is None else round(watch.restart_bound, 3),
                "stalls": watch.stalls, "restarts": self.watchdog_restarts}

    def _refuse(self, reason: str, message: str, n: int) -> None:
        self.metrics.requests_refused_total.labels(reason=reason).inc()
        raise EngineOverloaded(message, reason, self._router.retry_after(self._router.num_waiting + n))

    def generate(
        self, prompt_ids: list[int], params: list[SamplingParams], timeout_s: float | None = None,
    ) -> AbstractAsyncContextManager[GenerationStream]:
        """Run one request with ``len(params)`` independent choices over ``prompt_ids``."""
        return self.generate_batch([prompt_ids], params, timeout_s)

    @asynccontextmanager
    async def generate_batch(
        self, prompts: list[list[int]], params: list[SamplingParams],
        timeout_s: float | None = None,
    ) -> AsyncIterator[GenerationStream]:
        """Run one request over several prompts, each with ``len(params)`` choices: uid
        ``(request_id, j * len(params) + i)`` is choice i of prompt j, its own sequence in the
        engine. One session, one channel: leaving the block ends every one of them. With
        ``timeout_s`` (else ``request_timeout_s``) the request ends with :class:`RequestTimeout`
        that long after it entered, wherever it is."""
        n = len(params)
        self.check_admission(len(prompts) * n, sum(len(p) for p in prompts) * n)
        assert self.info is not None
        if timeout_s is None:
            timeout_s = self.settings.request_timeout_s
        request_id = self.info.id_offset + next(self._ids) * self.info.id_stride
        session = self._router.open(request_id, prompts, params, self.settings.channel_capacity,
                                    timeout_s)
        self.metrics.prompt_tokens_total.inc(sum(len(p) for p in prompts) * n)
        try:
            with session.outputs:
                yield GenerationStream(session)
        finally:
            session.close()

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_sessions_done(self) -> None:
        """Return once no request is live (for a graceful drain)."""
        await self._router.wait_closed()

    def abort_all(self, error: EngineError) -> None:
        self._router.close_all(error)

    # -- the task that talks to the worker ----------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the worker, serve it, restart it when it dies (``WorkerLink``): meanwhile the
        live requests fail and new ones get 503; after ``worker_max_restarts`` restarts in a row
        that did not stay up ``worker_restart_window_s`` it gives up (503 from then on). Only a
        worker's death is survived: a bug here propagates into the app's nursery."""
        try:
            await self._link.run(self._serve, self._worker_down, task_status=task_status)
        finally:
            self.healthy = False

    async def _serve(self, stream: MessageStream, hello: Hello) -> None:
        self.info = hello
        self.metrics.kv_pages_total.set(hello.num_pages)
        self.connection = stream.connection
        self.healthy = True
        log.info("batching worker ready: %s, context %d tokens, %d KV pages (%s), %s",
                 hello.name, hello.max_model_len, hello.num_pages, hello.kv_cache_dtype,
                 hello.kernels)
        if hello.kernels_problem:
            log.warning("slow path: %s", hello.kernels_problem)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_loop, stream.connection)
            await self._receive_loop(stream)
            # Gone: admit nothing more while the connection is torn down (with --data-parallel,
            # new requests go to the other workers from this instant, not after the teardown).
            self.healthy = False
            nursery.cancel_scope.cancel()

    def _worker_down(self) -> None:
        """The worker is gone: every live request ends with an error, and its uids with it."""
        self.healthy = False
        self.connection = None
        self._router.reset(EngineUnavailable(self._down_reason))
        self._down_reason = "the batching worker stopped; retry shortly"
        self.watch.reset()
        self.metrics.worker_stalled.set(0)
        self._last_step = None
        self._prefix_seen = (0, 0)
        self._spec_seen = (0, 0)
        m = self.metrics
        for gauge in (m.requests_running, m.requests_waiting, m.kv_pages_used, m.kv_pages_cached):
            gauge.set(0)

    async def _send_loop(self, connection: Connection) -> None:
        router = self._router
        while True:
            await router.has_data.wait()
            data = router.data_to_send()
            if data:
                # Whatever the worker is sent (a request, credits, an abort) may change whether
                # it owes a step, and may bring a deadline earlier than the receive loop's wait.
                self._note_pending()
                try:
                    await connection.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the worker is gone; the receive loop sees EOF

    async def _receive_loop(self, stream: MessageStream) -> None:
        while True:
            with trio.move_on_at(self._next_deadline()) as self._wait:
                messages = await stream.receive()
                if not messages:
                    return  # EOF: the worker is gone
                for message in messages:
                    if type(message) is Step:
                        self._step(message)
                    elif type(message) is Fatal:
                        log.error("the batching worker failed: %s", message.message)
                        return
                    else:
                        raise ProtocolError(f"{type(message).__name__} from a running worker")
                continue
            if not self._expire():
                return  # the worker is stuck past the restart bound: drop it

    def _note_pending(self) -> None:
        """Tell the watchdog whether the worker owes a step (a session not paused for credits),
        and bring the receive loop's wait to the earliest deadline."""
        router = self._router
        self.watch.pending(trio.current_time(), router.owes_step)
        if self._wait is not None:
            self._wait.deadline = min(self._wait.deadline, self._next_deadline())

    def _next_deadline(self) -> float:
        """The earliest of every session's deadlines: its stall (out of credits since), its
        queue time (nothing scheduled yet) and its own deadline. ``_expire`` compares each with
        the clock exactly as computed here."""
        router, settings = self._router, self.settings
        deadline = math.inf
        if (paused := router.oldest_paused()) is not None:
            deadline = paused.paused_since + settings.stall_timeout_s  # type: ignore[operator]
        if settings.max_queue_time_s is not None and (queued := router.oldest_queued()) is not None:
            deadline = min(deadline, queued.arrival + settings.max_queue_time_s)
        if (first := router.next_deadline()) is not None:
            deadline = min(deadline, first.deadline)  # type: ignore[type-var]
        return min(deadline, self.watch.next_deadline())

    def _expire(self) -> bool:
        """End every session whose deadline has passed: stalls, then queue times, then request
        deadlines (each with its own error; closing a session aborts it in the worker). Then the
        watchdog: False if the worker is to be dropped (no step past the restart bound)."""
        self._abort_stalled()
        router, now, limit = self._router, trio.current_time(), self.settings.max_queue_time_s
        if limit is not None:
            while (queued := router.oldest_queued()) is not None and queued.arrival + limit <= now:
                self.metrics.requests_refused_total.labels(reason="queue_time").inc()
                queued.close(EngineOverloaded(
                    f"the request waited {limit:g} s (max_queue_time_s) without being scheduled; "
                    "retry later", "queue_time", router.retry_after(router.num_waiting)),
                    reason="error")
        while (session := router.next_deadline()) is not None and session.deadline <= now:  # type: ignore[operator]
            self.metrics.request_timeouts_total.inc()
            session.close(RequestTimeout(session.timeout_s), reason="error")  # type: ignore[arg-type]
        return self._watchdog()

    def _watchdog(self) -> bool:
        """Check forward progress (``runtime/watchdog.py``); False: drop the worker."""
        self._note_pending()
        now, watch, was_stalled = trio.current_time(), self.watch, self.watch.stalled
        state = watch.check(now)
        if state == "stalled" and not was_stalled:
            self.metrics.worker_stalls_total.inc()
            self.metrics.worker_stalled.set(1)
            log.warning("watchdog: %s", watch.problem(now))
        elif state == "dead":
            self.watchdog_restarts += 1
            self.metrics.worker_watchdog_restarts_total.inc()
            self._down_reason = (f"the batching worker made no progress for "
                                 f"{watch.waited(now):.0f} s and is restarted; retry shortly")
            log.error("watchdog: no step for %.0f s with work pending: dropping the batching "
                      "worker (it is killed and restarted)", watch.waited(now))
            self._worker_down()  # every request ends now, not once the process is reaped
            return False
        return True
    def _step(self, step: Step) -> None:
        now = trio.current_time()
        if self.watch.stalled:
            log.warning("watchdog: the batching worker stepped again")
            self.metrics.worker_stalled.set(0)
        self.watch.stepped(now)
        outputs = step.outputs
        if outputs:
            m = self.metrics
            m.generation_tokens_total.inc(sum(len(out.token_ids) for out in outputs))
            if self._last_step is not None:
                m.inter_token_latency.observe(now - self._last_step)
            self._last_step = now
        self._router.deliver(outputs, step.failed, RequestFailed, step.admitted)
        self._update_gauges(step.stats)
        self._note_pending()

    def _abort_stalled(self) -> None:
        now, timeout = trio.current_time(), self.settings.stall_timeout_s
        while (session := self._router.oldest_paused()) is not None:
            assert session.paused_since is not None
            if session.paused_since + timeout > now:  # the deadline exactly as the loop computed it
                return
            session.close(RequestStalled(
                f"the client did not read its output for {timeout:g} s"))

    def _update_gauges(self, s: EngineStatistics) -> None:
        self.stats = s
        m = self.metrics
        m.requests_running.set(s.running)
        m.requests_waiting.set(s.waiting)
        m.kv_pages_used.set(s.pages_used)
        m.kv_pages_cached.set(s.pages_cached)
        m.prefix_cache_queries_total.inc(s.prefix_queries - self._prefix_seen[0])
        m.prefix_cache_hits_total.inc(s.prefix_hits - self._prefix_seen[1])
        self._prefix_seen = (s.prefix_queries, s.prefix_hits)
        if m.spec_proposed_total is not None and m.spec_accepted_total is not None:
            m.spec_proposed_total.inc(s.spec_proposed - self._spec_seen[0])
            m.spec_accepted_total.inc(s.spec_accepted - self._spec_seen[1])
            self._spec_seen = (s.spec_proposed, s.spec_accepted)
        if m.tokens_per_step is not None and s.sample_steps:
            m.tokens_per_step.set(s.sampled_tokens / s.sample_steps)


@asynccontextmanager
async def open_engine(
    settings: Settings, connect: Connect | None = None, metrics: Metrics | None = None, *,
    on_loading: OnLoading | None = None, wiring: Wiring = Wiring(),
    started: WorkerProcess | None = None,
) -> AsyncIterator[AsyncEngine]:
    """Start a batching worker for ``settings`` (a child process that loads the model), yield the
    engine once it is ready; on exit stop the worker and wait for it. ``on_loading`` hears the
    worker's progress reports while it loads (at every restart too), then None.

    With ``connect`` (an engine this program built, served in a task of this process over the
    same protocol: ``runtime/in_process.py: in_process(engine)``; tests, embedding), that is the
    worker instead, and it is not restarted. With
    ``wiring.worker_address`` (a front end of ``serve --api-workers``), it is the supervisor's
    shared worker, connected to (and reconnected to) on that socket. ``started``: a worker process
    already started for ``settings`` (``serve`` starts it before its own imports), which the first
    connection uses; a restart starts a new one. It is reaped like any other.

    ``async with open_engine(settings) as engine:`` then, per request,
    ``async with engine.generate(prompt_ids, [params]) as stream: async for outs in stream: ...``
    """
    if connect is not None:
        restart = False
    elif wiring.worker_address is not None:
        # A shared worker that a supervisor runs (and restarts): connect, and reconnect.
        address, timeout = wiring.worker_address, wiring.worker_connect_timeout_s
        connect = lambda: open_worker_socket(address, timeout)  # noqa: E731
        restart = True
    else:
        def connect_own() -> AbstractAsyncContextManager[Connection]:
            nonlocal started  # the worker already started, if any, is the first connection's
            first, started = started, None
            return open_worker_process(settings, started=first)

        connect = connect_own
        restart = True
    async_engine = AsyncEngine(settings, connect, metrics, restart=restart, on_loading=on_loading)
    async with trio.open_nursery() as nursery:
        await nursery.start(async_engine.run)
        try:
            yield async_engine
        finally:
            nursery.cancel_scope.cancel()
