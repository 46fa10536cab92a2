"""Continuous batching over the paged KV cache.

Each step the scheduler picks which tokens run, under two caps: ``max_running`` admitted
sequences and a budget of ``max_batched_tokens`` tokens per step. Running sequences go first,
oldest first, so decodes never starve behind a long prompt; a prompt longer than what is left of
the budget is prefilled in chunks over several steps. Waiting sequences are admitted in the order
of their ``queue_key``, priority (``SamplingParams.priority``, lower first: vLLM's) then arrival,
while the budget, the cap and the free pages allow; the head of the queue is never overtaken by
a lower-priority sequence (a head that does not fit stops admission).

When a running sequence needs a page and the pool is dry, a victim is *preempted*: its pages are
freed and it goes back to the queue at its own key (ahead of every younger sequence of its
priority), to be recomputed from its tokens later. Paused sequences are picked first (they make
no progress anyway), lowest priority first, then the running one of lowest priority, youngest
first, so a higher-priority sequence is never preempted while a lower-priority one holds pages,
and among equals the oldest always progresses. A victim that this step had already scheduled
loses its item (and gives its tokens back to the budget). The engine caps the context at the
pool's size, so a sequence alone can always finish.

Each sequence's first scheduling is recorded (:meth:`Scheduler.take_admitted`): the worker tells
the front end, for which that is the end of the request's queue time.

A sequence whose ``ready`` flag is False (its reader is behind) is skipped without losing anything:
it keeps its pages and resumes when the flag comes back.

With a :class:`~trio_infer.engine.prefix_cache.PrefixCache`, an admitted sequence starts from the
longest cached prefix of its tokens, every full page a step computes is recorded for later
requests, and the pool makes room by evicting cache-only pages before anything is preempted.
A sequence that still owes prompt logprobs starts from a cached prefix only as far as the
logprobs it already has (see :class:`~trio_infer.engine.sequence.Sequence`): the first time, from
none, so it computes its whole prompt; the pages it computes are still offered to the cache.

A sequence with ``max_tokens == 0`` prefills its prompt and never samples.

Speculative decoding (engine/speculative.py): a running sequence in decode that has a
``proposer`` may carry a draft of guessed tokens; its item then computes ``1 + len(draft)`` tokens
(the last sampled one and the draft) and counts among the decodes, one row per token. A draft
only takes pages the pool has free (or the prefix cache gives up): it never preempts anyone.
A draft model's pages (engine/draft.py) go back wherever the sequence's own do.
No sequence proposes in a step with more than ``spec_max_batch`` running sequences (0: never),
nor while ``drafting`` is False.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import NamedTuple

from trio_infer.engine.kv_cache import OutOfPages, PagePool
from trio_infer.engine.prefix_cache import ROOT, PrefixCache
from trio_infer.engine.sequence import Sequence, Status


class ScheduledSeq(NamedTuple):
    """One sequence's part of a step. Immutable, and a tuple: one is built for every sequence
    of every step, and a frozen dataclass's ``__init__`` (a ``object.__setattr__`` per field)
    cost 1.9 us of it, a tenth of the worker's CPU at 256 sequences."""

    seq: Sequence
    start: int  # first token computed this step (the sequence's num_computed at schedule time)
    num_tokens: int
    pages: tuple[int, ...]  # page table snapshot: the step must not see later changes
    samples: bool  # the chunk reaches the end of the sequence: sample the next token
    # Positions [lp_start, lp_end) of the chunk whose rows give prompt logprobs (empty for the
    # requests that ask for none): row p scores prompt token p + 1.
    lp_start: int = 0
    lp_end: int = 0
    # Guessed tokens to verify after the last sampled one (speculative decoding): the item's
    # tokens are that one and these, num_tokens == 1 + len(draft), each a decode row.
    draft: tuple[int, ...] = ()

    @property
    def decode_rows(self) -> bool:
        """Whether the item runs as one-token decode rows (a decode, or a decode and its draft)."""
        return self.num_tokens == 1 or bool(self.draft)


@dataclass(frozen=True)
class Schedule:
    items: list[ScheduledSeq]  # decode-row items first (decodes and drafts), then the chunks
    num_decodes: int  # decode rows: the tokens of the decode-row items
    preempted: list[Sequence]


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        max_running: int,
        max_batched_tokens: int,
        prefix_cache: PrefixCache | None = None,
        spec_max_batch: int = 0,
    ) -> None:
        self.pool = pool
        self.spec_max_batch = spec_max_batch
        # False: no sequence drafts in the next steps (the engine's measured off-switch sets it).
        self.drafting = True
        self.page_size = page_size
        # max_batched_tokens >= max_running (a decode is one token): EngineConfig checks it.
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.queue_key
        self.running: list[Sequence] = []  # admission order, oldest first
        self._arrivals = itertools.count()
        self._admitted: list[Sequence] = []  # scheduled for the first time since the last take
        self.prefix_cache = prefix_cache
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which served from it

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        seq.arrival = next(self._arrivals)
        self._enqueue(seq)

    def take_admitted(self) -> list[Sequence]:
        """The sequences scheduled for the first time since the last call (still live or not)."""
        admitted, self._admitted = self._admitted, []
        return admitted

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues and give back its pages (finish or abort)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> Schedule | None:
        budget = self.max_batched_tokens
        items: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        propose = self.drafting and 0 < len(self.running) <= self.spec_max_batch
        i = 0
        while i < len(self.running) and budget:
            seq = self.running[i]
            if not seq.ready:
                i += 1
                continue
            draft = self._draft(seq, budget) if propose else ()
            if draft:
                i += 1
                items.append(ScheduledSeq(seq, seq.num_computed, 1 + len(draft),
                                          tuple(seq.pages), True, draft=draft))
                budget -= 1 + len(draft)
                continue
            n = min(seq.num_pending, budget)
            preempted_before = len(preempted)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self._pick_victim(seq)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                for k, it in enumerate(items):  # a lower-priority victim this step scheduled
                    if it.seq is victim:
                        budget += it.num_tokens
                        del items[k]
                        break
            if seq.status is not Status.RUNNING:
                continue  # preempted itself; running[i] is now the next sequence
            if len(preempted) > preempted_before:
                i = self.running.index(seq)  # paused victims before seq shift its index
            i += 1
            items.append(self._item(seq, n))
            budget -= n

        # Admit new work in queue order (priority, then arrival), unless this step had to
        # preempt (the pool is dry: admitting now would only thrash). Paused ones are skipped.
        k = 0
        while k < len(self.waiting) and budget and len(self.running) < self.max_running and not preempted:
            seq = self.waiting[k]
            if not seq.ready:
                k += 1
                continue
            self._attach_cached_prefix(seq)
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, seq.num_computed + n):
                self._free(seq)
                seq.num_computed = 0
                break  # the pool is dry: new requests wait
            del self.waiting[k]
            seq.status = Status.RUNNING
            self.running.append(seq)
            if not seq.admitted:
                seq.admitted = True
                self._admitted.append(seq)
            items.append(self._item(seq, n))
            budget -= n

        if not items:
            return None
        num_decodes = 0
        chunks = False
        for it in items:  # one pass; a step of decodes only (the common one) needs no sort
            if it.decode_rows:
                num_decodes += it.num_tokens
            else:
                chunks = True
        if chunks:
            items.sort(key=lambda it: not it.decode_rows)  # stable: decodes first
        return Schedule(items, num_decodes, preempted)

    def record_computed(self, seq: Sequence) -> None:
        """Offer the full pages ``seq`` has computed to the prefix cache."""
        if self.prefix_cache is None:
            return
        ps = self.page_size
        while len(seq.cache_nodes) < seq.num_computed // ps:
            i = len(seq.cache_nodes)
            parent = seq.cache_nodes[-1] if seq.cache_nodes else ROOT
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            seq.cache_nodes.append(self.prefix_cache.insert(parent, tokens, seq.pages[i]))

    # -- helpers ------------------------------------------------------------------------------

    def _attach_cached_prefix(self, seq: Sequence) -> None:
        if self.prefix_cache is None or seq.num_computed:
            return
        # At least the last token must be computed: its logits give the next token.
        max_pages = (len(seq.token_ids) - 1) // self.page_size
        if seq.prompt_lps is not None:  # rows from lp_next on must be computed, not looked up
            max_pages = min(max_pages, seq.lp_next // self.page_size)
        nodes = self.prefix_cache.match(seq.token_ids, max_pages)
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += len(nodes) * self.page_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = len(nodes) * self.page_size
        if nodes:
            seq.pages = [node.page for node in nodes]
            self.pool.retain(seq.pages)
            seq.cache_nodes = [node.id for node in nodes]
            seq.num_computed = len(nodes) * self.page_size

    def _draft(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """The tokens ``seq`` guesses for this step, with the pages to verify them reserved; ()
        when it does not speculate now. A draft never goes past ``max_tokens`` or the context."""
        if seq.proposer is None or seq.num_pending != 1 or seq.prompt_lps is not None:
            return ()
        limit = min(budget - 1, seq.max_len - len(seq.token_ids))
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.params.max_tokens - seq.num_output_tokens - 1)
        draft = seq.proposer.propose(seq.token_ids, limit)
        if not draft or not self._reserve(seq, seq.num_computed + 1 + len(draft)):
            return ()
        return tuple(draft)

    def _item(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed
        end = start + n
        if seq.prompt_lps is None:  # the usual case
            return ScheduledSeq(seq, start, n, tuple(seq.pages),
                                end == len(seq.token_ids) and seq.params.max_tokens != 0)
        return ScheduledSeq(
            seq=seq,
            start=start,
            num_tokens=n,
            pages=tuple(seq.pages),
            samples=end == len(seq.token_ids) and seq.params.max_tokens != 0,
            lp_start=max(start, seq.lp_next),
            lp_end=min(end, seq.num_prompt_tokens - 1),
        )

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq`` hold enough pages for ``num_tokens`` tokens; False if the pool is dry."""
        missing = -(-num_tokens // self.page_size) - len(seq.pages)
        if missing <= 0:
            return True
        if missing > self.pool.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(missing - self.pool.num_free)
        try:
            seq.pages.extend(self.pool.allocate(missing))
        except OutOfPages:
            return False
        return True

    def _pick_victim(self, needy: Sequence) -> Sequence:
        """Paused sequences first, then the running one of lowest priority (the highest value),
        youngest first (possibly ``needy`` itself): ``max`` by key keeps the last of equals."""
        paused = [seq for seq in self.running if not seq.ready and seq is not needy]
        return max(paused or self.running, key=lambda seq: seq.queue_key)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.queue_key)

    def _free(self, seq: Sequence) -> None:
        """Every page ``seq`` holds goes back: its own, and its draft model's (engine/draft.py)."""
        self.pool.release(seq.pages)
        seq.pages = []
        seq.cache_nodes = []
        if seq.proposer is not None:
            seq.proposer.release()
