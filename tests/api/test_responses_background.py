"""Background responses in process (the fake model, the engine's steps let through one at a
time, the autojump clock): whatever is drawn (how many, how long, a cancel or a delete after some
steps, a stream resumed from some event), each ends exactly once, the store keeps that end, the
events are whole, and nothing is left in the engine. The official client's view is in
test_responses_stateful.py."""

from __future__ import annotations

import json
from typing import Any

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from .helpers import StepGate, all_zero, counts, make_app, running, state

TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


def _seqs(text: str) -> list[tuple[int, str]]:
    out = []
    for block in filter(None, text.strip().split("\n\n")):
        data = json.loads(block.split("data: ", 1)[1])
        out.append((data["sequence_number"], data["type"]))
    return out


@st.composite
def plans(draw: Any) -> list[dict[str, Any]]:
    n = draw(st.integers(1, 4))
    return [{"tokens": draw(st.integers(1, 12)),
             "action": draw(st.sampled_from([None, "cancel", "delete", "resume"])),
             "at": draw(st.integers(0, 14))} for _ in range(n)]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(drawn=plans())
def test_background_responses_end_once_and_leave_nothing(tokenizer: Any, drawn: list[dict[str, Any]]) -> None:
    async def scenario() -> None:
        app = make_app(tokenizer)
        async with running(app) as client:
            gate = StepGate(app)
            gate.hold()
            ids = []
            for d in drawn:
                r = await client.post("/v1/responses", json={
                    "model": "fake", "input": "hi", "background": True, "temperature": 0,
                    "max_output_tokens": d["tokens"]})
                said = await r.get_json()
                assert r.status_code == 200 and said["status"] == "queued", said
                ids.append(said["id"])
            acted: dict[int, str] = {}
            for step in range(16):
                for i, d in enumerate(drawn):
                    if d["at"] != step or d["action"] is None:
                        continue
                    rid = ids[i]
                    if d["action"] == "cancel":
                        r = await client.post(f"/v1/responses/{rid}/cancel")
                        acted[i] = (await r.get_json())["status"]
                    elif d["action"] == "delete":
                        r = await client.delete(f"/v1/responses/{rid}")
                        assert r.status_code == 200
                        acted[i] = "deleted"
                gate.allow(1)
                await trio.testing.wait_all_tasks_blocked()
            gate.allow()
            with trio.fail_after(60):
                for rid in ids:
                    run = state(app).background.get(rid)
                    if run is not None:
                        await run.done.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert state(app).background.running == 0
            assert all_zero(app), counts(app)
            for i, (d, rid) in enumerate(zip(drawn, ids)):
                r = await client.get(f"/v1/responses/{rid}")
                if acted.get(i) == "deleted":
                    assert r.status_code == 404
                    continue
                final = await r.get_json()
                run = state(app).background.get(rid)
                assert run is not None and run.done.is_set()
                events = _seqs("".join(run.events))
                assert [s for s, _ in events] == list(range(len(events)))
                ends = [kind for _, kind in events if kind in TERMINAL]
                if run.status == "cancelled":
                    assert acted.get(i) == "cancelled" and final["status"] == "cancelled" and ends == []
                else:
                    assert len(ends) == 1 and final["status"] == ends[0].split(".")[1]
                    assert final["usage"]["output_tokens"] <= d["tokens"]
                if d["action"] == "resume":
                    after = d["at"] % max(1, len(events))
                    r = await client.get(f"/v1/responses/{rid}?stream=true&starting_after={after}")
                    resumed = _seqs(await r.get_data(as_text=True)) if after + 1 < len(events) else []
                    assert [s for s, _ in resumed] == list(range(after + 1, len(events)))

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
