"""Speculative decoding by prompt lookup: guess a sequence's next tokens, check them in one step.

At batch 1 on a CPU a decode step reads every weight once for one token; checking a few guessed
tokens in the same forward costs little more. Prompt lookup guesses for free: summaries,
rewrites, code edits and retrieval answers copy spans of their prompt, so the tokens that
followed the latest earlier occurrence of the sequence's last ``n`` tokens are a good guess for
the ones that come next (longest match first, from ``speculative_ngram`` down to
``speculative_ngram_min`` tokens: a one-token match guesses wrong about half the time on the
grounded workload, a two-token one about a fifth; and of its occurrences the one that agrees
with the sequence for longest: measured with ``bench offline --speculative ngram --workload
grounded``).

What guesses is a sequence's :class:`~trio_infer.engine.proposer.Proposer`: :class:`PromptLookup` here, or a draft model
(engine/draft.py: a smaller model with the same vocabulary, in a KV cache of its own, greedy,
so its draft is a point mass too and everything below holds for it unchanged). Both share the
off-switches and the adaptive draft length of the base class.

The engine verifies a sequence's draft ``d_1..d_k`` as ``k + 1`` one-token rows of the decode
group of the step (positions ``start .. start + k``, each attending to the rows before it: every
row's key is stored before any row attends), so the verify forward is the same decode step as
any other: the one-call C step on the CPU kernels. Row ``j`` gives the model's distribution
after ``d_1..d_j``:

- a greedy sequence keeps the drafts while each is the argmax of its row, then takes the argmax
  of the first row it disagrees with (or of the last row): exactly the tokens decoding one at a
  time would pick, as long as the forward gives the same logits for a row whoever shares the
  step: on the CPU kernels, bitwise with ``activations=int8``, and with ``exact`` (the default)
  at any step size for weights in GGUF blocks (read in 16-row groups, each row summed as the
  one-row kernel sums it) and for steps of up to 5 rows for 16-bit float weights (the few-rows
  kernel); wider steps of 16-bit float weights take the tiles, whose sums run in another order,
  so there a near-tie of the top two logits can differ (docs/architecture.md);
- a sampled sequence keeps draft ``d_j`` with probability ``p_j(d_j)`` (the draft is a point
  mass, so this is the rejection sampling rule ``min(1, p/q)``) and on the first rejection
  draws from ``p_j`` without ``d_j``, renormalised; if every draft is kept it draws one more
  token from the last row. The output has the distribution of sampling one token at a time.

Rejected positions' keys and values stay in the sequence's pages and are overwritten by the next
step; the sequence's ``num_computed`` counts only the kept ones, so the prefix cache records only
pages of kept tokens.

The off-switch: a step with more running sequences than ``speculative_max_batch`` proposes
nothing (the batch is already wide: the weights are read once for many tokens), and a sequence
whose recent acceptance falls below ``speculative_min_acceptance`` stops proposing for a while.
Whether speculation pays depends on the machine and the kernels, so the engine also measures it
(``speculative_payoff``, :class:`Payoff`): the seconds per emitted token of its decode steps
that verified drafts against those that did not, per batch size; when drafting is slower it
pauses for a while, then measures again.
Checking a row is not free on a CPU (each row of a step multiplies every weight: measured on
SmolLM2-135M at one thread, 2 rows cost 1.36x one with int8 activations, 5 rows 2.8x; at two
threads about 1.25x and 2x with exact ones), so a sequence's draft length adapts: one token
more after a draft it kept whole (up to ``speculative_tokens``), one less after a draft it cut
(down to 1). With prompt lookup only a long match (a copy in progress) drafts the full
``speculative_tokens``; short ones adapt below it (:class:`PromptLookup`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from trio_infer.engine.proposer import Proposer
from trio_infer.engine.sampler import argmax_ids, probabilities

if TYPE_CHECKING:
    from trio_infer.engine.sequence import Sequence

# A prompt-lookup match that agrees with the sequence's suffix for this many tokens at least is
# a copy in progress: it drafts all k tokens (PromptLookup).
LONG_MATCH = 6
# Prompt lookup compares the suffix with at most this many of an n-gram's latest occurrences,
# each for at most MAX_AGREEMENT tokens back.
MAX_OCCURRENCES = 16
MAX_AGREEMENT = 32


class PromptLookup(Proposer):
    """One sequence's n-gram index over its own tokens (prompt and output), kept up to date as
    tokens are appended.

    ``_index[m - 1]`` maps each m-gram that has a token after it to the positions of that token,
    one per occurrence, oldest first; the sequence's current last m tokens are indexed only once
    a token follows them, so a lookup never finds the suffix itself.

    Of the occurrences of the longest n-gram that matches, the guess copies after the one whose
    agreement with the sequence's suffix reaches furthest back (the latest among equals): a
    rewrite that is copying a sentence agrees with that sentence for many tokens, while a common
    pair such as ``", the"`` occurs all over the prompt. A match that agrees for at least
    ``LONG_MATCH`` tokens is a copy in progress and drafts all ``k`` tokens; a shorter one drafts
    the adapted length, at most ``k - 1`` (on the grounded workload a short match guesses wrong
    about a third of the time, a long one rarely: ``bench offline --speculative ngram``). The
    acceptance off-switch holds short matches off; a long one drafts through it.
    """

    def __init__(self, max_ngram: int, num_tokens: int, min_acceptance: float,
                 min_ngram: int = 1) -> None:
        super().__init__(num_tokens, min_acceptance)
        self.max_ngram = max_ngram
        self.min_ngram = min(min_ngram, max_ngram)
        self._short = max(1, num_tokens - 1)  # what a short match drafts at most
        self._length = self._short
        self._index: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram)]
        self._indexed = 0  # positions whose following token is indexed: [0, _indexed)

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` tokens guessed to follow ``token_ids``; [] when no n-gram of
        the suffix occurred before, or while the off-switch holds this sequence (unless the
        match is long)."""
        self._extend(token_ids)
        cooling = self._cooldown > 0
        length = self._draft_length(limit)
        if limit <= 0:
            return []
        n = len(token_ids)
        for m in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            found = self._index[m - 1].get(tuple(token_ids[n - m :]))
            if found is None:
                continue
            best, agree = found[-1], -1
            for nxt in reversed(found[-MAX_OCCURRENCES:]):
                a = _agreement(token_ids, nxt, m)
                if a > agree:
                    best, agree = nxt, a
            if agree >= LONG_MATCH:
                length = min(limit, self.num_tokens)
            elif cooling:
                return []
            return token_ids[best : best + length]
        return []

    def record(self, proposed: int, accepted: int) -> None:
        """As :meth:`Proposer.record`, but the adapted length (the short matches') stays below
        k, which only a long match drafts."""
        super().record(proposed, accepted)
        self._length = min(self._length, self._short)

    def _extend(self, token_ids: list[int]) -> None:
        # Index every m-gram ending at position i - 1, followed by token i, for the new i.
        for i in range(max(self._indexed, 1), len(token_ids)):
            for m in range(1, min(self.max_ngram, i) + 1):
                self._index[m - 1].setdefault(tuple(token_ids[i - m : i]), []).append(i)
        self._indexed = max(self._indexed, len(token_ids))


def _agreement(token_ids: list[int], nxt: int, m: int) -> int:
    """How many tokens before position ``nxt`` agree with the end of ``token_ids`` (at least the
    ``m`` of the n-gram that matched; counted up to ``MAX_AGREEMENT``)."""
    n = len(token_ids)
    a = m
    while a < MAX_AGREEMENT and a < nxt and token_ids[nxt - 1 - a] == token_ids[n - 1 - a]:
        a += 1
    return a


class Payoff:
    """Whether verify steps emit tokens faster than plain decode steps, measured.

    The engine reports every decode-only step (no prefill chunk in it): how many sequences, its
    forward-and-sample seconds, the tokens it emitted, and whether it verified drafts. Each kind
    keeps running averages of its steps' seconds and of their tokens per batch size, and its
    seconds per token is the one over the other: the rate at which its steps emit tokens. (Not
    the average of each step's seconds per token: a verify step that keeps nothing, one token
    for its rows, would weigh as much as one that keeps four, and drafting would look slower
    than it runs.) Once both have ``min_samples`` steps and drafting is the slower,
    :meth:`allows` says no for ``pause`` steps, and the drafting averages start again (the
    machine's load may have changed).
    Drafting that has ``min_samples`` steps while plain decoding at that batch size has fewer
    (a draft model drafts at every step: no plain step would ever be measured) says no for as
    many steps as plain decoding lacks, so that both get measured (``probes`` counts those).
    """

    def __init__(self, min_samples: int = 16, pause: int = 64, weight: float = 0.1) -> None:
        self.min_samples = min_samples
        self.pause = pause
        self.weight = weight
        # (drafted, batch) -> running averages of a step's seconds and of its tokens
        self._seconds: dict[tuple[bool, int], float] = {}
        self._tokens: dict[tuple[bool, int], float] = {}
        self._count: dict[tuple[bool, int], int] = {}
        self._paused = 0
        self.pauses = 0  # times drafting was found slower, since start
        self.probes = 0  # times drafting paused so that plain steps could be measured

    def allows(self) -> bool:
        """Whether this step may draft (counts the paused steps down)."""
        if self._paused:
            self._paused -= 1
            return False
        return True

    def record(self, batch: int, seconds: float, tokens: int, drafted: bool) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        key = (drafted, batch)
        n = self._count.get(key, 0)
        w = self.weight if n else 1.0
        self._seconds[key] = self._seconds.get(key, 0.0) * (1 - w) + w * seconds
        self._tokens[key] = self._tokens.get(key, 0.0) * (1 - w) + w * tokens
        self._count[key] = n + 1
        plain = (False, batch)
        if not drafted or n + 1 < self.min_samples or self._paused:
            return
        measured = self._count.get(plain, 0)
        if measured < self.min_samples:
            self._paused = self.min_samples - measured
            self.probes += 1
        elif self._seconds[key] * self._tokens[plain] > self._seconds[plain] * self._tokens[key]:
            self._paused = self.pause
            self.pauses += 1
            self._count[key] = 0


@dataclass(frozen=True)
class Drafts:
    """The step's verifying sequences, for the model runner: their drafts and where their rows
    sit in the step's logits, and where each plain sampling sequence's one row sits.

    Sequence ``i`` of ``seqs`` has ``1 + len(tokens[i])`` consecutive rows from ``rows[i]``;
    ``plain_rows[j]`` is the row of the engine's ``j``-th plain sampling sequence.
    """

    seqs: list[Sequence]
    tokens: list[tuple[int, ...]]
    rows: list[int]
    plain_rows: list[int]


def verify(logits: np.ndarray, drafts: Drafts, rng: np.random.Generator) -> list[list[int]]:
    """The tokens each verifying sequence emits this step: its kept drafts, then the model's
    token at the first position it did not keep (or after the last draft). ``logits``: the
    step's sampling rows, float32 (left unchanged). A sampled sequence's uniforms and draws come
    from its own generator if it has one (the engine lets no seeded sampled request speculate,
    so that is a safety net), else from ``rng``, the caller's."""
    greedy = [i for i, seq in enumerate(drafts.seqs) if seq.params.greedy]
    best: dict[int, list[int]] = {}
    if greedy:
        idx = [r for i in greedy for r in range(drafts.rows[i], drafts.rows[i] + len(drafts.tokens[i]) + 1)]
        flat = argmax_ids(logits[idx])
        at = 0
        for i in greedy:
            n = len(drafts.tokens[i]) + 1
            best[i], at = flat[at : at + n], at + n
    out: list[list[int]] = []
    for i, seq in enumerate(drafts.seqs):
        draft = drafts.tokens[i]
        if i in best:
            picks = best[i]
            a = 0
            while a < len(draft) and draft[a] == picks[a]:
                a += 1
            out.append([*draft[:a], picks[a]])
        else:
            rows = logits[drafts.rows[i] : drafts.rows[i] + len(draft) + 1]
            gen = rng if seq.generator is None else seq.generator
            out.append(_rejection_sample(probabilities(rows, seq.params), draft, gen))
    return out


def _rejection_sample(probs: np.ndarray, draft: tuple[int, ...], rng: np.random.Generator) -> list[int]:
    """probs: [k + 1, V], the target distribution at each position (the draft is a point mass).
    One uniform per draft token from ``rng``, then one categorical draw."""
    kept: list[int] = []
    uniforms = rng.random(len(draft)).tolist()
    for j, token in enumerate(draft):
        p = probs[j]
        if uniforms[j] < float(p[token]):
            kept.append(token)
            continue
        residual = p.astype(np.float64)
        residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # p was (numerically) all on the draft token
            kept.append(int(p.argmax()))
        else:
            kept.append(_categorical(residual, rng))
        return kept
    kept.append(_categorical(probs[len(draft)], rng))
    return kept


def _categorical(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn with probability proportional to ``weights`` (non-negative, some
    positive; as ``torch.multinomial(weights, 1)``): one uniform, an inverse-CDF lookup in
    float64. A zero weight is never drawn: the lookup returns the first index whose cumulative
    weight exceeds the uniform's, and a zero weight does not raise the sum."""
    cdf = np.cumsum(weights, dtype=np.float64)
    at = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if at >= len(cdf):  # u * total rounded up to the total: the last positive weight
        at = int(np.flatnonzero(weights > 0)[-1])
    return at
