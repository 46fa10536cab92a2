"""A session's :class:`OutputQueue`: a one-writer, one-reader channel whose reader takes
everything queued in one wait. What the rest of the front end relies on:
the order of outputs, the end after the last one, a parked reader woken by either, a cancelled
reader leaving no trace, and the two closed sides failing as a trio memory channel's do."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_infer.metrics import Metrics
from trio_infer.runtime.errors import RequestFailed
from trio_infer.runtime.router import Router
from trio_infer.runtime.session import GenerationStream, OutputQueue
from trio_infer.wire import RequestOutput, SamplingParams


def out(i: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput((1, 0), [i], None, finish, None, 1, i)


async def test_a_read_takes_everything_queued_in_order() -> None:
    q = OutputQueue()
    for i in range(3):
        q.send_nowait(out(i))
    assert [o.token_ids[0] for o in await q.receive_batch()] == [0, 1, 2]
    with pytest.raises(trio.WouldBlock):
        q.receive_nowait()
    q.send_nowait(out(3, "stop"))
    q.close()
    assert [o.token_ids[0] for o in await q.receive_batch()] == [3]  # what was queued, then
    with pytest.raises(trio.EndOfChannel):
        await q.receive_batch()
    with pytest.raises(trio.EndOfChannel):
        q.receive_nowait()


async def test_a_parked_reader_wakes_on_a_delivery_and_on_the_end() -> None:
    q = OutputQueue()
    got: list[object] = []

    async def reader() -> None:
        while True:
            try:
                got.append([o.token_ids[0] for o in await q.receive_batch()])
            except trio.EndOfChannel:
                got.append("end")
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        q.send_nowait(out(0))
        q.send_nowait(out(1))  # before the reader runs: the same read
        await trio.testing.wait_all_tasks_blocked()
        assert got == [[0, 1]]
        q.close()
    assert got == [[0, 1], "end"]


async def test_a_cancelled_reader_leaves_no_waiter_behind(autojump_clock) -> None:
    q = OutputQueue()
    with trio.move_on_after(1) as scope:
        await q.receive_batch()
    assert scope.cancelled_caught
    q.send_nowait(out(7))  # would reschedule the cancelled task if it were still registered
    assert [o.token_ids[0] for o in await q.receive_batch()] == [7]


async def test_the_closed_sides_fail_as_a_memory_channels_do() -> None:
    q = OutputQueue()
    q.close()
    with pytest.raises(trio.ClosedResourceError):
        q.send_nowait(out(0))
    r = OutputQueue()
    with r:  # the reader leaves: what is queued is dropped, and a delivery is refused
        r.send_nowait(out(0))
    with pytest.raises(trio.BrokenResourceError):
        r.send_nowait(out(1))
    with pytest.raises(trio.ClosedResourceError):
        await r.receive_batch()


ops = st.lists(st.sampled_from(["deliver", "deliver", "run"]), min_size=4, max_size=60)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ops=ops, credits=st.integers(1, 6))
def test_every_output_is_read_once_in_order_and_gives_its_credit_back(ops, credits) -> None:
    """A session's reader in ``GenerationStream.__anext__``, outputs delivered between its
    reads in any interleaving: every output reaches it exactly once, in order, and each read
    gives its credits back (a reader that keeps up never leaves the worker without credits)."""
    router = Router(Metrics(), clock=lambda: 0.0)
    session = router.open(1, [[5]], [SamplingParams()], credits)
    stream = GenerationStream(session)
    seen: list[int] = []
    sent = 0

    def deliver(finish: str | None = None) -> None:
        nonlocal sent
        router.deliver([RequestOutput((1, 0), [sent], None, finish, None, 1, sent + 1)], [],
                       RequestFailed)
        sent += 1

    async def main() -> None:
        async def reader() -> None:
            async for outs in stream:
                seen.extend(o.token_ids[0] for o in outs)
                await trio.lowlevel.checkpoint()  # a reader busy with its read

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            for op in ops:
                if op == "deliver" and session.credits(0) > 0:
                    deliver()
                elif op == "run":
                    await trio.testing.wait_all_tasks_blocked()
                    if len(seen) == sent:
                        assert session.credits(0) >= 1 and session.paused_since is None
            await trio.testing.wait_all_tasks_blocked()
            if session.credits(0) > 0:
                deliver("length")
            else:
                session.close()
        assert seen == list(range(sent))

    trio.run(main)
