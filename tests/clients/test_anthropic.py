"""What Anthropic's clients send, beyond tests/api/test_messages.py's SDK matrix: Claude Code's
default ``max_tokens: 32000`` on a model whose context is far smaller (a cap, as Anthropic and
llama-server have it: the answer runs until the context is full and ends with ``max_tokens``;
the OpenAI routes keep vLLM's 400), and the assistant prefill (the answer continues the last
assistant message and does not repeat it). With the ``anthropic`` SDK against the real server,
and in process on the fake model where the exact count matters.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import anthropic
import httpx
import pytest

from api.helpers import fake_engine, make_app, post_stream, running
from api.test_server import Server
from trio_infer.models.synthetic import build_tokenizer

from .conftest import CONTEXT

CLAUDE_CODE_MAX_TOKENS = 32000
GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "Say hello."}]
PREFILLED = [*QUESTION, {"role": "assistant", "content": "Hello, my"}]


@pytest.fixture
def client(idle: Server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=idle.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


# -- max_tokens beyond the context ------------------------------------------------------------------


def test_claude_codes_max_tokens_streams_with_the_sdk(client: anthropic.Anthropic, idle: Server) -> None:
    with client.messages.stream(model=idle.model, max_tokens=CLAUDE_CODE_MAX_TOKENS, messages=QUESTION,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and text == final.content[0].text
    assert final.usage.input_tokens + final.usage.output_tokens <= CONTEXT
    if final.stop_reason == "max_tokens":  # the context, not the request, ended it
        assert final.usage.input_tokens + final.usage.output_tokens == CONTEXT


async def test_max_tokens_is_a_cap_on_messages_and_a_400_on_openais_routes(tokenizer: Any) -> None:
    context = 64
    app = make_app(tokenizer, fake_engine(tokenizer, max_model_len=context))
    body = {"model": "fake", "max_tokens": CLAUDE_CODE_MAX_TOKENS, "messages": QUESTION, **GREEDY}
    async with running(app) as c:
        r = await c.post("/v1/messages", json=body)
        assert r.status_code == 200, await r.get_data()
        whole = await r.get_json()
        assert whole["stop_reason"] == "max_tokens"
        assert whole["usage"]["input_tokens"] + whole["usage"]["output_tokens"] == context
        status, raw = await post_stream(c, "/v1/messages", {**body, "stream": True})
        assert status == 200
        events = [json.loads(line[len("data: "):]) for line in raw.split("\n") if line.startswith("data: ")]
        [delta] = [e for e in events if e["type"] == "message_delta"]
        assert delta["delta"]["stop_reason"] == "max_tokens"
        assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        assert text == whole["content"][0]["text"]
        # a max_tokens that fits is honoured as it is
        r = await c.post("/v1/messages", json={**body, "max_tokens": 5})
        assert (await r.get_json())["usage"]["output_tokens"] == 5
        # OpenAI's routes: vLLM's rule, a 400 naming the field
        r = await c.post("/v1/chat/completions", json={**body, "max_tokens": CLAUDE_CODE_MAX_TOKENS})
        error = (await r.get_json())["error"]
        assert r.status_code == 400 and error["param"] == "max_tokens"
        assert error["code"] == "context_length_exceeded"
        r = await c.post("/v1/responses", json={"model": "fake", "input": "Say hello.",
                                                "max_output_tokens": CLAUDE_CODE_MAX_TOKENS})
        assert r.status_code == 400 and (await r.get_json())["error"]["param"] == "max_output_tokens"
        # a prompt that fills the context is refused on Messages too
        r = await c.post("/v1/messages", json={**body, "messages": [{"role": "user", "content": "x " * context}]})
        assert r.status_code == 400 and (await r.get_json())["error"]["type"] == "invalid_request_error"


# -- the assistant prefill --------------------------------------------------------------------------


def _continuation(server: Server, messages: list[dict[str, Any]], max_tokens: int) -> tuple[int, str]:
    """The prompt of ``messages`` with the last (assistant) one left open, as the server's
    /tokenize renders it (vLLM's continue_final_message), and the greedy text that follows it."""
    prompt = httpx.post(server.url + "/tokenize", timeout=60, json={
        "model": server.model, "messages": messages, "add_generation_prompt": False,
        "continue_final_message": True}).json()["tokens"]
    done = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).json()
    return len(prompt), done["choices"][0]["text"]


def test_prefill_is_continued_not_repeated(client: anthropic.Anthropic, idle: Server) -> None:
    kw: dict[str, Any] = dict(model=idle.model, max_tokens=8, messages=PREFILLED, extra_body=GREEDY)
    reply = client.messages.create(**kw)
    prompt_tokens, expected = _continuation(idle, PREFILLED, 8)
    assert reply.usage.input_tokens == prompt_tokens
    assert [(b.type, b.text) for b in reply.content] == [("text", expected)]  # type: ignore[union-attr]
    with client.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == expected
    assert client.messages.count_tokens(model=idle.model, messages=PREFILLED).input_tokens == prompt_tokens
    # not the answer to the question alone: the prompt differs
    plain = client.messages.count_tokens(model=idle.model, messages=QUESTION).input_tokens
    assert plain != prompt_tokens


def test_prefill_edge_cases(client: anthropic.Anthropic, idle: Server) -> None:
    # Anthropic refuses a prefill that ends in whitespace, naming the message
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=idle.model, max_tokens=4, messages=[
            *QUESTION, {"role": "assistant", "content": "Hello "}])
    assert caught.value.body["error"]["message"].startswith("messages.1.content: ")  # type: ignore[index]
    # an empty last assistant message asks for an answer as if it were not there
    count = client.messages.count_tokens(model=idle.model, messages=QUESTION).input_tokens
    empty = client.messages.count_tokens(model=idle.model, messages=[
        *QUESTION, {"role": "assistant", "content": ""}]).input_tokens
    assert empty == count
    # text blocks and a thinking block echoed back: the text is the prefill
    blocks = client.messages.count_tokens(model=idle.model, messages=[*QUESTION, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "x"}, {"type": "text", "text": "Hello, my"}]}])
    assert blocks.input_tokens == client.messages.count_tokens(model=idle.model, messages=PREFILLED).input_tokens
