"""Turns a schedule into arrays, runs the model, samples.

The model computes logits only for the rows of ``batch.logits_indices``: first the sampling
rows in schedule order (one per sequence that samples, ``1 + len(draft)`` for a sequence that
verifies a draft: engine/speculative.py), then the rows that give prompt logprobs
(:class:`PromptRows`), which exist only for the sequences that asked for them.

The forward's logits become a host float32 numpy array at one place, :func:`host_logits`, right
after the forward: sampling, verification and prompt logprobs work on numpy and import no torch
(engine/sampler.py says why and what it costs a GPU).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.engine.grammar import TokenMasks
from trio_infer.engine.kv_cache import KVCache
from trio_infer.engine.sampler import SampleResult, prompt_logprobs, sample
from trio_infer.engine.scheduler import Schedule
from trio_infer.engine.sequence import Sequence
from trio_infer.engine.speculative import Drafts, verify
from trio_infer.models.base import CausalLM


@dataclass(frozen=True)
class PromptRows:
    """The step's prompt-logprob rows, after the sampling rows of the logits, in schedule order:
    the prompt token each row scores and how many alternatives it wants."""

    targets: list[int]
    top_k: list[int]


def host_logits(x: Any) -> np.ndarray:
    """A forward's logits as a writable, C-contiguous float32 numpy array on the host, which the
    sampler may change in place: the one place where they leave torch. Such an array is
    returned as it is; anything else is taken for a torch tensor (duck-typed, so this needs no
    torch): a contiguous CPU float32 one becomes a view of its memory (no copy), a GPU one is
    cast to float32 on the device and copied to the host (a device synchronisation every step:
    engine/sampler.py), anything else is copied."""
    if not isinstance(x, np.ndarray):
        x = x.detach().float().cpu().numpy()
    if x.dtype != np.float32 or not x.flags.c_contiguous or not x.flags.writeable:
        x = np.array(x, dtype=np.float32, order="C")  # a copy
    return x


def _int64(values: list[int]) -> np.ndarray:
    """``values`` as an int64 array, converted by ``array``'s C loop (``np.array`` on a list of
    ints walks it object by object: a 256 x 12 page table took ~3x as long). The array shares the
    ``array``'s memory and keeps it alive."""
    if not values:
        return np.zeros(0, dtype=np.int64)
    return np.frombuffer(array("q", values), dtype=np.int64)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self._aranges: dict[int, np.ndarray] = {}  # batch size -> arange(n + 1)
        # The random rows without a seed of their own draw from this (engine/sampler.py); a
        # seeded request draws from its Sequence.generator. Unseeded: fresh entropy per worker.
        self.rng = np.random.default_rng()

    def prepare(self, schedule: Schedule) -> tuple[ForwardBatch, PromptRows | None, Drafts | None]:
        """Build the step's input tensors from the schedule's snapshot (not from live state).

        An item with a draft becomes ``1 + len(draft)`` one-token decode rows of the same
        sequence (position ``start + j``, context ``start + j + 1``, the same page table), each
        with its logits; the :class:`Drafts` say where they sit (None when no item has one)."""
        if all(it.num_tokens == 1 and it.samples and not it.draft and it.lp_end <= it.lp_start
               for it in schedule.items):
            return self._prepare_decode(schedule), None, None
        page_size = self.kv_cache.page_size
        input_ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        max_pages = max(len(it.pages) for it in schedule.items)
        pages: list[int] = []  # the page table, row by row, padded with 0
        lp_rows: list[int] = []
        lp_targets: list[int] = []
        lp_top_k: list[int] = []
        draft_seqs: list[Sequence] = []
        draft_tokens: list[tuple[int, ...]] = []
        draft_rows: list[int] = []
        plain_rows: list[int] = []
        total = 0
        for it in schedule.items:
            end = it.start + it.num_tokens
            if it.draft:
                draft_seqs.append(it.seq)
                draft_tokens.append(it.draft)
                draft_rows.append(len(logits_indices))
                input_ids.append(it.seq.token_ids[it.start])
                input_ids.extend(it.draft)
                padded = [*it.pages, *[0] * (max_pages - len(it.pages))]
                for j in range(it.num_tokens):
                    starts.append(it.start + j)
                    counts.append(1)
                    seq_lens.append(it.start + j + 1)
                    pages.extend(padded)
                    logits_indices.append(total + j)
                total += it.num_tokens
                continue
            if it.num_tokens == 1:
                input_ids.append(it.seq.token_ids[it.start])
            else:
                input_ids.extend(it.seq.token_ids[it.start : end])
            starts.append(it.start)
            counts.append(it.num_tokens)
            seq_lens.append(end)
            pages.extend(it.pages)
            pages.extend([0] * (max_pages - len(it.pages)))
            if it.lp_end > it.lp_start:  # only sequences that asked for prompt logprobs
                first = total + it.lp_start - it.start
                lp_rows.extend(range(first, first + it.lp_end - it.lp_start))
                lp_targets.extend(it.seq.token_ids[it.lp_start + 1 : it.lp_end + 1])
                lp_top_k.extend([it.seq.params.prompt_logprobs or 0] * (it.lp_end - it.lp_start))
            total += it.num_tokens
            if it.samples:
                plain_rows.append(len(logits_indices))
                logits_indices.append(total - 1)
        page_table = _int64(pages).reshape(len(counts), max_pages)

        if total == len(counts):  # a pure decode step (the common one): plain lists, no indexing
            query_start_loc = np.arange(total + 1, dtype=np.int64)
            positions = _int64(starts)
            if draft_seqs:
                slots = (page_table[np.arange(total), positions // page_size] * page_size
                         + positions % page_size)
            else:
                slots = _int64([it.pages[it.start // page_size] * page_size + it.start % page_size
                                for it in schedule.items])
        else:
            counts_a = _int64(counts)
            seq_of_token = np.repeat(np.arange(len(counts)), counts_a)
            query_start_loc = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts_a, out=query_start_loc[1:])
            positions = np.arange(total, dtype=np.int64) - query_start_loc[seq_of_token]
            positions += _int64(starts)[seq_of_token]
            slots = page_table[seq_of_token, positions // page_size] * page_size + positions % page_size

        rows = None
        if lp_rows:
            logits_indices.extend(lp_rows)
            rows = PromptRows(lp_targets, lp_top_k)
        drafts = Drafts(draft_seqs, draft_tokens, draft_rows, plain_rows) if draft_seqs else None
        batch = ForwardBatch(
            input_ids=_int64(input_ids),
            positions=positions,
            slot_mapping=slots,
            page_table=page_table,
            seq_lens=_int64(seq_lens),
            query_start_loc=query_start_loc,
            num_decodes=schedule.num_decodes,
            logits_indices=_int64(logits_indices),
            max_query_len=max(counts),
            max_seq_len=max(seq_lens),
        )
        return batch, rows, drafts

    def _prepare_decode(self, schedule: Schedule) -> ForwardBatch:
        """:meth:`prepare` for the common step: every item one token that samples, with no draft
        and no prompt logprobs. The same tensors as the general path, built by one pass per
        list instead of a dozen appends per item (at 256 running sequences the general loop was
        most of the step's Python), all into one ``array`` that becomes one numpy array, of which
        the batch's arrays are views; ``query_start_loc`` and ``logits_indices`` are the same
        ``arange`` at every step of a batch size, kept."""
        items = schedule.items
        page_size = self.kv_cache.page_size
        n = len(items)
        max_pages = max(len(it.pages) for it in items)
        starts = [it.start for it in items]
        flat = array("q", [it.seq.token_ids[it.start] for it in items])
        flat.extend(starts)
        flat.extend([it.pages[it.start // page_size] * page_size + it.start % page_size
                     for it in items])
        flat.extend([s + 1 for s in starts])
        pad = (0,) * max_pages
        for it in items:
            flat.extend(it.pages)
            if len(it.pages) < max_pages:
                flat.extend(pad[len(it.pages):])
        t = np.frombuffer(flat, dtype=np.int64)  # shares flat's memory and keeps it alive
        rows = self._row_indices(n)
        return ForwardBatch(
            input_ids=t[:n],
            positions=t[n : 2 * n],
            slot_mapping=t[2 * n : 3 * n],
            page_table=t[4 * n :].reshape(n, max_pages),
            seq_lens=t[3 * n : 4 * n],
            query_start_loc=rows,
            num_decodes=schedule.num_decodes,
            logits_indices=rows[:n],
            max_query_len=1,
            max_seq_len=max(starts) + 1,
        )

    def _row_indices(self, n: int) -> np.ndarray:
        """``arange(n + 1)``, made once per batch size (nothing writes to it)."""
        rows = self._aranges.get(n)
        if rows is None:
            rows = self._aranges[n] = np.arange(n + 1, dtype=np.int64)
        return rows

    def run(
        self,
        batch: ForwardBatch,
        sampling: list[Sequence],
        prompt_rows: PromptRows | None = None,
        masks: TokenMasks | None = None,
        drafts: Drafts | None = None,
    ) -> SampleResult:
        """Forward pass and sampling; ``sampling`` lists the plain sampling sequences in
        logits-row order, and ``prompt_rows`` the rows after theirs. ``masks``: the grammar masks
        of the constrained rows, being computed while the model runs (engine/grammar.py).
        ``drafts``: the verifying sequences, whose rows are among the sampling ones.

        No ``torch.inference_mode()`` here: the torch models enter it in their own ``forward``
        (the runtime calls this from a worker thread, and the mode is per thread), and what
        follows the forward is numpy."""
        logits = host_logits(self.model.forward(batch, self.kv_cache.k, self.kv_cache.v))
        num_rows = len(sampling)
        if drafts is None:
            result = (sample(logits[:num_rows], sampling, masks, rng=self.rng) if sampling
                      else SampleResult([], []))
        else:
            num_rows += sum(len(d) + 1 for d in drafts.tokens)
            plain = logits[drafts.plain_rows]  # a copy: the sampler's changes stay out of verify's
            result = (sample(plain, sampling, masks, rng=self.rng) if sampling
                      else SampleResult([], []))
            result.verified.extend(verify(logits[:num_rows], drafts, self.rng))
        if prompt_rows is not None:
            result.prompt_logprobs.extend(prompt_logprobs(
                logits[num_rows:], prompt_rows.targets, prompt_rows.top_k
            ))
        return result
