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
from trio_infer.settings import BRIEF_SPIN_COUNT, Settings, worker_environment
from tests.test_gguf import decode_logits, needs_smollm2, smollm2  # noqa: F401 (a fixture)

MB = 2**20


def test_with_sleeping_waits_a_narrow_step_runs_on_one_thread_and_a_wide_one_on_all() -> None:
    assert step_threads(1, 98 * MB, 2, True) == 1  # SmolLM2-135M at batch 1
    assert step_threads(5, 98 * MB, 8, True) == 1
    assert step_threads(6, 98 * MB, 8, True) == 8  # ... from batch 6
    assert step_threads(1, 1030 * MB, 2, True) == 2  # a 1.7B Q4_K_M: every thread from batch 1
    assert step_threads(1, SERIAL_STEP_BYTES, 3, True) == 3  # the bound itself is wide
    assert step_threads(64, 1, 4, True) == 1


def test_with_spinning_waits_every_step_runs_on_every_thread() -> None:
    assert step_threads(1, 98 * MB, 2, False) == 2
    assert step_threads(64, 1, 4, False) == 4


@pytest.mark.parametrize(("env", "sleeps"), [
    ({}, False),  # libgomp's default spins ~3 ms
    ({"OMP_WAIT_POLICY": "passive"}, True),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, False),
    ({"GOMP_SPINCOUNT": "1000"}, False),
    ({"GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": "PASSIVE"}, False),  # the count wins
    ({"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "ACTIVE"}, True),
    ({"GOMP_SPINCOUNT": "infinite"}, False),
])
def test_sleeping_waits_are_read_from_the_environment_as_libgomp_reads_them(
        env: dict[str, str], sleeps: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cpu.waits_sleep_at_once() is sleeps


@pytest.mark.parametrize(("policy", "expected"), [
    ("brief", {"GOMP_SPINCOUNT": str(BRIEF_SPIN_COUNT)}),
    ("passive", {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("active", {"OMP_WAIT_POLICY": "ACTIVE"}),
])
def test_each_wait_policy_sets_one_of_the_two_variables_and_clears_the_other(
        policy: str, expected: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    env = worker_environment(Settings(omp_wait_policy=policy))
    assert {k: env[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in env} == expected


@needs_smollm2
def test_the_step_threads_follow_the_batch_and_leave_the_logits_unchanged(
        smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    model = smollm2[0]
    seen: list[tuple[int, int]] = []

    def spy(rows: int, weight_bytes: int, threads: int, waits_sleep: bool) -> int:
        chosen = step_threads(rows, weight_bytes, threads, True)  # as with OMP_WAIT_POLICY=PASSIVE
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
