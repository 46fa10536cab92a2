"""What the engine needs from a model, and nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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
    dtype: str  # the weights' float type by name: "float32", "bfloat16", "float16", "float64"
    eos_token_ids: tuple[int, ...]  # from generation_config.json (may be several), else config


class CausalLM(Protocol):
    info: ModelInfo

    def forward(self, batch: ForwardBatch, k_caches: list[Any], v_caches: list[Any]) -> Any:
        """Run the step's tokens; return fp32 logits [len(batch.logits_indices), vocab]: a numpy
        array, or a torch tensor (on any device), which the model runner brings to the host.

        ``k_caches[i]``/``v_caches[i]`` are layer i's pages, [num_pages, page_size, Hkv, D]:
        numpy arrays on the CPU, torch tensors on a GPU (engine/kv_cache.py).
        """
        ...
