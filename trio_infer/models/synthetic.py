"""Synthetic checkpoints: a real tokenizer and seeded random weights, saved like a real model.

Tests, benchmarks and the embedded default model all need a Llama-family checkpoint without a
network. Everything here goes through ``save_pretrained``, so the result is an ordinary Hugging Face
folder (config.json, safetensors, generation_config.json, tokenizer files) and loads through exactly
the path a downloaded checkpoint takes. The transformers model that wrote it is the test oracle.

All builders are deterministic: the same arguments give the same files, byte for byte.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
# The BPE trainer puts the special tokens first, in this order, so their ids are fixed.
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
# Qwen's convention: a chat turn ends with <|im_end|>, raw text with <|endoftext|>.
DEFAULT_EOS_TOKEN_IDS: tuple[int, ...] = (IM_END_ID, ENDOFTEXT_ID)

# ChatML, as the Qwen models use it, with a generation prompt for the assistant's turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Architecture -> transformers model_type, for the config class.
MODEL_TYPES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

SHAPES: dict[str, dict[str, Any]] = {
    # Seconds to build, milliseconds per step on a CPU: tests and the embedded default model.
    "tiny": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=1024,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    # Big enough that a GPU step is not all launch overhead: benchmarks.
    "small": dict(
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=32000,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    # The shapes of Qwen3-0.6B (random weights): realistic GPU benchmarks without a download.
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
}

# Standard deviation of the logits of a random model. HF's default init (std 0.02) gives logits
# near zero and a residual stream the embedding dominates, so greedy decoding repeats one token;
# with unit-scale layers and logits of this spread, outputs vary and top-2 gaps dwarf float noise.
_LOGIT_STD = 3.0
# Scale of queries and keys: attention scores of std about _QK_GAIN**2. At 1 (unit-scale q and k)
# attention is nearly uniform and a random model soon repeats one token forever.
_QK_GAIN = 3.0

# Training text for the tokenizer, written for this project. About 1.3k BPE merges fit in it.
_CORPUS = """\
The harbour town woke slowly on grey mornings. Fishing boats came back before the sun was high,
and the people on the quay counted crates, argued about prices, and drank strong tea from chipped
cups. Children ran between the nets while their parents talked about the weather, the tides, and
the new bridge that the council had promised for many years but never built.

A baker on the corner opened her shop at five o'clock every day. She mixed flour, water, salt and
yeast in a wooden bowl, folded the dough by hand, and left it to rise under a linen cloth. By seven
the street smelled of warm bread, and a short line formed outside her door. Some customers wanted
rye, others wanted sweet rolls with raisins, and one old sailor always asked for the darkest loaf
she had, because he said it reminded him of the ships he sailed on when he was young.

In the library near the station, a student was learning how computers read and write text. Her
teacher explained that a program splits each sentence into small pieces called tokens, and that a
model predicts the next token from the ones before it. "A token can be a whole word," he said,
"or only part of one, like the start of a long name or the end of a verb." She wrote the idea in
her notebook and drew arrows from each word to the next, then asked what happens when the model
meets a word it has never seen. "It falls back to smaller pieces," the teacher answered, "down to
single bytes if it must, so nothing is ever lost."

Questions and answers are the heart of a good conversation. What time is it? It is almost noon.
Where are you going? I am going to the market to buy apples, cheese, and a bottle of milk. Why is
the sky blue? Sunlight scatters in the air, and blue light scatters more than red light. How far
is the next village? About twelve kilometres, or three hours on foot if the road is dry. Can you
help me carry this box? Of course, it is lighter than it looks.

Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 2024, 3.14, and 0.5 are all common. A recipe may
ask for 250 grams of flour, 2 eggs, and 30 minutes in the oven at 180 degrees. A train leaves at
08:15 and arrives at 11:40. A list can be written as first, second, third, fourth, and fifth, or
as a, b, c, d, and e. Prices go up and down; a ticket that cost 12 euros last year now costs 15.

The weather changed quickly in autumn. Wind pushed the clouds across the hills, rain tapped on the
windows, and the river rose until it touched the lowest step of the old stone stairs. Farmers
brought the sheep down from the high fields, and families lit fires in the evening. When the storm
passed, the air was clean and cold, and the mountains looked close enough to touch.

Software engineers like to say that simple things should be simple and hard things should be
possible. A server receives a request, does some work, and sends a response. If the client goes
away in the middle, the server should notice, stop the work, and release what it was holding.
Every request must end exactly once, with an answer or with a clear error. Tests prove these
promises: they start many requests at once, cancel some of them, and check that nothing leaks.

Music filled the square on summer nights. A violinist played old songs, a drummer kept the beat on
an empty barrel, and people danced until the lamps were turned off. Tourists took pictures, and
the owner of the small hotel said that these were the best evenings of the year. In the morning
the square was quiet again, except for the pigeons and the man who swept the stones.

Good writing is clear writing. Use short sentences when you can, choose plain words, and say what
you mean. Read your text aloud, remove what is not needed, and check every number twice. A reader
who understands you on the first try will trust you on the second.

The garden behind the school grew beans, tomatoes, carrots, onions, and a row of tall sunflowers.
Each class looked after one bed, measured the plants every week, and wrote the results on a chart.
The youngest pupils were proud of their pumpkins, which grew so large that two of them had to
carry each one to the kitchen, where the cook turned them into soup for everyone.
"""


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the embedded text and save it to ``out_dir``.

    Byte-level like GPT-2/Llama 3/Qwen: every byte has a token, so any string round-trips, and the
    merges give real multi-character tokens with the ``Ġ`` leading-space marker. ``vocab_size`` is
    an upper bound: the embedded text supports about 1.3k tokens (3 special + 256 bytes + merges).
    Training is deterministic, so the files are the same every time.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(str(out_dir))
    return wrapped


def build_random_checkpoint(
    out_dir: str | Path,
    architecture: str = "Qwen3ForCausalLM",
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
    eos_token_ids: tuple[int, ...] = DEFAULT_EOS_TOKEN_IDS,
    max_shard_size: int | str = "50GB",
    **config_overrides: Any,
) -> Path:
    """Write a seeded random ``architecture`` checkpoint (and tokenizer) to ``out_dir``.

    The weights come from ``AutoModelForCausalLM.from_config`` and are then re-drawn at unit scale
    (see :func:`init_weights`), so the model's greedy output is varied rather than degenerate.
    A small ``max_shard_size`` gives a sharded checkpoint (``model.safetensors.index.json``).
    ``config_overrides`` go to the config as they are (e.g. ``attention_bias=True`` for Llama).
    Returns ``out_dir`` as a Path.
    """
    if architecture not in MODEL_TYPES:
        raise ValueError(
            f"unknown architecture {architecture!r}; known: {', '.join(MODEL_TYPES)}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        tokenizer = build_tokenizer(out, vocab_size=vocab_size)
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)"
            )
    rope_kwargs: dict[str, Any] = {"rope_theta": rope_theta}
    if rope_scaling is not None:
        rope_kwargs["rope_scaling"] = dict(rope_scaling)
    config = AutoConfig.for_model(
        MODEL_TYPES[architecture],
        architectures=[architecture],
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_ids[0],
        pad_token_id=ENDOFTEXT_ID,
        **rope_kwargs,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, seed)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=list(eos_token_ids), pad_token_id=ENDOFTEXT_ID
    )
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    return out


@torch.no_grad()
def init_weights(model: PreTrainedModel, seed: int) -> None:
    """Re-draw every parameter so each layer matters and the logits have a useful spread.

    Linear weights get std ``1/sqrt(fan_in)`` (activations keep unit scale through every layer),
    norm weights ``1 ± 0.1`` and biases std 0.1 (so a wrongly loaded norm or bias shows up), and
    the embedding and lm_head std ``_LOGIT_STD/sqrt(hidden)``: logits of about that spread, and an
    embedding small next to the layer outputs, so the model does not just echo its input token.
    """
    generator = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        # Queries and keys (or their per-head norms, in Qwen3) get a gain: sharp attention makes
        # the next token depend on specific earlier tokens, not on a blurred average of them.
        is_qk = any(k in name for k in ("q_proj.weight", "k_proj.weight", "q_norm", "k_norm"))
        gain = _QK_GAIN if is_qk else 1.0
        if name.endswith("norm.weight"):
            value = gain * (1.0 + 0.1 * noise)
        elif name.endswith("bias"):
            value = 0.1 * noise
        elif "embed_tokens" in name or name.startswith("lm_head"):
            value = noise * (_LOGIT_STD / math.sqrt(hidden))
        else:
            value = gain * noise / math.sqrt(param.shape[1])
            if name.endswith("qkv_proj.weight"):  # stored fused (Phi-3): the gain on q and k rows
                cfg = model.config
                head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
                qk_rows = (cfg.num_attention_heads + cfg.num_key_value_heads) * head_dim
                value[:qk_rows] *= _QK_GAIN
        param.copy_(value)
