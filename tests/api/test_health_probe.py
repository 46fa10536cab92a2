"""``/health`` answered before quart (api/health.py) says what quart's route says, and the bare
``hypercorn trio_infer.app:app`` command serves a whole stream."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h11

from trio_infer.api.health import is_plain_probe
from trio_infer.app import create_app
from trio_infer.settings import Settings

from .helpers import body_text, exchange, make_app, running, state


def through_quart(app: Any) -> list[str]:
    """Every request quart's machinery handles from now on, by its full path."""
    seen: list[str] = []

    @app.before_request
    async def _record() -> None:
        from quart import request

        seen.append(request.full_path)

    return seen


async def answer(client: Any, path: str, method: str = "GET", **kwargs: Any) -> tuple[int, dict, bytes]:
    response = await client.open(path, method=method, **kwargs)
    body = await response.get_data()
    return response.status_code, {k.lower(): v for k, v in response.headers.items()}, body


async def test_a_probe_is_answered_without_quart_and_as_quart_answers_it(tokenizer) -> None:
    app = make_app(tokenizer)
    seen = through_quart(app)
    async with running(app) as client:
        fast = await answer(client, "/health")
        assert seen == []  # never reached quart's request machinery
        slow = await answer(client, "/health?from=quart")
        assert seen == ["/health?from=quart"]
        assert fast == slow == (200, {"content-type": "application/json", "content-length": "15"},
                                b'{"status":"ok"}')

        head = await answer(client, "/health", "HEAD")
        assert head == await answer(client, "/health?from=quart", "HEAD")
        assert head[0] == 200

        # Draining: a 503 in the OpenAI envelope, the same either way.
        state(app).engine.begin_drain()
        fast = await answer(client, "/health")
        slow = await answer(client, "/health?from=quart")
        assert fast == slow
        assert fast[0] == 503
        assert json.loads(fast[2])["error"]["message"] == "the server is shutting down"
        assert seen == ["/health?from=quart"] * 3


async def test_a_probe_with_a_body_or_another_method_goes_to_quart(tokenizer) -> None:
    app = make_app(tokenizer)
    seen = through_quart(app)
    async with running(app) as client:
        status, _, _ = await answer(client, "/health", data=b"x", headers={"content-length": "1"})
        assert status == 200 and seen == ["/health?"]
        status, _, body = await answer(client, "/health", "POST")
        assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"


def scope(headers: list[tuple[bytes, bytes]], path: str = "/health", method: str = "GET") -> dict:
    return {"type": "http", "path": path, "method": method, "query_string": b"", "headers": headers}


def test_only_plain_probes_within_the_header_limit_take_the_fast_path() -> None:
    limit = 100
    small = [(b"host", b"x")]
    assert is_plain_probe(scope(small), limit)
    assert not is_plain_probe(scope(small, "/healthz"), limit)
    assert not is_plain_probe(scope(small, method="DELETE"), limit)
    assert not is_plain_probe(scope([(b"content-length", b"0")]), limit)
    assert not is_plain_probe(scope([(b"transfer-encoding", b"chunked")]), limit)
    assert not is_plain_probe({**scope(small), "query_string": b"a=1"}, limit)
    assert not is_plain_probe({"type": "websocket", "path": "/health"}, limit)
    # Counted as routes._prepare counts a head: "GET" + "/health?" + name + value + 4 each.
    exact = limit - len("GET") - len("/health?") - 4 - len(b"x-pad")
    assert is_plain_probe(scope([(b"x-pad", b"a" * exact)]), limit)
    assert not is_plain_probe(scope([(b"x-pad", b"a" * (exact + 1))]), limit)  # quart's 431


async def test_a_loading_server_answers_503_with_retry_after() -> None:
    app = create_app(Settings(model="fake", cache_dir=Path("/nonexistent-unused")))  # never started
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        raise AssertionError("a probe's answer reads nothing")

    await app(scope([(b"host", b"x")]), receive, send)
    start, body = sent
    assert start["status"] == 503
    assert (b"retry-after", b"5") in start["headers"]
    assert json.loads(body["body"])["error"]["message"] == "loading"


async def test_a_stream_under_bare_hypercorn_is_valid_chunked_http(tokenizer) -> None:
    """Under hypercorn's own ``Config`` (what the bare command runs), a streamed completion is
    valid chunked HTTP/1.1 that h11, as a client, parses to the whole stream."""
    events = await exchange(make_app(tokenizer), "/v1/completions",
                            {"model": "fake", "prompt": "hi", "max_tokens": 8, "stream": True})
    assert type(events[0]) is h11.Response and events[0].status_code == 200
    assert type(events[-1]) is h11.EndOfMessage
    text = body_text(events)
    chunks = [json.loads(line[len("data: "):]) for line in text.split("\n\n")
              if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert text.endswith("data: [DONE]\n\n")
