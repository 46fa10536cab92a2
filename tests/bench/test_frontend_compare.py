"""``frontend --compare`` / ``--repeats``: its helpers (argument parsing, medians, ratios, the CPU
of a whole process tree, stopping a process group) and one short end-to-end run against a stub
server. No figure is asserted: timings belong in docs/benchmarks.md, not in tests."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trio_infer.bench import frontend, procstat

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "TRIO_INFER_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
needs_proc = pytest.mark.skipif(not procstat.available(), reason="needs Linux /proc schedstat")


def test_compare_spec() -> None:
    assert frontend.compare_spec("anchor=cd x && run --port {port}") == (
        "anchor", "cd x && run --port {port}")
    # Only the first '=' splits: the command may hold more.
    assert frontend.compare_spec("a=A=1 run {port}") == ("a", "A=1 run {port}")
    for bad in ("no-equals {port}", "=run {port}", "a=", "a=run", "ours=run {port}",
                "sp ace=run {port}"):
        with pytest.raises(argparse.ArgumentTypeError):
            frontend.compare_spec(bad)


def _args(**kw: object) -> argparse.Namespace:
    base = dict(concurrency=[4], server_env=[], server_arg=[], step_ms=20.0, launcher="cli",
                compare=[], endpoint="auto")
    base.update(kw)
    return argparse.Namespace(**base)


def test_systems_and_environment() -> None:
    args = _args(compare=[("anchor", "run --port {port}")])
    ours, anchor = frontend.systems_for(args)
    assert ours.name == "ours" and "{port}" in ours.command
    assert "--port" in ours.argv(8123) and "8123" in ours.argv(8123)
    assert anchor.argv(8123)[-1] == "run --port 8123" and anchor.model is None
    assert anchor.env["NULL_ENGINE_STEP_MS"] == "20" and anchor.env["TRIO_INFER_MAX_RUNNING"] == "4"
    assert frontend.endpoint_for(args) == "chat"
    assert frontend.endpoint_for(_args()) == "completions"
    assert frontend.endpoint_for(_args(endpoint="completions", compare=args.compare)) == "completions"
    with pytest.raises(SystemExit):
        frontend.systems_for(_args(compare=[("a", "x {port}"), ("a", "y {port}")]))


def _level(c: int, tok_s: float, gap99: float, cpu: float, errors: int = 0) -> dict:
    return {"concurrency": c, "streams": c, "errors": errors, "error_kinds": {"e": errors} if errors else {},
            "streamed_tok_s": tok_s, "keep_up": tok_s / 100, "chunk_gap_ms": {"p50": 1.0, "p99": gap99},
            "server_cpu_us_per_token": cpu, "health_ms": {"p99": math.nan}, "command": "x"}


def test_median_levels_and_ratios() -> None:
    runs = [[_level(1, 10, 5, 100)], [_level(1, 30, 7, 300, errors=1)], [_level(1, 20, 6, 200, errors=2)]]
    (med,) = frontend.median_levels(runs)
    assert med["streamed_tok_s"] == 20 and med["chunk_gap_ms"]["p99"] == 6
    assert med["server_cpu_us_per_token"] == 200 and med["repeats"] == 3
    assert med["errors"] == 3 and med["error_kinds"] == {"e": 3}  # totals, not medians
    assert isinstance(med["streams"], int) and med["command"] == "x"
    assert math.isnan(med["health_ms"]["p99"])
    (r,) = frontend.ratios([med], [_level(1, 10, 3, 50)])
    assert r == pytest.approx({"concurrency": 1, "streamed_tok_s": 2.0, "keep_up": 2.0,
                               "chunk_gap_p99_ms": 2.0, "server_cpu_us_per_token": 4.0})
    (r,) = frontend.ratios([med], [_level(1, 0, 3, math.nan)])
    assert math.isnan(r["streamed_tok_s"]) and math.isnan(r["server_cpu_us_per_token"])


BURN = ("import sys, time\n"
        "while time.process_time() < 0.2: pass\n"
        "print('done', flush=True)\n"
        "time.sleep(60)\n")


@needs_proc
@pytest.mark.parametrize("children_files", [True, False])
def test_cpu_meter_counts_grandchildren(monkeypatch: pytest.MonkeyPatch, children_files: bool) -> None:
    """A shell whose grandchild burns 0.2 s of CPU: the meter on the shell counts it, whether the
    tree comes from /proc/<pid>/task/<tid>/children or from the parent pids of /proc/*/stat."""
    if not children_files:
        monkeypatch.setattr(procstat, "_has_children_files", lambda: False)
    cmd = f"{shlex.quote(sys.executable)} -c {shlex.quote(BURN)}; true"  # '; true': no exec
    proc = subprocess.Popen(["/bin/sh", "-c", cmd], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        meter = procstat.CpuMeter(proc.pid)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
        assert meter.sample() > 150_000_000  # ns: the grandchild's 0.2 s, less what ran before
        assert len(procstat.process_tree(proc.pid)) >= 2 and len(meter.pids_seen) >= 2
        assert meter.root_ns() < 50_000_000  # the shell itself only waited: its children's is not its own
    finally:
        frontend.stop_server(proc, timeout=5)


def test_stop_server_kills_the_whole_group(tmp_path: Path) -> None:
    """A command whose child ignores SIGINT and outlives the shell: after stop_server nothing of
    the group is left."""
    pid_file = tmp_path / "child.pid"
    system = frontend.System(
        "x", f"(trap '' INT; exec sleep 300) & echo $! > {pid_file}; sleep 300 # {{port}}",
        dict(os.environ), None)
    proc = frontend.start_server(system, 1, tmp_path / "log")
    deadline = time.monotonic() + 10
    while not pid_file.is_file() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    t = time.monotonic()
    frontend.stop_server(proc, timeout=1)
    assert time.monotonic() - t < 8
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@needs_proc
def test_frontend_compare_smoke(tmp_path: Path) -> None:
    """Ours and a stub (no usage chunk, an extra child process, started through `cd ... &&`), one
    level, one repetition: both systems and the ratios are in the table and the JSON."""
    out = tmp_path / "cmp.json"
    child_pid = tmp_path / "child.pid"
    stub = (f"cd {shlex.quote(str(HERE))} && {shlex.quote(sys.executable)} stub_server.py "
            f"--port {{port}} --spawn-child --child-pid-file {shlex.quote(str(child_pid))}")
    proc = subprocess.run(
        [sys.executable, "-m", "trio_infer.bench", "frontend", "--step-ms", "2",
         "--concurrency", "2", "--output-len", "4", "--idle-s", "0.1", "--repeats", "1",
         "--stop-timeout", "5", "--compare", f"stub={stub}", "--output-json", str(out)],
        env=ENV, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    text = proc.stdout
    assert "ours (one run)" in text and "stub (one run)" in text and "ours / theirs" in text
    assert "sent no usage chunk" in text  # the stub's tokens were counted as events
    data = json.loads(out.read_text())
    assert set(data["systems"]) == {"ours", "stub"} and set(data["ratios"]) == {"stub"}
    assert data["config"]["endpoint"] == "chat" and data["config"]["repeats"] == 1
    assert data["levels"] == data["systems"]["ours"]["levels"]  # the old field: ours
    assert [s["system"] for s in data["schedule"]] == ["ours", "stub"]
    for name in ("ours", "stub"):
        (lv,) = data["systems"][name]["levels"]
        assert lv["errors"] == 0 and lv["output_tokens"] == lv["expected_output_tokens"] == 2 * 4
        assert lv["health_ms"]["p99"] is not None or lv["health_probes"] == 0
        assert len(data["systems"][name]["runs"]) == 1
    assert data["systems"]["ours"]["levels"][0]["token_counts_from"] == {"usage": 2, "events": 0}
    stub_level = data["systems"]["stub"]["levels"][0]
    assert stub_level["token_counts_from"] == {"usage": 0, "events": 2}
    assert stub_level["server_processes"] >= 2  # the stub's child was in the measured tree
    (r,) = data["ratios"]["stub"]
    assert set(r) == {"concurrency", "streamed_tok_s", "keep_up", "chunk_gap_p99_ms",
                      "server_cpu_us_per_token"}
    assert r["streamed_tok_s"] > 0
    assert not _alive(int(child_pid.read_text()))  # stopped with its process group


def test_each_repetition_starts_with_the_next_system() -> None:
    """--repeats K: every system once per repetition, and each system first in turn (a fixed
    order would give the first system the first run's handicap every time)."""
    from trio_infer.bench.frontend import run_order

    assert run_order(["ours", "bare", "anchor"], 4) == [
        (0, "ours"), (0, "bare"), (0, "anchor"),
        (1, "bare"), (1, "anchor"), (1, "ours"),
        (2, "anchor"), (2, "ours"), (2, "bare"),
        (3, "ours"), (3, "bare"), (3, "anchor"),
    ]
    assert run_order(["ours"], 2) == [(0, "ours"), (1, "ours")]
