"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): the request
as a chat plan, the answer as a serializer over the same typed events as chat's (api/events.py).

:func:`plan_messages` translates ``system`` (a string or text blocks), messages of text /
``tool_use`` / ``tool_result`` blocks (``thinking`` blocks echoed back are left out), ``tools``
(``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``;
``disable_parallel_tool_use``), ``stop_sequences``, ``max_tokens``, ``temperature`` / ``top_p`` /
``top_k`` and ``output_config.format`` (a JSON schema) into a chat request planned by
``plans.plan_chat`` (api/translate.py); errors name this API's fields and come in Anthropic's
envelope (api/errors.py).

:class:`MessagesSerializer` renders the events as Anthropic does: ``message_start``, ``ping``,
per content block (text, thinking, tool_use) ``content_block_start``, its deltas (``text_delta``,
``thinking_delta``, ``input_json_delta``) and ``content_block_stop``, then ``message_delta`` with
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence`` and which, ``tool_use``) and the
usage, then ``message_stop``; an error mid-stream is an ``error`` event. The whole (non-streamed)
message is built by the same state machine from the same events.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Sequence

from trio_infer.api import sse
from trio_infer.api.anthropic_protocol import (
    BLOCKS,
    CountTokensRequest,
    CustomTool,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trio_infer.api.errors import APIError, anthropic_error_body
from trio_infer.api.events import Content, Event, Finish, Reasoning, ToolCallArguments, ToolCallStart
from trio_infer.api.plans import ModelLimits, Plan
from trio_infer.api.protocol import ChatCompletionRequest
from trio_infer.api.render import Serializer, TokenText
from trio_infer.api.translate import function_tool, message_origin, plan_as_chat, sampling_fields, validated

if TYPE_CHECKING:
    from trio_infer.runtime.text_stream import ChoiceText


# -- request -> plan ------------------------------------------------------------------------------


def _system(req: CountTokensRequest) -> str | None:
    if req.system is None or isinstance(req.system, str):
        return req.system or None
    return "\n".join(block.text for block in req.system) or None


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    text = content if isinstance(content, str) else "\n".join(b.text for b in content or ())
    return f"Error: {text}" if block.is_error else text


def _messages(req: CountTokensRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation as chat messages, and where each came from (``messages.3``)."""
    out: list[dict[str, Any]] = []
    origins: list[str] = []
    system = _system(req)
    if system is not None:
        out.append({"role": "system", "content": system})
        origins.append("system")
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            origins.append(where)
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, raw in enumerate(message.content):
            at = f"{where}.content.{j}"
            kind = raw.get("type")
            model = BLOCKS.get(kind) if isinstance(kind, str) else None
            if model is None:
                raise APIError(400, f"Content blocks of type {kind!r} are not supported by this server "
                               f"(it takes {', '.join(BLOCKS)}).", param=f"{at}.type")
            block = validated(model, raw, at)
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise APIError(400, "'tool_use' blocks belong in assistant messages.", param=f"{at}.type")
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name,
                    "arguments": json.dumps(block.input, ensure_ascii=False, separators=(",", ":"))}})
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise APIError(400, "'tool_result' blocks belong in user messages.", param=f"{at}.type")
                if texts:  # text before the result: its own user turn, in order
                    out.append({"role": "user", "content": "\n".join(texts)})
                    origins.append(where)
                    texts = []
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)})
                origins.append(at)
            # thinking blocks: left out of the prompt
        if calls:
            out.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls})
            origins.append(where)
        elif texts or not message.content:
            out.append({"role": message.role, "content": "\n".join(texts)})
            origins.append(where)
    return out, origins


def _tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, raw in enumerate(req.tools):
        kind = raw.get("type")
        if kind not in (None, "custom"):
            raise APIError(400, f"Tools of type {kind!r} (Anthropic's server tools) are not supported "
                           "by this server; only custom tools are.", param=f"tools.{i}.type")
        tool = validated(CustomTool, raw, f"tools.{i}")
        out.append(function_tool(tool.name, tool.description, tool.input_schema, tool.strict))
    return out


def _tool_choice(req: CountTokensRequest, body: dict[str, Any]) -> None:
    choice = req.tool_choice
    if choice is None:
        return
    if choice.type == "tool":
        if choice.name is None:
            raise APIError(400, "Missing required parameter: 'tool_choice.name'.", param="tool_choice.name")
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        if choice.name is not None:
            raise APIError(400, "'tool_choice.name' is only allowed with type 'tool'.", param="tool_choice.name")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False


def _renamer(origins: list[str]):  # type: ignore[no-untyped-def]
    by_message = message_origin(origins, "messages")

    def rename(name: str) -> str:
        if name.startswith("response_format"):
            return "output_config.format.schema" if name.endswith(".schema") else "output_config.format"
        if name in ("max_tokens", "max_completion_tokens"):
            return "max_tokens"
        if name == "stop":
            return "stop_sequences"
        if name.startswith("tools.") and name.endswith(".function.parameters"):
            return name.replace(".function.parameters", ".input_schema")
        if name.startswith("tools.") and ".function" in name:
            return name.replace(".function", "", 1)
        return by_message(name)

    return rename


def _chat_body(req: CountTokensRequest, stream: bool = False) -> tuple[dict[str, Any], list[str]]:
    messages, origins = _messages(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": stream}
    tools = _tools(req)
    if tools is not None:
        body["tools"] = tools
    _tool_choice(req, body)
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        # Anthropic's structured outputs take closed objects only: strict, as OpenAI's.
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.schema_, "strict": True}}
    # Thinking on or off, where the chat path lets the template know (enable_thinking, as Qwen3's
    # templates name it); otherwise the model thinks as its template has it.
    if req.thinking is not None and "chat_template_kwargs" in ChatCompletionRequest.model_fields:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    _prefill(req, messages, origins, body)
    return body, origins


def _prefill(req: CountTokensRequest, messages: list[dict[str, Any]], origins: list[str],
             body: dict[str, Any]) -> None:
    """Anthropic's prefill: a conversation that ends with the assistant's text is an answer
    begun, which the model continues (the template leaves that turn open: vLLM's
    ``continue_final_message``); the answer holds the continuation only. As Anthropic, the
    prefill may not end in whitespace (400 naming it). An empty last assistant message asks
    for a plain answer, and one with tool calls is a turn that ended."""
    last = len(req.messages) - 1
    if req.messages[last].role != "assistant" or origins[-1] != f"messages.{last}":
        return
    message = messages[-1]
    if message.get("tool_calls"):
        return
    text = message["content"]
    if not text:
        del messages[-1], origins[-1]
        return
    if text != text.rstrip():
        raise APIError(400, "The final assistant content cannot end with trailing whitespace.",
                       param=f"messages.{last}.content")
    body["add_generation_prompt"] = False
    body["continue_final_message"] = True


def plan_messages(req: MessagesRequest, tokenizer: Any, limits: ModelLimits,
                  reasoning: str = "auto", thinking_token_budget: int | None = None) -> Plan:
    body, origins = _chat_body(req, bool(req.stream))
    body["max_completion_tokens"] = req.max_tokens
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    body.update(sampling_fields(req, ("temperature", "top_p", "top_k", "timeout", "priority", "speculative")))
    # max_tokens is a cap, as Anthropic and llama-server have it: clients send a large default
    # (Claude Code: 32000) whatever the model's context; the answer ends with "max_tokens" there.
    plan = plan_as_chat(body, tokenizer, limits, _renamer(origins), reasoning, thinking_token_budget,
                        max_tokens_is_cap=True)
    plan.id = f"msg_{uuid.uuid4().hex}"
    return plan


def count_message_tokens(req: CountTokensRequest, tokenizer: Any, limits: ModelLimits) -> int:
    """The prompt's length in tokens: exactly the prompt ``/v1/messages`` would run."""
    body, origins = _chat_body(req)
    return len(plan_as_chat(body, tokenizer, limits, _renamer(origins)).prompts[0])


# -- events -> message ----------------------------------------------------------------------------

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _event(kind: str, obj: dict[str, Any]) -> str:
    return "event: " + kind + "\ndata: " + sse.dumps(obj) + "\n\n"


class MessagesSerializer(Serializer):
    """Anthropic's rendering of one choice's events (see the module's docstring)."""

    def __init__(self, plan: Plan, texts: TokenText) -> None:
        super().__init__(plan, texts)
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.finish: str | None = None

    def _apply(self, e: Event, out: list[str] | None) -> None:
        kind = type(e)
        if kind is Content or kind is Reasoning:
            text = e.text  # type: ignore[union-attr]
            if not text:
                return
            want = "text" if kind is Content else "thinking"
            block = self.open
            if block is None or block["type"] != want:
                block = self._start({"type": "text", "text": ""} if want == "text"
                                    else {"type": "thinking", "thinking": "", "signature": ""}, out)
            block["_text"].append(text)
            if out is not None:
                delta = {"type": "text_delta", "text": text} if want == "text" else \
                    {"type": "thinking_delta", "thinking": text}
                out.append(_event("content_block_delta", {"type": "content_block_delta",
                                                          "index": block["_index"], "delta": delta}))
        elif kind is ToolCallStart:
            self._start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}}, out)  # type: ignore[union-attr]
        elif kind is ToolCallArguments:
            block = self.open
            assert block is not None and block["type"] == "tool_use"
            block["_text"].append(e.text)  # type: ignore[union-attr]
            if out is not None:
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": block["_index"],
                    "delta": {"type": "input_json_delta", "partial_json": e.text}}))  # type: ignore[union-attr]
        elif kind is Finish:
            self.finish = e.reason  # type: ignore[union-attr]
            self._close(out)

    def _start(self, block: dict[str, Any], out: list[str] | None) -> dict[str, Any]:
        self._close(out)
        if out is not None:
            out.append(_event("content_block_start", {"type": "content_block_start",
                                                      "index": len(self.blocks), "content_block": block}))
        block = {**block, "_index": len(self.blocks), "_text": []}
        self.blocks.append(block)
        self.open = block
        return block

    def _close(self, out: list[str] | None) -> None:
        block = self.open
        if block is None:
            return
        self.open = None
        text = "".join(block.pop("_text"))
        index = block.pop("_index")
        if block["type"] == "text":
            block["text"] = text
        elif block["type"] == "thinking":
            block["thinking"] = text
        else:
            try:
                value = json.loads(text) if text else {}
            except ValueError:
                value = None
            block["input"] = value if isinstance(value, dict) else {}
        if out is not None:
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))

    def _stop(self, choices: Sequence[ChoiceText]) -> tuple[str, str | None]:
        matched = choices[0].stops.matched if choices else None
        if self.finish == "stop" and matched is not None:
            return "stop_sequence", matched
        return _STOP_REASONS.get(self.finish or "stop", "end_turn"), None

    def first(self) -> str:
        message = {"id": self.plan.id, "type": "message", "role": "assistant", "model": self.plan.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(self.plan.prompts[0]), "output_tokens": 0}}
        return _event("message_start", {"type": "message_start", "message": message}) + \
            _event("ping", {"type": "ping"})

    def write(self, events: Sequence[Event]) -> str | None:
        out: list[str] = []
        for e in events:
            self._apply(e, out)
        return "".join(out) if out else None

    def end(self, choices: Sequence[ChoiceText]) -> str:
        out: list[str] = []
        self._close(out)
        reason, sequence = self._stop(choices)
        out.append(_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": sum(c.num_tokens for c in choices)}}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return "".join(out)

    def failed(self, err: APIError) -> str:
        return _event("error", anthropic_error_body(err.status, err.message, err.param, err.code))

    def response(self, choices: Sequence[ChoiceText], events: Sequence[Sequence[Event]]) -> dict[str, Any]:
        for e in events[0]:
            self._apply(e, None)
        self._close(None)
        reason, sequence = self._stop(choices)
        return {
            "id": self.plan.id, "type": "message", "role": "assistant", "model": self.plan.model,
            "content": self.blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": len(self.plan.prompts[0]),
                      "output_tokens": sum(c.num_tokens for c in choices)},
        }
