"""``startup``: how long after its process starts a server answers ``GET /health``, and says 200.

Systems (``--systems``, default all three), on the same model file:

- ``serve``: ``python -m trio_infer serve --model FILE``;
- ``hypercorn``: the bare ``hypercorn trio_infer.app:app --worker-class trio`` command, the model
  given as the README says, through ``TRIO_INFER_MODEL``;
- ``llama-server``: llama.cpp's server (built once, cached: :mod:`trio_infer.bench.llamaserver`)
  with ``-t 2`` (``--llama-threads``) and its defaults otherwise (needs a ``.gguf`` file).

Each is started in its own process group, ``GET /health`` is polled every ``--poll-ms`` (a new
connection each time, each attempt given 1 s), and two times are taken from just before the
process is started: **first answer** (any HTTP response: a server loading in the background
answers 503 at once) and **healthy** (the first 200). Then it is stopped (SIGINT to the group,
SIGKILL after ``--stop-timeout``) before the next starts. ``--rounds`` repeats that, each round
starting with the next system in turn; medians over the rounds, and each system's ratio to
llama-server's (or, without it, to the first system's).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from trio_infer.bench import llamaserver, stats
from trio_infer.bench.client import Endpoint, request
from trio_infer.bench.servers import System, free_port, log_tail, start_server, stop_server

SYSTEMS = ("serve", "hypercorn", "llama-server")


def systems_spec(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SYSTEMS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected distinct names among {', '.join(SYSTEMS)}, got {text!r}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file (or anything `serve --model` takes, without llama-server); "
                   "default: the default model's file")
    p.add_argument("--systems", type=systems_spec, default=list(SYSTEMS),
                   metavar="NAME[,NAME...]", help=f"default: {','.join(SYSTEMS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--poll-ms", type=float, default=50.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for healthy")
    p.add_argument("--stop-timeout", type=float, default=15.0)
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `python -m trio_infer serve` (repeatable)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for serve and hypercorn (repeatable)")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--output-json", type=Path, default=None)


def resolve_model(spec: str | None, systems: list[str]) -> str:
    if spec is None:
        from trio_infer.models.default_model import default_cache_dir, require_default_model

        try:
            return str(require_default_model(default_cache_dir()))
        except FileNotFoundError as exc:
            raise SystemExit(f"error: {exc}") from None
    path = Path(spec).expanduser()
    if path.exists():
        spec = str(path.resolve())
    if "llama-server" in systems and not (path.is_file() and path.suffix.lower() == ".gguf"):
        raise SystemExit(f"error: llama-server needs a .gguf file, got --model {spec!r}")
    return spec


def system_for(name: str, model: str, args: argparse.Namespace, binary: Path | None) -> System:
    env = dict(os.environ)
    for item in args.server_env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --server-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    if name == "serve":
        cmd = [sys.executable, "-m", "trio_infer", "serve", "--model", model,
               "--host", "127.0.0.1", "--port", "{port}", *args.serve_arg]
    elif name == "hypercorn":
        env["TRIO_INFER_MODEL"] = model
        cmd = [sys.executable, "-m", "hypercorn", "trio_infer.app:app", "--worker-class", "trio",
               "--bind", "127.0.0.1:{port}"]
    else:
        assert binary is not None
        cmd = llamaserver.command(binary, Path(model), "{port}", threads=args.llama_threads)
    return System(name, cmd, env, None)


def display(system: System, model: str) -> str:
    """The command as a user would type it (the hypercorn one with its model variable)."""
    cmd = system.display().replace(sys.executable, "python")
    return f"TRIO_INFER_MODEL={model} {cmd}" if system.name == "hypercorn" else cmd


async def time_startup(system: System, port: int, log: Path, poll_s: float,
                       timeout: float, stop_timeout: float) -> dict[str, Any]:
    """Start ``system``; seconds to its first answer and to its first 200 on ``/health``."""
    ep = Endpoint("127.0.0.1", port, "")
    first = healthy = None
    first_status = None
    t0 = time.monotonic()
    proc = start_server(system, port, log)
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise SystemExit(f"error: {system.name} exited with {proc.returncode} while "
                                 f"starting; its log:\n{log_tail(log)}")
            status = None
            with trio.move_on_after(1.0):
                try:
                    status, _ = await request(ep, "GET", "/health")
                except OSError:
                    pass
            now = time.monotonic() - t0
            if status is not None and first is None:
                first, first_status = now, status
            if status == 200:
                healthy = now
                break
            await trio.sleep(poll_s)
        if healthy is None:
            raise SystemExit(f"error: {system.name} was not healthy after {timeout:g} s; its "
                             f"log:\n{log_tail(log)}")
    finally:
        stop_server(proc, stop_timeout)
    return {"first_answer_s": first, "first_status": first_status, "healthy_s": healthy}


async def _run(args: argparse.Namespace, systems: list[System], workdir: Path) -> list[dict]:
    runs = []
    for r in range(args.rounds):
        k = r % len(systems)
        for system in systems[k:] + systems[:k]:
            port = free_port()
            load = _loadavg()
            res = await time_startup(system, port, workdir / f"{system.name}-r{r}.log",
                                     args.poll_ms / 1000.0, args.timeout, args.stop_timeout)
            res.update(system=system.name, round=r, loadavg_1m=load)
            print(f"  round {r + 1} {system.name:>12}: first answer {res['first_answer_s']:.2f} s "
                  f"({res['first_status']}), healthy {res['healthy_s']:.2f} s", flush=True)
            runs.append(res)
            if args.output_json:  # what is done so far survives an interrupted run
                stats.write_json(args.output_json, {"partial": True, "runs": runs})
    return runs


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def summarize(runs: list[dict[str, Any]], names: list[str]) -> tuple[dict, dict]:
    med = {}
    for name in names:
        rows = [r for r in runs if r["system"] == name]
        med[name] = {
            "first_answer_s": statistics.median(r["first_answer_s"] for r in rows),
            "healthy_s": statistics.median(r["healthy_s"] for r in rows),
            "rounds": len(rows),
        }
    ref = "llama-server" if "llama-server" in med else names[0]
    ratios = {
        name: {k: m[k] / med[ref][k] if med[ref][k] else math.nan
               for k in ("first_answer_s", "healthy_s")}
        for name, m in med.items() if name != ref
    }
    return med, {"reference": ref, "ratios": ratios}


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit("error: --rounds must be >= 1")
    model = resolve_model(args.model, args.systems)
    binary = llamaserver.require() if "llama-server" in args.systems else None
    systems = [system_for(n, model, args, binary) for n in args.systems]
    print(f"startup of {', '.join(args.systems)} on {model}; {args.rounds} interleaved rounds, "
          f"/health polled every {args.poll_ms:g} ms", flush=True)
    shown = {s.name: display(s, model) for s in systems}
    for name, cmd in shown.items():
        print(f"  {name}: {cmd}", flush=True)
    # Started in the background by a non-interactive shell, this process inherits SIGINT
    # ignored; Ctrl-C / SIGINT must still stop it and, through trio, the server it runs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        workdir = Path(args.log_dir) if args.log_dir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        runs = trio.run(_run, args, systems, workdir)
    med, rat = summarize(runs, args.systems)
    ref = rat["reference"]
    print()
    rows = []
    for name, m in med.items():
        r = rat["ratios"].get(name, {"first_answer_s": 1.0, "healthy_s": 1.0})
        rows.append([name, m["first_answer_s"], m["healthy_s"], r["first_answer_s"],
                     r["healthy_s"]])
    stats.print_table(["system", "first answer s", "healthy s", f"first / {ref}",
                       f"healthy / {ref}"], rows)
    if args.output_json:
        stats.write_json(args.output_json, {
            "medians": med, **rat, "runs": runs,
            "config": {"model": model, "rounds": args.rounds, "poll_ms": args.poll_ms,
                       "systems": shown},
            "environment": stats.environment(),
        })
        print(f"wrote {args.output_json}")
    return 0
