"""Batched sampling with per-request parameters.

All work is tensor work over the whole batch; Python loops run only over the rows that need
something special (penalties, a seed), never over the vocabulary. A batch of greedy rows with
nothing special (the common step) costs one argmax over the logits, taken by numpy on the CPU:
torch's CPU argmax is not vectorised and took ~85 us a 49k-entry row (4.2 ms for 32 rows, more
than the whole Python of such a step), numpy's ~4 us (0.25 ms), with the same result (the first
maximum; a NaN counts as the maximum in both).

Sampling draws ``argmax(p / E)`` with ``E ~ Exp(1)`` per vocabulary entry, which picks token ``i``
with probability ``p_i``. Its appeal here: a seeded request draws its noise from its own
``torch.Generator``, so its tokens depend only on its seed and its logits, never on which other
requests share the batch.

Logprobs are those of the model's distribution after penalties, before temperature and
truncation (what vLLM reports by default). Prompt logprobs are the model's raw distribution.

A constrained row (a grammar, ``engine/grammar.py``) has every token its grammar forbids set to
-inf after the penalties and before anything else: its logprobs are those of the constrained
distribution (as vLLM's), so the chosen token's is always finite. Other rows are untouched, so an
unconstrained request samples the same tokens whoever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trio_infer.engine.grammar import TokenMasks
from trio_infer.engine.sequence import Sequence
from trio_infer.wire import TokenLogprob


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per prompt row
    # Per verifying sequence (engine/speculative.py), the tokens it emits: kept drafts, then one.
    verified: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0  # the forward pass and sampling (Engine.execute), for speculative.Payoff


# Prompt rows are scored this many at a time: a [rows, vocab] fp32 log-softmax per slice, not
# one for the whole chunk.
_PROMPT_SLICE = 64


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top_k: list[int]) -> list[TokenLogprob]:
    """logits: [R, V], row r scores prompt token ``targets[r]`` with ``top_k[r]`` alternatives."""
    out: list[TokenLogprob] = []
    device = logits.device
    for lo in range(0, len(targets), _PROMPT_SLICE):
        hi = min(lo + _PROMPT_SLICE, len(targets))
        lps = torch.log_softmax(logits[lo:hi].float(), dim=-1)
        ids = torch.tensor(targets[lo:hi], dtype=torch.int64, device=device)
        chosen = lps.gather(1, ids[:, None])[:, 0].tolist()
        k = max(top_k[lo:hi])
        if k:
            top = torch.topk(lps, k, dim=-1)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        for r in range(hi - lo):
            kr = top_k[lo + r]
            alts = tuple(zip(top_ids[r][:kr], top_lps[r][:kr])) if kr else ()
            out.append(TokenLogprob(targets[lo + r], chosen[r], alts))
    return out


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest logit (the first on a tie), as a list."""
    return _argmax_rows(logits).tolist()


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a [N, V] tensor: through numpy for CPU fp32 (vectorised, ~20x
    torch's CPU argmax), through torch elsewhere."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks | None = None) -> SampleResult:
    """logits: [N, V] fp32, row i for ``seqs[i]``. May modify ``logits`` in place. ``masks``:
    the grammar masks of the constrained rows."""
    # The rows whose sampling reads more than their logits (Sequence.plain_sampling is False):
    # penalties, logit_bias, min_tokens, a thinking budget, logprobs. Most steps have none.
    special = [i for i, s in enumerate(seqs) if not s.plain_sampling]
    vocab = logits.shape[-1]

    for i in special:
        if seqs[i].params.adjusted:
            _adjust(logits[i], seqs[i], seqs[i].params, vocab)

    if masks is not None:
        masks.apply(logits)

    for i in special:
        p = seqs[i].params
        if p.min_tokens or p.thinking_budget is not None:
            _restrict(logits[i], seqs[i], p)

    lp_rows = [i for i in special if seqs[i].params.logprobs is not None]
    logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None

    token_ids = argmax_ids(logits)
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        drawn = _sample_random(logits[random_rows], [seqs[i] for i in random_rows]).tolist()
        for i, token in zip(random_rows, drawn):
            token_ids[i] = token

    out_lps: list[TokenLogprob | None] = [None] * len(seqs)
    if logprobs is not None:
        for j, i in enumerate(lp_rows):
            k = seqs[i].params.logprobs or 0
            top = torch.topk(logprobs[j], k) if k else None
            out_lps[i] = TokenLogprob(
                token_id=token_ids[i],
                logprob=float(logprobs[j, token_ids[i]]),
                top=tuple(zip(top.indices.tolist(), top.values.tolist())) if top else (),
            )
    return SampleResult(token_ids, out_lps)


def _adjust(row: torch.Tensor, seq: Sequence, p: Any, vocab: int) -> None:
    """One row's logits changed in place by its sequence's penalties and ``logit_bias`` (in
    that order, as vLLM applies them), before the grammar's mask."""
    device = row.device
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(seq.token_ids, device=device).clamp_(0, vocab - 1)] = True
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalized, row))
    if p.penalized and seq.num_output_tokens:
        out = torch.tensor(seq.output_ids, device=device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.int64, device=device)
        bias = torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=row.dtype, device=device)
        row.index_add_(0, ids, bias)


def _restrict(row: torch.Tensor, seq: Sequence, p: Any) -> None:
    """One row's tokens restricted in place, after the grammar's mask: no EOS or stop token
    before ``min_tokens``, only the close tag past the thinking budget. A restriction that would
    leave no token at all (the grammar allows nothing else) is not applied: the grammar wins."""
    if p.min_tokens and seq.num_output_tokens < p.min_tokens and seq.min_tokens_block:
        block = list(seq.min_tokens_block)
        kept = row[block].clone()
        row[block] = float("-inf")
        if not torch.isfinite(row).any():
            row[block] = kept
    if p.thinking_budget is not None and _thought(seq, p) >= p.thinking_budget:
        close = p.think_ids[1]
        keep = row[close].item()
        if keep != float("-inf"):
            row.fill_(float("-inf"))
            row[close] = keep


def _thought(seq: Sequence, p: Any) -> int:
    """Tokens ``seq`` has thought since its last open tag, or -1 when it is not thinking (reads
    only the tokens added since the last call: the prompt once, then one token a step)."""
    open_id, close_id = p.think_ids
    count = seq.think_count
    ids = seq.token_ids
    for k in range(seq.think_read, len(ids)):
        t = ids[k]
        if t == open_id:
            count = 0
        elif t == close_id:
            count = None
        elif count is not None and k >= seq.num_prompt_tokens:
            count += 1
    seq.think_read, seq.think_count = len(ids), count
    return -1 if count is None else count


def probabilities(logits: torch.Tensor, params: Any) -> torch.Tensor:
    """The distribution a random (not greedy) row samples from, [N, V] in vocabulary order, for
    rows that share ``params``: temperature, then top-k, top-p and min-p truncation, exactly as
    :func:`_sample_random` draws (speculative verification, engine/speculative.py)."""
    logits = logits / params.temperature
    if not (params.top_k or params.top_p < 1 or params.min_p):
        return torch.softmax(logits, dim=-1)
    logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(logits, dim=-1)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= (params.top_k or vocab)
    drop = drop | ((probs.cumsum(dim=-1) - probs) > params.top_p)
    drop |= probs < params.min_p * probs[:, :1]
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.empty_like(probs).scatter_(1, order, probs)


def _sample_random(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    params = [s.params for s in seqs]
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps[:, None]

    truncate = any(p.top_k or p.top_p < 1 or p.min_p for p in params)
    if truncate:
        logits, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(logits, dim=-1)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        drop = ranks >= top_k[:, None]
        drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]  # keeps at least the best token
        drop |= probs < min_p[:, None] * probs[:, :1]
        probs = probs.masked_fill(drop, 0.0)
    else:
        probs = torch.softmax(logits, dim=-1)

    noise = torch.empty_like(probs).exponential_()
    for i, seq in enumerate(seqs):
        if seq.generator is not None:
            noise[i].exponential_(generator=seq.generator)
    choice = _argmax_rows(probs / noise)
    return order.gather(1, choice[:, None])[:, 0] if truncate else choice
