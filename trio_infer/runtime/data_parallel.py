"""``serve --data-parallel N``: N batching workers behind one front end, routed by prefix.

Each worker is a whole :class:`~trio_infer.runtime.client.AsyncEngine` (its own worker process,
engine, KV cache, prefix cache, :class:`~trio_infer.runtime.worker_link.WorkerLink` and
:class:`~trio_infer.runtime.router.Router` of sessions). :class:`DataParallelEngine` owns N of
them and answers what the API layer asks an engine (``check_admission``, ``generate``,
``generate_batch``, ``healthy``, ``draining``, ``info``, the drain calls), so nothing above it
knows there are several. A request is one session on one worker, so everything that holds per
request holds unchanged: per-uid credits and the channel bound, the stall timeout, release on
every exit path.

**Routing.** :mod:`trio_infer.runtime.affinity` picks the worker: by default the one that was
sent the prompt's longest known prefix of full pages (prefix affinity), else the least loaded;
``--dp-routing round_robin`` is the benchmark's baseline. Only healthy workers are candidates, and
not one the watchdog finds stalled (``runtime/watchdog.py``).

**Failure.** A worker's death is its :class:`AsyncEngine`'s business, as with one worker: its
own live requests end with :class:`~trio_infer.runtime.errors.EngineUnavailable`, it restarts
alone under its own restart policy, and meanwhile new requests go to the others. The group is
healthy while at least one worker is; with none, requests get 503 as with one worker down.
The affinity table forgets a restarted worker (its prefix cache is empty).

**Admission.** The queue bounds (``max_waiting``, ``max_waiting_tokens``) and the queue-time
limit are each worker's, as with one worker: a request is refused (429, with that worker's
Retry-After) when even the least loaded serving worker would refuse it; the worker it is routed
to checks its own bounds again when the request enters.

**Resources.** Each worker gets its share of the threads (``torch_threads``, or its automatic
value, split as evenly as possible, at least one each); ``kv_cache_mb`` is per worker. The
gauges the server exports are the group's sums (``Metrics.shares``); so is the page count in
:attr:`DataParallelEngine.info`.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import AsyncIterator, Sequence

import msgspec
import trio

from trio_infer.metrics import Metrics
from trio_infer.runtime.affinity import PrefixAffinity, RoundRobin, RoutingStatistics
from trio_infer.runtime.client import AsyncEngine
from trio_infer.runtime.errors import EngineError, EngineUnavailable
from trio_infer.runtime.router import RouterStatistics
from trio_infer.runtime.session import GenerationStream
from trio_infer.runtime.transport import open_worker_process
from trio_infer.runtime.worker_link import Connect, OnLoading
from trio_infer.settings import Settings, thread_shares
from trio_infer.wire import Hello, SamplingParams, Uid

__all__ = ["DataParallelEngine", "open_data_parallel", "worker_settings"]


class DataParallelEngine:
    def __init__(self, settings: Settings, workers: Sequence[AsyncEngine], metrics: Metrics) -> None:
        if not workers:
            raise ValueError("at least one worker is needed")
        self.settings = settings
        self.metrics = metrics
        self.workers = tuple(workers)  # read them (statistics, health); route through this
        self.draining = False
        config = settings.engine_config()
        self._policy: PrefixAffinity | RoundRobin
        if settings.dp_routing == "affinity":
            # The table's bound becomes the workers' KV pages once they are known (_route).
            self._policy = PrefixAffinity(config.page_size, capacity=1, slack=config.max_running)
        else:
            self._policy = RoundRobin()
        self._seen: list[Hello | None] = [None] * len(workers)  # each worker's hello, last route

    # -- what the API layer reads ---------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """At least one worker serves."""
        return any(w.healthy for w in self.workers)

    def stall_problem(self) -> str | None:
        """Why the group counts as stuck: every serving worker is stalled (one stalled worker
        only loses new requests to the others)."""
        serving = [w for w in self.workers if w.healthy]
        problems = [w.stall_problem() for w in serving]
        if serving and all(problems):
            return f"every batching worker is stalled: {problems[0]}"
        return None

    def watchdog_status(self) -> list[dict]:
        return [w.watchdog_status() for w in self.workers]

    @property
    def info(self) -> Hello | None:
        """A serving worker's hello (they serve the same model), with the group's KV pages."""
        hellos = [w.info for w in self.workers if w.info is not None]
        if not hellos:
            return None
        first = next((w.info for w in self.workers if w.healthy and w.info is not None), hellos[0])
        return msgspec.structs.replace(first, num_pages=sum(h.num_pages for h in hellos))

    @property
    def max_model_len(self) -> int:
        info = self.info
        assert info is not None
        return info.max_model_len

    @property
    def num_sessions(self) -> int:
        return sum(w.num_sessions for w in self.workers)

    def live_uids(self) -> list[Uid]:
        """Uids the workers' front ends still track (empty when nothing is in flight). Request ids
        are per worker: the same uid may appear once per worker."""
        return sorted(uid for w in self.workers for uid in w.live_uids())

    def statistics(self) -> RouterStatistics:
        """The group's per-request state, summed over the workers."""
        parts = [w.statistics() for w in self.workers]
        return RouterStatistics(**{f.name: sum(getattr(p, f.name) for p in parts)
                                   for f in dataclasses.fields(RouterStatistics)})

    def routing_statistics(self) -> RoutingStatistics:
        return self._policy.statistics()

    # -- the request side ---------------------------------------------------------------------

    def check_admission(self, n: int, tokens: int = 0) -> None:
        """Raise what :meth:`generate` would raise for ``n`` new choices holding ``tokens`` prompt
        tokens: 503 while no worker serves; otherwise the least loaded serving worker's own
        check (its queue bounds, 429 with its Retry-After). The worker a request is routed to
        checks again when it enters: each worker's queue is bounded, not only the group's."""
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        serving = [w for w in self.workers if w.healthy and not w.draining and not w.stalled]
        if not serving:
            if problem := self.stall_problem():
                raise EngineUnavailable(problem)
            raise EngineUnavailable("no batching worker is running (starting or restarting); "
                                    "retry shortly")
        min(serving, key=lambda w: w.statistics().waiting).check_admission(n, tokens)

    def generate(
        self, prompt_ids: list[int], params: list[SamplingParams], timeout_s: float | None = None,
    ) -> AbstractAsyncContextManager[GenerationStream]:
        """Run one request with ``len(params)`` choices over ``prompt_ids`` on one worker."""
        return self.generate_batch([prompt_ids], params, timeout_s)

    @asynccontextmanager
    async def generate_batch(
        self, prompts: list[list[int]], params: list[SamplingParams],
        timeout_s: float | None = None,
    ) -> AsyncIterator[GenerationStream]:
        """Run one request over several prompts on one worker (picked by the first prompt): one
        session there, exactly as :meth:`AsyncEngine.generate_batch` (which admits it against
        that worker's queue and applies the deadline)."""
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        worker = self.workers[self._route(prompts[0])]
        async with worker.generate_batch(prompts, params, timeout_s) as stream:
            yield stream

    def _route(self, prompt: list[int]) -> int:
        workers = self.workers
        for i, w in enumerate(workers):
            if w.info is not self._seen[i]:  # (re)started since the last route: its cache is new
                if self._seen[i] is not None:
                    self._policy.forget(i)
                self._seen[i] = w.info
                self._policy.resize(sum(h.num_pages for h in self._seen if h is not None))
        loads = [w.statistics().live_uids if w.healthy and not w.draining and not w.stalled
                 else None for w in workers]
        return self._policy.pick(prompt, loads)

    # -- shutdown -------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        self.draining = True
        for w in self.workers:
            w.begin_drain()

    async def wait_sessions_done(self) -> None:
        """Return once no request is live on any worker."""
        for w in self.workers:
            await w.wait_sessions_done()

    def abort_all(self, error: EngineError) -> None:
        for w in self.workers:
            w.abort_all(error)


def worker_settings(settings: Settings) -> list[Settings]:
    """Each data-parallel worker's settings: the group's, with its share of the threads."""
    n = settings.data_parallel
    return [settings.model_copy(update={"torch_threads": t, "data_parallel": 1})
            for t in thread_shares(settings.worker_threads(), n)]


def _process(settings: Settings) -> Connect:
    """A worker process's ``Connect`` (a new process at every start, as with one worker)."""
    return lambda: open_worker_process(settings)


@asynccontextmanager
async def open_data_parallel(
    settings: Settings, metrics: Metrics | None = None, *, on_loading: OnLoading | None = None,
    connects: Sequence[Connect] | None = None, restart: bool = True,
) -> AsyncIterator[DataParallelEngine]:
    """Start ``settings.data_parallel`` batching worker processes (each with its share of the
    threads) at once, yield the group once every one has said hello; on exit stop them all.

    ``connects`` replaces the worker processes (tests: in-process workers, one ``Connect`` per
    worker; their number is the group's size). A worker that cannot start the first time fails
    the whole start, as with one worker."""
    metrics = metrics or Metrics()
    if connects is None:
        connects = [_process(s) for s in worker_settings(settings)]
    views = metrics.shares(len(connects))
    workers = [AsyncEngine(settings, connect, view, restart=restart, on_loading=on_loading)
               for connect, view in zip(connects, views)]
    group = DataParallelEngine(settings, workers, metrics)
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as starting:
            for worker in workers:
                starting.start_soon(nursery.start, worker.run)
        try:
            yield group
        finally:
            nursery.cancel_scope.cancel()
