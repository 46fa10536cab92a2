"""The requests coding agents send, as recorded shapes (``data/agents/``: Codex CLI's Responses
requests and Claude Code's Messages requests, written from their public source and docs), each
sent to a real server on the tiny random model: honoured (200, and what the answer must hold),
or refused with a 400 that names the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from .test_server import Server, start_server

FIXTURES = Path(__file__).with_name("data") / "agents"


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from start_server(tiny_checkpoint, tmp_path_factory)


def fixture(name: str, server: Server) -> dict[str, Any]:
    body = json.loads((FIXTURES / f"{name}.json").read_text())
    body["model"] = server.model
    return body


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """An SSE body with named events (Responses, Messages) as (event, data) pairs."""
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        out.append((fields["event"], json.loads(fields["data"])))
    return out


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


@pytest.mark.parametrize("name", ["codex_first_turn", "codex_tool_turn"])
def test_codex_turns_stream_to_a_completed_response(server: Server, name: str) -> None:
    body = fixture(name, server)
    body["max_output_tokens"] = 24  # the tiny model's answers are noise: keep them short
    r = post(server, "/v1/responses", body)
    assert r.status_code == 200, r.text
    said = events(r.text)
    kind, last = said[-1]
    assert kind in ("response.completed", "response.incomplete"), said[-1]
    assert last["response"]["store"] is False
    for item in last["response"]["output"]:
        if item["type"] == "function_call":  # a call of a tool the request named, by its schema
            assert item["name"] in ("shell", "update_plan")
            args = json.loads(item["arguments"])
            assert item["name"] != "shell" or isinstance(args["command"], list)


def test_codex_output_schema_is_followed(server: Server) -> None:
    r = post(server, "/v1/responses", fixture("codex_output_schema", server))
    assert r.status_code == 200, r.text
    response = r.json()
    assert response["status"] == "completed"
    assert list(json.loads(response["output"][0]["content"][0]["text"])) == ["summary"]


def test_codex_hosted_tools_are_refused_by_name(server: Server) -> None:
    r = post(server, "/v1/responses", fixture("codex_web_search", server))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "tools.1.type" and "web_search" in error["message"]


@pytest.mark.parametrize("name", ["claude_code_turn", "claude_code_thinking", "claude_code_tool_result"])
def test_claude_code_turns_stream_to_a_finished_message(server: Server, name: str) -> None:
    r = post(server, "/v1/messages", fixture(name, server))
    assert r.status_code == 200, r.text
    said = events(r.text)
    assert said[0][0] == "message_start" and said[-1][0] == "message_stop"
    [delta] = [data for kind, data in said if kind == "message_delta"]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


def test_claude_code_image_tool_result_is_refused_naming_the_block(server: Server) -> None:
    r = post(server, "/v1/messages", fixture("claude_code_image_result", server))
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and "messages.2.content.0.content" in error["error"]["message"]


def test_claude_code_count_tokens_counts_what_create_prompts(server: Server) -> None:
    r = post(server, "/v1/messages/count_tokens", fixture("claude_code_count_tokens", server))
    assert r.status_code == 200, r.text
    body = {**fixture("claude_code_turn", server), "stream": False, "max_tokens": 1}
    created = post(server, "/v1/messages", body).json()
    assert r.json()["input_tokens"] == created["usage"]["input_tokens"]


def test_hosted_tools_ignore_drops_the_tool_and_its_earlier_calls(tokenizer: Any) -> None:
    from trio_infer.api.errors import APIError
    from trio_infer.api.plans import ModelLimits
    from trio_infer.api.responses import plan_responses
    from trio_infer.api.responses_protocol import ResponsesRequest

    limits = ModelLimits(name="fake", max_model_len=4096, vocab_size=len(tokenizer), max_n=4)
    body = {**json.loads((FIXTURES / "codex_web_search.json").read_text()), "model": "fake"}
    body["input"] = body["input"] + [
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "trio nurseries"}}]
    with pytest.raises(APIError) as refused:  # refused by default, the call item first
        plan_responses(ResponsesRequest.model_validate(body), tokenizer, limits)
    assert refused.value.param == "input.2.type"
    plan, echo = plan_responses(ResponsesRequest.model_validate(body), tokenizer, limits,
                                hosted_tools="ignore")
    assert [t["name"] for t in echo["tools"]] == ["shell"]
    without = {**body, "tools": body["tools"][:1], "input": body["input"][:-1]}
    same, _ = plan_responses(ResponsesRequest.model_validate(without), tokenizer, limits)
    assert plan.prompts == same.prompts  # the web search call left the prompt too
