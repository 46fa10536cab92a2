"""Per-request generation parameters, as the engine sees them (the API layer maps OpenAI's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops.

    ``temperature == 0`` means greedy. ``max_tokens=None`` means "until the context is full";
    ``max_tokens=0`` means no token at all: the prompt is prefilled (for its ``prompt_logprobs``)
    and the sequence finishes with "length" without sampling.
    ``logprobs=None`` returns no logprobs; ``logprobs=k`` returns the chosen token's logprob and
    the ``k`` most likely alternatives (k may be 0). ``prompt_logprobs=k`` does the same for every
    prompt token but the first (which has no context: its entry is None), computed from the
    prefill's own logits and delivered with the sequence's first output.
    ``grammar`` constrains the output: the JSON text of an llguidance grammar (the front end builds
    and validates it, ``api/structured.py``); the engine compiles it and masks every step's logits
    with it (``engine/grammar.py``). Such a sequence ends only when its grammar is complete (EOS,
    or nothing more can follow), or by ``max_tokens`` or the context ("length").
    ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before the sequence has that
    many output tokens. ``repetition_penalty`` (1 = none): the logit of every token already in
    the prompt or the output is divided by it when positive, multiplied when negative (vLLM's,
    CTRL's). ``logit_bias``: (token id, bias) pairs added to those tokens' logits (OpenAI's).
    ``thinking_budget`` with ``think_ids`` (the open and close tags' token ids): once the sequence
    has thought that many tokens (after an open tag, in its prompt or its output, with no close
    tag since), the close tag is the only token it may sample.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    thinking_budget: int | None = None
    think_ids: tuple[int, ...] = ()  # (open, close) when thinking_budget is set

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.thinking_budget is not None and (self.thinking_budget < 0 or len(self.think_ids) != 2):
            raise ValueError("thinking_budget must be >= 0 and come with the two think_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusted(self) -> bool:
        """Whether the sampler changes this sequence's logits before the grammar's mask
        (penalties, ``repetition_penalty``, ``logit_bias``)."""
        return self.penalized or self.repetition_penalty != 1.0 or bool(self.logit_bias)
