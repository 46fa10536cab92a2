"""Paged prefill/extend attention: a chunk of new tokens per sequence, causal, packed.

Contract: :func:`trio_infer_kernels.reference.extend_attention`. Sequence ``b`` owns the query rows
``query_start_loc[b]:query_start_loc[b+1]`` (``n`` of them, no padding between sequences) and
has ``seq_len = seq_lens[b]`` tokens in the cache, the chunk's own K/V included. Query ``i`` sits
at position ``prefix + i`` with ``prefix = seq_len - n`` and sees keys ``0 ..= prefix + i``.

This is flash attention over the paged cache, compute bound for long chunks:

* **Grid (query block, query head, sequence).** One program owns ``BLOCK_M`` queries of one head
  of one sequence and streams that sequence's keys in ``BLOCK_N`` tiles with an online softmax.
  Query heads that share a KV head are adjacent in the grid, so their K/V tiles are served from
  L2. The query-block axis is walked in reverse: causal blocks near the end of a chunk have the
  most keys, and starting the longest programs first shortens the tail of the launch.
* **Two loops per program.** Keys before ``prefix + m0`` (``m0`` the block's first query) are
  visible to every query of the block, so whole tiles there need no mask at all (the cached
  prefix of a chunked prefill, and the lower triangle of a fresh prompt). Only the tiles that
  straddle the diagonal, up to the block's last query position, are masked. Tiles wholly above
  the diagonal are never loaded.
* **Ragged batches without padding.** Every sequence gets ``ceil(max_query_len / BLOCK_M)``
  query-block programs; those past a shorter sequence's chunk return at once.
* **Paging by gather**, as in decode: each key position looks up its page, so any page size
  works.

The grid size needs the longest chunk on the host. The fixed op signature does not carry it, so
the wrapper reads it from ``query_start_loc`` (one small device-to-host copy per prefill step,
negligible next to the attention itself); callers that know it pass ``max_query_len``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_utils import (
    cast,
    cdiv,
    check_paged_attention_inputs,
    is_interpreted,
    mma,
    next_power_of_2,
)


@triton.jit
def _attend_tile(
    acc,
    m,
    l,  # noqa: E741
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    page_row_ptr,
    kv_head_off,
    start,
    kv_end,
    stride_cache_page,
    stride_cache_slot,
    scale_log2,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One online-softmax step over keys ``start .. start + BLOCK_N``; returns (acc, m, l)."""
    keys = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    if MASKED:
        in_range = keys < kv_end
        page = tl.load(page_row_ptr + keys // PAGE_SIZE, mask=in_range, other=0)
        kv_mask = in_range[:, None] & (d < HEAD_DIM)[None, :]
    else:
        page = tl.load(page_row_ptr + keys // PAGE_SIZE)
        kv_mask = (keys >= 0)[:, None] & (d < HEAD_DIM)[None, :]
    rows = page.to(tl.int64) * stride_cache_page + (keys % PAGE_SIZE) * stride_cache_slot
    offs = kv_head_off + rows[:, None] + d[None, :]
    k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
    scores = mma(q, tl.trans(k), INTERPRET) * scale_log2
    if MASKED:
        visible = (keys[None, :] <= q_pos[:, None]) & in_range[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
    v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + mma(cast(p, v_cache_ptr.dtype.element_ty, INTERPRET), v, INTERPRET)
    return acc, m_new, l


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_h,
    stride_pt,
    scale_log2,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    block = tl.num_programs(0) - 1 - tl.program_id(0)  # longest causal blocks first
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    n = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    m0 = block * BLOCK_M
    if m0 >= n:
        return
    prefix = tl.load(seq_lens_ptr + seq).to(tl.int32) - n

    rows = m0 + tl.arange(0, BLOCK_M)
    row_valid = rows < n
    q_pos = prefix + rows
    d = tl.arange(0, BLOCK_D)
    q_mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    q_offs = (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    page_row_ptr = page_table_ptr + seq * stride_pt
    kv_head_off = (head // GROUP) * stride_cache_h

    # Whole tiles every query of the block sees: no mask.
    full_end = ((prefix + m0) // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m, l = _attend_tile(  # noqa: E741
            acc, m, l, q, q_pos, k_cache_ptr, v_cache_ptr, page_row_ptr, kv_head_off, start,
            full_end, stride_cache_page, stride_cache_slot, scale_log2,
            PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, False, INTERPRET,
        )
    # Tiles across the diagonal, up to the last query of the block: causal mask.
    kv_end = prefix + tl.minimum(m0 + BLOCK_M, n)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m, l = _attend_tile(  # noqa: E741
            acc, m, l, q, q_pos, k_cache_ptr, v_cache_ptr, page_row_ptr, kv_head_off, start,
            kv_end, stride_cache_page, stride_cache_slot, scale_log2,
            PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, True, INTERPRET,
        )

    out = acc / l[:, None]
    o_offs = (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, cast(out, out_ptr.dtype.element_ty, INTERPRET), mask=q_mask)


def _default_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a GPU launch; see docs/kernels.md."""
    if head_dim <= 64:
        return 128, 64, 4, 3
    return 128, 64, 8, 2


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`trio_infer_kernels.reference.extend_attention` (same arguments,
    [T, Hq, D]).

    The keyword-only arguments are optional: the longest chunk (saves a device-to-host read) and
    tuning knobs (tests use small blocks to cover many tiles with small tensors).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[1]
    q, page_table = check_paged_attention_inputs(q, k_cache, v_cache, page_table)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = num_tokens if num_seqs == 1 else int(query_start_loc.diff().max())

    cfg_m, cfg_n, cfg_warps, cfg_stages = _default_config(head_dim)
    block_m = block_m or cfg_m
    block_n = block_n or cfg_n
    grid = (cdiv(max_query_len, block_m), num_q_heads, num_seqs)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        page_table,
        query_start_loc,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_table.stride(0),
        scale * math.log2(math.e),
        GROUP=num_q_heads // num_kv_heads,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=next_power_of_2(head_dim),
        INTERPRET=is_interpreted(_extend_kernel),
        num_warps=num_warps or cfg_warps,
        num_stages=num_stages or cfg_stages,
    )
    return out
