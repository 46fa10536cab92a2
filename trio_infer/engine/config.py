"""The engine's configuration: every knob of the batching engine, its one default, its one check.

Torch-free (nothing here imports the engine), so that :class:`~trio_infer.settings.Settings`
takes its defaults from here and checks its values by building one (:meth:`EngineConfig.
from_settings` is the one place settings become an engine configuration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from trio_infer.settings import Settings

KVCacheDType = Literal["auto", "float32", "float16", "bfloat16"]


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # None: size the pool from kv_cache_bytes
    kv_cache_bytes: int = 256 * 2**20
    max_running: int = 32  # sequences admitted (decoded together) at most
    max_batched_tokens: int = 256  # tokens per step (chunked prefill)
    enable_prefix_cache: bool = True
    # "auto": fp16 for an fp32 model on the CPU (llama.cpp's default: half the memory and
    # bandwidth of fp32, with the tolerance docs/kernels.md measures), the model's dtype
    # otherwise; or "float32", "float16", "bfloat16" (see kv_cache.resolve_kv_dtype).
    kv_cache_dtype: KVCacheDType = "auto"

    def __post_init__(self) -> None:
        for name in ("page_size", "kv_cache_bytes", "max_running", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.max_batched_tokens < self.max_running:
            # every running sequence decodes one token per step, within the step's budget
            raise ValueError("max_batched_tokens must be >= max_running (one token per decode)")

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        """The engine configuration ``settings`` ask for (raises ValueError if it is not one)."""
        return cls(
            page_size=settings.page_size,
            kv_cache_bytes=settings.kv_cache_mb * 2**20,
            max_running=settings.max_running,
            max_batched_tokens=settings.max_batched_tokens,
            kv_cache_dtype=settings.kv_cache_dtype,
        )


DEFAULT = EngineConfig()
