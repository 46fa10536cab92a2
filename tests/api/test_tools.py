"""Tool calling against real servers on the tiny random model, with the official ``openai``
client, in both styles of ``api/tools.py``:

* ``json``: the tiny model's own chat template knows no tools (the generic fallback);
* ``hermes``: the same checkpoint with a Qwen-style template that renders ``tools`` and
  ``<tool_call>`` blocks.

``required`` and a named function are enforced by the grammar, so even a random model calls the
tool with arguments that validate against its parameters (bounded strings: a random model closes
a string only when it must).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from trio_infer.api.events import ToolCallArguments, ToolCallStart
from trio_infer.api.tools import HERMES, JSON, CallStream, ToolPlan

from .test_server import Server, start_server

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module", params=[JSON, HERMES])
def server(request: pytest.FixtureRequest, tiny_checkpoint: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    checkpoint = tiny_checkpoint
    if request.param == HERMES:
        checkpoint = tmp_path_factory.mktemp("hermes") / "model"
        shutil.copytree(tiny_checkpoint, checkpoint)
        (checkpoint / "chat_template.jinja").write_text(HERMES_TEMPLATE)
        config = json.loads((checkpoint / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    for server in start_server(checkpoint, tmp_path_factory):
        server.style = request.param  # type: ignore[attr-defined]
        yield server


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    server.wait_idle()


class GetWeather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: Annotated[str, Field(max_length=10)]
    unit: Literal["celsius", "fahrenheit"]
    days: Annotated[int, Field(ge=1, le=7)]


WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather")
SEARCH_PARAMS = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 8}, "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["query", "limit"],
    "additionalProperties": False,
}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                           "parameters": SEARCH_PARAMS}}
PARAMS = {"get_weather": WEATHER["function"]["parameters"], "search": SEARCH_PARAMS}


def msgs() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}]


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, dict[int, dict[str, Any]], str | None]:
    """A streamed answer as (content, calls by index, finish reason), checking OpenAI's shape:
    each call's first chunk has its id and name, the arguments come after, in pieces."""
    content, calls, finish = "", {}, None  # type: dict[int, dict[str, Any]]
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or ():
            if tc.index not in calls:
                assert tc.id and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": "", "pieces": 0}
            else:
                assert tc.id is None
                calls[tc.index]["arguments"] += tc.function.arguments
                calls[tc.index]["pieces"] += 1
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_validate(client: openai.OpenAI, server: Server, choice: str, stream: bool) -> None:
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "search"}}
    names = {"get_weather", "search"} if choice == "required" else {"search"}
    kw = dict(model=server.model, messages=msgs(), tools=[WEATHER, SEARCH], tool_choice=tool_choice,
              max_tokens=300, seed=7, parallel_tool_calls=False)
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls, names)
        assert len(r.choices[0].message.tool_calls) == 1
        return
    content, calls, finish = streamed(client, **kw)
    assert finish == "tool_calls" and not content and len(calls) == 1
    for call in calls.values():
        assert call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
        assert call["pieces"] > 1  # the arguments stream as they are generated
    # the same seeded call as the non-streamed answer gives
    [same] = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert (same.function.name, same.function.arguments) == (calls[0]["name"], calls[0]["arguments"])


def test_a_call_cut_by_max_tokens_is_the_same_streamed_and_not(client: openai.OpenAI, server: Server) -> None:
    """A forced call that runs out of tokens mid-arguments: the non-streamed answer says what the
    stream said (the call begun, its arguments as far as they got, finish "length"), not the raw
    unfinished text as content."""
    kw = dict(model=server.model, messages=msgs(), tools=[SEARCH], max_tokens=300, seed=7,
              parallel_tool_calls=False, tool_choice={"type": "function", "function": {"name": "search"}})
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.usage is not None
    kw["max_tokens"] = whole.usage.completion_tokens - 3  # inside the call's closing brackets
    content, calls, finish = streamed(client, **kw)
    assert finish == "length" and len(calls) == 1, (content, calls)
    r = client.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "length"
    [call] = r.message.tool_calls
    assert (call.function.name, call.function.arguments) == (calls[0]["name"], calls[0]["arguments"])
    assert not r.message.content and not content


def test_sdk_parses_the_arguments_of_a_strict_tool(client: openai.OpenAI, server: Server) -> None:
    r = client.chat.completions.parse(
        model=server.model, messages=msgs(), tools=[WEATHER], max_tokens=300, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, GetWeather) for c in calls)


def test_parallel_calls_are_all_rendered(client: openai.OpenAI, server: Server) -> None:
    r = client.chat.completions.create(
        model=server.model, messages=msgs(), tools=[WEATHER, SEARCH], tool_choice="required",
        max_tokens=400, seed=4, n=4,
    )
    for c in r.choices:
        if c.finish_reason == "tool_calls":
            check_calls(c.message.tool_calls, {"get_weather", "search"})
            assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_is_text_or_a_call(client: openai.OpenAI, server: Server, stream: bool) -> None:
    kw = dict(model=server.model, messages=msgs(), tools=[WEATHER, SEARCH], max_tokens=60, seed=2, n=2)
    if not stream:
        r = client.chat.completions.create(**kw)
        for c in r.choices:
            if c.message.tool_calls and c.finish_reason == "length":
                assert not c.message.content  # a call cut short: its arguments as far as they got
            elif c.message.tool_calls:
                assert c.finish_reason == "tool_calls"
                check_calls(c.message.tool_calls, set(PARAMS))
            else:
                assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)
        return
    kw["n"] = 1
    content, calls, finish = streamed(client, **kw)
    assert finish == "length" or (finish == "tool_calls") == bool(calls)


def test_multi_turn_with_a_tool_message(client: openai.OpenAI, server: Server) -> None:
    first = client.chat.completions.create(
        model=server.model, messages=msgs(), tools=[WEATHER], tool_choice="required", max_tokens=300, seed=9,
    )
    message = first.choices[0].message
    [call] = message.tool_calls[:1]
    history = [*msgs(), message, {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, rain"}]
    second = client.chat.completions.create(
        model=server.model, messages=history, tools=[WEATHER], max_tokens=8, seed=9,
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the tool's answer is in the prompt the template rendered
    tokens = httpx.post(server.url + "/tokenize", timeout=30, json={"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query":"x"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"}]}).json()
    text = httpx.post(server.url + "/detokenize", timeout=30, json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "12 degrees, rain" in text and "search" in text
    if server.style == HERMES:  # type: ignore[attr-defined]
        assert "<tool_response>\n12 degrees, rain" in text and "<tool_call>" in text
    else:
        assert "Result of the call call_1 of search:\n12 degrees, rain" in text
        assert '{"tool_calls":[{"name":"search","arguments":{"query":"x"}}]}' in text


_BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [SEARCH, {"type": "function", "function": {"name": "g", "parameters": {"not": {}}}}]},
     "tools.1.function.parameters"),
    ({"tools": [SEARCH, {"type": "function", "function": {"name": "g", "parameters": {"type": "nope"}}}],
      "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tools.1.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "g", "parameters": {"type": "nope"}}}],
      "tool_choice": "none"}, "tools.0.function.parameters"),
    ({"tools": [SEARCH], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [SEARCH, SEARCH]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"tools": [SEARCH], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [SEARCH], "logprobs": True}, "logprobs"),  # streamed (the body above streams)
]


@pytest.mark.parametrize("extra,param", _BAD)
def test_bad_tools_are_a_400_naming_the_field(server: Server, extra: dict[str, Any], param: str) -> None:
    body = {"model": server.model, "messages": msgs(), "max_tokens": 4, "stream": True, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": server.model, "messages": msgs(), "max_tokens": 2})
    assert r.status_code == 200  # still serving


def test_tool_choice_none_and_auto_without_tools_ask_for_nothing(client: openai.OpenAI, server: Server) -> None:
    # Greedy: sampled at temperature 1, the random model met EOS within 4 tokens once (a
    # fresh-clone failure: "stop" where "length" was expected).
    r = client.chat.completions.create(model=server.model, messages=msgs(), max_tokens=4, tool_choice="auto",
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None
    r = client.chat.completions.create(model=server.model, messages=msgs(), max_tokens=4, tools=[SEARCH],
                                       tool_choice="none", temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


# -- the parsers, on text a real model writes ---------------------------------------------------


def test_hermes_text_is_parsed_into_calls_and_content() -> None:
    plan = ToolPlan(HERMES, [], "auto", True, None)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"query": "x", "limit": 1}}\n</tool_call>')
    out = plan.parse(text)
    assert out.content == "Let me check."
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather", "search"]
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert plan.parse("no call here").tool_calls == []
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert plan.parse(broken).content == broken and not plan.parse(broken).tool_calls


def test_json_text_is_parsed_into_calls_or_a_response() -> None:
    plan = ToolPlan(JSON, [], "auto", True, None)
    out = plan.parse('{"tool_calls":[{"name":"search","arguments":{"query":"a","limit":2}}]}')
    assert out.content is None and out.tool_calls[0]["function"]["name"] == "search"
    assert plan.parse('{"response":"Hello"}').content == "Hello"
    assert plan.parse('{"respo').content == '{"respo'


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_call_stream_reads_calls_in_any_chunking(step: int) -> None:
    def run(style: str, text: str) -> tuple[dict[int, list[str]], str | None]:
        scanner, events = CallStream(style), []
        for i in range(0, len(text), step):
            events += scanner.feed(text[i : i + step])
        calls: dict[int, list[str]] = {}
        for event in events:
            if isinstance(event, ToolCallStart):
                calls[event.call] = [event.name, ""]
            else:
                assert isinstance(event, ToolCallArguments)
                calls[event.call][1] += event.text
        return calls, scanner.rest()

    tricky = '{"x":"}\\"]","y":[1,{"z":2}]}'
    assert run(JSON, '{"tool_calls":[{"name":"a","arguments":' + tricky + '},{"name":"b","arguments":{}}]}') \
        == ({0: ["a", tricky], 1: ["b", "{}"]}, None)
    assert run(HERMES, '<tool_call>\n{"name":"a","arguments":{"x":"q"}}\n</tool_call>\n<tool_call>\n'
               '{"name":"b","arguments":{"k":[1]}}\n</tool_call>') == ({0: ["a", '{"x":"q"}'], 1: ["b", '{"k":[1]}']}, None)
    assert run(JSON, '{"response":"Hello \\"you\\""}') == ({}, 'Hello "you"')
    assert run(JSON, '{"tool_calls":[{"name":"a","argu') == ({}, '{"tool_calls":[{"name":"a","argu')  # cut short
