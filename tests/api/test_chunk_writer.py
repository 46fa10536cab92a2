"""The serializers' chunks: the same bytes as ``json.dumps`` of the OpenAI object each chunk is.

The serializers build chunks from a head rendered once per request and JSON-encode only what
varies; the oracle here is the plain object, encoded the generic way (``sse.event``).
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from trio_infer.api import sse
from trio_infer.api.events import (
    Content,
    Finish,
    Reasoning,
    ToolCallArguments,
    ToolCallStart,
    gather,
)
from trio_infer.api.plans import Plan
from trio_infer.api.response_events import ResponseEvents, parsed_events
from trio_infer.api.render import ChatSerializer, CompletionSerializer, serializer
from trio_infer.api.tools import HERMES, JSON, ToolPlan
from trio_infer.runtime.text_stream import ChoiceDelta


def plan(kind: str, include_usage: bool, n: int = 2, tools: ToolPlan | None = None) -> Plan:
    return Plan(
        kind=kind,  # type: ignore[arg-type]
        id="cmpl-ünï\"\\x",
        created=1700000000,
        model="m/ödel \"q\"",
        prompts=[[1, 2]],
        params=[None] * n,  # type: ignore[list-item]
        stop=[],
        logprobs=None,
        stream=True,
        include_usage=include_usage,
        tools=tools,
    )


def expected(p: Plan, index: int, fields: dict, finish: str | None) -> str:
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    head = {"id": p.id, "object": obj, "created": p.created, "model": p.model}
    if p.include_usage:
        head["usage"] = None
    return sse.event({**head, "choices": [{"index": index, **fields, "finish_reason": finish}]})


@given(
    kind=st.sampled_from(["chat", "completion"]),
    include_usage=st.booleans(),
    index=st.integers(0, 1),
    text=st.text(),
    finish=st.sampled_from([None, "stop", "length"]),
)
def test_text_chunks_are_byte_identical_to_the_generic_encoding(kind, include_usage, index, text, finish) -> None:
    p = plan(kind, include_usage)
    writer = serializer(p, texts=None)  # type: ignore[arg-type]
    events = ResponseEvents(p).feed([ChoiceDelta(index, text, [], finish)])
    got = writer.write(events)
    if not text and finish is None:
        assert events == [] and got is None
        return
    if kind == "chat":
        fields = {"delta": {"content": text} if text or finish is None else {}, "logprobs": None}
    else:
        fields = {"text": text, "logprobs": None}
    assert got == expected(p, index, fields, finish)  # text and finish in one chunk
    obj = json.loads(got.removeprefix("data: "))
    assert obj["id"] == "cmpl-ünï\"\\x" and obj["choices"][0]["finish_reason"] == finish
    assert ("usage" in obj) == include_usage


@given(include_usage=st.booleans(), name=st.text(), piece=st.text(), content=st.text(min_size=1))
def test_tool_call_and_reasoning_chunks(include_usage, name, piece, content) -> None:
    p = plan("chat", include_usage, tools=ToolPlan(JSON, [], "auto", True, "grammar"))
    writer = ChatSerializer(p, texts=None)  # type: ignore[arg-type]
    got = writer.write([
        Reasoning(1, piece), ToolCallStart(1, 0, "call_x", name), ToolCallArguments(1, 0, piece),
        Content(1, content), Finish(1, "tool_calls"),
    ])
    call = {"index": 0, "id": "call_x", "type": "function", "function": {"name": name, "arguments": ""}}
    assert got == "".join([
        expected(p, 1, {"delta": {"reasoning_content": piece}, "logprobs": None}, None),
        expected(p, 1, {"delta": {"tool_calls": [call]}, "logprobs": None}, None),
        expected(p, 1, {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]},
                        "logprobs": None}, None),
        # with tools the finish goes in a chunk of its own
        expected(p, 1, {"delta": {"content": content}, "logprobs": None}, None),
        expected(p, 1, {"delta": {}, "logprobs": None}, "tool_calls"),
    ])


def test_completions_have_no_place_for_calls_or_reasoning() -> None:
    writer = CompletionSerializer(plan("completion", False), texts=None)  # type: ignore[arg-type]
    assert writer.write([Reasoning(0, "hm"), ToolCallStart(0, 0, "c", "f")]) is None


def test_streamed_and_whole_answers_are_the_same_events() -> None:
    """The calls of a constrained answer read as it streams (CallStream) and parsed whole say
    the same thing, whatever the chunking."""
    text = ('{"tool_calls":[{"name":"get","arguments":{"city":"Oslo","days":[1,2]}},'
            '{"name":"search","arguments":{"q":"' + "x" * 70 + '"}}]}')
    p = plan("chat", False, n=1, tools=ToolPlan(JSON, [], "auto", True, "grammar"))
    for step in (1, 5, 1000):
        source = ResponseEvents(p)
        events = []
        for i in range(0, len(text), step):
            events += source.feed([ChoiceDelta(0, text[i : i + step], [], None)])
        events += source.feed([ChoiceDelta(0, "", [], "stop")])
        streamed, whole = gather(events), gather(parsed_events(p, 0, text, "stop"))
        assert streamed.finish_reason == whole.finish_reason == "tool_calls"
        assert streamed.content is None and whole.content is None
        strip = lambda calls: [c["function"] for c in calls]  # noqa: E731 (ids are random)
        assert strip(streamed.tool_calls) == strip(whole.tool_calls) == [
            {"name": "get", "arguments": '{"city":"Oslo","days":[1,2]}'},
            {"name": "search", "arguments": '{"q":"' + "x" * 70 + '"}'},
        ]


def test_hermes_auto_is_held_then_parsed_whole() -> None:
    p = plan("chat", False, n=1, tools=ToolPlan(HERMES, [], "auto", True, None))
    source = ResponseEvents(p)
    assert source.feed([ChoiceDelta(0, "Let me look.\n<tool_call>\n", [], None)]) == []
    events = source.feed([ChoiceDelta(0, '{"name": "f", "arguments": {"a": 1}}\n</tool_call>', [], "stop")])
    assert [type(e) for e in events] == [Content, ToolCallStart, ToolCallArguments, Finish]
    assert events[0] == Content(0, "Let me look.") and events[2].text == '{"a":1}'
    assert events[-1] == Finish(0, "tool_calls")
