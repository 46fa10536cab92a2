"""The memory-bound Triton kernels against their torch references: KV store, RMSNorm, rotary,
SiLU-and-mul. bf16 results must match bit for bit where the kernel rounds exactly where the
reference does (all four do), fp32 ones to rounding noise."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import TOLERANCE, randn

from trio_infer_kernels import reference
from trio_infer_kernels.activation import silu_and_mul
from trio_infer_kernels.rms_norm import rms_norm
from trio_infer_kernels.rotary import rotary_embedding
from trio_infer_kernels.store_kv import store_kv

DTYPES = [torch.float32, torch.bfloat16]


def _assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    else:
        torch.testing.assert_close(got, expected, **TOLERANCE[got.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [4, 16])
def test_store_kv(page_size: int, head_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(page_size + head_dim)
    num_pages, num_kv_heads, num_tokens = 6, 2, 11
    # k and v are views into a fused QKV projection, as a model produces them (strided rows).
    qkv = randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    k = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, -1)
    v = qkv[:, (4 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, -1)
    # Scattered slots, including the first and the last slot of the cache.
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[0], slots[1] = 0, num_pages * page_size - 1
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*shape, dtype=dtype, gen=gen), randn(*shape, dtype=dtype, gen=gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 200), (1, 1024)])
def test_rms_norm(shape: tuple[int, ...], with_residual: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = randn(*shape, dtype=dtype, gen=gen) * 3
    weight = randn(shape[-1], dtype=dtype, gen=gen)
    residual = randn(*shape, dtype=dtype, gen=gen) if with_residual else None
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    out_ref, new_residual_ref = reference.rms_norm(x, weight, 1e-6, residual)
    _assert_matches(out, out_ref)
    if with_residual:
        _assert_matches(new_residual, new_residual_ref)
    else:
        assert new_residual is None


def test_rms_norm_strided_rows() -> None:
    """A non-contiguous input (every other row) is read through its row stride."""
    gen = torch.Generator().manual_seed(1)
    x = randn(8, 96, dtype=torch.bfloat16, gen=gen)[::2]
    weight = randn(96, dtype=torch.bfloat16, gen=gen)
    _assert_matches(rms_norm(x, weight, 1e-5)[0], reference.rms_norm(x, weight, 1e-5)[0])


def _cos_sin_cache(max_pos: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_rotary(group: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(group + head_dim)
    num_tokens, num_kv_heads = 7, 2
    q = randn(num_tokens, num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    positions[0] = 0
    cache = _cos_sin_cache(4096, head_dim, cache_dtype)
    q_out, k_out = rotary_embedding(q, k, positions, cache)
    q_ref, k_ref = reference.rotary_embedding(q, k, positions, cache)
    _assert_matches(q_out, q_ref)
    _assert_matches(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 2 * 64), (2, 5, 2 * 300), (1, 2 * 1024)])
def test_silu_and_mul(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = randn(*shape, dtype=dtype, gen=gen) * 4
    # 128-column blocks: several blocks per row, the last one partial for width 300.
    _assert_matches(silu_and_mul(x, block=128), reference.silu_and_mul(x))


def test_empty_inputs() -> None:
    """Zero tokens (an idle step) launch nothing and return empty results."""
    x = torch.empty(0, 64)
    assert silu_and_mul(x).shape == (0, 32)
    assert rms_norm(x, torch.ones(64), 1e-6)[0].shape == (0, 64)
    no_positions = torch.empty(0, dtype=torch.int64)
    cache = _cos_sin_cache(8, 64, torch.float32)
    q, k = rotary_embedding(torch.empty(0, 4, 64), torch.empty(0, 2, 64), no_positions, cache)
    assert q.shape == (0, 4, 64) and k.shape == (0, 2, 64)
    kv, kv_cache = torch.empty(0, 2, 64), torch.zeros(1, 4, 2, 64)
    store_kv(kv, kv, kv_cache, kv_cache.clone(), no_positions)
