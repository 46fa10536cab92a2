"""What a response says, as typed events: the one stream every API's serializer reads.

A request's text stream (``runtime.text_stream``) gives each read's per-choice deltas: text,
logprobs, a finish. ``api/response_events.py: ResponseEvents`` turns them into events that say
what the text *is*:

* :class:`Content`: answer text (with its tokens' logprobs when the request asked for them);
* :class:`Reasoning`: the model's reasoning, apart from the answer: a reasoning model's
  ``<think>...</think>`` text, split out of the answer by ``ThinkSplit`` when the plan says
  the model thinks (``Plan.reasoning``); tool calls and content are read from the rest;
* :class:`ToolCallStart` and :class:`ToolCallArguments`: a tool call's id and name, then its
  arguments in pieces (parsed here, by ``api/tools.py``, never by a serializer);
* :class:`Finish`: the choice ended, and why.

Every event names its choice (``index``). A serializer (``api/render.py``: chat completions,
completions) only renders events; an API added later is one more serializer over the same events.
The events of a whole (non-streamed) answer are the same, from ``ResponseEvents.whole``; a
whole choice's events fold into its :class:`Message` (:func:`gather`).

This module is the bottom of the API's layers: the tool-call parser (``api/tools.py``) makes these
events, the plans (``api/plans.py``) hold the tool parser, and ``response_events.py`` reads the
plans; nothing here imports any of them.

The events are frozen msgspec structs: a ``Content`` is made for every streamed token, and a
frozen dataclass's constructor (a ``object.__setattr__`` per field) took 0.9 us of it, a struct's
0.1 us.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

import msgspec


class Content(msgspec.Struct, frozen=True):
    """Answer text of choice ``index``. ``logprobs``: its tokens' logprobs when the request asked
    for them (possibly empty: tokens whose text is held back), else None. ``prompt_logprobs``:
    the prompt's, in the choice's first event when asked (completions' echo with logprobs)."""

    index: int
    text: str
    logprobs: Sequence[Any] | None = None
    prompt_logprobs: Sequence[Any] | None = None


class Reasoning(msgspec.Struct, frozen=True):
    """Reasoning text of choice ``index``, apart from its answer."""

    index: int
    text: str


class ToolCallStart(msgspec.Struct, frozen=True):
    """Call number ``call`` of choice ``index`` begins: its id and the function's name."""

    index: int
    call: int
    id: str
    name: str


class ToolCallArguments(msgspec.Struct, frozen=True):
    """A piece of the arguments (JSON text) of call number ``call`` of choice ``index``; the
    pieces of one call, joined, are its arguments."""

    index: int
    call: int
    text: str


class Finish(msgspec.Struct, frozen=True):
    """Choice ``index`` ended: ``reason`` is "stop", "length" or "tool_calls"."""

    index: int
    reason: str


Event = Union[Content, Reasoning, ToolCallStart, ToolCallArguments, Finish]

@dataclass
class Message:
    """A whole choice's answer, gathered from its events (what a non-streamed response says)."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None


def gather(events: Sequence[Event]) -> Message:
    """One choice's events folded into its message. Content is None only when the answer is
    tool calls and nothing else (as OpenAI has it), else the text, "" for none."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    finish = None
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, Reasoning):
            reasoning.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, ToolCallArguments):
            calls[e.call]["function"]["arguments"] += e.text
        else:
            finish = e.reason
    text = "".join(content) if content or not calls else None
    return Message(text, "".join(reasoning) if reasoning else None, calls, finish)
