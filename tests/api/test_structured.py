"""Structured output (``response_format``) against a real server on the tiny random model, with
the official ``openai`` client: whatever a random model would say, the output parses and
validates against the schema (``jsonschema``) unless ``max_tokens`` cut it.

A random model only ends a document when the schema bounds it: the schemas here bound strings
(``maxLength``) and arrays (``maxItems``), and sampling is seeded, so every run replays.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from .test_server import Server, start_server


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from start_server(tiny_checkpoint, tmp_path_factory, {"TRIO_INFER_MAX_RUNNING": "32"})


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    server.wait_idle()


def msgs(text: str = "Describe the harbour.") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- the SDK's parse with a nested pydantic model ----------------------------------------------


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no other keys: the model would invent some
    label: Annotated[str, Field(max_length=8)]
    count: Annotated[int, Field(ge=0, le=99)]


class Ship(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(max_length=12)]
    colour: Colour
    length_m: Annotated[float, Field(ge=1, le=400)]
    parts: Annotated[list[Part], Field(max_length=3)]
    captain: Optional[Annotated[str, Field(max_length=10)]]
    home: Optional[Part]


def test_parse_returns_the_nested_pydantic_object(client: openai.OpenAI, server: Server) -> None:
    completion = client.chat.completions.parse(
        model=server.model, messages=msgs(), response_format=Ship, max_tokens=400, seed=3,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    ship = choice.message.parsed
    assert isinstance(ship, Ship)
    assert isinstance(ship.colour, Colour) and 1 <= ship.length_m <= 400
    assert Ship.model_validate_json(choice.message.content) == ship


def test_streamed_json_schema_is_the_whole_document(client: openai.OpenAI, server: Server) -> None:
    schema = Ship.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "ship", "schema": schema}}
    with client.chat.completions.stream(
        model=server.model, messages=msgs(), response_format=Ship, max_tokens=400, seed=5,
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Ship)
    raw = client.chat.completions.create(
        model=server.model, messages=msgs(), response_format=fmt, max_tokens=400, seed=5, stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in raw if c.choices)
    jsonschema.validate(json.loads(text), schema)


# -- 200 random nested schemas ------------------------------------------------------------------

_leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, d: {"type": "integer", "minimum": lo, "maximum": lo + d},
              st.integers(-50, 50), st.integers(0, 1000)),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.sampled_from(["a", "b", "c", 1, 2.5, True, None]),
                                               min_size=1, max_size=4, unique=True)),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    names = st.text("abcdefghij", min_size=1, max_size=5)

    @st.composite
    def build(draw: Any) -> dict[str, Any]:
        props = draw(st.dictionaries(names, children, min_size=1, max_size=4))
        required = [k for k in props if draw(st.booleans())]
        return {"type": "object", "properties": props, "required": required,
                "additionalProperties": False}

    return build()


_schema = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                  children, st.integers(0, 3)),
        st.builds(lambda options: {"anyOf": options}, st.lists(children, min_size=2, max_size=3)),
    ),
    max_leaves=8,
)


@settings(max_examples=1, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(_object(_schema), min_size=200, max_size=200))
def test_200_random_nested_schemas_all_validate(server: Server, schemas: list[dict[str, Any]]) -> None:
    """One hypothesis example of 200 schemas (derandomized: the same 200 every run), sent 32 at a
    time; every answer parses and validates."""

    def ask(i: int) -> tuple[str, str]:
        body = {
            "model": server.model, "messages": msgs(f"Example {i}"), "max_tokens": 600, "seed": i,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": f"s{i}", "schema": schemas[i], "strict": True}},
        }
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(len(schemas))))
    for schema, (text, finish) in zip(schemas, answers):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    server.wait_idle()


# -- json_object, completions ------------------------------------------------------------------


def test_json_object_returns_an_object(client: openai.OpenAI, server: Server) -> None:
    # Any object: a random model rarely closes one, so seeds whose documents end are used; the
    # guarantee under test is that whatever ends with "stop" is an object.
    r = client.chat.completions.create(
        model=server.model, messages=msgs(), response_format={"type": "json_object"},
        max_tokens=300, seed=11, n=4,
    )
    finished = [c for c in r.choices if c.finish_reason == "stop"]
    assert finished
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.finish_reason == "length"
    # streamed: the same seeded choices, chunk by chunk
    texts = {i: "" for i in range(4)}
    finishes = {}
    for chunk in client.chat.completions.create(
        model=server.model, messages=msgs(), response_format={"type": "json_object"},
        max_tokens=300, seed=11, n=4, stream=True,
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert [texts[c.index] for c in r.choices] == [c.message.content for c in r.choices]
    assert [finishes[c.index] for c in r.choices] == [c.finish_reason for c in r.choices]


def test_completions_json_schema_streamed_and_not(client: openai.OpenAI, server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "w": {"type": "string", "maxLength": 4}},
              "required": ["n", "w"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=60,
                                  seed=2, extra_body={"response_format": fmt})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    chunks = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=60,
                                       seed=2, stream=True, extra_body={"response_format": fmt})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_max_tokens_cuts_a_document_with_length(client: openai.OpenAI, server: Server) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 50}},
              "required": ["s"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=server.model, messages=msgs(), max_tokens=3, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


# -- bad input ----------------------------------------------------------------------------------

_BAD = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "xml"}, "response_format.type"),
]


@pytest.mark.parametrize("fmt,param", _BAD)
def test_bad_response_format_is_a_400_naming_the_field(server: Server, fmt: dict, param: str) -> None:
    for path, body in [
        ("/v1/chat/completions", {"model": server.model, "messages": msgs(), "response_format": fmt}),
        ("/v1/completions", {"model": server.model, "prompt": "hi", "response_format": fmt}),
    ]:
        r = httpx.post(server.url + path, json={**body, "stream": True}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["param"] == param
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": server.model, "messages": msgs(), "max_tokens": 2})
    assert r.status_code == 200  # still serving


def test_unconstrained_requests_get_their_tokens_alone_or_among_constrained_ones(server: Server) -> None:
    """Greedy unconstrained requests sent alone, then again together with constrained ones (all
    at once, so they share steps): the same text, token for token."""
    plain = [{"model": server.model, "messages": msgs(f"Plain {i}"), "max_tokens": 24,
              "temperature": 0, "ignore_eos": True} for i in range(4)]
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
                                               "b": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                                     "maxItems": 4}},
              "required": ["a", "b"], "additionalProperties": False}
    constrained = [{"model": server.model, "messages": msgs(f"JSON {i}"), "max_tokens": 200, "seed": i,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
                   for i in range(12)]

    def post(body: dict) -> dict:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    alone = [post(body) for body in plain]
    with ThreadPoolExecutor(16) as pool:
        mixed = list(pool.map(post, constrained + plain))
    assert [c["message"]["content"] for c in mixed[len(constrained):]] == [c["message"]["content"] for c in alone]
    for c in mixed[: len(constrained)]:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
    server.wait_idle()


def test_closed_schema_closes_every_object_that_names_properties() -> None:
    from trio_infer.api.structured import closed_schema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
            "any": {"type": "object"},  # names no property: any object
            "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
            "typed": {"type": "object", "properties": {"a": {}},
                      "additionalProperties": {"type": "object", "properties": {"b": {}}}},
            "either": {"anyOf": [{"type": "object", "properties": {"x": {}}}, {"type": "null"}]},
            "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
            "ref": {"$ref": "#/$defs/Point"},
        },
        "$defs": {"Point": {"type": "object", "properties": {"x": {}}}},
    }
    closed = closed_schema(schema)
    p = closed["properties"]
    assert closed["additionalProperties"] is False
    assert p["where"]["additionalProperties"] is False
    assert p["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in p["any"]
    assert p["open"]["additionalProperties"] is True
    assert p["typed"]["additionalProperties"]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False
    assert all("additionalProperties" not in member for member in p["both"]["allOf"])
    assert closed["$defs"]["Point"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left as it was
    jsonschema.validate({"city": "Oslo", "both": {"p": 1, "q": 2}}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Oslo", "type": "string"}, closed)
