"""Request models of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

Strict like api/protocol.py: an unknown field is a 400 naming it (in Anthropic's envelope,
api/errors.py). Content blocks are polymorphic: they are checked one by one in api/messages.py, so
an error names the block (``messages.2.content.0.tool_use_id``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from trio_infer.api.protocol import Priority, Timeout, _Strict


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: no prompt-cache breakpoints here
    citations: list[Any] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Strict):
    """Thinking echoed back from an earlier answer: accepted, left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


BLOCKS: dict[str, type[_Strict]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CustomTool(_Strict):
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: str | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted, changes nothing


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1, lt=2**63)]
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool | None = False
    # Anthropic's ranges; the current SDK sends them through extra_body.
    temperature: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0, lt=2**31)] | None = None
    metadata: Metadata | None = None  # accepted, changes nothing
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, changes nothing
    # Overload extensions and the speculative decoding opt-out, as on chat (api/protocol.py).
    timeout: Timeout | None = None
    priority: Priority | None = None
    speculative: bool | None = None
