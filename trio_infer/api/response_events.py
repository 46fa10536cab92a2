"""The events of a response, from its plan and its text: :class:`ResponseEvents` turns each read's
per-choice deltas into ``api/events.py``'s events (the reasoning split off by :class:`ThinkSplit`,
tool calls parsed as they come), and :func:`parsed_events` says a whole answer's.

Above the plans (``api/plans.py``: what the request asked for, its tool parser) and the events;
every API's route feeds a stream through one of these.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence

from trio_infer.api.events import (
    Content,
    Event,
    Finish,
    Reasoning,
    ToolCallArguments,
    ToolCallStart,
)
from trio_infer.api.plans import Plan, ReasoningPlan
from trio_infer.api.tools import CallStream

if TYPE_CHECKING:
    from trio_infer.runtime.text_stream import ChoiceDelta, ChoiceText

# A call's arguments in pieces of this many characters when they are known whole (a parsed
# answer), as OpenAI streams them; the client joins them.
ARGUMENT_PIECE = 32


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ThinkSplit:
    """A reasoning model's output, piece by piece, as (reasoning, content) text.

    The thinking is what stands between the open and close tags (``<think>``, ``</think>``):
    either the output opens with the tag (after whitespace; Qwen3), or the prompt left the model
    thinking already (``ReasoningPlan.thinking``), and it ends at the close tag. The tags are
    in neither part, nor is the whitespace right after the close tag (the template's own
    separator). An output that does not open with the tag is all content (a model told not to
    think: ``enable_thinking: false``). A tail that may still become a tag is held until the
    next piece tells, and given out at the end (``final``).
    """

    _START, _THINK, _AFTER, _ANSWER = range(4)

    def __init__(self, plan: ReasoningPlan) -> None:
        self.open, self.close = plan.open, plan.close
        self._state = self._THINK if plan.thinking else self._START
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            state = self._state
            if state == self._ANSWER:
                content.append(buf)
                break
            if state == self._START:
                stripped = buf.lstrip()
                if stripped.startswith(self.open):
                    self._state, buf = self._THINK, stripped[len(self.open):]
                elif not final and self.open.startswith(stripped):  # "" or a start of the tag
                    self._held = buf
                    break
                else:
                    self._state = self._ANSWER
            elif state == self._THINK:
                at = buf.find(self.close)
                if at >= 0:
                    reasoning.append(buf[:at])
                    self._state, buf = self._AFTER, buf[at + len(self.close):]
                    continue
                keep = 0 if final else _partial_tail(buf, self.close)
                reasoning.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break
            else:  # after the close tag: its separator is dropped
                buf = buf.lstrip()
                if buf:
                    self._state = self._ANSWER
        return "".join(reasoning), "".join(content)


class ResponseEvents:
    """The events of one request's choices, read after read (``feed``).

    Without tools a delta is its text and logprobs, then its finish. A request that may call
    tools has its calls read out of the text: while the grammar constrains the answer, by a
    :class:`~trio_infer.api.tools.CallStream` as the text comes (calls are said as soon as their
    name is complete, their arguments as they are generated; text that is no call is said at the
    end); hermes ``auto`` (unconstrained: a call may start anywhere in the text) is held until its
    choice ends, then parsed whole (:func:`parsed_events`). The finish of a choice that called a
    tool and stopped is "tool_calls".
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._want_lp = plan.logprobs is not None
        # With tools: each choice's call scanner (or its text so far, held); None otherwise.
        self._calls: dict[int, CallStream | list[str]] | None = {} if plan.tools is not None else None
        # A reasoning model's: each choice's thinking splitter; None otherwise.
        self._think: dict[int, ThinkSplit] | None = {} if plan.reasoning is not None else None

    def whole(self, choice: ChoiceText) -> list[Event]:
        """The events of a finished choice's whole text (a non-streamed answer)."""
        text, finish = choice.text, choice.finish_reason or "stop"
        if self.plan.reasoning is None:
            return self._whole_content(choice.index, text, finish)
        reasoning, content = ThinkSplit(self.plan.reasoning).feed(text, final=True)
        events = self._whole_content(choice.index, content, finish)
        return [Reasoning(choice.index, reasoning), *events] if reasoning else events

    def _whole_content(self, index: int, text: str, finish: str) -> list[Event]:
        # A constrained tool answer cut short (max_tokens, the context) is read by the call
        # scanner the stream uses, so both say the same: the calls begun, their arguments as far
        # as they got. Parsed whole, an unfinished call would be no call at all, only text.
        tools = self.plan.tools
        if tools is not None and finish != "stop":
            scanner = tools.stream(index)
            if scanner is not None:
                events: list[Event] = []
                self._tool_events({index: scanner}, index, text, finish, events)
                return events
        return parsed_events(self.plan, index, text, finish)

    def feed(self, deltas: Sequence[ChoiceDelta]) -> list[Event]:
        """The events of one read of the text stream (its deltas, choice by choice)."""
        events: list[Event] = []
        calls = self._calls
        think = self._think
        for delta in deltas:
            if think is not None:
                split = think.get(delta.index)
                if split is None:
                    split = think[delta.index] = ThinkSplit(self.plan.reasoning)  # type: ignore[arg-type]
                reasoning, content = split.feed(delta.text, final=delta.finish_reason is not None)
                if reasoning:
                    events.append(Reasoning(delta.index, reasoning))
                if delta.finish_reason is not None:
                    del think[delta.index]
                delta = replace(delta, text=content)
            if calls is not None:
                self._tool_events(calls, delta.index, delta.text, delta.finish_reason, events)
                continue
            lps = delta.logprobs if self._want_lp else None
            if delta.text or lps or delta.prompt_logprobs is not None:
                events.append(Content(delta.index, delta.text, lps, delta.prompt_logprobs))
            if delta.finish_reason is not None:
                events.append(Finish(delta.index, delta.finish_reason))
        return events

    def _tool_events(self, calls: dict[int, CallStream | list[str]], index: int, text: str,
                     finish: str | None, events: list[Event]) -> None:
        tools = self.plan.tools
        assert tools is not None
        scanner = calls.get(index)
        if scanner is None:
            scanner = calls[index] = tools.stream(index) or []
        if isinstance(scanner, list):  # held until the end, then parsed whole
            scanner.append(text)
            if finish is not None:
                del calls[index]
                events.extend(parsed_events(self.plan, index, "".join(scanner), finish))
            return
        events.extend(scanner.feed(text))
        if finish is not None:
            del calls[index]
            content = scanner.rest()
            if content:
                events.append(Content(index, content))
            events.append(Finish(index, "tool_calls" if scanner.num_calls and finish == "stop" else finish))


def parsed_events(plan: Plan, index: int, text: str, finish: str) -> list[Event]:
    """The events of choice ``index``'s whole text ``text``: with tools, its content and the
    calls parsed out of it (``ToolPlan.parse``), each call's arguments in pieces."""
    if plan.tools is None:
        return [Content(index, text), Finish(index, finish)] if text else [Finish(index, finish)]
    parsed = plan.tools.parse(text)
    events: list[Event] = []
    if parsed.content:
        events.append(Content(index, parsed.content))
    for k, call in enumerate(parsed.tool_calls):
        fn = call["function"]
        events.append(ToolCallStart(index, k, call["id"], fn["name"]))
        arguments = fn["arguments"]
        events.extend(
            ToolCallArguments(index, k, arguments[i : i + ARGUMENT_PIECE])
            for i in range(0, len(arguments), ARGUMENT_PIECE)
        )
    if parsed.tool_calls and finish == "stop":
        finish = "tool_calls"
    events.append(Finish(index, finish))
    return events


def reasoning_tokens(plan: Plan, choice: ChoiceText, token_text: Callable[[int], tuple[str, bytes]]) -> int | None:
    """How many of ``choice``'s tokens are its thinking, the tags included (what OpenAI's
    ``reasoning_tokens`` counts): 0 when the plan does not split thinking out or the output did
    not think; up to the close tag's token when the thinking ended; every token so far when it
    has not (cut by ``max_tokens``, or still running). None when it cannot be told: the thinking
    ended but no single token is the close tag (``reasoning: on`` over tags the tokenizer splits),
    so no count is better than a false one. ``token_text``: a token id's text
    (``render.TokenText``)."""
    think = plan.reasoning
    if think is None:
        return 0
    text = choice.text
    if not think.thinking and not text.lstrip().startswith(think.open):
        return 0
    if think.close not in text:
        return choice.num_tokens
    for i, token_id in enumerate(choice.token_ids):
        if token_text(token_id)[0] == think.close:
            return i + 1
    return None
