"""The dispatcher: the only kernel entry points the engine calls.

On CUDA tensors (and when Triton imports) each op runs its Triton kernel; everywhere else it runs
the torch reference in :mod:`kernels.reference`. ``TRIO_INFER_KERNELS=reference`` forces the
reference path, e.g. to compare backends end to end.

The Triton modules are imported on first use and only for CUDA tensors, so a CPU machine never
imports Triton at all: a missing or broken Triton install cannot stop the CPU engine.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from kernels import reference

_FORCE_REFERENCE = os.environ.get("TRIO_INFER_KERNELS", "") == "reference"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and not _FORCE_REFERENCE and _triton_available()


@contextlib.contextmanager
def forced_reference(enabled: bool = True) -> Iterator[None]:
    """Run the torch references even on CUDA inside the block, as ``TRIO_INFER_KERNELS=reference``
    does for a whole process; :mod:`kernels.check` uses it to compare both backends end to end in
    one process. Process-wide, not thread-safe: not for use while an engine serves requests."""
    global _FORCE_REFERENCE
    saved, _FORCE_REFERENCE = _FORCE_REFERENCE, enabled
    try:
        yield
    finally:
        _FORCE_REFERENCE = saved


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install failing in its own way
        return False
    return True


@functools.cache
def _triton_kernels() -> dict[str, ModuleType]:
    """The Triton kernel modules, imported once, on the first CUDA call."""
    from kernels import activation, decode_attention, extend_attention, rms_norm, rotary, store_kv

    return {
        "store_kv": store_kv,
        "decode_attention": decode_attention,
        "extend_attention": extend_attention,
        "rms_norm": rms_norm,
        "rotary": rotary,
        "activation": activation,
    }


def backend(t: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"``: which implementation the ops run for tensors like ``t``."""
    return "triton" if _use_triton(t) else "reference"


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    impl = _triton_kernels()["store_kv"] if _use_triton(k) else reference
    impl.store_kv(k, v, k_cache, v_cache, slot_mapping)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    impl = _triton_kernels()["decode_attention"] if _use_triton(q) else reference
    return impl.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """``max_query_len`` (the longest chunk, known on the host) spares the Triton path a
    device-to-host read of ``query_start_loc``; the reference does not need it."""
    if _use_triton(q):
        return _triton_kernels()["extend_attention"].extend_attention(
            q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale,
            max_query_len=max_query_len,
        )
    return reference.extend_attention(q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    impl = _triton_kernels()["rms_norm"] if _use_triton(x) else reference
    return impl.rms_norm(x, weight, eps, residual)


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _triton_kernels()["rotary"] if _use_triton(q) else reference
    return impl.rotary_embedding(q, k, positions, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    impl = _triton_kernels()["activation"] if _use_triton(x) else reference
    return impl.silu_and_mul(x)
