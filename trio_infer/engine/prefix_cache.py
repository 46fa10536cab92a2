"""Page-granular prefix cache: full KV pages shared across requests with the same prefix.

Every full page a sequence has computed is recorded under the key ``(parent node, the page's
tokens)``, so a node stands for a whole prefix, not just a page of tokens. A new sequence walks
this chain from the root over its prompt and starts with the matched pages already computed.

Ownership is plain reference counting in the :class:`~trio_infer.engine.kv_cache.PagePool`: the
cache holds one reference on each page it records, each sequence using the page holds one more.
A page only the cache holds is *evictable*; eviction goes least-recently-used first and never
touches a page a sequence holds, so it cannot corrupt a running request.

Node ids are never reused. When a node is evicted its descendants become unreachable (their keys
name a parent id that no longer exists) and simply age out of the LRU order; they can never be
matched under a different prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from trio_infer.engine.kv_cache import PagePool

ROOT = 0


@dataclass(frozen=True)
class _Node:
    id: int
    page: int
    key: tuple[int, tuple[int, ...]]


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._by_key: dict[tuple[int, tuple[int, ...]], _Node] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # least recently used first
        self._next_id = ROOT + 1

    @property
    def num_pages(self) -> int:
        return len(self._lru)

    @property
    def num_evictable(self) -> int:
        """Pages only the cache holds (no request uses them)."""
        return sum(1 for node in self._lru.values() if self.pool.refcount(node.page) == 1)

    def match(self, token_ids: list[int], max_pages: int) -> list[_Node]:
        """The longest chain of cached full pages that prefixes ``token_ids`` (at most
        ``max_pages``). Marks them recently used; the caller must ``retain`` their pages."""
        nodes: list[_Node] = []
        parent = ROOT
        ps = self.page_size
        for i in range(min(max_pages, len(token_ids) // ps)):
            node = self._by_key.get((parent, tuple(token_ids[i * ps : (i + 1) * ps])))
            if node is None:
                break
            nodes.append(node)
            parent = node.id
        # Touch deepest first so that parents end up more recent than their children: eviction
        # then takes the leaves of a chain before its root.
        for node in reversed(nodes):
            self._lru.move_to_end(node.id)
        return nodes

    def insert(self, parent: int, tokens: tuple[int, ...], page: int) -> int:
        """Record ``page`` (full, holding ``tokens``) under ``parent``; return the node id for
        that prefix. If the prefix is already cached (computed twice concurrently), keep the
        existing page and return its node."""
        key = (parent, tokens)
        node = self._by_key.get(key)
        if node is not None:
            self._lru.move_to_end(node.id)
            return node.id
        node = _Node(self._next_id, page, key)
        self._next_id += 1
        self.pool.retain([page])
        self._by_key[key] = node
        self._lru[node.id] = node
        return node.id

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages that only the cache holds, LRU first. Returns how many."""
        freed = 0
        for node in list(self._lru.values()):
            if freed == num_pages:
                break
            if self.pool.refcount(node.page) == 1:
                del self._lru[node.id]
                del self._by_key[node.key]
                self.pool.release([node.page])
                freed += 1
        return freed

    def clear(self) -> int:
        return self.evict(len(self._lru))
