"""The protocol between the front end and the batching worker: messages, framing, flow control.

Sans-IO, in the style of h11: nothing here reads a socket, starts a process or awaits. Each end
is a small state machine that takes bytes (or calls) in and gives bytes (or events) out, so both
are unit-tested without processes, and the same code runs over a pipe to a worker process and
over an in-memory transport in tests.

Messages (msgpack through msgspec, one *frame* = a 4-byte big-endian length + a msgpack array of
messages; each direction batches everything it has into one frame):

* front end -> worker: :class:`Add` (a sequence: uid, prompt ids, sampling parameters, its first
  credits), :class:`Abort` (the request ended on the front end's side: the client left, a stop
  string matched, the reader stalled), :class:`Credit` (the reader took outputs).
* worker -> front end: :class:`Loading` (while the model loads: which phase, and tensors loaded
  of total), :class:`Hello` (once, when the model is loaded), :class:`Step` (once per engine
  step: every output of the step, the sequences the worker ended on its own with an error, and
  the engine's statistics), :class:`Fatal` (the worker cannot go on; it exits after it).

Flow control is credit-based, per uid (a uid is one sequence: ``(request id, choice index)``).
A sequence starts with ``credits`` credits; the worker emits an output only against a credit and
pauses a sequence that has none left (its KV cache stays); the front end returns a credit for
every output its reader takes. So the outputs of a uid that exist anywhere (in the worker's send
buffer, in the pipe, in the request's channel) never exceed its initial credits, whatever the
reader does: the bound holds by construction, across the process boundary, and nothing is ever
dropped.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator, Union

import msgspec

from trio_infer.engine.params import SamplingParams
from trio_infer.engine.sampler import TokenLogprob

Uid = tuple[int, int]  # (request id, choice index)


# -- front end -> worker ---------------------------------------------------------------------------


class Add(msgspec.Struct, tag="add", array_like=True):
    uid: Uid
    prompt_ids: list[int]
    params: SamplingParams
    credits: int


class Abort(msgspec.Struct, tag="abort", array_like=True):
    uid: Uid


class Credit(msgspec.Struct, tag="credit", array_like=True):
    uid: Uid
    n: int


ToWorker = Union[Add, Abort, Credit]


# -- worker -> front end ---------------------------------------------------------------------------


class Loading(msgspec.Struct, tag="loading", array_like=True):
    """Where a load stands, for ``/v1/status``. Phases: ``"weights"`` (``done`` of ``total``
    tensors read), then ``"engine"`` (the grammar tables and the KV cache); the front end adds its
    own, ``"tokenizer"`` and ``"worker"`` (the process is starting). Counts are None where
    nothing is counted."""

    phase: str
    done: int | None = None
    total: int | None = None


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """The worker is ready: what the front end needs to know about the served model."""

    name: str
    vocab_size: int
    max_model_len: int
    num_pages: int
    id_offset: int = 0  # this front end numbers its requests id_offset + k * id_stride, k >= 1
    id_stride: int = 1
    kernels: str = ""  # the compute path: "cpu-kernels", "triton" or "torch-reference"
    kernels_problem: str | None = None  # why a slower path serves, and what it costs
    kv_cache_dtype: str = ""  # "float16", "float32", ...


class Output(msgspec.Struct, array_like=True):
    """What one step produced for one sequence: one new token, maybe a finish.

    ``prompt_logprobs`` is set on a sequence's first output only, and only when its parameters
    asked for them (entry 0 is None); every other output carries a nil there. A sequence with
    ``max_tokens == 0`` has one output, without a token.
    """

    uid: Uid
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_token_id: int | None  # the EOS/stop token that ended it (it is in token_ids)
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Failed(msgspec.Struct, array_like=True):
    """A sequence the worker ended with an error: its step raised, or it was refused."""

    uid: Uid
    message: str


class Stats(msgspec.Struct, array_like=True):
    """The engine's gauges and counters after a step (see ``Engine.statistics``)."""

    running: int
    waiting: int
    pages_used: int
    pages_cached: int
    pages_total: int
    prefix_queries: int
    prefix_hits: int


class Step(msgspec.Struct, tag="step", array_like=True):
    outputs: list[Output]
    failed: list[Failed]
    stats: Stats


class Fatal(msgspec.Struct, tag="fatal", array_like=True):
    message: str


FromWorker = Union[Loading, Hello, Step, Fatal]


class ProtocolError(Exception):
    """The other end broke the protocol (a bug, never a client's doing)."""


# -- framing ---------------------------------------------------------------------------------------

_LEN = struct.Struct(">I")
MAX_FRAME = 256 * 2**20
_encoder = msgspec.msgpack.Encoder()


def encode(messages: list) -> bytes:
    """One frame holding ``messages``."""
    body = _encoder.encode(messages)
    return _LEN.pack(len(body)) + body


class FrameDecoder:
    """Bytes in, messages out: feed what the transport delivered, get the complete messages."""

    def __init__(self, message_type: object) -> None:
        self._decoder = msgspec.msgpack.Decoder(list[message_type])  # type: ignore[valid-type]
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator:
        self._buffer += data
        buf = self._buffer
        start = 0
        while len(buf) - start >= 4:
            (size,) = _LEN.unpack_from(buf, start)
            if size > MAX_FRAME:
                raise ProtocolError(f"frame of {size} bytes")
            end = start + 4 + size
            if end > len(buf):
                break
            try:
                messages = self._decoder.decode(memoryview(buf)[start + 4 : end])
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"undecodable frame: {exc}") from None
            start = end
            yield from messages
        del buf[:start]


# -- the front end's side --------------------------------------------------------------------------


@dataclass
class Delivery:
    """What a frame from the worker means for the front end (see :meth:`ClientProtocol.receive_data`)."""

    outputs: list[Output]  # outputs of live uids, in order
    failed: list[Failed]  # live uids the worker ended with an error (they are gone now)
    stats: Stats | None  # the newest statistics in the frame
    hello: Hello | None
    fatal: Fatal | None
    loading: Loading | None = None  # the newest progress report in the frame


class ClientProtocol:
    """The front end's end of the protocol: which uids are live and how many credits each has.

    ``credits(uid)`` is what the worker may still send for ``uid`` once every credit returned so
    far has arrived: ``credits - outputs received + credits returned``. It reaches 0 only when
    the reader has left ``credits`` outputs untaken: that is how the front end tells a stalled
    reader.
    """

    def __init__(self) -> None:
        self._credits: dict[Uid, int] = {}
        self._outbox: list[ToWorker | msgspec.Raw] = []  # an Add is encoded when it is queued
        self._returned: dict[Uid, int] = {}
        self._decoder = FrameDecoder(FromWorker)

    # calls from the front end

    def add(self, uid: Uid, prompt_ids: list[int], params: SamplingParams, credits: int) -> None:
        """Queue a sequence. Raises ValueError for what cannot go on the wire (an integer beyond
        64 bits, say): it is encoded here, so a bad request fails alone, in its own task, and
        never breaks the frame that carries everyone else's messages."""
        if uid in self._credits:
            raise ValueError(f"uid {uid} is already live")
        if credits < 1:
            raise ValueError("a sequence needs at least one credit")
        try:
            message = msgspec.Raw(_encoder.encode(Add(uid, prompt_ids, params, credits)))
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:
            raise ValueError(f"the request cannot be sent to the worker: {exc}") from None
        self._credits[uid] = credits
        self._outbox.append(message)

    def abort(self, uid: Uid) -> bool:
        """End ``uid`` on the front end's side. False if it was not live (already ended)."""
        if self._credits.pop(uid, None) is None:
            return False
        self._returned.pop(uid, None)
        self._outbox.append(Abort(uid))
        return True

    def give_credit(self, uid: Uid, n: int = 1) -> None:
        """The reader took ``n`` outputs of ``uid``: the worker may send ``n`` more."""
        if uid in self._credits:
            self._credits[uid] += n
            self._returned[uid] = self._returned.get(uid, 0) + n

    def credits(self, uid: Uid) -> int:
        return self._credits.get(uid, 0)

    @property
    def live_uids(self) -> list[Uid]:
        return list(self._credits)

    def data_to_send(self) -> bytes:
        """Everything queued since the last call, as one frame (b"" if nothing)."""
        if not self._outbox and not self._returned:
            return b""
        messages: list[ToWorker | msgspec.Raw] = self._outbox
        messages.extend(Credit(uid, n) for uid, n in self._returned.items())
        self._outbox, self._returned = [], {}
        return encode(messages)

    def reset(self) -> list[Uid]:
        """The worker is gone: forget every uid and everything queued. Returns the live uids."""
        live = list(self._credits)
        self._credits.clear()
        self._outbox.clear()
        self._returned.clear()
        self._decoder = FrameDecoder(FromWorker)
        return live

    # data from the worker

    def receive_data(self, data: bytes) -> Delivery:
        outputs: list[Output] = []
        failed: list[Failed] = []
        stats = hello = fatal = loading = None
        credits = self._credits
        for message in self._decoder.feed(data):
            if type(message) is Step:
                for out in message.outputs:
                    left = credits.get(out.uid)
                    if left is None:
                        continue  # ended here while the output was on its way: drop it
                    if left <= 0:
                        raise ProtocolError(f"output for {out.uid} without a credit")
                    if out.finish_reason is None:
                        credits[out.uid] = left - 1
                    else:
                        del credits[out.uid]
                        self._returned.pop(out.uid, None)
                    outputs.append(out)
                for f in message.failed:
                    if credits.pop(f.uid, None) is not None:
                        self._returned.pop(f.uid, None)
                        failed.append(f)
                stats = message.stats
            elif type(message) is Loading:
                loading = message
            elif type(message) is Hello:
                hello = message
            else:
                fatal = message
        return Delivery(outputs, failed, stats, hello, fatal, loading)
