"""Stateful ``/v1/responses`` through the official ``openai`` client, on a server whose store is a
SQLite file: retrieve, delete, input items, ``previous_response_id`` (the conversation rebuilt
from the store, its prefix served by the prefix cache), ``store: false``; and the file across a
restart of the app."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from .test_server import Server, start_server


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    store = tmp_path_factory.mktemp("store") / "responses.sqlite"
    yield from start_server(tiny_checkpoint, tmp_path_factory,
                            {"TRIO_INFER_RESPONSES_STORE": str(store)})


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    server.wait_idle()


def _count(server: Server, messages: list[dict[str, Any]]) -> int:
    r = httpx.post(server.url + "/tokenize", json={"model": server.model, "messages": messages})
    return r.json()["count"]


def test_a_stored_response_is_retrieved_listed_and_deleted(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model=server.model, input="Tell me about the harbour.",
                                max_output_tokens=6, temperature=0)
    assert r.store is True
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id)
    [item] = items.data
    assert item.type == "message" and item.role == "user" and item.id.startswith("msg_")
    assert item.content[0].type == "input_text" and item.content[0].text == "Tell me about the harbour."
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_a_streamed_response_is_stored_as_its_last_event_says(client: openai.OpenAI, server: Server) -> None:
    events = list(client.responses.create(model=server.model, input="Hi there", max_output_tokens=5,
                                          temperature=0, stream=True))
    final = events[-1].response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_store_false_keeps_nothing(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model=server.model, input="hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_previous_response_id_continues_the_conversation_from_the_cache(
        client: openai.OpenAI, server: Server) -> None:
    """The second turn's prompt is the first turn's input and output then its own input, without
    the first turn's instructions (as OpenAI documents), and the prefix cache serves the first
    turn's pages."""
    first = client.responses.create(model=server.model, instructions="Answer in one word.",
                                    input="Name a colour of the sea, and a long story about it.",
                                    max_output_tokens=24, temperature=0)
    second = client.responses.create(model=server.model, previous_response_id=first.id,
                                     input=[{"role": "user", "content": "Another?"}],
                                     max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id and second.instructions is None
    want = _count(server, [
        {"role": "user", "content": "Name a colour of the sea, and a long story about it."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another?"}])
    assert second.usage.input_tokens == want
    # The second turn's prompt differs from the first's at its start (no system message), so
    # nothing is served from the cache; the third turn's starts as the second's did: every full
    # page (16 tokens) of the second turn's prompt comes from the cache.
    assert second.usage.input_tokens_details.cached_tokens == 0
    third = client.responses.create(model=server.model, previous_response_id=second.id,
                                    input="And one more?", max_output_tokens=2, temperature=0)
    assert third.usage.input_tokens_details.cached_tokens == second.usage.input_tokens // 16 * 16 > 0
    items = client.responses.input_items.list(third.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["And one more?"]


def test_an_unknown_previous_response_is_a_404_naming_the_field(server: Server) -> None:
    r = httpx.post(server.url + "/v1/responses", json={
        "model": server.model, "input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "previous_response_id"
    assert "resp_nope" in r.json()["error"]["message"]


def test_input_items_pages_in_both_orders(client: openai.OpenAI, server: Server) -> None:
    texts = [f"turn {i}" for i in range(5)]
    r = client.responses.create(model=server.model, max_output_tokens=1,
                                input=[{"role": "user", "content": t} for t in texts])
    first = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in first.data] == texts[:2] and first.has_more
    every = [i.content[0].text for i in client.responses.input_items.list(r.id, limit=2, order="asc")]
    assert every == texts  # the SDK's pager follows ``after``
    assert [i.content[0].text for i in client.responses.input_items.list(r.id)] == texts[::-1]
    bad = httpx.get(server.url + f"/v1/responses/{r.id}/input_items?limit=0")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_metrics_show_the_store(client: openai.OpenAI, server: Server) -> None:
    client.responses.create(model=server.model, input="hi", max_output_tokens=1)
    text = httpx.get(server.url + "/metrics").text
    stored = [line for line in text.splitlines() if line.startswith("trio_infer_responses_stored ")]
    assert stored and float(stored[0].split()[1]) >= 1


async def test_the_sqlite_store_survives_a_restart_of_the_app(tokenizer: Any, tmp_path: Path) -> None:
    from .helpers import make_app, running

    path = str(tmp_path / "responses.sqlite")
    async with running(make_app(tokenizer, responses_store=path)) as c:
        r = await c.post("/v1/responses", json={"model": "fake", "input": "hi", "max_output_tokens": 3})
        first = await r.get_json()
    async with running(make_app(tokenizer, responses_store=path)) as c:
        got = await c.get(f"/v1/responses/{first['id']}")
        assert got.status_code == 200 and await got.get_json() == first
        r = await c.post("/v1/responses", json={"model": "fake", "input": "again", "max_output_tokens": 2,
                                                "previous_response_id": first["id"]})
        assert r.status_code == 200, await r.get_data()
        assert (await r.get_json())["previous_response_id"] == first["id"]


async def test_store_off_refuses_store_true_and_previous_response_id(tokenizer: Any) -> None:
    from .helpers import make_app, running

    async with running(make_app(tokenizer, responses_store="off")) as c:
        for field, value in (("store", True), ("previous_response_id", "resp_x")):
            r = await c.post("/v1/responses", json={"model": "fake", "input": "hi", field: value})
            assert r.status_code == 400 and (await r.get_json())["error"]["param"] == field
        r = await c.post("/v1/responses", json={"model": "fake", "input": "hi", "max_output_tokens": 1})
        said = await r.get_json()
        assert said["store"] is False
        assert (await c.get(f"/v1/responses/{said['id']}")).status_code == 404


def test_input_tokens_counts_the_prompt_a_create_runs(client: openai.OpenAI, server: Server) -> None:
    first = client.responses.create(model=server.model, input="Hello there", max_output_tokens=3)
    kw: dict[str, Any] = dict(model=server.model, instructions="Be brief.", input="And now?",
                              previous_response_id=first.id)
    counted = client.responses.input_tokens.count(**kw)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == client.responses.create(max_output_tokens=1, **kw).usage.input_tokens


def _wait_done(client: openai.OpenAI, response_id: str) -> Any:
    """Poll a background response until it ends, as a client does (bounded)."""
    for _ in range(600):
        got = client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress"):
            return got
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {got.status}")


def test_a_background_response_is_polled_and_its_stream_resumed(client: openai.OpenAI, server: Server) -> None:
    kw: dict[str, Any] = dict(model=server.model, input="Tell me a story.", max_output_tokens=12,
                              temperature=0)
    queued = client.responses.create(background=True, **kw)
    assert queued.background is True and queued.status in ("queued", "in_progress")
    assert queued.output == []
    done = _wait_done(client, queued.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 12
    assert done.output_text == client.responses.create(**kw).output_text  # as a plain request
    # the whole stream again, then from a sequence number on
    every = list(client.responses.retrieve(queued.id, stream=True))
    assert [e.sequence_number for e in every] == list(range(len(every)))
    assert every[-1].type == "response.incomplete"
    rest = list(client.responses.retrieve(queued.id, stream=True, starting_after=4))
    assert [e.sequence_number for e in rest] == list(range(5, len(every)))
    assert rest[-1].response.output_text == done.output_text


def test_a_background_response_is_cancelled_within_a_step(client: openai.OpenAI, server: Server) -> None:
    queued = client.responses.create(model=server.model, input="A very long story.", background=True,
                                     max_output_tokens=3000, temperature=0)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    server.wait_idle()  # the sequence was aborted: nothing runs
    # a finished background response is returned as it is; a plain one cannot be cancelled
    assert client.responses.cancel(queued.id).status == "cancelled"
    plain = client.responses.create(model=server.model, input="hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)


def test_background_needs_store_and_a_plain_response_has_no_event_stream(server: Server) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"model": server.model, "input": "hi",
                                                       "background": True, "store": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    plain = httpx.post(server.url + "/v1/responses", json={"model": server.model, "input": "hi",
                                                           "max_output_tokens": 1}).json()
    r = httpx.get(server.url + f"/v1/responses/{plain['id']}?stream=true")
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
