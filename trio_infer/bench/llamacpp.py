"""The llama.cpp baseline of ``offline``: the same GGUF file through llama-cpp-python.

llama.cpp runs the quantized file itself (Q4_1 weights stay Q4_1), which is what a CPU user picks
for a small model, so it is the yardstick for the CPU path. It is an optional bench extra
(``pip install '.[bench-llamacpp]'``, built from source: a few minutes on two cores).

Two measurements, both greedy, both through the low-level API (``llama_decode`` on a
``llama_batch`` holding several sequences) so that llama.cpp batches exactly as our engine does:

- :func:`decode_profile`: ``batch`` sequences, each with its own ``context``-token prompt, then
  timed decode steps of one token per sequence.
- :func:`run_workload`: continuous batching of a workload over ``slots`` sequence slots, each
  step at most ``max_batched_tokens`` tokens (decodes first, then prompt chunks), a finished
  sequence's cache cleared and its slot given to the next request, as llama.cpp's server does.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trio_infer.bench.workload import BenchRequest, make_result


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "error: the llama.cpp baseline needs llama-cpp-python: "
            ".venv/bin/pip install '.[bench-llamacpp]' (builds llama.cpp from source)"
        ) from None
    return llama_cpp


# How llama-cpp-python must be built on a CPU with AMX (see :func:`refuse_amx`).
NO_AMX_BUILD = ('CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" '
                ".venv/bin/pip install --force-reinstall --no-deps 'llama-cpp-python==0.3.36'")


def refuse_amx(system_info: str) -> None:
    """Stop, saying how to rebuild, when this llama.cpp was compiled with its AMX matrix product
    (``AMX_INT8 = 1`` in its system info: ``-march=native`` on a CPU with AMX-INT8). In llama.cpp
    0.3.36 that product segfaults the process at its first forward (llama.cpp issue 20824):
    the bench would die with no word of why. The quantizer never multiplies and is not
    affected. (``bench llama-server`` builds its binary without AMX for the same reason.)"""
    if "AMX_INT8 = 1" in system_info:
        raise SystemExit(
            "error: this llama-cpp-python was built with llama.cpp's AMX matrix product, which "
            "crashes at the first forward on this CPU (llama.cpp issue 20824); rebuild it "
            "without: " + NO_AMX_BUILD)


@dataclass
class _Slot:
    index: int
    request: int = -1
    tokens: list[int] = field(default_factory=list)  # prompt, then outputs as they come
    fed: int = 0  # how many of ``tokens`` are in the cache
    produced: int = 0
    want: int = 0

    @property
    def busy(self) -> bool:
        return self.request >= 0


class LlamaCpp:
    """One model and context; ``n_seq`` sequences of up to ``n_ctx_per_seq`` tokens each."""

    def __init__(self, path: Path, threads: int, n_seq: int, n_ctx_per_seq: int,
                 max_batched_tokens: int) -> None:
        lc = require()
        self.lc = lc
        lc.llama_backend_init()
        refuse_amx(lc.llama_print_system_info().decode(errors="replace"))
        lc.llama_log_set(_quiet_log(), ctypes.c_void_p())
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise SystemExit(f"error: llama.cpp could not load {path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_seq * n_ctx_per_seq
        cparams.n_batch = max_batched_tokens
        cparams.n_ubatch = max_batched_tokens
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True  # one cache shared by all sequences, like our page pool
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("error: llama.cpp could not create a context")
        self.memory = lc.llama_get_memory(self.ctx)
        vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        self.eos = {lc.llama_vocab_eos(vocab), lc.llama_vocab_eot(vocab)} - {-1}
        self.max_batched_tokens = max_batched_tokens
        self.batch = lc.llama_batch_init(max_batched_tokens, 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def clear(self, seq: int = -1) -> None:
        self.lc.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, position, sequence, wants logits). Returns the greedy next token of
        each entry that wanted logits, in order."""
        import numpy as np

        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = sum(1 for e in entries if e[3])
        if not rows:
            return []
        ptr = self.lc.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        return logits.argmax(axis=1).tolist()


def _noop_log(level: int, text: bytes, user_data: Any) -> None:
    return None


_QUIET_LOG: list[Any] = []  # the ctypes callback, made once and kept alive


def _quiet_log() -> Any:
    """llama.cpp's log callback that drops everything (made on first use: importing llama_cpp
    loads its library, half a second, which importing this module should not cost)."""
    if not _QUIET_LOG:
        _QUIET_LOG.append(require().llama_log_callback(_noop_log))
    return _QUIET_LOG[0]


def decode_profile(path: Path, threads: int, batch: int, prompts: list[list[int]],
                   steps: int, warmup: int = 2) -> tuple[list[float], list[float]]:
    """Seconds per decode step of ``batch`` sequences after their prompts (one per sequence):
    wall time, and this process's CPU time (``time.process_time``: all its threads, which
    time-sharing with other work does not inflate; on one thread, the step's own cost)."""
    context = max(len(p) for p in prompts)
    llm = LlamaCpp(path, threads, batch, context + steps + warmup + 8, max(512, batch, context))
    try:
        last: list[int] = []
        for s, prompt in enumerate(prompts):
            entries = [(t, i, s, i == len(prompt) - 1) for i, t in enumerate(prompt)]
            last += llm.decode(entries)
        pos = [len(p) for p in prompts]
        wall: list[float] = []
        cpu: list[float] = []
        for step in range(warmup + steps):
            entries = [(last[s], pos[s], s, True) for s in range(batch)]
            t0, c0 = time.perf_counter(), time.process_time()
            last = llm.decode(entries)
            if step >= warmup:
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            pos = [p + 1 for p in pos]
        return wall, cpu
    finally:
        llm.close()


def run_workload(path: Path, threads: int, workload: list[BenchRequest], slots: int,
                 max_batched_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """Continuous batching over ``slots`` sequences; the same result fields as our engine's."""
    longest = max(r.prompt_len + r.output_len for r in workload)
    llm = LlamaCpp(path, threads, slots, longest + 8, max_batched_tokens)
    try:
        # Untimed warm-up: one short request.
        warm = workload[0].prompt_ids[:16]
        llm.decode([(t, i, 0, i == len(warm) - 1) for i, t in enumerate(warm)])
        llm.clear()

        pending = deque(range(len(workload)))
        table = [_Slot(i) for i in range(slots)]
        out_tokens = [0] * len(workload)
        first: dict[int, float] = {}
        steps = 0
        t0 = time.perf_counter()
        while pending or any(s.busy for s in table):
            for slot in table:
                if not slot.busy and pending:
                    r = pending.popleft()
                    slot.request, slot.tokens = r, list(workload[r].prompt_ids)
                    slot.fed, slot.produced, slot.want = 0, 0, workload[r].output_len
            entries: list[tuple[int, int, int, bool]] = []
            samplers: list[_Slot] = []
            # Decodes first (one token each), then prompt chunks in the room left.
            for slot in table:
                if slot.busy and slot.produced:
                    entries.append((slot.tokens[-1], slot.fed, slot.index, True))
                    slot.fed += 1
                    samplers.append(slot)
            for slot in table:
                room = max_batched_tokens - len(entries)
                if room <= 0:
                    break
                if not slot.busy or slot.produced:
                    continue
                todo = slot.tokens[slot.fed : slot.fed + room]
                done = slot.fed + len(todo) == len(slot.tokens)
                entries += [(t, slot.fed + i, slot.index, done and i == len(todo) - 1)
                            for i, t in enumerate(todo)]
                slot.fed += len(todo)
                if done:
                    samplers.append(slot)
            nexts = llm.decode(entries)
            steps += 1
            now = time.perf_counter() - t0
            for slot, tok in zip(samplers, nexts):
                slot.tokens.append(tok)
                slot.produced += 1
                out_tokens[slot.request] += 1
                first.setdefault(slot.request, now)
                if slot.produced >= slot.want or (not ignore_eos and tok in llm.eos):
                    llm.clear(slot.index)
                    slot.request = -1
        elapsed = time.perf_counter() - t0
    finally:
        llm.close()
    return make_result(workload, out_tokens, elapsed, [first[i] for i in range(len(workload))],
                   steps=steps, threads=threads, slots=slots)
