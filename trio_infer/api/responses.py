"""OpenAI's Responses API (``POST /v1/responses``), stateless: the request as a chat plan, the
answer as a serializer over the same typed events as chat's (api/events.py).

:func:`plan_responses` translates ``input`` (a string, or items: messages, ``function_call``,
``function_call_output``; ``reasoning`` items are accepted and left out), ``instructions``,
function ``tools`` and ``tool_choice``, ``text.format`` and the sampling fields into a chat request
planned by ``plans.plan_chat`` (api/translate.py), so the template, tools, structured output and
checks are chat's; errors name this API's fields.

The store (api/response_store.py) keeps each response whose request did not say ``store:
false`` (OpenAI's default is to store), with its input items: :func:`conversation` rebuilds what
``previous_response_id`` continues by walking the chain back (the input and output items of each
turn, oldest first; ``instructions`` are not carried over, as OpenAI documents), and
:func:`stored_record` is what the serializer hands the store once the response is done
(completed, incomplete or failed; a stream its client left is not stored). A ``background``
response runs in the server's nursery after its create returns (api/background.py).

:class:`ResponsesSerializer` renders the events as OpenAI does: ``response.created``,
``response.in_progress``, per output item ``response.output_item.added``, (messages and
reasoning) ``response.content_part.added``, text deltas and their ``.done``,
``response.content_part.done``, (function calls) ``response.function_call_arguments.delta`` and
``.done``, ``response.output_item.done``, then ``response.completed`` (``response.incomplete``
when ``max_output_tokens`` cut it; ``response.failed`` on an error mid-stream). Every event has
its ``sequence_number``. The whole (non-streamed) response is built by the same state machine
from the same events, so both say the same.
"""

from __future__ import annotations

import base64
import functools
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Sequence

from trio_infer.api import sse
from trio_infer.api.errors import APIError
from trio_infer.api.events import Content, Event, Finish, Reasoning, ToolCallArguments, ToolCallStart
from trio_infer.api.plans import ModelLimits, Plan
from trio_infer.api.render import Serializer, TokenText
from trio_infer.api.response_store import ResponseStore, StoredResponse
from trio_infer.api.responses_protocol import (
    ITEMS,
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    MessageItem,
    ResponsesRequest,
)
from trio_infer.api.translate import function_tool, message_origin, plan_as_chat, sampling_fields, validated

if TYPE_CHECKING:
    from trio_infer.runtime.text_stream import ChoiceText

log = logging.getLogger(__name__)


# -- request -> plan ------------------------------------------------------------------------------


NO_STORE = ("this server was started with --responses-store off and keeps no responses. Send "
            "the whole conversation in 'input'.")


def _check_fields(req: ResponsesRequest, store: ResponseStore | None) -> None:
    refuse = [
        ("store", req.store is True and store is None, f"'store': true is not supported: {NO_STORE}"),
        ("previous_response_id", req.previous_response_id is not None and store is None,
         f"'previous_response_id' is not supported: {NO_STORE}"),
        ("background", req.background is True and (store is None or req.store is False),
         "'background': true needs the response to be stored (it is retrieved from the store): "
         + ("this server keeps no responses (--responses-store off)." if store is None
            else "send 'store': true or leave it out.")),
        ("truncation", req.truncation == "auto", "'truncation': 'auto' is not supported by this "
         "server; a conversation longer than the context is refused."),
        ("max_tool_calls", req.max_tool_calls is not None, "'max_tool_calls' is not supported by this server."),
        ("top_logprobs", bool(req.top_logprobs), "'top_logprobs' is not supported on /v1/responses by "
         "this server."),
        ("service_tier", req.service_tier not in (None, "auto", "default"),
         "'service_tier' is not supported by this server."),
    ]
    for param, bad, message in refuse:
        if bad:
            raise APIError(400, message, param=param, code="unsupported_parameter")
    for i, value in enumerate(req.include or ()):
        if value not in INCLUDE:
            raise APIError(400, f"'include' value {value[:80]!r} is not supported by this server "
                           f"(it takes {', '.join(map(repr, INCLUDE))}).", param=f"include.{i}",
                           code="unsupported_parameter")


# What ``include`` may ask for. Reasoning's "encrypted" content, which stateless clients (Codex
# with ``store: false``) send back on the next turn: here it is the reasoning text itself,
# base64-encoded and not encrypted (the server has no secret to keep from its own client), and
# sent back it is left out of the prompt like every earlier turn's reasoning.
INCLUDE = ("reasoning.encrypted_content",)


def _item(raw: dict[str, Any], where: str) -> Any:
    """One ``input`` item validated as the model of its ``type``; a 400 naming it otherwise."""
    kind = raw.get("type", "message")
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise APIError(400, f"Input items of type {kind!r} are not supported by this server (it "
                       f"takes {', '.join(ITEMS)}).", param=f"{where}.type", code="unsupported_parameter")
    return validated(model, raw, where)


def _text(parts: str | list[ContentPart], where: str) -> str:
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        value = part.refusal if part.type == "refusal" else part.text
        if value is None:
            field = "refusal" if part.type == "refusal" else "text"
            raise APIError(400, f"Missing required parameter: '{where}.{j}.{field}'.",
                           param=f"{where}.{j}.{field}")
        out.append(value)
    return "".join(out)


def _messages(req: ResponsesRequest, history: Sequence[dict[str, Any]] = (), hosted: str = "refuse"
              ) -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation as chat messages (``history``: the items of the turns it continues,
    :func:`conversation`), and where each came from (``input.3``)."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        origins.append("instructions")
    raws: list[tuple[str, dict[str, Any]]] = [("previous_response_id", item) for item in history]
    if isinstance(req.input, str):
        raws.append(("input", {"type": "message", "role": "user", "content": req.input}))
    else:
        raws.extend((f"input.{i}", raw) for i, raw in enumerate(req.input))
    for where, raw in raws:
        if hosted == "ignore" and raw.get("type") in HOSTED_CALLS:
            continue  # an earlier call of a hosted tool the request may not name any more
        item = _item(raw, where)
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content, where + ".content")})
            origins.append(where)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, where + ".output")})
            origins.append(where)
        # reasoning items: left out of the prompt
    return messages, origins


# OpenAI's hosted tools: they run on OpenAI's side, so a call of one cannot be answered here.
# ``hosted_tools='ignore'`` drops them from the request (and their earlier calls from the input).
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "computer_use",
                          "computer_use_preview", "code_interpreter", "image_generation", "mcp"})
HOSTED_CALLS = frozenset({"web_search_call", "file_search_call", "computer_call",
                          "computer_call_output", "code_interpreter_call", "image_generation_call",
                          "mcp_call", "mcp_list_tools"})


@functools.cache
def _say_dropped(kind: str) -> None:
    log.info("requests' hosted tools of type %r are dropped (hosted_tools='ignore')", kind)


def _tools(req: ResponsesRequest, hosted: str) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, raw in enumerate(req.tools):
        kind = raw.get("type")
        if kind in HOSTED_TOOLS and hosted == "ignore":
            _say_dropped(kind)
            continue
        if kind in HOSTED_TOOLS:
            raise APIError(400, f"Tools of type {kind!r} run on OpenAI's side and cannot run on "
                           "this server; only 'function' tools are served (a server started with "
                           "--hosted-tools ignore drops them).", param=f"tools.{i}.type",
                           code="unsupported_parameter")
        if kind != "function":
            raise APIError(400, f"Tools of type {kind!r} are not supported by this server; only "
                           "'function' tools are.", param=f"tools.{i}.type", code="unsupported_parameter")
        tool = validated(FunctionTool, raw, f"tools.{i}")
        out.append(function_tool(tool.name, tool.description, tool.parameters, tool.strict))
    return out


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise APIError(400, f"'tool_choice' of type {choice.get('type')!r} is not supported by this "
                       "server; send 'none', 'auto', 'required' or a function.", param="tool_choice",
                       code="unsupported_parameter")
    named = validated(FunctionChoice, choice, "tool_choice")
    return {"type": "function", "function": {"name": named.name}}


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        for field in ("name", "schema_", "description", "strict"):
            if getattr(fmt, field) is not None:
                name = field.rstrip("_")
                raise APIError(400, f"'text.format.{name}' is only allowed with type 'json_schema'.",
                               param=f"text.format.{name}")
        return {"type": fmt.type}
    if fmt.name is None:
        raise APIError(400, "Missing required parameter: 'text.format.name'.", param="text.format.name")
    schema: dict[str, Any] = {"name": fmt.name}
    if fmt.schema_ is not None:
        schema["schema"] = fmt.schema_
    if fmt.description is not None:
        schema["description"] = fmt.description
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def _renamer(origins: list[str]):  # type: ignore[no-untyped-def]
    by_message = message_origin(origins, "input")

    def rename(name: str) -> str:
        if name.startswith("response_format"):
            return "text.format.schema" if name.endswith(".schema") else "text.format"
        if name in ("max_tokens", "max_completion_tokens"):
            return "max_output_tokens"
        if name.startswith("tools.") and ".function" in name:
            return name.replace(".function", "", 1)
        return by_message(name)

    return rename


SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed",
            "parallel_tool_calls", "timeout", "priority", "speculative")


def plan_responses(req: ResponsesRequest, tokenizer: Any, limits: ModelLimits, reasoning: str = "auto",
                   thinking_token_budget: int | None = None, store: ResponseStore | None = None,
                   hosted_tools: str = "refuse") -> tuple[Plan, dict[str, Any]]:
    """The request as a chat plan, and what the response object echoes of it. With ``store``,
    ``previous_response_id`` is looked up there (a 404 if it is not). ``hosted_tools``:
    'refuse' OpenAI's hosted tools (a 400 naming the tool) or 'ignore' them."""
    _check_fields(req, store)
    messages, origins = _messages(req, conversation(store, req.previous_response_id), hosted_tools)
    if not messages:
        raise APIError(400, "The input holds no message.", param="input")
    body: dict[str, Any] = {
        "model": req.model if req.model is not None else limits.name,
        "messages": messages,
        "stream": bool(req.stream),
        **sampling_fields(req, SAMPLING),
    }
    tools = _tools(req, hosted_tools)
    if tools is not None:
        body["tools"] = tools
    choice = _tool_choice(req)
    if choice is not None:
        body["tool_choice"] = choice
    fmt = _response_format(req)
    if fmt is not None:
        body["response_format"] = fmt
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    plan = plan_as_chat(body, tokenizer, limits, _renamer(origins), reasoning, thinking_token_budget)
    plan.id = f"resp_{uuid.uuid4().hex}"
    echo = {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.reasoning.summary if req.reasoning else None},
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                            if req.text is not None and req.text.format is not None else {"type": "text"})},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": [
            {"type": "function", "name": t["function"]["name"],
             "description": t["function"].get("description"),
             "parameters": t["function"].get("parameters"), "strict": t["function"].get("strict")}
            for t in (tools or ())
        ],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "user": req.user,
        "store": store is not None and req.store is not False,
        "background": req.background is True,
        "previous_response_id": req.previous_response_id,
    }
    return plan, echo


# -- the store's side -----------------------------------------------------------------------------

_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
              "reasoning": "rs_"}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as the items ``GET /v1/responses/{id}/input_items`` lists: each
    with its ``type`` and an ``id`` (the client's, else a new one), a message's text as parts."""
    raws = ([{"type": "message", "role": "user", "content": req.input}]
            if isinstance(req.input, str) else req.input)
    items = []
    for raw in raws:
        item = {"type": "message", **raw}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if not item.get("id"):
            item["id"] = _ID_PREFIX.get(item["type"], "item_") + _hex()
        items.append(item)
    return items


def conversation(store: ResponseStore | None, previous_id: str | None) -> list[dict[str, Any]]:
    """The items of every turn ``previous_id`` continues, oldest first: each turn's input items,
    then its output items. A 404 names the response that is not stored (never stored, deleted,
    evicted or aged out)."""
    if previous_id is None or store is None:
        return []
    chain: list[StoredResponse] = []
    rid: str | None = previous_id
    while rid is not None:
        record = store.get(rid)
        if record is None:
            message = (f"Previous response with id '{previous_id}' not found." if rid == previous_id
                       else f"Previous response with id '{previous_id}' continues '{rid}', which "
                       "is no longer stored.")
            raise APIError(404, message, param="previous_response_id", code="not_found")
        chain.append(record)
        rid = record.previous_response_id
    items: list[dict[str, Any]] = []
    for record in reversed(chain):
        items.extend(record.input_items)
        items.extend(record.response.get("output", ()))
    return items


def input_items_page(args: Any) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """The query of ``GET /v1/responses/{id}/input_items`` (``limit`` 1-100, default 20;
    ``order`` 'desc', the default, or 'asc'; ``after``: an item id), checked, as the function
    that pages a response's items (an OpenAI list: ``data``, ``first_id``, ``last_id``,
    ``has_more``)."""
    for name in args:
        if name not in ("limit", "order", "after", "include"):
            raise APIError(400, f"Unknown query parameter: {name!r}.", param=name)
    if args.getlist("include"):
        raise APIError(400, "'include' is not supported on input_items by this server.",
                       param="include", code="unsupported_parameter")
    raw_limit = args.get("limit", "20")
    limit = int(raw_limit) if raw_limit.isdigit() else 0
    if not 1 <= limit <= 100:
        raise APIError(400, f"'limit' must be an integer from 1 to 100 (got {raw_limit[:20]!r}).",
                       param="limit")
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"'order' must be 'asc' or 'desc' (got {order[:20]!r}).", param="order")
    after = args.get("after")

    def page(items: list[dict[str, Any]]) -> dict[str, Any]:
        ordered = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item.get("id") for item in ordered]
            if after not in ids:
                raise APIError(400, f"'after': no input item with id {after[:100]!r}.", param="after")
            ordered = ordered[ids.index(after) + 1:]
        data = ordered[:limit]
        return {"object": "list", "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(ordered) > limit}

    return page


def stored_record(req: ResponsesRequest, response: dict[str, Any],
                  items: list[dict[str, Any]] | None = None) -> StoredResponse:
    """What the store keeps of ``response`` (``items``: its input items, if already made: a
    background response is stored several times with the same items)."""
    return StoredResponse(response["id"], response, items if items is not None else input_items(req),
                          req.previous_response_id, time.time())


# -- events -> response ---------------------------------------------------------------------------


def _hex() -> str:
    return uuid.uuid4().hex


class ResponsesSerializer(Serializer):
    """The Responses API's rendering of one choice's events (see the module's docstring)."""

    def __init__(self, plan: Plan, texts: TokenText, echo: dict[str, Any],
                 keep: Callable[[dict[str, Any]], None] | None = None,
                 include: Sequence[str] = ()) -> None:
        super().__init__(plan, texts)
        self.echo = echo
        self.encrypted_reasoning = "reasoning.encrypted_content" in include
        self.keep = keep  # given the finished response object, to store it
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items, finished and open
        self.open: dict[str, Any] | None = None  # the item being said
        self.finish: str | None = None

    # -- the state machine (out is None for a whole response: nothing is rendered) -----------------

    def _event(self, out: list[str] | None, kind: str, **fields: Any) -> None:
        if out is None:
            return
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        out.append("event: " + kind + "\ndata: " + sse.dumps(obj) + "\n\n")

    def _apply(self, e: Event, out: list[str] | None) -> None:
        kind = type(e)
        if kind is Content or kind is Reasoning:
            text = e.text  # type: ignore[union-attr]
            if not text:
                return
            want = "message" if kind is Content else "reasoning"
            item = self.open
            if item is None or item["type"] != want:
                item = self._start(want, out)
            item["_text"].append(text)
            delta = "response.output_text.delta" if want == "message" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if want == "message" else {}
            self._event(out, delta, item_id=item["id"], output_index=item["_index"], content_index=0,
                        delta=text, **extra)
        elif kind is ToolCallStart:
            self._close(out)
            item = {"id": "fc_" + _hex(), "type": "function_call", "status": "in_progress",
                    "call_id": e.id, "name": e.name, "arguments": "",  # type: ignore[union-attr]
                    "_index": len(self.items), "_text": []}
            self.items.append(item)
            self.open = item
            self._event(out, "response.output_item.added", output_index=item["_index"], item=_public(item))
        elif kind is ToolCallArguments:
            item = self.open
            assert item is not None and item["type"] == "function_call"
            item["_text"].append(e.text)  # type: ignore[union-attr]
            self._event(out, "response.function_call_arguments.delta", item_id=item["id"],
                        output_index=item["_index"], delta=e.text)  # type: ignore[union-attr]
        elif kind is Finish:
            self.finish = e.reason  # type: ignore[union-attr]
            self._close(out)

    def _start(self, kind: str, out: list[str] | None) -> dict[str, Any]:
        self._close(out)
        if kind == "message":
            item = {"id": "msg_" + _hex(), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": "rs_" + _hex(), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        item["_index"] = len(self.items)
        item["_text"] = []
        self.items.append(item)
        self.open = item
        self._event(out, "response.output_item.added", output_index=item["_index"], item=_public(item))
        self._event(out, "response.content_part.added", item_id=item["id"], output_index=item["_index"],
                    content_index=0, part=part)
        return item

    def _close(self, out: list[str] | None) -> None:
        item = self.open
        if item is None:
            return
        self.open = None
        text = "".join(item.pop("_text"))
        index = item.pop("_index")
        status = "incomplete" if self.finish == "length" else "completed"
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            item["arguments"] = text
            item["status"] = "completed"
            self._event(out, "response.function_call_arguments.done", **where, arguments=text, name=item["name"])
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            item["status"] = status
            self._event(out, "response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            self._event(out, "response.content_part.done", **where, content_index=0, part=part)
        else:
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            item["status"] = status
            if self.encrypted_reasoning:
                item["encrypted_content"] = base64.b64encode(text.encode()).decode()
            self._event(out, "response.reasoning_text.done", **where, content_index=0, text=text)
            self._event(out, "response.content_part.done", **where, content_index=0, part=part)
        self._event(out, "response.output_item.done", output_index=index, item=item)

    def _response(self, status: str, usage: dict[str, Any] | None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        plan = self.plan
        return {
            "id": plan.id,
            "object": "response",
            "created_at": plan.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": plan.model,
            "output": [_public(item) for item in self.items],
            "service_tier": "default",
            "top_logprobs": 0,
            "truncation": "disabled",
            "usage": usage,
            **self.echo,
        }

    def _usage(self, choices: Sequence[ChoiceText]) -> dict[str, Any]:
        prompt = len(self.plan.prompts[0])
        completion = sum(c.num_tokens for c in choices)
        cached = choices[0].num_cached_tokens if choices else 0  # served by the prefix cache
        out: dict[str, Any] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                               "output_tokens": completion}
        # A plain model thinks 0 tokens; a reasoning model's are counted, or left out when they
        # cannot be told (render.ReasoningCount).
        thought = self.reasoning(choices) if self.plan.reasoning is not None else 0
        if thought is not None:
            out["output_tokens_details"] = {"reasoning_tokens": thought}
        out["total_tokens"] = prompt + completion
        return out

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    # -- the Serializer interface -------------------------------------------------------------------

    def first(self) -> str:
        out: list[str] = []
        start = self._response("in_progress", None)
        self._event(out, "response.created", response=start)
        self._event(out, "response.in_progress", response=start)
        return "".join(out)

    def write(self, events: Sequence[Event]) -> str | None:
        out: list[str] = []
        for e in events:
            self._apply(e, out)
        return "".join(out) if out else None

    def end(self, choices: Sequence[ChoiceText]) -> str:
        out: list[str] = []
        self._close(out)
        status = self._status()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        self._event(out, kind, response=self._done(self._response(status, self._usage(choices))))
        return "".join(out)

    def failed(self, err: APIError) -> str:
        out: list[str] = []
        error = {"code": err.code or "server_error", "message": err.message}
        self._event(out, "response.failed", response=self._done(self._response("failed", None, error)))
        return "".join(out)

    def response(self, choices: Sequence[ChoiceText], events: Sequence[Sequence[Event]]) -> dict[str, Any]:
        for e in events[0]:
            self._apply(e, None)
        self._close(None)
        return self._done(self._response(self._status(), self._usage(choices)))

    def queued(self, status: str = "queued") -> dict[str, Any]:
        """A background response before anything is said: "queued" (what its create answers),
        then "in_progress" once it started."""
        return self._response(status, None)

    def snapshot(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response as it stands, ended with ``status`` (a background response cancelled or
        failed outside its stream), handed to the store like a finished one."""
        self._close(None)
        return self._done(self._response(status, None, error))

    def _done(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.keep is not None:
            self.keep(response)
        return response


def _public(item: dict[str, Any]) -> dict[str, Any]:
    """An output item without the serializer's own bookkeeping (``_text``, ``_index``)."""
    return {k: v for k, v in item.items() if not k.startswith("_")}


def make_serializer(echo: dict[str, Any], keep: Callable[[dict[str, Any]], None] | None = None,  # type: ignore[no-untyped-def]
                    include: Sequence[str] = ()):
    """What routes._serve takes: ``(plan, texts) -> ResponsesSerializer``."""
    return functools.partial(ResponsesSerializer, echo=echo, keep=keep, include=include)
