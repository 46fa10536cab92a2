"""An agent's session against the default model (SmolLM2-135M-Instruct, as ``make serve`` serves
it), through the official ``openai`` and ``anthropic`` clients: the Responses API's store,
``previous_response_id``, background responses, and forced tool calls that end as calls."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from tests.test_default_model_http import SMOLLM2, default_model_server


def check_agent_session(client: openai.OpenAI, url: str, model: str) -> None:
    """An agent's basic session on the Responses API (store, retrieve, input items, a second
    turn by previous_response_id with its prefix from the cache, a stream stored, background
    polled, resumed, cancelled, delete) and a forced one-property call on both APIs."""
    import anthropic

    first = client.responses.create(model=model, input="What is the capital of France?",
                                    max_output_tokens=24, temperature=0)
    assert "Paris" in first.output_text and first.store is True
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert [i.content[0].text for i in client.responses.input_items.list(first.id).data] == [
        "What is the capital of France?"]
    second = client.responses.create(model=model, previous_response_id=first.id,
                                     input="Say it again in one word.", max_output_tokens=8, temperature=0)
    # the first turn's prompt and answer come back as the second turn's prefix: its full pages
    # are served by the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 > 0
    streamed = list(client.responses.create(model=model, input="Hi!", max_output_tokens=6, stream=True))
    assert client.responses.retrieve(streamed[-1].response.id).status == streamed[-1].response.status
    queued = client.responses.create(model=model, input="Count to five.", max_output_tokens=16,
                                     temperature=0, background=True)
    for _ in range(600):
        done = client.responses.retrieve(queued.id)
        if done.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert done.status in ("completed", "incomplete") and done.background is True
    resumed = list(client.responses.retrieve(queued.id, stream=True, starting_after=2))
    assert resumed[0].sequence_number == 3 and resumed[-1].response.output_text == done.output_text
    long = client.responses.create(model=model, input="Write a long essay.", max_output_tokens=2000,
                                   background=True)
    assert client.responses.cancel(long.id).status == "cancelled"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    call = client.responses.create(
        model=model, input="What is the weather in Paris?", max_output_tokens=60, temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": city}],
        tool_choice={"type": "function", "name": "get_weather"})
    assert call.status == "completed" and [o.type for o in call.output] == ["function_call"]
    assert list(json.loads(call.output[0].arguments)) == ["city"]
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120) as claude:
        message = claude.messages.create(
            model=model, max_tokens=60, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[{"name": "get_weather", "input_schema": city}],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    assert [list(b.input) for b in message.content if b.type == "tool_use"] == [["city"]]


@pytest.mark.skipif(not SMOLLM2.exists(), reason=f"{SMOLLM2} is absent (`make venv` fetches it)")
def test_an_agents_session_on_the_default_model(tmp_path: Path) -> None:
    with default_model_server() as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            check_agent_session(client, url, "smollm2-135m-instruct")
