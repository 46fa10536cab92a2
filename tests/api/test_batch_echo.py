"""What evaluation harnesses send to /v1/completions: batches of prompts (strings or token ids),
``echo`` with ``logprobs`` (prompt logprobs), ``max_tokens`` 0. On the fake model (exact)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from .helpers import (
    expected,
    StepGate,
    all_zero,
    counts,
    make_app,
    metric,
    open_request,
    parse_sse,
    post_stream,
    read_until,
    running,
)
from trio_infer.models.fake import expected_next_token, logprob
from trio_infer.models.synthetic import IM_END


def fake_lp(tokenizer: Any, ids: list[int], i: int) -> tuple[float, int]:
    """The fake model's logprob of ``ids[i]`` after ``ids[:i]``, and its best token there."""
    vocab, eos = len(tokenizer), tokenizer.convert_tokens_to_ids(IM_END)
    best = expected_next_token(ids[:i], vocab, eos)
    return logprob(ids[:i], ids[i], vocab, eos), best


def token_text(tokenizer: Any, t: int) -> str:
    return tokenizer.decode([t], skip_special_tokens=False)


def check_prompt_logprobs(tokenizer: Any, lp: dict, ids: list[int]) -> None:
    """The first ``len(ids)`` entries of a legacy logprobs object are the prompt's."""
    n = len(ids)
    assert lp["tokens"][:n] == [token_text(tokenizer, t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = [0]
    for t in ids[:-1]:
        offsets.append(offsets[-1] + len(token_text(tokenizer, t)))
    assert lp["text_offset"][:n] == offsets
    for i in range(1, n):
        want, best = fake_lp(tokenizer, ids, i)
        assert lp["token_logprobs"][i] == pytest.approx(want, abs=1e-5)
        [(text, value)] = lp["top_logprobs"][i].items()  # logprobs: 1
        assert text == token_text(tokenizer, best)
        assert value == pytest.approx(fake_lp(tokenizer, ids[: i] + [best], i)[0], abs=1e-5)


@pytest.fixture
async def app(tokenizer):  # type: ignore[no-untyped-def]
    app = make_app(tokenizer, max_waiting=16)
    async with running(app) as client:
        app.client = client
        yield app
        assert all_zero(app), counts(app)  # every session ended, nothing left behind


async def post(app, body: dict[str, Any]) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    r = await app.client.post("/v1/completions", json={"model": "fake", **body})
    return r.status_code, await r.get_json()


async def test_batch_of_strings_is_prompt_major_with_summed_usage(app, tokenizer) -> None:
    prompts = ["the harbour", "a", "once upon"]
    status, body = await post(app, {"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0})
    assert status == 200
    ids = [tokenizer.encode(p) for p in prompts]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for c in body["choices"]:
        j = c["index"] // 2
        assert c["text"] == tokenizer.decode(expected(tokenizer, ids[j], 3)) and c["finish_reason"] == "length"
    n_prompt = sum(len(i) for i in ids)
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 18, "total_tokens": n_prompt + 18}


async def test_batch_of_token_ids_with_echo_and_seeds(app, tokenizer) -> None:
    ids = [tokenizer.encode("hello"), [5, 6, 7, 8], tokenizer.encode("world")]
    status, body = await post(app, {"prompt": ids, "max_tokens": 4, "temperature": 0, "echo": True})
    assert status == 200 and len(body["choices"]) == 3
    for j, c in enumerate(body["choices"]):
        assert c["index"] == j
        assert c["text"] == tokenizer.decode(ids[j]) + tokenizer.decode(expected(tokenizer, ids[j], 4))
    # Seeded sampling: a prompt's choices in a batch are those it gets alone.
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 6, "n": 2}
    _, batch = await post(app, {"prompt": ids, **sampled})
    _, alone = await post(app, {"prompt": ids[1], **sampled})
    assert [c["text"] for c in batch["choices"][2:4]] == [c["text"] for c in alone["choices"]]


async def test_echo_with_logprobs_scores_the_prompt_then_the_completion(app, tokenizer) -> None:
    """The lm-evaluation-harness loglikelihood request: token ids, echo, logprobs 1, max_tokens 1."""
    ids = [tokenizer.encode("the quick brown fox"), [9, 10, 11, 12, 13, 14]]
    status, body = await post(app, {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True,
                                     "logprobs": 1})
    assert status == 200
    for j, c in enumerate(body["choices"]):
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(ids[j]) + 1
        check_prompt_logprobs(tokenizer, lp, ids[j])
        [nxt] = expected(tokenizer, ids[j], 1)
        assert lp["token_logprobs"][-1] == pytest.approx(fake_lp(tokenizer, ids[j] + [nxt], len(ids[j]))[0], abs=1e-5)
        assert lp["text_offset"][-1] == len(tokenizer.decode(ids[j]))
        assert c["text"] == tokenizer.decode(ids[j]) + tokenizer.decode([nxt])
    assert body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_max_tokens_zero_with_echo_and_logprobs_is_the_prompt_alone(app, tokenizer, stream) -> None:
    prompts = ["hello there", "general kenobi"]
    ids = [tokenizer.encode(p) for p in prompts]
    gate = StepGate(app)
    req = {"model": "fake", "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
    if stream:
        status, raw = await post_stream(app.client, "/v1/completions",
                                        {**req, "stream": True, "stream_options": {"include_usage": True}})
        *chunks, usage_chunk, done = parse_sse(raw)
        assert done == "[DONE]" and status == 200
        assert len(chunks) == 2  # one chunk per choice: the echo, its logprobs and the finish
        choices = sorted((c["choices"][0] for c in chunks), key=lambda c: c["index"])
        usage = usage_chunk["usage"]
    else:
        r = await app.client.post("/v1/completions", json=req)
        body = await r.get_json()
        choices, usage = body["choices"], body["usage"]
    for j, c in enumerate(choices):
        assert c["index"] == j and c["text"] == prompts[j] and c["finish_reason"] == "length"
        assert len(c["logprobs"]["tokens"]) == len(ids[j])
        check_prompt_logprobs(tokenizer, c["logprobs"], ids[j])
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == sum(len(i) for i in ids)
    assert gate.steps >= 1  # the prefill ran (it computes the logprobs), and nothing else:
    text = await (await app.client.get("/metrics")).get_data(as_text=True)
    assert metric(text, "trio_infer_generation_tokens_total") == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_max_tokens_zero_without_logprobs_runs_nothing(app, tokenizer, stream) -> None:
    gate = StepGate(app)
    req = {"model": "fake", "prompt": ["ab", "cd"], "max_tokens": 0, "echo": True, "stream": stream}
    if stream:
        _, raw = await post_stream(app.client, "/v1/completions", req)
        events = parse_sse(raw)
        assert events[-1] == "[DONE]"
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        for e in events[:-1]:
            c = e["choices"][0]
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
        assert texts == {0: "ab", 1: "cd"} and finishes == {0: "length", 1: "length"}
    else:
        r = await app.client.post("/v1/completions", json=req)
        body = await r.get_json()
        assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [("ab", "length"), ("cd", "length")]
        assert body["usage"]["completion_tokens"] == 0
        r = await app.client.post("/v1/completions", json={**req, "echo": False})
        assert [c["text"] for c in (await r.get_json())["choices"]] == ["", ""]
    assert gate.steps == 0


async def test_streaming_a_batch(app, tokenizer) -> None:
    prompts = ["abc", "hello world", "x"]
    ids = [tokenizer.encode(p) for p in prompts]
    status, raw = await post_stream(app.client, "/v1/completions", {
        "model": "fake", "prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0, "echo": True,
        "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    *chunks, usage_chunk, done = parse_sse(raw)
    assert done == "[DONE]"
    text: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        [c] = chunk["choices"]
        text[c["index"]] = text.get(c["index"], "") + c["text"]
        tokens.setdefault(c["index"], []).extend(c["logprobs"]["tokens"])
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    assert sorted(text) == list(range(6)) and set(finish.values()) == {"length"}
    for k, t in text.items():
        want = expected(tokenizer, ids[k // 2], 5)
        assert t == prompts[k // 2] + tokenizer.decode(want)
        assert tokens[k] == [token_text(tokenizer, x) for x in ids[k // 2] + want]
    n_prompt = sum(len(i) for i in ids)
    assert usage_chunk["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 30,
                                    "total_tokens": n_prompt + 30}


async def test_a_bad_prompt_refuses_the_whole_batch_naming_it(app, tokenizer) -> None:
    text = await (await app.client.get("/metrics")).get_data(as_text=True)
    prompt_tokens = metric(text, "trio_infer_prompt_tokens_total")
    cases = [
        (["a", ""], "prompt.1", "rompt 1 of the batch is empty"),
        ([[1, 2], [3, 10**9]], "prompt.1", "in prompt 1 of the batch is out of range"),
        ([[1, 2], []], "prompt.1", "rompt 1 of the batch is empty"),
        (["a", "b" * 5000], "prompt.1", "prompt 1 of the batch has"),
        (["a", "b", "c", "d", "e", "f", "g", "h", "i"], "prompt", "Split it"),  # 9 x n=2 > 16
    ]
    for prompt, param, message in cases:
        status, body = await post(app, {"prompt": prompt, "max_tokens": 2, "n": 2})
        assert status == 400, prompt
        assert body["error"]["param"] == param and message in body["error"]["message"], body
    status, body = await post(app, {"prompt": [[1, 2], "a"], "max_tokens": 2})  # mixed kinds
    assert status == 400 and body["error"]["param"].startswith("prompt")
    status, body = await post(app, {"prompt": "a", "max_tokens": -1})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    text = await (await app.client.get("/metrics")).get_data(as_text=True)
    assert metric(text, "trio_infer_prompt_tokens_total") == prompt_tokens  # nothing was scheduled


async def test_leaving_a_streamed_batch_ends_every_prompt(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        gate = StepGate(app)
        gate.allow(4)
        body = {"model": "fake", "prompt": ["a", "bb", "ccc"], "n": 2, "max_tokens": 2000,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with trio.fail_after(60):
            async with open_request(client, "/v1/completions", body) as conn:
                await read_until(conn, lambda t: t.count("data: ") >= 6)
                await trio.testing.wait_all_tasks_blocked()
                during = counts(app)
                assert during["sessions"] == 1 and during["running"] == 6 and during["live_uids"] == 6
            await trio.testing.wait_all_tasks_blocked()
            assert all_zero(app), counts(app)
            steps = gate.steps
            gate.allow()
            await trio.testing.wait_all_tasks_blocked()
            assert gate.steps == steps  # nothing of the batch runs any more
            text = await (await client.get("/metrics")).get_data(as_text=True)
            assert metric(text, "trio_infer_requests_total", 'finish_reason="abort"') == 6


async def test_leaving_a_non_streamed_batch_ends_every_prompt(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        gate = StepGate(app)
        gate.allow(3)
        body = {"model": "fake", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2000, "ignore_eos": True,
                "echo": True, "logprobs": 2}
        with trio.fail_after(60):
            async with open_request(client, "/v1/completions", body):
                await trio.testing.wait_all_tasks_blocked()
                assert counts(app)["running"] == 2 and gate.steps == 3
            await trio.testing.wait_all_tasks_blocked()
            assert all_zero(app), counts(app)
