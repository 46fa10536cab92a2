"""How many threads a one-call decode step runs on, chosen per step from measured step times.

A decode step of a small model at a small batch is hundreds of ops of tens of microseconds each,
with the threads meeting at a barrier after every op. Whether a second thread pays depends on
things the code cannot know in advance: the wait policy (a barrier with a brief spin costs
microseconds, one that sleeps at once costs a sleep and a wake-up), and whether the other cores
are free. On 2 cores, SmolLM2-135M at batch 1 took 5.5 ms on two spinning threads and 10.5 ms on
one on a quiet machine, but 28 ms on two against 11.5-16 ms on one while another process kept a
core busy (docs/kernels.md). So for narrow steps the count is measured, not assumed: each row
count keeps a running mean of the step's wall time on one thread and on all of them, runs on the
faster, and tries the other one step in :data:`PROBE_EVERY` to notice when the machine changes.
A step of :data:`SERIAL_STEP_BYTES` or more of work always runs on every thread: its ops are long
enough that a barrier is noise.

The kernels split every op by output rows, so the logits are bitwise the same on any count
(tests/test_step_threads.py): switching is free of numerical consequences.
"""

from __future__ import annotations

# Rows times linear bytes at or above which a step runs on every thread without measuring: a
# 1 GB model from batch 1, SmolLM2-135M (98 MB of linears) from batch 6.
SERIAL_STEP_BYTES = 512 * 2**20
# One step in this many (per row count) runs on the count not preferred, to keep its mean fresh.
PROBE_EVERY = 32
# Weight of the newest step in a running mean: a shift in the machine's load shows within a few
# probes, and one slow step (a page fault, a preemption) moves the choice by a quarter at most.
SMOOTHING = 0.25


class StepThreads:
    """The thread count of each one-call decode step, out of the worker's ``threads``.

    ``waits_sleep`` (trio_infer_kernels.cpu.waits_sleep_at_once) decides the first guess for a
    narrow step, before anything is measured: one thread when waiting threads sleep at once, every
    thread otherwise. Call :meth:`choose` before a step and, for a :meth:`narrow` one,
    :meth:`record` with its wall time after.
    """

    def __init__(self, waits_sleep: bool) -> None:
        self._waits_sleep = waits_sleep
        # (rows, threads available) -> {thread count: running mean of the step's seconds}
        self._means: dict[tuple[int, int], dict[int, float]] = {}
        self._steps: dict[tuple[int, int], int] = {}  # narrow steps chosen so far

    @staticmethod
    def narrow(rows: int, weight_bytes: int, threads: int) -> bool:
        """Whether the count of a step of ``rows`` rows over ``weight_bytes`` is measured."""
        return threads > 1 and rows * weight_bytes < SERIAL_STEP_BYTES

    def choose(self, rows: int, weight_bytes: int, threads: int) -> int:
        if not self.narrow(rows, weight_bytes, threads):
            return threads
        key = (rows, threads)
        means = self._means.get(key, {})
        count = self._steps.get(key, 0)
        self._steps[key] = count + 1
        first, other = (1, threads) if self._waits_sleep else (threads, 1)
        if first not in means:
            return first
        if other not in means:
            return other
        best = min(means, key=means.__getitem__)
        if count % PROBE_EVERY == 0:
            return other if best == first else first
        return best

    def record(self, rows: int, threads: int, chosen: int, seconds: float) -> None:
        """A narrow step of ``rows`` rows took ``seconds`` on ``chosen`` of ``threads``."""
        means = self._means.setdefault((rows, threads), {})
        old = means.get(chosen)
        means[chosen] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def statistics(self) -> dict[tuple[int, int], dict[int, float]]:
        """(rows, threads available) -> thread count -> running mean of a step's seconds."""
        return {key: dict(means) for key, means in self._means.items()}
