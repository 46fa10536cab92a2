"""Speculative decoding (engine/speculative.py) by prompt lookup and with a draft model
(engine/draft.py): the proposals, the greedy and sampled verification, and the engine around
them (opt-out, off-switch, stops, pages and draft pages, counters, settings)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from trio_infer_kernels import cpu
from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.engine.proposer import COOLDOWN_STEPS
from trio_infer.engine.sampler import probabilities
from trio_infer.engine.speculative import (LONG_MATCH, Drafts, Payoff, PromptLookup,
                                           verify)
from trio_infer.models.base import ModelInfo
from trio_infer.models.default_model import default_cache_dir, default_model_file
from trio_infer.models.loader import load_model
from trio_infer.wire import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Without the payoff measurement, which depends on timings: these tests are deterministic.
SPEC = dict(speculative="ngram", speculative_tokens=4, speculative_max_batch=8,
            speculative_payoff=False)


def run(engine: Engine, requests: dict, stagger: int = 0) -> dict[object, list[int]]:
    """Submit ``requests`` (uid -> (prompt, params)), ``stagger`` steps apart; collect tokens.
    Every step's outputs carry at most one output per uid."""
    pending = list(requests.items())
    got: dict[object, list[int]] = {uid: [] for uid in requests}
    while pending or engine.has_unfinished():
        for _ in range(1 if stagger else len(pending)):
            if pending:
                uid, (prompt, params) = pending.pop(0)
                engine.add_request(uid, prompt, params)
        for _ in range(max(stagger, 1)):
            outs = engine.step()
            assert len({o.uid for o in outs}) == len(outs)
            for out in outs:
                got[out.uid].extend(out.token_ids)
    assert engine.num_request_pages == 0 and engine.num_requests == 0
    assert engine.num_draft_pages == 0 == engine.statistics().draft_pages_used
    return got


# -- prompt lookup --------------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_match_longest_first() -> None:
    lookup = PromptLookup(max_ngram=3, num_tokens=5, min_acceptance=0.0)
    # "7 8 9" occurs twice; the latest occurrence is followed by 50 51; "8 9" alone by 60.
    # Both agree with the suffix for 3 tokens only (a short match: at most k - 1 = 4 tokens).
    ids = [7, 8, 9, 1, 2, 3, 4, 5, 7, 8, 9, 50, 51, 8, 9, 60, 7, 8, 9]
    assert lookup.propose(ids, limit=10) == [50, 51, 8, 9]
    assert lookup.propose(ids, limit=2) == [50, 51]
    assert lookup.propose([*ids, 99], limit=4) == []  # 99 never occurred before
    # Indexed incrementally: a suffix that only now has an earlier occurrence is found.
    assert lookup.propose([*ids, 99, 7, 8, 9, 99], limit=4) == [7, 8, 9, 99][:4]


def test_lookup_copies_after_the_occurrence_that_agrees_longest() -> None:
    """Of the occurrences of the matching n-gram, the one whose agreement with the suffix reaches
    furthest back, even if it is not the latest; a short match drafts k - 1 tokens at most."""
    passage = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    ids = [*passage, 99, 14, 15, 77, 13, 14, 15]  # "14 15" latest after 99; "13 14 15" in passage
    lookup = PromptLookup(max_ngram=2, num_tokens=4, min_acceptance=0.0, min_ngram=2)
    assert lookup.propose(ids, limit=9) == [16, 17, 18]  # agreement 3 < LONG_MATCH: k - 1
    ids = [*passage, 99, 14, 15, 77, 99, 14, 15]
    assert lookup.propose(ids, limit=9) == [77, 99, 14]  # the latest agrees for 3: it wins


def test_a_long_match_drafts_k_and_a_short_one_adapts_below_k() -> None:
    passage = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    copying = [*passage, 99, 14, 15, 77, *passage[:LONG_MATCH]]  # agrees for LONG_MATCH tokens
    lookup = PromptLookup(max_ngram=2, num_tokens=4, min_acceptance=0.0, min_ngram=2)
    assert lookup.propose(copying, limit=9) == passage[LONG_MATCH : LONG_MATCH + 4]
    assert lookup.propose(copying, limit=2) == passage[LONG_MATCH : LONG_MATCH + 2]
    lookup.record(proposed=4, accepted=0)  # the short matches' length: 3 -> 2
    assert lookup.propose(copying, limit=9) == passage[LONG_MATCH : LONG_MATCH + 4]
    short = [*passage, 99, 14, 15, 77, 13, 14, 15]
    assert lookup.propose(short, limit=9) == [16, 17]


def test_lookup_never_matches_the_suffix_itself() -> None:
    lookup = PromptLookup(max_ngram=2, num_tokens=4, min_acceptance=0.0)
    assert lookup.propose([1, 2, 3], limit=4) == []
    assert lookup.propose([5], limit=4) == []


def test_low_acceptance_pauses_proposals_then_retries() -> None:
    lookup = PromptLookup(max_ngram=1, num_tokens=1, min_acceptance=0.5)
    ids = [1, 2, 1]
    assert lookup.propose(ids, limit=2) == [2]
    lookup.record(proposed=1, accepted=0)  # 1.0 -> 0.7
    assert lookup.propose(ids, limit=2) == [2]
    lookup.record(proposed=1, accepted=0)  # 0.7 -> 0.49 < 0.5: off
    for _ in range(COOLDOWN_STEPS):
        assert lookup.propose(ids, limit=2) == []
    assert lookup.propose(ids, limit=2) == [2]


def test_a_long_match_drafts_while_low_acceptance_holds_short_ones_off() -> None:
    """The acceptance off-switch stops guesses from short matches; a copy in progress (a long
    match) still drafts, and counts the cooldown down."""
    passage = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    lookup = PromptLookup(max_ngram=2, num_tokens=4, min_acceptance=0.5, min_ngram=2)
    short = [*passage, 99, 14, 15, 77, 13, 14, 15]
    assert lookup.propose(short, limit=9) == [16, 17, 18]
    lookup.record(proposed=3, accepted=0)  # 1.0 -> 0.7
    lookup.record(proposed=3, accepted=0)  # 0.7 -> 0.49 < 0.5: off
    assert lookup.propose(short, limit=9) == []
    copying = [*passage, 99, 14, 15, 77, *passage[:LONG_MATCH]]
    assert lookup.propose(copying, limit=9) == passage[LONG_MATCH : LONG_MATCH + 4]
    for _ in range(COOLDOWN_STEPS - 2):  # the two calls above counted two of its steps
        assert lookup.propose(short, limit=9) == []
    assert lookup.propose(short, limit=9) != []


def test_draft_length_grows_after_kept_drafts_and_shrinks_after_cut_ones() -> None:
    """A short match's draft adapts within 1..k - 1 (k is for long matches: the test above)."""
    lookup = PromptLookup(max_ngram=2, num_tokens=4, min_acceptance=0.0, min_ngram=2)
    ids = [5, 6, 7, 8, 9, 10, 5, 6]
    assert lookup.propose(ids, limit=9) == [7, 8, 9]
    lookup.record(proposed=3, accepted=1)
    assert lookup.propose(ids, limit=9) == [7, 8]
    lookup.record(proposed=2, accepted=0)
    assert lookup.propose(ids, limit=9) == [7]
    lookup.record(proposed=1, accepted=0)
    assert lookup.propose(ids, limit=9) == [7]  # never below one
    lookup.record(proposed=1, accepted=1)
    assert lookup.propose(ids, limit=9) == [7, 8]
    lookup.record(proposed=2, accepted=2)
    lookup.record(proposed=3, accepted=3)
    assert lookup.propose(ids, limit=9) == [7, 8, 9]  # never k on a short match
    fresh = PromptLookup(max_ngram=2, num_tokens=3, min_acceptance=0.0, min_ngram=2)
    assert fresh.propose([6, 7, 9, 6], limit=9) == []  # "6" occurred, but one token is too short


def test_payoff_pauses_drafting_when_it_emits_tokens_slower() -> None:
    payoff = Payoff(min_samples=4, pause=3)
    for _ in range(4):
        payoff.record(batch=1, seconds=0.010, tokens=1, drafted=False)  # 10 ms a token
    for _ in range(3):
        payoff.record(batch=1, seconds=0.030, tokens=2, drafted=True)  # 15 ms a token
        assert payoff.allows()  # not enough drafting steps yet
    payoff.record(batch=1, seconds=0.030, tokens=2, drafted=True)
    assert [payoff.allows() for _ in range(4)] == [False, False, False, True]
    assert payoff.pauses == 1
    # faster drafting (or another batch size, measured apart) never pauses
    for _ in range(8):
        payoff.record(batch=1, seconds=0.015, tokens=3, drafted=True)
        payoff.record(batch=2, seconds=0.020, tokens=1, drafted=False)
        payoff.record(batch=2, seconds=0.030, tokens=2, drafted=True)
        assert payoff.allows()
    assert payoff.pauses == 1 and payoff.probes == 0


def test_payoff_compares_the_rate_of_tokens_not_the_average_step() -> None:
    """Verify steps that keep nothing (1 token, 8 ms) and steps that keep four (5 tokens, 10 ms)
    emit 6 tokens in 18 ms: 3 ms a token, faster than plain steps' 5 ms, though the average of
    each step's ms per token (5 ms) is not."""
    payoff = Payoff(min_samples=4, pause=3, weight=0.5)
    for _ in range(4):
        payoff.record(batch=1, seconds=0.005, tokens=1, drafted=False)
    for i in range(16):
        if i % 2:
            payoff.record(batch=1, seconds=0.010, tokens=5, drafted=True)
        else:
            payoff.record(batch=1, seconds=0.008, tokens=1, drafted=True)
        assert payoff.allows()
    assert payoff.pauses == 0


def test_payoff_pauses_drafting_to_measure_plain_steps_it_never_saw() -> None:
    """A draft model drafts at every step: after min_samples drafting steps with no plain one,
    drafting pauses for min_samples steps, the plain ones are measured, and the verdict follows."""
    payoff = Payoff(min_samples=4, pause=6)
    for _ in range(3):
        payoff.record(batch=1, seconds=0.030, tokens=2, drafted=True)  # 15 ms a token
        assert payoff.allows()
    payoff.record(batch=1, seconds=0.030, tokens=2, drafted=True)
    assert payoff.probes == 1
    for _ in range(4):
        assert not payoff.allows()
        payoff.record(batch=1, seconds=0.010, tokens=1, drafted=False)  # 10 ms a token
    assert payoff.allows()
    payoff.record(batch=1, seconds=0.030, tokens=2, drafted=True)  # slower: the verdict
    assert payoff.pauses == 1 and payoff.probes == 1
    assert [payoff.allows() for _ in range(7)] == [False] * 6 + [True]


def test_engine_with_the_payoff_measurement_gives_the_same_tokens() -> None:
    prompt = list(range(1, 40)) + [10]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(Successor(), EngineConfig(page_size=4, num_pages=64, speculative="ngram"))
    assert run(engine, {"a": (prompt, params)})["a"] == [(10 + i) % 64 for i in range(1, 13)]
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        EngineConfig(speculative="ngram", speculative_ngram=2, speculative_ngram_min=3)


# -- verification ---------------------------------------------------------------------------------


def test_greedy_verification_keeps_the_agreeing_prefix_and_corrects() -> None:
    vocab = 6
    seq = type("S", (), {"params": SamplingParams(temperature=0), "generator": None})()
    best = [3, 4, 1, 5]  # the argmax of each row: row j is after draft[:j]
    logits = np.zeros((4, vocab), dtype=np.float32)
    logits[np.arange(4), best] = 1.0
    drafts = Drafts([seq], [(3, 4, 2)], [0], [])
    assert verify(logits, drafts, np.random.default_rng()) == [[3, 4, 1]]  # kept 3, 4; row 2 says 1
    drafts = Drafts([seq], [(3, 4, 1)], [0], [])
    assert verify(logits, drafts, np.random.default_rng()) == [[3, 4, 1, 5]]  # all kept, and the bonus


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_rejection_sampling_keeps_the_distribution_at_temperature_1() -> None:
    """Draft (2, 5) against fixed rows p0, p1, p2 over 8 tokens: the first token is distributed as
    p0 and, when it is the draft's, the second as p1; tokens outside a top-k never appear."""
    rng = np.random.default_rng(0)
    vocab, n = 8, 6000
    logits = (rng.standard_normal((3, vocab)) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    p = probabilities(logits, params)
    seq = type("S", (), {"params": params, "generator": None})()
    tiled = np.tile(logits, (n, 1))
    drafts = Drafts([seq] * n, [(2, 5)] * n, list(range(0, 3 * n, 3)), [])
    outs = verify(tiled, drafts, rng)
    assert np.array_equal(tiled, np.tile(logits, (n, 1)))  # verify leaves the logits alone
    first = [0] * vocab
    second = [0] * vocab
    for toks in outs:
        first[toks[0]] += 1
        if toks[0] == 2:
            second[toks[1]] += 1
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001.
    assert _chi_square(first, p[0].tolist()) < 24.3, first
    assert _chi_square(second, p[1].tolist()) < 24.3, second
    assert sum(second) > 300  # the conditional had samples enough to mean something

    top2 = SamplingParams(temperature=1.0, top_k=2)
    q = probabilities(logits, top2)
    assert int((q > 0).sum(axis=-1).max()) == 2
    assert np.allclose(q.sum(axis=-1), 1.0)
    seq2 = type("S", (), {"params": top2, "generator": None})()
    outs = verify(np.tile(logits, (200, 1)), Drafts([seq2] * 200, [(2, 5)] * 200,
                                                   list(range(0, 600, 3)), []), rng)
    allowed = [set(np.flatnonzero(q[j]).tolist()) for j in range(3)]
    for toks in outs:
        for j, t in enumerate(toks):
            assert t in allowed[j]


# -- the engine on a model whose next token is known: drafts are always right ----------------------


class Successor:
    """Next token = (input token + 1) % vocab: an ascending prompt makes prompt lookup exact.
    The model stores each token in the KV cache and reads it back through the page table, so a
    row that reads the wrong slot gives a wrong token."""

    def __init__(self, vocab: int = 64) -> None:
        self.info = ModelInfo(name="successor", architecture="Successor", num_layers=1,
                              num_kv_heads=1, head_dim=1, vocab_size=vocab, max_model_len=4096,
                              dtype="float64", eos_token_ids=(0,))
        self.rows_per_step: list[int] = []
        # Stepped inline on the event loop: exact under the autojump clock, which would otherwise
        # run ahead (to the watchdog's bounds) while a worker thread computed in real time.
        self.instant = True

    def forward(self, batch: ForwardBatch, k_caches, v_caches) -> np.ndarray:
        flat = k_caches[0].reshape(-1)  # a view: the pool is contiguous
        flat[batch.slot_mapping] = batch.input_ids
        rows = batch.logits_indices
        page_size = k_caches[0].shape[1]
        seq_of_row = np.searchsorted(batch.query_start_loc, rows, side="right") - 1
        pos = batch.positions[rows]
        slots = batch.page_table[seq_of_row, pos // page_size] * page_size + pos % page_size
        last = flat[slots].astype(np.int64)
        self.rows_per_step.append(len(rows))
        logits = np.zeros((len(rows), self.info.vocab_size), dtype=np.float32)
        logits[np.arange(len(rows)), (last + 1) % self.info.vocab_size] = 1.0
        return logits


def test_a_step_emits_several_tokens_and_stops_exactly() -> None:
    model = Successor()
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, **SPEC))
    prompt = list(range(1, 40)) + [10]  # "10" occurred: propose 11 12 13 14
    want = [(10 + i) % 64 for i in range(1, 21)]
    got = run(engine, {"a": (prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))})
    assert got["a"] == want
    stats = engine.statistics()
    assert stats.spec_accepted == stats.spec_proposed > 0
    assert stats.sample_steps < 10 and stats.sampled_tokens == 20
    # max_tokens cuts a step's tokens: never more than asked
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, **SPEC))
    got = run(engine, {"b": (prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))})
    assert got["b"] == want[:3]
    # a stop token among the kept drafts ends the output there, with the stop token last
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, **SPEC))
    engine.add_request("c", prompt, SamplingParams(temperature=0, max_tokens=20,
                                                   stop_token_ids=(14,), ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == [11, 12, 13, 14]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == 14
    assert engine.num_request_pages == 0


def test_opt_out_and_batch_off_switch() -> None:
    model = Successor()
    prompt = list(range(1, 40)) + [10]
    opted_out = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculative=False)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, **SPEC))
    assert run(engine, {"a": (prompt, opted_out)})["a"] == [(10 + i) % 64 for i in range(1, 13)]
    assert engine.statistics().spec_proposed == 0
    # three running sequences with speculative_max_batch=2: nobody proposes
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, speculative="ngram",
                                        speculative_max_batch=2))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    run(engine, {i: (prompt, params) for i in range(3)})
    assert engine.statistics().spec_proposed == 0
    # on by default (prompt lookup), and off when asked
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64))
    assert run(engine, {"a": (prompt, params)})["a"] == [(10 + i) % 64 for i in range(1, 13)]
    assert engine.statistics().spec_accepted > 0
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, speculative="off"))
    run(engine, {"a": (prompt, params)})
    assert engine.statistics().spec_proposed == 0


def test_requests_that_cannot_speculate_decode_one_token_a_step() -> None:
    engine = Engine(Successor(), EngineConfig(page_size=4, num_pages=64, **SPEC))
    prompt = list(range(1, 40)) + [10]
    for params in (SamplingParams(temperature=0, max_tokens=6, logprobs=1),
                   SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.2),
                   SamplingParams(temperature=1.0, max_tokens=6, seed=3),
                   SamplingParams(temperature=0, max_tokens=6, min_tokens=2)):
        run(engine, {"x": (prompt, params)})
    assert engine.statistics().spec_proposed == 0


def test_drafts_never_preempt_and_pages_come_back() -> None:
    """A pool one sequence fills: drafts take only free pages, preemption still makes progress,
    and every page comes back."""
    model = Successor()
    prompt = list(range(1, 30)) + [5]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=16, max_running=3,
                                        max_batched_tokens=16, **SPEC))
    got = run(engine, {i: (prompt, params) for i in range(3)}, stagger=1)
    assert all(v == [(5 + i) % 64 for i in range(1, 31)] for v in got.values())
    assert engine.statistics().spec_accepted > 0


# -- greedy exactness on real checkpoints ---------------------------------------------------------


def _grounded_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat their own spans (as a rewrite of a passage does), so lookups hit."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        passage = torch.randint(3, 1000, (int(torch.randint(8, 30, (1,), generator=g)),),
                                generator=g).tolist()
        out.append(passage + passage[: len(passage) // 2])
    return out


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_ids_identical_with_and_without_speculation(tiny_checkpoint_factory, arch) -> None:
    """Alone, batched with preemption in a tiny pool, and after a prefix-cache hit: the same ids
    with speculation as without, on each family."""
    model = load_model(tiny_checkpoint_factory(arch))
    ps = _grounded_prompts(6, seed=1)
    reqs = {i: (p, GREEDY) for i, p in enumerate(ps)}
    base = EngineConfig(page_size=4, num_pages=200, max_running=8, max_batched_tokens=32)
    plain = run(Engine(model, base), reqs)
    spec_engine = Engine(model, EngineConfig(page_size=4, num_pages=200, max_running=8,
                                             max_batched_tokens=32, **SPEC))
    assert run(spec_engine, reqs) == plain
    stats = spec_engine.statistics()
    assert stats.spec_proposed > 0 and stats.spec_accepted > 0, stats
    # again on the same engine: every prompt now starts from the prefix cache
    hits = stats.prefix_hits
    assert run(spec_engine, reqs) == plain
    assert spec_engine.statistics().prefix_hits > hits
    # a pool too small for all of them: preemptions, recomputation, drafts on recomputed KV
    tiny = Engine(model, EngineConfig(page_size=4, num_pages=24, max_running=6,
                                      max_batched_tokens=16, **SPEC))
    assert run(tiny, reqs, stagger=1) == plain


DEFAULT_GGUF = default_model_file(default_cache_dir())


@pytest.fixture(scope="module")
def default_model():
    """SmolLM2-135M Q4_1, loaded once for this module's tests (seconds per load)."""
    if not DEFAULT_GGUF.exists():
        pytest.skip("the default model is not fetched")
    return load_model(DEFAULT_GGUF)


def test_greedy_ids_identical_on_the_default_model(default_model) -> None:
    """SmolLM2-135M Q4_1 on the CPU kernels: the verify rows go through the one-call decode step
    with more rows than a plain decode (another matmul kernel past one row)."""
    model = default_model
    passage = list(range(1000, 1060))
    prompt = passage + passage[:20]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = run(Engine(model, EngineConfig()), {0: (prompt, params)})
    engine = Engine(model, EngineConfig(**SPEC))
    assert run(engine, {0: (prompt, params)}) == plain
    assert engine.statistics().spec_accepted > 0


def test_exact_verify_rows_are_bitwise_the_one_token_steps_on_the_default_model(default_model
                                                                             ) -> None:
    """Why greedy ids with speculation are the plain ones, bitwise rather than up to near-ties:
    with ``activations=exact`` a verify step of up to 5 rows (``speculative_tokens`` up to 4 at
    batch 1) gives each row the logits that decoding its token alone gives, to the bit, because
    every linear of the step takes the few-rows kernel, which sums each row as the one-row
    kernel does (kernels/cpu_kernels.c, ``dot_rows``)."""
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    model = default_model
    rows = cpu.require().few_rows_exact() - 1
    assert rows >= SPEC["speculative_tokens"] + 1
    info = model.info
    page_size, pages, start = 16, 8, 60
    g = np.random.default_rng(3)
    shape = (pages, page_size, info.num_kv_heads, info.head_dim)
    k = [g.standard_normal(shape, dtype=np.float32) for _ in range(info.num_layers)]
    v = [g.standard_normal(shape, dtype=np.float32) for _ in range(info.num_layers)]
    table = g.permutation(pages).astype(np.int64)
    ids = g.integers(0, info.vocab_size, rows, dtype=np.int64)
    pos = start + np.arange(rows, dtype=np.int64)
    slots = table[pos // page_size] * page_size + pos % page_size

    def step(sel: list[int], k_cache: list[np.ndarray], v_cache: list[np.ndarray]) -> np.ndarray:
        n = len(sel)
        batch = ForwardBatch(
            input_ids=ids[sel], positions=pos[sel], slot_mapping=slots[sel],
            page_table=np.ascontiguousarray(np.broadcast_to(table, (n, pages))),
            seq_lens=pos[sel] + 1, query_start_loc=np.arange(n + 1), num_decodes=n,
            logits_indices=np.arange(n), max_query_len=1, max_seq_len=int(pos[sel].max()) + 1)
        return np.asarray(model.forward(batch, k_cache, v_cache))

    verify_rows = step(list(range(rows)), [c.copy() for c in k], [c.copy() for c in v])
    k1, v1 = [c.copy() for c in k], [c.copy() for c in v]
    one_at_a_time = np.concatenate([step([i], k1, v1) for i in range(rows)])
    assert np.array_equal(verify_rows, one_at_a_time)


def test_sampled_speculation_runs_to_the_end_with_its_pages_back(tiny_checkpoint) -> None:
    model = load_model(tiny_checkpoint)
    ps = _grounded_prompts(4, seed=2)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, **SPEC))
    got = run(engine, {i: (p, params) for i, p in enumerate(ps)})
    assert all(len(v) == 24 for v in got.values())
    assert engine.statistics().sampled_tokens == 96


def test_chi_square_bound_is_meaningful() -> None:
    """The bound above rejects a wrong distribution: the draft's token forced every time."""
    counts = [0, 0, 6000, 0, 0, 0, 0, 0]
    assert _chi_square(counts, [1 / 8] * 8) > 24.3
    assert math.isfinite(_chi_square([750] * 8, [1 / 8] * 8))


async def test_front_end_takes_multi_token_outputs_within_credits(autojump_clock) -> None:
    """Through the runtime with one credit per choice and a slow reader: every token arrives, in
    fewer outputs than tokens, and /metrics' speculative families are fed."""
    import trio

    from trio_infer.metrics import Metrics
    from trio_infer.runtime.client import open_engine
    from trio_infer.runtime.in_process import in_process
    from trio_infer.settings import Settings

    engine = Engine(Successor(), EngineConfig(page_size=4, num_pages=64, **SPEC))
    prompt = list(range(1, 40)) + [10]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    metrics = Metrics(speculative=True)
    settings = Settings(channel_capacity=1, stall_timeout_s=60.0, speculative="ngram")
    async with open_engine(settings, in_process(engine), metrics=metrics) as ae:
        outs = []
        async with ae.generate(prompt, [params, params]) as stream:
            async for batch in stream:
                outs.extend(batch)
                await trio.sleep(1)  # a slow reader (autojump clock): credits run out
        for choice in (0, 1):
            mine = [o for o in outs if o.uid[1] == choice]
            assert [t for o in mine for t in o.token_ids] == [(10 + i) % 64 for i in range(1, 21)]
            assert len(mine) < 20
            assert mine[-1].finish_reason == "length"
    assert metrics.spec_proposed_total is not None and metrics.spec_accepted_total is not None
    assert metrics.spec_accepted_total._value.get() > 0
    assert metrics.spec_proposed_total._value.get() >= metrics.spec_accepted_total._value.get()
    assert metrics.tokens_per_step is not None and metrics.tokens_per_step._value.get() > 1
    assert b"trio_infer_spec_decode_accepted_tokens_total" in metrics.render()
    assert b"spec_decode" not in Metrics().render()  # a server that does not speculate


@pytest.mark.parametrize("value, want", [(None, True), (True, True), (False, False)])
def test_request_field_speculative_is_honoured(value, want) -> None:
    from trio_infer.api.plans import ModelLimits, plan_completion
    from trio_infer.api.protocol import CompletionRequest

    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3}
    if value is not None:
        body["speculative"] = value
    plan = plan_completion(CompletionRequest.model_validate(body), None,
                           ModelLimits(name="m", max_model_len=64, vocab_size=100, max_n=4))
    assert [p.speculative for p in plan.params] == [want]


def test_a_stop_string_counts_the_tokens_up_to_its_own_in_a_multi_token_output() -> None:
    """The front end folds an output of several tokens one token at a time: a stop string
    completed by the first token ends the text and the token count there."""
    from trio_infer.runtime.detokenizer import IncrementalDetokenizer
    from trio_infer.runtime.stop_strings import StopStringMatcher
    from trio_infer.runtime.text_stream import ChoiceText
    from trio_infer.wire import RequestOutput

    class Letters:  # token t is the letter chr(ord("a") + t)
        def decode(self, ids, **kwargs) -> str:
            return "".join(chr(ord("a") + t) for t in ids)

        def convert_ids_to_tokens(self, ids):
            return [chr(ord("a") + t) for t in ids]

    def fold(outs):
        choice = ChoiceText(0, IncrementalDetokenizer(Letters(), [0]), StopStringMatcher(["c"]))
        delta = choice.consume(outs)
        return delta.text, delta.finish_reason, choice.num_tokens

    one_by_one = [RequestOutput((1, 0), [t], None, None, None, 1, i + 1, None)
                  for i, t in enumerate([1, 2, 3, 4])]
    at_once = [RequestOutput((1, 0), [1, 2, 3, 4], None, None, None, 1, 4, None)]
    assert fold(at_once) == fold(one_by_one) == ("b", "stop", 2)


# -- a draft model (engine/draft.py) ---------------------------------------------------------------

DRAFT = dict(SPEC, speculative="draft")


class WrongSuccessor(Successor):
    """A draft for :class:`Successor` that guesses wrong at every position divisible by 3."""

    def forward(self, batch: ForwardBatch, k_caches, v_caches) -> np.ndarray:
        logits = super().forward(batch, k_caches, v_caches)
        wrong = np.flatnonzero(batch.positions[batch.logits_indices] % 3 == 0)
        logits[wrong] = np.roll(logits[wrong], 1, axis=-1)
        return logits


def test_a_draft_model_guesses_and_the_engine_keeps_what_the_model_agrees_with() -> None:
    prompt = [7, 3, 9, 1]  # nothing repeats: prompt lookup would guess nothing
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [(1 + i) % 64 for i in range(1, 21)]
    engine = Engine(Successor(), EngineConfig(page_size=4, num_pages=64, **DRAFT),
                    draft_model=Successor())
    assert run(engine, {"a": (prompt, params)})["a"] == want
    stats = engine.statistics()
    assert stats.spec_accepted == stats.spec_proposed > 0  # a perfect draft
    assert stats.sample_steps < 10 and stats.draft_pages_total == 64
    engine = Engine(Successor(), EngineConfig(page_size=4, num_pages=64, **DRAFT),
                    draft_model=WrongSuccessor())
    assert run(engine, {"a": (prompt, params)})["a"] == want
    stats = engine.statistics()
    assert 0 < stats.spec_accepted < stats.spec_proposed  # guesses cut and rolled back


def test_draft_pages_come_back_on_abort_preemption_failure_and_a_dry_draft_pool() -> None:
    prompt = [7, 3, 9, 1, 5]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    config = EngineConfig(page_size=4, num_pages=64, **DRAFT)
    # abort while the step that drafts is in flight: commit skips it, its draft pages are back
    engine = Engine(Successor(), config, draft_model=WrongSuccessor())
    engine.add_request("a", prompt, params)
    engine.step()  # prefill, first token
    plan = engine.schedule()
    assert plan is not None and plan.draft_work and engine.num_draft_pages > 0
    engine.abort("a")
    assert engine.num_draft_pages == 0
    assert engine.commit(plan, engine.execute(plan)) == []
    # a step that raises: fail() ends its requests and their draft pages come back
    engine.add_request("b", prompt, params)
    engine.step()
    plan = engine.schedule()
    assert plan is not None and plan.draft_work
    assert engine.fail(plan) == ["b"] and engine.num_draft_pages == 0
    # preemption in a pool one sequence fills: the victim's draft pages go back, the draft
    # re-prefills on resume, and the ids are the model's
    model = Successor()
    engine = Engine(model, EngineConfig(page_size=4, num_pages=12, max_running=3,
                                        max_batched_tokens=16, **DRAFT),
                    draft_model=WrongSuccessor())
    preempted = 0
    original = engine.scheduler.schedule

    def watch():  # every preempted sequence holds no draft page once the schedule is made
        nonlocal preempted
        sched = original()
        for seq in sched.preempted if sched else ():
            preempted += 1
            assert seq.pages == [] and seq.proposer.pages == [] and seq.proposer.num_computed == 0
        return sched

    engine.scheduler.schedule = watch
    got = run(engine, {i: ([7, 3, 9, 1 + i], params) for i in range(3)}, stagger=1)
    assert preempted > 0
    assert all(v == [(1 + i + j) % 64 for j in range(1, 31)] for i, v in got.items())
    assert engine.statistics().spec_accepted > 0
    # a draft pool of one page: drafts only take free pages, the output is the same
    engine = Engine(Successor(), EngineConfig(page_size=4, num_pages=64, **DRAFT,
                                              speculative_draft_kv_bytes=1),
                    draft_model=Successor())
    assert engine.statistics().draft_pages_total == 1
    got = run(engine, {i: (prompt, params) for i in range(2)})
    assert all(v == [(5 + j) % 64 for j in range(1, 31)] for v in got.values())


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_ids_identical_with_and_without_a_draft_model(tiny_checkpoint_factory, arch) -> None:
    """Draft = the model itself (every guess right) and a one-layer model with the same vocabulary
    (mostly wrong guesses): alone, after prefix-cache hits and with preemption, the same ids."""
    model = load_model(tiny_checkpoint_factory(arch))
    small = load_model(tiny_checkpoint_factory(arch, num_layers=1, hidden_size=32, num_heads=2,
                                               num_kv_heads=1, intermediate_size=64))
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 1000, (int(n),), generator=gen).tolist()
          for n in torch.randint(4, 30, (6,), generator=gen)]
    reqs = {i: (p, GREEDY) for i, p in enumerate(ps)}
    shape = dict(page_size=4, num_pages=200, max_running=8, max_batched_tokens=32)
    plain = run(Engine(model, EngineConfig(**shape)), reqs)
    for draft in (model, small):
        engine = Engine(model, EngineConfig(**shape, **DRAFT), draft_model=draft)
        assert run(engine, reqs) == plain
        stats = engine.statistics()
        assert stats.spec_proposed > 0
        if draft is model:
            assert stats.spec_accepted > stats.spec_proposed // 2, stats
        hits = stats.prefix_hits
        assert run(engine, reqs) == plain  # every prompt now starts from the prefix cache
        assert engine.statistics().prefix_hits > hits
    tiny = Engine(model, EngineConfig(page_size=4, num_pages=24, max_running=6,
                                      max_batched_tokens=16, **DRAFT), draft_model=model)
    assert run(tiny, reqs, stagger=1) == plain


BENCH_MODELS = default_cache_dir() / "bench-models"


@pytest.mark.parametrize("draft_file", ["itself", "smollm2-135m-Q4_K_M.gguf"])
def test_greedy_ids_identical_with_a_draft_on_the_default_model(default_model, draft_file) -> None:
    """SmolLM2-135M Q4_1 drafted by itself, or by its Q4_K_M requantization (where the bench
    models were made): the same ids as without, and the guesses mostly kept; drafted by itself,
    also after prefix-cache hits and across preemption."""
    if draft_file != "itself" and not (BENCH_MODELS / draft_file).exists():
        pytest.skip(f"{draft_file} is not in {BENCH_MODELS}")
    model = default_model
    draft = model if draft_file == "itself" else load_model(BENCH_MODELS / draft_file)
    prompt = list(range(1000, 1040))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = {0: (prompt, params), 1: (prompt[:30], params)}
    plain = run(Engine(model, EngineConfig()), reqs)
    engine = Engine(model, EngineConfig(**DRAFT), draft_model=draft)
    assert run(engine, reqs) == plain
    stats = engine.statistics()
    assert stats.spec_accepted > stats.spec_proposed // 2, stats
    if draft is not model:
        return  # the prefix-cache and preemption paths once (seconds per run on this model)
    assert run(engine, reqs) == plain  # again: both prompts start from the prefix cache
    assert engine.statistics().prefix_hits > stats.prefix_hits
    # 5 pages of 16 tokens for sequences of 64 and 54 tokens: preemption, the draft re-prefills
    tiny = Engine(model, EngineConfig(num_pages=5, max_batched_tokens=64, **DRAFT),
                  draft_model=draft)
    preempted = 0
    original = tiny.scheduler.schedule

    def watch():
        nonlocal preempted
        sched = original()
        preempted += len(sched.preempted) if sched else 0
        return sched

    tiny.scheduler.schedule = watch
    assert run(tiny, reqs, stagger=1) == plain
    assert preempted > 0


class ByPosition:
    """Logits that depend only on a row's position (a fixed distribution per position), and a
    draft that always guesses token 2: the engine's sampled output can be checked against them."""

    def __init__(self, logits: np.ndarray | None = None) -> None:
        vocab = 8
        self.info = ModelInfo(name="by-position", architecture="ByPosition", num_layers=1,
                              num_kv_heads=1, head_dim=1, vocab_size=vocab, max_model_len=64,
                              dtype="float32", eos_token_ids=(0,))
        self.logits = logits

    def forward(self, batch: ForwardBatch, k_caches, v_caches) -> np.ndarray:
        pos = batch.positions[batch.logits_indices]
        if self.logits is None:  # the draft
            out = np.zeros((len(pos), self.info.vocab_size), dtype=np.float32)
            out[:, 2] = 1.0
            return out
        return self.logits[np.minimum(pos, len(self.logits) - 1)]


def test_sampling_with_a_draft_model_keeps_the_distribution_at_temperature_1() -> None:
    """Token 2 of each request comes from a verify row (the draft guessed 2) and token 3 from
    the verify's bonus row or the next step: each is distributed as the model's row at its
    position, whatever the draft guessed (chi-square, P = 0.001)."""
    logits = (np.random.default_rng(1).standard_normal((4, 8)) * 1.5).astype(np.float32)
    logits[:, 0] = -30.0  # no EOS
    logits[1, 2] = 1.0  # the draft's guess is kept sometimes, not always
    model = ByPosition(logits)
    n = 3000
    engine = Engine(model, EngineConfig(page_size=4, num_pages=4 * 512, max_running=512,
                                        max_batched_tokens=1024, **dict(DRAFT, speculative_max_batch=512,
                                                                         speculative_min_acceptance=0.0)),
                    draft_model=ByPosition())
    engine.runner.rng = np.random.default_rng(1)  # the sampler's draws, fixed (the test's too)
    params = SamplingParams(temperature=1.0, max_tokens=3)
    got = run(engine, {i: ([5], params) for i in range(n)})
    stats = engine.statistics()
    assert 0 < stats.spec_accepted < stats.spec_proposed
    p = probabilities(logits.copy(), params)
    second = [0] * 8
    third = [0] * 8
    for toks in got.values():
        second[toks[1]] += 1
        third[toks[2]] += 1
    # 6 degrees of freedom (7 possible tokens): P(chi2 > 22.5) = 0.001.
    assert _chi_square(second, p[1].tolist()) < 22.5, second
    assert _chi_square(third, p[2].tolist()) < 22.5, third
    assert second[2] < 0.9 * n  # the draft's guess did not take over


def test_draft_settings_are_checked() -> None:
    from pydantic import ValidationError

    from trio_infer.settings import Settings

    with pytest.raises(ValidationError, match="speculative='draft' needs speculative_draft_model"):
        Settings(speculative="draft")
    with pytest.raises(ValidationError, match="speculative_draft_model goes with"):
        Settings(speculative_draft_model=str(DEFAULT_GGUF))
    with pytest.raises(ValidationError, match="no such file or folder"):
        Settings(speculative="draft", speculative_draft_model="/nonexistent/draft.gguf")
    with pytest.raises(ValidationError, match="speculative_draft_kv_mb must be >= 0"):
        Settings(speculative_draft_kv_mb=-1)
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(Successor(), EngineConfig(**DRAFT))
    with pytest.raises(ValueError, match="not 'draft'"):
        Engine(Successor(), EngineConfig(**SPEC), draft_model=Successor())
    with pytest.raises(ValueError, match="vocabulary has 32 ids, the model's 64"):
        Engine(Successor(), EngineConfig(**DRAFT), draft_model=Successor(vocab=32))


@pytest.mark.skipif(not DEFAULT_GGUF.exists(), reason="the default model is not fetched")
def test_a_draft_with_another_tokenizer_is_refused_at_load(tiny_checkpoint) -> None:
    """(The default model's tokenizer is read from the cache its first use converted it into.)"""
    from trio_infer.runtime.loading import build_engine
    from trio_infer.settings import Settings

    settings = Settings(model=str(tiny_checkpoint), speculative="draft",
                        speculative_draft_model=str(DEFAULT_GGUF), torch_threads=1)
    with pytest.raises(ValueError, match="tokenizer's vocabulary differs from the model's"):
        build_engine(settings)
    same = Settings(model=str(tiny_checkpoint), speculative="draft",
                    speculative_draft_model=str(tiny_checkpoint), torch_threads=1)
    engine = build_engine(same)
    assert engine.statistics().draft_pages_total == engine.statistics().pages_total


def test_a_draft_model_with_a_shorter_context_guesses_only_within_it() -> None:
    class ShortSuccessor(Successor):
        def __init__(self) -> None:
            super().__init__()
            self.info = dataclasses.replace(self.info, max_model_len=12)
            self.longest = 0

        def forward(self, batch, k_caches, v_caches):
            self.longest = max(self.longest, int(batch.positions.max()) + 1)
            return super().forward(batch, k_caches, v_caches)

    draft = ShortSuccessor()
    engine = Engine(Successor(), EngineConfig(page_size=4, num_pages=64, **DRAFT), draft_model=draft)
    got = run(engine, {"a": ([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True))})
    assert got["a"] == [(4 + i) % 64 for i in range(1, 21)]
    assert draft.longest == 12 and engine.statistics().spec_accepted > 0
