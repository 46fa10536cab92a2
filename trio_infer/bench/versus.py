"""``serve --baseline llama-server`` (and ``--variant``): our server against llama.cpp's own
server, end to end, on the same GGUF file, the same requests, interleaved.

Systems: ``ours`` (``python -m trio_infer serve --model FILE`` at its defaults), each
``--variant NAME='ARGS'`` (ours with those extra ``serve`` flags, e.g. ``--torch-threads 2``), and
with ``--baseline llama-server`` llama.cpp's server (:mod:`trio_infer.bench.llamaserver`: built
once, cached) on the same file with ``-t 2`` (``--llama-threads``) and ``-np C`` at each
concurrency C, ``-c`` = C x the context one request needs. Only one server runs at a time: it is
started, measured at every concurrency level (llama-server: started again per level, since its
slots are the concurrency), stopped, then the next one. ``--rounds`` repeats that, each round
starting with the next system in turn, so a change in the machine's load hits every system alike;
the figures are medians over the rounds.

Every system gets the same requests: per round and level the same seeded prompts (random common
English words, ``--input-len`` words, about one token each), streamed to
``/v1/chat/completions`` with ``max_tokens`` = ``--output-len``, ``temperature`` 0,
``ignore_eos`` (both servers accept it; the JSON's ``output_tokens`` against
``expected_output_tokens`` shows they honoured it), ``stream_options.include_usage``. Prompts
differ between levels and rounds, so no server reuses a cached prefix beyond the chat template.
Before its levels each server gets one untimed short request (warm-up). ``--num-prompts`` per level
is ``--requests-per-slot`` x C (at least 8) unless given.

Figures per level (the ``serve`` load generator's, see its doc): output tok/s, TTFT p50/p99, ITL
p50/p99 (gaps between token events, pooled), TPOT p50, errors; and the CPU the server's process
tree used over the level in cores (ours split into the front end, the process started, and the
rest, its batching worker). Ratios: tok/s ours / theirs (> 1: ours ahead), latencies theirs /
ours (> 1: ours faster).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from trio_infer.bench import llamaserver, stats
from trio_infer.bench.client import Endpoint, request
from trio_infer.bench.procstat import thread_cpu_ns
from trio_infer.bench.serve import run_load
from trio_infer.bench.servers import System, free_port, log_tail, start_server, stop_server
from trio_infer.bench.workload import LengthRange

FIGURES = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "tpot_p50_ms")


@dataclass
class Target:
    """A system of the comparison."""

    name: str
    kind: str  # "ours" or "llama-server"
    argv: list[str] = field(default_factory=list)  # with {port}; llama-server: built per level
    env: dict[str, str] = field(default_factory=dict)


def model_file(args: argparse.Namespace) -> str:
    """The GGUF file every system serves (default: the default model's). Without llama-server,
    anything ``serve --model`` takes (``fake`` for the smoke tests)."""
    if args.model_file:
        path = Path(args.model_file).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            return str(path.resolve())
        if args.baseline == "llama-server":
            raise SystemExit(f"error: llama-server needs a .gguf --model-file, got {path}")
        return str(path.resolve()) if path.exists() else args.model_file
    from trio_infer.models.default_model import default_cache_dir, require_default_model

    try:
        return str(require_default_model(default_cache_dir()))
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None


def ctx_per_slot(args: argparse.Namespace) -> int:
    """Context for one request: its prompt (words -> tokens, with slack for the chat template and
    words that take two tokens) and its output, rounded up to 256."""
    if args.ctx_per_slot:
        return args.ctx_per_slot
    need = int(args.input_len.hi * 1.5) + 64 + args.output_len.hi
    return 256 * math.ceil(need / 256)


def targets(args: argparse.Namespace, path: str) -> list[Target]:
    env = dict(os.environ)
    ours_argv = [sys.executable, "-m", "trio_infer", "serve", "--model", path,
                 "--host", "127.0.0.1", "--port", "{port}", *args.serve_arg]
    out = [Target("ours", "ours", ours_argv, env)]
    for name, extra in args.variant:
        out.append(Target(name, "ours", ours_argv + extra, env))
    if args.baseline == "llama-server":
        out.append(Target("llama-server", "llama-server", [], env))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: system names must be unique, got {names}")
    return out


class TreeCpu:
    """CPU nanoseconds of a process tree, split into the leader and the rest, sampled often
    enough that exited threads lose little (see :mod:`trio_infer.bench.procstat`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.last: dict[tuple[int, int], int] = {}
        self.sample()
        self.base = dict(self.last)

    def sample(self) -> None:
        self.last.update(thread_cpu_ns(self.pid))

    def split(self) -> tuple[float, float]:
        """(leader, rest) seconds since creation."""
        lead = rest = 0
        for key, v in self.last.items():
            d = v - self.base.get(key, 0)
            if key[0] == self.pid:
                lead += d
            else:
                rest += d
        return lead / 1e9, rest / 1e9


async def _first_model(ep: Endpoint) -> str:
    status, body = await request(ep, "GET", "/models")
    if status != 200:
        raise SystemExit(f"error: GET /v1/models answered {status}")
    return json.loads(body)["data"][0]["id"]


async def wait_healthy(port: int, proc: Any, timeout: float, log: Path, name: str) -> float:
    ep = Endpoint("127.0.0.1", port, "")
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"error: {name} exited with {proc.returncode}; its log:\n"
                             + log_tail(log))
        with trio.move_on_after(2.0):
            try:
                status, _ = await request(ep, "GET", "/health")
                if status == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
        await trio.sleep(0.1)
    raise SystemExit(f"error: {name} was not healthy after {timeout:g} s; its log:\n"
                     + log_tail(log))


def _load_args(args: argparse.Namespace, port: int, model: str, concurrency: int, num: int,
               seed: int, input_len: LengthRange, output_len: LengthRange) -> argparse.Namespace:
    return argparse.Namespace(
        base_url=f"http://127.0.0.1:{port}/v1", model=model, endpoint="chat", api_key=None,
        num_prompts=num, concurrency=concurrency, request_rate=math.inf, input_len=input_len,
        output_len=output_len, ignore_eos=True, shared_prefix_len=0, seed=seed,
        timeout=args.timeout,
    )


def prompts_for(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or max(8, args.requests_per_slot * concurrency)


async def _measure(args: argparse.Namespace, port: int, pid: int, model: str, concurrency: int,
                   seed: int) -> dict[str, Any]:
    num = prompts_for(args, concurrency)
    cpu = TreeCpu(pid)
    load_before = _loadavg()
    res: dict[str, Any] = {}

    async def sampler() -> None:
        while True:
            await trio.sleep(0.1)
            cpu.sample()

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sampler)
        res = await run_load(_load_args(args, port, model, concurrency, num, seed,
                                        args.input_len, args.output_len))
        nursery.cancel_scope.cancel()
    cpu.sample()
    wall = time.perf_counter() - t0
    lead, rest = cpu.split()
    expected = num * args.output_len.hi if args.output_len.lo == args.output_len.hi else None
    return {
        "concurrency": concurrency,
        "num_prompts": num,
        "seed": seed,
        "completed": res["completed"],
        "errors": res["errors"],
        "error_kinds": res["error_kinds"],
        "prompt_tokens": res["prompt_tokens"],
        "output_tokens": res["output_tokens"],
        "expected_output_tokens": expected,
        "token_counts_from": res["token_counts_from"],
        "duration_s": res["duration_s"],
        "output_tok_s": res["output_throughput"],
        "ttft_p50_ms": res["ttft_ms"]["p50"],
        "ttft_p99_ms": res["ttft_ms"]["p99"],
        "itl_p50_ms": res["itl_ms"]["p50"],
        "itl_p99_ms": res["itl_ms"]["p99"],
        "tpot_p50_ms": res["tpot_ms"]["p50"],
        "e2e_p50_ms": res["e2e_ms"]["p50"],
        "server_cores": (lead + rest) / wall,
        # Output tokens per CPU-second the server got: on a shared machine a system measured
        # while others took the cores gets fewer of them, which this figure discounts.
        "output_tok_s_per_core": res["output_throughput"] / max((lead + rest) / wall, 1e-9),
        "server_cores_leader": lead / wall,  # ours: the front end
        "server_cores_children": rest / wall,  # ours: the batching worker
        "loadavg_1m": [load_before, _loadavg()],
        "t_start_unix": res["t_start_unix"],
        "t_end_unix": res["t_end_unix"],
    }


async def _warm_up(args: argparse.Namespace, port: int, model: str, seed: int) -> None:
    res = await run_load(_load_args(args, port, model, 1, 1, seed, LengthRange(16, 16),
                                    LengthRange(8, 8)))
    if not res["completed"]:
        raise SystemExit(f"error: the warm-up request failed: {res['error_kinds']}")


async def run_system(args: argparse.Namespace, target: Target, path: str, round_i: int,
                     workdir: Path) -> list[dict[str, Any]]:
    """Start ``target``, run every level, stop it; llama-server is started once per level."""
    levels: list[dict[str, Any]] = []
    groups: list[list[int]] = (
        [[c] for c in args.levels] if target.kind == "llama-server" else [list(args.levels)]
    )
    for group in groups:
        port = free_port()
        if target.kind == "llama-server":
            argv = llamaserver.command(args.llama_server_binary, Path(path), port,
                                       threads=args.llama_threads, slots=group[0],
                                       ctx_per_slot=ctx_per_slot(args),
                                       extra=args.llama_server_arg)
        else:
            argv = [a.replace("{port}", str(port)) for a in target.argv]
        log = workdir / f"{target.name}-r{round_i}-c{group[0]}.log"
        proc = start_server(System(target.name, argv, target.env, None), port, log)
        try:
            healthy = await wait_healthy(port, proc, args.startup_timeout, log, target.name)
            ep = Endpoint("127.0.0.1", port, "/v1")
            model = await _first_model(ep)
            await _warm_up(args, port, model, seed=10_000 + round_i)
            for c in group:
                seed = args.seed + 1000 * round_i + c
                level = await _measure(args, port, proc.pid, model, c, seed)
                level.update(system=target.name, round=round_i, healthy_after_s=healthy,
                             command=" ".join(argv))
                _progress(level)
                levels.append(level)
        finally:
            stop_server(proc, args.stop_timeout)
    return levels


def _progress(level: dict[str, Any]) -> None:
    note = ""
    if level["expected_output_tokens"] and level["output_tokens"] != level["expected_output_tokens"]:
        note = f" (expected {level['expected_output_tokens']} output tokens!)"
    print(f"  round {level['round'] + 1} {level['system']:>14} c={level['concurrency']:<3} "
          f"{level['output_tok_s']:7.1f} tok/s  TTFT p50 {level['ttft_p50_ms']:7.1f} ms  "
          f"ITL p50 {level['itl_p50_ms']:6.1f} ms  p99 {level['itl_p99_ms']:6.1f} ms  "
          f"errors {level['errors']}  cores {level['server_cores']:.2f}{note}", flush=True)


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def medians(runs: list[dict[str, Any]], names: list[str], levels: list[int]) -> dict[str, Any]:
    """{system: {concurrency: {figure: median over rounds, ...}}}"""
    keys = (*FIGURES, "server_cores", "server_cores_leader", "server_cores_children",
            "e2e_p50_ms", "output_tok_s_per_core")
    out: dict[str, Any] = {}
    for name in names:
        per: dict[str, Any] = {}
        for c in levels:
            rows = [r for r in runs if r["system"] == name and r["concurrency"] == c]
            if not rows:
                continue
            med = {k: _median([r[k] for r in rows]) for k in keys}
            med["errors"] = sum(r["errors"] for r in rows)
            med["output_tokens"] = [r["output_tokens"] for r in rows]
            med["expected_output_tokens"] = rows[0]["expected_output_tokens"]
            med["rounds"] = len(rows)
            per[str(c)] = med
        out[name] = per
    return out


def _median(values: list[float]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def ratios(med: dict[str, Any], ours: str, theirs: str) -> dict[str, Any]:
    """Per level: tok/s ours / theirs; latencies theirs / ours (> 1: ours better in both)."""
    out: dict[str, Any] = {}
    for c, a in med.get(ours, {}).items():
        b = med.get(theirs, {}).get(c)
        if b is None:
            continue
        r: dict[str, float] = {"output_tok_s": _div(a["output_tok_s"], b["output_tok_s"])}
        for k in FIGURES[1:]:
            r[k] = _div(b[k], a[k])
        r["output_tok_s_per_core"] = _div(a.get("output_tok_s_per_core"),
                                          b.get("output_tok_s_per_core"))
        out[c] = r
    return out


def _div(a: float, b: float) -> float:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


def print_tables(med: dict[str, Any], all_ratios: dict[str, Any], levels: list[int]) -> None:
    for c in levels:
        key = str(c)
        print(f"\nconcurrency {c} (medians over rounds)")
        rows = []
        for name, per in med.items():
            m = per.get(key)
            if m is None:
                continue
            rows.append([name, m["output_tok_s"], m["ttft_p50_ms"], m["ttft_p99_ms"],
                         m["itl_p50_ms"], m["itl_p99_ms"], m["tpot_p50_ms"],
                         m["server_cores"], m["server_cores_leader"],
                         m["output_tok_s_per_core"], m["errors"]])
        stats.print_table(["system", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                           "ITL p99 ms", "TPOT p50 ms", "cores", "front end", "tok/s/core",
                           "errors"], rows)
        rrows = []
        for label, per in all_ratios.items():
            r = per.get(key)
            if r is None:
                continue
            rrows.append([label, r["output_tok_s"], r["ttft_p50_ms"], r["ttft_p99_ms"],
                          r["itl_p50_ms"], r["itl_p99_ms"], r["tpot_p50_ms"],
                          r["output_tok_s_per_core"]])
        if rrows:
            print("ratios (> 1: the first system better): tok/s first/second, latencies "
                  "second/first")
            stats.print_table(["first vs second", "tok/s", "TTFT p50", "TTFT p99", "ITL p50",
                               "ITL p99", "TPOT p50", "tok/s/core"], rrows)


async def _run(args: argparse.Namespace, path: str, systems: list[Target],
               workdir: Path) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    schedule: list[dict[str, Any]] = []
    for r in range(args.rounds):
        k = r % len(systems)
        for target in systems[k:] + systems[:k]:
            t = time.time()
            runs += await run_system(args, target, path, r, workdir)
            schedule.append({"round": r, "system": target.name, "t_start_unix": t,
                             "t_end_unix": time.time()})
            if args.output_json:  # what is done so far survives an interrupted run
                stats.write_json(args.output_json, {"partial": True, "runs": runs,
                                                    "schedule": schedule})
    args._schedule = schedule
    return runs


def main(args: argparse.Namespace) -> int:
    path = model_file(args)
    systems = targets(args, path)
    if args.baseline == "llama-server":
        args.llama_server_binary = llamaserver.require()
    levels = args.levels
    print(f"model {path}; systems: {', '.join(t.name for t in systems)}; concurrency "
          f"{','.join(map(str, levels))}; chat, {args.input_len} words in, {args.output_len} "
          f"tokens out (ignore_eos), {args.rounds} interleaved rounds", flush=True)
    if args.baseline == "llama-server":
        print(f"llama-server: {args.llama_server_binary} -t {args.llama_threads} -np C "
              f"-c C*{ctx_per_slot(args)}", flush=True)
    # Started in the background by a non-interactive shell, this process inherits SIGINT
    # ignored; Ctrl-C / SIGINT must still stop it and, through trio, the server it runs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="bench-versus-") as tmp:
        workdir = Path(args.log_dir) if args.log_dir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        runs = trio.run(_run, args, path, systems, workdir)
    names = [t.name for t in systems]
    med = medians(runs, names, levels)
    all_ratios: dict[str, Any] = {}
    if args.baseline == "llama-server":
        for name in names[:-1]:
            all_ratios[f"{name} vs llama-server"] = ratios(med, name, "llama-server")
    for name in names[1:]:
        if name != "llama-server":
            all_ratios[f"{name} vs ours"] = ratios(med, name, "ours")
    print_tables(med, all_ratios, levels)
    bad = [r for r in runs if r["errors"] or (r["expected_output_tokens"] and
                                             r["output_tokens"] != r["expected_output_tokens"])]
    if bad:
        print(f"\nwarning: {len(bad)} runs had errors or not exactly the output tokens asked for",
              file=sys.stderr)
    if args.output_json:
        stats.write_json(args.output_json, {
            "medians": med,
            "ratios": all_ratios,
            "runs": runs,
            "schedule": args._schedule,
            "config": {
                "model": path, "levels": levels, "rounds": args.rounds,
                "input_len": str(args.input_len), "output_len": str(args.output_len),
                "requests_per_slot": args.requests_per_slot, "num_prompts": args.num_prompts,
                "systems": {t.name: (" ".join(t.argv) if t.kind == "ours" else
                                     f"{getattr(args, 'llama_server_binary', '')} -t "
                                     f"{args.llama_threads} -np C -c C*{ctx_per_slot(args)} "
                                     + " ".join(args.llama_server_arg)) for t in systems},
            },
            "environment": stats.environment(),
        })
        print(f"wrote {args.output_json}")
    return 0 if all(r["completed"] for r in runs) else 1
