"""What one forward pass needs to know about the batch, as tensors.

The scheduler decides *which* tokens run; the model runner turns that decision into a
:class:`ForwardBatch`; the model reads only this. Tokens of all sequences are packed along one
axis (no padding). Decode sequences (one new token each) come first, then the sequences that
extend by a chunk (prefill or chunked prefill), so attention can batch the decodes in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (page * page_size + offset) per token
    page_table: torch.Tensor  # [B, max_pages] int64 (rows padded with 0)
    seq_lens: torch.Tensor  # [B] int64: tokens in context after this step (cached + new)
    query_start_loc: torch.Tensor  # [B + 1] int64: sequence b owns tokens [qsl[b], qsl[b+1])
    num_decodes: int  # sequences [0, num_decodes) have exactly one new token each
    logits_indices: torch.Tensor  # [N] int64: token rows whose next-token logits are needed
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
