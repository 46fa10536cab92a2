"""CPU time of another process (and its children), from /proc, with nanosecond resolution.

``/proc/<pid>/stat`` counts the whole process, exited threads included, but only in clock ticks
(10 ms): too coarse for a one-stream run that costs the server a few tens of milliseconds. Each
thread's ``/proc/<pid>/task/<tid>/schedstat`` counts nanoseconds on the CPU. :class:`CpuMeter`
sums the latter over every thread of the process tree and remembers the last value seen per
thread, so a thread that exits between two samples loses only what it ran since the last sample;
sample often (every 50-100 ms) around the window you measure.

The tree is walked on every sample, so a child started after the meter (a server's worker
process, hypercorn's worker) is counted from its start, and the tree of a shell command
(``sh -c 'cd x && server ...'``) includes the server under the shell. Children are found through
``/proc/<pid>/task/<tid>/children`` (Linux >= 3.5 with CONFIG_PROC_CHILDREN), else by scanning
every ``/proc/<pid>/stat`` for its parent pid. Not counted: what a child that starts and exits
between two samples ran, and a process that left the tree (a daemon that double-forks away and
is re-parented to init).
"""

from __future__ import annotations

import functools
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


@functools.cache
def _has_children_files() -> bool:
    me = os.getpid()
    return Path(f"/proc/{me}/task/{me}/children").is_file()


def _parents() -> dict[int, list[int]]:
    """ppid -> pids, from every /proc/<pid>/stat (the fallback without ``children`` files)."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])  # field 4 of proc(5)
        out.setdefault(ppid, []).append(int(name))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (children, grandchildren, ...)."""
    if _has_children_files():
        children = _children
    else:
        table = _parents()
        children = lambda p: table.get(p, [])  # noqa: E731
    pids, seen, todo = [], set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        pids.append(p)
        todo.extend(children(p))
    return pids


_tree = process_tree


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
        self.pids_seen: set[int] = {p for p, _ in self._base}  # every process counted so far

    def sample(self) -> int:
        now = thread_cpu_ns(self.pid)
        self.pids_seen.update(p for p, _ in now)
        self._last.update(now)
        return sum(v - self._base.get(k, 0) for k, v in self._last.items())

    def root_ns(self) -> int:
        """Of the last :meth:`sample`, the CPU of the process itself, its children left out
        (``serve``'s front end, without its batching worker)."""
        return sum(v - self._base.get(k, 0) for k, v in self._last.items() if k[0] == self.pid)


def available() -> bool:
    return Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").is_file()
