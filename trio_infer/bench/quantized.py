"""GGUF files in the formats people download, made here: a real model's shape with seeded random
weights, or the default model requantized, quantized by llama.cpp's own quantizer.

The model hubs are out of reach, so the K-quant files the benchmarks and tests need are made
locally. A shape's F16 file is written with seeded random weights (the same bytes on every
machine) and SmolLM2's tokenizer, copied from the default model's metadata; llama.cpp's
``llama_model_quantize`` (llama-cpp-python, the ``bench-llamacpp`` extra) turns it into Q4_K_M,
Q5_K_M, Q6_K..., choosing each tensor's type as it does for a download (Q4_K_M keeps some
``attn_v`` and ``ffn_down`` in Q6_K, the output in Q6_K). The default model's file can be
requantized the same way (``--allow-requantize``: quality is beside the point, the layout is).

Files are made once into ``<cache>/bench-models/`` and written under a temporary name first, so
an interrupted build never leaves a half file that looks finished.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from trio_infer.bench import llamacpp

# Shapes of real models (seeded random weights). SmolLM2-1.7B: Llama architecture, tied
# embeddings, SmolLM2's 49152-token vocabulary.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-1.7b": dict(hidden=2048, intermediate=8192, layers=24, heads=32, kv_heads=32,
                         vocab=49152, context=8192, rope_theta=130000.0, eps=1e-5),
}

# llama.cpp's file types (llama_ftype) by the names its quantize tool uses.
FILE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M",
              "Q5_K_S", "Q5_K_M", "Q6_K")


def available() -> bool:
    """Whether llama-cpp-python (the quantizer) is installed."""
    return llamacpp.available()


def bench_models_dir(cache_dir: Path | None = None) -> Path:
    from trio_infer.models.default_model import default_cache_dir

    return (cache_dir or default_cache_dir()) / "bench-models"


def quantize(source: Path, out: Path, file_type: str, threads: int = 2) -> Path:
    """``source`` (any GGUF llama.cpp reads) quantized to ``file_type`` at ``out``, once."""
    import llama_cpp

    if out.is_file():
        return out
    if file_type not in FILE_TYPES:
        raise ValueError(f"file type {file_type!r}: expected one of {', '.join(FILE_TYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = threads
    params.allow_requantize = True
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({source.name} -> {file_type}) returned {rc}")
    os.replace(tmp, out)
    return out


def ensure_shape(shape: str, file_type: str, cache_dir: Path | None = None) -> Path:
    """The ``shape`` model quantized to ``file_type`` (made once: minutes for 1.7B on 2 cores)."""
    directory = bench_models_dir(cache_dir)
    out = directory / f"{shape}-{file_type}.gguf"
    if out.is_file():
        return out
    f16 = write_random_f16(shape, directory / f"{shape}-F16.gguf")
    return quantize(f16, out, file_type)


def ensure_requantized(file_type: str, cache_dir: Path | None = None) -> Path:
    """The default model (SmolLM2-135M-Instruct, Q4_1) requantized to ``file_type``."""
    from trio_infer.models.default_model import require_default_model

    source = require_default_model(cache_dir or _default_cache())
    return quantize(source, bench_models_dir(cache_dir) / f"smollm2-135m-{file_type}.gguf",
                    file_type)


def _default_cache() -> Path:
    from trio_infer.models.default_model import default_cache_dir

    return default_cache_dir()


def write_random_f16(shape: str, out: Path, seed: int = 0) -> Path:
    """An F16 GGUF of ``shape`` with seeded random weights (std 0.02; norms 1) and the default
    model's tokenizer. Written tensor by tensor: memory stays at one tensor."""
    import gguf

    from trio_infer.models.default_model import require_default_model

    if out.is_file():
        return out
    s = SHAPES[shape]
    h, inter, heads, kv, layers = s["hidden"], s["intermediate"], s["heads"], s["kv_heads"], s["layers"]
    head_dim = h // heads
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"{shape} (random weights, trio-infer bench)")
    writer.add_block_count(layers)
    writer.add_context_length(s["context"])
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(s["eps"])
    writer.add_vocab_size(s["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    reader = gguf.GGUFReader(str(require_default_model(_default_cache())))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)

    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s["vocab"], h))]
    for i in range(layers):
        tensors += [(f"blk.{i}.attn_norm.weight", (h,)),
                    (f"blk.{i}.attn_q.weight", (heads * head_dim, h)),
                    (f"blk.{i}.attn_k.weight", (kv * head_dim, h)),
                    (f"blk.{i}.attn_v.weight", (kv * head_dim, h)),
                    (f"blk.{i}.attn_output.weight", (h, heads * head_dim)),
                    (f"blk.{i}.ffn_norm.weight", (h,)),
                    (f"blk.{i}.ffn_gate.weight", (inter, h)),
                    (f"blk.{i}.ffn_up.weight", (inter, h)),
                    (f"blk.{i}.ffn_down.weight", (h, inter))]
    tensors.append(("output_norm.weight", (h,)))
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, dtype=np.float32) * 0.02)
                                     .astype(np.float16))
    writer.close()
    os.replace(tmp, out)
    return out
