"""The hot routes (chat and completions) answered before quart (api/direct.py): what that path
must do itself that quart did for it. Driven through the app's ASGI call with a hand-made
``receive``/``send``, so each test controls exactly when the body arrives and when the client
leaves; the rest of tests/api covers the routes' answers through the test client."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from .helpers import StepGate, all_zero, chat_body, counts, make_app, running

LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def scope_for(path: str, method: str = "POST", headers: list[tuple[bytes, bytes]] | None = None,
              root_path: str = "") -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": root_path, "headers": headers or [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "extensions": {},
    }


class Client:
    """One ASGI request: ``feed`` body parts, ``leave`` to disconnect; ``sent`` is what the app
    sent back."""

    def __init__(self) -> None:
        self.to_app, self._from_test = trio.open_memory_channel[dict[str, Any]](100)
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        return await self._from_test.receive()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def feed(self, body: bytes, more: bool = False) -> None:
        self.to_app.send_nowait({"type": "http.request", "body": body, "more_body": more})

    def leave(self) -> None:
        self.to_app.send_nowait({"type": "http.disconnect"})

    def status(self) -> int:
        return self.sent[0]["status"]

    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


async def test_the_hot_routes_do_not_run_quarts_hooks(tokenizer, autojump_clock) -> None:
    """The point of the path: no quart request machinery (its hooks stand for all of it)."""
    app = make_app(tokenizer)
    seen: list[str] = []

    @app.before_request
    async def _seen() -> None:
        from quart import request
        seen.append(request.path)

    async with running(app) as client:
        r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert r.status_code == 200
        r = await client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        assert seen == []
        assert (await client.get("/v1/models")).status_code == 200
        assert seen == ["/v1/models"]


async def test_a_body_slower_than_the_body_timeout_gets_408_and_close(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, body_timeout_s=5.0)
    async with running(app):
        c = Client()
        c.feed(b'{"model": "fake",', more=True)  # ... and never the rest
        with trio.fail_after(60):
            start = trio.current_time()
            await app(scope_for("/v1/chat/completions"), c.receive, c.send)
            assert 5.0 <= trio.current_time() - start < 6.0
        assert c.status() == 408
        assert c.headers()[b"connection"] == b"close"
        assert json.loads(c.body())["error"]["type"] == "invalid_request_error"
        assert all_zero(app)


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_past_max_body_bytes_gets_413_and_close(tokenizer, autojump_clock, declared) -> None:
    app = make_app(tokenizer, max_body_bytes=1024)
    async with running(app):
        c = Client()
        headers = [(b"content-type", b"application/json")]
        if declared:  # refused from the header alone, before a byte of the body
            headers.append((b"content-length", b"5000"))
        else:
            c.feed(b"x" * 1000, more=True)
            c.feed(b"x" * 1000, more=True)
        with trio.fail_after(60):
            await app(scope_for("/v1/completions", headers=headers), c.receive, c.send)
        assert c.status() == 413
        assert c.headers()[b"connection"] == b"close"
        assert json.loads(c.body())["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("parts", [1, 3])
async def test_a_body_of_its_declared_length_is_answered_without_the_end_message(
        tokenizer, autojump_clock, parts) -> None:
    # hypercorn sends "more_body: false" in a message of its own after the last bytes, a round
    # of the run loop later; a body whose Content-Length bytes are all in does not wait for it.
    app = make_app(tokenizer)
    body = json.dumps(chat_body(max_tokens=2)).encode()
    async with running(app):
        c = Client()
        cuts = [len(body) * i // parts for i in range(parts + 1)]
        for start, end in zip(cuts, cuts[1:]):
            c.feed(body[start:end], more=True)  # ... and never the end message
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        with trio.fail_after(60):
            await app(scope_for("/v1/chat/completions", headers=headers), c.receive, c.send)
        assert c.status() == 200
        assert json.loads(c.body())["usage"]["completion_tokens"] == 2
        assert all_zero(app)


async def test_a_client_gone_while_its_body_arrives_gets_nothing_and_leaves_nothing(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app):
        c = Client()
        c.feed(b'{"model": "fake",', more=True)
        c.leave()
        with trio.fail_after(60):
            await app(scope_for("/v1/chat/completions"), c.receive, c.send)
        assert c.sent == []
        assert all_zero(app)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_disconnect_mid_request_cancels_it_and_frees_the_session(tokenizer, autojump_clock, stream) -> None:
    """The path's own disconnect watcher (quart-trio's nursery did this before): a client gone
    while its request runs ends the request's session within the step."""
    app = make_app(tokenizer)
    async with running(app):
        gate = StepGate(app)
        c = Client()
        c.feed(json.dumps(chat_body(stream=stream, **LONG)).encode())
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(app, scope_for("/v1/chat/completions"), c.receive, c.send)
                gate.allow(3)
                await wait_all_tasks_blocked()
                assert counts(app)["sessions"] == 1
                c.leave()
            await wait_all_tasks_blocked()
        assert all_zero(app), counts(app)
        if stream:  # it had started: headers and the first chunks, never the end of the body
            assert c.status() == 200 and c.sent[-1].get("more_body") is True
        else:
            assert c.sent == []


async def test_the_api_key_and_the_method_are_checked_as_quart_checked_them(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, api_key="sekrit")
    async with running(app) as client:
        body = chat_body(max_tokens=1)
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 401 and (await r.get_json())["error"]["code"] == "invalid_api_key"
        for auth in ({"Authorization": "Bearer sekrit"}, {"x-api-key": "sekrit"}):
            r = await client.post("/v1/chat/completions", json=body, headers=auth)
            assert r.status_code == 200, auth
        r = await client.get("/v1/chat/completions", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 405
        assert set(r.headers["Allow"].split(", ")) == {"OPTIONS", "POST"}
        assert (await r.get_json())["error"]["code"] == "method_not_allowed"
        r = await client.options("/v1/completions", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and set(r.headers["Allow"].split(", ")) == {"OPTIONS", "POST"}


async def test_a_root_path_is_stripped_as_quart_strips_it(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app):
        c = Client()
        c.feed(json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 2}).encode())
        with trio.fail_after(60):
            await app(scope_for("/api/v1/completions", root_path="/api"), c.receive, c.send)
        assert c.status() == 200
        assert json.loads(c.body())["object"] == "text_completion"
