"""The engine on a real (tiny, random) checkpoint: exact against transformers, batch invariant."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.models.loader import load_model
from trio_infer.wire import SamplingParams

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path):
    return load_model(tiny_checkpoint)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 90, (n,), generator=g)]
    lengths[:3] = [70, 85, 1]  # longer than the per-step budget below, and a single token
    return [torch.randint(3, 1000, (L,), generator=g).tolist() for L in lengths]


def run(engine: Engine, requests: dict, stagger: int = 0) -> dict[object, list[int]]:
    """Submit ``requests`` (uid -> (prompt, params)), ``stagger`` steps apart; collect tokens."""
    pending = list(requests.items())
    got: dict[object, list[int]] = {uid: [] for uid in requests}
    while pending or engine.has_unfinished():
        for _ in range(1 if stagger else len(pending)):
            if pending:
                uid, (prompt, params) = pending.pop(0)
                engine.add_request(uid, prompt, params)
        for _ in range(max(stagger, 1)):
            for out in engine.step():
                got[out.uid].extend(out.token_ids)
    assert engine.num_request_pages == 0 and engine.num_requests == 0
    return got


def test_greedy_matches_transformers_generate(model, tiny_checkpoint: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    prompt = prompts(1, seed=3)[0][:20]
    ids = hf.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=64, min_new_tokens=64,
        eos_token_id=None, pad_token_id=0,
    )[0, len(prompt):].tolist()
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, max_running=4, max_batched_tokens=8))
    got = run(engine, {0: (prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))})
    assert got[0] == ids


@pytest.mark.parametrize("num_pages", [200, 40], ids=["roomy", "tiny-pool-preempts"])
def test_batch_invariance(model, num_pages: int) -> None:
    """16 prompts of mixed lengths, staggered, give exactly the greedy tokens each gets alone."""
    ps = prompts(16)
    alone = {}
    for i, p in enumerate(ps):
        engine = Engine(model, EngineConfig(page_size=4, num_pages=200, enable_prefix_cache=False))
        alone[i] = run(engine, {i: (p, GREEDY_32)})[i]
    config = EngineConfig(page_size=4, num_pages=num_pages, max_running=8, max_batched_tokens=32)
    engine = Engine(model, config)
    batched = run(engine, {i: (p, GREEDY_32) for i, p in enumerate(ps)}, stagger=2)
    assert batched == alone
    assert len({tuple(v) for v in alone.values()}) > 1


def test_seeded_sampling_reproducible_alone_and_in_a_batch(model) -> None:
    ps = prompts(6, seed=1)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=42, max_tokens=24,
                             ignore_eos=True)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=200))
    alone = run(engine, {"s": (ps[0], sampled)})["s"]
    again = run(Engine(model, EngineConfig(page_size=4, num_pages=200)), {"s": (ps[0], sampled)})["s"]
    others = {i: (p, SamplingParams(temperature=1.0, max_tokens=24)) for i, p in enumerate(ps[1:])}
    batched = run(Engine(model, EngineConfig(page_size=4, num_pages=200)),
                  {"s": (ps[0], sampled), **others}, stagger=1)["s"]
    assert alone == again == batched
    other_seed = msgspec.structs.replace(sampled, seed=7)
    assert run(engine, {"t": (ps[0], other_seed)})["t"] != alone


def test_no_leaks_after_finish_abort_and_preemption(model) -> None:
    """Abort before, during and after prefill, with a pool small enough to preempt."""
    engine = Engine(model, EngineConfig(page_size=4, num_pages=30, max_running=4,
                                        max_batched_tokens=8))
    ps = prompts(8, seed=2)
    for i, p in enumerate(ps):
        engine.add_request(i, p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.abort(7)  # before prefill (still waiting)
    engine.step()
    mid = next(s.uid for s in engine.scheduler.running if 0 < s.num_computed < s.num_prompt_tokens)
    engine.abort(mid)  # during a chunked prefill
    for _ in range(15):
        engine.step()
    decoding = [s.uid for s in engine.scheduler.running if s.num_output_tokens]
    engine.abort(decoding[0])  # after prefill
    while engine.has_unfinished():
        engine.step()
    assert engine.num_request_pages == 0
    assert engine.num_running == engine.num_waiting == 0
    engine.prefix_cache.clear()
    assert engine.pool.num_used == 0
