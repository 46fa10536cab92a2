"""The C kernels on numpy arrays (kernels/cpu.py): every entry point gives bitwise what it gives
the same data as CPU torch tensors, numpy in gives numpy out (float32, C-contiguous), and the
module, the library and a packed linear run without importing torch (the batching worker that
will not load it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trio_infer_kernels import cpu
from trio_infer_kernels.cpu import DecoderLayerWeights, DecoderWeights, PackedParts, PackedWeight
from tests.kernels.blocks import random_blocks

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the CPU kernels do not build here")

ROOT = Path(__file__).resolve().parents[2]


def t(a: np.ndarray) -> torch.Tensor:
    """The same memory as a torch tensor."""
    return torch.from_numpy(a)


def same_bits(got: np.ndarray, want: torch.Tensor) -> None:
    """``got`` is a numpy float32 C-contiguous result, bitwise ``want``'s values."""
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.flags.c_contiguous
    assert isinstance(want, torch.Tensor)
    assert got.shape == tuple(want.shape)
    assert np.array_equal(got.view(np.uint32), want.numpy().view(np.uint32))


def weight(fmt: str, n: int, k: int, seed: int, activations: str = "exact") -> PackedWeight:
    return PackedWeight.from_blocks(fmt, random_blocks(fmt, n, k, torch.Generator().manual_seed(seed)),
                                    k, activations)


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("fmt,activations,layout", [
    ("Q4_K", "exact", "rows"), ("Q4_K", "exact", "x16"), ("Q6_K", "int8", "x8"),
    ("Q8_0", "int8", "rows"), ("F16", "exact", "rows")])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_linear(fmt: str, activations: str, layout: str, m: int) -> None:
    rng = np.random.default_rng(m)
    w = weight(fmt, 40, 512, m, activations).with_layout(layout)
    assert w.layout == layout
    x, b = randn(rng, m, 512), randn(rng, 40)
    kernels = cpu.require()
    for bias in (None, b):
        got = kernels.linear(x, w, bias, 2)
        want = kernels.linear(t(x), w, None if bias is None else t(bias), 2)
        same_bits(got, want)


def test_linear_of_parts() -> None:
    rng = np.random.default_rng(0)
    fused = PackedParts((weight("Q4_K", 16, 256, 1), weight("Q6_K", 8, 256, 2)))
    x, b = randn(rng, 5, 256), randn(rng, 24)
    kernels = cpu.require()
    same_bits(kernels.linear(x, fused, b, 2), kernels.linear(t(x), fused, t(b), 2))


@pytest.mark.parametrize("layout", ["rows", "x16"])
def test_dequant_rows(layout: str) -> None:
    w = weight("Q4_K", 32, 256, 3).with_layout(layout)
    rows = np.array([0, 31, 7, 7, 16], dtype=np.int64)
    kernels = cpu.require()
    same_bits(kernels.dequant_rows(w, rows), kernels.dequant_rows(w, t(rows)))


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(residual: bool) -> None:
    rng = np.random.default_rng(1)
    x, r, w = randn(rng, 7, 576), randn(rng, 7, 576), randn(rng, 576)
    kernels = cpu.require()
    got = kernels.rms_norm(x, w, 1e-5, r if residual else None, 2)
    want = kernels.rms_norm(t(x), t(w), 1e-5, t(r) if residual else None, 2)
    same_bits(got[0], want[0])
    if residual:
        same_bits(got[1], want[1])
    else:
        assert got[1] is None and want[1] is None


def test_silu_and_mul() -> None:
    x = randn(np.random.default_rng(2), 9, 2 * 384) * 4
    kernels = cpu.require()
    same_bits(kernels.silu_and_mul(x, 2), kernels.silu_and_mul(t(x), 2))


def test_pack_and_relayout() -> None:
    """pack into a numpy or a torch output, from numpy or torch blocks: the same bytes; and a
    layout change on a given number of threads or the default is the same conversion."""
    blocks = random_blocks("Q4_K", 20, 512, torch.Generator().manual_seed(4))
    kernels = cpu.require()
    ours = PackedWeight.empty("Q4_K", 20, 512)
    assert isinstance(ours.data, np.ndarray) and ours.data.dtype == np.uint8
    kernels.pack("Q4_K", blocks, 512, ours.data, 2)
    theirs = torch.empty(ours.data.shape, dtype=torch.uint8)
    kernels.pack("Q4_K", t(blocks), 512, theirs, 2)
    assert np.array_equal(ours.data, theirs.numpy())
    assert np.array_equal(ours.data, PackedWeight.from_blocks("Q4_K", blocks, 512).data)
    assert np.array_equal(ours.data, PackedWeight.from_blocks("Q4_K", t(blocks), 512, threads=1).data)
    assert ours.nbytes == ours.data.nbytes
    one = PackedWeight("Q4_K", ours.data.copy(), 512).with_layout("x16", threads=1)
    default = PackedWeight("Q4_K", ours.data.copy(), 512).with_layout("x16")
    assert np.array_equal(one.data, default.data) and not np.array_equal(one.data, ours.data)
    kernels.relayout(one, "x16", to_layout=False, threads=2)
    assert np.array_equal(one.data, ours.data)


def test_a_packed_weight_holds_numpy_bytes() -> None:
    with pytest.raises(TypeError, match="numpy uint8"):
        PackedWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), 32)


def _paged(rng: np.random.Generator, dtype: type, pages: int = 12, page_size: int = 8,
           hkv: int = 2, d: int = 64) -> tuple[np.ndarray, np.ndarray]:
    return (randn(rng, pages, page_size, hkv, d).astype(dtype),
            randn(rng, pages, page_size, hkv, d).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rope_store(dtype: type) -> None:
    """q, k, v as strided views into one qkv output (as the model passes them), in place."""
    rng = np.random.default_rng(5)
    tokens, hq, hkv, d = 5, 6, 2, 64
    qkv = randn(rng, tokens, (hq + 2 * hkv) * d)
    caches = _paged(rng, dtype)
    cos_sin = randn(rng, 40, d)
    positions = np.array([0, 3, 9, 10, 31], dtype=np.int64)
    slots = np.array([5, 0, 23, 12, 7], dtype=np.int64)

    def split(x: np.ndarray):
        q, k, v = x[:, :hq * d], x[:, hq * d:(hq + hkv) * d], x[:, (hq + hkv) * d:]
        return q.reshape(tokens, hq, d), k.reshape(tokens, hkv, d), v.reshape(tokens, hkv, d)

    before, theirs_qkv, theirs_caches = qkv.copy(), qkv.copy(), tuple(c.copy() for c in caches)
    kernels = cpu.require()
    q, k, v = split(qkv)
    assert all(np.shares_memory(a, qkv) and a.strides[0] == qkv.strides[0] for a in (q, k, v))
    kernels.rope_store(q, k, v, positions, slots, cos_sin, *caches)
    tq, tk, tv = (t(a) for a in split(theirs_qkv))
    kernels.rope_store(tq, tk, tv, t(positions), t(slots), t(cos_sin),
                       *(t(c) for c in theirs_caches))
    assert np.array_equal(qkv.view(np.uint32), theirs_qkv.view(np.uint32))
    assert not np.array_equal(qkv, before)  # q and k rotated in place
    for ours, theirs in zip(caches, theirs_caches):
        assert np.array_equal(ours.view(np.uint8), theirs.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attention(dtype: type) -> None:
    rng = np.random.default_rng(6)
    hq, hkv, d, page_size = 6, 2, 64, 8
    k_cache, v_cache = _paged(rng, dtype)
    table = rng.permutation(12)[:9].astype(np.int64).reshape(3, 3)
    lens = np.array([17, 1, 24], dtype=np.int64)
    kernels = cpu.require()
    tk, tv, ttable, tlens = t(k_cache), t(v_cache), t(table), t(lens)

    q = randn(rng, 3, hq, d)
    got = kernels.decode_attention(q, k_cache, v_cache, table, lens, d**-0.5, 24, 2)
    same_bits(got, kernels.decode_attention(t(q), tk, tv, ttable, tlens, d**-0.5, 24, 2))

    chunks = np.array([0, 5, 6, 10], dtype=np.int64)  # 5, 1 and 4 new tokens
    q = randn(rng, 10, hq, d)
    got = kernels.extend_attention(q, k_cache, v_cache, table, chunks, lens, d**-0.5, 24, 2)
    same_bits(got, kernels.extend_attention(t(q), tk, tv, ttable, t(chunks), tlens, d**-0.5,
                                            24, 2))


def test_kv_dtypes() -> None:
    """numpy dtypes and scalar types, torch dtypes, the two names, and caches of either kind."""
    for f16 in (np.float16, np.dtype("float16"), torch.float16, "float16",
                np.zeros(1, np.float16), torch.zeros(1, dtype=torch.float16)):
        assert cpu._kv_is_f16(f16) is True
    for f32 in (np.float32, np.dtype("float32"), torch.float32, "float32",
                np.zeros(1, np.float32), torch.zeros(1)):
        assert cpu._kv_is_f16(f32) is False
    for other in (np.float64, torch.bfloat16, "bfloat16", "half", None, np.zeros(1, np.int64)):
        with pytest.raises(ValueError, match="fp32, fp16, q8_0 or q4_0 KV cache"):
            cpu._kv_is_f16(other)
    for q8 in ("q8_0", np.zeros((1, 34), np.uint8), torch.zeros((1, 34), dtype=torch.uint8)):
        assert cpu._kv_kind(q8, 32) == cpu.KV_KINDS["q8_0"]
    assert cpu._kv_kind("q4_0") == cpu.KV_KINDS["q4_0"]


# -- the whole decode step --------------------------------------------------------------------------

H, HQ, HKV, D, INTER, VOCAB, LAYERS, PAGE, PAGES = 256, 4, 2, 64, 512, 96, 2, 8, 16


def decoder(packed_embed: bool) -> DecoderWeights:
    """A random two-layer decoder (Q8_0 and Q4_K linears, a Qwen3-like q/k norm, biases on
    qkv), its small tensors numpy arrays."""
    rng = np.random.default_rng(7)
    layers = []
    for i in range(LAYERS):
        seed = 10 * i
        layers.append(DecoderLayerWeights(
            1 + 0.1 * randn(rng, H), 1 + 0.1 * randn(rng, H), 1 + 0.1 * randn(rng, D),
            1 + 0.1 * randn(rng, D),
            (weight("Q8_0", (HQ + 2 * HKV) * D, H, seed + 1), 0.1 * randn(rng, (HQ + 2 * HKV) * D)),
            (weight("Q8_0", H, HQ * D, seed + 2), None),
            (weight("Q4_K", 2 * INTER, H, seed + 3), None),
            (weight("Q8_0", H, INTER, seed + 4), None)))
    embed = weight("Q8_0", VOCAB, H, 99) if packed_embed else randn(rng, VOCAB, H)
    angles = np.outer(np.arange(64), 10000.0 ** (-np.arange(0, D, 2) / D))
    cos_sin = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    return DecoderWeights(HQ, HKV, D, 1e-6, embed, layers, 1 + 0.1 * randn(rng, H),
                          weight("Q6_K", VOCAB, H, 98), cos_sin)


def torch_twin(w: DecoderWeights) -> DecoderWeights:
    """The same weights, every numpy array as a torch tensor over the same memory."""
    def tt(a):
        return t(a) if isinstance(a, np.ndarray) else a

    layers = [DecoderLayerWeights(tt(lw.input_norm), tt(lw.post_norm), tt(lw.q_norm),
                                  tt(lw.k_norm), *((p, tt(b)) for p, b in
                                                   (lw.qkv, lw.o, lw.gate_up, lw.down)))
              for lw in w.layers]
    return DecoderWeights(w.num_heads, w.num_kv_heads, w.head_dim, w.eps, tt(w.embed), layers,
                          tt(w.final_norm), w.lm_head, tt(w.cos_sin))


@pytest.mark.parametrize("packed_embed", [False, True])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_decode_step(packed_embed: bool, kv: str) -> None:
    """Three sequences decode one token each: numpy weights, inputs and caches give bitwise the
    logits and caches of the same data as torch tensors, and the KV dtype may be named in any
    of its spellings."""
    rng = np.random.default_rng(8)
    w = decoder(packed_embed)
    kernels = cpu.require()
    dtype = np.dtype(kv)
    caches = [randn(rng, PAGES, PAGE, HKV, D).astype(dtype) for _ in range(2 * LAYERS)]
    ids = np.array([3, 95, 40], dtype=np.int64)
    seq_lens = np.array([9, 1, 20], dtype=np.int64)
    positions = seq_lens - 1
    table = rng.permutation(PAGES)[:9].astype(np.int64).reshape(3, 3)
    slots = table[np.arange(3), positions // PAGE] * PAGE + positions % PAGE
    theirs = [c.copy() for c in caches]

    step = kernels.decode_step(w, PAGE, dtype)
    got = step(ids, positions, slots, table, seq_lens, 20, caches[:LAYERS], caches[LAYERS:], 2)
    assert np.isfinite(got).all() and got.shape == (3, VOCAB)
    torch_kv = torch.float16 if kv == "float16" else torch.float32
    for spelling in (kv, torch_kv, dtype.type):
        twin = kernels.decode_step(torch_twin(w), PAGE, spelling)
        tc = [t(c.copy()) for c in theirs]
        want = twin(t(ids), t(positions), t(slots), t(table), t(seq_lens), 20, tc[:LAYERS],
                    tc[LAYERS:], 2)
        same_bits(got, want)
        for ours, after in zip(caches, tc):
            assert np.array_equal(ours.view(np.uint8), after.numpy().view(np.uint8))
    assert not all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                   for a, b in zip(caches, theirs))  # the new tokens' k and v went in

    other = [c.astype(np.float32 if kv == "float16" else np.float16) for c in caches]
    with pytest.raises(ValueError, match="KV cache"):
        step(ids, positions, slots, table, seq_lens, 20, other[:LAYERS], other[LAYERS:], 2)
    with pytest.raises(ValueError, match="fp32, fp16, q8_0 or q4_0"):
        kernels.decode_step(w, PAGE, np.float64)


# -- no torch ---------------------------------------------------------------------------------------

NO_TORCH = """
import sys
import numpy as np
from trio_infer_kernels import cpu
kernels = cpu.require()
rng = np.random.default_rng(0)
codes = rng.integers(-127, 128, (24, 2, 32), dtype=np.int8)  # Q8_0: 2 blocks of 32 a row
scales = rng.uniform(0.001, 0.02, (24, 2, 1)).astype(np.float16)
blocks = np.concatenate([scales.view(np.uint8), codes.view(np.uint8)], axis=2).reshape(24, -1)
packed = cpu.PackedWeight.from_blocks("Q8_0", blocks, 64).with_layout("x16")
assert packed.layout == "x16" and type(packed.data) is np.ndarray
x = rng.standard_normal((3, 64), dtype=np.float32)
y = kernels.linear(x, packed, None, 1)
assert type(y) is np.ndarray and y.dtype == np.float32 and y.shape == (3, 24)
want = x @ (scales.astype(np.float32) * codes).reshape(24, 64).T
assert np.allclose(y, want, rtol=1e-4, atol=1e-4), abs(y - want).max()
rows = kernels.dequant_rows(packed, np.array([2, 0], dtype=np.int64))
assert type(rows) is np.ndarray
print("torch" in sys.modules)
"""


def test_the_kernels_run_without_torch() -> None:
    """``import trio_infer_kernels.cpu``, loading the library, packing a weight and a linear on
    numpy arrays leave torch unimported (a fresh interpreter: this one has torch)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", NO_TORCH], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# The broadcast row is read-only (numpy's broadcast views are); torch warns when it wraps one.
# The kernels only read it.
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_a_single_row_page_table_of_any_stride_reads_as_its_row() -> None:
    """numpy gives an axis of length 1 any stride: a page table row broadcast and then made
    contiguous has row stride 0, which the kernels would read as a table of no pages. A single
    row's stride is its length, as torch reports it."""
    kernels = cpu.require()
    rng = np.random.default_rng(5)
    pages, page_size, hkv, d = 4, 16, 2, 64
    k = rng.standard_normal((pages, page_size, hkv, d), dtype=np.float32)
    v = rng.standard_normal((pages, page_size, hkv, d), dtype=np.float32)
    q = rng.standard_normal((1, 4, d), dtype=np.float32)
    row = np.array([2, 0, 3, 1], dtype=np.int64)
    broadcast = np.ascontiguousarray(np.broadcast_to(row, (1, pages)))
    assert broadcast.strides[0] == 0  # what numpy does
    lens = np.array([50], dtype=np.int64)
    got = kernels.decode_attention(q, k, v, broadcast, lens, 0.125, 50, 1)
    want = kernels.decode_attention(q, k, v, row[None].copy(), lens, 0.125, 50, 1)
    assert np.array_equal(got, want)
    # torch.from_numpy keeps the stride 0 (the torch model reads the engine's arrays so).
    as_tensors = kernels.decode_attention(*(torch.from_numpy(a) for a in (q, k, v, broadcast,
                                                                          lens)), 0.125, 50, 1)
    assert np.array_equal(as_tensors.numpy(), want)
