"""Prometheus metrics, one registry per app (no process-global state), vLLM-style names.

Every family registered here is fed (tests/api/test_metrics.py fails otherwise). The queue time
(vLLM's ``request_queue_time_seconds``) is a request's arrival to the step where the worker first
scheduled one of its sequences (``wire.Step.admitted``); the waiting queue's length is
``requests_waiting``. Overload: ``requests_refused_total`` by reason (``queue_full``,
``queue_tokens``, ``queue_time``) and ``request_timeouts_total`` (deadlines that passed).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "trio_infer_"
        self.requests_running = Gauge(p + "requests_running", "Sequences admitted", registry=r)
        self.requests_waiting = Gauge(p + "requests_waiting", "Sequences queued", registry=r)
        self.sessions_active = Gauge(p + "sessions_active", "Live request sessions", registry=r)
        self.kv_pages_used = Gauge(p + "kv_pages_used", "KV pages in use", registry=r)
        self.kv_pages_total = Gauge(p + "kv_pages_total", "KV pages in the pool", registry=r)
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
        for reason in ("stop", "length", "abort", "error"):
            self.requests_total.labels(finish_reason=reason)
        for reason in ("queue_full", "queue_tokens", "queue_time"):
            self.requests_refused_total.labels(reason=reason)

    def render(self) -> bytes:
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
