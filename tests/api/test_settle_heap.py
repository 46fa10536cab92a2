"""``app.settle_heap``: what a served model's process does to its garbage collector. Run in a
child process: freezing the heap and moving the thresholds are process-wide,
and the test process makes many apps that must be collected."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import gc
from trio_infer.app import YOUNG_GC_THRESHOLD, settle_heap
before = gc.get_threshold()
objects = len(gc.get_objects())
settle_heap()
after = gc.get_threshold()
assert after == (YOUNG_GC_THRESHOLD, *before[1:]), (before, after)
assert before[0] < YOUNG_GC_THRESHOLD
assert gc.get_freeze_count() >= objects // 2, (gc.get_freeze_count(), objects)
print("ok")
"""


def test_settle_heap_freezes_the_heap_and_raises_only_the_young_threshold() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
