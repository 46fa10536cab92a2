"""Tensor parallelism for the Llama family: which slice of each weight a rank holds, and the
collectives that put the slices' results back together.

A :class:`ShardPlan` is pure data (no process group): from a model's shape and the number of
ranks it says which kv heads (and so which query heads), which intermediate rows and which
vocabulary rows rank ``r`` holds, and :meth:`ShardPlan.take` cuts a checkpoint tensor (Hugging
Face name) down to that rank's part as the loaders read it:

- q/k/v (weights and biases) by heads, gate/up by intermediate rows: column parallel, each rank
  computes its own output features;
- o_proj and down_proj by input columns: row parallel, each rank computes a partial sum that an
  all-reduce completes; their biases stay whole on rank 0 and are zero elsewhere (added once);
- the embedding and the lm_head by vocabulary rows: a masked lookup plus an all-reduce, and
  each rank's logits gathered into the full row;
- norms (and Qwen3's per-head q/k norms) are replicated.

Splits are as even as the model allows, not required to be exact: SmolLM2-135M has 3 kv heads,
so with 2 ranks one holds 2 kv heads (6 query heads) and the other 1 (3). A rank needs at least
one kv head (kv heads are not replicated), so ``size <= num_kv_heads``. A row-parallel weight
kept in GGUF blocks can be cut only between blocks (32 columns, 256 for K-quants): the
intermediate split is made in whole blocks, and a head split that falls inside a block is
refused.

:class:`Collectives` wraps the torch.distributed group the model's forward uses; nothing here is
home-made (gloo on the CPU, NCCL on CUDA).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from trio_infer_kernels.cpu import PackedWeight


class ShardError(ValueError):
    """The model cannot be split over this many ranks (the message says why)."""


def split_even(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(total)``, in whole ``unit``s, as even as
    possible (the first ranges get the extra units)."""
    if total % unit:
        raise ShardError(f"{total} is not a multiple of {unit}")
    units, extra = divmod(total // unit, parts)
    out, start = [], 0
    for r in range(parts):
        stop = start + (units + (r < extra)) * unit
        out.append((start, stop))
        start = stop
    return out


def block_columns(fmt: str | None) -> int:
    """Columns per block of a weight kept in ``fmt`` (1: a plain tensor, cut anywhere)."""
    if fmt is None or fmt in ("F16", "BF16", "F32"):
        return 1
    return 256 if fmt.endswith("_K") else 32


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    head_dim: int
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_ranges: tuple[tuple[int, int], ...]  # every rank's, for the logits gather

    @classmethod
    def build(cls, spec: Any, rank: int, size: int,
              formats: Mapping[str, Any] | None = None) -> ShardPlan:
        """The plan of ``rank`` of ``size`` for a :class:`~trio_infer.models.llama.LlamaSpec`.
        ``formats``: module name -> kept GGUF format (the loader's ``packed``), which decides
        where a row-parallel weight may be cut. Raises :class:`ShardError` when it cannot be."""
        if not 0 <= rank < size:
            raise ShardError(f"rank {rank} of {size}")
        if size > spec.num_kv_heads:
            raise ShardError(
                f"tensor_parallel {size} exceeds the model's {spec.num_kv_heads} kv heads: each "
                f"rank holds at least one (kv heads are not replicated)")
        if spec.num_heads % spec.num_kv_heads:
            raise ShardError(f"{spec.num_heads} query heads for {spec.num_kv_heads} kv heads")
        group = spec.num_heads // spec.num_kv_heads
        formats = formats or {}

        def unit(leaf: str) -> int:
            units = {1}
            for name, fmt in formats.items():
                if name.endswith(leaf):
                    units |= {block_columns(f) for f in (fmt if isinstance(fmt, tuple) else (fmt,))}
            return max(units)

        kv = split_even(spec.num_kv_heads, size)
        o_unit = unit("self_attn.o_proj")
        for start, stop in kv:
            if (start * group * spec.head_dim) % o_unit or (stop * group * spec.head_dim) % o_unit:
                raise ShardError(
                    f"o_proj is kept in blocks of {o_unit} columns; a split of the "
                    f"{spec.num_heads} query heads of {spec.head_dim} over {size} ranks falls "
                    f"inside a block (try keep_gguf_blocks=false)")
        d_unit = unit("mlp.down_proj")
        if spec.intermediate_size % d_unit or spec.intermediate_size // d_unit < size:
            raise ShardError(
                f"down_proj is kept in blocks of {d_unit} columns: its {spec.intermediate_size} "
                f"columns cannot be split over {size} ranks (try keep_gguf_blocks=false)")
        vocab = split_even(spec.vocab_size, size)
        start, stop = kv[rank]
        return cls(
            rank=rank,
            size=size,
            head_dim=spec.head_dim,
            kv_heads=(start, stop),
            q_heads=(start * group, stop * group),
            intermediate=split_even(spec.intermediate_size, size, d_unit)[rank],
            vocab=vocab[rank],
            vocab_ranges=tuple(vocab),
        )

    def local_spec(self, spec: Any) -> Any:
        """The spec of this rank's slice: its heads, intermediate rows and vocabulary rows."""
        return dataclasses.replace(
            spec,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab[1] - self.vocab[0],
        )

    def _range(self, name: str) -> tuple[str, tuple[int, int]] | None:
        """("rows" | "cols" | "bias0", range) for a Hugging Face tensor name, None if whole."""
        module, _, attr = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        d = self.head_dim
        if module in ("model.embed_tokens", "lm_head"):
            return "rows", self.vocab
        if leaf == "q_proj":
            return "rows", (self.q_heads[0] * d, self.q_heads[1] * d)
        if leaf in ("k_proj", "v_proj"):
            return "rows", (self.kv_heads[0] * d, self.kv_heads[1] * d)
        if leaf in ("gate_proj", "up_proj"):
            return "rows", self.intermediate
        if leaf in ("o_proj", "down_proj"):
            cols = (self.q_heads[0] * d, self.q_heads[1] * d) if leaf == "o_proj" \
                else self.intermediate
            return ("cols", cols) if attr == "weight" else ("bias0", cols)
        return None

    def columns(self, name: str) -> tuple[int, int] | None:
        """The input columns of a row-parallel weight this rank holds (None: all of them). The
        GGUF loader cuts kept blocks with it before packing them (packed rows cannot be cut)."""
        cut = self._range(name)
        return cut[1] if cut is not None and cut[0] == "cols" else None

    def take(self, name: str, tensor: Any) -> Any:
        """This rank's part of checkpoint tensor ``name`` (whole if it is replicated): a numpy
        array (what the GGUF loader reads), a torch tensor (safetensors) or packed blocks."""
        cut = self._range(name)
        if cut is None:
            return tensor
        how, (start, stop) = cut
        if how == "bias0":
            return tensor if self.rank == 0 else tensor * 0
        if isinstance(tensor, PackedWeight):
            if how == "cols":
                if tensor.in_features != stop - start:
                    raise ShardError(f"{name}: packed blocks of {tensor.in_features} columns "
                                     f"were not cut to this rank's {stop - start}")
                return tensor
            return dataclasses.replace(tensor, data=np.ascontiguousarray(tensor.data[start:stop]))
        part = tensor[:, start:stop] if how == "cols" else tensor[start:stop]
        return np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part.contiguous()


class Collectives:
    """The tensor-parallel collectives of a model's forward, over one torch.distributed group.

    ``group`` None is the default group (what :func:`torch.distributed.init_process_group`
    made). Every rank calls the same collectives in the same order: the model's forward is the
    same code on every rank, fed the same batch (runtime/tp_group.py broadcasts it)."""

    def __init__(self, plan: ShardPlan, group: Any = None) -> None:
        self.plan = plan
        self.group = group

    def all_reduce(self, x: Any) -> Any:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, ids: Any, table: Any, lookup: Any) -> Any:
        """Rows of the vocabulary-split embedding: each rank looks up the ids it holds (zeros
        for the rest), and the sum over ranks is the full lookup."""
        start, stop = self.plan.vocab
        local = ids - start
        outside = (local < 0) | (local >= stop - start)
        hidden = lookup(local.masked_fill(outside, 0), table)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.all_reduce(hidden)

    def gather_logits(self, logits: Any) -> Any:
        """Each rank's vocabulary columns -> the full rows (on every rank). all_gather needs equal
        sizes: an uneven split is padded to the widest part and trimmed after."""
        import torch
        import torch.distributed as dist

        ranges = self.plan.vocab_ranges
        width = max(stop - start for start, stop in ranges)
        if logits.shape[1] < width:
            logits = torch.nn.functional.pad(logits, (0, width - logits.shape[1]))
        parts = [torch.empty_like(logits) for _ in ranges]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat([p[:, : stop - start] for p, (start, stop) in zip(parts, ranges)], dim=1)
