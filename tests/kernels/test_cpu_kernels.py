"""The C kernels of the CPU path against the torch references (and gguf's own dequantizer).

Every kernel computes in fp32 like its reference, so they agree to float rounding; the linear
kernel is checked on both of its code paths (a few rows: weights unpacked in registers; more:
dequantized tiles) and across its 64-row passes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels import cpu, ops, reference
from kernels.cpu import PackedWeight

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the CPU kernels do not build here")


def pack(w: torch.Tensor, fmt: str) -> tuple[PackedWeight, torch.Tensor]:
    """``w`` quantized to ``fmt`` by gguf, and the fp32 values those blocks stand for."""
    qtype = getattr(GGMLQuantizationType, fmt)
    blocks = np.ascontiguousarray(quantize(w.numpy(), qtype))
    packed = PackedWeight.from_blocks(
        fmt, torch.from_numpy(blocks).view(torch.uint8).reshape(w.shape[0], -1), w.shape[1])
    return packed, torch.from_numpy(dequantize(blocks, qtype)).reshape(w.shape)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [96, 576])  # 3 and 18 blocks: a part of a group of 8, and more
def test_linear_matches_dequantized_matmul(fmt: str, rows: int, bias: bool, k: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(70, k, generator=g) * 0.05  # 70 rows: a last tile of 2 weight rows
    packed, dense = pack(w, fmt)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(70, generator=g) if bias else None
    got = ops.linear(x, packed, b)
    want = (x.double() @ dense.double().T + (b.double() if b is not None else 0)).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("k", [96, 128, 288, 576])
def test_linear_with_int16_activations_is_close(fmt: str, rows: int, k: int) -> None:
    """1-3 rows take the int16 kernel (x rounded per 32-block: relative error ~5e-5); from 4
    rows on the exact kernel runs whatever the flag. K of 3, 4, 9 and 18 blocks: the kernel
    takes 8 blocks at a time, 4-bit codes two blocks at a time (an odd block count pads)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(64, k, generator=g) * 0.05
    packed, dense = pack(w, fmt)
    packed = PackedWeight(packed.fmt, packed.data, packed.in_features, int16_activations=True)
    x = torch.randn(rows, k, generator=g)
    want = (x.double() @ dense.double().T).float()
    got = ops.linear(x, packed)
    err = ((got - want).norm() / want.norm()).item()
    assert err < (2e-4 if rows < 4 else 1e-6), err


def test_linear_refuses_what_it_cannot_run() -> None:
    packed, _ = pack(torch.randn(8, 32), "Q8_0")
    with pytest.raises(ValueError, match="Q8_0 weight needs"):
        ops.linear(torch.randn(2, 32, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="cannot pack"):
        PackedWeight.empty("Q4_1", 8, 33)


def test_embedding_of_packed_rows() -> None:
    packed, dense = pack(torch.randn(50, 64), "Q8_0")
    ids = torch.tensor([0, 49, 7, 7])
    torch.testing.assert_close(ops.embedding(ids, packed), dense[ids], rtol=0, atol=0)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(residual: bool) -> None:
    x, r, w = torch.randn(17, 576), torch.randn(17, 576), torch.randn(576)
    got = ops.rms_norm(x, w, 1e-5, r if residual else None)
    want = reference.rms_norm(x, w, 1e-5, r if residual else None)
    torch.testing.assert_close(got[0], want[0])
    if residual:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    else:
        assert got[1] is None


def test_silu_and_mul() -> None:
    x = torch.randn(9, 2 * 1536) * 4
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))


def _paged(num_pages: int, page_size: int, hkv: int, d: int, g: torch.Generator):
    return (torch.randn(num_pages, page_size, hkv, d, generator=g),
            torch.randn(num_pages, page_size, hkv, d, generator=g))


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (8, 2, 24)])
def test_rotary_store_on_a_fused_projection(hq: int, hkv: int, d: int) -> None:
    """q/k/v are strided views into one qkv output, as the model passes them."""
    g = torch.Generator().manual_seed(hq)
    t, page_size = 5, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    caches = _paged(6, page_size, hkv, d, g)
    cos_sin = torch.randn(64, d, generator=g)
    positions = torch.tensor([0, 3, 9, 10, 31])
    slots = torch.tensor([5, 0, 23, 12, 7])

    def split(x: torch.Tensor):
        q, k, v = x.split((hq * d, hkv * d, hkv * d), dim=-1)
        return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)

    want_caches = tuple(c.clone() for c in caches)
    q, k, v = split(qkv.clone())
    want_q, want_k = reference.rotary_embedding(q, k, positions, cos_sin)
    reference.store_kv(want_k, v, *want_caches, slots)
    got_q, got_k = ops.rotary_store(*split(qkv), positions, cos_sin, *caches, slots)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
    for got, want in zip(caches, want_caches):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (8, 2, 24)])
@pytest.mark.parametrize("lens", [[1], [37], [5, 64, 17, 1, 40]])
def test_decode_attention(hq: int, hkv: int, d: int, lens: list[int]) -> None:
    g = torch.Generator().manual_seed(len(lens) * d)
    page_size, num_pages = 16, 24
    k_cache, v_cache = _paged(num_pages, page_size, hkv, d, g)
    max_pages = max((n + page_size - 1) // page_size for n in lens)
    perm = torch.randperm(num_pages, generator=g)
    page_table = perm[: len(lens) * max_pages].view(len(lens), max_pages).contiguous()
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens), hq, d, generator=g)
    got = ops.decode_attention(q, k_cache, v_cache, page_table, seq_lens, d**-0.5)
    want = reference.decode_attention(q, k_cache, v_cache, page_table, seq_lens, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_build_is_cached(tmp_path) -> None:
    first = cpu.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
