"""Speculative decoding with a draft model: a smaller model with the target's vocabulary guesses
a sequence's next tokens, and the target checks them in one step (engine/speculative.py).

The draft model runs in the worker next to the target, with a paged KV cache of its own (its own
:class:`~trio_infer.engine.kv_cache.PagePool` and tensors: :class:`DraftModel`) and, per
speculating sequence, its own pages and progress (:class:`DraftProposer`, the sequence's
:class:`~trio_infer.engine.speculative.Proposer`). The step splits as the target's does:

- ``schedule`` (cheap): the proposer decides how many tokens to guess (the adaptive length and
  the off-switches of the base class) and reserves the draft pages they need; the draft only
  takes free pages, never anyone's. Its tokens are not known yet: the item carries ``k``
  placeholders (:data:`PENDING`), and the plan a :class:`DraftWork` snapshot per sequence.
- ``execute`` (heavy, off the event loop): :meth:`DraftModel.run` catches each sequence's draft
  KV up on the tokens it has not seen (the tokens the last verify kept, the bonus token, the
  whole sequence after a preemption or on its first draft) and takes the argmax of its last row,
  then one decode forward per further position, each batched over the sequences still drafting
  (a sequence's draft may be shorter than another's). The tokens replace the placeholders before
  the target's forward.
- ``commit``: the verify step kept ``a`` drafts, so the target's ``num_computed`` is
  ``start + 1 + a``; the draft had computed the sequence's tokens and its own first ``k - 1``
  guesses, of which the kept ones are the target's tokens too, so its ``num_computed`` rolls
  back to the smaller of the two (:meth:`DraftProposer.keep`). The next step's catch-up starts
  there.

The draft is greedy (its argmax): a point mass, so the verification's rules stay exactly right:
greedy requests keep a draft while it is the target's argmax, and for sampled ones keeping ``d``
with probability ``min(1, p(d) / q(d)) = p(d)`` and drawing a rejection's token from ``p``
without ``d``, renormalised (the residual ``max(0, p - q)`` of a point mass) is rejection
sampling, so the output keeps the target's distribution whatever the draft guesses.

Every draft page goes back when the sequence gives its pages back, however it ends (the
scheduler's one place for it calls :meth:`DraftProposer.release`), and after a preemption the
draft re-prefills with the target. The draft keeps no prefix cache: a page of draft KV belongs
to one sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.engine.kv_cache import KVCache, OutOfPages, PagePool, check_kv_dtype, resolve_kv_dtype
from trio_infer.engine.model_runner import host_logits
from trio_infer.engine.sampler import argmax_ids
from trio_infer.engine.sequence import Sequence
from trio_infer.engine.speculative import Drafts, Proposer
from trio_infer.models.base import CausalLM

# A draft token the draft model has not proposed yet: an item's placeholders between schedule
# and execute, replaced before the target's forward (never a token id: ids are >= 0).
PENDING = -1


@dataclass(frozen=True)
class DraftWork:
    """One sequence's draft this step, snapshotted at schedule time: the tokens the draft model
    has not seen (the last one is the sequence's last sampled token), the position of the first,
    the draft page table, and how many tokens to propose."""

    tokens: tuple[int, ...]
    start: int
    pages: tuple[int, ...]
    num_tokens: int


class DraftModel:
    """The draft model, its KV cache and page pool: one per engine."""

    def __init__(self, model: CausalLM, page_size: int, num_pages: int,
                 kv_cache_dtype: str, device: str) -> None:
        info = model.info
        self.model = model
        self.page_size = page_size
        self.device = device
        dtype = resolve_kv_dtype(kv_cache_dtype, info.dtype, device)
        check_kv_dtype(model, dtype)
        self.pool = PagePool(num_pages)
        self.kv_cache = KVCache(info.num_layers, num_pages, page_size, info.num_kv_heads,
                                info.head_dim, dtype, device)

    @staticmethod
    def bytes_per_page(model: CausalLM, page_size: int, kv_cache_dtype: str,
                       device: str) -> int:
        info = model.info
        dtype = resolve_kv_dtype(kv_cache_dtype, info.dtype, device)
        return KVCache.bytes_per_page(info.num_layers, page_size, info.num_kv_heads,
                                      info.head_dim, dtype)

    def proposer(self, num_tokens: int, min_acceptance: float) -> DraftProposer:
        """A new sequence's drafting state (no pages yet)."""
        return DraftProposer(self.pool, self.page_size, num_tokens, min_acceptance,
                             self.model.info.max_model_len)

    def run(self, work: list[DraftWork]) -> list[tuple[int, ...]]:
        """Each sequence's draft: catch up and guess the first token in one forward (chunks of
        several tokens and single ones alike), then one decode forward per further position over
        the sequences that want it. Runs in ``execute``: reads only ``work``, writes only the
        draft pages it names."""
        out: list[list[int]] = [[] for _ in work]
        rows = [(w.tokens, w.start, w.pages) for w in work]
        for i, token in zip(range(len(work)), self._forward(rows)):
            out[i].append(token)
        for j in range(1, max(w.num_tokens for w in work)):
            active = [i for i, w in enumerate(work) if w.num_tokens > j]
            rows = [((out[i][-1],), work[i].start + len(work[i].tokens) + j - 1,
                     work[i].pages) for i in active]
            for i, token in zip(active, self._forward(rows)):
                out[i].append(token)
        return [tuple(tokens) for tokens in out]

    def _forward(self, rows: list[tuple[tuple[int, ...], int, tuple[int, ...]]]) -> list[int]:
        """One forward of the draft model over ``rows`` (tokens, position of the first, pages):
        the argmax after each row's last token, in the order of ``rows``."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) != 1)  # decodes first
        ps = self.page_size
        max_pages = max(len(rows[i][2]) for i in order)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        pages: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        for i in order:
            tokens, start, table = rows[i]
            input_ids.extend(tokens)
            for p in range(start, start + len(tokens)):
                positions.append(p)
                slots.append(table[p // ps] * ps + p % ps)
            pages.extend(table)
            pages.extend([0] * (max_pages - len(table)))
            seq_lens.append(start + len(tokens))
            qsl.append(qsl[-1] + len(tokens))
        def tensor(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64)

        counts = [len(rows[i][0]) for i in order]
        batch = ForwardBatch(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            page_table=tensor(pages).reshape(len(order), max_pages),
            seq_lens=tensor(seq_lens),
            query_start_loc=tensor(qsl),
            num_decodes=sum(1 for n in counts if n == 1),
            logits_indices=tensor([end - 1 for end in qsl[1:]]),
            max_query_len=max(counts),
            max_seq_len=max(seq_lens),
        )
        best = argmax_ids(host_logits(self.model.forward(batch, self.kv_cache.k, self.kv_cache.v)))
        tokens = [0] * len(rows)
        for row, i in enumerate(order):
            tokens[i] = best[row]
        return tokens


class DraftProposer(Proposer):
    """One sequence's draft-model state: its draft pages, how many of its tokens the draft KV
    holds (``num_computed``), and (from the base class) the draft length and off-switch."""

    def __init__(self, pool: PagePool, page_size: int, num_tokens: int,
                 min_acceptance: float, max_len: int) -> None:
        super().__init__(num_tokens, min_acceptance)
        self._pool = pool
        self._page_size = page_size
        self._max_len = max_len  # the draft model's context: it guesses no position past it
        self.pages: list[int] = []
        self.num_computed = 0
        self._ahead = 0  # num_computed after the step in flight, before the verify's rollback

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """``k`` placeholders (:data:`PENDING`: the draft model fills them in ``execute``) with
        the draft pages for them reserved; [] while the off-switch holds the sequence or the
        draft pool has no free pages for it (a draft never takes anyone's pages)."""
        k = self._draft_length(min(limit, self._max_len + 1 - len(token_ids)))
        if k <= 0:
            return []
        # The draft computes the sequence's tokens and its own first k - 1 guesses.
        missing = -(-(len(token_ids) + k - 1) // self._page_size) - len(self.pages)
        if missing > 0:
            try:
                self.pages.extend(self._pool.allocate(missing))
            except OutOfPages:
                return []
        return [PENDING] * k

    def work(self, token_ids: list[int], num_tokens: int) -> DraftWork:
        """The snapshot ``execute`` drafts from, for a draft of ``num_tokens`` that the scheduler
        kept (after :meth:`propose`)."""
        self._ahead = len(token_ids) + num_tokens - 1
        return DraftWork(tuple(token_ids[self.num_computed :]), self.num_computed,
                         tuple(self.pages), num_tokens)

    def keep(self, num_computed: int) -> None:
        """Roll the draft KV back to what the verify kept: its positions before the target's new
        ``num_computed`` hold the sequence's tokens, the rest are rejected guesses."""
        self.num_computed = min(self._ahead, num_computed)

    def release(self) -> None:
        self._pool.release(self.pages)
        self.pages = []
        self.num_computed = 0
        self._ahead = 0


def draft_work(seq: Sequence, num_tokens: int) -> DraftWork:
    """What the draft model reads to guess ``num_tokens`` for ``seq`` this step (schedule time)."""
    assert isinstance(seq.proposer, DraftProposer)
    return seq.proposer.work(seq.token_ids, num_tokens)


def fill_drafts(batch: ForwardBatch, drafts: Drafts,
                tokens: list[tuple[int, ...]]) -> tuple[ForwardBatch, Drafts]:
    """The step's batch and drafts with the draft model's ``tokens`` (one tuple per verifying
    sequence, in order) in place of the :data:`PENDING` placeholders: row ``j`` of a verifying
    sequence reads draft token ``j`` (its row 0 the last sampled token)."""
    rows = batch.logits_indices.tolist()  # a verify row's logits row is its input row
    at: list[int] = []
    values: list[int] = []
    for first, toks in zip(drafts.rows, tokens):
        at.extend(rows[first + 1 : first + 1 + len(toks)])
        values.extend(toks)
    input_ids = batch.input_ids.copy()
    input_ids[np.array(at, dtype=np.int64)] = np.array(values, dtype=np.int64)
    return (dataclasses.replace(batch, input_ids=input_ids),
            dataclasses.replace(drafts, tokens=list(tokens)))
