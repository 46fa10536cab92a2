"""``stream_interval``: fewer, larger chunks; the same content as streaming every token."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from .helpers import all_zero, chat_body, make_app, parse_sse, running


async def stream_events(tokenizer: Any, interval: int, path: str, body: dict[str, Any]) -> list[Any]:
    app = make_app(tokenizer, stream_interval=interval)
    async with running(app) as client:
        with trio.fail_after(60):
            r = await client.post(path, json=body)
            assert r.status_code == 200
            events = parse_sse(await r.get_data(as_text=True))
        assert all_zero(app)
    assert events[-1] == "[DONE]"
    return events[:-1]


def per_choice(events: list[Any], field: str) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for e in events:
        for c in e["choices"]:
            out.setdefault(c["index"], []).append(c)
    return out


COMPLETION = {"model": "fake", "prompt": "the harbour town", "max_tokens": 11, "temperature": 0,
              "n": 2, "seed": 7, "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("interval", [2, 3, 4, 20])
async def test_chunks_carry_interval_tokens_and_the_same_content(tokenizer, autojump_clock, interval) -> None:
    base = await stream_events(tokenizer, 1, "/v1/completions", COMPLETION)
    got = await stream_events(tokenizer, interval, "/v1/completions", COMPLETION)
    assert got[-1]["usage"] == base[-1]["usage"]  # the usage chunk
    want_choices, got_choices = per_choice(base[:-1], "text"), per_choice(got[:-1], "text")
    assert sorted(got_choices) == sorted(want_choices) == [0, 1]
    for index, chunks in got_choices.items():
        want = want_choices[index]
        assert "".join(c["text"] for c in chunks) == "".join(c["text"] for c in want)
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert sum((c["logprobs"][key] for c in chunks), []) == sum((c["logprobs"][key] for c in want), [])
        assert chunks[-1]["finish_reason"] == want[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in chunks[:-1])
        sizes = [len(c["logprobs"]["tokens"]) for c in chunks]
        # The first read goes out at once (time to first token); then >= interval per chunk,
        # but the last (the choice's end).
        assert all(s >= interval for s in sizes[1:-1]), sizes
        assert len(chunks) <= 2 + (11 - 1) // interval


async def test_chat_content_is_the_same_with_an_interval(tokenizer, autojump_clock) -> None:
    body = chat_body("hi there", max_tokens=9, temperature=0, n=2, stream=True)
    base = await stream_events(tokenizer, 1, "/v1/chat/completions", body)
    got = await stream_events(tokenizer, 4, "/v1/chat/completions", body)
    want_choices, got_choices = per_choice(base, "delta"), per_choice(got, "delta")
    for index in (0, 1):
        text = lambda cs: "".join(c["delta"].get("content", "") for c in cs)  # noqa: E731
        assert text(got_choices[index]) == text(want_choices[index])
        assert got_choices[index][0]["delta"] == {"role": "assistant", "content": ""}
        assert got_choices[index][-1]["finish_reason"] == want_choices[index][-1]["finish_reason"]
    assert len(got) < len(base)


def test_stream_interval_is_a_serve_flag() -> None:
    from trio_infer.__main__ import build_parser

    args = build_parser().parse_args(["serve", "--stream-interval", "4"])
    assert args.stream_interval == "4"
