"""The shape of a Llama, Mistral, Phi-3, Qwen2 or Qwen3 checkpoint, read from its config: what both model
implementations (the torch one, models/llama.py; the CPU kernels' one, models/cpu_llama.py)
build from. No torch here: the CPU model's worker never imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Checkpoints that store a fused projection themselves (Phi-3: qkv_proj, gate_up_proj): the
# weight iterators split them into the parts above (``split_fused``), in this order of rows.
STORED_FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# Checkpoint projection -> (fused weight, index of its part in the fused output): both models
# fuse q/k/v and gate/up into one weight each (two products fewer per layer).
FUSED_PARTS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# Rotary variants whose frequencies do not depend on the sequence length, so one cos/sin table
# computed at load time is exact. "dynamic" and "longrope" change with the context length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class LlamaSpec:
    """The shape facts of a checkpoint, read once from its Hugging Face config.

    Kept separate from the config object so the modules below depend on a handful of named fields
    rather than on whichever attribute names a transformers version happens to use.
    """

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # The attention window of a sliding-window model (Mistral v0.1, Phi-3, Qwen2 with
    # use_sliding_window), None for full attention. The window is not implemented beyond its
    # length: the context (max_position_embeddings above) is capped at it, where every query
    # sees every earlier token, so attention is exactly the windowed one.
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, config: Any, architecture: str) -> LlamaSpec:
        """Read the fields this model needs; reject what it would silently get wrong."""
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise ValueError("partial rotary embeddings (partial_rotary_factor "
                             f"{config.partial_rotary_factor}) are not supported")
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        window = sliding_window(config, architecture)
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            max_position_embeddings=min(int(config.max_position_embeddings),
                                        window or int(config.max_position_embeddings)),
            sliding_window=window,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and never an o_proj bias; Llama and Qwen3 follow
            # ``attention_bias`` for all four projections.
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
        )


def sliding_window(config: Any, architecture: str) -> int | None:
    """The window a checkpoint's attention slides over, or None: Mistral and Phi-3 configs set
    ``sliding_window`` (null for full attention, as Mistral v0.2+); Qwen2's applies only with
    ``use_sliding_window``."""
    window = getattr(config, "sliding_window", None)
    if architecture == "Qwen2ForCausalLM" and not getattr(config, "use_sliding_window", False):
        return None
    if architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM") and not getattr(
            config, "use_sliding_window", False):
        return None
    return int(window) if window else None


def split_fused(name: str, tensor: Any, spec: LlamaSpec) -> list[tuple[str, Any]]:
    """A checkpoint tensor as the checkpoint names the models load: a stored fused projection
    (``STORED_FUSED``: Phi-3's qkv_proj and gate_up_proj, weights or biases) split by rows into
    its parts; any other tensor as it is. Rows are independent in every format the loaders keep
    (a packed weight's rows too), so the split is a view or a copy of whole rows."""
    module, _, attr = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    parts = STORED_FUSED.get(proj)
    if parts is None:
        return [(name, tensor)]
    if proj == "qkv_proj":
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        sizes = (q, kv, kv)
    else:
        sizes = (spec.intermediate_size, spec.intermediate_size)
    rows = tensor.shape[0] if not hasattr(tensor, "out_features") else tensor.out_features
    if rows != sum(sizes):
        raise ValueError(f"{name}: {rows} rows, expected {sum(sizes)} ({' + '.join(map(str, sizes))})")
    out, start = [], 0
    for part, size in zip(parts, sizes):
        out.append((f"{parent}.{part}.{attr}", _rows(tensor, start, start + size)))
        start += size
    return out


def _rows(tensor: Any, start: int, stop: int) -> Any:
    if hasattr(tensor, "out_features"):  # a packed weight: its rows of blocks
        import dataclasses

        return dataclasses.replace(tensor, data=tensor.data[start:stop])
    return tensor[start:stop]


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rotary settings as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; 4.x in ``rope_scaling`` (which may be
    None, or use the old key ``type``) plus a separate ``rope_theta``. Accept both.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params



def default_inv_freq(params: dict[str, Any], head_dim: int) -> np.ndarray | None:
    """The rotary inverse frequencies [head_dim / 2] (fp32) for the rope types computed without
    transformers ("default", and "linear": the default ones over the factor), computed in fp32
    as transformers computes them; None for the others (llama3 from a config, yarn), whose
    tables come from transformers' own functions (models/llama.py)."""
    rope_type = params["rope_type"]
    if rope_type not in ("default", "linear"):
        return None
    theta = np.float32(params["rope_theta"])
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (theta ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    return inv_freq.astype(np.float32)


def cos_sin_table(inv_freq: np.ndarray, max_positions: int, attention_factor: float = 1.0,
                  freq_factors: np.ndarray | None = None) -> np.ndarray:
    """``cat(cos, sin)`` of ``position * inv_freq`` for positions ``0 .. max_positions-1``:
    [max_positions, head_dim] fp32. ``freq_factors`` (GGUF's ``rope_freqs``: Llama 3's scaling
    as llama.cpp stores it) divide the frequencies first. The angles are fp32 products, as
    transformers forms them; their cosines and sines are taken in float64 and rounded."""
    if freq_factors is not None:
        if freq_factors.shape != inv_freq.shape:
            raise ValueError(f"rope frequency factors of shape {tuple(freq_factors.shape)} for "
                             f"{inv_freq.shape[0]} frequencies")
        inv_freq = (inv_freq / freq_factors.astype(np.float32)).astype(np.float32)
    positions = np.arange(max_positions, dtype=np.float32)
    freqs = np.outer(positions, inv_freq.astype(np.float32)).astype(np.float64)
    table = np.concatenate((np.cos(freqs), np.sin(freqs)), axis=-1).astype(np.float32)
    if attention_factor != 1.0:
        table *= np.float32(attention_factor)
    return np.ascontiguousarray(table)
