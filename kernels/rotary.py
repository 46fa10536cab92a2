"""Neox-style rotary position embedding of queries and keys in one launch.

Contract: :func:`trio_infer_kernels.reference.rotary_embedding`. One program per token: it loads the
token's ``cos``/``sin`` row once (indexed by its position) and rotates every query and key head
with it, so the table is read once per token instead of once per head, and q and k need no
second launch. Heads are processed as a ``[heads, D/2]`` tile: the two halves of each head are
the two operands of the rotation, so they are loaded as two tiles rather than shuffled in
registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import cast, is_interpreted, next_power_of_2


@triton.jit
def _rotate_heads(
    in_ptr,
    out_ptr,
    stride_in_t,
    stride_in_h,
    stride_out_t,
    stride_out_h,
    token,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
    src = in_ptr + token * stride_in_t + heads[:, None] * stride_in_h + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * stride_out_t + heads[:, None] * stride_out_h + dims[None, :]
    out_dtype = out_ptr.dtype.element_ty
    tl.store(dst, cast(x1 * cos - x2 * sin, out_dtype, INTERPRET), mask=mask)
    tl.store(dst + HALF, cast(x2 * cos + x1 * sin, out_dtype, INTERPRET), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cache + dims
    cos = tl.load(row, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, cos, sin,
        NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF, INTERPRET,
    )
    _rotate_heads(
        k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, cos, sin,
        NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF, INTERPRET,
    )


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`trio_infer_kernels.reference.rotary_embedding` (returns new
    tensors)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if head_dim % 2 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("rotary needs an even head_dim equal to the cos_sin_cache width")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=half,
        BLOCK_QH=next_power_of_2(num_q_heads),
        BLOCK_KH=next_power_of_2(num_k_heads),
        BLOCK_HALF=next_power_of_2(half),
        INTERPRET=is_interpreted(_rotary_kernel),
    )
    return q_out, k_out
