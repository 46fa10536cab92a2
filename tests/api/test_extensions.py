"""The vLLM extensions and OpenAI fields the server takes, on the fake model (exact outputs),
in process:
``stream_options.continuous_usage_stats``, ``logit_bias``, ``min_tokens``, ``stop_token_ids``,
``repetition_penalty``, ``skip_special_tokens``, ``include_stop_str_in_output``, the structured
outputs by regex, choice and Lark grammar, ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``, the ``unknown_fields`` policy, and a reasoning model's thinking split
into ``reasoning_content``.

The fake model's logits are 1 on its next token and 0 elsewhere (EOS far below), so a bias of a
few units decides the greedy token exactly.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trio_infer.api.errors import APIError
from trio_infer.api.events import Content, Finish, Reasoning
from trio_infer.api.response_events import ResponseEvents, ThinkSplit, reasoning_tokens
from trio_infer.api.plans import ModelLimits, ReasoningPlan, plan_chat, template_thinks
from trio_infer.api.protocol import ChatCompletionRequest
from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.engine.grammar import Grammars
from trio_infer.wire import SamplingParams
from trio_infer.engine.sampler import _adjust, _restrict
from trio_infer.models.fake import FakeModel
from trio_infer.models.synthetic import IM_END, IM_START_ID, build_tokenizer
from trio_infer.runtime.text_stream import ChoiceDelta

from .helpers import all_zero, chat_body, expected, make_app, parse_sse, post_stream, running

# Qwen3's own chat template (Qwen/Qwen3-0.6B, Apache-2.0), as its tokenizer_config ships it: earlier
# turns' thinking dropped, ``enable_thinking`` false writes an empty thinking block after the
# generation prompt, tools as <tool_call> blocks.
QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The synthetic tokenizer (ChatML, as Qwen's) with Qwen3's think tags as tokens (not special:
    Qwen3's are not, so they stay in decoded text) and Qwen3's chat template."""
    tok = build_tokenizer(tmp_path_factory.mktemp("thinking-tokenizer"))
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def engine_with_grammars(tokenizer: Any) -> Engine:
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    model = FakeModel(vocab_size=len(tokenizer), max_model_len=4096, eos_token_id=eos)
    config = EngineConfig(page_size=16, num_pages=512, max_running=8, max_batched_tokens=256)
    grammars = Grammars.for_hf_tokenizer(tokenizer, len(tokenizer), [eos])
    return Engine(model, config, grammars=grammars)


@pytest.fixture
async def client(tokenizer):  # type: ignore[no-untyped-def]
    app = make_app(tokenizer, engine_with_grammars(tokenizer))
    async with running(app) as c:
        yield c
        assert all_zero(app)


def completion(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": prompt, "temperature": 0, **kw}


PROMPT = [300, 301, 302, 303]


# -- continuous_usage_stats ----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_continuous_usage_stats_puts_usage_on_every_chunk(client, path: str) -> None:
    body = chat_body("hi", max_tokens=5, temperature=0) if "chat" in path else completion(PROMPT, max_tokens=5)
    body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    status, raw = await post_stream(client, path, body)
    assert status == 200
    *chunks, last_usage, done = parse_sse(raw)
    assert done == "[DONE]" and last_usage["choices"] == [] and last_usage["usage"]["completion_tokens"] == 5
    prompt_tokens = last_usage["usage"]["prompt_tokens"]
    seen = []
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        seen.append(usage["completion_tokens"])
    assert seen == sorted(seen) and seen[-1] == 5
    # Without it, usage is null on every chunk but the last (OpenAI's include_usage).
    body["stream_options"] = {"include_usage": True}
    *chunks, last_usage, _ = parse_sse((await post_stream(client, path, body))[1])
    assert all(c["usage"] is None for c in chunks) and last_usage["usage"]["completion_tokens"] == 5
    # As vLLM: continuous_usage_stats alone (no include_usage) adds nothing.
    body["stream_options"] = {"continuous_usage_stats": True}
    *chunks, _ = parse_sse((await post_stream(client, path, body))[1])
    assert all("usage" not in c for c in chunks)


# -- sampling fields -----------------------------------------------------------------------------


async def test_logit_bias_decides_the_greedy_token(client, tokenizer) -> None:
    r = await client.post("/v1/completions", json=completion(PROMPT, max_tokens=4, logit_bias={"77": 5}))
    assert r.status_code == 200
    assert (await r.get_json())["choices"][0]["text"] == tokenizer.decode([77] * 4)
    # A bias of -100 on what the model would say makes it say something else.
    first = expected(tokenizer, PROMPT, 1)[0]
    r = await client.post("/v1/completions", json=completion(PROMPT, max_tokens=1, logit_bias={str(first): -100}))
    assert (await r.get_json())["choices"][0]["text"] != tokenizer.decode([first])
    for bad in ({"x": 1}, {"1": 101}, {str(len(tokenizer) + 5): 1}):
        r = await client.post("/v1/completions", json=completion(PROMPT, max_tokens=1, logit_bias=bad))
        assert r.status_code == 400 and (await r.get_json())["error"]["param"].startswith("logit_bias"), bad


async def test_min_tokens_holds_back_stop_tokens(client, tokenizer) -> None:
    # Token 77 is pushed to the top and is a stop token: the answer ends at once...
    body = completion(PROMPT, max_tokens=10, logit_bias={"77": 5}, stop_token_ids=[77])
    r = await client.post("/v1/completions", json=body)
    out = await r.get_json()
    assert out["choices"][0]["text"] == "" and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 1
    # ...unless min_tokens forbids it for the first 3 tokens (the model's own tokens come then).
    r = await client.post("/v1/completions", json={**body, "min_tokens": 3})
    out = await r.get_json()
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 4
    assert out["choices"][0]["text"] == tokenizer.decode(expected(tokenizer, PROMPT, 3))
    r = await client.post("/v1/completions", json=completion(PROMPT, max_tokens=2, min_tokens=3))
    assert r.status_code == 400 and (await r.get_json())["error"]["param"] == "min_tokens"


def test_repetition_penalty_and_min_tokens_in_the_sampler() -> None:
    class Seq:
        token_ids = [1, 2, 5]
        num_prompt_tokens = 2
        num_output_tokens = 1
        output_ids = [5]
        min_tokens_block = (0,)

    row = np.array([3.0, 2.0, -2.0, 1.0, 0.0, 4.0], dtype=np.float32)
    p = SamplingParams(repetition_penalty=2.0, min_tokens=2)
    _adjust(row, Seq(), p, 6)  # type: ignore[arg-type]
    _restrict(row, Seq(), p)  # type: ignore[arg-type]
    # Seen tokens (prompt and output: 1, 2, 5): positive logits halved, negative ones doubled;
    # token 0 (the EOS here) forbidden while fewer than min_tokens were generated.
    assert row.tolist() == [float("-inf"), 1.0, -4.0, 1.0, 0.0, 2.0]
    row = np.array([3.0, 2.0, -2.0, 1.0, 0.0, 4.0], dtype=np.float32)
    p = SamplingParams(min_tokens=1, logit_bias=((3, 1.5),))
    _adjust(row, Seq(), p, 6)  # type: ignore[arg-type]
    _restrict(row, Seq(), p)  # type: ignore[arg-type]
    assert row.tolist() == [3.0, 2.0, -2.0, 2.5, 0.0, 4.0]
    # A grammar that allows only the EOS wins over min_tokens (a row with no token left would
    # sample garbage).
    row = np.array([0.5] + [float("-inf")] * 5, dtype=np.float32)
    _restrict(row, Seq(), SamplingParams(min_tokens=3))  # type: ignore[arg-type]
    assert row[0] == 0.5


async def test_repetition_penalty_is_checked(client) -> None:
    r = await client.post("/v1/completions", json=completion(PROMPT, max_tokens=2, repetition_penalty=1.3))
    assert r.status_code == 200
    r = await client.post("/v1/completions", json=completion(PROMPT, max_tokens=2, repetition_penalty=0))
    assert r.status_code == 400 and (await r.get_json())["error"]["param"] == "repetition_penalty"


# -- the text ------------------------------------------------------------------------------------


async def test_skip_special_tokens(client) -> None:
    body = completion(PROMPT, max_tokens=3, logit_bias={str(IM_START_ID): 5})
    r = await client.post("/v1/completions", json=body)
    assert (await r.get_json())["choices"][0]["text"] == ""
    r = await client.post("/v1/completions", json={**body, "skip_special_tokens": False})
    assert (await r.get_json())["choices"][0]["text"] == "<|im_start|>" * 3


@pytest.mark.parametrize("stream", [False, True])
async def test_include_stop_str_in_output(client, tokenizer, stream: bool) -> None:
    whole = tokenizer.decode(expected(tokenizer, PROMPT, 12))
    stop = whole[5:8]
    cut = whole[: whole.find(stop)]
    for include, want in ((False, cut), (True, cut + stop)):
        body = completion(PROMPT, max_tokens=12, stop=[stop], include_stop_str_in_output=include, stream=stream)
        if stream:
            events = parse_sse((await post_stream(client, "/v1/completions", body))[1])
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
        else:
            text = (await (await client.post("/v1/completions", json=body)).get_json())["choices"][0]["text"]
        assert text == want, include


# -- structured outputs by regex, choice and grammar ---------------------------------------------


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", "[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ("guided_choice", ["harbour", "hill", "river"], lambda t: t in ("harbour", "hill", "river")),
    ("guided_grammar", 'start: "ab" NUM\nNUM: /[0-9]{2}/', lambda t: re.fullmatch("ab[0-9]{2}", t)),
    ("guided_json", {"type": "object", "properties": {"a": {"type": "boolean"}},
                     "required": ["a"], "additionalProperties": False},
     lambda t: t in ('{"a":true}', '{"a":false}')),
    ("structured_outputs", {"regex": "x{4}"}, lambda t: t == "xxxx"),
    ("structured_outputs", {"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ("structured_outputs", {"grammar": 'start: "q" ("r" | "s")'}, lambda t: t in ("qr", "qs")),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_structured_outputs(client, path: str, field: str, value: Any, check: Any) -> None:
    base = chat_body("hi", max_tokens=40, temperature=0) if "chat" in path else completion(PROMPT, max_tokens=40)
    r = await client.post(path, json={**base, field: value})
    assert r.status_code == 200, await r.get_json()
    choice = (await r.get_json())["choices"][0]
    text = choice["message"]["content"] if "chat" in path else choice["text"]
    assert check(text), text
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "["}, "guided_regex"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}, "structured_outputs.grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
])
async def test_structured_outputs_refused_before_anything_runs(client, body: dict, param: str) -> None:
    r = await client.post("/v1/completions", json=completion(PROMPT, max_tokens=3, **body))
    assert r.status_code == 400
    assert (await r.get_json())["error"]["param"] == param


# -- unknown fields --------------------------------------------------------------------------------


async def test_unknown_fields_rejected_by_default(client) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=1, frobnicate_reject=1))
    assert r.status_code == 400
    err = (await r.get_json())["error"]
    assert err["param"] == "frobnicate_reject" and "frobnicate_reject" in err["message"]


async def test_unknown_fields_warned_once_and_ignored(tokenizer, caplog) -> None:
    app = make_app(tokenizer, unknown_fields="warn")
    async with running(app) as c:
        with caplog.at_level(logging.WARNING, logger="trio_infer.api.protocol"):
            for path, body in [("/v1/chat/completions", chat_body(max_tokens=1, frobnicate_warn=1)),
                               ("/v1/completions", completion(PROMPT, max_tokens=1, frobnicate_warn={"a": 1})),
                               ("/v1/chat/completions", chat_body(max_tokens=1, frobnicate_warn=2)),
                               ("/tokenize", {"model": "fake", "prompt": "a", "frobnicate_warn": 3})]:
                r = await c.post(path, json=body)
                assert r.status_code == 200, await r.get_json()
        # OpenAI fields this server does not implement stay refused: they would change the answer.
        r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=1, functions=[{"name": "f"}]))
        assert r.status_code == 400 and (await r.get_json())["error"]["param"] == "functions"
        # Nested unknown fields are refused whatever the policy.
        r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=1, stream=True,
                                                               stream_options={"frobnicate": 1}))
        assert r.status_code == 400
    warned = [rec for rec in caplog.records if "frobnicate_warn" in rec.getMessage()]
    assert len(warned) == 1


# -- the chat template -----------------------------------------------------------------------------


LIMITS = ModelLimits(name="fake", max_model_len=4096, vocab_size=2048, max_n=8)


def chat_request(messages: list[dict[str, str]], **kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "fake", "messages": messages, **kw})


def hf_ids(tokenizer: Any, messages: list[dict[str, str]], **kw: Any) -> list[int]:
    """transformers' own prompt ids (newer versions return a BatchEncoding)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is the harbour?"},
    {"role": "assistant", "content": "<think>\nThey ask about the harbour.\n</think>\n\nDown the hill."},
    {"role": "user", "content": "And the river?"},
]


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": True}, {"enable_thinking": False}])
def test_prompt_ids_equal_transformers_apply_chat_template(thinking_tokenizer, kwargs) -> None:
    req = chat_request(CONVERSATION, **({"chat_template_kwargs": kwargs} if kwargs is not None else {}))
    plan = plan_chat(req, thinking_tokenizer, LIMITS)
    want = hf_ids(thinking_tokenizer, CONVERSATION, add_generation_prompt=True, **(kwargs or {}))
    assert plan.prompts[0] == want
    closed = "<think>\n\n</think>\n\n"
    assert thinking_tokenizer.decode(plan.prompts[0]).endswith(closed) == (kwargs == {"enable_thinking": False})
    # The template thinks, and the prompt does not leave the model thinking: its output may open
    # a thinking block (or not, when told not to think).
    assert plan.reasoning == ReasoningPlan(thinking=False)


def test_add_generation_prompt_and_continue_final_message(thinking_tokenizer) -> None:
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    for kw, hf in [
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        ({"add_generation_prompt": False, "continue_final_message": True},
         {"add_generation_prompt": False, "continue_final_message": True}),
    ]:
        plan = plan_chat(chat_request(messages, **kw), thinking_tokenizer, LIMITS)
        assert plan.prompts[0] == hf_ids(thinking_tokenizer, messages, **hf)
    text = thinking_tokenizer.decode(plan.prompts[0])
    assert text.endswith("The colour is")
    with pytest.raises(APIError) as e:
        plan_chat(chat_request(messages, continue_final_message=True), thinking_tokenizer, LIMITS)
    assert e.value.param == "continue_final_message"
    with pytest.raises(APIError) as e:
        plan_chat(chat_request(messages, chat_template_kwargs={"tokenize": True}), thinking_tokenizer, LIMITS)
    assert e.value.param == "chat_template_kwargs.tokenize"


def test_reasoning_detected_from_the_template_and_the_tokens(tokenizer, thinking_tokenizer) -> None:
    assert template_thinks(thinking_tokenizer) and not template_thinks(tokenizer)
    assert plan_chat(chat_request(CONVERSATION), tokenizer, LIMITS).reasoning is None
    assert plan_chat(chat_request(CONVERSATION), tokenizer, LIMITS, reasoning="on").reasoning is not None
    assert plan_chat(chat_request(CONVERSATION), thinking_tokenizer, LIMITS, reasoning="off").reasoning is None


# -- the reasoning split ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, thinking, want", [
    ("<think>\nLet me see.\n</think>\n\nThe answer.", False, ("\nLet me see.\n", "The answer.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("The answer, no thinking.", False, ("", "The answer, no thinking.")),
    ("<thinking is a word", False, ("", "<thinking is a word")),
    ("still thinking</think>\n\nanswer <think> kept", True, ("still thinking", "answer <think> kept")),
    ("<think>cut by max_tokens </thi", False, ("cut by max_tokens </thi", "")),
    ("", False, ("", "")),
])
def test_think_split_is_the_same_whatever_the_pieces(text: str, thinking: bool, want: tuple[str, str]) -> None:
    plan = ReasoningPlan(thinking=thinking)
    assert ThinkSplit(plan).feed(text, final=True) == want
    for size in (1, 2, 3, 5):
        split = ThinkSplit(plan)
        pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
        got = [split.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want, size


def test_reasoning_events_from_deltas(thinking_tokenizer) -> None:
    plan = plan_chat(chat_request(CONVERSATION), thinking_tokenizer, LIMITS)
    events = ResponseEvents(plan)
    out = []
    for i, piece in enumerate(["<thi", "nk>ab", "c</th", "ink>\n", "\nDone", "."]):
        out += events.feed([ChoiceDelta(0, piece, [], "stop" if i == 5 else None)])
    assert out == [Reasoning(0, "ab"), Reasoning(0, "c"), Content(0, "Done"), Content(0, "."), Finish(0, "stop")]


@pytest.mark.parametrize("pieces, thinking, want", [
    (["<think>", "a", "b", "</think>", "\n\n", "ok"], False, 4),  # the tags and what they hold
    (["\n", "<think>", "a", "b"], False, 4),  # cut before the close tag: all of it
    (["still", "</think>", "ok"], True, 2),  # the prompt left the model thinking
    (["ok", " <think>", "x", "</think>"], False, 0),  # did not open with the tag: no thinking
    (["<think>", "a", "</th", "ink>", "ok"], False, None),  # no token is the close tag: untold
])
def test_reasoning_tokens_count_up_to_the_close_tag(pieces: list[str], thinking: bool, want: int | None,
                                                    tokenizer, thinking_tokenizer) -> None:
    from types import SimpleNamespace

    plan = plan_chat(chat_request(CONVERSATION), thinking_tokenizer, LIMITS)
    plan.reasoning = ReasoningPlan(thinking=thinking)
    choice = SimpleNamespace(text="".join(pieces), num_tokens=len(pieces), token_ids=list(range(len(pieces))))
    assert reasoning_tokens(plan, choice, lambda i: (pieces[i], b"")) == want  # type: ignore[arg-type]
    plain = plan_chat(chat_request(CONVERSATION), tokenizer, LIMITS)  # a model that does not think
    assert reasoning_tokens(plain, choice, lambda i: (pieces[i], b"")) == 0  # type: ignore[arg-type]


# The tags are tokens of their own, which llguidance treats as special: a Lark grammar names them
# as such (<think>), as a client's grammar for a Qwen3 model would.
THINKING_GRAMMAR = 'start: <think> "\\nabc\\n" </think> "\\n\\n" ("yes" | "no")'


@pytest.fixture
async def thinking_client(thinking_tokenizer):  # type: ignore[no-untyped-def]
    app = make_app(thinking_tokenizer, engine_with_grammars(thinking_tokenizer))
    async with running(app) as c:
        yield c
        assert all_zero(app)


async def test_reasoning_content_whole_and_streamed(thinking_client) -> None:
    # A grammar makes the fake model think "\nabc\n" and then answer.
    body = chat_body("hi", max_tokens=40, temperature=0, guided_grammar=THINKING_GRAMMAR)
    r = await thinking_client.post("/v1/chat/completions", json=body)
    message = (await r.get_json())["choices"][0]["message"]
    assert message["reasoning_content"] == "\nabc\n" and message["content"] in ("yes", "no")
    status, raw = await post_stream(thinking_client, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in parse_sse(raw)[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nabc\n"
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    # Told not to think (and its prompt closes the thinking), the same answer is all content.
    body["chat_template_kwargs"] = {"enable_thinking": False}
    del body["guided_grammar"]
    body["guided_regex"] = "(yes|no)"
    r = await thinking_client.post("/v1/chat/completions", json=body)
    message = (await r.get_json())["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] in ("yes", "no")


# -- structured output after the thinking ----------------------------------------------------------


@pytest.mark.parametrize("thinking", [False, True])
def test_a_grammar_constrains_the_answer_after_the_thinking(thinking_tokenizer, thinking: bool) -> None:
    import llguidance
    import llguidance.hf

    from trio_infer.api.structured import after_thinking, json_schema_grammar, lark_source

    ll = llguidance.hf.from_tokenizer(thinking_tokenizer, n_vocab=len(thinking_tokenizer), eos_token=[2])
    ids = lambda text: thinking_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    think_open, think_close = ids("<think>"), ids("</think>")
    schema = json_schema_grammar({"type": "object", "properties": {"a": {"type": "boolean"}},
                                  "required": ["a"], "additionalProperties": False}, "x")
    for inner, answer in ((schema, '{"a":true}'), (lark_source('start: "yes" | "no"'), "no")):
        source = after_thinking(inner, thinking)
        assert not llguidance.LLMatcher.validate_grammar(source)
        thought = ids("Some thought,\nthen more.") + think_close + ids("\n\n")
        with_thinking = ([] if thinking else think_open) + thought + ids(answer)
        cases = [(with_thinking, True), (ids(answer) + think_close, False), (ids("{") + think_open, False)]
        if not thinking:  # no thinking at all is an answer too; a prompt that opened it must close it
            cases.append((ids(answer), True))
        for tokens, ok in cases:
            m = llguidance.LLMatcher(ll, source)
            assert (m.consume_tokens(tokens) and m.is_accepting()) == ok, (inner[:30], tokens)


async def test_structured_output_on_a_thinking_model(thinking_client, thinking_tokenizer) -> None:
    think = thinking_tokenizer.convert_tokens_to_ids("<think>")
    close = thinking_tokenizer.convert_tokens_to_ids("</think>")
    # Biased to open a thinking block and to close it at once: the grammar lets it think, then
    # constrains the answer.
    body = chat_body("hi", max_tokens=20, temperature=0, guided_choice=["yes", "no"],
                     logit_bias={str(think): 10, str(close): 5})
    r = await thinking_client.post("/v1/chat/completions", json=body)
    choice = (await r.get_json())["choices"][0]
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop"
    assert choice["message"].get("reasoning_content") in (None, "")
    r = await thinking_client.post("/v1/completions", json=completion(
        thinking_tokenizer.encode("hi"), max_tokens=20, guided_choice=["yes", "no"], logit_bias={str(think): 10}))
    # Completions are not split: there the grammar constrains the text from its first token.
    assert (await r.get_json())["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_on_a_thinking_model(thinking_client, thinking_tokenizer, stream: bool) -> None:
    think = thinking_tokenizer.convert_tokens_to_ids("<think>")
    close = thinking_tokenizer.convert_tokens_to_ids("</think>")
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
        "additionalProperties": False}}}
    body = chat_body("hi", max_tokens=300, temperature=0, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                     logit_bias={str(think): 10, str(close): 5}, stream=stream)
    if stream:
        events = parse_sse((await post_stream(thinking_client, "/v1/chat/completions", body))[1])
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        calls = [c for d in deltas for c in d.get("tool_calls") or ()]
        name = calls[0]["function"]["name"]
        arguments = "".join(c["function"]["arguments"] for c in calls)
        finish = events[-2]["choices"][0]["finish_reason"]
        assert not "".join(d.get("content") or "" for d in deltas)
    else:
        choice = (await (await thinking_client.post("/v1/chat/completions", json=body)).get_json())["choices"][0]
        assert "tool_calls" in choice["message"], choice
        [call] = choice["message"]["tool_calls"]
        name, arguments, finish = call["function"]["name"], call["function"]["arguments"], choice["finish_reason"]
        assert not choice["message"]["content"]
    assert name == "pick" and arguments in ('{"x":true}', '{"x":false}') and finish == "tool_calls"


# -- the thinking budget ---------------------------------------------------------------------------


async def test_thinking_token_budget_closes_the_thinking(thinking_tokenizer) -> None:
    # The grammar lets the model think letters for ever, then answer "ok".
    body = chat_body("hi", max_tokens=30, temperature=0,
                     guided_grammar='start: <think> /[a-z ]*/ </think> "ok"')
    for default in (None, 3):
        app = make_app(thinking_tokenizer, engine_with_grammars(thinking_tokenizer), thinking_token_budget=default)
        async with running(app) as c:
            r = await c.post("/v1/chat/completions", json=body)
            out = await r.get_json()
            choice = out["choices"][0]
            if default is None:  # no budget: it thinks until max_tokens
                assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
            else:  # the server's default budget
                assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "ok"
                assert len(thinking_tokenizer.encode(choice["message"]["reasoning_content"])) <= 3
            # A request's own budget, streamed too.
            for stream in (False, True):
                request = {**body, "thinking_token_budget": 2, "stream": stream}
                if stream:
                    events = parse_sse((await post_stream(c, "/v1/chat/completions", request))[1])
                    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
                    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
                    content = "".join(d.get("content") or "" for d in deltas)
                    usage = None
                else:
                    out = await (await c.post("/v1/chat/completions", json=request)).get_json()
                    reasoning = out["choices"][0]["message"]["reasoning_content"]
                    content = out["choices"][0]["message"]["content"]
                    usage = out["usage"]["completion_tokens"]
                assert content == "ok" and reasoning
                # <think>, 2 thought tokens, </think>, then "ok" (and the EOS that ends it)
                if usage is not None:
                    assert usage <= 1 + 2 + 1 + len(thinking_tokenizer.encode("ok")) + 1
            assert all_zero(app)


async def test_thinking_token_budget_needs_a_thinking_model(client) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2, thinking_token_budget=5))
    assert r.status_code == 400 and (await r.get_json())["error"]["param"] == "thinking_token_budget"


async def test_tokenize_takes_the_chat_template_fields(thinking_tokenizer) -> None:
    app = make_app(thinking_tokenizer)
    async with running(app) as c:
        for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}):
            r = await c.post("/tokenize", json={"model": "fake", "messages": CONVERSATION,
                                                "chat_template_kwargs": kwargs})
            assert (await r.get_json())["tokens"] == hf_ids(thinking_tokenizer, CONVERSATION,
                                                            add_generation_prompt=True, **kwargs)
        # An assistant message sent back with its reasoning_content is accepted.
        messages = [*CONVERSATION[:2], {"role": "assistant", "content": "Down the hill.",
                                        "reasoning_content": "They ask."}, CONVERSATION[3]]
        r = await c.post("/v1/chat/completions", json={"model": "fake", "messages": messages, "max_tokens": 1})
        assert r.status_code == 200
        # ...and given to the template, which shows it for a turn after the last user message.
        tail = [*messages[:3]]
        r = await c.post("/tokenize", json={"model": "fake", "messages": tail, "add_generation_prompt": False})
        assert (await r.get_json())["tokens"] == hf_ids(thinking_tokenizer, tail)
        assert "<think>\nThey ask.\n</think>" in thinking_tokenizer.decode((await r.get_json())["tokens"])
        r = await c.post("/v1/chat/completions", json={"model": "fake", "messages": messages, "max_tokens": 1,
                                                       "chat_template_kwargs": {"sanitize_control_tokens": 1}})
        assert r.status_code == 400
