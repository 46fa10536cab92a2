"""``/metrics``: every family the server registers is fed. A family that nothing observes (a
histogram with no observation, a counter never above zero, a gauge never set) fails here."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import prometheus_client
import trio
import trio.testing

from trio_infer.metrics import Metrics
from trio_infer.models.fake import expected_next_token

from .helpers import IM_END, StepGate, make_app, parse_sse, running


def copying_prompt(vocab: int, eos: int) -> list[int]:
    """Token ids ``5 6 7 a b c f g a b`` with fillers ``f g`` chosen so that the fake model
    answers ``c`` and then ``f``: once it has given ``c``, prompt lookup matches ``a b c`` and
    guesses ``f``, which the model then gives. The fake model's next token is a hash linear in
    the sequence's tokens (models/fake.py), so every pair of fillers is tried at once (for a few
    ``c``: a given one has a pair about once in 8); the pick is checked with the model's own
    function."""
    a, b = 11, 12
    f, g = np.meshgrid(np.arange(20, vocab), np.arange(20, vocab), indexing="ij")
    for c in range(13, 200):
        head = [5, 6, 7, a, b, c]
        acc = sum(t * (i + 1) for i, t in enumerate(head)) + 7 * f + 8 * g + 9 * a + 10 * b
        first, then = (acc * 31 + 7 * 10) % vocab, ((acc + 11 * c) * 31 + 7 * 11) % vocab
        hits = np.argwhere((first == c) & (then == f) & (f != eos) & (g != eos))
        if len(hits):
            ids = head + [int(f[tuple(hits[0])]), int(g[tuple(hits[0])]), a, b]
            assert expected_next_token(ids, vocab, eos) == c
            assert expected_next_token(ids + [c], vocab, eos) == ids[6]
            return ids
    raise AssertionError("no fillers make the fake model copy")


async def test_every_registered_family_is_observed(tokenizer, monkeypatch, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    set_gauges: set[str] = set()
    for method in ("set", "inc", "dec"):
        real = getattr(prometheus_client.Gauge, method)

        def spy(self: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            set_gauges.add(self._name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(prometheus_client.Gauge, method, spy)

    app = make_app(tokenizer, max_waiting=2, max_waiting_tokens=40, max_queue_time_s=5,
                   responses_store_max_count=1)
    metrics: Metrics = app.extensions["trio_infer"].metrics
    # Two prompts that share their first pages (prefix-cache hits), streamed and not, several
    # tokens each (inter-token latency), ending by length and by a stop string.
    shared = "The quick brown fox jumps over the lazy dog, " * 4
    async with running(app) as client:
        for i, stream in enumerate((False, True)):
            body = {"model": "fake", "prompt": shared + str(i), "max_tokens": 5, "stream": stream}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200
            if stream:
                assert parse_sse(await r.get_data(as_text=True))[-1] == "[DONE]"
        # A greedy prompt whose answer starts by copying it: speculative decoding (on by
        # default) proposes and has a guess accepted.
        ids = copying_prompt(len(tokenizer), tokenizer.convert_tokens_to_ids(IM_END))
        body = {"model": "fake", "prompt": ids, "max_tokens": 3, "temperature": 0}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200
        # The response store: two stored responses, one evicted by the count bound.
        for text in ("one", "two"):
            r = await client.post("/v1/responses", json={"model": "fake", "input": text,
                                                         "max_output_tokens": 1})
            assert r.status_code == 200
        # Overload, with the engine held: a deadline, then each refusal (queue time; a full queue
        # in sequences, then in tokens).
        gate = StepGate(app)
        gate.hold()
        r = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "timeout": 1})
        assert r.status_code == 504
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/completions", json={"model": "fake", "prompt": "b"}))
            await trio.testing.wait_all_tasks_blocked()
            r = await client.post("/v1/completions", json={"model": "fake", "prompt": "c", "n": 2})
            assert r.status_code == 429
            r = await client.post("/v1/completions", json={"model": "fake", "prompt": "d" * 60})
            assert r.status_code == 429
        assert metrics.refusals() == {"queue_full": 1, "queue_tokens": 1, "queue_time": 1}
        # The watchdog: a request scheduled (one step, so the queue-time limit is behind it), then
        # no step past the stall bound, then past the restart bound (the in-process worker is
        # dropped, not restarted).
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/completions",
                                       json={"model": "fake", "prompt": "e", "max_tokens": 50}))
            await trio.testing.wait_all_tasks_blocked()
            gate.allow(1)
            await trio.sleep(11)
            assert (await client.get("/health")).status_code == 503
            assert b"trio_infer_worker_last_step_age_seconds" in await (await client.get("/metrics")).get_data()
            await trio.sleep(60)

    unobserved = []
    for family in metrics.registry.collect():
        samples = family.samples
        if family.type == "counter":
            fed = sum(s.value for s in samples if s.name.endswith("_total")) > 0
        elif family.type == "histogram":
            fed = sum(s.value for s in samples if s.name.endswith("_count")) > 0
        elif family.type == "gauge":
            fed = family.name in set_gauges
        else:
            raise AssertionError(f"a {family.type} family the test does not know: {family.name}")
        if not fed:
            unobserved.append(family.name)
    assert unobserved == [], f"registered but never observed: {unobserved}"
