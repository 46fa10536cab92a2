"""``/v1/responses`` against a real server on the tiny random model, driven by the official
``openai`` client (``responses.create``, streamed and not, the ``responses.stream`` helper, a
function tool round trip, ``text.format``) and by raw httpx for the errors. One server for the
module; greedy or seeded requests so the streamed and the whole answer can be compared.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Annotated, Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from trio_infer.api.errors import APIError
from trio_infer.api.plans import Plan
from trio_infer.api.responses import ResponsesSerializer

from .test_server import Server, start_server


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from start_server(tiny_checkpoint, tmp_path_factory)


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    server.wait_idle()


WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": WEATHER_PARAMS, "strict": True}


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(max_length=8)]
    rank: Annotated[int, Field(ge=1, le=5)]


def _events(stream: Any) -> list[Any]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def _final(events: list[Any]) -> Any:
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


def _said(r: Any) -> list[Any]:
    """What a response says, without its ids."""
    out = []
    for item in r.output:
        if item.type == "message":
            out.append(("message", item.status, [c.text for c in item.content]))
        else:
            out.append((item.type, item.name, item.arguments, item.status))
    return out


def test_create_non_streamed(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model=server.model, input="Tell me about the harbour.", max_output_tokens=8,
                                instructions="You are terse.", temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == server.model
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.output_text == item.content[0].text and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.instructions == "You are terse." and r.store is True  # OpenAI's default: stored


def test_streamed_events_and_equality(client: openai.OpenAI, server: Server) -> None:
    kw: dict[str, Any] = dict(model=server.model, input=[{"role": "user", "content": "Hi there"}],
                              max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = _events(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # max_output_tokens cut it
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = _final(events)
    assert text == whole.output_text == final.output_text
    assert _said(final) == _said(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_text_format_json_schema_and_the_stream_helper(client: openai.OpenAI, server: Server) -> None:
    kw: dict[str, Any] = dict(model=server.model, input="A city, please.", max_output_tokens=80,
                              extra_body={"seed": 5})
    with client.responses.stream(text_format=City, **kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert isinstance(final.output_parsed, City)
    assert "".join(deltas) == final.output_text
    # the same request, not streamed (text.format json_schema through parse)
    whole = client.responses.parse(text_format=City, **kw)
    assert whole.output_parsed == final.output_parsed
    # json_object: any object
    r = client.responses.create(model=server.model, input="JSON!", max_output_tokens=60,
                                text={"format": {"type": "json_object"}}, extra_body={"seed": 2})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip(client: openai.OpenAI, server: Server, stream: bool) -> None:
    kw: dict[str, Any] = dict(model=server.model, input=[{"role": "user", "content": "Weather in Oslo?"}],
                              tools=[WEATHER], tool_choice="required", max_output_tokens=200,
                              parallel_tool_calls=False, extra_body={"seed": 7})
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    if stream:
        events = _events(client.responses.create(stream=True, **kw))
        types = [e.type for e in events]
        assert "response.function_call_arguments.delta" in types
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].arguments == call.arguments
        assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") \
            == call.arguments
        assert types[-1] == "response.completed" and _said(_final(events)) == _said(whole)
        with client.responses.stream(**kw) as helper:  # the SDK's helper accumulates the call too
            final = helper.get_final_response()
        assert _said(final) == _said(whole)
        return
    # the result goes back as a function_call_output item, with the call echoed from the output
    second = client.responses.create(
        model=server.model, tools=[WEATHER], max_output_tokens=6, temperature=0,
        input=[*kw["input"], *whole.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees, rain"}],
    )
    assert second.status in ("completed", "incomplete")
    # the named form of tool_choice
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [o.name for o in named.output] == ["get_weather"]


_BAD: list[tuple[dict[str, Any], str]] = [
    ({"background": True, "store": False}, "background"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include.1"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "output": "y"}]},
     "input.1.call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "parameters": {"type": "nope"}}]}, "tools.0.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("extra,param", _BAD)
def test_bad_input_is_a_400_naming_the_field_before_the_stream(server: Server, extra: dict[str, Any],
                                                               param: str) -> None:
    body = {"model": server.model, "input": "hi", "max_output_tokens": 4, "stream": True, **extra}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == param, r.text


def test_unknown_model_is_a_404(server: Server) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"model": "nope", "input": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_an_error_mid_stream_is_response_failed() -> None:
    plan = Plan(kind="chat", id="resp_x", created=1, model="m", prompts=[[1, 2]], params=[], stop=[],
                logprobs=None, stream=True, include_usage=False)
    writer = ResponsesSerializer(plan, None, {})  # type: ignore[arg-type]
    first = writer.first()
    tail = writer.failed(APIError(500, "the engine failed", "server_error", code="engine_error"))
    blocks = (first + tail).strip().split("\n\n")
    events = [json.loads(b.split("data: ", 1)[1]) for b in blocks]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "engine_error", "message": "the engine failed"}
    assert blocks[-1].startswith("event: response.failed\n")


# -- the serializer alone, on events no model served here emits yet (reasoning) ------------------


def _fold(raw: str) -> list[dict[str, Any]]:
    out = []
    for block in raw.strip().split("\n\n"):
        head, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        out.append(event)
    return out


def test_reasoning_function_calls_and_text_stream_as_the_whole_response_says() -> None:
    from types import SimpleNamespace

    from trio_infer.api.events import Content, Finish, Reasoning, ToolCallArguments, ToolCallStart

    plan = Plan(kind="chat", id="resp_x", created=1, model="m", prompts=[[1, 2, 3]], params=[], stop=[],
                logprobs=None, stream=True, include_usage=False)
    events = [Reasoning(0, "Let me "), Reasoning(0, "think."), Content(0, "Sure."),
              ToolCallStart(0, 0, "call_1", "f"), ToolCallArguments(0, 0, '{"a":'), ToolCallArguments(0, 0, "1}"),
              Finish(0, "tool_calls")]
    choices = [SimpleNamespace(num_tokens=9, num_cached_tokens=0)]
    writer = ResponsesSerializer(plan, None, {})  # type: ignore[arg-type]
    raw = writer.first() + "".join(writer.write([e]) or "" for e in events) + writer.end(choices)  # type: ignore[arg-type]
    streamed = _fold(raw)
    assert [e["sequence_number"] for e in streamed] == list(range(len(streamed)))
    types = [e["type"] for e in streamed]
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]
    whole = ResponsesSerializer(plan, None, {}).response(choices, [events])  # type: ignore[arg-type]
    final = streamed[-1]["response"]
    strip = lambda r: [{k: v for k, v in o.items() if k != "id"} for o in r["output"]]  # noqa: E731
    assert strip(final) == strip(whole)
    assert [o["type"] for o in whole["output"]] == ["reasoning", "message", "function_call"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert whole["output"][2]["arguments"] == '{"a":1}' and whole["output"][2]["call_id"] == "call_1"
    assert whole["status"] == "completed" and whole["usage"]["output_tokens"] == 9
    assert "encrypted_content" not in whole["output"][0]  # only when include asks for it
    # include: ["reasoning.encrypted_content"]: the reasoning item carries its text, base64
    asked = ResponsesSerializer(plan, None, {}, include=["reasoning.encrypted_content"])  # type: ignore[arg-type]
    item = asked.response(choices, [events])["output"][0]  # type: ignore[arg-type]
    assert base64.b64decode(item["encrypted_content"]).decode() == "Let me think."


async def test_echoed_reasoning_items_and_store_false_are_accepted(tokenizer: Any) -> None:
    from .helpers import make_app, running

    async with running(make_app(tokenizer)) as c:
        body = {"model": "fake", "store": False, "max_output_tokens": 2, "instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo", "annotations": []}]},
            {"role": "user", "content": "again"}]}
        r = await c.post("/v1/responses", json=body)
        assert r.status_code == 200, await r.get_data()
        said = await r.get_json()
        assert said["store"] is False and said["instructions"] == "Be brief."
        tokens = await c.post("/tokenize", json={"messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]})
        assert said["usage"]["input_tokens"] == (await tokens.get_json())["count"]


async def test_disconnect_mid_stream_frees_everything(tokenizer: Any, autojump_clock: Any) -> None:
    import trio

    from .helpers import StepGate, all_zero, counts, make_app, open_request, read_until, running

    app = make_app(tokenizer)
    body = {"model": "fake", "max_output_tokens": 2000, "stream": True, "input": "hi",
            "temperature": 0}  # greedy: the delta is there after three steps (test_messages.py)
    async with running(app) as c:
        gate = StepGate(app)
        gate.allow(3)
        with trio.fail_after(60):
            async with open_request(c, "/v1/responses", body) as conn:
                await read_until(conn, lambda t: "response.output_text.delta" in t)
                await trio.testing.wait_all_tasks_blocked()
                assert counts(app)["sessions"] == 1
            await trio.testing.wait_all_tasks_blocked()
            assert all_zero(app), counts(app)


# A one-property tool that says nothing of additionalProperties: its calls hold exactly "city".
CITY_ONLY = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_forced_call_holds_exactly_the_named_property(client: openai.OpenAI, server: Server,
                                                        stream: bool, seed: int) -> None:
    kw: dict[str, Any] = dict(model=server.model, input="Weather in Oslo?", tools=[CITY_ONLY],
                              tool_choice={"type": "function", "name": "get_weather"},
                              max_output_tokens=200, parallel_tool_calls=False, extra_body={"seed": seed})
    if stream:
        final = _final(_events(client.responses.create(stream=True, **kw)))
    else:
        final = client.responses.create(**kw)
    assert final.status == "completed"
    [call] = final.output
    assert call.type == "function_call" and list(json.loads(call.arguments)) == ["city"]
