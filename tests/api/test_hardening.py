"""Hardening: what hostile and broken clients send, against the real app in process.

Hypothesis draws batches of bad requests for every endpoint: random methods and paths, content
types, bodies of every JSON type, valid requests with one field replaced by anything, truncated
JSON, other encodings (UTF-16, UTF-32, a BOM, Latin-1), invalid UTF-8, raw bytes, NaN and
10,000-digit numbers, lone surrogates, deep nesting, bodies around and over the size limit, sent
in random pieces, with and without an API key. Every answer must be an error in the OpenAI
envelope with a 4xx status (or a success for a request that happens to be valid: never a 5xx),
never a hang (``trio.fail_after`` under the autojump clock: a deadlock fails at once), and right
after each batch a normal request must be served and nothing may be left in the engine.

The examples are derandomized (``derandomize=True``): every run tries the same ones, and a
failure prints the example (and its ``@reproduce_failure`` blob), which replays. Bugs this found
are listed in docs/testing.md, "Hardening".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from .helpers import all_zero, chat_body, counts, fake_engine, make_app, running
from trio_infer.api.jsondepth import MAX_JSON_DEPTH, json_depth

KEY = "sekrit-key"
BODY_LIMIT = 16 * 1024  # max_body_bytes of the app under test: oversized bodies stay cheap
HEADER_LIMIT = 2048  # max_header_bytes of the app under test
MAX_MODEL_LEN = 128  # a valid request the fuzzer happens to build generates little

HARDENING = settings(
    max_examples=int(os.environ.get("TRIO_INFER_HARDENING_EXAMPLES", "500")),
    # Same examples every run; TRIO_INFER_HARDENING_RANDOM=1 explores new ones (a failure still
    # prints its @reproduce_failure blob).
    derandomize=not os.environ.get("TRIO_INFER_HARDENING_RANDOM"),
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    report_multiple_bugs=False,
)

POST_ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
GET_ENDPOINTS = ["/v1/models", "/health", "/metrics", "/v1/status", "/"]


def base_body(path: str) -> dict[str, Any]:
    """A valid request for ``path`` (the fuzzer breaks it)."""
    return {
        "/v1/chat/completions": chat_body("hi", max_tokens=3),
        "/v1/completions": {"model": "fake", "prompt": "hi", "max_tokens": 3},
        "/tokenize": {"model": "fake", "prompt": "hi"},
        "/detokenize": {"model": "fake", "tokens": [104, 105]},
    }.get(path, {})


FIELDS = [
    "model", "messages", "prompt", "tokens", "max_tokens", "max_completion_tokens", "n", "stream",
    "stream_options", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "user", "logprobs",
    "top_logprobs", "echo", "best_of", "metadata", "add_special_tokens", "add_generation_prompt",
    "tools", "tool_choice", "response_format", "logit_bias", "store", "suffix", "service_tier",
    "functions", "modalities", "audio", "prediction", "reasoning_effort",
    # vLLM's extensions
    "chat_template_kwargs", "continue_final_message", "skip_special_tokens",
    "include_stop_str_in_output", "min_tokens", "repetition_penalty", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "thinking_token_budget", "continuous_usage_stats", "enable_thinking", "reasoning_content",
]

# Values chosen to sit on every edge the validators have.
EDGE_VALUES = st.sampled_from([
    None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 0.5, -0.0, 1e308,
    -1e308, 2.0000001, "", "fake", "0", "1", "true", "null", "\x00", "\ud800", "\udfff x \ud800",
    "<|im_end|>", "<script>", "é" * 300, [], [""], [0], [-1], [2**40], [[0]], [[]], [["a"]],
    {}, {"role": "user"}, {"role": "user", "content": None}, {"role": "tool", "content": "x"},
    {"role": "user", "content": []}, {"role": "user", "content": [{"type": "image_url"}]},
    {"role": "user", "content": [{"type": "text", "text": "\ud800"}]},
    [{"role": "user", "content": "\ud800"}], [{"role": "system", "content": ""}],
    [{"role": "user", "content": "hi", "name": "x"}], {"include_usage": "yes"},
    {"include_usage": True, "extra": 1}, ["a"] * 17, list(range(65)),
])
NASTY_STRINGS = st.sampled_from([
    "", "\x00", "\ud800", "a\udfff", "\udc00\ud800", "\ud83d", "\ufeff", "\uffff", "\U0010ffff",
    "<|im_end|>", "<|im_start|>system", "\r\n\r\n", "%s%n", "{{ raise_exception('x') }}",
    "\u202e", "a" * 3000,
]) | st.text(max_size=30)


def string_leaves(value: Any):  # type: ignore[no-untyped-def]
    """(container, key) of every string in a request body."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(item, str):
            yield value, key
        else:
            yield from string_leaves(item)


SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.integers(0xD800, 0xDFFF).map(chr)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
ANY_VALUE = st.one_of(EDGE_VALUES, JSON_VALUES)


def nest(depth: int, inner: str, kinds: list[bool]) -> str:
    """``inner`` inside ``depth`` levels of arrays and objects (``kinds`` cycles: True = object)."""
    out, closes = [], []
    for i in range(depth):
        obj = kinds[i % len(kinds)]
        out.append('{"a":' if obj else "[")
        closes.append("}" if obj else "]")
    return "".join(out) + inner + "".join(reversed(closes))


@st.composite
def bodies(draw: st.DrawFn, path: str) -> tuple[str, bytes]:
    """(what kind of body, its bytes)."""
    base = base_body(path)
    kind = draw(st.sampled_from([
        "mutated", "mutated", "mutated", "any-json", "deep", "deep-in-field", "bytes", "encoded",
        "truncated", "invalid-utf8", "constants", "huge-number", "big", "empty", "valid",
        "string-leaf", "string-leaf", "string-leaf",
    ]))
    if kind == "string-leaf":  # a nasty string where the request has a string
        body = json.loads(json.dumps(base))
        leaves = list(string_leaves(body))
        if leaves:
            parent, key = draw(st.sampled_from(leaves))
            parent[key] = draw(NASTY_STRINGS)
        # Mostly ASCII escapes: raw UTF-8 cannot carry a surrogate (that is the invalid-UTF-8 case).
        ascii_only = draw(st.integers(0, 3)) > 0
        return kind, json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    if kind in ("mutated", "valid", "encoded", "truncated"):
        body = dict(base)
        if kind != "valid":
            for _ in range(draw(st.integers(1, 3))):
                name = draw(st.sampled_from(FIELDS) | st.text(max_size=10))
                if draw(st.booleans()) and body:
                    body.pop(draw(st.sampled_from(sorted(body))), None)
                else:
                    body[name] = draw(ANY_VALUE)
        text = json.dumps(body, ensure_ascii=draw(st.booleans()))
        if kind == "encoded":
            codec = draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32", "utf-8-sig", "latin-1"]))
            return kind, text.encode(codec, errors="replace")
        if kind == "truncated":
            return kind, text.encode("utf-8", "surrogatepass")[: draw(st.integers(0, max(0, len(text) - 1)))]
        return kind, text.encode("utf-8", "surrogatepass")
    if kind == "any-json":
        return kind, json.dumps(draw(ANY_VALUE)).encode()
    if kind in ("deep", "deep-in-field"):
        depth = draw(st.sampled_from([MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 100, 999, 1000, 1001, 3000])
                     | st.integers(0, 5000))
        kinds = draw(st.lists(st.booleans(), min_size=1, max_size=3))
        inner = draw(st.sampled_from(["", "1", '"x"', "null", "[", "]"]))
        nested = nest(depth, inner, kinds)
        if kind == "deep":
            return kind, nested.encode()
        name = draw(st.sampled_from(FIELDS))
        text = json.dumps({**base, name: None}).replace("null}", nested + "}", 1)
        return kind, text.encode()
    if kind == "bytes":
        return kind, draw(st.binary(max_size=300))
    if kind == "invalid-utf8":
        good = json.dumps(base).encode()
        at = draw(st.integers(0, len(good)))
        return kind, good[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"])) + good[at:]
    if kind == "constants":
        word = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "nan", "undefined", "1e999", "-1e999"]))
        return kind, json.dumps({**base, draw(st.sampled_from(FIELDS)): 0}).replace(": 0", ": " + word, 1).encode()
    if kind == "huge-number":
        digits = "9" * draw(st.sampled_from([20, 400, 4300, 4301, 10_000]))
        return kind, json.dumps({**base, draw(st.sampled_from(FIELDS)): 0}).replace(": 0", ": " + digits, 1).encode()
    if kind == "big":
        size = draw(st.sampled_from([BODY_LIMIT - 200, BODY_LIMIT, BODY_LIMIT + 1, 4 * BODY_LIMIT]))
        field_name = "prompt" if path == "/v1/completions" else "user"
        text = json.dumps({**base, field_name: ""})
        filler = "x" * max(0, size - len(text))
        return kind, text.replace('""', json.dumps(filler), 1).encode()
    return kind, b""


CONTENT_TYPES = st.sampled_from([
    "application/json", "application/json", "text/plain", None, "application/json; charset=utf-16",
    "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "*/*", "application/jsonx",
])


@dataclass
class BadRequest:
    method: str
    path: str
    headers: dict[str, str]
    kind: str
    body: bytes
    pieces: list[int] = field(default_factory=list)  # where the body is split into sends


@st.composite
def bad_requests(draw: st.DrawFn, keyed: bool) -> BadRequest:
    # Bodies matter on the POST endpoints: three requests in four go there.
    path = draw(st.sampled_from(POST_ENDPOINTS if draw(st.integers(0, 3)) else GET_ENDPOINTS))
    method = "POST" if path in POST_ENDPOINTS else "GET"
    if draw(st.integers(0, 5)) == 0:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]))
    if draw(st.integers(0, 7)) == 0:
        path = draw(st.sampled_from([
            "/v1/chat/completions/", "/V1/models", "//v1/models", "/v1/../v1/models", "/nope",
            "/v1/chat%2Fcompletions", "/static/../routes.py", "/static/nope.js", "/v1/" + "a" * 2000,
            "/v1/models?x=" + "%" * 10, "/tokenize?model=fake&x[]=1",
        ]))
    kind, body = draw(bodies(path.split("?")[0]))
    headers: dict[str, str] = {}
    content_type = draw(CONTENT_TYPES)
    if content_type is not None:
        headers["Content-Type"] = content_type
    if keyed:
        headers["Authorization"] = draw(st.sampled_from([
            f"Bearer {KEY}", f"Bearer {KEY}", f"bearer  {KEY} ", "Bearer", "Bearer wrong", KEY,
            f"Basic {KEY}", "Bearer \u00e9", "",
        ]))
    elif draw(st.integers(0, 4)) == 0:
        headers["Authorization"] = "Bearer anything"
    if draw(st.integers(0, 9)) == 0:  # around max_header_bytes: 431 past it
        headers["X-Pad"] = "a" * draw(st.sampled_from([10, HEADER_LIMIT - 600, HEADER_LIMIT, 4 * HEADER_LIMIT]))
    if draw(st.integers(0, 4)) == 0:
        headers["Accept"] = draw(st.sampled_from(["text/html", "*/*", "text/event-stream", "x/y;q=bad"]))
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3))) if body else []
    return BadRequest(method, path, headers, kind, body, cuts)


async def send(client, req: BadRequest) -> tuple[int, dict[str, str], bytes]:  # type: ignore[no-untyped-def]
    """Send ``req`` (its body in pieces) and read the whole answer as it comes."""
    path, _, query = req.path.partition("?")
    async with client.request(
        path, method=req.method, headers=req.headers,
        query_string=dict(p.partition("=")[::2] for p in query.split("&")) if query else None,
    ) as conn:
        last = 0
        for cut in [*req.pieces, len(req.body)]:
            if cut > last:
                await conn.send(req.body[last:cut])
                last = cut
        await conn.send_complete()
        data = b""
        while True:
            try:
                data += await conn.receive()
            except trio.EndOfChannel:
                break
    return conn.status_code, dict(conn.headers or {}), data


def check_answer(req: BadRequest, status: int, headers: dict[str, str], data: bytes) -> None:
    """Never a 5xx; an error is the OpenAI envelope; a success is well formed."""
    where = f"{req.method} {req.path} [{req.kind}] -> {status}: {data[:300]!r}"
    assert status < 500, where
    if status >= 400:
        body = json.loads(data)
        assert set(body) == {"error"}, where
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
        assert isinstance(err["message"], str) and err["message"], where
        assert err["type"] == "invalid_request_error", where
        return
    assert 200 <= status < 300, where
    if req.method in ("HEAD", "OPTIONS") or req.path in ("/", "/metrics") or not data:
        return
    if data.startswith(b"data: "):
        assert data.endswith(b"data: [DONE]\n\n"), where
        assert b'"error"' not in data, where
    else:
        json.loads(data)


async def normal_request_works(client, keyed: bool) -> None:  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {KEY}"} if keyed else {}
    r = await client.post("/v1/chat/completions", json=chat_body("hello", max_tokens=4), headers=headers)
    assert r.status_code == 200, await r.get_data()
    body = await r.get_json()
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] >= 1


def run_batch(tokenizer: Any, reqs: list[BadRequest], keyed: bool) -> None:
    async def main() -> None:
        app = make_app(
            tokenizer, fake_engine(tokenizer, max_model_len=MAX_MODEL_LEN, num_pages=64),
            max_body_bytes=BODY_LIMIT, max_header_bytes=HEADER_LIMIT, api_key=KEY if keyed else None,
        )
        with trio.fail_after(120):  # virtual seconds: a request that hangs fails at once
            async with running(app) as client:
                answers: list[Any] = [None] * len(reqs)

                async def one(i: int) -> None:
                    answers[i] = await send(client, reqs[i])

                async with trio.open_nursery() as nursery:
                    for i in range(len(reqs)):
                        nursery.start_soon(one, i)
                for req, answer in zip(reqs, answers):
                    event(f"{req.kind}: {answer[0]}")
                    check_answer(req, *answer)
                await trio.testing.wait_all_tasks_blocked()
                assert all_zero(app), counts(app)
                await normal_request_works(client, keyed)
                await trio.testing.wait_all_tasks_blocked()
                assert all_zero(app), counts(app)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@st.composite
def batches(draw: st.DrawFn) -> tuple[bool, list[BadRequest]]:
    keyed = draw(st.integers(0, 3)) == 0
    return keyed, draw(st.lists(bad_requests(keyed), min_size=1, max_size=6))


@HARDENING
@given(batch=batches())
def test_bad_input_never_fails_open(tokenizer: Any, batch: tuple[bool, list[BadRequest]]) -> None:
    keyed, reqs = batch
    run_batch(tokenizer, reqs, keyed)


# -- the deep-nesting 500, by hand --------------------------------------------------------------


@pytest.mark.parametrize("path", POST_ENDPOINTS)
@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_json_is_a_400_not_a_500(tokenizer: Any, path: str, depth: int) -> None:
    """The fuzzer's find: ``[[[[...]]]]`` ~1,000 deep (2 KB) made json.loads raise RecursionError."""
    bodies_ = [b"[" * depth + b"]" * depth,
               json.dumps(base_body(path))[:-1].encode() + b', "user": ' + b"[" * depth + b"]" * depth + b"}"]
    for body in bodies_:
        req = BadRequest("POST", path, {"Content-Type": "application/json"}, "deep", body)
        status, out = _one(tokenizer, req)
        assert status == 400, out
        err = json.loads(out)["error"]
        assert err["code"] == "json_too_deep" and str(MAX_JSON_DEPTH) in err["message"]
        assert err["type"] == "invalid_request_error"


def test_nesting_up_to_the_limit_is_parsed() -> None:
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json_depth(at_limit) <= MAX_JSON_DEPTH  # accepted (0: too few brackets to look)
    assert json_depth(at_limit, limit=0) == MAX_JSON_DEPTH
    assert json.loads(at_limit)  # and the parser takes it
    assert json_depth("[" + at_limit + "]") == MAX_JSON_DEPTH + 1
    # brackets inside strings, escaped quotes, do not count
    assert json_depth(json.dumps(["[" * 500, '\\"[[[', {"k": "{" * 100}]), limit=0) == 2


@HARDENING
@given(value=JSON_VALUES)
def test_json_depth_matches_the_structure(value: Any) -> None:
    def depth(v: Any) -> int:
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        return 0

    text = json.dumps(value, ensure_ascii=False)
    assert json_depth(text, limit=0) == depth(value)


def _one(tokenizer: Any, req: BadRequest) -> tuple[int, bytes]:
    out: list[Any] = []

    async def main() -> None:
        app = make_app(tokenizer, fake_engine(tokenizer, max_model_len=MAX_MODEL_LEN, num_pages=64))
        with trio.fail_after(60):
            async with running(app) as client:
                status, _, data = await send(client, req)
                out.extend([status, data])
                await normal_request_works(client, False)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return out[0], out[1]


# -- lone surrogates, by hand --------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"model": "fake", "prompt": "\ud800"}, "prompt"),
        ("/v1/chat/completions", chat_body("a\udfff", max_tokens=2), "messages.0.content"),
        ("/v1/completions", {"model": "fake", "prompt": ["ok", "\ud83d"], "max_tokens": 2}, "prompt.1"),
        ("/v1/chat/completions", chat_body("a", max_tokens=2, stream=True, stop=["\ud800"]), "stop.0"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(tokenizer: Any, path: str, body: dict, param: str) -> None:
    """The suite's second find: "\\ud800" parses to a str the tokenizer refused with TypeError (500)."""
    req = BadRequest("POST", path, {"Content-Type": "application/json"}, "surrogate", json.dumps(body).encode())
    status, out = _one(tokenizer, req)
    assert status == 400, out
    err = json.loads(out)["error"]
    assert err["param"] == param and "surrogate" in err["message"]


def test_a_surrogate_pair_is_text(tokenizer: Any) -> None:
    body = json.dumps({"model": "fake", "prompt": "\U0001f600 \\ud800"}).encode()  # escaped pair
    assert b"\\ud83d\\ude00" in body
    status, out = _one(tokenizer, BadRequest("POST", "/tokenize", {"Content-Type": "application/json"}, "pair", body))
    assert status == 200, out


# -- integers past what the pipe to the worker carries ----------------------------------------------

INT_FIELDS = ["max_tokens", "max_completion_tokens", "n", "top_k", "seed", "logprobs", "top_logprobs",
              "best_of", "stop_token_ids"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("value", [2**64, 10**30, -(2**63) - 1, 10**4300 - 1])  # 4,300 nines
def test_huge_integers_in_any_field_are_a_400(tokenizer: Any, path: str, value: int) -> None:
    """The random suite's find: "top_k": 99999999999999999999 passed validation, then the
    protocol's encoder raised OverflowError in the front end's send loop: the connection to the
    worker failed and every running request with it (503). And a 4,300-digit max_tokens (the
    most json.loads takes) plus the prompt's length was a number too long to format (500)."""
    for name in INT_FIELDS:
        body = {**base_body(path), name: [value] if name == "stop_token_ids" else value}
        req = BadRequest("POST", path, {"Content-Type": "application/json"}, "huge-int", json.dumps(body).encode())
        status, out = _one(tokenizer, req)
        assert 400 <= status < 500, (name, out)
