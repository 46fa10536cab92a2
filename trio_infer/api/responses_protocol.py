"""Request models of OpenAI's Responses API (``POST /v1/responses``).

Strict like api/protocol.py: an unknown field is a 400 naming it. ``input`` items and ``tools``
are polymorphic (their ``type`` says which, and a message item may omit it): they are checked one
by one in api/responses.py, so an error names the item (``input.3.call_id``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from trio_infer.api.protocol import Priority, Timeout, _Strict


class ContentPart(_Strict):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # what the SDK echoes back of an output_text part
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None
    end_turn: bool | None = None  # what Codex echoes of an assistant message; changes nothing


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Strict):
    """A reasoning item echoed back from an earlier answer: accepted, and left out of the prompt
    (chat templates drop earlier turns' thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


ITEMS: dict[str, type[_Strict]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, changes nothing


class ReasoningConfig(_Strict):
    effort: str | None = None  # accepted, changes nothing
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # no obfuscation padding is sent either way


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, lt=2**63)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # The store's fields and what is refused of the rest: checked in api/responses.py.
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    max_tool_calls: int | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    service_tier: str | None = None
    reasoning: ReasoningConfig | None = None
    # Accepted, change nothing.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Sampling extensions (vLLM accepts them on /v1/responses too).
    top_k: Annotated[int, Field(ge=-1, lt=2**31)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    # Overload extensions and the speculative decoding opt-out, as on chat (api/protocol.py).
    timeout: Timeout | None = None
    priority: Priority | None = None
    speculative: bool | None = None
