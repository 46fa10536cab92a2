"""Rendering: a request's text (``runtime.text_stream``) as OpenAI response objects and SSE.

The ``*_response`` functions build whole responses; :class:`ChunkWriter` the chunks of a streamed
one. :class:`TokenText` gives a token's text and bytes for logprobs.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from trio_infer.api import sse
from trio_infer.api.plans import Plan
from trio_infer.api.tools import CallStream
from trio_infer.runtime.text_stream import ChoiceDelta, ChoiceText
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


def usage(plan: Plan, choices: Sequence[ChoiceText]) -> dict[str, int]:
    prompt = sum(len(p) for p in plan.prompts)  # once per prompt, whatever n
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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


def chat_message(plan: Plan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A choice's message and finish reason: with tools, the calls parsed out of the text
    (``finish_reason`` "tool_calls" when the model ended on calls)."""
    if plan.tools is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = plan.tools.parse(text)
    if not parsed.tool_calls:
        return {"role": "assistant", "content": parsed.content}, finish_reason
    message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def chat_response(plan: Plan, choices: Sequence[ChoiceText], texts: TokenText) -> dict[str, Any]:
    out = []
    for c in choices:
        message, finish = chat_message(plan, c.text, c.finish_reason)
        out.append({
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c.logprobs, texts) if plan.logprobs is not None else None,
            "finish_reason": finish,
        })
    return {**_head(plan, "chat.completion"), "choices": out, "usage": usage(plan, choices)}


def _echo_logprobs(plan: Plan, index: int, prompt_lps: Sequence[TokenLogprob | None] | None):  # type: ignore[no-untyped-def]
    """The prompt part of choice ``index``'s logprobs (echo with logprobs), or None."""
    if plan.echo is None or prompt_lps is None:
        return None
    return plan.prompts[plan.prompt_of(index)], prompt_lps


def completion_response(plan: Plan, choices: Sequence[ChoiceText], texts: TokenText) -> dict[str, Any]:
    out = []
    for c in choices:
        echo = plan.echo_of(c.index)
        lp = None
        if plan.logprobs is not None:
            lp = completion_logprobs(
                c.logprobs, texts, len(echo), _echo_logprobs(plan, c.index, c.prompt_logprobs)
            )
        out.append({"index": c.index, "text": echo + c.text, "logprobs": lp,
                    "finish_reason": c.finish_reason})
    return {**_head(plan, "text_completion"), "choices": out, "usage": usage(plan, choices)}


class ChunkWriter:
    """Renders the chunks of one streamed response (chat or completions) as SSE events.

    The per-token path does no dict building and no ``json.dumps`` of a whole chunk: the constant
    head of every chunk (id, object, created, model, usage null) is rendered once per request, and
    only the text is JSON-encoded per chunk (with the encoder ``json.dumps(ensure_ascii=False)``
    uses, so the bytes are exactly what :func:`sse.event` of the equivalent object gives). Chunks
    with logprobs, and the rare ones, go through the generic ``sse.event``.

    A request that may call tools streams calls as OpenAI does: per call, a chunk with its index,
    id and name (arguments ""), then the arguments in pieces as they are generated, then the
    finish reason. When the grammar constrains the answer, a :class:`~trio_infer.api.tools.
    CallStream` reads the calls as the text comes; hermes ``auto`` (unconstrained: a call may
    start anywhere in the text) is held until its choice ends, then written the same way.
    """

    def __init__(self, plan: Plan, texts: TokenText) -> None:
        self.plan = plan
        self.texts = texts
        self._chat = plan.kind == "chat"
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        self._head = _head(plan, obj)
        if plan.include_usage:
            self._head["usage"] = None  # OpenAI: null on every chunk but the usage one
        # completions text_offset of each choice's next token
        self._offsets = [len(plan.echo_of(i)) for i in range(plan.num_choices)]
        # 'data: {"id":...,"model":...,"choices":[{"index":' : everything before the index.
        head = sse.dumps(self._head)
        self._prefix = 'data: ' + head[:-1] + ',"choices":[{"index":'
        self._want_lp = plan.logprobs is not None
        # With tools: each choice's call scanner (or its text so far, held); None otherwise.
        self._calls: dict[int, CallStream | list[str]] | None = {} if plan.tools is not None else None

    def first(self) -> list[str]:
        """Chat: the role chunk of each choice. Completions: the echoed prompt, if any (with
        logprobs the echo waits for the prompt's logprobs, and goes out with the first delta)."""
        if self._chat:
            return [
                sse.event(self._chunk(i, {"delta": {"role": "assistant", "content": ""}, "logprobs": None}))
                for i in range(self.plan.n)
            ]
        if self.plan.echo is not None and not self._want_lp:
            return [
                sse.event(self._chunk(i, {"text": self.plan.echo_of(i), "logprobs": None}))
                for i in range(self.plan.num_choices)
                if self.plan.echo_of(i)
            ]
        return []

    def delta(self, delta: ChoiceDelta) -> str | None:
        """The event for one choice's delta, or None when there is nothing to say yet."""
        if self._calls is not None:
            return self._tool_delta(self._calls, delta)
        index = delta.index
        text = delta.text
        finish = delta.finish_reason
        if self._want_lp:
            if not text and finish is None and not delta.logprobs and delta.prompt_logprobs is None:
                return None  # nothing to say yet (text held back)
            return sse.event(self._delta_object(index, delta))
        if not text and finish is None:
            return None
        # The fast path: the same bytes as sse.event(self._delta_object(index, delta)).
        if self._chat:
            content = '{"content":' + sse.encode_str(text) + "}" if text or finish is None else "{}"
            body = ',"delta":' + content + ',"logprobs":null,"finish_reason":'
        else:
            body = ',"text":' + sse.encode_str(text) + ',"logprobs":null,"finish_reason":'
        end = "null}]}\n\n" if finish is None else sse.encode_str(finish) + "}]}\n\n"
        return self._prefix + str(index) + body + end

    def _tool_delta(self, calls: dict[int, CallStream | list[str]], delta: ChoiceDelta) -> str | None:
        index, finish = delta.index, delta.finish_reason
        assert self.plan.tools is not None
        scanner = calls.get(index)
        if scanner is None:
            scanner = calls[index] = self.plan.tools.stream() or []
        events: list[dict[str, Any]] = []
        if isinstance(scanner, CallStream):
            for event in scanner.feed(delta.text):
                events.append(self._call_chunk(index, event))
            if finish is not None:
                content = scanner.rest()
                if content:
                    events.append(self._chunk(index, {"delta": {"content": content}, "logprobs": None}))
                if scanner.num_calls and finish == "stop":
                    finish = "tool_calls"
        else:  # held until the end, then parsed whole
            scanner.append(delta.text)
            if finish is None:
                return None
            message, finish = chat_message(self.plan, "".join(scanner), finish)
            if message["content"]:
                events.append(self._chunk(index, {"delta": {"content": message["content"]}, "logprobs": None}))
            for k, call in enumerate(message.get("tool_calls", ())):
                fn = call["function"]
                events.append(self._call_chunk(index, ("call", k, call["id"], fn["name"])))
                events.extend(self._call_chunk(index, ("arguments", k, piece)) for piece in _pieces(fn["arguments"]))
        if finish is not None:
            del calls[index]
            events.append(self._chunk(index, {"delta": {}, "logprobs": None}, finish))
        return "".join(sse.event(e) for e in events) or None

    def _call_chunk(self, index: int, event: tuple) -> dict[str, Any]:
        """A ``delta.tool_calls`` chunk: ("call", k, id, name) or ("arguments", k, piece)."""
        if event[0] == "call":
            _, k, call_id, name = event
            call = {"index": k, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        else:
            _, k, piece = event
            call = {"index": k, "function": {"arguments": piece}}
        return self._chunk(index, {"delta": {"tool_calls": [call]}, "logprobs": None})

    def _delta_object(self, index: int, delta: ChoiceDelta) -> dict[str, Any]:
        want_lp = self._want_lp
        if self._chat:
            body: dict[str, Any] = {
                "delta": {"content": delta.text} if delta.text or delta.finish_reason is None else {},
                "logprobs": chat_logprobs(delta.logprobs, self.texts) if want_lp else None,
            }
        else:
            lp = None
            text = delta.text
            if want_lp:
                prompt = _echo_logprobs(self.plan, index, delta.prompt_logprobs)
                lp = completion_logprobs(delta.logprobs, self.texts, self._offsets[index], prompt)
                if prompt is not None:  # the echo goes out with its logprobs, before the text
                    text = self.plan.echo_of(index) + text
                    self._offsets[index] += sum(len(t) for t in lp["tokens"][len(prompt[0]) :])
                else:
                    self._offsets[index] += sum(len(t) for t in lp["tokens"])
            body = {"text": text, "logprobs": lp}
        return self._chunk(index, body, delta.finish_reason)

    def usage_chunk(self, choices: Sequence[ChoiceText]) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": usage(self.plan, choices)}

    def _chunk(self, index: int, body: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**self._head, "choices": [{"index": index, **body, "finish_reason": finish}]}


def _pieces(text: str, size: int = 32) -> list[str]:
    """A call's arguments in pieces, as OpenAI streams them (the client joins them)."""
    return [text[i : i + size] for i in range(0, len(text), size)]
