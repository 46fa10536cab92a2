"""What one forward pass needs to know about the batch, as arrays.

The scheduler decides *which* tokens run; the model runner turns that decision into a
:class:`ForwardBatch`; the model reads only this. Tokens of all sequences are packed along one
axis (no padding). Decode sequences (one new token each) come first, then the sequences that
extend by a chunk (prefill or chunked prefill), so attention can batch the decodes in one call.

The arrays are numpy int64 on the host: the engine imports no torch, so that a worker serving a
GGUF model on the CPU kernels never loads it (torch costs ~220 MiB of resident memory for
nothing there). A torch model takes its tensors with :meth:`ForwardBatch.to_torch`, views of the
same memory on the CPU and one copy each to a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64: position of each token in its sequence
    slot_mapping: np.ndarray  # [T] int64: flat KV slot (page * page_size + offset) per token
    page_table: np.ndarray  # [B, max_pages] int64 (rows padded with 0)
    seq_lens: np.ndarray  # [B] int64: tokens in context after this step (cached + new)
    query_start_loc: np.ndarray  # [B + 1] int64: sequence b owns tokens [qsl[b], qsl[b+1])
    num_decodes: int  # sequences [0, num_decodes) have exactly one new token each
    logits_indices: np.ndarray  # [N] int64: token rows whose next-token logits are needed
    # The longest chunk of the step, known on the host: spares the GPU path a device read.
    # None (hand-built batches): the kernel derives it from query_start_loc.
    max_query_len: int | None = None
    # The longest context of the step (max of seq_lens), known on the host, for the CPU kernels.
    max_seq_len: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def to_torch(self, device: Any = "cpu") -> ForwardBatch:
        """The same batch with torch int64 tensors on ``device`` (a tensor stays a tensor, moved
        if it is elsewhere): what the torch models read. Imports torch, so only they call it."""
        import torch

        def convert(a: Any) -> Any:
            if isinstance(a, np.ndarray):
                a = torch.from_numpy(np.ascontiguousarray(a))
            return a.to(device)

        return dataclasses.replace(self, **{
            f.name: convert(getattr(self, f.name)) for f in dataclasses.fields(self)
            if hasattr(getattr(self, f.name), "shape")})  # the arrays, not the ints

