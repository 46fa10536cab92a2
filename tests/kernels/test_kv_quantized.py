"""The q8_0 and q4_0 KV caches of the C kernels (cpu_kernels.c: kv_store, kv_load): written as
ggml's quantize_row_q8_0 / quantize_row_q4_0 write a block (q8_0: d = max |x| / 127 kept as
fp16, codes round(x / d); q4_0: d = the value of max |x| over -8, nibbles x / d + 8), and read as
d * code (d * (nibble - 8)), so attention over a quantized cache is bitwise attention over its
dequantized values in an fp32 cache, on every path (decode, extend; the one-call decode step in
tests/test_gguf.py)."""

from __future__ import annotations

import numpy as np
import pytest

from trio_infer_kernels import cpu

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the CPU kernels do not build here")

HQ, HKV, D, S, PAGES = 4, 2, 64, 16, 6


def reference(kind: str, x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref over rows of 32: the blocks' bytes."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    if kind == "q8_0":
        d = np.abs(blocks).max(axis=1) / np.float32(127)
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
        scaled = blocks * inv[:, None]
        codes = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8)
        body = codes.view(np.uint8)
    else:
        at = np.abs(blocks).argmax(axis=1)
        d = blocks[np.arange(len(blocks)), at] / np.float32(-8)
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
        nib = np.minimum(15, np.trunc(blocks * inv[:, None] + np.float32(8.5))).astype(np.uint8)
        body = nib[:, :16] | (nib[:, 16:] << 4)
    return np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), body], axis=1)


def dequantized(kind: str, cache: np.ndarray) -> np.ndarray:
    """A quantized cache [.., D / 32 * block bytes] as the fp32 values it holds [.., D]."""
    size = cpu.BLOCK_BYTES[kind]
    blocks = cache.reshape(-1, size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if kind == "q8_0":
        codes = blocks[:, 2:].view(np.int8).astype(np.float32)
    else:
        qs = blocks[:, 2:]
        codes = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32) - 8
    return (d * codes).reshape(*cache.shape[:-1], cache.shape[-1] // size * 32)


def filled(kind: str, rng: np.random.Generator, tokens: int,
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``kind`` K and V caches with ``tokens`` positions stored through rope_store at scattered
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
    shape = (PAGES, S, HKV, D // 32 * cpu.BLOCK_BYTES[kind])
    k_cache, v_cache = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
    kernels.rope_store(q, k, v, positions, slots, cos_sin, k_cache, v_cache)
    return k_cache, v_cache, k, v  # k rotated in place


KINDS = ["q8_0", "q4_0"]


@pytest.mark.parametrize("kind", KINDS)
def test_stored_blocks_are_ggmls_blocks(kind: str) -> None:
    k_cache, v_cache, k, v = filled(kind, np.random.default_rng(0), PAGES * S)
    for cache, values in ((k_cache, k), (v_cache, v)):
        assert np.array_equal(cache.reshape(-1, cpu.BLOCK_BYTES[kind]), reference(kind, values))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 5])
def test_attention_over_a_quantized_cache_is_attention_over_its_values(kind: str, batch: int) -> None:
    kernels = cpu.require()
    rng = np.random.default_rng(batch)
    k_cache, v_cache, _, _ = filled(kind, rng, PAGES * S)
    k32, v32 = dequantized(kind, k_cache), dequantized(kind, v_cache)
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


def test_a_quantized_cache_takes_heads_of_whole_blocks_and_says_its_kind_by_its_rows() -> None:
    assert cpu.kv_row_bytes("q8_0", 64) == 68 and cpu.kv_row_bytes("q4_0", 64) == 36
    assert cpu.kv_row_bytes("float16", 64) == 128
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu.kv_row_bytes("q4_0", 80)
    assert cpu.kv_kind_name(np.zeros((2, 68), np.uint8), 64) == "q8_0"
    assert cpu.kv_kind_name(np.zeros((2, 36), np.uint8), 64) == "q4_0"
    with pytest.raises(ValueError, match="neither q8_0 nor q4_0"):
        cpu.kv_kind_name(np.zeros((2, 64), np.uint8), 64)
