"""The OpenAI API as seen through the Quart test client, on the fake model (exact outputs)."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from .helpers import (
    expected,
    StepGate,
    all_zero,
    chat_body,
    counts,
    fake_engine,
    make_app,
    metric,
    parse_sse,
    running,
)


def chat_prompt(tokenizer: Any, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
async def app(tokenizer):  # type: ignore[no-untyped-def]
    app = make_app(tokenizer)
    async with running(app) as client:
        app.client = client
        yield app
        assert counts(app) == dict.fromkeys(counts(app), 0)  # nothing left behind (G1)


async def test_chat_completion_is_exact_and_shaped_like_openai(app, tokenizer) -> None:
    r = await app.client.post("/v1/chat/completions", json=chat_body("hi there", max_tokens=6, temperature=0))
    assert r.status_code == 200
    body = await r.get_json()
    want = expected(tokenizer, chat_prompt(tokenizer, "hi there"), 6)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "fake" and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": tokenizer.decode(want)},
        "logprobs": None,
        "finish_reason": "length",
    }
    prompt_len = len(chat_prompt(tokenizer, "hi there"))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 6, "total_tokens": prompt_len + 6}


async def test_content_parts_and_developer_role_are_accepted(app, tokenizer) -> None:
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    r = await app.client.post(
        "/v1/chat/completions",
        json={"model": "fake", "max_tokens": 2, "temperature": 0,
              "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}]},
    )
    assert r.status_code == 200


async def test_stream_has_role_first_finish_last_then_done(app, tokenizer) -> None:
    r = await app.client.post("/v1/chat/completions", json=chat_body("hey", max_tokens=5, temperature=0, stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(await r.get_data(as_text=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == tokenizer.decode(expected(tokenizer, chat_prompt(tokenizer, "hey"), 5))


async def test_include_usage_adds_a_final_usage_chunk(app, tokenizer) -> None:
    r = await app.client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "abc", "max_tokens": 4, "n": 2, "stream": True,
              "stream_options": {"include_usage": True}},
    )
    events = parse_sse(await r.get_data(as_text=True))
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert usage_chunk["choices"] == [] and usage_chunk["object"] == "text_completion"
    n_prompt = len(tokenizer.encode("abc"))
    assert usage_chunk["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 8, "total_tokens": n_prompt + 8}
    assert all(c["usage"] is None for c in chunks)  # null on every other chunk, as OpenAI does
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}


async def test_stream_options_null_is_accepted_and_without_stream_rejected(app) -> None:
    r = await app.client.post("/v1/chat/completions", json=chat_body(max_tokens=1, stream=True, stream_options=None))
    assert r.status_code == 200
    r = await app.client.post("/v1/chat/completions", json=chat_body(max_tokens=1, stream_options={"include_usage": True}))
    assert r.status_code == 400 and (await r.get_json())["error"]["param"] == "stream_options"


async def test_completion_with_token_ids_prompt_and_echo(app, tokenizer) -> None:
    prompt = tokenizer.encode("the harbour")
    r = await app.client.post("/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True})
    body = await r.get_json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    want = expected(tokenizer, prompt, 3)
    assert body["choices"][0]["text"] == tokenizer.decode(prompt) + tokenizer.decode(want)


async def test_stop_token_gives_stop_and_is_not_in_the_text(app, tokenizer) -> None:
    prompt = tokenizer.encode("abc")
    want = expected(tokenizer, prompt, 6)
    r = await app.client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stop_token_ids": [want[3]]},
    )
    body = await r.get_json()
    cut = want.index(want[3])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == tokenizer.decode(want[:cut])
    assert body["usage"]["completion_tokens"] == cut + 1  # the stop token was generated


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_tokens_is_cut_and_gives_stop(app, tokenizer, stream) -> None:
    prompt = tokenizer.encode("hello")
    want = expected(tokenizer, prompt, 12)
    pieces = [tokenizer.decode(want[:i]) for i in range(13)]
    full = pieces[12]
    # A stop string that starts inside token 4's text and ends inside token 6's: no single
    # engine step (one token) contains it.
    start = len(pieces[4]) - 1 if len(tokenizer.decode(want[3:4])) > 1 else len(pieces[4])
    stop = full[start : len(pieces[6]) + 1]
    assert stop and full.find(stop) == start
    r = await app.client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop, "zzzz-never"], "stream": stream},
    )
    if stream:
        events = parse_sse(await r.get_data(as_text=True))
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        finish = events[-2]["choices"][0]["finish_reason"]
        assert all(stop not in e["choices"][0]["text"] for e in events[:-1])
    else:
        body = await r.get_json()
        text, finish = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
    assert text == full[:start] and finish == "stop"


async def test_n_choices_with_seed_differ_and_replay(app) -> None:
    body = {"model": "fake", "prompt": "once", "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 7}
    first = await (await app.client.post("/v1/completions", json=body)).get_json()
    again = await (await app.client.post("/v1/completions", json=body)).get_json()
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3  # seed + i per choice
    assert texts == [c["text"] for c in again["choices"]]
    other = await (await app.client.post("/v1/completions", json={**body, "seed": 8})).get_json()
    assert [c["text"] for c in other["choices"]] != texts
    assert first["usage"]["completion_tokens"] == 24


async def test_chat_logprobs_are_consistent_with_the_text(app, tokenizer) -> None:
    r = await app.client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3))
    body = await r.get_json()
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 5
    # The fake model emits arbitrary bytes; a broken sequence may show as one U+FFFD or several.
    lossy = b"".join(bytes(e["bytes"]) for e in content).decode(errors="replace")
    assert re.sub("\ufffd+", "?", lossy) == re.sub("\ufffd+", "?", choice["message"]["content"])
    assert choice["message"]["content"] == tokenizer.decode(expected(tokenizer, chat_prompt(tokenizer, "hi"), 5))
    for e in content:
        assert len(e["top_logprobs"]) == 3 and e["logprob"] <= 0
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][-1]["logprob"]
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the chosen one is the best


async def test_completion_logprobs_legacy_format(app, tokenizer) -> None:
    r = await app.client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 2})
    lp = (await r.get_json())["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0


async def test_max_tokens_absent_fills_the_context(tokenizer) -> None:
    app = make_app(tokenizer, fake_engine(tokenizer, max_model_len=40))
    async with running(app) as client:
        prompt = tokenizer.encode("hello")
        r = await client.post("/v1/completions", json={"model": "fake", "prompt": prompt, "temperature": 0, "ignore_eos": True})
        body = await r.get_json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["total_tokens"] == 40
        # max_completion_tokens is honoured on chat
        r = await client.post("/v1/chat/completions", json=chat_body("x", max_completion_tokens=2, temperature=0))
        assert (await r.get_json())["usage"]["completion_tokens"] == 2


async def test_models_tokenize_detokenize_metrics(app, tokenizer) -> None:
    models = await (await app.client.get("/v1/models")).get_json()
    assert models["data"][0]["id"] == "fake" and models["object"] == "list"
    tok = await (await app.client.post("/tokenize", json={"prompt": "hello world"})).get_json()
    assert tok["tokens"] == tokenizer.encode("hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 4096
    chat = await (await app.client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).get_json()
    assert chat["tokens"] == chat_prompt(tokenizer, "hi")
    detok = await (await app.client.post("/detokenize", json={"tokens": tok["tokens"]})).get_json()
    assert detok == {"prompt": "hello world"}
    r = await app.client.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400
    # The "length" counter must move: a fake model that met EOS by chance at temperature 1 (about
    # once in 500 tokens) would leave it at 0. It never samples EOS by chance (see
    # trio_infer/models/fake.py); ignore_eos stays, and the response's finish_reason is checked first.
    r = await app.client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 3,
                                                        "ignore_eos": True})
    assert (await r.get_json())["choices"][0]["finish_reason"] == "length"
    text = await (await app.client.get("/metrics")).get_data(as_text=True)
    assert metric(text, "trio_infer_requests_total", 'finish_reason="length"') >= 1
    assert metric(text, "trio_infer_generation_tokens_total") >= 3
    assert metric(text, "trio_infer_sessions_active") == 0


async def test_api_key_is_required_except_for_health(tokenizer) -> None:
    app = make_app(tokenizer, api_key="sekret")
    async with running(app) as client:
        r = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 401
        err = (await r.get_json())["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        r = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_unknown_and_unsupported_fields_are_named(app) -> None:
    for field, value in [("prediction", {"type": "content"}), ("functions", [{"name": "f"}]), ("frobnicate", 1)]:
        r = await app.client.post("/v1/chat/completions", json=chat_body(max_tokens=1, **{field: value}))
        assert r.status_code == 400, field
        err = (await r.get_json())["error"]
        assert err["param"] == field and field in err["message"]
    # Supported fields are checked inside: the param names where.
    r = await app.client.post("/v1/chat/completions", json=chat_body(max_tokens=1, tools=[{"type": "function"}]))
    assert r.status_code == 400 and (await r.get_json())["error"]["param"] == "tools.0.function"
    # Values that ask for nothing are not refused: clients send them.
    r = await app.client.post("/v1/chat/completions", json=chat_body(max_tokens=1, tools=None, logit_bias={}, user="u1", store=False))
    assert r.status_code == 200
    r = await app.client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 1, "suffix": "x"})
    assert r.status_code == 400 and (await r.get_json())["error"]["param"] == "suffix"


async def test_n_above_the_limit_is_refused_and_a_one_prompt_list_is_one_prompt(app) -> None:
    r = await app.client.post("/v1/completions", json={"model": "fake", "prompt": "a", "n": 9})
    assert r.status_code == 400 and (await r.get_json())["error"]["param"] == "n"
    r = await app.client.post("/v1/completions", json={"model": "fake", "prompt": ["a"], "max_tokens": 1})
    assert r.status_code == 200 and len((await r.get_json())["choices"]) == 1


async def test_queue_full_is_429_with_retry_after(tokenizer) -> None:
    app = make_app(tokenizer, max_waiting=1)
    async with running(app) as client:
        gate = StepGate(app)
        gate.hold()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2}))
            await trio.testing.wait_all_tasks_blocked()
            assert counts(app)["waiting"] == 1
            r = await client.post("/v1/completions", json={"model": "fake", "prompt": "b", "max_tokens": 2, "stream": True})
            # Nothing was scheduled in the drain window: Retry-After is the window (30 s).
            assert r.status_code == 429 and r.headers["Retry-After"] == "30"
            error = (await r.get_json())["error"]
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
            gate.allow()
        assert all_zero(app)


async def test_chat_n2_stream_has_a_role_chunk_and_a_finish_per_choice(app, tokenizer) -> None:
    r = await app.client.post("/v1/chat/completions", json=chat_body("hey", max_tokens=3, n=2, temperature=0, stream=True))
    chunks = parse_sse(await r.get_data(as_text=True))[:-1]
    assert all(len(c["choices"]) == 1 for c in chunks)
    by_choice: dict[int, list[dict]] = {0: [], 1: []}
    for c in chunks:
        by_choice[c["choices"][0]["index"]].append(c["choices"][0])
    want = tokenizer.decode(expected(tokenizer, chat_prompt(tokenizer, "hey"), 3))
    for choice in by_choice.values():
        assert choice[0]["delta"] == {"role": "assistant", "content": ""}
        assert [x["finish_reason"] for x in choice][-1] == "length"
        assert "".join(x["delta"].get("content", "") for x in choice) == want  # greedy: equal


async def test_validation_errors_name_the_field_and_the_accepted_types(app) -> None:
    r = await app.client.post("/v1/completions", json={"model": "fake", "prompt": "a", "stop": 5})
    err = (await r.get_json())["error"]
    assert r.status_code == 400 and err["param"] == "stop" and "str or list[str]" in err["message"]
    r = await app.client.post("/v1/chat/completions", json={"model": "fake", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    err = (await r.get_json())["error"]
    assert r.status_code == 400 and err["param"] == "messages.0.content.0.type"
    r = await app.client.post("/v1/completions", json={"prompt": "a"})
    assert (await r.get_json())["error"]["message"] == "Missing required parameter: 'model'."
