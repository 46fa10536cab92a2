"""The model layer against transformers, through the paged KV cache, and the checkpoint loader.

Every architecture variant is checked two ways against ``AutoModelForCausalLM`` on the same
checkpoint: prefill logits at every position (1e-4 max-abs, fp32) and 64 greedy tokens. Our side
always runs through real pages (:class:`PagedKV` hands out pages in shuffled order), including a
chunked prefill and a batch that mixes a decode with an extend, so the numbers prove the paged
path and the ``ForwardBatch`` layout, not just the layer math.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.models import synthetic
from trio_infer.models.base import CausalLM
from trio_infer.models.embedded import TINY_MODEL_NAME, ensure_tiny_model
from trio_infer.models.llama import LlamaForCausalLM, build_cos_sin_cache
from trio_infer.models.loader import (
    default_dtype,
    default_served_name,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from trio_infer.models.synthetic import (
    IM_END_ID,
    IM_START_ID,
    SHAPES,
    build_random_checkpoint,
    build_tokenizer,
)

CheckpointFactory = Callable[..., Path]  # the conftest fixture tiny_checkpoint_factory

TOL = 1e-4
NUM_NEW_TOKENS = 64
PROMPT_A = "The baker opened her shop at five o'clock, and the street smelled of bread."
PROMPT_B = "What time is it? It is almost noon."

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that with head_dim 16 some frequencies are kept, some divided, some smoothed.
    "original_max_position_embeddings": 64,
}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "llama3-rope": (
        "LlamaForCausalLM",
        {"max_position_embeddings": 256, "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    ),
    "qwen2-bias-untied": ("Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3-untied": ("Qwen3ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3-sharded": ("Qwen3ForCausalLM", {"max_shard_size": "100KB"}),
    # Mistral: Llama's layers; v0.2+ without a window, v0.1 with one (the context is capped at it).
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 96}),
    # Phi-3: q/k/v and gate/up stored fused, split at load.
    "phi3": ("Phi3ForCausalLM", {}),
}


class PagedKV:
    """A minimal stand-in for the engine's KV manager, enough to drive the model step by step.

    Pages come from a shuffled free list, so a sequence's pages are scattered and a wrong slot or
    page-table row would show up as wrong logits.
    """

    def __init__(self, model: CausalLM, num_pages: int = 64, page_size: int = 4) -> None:
        info = model.info
        shape = (num_pages, page_size, info.num_kv_heads, info.head_dim)
        self.model = model
        self.page_size = page_size
        self.k_caches = [torch.zeros(shape, dtype=getattr(torch, info.dtype)) for _ in range(info.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=getattr(torch, info.dtype)) for _ in range(info.num_layers)]
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist()
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(
        self, chunks: list[tuple[int, list[int]]], num_decodes: int, all_logits: bool = False
    ) -> list[torch.Tensor]:
        """Run one forward over ``chunks`` (``(seq_id, new_tokens)``, decodes first).

        Returns, per chunk, its logits: every token's row if ``all_logits``, else the last one's.
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        for seq_id, tokens in chunks:
            cached = self.lens.get(seq_id, 0)
            pages = self.pages.setdefault(seq_id, [])
            new_len = cached + len(tokens)
            while len(pages) * self.page_size < new_len:
                pages.append(self.free.pop())
            for pos in range(cached, new_len):
                positions.append(pos)
                slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
            first_row = len(ids)
            ids.extend(tokens)
            logits_rows.extend(range(first_row if all_logits else len(ids) - 1, len(ids)))
            starts.append(len(ids))
            seq_lens.append(new_len)
            self.lens[seq_id] = new_len
        max_pages = max(len(self.pages[seq_id]) for seq_id, _ in chunks)
        table = [self.pages[s] + [0] * (max_pages - len(self.pages[s])) for s, _ in chunks]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            page_table=torch.tensor(table),
            seq_lens=torch.tensor(seq_lens),
            query_start_loc=torch.tensor(starts),
            num_decodes=num_decodes,
            logits_indices=torch.tensor(logits_rows),
        )
        logits = self.model.forward(batch, self.k_caches, self.v_caches)
        assert logits.dtype == torch.float32
        assert logits.shape == (len(logits_rows), self.model.info.vocab_size)
        sizes = [len(t) if all_logits else 1 for _, t in chunks]
        return list(logits.split(sizes))


@dataclass(frozen=True)
class Case:
    path: Path
    ours: LlamaForCausalLM
    oracle: PreTrainedModel
    prompt_a: list[int]
    prompt_b: list[int]

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.oracle(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request: pytest.FixtureRequest, tiny_checkpoint_factory: CheckpointFactory) -> Case:
    architecture, overrides = CASES[request.param]
    path = tiny_checkpoint_factory(architecture, **overrides)
    ours = load_model(path)
    assert isinstance(ours, LlamaForCausalLM)
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path)
    return Case(
        path=path,
        ours=ours,
        oracle=oracle,
        prompt_a=tokenizer(PROMPT_A)["input_ids"],
        prompt_b=tokenizer(PROMPT_B)["input_ids"],
    )


def test_prefill_logits_match_transformers(case: Case) -> None:
    (ours,) = PagedKV(case.ours).step([(0, case.prompt_a)], num_decodes=0, all_logits=True)
    reference = case.reference_logits(case.prompt_a)
    assert (ours - reference).abs().max().item() < TOL
    # Only the requested rows: the last token's logits alone are the same numbers.
    (last,) = PagedKV(case.ours).step([(0, case.prompt_a)], num_decodes=0)
    assert last.shape[0] == 1
    assert (last[0] - reference[-1]).abs().max().item() < TOL


def test_greedy_matches_generate(case: Case) -> None:
    kv = PagedKV(case.ours)
    (logits,) = kv.step([(0, case.prompt_a)], num_decodes=0)
    ours: list[int] = []
    for _ in range(NUM_NEW_TOKENS):
        ours.append(int(logits[-1].argmax()))
        (logits,) = kv.step([(0, [ours[-1]])], num_decodes=1)

    prompt = torch.tensor([case.prompt_a])
    case.oracle.generation_config.eos_token_id = None  # run all 64 tokens, like ignore_eos
    generated = case.oracle.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=NUM_NEW_TOKENS,
        pad_token_id=0,
    )
    theirs = generated[0, len(case.prompt_a) :].tolist()
    assert len(theirs) == NUM_NEW_TOKENS
    assert ours == theirs
    assert len(set(ours)) > 4, "degenerate random model: greedy output barely varies"


def test_chunked_prefill_matches_transformers(case: Case) -> None:
    kv = PagedKV(case.ours)
    cut = 7  # not a multiple of the page size: the second chunk starts mid-page
    (first,) = kv.step([(0, case.prompt_a[:cut])], num_decodes=0, all_logits=True)
    (second,) = kv.step([(0, case.prompt_a[cut:])], num_decodes=0, all_logits=True)
    reference = case.reference_logits(case.prompt_a)
    assert (torch.cat([first, second]) - reference).abs().max().item() < TOL


def test_mixed_decode_and_extend_batch(case: Case) -> None:
    """One step holding a decode (sequence A) and a prefill chunk (sequence B), then a step where
    both decode: each sequence's logits match running it alone through transformers."""
    kv = PagedKV(case.ours)
    a, b = list(case.prompt_a), list(case.prompt_b)
    (logits_a,) = kv.step([(0, a)], num_decodes=0)
    a.append(int(logits_a[-1].argmax()))

    decode_a, extend_b = kv.step([(0, a[-1:]), (1, b)], num_decodes=1, all_logits=True)
    assert (decode_a[0] - case.reference_logits(a)[-1]).abs().max().item() < TOL
    assert (extend_b - case.reference_logits(b)).abs().max().item() < TOL

    a.append(int(decode_a[0].argmax()))
    b.append(int(extend_b[-1].argmax()))
    decode_a, decode_b = kv.step([(0, a[-1:]), (1, b[-1:])], num_decodes=2)
    assert (decode_a[0] - case.reference_logits(a)[-1]).abs().max().item() < TOL
    assert (decode_b[0] - case.reference_logits(b)[-1]).abs().max().item() < TOL


def test_checkpoint_variants_are_what_they_claim(
    tiny_checkpoint_factory: CheckpointFactory,
) -> None:
    """Guards the parity cases against silently testing less than their names say."""
    sharded = tiny_checkpoint_factory("Qwen3ForCausalLM", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1

    qwen2 = load_model(tiny_checkpoint_factory("Qwen2ForCausalLM", tie_word_embeddings=False))
    assert isinstance(qwen2, LlamaForCausalLM)
    attn = qwen2.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert qwen2.lm_head.weight is not qwen2.model.embed_tokens.weight

    _, overrides = CASES["llama3-rope"]
    llama3 = load_model(tiny_checkpoint_factory("LlamaForCausalLM", **overrides))
    assert isinstance(llama3, LlamaForCausalLM)
    plain = build_cos_sin_cache(SimpleNamespace(rope_theta=500000.0), 16, 256, torch.device("cpu"))
    assert not torch.allclose(llama3.cos_sin_cache, plain)


# --- loader -------------------------------------------------------------------------------------


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_dtype_selection(tiny_checkpoint: Path) -> None:
    assert default_dtype("cpu") == torch.float32
    assert default_dtype(torch.device("cuda")) == torch.bfloat16
    assert default_dtype("cuda:1") == torch.bfloat16

    model = load_model(tiny_checkpoint)
    assert model.info.dtype == "float32"
    assert isinstance(model, LlamaForCausalLM)
    assert model.model.embed_tokens.weight.dtype == torch.float32

    half = load_model(tiny_checkpoint, dtype=torch.bfloat16)
    assert half.info.dtype == "bfloat16"
    assert isinstance(half, LlamaForCausalLM)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    (logits,) = PagedKV(half).step([(0, [5, 6, 7])], num_decodes=0)
    assert logits.dtype == torch.float32  # logits are fp32 whatever the weights


def test_model_info(tiny_checkpoint_factory: CheckpointFactory) -> None:
    path = tiny_checkpoint_factory("Qwen3ForCausalLM", max_position_embeddings=512)
    info = load_model(path).info
    assert (info.architecture, info.num_layers, info.num_kv_heads, info.head_dim) == (
        "Qwen3ForCausalLM",
        2,
        2,
        16,
    )
    assert info.vocab_size == 1024
    assert info.max_model_len == 512
    assert info.name == path.name
    assert load_model(path, served_name="my-model").info.name == "my-model"


def test_unknown_architecture_is_a_clear_error(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GemmaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GemmaForCausalLM") as error:
        load_model(path)
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
                      "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in str(error.value)


def test_missing_tensor_is_an_error(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="k_proj|qkv_proj"):
        load_model(path)


def test_eos_ids(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # generation_config.json lists several: <|im_end|> first, then <|endoftext|>.
    assert load_model(tiny_checkpoint).info.eos_token_ids == (IM_END_ID, 0)

    single = copy_checkpoint(tiny_checkpoint, tmp_path / "single")
    (single / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_model(single).info.eos_token_ids == (7,)

    without = copy_checkpoint(tiny_checkpoint, tmp_path / "without")
    (without / "generation_config.json").unlink()
    assert load_model(without).info.eos_token_ids == (IM_END_ID,)  # config.json's eos_token_id


def test_tiny_model_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = resolve_model_path(TINY_MODEL_NAME, tmp_path)
    assert path == tmp_path / "tiny-model"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-model"]  # no staging left behind

    def must_not_build(*args: object, **kwargs: object) -> Path:
        raise AssertionError("the tiny model was rebuilt")

    # embedded.py imports the builder when it builds (synthetic.py is slow to import)
    monkeypatch.setattr(synthetic, "build_random_checkpoint", must_not_build)
    assert ensure_tiny_model(tmp_path) == path
    assert resolve_model_path(TINY_MODEL_NAME, tmp_path) == path

    model = load_model(path)
    assert model.info.name == TINY_MODEL_NAME
    assert model.info.architecture == "Qwen3ForCausalLM"
    assert load_tokenizer(path).chat_template


def test_resolve_model_path(tmp_path: Path, tiny_checkpoint: Path) -> None:
    assert resolve_model_path(str(tiny_checkpoint), tmp_path) == tiny_checkpoint
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        resolve_model_path("trio-infer-tests/does-not-exist", tmp_path)
    assert not (tmp_path / "tiny-model").exists()


def test_served_name_of_a_hub_snapshot(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert default_served_name(snapshot) == "Qwen/Qwen3-0.6B"
    assert default_served_name(tmp_path) == tmp_path.name


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_chat_template(tiny_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(tiny_checkpoint)
    for text in (PROMPT_A, "naïve café, 12 €, 😀 and\ttabs\n", "  leading spaces"):
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(PROMPT_A)["input_ids"])
    assert any(t.startswith("Ġ") and len(t) > 2 for t in tokens), "no real merges"
    assert len(tokens) < len(PROMPT_A) / 2

    special = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert special == [IM_START_ID, IM_END_ID]
    assert tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not closed.endswith("assistant\n")
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 2


def test_builders_are_deterministic(tmp_path: Path, tiny_checkpoint: Path) -> None:
    first = build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    for file in sorted((tmp_path / "a").iterdir()):
        assert file.read_bytes() == (tmp_path / "b" / file.name).read_bytes(), file.name
    assert len(first) == 1024

    again = build_random_checkpoint(tmp_path / "again", "Qwen3ForCausalLM", **SHAPES["tiny"])
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name


def test_a_sliding_window_caps_the_context_and_says_so(tiny_checkpoint_factory,  # type: ignore[no-untyped-def]
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Mistral v0.1's window (96 here): the context is the window, where attention is exact."""
    with caplog.at_level(logging.WARNING, logger="trio_infer.models.loader"):
        model = load_model(tiny_checkpoint_factory("MistralForCausalLM", sliding_window=96))
    assert model.info.max_model_len == 96
    assert any("sliding window of 96 tokens" in r.getMessage() for r in caplog.records)
    full = load_model(tiny_checkpoint_factory("MistralForCausalLM", sliding_window=None))
    assert full.info.max_model_len == 4096
