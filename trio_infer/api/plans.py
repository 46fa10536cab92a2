"""Validation: an OpenAI request in, a :class:`Plan` out, or an :class:`APIError`.

Every check a client can fail happens here, once, before anything is scheduled or any byte of a
stream is sent (gap G4): the model name, ``n``, the context length, token ids, the sampling
parameters, ``response_format`` and the tools (``api/structured.py``, ``api/tools.py``). A
completions batch (several prompts) is checked prompt by prompt, all of them before anything
runs: one bad prompt refuses the whole request, naming it. Nothing here talks to the
engine or awaits anything.
"""

from __future__ import annotations

import inspect
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from trio_infer.api.errors import APIError
from trio_infer.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from trio_infer.api.structured import after_thinking, check_grammar, extension_grammar, response_format_grammar
from trio_infer.api.tools import HERMES, ToolPlan, conversation, plan_tools, template_style
from trio_infer.runtime.detokenizer import encoder
from trio_infer.wire import SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    max_n: int
    # Most sequences (prompts x n) one completions batch may hold: more would never be admitted
    # (the waiting queue holds this many). None: no limit.
    max_batch_sequences: int | None = None


@dataclass
class Plan:
    """A validated request, ready for ``open_batch_text_stream(engine, tokenizer, plan.prompts,
    plan.params, plan.stop)``: each prompt gets ``n`` choices, and choice ``j * n + i`` is choice
    i of prompt j (a chat request, and most completions, have one prompt)."""

    kind: Literal["chat", "completion"]
    id: str
    created: int
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]  # the n choices of each prompt
    stop: list[str]
    logprobs: int | None  # None: no logprobs; k: the chosen token and k alternatives
    stream: bool
    include_usage: bool
    # Completions with echo: each prompt as text, prepended to its choices' text. With logprobs
    # too, each choice's logprobs start with its prompt's (the first one null).
    echo: list[str] | None = None
    # A chat request that may call tools: its output is parsed into tool calls (api/tools.py).
    tools: ToolPlan | None = None
    # stream_options.continuous_usage_stats (vLLM): usage in every chunk of the stream.
    continuous_usage: bool = False
    # How the text is made (runtime/text_stream.py): special tokens dropped from it, and the
    # stop string that ended a choice kept at its end (vLLM's include_stop_str_in_output).
    skip_special_tokens: bool = True
    include_stop_str: bool = False
    # A chat request to a reasoning model: its thinking is split out of the answer (response_events.py: ThinkSplit).
    reasoning: ReasoningPlan | None = None
    # The request's 'timeout' field: its deadline in seconds (routes.py adds X-Request-Timeout,
    # the runtime request_timeout_s). Its 'priority' is in each SamplingParams.
    timeout_s: float | None = None

    @property
    def n(self) -> int:
        return len(self.params)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * len(self.params)

    def prompt_of(self, index: int) -> int:
        """The prompt choice ``index`` continues."""
        return index // len(self.params)

    def echo_of(self, index: int) -> str:
        return self.echo[index // len(self.params)] if self.echo is not None else ""


@dataclass(frozen=True)
class ReasoningPlan:
    """Where a reasoning model's thinking is in its output: between ``open`` and ``close``;
    ``thinking`` when the prompt left the model thinking already (it ends with an open tag, as
    the templates of thinking-only models do), so the output starts inside the thinking."""

    thinking: bool
    open: str = "<think>"
    close: str = "</think>"


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_thinks(tokenizer: Any) -> bool:
    """Whether the chat template thinks in ``<think>...</think>`` (Qwen3 and kin): the template
    writes the tags and the tokenizer has each of them as one token."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or THINK_CLOSE not in template:
        return False
    # One token each (a lookup: get_vocab() would build the whole vocabulary per request).
    unknown = (None, getattr(tokenizer, "unk_token_id", None))
    try:
        ids = tokenizer.convert_tokens_to_ids([THINK_OPEN, THINK_CLOSE])
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return all(i not in unknown for i in ids)


def reasoning_plan(prompt_text: str, tokenizer: Any, mode: str) -> ReasoningPlan | None:
    """The reasoning split of a chat request whose prompt is ``prompt_text`` (``mode``: the
    ``reasoning`` setting), or None when the answer is all content."""
    if mode == "off" or (mode == "auto" and not template_thinks(tokenizer)):
        return None
    return ReasoningPlan(thinking=prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE))


# -- request -> plan ------------------------------------------------------------------------------


def check_model(requested: str | None, limits: ModelLimits) -> None:
    if requested is not None and requested != limits.name:
        raise APIError(
            404,
            f"The model `{requested}` does not exist. This server serves `{limits.name}`.",
            param="model",
            code="model_not_found",
        )


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
    tools: ToolPlan | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Messages (and the tools a request may call) -> prompt ids through the tokenizer's own chat
    template, or the generic rendering of tools for a template that knows none (api/tools.py)."""
    return encoder(tokenizer)(render_chat_text(
        tokenizer, messages, add_generation_prompt, tools, template_kwargs, continue_final_message
    ))


# Keyword arguments of apply_chat_template that chat_template_kwargs may not set: they are
# fields of the request (or this server's business), not variables of the template. Its own
# named parameters are added per tokenizer class (_reserved).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens",
})
_RESERVED_BY_CLASS: dict[type, frozenset[str]] = {}


def _reserved(tokenizer: Any) -> frozenset[str]:
    cls = type(tokenizer)
    found = _RESERVED_BY_CLASS.get(cls)
    if found is None:
        try:
            names = inspect.signature(tokenizer.apply_chat_template).parameters
            named = {n for n, p in names.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        except (TypeError, ValueError):
            named = set()
        found = _RESERVED_BY_CLASS[cls] = _RESERVED_TEMPLATE_KWARGS | named
    return found


def render_chat_text(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
    tools: ToolPlan | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """:func:`render_chat`'s prompt as text (the template writes every special token it wants,
    BOS included). ``template_kwargs``: variables for the template (vLLM's
    ``chat_template_kwargs``, e.g. ``enable_thinking``); ``continue_final_message``: the last
    message (an assistant's) is left open for the model to continue."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "This model has no chat template; use /v1/completions with a plain prompt.",
            param="messages",
        )
    style = tools.style if tools is not None else template_style(tokenizer)
    turns = conversation(messages, style, tools)
    extra: dict[str, Any] = {}
    for key in template_kwargs or {}:
        if key in _reserved(tokenizer):
            raise APIError(400, f"'chat_template_kwargs' may not set '{key}'.",
                           param=f"chat_template_kwargs.{key}")
    extra.update(template_kwargs or {})
    if tools is not None and tools.style == HERMES:
        extra["tools"] = tools.tools
    if continue_final_message:
        if add_generation_prompt:
            raise APIError(400, "'continue_final_message' and 'add_generation_prompt' cannot both "
                           "be true; send 'add_generation_prompt': false.", param="continue_final_message")
        if messages[-1].role != "assistant":
            raise APIError(400, "'continue_final_message' needs the last message to be the "
                           "assistant's.", param="continue_final_message")
        extra["continue_final_message"] = True
    try:
        return tokenizer.apply_chat_template(
            turns, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as exc:  # a template may raise for conversations it does not support
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None


def split_prompts(prompt: Any) -> list[Any]:
    """The completions ``prompt`` as a list of prompts, each a string or a list of token ids: a
    string or a list of ids is one prompt; a list of strings or of id lists is a batch."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "The prompt is empty: it must have at least one token.", param="prompt")
    if isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def completion_prompt_ids(
    tokenizer: Any, prompt: str | list[int], vocab_size: int, param: str = "prompt", where: str = ""
) -> tuple[list[int], str | None]:
    """One completions prompt -> (ids, the prompt as text when it was given as text)."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True)), prompt
    check_token_ids(prompt, vocab_size, param, where)
    return list(prompt), None


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str, where: str = "") -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        place = f" in {where}" if where else ""
        raise APIError(
            400, f"Token id {bad[0]}{place} is out of range: ids must be in [0, {vocab_size}).",
            param=param,
        )


def check_context(
    num_prompt: int, max_tokens: int | None, limits: ModelLimits, param: str, which: str = "your prompt"
) -> None:
    """G4: a request that cannot fit is refused before anything is scheduled. ``which`` names
    the prompt in the message (a batch has several)."""
    if num_prompt == 0:
        raise APIError(
            400, f"{which[0].upper()}{which[1:]} is empty: it must have at least one token.", param=param
        )
    limit = limits.max_model_len
    if num_prompt >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, {which} has "
            f"{num_prompt} tokens, which leaves no room for a completion. Please reduce the "
            f"length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in {which}, {max_tokens} for the "
            f"completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def capped_max_tokens(num_prompt: int, max_tokens: int | None, limits: ModelLimits) -> int | None:
    """``max_tokens`` as a cap: at most the room the context leaves after the prompt, so a
    client's large default (Claude Code sends 32000) runs until the context is full and ends
    with the API's "length" reason. A prompt that fills the context is still refused
    (:func:`check_context`)."""
    if max_tokens is None:
        return None
    return min(max_tokens, max(1, limits.max_model_len - num_prompt))


def _sampling(
    req: ChatCompletionRequest | CompletionRequest,
    n: int,
    max_tokens: int | None,
    logprobs: int | None,
    limits: ModelLimits,
    prompt_logprobs: int | None = None,
    grammar: str | None = None,
    thinking: tuple[int | None, tuple[int, ...]] = (None, ()),
) -> list[SamplingParams]:
    stop_token_ids = tuple(req.stop_token_ids or ())
    check_token_ids(stop_token_ids, limits.vocab_size, "stop_token_ids")
    bias = tuple(sorted((int(k), v) for k, v in (req.logit_bias or {}).items()))
    check_token_ids([t for t, _ in bias], limits.vocab_size, "logit_bias")
    if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
        raise APIError(400, f"'min_tokens' ({req.min_tokens}) must be at most 'max_tokens' "
                       f"({max_tokens}).", param="min_tokens")
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
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
        min_tokens=req.min_tokens or 0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=tuple((t, b) for t, b in bias if b != 0),
        thinking_budget=thinking[0],
        think_ids=thinking[1] if thinking[0] is not None else (),
        priority=req.priority or 0,
        speculative=req.speculative is not False,
    )
    # Choice i of a seeded request uses seed + i: the choices differ, and the whole request
    # replays exactly with the same seed. (In a batch, choice i of every prompt: a prompt gives
    # the same choices in a batch as alone.)
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


def _output_grammar(req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The grammar of ``response_format`` or of vLLM's structured-output fields (at most one)."""
    grammar = response_format_grammar(req.response_format)
    extension = extension_grammar(req)
    if grammar is not None and extension is not None:
        raise APIError(400, "Send one of 'response_format' and vLLM's structured-output fields, "
                       "not both.", param="response_format")
    return grammar if grammar is not None else extension


def _text_options(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    # As vLLM: continuous_usage_stats adds usage to every chunk of a stream that includes usage.
    options = req.stream_options
    include_usage = bool(options is not None and options.include_usage)
    return dict(
        include_usage=include_usage,
        continuous_usage=include_usage and bool(options is not None and options.continuous_usage_stats),
        skip_special_tokens=req.skip_special_tokens is not False,
        include_stop_str=bool(req.include_stop_str_in_output),
    )


def plan_chat(
    req: ChatCompletionRequest,
    tokenizer: Any,
    limits: ModelLimits,
    reasoning: str = "auto",
    thinking_token_budget: int | None = None,
    max_tokens_is_cap: bool = False,
) -> Plan:
    """``reasoning``, ``thinking_token_budget``: the settings of those names (split a reasoning
    model's thinking out; the server's default budget). ``max_tokens_is_cap``: the API's
    ``max_tokens`` is a cap (Anthropic's, llama-server's), not a promise (OpenAI's and vLLM's:
    prompt + max_tokens past the context is a 400): see :func:`capped_max_tokens`."""
    n = _common_checks(req, limits)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(
            400, "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs"
        )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tools = plan_tools(req, template_style(tokenizer))
    grammar = _output_grammar(req)
    if grammar is not None and tools is not None:
        raise APIError(
            400, "'response_format' cannot be combined with tools the model may call on this "
            "server; send 'tool_choice': 'none' or no 'response_format'.", param="response_format",
        )
    if tools is not None:
        grammar = tools.grammar
        if req.stream and req.logprobs:
            raise APIError(
                400, "'logprobs' cannot be streamed for a request whose answer may be a tool "
                "call on this server; send 'stream': false, or 'tool_choice': 'none'.",
                param="logprobs",
            )
    prompt_text = render_chat_text(
        tokenizer, req.messages, req.add_generation_prompt is not False, tools,
        req.chat_template_kwargs, bool(req.continue_final_message),
    )
    prompt_ids = encoder(tokenizer)(prompt_text)
    if max_tokens_is_cap:
        max_tokens = capped_max_tokens(len(prompt_ids), max_tokens, limits)
    check_context(len(prompt_ids), max_tokens, limits, "messages")
    think = reasoning_plan(prompt_text, tokenizer, reasoning)
    if (think is not None and grammar is not None and template_thinks(tokenizer)
            and think.close not in grammar):
        # Structured output and tool calls constrain the answer, not the thinking before it
        # (unless the grammar names the tags itself: then it constrains the thinking too).
        grammar = after_thinking(grammar, think.thinking, think.open, think.close)
        check_grammar(grammar, "response_format", code="invalid_grammar")
    budget = req.thinking_token_budget if req.thinking_token_budget is not None else thinking_token_budget
    think_ids: tuple[int, ...] = ()
    if budget is not None and think is not None and template_thinks(tokenizer):
        think_ids = tuple(tokenizer.convert_tokens_to_ids([think.open, think.close]))
    elif req.thinking_token_budget is not None:
        raise APIError(400, "'thinking_token_budget' needs a reasoning model whose think tags are "
                       "tokens; this one has none.", param="thinking_token_budget")
    else:
        budget = None
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Plan(
        kind="chat",
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=limits.name,
        prompts=[prompt_ids],
        params=_sampling(req, n, max_tokens, logprobs, limits, grammar=grammar,
                         thinking=(budget, think_ids)),
        stop=req.stop_list(),
        logprobs=logprobs,
        stream=bool(req.stream),
        tools=tools,
        reasoning=think,
        timeout_s=req.timeout,
        **_text_options(req),
    )


def plan_completion(req: CompletionRequest, tokenizer: Any, limits: ModelLimits) -> Plan:
    n = _common_checks(req, limits)
    if req.best_of is not None and req.best_of != n:
        raise APIError(
            400, "'best_of' different from 'n' is not supported by this server.", param="best_of"
        )
    grammar = _output_grammar(req)
    raw = split_prompts(req.prompt)
    batch = len(raw) > 1
    cap = limits.max_batch_sequences
    if batch and cap is not None and len(raw) * n > cap:
        raise APIError(
            400,
            f"This batch holds {len(raw)} prompts x n={n} = {len(raw) * n} sequences; this server "
            f"queues at most {cap} at a time. Split it into smaller requests.",
            param="prompt",
        )
    prompts: list[list[int]] = []
    texts: list[str | None] = []
    for j, one in enumerate(raw):
        param, which = (f"prompt.{j}", f"prompt {j} of the batch") if batch else ("prompt", "your prompt")
        ids, text = completion_prompt_ids(tokenizer, one, limits.vocab_size, param, which if batch else "")
        check_context(len(ids), req.max_tokens, limits, param, which)
        prompts.append(ids)
        texts.append(text)
    echo = None
    if req.echo:
        echo = [t if t is not None else tokenizer.decode(ids) for t, ids in zip(texts, prompts)]
    # With echo, logprobs cover the prompt too: computed from the prefill (the first one null).
    prompt_logprobs = req.logprobs if req.echo else None
    return Plan(
        kind="completion",
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=limits.name,
        prompts=prompts,
        params=_sampling(req, n, req.max_tokens, req.logprobs, limits, prompt_logprobs, grammar),
        stop=req.stop_list(),
        logprobs=req.logprobs,
        stream=bool(req.stream),
        echo=echo,
        timeout_s=req.timeout,
        **_text_options(req),
    )
