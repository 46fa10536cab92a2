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
  "of it front end": the same for the server's own process alone (``serve``'s front end; the
  rest is its batching worker, whose stand-in model's forward is part of it; a one-process
  server's is all of it).
- loadgen CPU us/token and cores busy (server + load generator CPU over the window / its length):
  with 2 cores, "cores busy" near 2 means the figures are bounded by the machine, not the server.
- /health p99: latency of the probes sent during the load window.

``--compare NAME=CMD`` (repeatable) measures another server in the same run: ``CMD`` is a shell
command (``bash -c``) with ``{port}`` replaced by a free port, started in its own process group
with our server's environment (plus ``NULL_ENGINE_STEP_MS`` = ``--step-ms`` unless already set),
waited on until ``GET /health`` answers 200, measured at every level exactly like ours, then
stopped: SIGINT to its whole process group, SIGKILL to whatever is left of the group after
``--stop-timeout`` seconds. ``--repeats K`` interleaves: for each repetition, for each system (in
the order ours, then the compared ones, starting with the next system at each repetition:
:func:`run_order`), a fresh server runs every level. The tables and JSON give
per system per level the median of the K repetitions, and for each compared system the ratios
ours / theirs of tok/s, keep-up, gap p99 and server CPU us/token. With ``--compare`` requests go to
``/v1/chat/completions`` (``--endpoint``), which every OpenAI-compatible server serves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trio_infer.bench import procstat, stats
from trio_infer.bench.client import Endpoint, request
from trio_infer.bench.procstat import CpuMeter
from trio_infer.bench.serve import levels_spec
from trio_infer.bench.servers import (  # noqa: F401  (re-exported: the tests use frontend.*)
    System,
    free_port,
    log_tail,
    start_server,
    stop_server,
    wait_healthy,
)


def compare_spec(text: str) -> tuple[str, str]:
    name, sep, cmd = text.partition("=")
    name = name.strip()
    if not sep or not name or not cmd.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=CMD, got {text!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == "ours":
        raise argparse.ArgumentTypeError(
            f"NAME must be letters, digits, '_', '.', '-' and not 'ours', got {name!r}")
    if "{port}" not in cmd:
        raise argparse.ArgumentTypeError(f"the command of {name!r} has no {{port}} to substitute")
    return name, cmd


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="simulated compute per engine step; 0 = instant fake model")
    p.add_argument("--concurrency", type=levels_spec, default=[1, 64, 256], metavar="C1,C2,...")
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
    p.add_argument("--compare", type=compare_spec, action="append", default=[],
                   metavar="NAME=CMD",
                   help="also measure another server, started by the shell command CMD with {port} "
                   "substituted (repeatable); see docs/benchmarks.md")
    p.add_argument("--repeats", type=positive_int, default=1, metavar="K",
                   help="interleaved repetitions (each system runs every level once per "
                   "repetition); figures are medians over the K repetitions")
    p.add_argument("--endpoint", choices=("auto", "completions", "chat"), default="auto",
                   help="what the load generator streams from: /v1/completions or "
                   "/v1/chat/completions; auto = chat with --compare, else completions")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="seconds a server gets to exit after SIGINT before its process group is "
                   "killed")
    p.add_argument("--output-json", type=Path, default=None)


def default_launcher() -> str:
    import importlib.util

    return "cli" if importlib.util.find_spec("trio_infer.__main__") else "hypercorn"


def server_command(launcher: str, step_ms: float, port: int | str, extra: list[str]) -> list[str]:
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
    """Our server's environment for ``args``' widest level."""
    return environment(max(args.concurrency), args.step_ms, args.server_env)


def compare_env(args: argparse.Namespace) -> dict[str, str]:
    """A compared server's environment for ``args``' widest level (:func:`environment`)."""
    return environment(max(args.concurrency), args.step_ms, args.server_env, anchor_step=True)


def environment(top: int, step_ms: float, extra: list[str], anchor_step: bool = False) -> dict[str, str]:
    """A server's environment: the fake model with ``step_ms`` steps and room for ``top`` streams
    at once, then ``extra`` (``--server-env`` KEY=VALUE items). With ``anchor_step`` (a compared
    server) also the anchor's step-time variable, set to ``step_ms`` unless the environment
    already has it (the command may still set its own)."""
    env = dict(os.environ)
    env.update({
        "TRIO_INFER_MODEL": "fake",  # for the hypercorn launcher; the CLI gets --model fake
        "TRIO_INFER_FAKE_STEP_MS": str(step_ms),
        # Room for every stream at once: the front end is measured, not admission control.
        "TRIO_INFER_MAX_RUNNING": str(top),
        "TRIO_INFER_MAX_WAITING": str(max(256, 2 * top)),
        "TRIO_INFER_MAX_BATCHED_TOKENS": str(max(8192, 2 * top)),
    })
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --server-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    if anchor_step:
        env.setdefault("NULL_ENGINE_STEP_MS", f"{step_ms:g}")
    return env


def endpoint_for(args: argparse.Namespace) -> str:
    if args.endpoint != "auto":
        return args.endpoint
    return "chat" if args.compare else "completions"


def systems_for(args: argparse.Namespace) -> list[System]:
    launcher = args.launcher or default_launcher()
    ours = System("ours", server_command(launcher, args.step_ms, "{port}", args.server_arg),
                  server_env(args), "fake")
    names = [name for name, _ in args.compare]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: --compare names must be unique, got {names}")
    return [ours] + [System(name, cmd, compare_env(args), None) for name, cmd in args.compare]


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


async def _measure_level(args: argparse.Namespace, port: int, pid: int, concurrency: int,
                         workdir: Path, system: System | None = None, tag: str = "ours",
                         endpoint: str = "completions") -> dict[str, Any]:
    import trio


    root = Endpoint("127.0.0.1", port, "")
    meter = CpuMeter(pid)  # the server's whole process tree, children included
    cpu: list[tuple[float, int]] = []
    root_cpu: list[tuple[float, int]] = []  # the server process alone (ours: the front end)
    probes: list[tuple[float, float]] = []  # (sent at, unix; latency s)
    probe_errors = 0
    interval = args.health_interval_ms / 1000.0

    client_cpu: list[tuple[float, int]] = []
    client_meter: list[CpuMeter] = []  # set once the load generator runs

    async def sample_cpu() -> None:
        while True:
            now = time.time()
            cpu.append((now, meter.sample()))
            root_cpu.append((now, meter.root_ns()))
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
    out_json = workdir / f"load-{tag}-{concurrency}.json"
    model = system.model if system is not None else "fake"
    cmd = [
        sys.executable, "-m", "trio_infer.bench", "serve",
        "--base-url", f"http://127.0.0.1:{port}/v1", *(["--model", model] if model else []),
        "--endpoint", endpoint,
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
        err_log = workdir / f"load-{tag}-{concurrency}.log"
        with open(err_log, "wb") as err:
            loadgen = await trio.lowlevel.open_process(cmd, stdout=err, stderr=err)
            client_meter.append(CpuMeter(loadgen.pid))
            returncode = await loadgen.wait()
        await trio.sleep(0.1)  # one more CPU sample past the end
        nursery.cancel_scope.cancel()
    if returncode != 0 or not out_json.is_file():
        raise SystemExit(f"error: the load generator failed ({returncode}) against {tag}:\n"
                         + err_log.read_text(errors="replace")[-4000:])
    load = json.loads(out_json.read_text())
    t0, t1 = load["t_start_unix"], load["t_end_unix"]

    def load_ns(series: list[tuple[float, int]]) -> tuple[float, float, float]:
        """CPU ns of ``series`` over the load window, and that less the idle rate measured
        before it; and the idle rate (ns/s)."""
        idle = (_interp(series, idle_t1) - _interp(series, idle_t0)) / (idle_t1 - idle_t0)
        raw = _interp(series, t1) - _interp(series, t0)
        return raw, max(0.0, raw - idle * (t1 - t0)), idle

    raw_ns, net_ns, idle_rate = load_ns(cpu)
    root_ns = load_ns(root_cpu)[1]
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
        "expected_output_tokens": load["completed"] * args.output_len,
        "token_counts_from": load.get("token_counts_from", {}),
        "duration_s": load["duration_s"],
        "t_start_unix": t0,
        "t_end_unix": t1,
        "streamed_tok_s": tok_s,
        "keep_up": tok_s / ideal if ideal == ideal else math.nan,
        "ttft_ms": load["ttft_ms"],
        "chunk_gap_ms": load["chunk_gap_ms"],
        "itl_ms": load["itl_ms"],
        "chunks": load["chunks"],
        "http_chunks": load.get("http_chunks"),
        "server_cpu_s": raw_ns / 1e9,
        "server_idle_cpu_per_s": idle_rate / 1e9,
        "server_cpu_us_per_token": net_ns / 1e3 / tokens if tokens else math.nan,
        "server_cpu_us_per_token_raw": raw_ns / 1e3 / tokens if tokens else math.nan,
        # Of it, the server's own process (ours: the front end; the rest is the worker's).
        "front_end_cpu_us_per_token": root_ns / 1e3 / tokens if tokens else math.nan,
        "server_processes": len(meter.pids_seen),
        "client_cpu_us_per_token": client_ns / 1e3 / tokens if tokens else math.nan,
        "cpu_cores_busy": (raw_ns + client_ns) / 1e9 / (t1 - t0),
        # Near 1.0 for a single-process server means the server itself is the bottleneck (the GIL).
        "server_cores_busy": raw_ns / 1e9 / (t1 - t0),
        "health_ms": stats.summarize(during, 1e3),
        "health_probes": len(during),
        "health_errors": probe_errors,
    }


async def _run_system(args: argparse.Namespace, system: System, repeat: int,
                      workdir: Path, endpoint: str) -> dict[str, Any]:
    """Start ``system`` on a free port, run every level, stop its whole process group."""

    port = free_port()
    tag = f"{system.name}-r{repeat}"
    log = workdir / f"server-{tag}.log"
    started = time.time()
    proc = start_server(system, port, log)
    try:
        await wait_healthy(Endpoint("127.0.0.1", port, ""), proc, args.startup_timeout, log,
                            system.name)
        levels = []
        for c in args.concurrency:
            print(f"[{repeat + 1}/{args.repeats}] {system.name}: {c} streams x {args.output_len} "
                  f"tokens, step {args.step_ms:g} ms ...", flush=True)
            levels.append(await _measure_level(args, port, proc.pid, c, workdir, system, tag,
                                               endpoint))
            if proc.poll() is not None:
                raise SystemExit(f"error: the server {system.name!r} died; its log:\n"
                                 + log_tail(log))
    finally:
        stop_server(proc, args.stop_timeout)
    return {"repeat": repeat, "system": system.name, "port": port, "t_start_unix": started,
            "t_end_unix": time.time(), "levels": levels}


def run_order(systems: list[Any], repeats: int) -> list[tuple[int, Any]]:
    """The (repetition, system) runs in order: each repetition runs every system once, and
    repetition ``r`` starts with system ``r`` (round-robin), so that over ``len(systems)``
    repetitions each system runs first once.

    Why: the systems run one after another, and on a 2-core VM the first run of a repetition
    came out slower than the same server run later in it (three runs in the order ours (``serve``),
    bare hypercorn, anchor: ours' TTFT p99 was 1.14-1.22x bare's; a fourth with bare first:
    bare's was 1.11x ours'; Xeon, 2026-12-06). A
    fixed order puts that on the first system every time: ours, when its figures are the ones
    compared."""
    n = len(systems)
    return [(r, systems[(r + i) % n]) for r in range(repeats) for i in range(n)]


async def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:

    if not procstat.available():
        raise SystemExit("error: frontend needs Linux /proc/<pid>/task/<tid>/schedstat")
    systems = systems_for(args)
    endpoint = endpoint_for(args)
    runs: dict[str, list[list[dict[str, Any]]]] = {s.name: [] for s in systems}
    schedule = []
    for repeat, system in run_order(systems, args.repeats):
        res = await _run_system(args, system, repeat, workdir, endpoint)
        runs[system.name].append(res.pop("levels"))
        schedule.append(res)
    return {
        "endpoint": endpoint,
        "systems": {s.name: {"command": s.display(), "runs": runs[s.name],
                             "levels": median_levels(runs[s.name])} for s in systems},
        "schedule": schedule,
    }


# -- medians over repetitions and ratios ----------------------------------------------------------

# Totals over the repetitions, not medians: an error in any repetition must show.
_SUMMED = {"errors", "health_errors"}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _combine(values: list[Any], key: str | None = None) -> Any:
    first = values[0]
    if key == "error_kinds":
        merged: dict[str, int] = {}
        for v in values:
            for kind, n in (v or {}).items():
                merged[kind] = merged.get(kind, 0) + n
        return merged
    if isinstance(first, dict):
        keys = list(first)
        for v in values[1:]:
            keys += [k for k in v if k not in keys]
        return {k: _combine([v.get(k) for v in values], k) for k in keys}
    if _is_number(first):
        nums = [v for v in values if _is_number(v) and not math.isnan(v)]
        if key in _SUMMED:
            return sum(nums)
        if nums and all(isinstance(v, int) for v in nums):
            return statistics.median_low(nums)  # counts stay integers (one of the runs' values)
        return statistics.median(nums) if nums else math.nan
    return first


def median_levels(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per level, every numeric figure's median over the repetitions (``errors``,
    ``health_errors`` and ``error_kinds`` are totals); ``repeats`` = how many."""
    out = []
    for per_level in zip(*runs):
        combined = _combine(list(per_level))
        combined["repeats"] = len(per_level)
        out.append(combined)
    return out


def _ratio(a: Any, b: Any) -> float:
    if not (_is_number(a) and _is_number(b)) or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


RATIO_FIELDS = (
    ("streamed_tok_s", lambda lv: lv["streamed_tok_s"]),
    ("keep_up", lambda lv: lv["keep_up"]),
    ("chunk_gap_p99_ms", lambda lv: lv["chunk_gap_ms"]["p99"]),
    ("server_cpu_us_per_token", lambda lv: lv["server_cpu_us_per_token"]),
)


def ratios(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level, ours / theirs of the medians: > 1 is better for ours for tok/s and keep-up,
    worse for gap p99 and server CPU us/token."""
    out = []
    for a, b in zip(ours, theirs):
        row: dict[str, Any] = {"concurrency": a["concurrency"]}
        for name, get in RATIO_FIELDS:
            row[name] = _ratio(get(a), get(b))
        out.append(row)
    return out


# -- output ---------------------------------------------------------------------------------------

TABLE_HEADERS = ["streams", "reqs", "errors", "tok/s", "keep-up", "TTFT p50 ms", "TTFT p99 ms",
                 "gap p50 ms", "gap p99 ms", "server CPU us/tok", "of it front end",
                 "loadgen CPU us/tok",
                 "cores busy", "/health p99 ms"]


def _table_row(lv: dict[str, Any]) -> list[Any]:
    return [
        lv["concurrency"], lv["streams"], lv["errors"], lv["streamed_tok_s"], lv["keep_up"],
        lv["ttft_ms"]["p50"], lv["ttft_ms"]["p99"], lv["chunk_gap_ms"]["p50"],
        lv["chunk_gap_ms"]["p99"], lv["server_cpu_us_per_token"],
        lv.get("front_end_cpu_us_per_token", math.nan), lv["client_cpu_us_per_token"],
        lv["cpu_cores_busy"], lv["health_ms"]["p99"],
    ]


def main(args: argparse.Namespace) -> int:
    import trio

    with tempfile.TemporaryDirectory(prefix="trio-infer-frontend-") as tmp:
        res = trio.run(_run, args, Path(tmp))
    step = args.step_ms
    systems = res["systems"]
    ours = systems["ours"]["levels"]
    print(f"\nfrontend: fake model, step {step:g} ms, {args.output_len} tokens per stream, "
          f"prompt {args.input_len} words")
    several = len(systems) > 1 or args.repeats > 1
    for name, sysres in systems.items():
        if several:
            what = f"median of {args.repeats} interleaved runs" if args.repeats > 1 else "one run"
            print(f"\n{name} ({what}): {sysres['command']}")
        stats.print_table(TABLE_HEADERS, [_table_row(lv) for lv in sysres["levels"]])
    all_ratios = {name: ratios(ours, sysres["levels"])
                  for name, sysres in systems.items() if name != "ours"}
    if all_ratios:
        print("\nours / theirs (tok/s, keep-up: > 1 = ours better; gap p99, server CPU: "
              "< 1 = ours better)")
        rows = []
        for name, per_level in all_ratios.items():
            for r in per_level:
                rows.append([r["concurrency"], name] + [r[f] for f, _ in RATIO_FIELDS])
        stats.print_table(["streams", "vs", "tok/s", "keep-up", "gap p99", "server CPU us/tok"],
                          rows)
    for name, sysres in systems.items():
        for lv in sysres["levels"]:
            counted = lv.get("token_counts_from") or {}
            if counted.get("events"):
                print(f"note: {name} sent no usage chunk; its tokens at {lv['concurrency']} streams "
                      f"are counted as text-carrying events ({lv['output_tokens']:g} counted, "
                      f"{lv['expected_output_tokens']:g} asked for)")
    if args.output_json:
        stats.write_json(args.output_json, {
            "config": {"step_ms": step, "output_len": args.output_len, "input_len": args.input_len,
                       "concurrency": args.concurrency, "server_env": args.server_env,
                       "server_args": args.server_arg, "repeats": args.repeats,
                       "endpoint": res["endpoint"],
                       "compare": {name: cmd for name, cmd in args.compare}},
            "levels": ours,
            "systems": systems,
            "ratios": all_ratios,
            "schedule": res["schedule"],
            "environment": stats.environment(),
        })
        print(f"wrote {args.output_json}")
    errors = sum(lv["errors"] for sysres in systems.values() for lv in sysres["levels"])
    return 1 if errors else 0
