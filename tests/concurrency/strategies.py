"""Hypothesis strategies for scenarios.

Everything shrinks towards the plain case: few requests, arrival at 0, clients that read
everything, no fault, no shutdown, a roomy pool. Rare features (faults, shutdowns, a tiny waiting
cap, prompts too long for the context) are behind :func:`sometimes`, whose selector shrinks to
"off", so a shrunk counterexample keeps only what it needs.

Drawing is a good part of the suite's time, so the per-element draws build no strategy objects
(hypothesis caches ``st.integers(a, b)`` and friends by their arguments, but a fresh
``sampled_from(list)``, ``.map(lambda)`` or ``flatmap`` is validated anew at every draw): a pick
from a list is an index drawn with ``st.integers``.
"""

from __future__ import annotations

from typing import TypeVar

from hypothesis import strategies as st

from .char_tokenizer import ALPHABET, MESSAGE_CHARS, CharTokenizer
from .scenario import (
    VOCAB,
    Choice,
    Client,
    EngineShape,
    Hold,
    HttpRequest,
    HttpScenario,
    Request,
    Scenario,
    Shutdown,
    continuation,
)

T = TypeVar("T")

BOOLS = st.booleans()
NOT_BOOLS = st.booleans().map(lambda b: not b)  # shrinks to True
MAYBE_24 = st.one_of(st.integers(1, 24), st.none())
MAYBE_16 = st.one_of(st.integers(1, 16), st.none())


def pick(draw: st.DrawFn, items):  # type: ignore[no-untyped-def]
    """One of ``items`` (shrinks towards the first)."""
    return items[draw(st.integers(0, len(items) - 1))]


def sometimes(draw: st.DrawFn, strategy: st.SearchStrategy[T], default: T, one_in: int = 4) -> T:
    """``strategy`` about once in ``one_in`` draws, else ``default`` (what it shrinks to)."""
    return draw(strategy) if draw(st.integers(0, one_in - 1)) == one_in - 1 else default


@st.composite
def engine_shapes(draw: st.DrawFn) -> EngineShape:
    """Pools from one sequence's worth of pages to a few: small enough to force preemption."""
    page_size = pick(draw, (4, 1, 2, 3, 8))
    num_pages = draw(st.integers(max(2, -(-6 // page_size)), max(3, 96 // page_size)))
    max_running = draw(st.integers(1, 8))
    max_batched_tokens = max_running + draw(st.integers(0, 24))
    prefix_cache = draw(st.booleans())
    speculative = draw(BOOLS)  # shrinks to off
    draft = speculative and draw(BOOLS)  # shrinks to prompt lookup
    # The draft pool: sometimes too small for everyone (a draft only takes free pages).
    draft_pages = draw(st.integers(1, 2 * num_pages)) if draft else 16
    return EngineShape(page_size, num_pages, max_running, max_batched_tokens, prefix_cache,
                       speculative, draft, draft_pages)


ALL_KINDS = ("read_all", "slow", "leave", "stall", "cancel", "finish")


@st.composite
def clients(draw: st.DrawFn, kinds: tuple[str, ...] = ALL_KINDS) -> Client:
    kind = pick(draw, kinds)
    if kind == "leave":
        return Client(kind, k=draw(st.integers(1, 6)))
    if kind == "cancel":
        return Client(kind, k=draw(st.integers(0, 60)))
    if kind == "slow":
        return Client(kind, delay=draw(st.integers(1, 24)) / 2)
    if kind == "stall":
        return Client(kind, delay=float(draw(st.integers(1, 60))))
    if kind == "finish":
        delay = draw(st.integers(0, 24)) / 2
        return Client(kind, k=draw(st.integers(1, 6)), delay=delay)
    return Client(kind)


@st.composite
def choices(draw: st.DrawFn, prompt: tuple[int, ...]) -> Choice:
    max_tokens = draw(MAYBE_24)
    cont = continuation(prompt, 24)  # stop tokens taken from the output are actually hit
    stop = [pick(draw, cont) if draw(BOOLS) else draw(st.integers(0, VOCAB - 1))
            for _ in range(draw(st.integers(0, 2)))]
    ignore_eos = draw(NOT_BOOLS)  # shrinks to ignoring the EOS
    constrained = sometimes(draw, BOOLS, False)  # with grammar state (engine/grammar.py)
    speculative = sometimes(draw, st.just(False), True)  # opted out of speculation
    return Choice(max_tokens, tuple(dict.fromkeys(stop)), ignore_eos, constrained, speculative)


def tokens(length: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(1, VOCAB - 1), min_size=length, max_size=length)


@st.composite
def requests(draw: st.DrawFn, shape: EngineShape, bases: list[tuple[int, ...]],
             max_n: int = 3) -> Request:
    limit = shape.max_model_len
    too_long = sometimes(draw, st.just(True), False, one_in=12)
    if too_long:
        length = draw(st.integers(limit, limit + 4))
    else:
        length = draw(st.integers(1, min(limit - 1, 40)))
    # Often start with part of a prompt other requests share, so the prefix cache shares pages.
    head: tuple[int, ...] = ()
    if bases and draw(BOOLS):
        base = pick(draw, bases)
        head = base[: draw(st.integers(0, min(len(base), length)))]
    prompt = head + tuple(draw(tokens(length - len(head))))
    n = draw(st.integers(1, max_n))
    return Request(
        prompt=prompt,
        choices=tuple(draw(choices(prompt)) for _ in range(n)),
        arrival=float(draw(st.integers(0, 10))),
        ticks=draw(st.integers(0, 30)),
        client=draw(clients()),
        priority=sometimes(draw, st.integers(-1, 2), 0, one_in=2),
        timeout=sometimes(draw, st.integers(1, 40).map(lambda k: k / 2), None, one_in=4),
    )


@st.composite
def shutdowns(draw: st.DrawFn) -> Shutdown:
    kind = pick(draw, ("drain", "cancel"))
    return Shutdown(
        kind=kind,
        at=float(draw(st.integers(0, 20))),
        ticks=draw(st.integers(0, 40)),
        grace=float(draw(st.integers(0, 10))) if kind == "drain" else 0.0,
    )


@st.composite
def holds(draw: st.DrawFn) -> Hold:
    """A worker that stops stepping: shorter than the stall bound, past it, well past it (all
    below the restart bound)."""
    return Hold(at=pick(draw, (0.0, 0.0, 1.0, 2.0)), for_s=pick(draw, (3.0, 12.0, 40.0)))


BASES = st.lists(st.integers(1, 32).flatmap(tokens).map(tuple), max_size=3)


@st.composite
def scenarios(draw: st.DrawFn, max_requests: int = 24, max_n: int = 3) -> Scenario:
    shape = draw(engine_shapes())
    bases = draw(BASES)
    reqs = draw(st.lists(requests(shape, bases, max_n), min_size=1, max_size=max_requests))
    return Scenario(
        engine=shape,
        requests=tuple(reqs),
        channel_capacity=draw(st.integers(1, 8)),
        stall_timeout_s=float(draw(st.integers(1, 30))),
        max_waiting=sometimes(draw, st.integers(1, 8), 256, one_in=8),
        fail_steps=sometimes(
            draw, st.frozensets(st.integers(1, 150), min_size=1, max_size=3), frozenset(), one_in=5
        ),
        shutdown=sometimes(draw, shutdowns(), None, one_in=5),
        hold=sometimes(draw, holds(), None, one_in=5),
        sched_seed=draw(st.integers(0, 2**16)),
        max_waiting_tokens=sometimes(draw, st.integers(1, 120), None, one_in=6),
        max_queue_time_s=sometimes(draw, st.integers(1, 20).map(float), None, one_in=4),
    )


# -- the HTTP layer ------------------------------------------------------------------------------


RANDOM_STOP = st.text(alphabet=ALPHABET, min_size=1, max_size=3)


@st.composite
def http_requests(draw: st.DrawFn, shape: EngineShape) -> HttpRequest:
    endpoint = pick(draw, ("completions", "chat"))
    limit = shape.max_model_len
    if endpoint == "chat":
        message = "".join(pick(draw, MESSAGE_CHARS) for _ in range(draw(st.integers(0, 12))))
        prompt = tuple(CharTokenizer().encode(CharTokenizer().apply_chat_template(
            [{"role": "user", "content": message}])))
    else:
        message = ""
        length = draw(st.integers(1, max(1, min(limit + 2, 30))))
        prompt = tuple(draw(tokens(length)))
    max_tokens = draw(MAYBE_16)
    # Stop strings: pieces of the text the request will produce (so they are hit, often across
    # tokens) or a few random characters.
    text = "".join(CharTokenizer.text_of(t, True) for t in continuation(prompt, 20))
    stop = []
    for _ in range(draw(st.integers(0, 2))):
        if draw(BOOLS):
            i = draw(st.integers(0, max(0, len(text) - 1)))
            stop.append(text[i:i + draw(st.integers(1, 3))])
        else:
            stop.append(draw(RANDOM_STOP))
    stop = [s for s in stop if s]
    stream = draw(NOT_BOOLS)  # shrinks to streaming
    kinds = ("read_all", "slow", "leave", "stall", "cancel") if stream else ("read_all", "cancel")
    client = draw(clients(kinds))
    return HttpRequest(
        endpoint=endpoint,
        prompt=prompt,
        message=message,
        n=draw(st.integers(1, 3)),
        max_tokens=max_tokens,
        stop=tuple(dict.fromkeys(stop)),
        ignore_eos=draw(NOT_BOOLS),
        stream=stream,
        include_usage=stream and draw(BOOLS),
        arrival=float(draw(st.integers(0, 6))),
        ticks=draw(st.integers(0, 30)),
        client=client,
        priority=sometimes(draw, st.integers(-1, 2), 0, one_in=2),
        timeout=sometimes(draw, st.integers(1, 20).map(lambda k: k / 2), None, one_in=4),
    )


@st.composite
def http_scenarios(draw: st.DrawFn, max_requests: int = 8) -> HttpScenario:
    shape = draw(engine_shapes())
    drain = sometimes(draw, st.integers(0, 12), None, one_in=5)
    return HttpScenario(
        engine=shape,
        requests=tuple(draw(st.lists(http_requests(shape), min_size=1, max_size=max_requests))),
        channel_capacity=draw(st.integers(1, 8)),
        stall_timeout_s=float(draw(st.integers(1, 30))),
        max_waiting=sometimes(draw, st.integers(1, 8), 256, one_in=8),
        fail_steps=sometimes(
            draw, st.frozensets(st.integers(1, 100), min_size=1, max_size=2), frozenset(), one_in=6
        ),
        drain_at=None if drain is None else float(drain),
        drain_grace=float(draw(st.integers(0, 5))) if drain is not None else 0.0,
        sched_seed=draw(st.integers(0, 2**16)),
        max_queue_time_s=sometimes(draw, st.integers(1, 10).map(float), None, one_in=4),
    )
