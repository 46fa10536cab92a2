"""Every way an HTTP request can end leaves nothing behind: the reference design's gaps G1-G7 and the traps
of the trio / quart-trio / hypercorn stack (docs/lifecycle.md), each with a test that fails on the reference behaviour.

All in-process on the fake model with the engine steps inline, under ``autojump_clock``:
``wait_all_tasks_blocked`` is the synchronisation, virtual time runs the timeouts, and every test
body is under ``fail_after`` so a deadlock fails at once instead of hanging.
"""

from __future__ import annotations

import gc
import json
import re
import threading
import tomllib
import weakref
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from packaging.requirements import Requirement
from trio.testing import wait_all_tasks_blocked

import trio_infer.api.routes as routes
import trio_infer.api.render as render
import trio_infer.runtime.text_stream as text_stream
from trio_infer.app import drain
from trio_infer.models.fake import FakeModel
from trio_infer.models.synthetic import IM_END

from .helpers import (
    StepGate,
    all_zero,
    chat_body,
    counts,
    fake_engine,
    make_app,
    metric,
    open_request,
    parse_sse,
    post_stream,
    read_until,
    running,
    state,
)

LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def completion(prompt: Any = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": prompt, **kw}


async def metrics_text(client) -> str:  # type: ignore[no-untyped-def]
    return await (await client.get("/metrics")).get_data(as_text=True)


async def drain_body(conn) -> str:  # type: ignore[no-untyped-def]
    text = ""
    while True:
        try:
            text += (await conn.receive()).decode()
        except trio.EndOfChannel:
            return text


# -- G1 / G2: disconnects -------------------------------------------------------------------------


async def test_disconnect_mid_stream_frees_everything_within_one_step(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        gate = StepGate(app)
        gate.allow(3)
        tasks_before = len(app.nursery.child_tasks)
        with trio.fail_after(60):
            async with open_request(client, "/v1/chat/completions", chat_body(stream=True, **LONG)) as conn:
                await read_until(conn, lambda t: t.count("data: ") >= 2)
                await wait_all_tasks_blocked()
                during = counts(app)
                assert during["sessions"] == during["running"] == 1 and during["request_pages"] > 0
                t0 = trio.current_time()
            await wait_all_tasks_blocked()
            assert all_zero(app), counts(app)
            # G7: cleanup took no (virtual) time and left no detached task behind.
            assert trio.current_time() == t0
            assert len(app.nursery.child_tasks) == tasks_before
            # G2: the engine runs no further step for the vanished request.
            steps = gate.steps
            gate.allow()
            await wait_all_tasks_blocked()
            assert gate.steps == steps
            text = await metrics_text(client)
            assert metric(text, "trio_infer_requests_total", 'finish_reason="abort"') == 1
            assert metric(text, "trio_infer_sessions_active") == 0
            assert metric(text, "trio_infer_requests_running") == 0


async def test_disconnect_mid_non_stream_frees_everything(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        gate = StepGate(app)
        gate.allow(3)
        with trio.fail_after(60):
            async with open_request(client, "/v1/completions", completion(**LONG)):
                await wait_all_tasks_blocked()
                during = counts(app)
                assert during["sessions"] == during["running"] == 1 and during["request_pages"] > 0
                assert gate.steps == 3  # it is mid-generation, not finished
            await wait_all_tasks_blocked()
            assert all_zero(app), counts(app)


async def test_disconnect_while_queued_leaves_the_queue(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, engine=fake_engine(tokenizer, max_running=1))
    async with running(app) as client:
        gate = StepGate(app)
        gate.hold()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                results: list[Any] = []

                async def first() -> None:
                    r = await client.post("/v1/completions", json=completion(max_tokens=4, temperature=0))
                    results.append((r.status_code, await r.get_json()))

                nursery.start_soon(first)
                await wait_all_tasks_blocked()
                gate.allow(1)  # admit the first request: it holds the only running slot
                await wait_all_tasks_blocked()
                async with open_request(client, "/v1/completions", completion(max_tokens=4)):
                    await wait_all_tasks_blocked()
                    assert counts(app)["waiting"] == 1 and counts(app)["running"] == 1
                await wait_all_tasks_blocked()
                assert counts(app)["waiting"] == 0 and counts(app)["sessions"] == 1
                gate.allow()
            [(status, body)] = results
            assert status == 200 and body["choices"][0]["finish_reason"] == "length"
            assert all_zero(app)


async def test_disconnect_before_the_body_starts_still_ends_the_session(tokenizer, autojump_clock, monkeypatch) -> None:
    """Between the handler's return and the first body byte, Quart awaits the
    ``http.response.start`` send. A client gone right then cancels the request before the body
    generator ever runs: the session is entered in the body, so none exists yet and nothing is
    left behind (G1)."""
    app = make_app(tokenizer)
    async with running(app):
        body = json.dumps(chat_body(stream=True, **LONG)).encode()
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "extensions": {},
        }
        sent = trio.Event()
        gone = trio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            assert message["type"] == "http.response.start"
            sent.set()
            await trio.sleep_forever()  # a socket that never drains

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(app, scope, receive, send)
                await sent.wait()
                assert counts(app)["sessions"] == 0  # admitted, but no session before the body
                gone.set()  # the client disconnects before any body byte was sent
            await wait_all_tasks_blocked()
            assert all_zero(app), counts(app)


# -- G3: per-request text state dies with the request ---------------------------------------------


async def test_detokenizer_and_stop_state_die_with_the_request(tokenizer, autojump_clock, monkeypatch) -> None:
    made: list[weakref.ref] = []
    real = text_stream.TextStream.__init__

    def tracking(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        real(self, *args, **kwargs)
        made.append(weakref.ref(self))
        made.extend(weakref.ref(c) for c in self.choices)
        made.extend(weakref.ref(c.detokenizer) for c in self.choices)
        made.extend(weakref.ref(c.stops) for c in self.choices)

    monkeypatch.setattr(text_stream.TextStream, "__init__", tracking)
    app = make_app(tokenizer)
    async with running(app) as client:
        gate = StepGate(app)
        gate.allow(2)
        with trio.fail_after(60):
            async with open_request(client, "/v1/completions", completion(stream=True, n=2, stop=["zz"], **LONG)) as conn:
                await read_until(conn, lambda t: "data: " in t)
            await wait_all_tasks_blocked()
            gate.allow()
            await client.post("/v1/completions", json=completion(max_tokens=3, stop=["\n"]))
        gc.collect()
        assert made and all(ref() is None for ref in made)
        assert all_zero(app)


# -- G4: a prompt that cannot fit is refused before scheduling ------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_too_long_prompt_is_400_before_anything_is_scheduled(tokenizer, autojump_clock, stream) -> None:
    app = make_app(tokenizer, engine=fake_engine(tokenizer, max_model_len=64))
    async with running(app) as client:
        gate = StepGate(app)
        with trio.fail_after(60):
            cases = [
                (completion([5] * 64, stream=stream), "prompt"),
                (completion([5] * 60, max_tokens=5, stream=stream), "max_tokens"),
                (chat_body("word " * 80, stream=stream), "messages"),
            ]
            for body, param in cases:
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                r = await client.post(path, json=body)
                assert r.status_code == 400, body
                err = (await r.get_json())["error"]
                assert err["code"] == "context_length_exceeded" and err["param"] == param
                assert "64" in err["message"]
            text = await metrics_text(client)
            assert metric(text, "trio_infer_prompt_tokens_total") == 0
            assert gate.steps == 0
            r = await client.post("/v1/completions", json=completion([5] * 60, max_tokens=4))
            assert r.status_code == 200


# -- G5: slow readers ----------------------------------------------------------------------------


async def test_a_reader_that_stops_is_paused_bounded_then_aborted(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer, channel_capacity=4, stall_timeout_s=30)
    async with running(app) as client:
        with trio.fail_after(600):
            async with open_request(client, "/v1/completions", completion(stream=True, **LONG)) as conn:
                await wait_all_tasks_blocked()  # the client reads nothing: everything fills up
                paused = counts(app)
                assert paused["sessions"] == paused["running"] == 1 and paused["request_pages"] > 0
                produced = metric(await metrics_text(client), "trio_infer_generation_tokens_total")
                # Bounded: the request channel (4) plus the transport's buffer, not max_tokens.
                assert produced < 40
                await trio.sleep(20)  # virtual time: still paused, nothing more produced
                assert metric(await metrics_text(client), "trio_infer_generation_tokens_total") == produced
                assert counts(app)["sessions"] == 1
                # Trap 9: the stuck reader does not stop the server from serving others.
                r = await client.post("/v1/completions", json=completion(max_tokens=5))
                assert r.status_code == 200
                await trio.sleep(15)  # past the stall timeout: aborted, engine state freed...
                assert counts(app)["sessions"] == 0 and counts(app)["running"] == 0
                assert counts(app)["request_pages"] == 0
                # ... and the client, once it reads again, gets its tokens, an error, [DONE].
                events = parse_sse(await drain_body(conn))
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "stalled"
            got = sum(1 for e in events[:-2] if e["choices"][0]["text"])
            assert 0 < got <= produced
            assert all_zero(app)


# -- engine failures ------------------------------------------------------------------------------

POISON = 666


class PoisonModel(FakeModel):
    """Fails the step that carries the POISON token (a model bug or a CUDA error)."""

    def forward(self, batch, k_caches, v_caches):  # type: ignore[no-untyped-def]
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError("poisoned step")
        return super().forward(batch, k_caches, v_caches)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failing_step_fails_its_requests_and_the_server_goes_on(tokenizer, autojump_clock, stream) -> None:
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    model = PoisonModel(vocab_size=len(tokenizer), eos_token_id=eos)
    app = make_app(tokenizer, engine=fake_engine(tokenizer, model=model))
    async with running(app) as client:
        with trio.fail_after(60):
            r = await client.post("/v1/completions", json=completion([1, 2, POISON], max_tokens=3, stream=stream))
            if stream:
                assert r.status_code == 200
                events = parse_sse(await r.get_data(as_text=True))
                assert events[-1] == "[DONE]"
                err = events[-2]["error"]
            else:
                assert r.status_code == 500
                err = (await r.get_json())["error"]
            assert err["type"] == "server_error" and err["code"] == "engine_error"
            assert all_zero(app)
            r = await client.post("/v1/completions", json=completion([1, 2, 3], max_tokens=3, stream=stream))
            assert r.status_code == 200
            assert (await client.get("/health")).status_code == 200
            text = await metrics_text(client)
            assert metric(text, "trio_infer_requests_total", 'finish_reason="error"') == 1


async def test_a_crashed_worker_fails_requests_and_turns_health_503(tokenizer, autojump_clock) -> None:
    """Trap 7: an app.nursery task that dies must not leave the server up but deaf."""
    app = make_app(tokenizer)
    async with running(app) as client:
        engine = state(app).engine.connection.core.engine
        real, calls = engine.schedule, [0]

        def crash_on_third():  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("scheduler bug")
            return real()

        engine.schedule = crash_on_third
        with trio.fail_after(60):
            r = await client.post("/v1/chat/completions", json=chat_body(stream=True, **LONG))
            events = parse_sse(await r.get_data(as_text=True))
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "service_unavailable"
            assert (await client.get("/health")).status_code == 503
            r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            assert r.status_code == 503
            assert (await r.get_json())["error"]["type"] == "server_error"
            assert state(app).engine.num_sessions == 0


async def test_unexpected_error_mid_stream_becomes_an_error_event(tokenizer, autojump_clock, monkeypatch) -> None:
    """Trap 6: an exception after the first byte must not truncate the body."""
    calls = [0]
    real = render.CompletionSerializer.write

    def flaky(self, events):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            raise ValueError("formatting bug")
        return real(self, events)

    monkeypatch.setattr(render.CompletionSerializer, "write", flaky)
    app = make_app(tokenizer)
    async with running(app) as client:
        with trio.fail_after(60):
            r = await client.post("/v1/completions", json=completion(stream=True, max_tokens=5))
            events = parse_sse(await r.get_data(as_text=True))
            assert events[-1] == "[DONE]"
            err = events[-2]["error"]
            assert err["type"] == "server_error" and "formatting bug" not in err["message"]
            assert all_zero(app)


# -- health, timeouts, shutdown -------------------------------------------------------------------


async def test_health_answers_while_a_long_generation_runs(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        with trio.fail_after(60):
            async with open_request(client, "/v1/completions", completion(stream=True, **LONG)) as conn:
                await read_until(conn, lambda t: "data: " in t)
                for _ in range(5):
                    assert (await client.get("/health")).status_code == 200
                    assert state(app).engine.num_sessions == 1  # the generation is still running
                    await conn.receive()  # keep reading so it is not paused


class HeldModel(FakeModel):
    """The fake model, computing in the worker's step thread (as a real forward pass does), where
    each forward pass waits until the test releases it: while it waits, a step is known to be in
    progress."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.instant = False  # stepped in a thread, not inline on the event loop
        self.entered = threading.Event()
        self.release = threading.Event()
        self.computing = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.computing = True
        self.entered.set()
        self.release.wait(timeout=120)  # bounded: a broken test fails rather than hangs
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.computing = False


async def test_health_stays_fast_while_the_model_computes(tokenizer) -> None:
    """``/health`` is answered while an engine step is in progress, not after it: the model's
    forward pass is held until the answers are in. No timing is asserted; a server whose event
    loop waited for the step would answer only after the release (then ``computing`` is False)
    or never."""
    model = HeldModel(vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids(IM_END))
    app = make_app(tokenizer, fake_engine(tokenizer, model=model))
    async with running(app) as client:
        try:
            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(client.post, "/v1/completions",
                                               json=completion(max_tokens=3)))
                    await trio.to_thread.run_sync(model.entered.wait)  # a step is computing
                    for _ in range(3):
                        r = await client.get("/health")
                        assert r.status_code == 200 and (await r.get_json()) == {"status": "ok"}
                        status = await (await client.get("/v1/status")).get_json()
                        assert model.computing and not model.release.is_set()  # still in the step
                    assert status["requests"]["sessions"] == 1
                    model.release.set()
        finally:
            model.release.set()
        assert all_zero(app)


async def test_streams_longer_than_quarts_60s_response_timeout_complete(tokenizer, autojump_clock) -> None:
    """Trap 1: Quart's default RESPONSE_TIMEOUT (60 s) would cut this stream silently."""
    app = make_app(tokenizer)
    assert app.config["RESPONSE_TIMEOUT"] is None
    async with running(app) as client:
        gate = StepGate(app)
        gate.hold()
        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                got: list[str] = []

                async def fetch() -> None:
                    status, text = await post_stream(client, "/v1/completions", completion(stream=True, max_tokens=90, temperature=0))
                    got.append(text)

                nursery.start_soon(fetch)
                t0 = trio.current_time()
                while not got:
                    gate.allow(1)  # one token per virtual second
                    await trio.sleep(1)
            assert trio.current_time() - t0 > 60
            events = parse_sse(got[0])
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


async def test_drain_refuses_new_work_then_ends_running_requests(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        gate = StepGate(app)
        gate.allow(2)
        with trio.fail_after(60):
            async with open_request(client, "/v1/completions", completion(stream=True, **LONG)) as conn:
                await read_until(conn, lambda t: "data: " in t)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain, app, 5.0)
                    await wait_all_tasks_blocked()
                    assert (await client.get("/health")).status_code == 503
                    r = await client.post("/v1/completions", json=completion(max_tokens=2))
                    assert r.status_code == 503
                    assert state(app).engine.num_sessions == 1  # within the grace period
                events = parse_sse(await drain_body(conn))
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["message"] == "the server is shutting down"
            assert all_zero(app)


async def test_drain_lets_requests_finish_within_the_grace_period(tokenizer, autojump_clock) -> None:
    app = make_app(tokenizer)
    async with running(app) as client:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                got: list[Any] = []

                async def fetch() -> None:
                    r = await client.post("/v1/completions", json=completion(max_tokens=50))
                    got.append(r.status_code)

                gate = StepGate(app)
                gate.hold()
                nursery.start_soon(fetch)
                await wait_all_tasks_blocked()
                nursery.start_soon(drain, app, 5.0)
                await wait_all_tasks_blocked()
                gate.allow()
            assert got == [200]


async def test_app_shutdown_does_not_wait_for_background_tasks(tokenizer, autojump_clock) -> None:
    """Trap 10: with Quart's default BACKGROUND_TASK_SHUTDOWN_TIMEOUT every exit waits 5 s."""
    app = make_app(tokenizer)
    async with running(app):
        t0 = trio.current_time()
    assert trio.current_time() - t0 < 1


# -- static guards for the remaining traps ---------------------------------------------------------


def test_no_handler_catches_a_bare_cancelled() -> None:
    """Trap 3: cancellation of a handler holding a nursery arrives as a BaseExceptionGroup, which
    ``except trio.Cancelled`` misses; cleanup in the HTTP layer uses ``finally`` only."""
    root = Path(__file__).resolve().parents[2] / "trio_infer"
    for path in [*root.joinpath("api").glob("*.py"), root / "app.py", root / "__main__.py"]:
        assert not re.search(r"except\s*\(?[^:]*Cancelled", path.read_text()), path


def test_stack_versions_are_within_the_tested_ranges() -> None:
    """The installed trio, quart, quart-trio and hypercorn are within pyproject.toml's ranges,
    which stop before the next minor release of each (trap 12: quart-trio 0.13 changes hook
    signatures and needs Python 3.13)."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    ranges = {r.name: r.specifier for r in map(Requirement, pyproject["project"]["dependencies"])}
    for name in ("trio", "quart", "quart-trio", "hypercorn"):
        assert ranges[name].contains(version(name)), (name, version(name), str(ranges[name]))
    assert not ranges["quart-trio"].contains("0.13.0")
