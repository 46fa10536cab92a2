"""The model runner: the decode batch (the arrays a step of one-token decodes hands the
model), and the forward's logits taken to the host as numpy for sampling."""

from __future__ import annotations

import numpy as np
import torch

from trio_infer.engine.kv_cache import KVCache
from trio_infer.engine.model_runner import ModelRunner, host_logits
from trio_infer.engine.scheduler import Schedule, ScheduledSeq
from trio_infer.engine.sequence import Sequence
from trio_infer.wire import SamplingParams

PAGE = 4


def runner() -> ModelRunner:
    kv = KVCache(1, 64, PAGE, 1, 2, "float32")
    return ModelRunner(model=None, kv_cache=kv, device="cpu")  # type: ignore[arg-type]


def decodes(lengths: list[int], first_page: int = 0) -> Schedule:
    """One decode item per length: a sequence of that many tokens whose last one is computed now,
    on consecutive pages from ``first_page``."""
    items = []
    page = first_page
    for n, length in enumerate(lengths):
        pages = tuple(range(page, page + -(-length // PAGE)))
        page += len(pages)
        seq = Sequence(uid=n, token_ids=[100 * n + t for t in range(length)], num_prompt_tokens=1,
                       params=SamplingParams(temperature=0), max_len=999, pages=list(pages))
        items.append(ScheduledSeq(seq, length - 1, 1, pages, True))
    return Schedule(items, len(items), [])


def test_a_decode_batch_holds_what_the_schedule_says() -> None:
    schedule = decodes([1, 6, 13])
    batch, rows, drafts = runner().prepare(schedule)
    assert rows is None and drafts is None
    assert batch.input_ids.tolist() == [0, 105, 212]
    assert batch.positions.tolist() == [0, 5, 12]
    # page 0 offset 0; pages 1-2, position 5 -> page 2 offset 1; pages 3-6, position 12 -> page 6
    assert batch.slot_mapping.tolist() == [0, 2 * PAGE + 1, 6 * PAGE + 0]
    assert batch.page_table.tolist() == [[0, 0, 0, 0], [1, 2, 0, 0], [3, 4, 5, 6]]
    assert batch.seq_lens.tolist() == [1, 6, 13]
    assert batch.query_start_loc.tolist() == [0, 1, 2, 3]
    assert batch.logits_indices.tolist() == [0, 1, 2]
    assert (batch.num_decodes, batch.max_query_len, batch.max_seq_len) == (3, 1, 13)
    # The one-call C step reads them by pointer: int64, rows of the page table contiguous.
    for t in (batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens):
        assert t.dtype == np.int64 and t.flags.c_contiguous
    assert batch.page_table.dtype == np.int64 and batch.page_table.strides == (4 * 8, 8)


def test_a_decode_batch_is_a_snapshot_the_next_step_leaves_alone() -> None:
    r = runner()
    first, _, _ = r.prepare(decodes([3, 5]))
    kept = {name: getattr(first, name).copy() for name in
            ("input_ids", "positions", "slot_mapping", "page_table", "seq_lens", "query_start_loc",
             "logits_indices")}
    second, _, _ = r.prepare(decodes([9, 2], first_page=20))
    assert second.positions.tolist() == [8, 1]
    for name, values in kept.items():
        assert np.array_equal(getattr(first, name), values), name



def test_host_logits_is_a_writable_contiguous_float32_array() -> None:
    """The forward's logits as the sampler takes them: a numpy float32 array as it is, a CPU
    float32 tensor as a view of its memory (no copy), anything else copied."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert host_logits(a) is a
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = host_logits(t)
    view[0, 0] = 7.0
    assert t[0, 0] == 7.0  # shared memory
    with torch.inference_mode():  # as the models return them
        inf = torch.ones(2, 3)
    assert host_logits(inf).tolist() == [[1.0] * 3] * 2
    for x in (torch.ones(2, 3, dtype=torch.bfloat16), t[:, ::2], a[:, ::2], a.astype(np.float64),
              np.broadcast_to(a[:1], (3, 4))):
        h = host_logits(x)
        assert h.dtype == np.float32 and h.flags.c_contiguous and h.flags.writeable
        assert np.array_equal(h, np.asarray(x.float() if isinstance(x, torch.Tensor) else x,
                                            dtype=np.float32))


class Rows:
    """Returns fixed logits rows, as a torch tensor or as a numpy array."""

    def __init__(self, logits: np.ndarray, as_numpy: bool) -> None:
        self.logits = logits
        self.as_numpy = as_numpy

    def forward(self, batch, k, v):  # type: ignore[no-untyped-def]
        x = self.logits.copy()
        return x if self.as_numpy else torch.from_numpy(x)


def test_run_samples_the_same_from_a_tensor_or_an_array() -> None:
    logits = np.random.default_rng(0).standard_normal((3, 10)).astype(np.float32)
    seqs = [Sequence(uid=i, token_ids=[1], num_prompt_tokens=1, params=p, max_len=9)
            for i, p in enumerate([SamplingParams(temperature=0), SamplingParams(temperature=0.9),
                                   SamplingParams(temperature=0, logprobs=2)])]
    results = []
    for as_numpy in (False, True):
        r = runner()
        r.model = Rows(logits, as_numpy)  # type: ignore[assignment]
        assert isinstance(r.rng, np.random.Generator)
        r.rng = np.random.default_rng(5)
        results.append(r.run(r.prepare(decodes([1, 1, 1]))[0], seqs))
    assert results[0] == results[1]
    assert results[0].token_ids[0] == int(logits[0].argmax())
