"""Translation between the OpenAI API and the runtime: requests in, response objects out.

Nothing here talks to the engine or awaits anything. :func:`plan_chat` and
:func:`plan_completion` turn a validated request into a :class:`Plan` (prompt ids and one
:class:`~trio_infer.engine.params.SamplingParams` per choice) or raise an
:class:`~trio_infer.api.errors.APIError`: every check a client can fail happens here, before
anything is scheduled or any byte of a stream is sent (gap G4). :class:`ChoiceState` turns the
runtime's outputs for one choice into text (incremental detokenization, stop strings, logprobs);
it belongs to the request's own task and dies with it (gap G3). The ``*_chunk``/``*_response``
functions build the exact OpenAI objects.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from trio_infer.api import sse
from trio_infer.api.errors import APIError
from trio_infer.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from trio_infer.engine.engine import RequestOutput
from trio_infer.engine.params import SamplingParams
from trio_infer.engine.sampler import TokenLogprob
from trio_infer.runtime.detokenizer import IncrementalDetokenizer
from trio_infer.runtime.stop_strings import StopStringMatcher

# JSON has no -inf; OpenAI reports "practically impossible" as this.
_MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    max_n: int


@dataclass
class Plan:
    """A validated request, ready for ``engine.generate(plan.prompt_ids, plan.params)``."""

    kind: Literal["chat", "completion"]
    id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: list[SamplingParams]
    stop: list[str]
    logprobs: int | None  # None: no logprobs; k: the chosen token and k alternatives
    stream: bool
    include_usage: bool
    echo_text: str | None = None  # completions with echo: the prompt, prepended to each choice

    @property
    def n(self) -> int:
        return len(self.params)


# -- request -> plan ------------------------------------------------------------------------------


def check_model(requested: str | None, limits: ModelLimits) -> None:
    if requested is not None and requested != limits.name:
        raise APIError(
            404,
            f"The model `{requested}` does not exist. This server serves `{limits.name}`.",
            param="model",
            code="model_not_found",
        )


def render_chat(tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    """Messages -> prompt ids through the tokenizer's own chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "This model has no chat template; use /v1/completions with a plain prompt.",
            param="messages",
        )
    conversation = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # a template may raise for conversations it does not support
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
    # The template already wrote every special token it wants (BOS included).
    return list(tokenizer.encode(text, add_special_tokens=False))


def completion_prompt_ids(tokenizer: Any, prompt: Any, vocab_size: int) -> tuple[list[int], str | None]:
    """The completions ``prompt`` -> (ids, the prompt as text when it was given as text)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(
                400,
                f"Batched prompts are not supported: send one prompt per request (got {len(prompt)}).",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True)), prompt
    check_token_ids(prompt, vocab_size, "prompt")
    return list(prompt), None


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400, f"Token id {bad[0]} is out of range: ids must be in [0, {vocab_size}).", param=param
        )


def check_context(num_prompt: int, max_tokens: int | None, limits: ModelLimits, param: str) -> None:
    """G4: a request that cannot fit is refused before anything is scheduled."""
    if num_prompt == 0:
        raise APIError(400, "The prompt is empty: it must have at least one token.", param=param)
    limit = limits.max_model_len
    if num_prompt >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{num_prompt} tokens, which leaves no room for a completion. Please reduce the "
            f"length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _sampling(
    req: ChatCompletionRequest | CompletionRequest,
    n: int,
    max_tokens: int | None,
    logprobs: int | None,
    limits: ModelLimits,
) -> list[SamplingParams]:
    stop_token_ids = tuple(req.stop_token_ids or ())
    check_token_ids(stop_token_ids, limits.vocab_size, "stop_token_ids")
    if logprobs is not None and logprobs > limits.vocab_size:
        param = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise APIError(400, f"At most {limits.vocab_size} alternatives exist for each token.", param=param)
    common = dict(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),  # -1 and 0 both disable it
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
    )
    # Choice i of a seeded request uses seed + i: the choices differ, and the whole request
    # replays exactly with the same seed.
    seeds = [None if req.seed is None else (req.seed + i) % 2**64 for i in range(n)]
    try:
        return [SamplingParams(seed=s, **common) for s in seeds]
    except ValueError as exc:  # the pydantic bounds should already exclude this
        raise APIError(400, str(exc)) from None


def _common_checks(req: ChatCompletionRequest | CompletionRequest, limits: ModelLimits) -> int:
    check_model(req.model, limits)
    n = 1 if req.n is None else req.n
    if n > limits.max_n:
        raise APIError(400, f"'n' must be at most {limits.max_n} on this server (got {n}).", param="n")
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    if any(s == "" for s in req.stop_list()):
        raise APIError(400, "Stop strings must not be empty.", param="stop")
    return n


def plan_chat(req: ChatCompletionRequest, tokenizer: Any, limits: ModelLimits) -> Plan:
    n = _common_checks(req, limits)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(
            400, "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs"
        )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt_ids = render_chat(tokenizer, req.messages)
    check_context(len(prompt_ids), max_tokens, limits, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Plan(
        kind="chat",
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=limits.name,
        prompt_ids=prompt_ids,
        params=_sampling(req, n, max_tokens, logprobs, limits),
        stop=req.stop_list(),
        logprobs=logprobs,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def plan_completion(req: CompletionRequest, tokenizer: Any, limits: ModelLimits) -> Plan:
    n = _common_checks(req, limits)
    if req.best_of is not None and req.best_of != n:
        raise APIError(
            400, "'best_of' different from 'n' is not supported by this server.", param="best_of"
        )
    if req.echo and req.logprobs is not None:
        raise APIError(
            400,
            "'echo' together with 'logprobs' is not supported: this server does not compute "
            "prompt logprobs.",
            param="echo",
        )
    if isinstance(req.prompt, list) and not req.prompt:
        raise APIError(400, "The prompt is empty: it must have at least one token.", param="prompt")
    prompt_ids, prompt_text = completion_prompt_ids(tokenizer, req.prompt, limits.vocab_size)
    check_context(len(prompt_ids), req.max_tokens, limits, "prompt")
    echo_text = None
    if req.echo:
        echo_text = prompt_text if prompt_text is not None else tokenizer.decode(prompt_ids)
    return Plan(
        kind="completion",
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=limits.name,
        prompt_ids=prompt_ids,
        params=_sampling(req, n, req.max_tokens, req.logprobs, limits),
        stop=req.stop_list(),
        logprobs=req.logprobs,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        echo_text=echo_text,
    )


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


# -- outputs -> text, per choice ------------------------------------------------------------------


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None

    def merge(self, later: "Delta") -> "Delta":
        """This delta followed by ``later``, as one (stream_interval holds deltas back)."""
        return Delta(self.text + later.text, self.logprobs + later.logprobs, later.finish_reason)


@dataclass
class ChoiceState:
    """One choice's text: detokenizer, stop strings, counts. Owned by the request's task."""

    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    finish_reason: str | None = None
    num_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def consume(self, outputs: Sequence[RequestOutput]) -> Delta | None:
        """Fold this step's outputs for the choice into a delta; None once it has finished (a
        stop string may end a choice before the engine does: later outputs are dropped)."""
        if self.finished:
            return None
        text_parts: list[str] = []
        lps: list[TokenLogprob] = []
        finish: str | None = None
        for out in outputs:
            ids = out.token_ids
            lp = out.logprobs
            self.num_tokens += len(ids)
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
        return Delta(text, lps, finish)


def new_choices(plan: Plan, tokenizer: Any) -> list[ChoiceState]:
    return [
        ChoiceState(i, IncrementalDetokenizer(tokenizer, plan.prompt_ids), StopStringMatcher(plan.stop))
        for i in range(plan.n)
    ]


def group_by_choice(outputs: Sequence[RequestOutput]) -> dict[int, list[RequestOutput]]:
    grouped: dict[int, list[RequestOutput]] = {}
    for out in outputs:
        grouped.setdefault(out.uid[1], []).append(out)
    return grouped


# -- response objects -----------------------------------------------------------------------------


def usage(plan: Plan, choices: Sequence[ChoiceState]) -> dict[str, int]:
    prompt = len(plan.prompt_ids)
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
    entries: Sequence[TokenLogprob], texts: TokenText, offset: int
) -> dict[str, Any]:
    """The legacy completions format; ``offset`` is where the first token's text starts."""
    tokens, token_lps, tops, offsets = [], [], [], []
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


def chat_response(plan: Plan, choices: Sequence[ChoiceState], texts: TokenText) -> dict[str, Any]:
    return {
        **_head(plan, "chat.completion"),
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs, texts) if plan.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(plan, choices),
    }


def completion_response(plan: Plan, choices: Sequence[ChoiceState], texts: TokenText) -> dict[str, Any]:
    echo = plan.echo_text or ""
    return {
        **_head(plan, "text_completion"),
        "choices": [
            {
                "index": c.index,
                "text": echo + c.text,
                "logprobs": (
                    completion_logprobs(c.logprobs, texts, len(echo))
                    if plan.logprobs is not None
                    else None
                ),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(plan, choices),
    }


class ChunkWriter:
    """Renders the chunks of one streamed response (chat or completions) as SSE events.

    The per-token path does no dict building and no ``json.dumps`` of a whole chunk: the constant
    head of every chunk (id, object, created, model, usage null) is rendered once per request, and
    only the text is JSON-encoded per chunk (with the encoder ``json.dumps(ensure_ascii=False)``
    uses, so the bytes are exactly what :func:`sse.event` of the equivalent object gives). Chunks
    with logprobs, and the rare ones, go through the generic ``sse.event``.
    """

    def __init__(self, plan: Plan, texts: TokenText) -> None:
        self.plan = plan
        self.texts = texts
        self._chat = plan.kind == "chat"
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        self._head = _head(plan, obj)
        if plan.include_usage:
            self._head["usage"] = None  # OpenAI: null on every chunk but the usage one
        self._offsets = [len(plan.echo_text or "")] * plan.n  # completions text_offset
        # 'data: {"id":...,"model":...,"choices":[{"index":' : everything before the index.
        head = sse.dumps(self._head)
        self._prefix = 'data: ' + head[:-1] + ',"choices":[{"index":'
        self._want_lp = plan.logprobs is not None

    def first(self) -> list[str]:
        """Chat: the role chunk of each choice. Completions: the echoed prompt, if any."""
        if self._chat:
            return [
                sse.event(self._chunk(i, {"delta": {"role": "assistant", "content": ""}, "logprobs": None}))
                for i in range(self.plan.n)
            ]
        if self.plan.echo_text:
            return [
                sse.event(self._chunk(i, {"text": self.plan.echo_text, "logprobs": None}))
                for i in range(self.plan.n)
            ]
        return []

    def delta(self, index: int, delta: Delta) -> str | None:
        """The event for one choice's delta, or None when there is nothing to say yet."""
        text = delta.text
        finish = delta.finish_reason
        if self._want_lp:
            if not text and finish is None and not delta.logprobs:
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

    def _delta_object(self, index: int, delta: Delta) -> dict[str, Any]:
        want_lp = self._want_lp
        if self._chat:
            body: dict[str, Any] = {
                "delta": {"content": delta.text} if delta.text or delta.finish_reason is None else {},
                "logprobs": chat_logprobs(delta.logprobs, self.texts) if want_lp else None,
            }
        else:
            lp = None
            if want_lp:
                lp = completion_logprobs(delta.logprobs, self.texts, self._offsets[index])
                self._offsets[index] += sum(len(t) for t in lp["tokens"])
            body = {"text": delta.text, "logprobs": lp}
        return self._chunk(index, body, delta.finish_reason)

    def usage_chunk(self, choices: Sequence[ChoiceState]) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": usage(self.plan, choices)}

    def _chunk(self, index: int, body: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**self._head, "choices": [{"index": index, **body, "finish_reason": finish}]}
