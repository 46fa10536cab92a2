"""Fixtures shared by every test suite: tiny real checkpoints, built once per session.

A checkpoint here is a complete Hugging Face folder (config, safetensors, generation config,
tokenizer with chat template) written by :mod:`trio_infer.models.synthetic`, so whatever loads it
goes through the same path as a downloaded model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trio_infer.models.synthetic import SHAPES, build_random_checkpoint

# One intra-op thread: test shapes are tiny, and with two spinning OpenMP threads on a 2-core
# machine a step collapses from milliseconds to a second whenever anything else wants a core.
torch.set_num_threads(1)

CheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``factory(architecture="Qwen3ForCausalLM", **overrides) -> Path``.

    Overrides are keyword arguments of :func:`build_random_checkpoint` on top of
    ``SHAPES["tiny"]`` (e.g. ``tie_word_embeddings=False``, ``max_shard_size="100KB"``,
    ``max_position_embeddings=128``). The same arguments give the same folder, built only once per
    test session; treat it as read-only (copy it to modify it).
    """
    built: dict[str, Path] = {}

    def factory(architecture: str = "Qwen3ForCausalLM", **overrides: Any) -> Path:
        kwargs = {**SHAPES["tiny"], **overrides}
        key = repr((architecture, sorted(kwargs.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"ckpt-{architecture}")
            built[key] = build_random_checkpoint(out, architecture, **kwargs)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_factory: CheckpointFactory) -> Path:
    """The tiny Qwen3 checkpoint (the embedded default model's shape and seed)."""
    return tiny_checkpoint_factory()
