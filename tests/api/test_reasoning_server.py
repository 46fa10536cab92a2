"""A reasoning model end to end: a real server (hypercorn, the batching worker process) on a tiny
random Qwen3 checkpoint whose tokenizer has Qwen3's think tags and chat template, with the
official ``openai`` client: ``reasoning_content`` apart from the answer, streamed and not, the
same either way; ``enable_thinking: false`` through ``chat_template_kwargs``; the thinking budget;
and ``continuous_usage_stats`` (what guidellm sends).

A random model does not think on its own: a grammar naming the tags makes it (and then the
grammar constrains the thinking too).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from .test_extensions import QWEN3_TEMPLATE
from .test_server import Server, start_server


@pytest.fixture(scope="module")
def server(tiny_checkpoint_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A vocabulary wider than the tokenizer's (the synthetic one trains ~1.3k tokens): room for the
    # two tags.
    source = tiny_checkpoint_factory(vocab_size=2048)
    folder = tmp_path_factory.mktemp("thinking") / "qwen3-thinking"
    shutil.copytree(source, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(folder)
    yield from start_server(folder, tmp_path_factory, {"TRIO_INFER_THINKING_TOKEN_BUDGET": "50"})


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    server.wait_idle()


MESSAGES = [{"role": "user", "content": "Is the harbour open?"}]
THINK = 'start: <think> "\\nLet me see.\\n" </think> "\\n\\n" ("yes" | "no")'


def test_reasoning_content_with_the_openai_client(client: openai.OpenAI, server: Server) -> None:
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=40, temperature=0,
        extra_body={"guided_grammar": THINK})
    message = reply.choices[0].message
    assert message.reasoning_content == "\nLet me see.\n"  # type: ignore[attr-defined]
    assert message.content in ("yes", "no") and reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"guided_grammar": THINK})
    reasoning, content, usages = "", "", []
    for chunk in stream:
        usages.append(chunk.usage.completion_tokens)
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)  # type: ignore[attr-defined]
    assert usages == sorted(usages) and usages[-1] == reply.usage.completion_tokens


def test_enable_thinking_false_and_the_budget(client: openai.OpenAI, server: Server) -> None:
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=5, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert not getattr(reply.choices[0].message, "reasoning_content", None)
    prompt = httpx.post(server.url + "/tokenize", json={
        "model": server.model, "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert reply.usage.prompt_tokens == prompt["count"]
    # Thinking letters for ever, but the budget (the request's, below the server's 50) closes it.
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=40, temperature=0,
        extra_body={"guided_grammar": 'start: <think> /[a-z ]*/ </think> "ok"', "thinking_token_budget": 4})
    message = reply.choices[0].message
    assert message.content == "ok" and reply.choices[0].finish_reason == "stop"
    assert message.reasoning_content  # type: ignore[attr-defined]


def test_reasoning_tokens_are_counted_in_the_usage(client: openai.OpenAI, server: Server) -> None:
    kw = dict(model=server.model, messages=MESSAGES, max_tokens=40, temperature=0,
              extra_body={"guided_grammar": THINK})
    reply = client.chat.completions.create(logprobs=True, **kw)  # type: ignore[call-overload]
    tokens = [t.token for t in reply.choices[0].logprobs.content]
    thought = tokens.index("</think>") + 1  # the tags and what stands between them
    assert 0 < thought < reply.usage.completion_tokens
    assert reply.usage.completion_tokens_details.reasoning_tokens == thought
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)  # type: ignore[call-overload]
    counts = [chunk.usage.completion_tokens_details.reasoning_tokens for chunk in stream if chunk.choices or chunk.usage]
    assert counts == sorted(counts) and counts[-1] == thought
    # an answer that does not think: a true 0
    plain = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=5, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    # the Responses API counts the same as chat for the same request
    chat = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6, temperature=0)
    resp = client.responses.create(model=server.model, input=MESSAGES[0]["content"], max_output_tokens=6,
                                   temperature=0)
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens
