"""One sequence's state inside the engine: tokens, progress and the KV pages it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable

import numpy as np

from trio_infer.wire import SamplingParams

if TYPE_CHECKING:
    from trio_infer.engine.proposer import Proposer
    from trio_infer.wire import TokenLogprob


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # admitted: holds KV pages
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's sequence. ``token_ids`` is prompt then output, appended to in place.

    ``num_computed`` counts the leading tokens whose keys/values sit in ``pages``. The last sampled
    token is never computed yet: a sequence in decode has ``num_computed == len(token_ids) - 1``.

    Prompt logprobs (``params.prompt_logprobs``): ``prompt_lps`` collects them while the prompt is
    prefilled (entry i is prompt token i's; entry 0 is None) and is handed over, then set to None,
    with the first output. The row of position p scores prompt token p + 1, so the rows of
    positions ``[lp_next, num_prompt_tokens - 1)`` still have to be computed; until the list is
    handed over the prefix cache may serve only positions before ``lp_next`` (their logprobs are
    already here), so a cache hit never skips a logprob.
    """

    uid: Hashable
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_len: int  # stop with "length" once the sequence holds this many tokens
    # The request's own RNG when it has a seed (Engine.add_request): its random rows draw only
    # from it, so its tokens do not depend on the batch (engine/sampler.py).
    generator: np.random.Generator | None = None
    status: Status = Status.WAITING
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    cache_nodes: list[int] = field(default_factory=list)  # prefix-cache node per full page
    # Prompt tokens the prefix cache served at its first admission (what usage reports as
    # cached; a preempted sequence's later re-admission does not change it).
    num_cached_tokens: int | None = None
    ready: bool = True  # False: the caller cannot take output now (backpressure); skip it
    finish_reason: str | None = None
    prompt_lps: list[TokenLogprob | None] | None = None  # None: not asked, or already delivered
    lp_next: int = 0  # first position whose row still has to give a prompt logprob
    # The grammar state of a constrained sequence (an llguidance matcher that has consumed every
    # output token), None otherwise; dropped when the sequence ends (engine/grammar.py).
    matcher: Any = None
    # The token ids ``params.min_tokens`` forbids until the sequence has that many output tokens
    # (its EOS ids unless ignore_eos, and its stop_token_ids); set by Engine.add_request.
    min_tokens_block: tuple[int, ...] = ()
    # params.thinking_budget: how far token_ids were read for think tags, and the tokens thought
    # since the last open tag (None: not thinking). Kept in the sampler (engine/sampler.py).
    think_read: int = 0
    think_count: int | None = None
    # The scheduler's arrival number (its tie-break within a priority) and whether it was ever
    # scheduled (the first time is reported to the front end as the end of its queue time).
    arrival: int = 0
    admitted: bool = False
    # Speculative decoding (engine/speculative.py): what guesses this sequence's tokens (its
    # n-gram index, or its draft model's pages and progress: engine/draft.py) and its acceptance
    # record; None when it does not speculate (off, opted out, or a request it cannot serve).
    proposer: Proposer | None = None
    # Whether the sampler needs nothing for this row but its logits, temperature and truncation
    # (no penalties, logit_bias, min_tokens, thinking budget or logprobs): decided once here, so
    # a step's sampler looks at the others only (engine/sampler.py).
    plain_sampling: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_sampling = not (p.adjusted or p.min_tokens or p.thinking_budget is not None
                                   or p.logprobs is not None)

    @property
    def queue_key(self) -> tuple[int, int]:
        """Order of the waiting queue: priority (lower first), then arrival. A preempted sequence
        keeps its key, so it goes back ahead of every younger one of its priority."""
        return (self.params.priority, self.arrival)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return len(self.token_ids) - self.num_computed
