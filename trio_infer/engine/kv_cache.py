"""The paged KV cache: a fixed pool of pages, and the tensors that hold them.

The pool is sized once, from a memory budget, and never re-allocated: sequences borrow pages and
give every one back on finish, abort or preemption. Pages are reference counted so that a page can
be shared (by the prefix cache and the sequences that reuse it); a page returns to the free list
when its last holder lets go.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch


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
    """Per-layer key and value tensors, each [num_pages, page_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.page_size = page_size
        self.num_pages = num_pages
        self.k: list[torch.Tensor] = [zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [zeros(shape, dtype, device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize


# The KV pool's tensors start at this byte alignment (torch's own CPU allocator's), whatever the
# one of the memory they are carved from.
_ALIGNMENT = 64


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor for the pool. On the CPU its memory comes from ``calloc`` (through numpy),
    which hands over pages the OS has zeroed and makes each resident when first written:
    ``torch.zeros`` writes every byte before the first step (on the default model 45 MiB and
    0.08 s of the worker's start, before the server is healthy; a long context's pool, seconds),
    and an idle server would hold the whole pool resident. Elsewhere, ``torch.zeros``."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(nbytes + _ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV cache's dtype for the setting ``name``: "auto" is fp16 for an fp32 model on the CPU
    (as llama.cpp: half the memory and the bandwidth of fp32 at decode, widened to fp32 as it is
    read) and the model's dtype otherwise; else the named dtype."""
    if name == "auto":
        cpu = torch.device(device).type == "cpu"
        return torch.float16 if cpu and model_dtype == torch.float32 else model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: expected auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]
