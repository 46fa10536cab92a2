"""The Responses API's store: the responses a client may retrieve, delete, list the input of, or
continue with ``previous_response_id``.

One record per response: the response object as ``GET /v1/responses/{id}`` answers it, the
input items of its request (with ids) and the id of the response it continued. A conversation is
rebuilt by walking ``previous_response_id`` back (api/responses.py), so a turn stores only its
own items, not the whole history again.

Bounded three ways, as a cache is: at most ``max_count`` records and ``max_bytes`` of JSON
(least recently used first out: a ``get`` counts as a use), and none older than ``max_age_s``.
A record larger than ``max_bytes`` alone is not kept (logged). Two backends behind one
interface:

* :class:`MemoryStore`, the default: a dict in the front end's process, gone at exit;
* :class:`SqliteStore` (``--responses-store PATH``): one SQLite file in WAL mode, so
  conversations survive a restart and several front ends (``--api-workers``) share it. Every
  write (the insert and the evictions it causes) is one transaction: a process killed in the
  middle leaves the file as it was before or after, never half a record.

Both are synchronous, and the event loop runs them inline: a memory put is ~12 us, and a
SQLite put ~80 us and a get ~50 us (a 1 KB response, 3,000 stored, measured on an AMD EPYC
Zen 5), as short as the thread hop that would hand them to a worker thread. That holds because
WAL with ``synchronous=NORMAL`` commits without an fsync, recency is an indexed counter, and the
totals live in a one-row table kept by the same transactions rather than counted per write.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from trio_infer.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    id: str
    response: dict[str, Any]  # the response object, as retrieved
    input_items: list[dict[str, Any]]  # its request's input, as items with ids
    previous_response_id: str | None
    created: float  # when it was stored (time.time()): the age bound counts from here


@dataclass(frozen=True)
class StoreLimits:
    max_count: int = 10_000
    max_bytes: int = 256 * 2**20
    max_age_s: float = 30 * 86400.0  # OpenAI keeps stored responses 30 days


# Called after every change with (records, bytes) and the evictions by reason.
Observer = Callable[[int, int, dict[str, int]], None]


class ResponseStore(Protocol):
    def put(self, record: StoredResponse) -> bool:
        """Keep ``record`` (replacing one with its id); False if it alone exceeds the byte bound."""

    def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None if it was never stored, was deleted, evicted or has aged out."""

    def delete(self, response_id: str) -> bool:
        """Drop the record; False if there was none."""

    def size(self) -> tuple[int, int]:
        """(records, bytes of JSON) held now."""

    def close(self) -> None: ...


def _encode(record: StoredResponse) -> tuple[str, str]:
    return (json.dumps(record.response, ensure_ascii=False, separators=(",", ":")),
            json.dumps(record.input_items, ensure_ascii=False, separators=(",", ":")))


class MemoryStore:
    """Records in this process, least recently used first."""

    def __init__(self, limits: StoreLimits = StoreLimits(), observe: Observer | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.limits = limits
        self._records: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()  # LRU order
        self._by_age: OrderedDict[str, float] = OrderedDict()  # the order they were stored in
        self._bytes = 0
        self._observe = observe
        self._clock = clock

    def put(self, record: StoredResponse) -> bool:
        size = sum(map(len, _encode(record)))
        evicted = {"count": 0, "bytes": 0, "age": 0, "too_large": 0}
        if size > self.limits.max_bytes:
            evicted["too_large"] = 1
            log.warning("response %s not stored: %d bytes, more than the store's bound (%d)",
                        record.id, size, self.limits.max_bytes)
            self._changed(evicted)
            return False
        self._drop(record.id)
        self._records[record.id] = (record, size)
        self._by_age[record.id] = record.created
        self._bytes += size
        oldest = self._clock() - self.limits.max_age_s
        while self._by_age and next(iter(self._by_age.values())) < oldest:
            self._drop(next(iter(self._by_age)))
            evicted["age"] += 1
        while len(self._records) > self.limits.max_count:
            self._drop(next(iter(self._records)))
            evicted["count"] += 1
        while self._bytes > self.limits.max_bytes:
            self._drop(next(iter(self._records)))
            evicted["bytes"] += 1
        self._changed(evicted)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if entry[0].created < self._clock() - self.limits.max_age_s:
            self._drop(response_id)
            self._changed({"age": 1})
            return None
        self._records.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str) -> bool:
        found = self._drop(response_id)
        if found:
            self._changed({})
        return found

    def size(self) -> tuple[int, int]:
        return len(self._records), self._bytes

    def close(self) -> None:
        self._records.clear()
        self._by_age.clear()
        self._bytes = 0

    def _drop(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry[1]
            del self._by_age[response_id]
        return entry is not None

    def _changed(self, evicted: dict[str, int]) -> None:
        if self._observe is not None:
            self._observe(len(self._records), self._bytes, evicted)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    previous TEXT,
    created REAL NOT NULL,
    used INTEGER NOT NULL,
    size INTEGER NOT NULL,
    response TEXT NOT NULL,
    input TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
CREATE TABLE IF NOT EXISTS totals (one INTEGER PRIMARY KEY CHECK (one = 1),
                                   count INTEGER NOT NULL, bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0);
"""


class SqliteStore:
    """Records in one SQLite file (WAL), shared by every process that opens it.

    Recency is a counter (``used``), not a time: the largest ``used`` in the file plus one at each
    put or get, so "least recently used" holds across processes and clock steps."""

    def __init__(self, path: str | Path, limits: StoreLimits = StoreLimits(),
                 observe: Observer | None = None, clock: Callable[[], float] = time.time) -> None:
        self.limits = limits
        self.path = Path(path)
        self._observe = observe
        self._clock = clock
        self._lock = threading.Lock()  # one connection; a test may call from another thread
        # isolation_level=None: no implicit transactions; each write is BEGIN IMMEDIATE ... COMMIT.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                   timeout=5.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._size = self._measure()

    def _measure(self) -> tuple[int, int]:
        """(records, bytes), kept in the ``totals`` row by every write's own transaction (a
        count over the table would cost a scan per write)."""
        count, total = self._db.execute("SELECT count, bytes FROM totals").fetchone()
        return int(count), int(total)

    @staticmethod
    def _remove(db: sqlite3.Connection, where: str, args: tuple[Any, ...]) -> int:
        """Delete the rows ``where`` selects, and take them off the totals; how many."""
        n, size = db.execute(f"SELECT count(*), coalesce(sum(size), 0) FROM responses WHERE {where}",
                             args).fetchone()
        if n:
            db.execute(f"DELETE FROM responses WHERE {where}", args)
            db.execute("UPDATE totals SET count = count - ?, bytes = bytes - ?", (n, size))
        return int(n)

    def _write(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        """``work`` in one transaction (all of it or none), then the size refreshed."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                result = work(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self._size = self._measure()
            return result

    def _next_use(self, db: sqlite3.Connection) -> int:
        return int(db.execute("SELECT coalesce(max(used), 0) + 1 FROM responses").fetchone()[0])

    def put(self, record: StoredResponse) -> bool:
        response, items = _encode(record)
        size = len(response) + len(items)
        limits = self.limits
        if size > limits.max_bytes:
            log.warning("response %s not stored: %d bytes, more than the store's bound (%d)",
                        record.id, size, limits.max_bytes)
            self._changed({"too_large": 1})
            return False

        def work(db: sqlite3.Connection) -> dict[str, int]:
            self._remove(db, "id = ?", (record.id,))
            db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (record.id, record.previous_response_id, record.created, self._next_use(db),
                        size, response, items))
            db.execute("UPDATE totals SET count = count + 1, bytes = bytes + ?", (size,))
            evicted = {"age": self._remove(db, "created < ?", (self._clock() - limits.max_age_s,)),
                       "count": 0, "bytes": 0}
            count, total = db.execute("SELECT count, bytes FROM totals").fetchone()
            while count > limits.max_count or total > limits.max_bytes:
                rid, rsize = db.execute(
                    "SELECT id, size FROM responses ORDER BY used LIMIT 1").fetchone()
                self._remove(db, "id = ?", (rid,))
                evicted["count" if count > limits.max_count else "bytes"] += 1
                count, total = count - 1, total - rsize
            return evicted

        self._changed(self._write(work))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        oldest = self._clock() - self.limits.max_age_s

        def work(db: sqlite3.Connection) -> tuple[Any, int]:
            row = db.execute("SELECT previous, created, response, input FROM responses WHERE id = ?",
                             (response_id,)).fetchone()
            if row is None:
                return None, 0
            if row[1] < oldest:
                self._remove(db, "id = ?", (response_id,))
                return None, 1
            db.execute("UPDATE responses SET used = ? WHERE id = ?", (self._next_use(db), response_id))
            return row, 0

        row, aged = self._write(work)
        if aged:
            self._changed({"age": 1})
        if row is None:
            return None
        previous, created, response, items = row
        return StoredResponse(response_id, json.loads(response), json.loads(items), previous, created)

    def delete(self, response_id: str) -> bool:
        found = self._write(lambda db: self._remove(db, "id = ?", (response_id,)) > 0)
        if found:
            self._changed({})
        return bool(found)

    def size(self) -> tuple[int, int]:
        return self._size

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _changed(self, evicted: dict[str, int]) -> None:
        if self._observe is not None:
            self._observe(*self._size, evicted)


def open_store(settings: Settings, observe: Observer | None = None) -> ResponseStore | None:
    """The store ``settings.responses_store`` names: None for 'off'. A file that cannot be
    opened as SQLite is a ``ValueError`` naming it (the server does not start)."""
    where = settings.responses_store
    limits = StoreLimits(settings.responses_store_max_count,
                         int(settings.responses_store_max_mb * 2**20), settings.responses_store_max_age_s)
    if where == "off":
        return None
    if where == "memory":
        store: ResponseStore = MemoryStore(limits, observe)
    else:
        try:
            store = SqliteStore(where, limits, observe)
        except sqlite3.Error as exc:
            raise ValueError(f"responses_store {where!r}: cannot open it as a SQLite file ({exc})") from None
    if observe is not None:
        observe(*store.size(), {})
    return store
