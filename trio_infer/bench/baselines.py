"""The transformers baselines of ``offline``: what a user gets from ``model.generate`` directly.

- ``hf-sequential``: one request at a time, greedy, exactly ``output_len`` new tokens per request
  with ``--ignore-eos`` (``min_new_tokens = max_new_tokens``), else up to ``output_len``.
- ``hf-static``: left-padded static batches of ``--baseline-batch`` requests in workload order;
  each batch runs until its longest request is done; tokens past a request's own ``output_len``
  (or after its own EOS) are discarded and not counted.

Both load the same checkpoint with ``AutoModelForCausalLM.from_pretrained`` in the same dtype and
with the same torch thread count as our engine: a folder as it is, a GGUF file with
``from_pretrained(its folder, gguf_file=its name)`` (transformers dequantizes it to that dtype, as
our loader does), so every system runs the same weights.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from trio_infer.bench.engine_setup import torch_dtype
from trio_infer.bench.workload import BenchRequest, make_result, warmup_request


def load_hf(path: Path, dtype_name: str) -> Any:
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch_dtype(dtype_name)
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype_name))
    return model.eval()


def _eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _pad_id(model: Any) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = next(iter(_eos_ids(model)), 0)
    return int(pad)


def _counted(row: list[int], own_len: int, eos: set[int], ignore_eos: bool) -> int:
    """Tokens of one generated row that belong to its request."""
    row = row[:own_len]
    if not ignore_eos:
        for i, t in enumerate(row):
            if t in eos:
                return i + 1
    return len(row)


def generate(model: Any, batch: list[BenchRequest], ignore_eos: bool) -> list[int]:
    """One ``generate`` call over a left-padded batch; returns the counted tokens per request."""
    import torch

    pad = _pad_id(model)
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for b, r in enumerate(batch):
        ids[b, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
        mask[b, width - r.prompt_len :] = 1
    max_new = max(r.output_len for r in batch)
    kwargs: dict[str, Any] = dict(
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad,
    )
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    gen = out[:, width:].tolist()
    eos = _eos_ids(model)
    return [_counted(gen[b], r.output_len, eos, ignore_eos) for b, r in enumerate(batch)]


def run_hf(name: str, model: Any, args: argparse.Namespace,
           workload: list[BenchRequest]) -> dict[str, Any]:
    """Run baseline ``name`` over the workload with a model from :func:`load_hf` (one model
    serves every hf-* baseline of an invocation: ``generate`` leaves its weights as they are)."""
    from tqdm import tqdm

    warm = warmup_request(workload)
    generate(model, [warm, warm] if name == "hf-static" else [warm], True)

    size = 1 if name == "hf-sequential" else args.baseline_batch
    batches = [workload[i : i + size] for i in range(0, len(workload), size)]
    counted: list[int] = []
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc=name, unit="batch" if size > 1 else "req", leave=False):
        counted.extend(generate(model, batch, args.ignore_eos))
    elapsed = time.perf_counter() - t0
    return make_result(workload, counted, elapsed, None, batch_size=size)


def hf_decode_step_s(path: Path, dtype_name: str, prompt: list[list[int]], steps: int) -> float:
    """transformers' decode step time at batch ``len(prompt)``: the time of ``generate`` with
    ``1 + steps`` new tokens minus the time with 1 (the prefill), over ``steps``; best of two."""
    model = load_hf(path, dtype_name)
    reqs = [BenchRequest(p, 1) for p in prompt]
    generate(model, reqs, True)  # warm-up

    def timed(n: int) -> float:
        batch = [BenchRequest(p, n) for p in prompt]
        t = time.perf_counter()
        generate(model, batch, True)
        return time.perf_counter() - t

    best = float("inf")
    for _ in range(2):
        best = min(best, (timed(1 + steps) - timed(1)) / steps)
    del model
    return best
