"""Prometheus metrics, one registry per app (no process-global state), vLLM-style names.

Every family registered here is fed (tests/api/test_metrics.py fails otherwise). There is no
queue-time histogram (vLLM's ``request_queue_time_seconds``): the front end does not see when
the worker's scheduler admits a sequence, only its first token (``time_to_first_token``); the
waiting queue's length is ``requests_waiting``.

The speculative decoding families (vLLM's ``spec_decode_*``) are registered only on a server
that speculates (``Metrics(speculative=True)``, setting ``speculative``), so every registered
family can be fed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, speculative: bool = False) -> None:
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
        self.inter_token_latency = hist("inter_token_latency_seconds", "Between output tokens")
        self.e2e_request_latency = hist("e2e_request_latency_seconds", "Arrival to finish")
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

    def render(self) -> bytes:
        return generate_latest(self.registry)

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
