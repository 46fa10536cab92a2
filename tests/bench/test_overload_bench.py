"""``python -m trio_infer.bench overload`` runs end to end on the fake model, small: two servers,
one round, a burst of 2 x capacity. Its exit status depends on timings (the TTFT bound, the
priority ratio), which belong in docs/benchmarks.md, so only what holds whatever the machine's
load is asserted: the statuses, Retry-After on every 429, no client timeout, the JSON's shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "TRIO_INFER_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}


def test_overload_bench_small(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trio_infer.bench", "overload", "--max-running", "2",
         "--burst-factor", "3", "--rounds", "1", "--step-ms", "5", "--output-len", "4",
         "--input-len", "8", "--max-queue-time-s", "0.05", "--high-delay-s", "0.05",
         "--timeout", "60", "--startup-timeout", "120", "--output-json", str(out)],
        env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Overload Benchmark Result" in proc.stdout
    data = json.loads(out.read_text())
    assert data["burst_size"] == 6 and sum(data["burst"]["by_status"].values()) == 6
    assert data["checks"]["only_200_or_429_with_retry_after"], data["burst"]
    assert data["checks"]["no_client_timeout"], data["burst"]
    assert data["unlimited_burst"]["by_status"] == {"200": 6}
