"""The one-call decode step's thread count, chosen per step (models/llama.py ``step_threads``):
one thread for a step too short for a barrier after every op to pay, every thread otherwise,
with the same logits either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels import cpu
from trio_infer.models import llama
from trio_infer.models.llama import SERIAL_STEP_BYTES, step_threads
from tests.test_gguf import decode_logits, needs_smollm2, smollm2  # noqa: F401 (a fixture)

MB = 2**20


def test_a_narrow_step_runs_on_one_thread_and_a_wide_one_on_all() -> None:
    assert step_threads(1, 98 * MB, 2) == 1  # SmolLM2-135M at batch 1
    assert step_threads(5, 98 * MB, 8) == 1
    assert step_threads(6, 98 * MB, 8) == 8  # ... from batch 6
    assert step_threads(1, 1030 * MB, 2) == 2  # a 1.7B Q4_K_M: every thread from batch 1
    assert step_threads(1, SERIAL_STEP_BYTES, 3) == 3  # the bound itself is wide
    assert step_threads(64, 1, 4) == 1


@needs_smollm2
def test_the_step_threads_follow_the_batch_and_leave_the_logits_unchanged(
        smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    model = smollm2[0]
    seen: list[tuple[int, int]] = []

    def spy(rows: int, weight_bytes: int, threads: int) -> int:
        chosen = step_threads(rows, weight_bytes, threads)
        seen.append((rows, chosen))
        return chosen

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(llama, "step_threads", spy)
        decode_logits(model, 1, fused=True)
        decode_logits(model, 8, fused=True)
        assert seen == [(1, 1), (8, 2)]  # SmolLM2's linears: 98 MB

        # The same wide step on one thread and on two: bitwise the same logits and caches.
        monkeypatch.setattr(llama, "SERIAL_STEP_BYTES", 2**62)
        one = decode_logits(model, 8, fused=True)
        monkeypatch.setattr(llama, "SERIAL_STEP_BYTES", 0)
        two = decode_logits(model, 8, fused=True)
    finally:
        torch.set_num_threads(before)
    assert seen[-2:] == [(8, 1), (8, 2)]
    assert torch.equal(one[0], two[0])
    assert all(torch.equal(a, b) for a, b in zip(one[1] + one[2], two[1] + two[2]))
