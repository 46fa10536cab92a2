"""Paged decode attention: one new query token per sequence against all of its cached tokens.

Contract: :func:`trio_infer_kernels.reference.decode_attention`.

Decode is memory bound: every cached K/V byte of the batch is read once per step and used for a
handful of FLOPs. The design follows from that.

* **One program per (sequence, KV head, split)**, not per query head. Under grouped-query
  attention the ``Hq / Hkv`` query heads that share a KV head are stacked as the rows of one
  ``[BLOCK_G, D]`` query tile, so each K/V tile is loaded once for the whole group and the
  products are a small matrix multiply (``tl.dot``; rows are padded to 16, the smallest MMA
  shape, which costs nothing in a memory-bound loop).
* **Split-K** (flash-decoding): a batch of a few long sequences has too few (sequence, head)
  pairs to occupy every SM, and each would walk its whole context serially. The context of each
  sequence is cut into ``num_splits`` ranges of whole tiles; stage 1 computes an independent
  softmax-weighted partial output and its log-sum-exp per range; stage 2 (one small program per
  (sequence, query head)) rescales and sums the partials. The split count is chosen on the host
  from shapes only (batch, heads, the page table's width, the SM count), never from ``seq_lens``
  values, so the launch never waits for the GPU and stays capturable in a CUDA graph. Each
  sequence divides *its own* length among the splits, so a short sequence in a long batch simply
  leaves some of its splits empty (they write ``lse = -inf`` and weigh nothing).
* **Paging by gather**: a tile of ``BLOCK_N`` token positions looks up each position's page in
  the page table and loads that row. Any page size works (a tile may span pages or cover part of
  one) and each row is one contiguous ``D``-element burst.

Softmax runs in base 2 (``exp2`` with ``scale * log2(e)`` folded into the scores), online across
the tiles of a split, with fp32 statistics and accumulator.
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
    device_sms,
    is_interpreted,
    mma,
    next_power_of_2,
)

# Heuristics for the GPU launch (tests override the tile size and the split count to exercise
# many tiles and splits with tiny tensors). See docs/kernels.md for why these values.
_BLOCK_N = 64  # tokens per K/V tile
_MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds
_MAX_SPLITS = 32
_WAVES = 4  # aim for this many programs per SM in stage 1


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_h,
    stride_pt,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    scale_log2,
    num_splits,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Stage 1: partial attention of one (sequence, KV head) over one range of its tokens."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & d_mask[None, :]
    q_rows = q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)  # noqa: E741 (the softmax denominator's usual name)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    kv_dtype = v_cache_ptr.dtype.element_ty
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        valid = tokens < end
        page = tl.load(page_table_ptr + seq * stride_pt + tokens // PAGE_SIZE, mask=valid, other=0)
        rows = (
            page.to(tl.int64) * stride_cache_page
            + (tokens % PAGE_SIZE) * stride_cache_slot
            + kv_head * stride_cache_h
        )
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = mma(q, tl.trans(k), INTERPRET) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + mma(cast(p, kv_dtype, INTERPRET), v, INTERPRET)
        m = m_new

    # An empty split (short sequence) has l == 0: it writes a zero output with weight -inf.
    has_tokens = l > 0.0
    out = acc / tl.where(has_tokens, l, 1.0)[:, None]
    lse = tl.where(has_tokens, m + tl.log2(tl.where(has_tokens, l, 1.0)), float("-inf"))
    po = part_out_ptr + seq * stride_pob + q_heads[:, None] * stride_poh + split * stride_pos
    tl.store(po + d[None, :], out, mask=q_mask)
    pl = part_lse_ptr + seq * stride_plb + q_heads * stride_plh + split
    tl.store(pl, lse, mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Stage 2: merge the splits of one (sequence, query head) by their log-sum-exps."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(
        part_lse_ptr + seq * stride_plb + head * stride_plh + s, mask=s_mask, other=float("-inf")
    )
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # empty splits: exp2(-inf) = 0
    mask = s_mask[:, None] & (d < HEAD_DIM)[None, :]
    po = part_out_ptr + seq * stride_pob + head * stride_poh + s[:, None] * stride_pos + d[None, :]
    partial = tl.load(po, mask=mask, other=0.0)
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    o = out_ptr + seq * stride_ob + head * stride_oh + d
    tl.store(o, cast(out, out_ptr.dtype.element_ty, INTERPRET), mask=d < HEAD_DIM)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """How many ranges to cut each sequence into, from host-known shapes only.

    Enough (sequence, KV head, split) programs for ``_WAVES`` per SM, but no split shorter than
    ``_MIN_TOKENS_PER_SPLIT`` tokens of the longest possible context, and at most ``_MAX_SPLITS``
    (stage 2 holds all splits of a head in one tile).
    """
    wanted = cdiv(_WAVES * sms, max(batch * num_kv_heads, 1))
    useful = cdiv(max_context, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, _MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int = _BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Triton version of :func:`trio_infer_kernels.reference.decode_attention` (same arguments,
    [B, Hq, D]).

    The keyword-only arguments are tuning knobs (``num_splits=None`` picks it from the shapes);
    the tests use them to cover several tiles and splits with small tensors.
    """
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1:3]
    q, page_table = check_paged_attention_inputs(q, k_cache, v_cache, page_table)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        max_context = page_table.shape[1] * page_size
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, device_sms(q))

    part_out = torch.empty(
        batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = next_power_of_2(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        scale * math.log2(math.e),
        num_splits,
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        INTERPRET=is_interpreted(_decode_split_kernel),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _decode_reduce_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=next_power_of_2(num_splits),
        BLOCK_D=block_d,
        INTERPRET=is_interpreted(_decode_reduce_kernel),
    )
    return out
