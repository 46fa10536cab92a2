"""The dispatcher: C kernels (or the references) on CPU tensors, Triton only for CUDA tensors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from trio_infer_kernels import cpu, ops, reference
from trio_infer_kernels.triton_utils import is_interpreted

REPO = Path(__file__).resolve().parents[2]


def test_cpu_tensors_use_the_c_kernels_where_they_build() -> None:
    x = torch.randn(3, 8)
    assert ops.backend(x) == ("cpu" if cpu.load() is not None else "reference")
    assert ops.backend(x.double()) == "reference"  # the C kernels are fp32 only
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))
    with ops.forced_reference():
        assert ops.backend(x) == "reference"
        torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x), rtol=0, atol=0)


def test_cpu_engine_never_imports_triton() -> None:
    """A CPU process runs every op without importing Triton (it may be missing or broken)."""
    code = (
        "import sys, torch\n"
        "from trio_infer_kernels import ops\n"
        "x = torch.randn(4, 16)\n"
        "ops.rms_norm(x, torch.ones(16), 1e-6, x)\n"
        "ops.silu_and_mul(x)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_triton_kernel_modules_import_and_are_interpreted_here() -> None:
    """All kernel modules import, and this suite really runs them through the interpreter."""
    modules = ops._triton_kernels()
    assert set(modules) == {"store_kv", "decode_attention", "extend_attention", "rms_norm",
                            "rotary", "activation"}
    from trio_infer_kernels.decode_attention import _decode_split_kernel
    from trio_infer_kernels.extend_attention import _extend_kernel

    assert is_interpreted(_decode_split_kernel) and is_interpreted(_extend_kernel)
