"""Llama, Qwen2 and Qwen3 as one model, written over a flat token axis and the paged KV cache.

The three families differ in three details only, so one implementation covers them:

- Qwen2 adds a bias to the q/k/v projections (Llama may too, with ``attention_bias``).
- Qwen3 normalizes each query and key head (RMSNorm over ``head_dim``) before the rotary embedding.
- Llama 3.x rescales the rotary frequencies (``rope_type: llama3``).

Every tensor is ``[T, ...]``: the tokens of all sequences of a step packed along one axis, as
:class:`~trio_infer.engine.forward_batch.ForwardBatch` lays them out. There is no batch dimension
and no padding; attention is the only place that knows about sequences, through
:func:`~trio_infer.models.attention.paged_attention`.

The q/k/v projections are fused into one weight and gate/up into another when the checkpoint is
loaded (two GEMMs fewer per layer). A fused :class:`Linear` remembers the sizes of its parts, so a
later column-parallel split can cut each part separately instead of the concatenation.

A linear layer (and the embedding) may keep its weight as GGUF blocks (``packed``: module name ->
ggml format, decided by the loader): a :class:`~trio_infer_kernels.cpu.PackedWeight` read by the
CPU kernels, 4 or 8 bits a weight instead of 32, with the same fp32 math.

With ``parallel`` (:class:`~trio_infer.models.parallel.Collectives`) the model is one rank's
slice of a tensor-parallel group: its modules have that rank's heads, intermediate rows and
vocabulary rows (:class:`~trio_infer.models.parallel.ShardPlan`), o_proj and down_proj end in an
all-reduce, the embedding is a masked lookup plus an all-reduce and the logits are gathered.
Every rank runs the op-by-op path: the one-call C decode step cannot call a collective between
its layers. Without ``parallel`` none of this code runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from trio_infer_kernels import ops
from trio_infer_kernels.cpu import (
    DecoderLayerWeights,
    DecoderWeights,
    DecodeStep,
    Packed,
    PackedParts,
    PackedWeight,
    waits_sleep_at_once,
)
from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.models.attention import paged_attention
from trio_infer.models.base import ModelInfo
from trio_infer.models.parallel import Collectives
from trio_infer.models.spec import (  # noqa: F401 (re-exported)
    FUSED_PARTS,
    STATIC_ROPE_TYPES,
    SUPPORTED_ARCHITECTURES,
    LlamaSpec,
    cos_sin_table,
    default_inv_freq,
    rope_parameters,
)
from trio_infer.models.step_threads import StepThreads



def build_cos_sin_cache(
    config: Any,
    head_dim: int,
    max_positions: int,
    device: torch.device,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cat(cos, sin)`` for positions ``0 .. max_positions-1``: [max_positions, head_dim], fp32.

    Default and linear frequencies are computed by :func:`~trio_infer.models.spec.cos_sin_table`
    (the CPU kernels' numpy model's table too, so that both models rotate bitwise alike); the
    other scaled variants (llama3, yarn) come from transformers' own rope init functions. The table
    stays fp32 whatever the model dtype: it is small, and the rotary op computes in fp32 anyway.

    ``freq_factors`` ([head_dim / 2]) divide the default frequencies: that is how GGUF files store
    Llama 3's rope scaling (llama.cpp's ``rope_freqs`` tensor), equivalent to ``rope_type: llama3``.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    inv_freq = default_inv_freq(params, head_dim)
    if inv_freq is not None:
        # The CPU kernels' numpy model builds its table the same way: both models' rotary
        # embeddings are bitwise the same.
        factors = None if freq_factors is None else freq_factors.float().numpy()
        if factors is not None and rope_type != "default":
            raise ValueError(f"rope frequency factors need the default rope type (got {rope_type!r})")
        if inv_freq.shape[0] * 2 != head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        return torch.from_numpy(cos_sin_table(inv_freq, max_positions, freq_factors=factors)).to(device)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq_t, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if inv_freq_t.shape[0] * 2 != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    if freq_factors is not None:
        raise ValueError(f"rope frequency factors need the default rope type (got {rope_type!r})")
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq_t.float())  # [P, D/2]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
    return cache.to(device)


def _as_tensor(a: Any) -> torch.Tensor:
    """A KV cache layer as a tensor: a numpy array (the CPU pool) as a view of its memory."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a


def _param(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised, frozen parameter: every value is overwritten by the checkpoint."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T + b``, W possibly the concatenation of several projections.

    ``output_sizes`` lists the parts of a fused weight (e.g. q, k, v); :meth:`load_part` writes one
    of them. Nothing else is assumed, so a tensor-parallel version only has to slice rows (column
    parallel) or columns (row parallel) of each part and add a collective after ``forward``.
    With ``fmt`` the weight is kept packed in that GGUF format (``self.packed``) and
    ``self.weight`` does not exist; a tuple of formats, one per part, keeps each part in its own
    (a :class:`~trio_infer_kernels.cpu.PackedParts`: q and k in Q4_K, v in Q6_K).
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        fmt: str | tuple[str, ...] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        out_features = sum(self.output_sizes)
        self.packed: Packed | None = None
        if fmt is None:
            self.weight = _param((out_features, in_features), dtype, device)
        elif isinstance(fmt, tuple):
            if len(fmt) != len(self.output_sizes):
                raise ValueError(f"{len(fmt)} formats for {len(self.output_sizes)} parts")
            self.packed = PackedParts(tuple(
                PackedWeight.empty(f, size, in_features) for f, size in zip(fmt, self.output_sizes)))
        else:
            self.packed = PackedWeight.empty(fmt, out_features, in_features)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.packed or self.weight, self.bias)

    def load_part(self, attr: str, part: int, tensor: torch.Tensor | PackedWeight) -> None:
        """Copy one projection of a fused weight (or bias) into its rows."""
        if attr == "weight" and isinstance(self.packed, PackedParts):
            _copy_packed(self.packed.parts[part], tensor, f"weight part {part}")
            return
        target = _load_target(self, attr, tensor)
        if isinstance(tensor, PackedWeight):
            tensor = tensor.data
        start = sum(self.output_sizes[:part])
        rows = target[start:start + self.output_sizes[part]]  # a view: a tensor's or an array's
        if tuple(rows.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{attr} part {part}: checkpoint shape {tuple(tensor.shape)}, "
                f"expected {tuple(rows.shape)}"
            )
        _copy_into(rows, tensor)


def _copy_packed(target: PackedWeight, tensor: torch.Tensor | PackedWeight, what: str) -> None:
    if not isinstance(tensor, PackedWeight) or tensor.fmt != target.fmt:
        got = tensor.fmt if isinstance(tensor, PackedWeight) else str(tensor.dtype)
        raise ValueError(f"{what} packed as {target.fmt}, checkpoint gives {got}")
    if tuple(tensor.data.shape) != tuple(target.data.shape):
        raise ValueError(f"{what}: checkpoint blocks {tuple(tensor.data.shape)}, "
                         f"expected {tuple(target.data.shape)}")
    np.copyto(target.data, tensor.data)


def _copy_into(target: torch.Tensor | np.ndarray, source: torch.Tensor | np.ndarray) -> None:
    """Copy a checkpoint tensor into a parameter (torch), or blocks into packed blocks (numpy
    arrays: :attr:`PackedWeight.data`)."""
    if isinstance(target, np.ndarray):
        np.copyto(target, source)
    else:
        target.copy_(source)


def _load_target(module: nn.Module, attr: str,
                 tensor: torch.Tensor | PackedWeight) -> torch.Tensor | np.ndarray:
    """What a checkpoint tensor is copied into: the parameter, or the packed blocks (a numpy
    array, which takes only blocks of the same format)."""
    packed = getattr(module, "packed", None)
    if attr == "weight" and packed is not None:
        if not isinstance(tensor, PackedWeight) or tensor.fmt != packed.fmt:
            got = tensor.fmt if isinstance(tensor, PackedWeight) else str(tensor.dtype)
            raise ValueError(f"weight packed as {packed.fmt}, checkpoint gives {got}")
        return packed.data
    if isinstance(tensor, PackedWeight):
        raise ValueError(f"{attr}: checkpoint gives {tensor.fmt} blocks for a plain parameter")
    return getattr(module, attr)


class RMSNorm(nn.Module):
    """RMSNorm through the kernel dispatcher (fused with the residual add when one is given)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((size,), dtype, device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(
        self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device,
        formats: tuple[Any, Any] = (None, None),  # see Linear's fmt
        parallel: Collectives | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel  # o_proj is row parallel: its partial sums are all-reduced
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(
            spec.hidden_size, (q_size, kv_size, kv_size), spec.qkv_bias, dtype, device, formats[0]
        )
        self.o_proj = Linear(q_size, (spec.hidden_size,), spec.o_bias, dtype, device, formats[1])
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            # Per-head norm: rows of head_dim, so the same 2-D kernel as every other norm applies.
            q = self.q_norm(q.reshape(-1, self.head_dim))[0]
            k = self.k_norm(k.reshape(-1, self.head_dim))[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary_store(q, k, v, batch.positions, cos_sin_cache, k_cache, v_cache,
                                batch.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, batch, self.scale)
        out = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        return out if self.parallel is None else self.parallel.all_reduce(out)


class MLP(nn.Module):
    def __init__(
        self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device,
        formats: tuple[Any, Any] = (None, None),  # see Linear's fmt
        parallel: Collectives | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel  # down_proj is row parallel: its partial sums are all-reduced
        size = spec.intermediate_size
        self.gate_up_proj = Linear(
            spec.hidden_size, (size, size), spec.mlp_bias, dtype, device, formats[0]
        )
        self.down_proj = Linear(size, (spec.hidden_size,), spec.mlp_bias, dtype, device, formats[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return out if self.parallel is None else self.parallel.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device,
        packed: Mapping[str, str | tuple[str, ...]], prefix: str,
        parallel: Collectives | None = None,
    ) -> None:
        super().__init__()

        def fmt(name: str) -> str | tuple[str, ...] | None:
            return packed.get(f"{prefix}.{name}")

        self.self_attn = Attention(
            spec, dtype, device, (fmt("self_attn.qkv_proj"), fmt("self_attn.o_proj")), parallel
        )
        self.mlp = MLP(spec, dtype, device, (fmt("mlp.gate_up_proj"), fmt("mlp.down_proj")),
                       parallel)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(hidden, residual)`` with the residual add left undone.

        Each norm adds the pending residual in the same kernel that normalizes (the fused form of
        :func:`trio_infer_kernels.ops.rms_norm`), which saves one read and write of the hidden state
        per norm.
        """
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)[0]
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch, k_cache, v_cache, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack; parameter names match the Hugging Face ``model.*`` prefix."""

    def __init__(
        self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device,
        packed: Mapping[str, str | tuple[str, ...]],
        parallel: Collectives | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = _table(spec, dtype, device, packed.get("model.embed_tokens"))
        self.layers = nn.ModuleList(
            DecoderLayer(spec, dtype, device, packed, f"model.layers.{i}", parallel)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)


def _table(spec: LlamaSpec, dtype: torch.dtype, device: torch.device, fmt: Any) -> nn.Module:
    """A [vocab, hidden] table (the embedding, the lm_head): a parameter or packed blocks."""
    table = nn.Module()
    table.packed = None
    if fmt is None:
        table.weight = _param((spec.vocab_size, spec.hidden_size), dtype, device)
    else:
        table.packed = PackedWeight.empty(fmt, spec.vocab_size, spec.hidden_size)
    return table


def _table_weight(table: nn.Module) -> torch.Tensor | PackedWeight:
    return table.packed if table.packed is not None else table.weight


class LlamaForCausalLM(nn.Module):
    """Implements :class:`~trio_infer.models.base.CausalLM` for Llama, Qwen2 and Qwen3.

    Build it with :func:`trio_infer.models.loader.load_model`; the constructor only allocates
    (uninitialised) parameters, :meth:`load_weights` fills them. ``packed`` maps module names
    (``model.layers.0.self_attn.qkv_proj``, ``model.embed_tokens``, ``lm_head``) to the GGUF
    block format their weight stays in; a tied lm_head follows the embedding. ``parallel``: this
    model is one rank's slice (see the module docstring); ``spec`` stays the whole model's.
    """

    def __init__(
        self,
        spec: LlamaSpec,
        info: ModelInfo,
        cos_sin_cache: torch.Tensor,
        device: torch.device,
        packed: Mapping[str, str | tuple[str, ...]] | None = None,
        activations: str = "exact",
        parallel: Collectives | None = None,
    ) -> None:
        super().__init__()
        packed = packed or {}
        self.spec = spec
        self.info = info
        self.parallel = parallel
        dtype = getattr(torch, info.dtype)
        local = spec if parallel is None else parallel.plan.local_spec(spec)
        self.model = LlamaModel(local, dtype, device, packed, parallel)
        if spec.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.packed = self.model.embed_tokens.packed
            if self.lm_head.packed is None:
                self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = _table(local, dtype, device, packed.get("lm_head"))
        if activations != "exact":
            for module in self.modules():
                if getattr(module, "packed", None) is not None:
                    module.packed = module.packed.with_activations(activations)
            if spec.tie_word_embeddings and self.lm_head.packed is not None:
                self.lm_head.packed = self.model.embed_tokens.packed
        # Read in an interleaved layout (trio_infer_kernels.cpu.LAYOUTS), converted in place once
        # loaded (see load_weights): with int8 activations Q4_K and Q6_K weights in 8-row groups,
        # with exact ones every block format's weights in 16-row groups (bitwise the row layout's
        # sums at one row of x, about twice as fast).
        self._weight_layout = {"int8": "x8", "exact": "x16"}.get(activations, "rows")
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        # Pure decode steps on the CPU kernels run as one C call
        # (trio_infer_kernels.ops.decode_step), built on first use per page size; False turns it off
        # (tests compare both paths).
        self.fused_decode = parallel is None
        self._decode_steps: dict[tuple[int, torch.dtype], DecodeStep | None] = {}
        self._step_bytes = 0  # the one-call step's linears, for step_threads
        self.step_threads = StepThreads(waits_sleep_at_once())  # read as OpenMP read it

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Run the step's tokens; return fp32 logits [len(batch.logits_indices), vocab].

        The final norm and the lm_head run only on ``batch.logits_indices``: a prefill of a few
        thousand tokens needs one row of logits, not a [T, vocab] matrix. The batch and the
        caches may be numpy arrays (the engine's, on the host): read as tensors on this model's
        device (views of the same memory on the CPU).
        """
        batch = batch.to_torch(self.cos_sin_cache.device)
        k_caches = [_as_tensor(k) for k in k_caches]
        v_caches = [_as_tensor(v) for v in v_caches]
        step = self._decode_step(batch, k_caches[0]) if self.fused_decode else None
        if step is not None:
            rows, available = batch.num_tokens, torch.get_num_threads()
            threads = self.step_threads.choose(rows, self._step_bytes, available)
            start = time.perf_counter()
            logits = step(batch.input_ids, batch.positions, batch.slot_mapping, batch.page_table,
                          batch.seq_lens, batch.max_seq_len, k_caches, v_caches, threads)
            if StepThreads.narrow(rows, self._step_bytes, available):
                self.step_threads.record(rows, available, threads, time.perf_counter() - start)
            return logits
        if self.parallel is None:
            hidden = ops.embedding(batch.input_ids, _table_weight(self.model.embed_tokens))
        else:
            hidden = self.parallel.embed(batch.input_ids, _table_weight(self.model.embed_tokens),
                                         ops.embedding)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(
                hidden, residual, batch, k_caches[i], v_caches[i], self.cos_sin_cache
            )
        rows = batch.logits_indices
        hidden = hidden[rows]
        hidden = self.model.norm(hidden, residual[rows] if residual is not None else None)[0]
        logits = ops.linear(hidden, _table_weight(self.lm_head)).float()
        return logits if self.parallel is None else self.parallel.gather_logits(logits)

    @property
    def one_call_decode(self) -> bool:
        """Whether decode steps have run as one C call
        (:func:`trio_infer_kernels.ops.decode_step`)."""
        return any(step is not None for step in self._decode_steps.values())

    def _decode_step(self, batch: ForwardBatch, k_cache: torch.Tensor) -> DecodeStep | None:
        """The one-call decode step (:func:`trio_infer_kernels.ops.decode_step`) if this batch can
        take it: every sequence decodes one token and wants its logits, on the CPU kernels'
        layouts."""
        if not (batch.num_decodes == batch.num_seqs == batch.num_tokens
                and batch.logits_indices.shape[0] == batch.num_tokens
                and batch.max_seq_len is not None
                and batch.page_table.dtype == torch.int64 and batch.page_table.stride(1) == 1
                and k_cache.is_contiguous()):
            return None
        key = (int(k_cache.shape[1]), k_cache.dtype)
        if self._decode_steps.get(key, False) is False:
            weights = self._decoder_weights()
            self._decode_steps[key] = (
                None if weights is None else ops.decode_step(weights, *key))
        return self._decode_steps[key]

    def _decoder_weights(self) -> DecoderWeights | None:
        """The model for the one-call decode step; None unless every linear is in blocks (and
        the model is whole: the C step cannot call a tensor-parallel collective)."""
        lm_head = _table_weight(self.lm_head)
        if self.parallel is not None or not isinstance(lm_head, PackedWeight):
            return None
        layers = []
        step_bytes = lm_head.nbytes
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin.packed is None for lin in linears):
                return None
            qkv, o, gate_up, down = ((lin.packed, lin.bias) for lin in linears)
            step_bytes += sum(lin.packed.nbytes for lin in linears)
            layers.append(DecoderLayerWeights(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                attn.q_norm.weight if attn.q_norm is not None else None,
                attn.k_norm.weight if attn.k_norm is not None else None,
                qkv, o, gate_up, down))
        self._step_bytes = step_bytes
        return DecoderWeights(
            self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim,
            self.spec.rms_norm_eps, _table_weight(self.model.embed_tokens), layers,
            self.model.norm.weight, lm_head, self.cos_sin_cache)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, fusing as it goes.

        Raises ``ValueError`` on a tensor the model has no place for, a shape mismatch, or a
        parameter the checkpoint never provided: a half-loaded model would run and emit garbage.
        """
        self._decode_steps.clear()  # built over the old tensors
        self._set_weight_layout("rows")  # checkpoint rows are copied in as rows
        params: dict[str, Any] = dict(self.named_parameters())
        params.update(self._packed_weights())
        expected = set(params)
        for name, parts in self._fused_parts().items():
            expected.discard(name)
            expected |= {f"{name}#{part}" for part in range(parts)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed from the config; some old checkpoints store it
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue  # tied: the embedding is the head
            module_name, _, attr = name.rpartition(".")
            parent, _, proj = module_name.rpartition(".")
            if proj in FUSED_PARTS:
                fused, part = FUSED_PARTS[proj]
                fused_name = f"{parent}.{fused}"
                if f"{fused_name}.{attr}" not in params:
                    raise ValueError(f"unexpected checkpoint tensor {name!r}")
                module = self.get_submodule(fused_name)
                assert isinstance(module, Linear)
                module.load_part(attr, part, tensor)
                loaded.add(f"{fused_name}.{attr}#{part}")
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            if isinstance(param, nn.Module):  # a packed weight: its blocks
                param = _load_target(param, "weight", tensor)
                tensor = tensor.data if isinstance(tensor, PackedWeight) else tensor
            elif isinstance(tensor, PackedWeight):
                raise ValueError(f"{name}: checkpoint gives {tensor.fmt} blocks for a parameter")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            _copy_into(param, tensor)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint lacks {len(missing)} tensors: {shown}")
        self._set_weight_layout(self._weight_layout)

    def _set_weight_layout(self, layout: str) -> None:
        """Every packed weight in ``layout`` where it takes it, converted in place (a tied
        lm_head is the embedding's table: converted once, then shared again)."""
        for name, module in self.named_modules():
            if getattr(module, "packed", None) is None:
                continue
            if name == "lm_head" and self.spec.tie_word_embeddings:
                continue
            module.packed = module.packed.with_layout(layout, torch.get_num_threads())
        if self.spec.tie_word_embeddings and self.lm_head.packed is not None:
            self.lm_head.packed = self.model.embed_tokens.packed

    def _packed_weights(self) -> dict[str, nn.Module]:
        """``"<module>.weight"`` -> module, for every module whose weight is packed (they have no
        weight parameter; a tied lm_head is the embedding's and is not listed)."""
        out = {}
        for name, module in self.named_modules():
            if getattr(module, "packed", None) is None:
                continue
            if name == "lm_head" and self.spec.tie_word_embeddings:
                continue
            out[f"{name}.weight"] = module
        return out

    def _fused_parts(self) -> dict[str, int]:
        """Fused parameter name -> number of checkpoint tensors that fill it."""
        out: dict[str, int] = {}
        for module_name, module in self.named_modules():
            if isinstance(module, Linear) and len(module.output_sizes) > 1:
                out[f"{module_name}.weight"] = len(module.output_sizes)
                if module.bias is not None:
                    out[f"{module_name}.bias"] = len(module.output_sizes)
        return out
