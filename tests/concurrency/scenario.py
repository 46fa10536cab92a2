"""What a scenario is: plain data, drawn by :mod:`.strategies`, run by :mod:`.runner`.

A scenario fixes everything that can vary: the engine's pool and batch sizes, the server settings,
the requests (prompt, choices, stop tokens, arrival), how each client reads, the faults (engine
steps that raise, a worker that stops stepping for a while, a shutdown) and the seed of trio's scheduler. Running the same scenario twice
under a :class:`trio.testing.MockClock` gives the same run, which is what lets hypothesis shrink
and replay a failure.

Times are virtual seconds. Engine steps of the fake model take no virtual time, so "when" inside
one instant is counted in *ticks*: trio checkpoints that a task waits before acting. A request
that arrives at ``t=3, ticks=7`` arrives a few engine steps after everything due at ``t=3``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from trio_infer.models.fake import expected_next_token
from trio_infer.wire import SamplingParams

VOCAB = 61  # small, so stop tokens and the EOS are hit often
EOS = 0

# How a client reads its stream.
#   read_all: reads every chunk as soon as it can.
#   leave:    reads ``k`` chunks, then leaves the ``async with`` (a ``break``).
#   slow:     sleeps ``delay`` seconds after every chunk.
#   stall:    does not read for ``delay`` seconds, then reads everything.
#   cancel:   reads everything, but its cancel scope is cancelled ``k`` ticks (after ``delay``
#             seconds, process variant only) after it is admitted (k=0: before the worker has
#             it; small k: queued, during prefill or with a step in flight).
#   finish:   sleeps ``delay`` seconds after every chunk, like slow; after ``k`` chunks it ends
#             every choice early with ``stream.finish(i)`` (what the HTTP layer does when a
#             stop string matches), then reads what is left.
Kind = Literal["read_all", "leave", "slow", "stall", "cancel", "finish"]


@dataclass(frozen=True)
class Client:
    kind: Kind = "read_all"
    k: int = 0
    delay: float = 0.0

    def __repr__(self) -> str:
        extra = {"leave": f", k={self.k}",
                 "cancel": f", k={self.k}" + (f", delay={self.delay}" if self.delay else ""),
                 "slow": f", delay={self.delay}", "stall": f", delay={self.delay}",
                 "finish": f", k={self.k}, delay={self.delay}"}
        return f"Client({self.kind!r}{extra.get(self.kind, '')})"


@dataclass(frozen=True)
class Choice:
    """One of a request's ``n`` choices: greedy, so its output is known in advance.

    A ``constrained`` choice carries a grammar that allows every text and the EOS anywhere
    (``char_tokenizer.any_text_grammar``): it writes the same tokens, except that the EOS ends it
    whatever ``ignore_eos`` says (a grammar that took the EOS is complete), and its grammar state
    must be released on every way out like the rest of its state."""

    max_tokens: int | None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = True
    constrained: bool = False
    speculative: bool = True  # False: the request opts out (on a speculating engine)

    @property
    def ends_at_eos(self) -> bool:
        return not self.ignore_eos or self.constrained

    def params(self, priority: int = 0) -> SamplingParams:
        return SamplingParams(
            priority=priority,
            temperature=0,
            max_tokens=self.max_tokens,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            grammar=_any_text_grammar() if self.constrained else None,
            speculative=self.speculative,
        )


@functools.lru_cache(maxsize=1)
def _any_text_grammar() -> str:
    from .char_tokenizer import any_text_grammar

    return any_text_grammar()


@dataclass(frozen=True)
class Request:
    """``priority``: every choice's (lower first); ``timeout``: the request's deadline in
    seconds from when its session opens (``generate(..., timeout_s)``), None for none."""

    prompt: tuple[int, ...]
    choices: tuple[Choice, ...]
    arrival: float = 0.0
    ticks: int = 0
    client: Client = Client()
    priority: int = 0
    timeout: float | None = None


@dataclass(frozen=True)
class Shutdown:
    """``cancel``: the engine (front end and worker task) is cancelled, a hard stop.
    ``drain``: new requests are refused, live ones get ``grace`` seconds, then every session is
    failed (``abort_all``) and, once the worker has applied the aborts, the engine is cancelled."""

    kind: Literal["cancel", "drain"]
    at: float
    ticks: int = 0
    grace: float = 0.0


@dataclass(frozen=True)
class Hold:
    """The worker stops stepping at ``at`` for ``for_s`` seconds, alive and with its pipe open
    (as a SIGSTOP holds a process), then goes on. Past the watchdog's stall bound (10 s here:
    the fake model's steps take no time) it is stalled: new requests are refused with
    ``EngineUnavailable`` ("no progress"), live ones wait. Holds stay below the restart bound
    (60 s), past which the worker counts as dead: the path a crash takes."""

    at: float
    for_s: float


@dataclass(frozen=True)
class EngineShape:
    page_size: int = 4
    num_pages: int = 16
    max_running: int = 4
    max_batched_tokens: int = 16
    prefix_cache: bool = True
    # Prompt-lookup speculation (engine/speculative.py) in every step: drafts take pages, get
    # rejected (rolled back) and, now and then, kept, so one output carries several tokens.
    speculative: bool = False
    # With speculative: a draft model guesses instead (engine/draft.py: a second fake model,
    # wrong at one position in three, in a KV pool of its own of draft_pages pages), so draft
    # pages are taken, rolled back, freed by preemption, aborts and failed steps.
    draft: bool = False
    draft_pages: int = 16

    @property
    def max_model_len(self) -> int:
        return self.num_pages * self.page_size  # the fake model's own limit is far larger


@dataclass(frozen=True)
class Scenario:
    engine: EngineShape
    requests: tuple[Request, ...]
    channel_capacity: int = 4
    stall_timeout_s: float = 10.0
    max_waiting: int = 256
    fail_steps: frozenset[int] = frozenset()  # 1-based engine steps whose execute raises
    shutdown: Shutdown | None = None
    hold: Hold | None = None
    sched_seed: int = 0  # seeds trio's run-queue shuffling: the interleaving is part of the example
    # Overload settings (None: off): the waiting queue's bound in prompt tokens, the queue-time
    # limit.
    max_waiting_tokens: int | None = None
    max_queue_time_s: float | None = None


@dataclass(frozen=True)
class Expected:
    tokens: tuple[int, ...]
    finish_reason: str  # "stop" | "length"


def expected_output(prompt: tuple[int, ...] | list[int], choice: Choice, max_model_len: int,
                    vocab: int = VOCAB, eos: int = EOS) -> Expected:
    """What a choice must produce, from the fake model's pure next-token function and the engine's
    stop rules (stop tokens and EOS are kept in the output; then max_tokens; then the context).
    ``vocab`` and ``eos`` are the fake model's: the suite's own, or (real worker process) the fake
    tokenizer's."""
    seq = list(prompt)
    out: list[int] = []
    while True:
        t = expected_next_token(seq, vocab, eos)
        seq.append(t)
        out.append(t)
        if (choice.ends_at_eos and t == eos) or t in choice.stop_token_ids:
            return Expected(tuple(out), "stop")
        if choice.max_tokens is not None and len(out) >= choice.max_tokens:
            return Expected(tuple(out), "length")
        if len(seq) >= max_model_len:
            return Expected(tuple(out), "length")


def continuation(prompt: tuple[int, ...] | list[int], n: int, vocab: int = VOCAB,
                 eos: int = EOS) -> list[int]:
    """The first ``n`` tokens the fake model writes after ``prompt`` (no stop rules)."""
    return list(_continuation(tuple(prompt), n, vocab, eos))


@functools.lru_cache(maxsize=4096)
def _continuation(prompt: tuple[int, ...], n: int, vocab: int, eos: int) -> tuple[int, ...]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(expected_next_token(seq, vocab, eos))
    return tuple(seq[len(prompt):])


@dataclass
class Stats:
    """What happened, for hypothesis ``event()`` statistics and for sanity tests."""

    steps: int = 0
    preemptions: int = 0
    preempted_paused: int = 0
    pauses: int = 0
    failed_steps: int = 0
    steps_after_end: int = 0  # most steps a sequence was in after the front end ended it
    multi_token_outputs: int = 0  # outputs carrying more than one token (speculation)


# -- the HTTP layer ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpRequest:
    """One OpenAI request. ``prompt`` is token ids for /v1/completions; for /v1/chat/completions
    ``message`` is the user message and the prompt is what the chat template renders."""

    endpoint: Literal["completions", "chat"]
    prompt: tuple[int, ...] = (1,)
    message: str = ""
    n: int = 1
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = True
    stream: bool = True
    include_usage: bool = False
    arrival: float = 0.0
    ticks: int = 0
    client: Client = Client()  # "cancel" = disconnect k ticks after sending the request
    priority: int = 0
    timeout: float | None = None  # the request's 'timeout' field

    def body(self) -> dict:
        body: dict = {"model": HTTP_MODEL, "n": self.n, "temperature": 0,
                      "ignore_eos": self.ignore_eos, "stream": self.stream}
        if self.priority:
            body["priority"] = self.priority
        if self.timeout is not None:
            body["timeout"] = self.timeout
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self.message}]
        else:
            body["prompt"] = list(self.prompt)
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.stop:
            body["stop"] = list(self.stop)
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


HTTP_MODEL = "fake-chars"


@dataclass(frozen=True)
class HttpScenario:
    engine: EngineShape
    requests: tuple[HttpRequest, ...]
    channel_capacity: int = 4
    stall_timeout_s: float = 10.0
    max_waiting: int = 256
    fail_steps: frozenset[int] = frozenset()
    drain_at: float | None = None  # trio_infer.app.drain(app, drain_grace) at this time
    drain_grace: float = 0.0
    sched_seed: int = 0
    max_queue_time_s: float | None = None  # streams then get their status once scheduled


@dataclass(frozen=True)
class ExpectedText:
    text: str
    finish_reason: str
    num_tokens: int  # tokens the server consumed for the choice (usage.completion_tokens)


def expected_text(prompt_ids: list[int], req: HttpRequest, max_model_len: int,
                  text_of) -> ExpectedText:
    """The OpenAI answer of one choice: the engine's tokens as text (a final EOS or stop token
    is not text; an EOS inside the output, with ``ignore_eos``, is an empty special token), cut
    where the first stop string *ends* (ties: the one starting first)."""
    exp = expected_output(prompt_ids, Choice(req.max_tokens, (), req.ignore_eos), max_model_len)
    tokens = list(exp.tokens)
    if exp.finish_reason == "stop":
        tokens = tokens[:-1]  # the EOS
    text = ""
    for count, token in enumerate(tokens, 1):
        text += text_of(token)
        starts = [text.find(s) for s in req.stop if s in text]
        if starts:  # each token adds at most one character: every match ends right here
            return ExpectedText(text[: min(starts)], "stop", count)
    return ExpectedText(text, exp.finish_reason, len(exp.tokens))
