"""Percentiles, tables and JSON output shared by the subcommands."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, p50, p90, p99 and max of ``values`` multiplied by ``scale`` (e.g. 1000 for ms)."""
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan}
    return {
        "mean": scale * sum(values) / len(values),
        "p50": scale * percentile(values, 50),
        "p90": scale * percentile(values, 90),
        "p99": scale * percentile(values, 99),
        "max": scale * max(values),
    }


def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "inf"
        mag = abs(value)
        if mag >= 1000:
            return f"{value:,.0f}"
        if mag >= 100:
            return f"{value:.1f}"
        if mag >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def print_kv(title: str, rows: Iterable[tuple[str, Any]], file=None) -> None:
    """A two-column block like ``vllm bench serve`` prints."""
    rows = list(rows)
    file = file or sys.stdout
    width = max([len(k) for k, _ in rows] + [20])
    bar = "=" * max(10, (width + 22 - len(title) - 2) // 2)
    print(f"{bar} {title} {bar}", file=file)
    for key, value in rows:
        print(f"{key + ':':<{width + 2}}{fmt(value):>20}", file=file)
    print("=" * (2 * len(bar) + len(title) + 2), file=file, flush=True)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], file=None) -> None:
    """A plain aligned table (numbers right-aligned)."""
    file = file or sys.stdout
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths))), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))), file=file)
    file.flush()


def environment() -> dict[str, Any]:
    """What a figure depends on besides the code: machine, load, threading settings."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "(default)"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "(unset)"),
    }
    try:
        env["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env.update(_git_state())
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
    return env


def _git_state() -> dict[str, Any]:
    """The commit measured, and whether the working tree differed from it (figures of a dirty
    tree are not reproducible from the commit alone)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               text=True, capture_output=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return {}
    if head.returncode != 0:
        return {}
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None  # strict JSON has no NaN/inf
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    text = json.dumps(_json_safe(data), indent=2, allow_nan=False)
    Path(path).write_text(text + "\n")
