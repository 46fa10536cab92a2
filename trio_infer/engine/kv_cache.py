"""The paged KV cache: a fixed pool of pages, and the tensors that hold them.

The pool is sized once, from a memory budget, and never re-allocated: sequences borrow pages and
give every one back on finish, abort or preemption. Pages are reference counted so that a page can
be shared (by the prefix cache and the sequences that reuse it); a page returns to the free list
when its last holder lets go.
"""

from __future__ import annotations

import math
from collections import deque

from typing import Any

import numpy as np


class OutOfPages(Exception):
    """The pool cannot satisfy an allocation right now."""


class PagePool:
    """Allocator of page ids ``0 .. num_pages-1`` with reference counts. Pure Python, no tensors."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (refcount 1 each), or raise :class:`OutOfPages` taking none."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """Add a holder to pages already in use (sharing)."""
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} is free; it cannot be shared")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one holder from each page; pages nobody holds go back to the free list."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} released more often than it was held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]


class KVCache:
    """Per-layer key and value arrays, each [num_pages, page_size, num_kv_heads, head_dim].

    On the CPU they are numpy arrays (the engine and the CPU kernels need no torch; a torch
    model on the CPU reads them through ``torch.from_numpy``, the same memory); on another
    device (``cuda``), torch tensors there. ``dtype`` is a name: float32, float16, bfloat16 (which
    the CPU kernels do not read and numpy lacks: a torch tensor, for a torch model) or float64
    (the fake model's)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        device: str = "cpu",
    ) -> None:
        if dtype in BLOCK_BYTES:  # each head's row as blocks of 32 values, as bytes
            if device != "cpu" or head_dim % 32:
                raise ValueError(f"a {dtype} KV cache is read by the CPU kernels only, for heads "
                                 f"of a multiple of 32 values (here {head_dim}, on {device})")
            shape = (num_pages, page_size, num_kv_heads, head_dim // 32 * BLOCK_BYTES[dtype])
            storage = "uint8"
        else:
            shape, storage = (num_pages, page_size, num_kv_heads, head_dim), dtype
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.k: list[Any] = [zeros(shape, storage, device) for _ in range(num_layers)]
        self.v: list[Any] = [zeros(shape, storage, device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: str
    ) -> int:
        row = (head_dim // 32 * BLOCK_BYTES[dtype] if dtype in BLOCK_BYTES
               else head_dim * ITEMSIZE[dtype])
        return 2 * num_layers * page_size * num_kv_heads * row


# The KV pool's arrays start at this byte alignment (torch's own CPU allocator's), whatever the
# one of the memory they are carved from.
_ALIGNMENT = 64

# Bytes of one element of each KV dtype the engine takes.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1}
# The quantized caches (the CPU kernels'): ggml's block_q8_0 (an fp16 scale and 32 int8 codes:
# 8.5 bits a value, against 16 for float16) or block_q4_0 (an fp16 scale and 32 nibbles: 4.5
# bits) in place of every 32 values of a head's row; bytes a block.
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


def zeros(shape: tuple[int, ...], dtype: str, device: str = "cpu") -> Any:
    """A zeroed array for the pool. On the CPU a numpy array whose memory comes from ``calloc``,
    which hands over pages the OS has zeroed and makes each resident when first written: writing
    every byte before the first step (as ``torch.zeros`` does) cost 45 MiB and 0.08 s of the
    default model's start, before the server is healthy (a long context's pool, seconds), and an
    idle server would hold the whole pool resident. Elsewhere, and for bfloat16 (which numpy
    lacks), ``torch.zeros`` on the device."""
    if dtype not in ITEMSIZE:
        raise ValueError(f"KV cache dtype {dtype!r}: expected one of {', '.join(ITEMSIZE)}")
    if device != "cpu" or dtype == "bfloat16":
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    raw = np.zeros(nbytes + _ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0")


def resolve_kv_dtype(name: str, model_dtype: str, device: str) -> str:
    """The KV cache's dtype for the setting ``name``: "auto" is fp16 for an fp32 model on the CPU
    (as llama.cpp: half the memory and the bandwidth of fp32 at decode, widened to fp32 as it is
    read) and the model's dtype otherwise; else the named dtype."""
    if name == "auto":
        return "float16" if device == "cpu" and model_dtype == "float32" else model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: expected auto, {', '.join(KV_CACHE_DTYPES)}")
    return name


def check_kv_dtype(model: Any, dtype: str) -> None:
    """ValueError (at startup) if ``model`` cannot read a KV cache of ``dtype``: a q8_0 or q4_0
    cache is read by the CPU kernels' model only (``model.reads_quantized_kv``)."""
    if dtype in BLOCK_BYTES and not getattr(model, "reads_quantized_kv", False):
        raise ValueError(f"kv_cache_dtype {dtype} is read by the CPU kernels' model only (a GGUF "
                         f"file on the CPU); {model.info.name} is served by "
                         f"{type(model).__name__}: use float16 or float32")
