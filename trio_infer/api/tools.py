"""Tool calling: the tools in the prompt, the grammar that enforces a call, the call parsed back.

Two styles, chosen by the model's chat template:

* ``hermes``: the template knows tools and writes calls as ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` (Qwen2.5/3, Hermes and their kin). The tools go to the
  template (``apply_chat_template(tools=...)``), and so do assistant ``tool_calls`` and ``tool``
  messages. ``auto`` is left to the model (its calls are parsed out of the text); ``required``
  and a named function are enforced by a grammar: one call (or several, with
  ``parallel_tool_calls``) whose arguments match the function's parameter schema.
* ``json``: any other template (the default SmolLM2's knows no tools). As llama.cpp's server
  does, the tool definitions go into a system message and the answer is one JSON object the
  grammar enforces: ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` and, for ``auto``,
  ``{"response": "..."}`` as the other choice. History renders as text: an assistant's calls as
  that JSON, a tool's result as a user message that says which call it answers.

Every check of ``tools``, ``tool_choice`` and the tool fields of messages is here, made before
anything runs (400 naming the field). Grammars are llguidance Lark grammars in which each call is
its own ``%json`` schema, so a parameter schema's ``$defs`` resolve as they would alone.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from trio_infer.api.errors import APIError
from trio_infer.api.events import Event, ToolCallArguments, ToolCallStart
from trio_infer.api.protocol import ChatCompletionRequest, ChatMessage, Tool
from trio_infer.api.structured import (
    JSON_OPTIONS,
    check_grammar,
    closed_schema,
    json_schema_grammar,
    lark_source,
)

HERMES = "hermes"
JSON = "json"

_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_style(tokenizer: Any) -> str:
    """``hermes`` when the chat template renders tools and ``<tool_call>`` blocks, else ``json``."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template)
    return HERMES if "<tool_call>" in template and "tools" in template else JSON


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI tool calls: id, type, function {name, arguments}


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one request that may call them (``tool_choice`` other than ``none``)."""

    style: str
    tools: list[dict[str, Any]]  # OpenAI tool objects, for the template
    choice: str  # "auto", "required", or the name of the function to call
    parallel: bool
    grammar: str | None  # None: the output is not constrained (hermes ``auto``)

    def stream(self, index: int = 0) -> CallStream | None:
        """A scanner that turns choice ``index``'s text into call events as it arrives, or None
        when the output is not constrained (hermes ``auto``: only the whole text tells)."""
        return CallStream(self.style, index) if self.grammar is not None else None

    def parse(self, text: str) -> ParsedOutput:
        """The model's text as content and tool calls. Text that holds no well-formed call is
        content, as it is."""
        if self.style == HERMES:
            return _parse_hermes(text)
        return _parse_json(text)


# -- checks ---------------------------------------------------------------------------------------


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """The tool fields of messages: calls only from the assistant, results only in ``tool``
    messages that name their call, and content everywhere else."""
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise APIError(400, "Only assistant messages may have 'tool_calls'.",
                           param=f"messages.{i}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise APIError(400, "Only tool messages may have 'tool_call_id'.",
                           param=f"messages.{i}.tool_call_id")
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(400, "A tool message needs the 'tool_call_id' of the call it answers.",
                           param=f"messages.{i}.tool_call_id")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, "Missing required parameter: 'content'.", param=f"messages.{i}.content")


def plan_tools(req: ChatCompletionRequest, style: str) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice``; None when the request calls no tool."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):  # "auto" without tools asks for nothing
            raise APIError(400, "'tool_choice' requires 'tools'.", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"Two tools are named '{name}'.", param=f"tools.{i}.function.name")
    schemas = [call_schema(t) for t in tools]
    if choice is None or choice in ("auto", "none"):
        name = "auto"
    elif choice == "required":
        name = "required"
    else:
        name = choice.function.name
        if name not in names:
            raise APIError(400, f"'tool_choice' names the function '{name}', which is not among the "
                           f"tools ({', '.join(names)}).", param="tool_choice")
    parallel = req.parallel_tool_calls is not False
    # Every tool's parameters are checked, whatever tool_choice (``none`` too, as OpenAI does): in
    # one grammar of all the calls, tool by tool only to name the one at fault.
    try:
        check_grammar(lark_source(_lark(style, schemas, parallel, False)), "tools")
    except APIError:
        for i, tool in enumerate(tools):
            json_schema_grammar(_parameters(tool), f"tools.{i}.function.parameters")
        raise
    if choice == "none":
        return None
    if name not in ("auto", "required"):
        # A named function is called once (vLLM's named tool choice): a small model allowed to
        # repeat the call repeats it until max_tokens, and the answer never ends as a call.
        schemas = [schemas[names.index(name)]]
        parallel = False
    grammar = None
    if not (style == HERMES and name == "auto"):  # hermes ``auto`` is left to the model
        grammar = lark_source(_lark(style, schemas, parallel, name == "auto"))
    return ToolPlan(style, [t.model_dump(exclude_none=True) for t in tools], name, parallel, grammar)


def _parameters(tool: Tool) -> dict[str, Any]:
    return dict(tool.function.parameters or {"type": "object", "properties": {}})


def call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``: its name, then its arguments, closed to the
    properties the parameters name (``structured.closed_schema``: unless they say
    ``additionalProperties``). The parameters' ``$defs`` move to the call's root, where their
    ``#/$defs/...`` references point."""
    params = closed_schema(_parameters(tool))
    defs = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    return {
        **defs,
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark(style: str, schemas: list[dict[str, Any]], parallel: bool, auto: bool) -> str:
    # compact JSON inside each call too (what api/structured.py asks of every schema)
    compact = [{**s, "x-guidance": JSON_OPTIONS} for s in schemas]
    rules = [f"c{i}: %json{json.dumps(s, ensure_ascii=False)}" for i, s in enumerate(compact)]
    one = " | ".join(f"c{i}" for i in range(len(schemas)))
    if style == HERMES:
        call = 'call: "<tool_call>\\n" (' + one + ') "\\n</tool_call>"'
        calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
        return "\n".join(["start: calls", calls, call, *rules])
    # json: the envelope is compact JSON around the calls (each call its own schema)
    calls = 'calls: "{\\"tool_calls\\":[" call ("," call)* "]}"' if parallel else \
        'calls: "{\\"tool_calls\\":[" call "]}"'
    lines = ["start: calls | response" if auto else "start: calls", calls, f"call: {one}", *rules]
    if auto:
        response = {"type": "object", "properties": {"response": {"type": "string"}},
                    "required": ["response"], "additionalProperties": False}
        lines.append(f"response: %json{json.dumps({**response, 'x-guidance': JSON_OPTIONS})}")
    return "\n".join(lines)


# -- the prompt -----------------------------------------------------------------------------------


def conversation(messages: Sequence[ChatMessage], style: str, plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (see the module's docstring)."""
    check_messages(messages)
    names = {c.id: c.function.name for m in messages for c in (m.tool_calls or ())}
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if style == HERMES:
            entry: dict[str, Any] = {"role": role, "content": m.text()}
            if m.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in m.tool_calls
                ]
            if m.reasoning_content is not None:  # a reasoning model's template may show it
                entry["reasoning_content"] = m.reasoning_content
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
                if m.tool_call_id in names:
                    entry["name"] = names[m.tool_call_id]
            out.append(entry)
        elif m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                     for c in m.tool_calls]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False, separators=(",", ":"))
            out.append({"role": "assistant", "content": (m.text() + "\n" + text) if m.text() else text})
        elif role == "tool":
            name = names.get(m.tool_call_id or "", "a tool")
            out.append({"role": "user",
                        "content": f"Result of the call {m.tool_call_id} of {name}:\n{m.text()}"})
        else:
            out.append({"role": role, "content": m.text()})
    if plan is not None and style == JSON:
        text = _json_instructions(plan)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _json_instructions(plan: ToolPlan) -> str:
    tools = [
        {k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")}
        for t in plan.tools
    ]
    lines = [
        "You can call these tools (their arguments follow each one's JSON schema 'parameters'):",
        json.dumps(tools, ensure_ascii=False),
        'To call tools, answer with one JSON object: {"tool_calls": [{"name": "<tool name>", '
        '"arguments": {...}}]}' + ("." if plan.parallel else ", with exactly one call."),
    ]
    if plan.choice == "auto":
        lines.append('To answer without a tool, answer {"response": "<your answer>"}.')
    elif plan.choice != "required":
        lines.append(f"Call the tool '{plan.choice}'.")
    return "\n".join(lines)


def _arguments(text: str) -> Any:
    """Arguments as templates want them: the object when the JSON text is one, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


# -- the output -----------------------------------------------------------------------------------


def _call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": text}}


def _parse_hermes(text: str) -> ParsedOutput:
    calls = []
    for block in _CALL_BLOCK.findall(text):
        try:
            call = _call(json.loads(block))
        except ValueError:
            call = None
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
    if not calls:
        return ParsedOutput(text, [])
    content = _CALL_BLOCK.sub("", text).strip()
    return ParsedOutput(content or None, calls)


def _parse_json(text: str) -> ParsedOutput:
    try:
        obj = json.loads(text)
    except ValueError:
        return ParsedOutput(text, [])
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        calls = [_call(c) for c in obj["tool_calls"]]
        if calls and all(c is not None for c in calls):
            return ParsedOutput(None, calls)  # type: ignore[arg-type]
    if isinstance(obj, dict) and set(obj) == {"response"} and isinstance(obj["response"], str):
        return ParsedOutput(obj["response"], [])
    return ParsedOutput(text, [])


# -- the output, as it streams ----------------------------------------------------------------------

# What the grammar makes the model write around each call (compact JSON inside, see _lark).
_OPEN = {JSON: '{"tool_calls":[', HERMES: "<tool_call>\n"}
_NEXT = {JSON: ",", HERMES: "\n</tool_call>\n<tool_call>\n"}
_NAME = '{"name":"'
_ARGUMENTS = '","arguments":'


class CallStream:
    """Tool calls out of a constrained answer as it streams (``ToolPlan.stream``).

    The grammar fixes everything around the calls, so this is not a JSON parser: it matches the
    fixed text, reads each call's name, then passes the arguments through as they come, counting
    brackets outside strings to see where they end. ``feed(text)`` returns the events of choice
    ``index`` that can be said now (``api/events.py``): a :class:`ToolCallStart` when a call's
    name is complete, :class:`ToolCallArguments` after. A ``json``-style answer that is not a
    call (``{"response": ...}``) is held and parsed whole by ``rest()``.
    """

    def __init__(self, style: str, index: int = 0) -> None:
        self._style = style
        self._index = index
        self._buf = ""
        self._pos = 0
        self._state = "open"  # open, name, arguments, between, other
        self.num_calls = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def rest(self) -> str | None:
        """At the end: the content of an answer that was no call (else None)."""
        if self._state == "other" or (self.num_calls == 0 and self._buf):
            return _parse_json(self._buf).content if self._style == JSON else self._buf
        return None

    def _literal(self, literal: str) -> bool | None:
        """Consume ``literal`` if it is next: True; None if the text so far may still become it;
        False if it cannot."""
        ahead = self._buf[self._pos : self._pos + len(literal)]
        if ahead == literal:
            self._pos += len(literal)
            return True
        return None if literal.startswith(ahead) else False

    def _step(self, events: list[Event]) -> bool:
        state = self._state
        if state == "open":
            found = self._literal(_OPEN[self._style])
            if found is None:
                return False
            self._state = "name" if found else "other"
            return found
        if state == "name":
            if self._literal(_NAME) is not True:
                return False
            end = self._buf.find('"', self._pos)
            if end < 0 or not self._buf.startswith(_ARGUMENTS, end):
                self._pos -= len(_NAME)  # wait for the whole name
                return False
            name = self._buf[self._pos : end]
            self._pos = end + len(_ARGUMENTS)
            events.append(ToolCallStart(self._index, self.num_calls, f"call_{uuid.uuid4().hex[:24]}", name))
            self.num_calls += 1
            self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
            return True
        if state == "arguments":
            start = i = self._pos
            buf = self._buf
            while i < len(buf):
                c = buf[i]
                if self._in_string:
                    if self._escaped:
                        self._escaped = False
                    elif c == "\\":
                        self._escaped = True
                    elif c == '"':
                        self._in_string = False
                elif c == '"':
                    self._in_string = True
                elif c in "{[":
                    self._depth += 1
                elif c in "]}":
                    if self._depth == 0:  # the call's own closing brace
                        break
                    self._depth -= 1
                i += 1
            if i > start:
                events.append(ToolCallArguments(self._index, self.num_calls - 1, buf[start:i]))
            self._pos = i
            if i < len(buf):
                self._pos += 1  # the call's "}"
                self._state = "between"
                return True
            return False
        if state == "between":  # another call, or (at the end) the closing text
            if self._literal(_NEXT[self._style]):
                self._state = "name"
                return True
            return False
        return False  # other: nothing more to say before the end
