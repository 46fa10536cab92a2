"""``python -m trio_infer_kernels.check`` and ``python -m trio_infer.gpu_check``: they skip cleanly
without a GPU, and their code runs (on CPU, through the interpreter, with tiny shapes and a stub
timer) so it cannot rot between GPU sessions. The kernels' package (the folder ``kernels/``,
installed as ``trio_infer_kernels``) stands alone: it imports nothing from ``trio_infer``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trio_infer_kernels import check
from trio_infer import gpu_check

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check really runs")
@pytest.mark.parametrize("module", ["trio_infer_kernels.check", "trio_infer.gpu_check"])
def test_check_without_gpu_prints_why_and_exits_0(module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", module], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    expected = (check.NO_GPU_MESSAGE if module == "trio_infer_kernels.check"
                else gpu_check.NO_GPU_MESSAGE)
    assert proc.stdout.strip() == expected


def test_kernels_import_nothing_from_trio_infer() -> None:
    """Every module of ``kernels/`` imports without importing ``trio_infer``."""
    code = (
        "import importlib, pkgutil, sys, trio_infer_kernels\n"
        "names = sorted(m.name for m in pkgutil.iter_modules(trio_infer_kernels.__path__))\n"
        "for name in names: importlib.import_module('trio_infer_kernels.' + name)\n"
        "assert 'check' in names and 'ops' in names, names\n"
        "print(sorted(m for m in sys.modules if m == 'trio_infer' or m.startswith('trio_infer.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    # ... nor later, from inside a function: no import statement of kernels/ names trio_infer.
    for path in sorted((REPO / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] == "trio_infer" for n in names), (path.name, node.lineno)


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
    assert gpu_check.check_end_to_end(torch.device("cpu"), shape="tiny", num_prompts=3)
