"""``burst``: bursts of streamed chat requests sent to several servers at once, paired round by
round: each server's CPU a request and its burst's TTFT, and their ratios to ours.

Why paired: on a 2-core VM a server's CPU a request moves by 10-15% from one run to the next
(other tenants, the clock, where the kernel places the processes), more than most changes worth
measuring, and ``frontend --repeats`` runs the systems one after another. Here every system is
up at once, and each round sends one burst of ``--requests`` streams to each, their connections
opened interleaved (the first system of the interleaving rotates from round to round), so a
round's noise falls on every system alike. The ratio of two systems' figures within a round
cancels most of it, and the median of the rounds' ratios resolves a few percent (two builds of
the same tree: 0.99x CPU, 1.00x TTFT p50 in 12 rounds; docs/benchmarks.md).

A request is a new connection with ``Connection: close`` (as a burst of new clients is), a
chat request of ``--input-len`` random words, ``stream: true``, ``max_tokens`` from
``--max-tokens``: 1 (the default) measures a request's whole way through the server, a larger
value adds the streaming. Its TTFT is the time to its first token-carrying event. A server's CPU
is its whole process tree's (front end, batching worker, threads; from /proc) over the round,
divided by the requests it was sent; the load generator runs in this process and is not counted.
The servers share the machine within a round, so a TTFT ratio between two different servers is
not the ratio each would show alone (``frontend --compare`` measures that); between two builds
of the same server it is a before and after.

Systems: ours (``python -m trio_infer serve`` over the fake model with ``--step-ms``, or the bare
hypercorn command with ``--launcher hypercorn``, started as ``frontend`` starts it) and every
``--compare NAME=CMD``: a shell command with ``{port}``, run with our server's environment. To
measure a change, compare against the same command run from a checkout without it::

    python -m trio_infer.bench burst --compare "base=cd /tmp && PYTHONPATH=/path/to/base \\
        python -m trio_infer serve --model fake --fake-step-ms 20 --port {port}"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trio_infer.bench import procstat, stats
from trio_infer.bench.client import Endpoint, StreamResult, request, stream_sse
from trio_infer.bench.frontend import (
    compare_spec,
    default_launcher,
    environment,
    positive_int,
    server_command,
)
from trio_infer.bench.procstat import CpuMeter
from trio_infer.bench.servers import (
    System,
    free_port,
    log_tail,
    start_server,
    stop_server,
    wait_healthy,
)
from trio_infer.bench.workload import LengthRange, make_text_workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compare", type=compare_spec, action="append", default=[],
                   metavar="NAME=CMD", required=True,
                   help="another server, started by the shell command CMD with {port} substituted "
                   "(repeatable; at least one)")
    p.add_argument("--requests", type=positive_int, default=128,
                   help="streams sent to each server per round")
    p.add_argument("--rounds", type=positive_int, default=20)
    p.add_argument("--max-tokens", type=positive_int, default=1, help="tokens per stream")
    p.add_argument("--input-len", type=positive_int, default=16, help="prompt words per stream")
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="our fake model's simulated compute per engine step")
    p.add_argument("--pause-s", type=float, default=0.3, help="idle time between rounds")
    p.add_argument("--launcher", choices=("cli", "hypercorn"), default=None,
                   help="start ours as `python -m trio_infer serve` (cli) or as "
                   "`hypercorn trio_infer.app:app --worker-class trio`")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every server")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--stop-timeout", type=float, default=15.0)
    p.add_argument("--output-json", type=Path, default=None)


def systems_for(args: argparse.Namespace) -> list[System]:
    names = [name for name, _ in args.compare]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: --compare names must be unique, got {names}")
    env = environment(args.requests, args.step_ms, args.server_env, anchor_step=True)  # room for a round
    ours = System("ours", server_command(args.launcher or default_launcher(), args.step_ms,
                                         "{port}", []), env, "fake")
    return [ours] + [System(name, cmd, env, None) for name, cmd in args.compare]


def prompts_for(args: argparse.Namespace) -> list[str]:
    """The prompts ``frontend``'s load generator sends for the same ``--input-len``."""
    words = LengthRange(args.input_len, args.input_len)
    return [prompt for prompt, _ in make_text_workload(args.requests, words, LengthRange(1, 1))]


async def _model_of(ep: Endpoint, system: System) -> str:
    if system.model is not None:
        return system.model
    status, body = await request(ep, "GET", "/v1/models")
    try:
        return json.loads(body)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise SystemExit(f"error: {system.name!r} answered GET /v1/models with {status}: {body[:200]!r}")


def round_figures(results: list[StreamResult], cpu_ns: int) -> dict[str, Any]:
    """One system's figures for one round."""
    ttfts = [r.ttft for r in results if r.ok and r.ttft is not None]
    return {
        "requests": len(results),
        "errors": sum(1 for r in results if not r.ok),
        "cpu_us_per_request": cpu_ns / 1e3 / len(results),
        "ttft_ms": stats.summarize(ttfts, 1e3),
    }


def paired_ratios(rounds: list[dict[str, dict[str, Any]]], ours: str, other: str) -> dict[str, Any]:
    """Per-round ratios ``ours / other`` of CPU a request and TTFT p50 / p99, and their medians
    (< 1: ours used less, or answered sooner)."""
    out: dict[str, Any] = {}
    for key, get in (("cpu_us_per_request", lambda f: f["cpu_us_per_request"]),
                     ("ttft_p50", lambda f: f["ttft_ms"]["p50"]),
                     ("ttft_p99", lambda f: f["ttft_ms"]["p99"])):
        per_round = [get(r[ours]) / get(r[other]) for r in rounds if get(r[other]) > 0]
        out[key] = {"rounds": per_round,
                    "median": statistics.median(per_round) if per_round else float("nan")}
    return out


async def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import trio

    if not procstat.available():
        raise SystemExit("error: burst needs Linux /proc/<pid>/task/<tid>/schedstat")
    systems = systems_for(args)
    prompts = prompts_for(args)
    procs, endpoints, models, meters = [], {}, {}, {}
    try:
        for system in systems:
            port = free_port()
            log = workdir / f"server-{system.name}.log"
            procs.append((system, start_server(system, port, log), log))
            endpoints[system.name] = Endpoint("127.0.0.1", port, "/v1")
        for system, proc, log in procs:
            root = Endpoint("127.0.0.1", endpoints[system.name].port, "")
            await wait_healthy(root, proc, args.startup_timeout, log, system.name)
            models[system.name] = await _model_of(root, system)
            meters[system.name] = CpuMeter(proc.pid)
        rounds: list[dict[str, dict[str, Any]]] = []
        for k in range(args.rounds):
            order = systems[k % len(systems):] + systems[:k % len(systems)]
            results: dict[str, list[StreamResult]] = {s.name: [] for s in order}
            before = {s.name: meters[s.name].sample() for s in order}
            async with trio.open_nursery() as nursery:
                for i, prompt in enumerate(prompts):
                    for s in order:
                        body = {"model": models[s.name], "stream": True,
                                "max_tokens": args.max_tokens,
                                "messages": [{"role": "user", "content": prompt}]}
                        res = StreamResult()
                        results[s.name].append(res)
                        nursery.start_soon(stream_sse, endpoints[s.name], "/chat/completions",
                                           body, None, res)
            figures = {s.name: round_figures(results[s.name], meters[s.name].sample() - before[s.name])
                       for s in order}
            rounds.append(figures)
            line = "  ".join(f"{name} {f['cpu_us_per_request']:.0f} us/req, TTFT p99 "
                             f"{f['ttft_ms']['p99']:.0f} ms" for name, f in figures.items())
            print(f"[{k + 1}/{args.rounds}] {line}", flush=True)
            for system, proc, log in procs:
                if proc.poll() is not None:
                    raise SystemExit(f"error: the server {system.name!r} died; its log:\n"
                                     + log_tail(log))
            await trio.sleep(args.pause_s)
    finally:
        for _, proc, _ in procs:
            stop_server(proc, args.stop_timeout)
    return {
        "systems": {s.name: {"command": s.display()} for s in systems},
        "rounds": rounds,
        "ratios": {s.name: paired_ratios(rounds, "ours", s.name) for s in systems[1:]},
    }


def _median_of(rounds: list[dict[str, dict[str, Any]]], name: str, get: Any) -> float:
    return statistics.median(get(r[name]) for r in rounds)


def main(args: argparse.Namespace) -> int:
    import trio

    with tempfile.TemporaryDirectory(prefix="trio-infer-burst-") as tmp:
        result = trio.run(_run, args, Path(tmp))
    rounds = result["rounds"]
    print(f"\nburst: {args.requests} streams of {args.max_tokens} token(s) to each server at once, "
          f"{args.rounds} rounds, prompt {args.input_len} words, our step {args.step_ms:g} ms")
    print(f"{'system':<12} {'CPU us/req':>10} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'errors':>6}"
          "   (medians of the rounds)")
    for name in result["systems"]:
        errors = sum(r[name]["errors"] for r in rounds)
        print(f"{name:<12} {_median_of(rounds, name, lambda f: f['cpu_us_per_request']):>10.0f} "
              f"{_median_of(rounds, name, lambda f: f['ttft_ms']['p50']):>11.1f} "
              f"{_median_of(rounds, name, lambda f: f['ttft_ms']['p99']):>11.1f} {errors:>6}")
    print("\nours / theirs, median of the per-round ratios (< 1: ours used less or answered sooner)")
    print(f"{'vs':<12} {'CPU/req':>8} {'TTFT p50':>9} {'TTFT p99':>9}")
    for name, r in result["ratios"].items():
        print(f"{name:<12} {r['cpu_us_per_request']['median']:>8.3f} {r['ttft_p50']['median']:>9.3f} "
              f"{r['ttft_p99']['median']:>9.3f}")
    if args.output_json:
        result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.output_json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output_json}")
    return 1 if any(r[name]["errors"] for r in rounds for name in r) else 0


if __name__ == "__main__":
    sys.exit("run it as: python -m trio_infer.bench burst ...")
