"""A session's :class:`OutputQueue`: a one-writer, one-reader channel whose reader takes
everything queued in one wait (issue 21, round 4). What the rest of the front end relies on:
the order of outputs, the end after the last one, a parked reader woken by either, a cancelled
reader leaving no trace, and the two closed sides failing as a trio memory channel's do."""

from __future__ import annotations

from itertools import cycle

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


# -- a parked reader's handler (OutputQueue.handle, GenerationStream.handle) ---------------------


async def test_a_parked_readers_handler_takes_outputs_and_the_reader_stays_parked() -> None:
    q = OutputQueue()
    taken: list[int] = []
    q.handle(lambda outs: taken.extend(o.token_ids[0] for o in outs) or True)
    got: list[object] = []

    async def reader() -> None:
        got.append(await q.receive_batch())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(3):
            q.send_nowait(out(i))
        await trio.testing.wait_all_tasks_blocked()
        assert taken == [0, 1, 2] and got == []  # never woken for them
        q.wake()  # the handler wants the reader: an empty read
    assert got == [[]]


async def test_what_the_handler_declines_or_the_reader_is_not_parked_for_goes_to_the_reader() -> None:
    q = OutputQueue()
    offered: list[int] = []

    def decline(outs: list[RequestOutput]) -> bool:
        offered.extend(o.token_ids[0] for o in outs)
        return False

    q.handle(decline)
    q.send_nowait(out(0))  # nobody parked: not offered
    assert offered == [] and [o.token_ids[0] for o in await q.receive_batch()] == [0]
    got: list[list[int]] = []

    async def reader() -> None:
        got.append([o.token_ids[0] for o in await q.receive_batch()])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        q.send_nowait(out(1))  # offered, declined: the reader wakes with it
    assert offered == [1] and got == [[1]]


async def test_a_cancelled_or_departed_reader_is_never_handled_for(autojump_clock) -> None:
    q = OutputQueue()
    calls: list[object] = []
    q.handle(lambda outs: calls.append(outs) or True)
    with trio.move_on_after(1):
        await q.receive_batch()
    q.send_nowait(out(0))  # the reader was cancelled: no longer parked, so queued for it
    assert calls == [] and [o.token_ids[0] for o in await q.receive_batch()] == [0]
    q.close()
    with pytest.raises(trio.EndOfChannel):
        await q.receive_batch()
    r = OutputQueue()
    with r:
        r.handle(lambda outs: calls.append(outs) or True)
    with pytest.raises(trio.BrokenResourceError):
        r.send_nowait(out(1))
    assert calls == []


ops = st.lists(st.sampled_from(["deliver", "deliver", "run", "run", "take", "wake"]),
               min_size=4, max_size=60)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ops=ops, credits=st.integers(1, 6), takes=st.lists(st.booleans(), min_size=1, max_size=8),
       wakes=st.lists(st.booleans(), min_size=1, max_size=8))
def test_every_output_is_read_once_in_order_by_the_handler_or_the_reader(ops, credits, takes, wakes) -> None:
    """A session's reader parked in ``GenerationStream.__anext__`` with a handler that takes or
    declines each offer (and sometimes asks for the reader): whatever the interleaving, every
    output reaches exactly one of them, in order, what it declines reaches the reader, and what the
    handler took gives its credits back as a read does (a reader that keeps up never leaves the
    worker without credits)."""
    router = Router(Metrics(), clock=lambda: 0.0)
    session = router.open(1, [[5]], [SamplingParams()], credits)
    stream = GenerationStream(session)
    seen: list[tuple[str, int]] = []
    choice = {"take": cycle(takes), "wake": cycle(wakes), "on": True}

    def handler(outs: list[RequestOutput]) -> bool:
        if not choice["on"] or not next(choice["take"]) or outs[-1].finish_reason is not None:
            return False  # (TextStream.handle leaves a choice's end to the reader too)
        seen.extend(("handler", o.token_ids[0]) for o in outs)
        if next(choice["wake"]):
            stream.wake()
        return True

    stream.handle(handler)
    sent = 0

    def deliver(finish: str | None = None) -> None:
        nonlocal sent
        router.deliver([RequestOutput((1, 0), [sent], None, finish, None, 1, sent + 1)], [],
                       RequestFailed)
        sent += 1

    async def main() -> None:
        async def reader() -> None:
            async for outs in stream:
                seen.extend(("reader", o.token_ids[0]) for o in outs)
                await trio.lowlevel.checkpoint()  # a reader busy with its read

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            for op in ops:
                if op == "deliver" and session.credits(0) > 0:
                    deliver()
                elif op == "run":
                    await trio.testing.wait_all_tasks_blocked()
                elif op == "take":
                    choice["on"] = not choice["on"]
                elif op == "wake":
                    stream.wake()
                if op == "run" and len(seen) == sent:
                    assert session.credits(0) >= 1 and session.paused_since is None
            await trio.testing.wait_all_tasks_blocked()
            finished = session.credits(0) > 0
            if finished:
                deliver("length")
            else:
                session.close()
        assert [t for _, t in seen] == list(range(sent))
        if finished:
            assert seen[-1][0] == "reader"  # a declined offer: the reader's, after the rest

    trio.run(main)
