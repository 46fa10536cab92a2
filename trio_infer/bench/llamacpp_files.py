"""Test and bench models written by llama.cpp's own tools, and llama.cpp's logits on them.

The model hubs are out of reach, so a family's model is made here the way a download is made:
a Hugging Face folder of the family's real config shape scaled down, seeded random weights
(:func:`hf_checkpoint`), converted by the ``convert_hf_to_gguf.py`` that the llama-cpp-python sdist
vendors (:func:`convert`: F32, F16, BF16 or Q8_0) and quantized by ``llama_model_quantize``
(:func:`trio_infer.bench.quantized.quantize`: Q4_0, Q4_K_M, ...). The same file through
llama-cpp-python is the oracle (:func:`llama_cpp_logits`), and transformers on the folder a
second one.

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text, and
refuses a tokenizer it has not seen: the folders get the default model's tokenizer (SmolLM2's,
which it knows as ``smollm``), taken from the default model's file. Families whose converter reads
only a sentencepiece ``tokenizer.model`` get one trained here (:func:`sentencepiece_tokenizer`;
needs the ``sentencepiece`` package).

What is missing (llama-cpp-python, the default model, sentencepiece, the sdist that cannot be
downloaded) is said by :func:`missing`, so that tests skip with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

# What a converted folder's weights and tokenizer look like: the SmolLM2 vocabulary.
VOCAB_SIZE = 49152
# The converter's output types; quantized types come from llama_model_quantize.
OUT_TYPES = ("f32", "f16", "bf16", "q8_0")


def missing(sentencepiece: bool = False) -> str | None:
    """Why files cannot be made here (for a skip), or None."""
    from trio_infer.bench import llamacpp
    from trio_infer.models.default_model import default_cache_dir, default_model_file

    default = default_model_file(default_cache_dir())
    if not llamacpp.available():
        return "needs llama-cpp-python (pip install '.[bench-llamacpp]')"
    if not default.is_file():
        return f"needs the default model at {default} (make venv)"
    if sentencepiece:
        try:
            import sentencepiece  # noqa: F401
        except ImportError:
            return "needs sentencepiece (pip install sentencepiece)"
    try:
        source()
    except Exception as exc:  # the sdist could not be downloaded: no network
        return f"needs the llama-cpp-python sdist: {exc}"
    return None


def source() -> Path:
    """The llama.cpp that the llama-cpp-python sdist vendors, extracted once into the cache
    (the same tree llama-server is built from)."""
    from trio_infer.bench.llamaserver import cache_root, extract_vendored, fetch_sdist

    root = cache_root()
    return extract_vendored(fetch_sdist(root), root / "src")


def default_tokenizer() -> Any:
    """The default model's tokenizer (SmolLM2's BPE), as transformers reads it from the file."""
    from trio_infer.models.default_model import default_cache_dir, default_model_file
    from trio_infer.models.gguf_loader import load_gguf_tokenizer

    return load_gguf_tokenizer(default_model_file(default_cache_dir()))


def sentencepiece_tokenizer(out_dir: Path, vocab_size: int = 1000, seed: int = 0) -> Path:
    """A sentencepiece BPE model (``tokenizer.model``) trained on a fixed text, for converters
    that read only sentencepiece (Gemma 2, Phi-3). Deterministic for the same arguments."""
    import sentencepiece as spm

    text = out_dir / "spm-train.txt"
    rng = np.random.default_rng(seed)
    words = ["once", "upon", "a", "time", "there", "was", "little", "girl", "named", "lily",
             "she", "liked", "to", "play", "in", "the", "park", "with", "her", "dog", "sun",
             "tree", "happy", "big", "red", "ball", "and", "said", "hello", "mom", "boat"]
    lines = [" ".join(rng.choice(words, size=12)) for _ in range(2000)]
    text.write_text("\n".join(lines) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out_dir / "tokenizer"), vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, num_threads=1,
        bos_id=1, eos_id=2, unk_id=0, pad_id=3, minloglevel=2, seed_sentencepiece_size=1000,
        hard_vocab_limit=False)
    text.unlink()
    (out_dir / "tokenizer.vocab").unlink(missing_ok=True)
    return out_dir / "tokenizer.model"


def hf_checkpoint(out_dir: str | Path, model_type: str, architecture: str, *, seed: int = 0,
                  tokenizer: str = "default", **config: Any) -> Path:
    """A Hugging Face folder of ``model_type`` (transformers' name: ``"gemma3_text"``,
    ``"qwen3_moe"``...) with seeded random weights at unit scale
    (:func:`trio_infer.models.synthetic.init_weights`), fp32 safetensors, and a tokenizer the
    converter accepts: ``"default"`` (the default model's BPE, ``vocab_size`` 49152) or
    ``"sentencepiece"`` (a ``tokenizer.model``; give ``vocab_size`` >= 1000)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trio_infer.models.synthetic import init_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.setdefault("vocab_size", VOCAB_SIZE)
    if tokenizer == "default":
        tok = default_tokenizer()
        tok.save_pretrained(str(out))
        ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id)
    elif tokenizer == "sentencepiece":
        sentencepiece_tokenizer(out, vocab_size=int(config["vocab_size"]), seed=seed)
        ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    else:
        raise ValueError(f"tokenizer {tokenizer!r}: 'default' or 'sentencepiece'")
    for key, value in ids.items():
        config.setdefault(key, value)
    cfg = AutoConfig.for_model(model_type, architectures=[architecture], **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    init_weights(model, seed)
    model.save_pretrained(str(out))
    return out


def convert(hf_dir: str | Path, out: str | Path, out_type: str = "f32") -> Path:
    """``hf_dir`` written as a GGUF file by llama.cpp's ``convert_hf_to_gguf.py`` (the vendored
    gguf-py first on its path, as the script expects), once. Raises RuntimeError with the
    converter's last lines if it fails."""
    out = Path(out)
    if out.is_file():
        return out
    if out_type not in OUT_TYPES:
        raise ValueError(f"out_type {out_type!r}: expected one of {', '.join(OUT_TYPES)}")
    src = source()
    tmp = out.with_name(out.name + ".tmp")
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), NO_LOCAL_GGUF="")
    proc = subprocess.run(
        [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(tmp),
         "--outtype", out_type], capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py {hf_dir} failed:\n{proc.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def llama_cpp_logits(path: str | Path, ids: list[int], threads: int = 2) -> np.ndarray:
    """llama.cpp's fp32 logits [len(ids), vocab] for one prompt (one batch, its defaults:
    F16 KV cache), through llama-cpp-python."""
    import llama_cpp

    from trio_infer.bench.llamacpp import _quiet_log

    llama_cpp.llama_log_set(_quiet_log(), None)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(256, len(ids) + 8),
                          n_batch=max(64, len(ids)), n_threads=threads, logits_all=True,
                          verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()
