"""``overload``: a burst of ``--burst-factor`` (10) times the server's capacity against our own
server, interleaved with the same server unloaded, to check what the server promises under
overload (README, "Overload and deadlines").

Two servers run side by side, each ``python -m trio_infer serve`` on the fake model
(``--fake-step-ms`` of simulated compute per engine step; ``--model PATH`` serves a real model
instead) with ``--max-running`` sequences at most (its *capacity*): *limited*, with the
queue-time limit ``--max-queue-time-s``, and *unlimited*, without (so every request is served,
however long it waits: what priorities are measured on). Each round, one after the other:

1. *unloaded* (limited server): ``capacity`` requests, one after another (the TTFT baseline);
2. *burst* (limited server), then the same burst on the unlimited server:
   ``burst-factor x capacity`` streamed requests: the low-priority ones (``priority`` 1) at
   once, then, ``--high-delay-s`` later (the server is saturated by then), the high-priority
   ones (``priority`` 0), a ``--high-fraction`` of the burst. Priorities order the waiting
   queue (they do not preempt a running sequence for a slot), so this is what "under
   saturation" means here: high-priority requests that arrive while the queue is full.

Every request streams (``stream: true``) with ``--output-len`` tokens (``ignore_eos``). What it
checks and prints, pooled over the rounds:

* every burst response is a 200 or a 429 that carries ``Retry-After``, and no client timed out
  (``--timeout`` per request, far above what the server should take);
* the 200s' TTFT p99 under the burst is at most 2 x the unloaded TTFT p99 + the queue-time limit
  (the ratio printed is burst p99 / that bound: at most 1 passes);
* on the unlimited server, the TTFT p50 of the high-priority requests is at most a third of the
  low-priority ones' (ratio printed: high p50 / low p50; the limited server's is printed too,
  over its 200s only: there a low-priority request either starts within the limit or is refused).

The exit status is 0 when every check passed. Timings on a shared machine are noisy: report the
load average with the figures (the JSON has it in ``environment``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from trio_infer.bench import stats
from trio_infer.bench.client import Endpoint, StreamResult, stream_sse
from trio_infer.bench.servers import System, free_port, start_server, stop_server, wait_healthy
from trio_infer.bench.workload import make_text_workload, parse_range

HIGH, LOW = 0, 1  # the priorities of the burst (vLLM's: lower first)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="fake", help="what the server serves (default: the fake model)")
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="the fake model's compute per engine step (default 20)")
    p.add_argument("--max-running", type=int, default=8,
                   help="the server's capacity: sequences decoded together (default 8)")
    p.add_argument("--max-queue-time-s", type=float, default=1.0,
                   help="the server's queue-time limit (default 1)")
    p.add_argument("--burst-factor", type=int, default=10, help="burst size over capacity (default 10)")
    p.add_argument("--high-fraction", type=float, default=0.2,
                   help="share of the burst sent with high priority (default 0.2)")
    p.add_argument("--high-delay-s", type=float, default=0.5,
                   help="the high-priority requests leave this long after the low ones (default 0.5)")
    p.add_argument("--input-len", type=parse_range, default=parse_range("32"), metavar="MIN:MAX",
                   help="prompt length in words (default 32)")
    p.add_argument("--output-len", type=parse_range, default=parse_range("16"), metavar="MIN:MAX",
                   help="tokens per request (default 16)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="client timeout per request, seconds (default 120)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `python -m trio_infer serve` (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", type=Path, default=None,
                   help="keep the server's log here (default: a temporary folder)")
    p.add_argument("--output-json", type=Path, default=None)


def server_argv(args: argparse.Namespace, limited: bool) -> list[str]:
    argv = [sys.executable, "-m", "trio_infer", "serve", "--model", args.model,
            "--host", "127.0.0.1", "--port", "{port}",
            "--max-running", str(args.max_running),
            "--max-batched-tokens", str(max(512, 64 * args.max_running)),
            # Room for the whole burst in the queue: the queue-time limit is what refuses here.
            "--max-waiting", str(max(256, 2 * args.burst_factor * args.max_running))]
    if limited:
        argv += ["--max-queue-time-s", f"{args.max_queue_time_s:g}"]
    if args.model == "fake":
        argv += ["--fake-step-ms", f"{args.step_ms:g}"]
    return argv + list(args.serve_arg)


async def _one(ep: Endpoint, body: dict[str, Any], timeout: float) -> StreamResult:
    res = StreamResult()
    with trio.move_on_after(timeout) as scope:
        await stream_sse(ep, "/completions", body, None, res)
    if scope.cancelled_caught:
        res.ok, res.error, res.end = False, f"client timeout after {timeout:g} s", time.perf_counter()
    return res


def _body(prompt: str, max_tokens: int, priority: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "any", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": True, "ignore_eos": True}
    if priority is not None:
        body["priority"] = priority
    return body


async def _model_id(ep: Endpoint) -> str:
    from trio_infer.bench.client import request

    status, raw = await request(ep, "GET", "/models")
    return json.loads(raw)["data"][0]["id"] if status == 200 else "any"


async def unloaded(ep: Endpoint, model: str, workload: list[tuple[str, int]], timeout: float) -> list[StreamResult]:
    out = []
    for prompt, max_tokens in workload:
        out.append(await _one(ep, {**_body(prompt, max_tokens, None), "model": model}, timeout))
    return out


async def burst(ep: Endpoint, model: str, workload: list[tuple[str, int]], priorities: list[int],
                timeout: float, high_delay: float) -> list[tuple[int, StreamResult]]:
    results: list[tuple[int, StreamResult] | None] = [None] * len(workload)

    async def one(i: int) -> None:
        prompt, max_tokens = workload[i]
        body = {**_body(prompt, max_tokens, priorities[i]), "model": model}
        results[i] = (priorities[i], await _one(ep, body, timeout))

    async with trio.open_nursery() as nursery:
        for i in range(len(workload)):
            if priorities[i] == LOW:
                nursery.start_soon(one, i)
        await trio.sleep(high_delay)
        for i in range(len(workload)):
            if priorities[i] == HIGH:
                nursery.start_soon(one, i)
    return [r for r in results if r is not None]


def classify(results: list[tuple[int, StreamResult]]) -> dict[str, Any]:
    """The burst's outcomes: statuses, 429s without Retry-After, client timeouts, other errors."""
    by_status: dict[str, int] = {}
    for _, r in results:
        key = str(r.status) if r.status else "none"
        by_status[key] = by_status.get(key, 0) + 1
    timeouts = sum(1 for _, r in results if r.error and r.error.startswith("client timeout"))
    no_retry = sum(1 for _, r in results if r.status == 429 and not r.retry_after)
    failed_200 = sum(1 for _, r in results if r.status == 200 and not r.ok)
    retry_after = sorted(int(r.retry_after) for _, r in results if r.status == 429 and r.retry_after
                         and r.retry_after.isdigit())
    return {"by_status": by_status, "client_timeouts": timeouts, "429_without_retry_after": no_retry,
            "200_that_failed": failed_200,
            "retry_after_s": {"min": retry_after[0], "max": retry_after[-1]} if retry_after else None}


def _p50s(results: list[tuple[int, StreamResult]]) -> tuple[list[float], list[float]]:
    ok = [(p, r) for p, r in results if r.ok and r.ttft is not None]
    return [r.ttft for p, r in ok if p == HIGH], [r.ttft for p, r in ok if p == LOW]  # type: ignore[misc]


async def run(args: argparse.Namespace, ep: Endpoint, ep_free: Endpoint) -> dict[str, Any]:
    rng = random.Random(args.seed)
    model = await _model_id(ep)
    cap = args.max_running
    base: list[float] = []
    burst_results: list[tuple[int, StreamResult]] = []
    free_results: list[tuple[int, StreamResult]] = []
    for rnd in range(args.rounds):
        work = make_text_workload(cap, args.input_len, args.output_len, seed=args.seed + 2 * rnd)
        base += [r.ttft for r in await unloaded(ep, model, work, args.timeout) if r.ok and r.ttft is not None]
        n = args.burst_factor * cap
        work = make_text_workload(n, args.input_len, args.output_len, seed=args.seed + 2 * rnd + 1)
        high = round(args.high_fraction * n)
        priorities = [HIGH] * high + [LOW] * (n - high)
        rng.shuffle(priorities)
        burst_results += await burst(ep, model, work, priorities, args.timeout, args.high_delay_s)
        free_results += await burst(ep_free, model, work, priorities, args.timeout, args.high_delay_s)
    free_high, free_low = _p50s(free_results)
    free_outcome = classify(free_results)
    ok = [(p, r) for p, r in burst_results if r.ok and r.ttft is not None]
    ttft_all = [r.ttft for _, r in ok]
    ttft_high = [r.ttft for p, r in ok if p == HIGH]
    ttft_low = [r.ttft for p, r in ok if p == LOW]
    unloaded_s = stats.summarize(base)
    burst_s = stats.summarize(ttft_all)
    bound = 2 * unloaded_s["p99"] + args.max_queue_time_s
    high_s, low_s = stats.summarize(ttft_high), stats.summarize(ttft_low)
    outcome = classify(burst_results)
    statuses_ok = set(outcome["by_status"]) <= {"200", "429"}
    free_high_s, free_low_s = stats.summarize(free_high), stats.summarize(free_low)
    checks = {
        "only_200_or_429_with_retry_after": statuses_ok and outcome["429_without_retry_after"] == 0
        and outcome["200_that_failed"] == 0,
        "no_client_timeout": outcome["client_timeouts"] == 0 and free_outcome["client_timeouts"] == 0,
        "ttft_p99_within_bound": burst_s["p99"] <= bound,
        "high_p50_at_most_a_third_of_low": free_high_s["p50"] <= free_low_s["p50"] / 3,
    }
    return {
        "capacity": cap,
        "burst_size": args.burst_factor * cap,
        "rounds": args.rounds,
        "max_queue_time_s": args.max_queue_time_s,
        "high_fraction": args.high_fraction,
        "high_delay_s": args.high_delay_s,
        "step_ms": args.step_ms if args.model == "fake" else None,
        "model": args.model,
        "unloaded_ttft_ms": stats.summarize(base, 1e3),
        "burst": outcome,
        "burst_200_ttft_ms": stats.summarize(ttft_all, 1e3),
        "high_200_ttft_ms": stats.summarize(ttft_high, 1e3),
        "low_200_ttft_ms": stats.summarize(ttft_low, 1e3),
        "high_200": len(ttft_high), "low_200": len(ttft_low),
        "ttft_bound_ms": 1e3 * bound,
        "ratio_burst_p99_over_bound": burst_s["p99"] / bound if bound else math.nan,
        "ratio_high_p50_over_low_p50": high_s["p50"] / low_s["p50"] if low_s["p50"] else math.nan,
        "unlimited_burst": free_outcome,
        "unlimited_high_ttft_ms": stats.summarize(free_high, 1e3),
        "unlimited_low_ttft_ms": stats.summarize(free_low, 1e3),
        "unlimited_ratio_high_p50_over_low_p50":
            free_high_s["p50"] / free_low_s["p50"] if free_low_s["p50"] else math.nan,
        "checks": checks,
    }


def print_report(res: dict[str, Any]) -> None:
    b = res["burst"]
    rows: list[tuple[str, Any]] = [
        ("Capacity (max_running)", res["capacity"]),
        ("Burst size (per round)", res["burst_size"]),
        ("Rounds", res["rounds"]),
        ("Queue-time limit (s)", res["max_queue_time_s"]),
        ("Burst statuses", ", ".join(f"{k}: {v}" for k, v in sorted(b["by_status"].items()))),
        ("429 without Retry-After", b["429_without_retry_after"]),
        ("Retry-After range (s)", b["retry_after_s"] and f"{b['retry_after_s']['min']}-{b['retry_after_s']['max']}"),
        ("Client timeouts", b["client_timeouts"]),
        ("Unloaded TTFT p50 / p99 (ms)", f"{res['unloaded_ttft_ms']['p50']:.1f} / {res['unloaded_ttft_ms']['p99']:.1f}"),
        ("Burst 200s TTFT p50 / p99 (ms)", f"{res['burst_200_ttft_ms']['p50']:.1f} / {res['burst_200_ttft_ms']['p99']:.1f}"),
        ("Bound 2 x unloaded p99 + limit (ms)", f"{res['ttft_bound_ms']:.1f}"),
        ("Burst p99 / bound", f"{res['ratio_burst_p99_over_bound']:.2f}"),
        ("High-priority 200s, TTFT p50 (ms)", f"{res['high_200']}, {res['high_200_ttft_ms']['p50']:.1f}"),
        ("Low-priority 200s, TTFT p50 (ms)", f"{res['low_200']}, {res['low_200_ttft_ms']['p50']:.1f}"),
        ("High p50 / low p50", f"{res['ratio_high_p50_over_low_p50']:.2f}"),
        ("Unlimited server: burst statuses",
         ", ".join(f"{k}: {v}" for k, v in sorted(res["unlimited_burst"]["by_status"].items()))),
        ("Unlimited: high TTFT p50 (ms)", f"{res['unlimited_high_ttft_ms']['p50']:.1f}"),
        ("Unlimited: low TTFT p50 (ms)", f"{res['unlimited_low_ttft_ms']['p50']:.1f}"),
        ("Unlimited: high p50 / low p50", f"{res['unlimited_ratio_high_p50_over_low_p50']:.2f}"),
    ]
    rows += [(f"check: {name}", "pass" if ok else "FAIL") for name, ok in res["checks"].items()]
    stats.print_kv("Overload Benchmark Result", rows)


def main(args: argparse.Namespace) -> int:
    if args.max_running < 1 or args.burst_factor < 1 or args.rounds < 1:
        raise SystemExit("error: --max-running, --burst-factor and --rounds must be >= 1")
    ports = {"limited": free_port(), "unlimited": free_port()}
    procs = {}
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for name, port in ports.items():
                system = System(name, server_argv(args, name == "limited"), env=dict(os.environ),
                                model=None)
                log = log_dir / f"overload-{name}.log"
                procs[name] = start_server(system, port, log)
                trio.run(wait_healthy, Endpoint("127.0.0.1", port, ""), procs[name],
                         args.startup_timeout, log, name)
            res = trio.run(run, args, *(Endpoint.parse(f"http://127.0.0.1:{ports[n]}/v1")
                                        for n in ("limited", "unlimited")))
        finally:
            for proc in procs.values():
                stop_server(proc)
    res["environment"] = stats.environment()
    print_report(res)
    if args.output_json:
        stats.write_json(args.output_json, res)
        print(f"wrote {args.output_json}")
    return 0 if all(res["checks"].values()) else 1
