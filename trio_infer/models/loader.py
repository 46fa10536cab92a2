"""From a model name or folder to a ready :class:`~trio_infer.models.base.CausalLM`.

A checkpoint is either an ordinary Hugging Face folder: ``config.json`` (parsed by transformers,
whose job that is), one or several ``*.safetensors`` files (read directly, tensor by tensor, so
peak memory is one tensor above the model), optional ``generation_config.json`` and tokenizer
files; or a single GGUF file (see :mod:`trio_infer.models.gguf_loader`), which holds all of that.
Nothing here downloads: a hub id must already be in the local Hugging Face cache, and the default
model must have been fetched by ``make venv`` (see :mod:`trio_infer.models.default_model`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from trio_infer.models.base import CausalLM, ModelInfo
from trio_infer.models.default_model import (
    KNOWN_GGUF_NAMES,
)
from trio_infer.models.embedded import SERVED_NAME_FILE
from trio_infer.models.gguf_loader import GGUFCheckpoint, load_gguf_tokenizer
from trio_infer.models.paths import find_gguf, resolve_model_path  # noqa: F401 (re-exported)
from trio_infer.models.spec import (
    SUPPORTED_ARCHITECTURES,
    LlamaSpec,
    cos_sin_table,
    default_inv_freq,
    rope_parameters,
    split_fused,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from trio_infer.models.cpu_llama import CpuLlama
    from trio_infer.models.parallel import ShardPlan

# transformers is imported where a Hugging Face folder's config or tokenizer is read, not here: a
# GGUF model needs neither, and the import costs the worker's start-up about a second. torch is
# imported where the torch model is built: a GGUF model served by the CPU kernels
# (models/cpu_llama.py) never imports it.

log = logging.getLogger(__name__)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's own tokenizer (and chat template), as transformers loads it (from the
    metadata, for a GGUF file)."""
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    served_name: str | None = None,
    keep_blocks: bool | None = None,
    activations: str = "exact",
    shard: tuple[int, int] | None = None,
    group: object = None,
    threads: int | None = None,
    backend: str = "auto",
) -> CausalLM:
    """Build the model of the checkpoint at ``path`` on ``device`` and load its weights.

    ``path`` is a Hugging Face folder or a GGUF file (or a folder holding one; see
    :func:`~trio_infer.models.gguf_loader.find_gguf`). A GGUF file on the CPU, where the CPU
    kernels run and read every linear weight of the file in place, loads as the numpy model
    over those kernels (:class:`~trio_infer.models.cpu_llama.CpuLlama`: no torch in the
    process); anything else as the torch model (``backend`` "torch" or "cpu" asks for one; "cpu"
    raises ValueError saying why it cannot serve the file). ``threads``: the CPU model's thread
    count (the torch model reads torch's). For the torch model: GGUF weights in a block format the CPU
    kernels read (:data:`trio_infer_kernels.cpu.FORMATS`: F16, BF16, Q4_0 to Q8_0, Q4_K, Q5_K, Q6_K)
    stay in it when ``keep_blocks`` is true, or is None and :func:`packing_possible` says they can
    run here; every other GGUF weight is dequantized to ``dtype`` (with a warning naming the type
    and the memory it takes, when it is a linear weight that a block format would have kept small).
    ``activations`` says how the CPU kernels multiply activations with kept blocks: exact, or
    rounded to int8 (see :data:`trio_infer_kernels.cpu.ACTIVATIONS`).
    ``dtype`` defaults to :func:`default_dtype`. The served name is ``served_name``, else the
    folder's ``served_name`` file, else the hub id for a folder inside the Hugging Face cache, else
    the folder name, or for a GGUF file its known name or file stem (see
    :func:`default_served_name`).

    ``shard``: ``(rank, size)`` of a tensor-parallel group (torch.distributed already
    initialised; ``group`` None is the default group): only that rank's slice of each weight is
    read into the model (:class:`~trio_infer.models.parallel.ShardPlan`), and its forward joins
    the group's collectives. Raises :class:`~trio_infer.models.parallel.ShardError` when the
    model cannot be split so.
    """
    if backend not in ("auto", "torch", "cpu"):
        raise ValueError(f"backend {backend!r}: one of auto, torch, cpu")
    gguf_file = find_gguf(Path(path))
    checkpoint = None if gguf_file is None else GGUFCheckpoint.open(gguf_file)
    if checkpoint is not None and backend != "torch":
        why = cpu_model_refusal(checkpoint, dtype, str(device), keep_blocks, shard)
        if why is None:
            return _load_cpu_model(checkpoint, served_name, activations, threads)
        if backend == "cpu":
            raise ValueError(f"{gguf_file.name} cannot be served by the CPU kernels' model: {why}")
        if str(device) == "cpu" and keep_blocks is not False:
            log.info("%s: served by the torch model, not the CPU kernels' numpy model: %s",
                     gguf_file.name, why)
    return _load_torch_model(Path(path), checkpoint, dtype, device, served_name, keep_blocks,
                             activations, shard, group)


def cpu_model_refusal(checkpoint: GGUFCheckpoint, dtype: object, device: str,
                      keep_blocks: bool | None, shard: tuple[int, int] | None) -> str | None:
    """Why the CPU kernels' numpy model cannot serve ``checkpoint`` with these settings, or None
    when it can: on the CPU, in fp32, whole (not a tensor-parallel shard), the C kernels built,
    every linear weight and the lm_head in a format they read, the attention heads' shape theirs,
    and a rotary table computed without transformers."""
    from trio_infer_kernels import cpu

    if device != "cpu":
        return f"the device is {device}"
    if dtype is not None and str(dtype).removeprefix("torch.") != "float32":
        return f"dtype {dtype} (it computes in float32)"
    if keep_blocks is False:
        return "the weights are to be dequantized (keep_gguf_blocks off)"
    if shard is not None:
        return "tensor parallelism"
    kernels, why = cpu.availability()
    if kernels is None:
        return f"the CPU kernels are unavailable ({why})"
    spec = LlamaSpec.from_config(checkpoint.config, checkpoint.architecture)
    if not cpu.attention_shape_supported(spec.num_heads, spec.num_kv_heads, spec.head_dim):
        return (f"heads of {spec.head_dim} ({spec.num_heads} query, {spec.num_kv_heads} kv) "
                "are not a shape the C attention takes")
    if default_inv_freq(rope_parameters(checkpoint.config), spec.head_dim) is None:
        return f"rope type {rope_parameters(checkpoint.config)['rope_type']!r}"
    packed = packed_modules(checkpoint.tensor_formats(), spec.tie_word_embeddings,
                            checkpoint.tensor_columns())
    linears = [f"model.layers.{i}.{m}" for i in range(spec.num_layers)
               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                         "mlp.down_proj")]
    linears.append("model.embed_tokens" if spec.tie_word_embeddings else "lm_head")
    odd = odd_rows(checkpoint)
    if odd:
        name, (kind, length) = next(iter(odd.items()))
        return (f"{len(odd)} weights ({name} first: {kind}) have rows of {length}, a length the "
                "CPU kernels' packed layouts do not take (multiples of 32; 256 for K-quants)")
    unread = sorted({_module_formats(checkpoint, m) for m in linears if m not in packed})
    if unread:
        return f"weights in {', '.join(unread)}, which the CPU kernels do not read in place"
    return None


def _module_formats(checkpoint: GGUFCheckpoint, module: str) -> str:
    """The GGUF types of a (possibly fused) module's checkpoint weights, for a message."""
    parent, _, leaf = module.rpartition(".")
    names = ([f"{parent}.{p}.weight" for p in _FUSED_FROM[leaf]] if leaf in _FUSED_FROM
             else [f"{module}.weight"])
    formats = checkpoint.tensor_formats()
    return "/".join(sorted({formats.get(n, "?") for n in names}))


def _load_cpu_model(checkpoint: GGUFCheckpoint, served_name: str | None, activations: str,
                    threads: int | None) -> CpuLlama:
    from trio_infer_kernels import cpu

    from trio_infer.models.cpu_llama import CpuLlama

    kernels = cpu.load()
    assert kernels is not None  # cpu_model_refusal checked
    spec = LlamaSpec.from_config(checkpoint.config, checkpoint.architecture)
    packed = packed_modules(checkpoint.tensor_formats(), spec.tie_word_embeddings,
                            checkpoint.tensor_columns())
    info = _model_info(served_name or default_served_name(checkpoint.path),
                       checkpoint.architecture, spec, spec.num_kv_heads, "float32",
                       checkpoint.eos_token_ids)
    inv_freq = default_inv_freq(rope_parameters(checkpoint.config), spec.head_dim)
    assert inv_freq is not None  # cpu_model_refusal checked
    cos_sin = cos_sin_table(inv_freq, spec.max_position_embeddings,
                            freq_factors=checkpoint.rope_freq_factors)
    kept = _kept_weights(packed)
    model = CpuLlama.load(spec, info, kernels, cos_sin,
                          checkpoint.iter_weights(f"Loading {info.name}", keep=kept), packed,
                          activations, threads or cpu.default_threads())
    release_freed_memory()
    return model


def _model_info(name: str, architecture: str, spec: LlamaSpec, num_kv_heads: int, dtype: str,
                eos_token_ids: tuple[int, ...]) -> ModelInfo:
    if spec.sliding_window is not None and spec.max_position_embeddings == spec.sliding_window:
        log.warning("%s attends over a sliding window of %d tokens, which is not implemented "
                    "beyond its length: the context is capped at %d tokens (where it is exactly "
                    "the windowed attention)", name, spec.sliding_window, spec.sliding_window)
    return ModelInfo(name=name, architecture=architecture, num_layers=spec.num_layers,
                     num_kv_heads=num_kv_heads, head_dim=spec.head_dim,
                     vocab_size=spec.vocab_size, max_model_len=spec.max_position_embeddings,
                     dtype=dtype, eos_token_ids=eos_token_ids)


def _kept_weights(packed: dict[str, str | tuple[str, ...]]) -> set[str]:
    """The checkpoint weight names that stay in blocks, for the packed modules."""
    kept = set()
    for module in packed:
        parent, _, leaf = module.rpartition(".")
        parts = _FUSED_FROM.get(leaf)
        # a fused module's parts, or the fused weight itself where the file stores it so (Phi-3)
        kept |= {f"{parent}.{p}.weight" for p in parts} | {f"{module}.weight"} if parts \
            else {f"{module}.weight"}
    return kept


def _load_torch_model(
    path: Path,
    checkpoint: GGUFCheckpoint | None,
    dtype: torch.dtype | str | None,
    device: str | torch.device,
    served_name: str | None,
    keep_blocks: bool | None,
    activations: str,
    shard: tuple[int, int] | None,
    group: object,
) -> CausalLM:
    """:func:`load_model` for the torch model (models/llama.py); ``checkpoint``: the GGUF file
    at ``path``, already opened, or None for a Hugging Face folder."""
    import torch

    from trio_infer.models.llama import LlamaForCausalLM, build_cos_sin_cache
    from trio_infer.models.parallel import Collectives, ShardPlan

    device = torch.device(device)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is None:
        dtype = default_dtype(device)
    freq_factors: torch.Tensor | None = None
    weights: Callable[[str], Iterator[tuple[str, torch.Tensor]]]
    if checkpoint is not None:
        path = checkpoint.path
        architecture, config = checkpoint.architecture, checkpoint.config
        eos_ids = checkpoint.eos_token_ids
        if checkpoint.rope_freq_factors is not None:
            freq_factors = torch.from_numpy(checkpoint.rope_freq_factors)
        if keep_blocks is None:
            keep_blocks = packing_possible(device, dtype)
        elif keep_blocks and not packing_possible(device, dtype):
            raise ValueError(
                "GGUF blocks can be kept only on the CPU, in float32, where the CPU kernels "
                "build (gcc, AVX2); use the dequantized weights instead"
            )
    else:
        architecture = _architecture(path)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        eos_ids = eos_token_ids(path, config)
        weights = partial(_iter_safetensors, path)
    spec = LlamaSpec.from_config(config, architecture)
    if checkpoint is None and architecture in STORED_FUSED_ARCHITECTURES:
        weights = partial(_split, weights, spec)  # before a shard plan sees the names
    packed: dict[str, str | tuple[str, ...]] = {}
    if checkpoint is not None:
        if keep_blocks:
            packed = packed_modules(checkpoint.tensor_formats(), spec.tie_word_embeddings,
                                    checkpoint.tensor_columns())
        kept = _kept_weights(packed)
        if keep_blocks:
            _warn_widened(checkpoint, kept)
    parallel = None
    if shard is not None:
        parallel = Collectives(ShardPlan.build(spec, shard[0], shard[1], packed), group)
    if checkpoint is not None:
        weights = partial(checkpoint.iter_weights, keep=kept,
                          shard=parallel.plan if parallel is not None else None)
    elif parallel is not None:
        weights = partial(_sharded, weights, parallel.plan)
    # Each rank's KV cache holds its own heads only.
    kv_heads = spec.num_kv_heads if parallel is None else parallel.plan.local_spec(spec).num_kv_heads
    info = _model_info(served_name or default_served_name(path), architecture, spec, kv_heads,
                       str(dtype).removeprefix("torch."), eos_ids)
    cos_sin_cache = build_cos_sin_cache(
        config, spec.head_dim, spec.max_position_embeddings, device, freq_factors
    )
    model = LlamaForCausalLM(spec, info, cos_sin_cache, device, packed, activations, parallel)
    model.load_weights(_tensors(weights(f"Loading {info.name}")))
    release_freed_memory()
    return model.eval()


def _tensors(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's weights with every numpy array (the GGUF loader's) as a tensor of the
    same memory, for the torch model."""
    import torch

    for name, tensor in weights:
        yield name, torch.from_numpy(tensor) if isinstance(tensor, np.ndarray) else tensor


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing), once a load is done.

    Each tensor of a load passes through buffers of its own size (the file's blocks, the packed
    rows) that are freed at once; after the first large one is freed glibc raises its mmap
    threshold, so the next ones come from the heap and their freed pages stay resident: on the
    1.7B-class Q4_K_M file about 65 MiB of a 1,340 MiB process right after the load. The
    worker's peak moves less (7 MiB there): without the trim the KV pool and the steps' buffers
    reuse those pages (docs/kernels.md, "Memory once loaded"). The weights themselves are never
    held twice: every transient is gone by the time this runs."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:  # glibc
        trim(0)


# Architectures whose checkpoints store q/k/v and gate/up fused (models/spec.py: split_fused).
STORED_FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)


def _split(weights: Callable[[str], Iterator[tuple[str, torch.Tensor]]], spec: LlamaSpec,
           desc: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with its stored fused projections split into their parts."""
    for name, tensor in weights(desc):
        yield from split_fused(name, tensor, spec)


def _sharded(weights: Callable[[str], Iterator[tuple[str, torch.Tensor]]], plan: ShardPlan,
             desc: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors cut to one rank's slices, still read one at a time."""
    for name, tensor in weights(desc):
        yield name, plan.take(name, tensor)


# A fused module of LlamaForCausalLM -> the checkpoint projections it is made of.
_FUSED_FROM = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _warn_widened(checkpoint: GGUFCheckpoint, kept: set[str]) -> None:
    """One warning per quantized type that is dequantized instead of read in place (Q2_K, Q3_K,
    the IQ types; or a fused projection the kernels cannot keep), with what it costs."""
    widened: dict[str, int] = {}
    for name, (kind, elements) in checkpoint.tensor_info().items():
        if name.endswith(".weight") and name not in kept and kind not in ("F32", "F16", "BF16"):
            widened[kind] = widened.get(kind, 0) + elements
    for kind, elements in sorted(widened.items()):
        log.warning("%s weights (%d of them, %.0f MB as fp32) are dequantized at load: the CPU "
                    "kernels do not read %s in place", kind, elements, elements * 4 / 1e6, kind)
    odd: dict[tuple[str, int], list[str]] = {}
    for name, key in odd_rows(checkpoint).items():
        odd.setdefault(key, []).append(name)
    info = checkpoint.tensor_info()
    for (kind, length), names in sorted(odd.items()):
        elements = sum(info[n][1] for n in names)
        width = 2 if kind in ("F16", "BF16") else None
        cost = (f"{elements * 4 / 1e6:.2f} MB as fp32 instead of {elements * width / 1e6:.2f} MB"
                if width else f"{elements * 4 / 1e6:.2f} MB as fp32")
        log.warning("%d %s weights have rows of %d, a length the CPU kernels' packed layouts do "
                    "not take (multiples of 32; 256 for K-quants): widened to fp32 at load (%s): "
                    "%s", len(names), kind, length, cost, _names(names))


def _names(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def packing_possible(device: str | torch.device, dtype: torch.dtype | str) -> bool:
    """True where packed GGUF blocks can be served: CPU, fp32 activations, C kernels built."""
    from trio_infer_kernels import cpu

    return (str(device) == "cpu" and str(dtype).removeprefix("torch.") == "float32"
            and cpu.load() is not None)


def packed_modules(formats: dict[str, str], tied: bool,
                   columns: dict[str, int] | None = None) -> dict[str, str | tuple[str, ...]]:
    """Module name -> format, for each linear layer (and the embedding, the lm_head) whose
    checkpoint weights are all in formats the CPU kernels read, in rows of a length they take
    (``columns``: weight name -> row length, :meth:`GGUFCheckpoint.tensor_columns`): one format,
    or for a fused projection whose parts differ (Q4_K_M's q/k in Q4_K, v in Q6_K), one per part.
    ``formats``: weight name -> GGUF type, as :meth:`GGUFCheckpoint.tensor_formats` gives it."""
    from trio_infer_kernels.cpu import FORMATS, row_length_supported

    out: dict[str, str | tuple[str, ...]] = {}
    modules: dict[str, dict[str, str]] = {}
    for name in formats:
        if not name.endswith(".weight"):
            continue
        module = name.removesuffix(".weight")
        parent, _, proj = module.rpartition(".")
        fused = next((f for f, parts in _FUSED_FROM.items() if proj in parts), None)
        modules.setdefault(f"{parent}.{fused}" if fused else module, {})[proj] = formats[name]
    for module, kinds in modules.items():
        leaf = module.rpartition(".")[2]
        if not (leaf.endswith("_proj") or module in ("model.embed_tokens", "lm_head")):
            continue
        if not all(kind in FORMATS for kind in kinds.values()):
            continue
        if columns is not None and not all(
                row_length_supported(kind, columns[_weight_name(module, proj)])
                for proj, kind in kinds.items()):
            continue
        if len(set(kinds.values())) == 1:
            out[module] = next(iter(kinds.values()))
        elif leaf in _FUSED_FROM and set(kinds) == set(_FUSED_FROM[leaf]):
            out[module] = tuple(kinds[part] for part in _FUSED_FROM[leaf])
    if tied:
        out.pop("lm_head", None)
    return out


def _weight_name(module: str, proj: str) -> str:
    """The checkpoint name of part ``proj`` of ``module`` (itself, unless it is fused)."""
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{proj}.weight" if leaf in _FUSED_FROM else f"{module}.weight"


def odd_rows(checkpoint: GGUFCheckpoint) -> dict[str, tuple[str, int]]:
    """Weights in a format the kernels read, in rows of a length their packed layouts do not
    take: name -> (type, row length)."""
    from trio_infer_kernels.cpu import FORMATS, row_length_supported

    columns = checkpoint.tensor_columns()
    return {name: (kind, columns[name]) for name, kind in checkpoint.tensor_formats().items()
            if name.endswith(".weight") and kind in FORMATS
            and not row_length_supported(kind, columns[name])}


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on CUDA; fp32 elsewhere, where bf16 matmuls are slow and fp32 keeps the CPU path an
    exact match for the transformers oracle."""
    import torch

    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def default_served_name(path: Path) -> str:
    """The id a checkpoint is served under when the user names none (see :func:`load_model`)."""
    if path.suffix.lower() == ".gguf" and path.is_file():
        return KNOWN_GGUF_NAMES.get(path.name, path.stem)
    marker = path / SERVED_NAME_FILE
    if marker.is_file():
        name = marker.read_text().strip()
        if name:
            return name
    # Hugging Face cache layout: .../models--{org}--{name}/snapshots/{revision}
    resolved = path.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent.name.removeprefix("models--").replace("--", "/")
    return resolved.name


def eos_token_ids(path: Path, config: object) -> tuple[int, ...]:
    """End-of-sequence ids: ``generation_config.json`` wins (it may list several, e.g. Qwen's
    ``<|im_end|>`` and ``<|endoftext|>``), else the model config's ``eos_token_id``."""
    value: object = None
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(config, "eos_token_id", None)
    if value is None:
        return ()
    ids = [value] if isinstance(value, int) else list(value)
    return tuple(dict.fromkeys(int(i) for i in ids))  # de-duplicated, order kept


def _architecture(path: Path) -> str:
    """The checkpoint's architecture, checked before transformers parses the rest of the config,
    so an unsupported model fails with our list of supported ones rather than somewhere deeper."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face checkpoint?")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    for architecture in architectures:
        if architecture in SUPPORTED_ARCHITECTURES:
            return architecture
    raise ValueError(
        f"unsupported architecture {', '.join(architectures) or '(none given)'} in {config_file}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files: those the shard index names, else ``model.safetensors``, else any."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _iter_safetensors(path: Path, desc: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every shard, with a progress bar over tensors.

    Tensors are read one at a time on the CPU; the model copies each into its (device, dtype)
    parameter, so a shard is never fully materialised twice.
    """
    from safetensors import safe_open

    files = _safetensors_files(path)
    counts = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            counts.append(len(list(f.keys())))
    with tqdm(total=sum(counts), desc=desc, unit="tensor") as progress:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    progress.update(1)
