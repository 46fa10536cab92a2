"""The conftest's promise: the interpreter tests pass even when ``triton`` was imported (in
compiled mode) before ``TRITON_INTERPRET`` was set, as happens in a whole-suite run where other
tests import transformers first. Checked in a fresh process that imports triton first, so it
holds whatever the import order of today's suite is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_suite_passes_when_triton_was_imported_first() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import sys, triton, triton.language as tl\n"
        "from triton.runtime.jit import JITFunction\n"
        "assert isinstance(tl.sum, JITFunction)  # compiled-mode stdlib, as in the bad order\n"
        "import trio_infer_kernels.triton_utils  # ours, compiled mode too\n"
        "import trio_infer_kernels.decode_attention\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
        "'tests/kernels/test_decode_attention.py::test_decode_split_counts', "
        "'tests/kernels/test_elementwise.py::test_rms_norm']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
