"""The dispatcher: the only kernel entry points the engine calls.

On CUDA tensors (and when Triton imports) each op runs its Triton kernel; on fp32 CPU tensors the
C kernels of :mod:`trio_infer_kernels.cpu` (when they build on this machine); everywhere else the
torch reference in :mod:`trio_infer_kernels.reference`. ``TRIO_INFER_KERNELS=reference`` forces the
reference path, e.g. to compare backends end to end.

A linear layer's weight is a tensor (``F.linear``) or a
:class:`~trio_infer_kernels.cpu.PackedWeight` (GGUF blocks, read by the C kernel; the loader packs
weights only where that kernel runs).

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

import torch.nn.functional as F

from . import cpu, reference
from .cpu import CpuKernels, DecoderWeights, DecodeStep, Packed, PackedParts, PackedWeight

_FORCE_REFERENCE = os.environ.get("TRIO_INFER_KERNELS", "") == "reference"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and not _FORCE_REFERENCE and _triton_available()


def _cpu(*tensors: torch.Tensor) -> CpuKernels | None:
    """The C kernels if they run here and every tensor is a contiguous fp32 CPU tensor."""
    if _FORCE_REFERENCE:
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return None
    return cpu.load()


def _cpu_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> CpuKernels | None:
    """The C kernels if they run here and the KV cache is a contiguous fp32 or fp16 CPU cache
    (both of one dtype)."""
    if (_FORCE_REFERENCE or k_cache.dtype != v_cache.dtype
            or k_cache.dtype not in (torch.float32, torch.float16)):
        return None
    for t in (k_cache, v_cache):
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
    return cpu.load()


def _heads_contiguous(t: torch.Tensor) -> bool:
    """[T, H, D] with each token's heads packed (rows may be strided: views into a fused qkv)."""
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(2) == 1
            and t.stride(1) == t.shape[2])


@contextlib.contextmanager
def forced_reference(enabled: bool = True) -> Iterator[None]:
    """Run the torch references even on CUDA inside the block, as ``TRIO_INFER_KERNELS=reference``
    does for a whole process; ``trio_infer.gpu_check`` uses it to compare both backends end to
    end in one process. Process-wide, not thread-safe: not for use while an engine serves requests."""
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
    from . import activation, decode_attention, extend_attention, rms_norm, rotary, store_kv

    return {
        "store_kv": store_kv,
        "decode_attention": decode_attention,
        "extend_attention": extend_attention,
        "rms_norm": rms_norm,
        "rotary": rotary,
        "activation": activation,
    }


def compute_path(device: torch.device | str) -> tuple[str, str | None]:
    """Which kernels serve on ``device``, and what is missing where a slower path stands in:
    ``("cpu-kernels", None)``, ``("triton", None)``, or e.g. ``("torch-reference", "the CPU
    kernels are unavailable here (no C compiler (gcc or $CC) found): ...")``. The worker reports
    both (the startup log, ``/v1/status``): nothing degrades silently."""
    if torch.device(device).type == "cuda":
        if not _FORCE_REFERENCE and _triton_available():
            return "triton", None
        return "torch-reference", "Triton is unavailable: every op runs on torch's reference"
    return cpu.compute_path()


def backend(t: torch.Tensor) -> str:
    """``"triton"``, ``"cpu"`` (the C kernels) or ``"reference"``: which implementation the ops
    run for tensors like ``t``."""
    if _use_triton(t):
        return "triton"
    return "cpu" if _cpu(t) is not None else "reference"


def linear(x: torch.Tensor, weight: torch.Tensor | Packed,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; x: [M, K]."""
    if isinstance(weight, (PackedWeight, PackedParts)):
        kernels = _cpu(x, *(() if bias is None else (bias,)))
        if kernels is None:
            raise ValueError(
                f"a {weight.fmt} weight needs the CPU kernels and contiguous fp32 CPU input "
                f"(got {x.dtype} on {x.device}, kernels {'off' if cpu.load() is None else 'on'})"
            )
        return kernels.linear(x, weight, bias, torch.get_num_threads())
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor | PackedWeight) -> torch.Tensor:
    """Rows ``ids`` of an embedding table."""
    if isinstance(weight, PackedWeight):
        kernels = cpu.load()
        if kernels is None or ids.dtype != torch.int64 or not ids.is_contiguous():
            raise ValueError(f"a {weight.fmt} embedding needs the CPU kernels and int64 ids")
        return kernels.dequant_rows(weight, ids)
    return F.embedding(ids, weight)


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
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """``max_seq_len`` (the longest context, known on the host) spares the C path a read of
    ``seq_lens``; the other paths do not need it."""
    if _use_triton(q):
        return _triton_kernels()["decode_attention"].decode_attention(
            q, k_cache, v_cache, page_table, seq_lens, scale)
    kernels = _cpu_kv(k_cache, v_cache)
    if (kernels is not None and _heads_contiguous(q)
            and cpu.attention_shape_supported(q.shape[1], k_cache.shape[2], q.shape[2])
            and page_table.dtype == seq_lens.dtype == torch.int64
            and page_table.stride(1) == 1 and seq_lens.is_contiguous()):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 1
        return kernels.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale,
                                        max_seq_len, torch.get_num_threads())
    return reference.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale)


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
    kernels = _cpu_kv(k_cache, v_cache)
    if (kernels is not None and _heads_contiguous(q) and q.shape[0] > 0
            and cpu.attention_shape_supported(q.shape[1], k_cache.shape[2], q.shape[2])
            and page_table.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int64
            and page_table.stride(1) == 1 and seq_lens.is_contiguous()
            and query_start_loc.is_contiguous()):
        max_len = int(seq_lens.max())
        return kernels.extend_attention(q, k_cache, v_cache, page_table, query_start_loc,
                                        seq_lens, scale, max_len, torch.get_num_threads())
    return reference.extend_attention(q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if _use_triton(x):
        return _triton_kernels()["rms_norm"].rms_norm(x, weight, eps, residual)
    kernels = _cpu(x, weight, *(() if residual is None else (residual,)))
    if kernels is not None and x.dim() == 2:
        return kernels.rms_norm(x, weight, eps, residual, torch.get_num_threads())
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _triton_kernels()["rotary"] if _use_triton(q) else reference
    return impl.rotary_embedding(q, k, positions, cos_sin_cache)


def rotary_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_embedding` on q and k, then :func:`store_kv` of the rotated k and v.

    Returns the rotated ``(q, k)``. The C path rotates q and k in place (they are the caller's
    fresh projections; nothing else reads them), the others return new tensors.
    """
    kernels = None if q.is_cuda else _cpu(cos_sin_cache) and _cpu_kv(k_cache, v_cache)
    if (kernels is not None and _heads_contiguous(q) and _heads_contiguous(k)
            and _heads_contiguous(v) and positions.dtype == slot_mapping.dtype == torch.int64
            and positions.is_contiguous() and slot_mapping.is_contiguous()):
        kernels.rope_store(q, k, v, positions, slot_mapping, cos_sin_cache, k_cache, v_cache)
        return q, k
    q, k = rotary_embedding(q, k, positions, cos_sin_cache)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _use_triton(x):
        return _triton_kernels()["activation"].silu_and_mul(x)
    kernels = _cpu(x)
    if kernels is not None and x.dim() == 2:
        return kernels.silu_and_mul(x, torch.get_num_threads())
    return reference.silu_and_mul(x)


def decode_step(weights: DecoderWeights, page_size: int,
                kv_dtype: torch.dtype = torch.float32) -> DecodeStep | None:
    """The model's whole decode step as one C call (:class:`trio_infer_kernels.cpu.DecodeStep`), or
    None where it cannot run: no C kernels, a tensor that is not contiguous fp32 on the CPU, or a KV
    cache that is neither fp32 nor fp16."""
    kernels = _cpu(*weights.arrays())
    if (kernels is None or kv_dtype not in (torch.float32, torch.float16)
            or not cpu.attention_shape_supported(weights.num_heads, weights.num_kv_heads,
                                                 weights.head_dim)):
        return None
    return kernels.decode_step(weights, page_size, kv_dtype)
