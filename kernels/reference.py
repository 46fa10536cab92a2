"""Plain torch reference implementations of every kernel.

These are the CPU path of the engine and the oracle the Triton kernels are tested against, so they
favour clarity over speed, but they must still be batched: no Python loops over tokens or over
the vocabulary, only over sequences where the shapes are ragged.

Paged KV layout, shared by every kernel:
    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
    A token at position ``p`` of a sequence lives in page ``page_table[seq, p // page_size]`` at
    offset ``p % page_size``; its flat *slot* is ``page * page_size + offset``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ([T, Hkv, D]) into the flat slots ``slot_mapping`` ([T], int64)."""
    num_pages, page_size = k_cache.shape[:2]
    k_cache.view(num_pages * page_size, *k_cache.shape[2:]).index_copy_(
        0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_pages * page_size, *v_cache.shape[2:]).index_copy_(
        0, slot_mapping, v.to(v_cache.dtype))


def _gather_pages(cache: torch.Tensor, page_table: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_pages] page ids -> [B, max_len, Hkv, D] keys or values, in sequence order."""
    page_size = cache.shape[1]
    num_pages = (max_len + page_size - 1) // page_size
    batch = page_table.shape[0]
    # index_select copies whole pages (contiguous blocks): much faster than advanced indexing.
    pages = cache.index_select(0, page_table[:, :num_pages].reshape(-1))
    return pages.view(batch, num_pages * page_size, *cache.shape[2:])[:, :max_len]


# Sequences whose lengths are within this ratio share one padded attention call.
_BUCKET_RATIO = 1.5


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its first ``seq_lens[b]`` cached tokens.

    q: [B, Hq, D]; page_table: [B, max_pages] int; seq_lens: [B] int (>= 1, includes the query
    token, whose K/V must already be stored). Returns [B, Hq, D]. Hq must be a multiple of Hkv
    (grouped-query attention).

    The torch path gathers each sequence's pages into a padded buffer, so a batch mixing short
    and long contexts would copy and attend over mostly padding. Sequences are therefore grouped
    by length (within ``_BUCKET_RATIO`` of each other) and each group gets its own call: on a
    batch with lengths from 48 to 768 this is 2-7x faster than one padded call.
    """
    lens = seq_lens.tolist()
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    if not order or lens[order[0]] <= lens[order[-1]] * _BUCKET_RATIO:
        return _decode_attention_padded(q, k_cache, v_cache, page_table, seq_lens, scale)
    out = torch.empty_like(q)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and lens[order[end]] * _BUCKET_RATIO >= lens[order[start]]:
            end += 1
        idx = torch.tensor(order[start:end], device=q.device)
        out[idx] = _decode_attention_padded(
            q[idx], k_cache, v_cache, page_table[idx], seq_lens[idx], scale
        )
        start = end
    return out


def _decode_attention_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """All of ``q``'s sequences in one call, padded to the longest.

    The query heads that share a KV head are laid out as that head's "query positions", so one
    plain (non-causal, masked) SDPA call does grouped-query decode without repeating K/V.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_len = int(seq_lens.max())
    # a cache in a narrower dtype (fp16 KV on the CPU) is widened to q's as it is read
    k = _gather_pages(k_cache, page_table, max_len).to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather_pages(v_cache, page_table, max_len).to(q.dtype).transpose(1, 2)
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    qg = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for a chunk of new tokens per sequence (prefill, chunked prefill).

    q: [T, Hq, D], the new tokens of all sequences packed without padding; sequence ``b`` owns rows
    ``query_start_loc[b]:query_start_loc[b+1]``. Those tokens are the *last* ones of its first
    ``seq_lens[b]`` tokens, whose K/V (earlier pages plus the chunk itself) are already stored.
    Query ``i`` of a chunk of length ``n`` sits at position ``seq_len - n + i`` and sees keys
    ``0 ..= seq_len - n + i``. Returns [T, Hq, D].
    """
    out = torch.empty_like(q)
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        n = hi - lo
        if n == 0:
            continue
        k = _gather_pages(k_cache, page_table[b : b + 1], seq_len)[0].to(q.dtype)  # [L, Hkv, D]
        v = _gather_pages(v_cache, page_table[b : b + 1], seq_len)[0].to(q.dtype)
        qb = q[lo:hi].transpose(0, 1)  # [Hq, n, D]
        kb = k.transpose(0, 1)  # [Hkv, L, D]
        vb = v.transpose(0, 1)
        # Causal with an offset: query i sees keys up to seq_len - n + i.
        mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - n)
        ob = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=num_q_heads != num_kv_heads
        )
        out[lo:hi] = ob.transpose(0, 1)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim, computed in fp32.

    With ``residual`` given, first ``x = x + residual`` and return ``(norm(x), x)`` so the caller
    keeps the sum as the next residual (the fused form); otherwise return ``(norm(x), None)``.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)), residual


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (rotate the two halves of each head).

    q: [T, Hq, D], k: [T, Hkv, D], positions: [T] int, cos_sin_cache: [max_pos, D] holding
    ``cat(cos, sin)`` of the (already scaled) frequencies, each half D/2 wide. Returns new tensors.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = cos[:, None, :]
    sin = sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] holding ``cat(gate, up)`` -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
