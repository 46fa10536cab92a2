"""``offline --profile``: how far a decode step is from what this machine allows.

Two lower bounds on a decode step, both measured here, now, with the same torch thread count:

- memory bandwidth: every weight is read once per step (the tied embedding as the lm_head; an
  untied input embedding is a lookup and is not counted), so a step takes at least
  ``weight bytes / read bandwidth``. The bandwidth is that of ``torch.sum`` over a 1 GiB tensor
  (far larger than the L3 cache), best of several. A variant adds the KV cache read by attention.
- GEMM throughput: the step's FLOPs (2 per weight per sequence, plus attention's
  ``4 * context * heads * head_dim`` per layer and sequence) at the GFLOP/s of a compute-bound
  GEMM of the model's own width (512 rows), best of several.

Both are measured before and after the timed steps and the best of all is kept, so a moment of
contention on a shared machine lowers the achieved figure, never the bound.

The achieved step is the median over ``--profile-steps`` decode steps of our engine (schedule,
forward and sampling, commit: everything ``Engine.step`` does), split into its three phases.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from trio_infer.bench import baselines, llamacpp, stats
from trio_infer.engine.kv_cache import BLOCK_BYTES, ITEMSIZE
from trio_infer.bench.engine_setup import (
    build_engine,
    model_config,
    special_token_ids,
    token_range,
    torch_dtype,
)
from trio_infer.bench.workload import BenchRequest


def measure_read_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes per second that ``torch.sum`` reads from DRAM (best of ``repeats``)."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    del x
    return nbytes / best


def measure_gemm_flops(m: int, k: int, n: int, dtype: Any, repeats: int = 5) -> float:
    """FLOP/s of an ``[m, k] @ [k, n]`` matmul in ``dtype`` (best of ``repeats``)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * m * k * n / best


def model_footprint(model: Any) -> dict[str, int]:
    """Bytes of weights a decode step reads, and the weight elements that take part in GEMMs."""
    import torch.nn as nn

    if hasattr(model, "footprint"):  # the CPU kernels' numpy model (models/cpu_llama.py)
        return model.footprint()

    embed = None
    lm_head = None
    for name, mod in model.named_modules():
        if name.endswith("embed_tokens") and hasattr(mod, "weight"):
            embed = mod.weight
        if name.endswith("lm_head") and hasattr(mod, "weight"):
            lm_head = mod.weight
    tied = embed is not None and lm_head is not None and embed is lm_head
    read_bytes = 0
    gemm_elems = 0
    counted: set[int] = set()
    for name, mod in model.named_modules():  # weights kept as GGUF blocks (no parameter)
        packed = getattr(mod, "packed", None)
        if packed is None or id(packed) in counted:
            continue  # a tied lm_head is the embedding's blocks: counted once
        counted.add(id(packed))
        if name.endswith("embed_tokens") and not _packed_tied(model):
            continue  # a lookup reads one row per token
        read_bytes += packed.nbytes
        gemm_elems += packed.out_features * packed.in_features
    seen: set[int] = set()
    tensors = list(model.named_parameters())
    if isinstance(model, nn.Module):
        tensors += [(n, b) for n, b in model.named_buffers() if "cos_sin" not in n]
    for name, p in tensors:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embed and not tied:
            continue  # a lookup reads one row per token
        read_bytes += p.numel() * p.element_size()
        if p.dim() == 2:
            gemm_elems += p.numel()
    return {"weight_bytes": read_bytes, "gemm_weight_elems": gemm_elems, "tied": int(tied)}


def _packed_tied(model: Any) -> bool:
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return (lm_head is not None and embed is not None
            and getattr(lm_head, "packed", None) is not None
            and lm_head.packed is getattr(embed, "packed", None))


def run_profile(path: Path, args: argparse.Namespace, threads: int) -> int:
    import torch

    from trio_infer.wire import SamplingParams

    batch, ctx, steps = args.profile_batch, args.profile_context, args.profile_steps
    warm_steps = 3
    rng = random.Random(args.seed)
    config = model_config(path)
    first_id, end_id = token_range(config.vocab_size, special_token_ids(path))
    prompts = [[rng.randrange(first_id, end_id) for _ in range(ctx)] for _ in range(batch)]
    # A batch whose prompts take several chunked-prefill steps: the sequences that start first
    # decode during the later chunks, so each may make up to one token per prefill step (at most
    # ``ctx`` steps at any sane max_batched_tokens) before the timed steps begin; they must not
    # run out of tokens (and leave the batch) before the last timed step.
    max_tokens = warm_steps + steps + 1 + (ctx if batch > 1 else 0)
    workload = [BenchRequest(p, max_tokens) for p in prompts]
    engine = build_engine(path, args, workload, None)
    info = engine.model.info

    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=max_tokens,
                                                temperature=0.0, ignore_eos=True))
    # The bounds are measured before and after the timed steps and the best is kept: on a shared
    # machine a bound measured in a busy moment would flatter the achieved step.
    nbytes = args.profile_bandwidth_mb * 2**20
    gemm_shape = (512, config.hidden_size, 2 * config.intermediate_size, torch_dtype(args.dtype))
    bandwidth = measure_read_bandwidth(nbytes)
    gemm = measure_gemm_flops(*gemm_shape)
    made: dict[Any, int] = {}  # tokens made per sequence by the end of the prefill
    while len(made) < batch:  # prefill (maybe chunked) until every sequence has a token
        for o in engine.step():
            made[o.uid] = made.get(o.uid, 0) + len(o.token_ids)
    for _ in range(warm_steps):
        engine.step()
    phases: dict[str, list[float]] = {"schedule": [], "execute": [], "commit": [], "step": []}
    cpu: list[float] = []  # the process's CPU time a step: not inflated by time-sharing
    for _ in range(steps):
        c0 = time.process_time()
        t0 = time.perf_counter()
        plan = engine.schedule()
        t1 = time.perf_counter()
        result = engine.execute(plan)
        t2 = time.perf_counter()
        engine.commit(plan, result)
        t3 = time.perf_counter()
        cpu.append(time.process_time() - c0)
        assert plan.batch.num_tokens == batch, "not a pure decode step"
        phases["schedule"].append(t1 - t0)
        phases["execute"].append(t2 - t1)
        phases["commit"].append(t3 - t2)
        phases["step"].append(t3 - t0)
    model = engine.model
    # bytes a value of the KV cache's own dtype takes (fp16 on the CPU; q8_0: 34 per 32)
    dtype = engine.kv_cache.dtype
    elem = BLOCK_BYTES[dtype] / 32 if dtype in BLOCK_BYTES else ITEMSIZE[dtype]
    del engine

    foot = model_footprint(model)
    avg_ctx = ctx + sum(made.values()) / batch + warm_steps + steps / 2
    kv_bytes = batch * avg_ctx * 2 * info.num_layers * info.num_kv_heads * info.head_dim * elem
    num_heads = config.num_attention_heads
    flops = 2.0 * batch * foot["gemm_weight_elems"] + (
        4.0 * batch * avg_ctx * num_heads * info.head_dim * info.num_layers
    )
    del model

    bandwidth = max(bandwidth, measure_read_bandwidth(nbytes))
    gemm = max(gemm, measure_gemm_flops(*gemm_shape))
    med = {k: statistics.median(v) for k, v in phases.items()}
    achieved = med["step"]
    best_step = min(phases["step"])
    cpu_step = statistics.median(cpu)
    bw_bound = foot["weight_bytes"] / bandwidth
    bw_kv_bound = (foot["weight_bytes"] + kv_bytes) / bandwidth
    gemm_bound = flops / gemm

    hf_step = None
    if "hf-sequential" in args.baseline or "hf-static" in args.baseline:
        print("transformers: timing its decode step ...", flush=True)
        hf_step = baselines.hf_decode_step_s(path, args.dtype, prompts, steps)
    lc_step = lc_cpu = None
    if "llama.cpp" in args.baseline:
        lc_threads = args.llamacpp_threads or threads
        print(f"llama.cpp: timing its decode step ({lc_threads} threads) ...", flush=True)
        lc_wall, lc_cpus = llamacpp.decode_profile(path, lc_threads, batch, prompts, steps)
        lc_step, lc_cpu = statistics.median(lc_wall), statistics.median(lc_cpus)

    print(
        f"\ndecode at batch {batch}, context {ctx}..{ctx + max(made.values()) + warm_steps + steps}"
        f" (mean {avg_ctx:.0f}), {args.dtype}"
        f"{', GGUF blocks dequantized' if args.no_gguf_blocks else ''}"
        f"{'' if args.activations == 'exact' else f', {args.activations} activations'}, {threads} torch threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}; model {path}"
    )
    rows = [
        ["ours: achieved step (median)", achieved * 1e3, 1.0, ""],
        ["ours: fastest step", best_step * 1e3, None, ""],
        ["ours: CPU time a step (median)", cpu_step * 1e3, None,
         "all threads; spinning waits count"],
        ["  schedule+prepare", med["schedule"] * 1e3, None, ""],
        ["  execute (forward+sample)", med["execute"] * 1e3, None, ""],
        ["  commit", med["commit"] * 1e3, None, ""],
        ["bandwidth bound (weights)", bw_bound * 1e3, achieved / bw_bound,
         f"{foot['weight_bytes'] / 1e9:.3f} GB / {bandwidth / 1e9:.1f} GB/s"],
        ["bandwidth bound (weights+KV)", bw_kv_bound * 1e3, achieved / bw_kv_bound,
         f"+{kv_bytes / 1e9:.3f} GB KV"],
        ["GEMM-throughput bound", gemm_bound * 1e3, achieved / gemm_bound,
         f"{flops / 1e9:.2f} GFLOP / {gemm / 1e9:.0f} GFLOP/s"],
    ]
    if hf_step is not None:
        rows.append(["transformers step", hf_step * 1e3, hf_step / bw_bound, "ratio vs weights bound"])
    if lc_step is not None:
        rows.append(["llama.cpp step (its own file)", lc_step * 1e3, lc_step / bw_bound,
                     f"ours/llama.cpp tok/s: {lc_step / achieved:.2f}x"])
        rows.append(["llama.cpp CPU time a step", lc_cpu * 1e3, None,
                     f"ours/llama.cpp by CPU time: {lc_cpu / cpu_step:.2f}x"])
    stats.print_table(["", "ms", "achieved/bound", "from"],
                      [[a, b, c if c is not None else "", d] for a, b, c, d in rows])
    if args.output_json:
        stats.write_json(args.output_json, {
            "ours": {
                "step_ms": {k: stats.summarize(v, 1e3) for k, v in phases.items()},
                "achieved_step_ms": achieved * 1e3,
                "cpu_step_ms": cpu_step * 1e3,
            },
            "bounds": {
                "read_bandwidth_gb_s": bandwidth / 1e9,
                "gemm_gflop_s": gemm / 1e9,
                "weight_bytes": foot["weight_bytes"],
                "kv_bytes": kv_bytes,
                "decode_gflop": flops / 1e9,
                "bandwidth_bound_ms": bw_bound * 1e3,
                "bandwidth_kv_bound_ms": bw_kv_bound * 1e3,
                "gemm_bound_ms": gemm_bound * 1e3,
            },
            "baselines": {
                **({"transformers": {"step_ms": hf_step * 1e3}} if hf_step else {}),
                **({"llama.cpp": {"step_ms": lc_step * 1e3, "cpu_step_ms": lc_cpu * 1e3,
                                  "threads": args.llamacpp_threads or threads}}
                   if lc_step else {}),
            },
            "ratios": {
                "achieved_over_bandwidth_bound": achieved / bw_bound,
                "achieved_over_gemm_bound": achieved / gemm_bound,
                **({"transformers_over_bandwidth_bound": hf_step / bw_bound} if hf_step else {}),
                **({"ours_over_llamacpp_tok_s": lc_step / achieved,
                    "ours_over_llamacpp_by_cpu_time": lc_cpu / cpu_step} if lc_step else {}),
            },
            "config": {"model": str(path), "dtype": args.dtype, "threads": threads,
                       "batch": batch, "context": ctx, "steps": steps},
            "environment": stats.environment(),
        })
        print(f"wrote {args.output_json}")
    return 0
