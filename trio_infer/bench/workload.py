"""Seeded synthetic workloads, the same for our engine and every baseline of one invocation.

A workload is a list of :class:`BenchRequest`: prompt token ids and the number of output tokens
wanted. Lengths are drawn uniformly from inclusive ranges (``--input-len 32:512``); token ids are
drawn uniformly from ``[first_id, vocab_size)``, skipping the special tokens at the start of the
vocabulary, so a prompt never contains an end-of-sequence token by accident.

With ``shared_prefix_len = N`` every prompt is the same N tokens followed by its own suffix whose
length is drawn from the input range: the shape of a system prompt shared by many requests.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

from trio_infer.bench import stats


@dataclass(frozen=True)
class LengthRange:
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return f"{self.lo}:{self.hi}"


def parse_range(text: str) -> LengthRange:
    """``"32:512"`` -> 32..512 inclusive; ``"128"`` -> exactly 128. For argparse ``type=``."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with integers, got {text!r}")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX in MIN:MAX, got {text!r}")
    return LengthRange(parts[0], parts[1])


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def make_workload(
    num_prompts: int,
    input_len: LengthRange,
    output_len: LengthRange,
    vocab_size: int,
    *,
    seed: int = 0,
    shared_prefix_len: int = 0,
    first_id: int = 3,
) -> list[BenchRequest]:
    """The same arguments give the same workload, on any machine."""
    if vocab_size <= first_id:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary token above id {first_id}")
    rng = random.Random(seed)
    prefix = [rng.randrange(first_id, vocab_size) for _ in range(shared_prefix_len)]
    requests = []
    for _ in range(num_prompts):
        n_in = input_len.draw(rng)
        n_out = output_len.draw(rng)
        suffix = [rng.randrange(first_id, vocab_size) for _ in range(n_in)]
        requests.append(BenchRequest(prefix + suffix, n_out))
    return requests


def warmup_request(workload: list[BenchRequest]) -> BenchRequest:
    """An untimed request of ordinary tokens: the workload's first 16 prompt ids, 4 new tokens."""
    return BenchRequest(workload[0].prompt_ids[:16], 4)


# The record of one system's run over a workload, the same fields for every system of ``offline``.
def make_result(workload: list[BenchRequest], out_tokens: list[int], elapsed: float,
                ttfts: list[float] | None, **extra: Any) -> dict[str, Any]:
    prompt = sum(r.prompt_len for r in workload)
    output = sum(out_tokens)
    res: dict[str, Any] = {
        "requests": len(workload),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "elapsed_s": elapsed,
        "output_tok_s": output / elapsed,
        "total_tok_s": (prompt + output) / elapsed,
    }
    if ttfts:
        prefill_done = max(ttfts)
        res["ttft_s"] = stats.summarize(ttfts)
        res["prefill_done_s"] = prefill_done
        res["prefill_tok_s"] = prompt / prefill_done
    res.update(extra)
    return res


# Short common English words: with a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen and our
# synthetic one) " word" is nearly always one token, so N words make a prompt of about N tokens
# on whatever server is measured, without knowing its tokenizer.
_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know get through back "
    "much before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why "
    "things help put years different away again off went old number great tell men say small "
    "every found still between name should home big give air line set own under read last never "
    "us left end along while might next sound below saw something thought both few those always "
    "looked show large often together asked house world going want school important until form "
    "food keep children feet land side without boy once animals life enough took sometimes four "
    "head above kind began almost live page got earth need far hand high year mother light parts "
    "country father let night following picture being study second eyes soon times story boys "
    "since white days ever paper hard near sentence better best across during today others sure "
    "means knew its try told young miles sun ways thing whole hear example heard several change "
    "answer room sea against top turned learn point city play toward five using himself usually"
).split()


def make_text_prompt(num_words: int, rng: random.Random) -> str:
    """About ``num_words`` tokens of random English words (see ``_WORDS``)."""
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def make_text_workload(
    num_prompts: int,
    input_len: LengthRange,
    output_len: LengthRange,
    *,
    seed: int = 0,
    shared_prefix_len: int = 0,
) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) pairs for a load generator; prompt lengths are approximate."""
    rng = random.Random(seed)
    prefix = make_text_prompt(shared_prefix_len, rng) + " " if shared_prefix_len else ""
    out = []
    for _ in range(num_prompts):
        n_in = input_len.draw(rng)
        n_out = output_len.draw(rng)
        out.append((prefix + make_text_prompt(n_in, rng), n_out))
    return out
