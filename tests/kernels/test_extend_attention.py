"""Triton paged extend (prefill / chunked prefill) attention against the torch reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import TOLERANCE, paged_batch, randn

from trio_infer_kernels import reference
from trio_infer_kernels.extend_attention import extend_attention

DTYPES = [torch.float32, torch.bfloat16]


def _check(
    chunks: list[tuple[int, int]],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    **knobs: int | None,
) -> None:
    """``chunks[b] = (cached, new)``: sequence b has ``cached`` tokens before a chunk of ``new``."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in chunks]
    batch = paged_batch(seq_lens, page_size, num_kv_heads, head_dim, dtype, gen)
    new = torch.tensor([n for _, n in chunks], dtype=torch.int64)
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    query_start_loc[1:] = new.cumsum(0)
    q = randn(int(new.sum()), num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    scale = 1 / math.sqrt(head_dim)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, query_start_loc, batch.seq_lens,
            scale)
    expected = reference.extend_attention(*args)
    got = extend_attention(*args, **knobs)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [4, 16])
def test_extend_matches_reference(
    page_size: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    chunks = [
        (0, 21),  # a fresh prompt spanning two query blocks, ending mid-page
        (2 * page_size, 9),  # chunked prefill whose cached prefix ends on a page boundary
        (7, 1),  # a one-token chunk (decode-like) after an unaligned prefix
        (0, 1),  # a one-token prompt
        (5, 0),  # a sequence with nothing new this step
        (19, 16),  # prefix not on a tile boundary, chunk exactly one query block
    ]
    _check(chunks, page_size, 2, group, head_dim, dtype, seed=page_size * group + head_dim,
           block_m=16, block_n=16)


def test_extend_default_tiles() -> None:
    """The GPU launch configuration itself (128x64 tiles), not just the test-sized one."""
    _check([(0, 130), (64, 70), (3, 1)], 16, 2, 2, 128, torch.bfloat16, seed=5)


def test_extend_known_max_query_len() -> None:
    """Passing the longest chunk (no device-to-host read) gives the same answer."""
    _check([(0, 20), (10, 5)], 4, 1, 2, 64, torch.float32, seed=9, max_query_len=20,
           block_m=16, block_n=16)


@settings(max_examples=10, deadline=None, database=None, derandomize=True)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=3)
    .filter(lambda cs: all(c + n > 0 for c, n in cs) and sum(n for _, n in cs) > 0),
    page_size=st.sampled_from([4, 16, 32]),
    num_kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    block_m=st.sampled_from([16, 32]),
    block_n=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_extend_random_shapes(
    chunks: list[tuple[int, int]],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    block_m: int,
    block_n: int,
    seed: int,
) -> None:
    _check(chunks, page_size, num_kv_heads, group, head_dim, dtype, seed,
           block_m=block_m, block_n=block_n)
