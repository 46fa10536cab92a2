"""``--data-parallel N``: the routing policy on its own (runtime/affinity.py), the group over
in-process workers (runtime/data_parallel.py), its settings and its metrics. The lifecycle
property (every request ends once, a worker lost mid-stream) is in tests/concurrency/
test_data_parallel_lifecycle.py; the serve path with worker processes at the end here."""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.metrics import Metrics
from trio_infer.models.fake import FakeModel
from trio_infer.runtime.affinity import PrefixAffinity, RoundRobin, least_loaded, page_chain_hashes
from trio_infer.runtime.data_parallel import open_data_parallel, worker_settings
from trio_infer.settings import thread_shares
from trio_infer.runtime.errors import EngineOverloaded, EngineUnavailable
from trio_infer.runtime.in_process import open_worker_task
from trio_infer.settings import Settings
from trio_infer.wire import SamplingParams

PAGE = 4


# -- the policy ----------------------------------------------------------------------------------


def test_page_chain_hashes_equal_exactly_for_equal_prefixes() -> None:
    a = page_chain_hashes(list(range(10)), PAGE)
    b = page_chain_hashes(list(range(8)) + [99, 98, 97], PAGE)
    c = page_chain_hashes([1] + list(range(1, 10)), PAGE)
    assert len(a) == 2 and a == b  # the partial third page is not hashed
    assert c[0] != a[0] and c[1] != a[1]  # a change in page 1 changes every chain after it


def test_affinity_sends_a_shared_prefix_back_to_its_worker() -> None:
    policy = PrefixAffinity(PAGE, capacity=100, slack=8)
    prefix = list(range(3 * PAGE))
    first = policy.pick(prefix + [1], [0, 0])
    other = policy.pick([50] * (3 * PAGE) + [1], [1 if first == 0 else 0, 1 if first == 1 else 0])
    assert other != first  # a new prefix goes to the least loaded worker
    loads = [5, 5]  # equal loads: without affinity the tie would go to worker 0
    for suffix in range(5):
        assert policy.pick(prefix + [7, suffix], loads) == first
    assert policy.statistics().affinity == 5


def test_a_short_match_or_a_busy_holder_falls_back_to_the_least_loaded() -> None:
    policy = PrefixAffinity(PAGE, capacity=100, slack=4)
    system = list(range(PAGE))
    assert policy.pick(system + list(range(100, 100 + 3 * PAGE)), [0, 3]) == 0
    # Only the first of four full pages matches (a shared system prompt): least loaded.
    assert policy.pick(system + list(range(200, 200 + 3 * PAGE)), [3, 0]) == 1
    prefix = list(range(300, 300 + 4 * PAGE))
    assert policy.pick(prefix, [0, 1]) == 0
    assert policy.pick(prefix, [3, 0]) == 0  # busier by less than the slack: still affinity
    assert policy.pick(prefix, [4, 0]) == 1  # a whole slack busier: least loaded
    assert policy.pick(prefix, [None, 0]) == 1  # gone


def test_a_restarted_worker_is_forgotten_and_the_table_is_bounded() -> None:
    policy = PrefixAffinity(PAGE, capacity=100, slack=4)
    prefix = list(range(2 * PAGE))
    assert policy.pick(prefix, [0, 0]) == 0
    policy.forget(0)
    assert policy.pick(prefix, [1, 1]) == 0 and policy.statistics().affinity == 0
    policy.resize(3)
    for i in range(10):
        policy.pick([i] * (2 * PAGE), [0, 0])
    assert policy.statistics().table_entries == 3


def test_round_robin_takes_turns_over_the_available_workers() -> None:
    policy = RoundRobin()
    assert [policy.pick([1], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [policy.pick([1], [0, None, 0]) for _ in range(3)] == [2, 0, 2]
    with pytest.raises(ValueError):
        policy.pick([1], [None, None])


loads_st = st.lists(st.one_of(st.none(), st.integers(0, 20)), min_size=1, max_size=4).filter(
    lambda loads: any(load is not None for load in loads))
prompt_st = st.lists(st.integers(0, 3), min_size=0, max_size=6 * PAGE)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(steps=st.lists(st.tuples(prompt_st, loads_st), min_size=1, max_size=30),
       slack=st.integers(1, 6), capacity=st.integers(1, 40))
def test_affinity_picks_an_available_worker_within_the_slack(steps, slack, capacity) -> None:
    """Whatever the prompts and loads: the pick is an available worker, never a slack or more
    busier than the least loaded, and a prompt without a full page goes to the least loaded."""
    policy = PrefixAffinity(PAGE, capacity=capacity, slack=slack)
    for prompt, loads in steps:
        choice = policy.pick(prompt, loads)
        assert loads[choice] is not None
        floor = loads[least_loaded(loads)]
        assert loads[choice] < floor + slack or choice == least_loaded(loads)
        if len(prompt) < PAGE:
            assert choice == least_loaded(loads)
        # The same prompt again, nothing else changed: the same worker.
        assert policy.pick(prompt, loads) == choice
    assert policy.statistics().table_entries <= capacity


# -- settings ------------------------------------------------------------------------------------


def test_data_parallel_is_refused_with_api_workers() -> None:
    with pytest.raises(ValidationError, match="data_parallel > 1 cannot be combined with api_workers"):
        Settings(model="fake", data_parallel=2, api_workers=2)


def test_each_worker_gets_its_share_of_the_threads() -> None:
    assert thread_shares(5, 2) == [3, 2]
    assert thread_shares(1, 3) == [1, 1, 1]
    shares = worker_settings(Settings(model="fake", data_parallel=2, torch_threads=4))
    assert [s.torch_threads for s in shares] == [2, 2]
    assert all(s.data_parallel == 1 for s in shares)


# -- the group over in-process workers -----------------------------------------------------------


def make_engine(num_pages: int = 64) -> Engine:
    return Engine(FakeModel(vocab_size=61, eos_token_id=0),
                  EngineConfig(page_size=PAGE, num_pages=num_pages, max_running=4,
                               max_batched_tokens=16))


def group_settings(**kw) -> Settings:
    return Settings(model="fake", page_size=PAGE, max_running=4, max_batched_tokens=16,
                    data_parallel=2, **kw)


@asynccontextmanager
async def in_process_group(settings: Settings, n: int = 2, metrics: Metrics | None = None):
    engines = [make_engine() for _ in range(n)]
    connects = [lambda e=e: open_worker_task(e, in_thread=False) for e in engines]
    async with open_data_parallel(settings, metrics, connects=connects, restart=False) as group:
        yield group, engines


async def run(group, prompt, max_tokens=3) -> list[int]:
    async with group.generate(prompt, [SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True)]) as stream:
        return [t async for outs in stream for out in outs for t in out.token_ids]


async def test_requests_with_a_shared_prefix_share_a_worker_and_its_prefix_cache() -> None:
    metrics = Metrics()
    async with in_process_group(group_settings(), metrics=metrics) as (group, engines):
        prefixes = [[10 + p] * (3 * PAGE) for p in range(4)]
        for round_ in range(3):
            async with trio.open_nursery() as nursery:
                for p, prefix in enumerate(prefixes):
                    nursery.start_soon(run, group, prefix + [round_, p])
        served = [e.statistics().prefix_queries for e in engines]
        assert all(served), f"one worker served everything: {served}"
        assert group.routing_statistics().affinity == 8  # rounds 2 and 3 follow round 1
        # Each prefix was computed once: later rounds hit the cache for its 3 full pages.
        hits = sum(e.statistics().prefix_hits for e in engines)
        assert hits == 8 * 3 * PAGE
        values = metrics.snapshot()
        assert values["trio_infer_prefix_cache_hits_total"] == hits
        assert values["trio_infer_kv_pages_total"] == 2 * 64
        assert group.info is not None and group.info.num_pages == 2 * 64
    assert group.statistics().sessions == 0


async def test_admission_bounds_each_workers_waiting_sequences() -> None:
    """max_waiting bounds each worker's queue: a request is refused (429) only when even the
    least loaded serving worker could not queue it."""
    async with in_process_group(group_settings(max_waiting=2)) as (group, _):
        two = [SamplingParams(max_tokens=2)] * 2
        async with group.generate([1, 2, 3], two):
            group.check_admission(1)  # the other worker's queue is empty
            async with group.generate([4, 5, 6], two):
                with pytest.raises(EngineOverloaded):
                    group.check_admission(1)
        group.begin_drain()
        with pytest.raises(EngineUnavailable, match="shutting down"):
            group.check_admission(1)


async def test_gauges_are_the_sum_over_the_workers() -> None:
    metrics = Metrics()
    a, b = metrics.shares(2)
    a.requests_waiting.set(2)
    b.requests_waiting.set(3)
    a.kv_pages_total.set(10)
    b.kv_pages_total.set(30)
    b.kv_pages_used.set(10)
    a.requests_waiting.set(0)
    values = metrics.snapshot()
    assert values["trio_infer_requests_waiting"] == 3 == values["vllm:num_requests_waiting"]
    assert values["vllm:kv_cache_usage_perc"] == 0.25 == values["vllm:gpu_cache_usage_perc"]
    assert values["trio_infer_kv_cache_usage_ratio"] == 0.25


# -- serve --data-parallel 2, with worker processes -----------------------------------------------


def test_serve_data_parallel_loading_a_killed_worker_and_the_gateway_metrics(tmp_path) -> None:
    """``serve --data-parallel 2`` (fake model, worker processes): 503 ``loading`` until the
    workers are up; under 16 streams, ``kill -9`` of one worker fails only the streams it served
    while ``/health`` stays 200 (the other serves); it is restarted alone, the group serves again,
    and the gauges (ours and the gateway's names) come back to 0."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    import httpx

    from .test_worker_process import alive, children, free_port, health, stream_events, wait_for

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_infer", "serve", "--model", "fake", "--port", str(port),
         "--cache-dir", str(tmp_path), "--data-parallel", "2", "--fake-step-ms", "5",
         "--worker-restart-delay-s", "0.1", "--shutdown-grace-s", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TRIO_INFER_TEST_LOAD_DELAY_S": "1"},
    )
    try:
        wait_for(lambda: health(url) != 0 or proc.poll() is not None, 120, "the server to listen")
        loading = httpx.get(url + "/health")
        assert loading.status_code == 503 and loading.json()["error"]["message"] == "loading"
        assert httpx.get(url + "/v1/models").status_code == 503
        wait_for(lambda: health(url) == 200 or proc.poll() is not None, 120, "the workers")
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        metrics = httpx.get(url + "/metrics").text
        assert 'vllm:cache_config_info{block_size="16"' in metrics

        # Prompts shorter than a page: no affinity, so least loaded alternates the workers.
        bodies = [{"model": "fake", "prompt": f"p{i}", "max_tokens": 400, "ignore_eos": True,
                   "stream": True} for i in range(16)]
        started = threading.Barrier(17)
        results: list = [None] * 16

        def run(i: int) -> None:
            try:
                results[i] = stream_events(url, bodies[i], started)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        started.wait(timeout=60)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        healthy_during = [health(url) for _ in range(5)]
        for t in threads:
            t.join(timeout=120)
        failed = [r for r in results if isinstance(r, list) and "error" in r[-2]]
        finished = [r for r in results if isinstance(r, list) and "error" not in r[-2]]
        assert len(failed) + len(finished) == 16, [r for r in results if not isinstance(r, list)]
        assert all(r[-2]["error"]["code"] == "service_unavailable" for r in failed)
        assert all(r[-2]["choices"][0]["finish_reason"] == "length" for r in finished)
        assert 0 < len(failed) < 16 and len(finished) > 0, (len(failed), len(finished))
        assert all(code == 200 for code in healthy_during), healthy_during

        wait_for(lambda: len(children(proc.pid)) == 2 and victim not in children(proc.pid), 60,
                 "the killed worker to be restarted")
        assert not alive(victim)
        ok = [httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "fake", "prompt": f"again {i}", "max_tokens": 5}) for i in range(4)]
        assert all(r.status_code == 200 for r in ok), [r.text for r in ok]
        metrics = httpx.get(url + "/metrics").text
        for line in ("trio_infer_sessions_active 0.0", "trio_infer_requests_running 0.0",
                     "vllm:num_requests_running 0.0", "vllm:num_requests_waiting 0.0"):
            assert line in metrics, line
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-3000:]
        assert output.count("restarting the batching worker (1 of at most") == 1, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
