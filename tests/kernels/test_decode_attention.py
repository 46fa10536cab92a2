"""Triton paged decode attention against the torch reference, under the interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import TOLERANCE, paged_batch, randn

from trio_infer_kernels import reference
from trio_infer_kernels.decode_attention import choose_num_splits, decode_attention

DTYPES = [torch.float32, torch.bfloat16]


def _check(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    **knobs: int | None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = paged_batch(seq_lens, page_size, num_kv_heads, head_dim, dtype, gen)
    q = randn(len(seq_lens), num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    scale = 1 / math.sqrt(head_dim)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, scale)
    expected = reference.decode_attention(*args)
    got = decode_attention(*args, **knobs)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [4, 16])
def test_decode_matches_reference(
    page_size: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    # Ragged lengths: a single token, one ending exactly on a page boundary, one ending exactly
    # on a tile boundary, and longer ones spanning several tiles and pages. Three splits of
    # 16-token tiles leave the short sequences with empty splits, which the reduce must ignore.
    seq_lens = [1, 3 * page_size, 32, 45, 70]
    _check(seq_lens, page_size, 2, group, head_dim, dtype, seed=page_size * group + head_dim,
           num_splits=3, block_n=16)


@pytest.mark.parametrize("num_splits", [None, 1, 2, 8])
def test_decode_split_counts(num_splits: int | None) -> None:
    """One split (no split-K), the automatic choice, and more splits than some sequences have
    tiles: all must give the same answer."""
    _check([1, 17, 64, 100], 16, 2, 2, 64, torch.float32, seed=7, num_splits=num_splits,
           block_n=16)


def test_decode_default_tiles() -> None:
    """The GPU launch configuration itself (64-token tiles), not just the test-sized one."""
    _check([1, 63, 64, 65, 200], 16, 2, 4, 128, torch.bfloat16, seed=3)


@settings(max_examples=10, deadline=None, database=None, derandomize=True)
@given(
    seq_lens=st.lists(st.integers(1, 80), min_size=1, max_size=4),
    page_size=st.sampled_from([4, 16, 32]),
    num_kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    num_splits=st.integers(1, 4),
    block_n=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_decode_random_shapes(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int,
    block_n: int,
    seed: int,
) -> None:
    _check(seq_lens, page_size, num_kv_heads, group, head_dim, dtype, seed,
           num_splits=num_splits, block_n=block_n)


def test_choose_num_splits() -> None:
    # A big batch already fills the GPU: no split.
    assert choose_num_splits(batch=256, num_kv_heads=8, max_context=2048, sms=132) == 1
    # One long sequence: split, but bounded.
    assert 1 < choose_num_splits(batch=1, num_kv_heads=8, max_context=32768, sms=132) <= 32
    # A short context is never cut into splits shorter than the minimum.
    assert choose_num_splits(batch=1, num_kv_heads=1, max_context=256, sms=132) == 1


def test_decode_rejects_bad_gqa() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = paged_batch([4], 4, 2, 64, torch.float32, gen)
    q = randn(1, 3, 64, dtype=torch.float32, gen=gen)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, 1.0)
