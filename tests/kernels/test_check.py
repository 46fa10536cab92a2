"""``python -m kernels.check``: skips cleanly without a GPU, and its code runs (on CPU, through
the interpreter, with tiny shapes and a stub timer) so it cannot rot between GPU sessions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import check

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check really runs")
def test_check_without_gpu_prints_why_and_exits_0() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.check"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == check.NO_GPU_MESSAGE


def test_check_tables_dry_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Every table of the check on tiny CPU shapes: correctness columns are real, times are 1 ms."""

    def one_call(fn):  # run the function once (so it must work), report a fixed time
        fn()
        return 1.0

    monkeypatch.setattr(check, "_bench", one_call)
    cpu = torch.device("cpu")
    sections = [
        check.check_store_kv(cpu, [(5, 2, 64)]),
        check.check_rms_norm(cpu, [(3, 64, False), (3, 64, True)]),
        check.check_rotary(cpu, [(3, 4, 2, 64)]),
        check.check_silu_and_mul(cpu, [(2, 64)]),
        check.check_decode(cpu, 4800.0, [(2, 40, 4, 2, 64, False), (3, 40, 4, 2, 64, True)]),
        check.check_extend(cpu, [(1, 0, 20, 4, 2, 64), (2, 16, 5, 4, 2, 64)]),
    ]
    for rows in sections:
        check._print_table("dry run", rows, 4800.0)
        assert rows and all(r.ok for r in rows), [(r.case, r.max_err) for r in rows]
    check.sweep(cpu, decode_case=(2, 40, 4, 2, 64), extend_case=(1, 0, 20, 4, 2, 64))
    out = capsys.readouterr().out
    assert "== sweep: decode" in out and "== sweep: prefill" in out


def test_check_end_to_end_dry_run() -> None:
    """The end-to-end part against the real engine API, on CPU (both sides run the references
    there, so it can only check that the code path works, not the kernels)."""
    assert check.check_end_to_end(torch.device("cpu"), shape="tiny", num_prompts=3)
