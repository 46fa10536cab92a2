"""Overload and deadlines over HTTP (docs/lifecycle.md, "Overload and deadlines"): what a client
sees for each knob (status, body, ``Retry-After``), and that every way out leaves nothing behind.

In-process on the fake model under ``autojump_clock``: a :class:`StepGate` holds the engine so
requests wait exactly where the test wants them, and virtual time runs the deadlines.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from .helpers import (
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

LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}


@pytest.fixture
async def app(tokenizer):  # type: ignore[no-untyped-def]
    app = make_app(tokenizer)
    async with running(app) as client:
        app.client = client
        yield app
        assert all_zero(app)


def completion(prompt: Any = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": prompt, **kw}


async def metrics_text(client) -> str:  # type: ignore[no-untyped-def]
    return await (await client.get("/metrics")).get_data(as_text=True)


# -- deadlines --------------------------------------------------------------------------------------


async def test_a_deadline_mid_generation_is_504_naming_the_timeout(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        gate = StepGate(app)
        gate.allow(3)  # mid-generation, then the engine holds: only the deadline can end it
        with trio.fail_after(60):
            t0 = trio.current_time()
            r = await client.post("/v1/completions", json=completion(timeout=2.5, **LONG))
            assert trio.current_time() - t0 == pytest.approx(2.5)
        assert r.status_code == 504
        error = (await r.get_json())["error"]
        assert error["code"] == "timeout" and error["param"] == "timeout" and "2.5 s" in error["message"]
        await wait_all_tasks_blocked()
        assert all_zero(app)
        text = await metrics_text(client)
        assert metric(text, "trio_infer_request_timeouts_total") == 1


async def test_a_stream_past_its_deadline_ends_with_an_error_event(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        gate = StepGate(app)
        gate.allow(3)
        with trio.fail_after(60):
            r = await client.post("/v1/chat/completions", json=chat_body(stream=True, timeout=1, **LONG))
        events = parse_sse(await r.get_data(as_text=True))
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "timeout"
        assert any(e["choices"][0]["delta"].get("content") for e in events[:-2])  # it had begun
        await wait_all_tasks_blocked()
        assert all_zero(app)


async def test_the_header_and_the_server_default_set_the_deadline(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, request_timeout_s=7)
    async with running(app) as client:
        gate = StepGate(app)
        gate.hold()
        with trio.fail_after(60):
            for headers, want in (({}, 7.0), ({"X-Request-Timeout": "0.5"}, 0.5)):
                t0 = trio.current_time()
                r = await client.post("/v1/completions", json=completion(**LONG), headers=headers)
                assert r.status_code == 504 and trio.current_time() - t0 == pytest.approx(want)
            # The field wins over the header.
            t0 = trio.current_time()
            r = await client.post("/v1/completions", json=completion(timeout=2, **LONG),
                                  headers={"X-Request-Timeout": "5"})
            assert r.status_code == 504 and trio.current_time() - t0 == pytest.approx(2)
        await wait_all_tasks_blocked()
        assert all_zero(app)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon", "1e9"])
async def test_a_bad_timeout_header_is_400_naming_it(app, value) -> None:  # type: ignore[no-untyped-def]
    r = await app.client.post("/v1/completions", json=completion(max_tokens=1),
                              headers={"X-Request-Timeout": value})
    assert r.status_code == 400
    assert (await r.get_json())["error"]["param"] == "X-Request-Timeout"


@pytest.mark.parametrize("field,value", [("timeout", 0), ("timeout", -3), ("timeout", "5"),
                                         ("priority", 1.5), ("priority", 2**31), ("priority", "1")])
async def test_bad_timeout_and_priority_fields_are_400_naming_them(app, field, value) -> None:  # type: ignore[no-untyped-def]
    for path, body in (("/v1/completions", completion(max_tokens=1)),
                       ("/v1/chat/completions", chat_body(max_tokens=1)),
                       ("/v1/responses", {"model": "fake", "input": "hi", "max_output_tokens": 1})):
        r = await app.client.post(path, json={**body, field: value})
        assert r.status_code == 400, path
        assert (await r.get_json())["error"]["param"] == field, path


async def test_every_generation_api_takes_timeout_and_priority(app) -> None:  # type: ignore[no-untyped-def]
    # (and the speculative decoding opt-out, an extension of every generation API too)
    extra = {"timeout": 30, "priority": -2, "speculative": False}
    for path, body in (("/v1/completions", completion(max_tokens=2)),
                       ("/v1/chat/completions", chat_body(max_tokens=2)),
                       ("/v1/responses", {"model": "fake", "input": "hi", "max_output_tokens": 2}),
                       ("/v1/messages", {"model": "fake", "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "hi"}]})):
        r = await app.client.post(path, json={**body, **extra})
        assert r.status_code == 200, (path, await r.get_data(as_text=True))


async def test_a_deadline_on_the_messages_api_is_in_anthropics_envelope(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        StepGate(app).hold()
        with trio.fail_after(60):
            r = await client.post("/v1/messages", json={
                "model": "fake", "max_tokens": 5, "timeout": 1,
                "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 504
        body = await r.get_json()
        assert body["type"] == "error" and "timeout" in body["error"]["message"]


# -- the queue-time limit ---------------------------------------------------------------------------


async def test_a_request_not_scheduled_within_the_queue_time_is_429(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, max_queue_time_s=3)
    async with running(app) as client:
        gate = StepGate(app)
        gate.hold()
        with trio.fail_after(60):
            t0 = trio.current_time()
            r = await client.post("/v1/completions", json=completion(**LONG))
            assert trio.current_time() - t0 == pytest.approx(3)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        error = (await r.get_json())["error"]
        assert error["code"] == "queue_time" and error["type"] == "rate_limit_error"
        # A stream's status waits for the worker to start it: the same 429, not an event.
        with trio.fail_after(60):
            r = await client.post("/v1/completions", json=completion(stream=True, **LONG))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert (await r.get_json())["error"]["code"] == "queue_time"
        await wait_all_tasks_blocked()
        assert all_zero(app)
        text = await metrics_text(client)
        assert metric(text, "trio_infer_requests_refused_total", 'reason="queue_time"') == 2
        # Once scheduled, a request is past the limit for good: a long one runs to its end.
        gate.allow()
        with trio.fail_after(60):
            r = await client.post("/v1/completions", json=completion(max_tokens=50, ignore_eos=True))
        assert r.status_code == 200
        text = await metrics_text(client)
        assert metric(text, "trio_infer_request_queue_time_seconds_count") == 1


# -- the bounded queue, and Retry-After from the drain rate ----------------------------------------


async def test_retry_after_is_the_queue_ahead_over_the_measured_drain_rate(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, fake_engine(tokenizer, max_running=1), max_waiting=4)
    async with running(app) as client:
        gate = StepGate(app)
        gate.hold()
        post = partial(client.post, "/v1/completions", json=completion(max_tokens=1))
        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                await trio.sleep(40)
                for _ in range(4):  # four queued at t=40
                    nursery.start_soon(post)
                await wait_all_tasks_blocked()
                for t in (42, 44):  # the engine takes one at t=42 and one at t=44
                    await trio.sleep(t - trio.current_time())
                    gate.allow(1)
                    await wait_all_tasks_blocked()
                for _ in range(2):  # the queue is full again
                    nursery.start_soon(post)
                await wait_all_tasks_blocked()
                r = await post()
                # Two admissions for 4 s of waiting: 2 s each; five sequences ahead (the four
                # queued and its own): 10 s. Idle time before t=40 does not count.
                assert r.status_code == 429 and r.headers["Retry-After"] == "10"
                assert (await r.get_json())["error"]["code"] == "queue_full"
                gate.allow()
        await wait_all_tasks_blocked()
        assert all_zero(app)


async def test_the_token_bound_refuses_at_once_but_an_empty_queue_takes_anything(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, max_waiting_tokens=8)
    async with running(app) as client:
        gate = StepGate(app)
        gate.hold()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                # Alone, 20 prompt tokens get in although the bound is 8.
                nursery.start_soon(partial(client.post, "/v1/completions",
                                           json=completion([5] * 20, max_tokens=1)))
                await wait_all_tasks_blocked()
                t0 = trio.current_time()
                r = await client.post("/v1/completions", json=completion([5], max_tokens=1, stream=True))
                assert trio.current_time() == t0  # at once, before anything was queued
                assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
                assert (await r.get_json())["error"]["code"] == "queue_tokens"
                gate.allow()
        await wait_all_tasks_blocked()
        assert all_zero(app)
        text = await metrics_text(client)
        assert metric(text, "trio_infer_requests_refused_total", 'reason="queue_tokens"') == 1
        status = await (await client.get("/v1/status")).get_json()
        assert status["overload"]["refused"]["queue_tokens"] == 1


async def test_the_anthropic_api_gets_its_429_as_a_rate_limit_error(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, max_waiting=1)
    async with running(app) as client:
        gate = StepGate(app)
        gate.hold()
        body = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(client.post, "/v1/messages", json=body))
                await wait_all_tasks_blocked()
                r = await client.post("/v1/messages", json=body)
                assert r.status_code == 429 and "Retry-After" in r.headers
                assert (await r.get_json())["error"]["type"] == "rate_limit_error"
                gate.allow()


async def test_a_stream_under_the_queue_time_limit_streams_once_scheduled(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, max_queue_time_s=3)
    async with running(app) as client:
        gate = StepGate(app)
        gate.hold()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                got: list = []

                async def post() -> None:
                    r = await client.post("/v1/chat/completions",
                                          json=chat_body(stream=True, max_tokens=3, timeout=30))
                    got.append((r.status_code, parse_sse(await r.get_data(as_text=True))))

                nursery.start_soon(post)
                await trio.sleep(2)  # queued for 2 s of its 3: then the engine takes it
                gate.allow()
        [(status, events)] = got
        assert status == 200 and events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        await wait_all_tasks_blocked()
        assert all_zero(app)


async def test_a_held_stream_past_its_deadline_before_it_starts_is_504(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, max_queue_time_s=10)
    async with running(app) as client:
        StepGate(app).hold()
        with trio.fail_after(60):
            t0 = trio.current_time()
            r = await client.post("/v1/completions", json=completion(stream=True, timeout=2, **LONG))
            assert trio.current_time() - t0 == pytest.approx(2)
        assert r.status_code == 504 and (await r.get_json())["error"]["code"] == "timeout"
        await wait_all_tasks_blocked()
        assert all_zero(app)


async def test_a_held_stream_dropped_before_its_body_leaves_nothing(tokenizer, autojump_clock) -> None:
    """With the queue-time limit the session opens in the handler (the status waits for the
    first scheduling). A client gone between the handler's return and the first body byte drops
    the response unsent; the started body is closed by trio's finalizer, and its session too
    (at once: the response is freed by reference counting, no ``gc.collect()`` needed)."""
    app = make_app(tokenizer, max_queue_time_s=30)
    async with running(app):
        body = json.dumps(chat_body(stream=True, **LONG)).encode()
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "extensions": {},
        }
        sent, gone = trio.Event(), trio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            assert message["type"] == "http.response.start" and message["status"] == 200
            sent.set()
            await trio.sleep_forever()  # a socket that never drains

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(app, scope, receive, send)
                await sent.wait()
                assert counts(app)["sessions"] == 1  # scheduled, status on its way
                gone.set()
            await wait_all_tasks_blocked()
            assert all_zero(app), counts(app)
