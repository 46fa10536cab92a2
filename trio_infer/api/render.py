"""Serializers: a request's events (``api/events.py``) as the OpenAI response objects and SSE
chunks of one API, one class per API: :class:`ChatSerializer` (``/v1/chat/completions``) and
:class:`CompletionSerializer` (``/v1/completions``). An API added later is one more subclass of
:class:`Serializer`. They render; they never parse (tool calls arrive as events).

:class:`TokenText` gives a token's text and bytes for logprobs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

from trio_infer.api import sse
from trio_infer.api.errors import APIError
from trio_infer.api.events import (
    Content,
    Event,
    Finish,
    Reasoning,
    ToolCallArguments,
    ToolCallStart,
    gather,
)
from trio_infer.api.plans import Plan
from trio_infer.api.response_events import reasoning_tokens

if TYPE_CHECKING:
    from trio_infer.runtime.text_stream import ChoiceText
    from trio_infer.wire import TokenLogprob

# JSON has no -inf; OpenAI reports "practically impossible" as this.
_MIN_LOGPROB = -9999.0


# -- token strings for logprobs -------------------------------------------------------------------


def _byte_to_unicode() -> dict[int, str]:
    """The byte <-> printable-character table of byte-level BPE (GPT-2 convention): printable
    Latin-1 bytes stand for themselves; the others are shifted above 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table, shift = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


class TokenText:
    """A token id's text and raw bytes, for logprobs (cached per tokenizer, bounded by vocab)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        raw: bytes | None = None
        if isinstance(piece, str):
            if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                raw = bytes(_UNICODE_TO_BYTE[c] for c in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    raw = bytes([int(piece[3:5], 16)])
                except ValueError:
                    raw = None
        if raw is None:
            raw = text.encode("utf-8")
        return text, raw


def _lp(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


# -- response objects -----------------------------------------------------------------------------


def usage(plan: Plan, choices: Sequence[ChoiceText], reasoning: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``reasoning`` (a reasoning model's thinking tokens, all choices together)
    adds ``completion_tokens_details.reasoning_tokens``."""
    prompt = sum(len(p) for p in plan.prompts)  # once per prompt, whatever n
    completion = sum(c.num_tokens for c in choices)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


class ReasoningCount:
    """The thinking tokens of a request's choices (``response_events.reasoning_tokens``), for the usage
    of a reasoning model's answer; a choice whose thinking has ended is counted once."""

    def __init__(self, plan: Plan, texts: TokenText) -> None:
        self.plan = plan
        self.texts = texts
        self._ended: dict[int, int] = {}

    def __call__(self, choices: Sequence[ChoiceText]) -> int | None:
        """All choices' thinking tokens so far; None when one cannot be told, or the plan does
        not split thinking out (a plain model's usage has no reasoning count)."""
        if self.plan.reasoning is None:
            return None
        total = 0
        for c in choices:
            count = self._ended.get(c.index)
            if count is None:
                count = reasoning_tokens(self.plan, c, self.texts)
                if count is None:
                    return None
                if c.finished or 0 < count < c.num_tokens:  # the close tag is behind: final
                    self._ended[c.index] = count
            total += count
        return total


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenText) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = texts(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(raw)}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    entries: Sequence[TokenLogprob],
    texts: TokenText,
    offset: int,
    prompt: tuple[list[int], Sequence[TokenLogprob | None]] | None = None,
) -> dict[str, Any]:
    """The legacy completions format; ``offset`` is where the first token's text starts.

    ``prompt`` (echo with logprobs): the prompt's ids and logprobs, listed first with offsets
    from 0; the first token has none (``null`` logprob and top logprobs, as OpenAI has it).
    """
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if prompt is not None:
        at = 0
        for token_id, e in zip(*prompt):
            text, _ = texts(token_id)
            tokens.append(text)
            token_lps.append(None if e is None else _lp(e.logprob))
            tops.append(None if e is None else {texts(t)[0]: _lp(lp) for t, lp in e.top})
            offsets.append(at)
            at += len(text)
    for e in entries:
        text, _ = texts(e.token_id)
        tokens.append(text)
        token_lps.append(_lp(e.logprob))
        tops.append({texts(t)[0]: _lp(lp) for t, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _head(plan: Plan, obj: str) -> dict[str, Any]:
    return {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model}


def _echo_logprobs(plan: Plan, index: int, prompt_lps: Sequence[TokenLogprob | None] | None):  # type: ignore[no-untyped-def]
    """The prompt part of choice ``index``'s logprobs (echo with logprobs), or None."""
    if plan.echo is None or prompt_lps is None:
        return None
    return plan.prompts[plan.prompt_of(index)], prompt_lps


def _fields(obj: dict[str, Any]) -> str:
    """The members of a JSON object, without its braces: ``{"a":1,"b":2}`` -> ``"a":1,"b":2``."""
    return sse.dumps(obj)[1:-1]


_encode = sse.encode_str


class Serializer:
    """One API's rendering of a request's events: its streamed chunks and its whole response.

    A streamed chunk is one choice's say; every chunk of a response has the same head (id,
    object, created, model, and with ``include_usage`` a null usage), so the head is rendered once
    per request and a chunk is that prefix, the choice's index, its fields and its finish reason
    (:meth:`_chunk`): the per-token path builds no dict and JSON-encodes only the text. The bytes
    are exactly ``sse.event`` of the equivalent object (``json.dumps(ensure_ascii=False)``,
    compact), which is what tests/api/test_chunk_writer.py checks against the OpenAI objects.

    Subclasses say what the API's chunks hold (:meth:`first`, :meth:`_text`, :meth:`_other`)
    and what its whole response is (:meth:`response`).
    """

    object_name = ""  # a chunk's "object"

    def __init__(self, plan: Plan, texts: TokenText) -> None:
        self.plan = plan
        self.texts = texts
        self._want_lp = plan.logprobs is not None
        self._head = _head(plan, self.object_name)
        self.reasoning = ReasoningCount(plan, texts)
        if plan.include_usage:
            self._head["usage"] = None  # OpenAI: null on every chunk but the usage one
        # 'data: {"id":...,"model":...,"choices":[{"index":' : everything before the index.
        self._prefix = "data: " + sse.dumps(self._head)[:-1] + ',"choices":[{"index":'
        # continuous_usage_stats (vLLM): every chunk's usage is the request's so far, so the
        # prefix is rendered again per write, from the head without its usage.
        self._bare = "data: " + sse.dumps(_head(plan, self.object_name))[:-1]
        if plan.continuous_usage:
            self.usage_so_far(())
        # A choice's text and its finish in one chunk (OpenAI sends a plain answer's finish with
        # its last text, and a tool-calling answer's in a chunk of its own).
        self._merge_finish = plan.tools is None

    def first(self) -> str:
        """What the stream says before any event ("" for nothing)."""
        return ""

    def usage_so_far(self, choices: Sequence[ChoiceText]) -> None:
        """With ``continuous_usage_stats``: the chunks written next carry this usage (the
        prompt's tokens and the tokens ``choices`` have so far)."""
        self._prefix = (self._bare + ',"usage":'
                        + sse.dumps(usage(self.plan, choices, self.reasoning(choices)))
                        + ',"choices":[{"index":')

    def write(self, events: Sequence[Event], choices: Sequence[ChoiceText] | None = None) -> str | None:
        """One read's events as SSE chunks (None when they say nothing). ``choices``: with
        ``continuous_usage_stats``, the request's choices, whose token counts are the usage
        every chunk carries."""
        if choices is not None:
            self.usage_so_far(choices)
        out: list[str] = []
        i, count = 0, len(events)
        while i < count:
            e = events[i]
            kind = type(e)
            if kind is Content:
                finish = None
                if self._merge_finish and i + 1 < count:
                    after = events[i + 1]
                    if type(after) is Finish and after.index == e.index:  # type: ignore[union-attr]
                        finish = after.reason  # type: ignore[union-attr]
                        i += 1
                out.append(self._text(e, finish))  # type: ignore[arg-type]
            elif kind is Finish:
                # Alone: the end of a choice that has no text left to say. With logprobs asked
                # every text chunk has a logprobs object, this one an empty one (tool-call
                # chunks have none: logprobs are not streamed with tools).
                lps = [] if self._want_lp and self._merge_finish else None
                out.append(self._text(Content(e.index, "", lps), e.reason))  # type: ignore[union-attr]
            else:
                chunk = self._other(e)
                if chunk:
                    out.append(chunk)
            i += 1
        if not out:
            return None
        return out[0] if len(out) == 1 else "".join(out)

    def usage_chunk(self, choices: Sequence[ChoiceText]) -> str:
        """The last chunk of a stream that asked for ``include_usage``."""
        return sse.event({**self._head, "choices": [],
                          "usage": usage(self.plan, choices, self.reasoning(choices))})

    def response(self, choices: Sequence[ChoiceText], events: Sequence[Sequence[Event]]) -> dict[str, Any]:
        """The whole (non-streamed) response: ``events[i]`` are what ``choices[i]`` says
        (``ResponseEvents.whole``)."""
        raise NotImplementedError

    def end(self, choices: Sequence[ChoiceText]) -> str:
        """What a stream says after its last event (``choices``: the whole text of each): the
        usage chunk when asked, then ``[DONE]``."""
        return (self.usage_chunk(choices) if self.plan.include_usage else "") + sse.DONE

    def failed(self, err: APIError) -> str:
        """What a stream says when it fails after its first byte (the status line is gone)."""
        return sse.error_event(err)

    def _text(self, e: Content, finish: str | None) -> str:
        raise NotImplementedError

    def _other(self, e: Event) -> str:
        """A chunk for an event that is neither text nor a finish ("": the API has none)."""
        return ""

    def _chunk(self, index: int, fields: str, finish: str | None) -> str:
        """One choice's chunk: ``fields`` are the choice's JSON members after its index."""
        end = "null}]}\n\n" if finish is None else _encode(finish) + "}]}\n\n"
        return self._prefix + str(index) + "," + fields + ',"finish_reason":' + end


class ChatSerializer(Serializer):
    """``/v1/chat/completions``: a role chunk per choice, then deltas of content, reasoning
    (``reasoning_content``) and tool calls (per call, a chunk with its index, id and name and
    arguments "", then the arguments in pieces), then the finish."""

    object_name = "chat.completion.chunk"

    def first(self) -> str:
        return "".join(
            self._chunk(i, '"delta":{"role":"assistant","content":""},"logprobs":null', None)
            for i in range(self.plan.n)
        )

    def _text(self, e: Content, finish: str | None) -> str:
        text = e.text
        delta = '"delta":{"content":' + _encode(text) + "}" if text or finish is None else '"delta":{}'
        if e.logprobs is None:
            return self._chunk(e.index, delta + ',"logprobs":null', finish)
        lp = sse.dumps(chat_logprobs(e.logprobs, self.texts))
        return self._chunk(e.index, delta + ',"logprobs":' + lp, finish)

    def _other(self, e: Event) -> str:
        if type(e) is ToolCallStart:
            call: dict[str, Any] = {"index": e.call, "id": e.id, "type": "function",
                                    "function": {"name": e.name, "arguments": ""}}
        elif type(e) is ToolCallArguments:
            call = {"index": e.call, "function": {"arguments": e.text}}
        elif type(e) is Reasoning:
            return self._chunk(e.index, '"delta":{"reasoning_content":' + _encode(e.text)
                               + '},"logprobs":null', None)
        else:
            return ""
        return self._chunk(e.index, _fields({"delta": {"tool_calls": [call]}, "logprobs": None}), None)

    def response(self, choices: Sequence[ChoiceText], events: Sequence[Sequence[Event]]) -> dict[str, Any]:
        plan = self.plan
        out = []
        for c, choice_events in zip(choices, events):
            said = gather(choice_events)
            message: dict[str, Any] = {"role": "assistant", "content": said.content}
            if said.reasoning is not None:
                message["reasoning_content"] = said.reasoning
            if said.tool_calls:
                message["tool_calls"] = said.tool_calls
            out.append({
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs, self.texts) if self._want_lp else None,
                "finish_reason": said.finish_reason if c.finish_reason is not None else None,
            })
        return {**_head(plan, "chat.completion"), "choices": out,
                "usage": usage(plan, choices, self.reasoning(choices))}


class CompletionSerializer(Serializer):
    """``/v1/completions``: the echoed prompt (if asked), then text deltas with the legacy
    logprobs (``text_offset`` counted across the stream), then the finish. It has no place for
    reasoning or tool calls."""

    object_name = "text_completion"

    def __init__(self, plan: Plan, texts: TokenText) -> None:
        super().__init__(plan, texts)
        # text_offset of each choice's next token
        self._offsets = [len(plan.echo_of(i)) for i in range(plan.num_choices)]

    def first(self) -> str:
        """The echoed prompt of each choice, if any (with logprobs the echo waits for the
        prompt's logprobs, and goes out with the choice's first text)."""
        plan = self.plan
        if plan.echo is None or self._want_lp:
            return ""
        return "".join(
            self._chunk(i, '"text":' + _encode(plan.echo_of(i)) + ',"logprobs":null', None)
            for i in range(plan.num_choices)
            if plan.echo_of(i)
        )

    def _text(self, e: Content, finish: str | None) -> str:
        index, text = e.index, e.text
        if e.logprobs is None:
            return self._chunk(index, '"text":' + _encode(text) + ',"logprobs":null', finish)
        prompt = _echo_logprobs(self.plan, index, e.prompt_logprobs)
        lp = completion_logprobs(e.logprobs, self.texts, self._offsets[index], prompt)
        if prompt is not None:  # the echo goes out with its logprobs, before the text
            text = self.plan.echo_of(index) + text
            self._offsets[index] += sum(len(t) for t in lp["tokens"][len(prompt[0]) :])
        else:
            self._offsets[index] += sum(len(t) for t in lp["tokens"])
        return self._chunk(index, '"text":' + _encode(text) + ',"logprobs":' + sse.dumps(lp), finish)

    def response(self, choices: Sequence[ChoiceText], events: Sequence[Sequence[Event]]) -> dict[str, Any]:
        # The text is each choice's whole text: completions have nothing but content.
        plan = self.plan
        out = []
        for c in choices:
            echo = plan.echo_of(c.index)
            lp = None
            if self._want_lp:
                lp = completion_logprobs(
                    c.logprobs, self.texts, len(echo), _echo_logprobs(plan, c.index, c.prompt_logprobs)
                )
            out.append({"index": c.index, "text": echo + c.text, "logprobs": lp,
                        "finish_reason": c.finish_reason})
        return {**_head(plan, "text_completion"), "choices": out, "usage": usage(plan, choices)}


SERIALIZERS: dict[str, type[Serializer]] = {"chat": ChatSerializer, "completion": CompletionSerializer}


def serializer(plan: Plan, texts: TokenText) -> Serializer:
    """The serializer of the API ``plan`` came in through."""
    return SERIALIZERS[plan.kind](plan, texts)
