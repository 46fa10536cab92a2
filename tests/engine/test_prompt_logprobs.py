"""Prompt logprobs: computed from the prefill's own rows, exact against transformers, and
correct across chunked prefill, prefix-cache hits, preemption and ``max_tokens=0``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trio_infer.engine.engine import Engine, EngineConfig, RequestOutput
from trio_infer.models.fake import FakeModel, logprob
from trio_infer.models.loader import load_model
from trio_infer.wire import SamplingParams

K = 3
# Compared with an fp32 oracle to 1e-4: the KV cache stays fp32 (fp16 KV has its own tolerance test).
EXACT_KV = "float32"
WANT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
PLAIN = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def hf(tiny_checkpoint: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=g).tolist()


def oracle(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the log-distribution of token i + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def drain(engine: Engine) -> dict[object, list[RequestOutput]]:
    outs: dict[object, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.uid, []).append(o)
    return outs


def check(entries, ids: list[int], want: torch.Tensor, k: int = K) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == ids[i]
        assert abs(e.logprob - float(want[i - 1, ids[i]])) < 1e-4, i
        top = torch.topk(want[i - 1], k)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert all(abs(lp - float(v)) < 1e-4 for (_, lp), v in zip(e.top, top.values))


@pytest.mark.parametrize("max_batched_tokens", [64, 8], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_match_transformers(model, hf, max_batched_tokens: int) -> None:
    ids = prompt(41, seed=5)
    want = oracle(hf, ids)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, max_running=4, kv_cache_dtype=EXACT_KV,
                                        max_batched_tokens=max_batched_tokens))
    engine.add_request("lp", ids, WANT)
    engine.add_request("plain", prompt(30, seed=6), PLAIN)  # shares the steps, asks for none
    outs = drain(engine)
    first, *rest = outs["lp"]
    check(first.prompt_logprobs, ids, want)
    assert first.token_ids == [int(want[-1].argmax())]  # the sampling row is still there
    assert all(o.prompt_logprobs is None for o in rest)
    assert all(o.prompt_logprobs is None for o in outs["plain"])
    assert sum(len(o.token_ids) for o in outs["lp"]) == 4
    assert engine.num_request_pages == 0


def test_a_prefix_cache_hit_does_not_skip_prompt_logprobs(model, hf) -> None:
    ids = prompt(37, seed=7)
    want = oracle(hf, ids)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, max_running=4, kv_cache_dtype=EXACT_KV, max_batched_tokens=16))
    engine.add_request("warm", ids, PLAIN)  # fills the prefix cache with the prompt's pages
    plain_tokens = [t for o in drain(engine)["warm"] for t in o.token_ids]
    hits = engine.scheduler.prefix_hits
    engine.add_request("again", ids, PLAIN)
    drain(engine)
    assert engine.scheduler.prefix_hits > hits  # the cache serves this prompt
    for uid in ("lp1", "lp2"):  # asking for prompt logprobs: computed, cache or not
        engine.add_request(uid, ids, WANT)
        outs = drain(engine)[uid]
        check(outs[0].prompt_logprobs, ids, want)
        assert [t for o in outs for t in o.token_ids] == plain_tokens


def test_max_tokens_zero_prefills_and_samples_nothing(model, hf) -> None:
    ids = prompt(23, seed=8)
    want = oracle(hf, ids)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, max_running=4, kv_cache_dtype=EXACT_KV, max_batched_tokens=8))
    engine.add_request("zero", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    engine.add_request("bare", ids, SamplingParams(max_tokens=0))
    outs = drain(engine)
    [zero] = outs["zero"]
    assert zero.token_ids == [] and zero.finish_reason == "length" and zero.num_output_tokens == 0
    check(zero.prompt_logprobs, ids, want, k=0)
    assert all(e.top == () for e in zero.prompt_logprobs[1:])
    [bare] = outs["bare"]
    assert bare.token_ids == [] and bare.finish_reason == "length" and bare.prompt_logprobs is None
    assert engine.num_request_pages == 0 and engine.num_requests == 0


# -- on the fake model: exact positions under preemption ------------------------------------------


def fake_logprob(model: FakeModel, ids: list[int], i: int) -> float:
    """The fake model's logprob of ``ids[i]``."""
    return logprob(ids[:i], ids[i], model.info.vocab_size, model.eos_token_id)


def test_prompt_logprobs_survive_preemption_mid_prefill() -> None:
    model = FakeModel(vocab_size=97)
    # A pool too small for all three: someone is preempted, in the middle of a chunked prefill.
    engine = Engine(model, EngineConfig(page_size=4, num_pages=14, max_running=3,
                                        max_batched_tokens=8))
    prompts = {i: [(i * 13 + j * 7) % 96 + 1 for j in range(18 + i)] for i in range(3)}
    for i, ids in prompts.items():
        # Make some prompt tokens the model's own prediction, so both logprob values occur.
        for j in range(2, len(ids), 3):
            ids[j] = model.next_token(ids[:j])
        engine.add_request(i, ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  prompt_logprobs=1))
    preempted = 0
    outs: dict = {}
    while engine.has_unfinished():
        plan = engine.schedule()
        if plan is None:
            continue
        preempted += len(plan.schedule.preempted)
        for o in engine.commit(plan, engine.execute(plan)):
            outs.setdefault(o.uid, []).append(o)
    assert preempted
    for i, ids in prompts.items():
        entries = outs[i][0].prompt_logprobs
        assert entries[0] is None and len(entries) == len(ids)
        for j in range(1, len(ids)):
            assert entries[j].token_id == ids[j]
            assert entries[j].logprob == pytest.approx(fake_logprob(model, ids, j), abs=1e-6)
            assert entries[j].top[0][0] == model.next_token(ids[:j])
        assert all(o.prompt_logprobs is None for o in outs[i][1:])
        assert len(outs[i]) == 20
    assert engine.num_request_pages == 0


def test_logits_rows_only_for_those_that_ask() -> None:
    """The lm_head runs on one row per sampling sequence, plus the prompt rows of the requests
    that asked; decodes of such a request add none."""
    engine = Engine(FakeModel(vocab_size=97), EngineConfig(page_size=4, num_pages=64, max_running=4,
                                                           max_batched_tokens=64))
    engine.add_request("plain", list(range(1, 30)), PLAIN)
    plan = engine.schedule()
    assert plan.prompt_rows is None and len(plan.batch.logits_indices) == len(plan.sampling) == 1
    engine.commit(plan, engine.execute(plan))
    engine.add_request("lp", list(range(1, 12)), WANT)
    plan = engine.schedule()  # plain's decode, lp's whole prompt
    assert len(plan.sampling) == 2 and len(plan.prompt_rows.targets) == 10
    assert len(plan.batch.logits_indices) == 12
    engine.commit(plan, engine.execute(plan))
    plan = engine.schedule()  # two decodes
    assert plan.prompt_rows is None and len(plan.batch.logits_indices) == 2
    engine.commit(plan, engine.execute(plan))
    drain(engine)
