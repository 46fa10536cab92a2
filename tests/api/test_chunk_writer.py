"""The streamed chunks' fast encoding: the same bytes as the generic ``json.dumps`` of the object."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from trio_infer.api import sse
from trio_infer.api.plans import Plan
from trio_infer.api.render import ChunkWriter
from trio_infer.runtime.text_stream import ChoiceDelta


def plan(kind: str, include_usage: bool, n: int = 2) -> Plan:
    return Plan(
        kind=kind,  # type: ignore[arg-type]
        id="cmpl-ünï\"\\x",
        created=1700000000,
        model="m/ödel \"q\"",
        prompts=[[1, 2]],
        params=[None] * n,  # type: ignore[list-item]
        stop=[],
        logprobs=None,
        stream=True,
        include_usage=include_usage,
    )


@given(
    kind=st.sampled_from(["chat", "completion"]),
    include_usage=st.booleans(),
    index=st.integers(0, 1),
    text=st.text(),
    finish=st.sampled_from([None, "stop", "length"]),
)
def test_fast_chunks_are_byte_identical_to_the_generic_encoding(kind, include_usage, index, text, finish) -> None:
    writer = ChunkWriter(plan(kind, include_usage), texts=None)  # type: ignore[arg-type]
    delta = ChoiceDelta(index, text, [], finish)
    fast = writer.delta(delta)
    if not text and finish is None:
        assert fast is None
        return
    assert fast == sse.event(writer._delta_object(index, delta))
    obj = json.loads(fast.removeprefix("data: "))
    assert obj["id"] == "cmpl-ünï\"\\x" and obj["choices"][0]["finish_reason"] == finish
    assert ("usage" in obj) == include_usage
