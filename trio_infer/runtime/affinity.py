"""Which data-parallel worker serves a request: prefix affinity, else the least loaded.

Sans-IO, like the router: a prompt and the workers' loads in, a worker's index out; nothing here
awaits or reads a socket, so the policy is tested on its own (``tests/runtime/
test_data_parallel.py``) and the front end (``runtime/data_parallel.py``) only asks it.

**Why affinity.** Each worker has its own KV cache and prefix cache. A prompt whose first pages a
worker has computed already is prefilled there from cache; sent to another worker, those pages are
computed again, and cached twice. So a request goes where its longest cached prefix most likely
is: :class:`PrefixAffinity` keeps a bounded table from a *page chain hash* (the hash of a prompt's
first k full pages, k = 1, 2, ...: the key the engine's prefix cache uses, at the same page size)
to the worker it last sent those pages to, and looks up the prompt's deepest chain.

**When not.** Affinity gives way to the least loaded worker (fewest live sequences in the front
end, ties to the lowest index) when:

* the match covers half of the prompt's full pages or less: a shared system prompt alone should
  not pin every conversation to one worker;
* the worker that holds the prefix has ``slack`` or more live sequences than the least loaded
  (the front end passes the engine's ``max_running``): recomputing a prefix costs less than
  waiting behind a whole batch;
* that worker is unavailable (restarting, or given up): ``None`` in ``loads``.

The table is an LRU bounded by ``capacity`` chains (the front end passes the workers' KV pages in
all: a chain older than that has been evicted from every prefix cache anyway), and a restarted
worker's entries are forgotten (:meth:`PrefixAffinity.forget`): its cache starts empty.

:class:`RoundRobin` is the baseline the benchmark compares against (``--dp-routing round_robin``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


def page_chain_hashes(prompt: Sequence[int], page_size: int) -> list[int]:
    """Hash of the first k full pages of ``prompt`` for k = 1 .. len(prompt) // page_size, each
    chained to the one before (equal hashes: equal prefixes, whatever follows)."""
    hashes: list[int] = []
    h = 0
    for start in range(0, len(prompt) - page_size + 1, page_size):
        h = hash((h, tuple(prompt[start:start + page_size])))
        hashes.append(h)
    return hashes


@dataclass
class RoutingStatistics:
    """How requests were routed: by affinity (a long enough match on an available worker that
    was not too busy), or to the least loaded worker (no match, a short one, or a busy or gone
    holder). Round robin counts every request as ``least_loaded`` (it never uses a table)."""

    affinity: int = 0
    least_loaded: int = 0
    table_entries: int = 0


class PrefixAffinity:
    """Routes by the prompt's deepest known page chain; see the module docstring."""

    def __init__(self, page_size: int, capacity: int, slack: int) -> None:
        if page_size < 1 or capacity < 1 or slack < 1:
            raise ValueError("page_size, capacity and slack must be at least 1")
        self._page_size = page_size
        self._capacity = capacity
        self._slack = slack
        self._table: OrderedDict[int, int] = OrderedDict()  # chain hash -> worker, oldest first
        self._stats = RoutingStatistics()

    def pick(self, prompt: Sequence[int], loads: Sequence[int | None]) -> int:
        """The worker for ``prompt``, given each worker's live sequences (None: unavailable).
        Raises ValueError when no worker is available. Records the choice for the prompt's
        page chains."""
        least = least_loaded(loads)
        hashes = page_chain_hashes(prompt, self._page_size)
        choice, followed = least, False
        for depth in range(len(hashes), 0, -1):
            owner = self._table.get(hashes[depth - 1])
            if owner is None or owner >= len(loads):
                continue
            load, floor = loads[owner], loads[least]
            assert floor is not None
            if load is not None and 2 * depth > len(hashes) and load < floor + self._slack:
                choice, followed = owner, True
            break  # the deepest match decides, whether it is followed or not
        if followed:
            self._stats.affinity += 1
        else:
            self._stats.least_loaded += 1
        table = self._table
        for h in hashes:
            table[h] = choice
            table.move_to_end(h)
        while len(table) > self._capacity:
            table.popitem(last=False)
        return choice

    def resize(self, capacity: int) -> None:
        """Bound the table to ``capacity`` chains (the workers' KV pages, once they are known)."""
        self._capacity = max(1, capacity)
        while len(self._table) > self._capacity:
            self._table.popitem(last=False)

    def forget(self, worker: int) -> None:
        """``worker`` restarted: its prefix cache is empty, so nothing routes to it by affinity."""
        for h in [h for h, w in self._table.items() if w == worker]:
            del self._table[h]

    def statistics(self) -> RoutingStatistics:
        return RoutingStatistics(self._stats.affinity, self._stats.least_loaded, len(self._table))


class RoundRobin:
    """Each request to the next available worker in turn: the baseline without affinity."""

    def __init__(self) -> None:
        self._next = 0
        self._routed = 0

    def pick(self, prompt: Sequence[int], loads: Sequence[int | None]) -> int:
        available = [i for i, load in enumerate(loads) if load is not None]
        if not available:
            raise ValueError("no worker is available")
        choice = next((i for i in available if i >= self._next), available[0])
        self._next = choice + 1
        self._routed += 1
        return choice

    def resize(self, capacity: int) -> None:
        pass  # no table

    def forget(self, worker: int) -> None:
        pass  # no table

    def statistics(self) -> RoutingStatistics:
        return RoutingStatistics(0, self._routed, 0)


def least_loaded(loads: Sequence[int | None]) -> int:
    """The available worker with the fewest live sequences (ties: the lowest index)."""
    available = [(load, i) for i, load in enumerate(loads) if load is not None]
    if not available:
        raise ValueError("no worker is available")
    return min(available)[1]
