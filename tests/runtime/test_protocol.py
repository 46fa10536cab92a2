"""The front end / worker protocol as pure state machines: no process, no event loop, no socket.

The front end's end is the router and its sessions (``runtime/router.py``, ``runtime/session.py``:
their channels are used with ``*_nowait`` only), the worker's is ``WorkerCore``. Both run over a
simulated pipe that delivers bytes in arbitrary pieces; hypothesis chooses the interleaving of
adds, aborts, reads (credits), worker steps and deliveries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trio

from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.metrics import Metrics
from trio_infer.models.fake import FakeModel
from trio_infer.runtime.errors import RequestFailed
from trio_infer.runtime.router import Router
from trio_infer.runtime.session import Session
from trio_infer.runtime.worker import WorkerCore
from trio_infer.wire import (
    Abort,
    Add,
    Credit,
    EngineStatistics,
    FrameDecoder,
    FromWorker,
    Hello,
    Loading,
    ProtocolError,
    RequestOutput,
    SamplingParams,
    Start,
    Step,
    ToWorker,
    encode,
)

VOCAB = 97


def test_frames_survive_any_split() -> None:
    params = SamplingParams(temperature=0, max_tokens=3, stop_token_ids=(1, 2))
    messages = [Start("{}", "DEBUG"), Add((1, 0), [1, 2, 3], params, 4), Credit((1, 0), 2),
                Abort((1, 0))]
    data = encode(messages[:3]) + encode(messages[3:])
    for cut in range(len(data) + 1):
        decoder = FrameDecoder(ToWorker)
        got = list(decoder.feed(data[:cut])) + list(decoder.feed(data[cut:]))
        assert got == messages


def test_garbage_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        list(FrameDecoder(ToWorker).feed(b"\x00\x00\x00\x02\xc1\xc1"))
    with pytest.raises(ProtocolError):
        list(FrameDecoder(ToWorker).feed(b"\xff\xff\xff\xff"))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sampling_params_are_checked_when_decoded_too() -> None:
    """A worker never sees parameters the front end could not have built."""
    data = encode([Add((1, 0), [1], SamplingParams(), 1)]).replace(b"\xcb?\xf0", b"\xcb\xbf\xf0", 1)
    with pytest.raises(ProtocolError, match="temperature"):
        FrameDecoder(ToWorker).feed(data)  # temperature -1.0


def test_an_output_without_a_credit_is_refused() -> None:
    router = Router(Metrics(), clock=Clock())
    session = router.open(1, [[5]], [SamplingParams()], credits=1)
    out = RequestOutput((1, 0), [3], None, None, None, 1, 1)
    router.deliver([out], [], RequestFailed)
    assert session.credits(0) == 0 and router.oldest_paused() is session
    with pytest.raises(ProtocolError, match="without a credit"):
        router.deliver([out], [], RequestFailed)


def test_credits_go_back_a_quarter_of_the_window_at_a_time_and_at_once_when_low() -> None:
    """One credit message for several outputs taken; but never while the worker holds fewer
    than a quarter of the window (a reader that keeps up must not run it dry)."""
    router = Router(Metrics(), clock=Clock())
    session = router.open(1, [[5]], [SamplingParams()], credits=8)  # a quarter: 2
    router.data_to_send()  # the Add

    def out() -> RequestOutput:
        return RequestOutput((1, 0), [3], None, None, None, 1, 1)

    def read_one() -> list[object]:
        router.deliver([out()], [], RequestFailed)
        session.take([session.outputs.receive_nowait()])
        return FrameDecoder(ToWorker).feed(router.data_to_send())

    assert read_one() == [] and session.credits(0) == 7  # owed 1: held back
    assert read_one() == [Credit((1, 0), 2)] and session.credits(0) == 8
    router.deliver([out()] * 7, [], RequestFailed)  # the worker holds 1: fewer than a quarter
    session.take([session.outputs.receive_nowait()])
    assert FrameDecoder(ToWorker).feed(router.data_to_send()) == [Credit((1, 0), 1)]
    assert session.credits(0) == 2
    for _ in range(5):  # the reader takes 5 of the 6 left: 2 + 2 go back, 1 is held back
        session.take([session.outputs.receive_nowait()])
    assert FrameDecoder(ToWorker).feed(router.data_to_send()) == [Credit((1, 0), 4)]
    assert session.credits(0) == 6
    # The worker spends them; the one owed goes back before it would run dry, not after.
    router.deliver([out()] * 5, [], RequestFailed)
    assert FrameDecoder(ToWorker).feed(router.data_to_send()) == [Credit((1, 0), 1)]
    assert session.credits(0) == 2 and session.paused_since is None


def test_a_session_owns_its_uids_credits_and_pause() -> None:
    clock = Clock()
    router = Router(Metrics(), clock=clock)
    session = router.open(7, [[5], [6]], [SamplingParams()], credits=2)
    assert router.live_uids() == [(7, 0), (7, 1)] and router.num_waiting == 2
    clock.now = 1.0
    router.deliver([], [], RequestFailed, admitted=[(7, 0)])  # a first scheduling: out of the queue
    assert router.num_waiting == 1 and router.waiting_tokens == 1 and router.oldest_queued() is None
    router.deliver([RequestOutput((7, 0), [3], None, None, None, 1, 1)] * 2, [], RequestFailed)
    assert router.num_waiting == 1 and session.paused_since == 1.0
    outs = [session.outputs.receive_nowait(), session.outputs.receive_nowait()]
    session.take(outs)  # two credits back: resumed
    assert session.paused_since is None and router.oldest_paused() is None
    session.finish(1)  # a stop string: aborted in the worker, and out of the queue
    assert router.live_uids() == [(7, 0)] and router.num_waiting == 0 and router.waiting_tokens == 0
    frame = FrameDecoder(ToWorker).feed(router.data_to_send())
    assert [type(m) for m in frame] == [Add, Add, Abort, Credit]
    router.deliver([RequestOutput((7, 1), [4], None, None, None, 1, 1)], [], RequestFailed)  # dropped
    session.close()
    assert router.num_sessions == 0 and router.live_uids() == []
    assert FrameDecoder(ToWorker).feed(router.data_to_send()) == [Abort((7, 0))]
    with pytest.raises(trio.EndOfChannel):
        session.outputs.receive_nowait()


def test_a_request_that_cannot_be_encoded_leaves_nothing_behind() -> None:
    router = Router(Metrics(), clock=Clock())
    with pytest.raises(ValueError, match="cannot be sent"):
        router.open(1, [[5]], [SamplingParams(), SamplingParams(top_k=10**20)], credits=1)
    assert router.num_sessions == 0 and router.num_waiting == 0 and router.data_to_send() == b""


def test_load_progress_comes_before_the_hello() -> None:
    decoder = FrameDecoder(FromWorker)
    data = encode([Loading("weights", 0, 9), Loading("weights", 4, 9)]) + encode([Loading("engine")])
    first = decoder.feed(data[:-3])
    assert first == [Loading("weights", 0, 9), Loading("weights", 4, 9)]
    second = decoder.feed(data[-3:] + encode([Hello("m", 97, 64, 8)]))
    assert second == [Loading("engine", None, None), Hello("m", 97, 64, 8)]


@dataclass
class Pipe:
    """Bytes in flight in one direction, delivered in pieces of the test's choosing."""

    data: bytearray = field(default_factory=bytearray)

    def take(self, n: int | None) -> bytes:
        n = len(self.data) if n is None else min(n, len(self.data))
        piece = bytes(self.data[:n])
        del self.data[:n]
        return piece


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 12), st.integers(1, 3), st.integers(1, 9)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("read"), st.integers(0, 50), st.integers(1, 4)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("to_worker"), st.one_of(st.none(), st.integers(1, 64))),
    st.tuples(st.just("to_client"), st.one_of(st.none(), st.integers(1, 64))),
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(ops=st.lists(op, max_size=80), credits=st.integers(1, 9), num_pages=st.integers(4, 24))
def test_any_interleaving_keeps_the_bound_and_ends_every_uid_once(ops, credits, num_pages) -> None:
    model = FakeModel(vocab_size=VOCAB, eos_token_id=0)
    engine = Engine(model, EngineConfig(page_size=2, num_pages=num_pages, max_running=4,
                                        max_batched_tokens=8))
    worker, client = WorkerCore(engine), Router(Metrics(), clock=Clock())
    sessions: dict[int, Session] = {}
    to_worker, to_client = Pipe(), Pipe()
    unread: dict[tuple[int, int], list[RequestOutput]] = {}  # delivered, not taken by the reader
    tokens: dict[tuple[int, int], list[int]] = {}
    prompts: dict[tuple[int, int], list[int]] = {}
    ends: dict[tuple[int, int], list[str]] = {}
    next_id = 1

    def end(uid, how) -> None:
        ends.setdefault(uid, []).append(how)

    decoder = FrameDecoder(FromWorker)

    def deliver(n) -> None:
        for step in decoder.feed(to_client.take(n)):
            client.deliver(step.outputs, [], RequestFailed)
            drain()
            for f in step.failed:  # a failure ends the whole request
                session = sessions[f.uid[0]]
                if session.is_live(f.uid[1]):
                    for uid in session.live_uids:
                        end(uid, "failed" if uid == f.uid else "abort")
                client.deliver([], [f], RequestFailed)

    def drain() -> None:
        for session in sessions.values():  # what the sessions' channels now hold
            while True:
                try:
                    out = session.outputs.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                unread[out.uid].append(out)
                tokens[out.uid].extend(out.token_ids)
                # The bound: what exists of a uid on the front end never exceeds its credits.
                assert len(unread[out.uid]) <= credits, f"{out.uid}: {len(unread[out.uid])} unread"
                if out.finish_reason is not None:
                    end(out.uid, out.finish_reason)

    def read(uid, k) -> None:
        taken, unread[uid] = unread[uid][:k], unread[uid][k:]
        sessions[uid[0]].take(taken)

    def step() -> None:
        to_worker_bytes = to_worker.take(None)
        if to_worker_bytes:
            worker.receive_data(to_worker_bytes)
        plan = worker.schedule()
        to_client.data += worker.run_step(plan) if plan is not None else worker.idle_frame()

    for o in ops:
        kind = o[0]
        if kind == "add":
            _, plen, n, max_tokens = o
            prompt = [(next_id * 7 + j) % (VOCAB - 1) + 1 for j in range(plen)]
            sessions[next_id] = client.open(
                next_id, [prompt], [SamplingParams(temperature=0, max_tokens=max_tokens)] * n,
                credits)
            for i in range(n):
                uid = (next_id, i)
                prompts[uid] = prompt
                unread[uid], tokens[uid] = [], []
            next_id += 1
        elif kind == "abort" and client.live_uids():
            live = client.live_uids()
            uid = live[o[1] % len(live)]
            sessions[uid[0]].finish(uid[1])  # ends that choice alone, on the front end's side
            end(uid, "abort")
        elif kind == "read" and unread:
            uids = sorted(unread)
            read(uids[o[1] % len(uids)], o[2])
        elif kind == "step":
            step()
        elif kind == "to_worker":
            to_worker.data += client.data_to_send()
            worker.receive_data(to_worker.take(o[1]))
        elif kind == "to_client":
            deliver(o[1])

    # Then a reader that reads everything, every few steps, until nothing moves.
    for _ in range(300):
        for uid in list(unread):
            read(uid, len(unread[uid]))
        to_worker.data += client.data_to_send()
        for _ in range(credits + 1):
            step()
            deliver(None)
        if not client.live_uids() and not worker.live_uids and not to_client.data:
            break
    assert not client.live_uids() and not worker.live_uids
    assert engine.num_requests == 0 and engine.num_request_pages == 0
    for uid in prompts:
        assert len(ends.get(uid, [])) == 1, f"{uid} ended {ends.get(uid)}"
        if ends[uid][0] in ("stop", "length"):  # finished: exactly the fake model's tokens
            seq, want = list(prompts[uid]), []
            for _ in range(len(tokens[uid])):
                want.append(model.next_token(seq))
                seq.append(want[-1])
            assert tokens[uid] == want
