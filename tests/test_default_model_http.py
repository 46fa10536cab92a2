"""The default model (SmolLM2-135M-Instruct, GGUF) served over HTTP, asked through the official
``openai`` client: a real question gets the real answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Iterator, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from trio_infer.models.default_model import default_cache_dir, default_model_file
from trio_infer.settings import Settings

SMOLLM2 = default_model_file(default_cache_dir())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


class City(BaseModel):
    name: str
    country: str
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]
    landmarks: Annotated[list[str], Field(max_length=3)]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def check_structured_output_and_tools(client: openai.OpenAI, model: str) -> None:
    """The SDK's parse, and a tool call through the generic fallback (SmolLM2's template knows
    no tools): the real model fills both with the right facts."""
    reply = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, temperature=0, max_tokens=200,
    )
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and city.name == "Paris" and city.continent == "Europe", city
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER], temperature=0, max_tokens=100,  # tool_choice "auto"
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"


@contextmanager
def default_model_server() -> Iterator[str]:
    """``serve`` with no model configured (the default one), on a free port: its URL, once
    healthy; stopped at the end."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_infer", "serve", "--port", str(port), "--torch-threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 300  # a real process on the other side: real time
        while _health(url) != 200 and proc.poll() is None:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@pytest.mark.skipif(not SMOLLM2.exists(), reason=f"{SMOLLM2} is absent (`make venv` fetches it)")
def test_the_default_model_answers_paris_over_http(tmp_path: Path) -> None:
    assert Settings().model is None  # no model configured: the default one is served
    with default_model_server() as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        [model] = [m.id for m in client.models.list()]
        assert model == "smollm2-135m-instruct"
        question = "What is the capital of France? Answer in one sentence."
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0,
            max_tokens=32,
        )
        choice = reply.choices[0]
        assert "Paris" in choice.message.content, choice.message.content
        assert choice.finish_reason == "stop"  # it ended its turn with <|im_end|>
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0,
            max_tokens=32, stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == choice.message.content
        check_structured_output_and_tools(client, model)
        assert httpx.get(url + "/health").status_code == 200
