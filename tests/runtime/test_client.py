"""The front end's engine and its sessions, over an in-process worker task: every way a request
can end leaves nothing behind, on either side of the protocol."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.metrics import Metrics
from trio_infer.models.fake import FakeModel
from trio_infer.runtime.client import AsyncEngine, open_engine
from trio_infer.wire import SamplingParams
from trio_infer.runtime.errors import (
    EngineOverloaded,
    EngineUnavailable,
    RequestFailed,
    RequestStalled,
)
from trio_infer.runtime.in_process import in_process, open_worker_task
from trio_infer.settings import Settings

VOCAB = 101
GREEDY = SamplingParams(temperature=0, ignore_eos=True, max_tokens=10)


def expected(model: FakeModel, prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(model.next_token(seq))
        seq.append(out[-1])
    return out


def make(settings: Settings | None = None, num_pages: int = 64, max_running: int = 8) -> Engine:
    model = FakeModel(vocab_size=VOCAB)
    return Engine(model, EngineConfig(page_size=4, num_pages=num_pages, max_running=max_running,
                                      max_batched_tokens=16))


def settings(**kw) -> Settings:
    return Settings(**{"channel_capacity": 4, "stall_timeout_s": 5.0, **kw})


async def assert_clean(ae: AsyncEngine, e: Engine | None) -> None:
    """Nothing left on the front end's side; with ``e``, once the worker has applied what was
    sent to it (messages cross asynchronously), nothing left in the engine either."""
    assert ae.num_sessions == 0 and not ae.live_uids()
    if e is not None:
        await trio.testing.wait_all_tasks_blocked()
        assert ae.connection.core.live_uids == []
        assert e.num_requests == e.num_running == e.num_waiting == e.num_request_pages == 0


async def collect(ae: AsyncEngine, prompt: list[int], params: list[SamplingParams]) -> dict:
    got: dict = {}
    async with ae.generate(prompt, params) as stream:
        async for outs in stream:
            for o in outs:
                got.setdefault(o.uid[1], []).append(o)
    return got


async def test_concurrent_requests_get_exact_outputs(autojump_clock) -> None:
    engine = make()
    model = engine.model
    prompts = [[i + 1] * (i + 2) for i in range(12)]
    results: dict = {}
    async with open_engine(settings(), in_process(engine)) as ae:
        async with trio.open_nursery() as n:
            for i, p in enumerate(prompts):
                async def one(i=i, p=p):
                    results[i] = await collect(ae, p, [GREEDY])
                n.start_soon(one)
        for i, p in enumerate(prompts):
            outs = results[i][0]
            assert [t for o in outs for t in o.token_ids] == expected(model, p, 10)
            assert outs[-1].finish_reason == "length"
        await assert_clean(ae, engine)


async def test_n_choices_share_one_session(autojump_clock) -> None:
    engine = make()
    async with open_engine(settings(), in_process(engine)) as ae:
        got = await collect(ae, [1, 2, 3], [GREEDY, GREEDY])
        assert set(got) == {0, 1}
        assert [t for o in got[0] for t in o.token_ids] == [t for o in got[1] for t in o.token_ids]
        await assert_clean(ae, engine)


@pytest.mark.parametrize("after", [0, 1, 3])
async def test_leaving_early_aborts_and_frees(autojump_clock, after: int) -> None:
    engine = make()
    async with open_engine(settings(), in_process(engine)) as ae:
        async with ae.generate([5] * 30, [SamplingParams(temperature=0, ignore_eos=True)]) as s:
            for _ in range(after):
                await s.__anext__()
            await trio.testing.wait_all_tasks_blocked()
            assert engine.num_requests == 1
        await assert_clean(ae, engine)
        assert ae.metrics.requests_total.labels(finish_reason="abort")._value.get() == 1


async def test_cancel_while_queued_frees_the_slot(autojump_clock) -> None:
    engine = make(max_running=1)
    async with open_engine(settings(), in_process(engine)) as ae:
        long = SamplingParams(temperature=0, ignore_eos=True, max_tokens=50)
        async with ae.generate([1], [long]):  # not read: paused, it keeps the only slot
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as cs:
                async with ae.generate([2], [GREEDY]) as stream:
                    await trio.testing.wait_all_tasks_blocked()
                    assert engine.num_waiting == 1
                    cs.cancel()
                    await stream.__anext__()
            await trio.testing.wait_all_tasks_blocked()
            assert engine.num_waiting == 0
        await assert_clean(ae, engine)


async def test_slow_reader_pauses_then_resumes_exactly(autojump_clock) -> None:
    engine = make()
    model = engine.model
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=20)
    async with open_engine(settings(channel_capacity=3, stall_timeout_s=1e9), in_process(engine)) as ae:
        async with ae.generate([7, 7], [params]) as stream:
            await trio.testing.wait_all_tasks_blocked()
            seq = engine._seqs[(stream.request_id, 0)]
            # Not read at all: the channel holds 3 outputs and the sequence is paused, pages kept.
            assert seq.num_output_tokens == 3 and not seq.ready and seq.pages
            assert ae.metrics.kv_pages_used._value.get() > 0
            got = []
            async for outs in stream:
                got += [t for o in outs for t in o.token_ids]
                await trio.sleep(1)  # a slow reader
            assert got == expected(model, [7, 7], 20)
        await assert_clean(ae, engine)


async def test_stalled_reader_is_aborted_after_timeout(autojump_clock) -> None:
    engine = make()
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=50)
    async with open_engine(settings(channel_capacity=2, stall_timeout_s=5), in_process(engine)) as ae:
        async with ae.generate([1], [params]) as stream:
            t0 = trio.current_time()
            await trio.sleep(100)  # never reads
            assert engine.num_requests == 0 and engine.pool.num_used == 0  # aborted, freed
            got = []
            with pytest.raises(RequestStalled):
                async for outs in stream:
                    got += outs
            assert len(got) == 2  # the buffered outputs are still delivered first
        await assert_clean(ae, engine)
        assert ae.metrics.requests_total.labels(finish_reason="abort")._value.get() == 1


class Exploding(FakeModel):
    def __init__(self, bad_token: int, **kw) -> None:
        super().__init__(**kw)
        self.bad_token = bad_token

    def forward(self, batch, k, v):
        if (batch.input_ids == self.bad_token).any():
            raise RuntimeError("boom")
        return super().forward(batch, k, v)


async def test_failed_step_fails_its_requests_and_the_engine_keeps_serving(autojump_clock) -> None:
    model = Exploding(bad_token=66, vocab_size=VOCAB)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, max_running=8, max_batched_tokens=16))
    async with open_engine(settings(), in_process(engine)) as ae:
        with pytest.raises(RequestFailed, match="boom"):
            await collect(ae, [66, 1], [GREEDY])
        good = await collect(ae, [1, 2], [GREEDY])
        assert len(good[0]) == 10
        assert ae.healthy
        await assert_clean(ae, engine)
        assert ae.metrics.requests_total.labels(finish_reason="error")._value.get() == 1


async def test_worker_crash_marks_unhealthy_and_fails_sessions(autojump_clock) -> None:
    engine = make()
    async with open_engine(settings(), in_process(engine)) as ae:
        def broken():
            raise RuntimeError("scheduler bug")
        async with ae.generate([1], [GREEDY]) as stream:
            engine.schedule = broken
            with pytest.raises(EngineUnavailable):
                async for _ in stream:
                    pass
        assert not ae.healthy
        with pytest.raises(EngineUnavailable):
            async with ae.generate([1], [GREEDY]):
                pass
        assert ae.num_sessions == 0


async def test_waiting_cap_overload(autojump_clock) -> None:
    engine = make(max_running=1)
    async with open_engine(settings(max_waiting=1), in_process(engine)) as ae:
        long = SamplingParams(temperature=0, ignore_eos=True, max_tokens=30)
        async with ae.generate([1], [long]):
            await trio.testing.wait_all_tasks_blocked()
            async with ae.generate([2], [long]):  # waits: queue holds 1
                with pytest.raises(EngineOverloaded):
                    async with ae.generate([3], [long]):
                        pass
        await assert_clean(ae, engine)


async def test_drain_rejects_new_and_abort_all_ends_live(autojump_clock) -> None:
    engine = make()
    async with open_engine(settings(), in_process(engine)) as ae:
        async with ae.generate([1], [SamplingParams(temperature=0, ignore_eos=True)]) as stream:
            ae.begin_drain()
            with pytest.raises(EngineUnavailable, match="shutting down"):
                async with ae.generate([1], [GREEDY]):
                    pass
            ae.abort_all(EngineUnavailable("the server is shutting down"))
            with pytest.raises(EngineUnavailable):
                async for _ in stream:
                    pass
        await assert_clean(ae, engine)


async def test_shutdown_stops_the_worker_and_fails_sessions(autojump_clock) -> None:
    engine = make()
    errors = []
    async with trio.open_nursery() as outer:
        async with open_engine(settings(), in_process(engine)) as ae:
            async def reader(task_status=trio.TASK_STATUS_IGNORED):
                try:
                    async with ae.generate([1], [SamplingParams(temperature=0, ignore_eos=True)]) as s:
                        task_status.started()
                        async for _ in s:
                            await trio.sleep(1)
                except EngineUnavailable as exc:
                    errors.append(exc)
            await outer.start(reader)
        # open_engine exited: worker stopped, the live session got an error
    assert len(errors) == 1
    await assert_clean(ae, None)  # the worker is gone with its engine


async def test_health_of_event_loop_while_thread_steps(autojump_clock) -> None:
    """A model step in a worker thread does not block other trio tasks."""
    engine = make()
    # Off: the autojumping clock runs ahead while the thread steps in real time.
    ae_settings = settings(watchdog_stall_s=None)
    async with trio.open_nursery() as n:
        ae = AsyncEngine(ae_settings, lambda: open_worker_task(engine, in_thread=True), Metrics())
        await n.start(ae.run)
        got = await collect(ae, [1, 2], [GREEDY])
        assert len(got[0]) == 10
        n.cancel_scope.cancel()


async def test_prefix_cache_metrics(autojump_clock) -> None:
    engine = make()
    async with open_engine(settings(), in_process(engine)) as ae:
        shared = list(range(1, 17))  # four pages of 4
        await collect(ae, shared + [20], [GREEDY])
        await collect(ae, shared + [30], [GREEDY])
        m = ae.metrics
        assert m.prefix_cache_queries_total._value.get() == 34
        assert m.prefix_cache_hits_total._value.get() == 16
        assert m.kv_pages_cached._value.get() == engine.num_cached_pages > 0
        await assert_clean(ae, engine)


async def test_finishing_one_choice_stops_its_sequence(autojump_clock) -> None:
    engine = make()
    model = engine.model
    long = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40)
    async with open_engine(settings(), in_process(engine)) as ae:
        got: dict[int, list[int]] = {0: [], 1: []}
        async with ae.generate([4, 5], [long, long]) as stream:
            async for outs in stream:
                for o in outs:
                    got[o.uid[1]] += o.token_ids
                if len(got[0]) >= 3:
                    stream.finish(0)  # as when a stop string matched in choice 0's text
                    stream.finish(0)  # idempotent
        assert got[1] == expected(model, [4, 5], 40)
        assert 3 <= len(got[0]) < 40
        assert ae.metrics.requests_total.labels(finish_reason="stop")._value.get() == 1
        assert ae.metrics.requests_total.labels(finish_reason="length")._value.get() == 1
        await assert_clean(ae, engine)


async def test_wait_sessions_done(autojump_clock) -> None:
    engine = make()
    async with open_engine(settings(), in_process(engine)) as ae:
        await ae.wait_sessions_done()  # none: returns at once
        done = []
        async with trio.open_nursery() as n:
            async def waiter():
                await ae.wait_sessions_done()
                done.append(trio.current_time())
            async def client():
                await trio.sleep(3)
                await collect(ae, [1], [GREEDY])
            n.start_soon(client)
            await trio.sleep(1)
            n.start_soon(waiter)
            await trio.sleep(1)
            assert not done or ae.num_sessions == 0
        assert done and ae.num_sessions == 0


def test_inference_mode_is_entered_in_the_worker_thread(tiny_checkpoint) -> None:
    """Trap 11: grad and inference mode are thread-local; the step runs in a worker thread, so
    inference mode must be entered there, not relied on from the caller's thread: a torch model
    enters it in its own forward (the model runner's sampling after it is numpy, and the CPU
    kernels' model has no torch). Seen from inside the torch model's forward (a hook on its
    final norm), in the worker thread, while the calling thread has grad on."""
    from trio_infer.models.loader import load_model

    model = load_model(tiny_checkpoint)  # a Hugging Face folder: the torch model
    seen = []
    model.model.norm.register_forward_hook(
        lambda *_: seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled())))
    engine = Engine(model, EngineConfig(page_size=4, num_pages=16, max_running=4,
                                        max_batched_tokens=8))

    async def main():
        async with trio.open_nursery() as n:
            ae = AsyncEngine(settings(watchdog_stall_s=None),  # the clock jumps while it steps
                             lambda: open_worker_task(engine, in_thread=True), Metrics())
            await n.start(ae.run)
            with torch.inference_mode(False), torch.enable_grad():
                await collect(ae, [1, 2], [GREEDY])
            n.cancel_scope.cancel()

    trio.run(main)
    assert seen and all(inf and not grad for inf, grad in seen)


async def test_a_worker_that_breaks_the_protocol_is_dropped(autojump_clock, caplog) -> None:
    """Garbage from the worker is a ProtocolError: its requests fail with EngineUnavailable, the
    connection is dropped (and, for a worker process, it is restarted)."""
    from contextlib import asynccontextmanager

    from trio_infer.wire import Hello, encode

    class Broken:
        def __init__(self) -> None:
            self.frames = [encode([Hello("m", VOCAB, 64, 16)])]

        async def send_all(self, data: bytes) -> None:
            self.frames.append(b"\x00\x00\x00\x02\xc1\xc1")  # answers anything with garbage

        async def receive_some(self) -> bytes:
            while not self.frames:
                await trio.sleep(1)
            return self.frames.pop(0)

    @asynccontextmanager
    async def connect():
        yield Broken()

    async with trio.open_nursery() as n:
        ae = AsyncEngine(settings(), connect, Metrics(), restart=False)
        await n.start(ae.run)
        with pytest.raises(EngineUnavailable):
            await collect(ae, [1, 2], [GREEDY])
        assert not ae.healthy and ae.num_sessions == 0 and not ae.live_uids()
        assert "broke the protocol" in caplog.text
        n.cancel_scope.cancel()


async def test_ending_the_choice_that_was_out_of_credits_unpauses_the_session(autojump_clock) -> None:
    """Choice 0 fills its credits while choice 1 is read; a stop string then ends choice 0: the
    session must not stay marked as stalled (it would be aborted after stall_timeout_s)."""
    engine = make()
    long = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40)
    async with open_engine(settings(channel_capacity=2, stall_timeout_s=5), in_process(engine)) as ae:
        async with ae.generate([4, 5], [long, long]) as stream:
            await trio.testing.wait_all_tasks_blocked()  # both choices out of credits: paused
            stream.finish(0)  # choice 0 ends (as when a stop string matched)
            got = []
            async for outs in stream:  # choice 1 is read to its end, slowly
                got += [o for o in outs if o.uid[1] == 1]
                await trio.sleep(1)
            assert got[-1].finish_reason == "length" and sum(len(o.token_ids) for o in got) == 40
        await assert_clean(ae, engine)


async def test_a_request_that_cannot_be_encoded_fails_alone(autojump_clock) -> None:
    """An integer the wire cannot carry (top_k of 10^20) is refused when the request is queued,
    in the request's own task: the connection and the other requests go on."""
    engine = make()
    async with open_engine(settings(), in_process(engine)) as ae:
        async with trio.open_nursery() as n:
            results = {}

            async def other() -> None:
                results["other"] = await collect(ae, [3, 4], [GREEDY])

            n.start_soon(other)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(ValueError, match="cannot be sent"):
                async with ae.generate([1], [GREEDY, SamplingParams(top_k=10**20)]):
                    pass
        assert len(results["other"][0]) == 10 and ae.healthy
        await assert_clean(ae, engine)


async def test_a_front_end_bug_is_not_taken_for_a_worker_death(autojump_clock, monkeypatch, caplog) -> None:
    """Only a worker's death is survived (and restarted); a bug on the front end's side propagates
    out of ``AsyncEngine.run`` and stops the program loudly."""
    def bug(self, stats):
        raise ZeroDivisionError("a bug in the front end")

    monkeypatch.setattr(AsyncEngine, "_update_gauges", bug)
    engine = make()
    with pytest.raises(BaseExceptionGroup) as info:
        async with open_engine(settings(), in_process(engine)) as ae:
            await collect(ae, [1, 2], [GREEDY])
    assert info.group_contains(ZeroDivisionError, match="a bug in the front end")
    assert "batching worker" not in caplog.text  # not reported as the worker's death


def test_the_start_message_carries_the_settings_and_the_log_level_not_the_api_key() -> None:
    import logging

    from trio_infer.runtime.spawn import start_message

    logger = logging.getLogger("trio_infer")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        message = start_message(Settings(api_key="secret-key", max_waiting=7))
    finally:
        logger.setLevel(level)
    assert message.log_level == "DEBUG"  # serve --log-level debug reaches the worker
    assert "secret-key" not in message.settings
    assert Settings.model_validate_json(message.settings).max_waiting == 7
    assert start_message(Settings(), "warning").log_level == "WARNING"
