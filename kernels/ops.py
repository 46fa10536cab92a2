"""The dispatcher: the only kernel entry points the engine calls.

On CUDA tensors (and when Triton imports) each op runs its Triton kernel; everywhere else it runs
the torch reference in :mod:`kernels.reference`. ``TRIO_INFER_KERNELS=reference`` forces the
reference path, e.g. to compare backends end to end.
"""

from __future__ import annotations

import os

import torch

from kernels import reference

_FORCE_REFERENCE = os.environ.get("TRIO_INFER_KERNELS", "") == "reference"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and not _FORCE_REFERENCE and _triton_available()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale):
    return reference.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale)


def extend_attention(q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale):
    return reference.extend_attention(
        q, k_cache, v_cache, page_table, query_start_loc, seq_lens, scale
    )


def rms_norm(x, weight, eps, residual=None):
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(q, k, positions, cos_sin_cache):
    return reference.rotary_embedding(q, k, positions, cos_sin_cache)


def silu_and_mul(x):
    return reference.silu_and_mul(x)
