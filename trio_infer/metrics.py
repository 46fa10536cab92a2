"""Prometheus metrics, one registry per app (no process-global state), vLLM-style names.

Every family registered here is fed (tests/api/test_metrics.py fails otherwise). The queue time
(vLLM's ``request_queue_time_seconds``) is a request's arrival to the step where the worker first
scheduled one of its sequences (``wire.Step.admitted``); the waiting queue's length is
``requests_waiting``. Overload: ``requests_refused_total`` by reason (``queue_full``,
``queue_tokens``, ``queue_time``) and ``request_timeouts_total`` (deadlines that passed).

**Gateway names.** An inference gateway (the Gateway API Inference Extension's endpoint picker,
llm-d, SGLang's router) scrapes a model server for its queue, its running requests and how full
its KV cache is, under the names of the extension's model-server protocol, which are vLLM's:
``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (a
ratio in [0, 1] despite the name; ``vllm:gpu_cache_usage_perc`` is the older name of the same)
and ``vllm:cache_config_info`` (its ``block_size`` label: the page size, for prefix-aware
scheduling). They are mirrors: whoever sets ``requests_waiting`` sets the gateway's name too
(:class:`_Mirrored`), so the two can never disagree and nothing else feeds them.

**Data parallelism.** ``serve --data-parallel N`` runs N front-end engines, each setting its
gauges from its own worker; :meth:`Metrics.shares` gives each one a view in which every gauge is
its share of a sum, so the families the server exports are the group's totals (a gateway routes
to the server, not to its workers). Counters and histograms are shared as they are.

The speculative decoding families (vLLM's ``spec_decode_*``) are registered only on a server
that speculates (``Metrics(speculative=True)``, setting ``speculative``), so every registered
family can be fed. ``tokens_per_step`` is a ratio: with ``--data-parallel`` it is not summed
over the workers (the latest worker's step sets it).
"""

from __future__ import annotations

import copy
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Mirrored(Gauge):
    """A gauge whose every value is also passed to ``mirrors`` (the gateway's names)."""

    mirrors: tuple[Callable[[float], None], ...] = ()

    def set(self, value: float) -> None:
        super().set(value)
        for mirror in self.mirrors:
            mirror(value)


class _Ratio:
    """``used / total`` kept in ``gauges`` (0 while total is 0: nothing loaded)."""

    def __init__(self, *gauges: Gauge) -> None:
        self._gauges = gauges
        self._used = 0.0
        self._total = 0.0

    def used(self, value: float) -> None:
        self._used = value
        self._update()

    def total(self, value: float) -> None:
        self._total = value
        self._update()

    def _update(self) -> None:
        ratio = self._used / self._total if self._total > 0 else 0.0
        for gauge in self._gauges:
            gauge.set(ratio)


class _GaugeShare:
    """One engine's part of a gauge summed over ``parts`` engines: setting it sets the gauge to
    the sum of the latest values of every part."""

    def __init__(self, gauge: Gauge, parts: list[float], index: int) -> None:
        self._gauge = gauge
        self._parts = parts
        self._index = index

    def set(self, value: float) -> None:
        self._parts[self._index] = float(value)
        self._gauge.set(sum(self._parts))

    def inc(self, amount: float = 1) -> None:
        self.set(self._parts[self._index] + amount)

    def dec(self, amount: float = 1) -> None:
        self.set(self._parts[self._index] - amount)


class Metrics:
    def __init__(self, speculative: bool = False) -> None:
        r = self.registry = CollectorRegistry()
        p = "trio_infer_"
        mirrored = lambda name, doc, *mirrors: _mirrored(p + name, doc, r, mirrors)  # noqa: E731
        gateway = lambda name, doc: Gauge(name, doc, registry=r)  # noqa: E731
        waiting = gateway("vllm:num_requests_waiting", "Requests waiting (gateway name)")
        running = gateway("vllm:num_requests_running", "Requests running (gateway name)")
        kv_usage = _Ratio(
            gateway(p + "kv_cache_usage_ratio", "KV pages in use / KV pages in the pool"),
            gateway("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full (gateway name)"),
            gateway("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full (older gateway name)"),
        )
        self.cache_config_info = Gauge(
            "vllm:cache_config_info", "The KV cache's page size (block_size), page count "
            "(num_gpu_blocks) and element type (cache_dtype) as labels, for prefix-aware gateways",
            ["block_size", "num_gpu_blocks", "cache_dtype"],
            registry=r,
        )
        self.requests_running = mirrored("requests_running", "Sequences admitted", running.set)
        self.requests_waiting = mirrored("requests_waiting", "Sequences queued", waiting.set)
        self.sessions_active = Gauge(p + "sessions_active", "Live request sessions", registry=r)
        self.kv_pages_used = mirrored("kv_pages_used", "KV pages in use", kv_usage.used)
        self.kv_pages_total = mirrored("kv_pages_total", "KV pages in the pool", kv_usage.total)
        self.kv_pages_cached = Gauge(p + "kv_pages_cached", "KV pages held by the prefix cache", registry=r)
        self.requests_total = Counter(
            p + "requests", "Finished sequences", ["finish_reason"], registry=r
        )
        self.prompt_tokens_total = Counter(p + "prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens_total = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.prefix_cache_queries_total = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits_total = Counter(
            p + "prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r
        )
        hist = lambda name, doc: Histogram(p + name, doc, buckets=_LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.time_to_first_token = hist("time_to_first_token_seconds", "Arrival to first token")
        self.request_queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled")
        self.requests_refused_total = Counter(
            p + "requests_refused", "Requests refused with 429, by reason", ["reason"], registry=r
        )
        self.request_timeouts_total = Counter(
            p + "request_timeouts", "Requests ended by their deadline", registry=r
        )
        self.inter_token_latency = hist("inter_token_latency_seconds", "Between output tokens")
        self.e2e_request_latency = hist("e2e_request_latency_seconds", "Arrival to finish")
        # The forward-progress watchdog (runtime/watchdog.py). worker_stalled is a gauge of
        # workers stalled now (0 or 1 per worker, so the data-parallel sum counts them).
        self.worker_stalls_total = Counter(
            p + "worker_stalls", "Stalls: work pending and no worker step past the stall bound",
            registry=r)
        self.worker_watchdog_restarts_total = Counter(
            p + "worker_watchdog_restarts", "Workers dropped and restarted by the watchdog",
            registry=r)
        self.worker_stalled = Gauge(p + "worker_stalled", "Workers stalled now", registry=r)
        self._step_ages: list[Callable[[], float | None]] = []
        self.worker_last_step_age = Gauge(
            p + "worker_last_step_age_seconds", "Seconds since a worker's last step (the oldest)",
            registry=r)
        # The Responses API's store (api/response_store.py): its size and what it dropped.
        self.responses_stored = Gauge(p + "responses_stored", "Responses in the store", registry=r)
        self.responses_stored_bytes = Gauge(
            p + "responses_stored_bytes", "Bytes of JSON in the response store", registry=r)
        self.responses_evicted_total = Counter(
            p + "responses_evicted", "Responses dropped by the store's bounds, by reason",
            ["reason"], registry=r)
        for reason in ("count", "bytes", "age", "too_large"):
            self.responses_evicted_total.labels(reason=reason)
        self.spec_proposed_total: Counter | None = None
        self.spec_accepted_total: Counter | None = None
        self.tokens_per_step: Gauge | None = None
        if speculative:
            self.spec_proposed_total = Counter(
                p + "spec_decode_draft_tokens", "Tokens guessed by speculative decoding", registry=r
            )
            self.spec_accepted_total = Counter(
                p + "spec_decode_accepted_tokens", "Guessed tokens the model confirmed", registry=r
            )
            self.tokens_per_step = Gauge(
                p + "tokens_per_step", "Output tokens per sequence per engine step, since the "
                "worker started (1 without speculation)", registry=r
            )
        for reason in ("stop", "length", "abort", "error"):
            self.requests_total.labels(finish_reason=reason)
        for reason in ("queue_full", "queue_tokens", "queue_time"):
            self.requests_refused_total.labels(reason=reason)

    def set_cache_config(self, page_size: int, num_pages: int, cache_dtype: str) -> None:
        """The KV cache's shape, once the engine is loaded (``vllm:cache_config_info``)."""
        self.cache_config_info.clear()
        self.cache_config_info.labels(block_size=str(page_size), num_gpu_blocks=str(num_pages),
                                      cache_dtype=cache_dtype).set(1)

    def store_changed(self, records: int, size: int, evicted: dict[str, int]) -> None:
        """The response store's observer (api/response_store.py)."""
        self.responses_stored.set(records)
        self.responses_stored_bytes.set(size)
        for reason, n in evicted.items():
            if n:
                self.responses_evicted_total.labels(reason=reason).inc(n)

    def watch_step_age(self, age: Callable[[], float | None]) -> None:
        """Report ``age()`` (a worker's seconds since its last step, None before its first) in
        ``worker_last_step_age_seconds``; with several workers, the oldest."""
        self._step_ages.append(age)

    def shares(self, n: int) -> list[Metrics]:
        """``n`` views of these metrics for ``n`` data-parallel engines: the same counters and
        histograms, and every gauge replaced by that engine's share of a sum."""
        parts = {name: [0.0] * n for name, value in vars(self).items()
                 if isinstance(value, Gauge)
                 and value is not self.cache_config_info and value is not self.tokens_per_step
                 and value is not self.worker_last_step_age
                 and value is not self.responses_stored and value is not self.responses_stored_bytes}
        views = []
        for i in range(n):
            view = copy.copy(self)
            for name in parts:
                setattr(view, name, _GaugeShare(getattr(self, name), parts[name], i))
            views.append(view)
        return views

    def render(self) -> bytes:
        ages = [a for age in self._step_ages if (a := age()) is not None]
        self.worker_last_step_age.set(max(ages, default=0.0))  # as of this scrape
        return generate_latest(self.registry)

    def refusals(self) -> dict[str, int]:
        """Requests refused with 429 so far, by reason (for ``GET /v1/status``)."""
        return {
            sample.labels["reason"]: int(sample.value)
            for metric in self.requests_refused_total.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        }

    def snapshot(self) -> dict[str, float]:
        """The current value of every unlabelled gauge and counter by sample name (counters as
        ``..._total``), for ``GET /v1/status``; one pass over the registry."""
        return {
            sample.name: sample.value
            for metric in self.registry.collect()
            if metric.type in ("gauge", "counter")
            for sample in metric.samples
            if not sample.labels and not sample.name.endswith("_created")
        }


def _mirrored(name: str, doc: str, registry: CollectorRegistry,
              mirrors: tuple[Callable[[float], None], ...]) -> _Mirrored:
    gauge = _Mirrored(name, doc, registry=registry)
    gauge.mirrors = mirrors
    return gauge
