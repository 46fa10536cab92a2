"""Constrained decoding in the engine: per-sequence grammar state and the step's token masks.

The grammar engine is llguidance (docs/structured-output.md says why). A constrained sequence
carries a *grammar source* in its :class:`~trio_infer.wire.SamplingParams` (the JSON
text of an llguidance grammar, built and validated by the front end); the engine compiles it
into an ``LLMatcher`` when the request is added and keeps the matcher on the
:class:`~trio_infer.engine.sequence.Sequence`, so it lives exactly as long as the sequence:

* created in ``Engine.add_request`` (compiling is cached by source: a second request with the
  same schema copies a compiled matcher instead of compiling again; the worker's first one also
  builds llguidance's view of the tokenizer, see :meth:`Grammars.deferred`);
* advanced in ``Engine.commit`` by every token the sequence accepts;
* dropped with the sequence on every way out (finish, abort, a failed step, the worker's death);
  preemption keeps every token, so the matcher, which has consumed exactly those tokens, stays
  valid while the sequence is recomputed.

Each step, :class:`TokenMasks` computes the masks of the constrained sequences that sample, in a
thread started before the forward pass (llguidance and the model's kernels release the GIL while
they compute, so the masks overlap the model): llguidance's packed bitmask, then the additive bias
the sampler needs (0 where allowed, -inf elsewhere), a numpy float32 array like the logits it
is added to (the sampling stack imports no torch: engine/sampler.py). The sampler then adds it
to the constrained rows, one array op on the stepping thread. Unconstrained rows are never
touched.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence as Seq

import llguidance
import llguidance.numpy
import numpy as np


class Grammars:
    """Compiles grammar sources for one tokenizer (llguidance's view of it, over the model's
    ``vocab_size``), with a bounded cache of compiled matchers.

    ``matcher(source)`` gives a fresh matcher (a copy of the cached compiled one). It raises
    ValueError for a grammar that does not compile (the front end validated it already; this is
    a safety net for the worker).

    ``tokenizer`` is llguidance's tokenizer, or a function that builds it: then it is built by
    the first :meth:`matcher` call (see :meth:`deferred`).
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer | Callable[[], llguidance.LLTokenizer],
                 vocab_size: int, cache_size: int = 64) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer if isinstance(tokenizer, llguidance.LLTokenizer) else None
        self._build = None if self._tokenizer is not None else tokenizer
        self._build_lock = threading.Lock()
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        # Mask computation runs llguidance's own thread pool (Rust, no GIL): at most 2 threads, so
        # it never competes with torch for more than a core's share on a small machine.
        self.executor = llguidance.LLExecutor(num_threads=2)

    @classmethod
    def for_hf_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: Seq[int]) -> Grammars:
        """For a Hugging Face tokenizer; the model's logits may be wider than its vocabulary
        (padding ids, never allowed), and its EOS ids are the engine's."""
        return cls(_from_hf(tokenizer, vocab_size, eos_token_ids), vocab_size)

    @classmethod
    def deferred(cls, load_tokenizer: Callable[[], Any], vocab_size: int,
                 eos_token_ids: Seq[int]) -> Grammars:
        """As :meth:`for_hf_tokenizer`, with the Hugging Face tokenizer loaded, and llguidance's
        view of it built (about half a second, and transformers imported: a second more), by
        the first constrained request rather than before the worker is ready: most workers
        never see one, and none should make every start wait for it."""
        eos = tuple(eos_token_ids)
        return cls(lambda: _from_hf(load_tokenizer(), vocab_size, eos), vocab_size)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built now if it was deferred. A build that fails raises
        ValueError (the request that needed it is refused) and is tried again next time."""
        with self._build_lock:
            if self._tokenizer is None:
                assert self._build is not None
                try:
                    self._tokenizer = self._build()
                except Exception as exc:
                    raise ValueError(
                        f"the tokenizer for grammars could not be built: {exc}") from exc
                self._build = None
            return self._tokenizer

    def matcher(self, source: str) -> llguidance.LLMatcher:
        compiled = self._cache.get(source)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, source)
            if compiled.is_error():
                raise ValueError(f"the grammar does not compile: {compiled.get_error()}")
            self._cache[source] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(source)
        return compiled.deep_copy()

    @property
    def num_cached(self) -> int:
        return len(self._cache)


def _from_hf(tokenizer: Any, vocab_size: int, eos_token_ids: Seq[int]) -> llguidance.LLTokenizer:
    import llguidance.hf  # imports transformers: only when a tokenizer is built

    return llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


class TokenMasks:
    """The token masks of one step's constrained rows, computed in a thread.

    ``rows`` are the logits rows (sampling order) of the constrained sequences. The thread is
    started by :meth:`start` and always joined (the sampler waits for it; the engine joins it in
    a ``finally`` too), so no thread outlives its step.
    """

    def __init__(self, grammars: Grammars, rows: list[int], matchers: list[llguidance.LLMatcher]) -> None:
        self.rows = rows
        self._matchers = matchers
        self._grammars = grammars
        # numpy's helpers, not llguidance.torch's: importing those runs a torch.compile
        # decorator, which imports dynamo and inductor (2-3 s of the worker's start-up).
        self.bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), grammars.vocab_size)
        self.bias: np.ndarray | None = None  # [len(rows), vocab] float32: 0 allowed, -inf forbidden
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._compute, name="token-masks", daemon=True)

    @classmethod
    def start(cls, grammars: Grammars | None, matchers: Seq[Any]) -> TokenMasks | None:
        """Start computing the masks of the rows whose matcher is not None; None if there are none."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows or grammars is None:
            return None
        masks = cls(grammars, rows, [matchers[i] for i in rows])
        masks._thread.start()
        return masks

    def _compute(self) -> None:
        try:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._grammars.executor, [(m, j) for j, m in enumerate(self._matchers)], self.bitmask
            )
            # numpy, single-threaded: it never starts a thread team of its own to fight the
            # forward pass for cores (torch ops here would start an OpenMP team per thread).
            allowed = unpack_bitmask(self.bitmask, self._grammars.vocab_size)
            self.bias = np.take(_BIAS, allowed.view(np.uint8))
        except BaseException as exc:  # re-raised in the stepping thread by wait()
            self._error = exc

    def join(self) -> None:
        self._thread.join()

    def wait(self) -> None:
        """Join the thread; raise what it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def apply(self, logits: np.ndarray) -> None:
        """Set the logits of every token the grammar forbids to -inf, in the constrained rows
        only (adding 0 leaves an allowed logit exactly as it was). ``logits`` is [N, V] float32
        with V the grammars' vocabulary (the model's), changed in place."""
        self.wait()
        assert self.bias is not None
        if len(self.rows) == logits.shape[0]:  # every row constrained: in place, no gather
            logits += self.bias
        else:
            logits[self.rows] += self.bias  # the rows are distinct: a gather, an add, a scatter


_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # forbidden, allowed (a gather: np.where is 4x slower)


def unpack_bitmask(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's packed int32 bitmask [R, ceil(V/32)] as a bool array [R, vocab]: bit b of
    word w is token 32*w + b, little-endian, so bit k of byte j is token 8*j + k."""
    packed = bitmask.view(np.uint8)
    return np.unpackbits(packed, axis=1, count=vocab, bitorder="little").view(np.bool_)
