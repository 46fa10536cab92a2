"""The one-call decode step's thread count, chosen per step (models/step_threads.py): every
thread for a wide step, the faster count by measurement for a narrow one, with the same logits
either way; and the OpenMP wait policy the worker is started with."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from trio_infer_kernels import cpu
from trio_infer.models import step_threads
from trio_infer.models.step_threads import PROBE_EVERY, SERIAL_STEP_BYTES, StepThreads
from trio_infer.settings import BRIEF_SPIN_COUNT, Settings, worker_environment
from tests.test_gguf import decode_logits, needs_smollm2, smollm2  # noqa: F401 (a fixture)

MB = 2**20


def test_a_wide_step_runs_on_every_thread_without_measuring() -> None:
    chooser = StepThreads(waits_sleep=True)
    assert chooser.choose(1, 1030 * MB, 2) == 2  # a 1.7B Q4_K_M: every thread from batch 1
    assert chooser.choose(6, 98 * MB, 8) == 8  # SmolLM2-135M from batch 6
    assert chooser.choose(1, SERIAL_STEP_BYTES, 3) == 3  # the bound itself is wide
    assert chooser.choose(3, 98 * MB, 1) == 1  # one thread available: nothing to choose
    assert not StepThreads.narrow(6, 98 * MB, 8) and StepThreads.narrow(5, 98 * MB, 8)


@pytest.mark.parametrize(("waits_sleep", "first", "other"), [(True, 1, 2), (False, 2, 1)])
def test_a_narrow_step_tries_its_first_guess_then_the_other_count(
        waits_sleep: bool, first: int, other: int) -> None:
    chooser = StepThreads(waits_sleep)
    assert chooser.choose(1, 98 * MB, 2) == first
    chooser.record(1, 2, first, 0.010)
    assert chooser.choose(1, 98 * MB, 2) == other
    chooser.record(1, 2, other, 0.005)
    assert chooser.statistics() == {(1, 2): {first: 0.010, other: 0.005}}


def drive(chooser: StepThreads, seconds: dict[int, float], steps: int) -> list[int]:
    """Run ``steps`` batch-1 steps whose wall time on each count is ``seconds[count]``."""
    chosen = []
    for _ in range(steps):
        threads = chooser.choose(1, 98 * MB, 2)
        chooser.record(1, 2, threads, seconds[threads])
        chosen.append(threads)
    return chosen


def test_narrow_steps_run_on_the_faster_count_and_follow_when_the_machine_changes() -> None:
    chooser = StepThreads(waits_sleep=False)
    quiet = {1: 0.0105, 2: 0.0055}  # SmolLM2-135M batch 1, 2 cores to itself
    chosen = drive(chooser, quiet, 200)
    assert chosen[2:].count(2) > 180  # after one try of each, two threads, bar the probes
    assert 1 in chosen[2:]  # ... which keep one thread's mean fresh

    busy = {1: 0.0115, 2: 0.028}  # another process keeps a core busy
    chosen = drive(chooser, busy, 200)
    switched = chosen.index(1)
    assert switched <= 2 * PROBE_EVERY + 1  # one thread's mean is still ~quiet's: a probe of
    assert chosen[switched:].count(1) > 150  # two threads (slow now) moves the choice
    assert chooser.statistics()[(1, 2)][2] > 0.02


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
def test_the_model_measures_its_narrow_steps_and_the_count_leaves_the_logits_unchanged(
        smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    model = smollm2[0]  # the CPU kernels' model: its own thread count
    before = model.threads
    model.threads = 2
    try:
        model.step_threads = StepThreads(waits_sleep=True)
        decode_logits(model, 1, fused=True)
        decode_logits(model, 8, fused=True)  # SmolLM2's linears: 98 MB, so 8 rows are wide
        assert list(model.step_threads.statistics()) == [(1, 2)]
        assert list(model.step_threads.statistics()[(1, 2)]) == [1]  # the first guess

        # The same wide step on one thread and on two: bitwise the same logits and caches.
        monkeypatch.setattr(step_threads, "SERIAL_STEP_BYTES", 2**62)
        model.step_threads = StepThreads(waits_sleep=True)
        one = decode_logits(model, 8, fused=True)
        model.step_threads = StepThreads(waits_sleep=False)
        two = decode_logits(model, 8, fused=True)
        assert {c for means in model.step_threads.statistics().values() for c in means} == {2}
    finally:
        model.threads = before
        model.step_threads = StepThreads(cpu.waits_sleep_at_once())
    assert np.array_equal(one[0], two[0])
    assert all(np.array_equal(a, b) for a, b in zip(one[1] + one[2], two[1] + two[2]))
