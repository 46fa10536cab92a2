"""The front end / worker protocol as pure state machines: no process, no trio, no socket.

Both ends run over a simulated pipe that delivers bytes in arbitrary pieces; hypothesis chooses
the interleaving of adds, aborts, reads (credits), worker steps and deliveries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.engine.params import SamplingParams
from trio_infer.models.fake import FakeModel
from trio_infer.runtime.protocol import (
    Abort,
    Add,
    ClientProtocol,
    Credit,
    FrameDecoder,
    Hello,
    Loading,
    Output,
    ProtocolError,
    Stats,
    Step,
    ToWorker,
    encode,
)
from trio_infer.runtime.worker import WorkerCore

VOCAB = 97


def test_frames_survive_any_split() -> None:
    params = SamplingParams(temperature=0, max_tokens=3, stop_token_ids=(1, 2))
    messages = [Add((1, 0), [1, 2, 3], params, 4), Credit((1, 0), 2), Abort((1, 0))]
    data = encode(messages[:2]) + encode(messages[2:])
    for cut in range(len(data) + 1):
        decoder = FrameDecoder(ToWorker)
        got = list(decoder.feed(data[:cut])) + list(decoder.feed(data[cut:]))
        assert got == messages


def test_garbage_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        list(FrameDecoder(ToWorker).feed(b"\x00\x00\x00\x02\xc1\xc1"))
    with pytest.raises(ProtocolError):
        list(FrameDecoder(ToWorker).feed(b"\xff\xff\xff\xff"))


def test_an_output_without_a_credit_is_refused() -> None:
    client = ClientProtocol()
    client.add((1, 0), [5], SamplingParams(), credits=1)
    stats = Stats(0, 0, 0, 0, 1, 0, 0)
    out = Output((1, 0), [3], None, None, None, 1, 1)
    client.receive_data(encode([Step([out], [], stats)]))
    assert client.credits((1, 0)) == 0
    with pytest.raises(ProtocolError, match="without a credit"):
        client.receive_data(encode([Step([out], [], stats)]))


def test_load_progress_comes_before_the_hello() -> None:
    client = ClientProtocol()
    data = encode([Loading("weights", 0, 9), Loading("weights", 4, 9)]) + encode([Loading("engine")])
    first = client.receive_data(data[:-3])
    assert first.loading == Loading("weights", 4, 9) and first.hello is None  # the newest
    second = client.receive_data(data[-3:] + encode([Hello("m", 97, 64, 8)]))
    assert second.loading == Loading("engine", None, None) and second.hello is not None


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
@given(ops=st.lists(op, max_size=80), credits=st.integers(1, 3), num_pages=st.integers(4, 24))
def test_any_interleaving_keeps_the_bound_and_ends_every_uid_once(ops, credits, num_pages) -> None:
    model = FakeModel(vocab_size=VOCAB, eos_token_id=0)
    engine = Engine(model, EngineConfig(page_size=2, num_pages=num_pages, max_running=4,
                                        max_batched_tokens=8))
    worker, client = WorkerCore(engine), ClientProtocol()
    to_worker, to_client = Pipe(), Pipe()
    unread: dict[tuple[int, int], list[Output]] = {}  # delivered, not taken by the reader
    tokens: dict[tuple[int, int], list[int]] = {}
    prompts: dict[tuple[int, int], list[int]] = {}
    ends: dict[tuple[int, int], list[str]] = {}
    next_id = 1

    def end(uid, how) -> None:
        ends.setdefault(uid, []).append(how)

    def deliver(n) -> None:
        delivery = client.receive_data(to_client.take(n))
        for out in delivery.outputs:
            unread[out.uid].append(out)
            tokens[out.uid].extend(out.token_ids)
            # The bound: what exists of a uid on the front end never exceeds its credits.
            assert len(unread[out.uid]) <= credits, f"{out.uid}: {len(unread[out.uid])} unread"
            if out.finish_reason is not None:
                end(out.uid, out.finish_reason)
        for failed in delivery.failed:
            end(failed.uid, "failed")

    def read(uid, k) -> None:
        taken, unread[uid] = unread[uid][:k], unread[uid][k:]
        running = [o for o in taken if o.finish_reason is None]
        if running:
            client.give_credit(uid, len(running))

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
            for i in range(n):
                uid = (next_id, i)
                prompts[uid] = [(next_id * 7 + j) % (VOCAB - 1) + 1 for j in range(plen)]
                client.add(uid, prompts[uid], SamplingParams(temperature=0, max_tokens=max_tokens),
                           credits)
                unread[uid], tokens[uid] = [], []
            next_id += 1
        elif kind == "abort" and client.live_uids:
            uid = client.live_uids[o[1] % len(client.live_uids)]
            assert client.abort(uid)
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
        if not client.live_uids and not worker.live_uids and not to_client.data:
            break
    assert not client.live_uids and not worker.live_uids
    assert engine.num_requests == 0 and engine.num_request_pages == 0
    for uid in prompts:
        assert len(ends.get(uid, [])) == 1, f"{uid} ended {ends.get(uid)}"
        if ends[uid][0] in ("stop", "length"):  # finished: exactly the fake model's tokens
            seq, want = list(prompts[uid]), []
            for _ in range(len(tokens[uid])):
                want.append(model.next_token(seq))
                seq.append(want[-1])
            assert tokens[uid] == want
