"""RMSNorm over the last dimension, optionally fused with the residual add before it.

Contract: :func:`trio_infer_kernels.reference.rms_norm`. One program per row holds the whole row in
registers (hidden sizes of served models are at most a few thousand, one block), so the row is
read once and written once: the residual sum, its square-mean and the scaled output all come
from the same registers. That fusion is the point of the kernel; unfused, the add, the norm and
the multiply would each make a round trip through memory.

Rounding follows the reference step by step, so outputs match it bit for bit in practice: the
residual sum is rounded to the input dtype (it is what the next layer receives), the normalised
row is rounded to the input dtype before the weight multiply, and the product is rounded once to
the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import cast, is_interpreted, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        summed = cast(x + r.to(tl.float32), residual_out_ptr.dtype.element_ty, INTERPRET)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / hidden
    # Without a residual, residual_out_ptr is x itself: either way this is the dtype of the
    # reference's ``x`` after the optional add.
    normed = cast(x * tl.rsqrt(mean_sq + eps), residual_out_ptr.dtype.element_ty, INTERPRET)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = cast(w * normed.to(tl.float32), out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """View ``t`` as [rows, hidden] with a unit inner stride (copying only if it must)."""
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of :func:`trio_infer_kernels.reference.rms_norm` (same arguments and
    results)."""
    hidden = x.shape[-1]
    x2 = _rows(x, hidden)
    num_rows = x2.shape[0]
    # Dtypes follow torch promotion exactly as in the reference: ``x + residual`` then
    # ``weight * normed``.
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual, hidden)
        new_residual = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
        nr2 = new_residual.view(-1, hidden)
    else:
        r2 = nr2 = x2  # placeholders; the HAS_RESIDUAL=False kernel never touches them
        new_residual = None
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x2,
            r2,
            weight,
            out2,
            nr2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            nr2.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=next_power_of_2(hidden),
            INTERPRET=is_interpreted(_rms_norm_kernel),
        )
    return out, new_residual
