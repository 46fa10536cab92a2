"""What the engine needs from a model, and nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from trio_infer.engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class ModelInfo:
    """Shape facts the engine uses to size the KV cache and to stop sequences."""

    name: str  # served model id (folder name or hub id) unless overridden
    architecture: str  # e.g. "Qwen3ForCausalLM"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int  # context limit: prompt + output tokens
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]  # from generation_config.json (may be several), else config


class CausalLM(Protocol):
    info: ModelInfo

    def forward(
        self,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Run the step's tokens; return fp32 logits [len(batch.logits_indices), vocab].

        ``k_caches[i]``/``v_caches[i]`` are layer i's pages, [num_pages, page_size, Hkv, D].
        """
        ...
