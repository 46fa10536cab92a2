"""Batched sampling: per-request parameters, seeds independent of the batch, logprobs; numpy
arrays in and out, and no torch on the way (engine/sampler.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trio_infer.engine.sampler import _top, argmax_ids, probabilities, prompt_logprobs, sample
from trio_infer.engine.sequence import Sequence
from trio_infer.wire import SamplingParams

VOCAB = 50


def seq(params: SamplingParams, output: list[int] = (), uid: int = 0) -> Sequence:
    s = Sequence(uid=uid, token_ids=[1, 2, *output], num_prompt_tokens=2, params=params, max_len=99)
    if params.seed is not None:
        s.generator = np.random.default_rng(params.seed)
    return s


def logits(n: int, seed: int = 0, vocab: int = VOCAB) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, vocab)) * 3).astype(np.float32)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_greedy_is_argmax() -> None:
    x = logits(4)
    res = sample(x.copy(), [seq(SamplingParams(temperature=0)) for _ in range(4)], rng=rng())
    assert res.token_ids == x.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    x = logits(1, seed=5)
    p = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)
    s_alone = seq(p)
    alone = [sample(x.copy(), [s_alone], rng=rng(7)).token_ids[0] for _ in range(20)]
    s_batched = seq(p)
    # Neighbours that truncate and that do not, seeded and not: none of it reaches the row.
    neighbours = [seq(SamplingParams(temperature=0.7)), seq(SamplingParams(temperature=1.3, top_k=3)),
                  seq(SamplingParams(temperature=0.5, seed=9, min_p=0.2))]
    batched = []
    shared = rng(8)
    for step in range(20):
        big = np.concatenate([logits(2, seed=step + 100), x, logits(1, seed=step)])
        batch = [neighbours[0], neighbours[1], s_batched, neighbours[2]]
        batched.append(sample(big, batch, rng=shared).token_ids[2])
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_a_seed_gives_the_same_tokens_again() -> None:
    x = logits(1, seed=3)
    for p in (SamplingParams(temperature=0.9, seed=42), SamplingParams(temperature=0.9, seed=42, top_k=5)):
        a, b = seq(p), seq(p)
        ta = [sample(x.copy(), [a], rng=rng(1)).token_ids[0] for _ in range(30)]
        tb = [sample(x.copy(), [b], rng=rng(2)).token_ids[0] for _ in range(30)]
        assert ta == tb and len(set(ta)) > 1


def test_different_seeds_differ() -> None:
    x = logits(1)
    a = seq(SamplingParams(temperature=1.0, seed=1))
    b = seq(SamplingParams(temperature=1.0, seed=2))
    ta = [sample(x.copy(), [a], rng=rng()).token_ids[0] for _ in range(30)]
    tb = [sample(x.copy(), [b], rng=rng()).token_ids[0] for _ in range(30)]
    assert ta != tb


def test_unseeded_rows_draw_from_the_callers_generator() -> None:
    x = logits(3, seed=4)
    rows = [seq(SamplingParams(temperature=1.0)) for _ in range(3)]
    draws = [sample(x.copy(), rows, rng=rng(11)).token_ids for _ in range(2)]
    assert draws[0] == draws[1]  # the same generator state: the same tokens
    g = rng(11)
    assert [sample(x.copy(), rows, rng=g).token_ids for _ in range(8)] != [draws[0]] * 8


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    x = logits(3)
    rows = [
        seq(SamplingParams(temperature=1.5, top_k=1)),
        seq(SamplingParams(temperature=1.5, top_p=1e-6)),
        seq(SamplingParams(temperature=1.5, min_p=1.0)),
    ]
    g = rng()
    for _ in range(10):
        assert sample(x.copy(), rows, rng=g).token_ids == x.argmax(-1).tolist()


def test_top_k_restricts_support() -> None:
    x = logits(1)
    allowed = set(np.argsort(-x[0], kind="stable")[:3].tolist())
    s = seq(SamplingParams(temperature=5.0, top_k=3, seed=0))
    seen = {sample(x.copy(), [s], rng=rng()).token_ids[0] for _ in range(200)}
    assert seen == allowed


def test_sampling_follows_the_distribution() -> None:
    x = np.log(np.array([[0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)], dtype=np.float32))
    for s, g in ((seq(SamplingParams(temperature=1.0, seed=3)), rng()),
                 (seq(SamplingParams(temperature=1.0)), rng(5))):
        draws = [sample(x.copy(), [s], rng=g).token_ids[0] for _ in range(2000)]
        freq = [draws.count(i) / len(draws) for i in range(3)]
        assert abs(freq[0] - 0.7) < 0.05 and abs(freq[1] - 0.2) < 0.05 and abs(freq[2] - 0.1) < 0.04


def test_truncated_sampling_follows_the_truncated_distribution() -> None:
    """Chi-square of 4000 draws against :func:`probabilities` (P = 0.001), top-p and min-p."""
    x = logits(1, seed=12, vocab=12)
    for params in (SamplingParams(temperature=0.8, top_p=0.8), SamplingParams(temperature=1.2, min_p=0.1)):
        p = probabilities(x, params)[0]
        s = seq(params)
        g = rng(13)
        draws = np.bincount([sample(x.copy(), [s], rng=g).token_ids[0] for _ in range(4000)],
                            minlength=12)
        assert set(np.flatnonzero(draws)) <= set(np.flatnonzero(p))
        support = np.flatnonzero(p)
        chi2 = float(((draws[support] - 4000 * p[support]) ** 2 / (4000 * p[support])).sum())
        # P(chi2 > x) = 0.001 for 1..11 degrees of freedom
        limit = [10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3, 26.1, 27.9, 29.6, 31.3][len(support) - 2]
        assert len(support) >= 2 and chi2 < limit, (draws, p)


def _reference(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The truncation rules as the torch sampler wrote them, over a full stable argsort."""
    x = x / params.temperature
    order = np.argsort(-x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, axis=-1)
    e = np.exp(xs - xs[:, :1])
    probs = e / e.sum(axis=-1, keepdims=True)
    vocab = x.shape[-1]
    drop = np.broadcast_to(np.arange(vocab) >= (params.top_k or vocab), x.shape).copy()
    drop |= (np.cumsum(probs, axis=-1, dtype=np.float64).astype(np.float32) - probs) > np.float32(params.top_p)
    drop |= probs < np.float32(params.min_p) * probs[:, :1]
    probs[drop] = 0
    out = np.empty_like(probs)
    np.put_along_axis(out, order, probs / probs.sum(axis=-1, keepdims=True), axis=-1)
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=7), SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=2.0, min_p=0.3), SamplingParams(temperature=1.0, top_k=4, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=3000, top_p=0.999), SamplingParams(temperature=9.0, top_p=0.9),
], ids=lambda p: f"k{p.top_k}-p{p.top_p}-m{p.min_p}-t{p.temperature}")
def test_truncation_keeps_what_a_stable_argsort_keeps(params: SamplingParams) -> None:
    """The kept tokens are those of the stable descending order (ties: lower ids), also with
    ties at the cut and a kept prefix longer than the first window (a flat, hot row)."""
    g = rng(21)
    x = np.round(g.standard_normal((6, 2000)) * 2, 1).astype(np.float32)  # many equal logits
    x[1] = 0.5  # all tied
    x[2, ::3] = 4.0  # ties at the top
    want = _reference(x, params)
    got = probabilities(x, params)
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert np.allclose(got.sum(axis=-1), 1.0)


def test_penalties_push_away_from_generated_tokens() -> None:
    x = np.zeros((2, VOCAB), dtype=np.float32)
    x[:, 7] = 1.0
    x[:, 8] = 0.9
    plain = seq(SamplingParams(temperature=0), output=[7])
    penal = seq(SamplingParams(temperature=0, presence_penalty=0.5), output=[7])
    freq = seq(SamplingParams(temperature=0, frequency_penalty=0.06), output=[7, 7])
    assert sample(x.copy(), [plain, penal], rng=rng()).token_ids == [7, 8]
    assert sample(x[:1].copy(), [freq], rng=rng()).token_ids == [8]


def test_penalties_and_bias_change_only_their_tokens() -> None:
    x = logits(1, seed=6)
    p = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.25,
                       presence_penalty=0.5, logit_bias=((3, 2.0), (40, -1.0)), logprobs=0)
    y = x.copy()
    sample(y, [seq(p, output=[9, 9, 1])], rng=rng())
    want = x[0].copy()
    for t in (1, 2, 9):  # seen: prompt 1, 2; output 9, 9, 1
        want[t] = want[t] / np.float32(1.5) if want[t] > 0 else want[t] * np.float32(1.5)
    want[9] -= np.float32(0.25) * 2 + np.float32(0.5)
    want[1] -= np.float32(0.25) * 1 + np.float32(0.5)
    want[3] += np.float32(2.0)
    want[40] -= np.float32(1.0)
    np.testing.assert_allclose(y[0], want, rtol=1e-6)
    changed = np.flatnonzero(y[0] != x[0])
    assert set(changed.tolist()) <= {1, 2, 3, 9, 40}


def test_logprobs_chosen_and_top() -> None:
    x = logits(2)
    rows = [seq(SamplingParams(temperature=0, logprobs=3)), seq(SamplingParams(temperature=0))]
    res = sample(x.copy(), rows, rng=rng())
    x64 = x[0].astype(np.float64)
    ref = x64 - x64.max() - np.log(np.exp(x64 - x64.max()).sum())
    lp = res.logprobs[0]
    assert lp.token_id == res.token_ids[0]
    assert abs(lp.logprob - float(ref.max())) < 1e-5
    assert [t for t, _ in lp.top] == np.argsort(-ref, kind="stable")[:3].tolist()
    assert all(abs(v - ref[t]) < 1e-5 for t, v in lp.top)
    assert res.logprobs[1] is None


def test_logprobs_are_stable_for_large_logits() -> None:
    x = np.array([[1e4, 1e4 - 1.0, -1e4] + [0.0] * (VOCAB - 3)], dtype=np.float32)
    lp = sample(x.copy(), [seq(SamplingParams(temperature=0, logprobs=2))], rng=rng()).logprobs[0]
    assert lp.token_id == 0 and abs(lp.logprob - -np.log1p(np.exp(-1.0))) < 1e-5
    assert all(np.isfinite(v) for _, v in lp.top)


def test_top_logprobs_break_ties_by_the_lower_id() -> None:
    row = np.array([[0.0, 3.0, 1.0, 3.0, 1.0, 1.0, -np.inf, 1.0]], dtype=np.float32)
    assert [t for t, _ in _top(row, [4])[0]] == [1, 3, 2, 4]
    assert [t for t, _ in _top(row, [1])[0]] == [1]
    # more alternatives asked than finite values: the -inf ones after, by id
    inf = np.full((1, 8), -np.inf, dtype=np.float32)
    inf[0, 5] = 0.0
    assert [t for t, _ in _top(inf, [3])[0]] == [5, 0, 1]
    many = np.random.default_rng(0).integers(0, 4, (5, 300)).astype(np.float32)
    for r, top in enumerate(_top(many, [1, 5, 20, 0, 300])):
        k = [1, 5, 20, 0, 300][r]
        assert [t for t, _ in top] == np.argsort(-many[r], kind="stable")[:k].tolist()


def test_prompt_logprobs_in_slices() -> None:
    x = logits(150, seed=9)
    targets = [int(t) for t in np.random.default_rng(1).integers(0, VOCAB, 150)]
    ks = [r % 4 for r in range(150)]
    out = prompt_logprobs(x, targets, ks)
    x64 = x.astype(np.float64)
    ref = x64 - x64.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    assert len(out) == 150
    for r, e in enumerate(out):
        assert e.token_id == targets[r] and abs(e.logprob - ref[r, targets[r]]) < 1e-5
        assert [t for t, _ in e.top] == np.argsort(-ref[r], kind="stable")[: ks[r]].tolist()


def test_argmax_ids_is_the_first_maximum() -> None:
    """The first of equal maxima, a NaN as the maximum, index 0 of a row of -inf (as torch's
    argmax picked: the sampler's greedy tokens did not change with numpy)."""
    x = logits(3)
    x[0, 7] = x[0, 11] = x[0].max() + 1  # a tie: the first wins
    x[1, 4] = np.nan
    x[2] = -np.inf
    assert argmax_ids(x) == [7, 4, 0]
    assert argmax_ids(x[:, ::2]) == [x[0, ::2].argmax(), 2, 0]  # strided rows


def test_a_mixed_batch_samples_each_row_as_alone() -> None:
    """Plain greedy rows, a penalised one, a logprobs one and a seeded sampled one in one batch:
    each row's token (and logprob) is what it gets alone."""
    x = logits(4, seed=2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=2.0),
              SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.8, seed=5)]
    together = sample(x.copy(), [seq(p, output=[3, 9]) for p in params], rng=rng())
    for i, p in enumerate(params):
        alone = sample(x[i : i + 1].copy(), [seq(p, output=[3, 9])], rng=rng(3))
        assert together.token_ids[i] == alone.token_ids[0]
        assert together.logprobs[i] == alone.logprobs[0]
    assert together.logprobs[2] is not None and together.logprobs[0] is None


def test_a_forbidden_token_is_never_sampled() -> None:
    """-inf logits (a grammar's mask) have p = 0: never drawn, also by a row whose only allowed
    token has a tiny probability next to the rest's nothing."""
    x = np.full((3, VOCAB), -np.inf, dtype=np.float32)
    x[0, [4, 9]] = [0.0, -80.0]
    x[1, 17] = -3.0
    x[2, [1, 2, 3]] = 5.0
    rows = [seq(SamplingParams(temperature=1.0)), seq(SamplingParams(temperature=2.0, top_p=0.5)),
            seq(SamplingParams(temperature=1.0, seed=4, top_k=2))]
    g = rng()
    for _ in range(200):
        t = sample(x.copy(), rows, rng=g).token_ids
        assert t[0] in (4, 9) and t[1] == 17 and t[2] in (1, 2)


def test_the_sampling_stack_imports_no_torch() -> None:
    code = ("import sys\n"
            "import trio_infer.engine.sampler, trio_infer.engine.speculative\n"
            "import trio_infer.engine.grammar, trio_infer.engine.sequence\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    # From the repository root: `python -c` imports this checkout's package.
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
