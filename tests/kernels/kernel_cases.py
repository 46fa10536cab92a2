"""Random inputs in the paged-KV layout, shared by the kernel tests.

Every builder takes a ``torch.Generator`` so a failing case is reproducible from its seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tolerances per dtype: fp32 kernels agree with the references to rounding noise; bf16 ones
# differ by a few units in the last place of bf16 (8 bits of mantissa), since the Triton kernels
# round intermediate products (e.g. attention probabilities) at different points.
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@dataclass
class PagedBatch:
    """A paged KV cache holding ``seq_lens[b]`` tokens for each sequence, pages scattered."""

    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int64, rows padded with 0
    seq_lens: torch.Tensor  # [B] int64


def paged_batch(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_pages: int = 3,
) -> PagedBatch:
    """Fill a cache whose pages are handed out in a random order, with some pages left unused.

    Unused slots hold large values, so a kernel that reads past a sequence's end (or a wrong
    page) produces a visibly wrong answer rather than a plausible one.
    """
    pages_per_seq = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 1e4, dtype=dtype)
    v_cache = torch.full(shape, -1e4, dtype=dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    max_pages = max(max(pages_per_seq), 1) + 1  # one padding column beyond the longest row
    page_table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int64)
    for b, (n, count) in enumerate(zip(seq_lens, pages_per_seq)):
        pages = [order.pop() for _ in range(count)]
        page_table[b, :count] = torch.tensor(pages, dtype=torch.int64)
        for p in range(n):
            page, offset = pages[p // page_size], p % page_size
            k_cache[page, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[page, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
    return PagedBatch(k_cache, v_cache, page_table, torch.tensor(seq_lens, dtype=torch.int64))


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)
