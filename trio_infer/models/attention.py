"""The one attention call site every model layer uses.

The step's new keys/values are already in their pages (:func:`trio_infer_kernels.ops.rotary_store`);
this attends: the decode sequences in one batched call, the extending sequences (prefill chunks) in
another. Which implementation runs (Triton on CUDA, C or torch on CPU) is the dispatcher's
business, in :mod:`trio_infer_kernels.ops`.
"""

from __future__ import annotations

import torch

from trio_infer_kernels import ops
from trio_infer.engine.forward_batch import ForwardBatch


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D] for the step's new tokens -> attention output [T, Hq, D]."""
    nd = batch.num_decodes
    if nd == batch.num_seqs:
        return ops.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale,
                                    batch.max_seq_len)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = ops.decode_attention(
            q[:nd], k_cache, v_cache, batch.page_table[:nd], batch.seq_lens[:nd], scale
        )
    out[nd:] = ops.extend_attention(
        q[nd:],
        k_cache,
        v_cache,
        batch.page_table[nd:],
        batch.query_start_loc[nd:] - nd,
        batch.seq_lens[nd:],
        scale,
        max_query_len=batch.max_query_len,
    )
    return out
