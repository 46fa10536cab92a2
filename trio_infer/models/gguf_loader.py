"""GGUF checkpoints (llama.cpp's single-file format): config, weights, EOS ids and tokenizer.

A GGUF file holds everything a Hugging Face folder spreads over several files: the model's shape
as metadata under ``<arch>.*`` keys, the tokenizer (vocabulary, merges, special token ids, chat
template) under ``tokenizer.*``, and the tensors under llama.cpp's own names, most of them
quantized. This module turns one into what :mod:`trio_infer.models.loader` needs for the CPU
kernels' model (:mod:`trio_infer.models.cpu_llama`) or for the same
:class:`~trio_infer.models.llama.LlamaForCausalLM` a safetensors checkpoint builds. It imports no
torch:

- a config made from the metadata (:meth:`GGUFCheckpoint.open`), read by our own parser
  (:mod:`trio_infer.models.gguf_meta`: ``gguf.GGUFReader`` takes seconds over a vocabulary);
- ``(hf_name, tensor)`` pairs, each dequantized by ``gguf.quants.dequantize`` one at a time (peak
  memory: the model plus one fp32 tensor), renamed to Hugging Face names, and, for the ``llama``
  architecture, with the row permutation llama.cpp's converter applies to q/k undone;
- the tokenizer through transformers' own GGUF conversion.

Supported: the ``llama``, ``qwen2`` and ``qwen3`` architectures, tensor types F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, IQ4_NL and IQ4_XS. Anything else is refused
before a single tensor is read, with an error that names it. Weights the CPU kernels read in place
(:data:`trio_infer_kernels.cpu.FORMATS`) are read from the file with plain reads, one tensor at a
time, and packed (:meth:`~trio_infer_kernels.cpu.PackedWeight.from_blocks`): the file is never
mapped in whole, so its pages do not add to the process's resident memory.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from tqdm import tqdm

from trio_infer_kernels.cpu import PackedWeight
from trio_infer.models.gguf_meta import GGUFMetadata, TensorInfo
from trio_infer.models.parallel import ShardError, ShardPlan, block_columns
from trio_infer.models.paths import GGUFError, find_gguf  # noqa: F401 (re-exported)
from trio_infer.models.spec import LlamaSpec, split_fused

# GGUF ``general.architecture`` -> the Hugging Face architecture our model implements.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# Tensor types we dequantize (with gguf.quants.dequantize), by GGMLQuantizationType name.
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS",
)

# llama.cpp per-layer tensor name -> Hugging Face module path inside ``model.layers.N``.
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Architectures whose files store fused projections under their own names (Phi-3: q/k/v as
# attn_qkv, gate and up as one ffn_up of twice the rows).
_ARCH_LAYER_TENSORS: dict[str, dict[str, str]] = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
# llama.cpp stores Llama 3's rotary frequency factors as a tensor, not as config metadata.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def gguf_tensor_name(name: str, arch: str = "llama") -> str:
    """llama.cpp tensor name -> Hugging Face parameter name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), for a file of GGUF architecture ``arch``.
    Raises :class:`GGUFError` for an unknown one."""
    if m := _LAYER_RE.match(name):
        layer, kind, attr = m.groups()
        names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {})}
        if kind in names:
            return f"model.layers.{layer}.{names[kind]}.{attr}"
    elif m := _GLOBAL_RE.match(name):
        kind, attr = m.groups()
        if kind in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[kind]}.{attr}"
    raise GGUFError(f"unexpected tensor {name!r} in the GGUF file")


def unpermute_qk(weight: Any, num_heads: int) -> Any:
    """Undo the row permutation llama.cpp's converter applies to Llama's q/k weights (and biases).

    The converter regroups each head's rows from Hugging Face's rotate-half layout (first halves,
    then second halves) into interleaved pairs, which is what llama.cpp's rotary kernel expects;
    this puts them back. ``num_heads`` is the number of query heads for q, of kv heads for k.
    A torch tensor or a numpy array (packed blocks' rows: :attr:`PackedWeight.data`).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:])
        .swapaxes(1, 2)  # torch's and numpy's name for the same swap
        .reshape(weight.shape)
    )


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file: its metadata already checked, its tensors not yet read."""

    path: Path
    gguf_architecture: str  # "llama", "qwen2", "qwen3"
    architecture: str  # the Hugging Face name, e.g. "LlamaForCausalLM"
    config: Any  # the model's config, built from the metadata (see _config)
    eos_token_ids: tuple[int, ...]
    rope_freq_factors: np.ndarray | None  # Llama 3 rope scaling, as llama.cpp stores it (fp32)
    _meta: GGUFMetadata

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        """Read and check the metadata; raises :class:`GGUFError` on anything we cannot serve."""
        path = Path(path)
        meta = GGUFMetadata.open(path)
        fields = meta.fields
        arch = fields.get("general.architecture")
        if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
            raise GGUFError(
                f"unsupported GGUF architecture {arch!r} in {path}; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        tensors = {t.name: t for t in meta.tensors}
        unsupported = sorted(
            {f"{t.tensor_type.name} ({t.name})" for t in meta.tensors
             if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES},
        )
        if unsupported:
            shown = ", ".join(unsupported[:3]) + (" ..." if len(unsupported) > 3 else "")
            raise GGUFError(
                f"{path}: tensor type not supported: {shown}; "
                f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )
        if "token_embd.weight" not in tensors:
            raise GGUFError(f"{path} has no token_embd.weight tensor")
        config = _config(path, arch, fields, tensors)
        rope_freqs = None
        if ROPE_FREQS_TENSOR in tensors:
            rope_freqs = _dequantize(meta, tensors[ROPE_FREQS_TENSOR])
        return cls(
            path=path,
            gguf_architecture=arch,
            architecture=GGUF_ARCHITECTURES[arch],
            config=config,
            eos_token_ids=_eos_token_ids(fields),
            rope_freq_factors=rope_freqs,
            _meta=meta,
        )

    @property
    def num_tensors(self) -> int:
        return sum(1 for t in self._meta.tensors if t.name != ROPE_FREQS_TENSOR)

    def tensor_formats(self) -> dict[str, str]:
        """Hugging Face weight name -> its GGUF tensor type name (``"Q4_1"``, ``"F32"``, ...)."""
        return {name: kind for name, (kind, _) in self.tensor_info().items()}

    def tensor_columns(self) -> dict[str, int]:
        """Hugging Face weight name -> its row length (GGUF's first dimension: a linear
        weight's input features)."""
        return {gguf_tensor_name(t.name, self.gguf_architecture): int(t.shape[0])
                for t in self._meta.tensors if t.name != ROPE_FREQS_TENSOR}

    def tensor_info(self) -> dict[str, tuple[str, int]]:
        """Hugging Face weight name -> (GGUF type name, number of elements)."""
        return {gguf_tensor_name(t.name, self.gguf_architecture): (t.tensor_type.name, int(t.n_elements))
                for t in self._meta.tensors if t.name != ROPE_FREQS_TENSOR}

    def iter_weights(
        self, desc: str, keep: Container[str] = (), shard: ShardPlan | None = None
    ) -> Iterator[tuple[str, np.ndarray | PackedWeight]]:
        """Yield ``(hf_name, fp32 numpy array)`` for every weight, dequantized one at a time,
        with a progress bar over tensors. The model casts to the serving dtype (numpy, so that
        the CPU kernels' model loads without torch; the torch model takes the arrays as
        tensors of the same memory).

        A weight whose Hugging Face name is in ``keep`` comes as a :class:`PackedWeight` of its
        raw blocks instead (its type must be one the CPU kernels read).

        With ``shard`` every weight comes cut to that tensor-parallel rank's slice
        (:meth:`ShardPlan.take`); kept blocks of a row-parallel weight are cut between blocks
        before they are packed (a packed row cannot be cut)."""
        permute = self.gguf_architecture == "llama"
        num_heads = int(self.config.num_attention_heads)
        num_kv_heads = int(self.config.num_key_value_heads)
        stored_fused = self.gguf_architecture in _ARCH_LAYER_TENSORS
        if stored_fused and shard is not None:
            raise ShardError(f"{self.path.name}: tensor parallelism of a {self.gguf_architecture} "
                             "GGUF file (its fused q/k/v and gate/up tensors) is not built")
        spec = LlamaSpec.from_config(self.config, self.architecture) if stored_fused else None
        with tqdm(total=self.num_tensors, desc=desc, unit="tensor") as progress:
            for tensor in self._meta.tensors:
                if tensor.name == ROPE_FREQS_TENSOR:
                    continue  # folded into the rotary table (see rope_freq_factors)
                name = gguf_tensor_name(tensor.name, self.gguf_architecture)
                weight: np.ndarray | PackedWeight
                if name in keep:
                    weight = _blocks(self.path, tensor,
                                     shard.columns(name) if shard is not None else None)
                else:
                    weight = _dequantize(self._meta, tensor)
                heads = 0
                if permute and ".self_attn.q_proj." in name:
                    heads = num_heads
                elif permute and ".self_attn.k_proj." in name:
                    heads = num_kv_heads
                if heads and isinstance(weight, PackedWeight):  # the packed rows move
                    weight = PackedWeight(weight.fmt,
                                          np.ascontiguousarray(unpermute_qk(weight.data, heads)),
                                          weight.in_features)
                elif heads:
                    weight = unpermute_qk(weight, heads)
                if shard is not None:
                    weight = shard.take(name, weight)
                if spec is not None:
                    yield from split_fused(name, weight, spec)
                else:
                    yield name, weight
                progress.update(1)


def load_gguf_tokenizer(path: Path) -> Any:
    """The file's tokenizer, special tokens and chat template, converted by transformers."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        # transformers' messages for a file it cannot read are cryptic (a numpy reshape error for
        # a truncated file): ours, located, if the file's structure is at fault; else what
        # transformers said of its tokenizer metadata, on one line.
        GGUFCheckpoint.open(path)
        said = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise GGUFError(f"{path}: its tokenizer (the tokenizer.ggml.* metadata) cannot be built: "
                        f"{type(exc).__name__}: {said}") from exc


# -- helpers --------------------------------------------------------------------------------------


def _config(path: Path, arch: str, fields: dict[str, Any], tensors: dict[str, TensorInfo]) -> Any:
    """The model's config from the ``<arch>.*`` metadata and the tensor list.

    A plain namespace of the fields :class:`~trio_infer.models.llama.LlamaSpec` and the rotary
    table read (``rope_parameters`` as transformers 5 spells it), unless the file scales its rope
    (linear, yarn): the scaled frequencies come from transformers' own functions, which take a
    transformers config. Importing transformers' config machinery costs about a second of a
    start-up, and a plain model does not need it."""

    def meta(key: str, default: Any = None, required: bool = False) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None and required:
            raise GGUFError(f"{path} lacks the metadata key {arch}.{key}")
        return value

    hidden = int(meta("embedding_length", required=True))
    heads = int(meta("attention.head_count", required=True))
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, np.ndarray):  # per-layer counts: only a uniform list is a plain model
        if len(set(kv_heads.tolist())) != 1:
            raise GGUFError(
                f"{path}: per-layer kv head counts {kv_heads.tolist()} are not supported")
        kv_heads = kv_heads[0]
    head_dim = int(meta("attention.key_length", hidden // heads))
    value_dim = int(meta("attention.value_length", head_dim))
    rotary_dim = int(meta("rope.dimension_count", head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{path}: key length {head_dim} != value length {value_dim}")
    if rotary_dim != head_dim:
        raise GGUFError(
            f"{path}: partial rotary embeddings (rope dimension {rotary_dim} of head dim "
            f"{head_dim}) are not supported"
        )
    layers = int(meta("block_count", required=True))
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are (cols, rows)

    rope: dict[str, Any] = {"rope_theta": float(meta("rope.freq_base", 10000.0))}
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported")
        factor = float(meta("rope.scaling.factor", 1.0))
        original = meta("rope.scaling.original_context_length")
        rope["rope_scaling"] = {"rope_type": scaling, "factor": factor}
        if original is not None:
            rope["rope_scaling"]["original_max_position_embeddings"] = int(original)
    if ROPE_FREQS_TENSOR in tensors and "rope_scaling" in rope:
        raise GGUFError(f"{path}: both rope frequency factors and rope scaling metadata")

    def has(kind: str) -> bool:
        return f"blk.0.{kind}" in tensors

    kwargs: dict[str, Any] = dict(
        architectures=[GGUF_ARCHITECTURES[arch]],
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        intermediate_size=int(meta("feed_forward_length", required=True)),
        vocab_size=vocab_size,
        max_position_embeddings=int(meta("context_length", required=True)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
    )
    if arch == "phi3":
        if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
            raise GGUFError(f"{path}: Phi-3's longrope (rope_factors_long/short: the 128k files) "
                            "is not supported; the 4k files (default rope) are")
        kwargs["sliding_window"] = meta("attention.sliding_window")
    if arch == "llama":
        kwargs["attention_bias"] = has("attn_q.bias") or has("attn_output.bias")
        kwargs["mlp_bias"] = has("ffn_gate.bias")
    elif arch == "qwen3":
        kwargs["attention_bias"] = has("attn_q.bias")
    if "rope_scaling" in rope:
        from transformers import AutoConfig

        return AutoConfig.for_model(arch, **kwargs, **rope)
    return SimpleNamespace(model_type=arch, **kwargs, rope_parameters={
        "rope_type": "default", "rope_theta": rope["rope_theta"]})


def _eos_token_ids(fields: dict[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids: the file's EOS, then its end-of-turn / end-of-message tokens if set."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id")
    ids = [int(v) for key in keys if (v := fields.get(key)) is not None]
    return tuple(dict.fromkeys(ids))


def _blocks(path: Path, tensor: TensorInfo,
            columns: tuple[int, int] | None = None) -> PackedWeight:
    """One GGUF tensor packed for the kernels (:meth:`PackedWeight.from_blocks`), its blocks read
    from the file into a buffer of its own (freed once packed), not through the memory map.
    ``columns``: only these input columns (a tensor-parallel rank's), cut between blocks."""
    fmt = tensor.tensor_type.name
    rows, cols = reversed(tensor.shape)
    raw = np.empty(tensor.n_bytes, dtype=np.uint8)
    with open(path, "rb") as f:
        f.seek(tensor.data_offset)
        if f.readinto(memoryview(raw)) != raw.size:
            raise GGUFError(f"{path}: {tensor.name} ends past the end of the file")
    if raw.size % rows:
        raise GGUFError(f"{tensor.name}: {raw.size} bytes of {fmt} for {rows} rows")
    blocks = raw.reshape(rows, -1)
    if columns is not None and columns != (0, cols):
        start, stop = columns
        row_bytes = blocks.shape[1]
        block = block_columns(fmt)
        if start % block or stop % block or (start * row_bytes) % cols:
            raise ShardError(f"{tensor.name}: {fmt} blocks cannot be cut at columns "
                             f"{start}..{stop} of {cols}")
        blocks = blocks[:, start * row_bytes // cols: stop * row_bytes // cols]
        cols = stop - start
    try:
        return PackedWeight.from_blocks(fmt, blocks, cols)
    except ValueError as exc:
        raise GGUFError(f"{tensor.name}: {exc}") from exc


def _dequantize(meta: GGUFMetadata, tensor: TensorInfo) -> np.ndarray:
    """One GGUF tensor as an fp32 array of its Hugging Face shape (rows, cols), writable."""
    from gguf.quants import dequantize

    array = dequantize(meta.tensor_data(tensor), tensor.tensor_type)
    shape = tuple(reversed(tensor.shape))  # GGUF lists cols first
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # F32 tensors come back as views of the read-only memmap
        array = array.copy()
    return array
