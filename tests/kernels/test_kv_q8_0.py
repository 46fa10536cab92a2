"""The q8_0 KV cache of the C kernels (cpu_kernels.c: kv_store, kv_load): written as ggml's
quantize_row_q8_0 writes a block (d = max |x| / 127 kept as fp16, codes round(x / d)), and read
as d * code, so attention over a q8_0 cache is bitwise attention over its dequantized values in
an fp32 cache, on every path (decode, extend, the one-call decode step)."""

from __future__ import annotations

import numpy as np
import pytest

from trio_infer_kernels import cpu

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the CPU kernels do not build here")

HQ, HKV, D, S, PAGES = 4, 2, 64, 16, 6


def reference_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_0_ref over rows of 32: (fp16 scales, int8 codes)."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    scaled = blocks * inv[:, None]
    codes = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))  # roundf: half away
    return d.astype(np.float16), codes.astype(np.int8)


def dequantized(cache: np.ndarray) -> np.ndarray:
    """A q8_0 cache [.., D / 32 * 34] as the fp32 values it holds [.., D]."""
    blocks = cache.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    codes = blocks[:, 2:].view(np.int8).astype(np.float32)
    return (d * codes).reshape(*cache.shape[:-1], cache.shape[-1] // 34 * 32)


def filled(rng: np.random.Generator, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q8_0 K and V caches with ``tokens`` positions stored through rope_store at scattered
    slots, and the rotated keys and the values stored."""
    kernels = cpu.require()
    q = rng.standard_normal((tokens, HQ, D), dtype=np.float32)
    k = rng.standard_normal((tokens, HKV, D), dtype=np.float32) * 3
    v = rng.standard_normal((tokens, HKV, D), dtype=np.float32)
    k[0, 0, :32] = 0  # an all-zero block: d = 0, codes 0
    positions = np.arange(tokens, dtype=np.int64)
    slots = np.arange(tokens, dtype=np.int64)
    angles = np.outer(np.arange(tokens), 1e-2 * np.arange(1, D // 2 + 1)).astype(np.float32)
    cos_sin = np.concatenate([np.cos(angles), np.sin(angles)], axis=1)
    shape = (PAGES, S, HKV, D // 32 * cpu.Q8_0_BLOCK_BYTES)
    k_cache, v_cache = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
    kernels.rope_store(q, k, v, positions, slots, cos_sin, k_cache, v_cache)
    return k_cache, v_cache, k, v  # k rotated in place


def test_stored_blocks_are_ggml_q8_0_blocks() -> None:
    k_cache, v_cache, k, v = filled(np.random.default_rng(0), PAGES * S)
    for cache, values in ((k_cache, k), (v_cache, v)):
        blocks = cache.reshape(-1, 34)
        d, codes = reference_q8_0(values)
        assert np.array_equal(blocks[:, :2].copy().view(np.float16).ravel(), d)
        assert np.array_equal(blocks[:, 2:].view(np.int8), codes)


@pytest.mark.parametrize("batch", [1, 5])
def test_attention_over_q8_0_is_attention_over_its_values(batch: int) -> None:
    kernels = cpu.require()
    rng = np.random.default_rng(batch)
    k_cache, v_cache, _, _ = filled(rng, PAGES * S)
    k32, v32 = dequantized(k_cache), dequantized(v_cache)
    tables = np.stack([rng.permutation(PAGES) for _ in range(batch)]).astype(np.int64)
    lens = rng.integers(1, PAGES * S + 1, batch).astype(np.int64)
    q = rng.standard_normal((batch, HQ, D), dtype=np.float32)
    scale = D ** -0.5
    got = kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale, PAGES * S, 2)
    want = kernels.decode_attention(q, k32, v32, tables, lens, scale, PAGES * S, 2)
    assert np.array_equal(got, want)
    chunks = np.minimum(lens, 7)
    qsl = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    qx = rng.standard_normal((int(qsl[-1]), HQ, D), dtype=np.float32)
    got = kernels.extend_attention(qx, k_cache, v_cache, tables, qsl, lens, scale, PAGES * S, 2)
    want = kernels.extend_attention(qx, k32, v32, tables, qsl, lens, scale, PAGES * S, 2)
    assert np.array_equal(got, want)


def test_a_q8_0_cache_takes_heads_of_whole_blocks_only() -> None:
    assert cpu.kv_row_bytes("q8_0", 64) == 68 and cpu.kv_row_bytes("float16", 64) == 128
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu.kv_row_bytes("q8_0", 80)
