"""A deterministic stand-in for a real model: instant, and its output known in advance.

The next token is a pure function of the sequence so far (:func:`expected_next_token`), so a test
can compute every request's expected output without running anything. The function is computed
*from the KV cache*: each step stores per-token values into the pages and reads the sequence's
whole context back through its page table. A paging bug (a wrong slot, a page freed while in use,
a page shared by mistake) therefore shows up as a wrong token, not as nothing.

Everything else (scheduler, allocator, runtime, HTTP) runs unchanged on top of it.
"""

from __future__ import annotations

import math
import time

import torch

from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.models.base import ModelInfo

_MOD = 65521  # prime; per-token terms stay exact in float64 for any realistic context


def expected_next_token(token_ids: list[int], vocab_size: int, eos_token_id: int) -> int:
    """The token the fake model produces after ``token_ids``. Never ``eos_token_id`` unless
    the hash lands on it, which happens about once per ``vocab_size`` tokens."""
    acc = sum((t * (i + 1)) % _MOD for i, t in enumerate(token_ids))
    return (acc * 31 + 7 * len(token_ids)) % vocab_size


# The logits: 1 on the expected token, 0 elsewhere, except EOS, which is far below everything
# (exp(-1000) is 0 in float32) unless it is the expected token. Greedy decoding gives the expected
# tokens; sampling (the API's default temperature is 1) gives nearly uniform text, so choices and
# seeds differ as they should, but it never meets EOS by chance: a test that leaves sampling at
# its defaults still knows how many tokens it gets. (With EOS at 0 like the rest, such a request
# met EOS about once in 500 tokens, and tests ended early at random.)
_EOS_FLOOR = -1000.0


def logprob(token_ids: list[int], token: int, vocab_size: int, eos_token_id: int) -> float:
    """The fake model's logprob of ``token`` after ``token_ids`` (before any temperature)."""
    best = expected_next_token(token_ids, vocab_size, eos_token_id)
    if best == eos_token_id:
        norm = math.log(math.e + vocab_size - 1)
    else:
        norm = math.log(math.e + vocab_size - 2 + math.exp(_EOS_FLOOR))
    logit = 1.0 if token == best else _EOS_FLOOR if token == eos_token_id else 0.0
    return logit - norm


class FakeModel:
    """Implements :class:`~trio_infer.models.base.CausalLM` with one KV head of one float64."""

    def __init__(
        self,
        vocab_size: int = 512,
        max_model_len: int = 4096,
        eos_token_id: int = 0,
        name: str = "fake",
        step_s: float = 0.0,
    ) -> None:
        self.info = ModelInfo(
            name=name,
            architecture="FakeModel",
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            dtype=torch.float64,
            eos_token_ids=(eos_token_id,),
        )
        self.eos_token_id = eos_token_id
        # With a simulated step time each forward takes step_s of wall time (a sleep, which holds
        # no GIL, like a torch forward) and the runtime runs it in its worker thread; without one
        # the model is instant and the runtime may run its steps inline.
        self.step_s = step_s
        self.instant = step_s == 0
        self._next_tick: float | None = None

    def next_token(self, token_ids: list[int]) -> int:
        return expected_next_token(token_ids, self.info.vocab_size, self.eos_token_id)

    def forward(
        self, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        # In inference mode, as the real models' forward (the model runner does not enter it:
        # its sampling is numpy).
        with torch.inference_mode():
            logits = self._forward(batch, k_caches[0])
        if self.step_s > 0:
            # Steps on a cadence of step_s (like a null engine's tick), not step_s on top of the
            # engine's own work: the simulated step includes scheduling and committing, as long as
            # they fit in it. After an idle spell the cadence starts again from now.
            now = time.perf_counter()
            if self._next_tick is None or now > self._next_tick + self.step_s:
                self._next_tick = now
            self._next_tick += self.step_s
            time.sleep(max(0.0, self._next_tick - now))
        return logits

    def _forward(self, batch: ForwardBatch, k_cache: torch.Tensor) -> torch.Tensor:
        page_size = k_cache.shape[1]
        flat = k_cache.view(-1)
        terms = (batch.input_ids * (batch.positions + 1)) % _MOD
        flat.index_copy_(0, batch.slot_mapping, terms.to(torch.float64))

        # Which sequence each logits row belongs to, and its context: the tokens up to the row's
        # own (the sequence's whole context for a sampling row; less for a prompt-logprob row),
        # read back through the page table whole pages at a time (one gather of each row's pages,
        # not one index per token: the same values, summed exactly in float64, a third of the
        # step's cost at 256 sequences before). Slots past a row's length (the rest of its last
        # page, the table's padding) are masked out; the cache holds only finite values (zeros,
        # or terms written here).
        if batch.num_decodes == len(batch.input_ids):
            # Every row one token (decodes, drafts): query_start_loc is 0..T, so a logits row's
            # sequence is the row itself. (searchsorted, exact here too, was ~15% of the worker's
            # samples at 256 sequences in the server, where torch runs it on every core.)
            seq_of_row = batch.logits_indices
        else:
            seq_of_row = torch.searchsorted(batch.query_start_loc, batch.logits_indices, right=True) - 1
        lens = batch.positions[batch.logits_indices] + 1
        num_pages = -(-int(lens.max()) // page_size) if len(lens) else 0
        table = batch.page_table[seq_of_row, :num_pages]
        context = flat.view(-1, page_size)[table].reshape(len(lens), num_pages * page_size)
        valid = torch.arange(num_pages * page_size)[None, :] < lens[:, None]
        acc = (context * valid).sum(dim=1).to(torch.int64)
        next_ids = (acc * 31 + 7 * lens) % self.info.vocab_size

        logits = torch.zeros(len(next_ids), self.info.vocab_size, dtype=torch.float32)
        logits[:, self.eos_token_id] = _EOS_FLOOR
        logits[torch.arange(len(next_ids)), next_ids] = 1.0
        return logits
