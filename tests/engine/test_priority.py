"""The scheduler's priorities (``SamplingParams.priority``, vLLM's: lower first), on the fake
model: admission by (priority, arrival), the victim of a preemption, and the first scheduling the
worker reports (``Engine.take_admitted``). The property suite (tests/concurrency) checks the same
rules at every step of random runs; these are the readable cases."""

from __future__ import annotations

from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.models.fake import FakeModel
from trio_infer.wire import SamplingParams

VOCAB = 97


def params(priority: int, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


def run_to_the_end(engine: Engine) -> list[object]:
    """Step ``engine`` until it is idle; the uids it preempted on the way, in order."""
    preempted: list[object] = []
    while engine.has_unfinished():
        plan = engine.schedule()
        assert plan is not None
        preempted.extend(seq.uid for seq in plan.schedule.preempted)
        engine.commit(plan, engine.execute(plan))
    return preempted


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    engine = Engine(FakeModel(vocab_size=VOCAB), EngineConfig(page_size=4, num_pages=64, max_running=1))
    for uid, priority in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        engine.add_request(uid, [1, 2, 3], params(priority, max_tokens=1))
    order = []
    while engine.has_unfinished():
        engine.step()
        order.extend(engine.take_admitted())
    assert order == ["b", "d", "c", "a"]


def test_a_high_priority_head_is_not_overtaken_by_a_lower_one_that_fits() -> None:
    """The head of the queue that does not fit stops admission: a smaller, lower-priority
    request behind it waits too (else a stream of small requests could starve a big one)."""
    engine = Engine(FakeModel(vocab_size=VOCAB),
                    EngineConfig(page_size=4, num_pages=6, max_running=4, max_batched_tokens=64,
                                 enable_prefix_cache=False))
    engine.add_request("running", list(range(1, 13)), params(0, max_tokens=8))
    engine.step()  # 12 tokens computed, a 13th sampled: 4 of the 6 pages from the next step on
    assert engine.take_admitted() == ["running"]
    engine.add_request("big", list(range(20, 36)), params(0))  # needs 4 pages: does not fit
    engine.add_request("small", [40, 41], params(5))  # 1 page would fit
    engine.step()
    assert engine.take_admitted() == []  # neither was admitted
    while engine.has_unfinished():
        engine.step()
    assert engine.take_admitted() == ["big", "small"]


def test_under_kv_pressure_the_lowest_priority_is_preempted_even_if_older() -> None:
    engine = Engine(FakeModel(vocab_size=VOCAB),
                    EngineConfig(page_size=4, num_pages=4, max_running=2, max_batched_tokens=64,
                                 enable_prefix_cache=False))
    engine.add_request("low", [1, 2, 3], params(1, max_tokens=12))  # older, lower priority
    engine.add_request("high", [4, 5, 6], params(0, max_tokens=12))
    preempted = run_to_the_end(engine)
    assert preempted and set(preempted) == {"low"}


def test_equal_priorities_preempt_the_youngest_as_before() -> None:
    engine = Engine(FakeModel(vocab_size=VOCAB),
                    EngineConfig(page_size=4, num_pages=4, max_running=2, max_batched_tokens=64,
                                 enable_prefix_cache=False))
    engine.add_request("old", [1, 2, 3], params(0, max_tokens=12))
    engine.add_request("young", [4, 5, 6], params(0, max_tokens=12))
    preempted = run_to_the_end(engine)
    assert preempted and set(preempted) == {"young"}


def test_admission_is_reported_once_even_after_a_preemption() -> None:
    engine = Engine(FakeModel(vocab_size=VOCAB),
                    EngineConfig(page_size=4, num_pages=4, max_running=2, max_batched_tokens=64,
                                 enable_prefix_cache=False))
    engine.add_request("a", [1, 2, 3], params(0, max_tokens=12))
    engine.add_request("b", [4, 5, 6], params(1, max_tokens=12))
    admitted = []
    while engine.has_unfinished():
        engine.step()
        admitted.extend(engine.take_admitted())
    assert sorted(admitted) == ["a", "b"]
