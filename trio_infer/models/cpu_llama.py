"""Llama, Qwen2 and Qwen3 on the C kernels with numpy arrays: a GGUF model served on the CPU,
in a worker that never imports torch.

Importing torch costs a process ~220 MiB of resident memory (its libraries' static state and
a thousand Python modules), whatever the model: on the default 98 MB file that was most of the
worker's peak, 1.75x llama.cpp's. On the CPU every op of a GGUF model already runs in the C
kernels (:mod:`trio_infer_kernels.cpu`), which read numpy arrays as well as tensors, so this model
is the same computation as :class:`~trio_infer.models.llama.LlamaForCausalLM` on its CPU-kernel
path, op for op and in the same order, over numpy arrays. The torch model stays for everything else:
a Hugging Face folder, a GPU, tensor parallelism, a weight type the kernels do not read in place
(dequantized to fp32), a rope scaling whose table needs transformers, and
``TRIO_INFER_KERNELS=reference``. :func:`~trio_infer.models.loader.load_model` picks.

Weights are read from the GGUF file one tensor at a time (:meth:`GGUFCheckpoint.iter_weights`),
q/k/v and gate/up fused into one packed weight each as their parts arrive (one weight of rows
of blocks, or a :class:`~trio_infer_kernels.cpu.PackedParts` where the parts' formats differ), then
put in the interleaved layout the kernels read fastest (trio_infer_kernels.cpu.LAYOUTS).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from trio_infer_kernels.cpu import (
    CpuKernels,
    DecoderLayerWeights,
    DecoderWeights,
    DecodeStep,
    Packed,
    PackedParts,
    PackedWeight,
    kv_kind_name,
    waits_sleep_at_once,
)
from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.models.base import ModelInfo
from trio_infer.models.spec import FUSED_PARTS, LlamaSpec
from trio_infer.models.step_threads import StepThreads

_NUM_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}
# A layer's tensors by Hugging Face module path inside ``model.layers.N``.
_LAYER_NORMS = {"input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                "self_attn.k_norm"}


@dataclass
class _Layer:
    """One decoder layer as it loads: norms, and each fused projection's parts until all came."""

    norms: dict[str, np.ndarray]
    parts: dict[str, dict[int, Any]]  # "qkv_proj.weight" -> part index -> PackedWeight / bias
    linears: dict[str, Any]  # "self_attn.o_proj.weight" -> PackedWeight; fused ones once whole


class CpuLlama:
    """Implements :class:`~trio_infer.models.base.CausalLM` over the C kernels and numpy.

    Build it with :meth:`load`. ``threads``: the worker's thread count (Settings.worker_threads),
    what torch's intra-op count is to the torch model; a narrow one-call decode step may run on
    fewer (models/step_threads.py)."""

    def __init__(self, spec: LlamaSpec, info: ModelInfo, kernels: CpuKernels,
                 weights: DecoderWeights, threads: int) -> None:
        self.spec = spec
        self.info = info
        self.threads = threads
        self._kernels = kernels
        self._weights = weights
        self._scale = spec.head_dim**-0.5
        # Pure decode steps run as one C call, built on first use per page size and KV dtype;
        # False turns it off (tests compare both paths; the bench's one-worker system).
        self.fused_decode = True
        self.reads_quantized_kv = True  # the C kernels write and read q8_0 / q4_0 KV in place
        self._decode_steps: dict[tuple[int, str], DecodeStep] = {}
        self._step_bytes = weights.lm_head.nbytes + sum(
            lin[0].nbytes for layer in weights.layers
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self.step_threads = StepThreads(waits_sleep_at_once())  # read as OpenMP read it

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def load(cls, spec: LlamaSpec, info: ModelInfo, kernels: CpuKernels, cos_sin: np.ndarray,
             weights: Iterable[tuple[str, Any]], packed: Mapping[str, str | tuple[str, ...]],
             activations: str, threads: int) -> CpuLlama:
        """The model from ``weights`` (Hugging Face names -> :class:`PackedWeight` for every
        linear weight and packed table, fp32 arrays for the rest), ``packed`` the formats
        :func:`~trio_infer.models.loader.packed_modules` chose. Raises ValueError on a tensor it
        has no place for, a shape that does not fit, or a weight the checkpoint lacks."""
        layers = [_Layer({}, {}, {}) for _ in range(spec.num_layers)]
        tables: dict[str, Any] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and spec.tie_word_embeddings:
                continue
            if not name.startswith("model.layers."):
                tables[name] = tensor
                continue
            index, _, rest = name.removeprefix("model.layers.").partition(".")
            layer = layers[int(index)]
            module, _, attr = rest.rpartition(".")
            parent, _, proj = module.rpartition(".")
            if module in _LAYER_NORMS and attr == "weight":
                layer.norms[module] = _f32(tensor, name)
            elif proj in FUSED_PARTS:
                fused, part = FUSED_PARTS[proj]
                key = f"{parent}.{fused}.{attr}"
                layer.parts.setdefault(key, {})[part] = tensor
                if len(layer.parts[key]) == _NUM_PARTS[fused]:
                    layer.linears[key] = _fuse(layer.parts.pop(key), attr, name)
            elif module in ("self_attn.o_proj", "mlp.down_proj"):
                layer.linears[f"{module}.{attr}"] = tensor
            else:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
        layout = {"int8": "x8", "exact": "x16"}.get(activations, "rows")

        def linear(layer: _Layer, i: int, module: str) -> tuple[Packed, np.ndarray | None]:
            w = layer.linears.get(f"{module}.weight")
            if not isinstance(w, (PackedWeight, PackedParts)):
                raise ValueError(f"model.layers.{i}.{module}.weight: missing, or not in blocks "
                                 f"the CPU kernels read ({packed.get(f'model.layers.{i}.{module}')})")
            bias = layer.linears.get(f"{module}.bias")
            return (w.with_activations(activations).with_layout(layout, threads),
                    None if bias is None else _f32(bias, f"{module}.bias"))

        built = []
        for i, layer in enumerate(layers):
            if layer.parts:
                raise ValueError(f"model.layers.{i}: the checkpoint lacks parts of "
                                 f"{', '.join(sorted(layer.parts))}")
            norms = layer.norms
            for norm in ("input_layernorm", "post_attention_layernorm"):
                if norm not in norms:
                    raise ValueError(f"checkpoint lacks model.layers.{i}.{norm}.weight")
            if spec.qk_norm and not {"self_attn.q_norm", "self_attn.k_norm"} <= set(norms):
                raise ValueError(f"checkpoint lacks model.layers.{i}'s q/k norms")
            built.append(DecoderLayerWeights(
                norms["input_layernorm"], norms["post_attention_layernorm"],
                norms.get("self_attn.q_norm"), norms.get("self_attn.k_norm"),
                linear(layer, i, "self_attn.qkv_proj"), linear(layer, i, "self_attn.o_proj"),
                linear(layer, i, "mlp.gate_up_proj"), linear(layer, i, "mlp.down_proj")))
        embed = tables.pop("model.embed_tokens.weight", None)
        final_norm = tables.pop("model.norm.weight", None)
        lm_head = embed if spec.tie_word_embeddings else tables.pop("lm_head.weight", None)
        if tables:
            raise ValueError(f"unexpected checkpoint tensors {sorted(tables)}")
        if embed is None or final_norm is None or lm_head is None:
            raise ValueError("checkpoint lacks the embedding, the final norm or the lm_head")
        if isinstance(embed, PackedWeight):
            embed = embed.with_activations(activations).with_layout(layout, threads)
        else:
            embed = _f32(embed, "model.embed_tokens.weight")
        if spec.tie_word_embeddings:
            lm_head = embed  # one table, converted once
        elif isinstance(lm_head, PackedWeight):
            lm_head = lm_head.with_activations(activations).with_layout(layout, threads)
        if not isinstance(lm_head, PackedWeight):
            raise ValueError("the lm_head is not in blocks the CPU kernels read")
        for name, w in (("model.embed_tokens", embed), ("lm_head", lm_head)):
            shape = (w.out_features, w.in_features) if isinstance(w, PackedWeight) else w.shape
            if tuple(shape) != (spec.vocab_size, spec.hidden_size):
                raise ValueError(f"{name}.weight: checkpoint shape {tuple(shape)}, expected "
                                 f"{(spec.vocab_size, spec.hidden_size)}")
        weights_ = DecoderWeights(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                  spec.rms_norm_eps, embed, built, _f32(final_norm, "model.norm"),
                                  lm_head, np.ascontiguousarray(cos_sin, dtype=np.float32))
        _check_shapes(spec, weights_)
        return cls(spec, info, kernels, weights_, threads)

    # -- what it holds (for the benches) -----------------------------------------------------

    def packed_weights(self) -> dict[str, Packed]:
        """Module name (the torch model's: ``model.layers.0.self_attn.qkv_proj``,
        ``model.embed_tokens``, ``lm_head``) -> its packed weight, for every weight kept in
        blocks (a tied lm_head is the embedding's and is not listed)."""
        w = self._weights
        out: dict[str, Packed] = {}
        if isinstance(w.embed, PackedWeight):
            out["model.embed_tokens"] = w.embed
        for i, layer in enumerate(w.layers):
            prefix = f"model.layers.{i}"
            out[f"{prefix}.self_attn.qkv_proj"] = layer.qkv[0]
            out[f"{prefix}.self_attn.o_proj"] = layer.o[0]
            out[f"{prefix}.mlp.gate_up_proj"] = layer.gate_up[0]
            out[f"{prefix}.mlp.down_proj"] = layer.down[0]
        if w.lm_head is not w.embed:
            out["lm_head"] = w.lm_head
        return out

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the packed weights (a tied lm_head is the embedding's table, counted once)
        and of the other arrays (norms, biases, an fp32 embedding, the rotary table)."""
        w = self._weights
        packed = self._step_bytes
        if isinstance(w.embed, PackedWeight) and w.embed is not w.lm_head:
            packed += w.embed.nbytes
        return {"packed": packed, "dense": sum(a.nbytes for a in w.arrays())}

    def footprint(self) -> dict[str, int]:
        """What a decode step reads, for the profile's bounds: the linears' and the lm_head's
        bytes (the embedding is a lookup of one row a token) with the norms and biases, and the
        weight elements that take part in products."""
        w = self._weights
        dense = [a for a in w.arrays() if a is not w.cos_sin and a is not w.embed]
        linears = [w.lm_head] + [lin[0] for layer in w.layers
                                 for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return {"weight_bytes": self._step_bytes + sum(a.nbytes for a in dense),
                "gemm_weight_elems": sum(p.out_features * p.in_features for p in linears),
                "tied": int(w.lm_head is w.embed)}

    # -- the forward pass --------------------------------------------------------------------

    @property
    def one_call_decode(self) -> bool:
        """Whether decode steps have run as one C call (``tri_decode_step``)."""
        return bool(self._decode_steps)

    def forward(self, batch: ForwardBatch, k_caches: list[np.ndarray],
                v_caches: list[np.ndarray]) -> np.ndarray:
        """Run the step's tokens; return fp32 logits [len(batch.logits_indices), vocab]. The
        final norm and the lm_head run only on ``batch.logits_indices``."""
        step = self._decode_step(batch, k_caches[0]) if self.fused_decode else None
        if step is not None:
            rows = batch.num_tokens
            threads = self.step_threads.choose(rows, self._step_bytes, self.threads)
            start = time.perf_counter()
            logits = step(batch.input_ids, batch.positions, batch.slot_mapping, batch.page_table,
                          batch.seq_lens, batch.max_seq_len, k_caches, v_caches, threads)
            if StepThreads.narrow(rows, self._step_bytes, self.threads):
                self.step_threads.record(rows, self.threads, threads, time.perf_counter() - start)
            return logits
        k, t, w = self._kernels, self.threads, self._weights
        ids = np.ascontiguousarray(batch.input_ids, dtype=np.int64)
        if isinstance(w.embed, PackedWeight):
            hidden = k.dequant_rows(w.embed, ids)
        else:
            hidden = np.ascontiguousarray(w.embed[ids])
        residual: np.ndarray | None = None
        for i, layer in enumerate(w.layers):
            if residual is None:
                residual = hidden
                hidden = k.rms_norm(hidden, layer.input_norm, w.eps, None, t)[0]
            else:
                hidden, residual = k.rms_norm(hidden, layer.input_norm, w.eps, residual, t)
            hidden = self._attention(hidden, layer, batch, k_caches[i], v_caches[i])
            hidden, residual = k.rms_norm(hidden, layer.post_norm, w.eps, residual, t)
            gate_up = k.linear(hidden, layer.gate_up[0], layer.gate_up[1], t)
            hidden = k.linear(k.silu_and_mul(gate_up, t), layer.down[0], layer.down[1], t)
        rows = batch.logits_indices
        assert residual is not None
        hidden = k.rms_norm(np.ascontiguousarray(hidden[rows]), w.final_norm, w.eps,
                            np.ascontiguousarray(residual[rows]), t)[0]
        return k.linear(hidden, w.lm_head, None, t)

    def _attention(self, x: np.ndarray, layer: DecoderLayerWeights, batch: ForwardBatch,
                   k_cache: np.ndarray, v_cache: np.ndarray) -> np.ndarray:
        k, t, w = self._kernels, self.threads, self._weights
        num_tokens = x.shape[0]
        hq, hkv, d = w.num_heads, w.num_kv_heads, w.head_dim
        qkv = k.linear(x, layer.qkv[0], layer.qkv[1], t)
        q, key, v = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:]
        if layer.q_norm is not None and layer.k_norm is not None:
            # Per-head norm: rows of head_dim, so the same 2-D kernel as every other norm.
            q = k.rms_norm(np.ascontiguousarray(q).reshape(-1, d), layer.q_norm, w.eps, None, t)[0]
            key = k.rms_norm(np.ascontiguousarray(key).reshape(-1, d), layer.k_norm, w.eps, None,
                             t)[0]
        q = q.reshape(num_tokens, hq, d)
        key = key.reshape(num_tokens, hkv, d)
        v = v.reshape(num_tokens, hkv, d)
        k.rope_store(q, key, v, batch.positions, batch.slot_mapping, w.cos_sin, k_cache, v_cache)
        out = self._paged_attention(q, k_cache, v_cache, batch)
        return k.linear(out.reshape(num_tokens, hq * d), layer.o[0], layer.o[1], t)

    def _paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                         batch: ForwardBatch) -> np.ndarray:
        """The decode sequences in one call, the extending ones (prefill chunks) in another, as
        models/attention.py splits them for the torch model."""
        k, t = self._kernels, self.threads
        nd = batch.num_decodes
        if nd == batch.num_seqs:
            max_len = batch.max_seq_len or int(batch.seq_lens.max())
            return k.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens,
                                      self._scale, max_len, t)
        out = np.empty(q.shape, dtype=np.float32)
        if nd:
            lens = batch.seq_lens[:nd]
            out[:nd] = k.decode_attention(q[:nd], k_cache, v_cache, batch.page_table[:nd], lens,
                                          self._scale, int(lens.max()), t)
        lens = np.ascontiguousarray(batch.seq_lens[nd:])
        out[nd:] = k.extend_attention(
            q[nd:], k_cache, v_cache, batch.page_table[nd:],
            np.ascontiguousarray(batch.query_start_loc[nd:] - nd), lens, self._scale,
            int(lens.max()), t)
        return out

    def _decode_step(self, batch: ForwardBatch, k_cache: np.ndarray) -> DecodeStep | None:
        """The one-call decode step if this batch can take it: every sequence decodes one token
        and wants its logits."""
        if not (batch.num_decodes == batch.num_seqs == batch.num_tokens
                and batch.logits_indices.shape[0] == batch.num_tokens
                and batch.max_seq_len is not None
                and batch.page_table.strides[1] == batch.page_table.itemsize
                and k_cache.flags.c_contiguous):
            return None
        key = (int(k_cache.shape[1]), kv_kind_name(k_cache, self.spec.head_dim))
        step = self._decode_steps.get(key)
        if step is None:
            step = self._decode_steps[key] = self._kernels.decode_step(self._weights, *key)
        return step


def _f32(tensor: Any, name: str) -> np.ndarray:
    if isinstance(tensor, (PackedWeight, PackedParts)):
        raise ValueError(f"{name}: checkpoint gives {tensor.fmt} blocks for a plain tensor")
    return np.ascontiguousarray(tensor, dtype=np.float32)


def _fuse(parts: dict[int, Any], attr: str, name: str) -> Any:
    """A fused projection from its parts in order: the biases concatenated; the weights as one
    packed weight of their rows where they share a format, else a :class:`PackedParts`."""
    ordered = [parts[i] for i in range(len(parts))]
    if attr == "bias":
        return np.concatenate([_f32(p, name) for p in ordered])
    if not all(isinstance(p, PackedWeight) for p in ordered):
        raise ValueError(f"{name}: a fused projection's part is not in blocks the CPU kernels read")
    if len({p.fmt for p in ordered}) > 1:
        return PackedParts(tuple(ordered))
    fused = PackedWeight.empty(ordered[0].fmt, sum(p.out_features for p in ordered),
                               ordered[0].in_features)
    start = 0
    for p in ordered:
        fused.data[start:start + p.out_features] = p.data
        start += p.out_features
    return fused


def _check_shapes(spec: LlamaSpec, w: DecoderWeights) -> None:
    """Every projection's shape against the spec's (a half-fitting model would run and emit
    garbage)."""
    h, d = spec.hidden_size, spec.head_dim
    expected = {
        "qkv": ((spec.num_heads + 2 * spec.num_kv_heads) * d, h),
        "o": (h, spec.num_heads * d),
        "gate_up": (2 * spec.intermediate_size, h),
        "down": (h, spec.intermediate_size),
    }
    for i, layer in enumerate(w.layers):
        for name, shape in expected.items():
            packed, bias = getattr(layer, name)
            got = (packed.out_features, packed.in_features)
            if got != shape or (bias is not None and bias.shape != (shape[0],)):
                raise ValueError(f"model.layers.{i} {name}: checkpoint shape {got}, expected {shape}")
        if layer.input_norm.shape != (h,) or layer.post_norm.shape != (h,):
            raise ValueError(f"model.layers.{i}: norm of shape {layer.input_norm.shape}, expected {(h,)}")
