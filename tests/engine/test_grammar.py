"""Constrained decoding in the engine (engine/grammar.py) on the tiny random checkpoint: masks
only for constrained rows, the unconstrained tokens unchanged by who shares the batch, grammar
state released on every exit and consistent across preemption, compiles cached by source."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from trio_infer.engine import engine as engine_module
from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.engine.grammar import Grammars, TokenMasks, unpack_bitmask
from trio_infer.models.loader import load_model, load_tokenizer
from trio_infer.runtime.loading import build_grammars
from trio_infer.wire import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["id", "tags", "kind"],
    "additionalProperties": False,
}
SOURCE = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path):  # type: ignore[no-untyped-def]
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):  # type: ignore[no-untyped-def]
    return load_tokenizer(tiny_checkpoint)


@pytest.fixture(scope="module")
def grammars(model, tokenizer) -> Grammars:  # type: ignore[no-untyped-def]
    return build_grammars(model, lambda: tokenizer)


def make(model, grammars, **config) -> Engine:  # type: ignore[no-untyped-def]
    return Engine(model, EngineConfig(**{"max_running": 16, "max_batched_tokens": 256, **config}),
                  grammars=grammars)


def run(engine: Engine, requests: dict) -> dict:
    for uid, (prompt, params) in requests.items():
        engine.add_request(uid, prompt, params)
    got: dict = {uid: [] for uid in requests}
    finish: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.uid].extend(out.token_ids)
            if out.finish_reason is not None:
                finish[out.uid] = (out.finish_reason, out.stop_token_id)
    return {uid: (got[uid], finish[uid]) for uid in requests}


def document(tokenizer, tokens: list[int], stop_token: int | None) -> object:  # type: ignore[no-untyped-def]
    if stop_token is not None:
        tokens = tokens[:-1]
    return json.loads(tokenizer.decode(tokens))


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (int(k),), generator=g).tolist() for k in torch.randint(2, 40, (n,), generator=g)]


def test_unconstrained_tokens_do_not_depend_on_constrained_neighbours(model, grammars) -> None:
    plain = {f"u{i}": (p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
             for i, p in enumerate(prompts(6))}
    alone = run(make(model, grammars), plain)
    constrained = {f"c{i}": (p, SamplingParams(temperature=0, max_tokens=60, grammar=SOURCE))
                   for i, p in enumerate(prompts(6))}
    constrained |= {f"s{i}": (p, SamplingParams(temperature=1, seed=i, max_tokens=60, grammar=SOURCE))
                    for i, p in enumerate(prompts(4))}
    mixed = run(make(model, grammars), {**constrained, **plain})
    for uid in plain:
        assert mixed[uid] == alone[uid], uid
    assert any(uid.startswith("c") for uid in mixed)


def test_every_constrained_output_validates(model, grammars, tokenizer) -> None:
    reqs = {i: (p, SamplingParams(temperature=1, seed=i, max_tokens=80, grammar=SOURCE))
            for i, p in enumerate(prompts(12))}
    engine = make(model, grammars)
    for uid, ((tokens, (reason, stop_token))) in run(engine, reqs).items():
        assert reason == "stop", (uid, tokenizer.decode(tokens))
        jsonschema.validate(document(tokenizer, tokens, stop_token), SCHEMA)
    assert engine.num_matchers == 0
    assert grammars.num_cached >= 1


def test_preemption_keeps_the_grammar_state_consistent(model, grammars, tokenizer) -> None:
    """A pool too small for the batch preempts and recomputes sequences mid-document: every
    token is kept, so the matcher (which consumed exactly those tokens) stays valid, and each
    seeded request writes the same document as with room to spare."""
    reqs = {i: (p, SamplingParams(temperature=1, seed=i, max_tokens=80, grammar=SOURCE))
            for i, p in enumerate(prompts(8))}
    roomy = run(make(model, grammars), reqs)
    tight_engine = make(model, grammars, page_size=4, num_pages=40, enable_prefix_cache=False)
    preempted = []
    schedule = tight_engine.scheduler.schedule

    def watch(*args):  # type: ignore[no-untyped-def]
        plan = schedule(*args)
        if plan is not None:
            preempted.extend(seq.uid for seq in plan.preempted)
        return plan

    tight_engine.scheduler.schedule = watch  # type: ignore[method-assign]
    tight = run(tight_engine, reqs)
    assert preempted, "the pool was meant to force preemption"
    assert tight == roomy
    for tokens, (reason, stop_token) in tight.values():
        jsonschema.validate(document(tokenizer, tokens, stop_token), SCHEMA)


def test_grammar_state_is_released_on_abort_and_failed_step(model, grammars) -> None:
    engine = make(model, grammars)
    params = SamplingParams(temperature=0, max_tokens=50, grammar=SOURCE)
    for uid, p in enumerate(prompts(4)):
        engine.add_request(uid, p, params)
    seqs = dict(engine._seqs)
    engine.step()
    assert engine.num_matchers == 4
    engine.abort(0)
    assert seqs[0].matcher is None and engine.num_matchers == 3
    plan = engine.schedule()
    assert plan is not None
    engine.fail(plan)  # what the worker does when a step raises
    assert engine.num_matchers == 0 and all(s.matcher is None for s in seqs.values())


def test_compiles_are_cached_by_source_and_matchers_are_not_shared(model, tokenizer) -> None:
    grammars = build_grammars(model, lambda: tokenizer)
    engine = make(model, grammars)
    engine.add_request("a", [5, 6], SamplingParams(grammar=SOURCE))
    engine.add_request("b", [5, 6], SamplingParams(grammar=SOURCE))
    assert grammars.num_cached == 1
    assert engine._seqs["a"].matcher is not engine._seqs["b"].matcher
    with pytest.raises(ValueError):
        engine.add_request("c", [5], SamplingParams(grammar=llguidance.LLMatcher.grammar_from_lark("start: nope")))
    with pytest.raises(ValueError):
        Engine(model).add_request("d", [5], SamplingParams(grammar=SOURCE))  # no tokenizer: refused


def test_a_complete_grammar_ends_the_sequence_even_with_ignore_eos(model, grammars) -> None:
    source = llguidance.LLMatcher.grammar_from_regex("ab")
    engine = make(model, grammars)
    [(tokens, (reason, _))] = run(engine, {"x": ([7, 8], SamplingParams(temperature=0, max_tokens=20,
                                                                      ignore_eos=True, grammar=source))}).values()
    assert reason == "stop" and len(tokens) <= 3


def test_masks_start_before_the_forward_pass_and_touch_only_constrained_rows(model, grammars, monkeypatch) -> None:
    events: list[str] = []
    start = TokenMasks.start

    def spy_start(g, matchers):  # type: ignore[no-untyped-def]
        masks = start(g, matchers)
        events.append(f"masks {None if masks is None else masks.rows}")
        return masks

    monkeypatch.setattr(engine_module.TokenMasks, "start", staticmethod(spy_start))
    engine = make(model, grammars)
    forward = engine.runner.model.forward
    monkeypatch.setattr(engine.runner.model, "forward", lambda *a: (events.append("forward"), forward(*a))[1])
    engine.add_request("plain", [3, 4, 5], SamplingParams(temperature=0, max_tokens=2))
    engine.add_request("json", [3, 4, 5], SamplingParams(temperature=0, max_tokens=2, grammar=SOURCE))
    engine.step()
    assert events == ["masks [1]", "forward"]
    engine.abort("json")
    engine.step()
    assert events[2:] == ["masks None", "forward"]  # no constrained row: nothing computed


def test_mask_application_leaves_other_rows_alone(grammars) -> None:
    matcher = grammars.matcher(llguidance.LLMatcher.grammar_from_regex("a"))
    masks = TokenMasks.start(grammars, [None, matcher, None])
    assert masks is not None
    logits = np.random.default_rng(0).standard_normal((3, grammars.vocab_size)).astype(np.float32)
    before = logits.copy()
    masks.apply(logits)
    assert masks.bias is not None and masks.bias.dtype == np.float32
    assert np.array_equal(logits[0], before[0]) and np.array_equal(logits[2], before[2])
    allowed = unpack_bitmask(masks.bitmask, grammars.vocab_size)[0]
    assert np.isneginf(logits[1][~allowed]).all() and np.array_equal(logits[1][allowed], before[1][allowed])
    assert 1 <= int(allowed.sum()) < grammars.vocab_size
