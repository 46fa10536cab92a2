"""Batched sampling: per-request parameters, seeds independent of the batch, logprobs."""

from __future__ import annotations

import torch

from trio_infer.engine.sampler import argmax_ids, sample
from trio_infer.engine.sequence import Sequence
from trio_infer.wire import SamplingParams

VOCAB = 50


def seq(params: SamplingParams, output: list[int] = (), uid: int = 0) -> Sequence:
    s = Sequence(uid=uid, token_ids=[1, 2, *output], num_prompt_tokens=2, params=params, max_len=99)
    if params.seed is not None:
        s.generator = torch.Generator().manual_seed(params.seed)
    return s


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    x = logits(4)
    res = sample(x.clone(), [seq(SamplingParams(temperature=0)) for _ in range(4)])
    assert res.token_ids == x.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    x = logits(1, seed=5)
    p = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)
    s_alone = seq(p)
    alone = [sample(x.clone(), [s_alone]).token_ids[0] for _ in range(20)]
    s_batched = seq(p)
    neighbours = [seq(SamplingParams(temperature=0.7)) for _ in range(3)]
    batched = []
    for step in range(20):
        big = torch.cat([logits(2, seed=step + 100), x, logits(1, seed=step)])
        batch = [neighbours[0], neighbours[1], s_batched, neighbours[2]]
        batched.append(sample(big, batch).token_ids[2])
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_different_seeds_differ() -> None:
    x = logits(1)
    a = seq(SamplingParams(temperature=1.0, seed=1))
    b = seq(SamplingParams(temperature=1.0, seed=2))
    ta = [sample(x.clone(), [a]).token_ids[0] for _ in range(30)]
    tb = [sample(x.clone(), [b]).token_ids[0] for _ in range(30)]
    assert ta != tb


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    x = logits(3)
    rows = [
        seq(SamplingParams(temperature=1.5, top_k=1)),
        seq(SamplingParams(temperature=1.5, top_p=1e-6)),
        seq(SamplingParams(temperature=1.5, min_p=1.0)),
    ]
    for _ in range(10):
        assert sample(x.clone(), rows).token_ids == x.argmax(-1).tolist()


def test_top_k_restricts_support() -> None:
    x = logits(1)
    allowed = set(torch.topk(x[0], 3).indices.tolist())
    s = seq(SamplingParams(temperature=5.0, top_k=3, seed=0))
    seen = {sample(x.clone(), [s]).token_ids[0] for _ in range(200)}
    assert seen == allowed


def test_sampling_follows_the_distribution() -> None:
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)]))
    s = seq(SamplingParams(temperature=1.0, seed=3))
    draws = [sample(x.clone(), [s]).token_ids[0] for _ in range(2000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert abs(freq[0] - 0.7) < 0.05 and abs(freq[1] - 0.2) < 0.05 and abs(freq[2] - 0.1) < 0.04


def test_penalties_push_away_from_generated_tokens() -> None:
    x = torch.zeros(2, VOCAB)
    x[:, 7] = 1.0
    x[:, 8] = 0.9
    plain = seq(SamplingParams(temperature=0), output=[7])
    penal = seq(SamplingParams(temperature=0, presence_penalty=0.5), output=[7])
    freq = seq(SamplingParams(temperature=0, frequency_penalty=0.06), output=[7, 7])
    assert sample(x.clone(), [plain, penal]).token_ids == [7, 8]
    assert sample(x[:1].clone(), [freq]).token_ids == [8]


def test_logprobs_chosen_and_top() -> None:
    x = logits(2)
    rows = [seq(SamplingParams(temperature=0, logprobs=3)), seq(SamplingParams(temperature=0))]
    res = sample(x.clone(), rows)
    ref = torch.log_softmax(x[0], -1)
    lp = res.logprobs[0]
    assert lp.token_id == res.token_ids[0]
    assert abs(lp.logprob - float(ref.max())) < 1e-5
    assert [t for t, _ in lp.top] == torch.topk(ref, 3).indices.tolist()
    assert res.logprobs[1] is None


def test_argmax_ids_is_torchs_argmax() -> None:
    """The sampler's argmax (numpy on CPU fp32) picks what torch's does: the first of equal
    maxima, a NaN as the maximum, index 0 of a row of -inf; other dtypes go through torch."""
    x = logits(3)
    x[0, 7] = x[0, 11] = x[0].max() + 1  # a tie: the first wins
    x[1, 4] = float("nan")
    x[2] = float("-inf")
    assert argmax_ids(x) == x.argmax(-1).tolist() == [7, 4, 0]
    assert argmax_ids(x[:, ::2]) == x[:, ::2].argmax(-1).tolist()  # strided rows
    y = logits(4, seed=1).to(torch.bfloat16)
    assert argmax_ids(y) == y.argmax(-1).tolist()


def test_a_mixed_batch_samples_each_row_as_alone() -> None:
    """Plain greedy rows, a penalised one, a logprobs one and a seeded sampled one in one batch:
    each row's token (and logprob) is what it gets alone."""
    x = logits(4, seed=2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=2.0),
              SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.8, seed=5)]
    together = sample(x.clone(), [seq(p, output=[3, 9]) for p in params])
    for i, p in enumerate(params):
        alone = sample(x[i : i + 1].clone(), [seq(p, output=[3, 9])])
        assert together.token_ids[i] == alone.token_ids[0]
        assert together.logprobs[i] == alone.logprobs[0]
    assert together.logprobs[2] is not None and together.logprobs[0] is None
