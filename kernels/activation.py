"""SiLU-and-multiply: the gated activation of Llama/Qwen MLPs, ``silu(gate) * up``.

Contract: :func:`trio_infer_kernels.reference.silu_and_mul`. The fused gate/up projection produces
``cat(gate, up)`` per token; the kernel reads both halves and writes the product once, instead of
materialising ``silu(gate)`` in memory first. The grid is (token, column block): the
intermediate size of served models (thousands to tens of thousands) is too wide for one block
per row, and column blocks of a row are independent.

Rounding follows the reference (``F.silu(gate) * up`` in the input dtype): silu is computed in
fp32 and rounded to the input dtype, then the product is rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import cast, is_interpreted

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = cast(gate * tl.sigmoid(gate), dtype, INTERPRET).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, cast(silu * up, dtype, INTERPRET), mask=mask)


def silu_and_mul(x: torch.Tensor, *, block: int = _BLOCK) -> torch.Tensor:
    """Triton version of :func:`trio_infer_kernels.reference.silu_and_mul`: [..., 2*I] -> [..., I].

    ``block`` (columns per program, a power of two) is exposed so tests can cover several column
    blocks per row with small tensors.
    """
    width = x.shape[-1]
    if width % 2:
        raise ValueError("silu_and_mul needs an even last dimension: cat(gate, up)")
    inter = width // 2
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    num_rows = rows.shape[0]
    if num_rows and inter:
        out2 = out.view(-1, inter)
        grid = (num_rows, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            rows,
            out2,
            rows.stride(0),
            out2.stride(0),
            inter,
            BLOCK=block,
            INTERPRET=is_interpreted(_silu_and_mul_kernel),
        )
    return out
