"""CPU time of another process (and its children), from /proc, with nanosecond resolution.

``/proc/<pid>/stat`` counts the whole process, exited threads included, but only in clock ticks
(10 ms): too coarse for a one-stream run that costs the server a few tens of milliseconds. Each
thread's ``/proc/<pid>/task/<tid>/schedstat`` counts nanoseconds on the CPU. :class:`CpuMeter`
sums the latter over every thread of the process tree and remembers the last value seen per
thread, so a thread that exits between two samples loses only what it ran since the last sample;
sample often (every 50-100 ms) around the window you measure.
"""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads, dead ones included), in seconds, tick-resolution."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14, 15 of proc(5)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            except OSError:
                continue
            out.extend(int(c) for c in text.split())
    except OSError:
        pass
    return out


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(_children(p))
    return pids


def thread_cpu_ns(pid: int) -> dict[tuple[int, int], int]:
    """(pid, tid) -> nanoseconds on the CPU, for every live thread of ``pid`` and its descendants."""
    out: dict[tuple[int, int], int] = {}
    for p in _tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                out[(p, int(tid))] = int(Path(f"/proc/{p}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return out


class CpuMeter:
    """Cumulative CPU nanoseconds of a process tree since the meter was created."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._base = thread_cpu_ns(pid)
        self._last = dict(self._base)

    def sample(self) -> int:
        self._last.update(thread_cpu_ns(self.pid))
        return sum(v - self._base.get(k, 0) for k, v in self._last.items())


def available() -> bool:
    return Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").is_file()
