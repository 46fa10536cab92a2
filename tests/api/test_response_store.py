"""The response store's two backends (api/response_store.py) behind one interface: their bounds
(count, bytes, age, least recently used first out), what they say to ``/metrics``, and the
SQLite file across a reopen and a process killed in the middle of its writes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_infer.api.response_store import MemoryStore, SqliteStore, StoredResponse, StoreLimits
from trio_infer.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(rid: str, text: str = "x", created: float = 1000.0, previous: str | None = None) -> StoredResponse:
    return StoredResponse(rid, {"id": rid, "output": [{"type": "message", "text": text}]},
                          [{"id": "msg_" + rid, "type": "message", "role": "user", "content": "hi"}],
                          previous, created)


@pytest.fixture(params=["memory", "sqlite"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Any]:
    def make_store(limits: StoreLimits = StoreLimits(), **kw: Any) -> Any:
        kw.setdefault("clock", Clock())
        if request.param == "memory":
            return MemoryStore(limits, **kw)
        return SqliteStore(tmp_path / "responses.sqlite", limits, **kw)
    return make_store


def test_a_record_comes_back_as_it_was_stored_and_is_gone_once_deleted(make) -> None:
    store = make()
    r = record("a", "é ✓", previous="z")
    assert store.put(r)
    assert store.get("a") == r
    assert store.delete("a") and store.get("a") is None
    assert not store.delete("a")
    assert store.size() == (0, 0)


def test_the_count_bound_evicts_the_least_recently_used(make) -> None:
    store = make(StoreLimits(max_count=3))
    for rid in "abc":
        store.put(record(rid))
    store.get("a")  # a use: "b" is now the least recent
    store.put(record("d"))
    assert [rid for rid in "abcd" if store.get(rid) is not None] == ["a", "c", "d"]
    assert store.size()[0] == 3


def test_the_byte_bound_holds_and_a_record_larger_than_it_is_refused(make) -> None:
    size = sum(len(json.dumps(x, separators=(",", ":"))) for x in
               (record("a").response, record("a").input_items))
    store = make(StoreLimits(max_bytes=2 * size + 1))
    for rid in "abc":
        assert store.put(record(rid))
    assert store.size() == (2, 2 * size)
    assert store.get("a") is None and store.get("c") is not None
    assert not store.put(record("big", "y" * (3 * size)))
    assert store.get("big") is None and store.size() == (2, 2 * size)


def test_a_record_past_the_age_bound_is_gone(make) -> None:
    clock = Clock()
    store = make(StoreLimits(max_age_s=60), clock=clock)
    store.put(record("old", created=clock.now))
    clock.now += 30
    store.put(record("new", created=clock.now))
    assert store.get("old") is not None
    clock.now += 31  # "old" is 61 s old, "new" 31 s
    assert store.get("old") is None
    assert store.get("new") is not None
    clock.now += 30
    store.put(record("newest", created=clock.now))  # a put drops what aged out
    assert store.size()[0] == 1


def test_the_store_reports_its_size_and_evictions_to_metrics(make) -> None:
    metrics = Metrics()
    store = make(StoreLimits(max_count=2), observe=metrics.store_changed)
    for rid in "abc":
        store.put(record(rid))
    values = metrics.snapshot()
    assert values["trio_infer_responses_stored"] == 2
    assert values["trio_infer_responses_stored_bytes"] == store.size()[1] > 0
    assert b'trio_infer_responses_evicted_total{reason="count"} 1.0' in metrics.render()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 7),
                              st.integers(0, 40)), max_size=40))
def test_both_backends_agree_on_every_sequence_of_operations(tmp_path_factory, ops) -> None:
    """The SQLite store behaves as the memory store does, operation for operation, under small
    bounds (so evictions by count and by bytes both happen)."""
    limits = StoreLimits(max_count=4, max_bytes=600)
    memory = MemoryStore(limits, clock=Clock())
    sqlite = SqliteStore(tmp_path_factory.mktemp("db") / "r.sqlite", limits, clock=Clock())
    for op, key, length in ops:
        rid = f"r{key}"
        if op == "put":
            assert memory.put(record(rid, "t" * length)) == sqlite.put(record(rid, "t" * length))
        elif op == "get":
            assert memory.get(rid) == sqlite.get(rid)
        else:
            assert memory.delete(rid) == sqlite.delete(rid)
        assert memory.size() == sqlite.size()
    sqlite.close()


def test_the_sqlite_file_keeps_its_records_across_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    store = SqliteStore(path, clock=Clock())
    store.put(record("a", previous=None))
    store.put(record("b", previous="a"))
    store.close()
    again = SqliteStore(path, clock=Clock())
    assert again.get("b") == record("b", previous="a")
    assert again.size()[0] == 2


WRITER = """
import sys, time
from trio_infer.api.response_store import SqliteStore, StoredResponse, StoreLimits
store = SqliteStore(sys.argv[1], StoreLimits(max_count=50))
i = 0
while True:
    rid = f"r{i}"
    store.put(StoredResponse(rid, {"id": rid, "output": ["y" * (i % 3000)]}, [{"id": "m"}], None, time.time()))
    print(rid, flush=True)  # committed
    i += 1
"""


@pytest.mark.parametrize("kill_after", [1, 37, 120])
def test_a_writer_killed_mid_write_leaves_only_whole_records(tmp_path: Path, kill_after: int) -> None:
    """SIGKILL a process that writes as fast as it can: every row's JSON is whole, and the rows
    are exactly the newest 50 (the count bound) of the writes up to some point at or after the
    last one it reported committed: nothing committed is lost but to eviction, nothing torn."""
    path = tmp_path / "r.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    for _ in range(kill_after):
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    db = sqlite3.connect(path)
    rows = db.execute("SELECT id, size, response, input FROM responses").fetchall()
    # the totals row is written in the same transactions: it never disagrees with the rows
    assert db.execute("SELECT count, bytes FROM totals").fetchone() == (
        len(rows), sum(size for _, size, *_ in rows))
    for rid, size, response, items in rows:
        assert json.loads(response)["id"] == rid and json.loads(items) == [{"id": "m"}]
        assert size == len(response) + len(items)
    written = sorted(int(rid[1:]) for rid, *_ in rows)
    last = written[-1]
    assert last >= kill_after - 1
    assert written == list(range(max(0, last - 49), last + 1))
