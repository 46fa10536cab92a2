"""What every way of guessing draft tokens shares: :class:`Proposer`, one sequence's drafting
state (the draft length now, its acceptance record, the off-switch).

A module of its own, below both the sequence (which holds its proposer) and the speculative
decoding that implements it (``speculative.py``, which needs the sampler, which needs the
sequence): so each imports it downward. It imports nothing of the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

# A sequence whose acceptance average falls below the threshold proposes nothing for this many
# of its steps, then tries again.
COOLDOWN_STEPS = 16
# Weight of the newest verify step in a sequence's running acceptance average.
_EMA = 0.3


class Proposer(ABC):
    """One sequence's drafting state, whatever guesses its tokens: the draft length now and its
    acceptance record, behind the off-switches (the same for every way of guessing).

    The scheduler calls :meth:`propose` for a draft of at most ``limit`` tokens; the engine calls
    :meth:`record` with what the verify step kept and :meth:`keep` with the sequence's new
    ``num_computed``; the scheduler calls :meth:`release` when the sequence gives its pages
    back (finish, abort, preemption). Two implementations: :class:`~trio_infer.engine.speculative.PromptLookup` (n-gram) and
    :class:`~trio_infer.engine.draft.DraftProposer` (a draft model).
    """

    def __init__(self, num_tokens: int, min_acceptance: float) -> None:
        self.num_tokens = num_tokens  # k: tokens proposed at most per step
        self.min_acceptance = min_acceptance
        self._length = num_tokens  # the draft length now, adapted by record()
        self._acceptance = 1.0
        self._cooldown = 0

    @abstractmethod
    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens guessed to follow ``token_ids`` ([] for none)."""

    def record(self, proposed: int, accepted: int) -> None:
        """A verify step kept ``accepted`` of ``proposed`` drafts: adapt the draft length, update
        the running average and switch proposals off for a while when it falls below the
        threshold."""
        if accepted == proposed:
            self._length = min(self.num_tokens, self._length + 1)
        else:
            self._length = max(1, self._length - 1)
        self._acceptance += _EMA * (accepted / proposed - self._acceptance)
        if self._acceptance < self.min_acceptance:
            self._cooldown = COOLDOWN_STEPS
            self._acceptance = self.min_acceptance  # one more try after the cooldown

    def keep(self, num_computed: int) -> None:
        """The sequence's keys and values now stand for its first ``num_computed`` tokens (after
        a verify step); a proposer with KV of its own rolls back past them."""

    def release(self) -> None:
        """The sequence gave back its pages (finish, abort, preemption): so does the proposer."""

    def _draft_length(self, limit: int) -> int:
        """How many tokens to guess this step: 0 while the off-switch holds the sequence (the
        call counts its cooldown down), else the adapted length, at most ``limit``."""
        if self._cooldown:
            self._cooldown -= 1
            return 0
        return max(0, min(limit, self._length))
