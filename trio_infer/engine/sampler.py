"""Batched sampling with per-request parameters, on numpy arrays.

Numpy, not torch: the batching worker is to run without importing torch (torch alone is ~220 MiB
of resident memory), so nothing on the sampling path may need it. The logits arrive as a host
float32 array (``model_runner.host_logits``). On the CPU that is the model's output itself, no
copy. A model on a GPU pays for it: its logits rows (only the rows that sample or give prompt
logprobs) are copied to the host every step, 4 bytes per vocabulary entry per row (6.3 MB for 32
rows of a 49k vocabulary) behind a device synchronisation, and the sampling then runs on the
host's cores instead of the GPU's.

All work is array work over the whole batch; Python loops run only over rows (those that need
something special: penalties, logprobs; and the random rows' noise, one row at a time into one
buffer that stays in the cache), never over the vocabulary. A batch of greedy rows with nothing
special (the common step) costs one ``np.argmax`` over the logits: the first maximum of each row
(a NaN counts as the maximum), the tokens torch's argmax gave.

Sampling draws ``argmax(p / E)`` with ``E ~ Exp(1)`` per vocabulary entry, which picks token ``i``
with probability ``p_i``. Its appeal here: a seeded request draws its noise from its own
``np.random.Generator`` (``Sequence.generator``), one draw per vocabulary entry in vocabulary
order, so its tokens depend only on its seed and its logits, never on which other requests share
the batch. The other random rows draw from the generator the caller owns and passes in
(``ModelRunner.rng``): there is no module-level RNG (no global mutable state).

Truncation (top-k, top-p, min-p) keeps a prefix of the row's tokens in the stable descending
order of their logits (ties: the lower token id first), the order of
``np.argsort(-logits, kind="stable")``, without sorting the ids (such an argsort cost 5 ms a 49k
row here): the sorted values, of a row's largest ``max(top_k)`` or ``_WINDOW`` logits first (a
partition), give the length of the kept prefix and the logit at its end, and a comparison with
that logit picks the tokens (:func:`_truncate`).

Measured on 32 rows of a 49152-entry vocabulary (a 2-core Zen 3, torch at 2 threads, ``timeit``
of the call and a copy of the logits, the torch sampler this replaced in the same process):
temperature 0.8 took 38 ms with torch, 13 ms here; top-k 50 and top-p 0.9, 107 ms and 18 ms;
top-p 0.9 alone or min-p 0.05 alone, 107 ms and 18 ms; greedy, 0.47 ms and 0.37 ms.

Logprobs are those of the model's distribution after penalties, before temperature and
truncation (what vLLM reports by default), a log-softmax in float32 (the row's maximum
subtracted first). The top alternatives come by logprob, descending; equal logprobs, the lower
token id first. Prompt logprobs are the model's raw distribution.

A constrained row (a grammar, ``engine/grammar.py``) has every token its grammar forbids set to
-inf after the penalties and before anything else: its logprobs are those of the constrained
distribution (as vLLM's), so the chosen token's is always finite. Other rows are untouched, so an
unconstrained request samples the same tokens whoever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

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


def prompt_logprobs(logits: np.ndarray, targets: list[int], top_k: list[int]) -> list[TokenLogprob]:
    """logits: [R, V] float32, row r scores prompt token ``targets[r]`` with ``top_k[r]``
    alternatives (by logprob, descending; equal logprobs: the lower token id first)."""
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), _PROMPT_SLICE):
        hi = min(lo + _PROMPT_SLICE, len(targets))
        lps = _log_softmax(logits[lo:hi])
        chosen = lps[np.arange(hi - lo), targets[lo:hi]].tolist()
        tops = _top(lps, top_k[lo:hi])
        for r in range(hi - lo):
            out.append(TokenLogprob(targets[lo + r], chosen[r], tops[r]))
    return out


def argmax_ids(logits: np.ndarray) -> list[int]:
    """The index of each row's largest logit as a list: the first on a tie; a NaN counts as the
    maximum (numpy's argmax, as torch's did)."""
    return np.argmax(logits, axis=-1).tolist()


def sample(logits: np.ndarray, seqs: list[Sequence], masks: TokenMasks | None = None, *,
           rng: np.random.Generator) -> SampleResult:
    """logits: [N, V] float32, row i for ``seqs[i]``. May modify ``logits`` in place. ``masks``:
    the grammar masks of the constrained rows. ``rng``: the caller's generator, which the random
    rows without a seed of their own draw from (a seeded row draws only from its
    ``seq.generator``)."""
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
    logprobs = _log_softmax(logits[lp_rows]) if lp_rows else None

    token_ids = argmax_ids(logits)
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        rows = logits if len(random_rows) == len(seqs) else logits[random_rows]  # (a copy)
        drawn = _sample_random(rows, [seqs[i] for i in random_rows], rng)
        for i, token in zip(random_rows, drawn):
            token_ids[i] = token

    out_lps: list[TokenLogprob | None] = [None] * len(seqs)
    if logprobs is not None:
        tops = _top(logprobs, [seqs[i].params.logprobs or 0 for i in lp_rows])
        for j, i in enumerate(lp_rows):
            out_lps[i] = TokenLogprob(
                token_id=token_ids[i],
                logprob=float(logprobs[j, token_ids[i]]),
                top=tops[j],
            )
    return SampleResult(token_ids, out_lps)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float32, stably: the row's maximum subtracted before the exp."""
    y = x - x.max(axis=-1, keepdims=True)
    y -= np.log(np.exp(y).sum(axis=-1, keepdims=True))
    return y


def _top(lps: np.ndarray, ks: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """Row r's ``ks[r]`` largest entries of ``lps`` [R, V] as (token id, value) pairs, by value
    descending; equal values: the lower token id first (``torch.topk`` left that order
    unspecified). One partition over the rows (no full sort of the vocabulary); a row whose cut
    falls among equal values is redone exactly on its own."""
    k = min(max(ks, default=0), lps.shape[-1])
    if not k:
        return [()] * len(ks)
    vocab = lps.shape[-1]
    if k < vocab:
        ids = np.argpartition(lps, vocab - k, axis=-1)[:, vocab - k :]  # the k largest, unordered
    else:
        ids = np.broadcast_to(np.arange(vocab), lps.shape)
    vals = np.take_along_axis(lps, ids, axis=-1)
    order = np.lexsort((ids, -vals), axis=-1)  # value descending, then the lower id
    ids = np.take_along_axis(ids, order, axis=-1)
    vals = np.take_along_axis(vals, order, axis=-1)
    # The partition chose among equal values at the cut arbitrarily: where a token left out equals
    # the k-th value, the row is taken again: the larger values, then the equal ones by id.
    cut = vals[:, k - 1 : k]
    ties = np.flatnonzero((lps >= cut).sum(axis=-1) > k) if k < vocab else ()
    out_ids, out_vals = ids.tolist(), vals.tolist()
    for r in ties:
        row, c = lps[r], cut[r, 0]
        above = np.flatnonzero(row > c)
        above = above[np.argsort(-row[above], kind="stable")]
        chosen = np.concatenate([above, np.flatnonzero(row == c)[: k - len(above)]])
        out_ids[r], out_vals[r] = chosen.tolist(), row[chosen].tolist()
    return [tuple(zip(out_ids[r][: ks[r]], out_vals[r][: ks[r]])) if ks[r] else ()
            for r in range(len(ks))]


def _adjust(row: np.ndarray, seq: Sequence, p: Any, vocab: int) -> None:
    """One row's logits changed in place by its sequence's penalties and ``logit_bias`` (in
    that order, as vLLM applies them), before the grammar's mask. Touches only the tokens
    concerned (the others' logits would change by nothing)."""
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.clip(np.asarray(seq.token_ids, dtype=np.int64), 0, vocab - 1))
        x = row[seen]
        row[seen] = np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if p.penalized and seq.num_output_tokens:
        ids, counts = np.unique(np.asarray(seq.output_ids, dtype=np.int64), return_counts=True)
        inside = ids < vocab
        ids, counts = ids[inside], counts[inside].astype(row.dtype)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty  # float32, as torch's
    if p.logit_bias:
        ids = np.array([t for t, _ in p.logit_bias if t < vocab], dtype=np.int64)
        bias = np.array([b for t, b in p.logit_bias if t < vocab], dtype=row.dtype)
        np.add.at(row, ids, bias)  # a token listed twice gets both


def _restrict(row: np.ndarray, seq: Sequence, p: Any) -> None:
    """One row's tokens restricted in place, after the grammar's mask: no EOS or stop token
    before ``min_tokens``, only the close tag past the thinking budget. A restriction that would
    leave no token at all (the grammar allows nothing else) is not applied: the grammar wins."""
    if p.min_tokens and seq.num_output_tokens < p.min_tokens and seq.min_tokens_block:
        block = list(seq.min_tokens_block)
        kept = row[block]  # a copy (fancy indexing)
        row[block] = -np.inf
        if not np.isfinite(row).any():
            row[block] = kept
    if p.thinking_budget is not None and _thought(seq, p) >= p.thinking_budget:
        close = p.think_ids[1]
        keep = row[close]
        if keep != -np.inf:
            row.fill(-np.inf)
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


def probabilities(logits: np.ndarray, params: Any) -> np.ndarray:
    """The distribution a random (not greedy) row samples from, [N, V] float32 in vocabulary
    order, for rows that share ``params``: temperature, then top-k, top-p and min-p truncation,
    exactly as :func:`_sample_random` draws (speculative verification, engine/speculative.py).
    Leaves ``logits`` alone."""
    x = logits / params.temperature  # float32: numpy casts a Python float to the array's type
    weights, top, total = _softmax_parts(x)
    if params.top_k or params.top_p < 1 or params.min_p:
        n = len(x)
        _truncate(x, weights, top, total, np.full(n, params.top_k),
                  np.full(n, params.top_p, np.float32), np.full(n, params.min_p, np.float32))
        total = weights.sum(axis=-1, keepdims=True)
    weights /= total
    return weights


def _softmax_parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-wise ``exp(x - max)`` of ``x`` [R, V] float32 (the softmax before its division: the
    draw ``argmax(p / E)`` does not need it), with the rows' maxima and sums, [R, 1] each."""
    top = x.max(axis=-1, keepdims=True)
    weights = np.exp(x - top)
    return weights, top, weights.sum(axis=-1, keepdims=True)


# Truncation first looks for the end of a row's kept prefix among its this many largest logits
# (a partition and a sort of those), and sorts the whole row only when it is not there (a wide
# top-p: a flat distribution).
_WINDOW = 1024


def _truncate(x: np.ndarray, weights: np.ndarray, top: np.ndarray, total: np.ndarray,
              top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> None:
    """Set to 0 in ``weights`` (from :func:`_softmax_parts` of ``x`` [R, V], with its ``top``
    and ``total``) every token that top-k, top-p or min-p drops, per row (``top_k`` 0: none;
    ``top_p`` and ``min_p`` float32).

    The rules, in the stable descending order of the logits (``np.argsort(-x, kind="stable")``:
    ties, the lower id first), on the softmax probabilities in that order: a token is dropped
    when its rank is ``top_k`` or more, when the probability before it (a cumulative sum,
    accumulated in float64 as torch's CPU cumsum did, then float32) exceeds ``top_p`` (so the
    best token always stays), or when its probability is below ``min_p`` times the best one's.
    Each rule drops a suffix of that order, so what stays is a prefix, whose length the sorted
    logits alone give (:func:`_kept_prefix`), without sorting the ids: the kept tokens are those
    whose logit is above the prefix's last, and of those equal to it the lowest ids, as many as
    the prefix still holds."""
    n, vocab = x.shape
    top_k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
    length, last, more = _kept_prefix(x, top, total, top_k, top_p, min_p, min(int(top_k.max()), _WINDOW))
    if more.any():  # the prefix goes on past the window: those rows sorted whole
        wide = np.flatnonzero(more)
        length[wide], last[wide], _ = _kept_prefix(
            x[wide], top[wide], total[wide], top_k[wide], top_p[wide], min_p[wide],
            int(top_k[wide].max()))
    kept = x >= last
    for r in np.flatnonzero(kept.sum(axis=-1) > length):  # ties at the cut: the lower ids stay
        equal = np.flatnonzero(x[r] == last[r, 0])
        kept[r, equal[length[r] - (kept[r].sum() - len(equal)) :]] = False
    weights *= kept


def _kept_prefix(x: np.ndarray, top: np.ndarray, total: np.ndarray, top_k: np.ndarray,
                 top_p: np.ndarray, min_p: np.ndarray,
                 width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_truncate`'s kept prefix, looked for among each row's ``width`` largest logits:
    its length [R], the logit at its end [R, 1], and whether it may go on past them [R] (then
    the other two are not the answer)."""
    n, vocab = x.shape
    values = np.partition(x, vocab - width, axis=-1)[:, vocab - width :] if width < vocab else x
    values = np.sort(values, axis=-1)[:, ::-1]  # the largest `width` logits, descending
    probs = np.exp(values - top)
    probs /= total
    before = np.cumsum(probs, axis=-1, dtype=np.float64).astype(np.float32)
    before -= probs
    keep = np.arange(width)[None, :] < top_k[:, None]
    keep &= before <= top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    length = keep.sum(axis=-1)  # at least the best token
    last = values[np.arange(n), length - 1][:, None]
    return length, last, keep[:, -1] & (top_k > width)


def _sample_random(x: np.ndarray, seqs: list[Sequence], rng: np.random.Generator) -> list[int]:
    """The token of each row of ``x`` [R, V] float32 (the logits of the random sequences
    ``seqs``, changed in place): ``argmax(p / E)`` with ``p`` the row's tempered, truncated
    distribution and ``E`` Exp(1) noise per vocabulary entry, drawn from the sequence's own
    generator if it has one, else from ``rng``."""
    params = [s.params for s in seqs]
    x /= np.array([p.temperature for p in params], dtype=np.float32)[:, None]
    top = x.max(axis=-1, keepdims=True)

    # Only the rows that truncate (a row is sampled the same whoever shares its batch).
    cut = [i for i, p in enumerate(params) if p.top_k or p.top_p < 1 or p.min_p]
    every = len(cut) == len(params)
    if cut:
        xc = x if every else x[cut]
        wc = np.exp(xc - top[cut])
        _truncate(xc, wc, top[cut], wc.sum(axis=-1, keepdims=True),
                  np.array([params[i].top_k for i in cut]),
                  np.array([params[i].top_p for i in cut], dtype=np.float32),
                  np.array([params[i].min_p for i in cut], dtype=np.float32))
    if every:
        weights = wc
    else:  # x becomes its rows' exp(x - max), in place, and takes the truncated rows
        weights = np.exp(np.subtract(x, top, out=x), out=x)
        if cut:
            weights[cut] = wc

    # One row at a time, into one buffer that stays in the cache (the whole [R, V] float64 noise
    # at once cost a third more here, much of it page faults). float64 noise: numpy's float32
    # exponential is 0 once in ~8M draws (then p / E is inf, or NaN where p is 0); float64's
    # once in 2**53.
    buf = np.empty(x.shape[-1], dtype=np.float64)
    tokens: list[int] = []
    for i, s in enumerate(seqs):
        (rng if s.generator is None else s.generator).standard_exponential(out=buf)
        scores = np.divide(weights[i], buf, out=buf)
        token = int(scores.argmax())
        if not weights[i, token] > 0:
            # A zero draw where p is 0 made a NaN, which argmax takes: ignore the NaNs (a dropped
            # or forbidden token never wins). Practically never.
            token = int(np.nan_to_num(scores, nan=0.0).argmax())
        tokens.append(token)
    return tokens
