"""``constrained``: the cost of constrained decoding (``response_format`` json_schema) in the engine.

One run, one model, one seeded workload (greedy, all requests at t=0, like ``offline``):

1. warm-up, then the workload with every request constrained by a typical extraction schema
   (nested objects, an array of objects, enums, bounded numbers and strings);
2. the same prompts unconstrained, each request making exactly as many tokens as it made
   constrained (``max_tokens`` = that count, ``ignore_eos``): the same tokens per request, so the
   batch has the same shape step by step and only the grammar differs. The prefix cache is off,
   so both runs prefill every prompt.

The two alternate for ``--rounds`` rounds (the machine may be shared: interleaving spreads any
other load over both), and the figures are totals over the rounds.

Reported: output tok/s of each and their ratio (constrained / unconstrained; the target is
>= 0.9), the time the masks took (in their thread, overlapped with the forward pass), and what a
first request pays before its first step: building llguidance's tokenizer tables (once per worker)
and compiling the schema (once per distinct schema; later requests copy the compiled matcher).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from trio_infer.bench import stats
from trio_infer.bench.engine_setup import (
    loadavg,
    engine_config,
    kv_bytes_per_token,
    model_config,
    resolve_checkpoint,
    set_threads,
    special_token_ids,
    token_range,
    warmup_request,
)
from trio_infer.bench.workload import make_workload, parse_range

# A typical extraction schema: what a client's pydantic model gives (objects, an array of
# objects, enums, bounded numbers, optional fields, bounded strings).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "status": {"enum": ["open", "closed", "pending"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16},
            "email": {"type": ["string", "null"], "maxLength": 24},
        }, "required": ["name", "email"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 3, "maxItems": 8, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 8},
                "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "kind": {"enum": ["part", "service", "fee"]},
            }, "required": ["sku", "qty", "price", "kind"], "additionalProperties": False,
        }},
        "note": {"anyOf": [{"type": "string", "maxLength": 32}, {"type": "null"}]},
    },
    "required": ["title", "status", "priority", "owner", "items", "note"],
    "additionalProperties": False,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="small", help="random-weight checkpoint shape (default: small)")
    p.add_argument("--model", default=None, help="a checkpoint folder or .gguf file instead of --shape")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = every core")
    p.add_argument("--num-prompts", type=int, default=32, help="the batch: every request at once")
    p.add_argument("--input-len", type=parse_range, default=parse_range("64:128"), metavar="MIN:MAX")
    p.add_argument("--max-tokens", type=int, default=192, help="cap of each constrained document")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="constrained then unconstrained, this many times")
    p.add_argument("--output-json", type=Path, default=None)


def _run(engine: Any, prompts: list[list[int]], params: list[Any]) -> tuple[list[int], float]:
    counts = [0] * len(prompts)
    t0 = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(i, prompt, p)
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.uid] += len(out.token_ids)
    return counts, time.perf_counter() - t0


def main(args: argparse.Namespace) -> int:
    import llguidance

    from trio_infer.engine.engine import Engine
    from trio_infer.engine.grammar import Grammars, TokenMasks
    from trio_infer.wire import SamplingParams
    from trio_infer.models.loader import load_model, load_tokenizer

    args.ignore_eos, args.page_size, args.max_running = True, None, args.num_prompts
    args.max_batched_tokens, args.kv_cache_mb = None, None
    threads = set_threads(args)
    path = resolve_checkpoint(args)
    vocab = model_config(path).vocab_size
    first_id, end_id = token_range(vocab, special_token_ids(path))
    workload = make_workload(args.num_prompts, args.input_len, parse_range(str(args.max_tokens)),
                             end_id, seed=args.seed, first_id=first_id)
    prompts = [r.prompt_ids for r in workload]

    model = load_model(path, dtype=args.dtype, device="cpu", threads=threads)
    tokenizer = load_tokenizer(path)
    t = time.perf_counter()
    grammars = Grammars.for_hf_tokenizer(tokenizer, model.info.vocab_size, model.info.eos_token_ids)
    tokenizer_s = time.perf_counter() - t
    source = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    t = time.perf_counter()
    grammars.matcher(source)
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    grammars.matcher(source)
    cached_s = time.perf_counter() - t

    tokens = sum(r.prompt_len + args.max_tokens for r in workload)
    # No prefix cache: the second run of the same prompts would skip their prefill.
    config = engine_config(args, tokens, kv_bytes_per_token(model.info), False)
    engine = Engine(model, config, device="cpu", grammars=grammars)
    print(f"model {path}, vocab {vocab}, {threads} torch threads, batch {args.num_prompts}, "
          f"input {args.input_len}, constrained documents up to {args.max_tokens} tokens", flush=True)

    # Mask time, as the mask thread spends it (overlapped with the forward pass): its compute
    # method wrapped with a timer for this run (restored after).
    mask_s = [0.0]
    compute = TokenMasks._compute

    def timed(self: TokenMasks) -> None:
        t0 = time.perf_counter()
        compute(self)
        mask_s[0] += time.perf_counter() - t0

    TokenMasks._compute = timed  # type: ignore[method-assign]
    warm = warmup_request(workload)
    _run(engine, [warm.prompt_ids, warm.prompt_ids], [
        SamplingParams(temperature=0, max_tokens=8, grammar=source),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    mask_s[0] = 0.0

    load = [loadavg()]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, grammar=source)
    constrained_s = plain_s = masks_total = 0.0
    rounds = []
    for _ in range(args.rounds):
        mask_s[0] = 0.0
        counts, c_s = _run(engine, prompts, [greedy] * len(prompts))
        masks_total += mask_s[0]
        plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in counts]
        counts_plain, p_s = _run(engine, prompts, plain)
        assert counts_plain == counts
        constrained_s, plain_s = constrained_s + c_s, plain_s + p_s
        rounds.append({"constrained_s": c_s, "unconstrained_s": p_s, "ratio": p_s / c_s,
                       "mask_thread_s": mask_s[0]})
        print(f"  round {len(rounds)}: constrained {c_s:.2f} s, unconstrained {p_s:.2f} s, "
              f"ratio {p_s / c_s:.3f}; masks {mask_s[0]:.2f} s in their thread", flush=True)
    load.append(loadavg())
    TokenMasks._compute = compute  # type: ignore[method-assign]

    out = sum(counts) * args.rounds
    result = {
        "output_tokens": out,
        "constrained_tok_s": out / constrained_s,
        "unconstrained_tok_s": out / plain_s,
        "ratio": plain_s / constrained_s,
        "constrained_s": constrained_s,
        "unconstrained_s": plain_s,
        "mask_thread_s": masks_total,
        "mask_us_per_token": 1e6 * masks_total / out,
        "tokenizer_tables_s": tokenizer_s,
        "first_compile_s": compile_s,
        "cached_matcher_s": cached_s,
        "document_tokens": stats.summarize([float(c) for c in counts]),
        "documents_finished": sum(1 for c in counts if c < args.max_tokens),
        "rounds": rounds,
        "loadavg_1m": load,
    }
    print(
        f"constrained:   {out:,} tokens in {constrained_s:.2f} s = {result['constrained_tok_s']:.1f} tok/s\n"
        f"unconstrained: {out:,} tokens in {plain_s:.2f} s = {result['unconstrained_tok_s']:.1f} tok/s\n"
        f"ratio constrained/unconstrained: {result['ratio']:.3f}\n"
        f"masks: {masks_total:.2f} s in their thread ({result['mask_us_per_token']:.0f} us per token), "
        f"overlapped with the forward pass\n"
        f"first request: llguidance tokenizer tables {1e3 * tokenizer_s:.0f} ms (once per worker), "
        f"schema compile {1e3 * compile_s:.1f} ms (once per schema), cached {1e3 * cached_s:.2f} ms\n"
        f"load average {load[0]:.2f} -> {load[1]:.2f}",
        flush=True,
    )
    if args.output_json:
        stats.write_json(args.output_json, {"result": result, "schema": SCHEMA, "config": {
            "model": str(path), "shape": None if args.model else args.shape, "threads": threads,
            "num_prompts": args.num_prompts, "input_len": str(args.input_len),
            "max_tokens": args.max_tokens, "seed": args.seed}, "environment": stats.environment()})
        print(f"wrote {args.output_json}")
    return 0
