"""Everything that crosses the process boundary, and how it is framed. Torch-free on purpose.

The front end (HTTP, sessions, text) and the batching worker (the engine) are two processes; this
module is the whole of what they share. The engine builds these types itself and returns them
(:class:`SamplingParams` in, :class:`RequestOutput` and :class:`EngineStatistics` out), so the
worker puts them on the wire as they are: no copy at the boundary, and a field added on one side
is on the other. Nothing here imports torch, transformers or the engine, so a front end that
imports this module (and it imports nothing heavier) stays a few tens of MB: the process-boundary
is a module boundary.

Messages are msgspec structs, encoded as msgpack arrays. A *frame* is a 4-byte big-endian length
and a msgpack array of messages; each side batches everything it has into one frame.

* front end -> worker: :class:`Start` (once, first, from whoever spawned the worker: the settings
  and the log level), :class:`Add` (a sequence: uid, prompt ids, sampling parameters, its first
  credits), :class:`Abort` (the request ended on the front end's side: the client left, a stop
  string matched, the reader stalled), :class:`Credit` (the reader took outputs).
* worker -> front end: :class:`Loading` (while the model loads), :class:`Hello` (once, when the
  model is loaded), :class:`Step` (once per engine step: every output of the step, the sequences
  the worker ended on its own with an error, the sequences it admitted, and the engine's
  statistics), :class:`Fatal` (the
  worker cannot go on; it exits after it).

Flow control (credits) is described in ``runtime/router.py``, the front end's end.
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

Uid = tuple[int, int]  # (request id, choice index); the engine passes any hashable through


# -- what the engine takes and returns --------------------------------------------------------------


class SamplingParams(msgspec.Struct, frozen=True, array_like=True):
    """How one sequence is sampled and when it stops (the API layer maps OpenAI's parameters).

    ``temperature == 0`` means greedy. ``max_tokens=None`` means "until the context is full";
    ``max_tokens=0`` means no token at all: the prompt is prefilled (for its ``prompt_logprobs``)
    and the sequence finishes with "length" without sampling.
    ``logprobs=None`` returns no logprobs; ``logprobs=k`` returns the chosen token's logprob and
    the ``k`` most likely alternatives (k may be 0). ``prompt_logprobs=k`` does the same for every
    prompt token but the first (which has no context: its entry is None), computed from the
    prefill's own logits and delivered with the sequence's first output.
    ``grammar`` constrains the output: the JSON text of an llguidance grammar (the front end builds
    and validates it, ``api/structured.py``); the engine compiles it and masks every step's logits
    with it (``engine/grammar.py``). Such a sequence ends only when its grammar is complete (EOS,
    or nothing more can follow), or by ``max_tokens`` or the context ("length").
    ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before the sequence has that
    many output tokens. ``repetition_penalty`` (1 = none): the logit of every token already in
    the prompt or the output is divided by it when positive, multiplied when negative (vLLM's,
    CTRL's). ``logit_bias``: (token id, bias) pairs added to those tokens' logits (OpenAI's).
    ``thinking_budget`` with ``think_ids`` (the open and close tags' token ids): once the sequence
    has thought that many tokens (after an open tag, in its prompt or its output, with no close
    tag since), the close tag is the only token it may sample.

    Checked when built and again when decoded (``__post_init__`` runs for both), so a worker
    never sees parameters the front end could not have built.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    thinking_budget: int | None = None
    think_ids: tuple[int, ...] = ()  # (open, close) when thinking_budget is set
    priority: int = 0  # vLLM's: a lower value is admitted first and preempted last
    # False: never speculate for this sequence (one token per step) even where the server does.
    speculative: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.thinking_budget is not None and (self.thinking_budget < 0 or len(self.think_ids) != 2):
            raise ValueError("thinking_budget must be >= 0 and come with the two think_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusted(self) -> bool:
        """Whether the sampler changes this sequence's logits before the grammar's mask
        (penalties, ``repetition_penalty``, ``logit_bias``)."""
        return self.penalized or self.repetition_penalty != 1.0 or bool(self.logit_bias)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely alternatives, best first


class RequestOutput(msgspec.Struct, array_like=True):
    """What one step produced for one sequence: at most one new token, maybe a finish.

    A sequence's first output carries its prompt logprobs when it asked for them (entry 0, the
    first prompt token's, is None); every other output carries a nil there. A sequence with
    ``max_tokens == 0`` has exactly one output, with no token, once its prompt is prefilled.
    """

    uid: Uid
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_token_id: int | None  # the EOS/stop token that ended it (it is in token_ids)
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (usage's cached tokens)


class EngineStatistics(msgspec.Struct, array_like=True):
    """The engine's gauges and counters after a step (see ``Engine.statistics``)."""

    running: int  # sequences admitted (holding KV pages)
    waiting: int  # sequences queued or preempted
    pages_used: int
    pages_cached: int  # held by the prefix cache (some may be in use by running requests too)
    pages_total: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int  # of which served from it
    # Since start: sequence-steps that sampled and the tokens they emitted (tokens per step), and
    # the speculative guesses proposed and accepted (engine/speculative.py).
    sample_steps: int = 0
    sampled_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    # The draft model's page pool (speculative=draft, engine/draft.py); 0 and 0 without one.
    draft_pages_used: int = 0
    draft_pages_total: int = 0


# -- front end -> worker ------------------------------------------------------------------------------


class Start(msgspec.Struct, tag="start", array_like=True):
    """What a new worker process needs before it loads anything: the settings (as the JSON of
    ``Settings``, without the API key, which a worker has no use for) and the log level of the
    process that started it (``serve --log-level``)."""

    settings: str
    log_level: str = "INFO"


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


ToWorker = Union[Start, Add, Abort, Credit]


# -- worker -> front end ------------------------------------------------------------------------------


class Loading(msgspec.Struct, tag="loading", array_like=True):
    """Where a load stands, for ``/v1/status``. Phases: ``"weights"`` (``done`` of ``total``
    tensors read), then ``"engine"`` (the KV cache); the front end adds its
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


class Failed(msgspec.Struct, array_like=True):
    """A sequence the worker ended with an error: its step raised, or it was refused."""

    uid: Uid
    message: str


class Step(msgspec.Struct, tag="step", array_like=True):
    """One engine step. ``admitted``: the sequences this step scheduled for the first time (their
    prefill starts in it), so the front end knows when a request stopped waiting (the
    queue-time limit, the queue-time histogram, the drain rate behind ``Retry-After``)."""

    outputs: list[RequestOutput]
    failed: list[Failed]
    stats: EngineStatistics
    admitted: list[Uid] = []


class Fatal(msgspec.Struct, tag="fatal", array_like=True):
    message: str


FromWorker = Union[Loading, Hello, Step, Fatal]


class ProtocolError(Exception):
    """The other end broke the protocol (a bug, never a client's doing)."""


# -- framing --------------------------------------------------------------------------------------

_LEN = struct.Struct(">I")
MAX_FRAME = 256 * 2**20
_encoder = msgspec.msgpack.Encoder()


def encode(messages: list) -> bytes:
    """One frame holding ``messages`` (structs, or ``msgspec.Raw`` of structs encoded earlier)."""
    body = _encoder.encode(messages)
    return _LEN.pack(len(body)) + body


def encode_message(message: object) -> msgspec.Raw:
    """``message`` encoded now, to go into a later frame: what cannot go on the wire (an integer
    beyond 64 bits, say) fails here, in the caller's hands, and never breaks the frame that
    carries everyone else's messages. Raises ValueError."""
    try:
        return msgspec.Raw(_encoder.encode(message))
    except (OverflowError, TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"the request cannot be sent to the worker: {exc}") from None


class FrameDecoder:
    """Bytes in, messages out: feed what the transport delivered, get the complete messages."""

    def __init__(self, message_type: object) -> None:
        self._decoder = msgspec.msgpack.Decoder(list[message_type])  # type: ignore[valid-type]
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        self._buffer += data
        buf = self._buffer
        out: list = []
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
            out.extend(messages)
        del buf[:start]
        return out
