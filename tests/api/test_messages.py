"""Anthropic's ``/v1/messages`` against a real server on the tiny random model, driven by the
official ``anthropic`` client (``messages.create``, the ``messages.stream`` helper, a tool round
trip, ``count_tokens``, errors), by raw httpx for the error envelope, and in process (the fake
model) for ``x-api-key``. One server for the module. The current SDK has no ``temperature`` /
``top_k`` arguments: they go through ``extra_body``, as the SDK's own docs say to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import jsonschema
import pytest

from .helpers import chat_body, make_app, running
from .test_server import Server, start_server


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from start_server(tiny_checkpoint, tmp_path_factory)


@pytest.fixture
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    server.wait_idle()


GREEDY = {"temperature": 0}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_SCHEMA}


def msgs(text: str = "Tell me about the harbour.") -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _said(m: Any) -> list[Any]:
    """What a message says, without its ids."""
    return [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in m.content]


def test_create(client: anthropic.Anthropic, server: Server) -> None:
    m = client.messages.create(model=server.model, max_tokens=8, messages=msgs(), system="You are terse.",
                               extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == server.model
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    [block] = m.content
    assert block.type == "text" and block.text
    assert m.usage.output_tokens == 8 and m.usage.input_tokens > 5
    # system as blocks is the same prompt as system as a string
    same = client.messages.create(model=server.model, max_tokens=8, messages=msgs(), extra_body=GREEDY,
                                  system=[{"type": "text", "text": "You are terse."}])
    assert _said(same) == _said(m) and same.usage.input_tokens == m.usage.input_tokens


def test_stream_helper_and_raw_events_equal_the_whole_message(client: anthropic.Anthropic, server: Server) -> None:
    kw: dict[str, Any] = dict(model=server.model, max_tokens=10, messages=msgs("Hi"), extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and _said(final) == _said(whole)
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    assert final.usage.input_tokens == whole.usage.input_tokens
    # the raw event sequence (ping is consumed by the SDK; checked over httpx below)
    types = [e.type for e in client.messages.create(stream=True, **kw)]
    assert types[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    with httpx.stream("POST", server.url + "/v1/messages", timeout=60,
                      json={**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY, "stream": True}) as r:
        body = r.read().decode()
    assert body.startswith("event: message_start\n") and "event: ping\ndata: {\"type\":\"ping\"}" in body


def test_stop_sequences(client: anthropic.Anthropic, server: Server) -> None:
    kw: dict[str, Any] = dict(model=server.model, max_tokens=24, messages=msgs(), extra_body=GREEDY)
    full = client.messages.create(**kw).content[0].text
    stop = full[6:9]  # cut the greedy answer a few characters in
    assert len(stop) == 3 and full.find(stop) < 9
    m = client.messages.create(stop_sequences=[stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[: full.find(stop)] if full.find(stop) else m.content == []
    with client.messages.stream(stop_sequences=[stop], **kw) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop) and _said(final) == _said(m)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client: anthropic.Anthropic, server: Server, stream: bool) -> None:
    kw: dict[str, Any] = dict(model=server.model, max_tokens=200, messages=msgs("Weather in Oslo?"),
                              tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                              extra_body={"temperature": 0, "top_k": 40, "top_p": 0.9})
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "tool_use"
    [use] = whole.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    if stream:
        raw = list(client.messages.create(stream=True, **kw))
        starts = [e for e in raw if e.type == "content_block_start"]
        assert [s.content_block.type for s in starts] == ["tool_use"]
        pieces = [e.delta.partial_json for e in raw if e.type == "content_block_delta"]
        assert len(pieces) > 1 and json.loads("".join(pieces)) == use.input
        assert [e for e in raw if e.type == "message_delta"][0].delta.stop_reason == "tool_use"
        with client.messages.stream(**kw) as s:
            final = s.get_final_message()
        assert _said(final) == _said(whole) and final.stop_reason == "tool_use"
        return
    # the result goes back as a tool_result block, the call echoed from the answer
    second = client.messages.create(
        model=server.model, max_tokens=6, tools=[WEATHER], extra_body=GREEDY,
        messages=[*kw["messages"], {"role": "assistant", "content": whole.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": use.id, "content": "12 degrees, rain"},
                      {"type": "text", "text": "And tomorrow?"}]}],
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the named form of tool_choice
    named = client.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert [b.name for b in named.content] == ["get_weather"]


def test_count_tokens_is_the_prompt_of_create(client: anthropic.Anthropic, server: Server) -> None:
    kw: dict[str, Any] = dict(model=server.model, messages=msgs(), system="Be brief.", tools=[WEATHER])
    counted = client.messages.count_tokens(**kw)
    m = client.messages.create(max_tokens=1, **kw)
    assert counted.input_tokens == m.usage.input_tokens > 10


def test_errors_in_anthropics_envelope(client: anthropic.Anthropic, server: Server) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nope", max_tokens=4, messages=msgs())
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=server.model, max_tokens=4, messages=msgs(), stream=True,
                               extra_body={"temperature": 1.5})
    assert bad.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": bad.value.body["error"]["message"]}}
    assert "temperature" in bad.value.body["error"]["message"]


_BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),  # beyond the context is a cap (tests/clients/test_anthropic.py)
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "messages.0.content.0.type"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "nope"}}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"top_k": -1}, "top_k"),
    ({"container": "x"}, "container"),
]


@pytest.mark.parametrize("extra,field", _BAD)
def test_bad_input_names_the_field_before_the_stream(server: Server, extra: dict[str, Any], field: str) -> None:
    body = {"model": server.model, "max_tokens": 4, "messages": msgs(), "stream": True, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert set(err["error"]) == {"type", "message"}
    message = err["error"]["message"]
    assert message.startswith(field + ":") or field in message, message


async def test_x_api_key_and_bearer_are_both_accepted(tokenizer: Any) -> None:
    app = make_app(tokenizer, api_key="sekret")
    body = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with running(app) as c:
        r = await c.post("/v1/messages", json=body)
        assert r.status_code == 401
        assert (await r.get_json())["error"]["type"] == "authentication_error"
        r = await c.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
        assert r.status_code == 401
        r = await c.post("/v1/messages", json=body, headers={"x-api-key": "sekret"})
        assert r.status_code == 200, await r.get_data()
        r = await c.post("/v1/messages", json=body, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        r = await c.post("/v1/messages/count_tokens", json={"model": "fake", "messages": body["messages"]},
                         headers={"x-api-key": "sekret"})
        assert r.status_code == 200 and (await r.get_json())["input_tokens"] > 0
        # the OpenAI routes keep OpenAI's envelope, and take the key either way too
        r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert r.status_code == 401 and (await r.get_json())["error"]["code"] == "invalid_api_key"
        r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=2), headers={"x-api-key": "sekret"})
        assert r.status_code == 200


# -- the serializer alone, on events no model served here emits yet (thinking) -------------------


def test_thinking_text_and_tool_use_stream_as_the_whole_message_says() -> None:
    from types import SimpleNamespace

    from trio_infer.api.errors import APIError
    from trio_infer.api.events import Content, Finish, Reasoning, ToolCallArguments, ToolCallStart
    from trio_infer.api.messages import MessagesSerializer
    from trio_infer.api.plans import Plan

    plan = Plan(kind="chat", id="msg_x", created=1, model="m", prompts=[[1, 2, 3]], params=[], stop=[],
                logprobs=None, stream=True, include_usage=False)
    events = [Reasoning(0, "Hm"), Reasoning(0, "m."), Content(0, "Sure."),
              ToolCallStart(0, 0, "call_1", "f"), ToolCallArguments(0, 0, '{"a":'), ToolCallArguments(0, 0, "1}"),
              Finish(0, "tool_calls")]
    choices = [SimpleNamespace(num_tokens=9, stops=SimpleNamespace(matched=None))]
    writer = MessagesSerializer(plan, None)  # type: ignore[arg-type]
    raw = writer.first() + "".join(writer.write([e]) or "" for e in events) + writer.end(choices)  # type: ignore[arg-type]
    streamed = []
    for block in raw.strip().split("\n\n"):
        head, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        streamed.append(event)
    assert [(e["type"], e.get("delta", {}).get("type") or e.get("content_block", {}).get("type"))
            for e in streamed] == [
        ("message_start", None), ("ping", None),
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"), ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None),
    ]
    assert [e["index"] for e in streamed if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert streamed[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    whole = MessagesSerializer(plan, None).response(choices, [events])  # type: ignore[arg-type]
    assert whole["content"] == [
        {"type": "thinking", "thinking": "Hmm.", "signature": ""}, {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}]
    assert whole["stop_reason"] == "tool_use" and whole["usage"] == {"input_tokens": 3, "output_tokens": 9}
    failed = MessagesSerializer(plan, None).failed(APIError(503, "busy", "server_error", code="overloaded"))  # type: ignore[arg-type]
    assert failed == 'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}\n\n'


async def test_disconnect_mid_stream_frees_everything(tokenizer: Any, autojump_clock: Any) -> None:
    import trio

    from .helpers import StepGate, all_zero, counts, open_request, read_until

    app = make_app(tokenizer)
    # Greedy: sampled text is held while it ends in an unfinished character, and three steps
    # of it said nothing 2 times in 1500 (the test then waited out its fail_after).
    body = {"model": "fake", "max_tokens": 2000, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]}
    async with running(app) as c:
        gate = StepGate(app)
        gate.allow(3)
        with trio.fail_after(60):
            async with open_request(c, "/v1/messages", body) as conn:
                await read_until(conn, lambda t: "content_block_delta" in t)
                await trio.testing.wait_all_tasks_blocked()
                assert counts(app)["sessions"] == 1
            await trio.testing.wait_all_tasks_blocked()
            assert all_zero(app), counts(app)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_forced_call_holds_exactly_the_named_property(client: anthropic.Anthropic, server: Server,
                                                        stream: bool, temperature: float) -> None:
    """A one-property tool that says nothing of additionalProperties: the call holds exactly
    "city", and the message ends as a tool use, not at max_tokens."""
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                             "required": ["city"]}}
    kw: dict[str, Any] = dict(model=server.model, max_tokens=200, tools=[tool],
                              messages=[{"role": "user", "content": "Weather in Oslo?"}],
                              tool_choice={"type": "tool", "name": "get_weather",
                                           "disable_parallel_tool_use": True},
                              extra_body={"temperature": temperature})
    if stream:
        with client.messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kw)
    assert message.stop_reason == "tool_use"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert list(use.input) == ["city"]
