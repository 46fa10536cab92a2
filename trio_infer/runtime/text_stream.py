"""One request's text: everything from token ids to text deltas, in the request's own task.

:class:`TextStream` reads a request's :class:`~trio_infer.runtime.client.GenerationStream` and
yields, per read, the choices' text deltas: incremental detokenization, the EOS / stop token
stripped from the text, stop strings (a match ends the choice in the engine at once), logprobs,
``stream_interval`` (a choice's text is held until it has that many new tokens; its first token
and its end go out at once). Its state is a few buffers per choice and dies with the request
(gap G3); callers never see uids or raw outputs.

``async with open_text_stream(engine, tokenizer, prompt_ids, params, stop) as text:`` then
``async for deltas in text: ...``; afterwards ``text.choices`` holds each choice's whole text,
token count and finish reason. :func:`open_batch_text_stream` does the same for several prompts
in one session (choice ``j * n + i`` is choice i of prompt j); a request that generates nothing
and asks for no prompt logprobs (``max_tokens=0``) finishes there without the engine.

A choice's prompt logprobs (``SamplingParams.prompt_logprobs``) come with its first output: they
are in the delta of that read (``ChoiceDelta.prompt_logprobs``) and stay in
``ChoiceText.prompt_logprobs``.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

import msgspec

from trio_infer.runtime.client import AsyncEngine, GenerationStream
from trio_infer.runtime.detokenizer import IncrementalDetokenizer
from trio_infer.runtime.stop_strings import StopStringMatcher
from trio_infer.wire import RequestOutput, SamplingParams, TokenLogprob


@dataclass
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # in the choice's first delta only


@dataclass
class ChoiceText:
    """One choice's text so far: detokenizer, stop strings, counts."""

    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    finish_reason: str | None = None
    num_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    sent_tokens: int = 0  # num_tokens when its text last went out (stream_interval)
    held: ChoiceDelta | None = None  # text waiting for stream_interval
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked: entry 0 is None
    num_cached_tokens: int = 0  # of the prompt's tokens, served by the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def consume(self, outputs: Sequence[RequestOutput]) -> ChoiceDelta | None:
        """Fold this read's outputs for the choice into a delta; None once it has finished (a
        stop string may end a choice before the engine does: later outputs are dropped)."""
        if self.finish_reason is not None:
            return None
        text_parts: list[str] = []
        lps: list[TokenLogprob] = []
        finish: str | None = None
        prompt_lps = None
        for out in _one_token_each(outputs):
            if out.prompt_logprobs is not None:  # the first output of a choice that asked
                prompt_lps = self.prompt_logprobs = out.prompt_logprobs
            ids = out.token_ids
            lp = out.logprobs
            self.num_cached_tokens = out.num_cached_tokens
            self.num_tokens += len(ids)
            self.token_ids.extend(ids)
            if out.stop_token_id is not None and ids and ids[-1] == out.stop_token_id:
                ids = ids[:-1]  # the EOS / stop token ends the text; it is not part of it
                if lp:
                    lp = lp[: len(ids)]
            if lp:
                lps.extend(lp)
            piece = self.detokenizer.add(ids)
            if out.finish_reason is not None:
                piece += self.detokenizer.flush()
            text_parts.append(self.stops.feed(piece))
            if self.stops.stopped:
                finish = "stop"
                break
            if out.finish_reason is not None:
                text_parts.append(self.stops.flush())
                finish = out.finish_reason
                break
        text = "".join(text_parts)
        self.finish_reason = finish
        self.text_parts.append(text)
        self.logprobs.extend(lps)
        return ChoiceDelta(self.index, text, lps, finish, prompt_lps)

    def pace(self, delta: ChoiceDelta, interval: int) -> ChoiceDelta | None:
        """``delta`` merged with what was held, or None while it waits for ``interval`` tokens."""
        if self.held is not None:
            h = self.held
            delta = ChoiceDelta(self.index, h.text + delta.text, h.logprobs + delta.logprobs,
                                delta.finish_reason, h.prompt_logprobs or delta.prompt_logprobs)
        if self.sent_tokens and not self.finished and self.num_tokens - self.sent_tokens < interval:
            self.held = delta
            return None
        self.held = None
        self.sent_tokens = self.num_tokens
        return delta


def _one_token_each(outputs: Sequence[RequestOutput]) -> Sequence[RequestOutput]:
    """The outputs with one token each: a step of speculative decoding emits several tokens in
    one output, and a stop string must end the choice (and its token count) at the token that
    completes it, as it does one token a step."""
    for out in outputs:  # every read goes through here: no generator for the usual case
        if len(out.token_ids) > 1:
            break
    else:
        return outputs
    split: list[RequestOutput] = []
    for out in outputs:
        n = len(out.token_ids)
        if n <= 1:
            split.append(out)
            continue
        for j, token in enumerate(out.token_ids):
            last = j == n - 1
            split.append(msgspec.structs.replace(
                out, token_ids=[token],
                logprobs=out.logprobs[j : j + 1] if out.logprobs else out.logprobs,
                finish_reason=out.finish_reason if last else None,
                stop_token_id=out.stop_token_id if last else None,
                num_output_tokens=out.num_output_tokens - (n - 1 - j),
                prompt_logprobs=out.prompt_logprobs if j == 0 else None,
            ))
    return split


@dataclass(frozen=True)
class TextOptions:
    """How a request's text is made from its tokens: special tokens dropped (vLLM's
    ``skip_special_tokens``, true by default) and the stop string that ended a choice kept at
    its end (``include_stop_str_in_output``)."""

    skip_special_tokens: bool = True
    include_stop_str: bool = False


DEFAULT_TEXT = TextOptions()


def _choices(tokenizer: Any, prompts: Sequence[list[int]], n: int, stop: Sequence[str],
             options: TextOptions = DEFAULT_TEXT) -> list[ChoiceText]:
    return [
        ChoiceText(
            j * n + i,
            IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=options.skip_special_tokens),
            StopStringMatcher(stop, include=options.include_stop_str),
        )
        for j, prompt in enumerate(prompts)
        for i in range(n)
    ]


class TextStream:
    """A request's choices' text; ``prompt_ids`` is one prompt, or with ``batch=True`` a list of
    prompts (choice ``j * n + i`` is choice i of prompt j)."""

    def __init__(
        self,
        stream: GenerationStream,
        tokenizer: Any,
        prompt_ids: Any,
        n: int,
        stop: Sequence[str] = (),
        interval: int = 1,
        *,
        batch: bool = False,
        options: TextOptions = DEFAULT_TEXT,
    ) -> None:
        self._stream = stream
        self._interval = interval
        self._stops = bool(stop)
        prompts: Sequence[list[int]] = prompt_ids if batch else [prompt_ids]
        self.choices = _choices(tokenizer, prompts, n, stop, options)
        self.num_prompt_tokens = sum(len(p) for p in prompts)

    @property
    def finished(self) -> bool:
        for c in self.choices:  # (a loop, not all() over a generator: asked twice per read)
            if c.finish_reason is None:
                return False
        return True

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def __aiter__(self) -> TextStream:
        return self

    async def admitted(self) -> None:
        """Return once the worker has started the request (:meth:`GenerationStream.admitted`)."""
        await self._stream.admitted()

    async def __anext__(self) -> list[ChoiceDelta]:
        """The next read's deltas: what each choice has to say now; never empty."""
        while not self.finished:
            try:
                outputs = await self._stream.__anext__()
            except StopAsyncIteration:
                raise RuntimeError("the engine ended the request without finishing it") from None
            deltas = self._fold(outputs)
            if deltas:
                return deltas
        raise StopAsyncIteration

    def _fold(self, outputs: Sequence[RequestOutput]) -> list[ChoiceDelta]:
        """One read's outputs as the choices' deltas (those with something to say)."""
        choices, interval = self.choices, self._interval
        if len(choices) == 1:  # the usual case: no grouping
            groups: Any = ((choices[0], outputs),)
        else:
            by_index: dict[int, list[RequestOutput]] = {}
            for out in outputs:
                by_index.setdefault(out.uid[1], []).append(out)
            groups = ((choices[i], outs) for i, outs in by_index.items())
        deltas = []
        for choice, outs in groups:
            delta = choice.consume(outs)
            if delta is None:
                continue  # finished earlier (a stop string): later outputs dropped
            if choice.finished:
                self._stream.finish(choice.index)  # no-op if the engine finished it
            if interval > 1:
                delta = choice.pace(delta, interval)
                if delta is None:
                    continue
            if (delta.text or delta.logprobs or delta.finish_reason is not None
                    or delta.prompt_logprobs is not None):
                deltas.append(delta)
        return deltas


@asynccontextmanager
async def open_text_stream(
    engine: AsyncEngine,
    tokenizer: Any,
    prompt_ids: list[int],
    params: list[SamplingParams],
    stop: Sequence[str] = (),
    interval: int = 1,
) -> AsyncIterator[TextStream]:
    """A request's session and its text: leaving the block ends the request (see
    :meth:`AsyncEngine.generate`)."""
    async with engine.generate(prompt_ids, params) as stream:
        yield TextStream(stream, tokenizer, prompt_ids, len(params), stop, interval)


class ChoiceTexts(Protocol):
    """What :func:`open_batch_text_stream` yields: ``async for deltas in text``, then
    ``text.choices``."""

    choices: list[ChoiceText]
    num_prompt_tokens: int

    @property
    def finished(self) -> bool: ...

    def __aiter__(self) -> Any: ...

    async def admitted(self) -> None: ...


class NothingToGenerate:
    """The text of a request that generates no token and asks for no prompt logprobs: every
    choice finishes with "length" at the first read; no engine, no session."""

    def __init__(self, tokenizer: Any, prompts: Sequence[list[int]], n: int) -> None:
        self.choices = _choices(tokenizer, prompts, n, ())
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> NothingToGenerate:
        return self

    async def admitted(self) -> None:
        """Nothing waits in a queue: at once."""

    async def __anext__(self) -> list[ChoiceDelta]:
        if self._done:
            raise StopAsyncIteration
        self._done = True
        for choice in self.choices:
            choice.finish_reason = "length"
        return [ChoiceDelta(c.index, "", [], "length") for c in self.choices]


@asynccontextmanager
async def open_batch_text_stream(
    engine: AsyncEngine,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    params: list[SamplingParams],
    stop: Sequence[str] = (),
    interval: int = 1,
    options: TextOptions = DEFAULT_TEXT,
    timeout_s: float | None = None,
) -> AsyncIterator[ChoiceTexts]:
    """:func:`open_text_stream` over several prompts, each with ``len(params)`` choices, in one
    session: each choice of each prompt is its own engine sequence, and leaving the block ends
    them all. One prompt goes through ``engine.generate`` as :func:`open_text_stream` does.
    ``timeout_s``: the request's deadline (``AsyncEngine.generate_batch``)."""
    if all(p.max_tokens == 0 and p.prompt_logprobs is None for p in params):
        yield NothingToGenerate(tokenizer, prompts, len(params))
        return
    if len(prompts) == 1:
        cm = engine.generate(prompts[0], params, timeout_s)
    else:
        cm = engine.generate_batch(prompts, params, timeout_s)
    async with cm as stream:
        yield TextStream(stream, tokenizer, prompts, len(params), stop, interval, batch=True,
                         options=options)
