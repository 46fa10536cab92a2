"""LangChain's ``ChatOpenAI`` (langchain-openai) against the server, with a bound tool: a forced
call whose arguments validate against the tool's schema, the same call streamed (LangChain
joins the chunks), and the round trip (the call and a ``ToolMessage`` sent back, then an answer
with the tool still bound), as an agent loop runs it.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (the 'clients' extra)")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from api.test_server import Server  # noqa: E402


class get_weather(BaseModel):  # noqa: N801 - the tool's name, as LangChain takes it from the class
    """The weather in a city for the next days."""

    model_config = ConfigDict(extra="forbid")  # additionalProperties: false (a random model adds keys)
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


SCHEMA = convert_to_openai_tool(get_weather)["function"]["parameters"]
QUESTION = [HumanMessage("What is the weather in Paris this week?")]


def _model(server: Server, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=server.model, temperature=0,
                      max_tokens=80, max_retries=0, timeout=120, **kw)


def test_bound_tool_call_streamed_and_not(idle: Server) -> None:
    # stream_usage: LangChain asks for the usage of a stream (stream_options.include_usage)
    bound = _model(idle, stream_usage=True).bind_tools([get_weather], tool_choice="get_weather")
    reply = bound.invoke(QUESTION)
    assert isinstance(reply, AIMessage) and reply.response_metadata["finish_reason"] == "tool_calls"
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], SCHEMA)
    assert not reply.invalid_tool_calls
    assert reply.usage_metadata["output_tokens"] > 0 and reply.usage_metadata["input_tokens"] > 0
    chunks = list(bound.stream(QUESTION))
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined = joined + chunk
    [streamed] = joined.tool_calls
    assert (streamed["name"], streamed["args"]) == (call["name"], call["args"])
    assert joined.response_metadata["finish_reason"] == "tool_calls"
    assert joined.usage_metadata == reply.usage_metadata


def test_tool_round_trip(idle: Server) -> None:
    model = _model(idle)
    call = model.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    [asked] = call.tool_calls
    history = [*QUESTION, call, ToolMessage("Sunny, 21 C.", tool_call_id=asked["id"])]
    answering = model.bind_tools([get_weather], tool_choice="none")
    answer = answering.invoke(history)
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert answer.content and answer.response_metadata["finish_reason"] in ("stop", "length")
    # the call and its result are in the prompt: longer than the question's alone
    alone = answering.invoke(QUESTION)
    assert answer.usage_metadata["input_tokens"] > alone.usage_metadata["input_tokens"]
