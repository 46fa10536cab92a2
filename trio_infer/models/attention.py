"""The one attention call site every model layer uses.

Stores the new keys/values of the step into their pages, then attends: the decode sequences in one
batched call, the extending sequences (prefill chunks) in another. Which implementation runs
(Triton on CUDA, torch on CPU) is the dispatcher's business, in :mod:`kernels.ops`.
"""

from __future__ import annotations

import torch

from kernels import ops
from trio_infer.engine.forward_batch import ForwardBatch


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for the step's new tokens -> attention output [T, Hq, D]."""
    ops.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    nd = batch.num_decodes
    if nd == batch.num_seqs:
        return ops.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale)
    out = torch.empty_like(q)
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
