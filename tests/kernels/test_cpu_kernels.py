"""The C kernels of the CPU path against the torch references (and gguf's own dequantizer).

Every kernel computes in fp32 like its reference, so they agree to float rounding; the linear
kernel is checked for every weight format it reads in place, on both of its code paths (a few
rows: weights unpacked in registers; more: dequantized tiles) and across its 64-row passes.
Weights are random blocks (every byte pattern is a valid block once its fp16 scales are finite),
so the K-quants are covered without a quantizer (gguf-py has none for them).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from trio_infer_kernels import cpu, ops, reference
from trio_infer_kernels.cpu import FORMATS, PackedParts, PackedWeight
from tests.kernels.blocks import KQUANTS, random_blocks

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the CPU kernels do not build here")


def pack(w: torch.Tensor, fmt: str) -> tuple[PackedWeight, torch.Tensor]:
    """``w`` quantized to ``fmt`` by gguf, and the fp32 values those blocks stand for."""
    qtype = getattr(GGMLQuantizationType, fmt)
    blocks = np.ascontiguousarray(quantize(w.numpy(), qtype))
    packed = PackedWeight.from_blocks(fmt, blocks.view(np.uint8).reshape(w.shape[0], -1), w.shape[1])
    return packed, torch.from_numpy(dequantize(blocks, qtype)).reshape(w.shape)


def packed_random(fmt: str, n: int, k: int, g: torch.Generator
                  ) -> tuple[PackedWeight, torch.Tensor]:
    """Random ``fmt`` blocks packed, and the fp32 values gguf's dequantizer says they stand for."""
    blocks = random_blocks(fmt, n, k, g)
    dense = dequantize(blocks, getattr(GGMLQuantizationType, fmt)).astype(np.float32)
    return PackedWeight.from_blocks(fmt, blocks, k), torch.from_numpy(dense).reshape(n, k)


def widths(fmt: str) -> list[int]:
    """3 and 18 blocks of 32 (a part of a group of 8, and more), or 1 and 3 super-blocks."""
    return [256, 768] if fmt in KQUANTS else [96, 576]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_packing_keeps_every_value(fmt: str) -> None:
    """tri_pack rearranges ggml's blocks without losing a bit: unpacked rows are gguf's values."""
    g = torch.Generator().manual_seed(FORMATS[fmt])
    for k in widths(fmt):
        packed, dense = packed_random(fmt, 9, k, g)
        assert packed.nbytes <= 1.03 * 9 * cpu.require().native_row_bytes(fmt, k)
        rows = torch.tensor([8, 0, 3, 3])
        assert torch.equal(ops.embedding(rows, packed), dense[rows])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 5, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_every_format_matches_a_float64_product(fmt: str, rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 100 + FORMATS[fmt])
    for k in widths(fmt):
        packed, dense = packed_random(fmt, 70, k, g)  # 70 rows: a last tile of 2 weight rows
        x = torch.randn(rows, k, generator=g)
        b = torch.randn(70, generator=g) if bias else None
        got = ops.linear(x, packed, b)
        want = x.double() @ dense.double().T + (b.double() if b is not None else 0)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 7])
def test_parts_in_different_formats_are_one_product(rows: int) -> None:
    """Q4_K_M's q and k in Q4_K with v in Q6_K: one call, each part's rows in its own format."""
    g = torch.Generator().manual_seed(rows)
    parts = [packed_random(fmt, n, 512, g) for fmt, n in (("Q4_K", 40), ("Q4_K", 8), ("Q6_K", 8))]
    fused = PackedParts(tuple(p for p, _ in parts))
    assert (fused.fmt, fused.out_features, fused.in_features) == ("Q4_K+Q4_K+Q6_K", 56, 512)
    dense = torch.cat([d for _, d in parts])
    x, b = torch.randn(rows, 512, generator=g), torch.randn(56, generator=g)
    want = x.double() @ dense.double().T + b.double()
    torch.testing.assert_close(ops.linear(x, fused, b).double(), want, rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())
    # int8 activations: every part (x rounded once; both layouts prepared)
    x8 = int8_exact_x(rows, 512, g)
    want8 = x8.double() @ dense.double().T + b.double()
    got8 = ops.linear(x8, fused.with_activations("int8"), b).double()
    assert ((got8 - want8).norm() / want8.norm()).item() < 1e-6


def int8_exact_x(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """x that rounds to int8 per 32-block without loss: integers times 1/4, each block's largest
    magnitude 127/4 (so its scale is 1/4 and every value is a multiple of it)."""
    x = torch.randint(-127, 128, (rows, k), generator=g).float()
    x.view(rows, k // 32, 32)[:, :, 5] = 127.0
    return x / 4


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 9, 130])
def test_int8_activations_are_exact_where_x_is_int8(fmt: str, rows: int) -> None:
    """Where rounding x to int8 loses nothing, the int8 kernels' product is the float64 one:
    every code, high bit, scale and offset is read right, at 1 row, in passes of 8 rows (9: 8 and
    1) and across 64-row passes (130). 16-bit float weights take the exact kernels."""
    g = torch.Generator().manual_seed(rows * 100 + FORMATS[fmt])
    for k in widths(fmt):
        packed, dense = packed_random(fmt, 70, k, g)
        x, b = int8_exact_x(rows, k, g), torch.randn(70, generator=g)
        want = x.double() @ dense.double().T + b.double()
        got = ops.linear(x, packed.with_activations("int8"), b).double()
        assert ((got - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_int8_activations_round_x_per_block(fmt: str) -> None:
    """Random x: within int8 rounding of the float64 product (relative error ~0.3-1.3% on random
    blocks, whose offsets are large), not exact; 16-bit float weights stay exact."""
    g = torch.Generator().manual_seed(FORMATS[fmt])
    for k in widths(fmt):
        packed, dense = packed_random(fmt, 70, k, g)
        x = torch.randn(5, k, generator=g)
        want = x.double() @ dense.double().T
        err = ((ops.linear(x, packed.with_activations("int8")).double() - want).norm()
               / want.norm()).item()
        assert err < 1e-6 if fmt in ("F16", "BF16") else 1e-4 < err < 3e-2, err


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [96, 576])  # 3 and 18 blocks: a part of a group of 8, and more
def test_linear_matches_dequantized_matmul(fmt: str, rows: int, bias: bool, k: int) -> None:
    """Blocks from gguf's own quantizer (of a weight), as a GGUF file holds them."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(70, k, generator=g) * 0.05  # 70 rows: a last tile of 2 weight rows
    packed, dense = pack(w, fmt)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(70, generator=g) if bias else None
    got = ops.linear(x, packed, b)
    want = (x.double() @ dense.double().T + (b.double() if b is not None else 0)).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_refuses_what_it_cannot_run() -> None:
    packed, _ = pack(torch.randn(8, 32), "Q8_0")
    with pytest.raises(ValueError, match="Q8_0 weight needs"):
        ops.linear(torch.randn(2, 32, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="cannot pack"):
        PackedWeight.empty("Q4_1", 8, 33)
    with pytest.raises(ValueError, match="cannot pack"):
        PackedWeight.empty("Q4_K", 8, 96)  # K-quants come in super-blocks of 256
    with pytest.raises(ValueError, match="cannot pack"):
        PackedWeight.empty("Q3_K", 8, 256)  # dequantized at load, never packed
    with pytest.raises(ValueError, match="blocks of shape"):
        PackedWeight.from_blocks("Q4_K", np.zeros((2, 100), dtype=np.uint8), 256)


def test_the_library_abi_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library whose structs or version differ from kernels/cpu.py's mirrors is refused."""
    import ctypes

    lib = ctypes.CDLL(str(cpu.build()))
    cpu.CpuKernels(lib)
    monkeypatch.setattr(cpu, "ABI_VERSION", cpu.ABI_VERSION + 1)
    with pytest.raises(cpu.BuildError, match="does not match"):
        cpu.CpuKernels(lib)


def test_a_failed_build_is_said_not_hidden(tmp_path) -> None:
    """Without a working compiler the kernels are unavailable, and the reason says why."""
    import subprocess
    import sys

    env = dict(os.environ, CC="/bin/false", TRIO_INFER_CACHE_DIR=str(tmp_path))
    code = ("from trio_infer_kernels import cpu, ops; print(cpu.load() is None); "
            "print(ops.compute_path('cpu'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "True"
    assert "torch-reference" in out[1] and "/bin/false failed" in out[1]
    assert "dequantized to fp32" in out[1]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 24), (4, 4, 128), (32, 32, 64)])
def test_decode_attention_gives_a_sequence_the_same_bits_alone_or_in_a_batch(
        dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    """Alone (one work item per query head), in a batch (per sequence: query heads grouped by KV
    head, or, where a position's row of all KV heads is long, the whole context walked once)
    and on one thread or two, a sequence's attention is the same sums in the same order."""
    g = torch.Generator().manual_seed(hq * d)
    page_size, num_pages = 16, 64
    k_cache, v_cache = (c.to(dtype) for c in _paged(num_pages, page_size, hkv, d, g))
    lens = [37, 1, 130, 16, 64, 9]
    table = torch.randperm(num_pages, generator=g)[:6 * 9].view(6, 9).contiguous()
    seq_lens, q = torch.tensor(lens), torch.randn(6, hq, d, generator=g)
    kernels = cpu.require()
    batch = kernels.decode_attention(q, k_cache, v_cache, table, seq_lens, d**-0.5, max(lens), 2)
    assert torch.equal(batch, kernels.decode_attention(q, k_cache, v_cache, table, seq_lens,
                                                       d**-0.5, max(lens), 1))
    for b, n in enumerate(lens):
        alone = kernels.decode_attention(q[b:b + 1], k_cache, v_cache, table[b:b + 1],
                                         seq_lens[b:b + 1], d**-0.5, n, 2)
        assert torch.equal(alone[0], batch[b]), b
    want = reference.decode_attention(q, k_cache, v_cache, table, seq_lens, d**-0.5)
    torch.testing.assert_close(batch, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 24), (32, 32, 64)])
def test_extend_attention_is_decode_attention_at_every_new_token(
        dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    """Chunks of new tokens (a whole prompt, a chunk after cached pages, one token, none)
    attend causally: close to the torch reference, and each new token at position p bitwise
    what decode attention gives a sequence of p + 1 positions (so the last token of a prefill
    and a decode step agree to the bit), on one thread or two."""
    g = torch.Generator().manual_seed(7 * hq + d)
    page_size, num_pages = 16, 48
    k_cache, v_cache = (c.to(dtype) for c in _paged(num_pages, page_size, hkv, d, g))
    seq_lens, chunks = [37, 130, 5, 16, 20], [37, 50, 1, 16, 0]
    table = torch.randperm(num_pages, generator=g)[:5 * 9].view(5, 9).contiguous()
    qsl = torch.tensor([0, *np.cumsum(chunks)], dtype=torch.int64)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    lens, kernels = torch.tensor(seq_lens), cpu.require()
    got = ops.extend_attention(q, k_cache, v_cache, table, qsl, lens, d**-0.5)
    want = reference.extend_attention(q, k_cache, v_cache, table, qsl, lens, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    one = kernels.extend_attention(q, k_cache, v_cache, table, qsl, lens, d**-0.5, max(seq_lens), 1)
    assert torch.equal(got, one)
    for b, (n, c) in enumerate(zip(seq_lens, chunks)):
        for i in range(c):
            t, p = int(qsl[b]) + i, n - c + i
            alone = kernels.decode_attention(q[t:t + 1], k_cache, v_cache, table[b:b + 1],
                                             torch.tensor([p + 1]), d**-0.5, p + 1, 2)
            assert torch.equal(alone[0], got[t]), (b, i)


def test_extend_attention_refuses_chunks_past_their_context() -> None:
    """A chunk longer than its sequence's context is refused, not read out of bounds."""
    k_cache, v_cache = _paged(4, 4, 2, 8, torch.Generator().manual_seed(0))
    q, table = torch.randn(6, 2, 8), torch.tensor([[0, 1]])
    with pytest.raises(ValueError):
        cpu.require().extend_attention(q, k_cache, v_cache, table, torch.tensor([0, 6]),
                                       torch.tensor([5]), 1.0, 5, 1)


def test_build_is_cached() -> None:
    """A second build of the same source and flags is the first one's file, not compiled again,
    and no temporary is left behind. In the user's cache folder, where the session compiles the
    library once anyway (on a fresh machine: the first build there); a fresh folder cost one more
    compile, 20-50 s on 2 cores."""
    first = cpu.build()
    mtime = first.stat().st_mtime_ns
    assert cpu.build() == first and first.stat().st_mtime_ns == mtime
    assert not list(first.parent.glob("*.tmp"))  # the temporary name is renamed, never left


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 24)])
def test_an_fp16_cache_stores_rounded_values_and_attends_over_them(hq: int, hkv: int, d: int) -> None:
    """fp16 KV (the CPU default): the C kernels store k and v rounded as torch's cast rounds them
    and read them back widened; attention equals the reference over the same fp16 cache."""
    g = torch.Generator().manual_seed(d)
    t, page_size, num_pages = 5, 4, 6
    q = torch.randn(t, hq, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    cos_sin = torch.randn(64, d, generator=g)
    positions, slots = torch.tensor([0, 3, 9, 10, 31]), torch.tensor([5, 0, 23, 12, 7])
    caches = [torch.zeros(num_pages, page_size, hkv, d, dtype=torch.float16) for _ in range(2)]
    want_q, want_k = reference.rotary_embedding(q.clone(), k.clone(), positions, cos_sin)
    got_q, got_k = ops.rotary_store(q, k, v, positions, cos_sin, *caches, slots)
    torch.testing.assert_close(got_k, want_k)
    flat_k, flat_v = (c.view(-1, hkv, d) for c in caches)
    assert torch.equal(flat_k[slots], want_k.half()) and torch.equal(flat_v[slots], v.half())

    full = [torch.randn(num_pages, page_size, hkv, d, generator=g).half() for _ in range(2)]
    table, lens = torch.tensor([[2, 0, 5], [4, 1, 3]]), torch.tensor([11, 3])
    qd = torch.randn(2, hq, d, generator=g)
    got = ops.decode_attention(qd, *full, table, lens, d**-0.5)
    want = reference.decode_attention(qd, *full, table, lens, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_refuses_a_context_past_its_bounds() -> None:
    """The C kernel reads as many keys as a context length says: one past max_len or past the
    page table is refused, not read out of bounds."""
    k_cache, v_cache = _paged(4, 4, 2, 8, torch.Generator().manual_seed(0))
    q = torch.randn(1, 2, 8)
    table = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="context length"):
        ops.decode_attention(q, k_cache, v_cache, table, torch.tensor([9]), 1.0)  # 2 pages: 8
    with pytest.raises(ValueError, match="context length"):
        ops.decode_attention(q, k_cache, v_cache, table, torch.tensor([5]), 1.0, max_seq_len=4)


# --- the 8-row interleaved layout (x8) of the int8 GEMM ---------------------------------------


def x8_twin(packed: PackedWeight) -> PackedWeight:
    """The same weight with int8 activations in the x8 layout, from a copy of its bytes."""
    rows = PackedWeight(packed.fmt, packed.data.copy(), packed.in_features, "int8")
    return rows.with_layout("x8")


@pytest.mark.parametrize("fmt", cpu.X8_FORMATS)
@pytest.mark.parametrize("n", [8, 29, 70])  # one group; 3 groups and 5 rows; 8 groups and 6 rows
def test_x8_layout_keeps_every_value(fmt: str, n: int) -> None:
    """The conversion is in place and loses no bit: rows read back out of their groups (the
    embedding lookup) are gguf's values, and converting back gives the row layout's bytes."""
    g = torch.Generator().manual_seed(n)
    packed, dense = packed_random(fmt, n, 512, g)
    rows = packed.with_activations("int8")
    x8 = x8_twin(packed)
    assert x8.layout == "x8" and x8.nbytes == packed.nbytes
    assert not np.array_equal(x8.data[: n // 8 * 8], rows.data[: n // 8 * 8])  # it did move
    assert np.array_equal(x8.data[n // 8 * 8:], rows.data[n // 8 * 8:])  # the last n % 8: rows
    ids = torch.tensor([0, 7, min(8, n - 1), n - 1, 3, n // 2])
    assert torch.equal(ops.embedding(ids, x8), dense[ids])
    assert np.array_equal(x8.with_layout("rows").data, rows.data)


@pytest.mark.parametrize("fmt", cpu.X8_FORMATS)
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 33, 130])
def test_x8_gemm_is_the_row_layout_int8_product(fmt: str, m: int) -> None:
    """The x8 GEMM sums the same integers as the row-layout int8 kernel (the same rounded x,
    scales and offsets), in another order of the float additions: equal to fp32 rounding
    (measured ~3e-7 of the largest output). 29 rows: 3 groups and 5 rows left in the row layout;
    130 rows of x: across the 64-row passes and the 4- and 8-row chunks."""
    g = torch.Generator().manual_seed(m * 10 + FORMATS[fmt])
    for k in (256, 768):
        packed, dense = packed_random(fmt, 29, k, g)
        x, b = torch.randn(m, k, generator=g), torch.randn(29, generator=g)
        want = ops.linear(x, packed.with_activations("int8"), b)
        got = ops.linear(x, x8_twin(packed), b)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * want.abs().max().item())
        # and exact where x rounds to int8 without loss (every code, bit and scale read right)
        xe = int8_exact_x(m, k, g)
        want64 = xe.double() @ dense.double().T + b.double()
        got64 = ops.linear(xe, x8_twin(packed), b).double()
        assert ((got64 - want64).norm() / want64.norm()).item() < 1e-6


@pytest.mark.parametrize("m", [1, 9, 33])
def test_x8_parts_in_different_formats_are_one_product(m: int) -> None:
    """Q4_K_M's q/k/v with v in Q6_K, every part in x8 (one with rows not a multiple of 8),
    next to a Q5_K part that stays in rows: one call, each part read in its own layout."""
    g = torch.Generator().manual_seed(m)
    parts = [packed_random(fmt, n, 512, g) for fmt, n in (("Q4_K", 40), ("Q5_K", 8), ("Q6_K", 12))]
    rows = PackedParts(tuple(p for p, _ in parts)).with_activations("int8")
    fused = PackedParts(tuple(PackedWeight(p.fmt, p.data.copy(), p.in_features, "int8")
                              for p in rows.parts)).with_layout("x8")
    assert [p.layout for p in fused.parts] == ["x8", "rows", "x8"]
    x, b = torch.randn(m, 512, generator=g), torch.randn(60, generator=g)
    want = ops.linear(x, rows, b)
    torch.testing.assert_close(ops.linear(x, fused, b), want, rtol=0,
                               atol=2e-6 * want.abs().max().item())


def test_x8_is_taken_only_where_it_is_read() -> None:
    """x8 is read only by the int8 kernels, for Q4_K and Q6_K with at least 8 rows: any other
    weight stays in rows, and an x8 weight refuses other activations."""
    g = torch.Generator().manual_seed(3)
    q4k, _ = packed_random("Q4_K", 16, 256, g)
    assert q4k.with_layout("x8") is q4k  # exact activations: stays in rows
    q40, _ = packed_random("Q4_0", 16, 256, g)
    assert q40.with_activations("int8").with_layout("x8").layout == "rows"
    short, _ = packed_random("Q6_K", 7, 256, g)
    assert short.with_activations("int8").with_layout("x8").layout == "rows"
    x8 = x8_twin(q4k)
    with pytest.raises(ValueError, match="x8 layout"):
        x8.with_activations("exact")
    with pytest.raises(ValueError, match="layout"):
        q4k.with_layout("x4")


@pytest.mark.parametrize("fmt", cpu.X8_FORMATS)
def test_x8_rows_of_x_do_not_depend_on_their_batch(fmt: str) -> None:
    """Each row of x is summed alone, in one order, whatever the rows around it: a row's
    output is bitwise the same at M = 1 and inside chunks of 4 and 8 and passes of 64 (what
    speculative decoding's verify rows rely on with int8 activations)."""
    g = torch.Generator().manual_seed(5)
    packed, _ = packed_random(fmt, 29, 512, g)
    w = x8_twin(packed)
    x = torch.randn(70, 512, generator=g)
    whole = ops.linear(x, w)
    for i in (0, 3, 8, 65, 69):
        assert torch.equal(ops.linear(x[i:i + 1], w)[0], whole[i])
    assert torch.equal(ops.linear(x[5:14], w), whole[5:14])


# --- the 16-row interleaved layout (x16) of the exact kernels ------------------------------------


def x16_twin(packed: PackedWeight) -> PackedWeight:
    """The same weight in the x16 layout (exact activations), from a copy of its bytes."""
    return PackedWeight(packed.fmt, packed.data.copy(), packed.in_features).with_layout("x16")


@pytest.mark.parametrize("fmt", cpu.X16_FORMATS)
@pytest.mark.parametrize("n", [16, 37, 70])  # one group; 2 groups and 5 rows; 4 groups and 6 rows
def test_x16_layout_keeps_every_value(fmt: str, n: int) -> None:
    """The conversion is in place and loses no bit: rows read back out of their groups (the
    embedding lookup) are gguf's values, and converting back gives the row layout's bytes."""
    g = torch.Generator().manual_seed(n)
    packed, dense = packed_random(fmt, n, widths(fmt)[1], g)
    x16 = x16_twin(packed)
    assert x16.layout == "x16" and x16.nbytes == packed.nbytes
    assert not np.array_equal(x16.data[: n // 16 * 16], packed.data[: n // 16 * 16])  # it did move
    assert np.array_equal(x16.data[n // 16 * 16:], packed.data[n // 16 * 16:])  # the last n % 16
    ids = torch.tensor([0, 15, min(16, n - 1), n - 1, 3, n // 2])
    assert torch.equal(ops.embedding(ids, x16), dense[ids])
    assert np.array_equal(x16.with_layout("rows").data, packed.data)


@pytest.mark.parametrize("fmt", cpu.X16_FORMATS)
def test_x16_products_are_the_one_row_kernels_bitwise(fmt: str) -> None:
    """A row in an x16 group gives, at every number of rows of x (1 to 130: the 8-row chunks and
    64-row passes) and on 1 or 2 threads, bitwise what the row layout's one-row kernel gives that
    row of x alone: the same products and additions in the same order, one weight row a lane.
    The rows left in rows (n % 16) give the row layout's own product at that M; every value is
    close to a float64 product."""
    g = torch.Generator().manual_seed(500 + FORMATS[fmt])
    for k in widths(fmt):  # Q4_0, Q4_1, Q8_0: 3 blocks, and 18 (2 past the last group of 8)
        packed, dense = packed_random(fmt, 37, k, g)
        x16 = x16_twin(packed)
        b = torch.randn(37, generator=g)
        x = torch.randn(130, k, generator=g)
        alone = torch.stack([ops.linear(x[i:i + 1], packed, b)[0] for i in range(130)])
        want = x.double() @ dense.double().T + b.double()
        for m in (1, 2, 3, 5, 6, 9, 130):
            for threads in (1, 2):
                got = cpu.require().linear(x[:m], x16, b, threads)
                assert torch.equal(got[:, :32], alone[:m, :32]), (fmt, k, m, threads)
                assert torch.equal(got[:, 32:], ops.linear(x[:m], packed, b)[:, 32:])
                torch.testing.assert_close(got.double(), want[:m], rtol=1e-5,
                                           atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("m", [1, 3, 9])
def test_x16_parts_in_different_formats_are_one_product(m: int) -> None:
    """Q4_K_M's q/k/v with v in Q6_K, each in x16 (one with rows not a multiple of 16), next to a
    BF16 part that has no x16 and stays in rows: one call, each part read in its own layout,
    the rows in x16 groups bitwise the row layout's one-row product, the others the row
    layout's own product at that M."""
    g = torch.Generator().manual_seed(m)
    parts = [packed_random(fmt, n, 512, g) for fmt, n in (("Q4_K", 40), ("BF16", 16), ("Q6_K", 16))]
    rows = PackedParts(tuple(p for p, _ in parts))
    fused = PackedParts(tuple(PackedWeight(p.fmt, p.data.copy(), p.in_features)
                              for p in rows.parts)).with_layout("x16")
    assert [p.layout for p in fused.parts] == ["x16", "rows", "x16"]
    x, b = torch.randn(m, 512, generator=g), torch.randn(72, generator=g)
    got = ops.linear(x, fused, b)
    # rows 32-39 (Q4_K's last 8) and 40-55 (BF16) are in the row layout
    assert torch.equal(got[:, 32:56], ops.linear(x, rows, b)[:, 32:56])
    for i in range(m):
        alone = ops.linear(x[i:i + 1], rows, b)[0]
        assert torch.equal(got[i, :32], alone[:32]) and torch.equal(got[i, 56:], alone[56:]), i


def test_x16_is_taken_only_where_it_is_read() -> None:
    """x16 is read only by the exact kernels, for the block formats (not 16-bit floats) with at
    least 16 rows: any other weight stays in rows, and an x16 weight refuses other activations."""
    g = torch.Generator().manual_seed(4)
    q4k, _ = packed_random("Q4_K", 16, 256, g)
    assert q4k.with_activations("int8").with_layout("x16").layout == "rows"
    f16, _ = packed_random("F16", 16, 256, g)
    assert f16.with_layout("x16") is f16
    short, _ = packed_random("Q4_1", 15, 256, g)
    assert short.with_layout("x16") is short
    x16 = x16_twin(q4k)
    with pytest.raises(ValueError, match="x16 layout"):
        x16.with_activations("int8")
    assert x16.with_layout("rows").with_activations("int8").with_layout("x8").layout == "x8"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_exact_rows_of_x_do_not_depend_on_their_batch(fmt: str) -> None:
    """With exact activations, each row of a product of M rows below the few-rows limit (1 to 5
    today) is bitwise the product of that row alone (the one-row kernel): what keeps speculative
    decoding's verify rows and a small batch's sequences on the plain greedy tokens. Past it (6
    to 17: the tiles) every row is still close to a float64 product, and bitwise the same at
    every M there (a tile's register block of rows, and the rows left over after the last full
    block, sum each product in the same order)."""
    limit = cpu.require().few_rows_exact()
    assert 2 <= limit <= 9
    g = torch.Generator().manual_seed(300 + FORMATS[fmt])
    for k in widths(fmt):
        packed, dense = packed_random(fmt, 19, k, g)
        b = torch.randn(19, generator=g)
        x = torch.randn(17, k, generator=g)
        alone = torch.stack([ops.linear(x[i:i + 1], packed, b)[0] for i in range(17)])
        want = x.double() @ dense.double().T + b.double()
        tol = {"rtol": 1e-5, "atol": 1e-5 * want.abs().max().item()}
        torch.testing.assert_close(alone.double(), want, **tol)
        tiles = ops.linear(x, packed, b)
        for m in range(2, 18):
            got = ops.linear(x[:m], packed, b)
            torch.testing.assert_close(got.double(), want[:m], **tol)
            if m < limit:
                for i in range(m):
                    assert torch.equal(got[i], alone[i]), (fmt, k, m, i)
            else:
                assert torch.equal(got, tiles[:m]), (fmt, k, m)


@pytest.mark.parametrize("rows", [2, 3, 5])
def test_exact_rows_of_parts_in_different_formats_do_not_depend_on_their_batch(rows: int) -> None:
    """A fused projection whose parts differ in format (Q4_K_M's Q4_K q, k and Q6_K v): each
    row of x's product is bitwise that row's alone, part by part."""
    assert rows < cpu.require().few_rows_exact()
    g = torch.Generator().manual_seed(40 + rows)
    parts = [packed_random(fmt, n, 512, g) for fmt, n in (("Q4_K", 24), ("Q4_K", 8), ("Q6_K", 8))]
    fused = PackedParts(tuple(p for p, _ in parts))
    x, b = torch.randn(rows, 512, generator=g), torch.randn(40, generator=g)
    got = ops.linear(x, fused, b)
    for i in range(rows):
        assert torch.equal(got[i], ops.linear(x[i:i + 1], fused, b)[0]), i


@pytest.mark.skipif(os.environ.get("TRIO_INFER_KERNEL_BUILDS") != "1",
                    reason="compiles the library a second time (~20-50 s): TRIO_INFER_KERNEL_BUILDS=1")
def test_every_build_gives_the_same_bits(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library built for AVX2 alone (no AVX-512: the lane-wise way of merging Q5_x's bit 4 and
    Q6_K's bits 4-5 into the codes, one block a pass in the x8 GEMM, 8 lanes a vector in x16)
    gives bitwise this machine's build's products, exact and int8, at 1, 3 and 9 rows of
    x (the x8 and x16 kernels at 1, 3, 9 and 33), and the same packed bytes: the instruction sets change
    how the integer codes are made, never the codes or the order of the float sums. Where this
    CPU has no AVX-512 the two builds are one and the test says so."""
    import ctypes

    if cpu.cflags() == cpu.CFLAGS:
        pytest.skip("this CPU's build is the AVX2 build")
    native = cpu.require()
    monkeypatch.setattr(cpu, "cflags", lambda: cpu.CFLAGS)
    avx2 = cpu.CpuKernels(ctypes.CDLL(str(cpu.build(tmp_path))))
    g = torch.Generator().manual_seed(19)
    for fmt in sorted(FORMATS):
        k = 768 if fmt in KQUANTS else 576  # 576: 18 blocks, 2 past the last group of 8
        blocks = random_blocks(fmt, 11, k, g)
        packed = [PackedWeight.from_blocks(fmt, blocks, k)]
        packed.append(PackedWeight.empty(fmt, 11, k))
        avx2.pack(fmt, blocks, k, packed[1].data, 1)
        assert np.array_equal(packed[0].data, packed[1].data), fmt
        for acts in ("exact", "int8"):
            for m in (1, 3, 9):
                x = torch.randn(m, k, generator=g)
                want = native.linear(x, packed[0].with_activations(acts), None, 1)
                got = avx2.linear(x, packed[1].with_activations(acts), None, 1)
                assert torch.equal(got, want), (fmt, acts, m)
        if fmt in cpu.X8_FORMATS:  # the x8 GEMM: two blocks a pass with AVX-512, one without
            for m in (1, 3, 9, 33):
                x = torch.randn(m, k, generator=g)
                want = native.linear(x, x8_twin(packed[0]), None, 1)
                got = avx2.linear(x, x8_twin(packed[1]), None, 1)
                assert torch.equal(got, want), (fmt, "x8", m)
        if fmt in cpu.X16_FORMATS:  # x16: 16 lanes a vector with AVX-512, two halves of 8 without
            for m in (1, 3, 9, 33):
                x = torch.randn(m, k, generator=g)
                want = native.linear(x, x16_twin(packed[0]), None, 1)
                got = avx2.linear(x, x16_twin(packed[1]), None, 1)
                assert torch.equal(got, want), (fmt, "x16", m)
