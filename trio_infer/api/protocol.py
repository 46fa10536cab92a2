"""Request models of the OpenAI-compatible API, and the rules for fields we do not support.

Validation is strict (``"10"`` is not an integer, ``1`` is not a boolean) and complete: a request
that passes here and the checks in :mod:`trio_infer.api.plans` is one the engine can serve, so
nothing can fail "later" for a reason the client could have been told up front.

A field of the OpenAI API that this server does not implement (``functions``, ``prediction``,
...) is rejected with a 400 naming it, unless its value asks for nothing (``null``, an empty list,
``false`` for ``store``): clients commonly send those. Fields that change nothing about the output
by definition (``user``, ``metadata``) are accepted. The vLLM extensions real clients send
(``stream_options.continuous_usage_stats``, ``chat_template_kwargs``, ``min_tokens``,
``guided_regex``, ...) are implemented as vLLM implements them. A field nobody defines follows
the ``unknown_fields`` setting (:func:`check_fields`): ``reject`` (400 naming it, as OpenAI) or
``warn`` (logged once per field name, then ignored, as vLLM).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trio_infer.api.errors import APIError

log = logging.getLogger(__name__)

# A value in the tuple means "not asking for the feature": such a field is dropped, not rejected.
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "prediction": (None,),
    "reasoning_effort": (None,),
}
UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_COMMON,
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
}
UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_COMMON,
    "suffix": (None, ""),
}


UnknownFields = Literal["reject", "warn"]

# Field names already logged by the ``warn`` policy (once per name per process: a client that
# sends one on every request does not flood the log). Bounded: a client inventing names cannot
# grow it without limit.
_WARNED: set[str] = set()
_MAX_WARNED = 1024


def check_fields(
    data: dict[str, Any],
    model: type[BaseModel],
    unsupported: dict[str, tuple],
    unknown: UnknownFields = "reject",
) -> dict:
    """Drop unsupported fields that ask for nothing; reject the others with a 400 naming them.

    Unknown fields (no OpenAI field, no extension this server implements) follow ``unknown``:
    ``reject`` leaves them in place for the model to reject (``Unrecognized request argument
    supplied``, a 400 naming the field, as OpenAI); ``warn`` logs each field name once and drops
    it (vLLM's behaviour). Only top-level fields: a misspelt nested one is always a 400.
    """
    out = dict(data)
    for key, value in data.items():
        if key in model.model_fields:
            continue
        if key not in unsupported:
            if unknown == "warn":
                del out[key]
                if key not in _WARNED and len(_WARNED) < _MAX_WARNED:
                    _WARNED.add(key)
                    log.warning("ignoring the unknown request field %r (unknown_fields=warn; "
                                "logged once per field name)", key[:100])
            continue
        if any(type(value) is type(v) and value == v for v in unsupported[key]) or value is None:
            del out[key]
            continue
        raise APIError(
            400,
            f"'{key}' is not supported by this server.",
            param=key,
            code="unsupported_parameter",
        )
    return out


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    # vLLM's extension (guidellm sends it): usage on every chunk, not only in the last one.
    continuous_usage_stats: bool | None = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """A message of the conversation. An assistant message may carry ``tool_calls`` (then its
    content may be null); a ``tool`` message answers one of them (``tool_call_id``). Which
    combinations make sense is checked in one place, ``api/tools.py``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None  # what the SDK echoes back of an assistant message; asks for nothing
    # A reasoning model's thinking, as this server (and vLLM) answered it: clients send the
    # message back as they got it. Given to templates that know tools (Qwen3's shows the thinking
    # of the assistant turns after the last user message, drops the others).
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


# -- structured output and tools (api/structured.py and api/tools.py give them meaning) ----------


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (one of them): output matching a JSON schema, a regular
    expression, one of the given strings, or a Lark grammar (api/structured.py)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


LogitBias = dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                 Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]]


# A request's deadline in seconds (a week at most: a bigger number is a mistake) and its
# priority (bounded so it stays an int32 on the wire).
Timeout = Annotated[float, Field(gt=0, le=7 * 86400, allow_inf_nan=False)]
Priority = Annotated[int, Field(ge=-(2**31), lt=2**31)]


class _SamplingFields(_Strict):
    """Sampling and stopping fields shared by both endpoints. ``None`` means "the default"."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Integers are bounded where they can grow: a 4,300-digit max_tokens plus the prompt's length
    # made a number Python refuses to format (ValueError in the 400's message: a 500).
    max_tokens: Annotated[int, Field(ge=1, lt=2**63)] | None = None
    n: Annotated[int, Field(ge=1, lt=2**63)] | None = 1
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    # Bounded: an int past 2**64 passed validation and then broke the encoder of the pipe to
    # the worker (OverflowError), which failed every running request (docs/testing.md).
    top_k: Annotated[int, Field(ge=-1, lt=2**31)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=64)] | None = None
    ignore_eos: bool | None = False
    user: str | None = None  # accepted: identifies the end user, changes nothing
    # OpenAI's logit_bias: token id (as a string) -> bias in [-100, 100], added to its logit.
    logit_bias: Annotated[LogitBias, Field(max_length=1024)] | None = None
    # vLLM's extensions (sampling and stopping).
    min_tokens: Annotated[int, Field(ge=0, lt=2**31)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # vLLM's structured outputs: the older guided_* fields and the newer structured_outputs.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Overload (trio-infer's extensions, docs/lifecycle.md): the request's deadline in seconds
    # (overrides X-Request-Timeout and request_timeout_s), and vLLM's priority (lower first).
    timeout: Timeout | None = None
    priority: Priority | None = None
    # trio-infer's extension: false keeps this request out of speculative decoding (one token
    # per step) on a server that speculates (`serve --speculative`); the output is the same.
    speculative: bool | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, lt=2**63)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    metadata: dict[str, str] | None = None  # accepted: stored nowhere, changes nothing
    # vLLM's extensions of the chat template: variables for it (``enable_thinking``, ...), no
    # generation prompt, or the last (assistant) message continued rather than closed.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    # Reasoning models (vLLM's name): the most tokens the model may think; then its thinking is
    # closed (the close tag is the next token) and it answers.
    thinking_token_budget: Annotated[int, Field(ge=0, lt=2**31)] | None = None


class CompletionRequest(_SamplingFields):
    # A string or token ids, or a batch of them (a list of strings or of token-id lists): each
    # prompt gets n choices (plans.py).
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 generates nothing: with echo, the prompt alone (and its logprobs, if asked).
    max_tokens: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    # As in chat requests (vLLM's /tokenize takes them too).
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
