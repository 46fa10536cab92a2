"""The engine's configuration: every knob of the batching engine, its one default, its one check.

Torch-free (nothing here imports the engine), so that :class:`~trio_infer.settings.Settings`
takes its defaults from here and checks its values by building one
(:meth:`Settings.engine_config <trio_infer.settings.Settings.engine_config>` is the one place
settings become an engine configuration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KVCacheDType = Literal["auto", "float32", "float16", "bfloat16", "q8_0", "q4_0"]
SpeculativeMethod = Literal["off", "ngram", "draft"]


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
    # Speculative decoding (engine/speculative.py): "ngram" guesses up to speculative_tokens
    # tokens per step by prompt lookup (matching the last speculative_ngram tokens at most,
    # speculative_ngram_min at least), "draft" with a draft model (engine/draft.py);
    # no sequence proposes in a step with more than speculative_max_batch running sequences,
    # and a sequence whose acceptance falls below speculative_min_acceptance pauses.
    speculative: SpeculativeMethod = "ngram"
    speculative_tokens: int = 4
    speculative_ngram: int = 3
    speculative_ngram_min: int = 2
    speculative_max_batch: int = 4
    speculative_min_acceptance: float = 0.3
    # Measure whether verify steps emit tokens faster than plain ones and pause drafting while
    # they do not (speculative.Payoff). False: decided by the rules above alone (deterministic).
    speculative_payoff: bool = True
    # "draft": a draft model (engine/draft.py) guesses instead; its KV pool gets this many bytes,
    # or 0: as many pages as the target's pool (each draft page then sized by the draft model).
    speculative_draft_kv_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("page_size", "kv_cache_bytes", "max_running", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.max_batched_tokens < self.max_running:
            # every running sequence decodes one token per step, within the step's budget
            raise ValueError("max_batched_tokens must be >= max_running (one token per decode)")
        if self.speculative not in ("off", "ngram", "draft"):
            raise ValueError(f"speculative {self.speculative!r}: expected off, ngram or draft")
        if self.speculative_draft_kv_bytes < 0:
            raise ValueError("speculative_draft_kv_mb must be >= 0 (0: as many pages as the "
                             "target's pool)")
        for name in ("speculative_tokens", "speculative_ngram", "speculative_ngram_min",
                     "speculative_max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.speculative_ngram_min > self.speculative_ngram:
            raise ValueError("speculative_ngram_min must be <= speculative_ngram")
        if not 0 <= self.speculative_min_acceptance <= 1:
            raise ValueError("speculative_min_acceptance must be in [0, 1]")


DEFAULT = EngineConfig()
