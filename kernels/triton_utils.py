"""Helpers shared by the Triton kernels and their wrappers.

Only the kernel modules import this one (and they are imported only when Triton is used), so it
may import Triton at the top.

Every kernel takes an ``INTERPRET`` constexpr, true when it was decorated under Triton's CPU
interpreter (``TRITON_INTERPRET=1``), because the interpreter handles bfloat16 differently from a
GPU in two ways that matter for testing:

* it stores bf16 as raw ``uint16`` and does integer arithmetic on it. So no kernel computes on a
  loaded value before an explicit ``.to(tl.float32)``, and :func:`mma` feeds ``tl.dot`` fp32
  copies of bf16 operands under the interpreter (bf16 itself on a GPU, for the tensor cores).
  Both compute the same products of bf16 values with an fp32 accumulator.
* its fp32 -> bf16 cast truncates, where a GPU rounds to nearest even. :func:`cast` rounds the
  bits itself under the interpreter, so that the tests see the GPU's rounding.

With ``INTERPRET`` false both helpers reduce at compile time to a plain ``.to()`` and
``tl.dot``; the GPU code pays nothing for them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1``.

    Triton reads the variable when ``@triton.jit`` runs (module import), so the kernel object
    itself is the reliable witness, not the environment now.
    """
    return not isinstance(kernel, JITFunction)


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (to size split-K); 1 off CUDA."""
    if not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    """:func:`num_sms` of the device ``t`` lives on."""
    if not t.is_cuda:
        return 1
    return num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    return triton.cdiv(a, b)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)


@triton.jit
def mma(a, b, INTERPRET: tl.constexpr):
    """``a @ b`` with an fp32 accumulator, for operands in their storage dtype.

    fp32 operands get exact IEEE products (the default would be TF32 on NVIDIA GPUs); bf16 and
    fp16 ones use the tensor cores (an fp32 copy under the interpreter, see the module docstring).
    """
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    elif INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def cast(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(DTYPE)`` rounding to nearest even, as a GPU does, also under the interpreter."""
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            # Round the fp32 bits to their top 16 (ties to even); the interpreter's truncating
            # cast is then exact. NaN payloads are not kept (no kernel makes NaN on purpose).
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


def check_paged_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the shapes and layouts both paged attention kernels rely on; return ``q`` and
    ``page_table`` with a unit last stride (copied only if needed)."""
    num_q_heads, head_dim = q.shape[-2:]
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads}) "
            f"and head dims must match ({head_dim} vs {cache_head_dim})"
        )
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError("q and the KV cache must share one dtype")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a unit head_dim stride")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    return q, page_table
