"""Run the Triton kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

``@triton.jit`` chooses between a compiled kernel and an interpreted one when it runs, that is
when the module defining the kernel is imported. That includes Triton's own library of jit
functions (``tl.sum``, ``tl.max``, ``tl.cdiv``...), decorated when ``triton`` itself is first
imported. Setting the variable here is therefore not enough on its own: in a whole-suite run the
root ``tests/conftest.py`` imports transformers, which imports torch._dynamo, which imports
triton, long before this file is read. An interpreted kernel that then calls the compiled
``tl.sum`` fails with "Cannot call @triton.jit'd outside of the scope of a kernel".

So this file sets the variable (forced, not defaulted: these tests use CPU tensors and cannot run
any other way) and then re-decorates whatever was decorated too early: Triton's language modules
and any kernel module of ours already imported. ``tests/kernels/test_interpreter_mode.py`` runs
this suite in a fresh process that imports triton first, to keep this honest.

Interpreter mode is process-wide: a Triton kernel imported later in the same pytest process is
interpreted too (it still computes correctly on CUDA tensors, slowly). GPU checks run in their
own process: ``python -m trio_infer_kernels.check``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import sys  # noqa: E402

# Triton modules holding @triton.jit functions, in dependency order (triton.language re-exports
# the other two, so it is reloaded last to pick up their new objects).
_TRITON_MODULES = ("triton.language.standard", "triton.language.random", "triton.language")
# Ours, in dependency order: the others bind triton_utils' jit helpers when imported.
_KERNEL_MODULES = (
    "trio_infer_kernels.triton_utils",
    "trio_infer_kernels.store_kv",
    "trio_infer_kernels.rms_norm",
    "trio_infer_kernels.rotary",
    "trio_infer_kernels.activation",
    "trio_infer_kernels.decode_attention",
    "trio_infer_kernels.extend_attention",
)


def _redecorate(names: tuple[str, ...]) -> None:
    """Reload the already-imported modules among ``names`` if any holds a compiled jit function."""
    from triton.runtime.jit import JITFunction

    loaded = [sys.modules[name] for name in names if name in sys.modules]
    if any(isinstance(obj, JITFunction) for module in loaded for obj in vars(module).values()):
        for module in loaded:
            importlib.reload(module)


if "triton" in sys.modules:
    _redecorate(_TRITON_MODULES)
    _redecorate(_KERNEL_MODULES)
