"""``frontend``: our HTTP stack alone, over the fake model with simulated step time.

Three processes: the server (``python -m trio_infer serve`` on loopback, a random
free port, started with ``--model fake --fake-step-ms`` so each engine step takes
``--step-ms``; 0 = the instant fake model), the load generator (``python -m trio_infer.bench
serve`` as a subprocess, so its CPU is not the server's), and this one, which starts them, probes
``GET /health`` every ``--health-interval-ms`` and samples the server's CPU time.

For each concurrency (``--concurrency 1,64,256``) the load generator keeps that many streams of
``--output-len`` tokens in flight (``--rounds`` streams per slot). Figures per level:

- streamed tok/s: completion tokens (the server's usage counts) / load duration.
- keep-up: streamed tok/s / (concurrency x 1000 / step-ms): 1.0 means every stream got a token
  every step; n/a for an instant model.
- TTFT, inter-chunk gap (gap between socket reads that delivered tokens) p50 / p99.
- server CPU us/token: the server process tree's CPU time (user + system, all threads, from
  /proc schedstat) over the load window, minus what it burns idle at the same probe rate
  (measured for ``--idle-s`` before each level), per streamed token. The raw figure is in the JSON.
- loadgen CPU us/token and cores busy (server + load generator CPU over the window / its length):
  with 2 cores, "cores busy" near 2 means the figures are bounded by the machine, not the server.
- /health p99: latency of the probes sent during the load window.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trio_infer.bench import stats


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="simulated compute per engine step; 0 = instant fake model")
    p.add_argument("--concurrency", type=_int_list, default=[1, 64, 256], metavar="C1,C2,...")
    p.add_argument("--output-len", type=int, default=256, help="tokens per stream")
    p.add_argument("--input-len", type=int, default=16, help="prompt words per stream")
    p.add_argument("--rounds", type=int, default=0,
                   help="streams per concurrency slot; 0 = 1 with --step-ms, else enough for "
                   "about 16k tokens per level")
    p.add_argument("--health-interval-ms", type=float, default=50.0)
    p.add_argument("--idle-s", type=float, default=1.0,
                   help="seconds of idle CPU measured before each level")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the server (e.g. TRIO_INFER_STREAM_INTERVAL=2)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `python -m trio_infer serve` (repeatable)")
    p.add_argument("--launcher", choices=("cli", "hypercorn"), default=None,
                   help="start the server as `python -m trio_infer serve` (cli, the default when "
                   "it exists) or as `hypercorn trio_infer.app:app --worker-class trio`")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--output-json", type=Path, default=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_launcher() -> str:
    import importlib.util

    return "cli" if importlib.util.find_spec("trio_infer.__main__") else "hypercorn"


def server_command(launcher: str, step_ms: float, port: int, extra: list[str]) -> list[str]:
    """The server process: ``--model fake`` with ``fake_step_ms`` of simulated compute per step
    (the hypercorn launcher gets both through the environment, see :func:`server_env`)."""
    if launcher == "hypercorn":
        return [
            sys.executable, "-m", "hypercorn", "trio_infer.app:app", "--worker-class", "trio",
            "--workers", "0", "--bind", f"127.0.0.1:{port}", *extra,
        ]
    return [
        sys.executable, "-m", "trio_infer", "serve", "--model", "fake",
        "--fake-step-ms", str(step_ms), "--host", "127.0.0.1", "--port", str(port), *extra,
    ]


def server_env(args: argparse.Namespace) -> dict[str, str]:
    top = max(args.concurrency)
    env = dict(os.environ)
    env.update({
        "TRIO_INFER_MODEL": "fake",  # for the hypercorn launcher; the CLI gets --model fake
        "TRIO_INFER_FAKE_STEP_MS": str(args.step_ms),
        # Room for every stream at once: the front end is measured, not admission control.
        "TRIO_INFER_MAX_RUNNING": str(top),
        "TRIO_INFER_MAX_WAITING": str(max(256, 2 * top)),
        "TRIO_INFER_MAX_BATCHED_TOKENS": str(max(8192, 2 * top)),
    })
    for item in args.server_env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --server-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def rounds_for(args: argparse.Namespace, concurrency: int) -> int:
    if args.rounds:
        return args.rounds
    if args.step_ms > 0:
        return 1
    return max(1, math.ceil(16384 / (concurrency * args.output_len)))


def _interp(series: list[tuple[float, int]], t: float) -> float:
    """Value of a sampled cumulative counter at time ``t`` (linear between samples)."""
    if not series:
        return math.nan
    if t <= series[0][0]:
        return series[0][1]
    for (t0, v0), (t1, v1) in zip(series, series[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
    return series[-1][1]


async def _wait_healthy(ep: Any, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    import trio

    from trio_infer.bench.client import request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with {proc.returncode}; its log:\n"
                             + log.read_text()[-4000:])
        try:
            status, _ = await request(ep, "GET", "/health")
            if status == 200:
                return
        except OSError:
            pass
        await trio.sleep(0.2)
    raise SystemExit(f"error: the server did not become healthy in {timeout:g} s; log: {log}")


async def _measure_level(args: argparse.Namespace, port: int, pid: int, concurrency: int,
                         workdir: Path) -> dict[str, Any]:
    import trio

    from trio_infer.bench.client import Endpoint, request
    from trio_infer.bench.procstat import CpuMeter

    root = Endpoint("127.0.0.1", port, "")
    meter = CpuMeter(pid)
    cpu: list[tuple[float, int]] = []
    probes: list[tuple[float, float]] = []  # (sent at, unix; latency s)
    probe_errors = 0
    interval = args.health_interval_ms / 1000.0

    client_cpu: list[tuple[float, int]] = []
    client_meter: list[CpuMeter] = []  # set once the load generator runs

    async def sample_cpu() -> None:
        while True:
            now = time.time()
            cpu.append((now, meter.sample()))
            if client_meter:
                client_cpu.append((now, client_meter[0].sample()))
            await trio.sleep(0.05)

    async def probe() -> None:
        nonlocal probe_errors
        while True:
            sent = time.time()
            t = time.perf_counter()
            try:
                status, _ = await request(root, "GET", "/health")
                if status != 200:
                    probe_errors += 1
            except OSError:
                probe_errors += 1
            probes.append((sent, time.perf_counter() - t))
            await trio.sleep(max(0.0, interval - (time.perf_counter() - t)))

    rounds = rounds_for(args, concurrency)
    out_json = workdir / f"load-{concurrency}.json"
    cmd = [
        sys.executable, "-m", "trio_infer.bench", "serve",
        "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "fake",
        "--num-prompts", str(concurrency * rounds), "--concurrency", str(concurrency),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--ignore-eos", "--output-json", str(out_json), "--quiet",
    ]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_cpu)
        nursery.start_soon(probe)
        idle_t0 = time.time()
        await trio.sleep(args.idle_s)
        idle_t1 = time.time()
        err_log = workdir / f"load-{concurrency}.log"
        with open(err_log, "wb") as err:
            loadgen = await trio.lowlevel.open_process(cmd, stdout=err, stderr=err)
            client_meter.append(CpuMeter(loadgen.pid))
            returncode = await loadgen.wait()
        await trio.sleep(0.1)  # one more CPU sample past the end
        nursery.cancel_scope.cancel()
    if returncode != 0 or not out_json.is_file():
        raise SystemExit(f"error: the load generator failed ({returncode}):\n"
                         + err_log.read_text(errors="replace")[-4000:])
    load = json.loads(out_json.read_text())
    t0, t1 = load["t_start_unix"], load["t_end_unix"]
    idle_rate = (_interp(cpu, idle_t1) - _interp(cpu, idle_t0)) / (idle_t1 - idle_t0)
    raw_ns = _interp(cpu, t1) - _interp(cpu, t0)
    net_ns = max(0.0, raw_ns - idle_rate * (t1 - t0))
    client_ns = _interp(client_cpu, t1) - _interp(client_cpu, t0)
    tokens = load["output_tokens"]
    during = [lat for sent, lat in probes if t0 <= sent <= t1]
    tok_s = load["output_throughput"]
    ideal = concurrency * 1000.0 / args.step_ms if args.step_ms > 0 else math.nan
    return {
        "concurrency": concurrency,
        "streams": load["num_prompts"],
        "completed": load["completed"],
        "errors": load["errors"],
        "error_kinds": load["error_kinds"],
        "output_tokens": tokens,
        "duration_s": load["duration_s"],
        "streamed_tok_s": tok_s,
        "keep_up": tok_s / ideal if ideal == ideal else math.nan,
        "ttft_ms": load["ttft_ms"],
        "chunk_gap_ms": load["chunk_gap_ms"],
        "itl_ms": load["itl_ms"],
        "chunks": load["chunks"],
        "server_cpu_s": raw_ns / 1e9,
        "server_idle_cpu_per_s": idle_rate / 1e9,
        "server_cpu_us_per_token": net_ns / 1e3 / tokens if tokens else math.nan,
        "server_cpu_us_per_token_raw": raw_ns / 1e3 / tokens if tokens else math.nan,
        "client_cpu_us_per_token": client_ns / 1e3 / tokens if tokens else math.nan,
        "cpu_cores_busy": (raw_ns + client_ns) / 1e9 / (t1 - t0),
        # One Python process: near 1.0 means the server itself is the bottleneck (the GIL).
        "server_cores_busy": raw_ns / 1e9 / (t1 - t0),
        "health_ms": stats.summarize(during, 1e3),
        "health_probes": len(during),
        "health_errors": probe_errors,
    }


async def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from trio_infer.bench.client import Endpoint
    from trio_infer.bench.procstat import available

    if not available():
        raise SystemExit("error: frontend needs Linux /proc/<pid>/task/<tid>/schedstat")
    port = free_port()
    log = workdir / "server.log"
    launcher = args.launcher or default_launcher()
    cmd = server_command(launcher, args.step_ms, port, args.server_arg)
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=server_env(args), stdout=log_file, stderr=subprocess.STDOUT)
    try:
        await _wait_healthy(Endpoint("127.0.0.1", port, ""), proc, args.startup_timeout, log)
        levels = []
        for c in args.concurrency:
            print(f"{c} streams x {args.output_len} tokens, step {args.step_ms:g} ms ...", flush=True)
            levels.append(await _measure_level(args, port, proc.pid, c, workdir))
            if proc.poll() is not None:
                raise SystemExit(f"error: the server died; log:\n{log.read_text()[-4000:]}")
        return {"levels": levels, "server_command": cmd}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(args: argparse.Namespace) -> int:
    import trio

    with tempfile.TemporaryDirectory(prefix="trio-infer-frontend-") as tmp:
        res = trio.run(_run, args, Path(tmp))
    step = args.step_ms
    print(f"\nfrontend: fake model, step {step:g} ms, {args.output_len} tokens per stream, "
          f"prompt {args.input_len} words")
    rows = []
    for lv in res["levels"]:
        rows.append([
            lv["concurrency"], lv["streams"], lv["errors"], lv["streamed_tok_s"], lv["keep_up"],
            lv["ttft_ms"]["p50"], lv["ttft_ms"]["p99"], lv["chunk_gap_ms"]["p50"],
            lv["chunk_gap_ms"]["p99"], lv["server_cpu_us_per_token"], lv["client_cpu_us_per_token"],
            lv["cpu_cores_busy"], lv["health_ms"]["p99"],
        ])
    stats.print_table(
        ["streams", "reqs", "errors", "tok/s", "keep-up", "TTFT p50 ms", "TTFT p99 ms",
         "gap p50 ms", "gap p99 ms", "server CPU us/tok", "loadgen CPU us/tok", "cores busy",
         "/health p99 ms"],
        rows,
    )
    if args.output_json:
        stats.write_json(args.output_json, {
            "config": {"step_ms": step, "output_len": args.output_len, "input_len": args.input_len,
                       "concurrency": args.concurrency, "server_env": args.server_env,
                       "server_args": args.server_arg},
            "levels": res["levels"],
            "environment": stats.environment(),
        })
        print(f"wrote {args.output_json}")
    errors = sum(lv["errors"] for lv in res["levels"])
    return 1 if errors else 0
