"""``offline``: the engine alone (no HTTP, no event loop) against transformers on one workload.

Every system runs the same seeded workload (:mod:`trio_infer.bench.workload`) with greedy
sampling, one after the other in this process, each after a short untimed warm-up. Our engine
gets every request at once (offline throughput: it batches as it likes); the baselines are in
:mod:`trio_infer.bench.baselines`. Ratios are ours / baseline on output tokens per second.

Definitions (also in docs/benchmarks.md):

- output tok/s: output tokens counted per request (at most its own ``output_len``) / wall time
  from the first request submitted to the last one finished.
- prefill tok/s: prompt tokens of the whole workload / time until every request has its first
  output token (all requests are submitted at t=0; the engine interleaves decodes of requests
  already past their prompt, which this figure includes).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from trio_infer.bench import stats
from trio_infer.bench.workload import BenchRequest, make_workload, parse_range

BASELINES = ("hf-sequential", "hf-static", "no-prefix-cache", "llama.cpp")
# --model names for the server's default model (SmolLM2-135M-Instruct, Q4_1 GGUF).
DEFAULT_MODEL_ALIASES = ("default", "smollm2", "smollm2-135m-instruct")
DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        help="a Hugging Face checkpoint folder, a .gguf file (or a folder holding one), or "
        f"{' / '.join(DEFAULT_MODEL_ALIASES)} for the default model's GGUF file (fetched by "
        "`make venv`)",
    )
    src.add_argument(
        "--shape",
        default=None,
        help="random-weight Qwen3 checkpoint of a named shape (tiny, small, qwen3-0.6b), "
        "built once into --cache-dir. Default: small",
    )
    src.add_argument(
        "--quantized",
        default=None,
        metavar="MODEL:TYPE",
        help="a GGUF file made here by llama.cpp's quantizer (the bench-llamacpp extra), once, "
        "into the cache's bench-models/: MODEL is a shape with seeded random weights and "
        "SmolLM2's tokenizer (smollm2-1.7b) or smollm2-135m (the default model requantized); "
        "TYPE a llama.cpp file type (Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...). "
        "E.g. --quantized smollm2-1.7b:Q4_K_M",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="where --shape checkpoints go")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--no-gguf-blocks", action="store_true",
                   help="dequantize a GGUF model's weights at load (the torch path) instead of "
                   "keeping its Q4_0/Q4_1/Q8_0 blocks for the CPU kernels (the default)")
    p.add_argument("--activations", choices=("exact", "int16", "int8"), default="exact",
                   help="how the CPU kernels multiply activations with GGUF blocks (int16, "
                   "int8: not exact; see docs/kernels.md)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for every system; 0 = the server's default (cores - 1)",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=parse_range, default=parse_range("32:512"), metavar="MIN:MAX")
    p.add_argument("--output-len", type=parse_range, default=parse_range("16:256"), metavar="MIN:MAX")
    p.add_argument("--ignore-eos", action="store_true", help="every request makes exactly its output-len")
    p.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N tokens (then its own input-len tokens)")
    p.add_argument("--seed", type=int, default=0)
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-running", type=int, default=None)
    eng.add_argument("--max-batched-tokens", type=int, default=None)
    eng.add_argument("--page-size", type=int, default=None)
    eng.add_argument("--kv-cache-mb", type=int, default=None,
                     help="default: enough for the whole workload at once (at least 256)")
    eng.add_argument("--kv-cache-dtype", default="auto",
                     choices=("auto", "float32", "float16", "bfloat16"),
                     help="the engine's KV cache dtype (auto: float16 on the CPU, as the server)")
    eng.add_argument("--no-prefix-cache", action="store_true",
                     help="run our engine with EngineConfig(enable_prefix_cache=False)")
    p.add_argument("--baseline", action="append", choices=BASELINES, default=[],
                   help="also run this system on the same workload (repeatable)")
    p.add_argument("--baseline-batch", type=int, default=8, help="batch size of hf-static")
    p.add_argument("--llamacpp-threads", type=int, default=0,
                   help="threads of the llama.cpp baseline (a GGUF --model only; needs the "
                   "bench-llamacpp extra); 0 = the same as ours")
    p.add_argument("--llamacpp-slots", type=int, default=0,
                   help="sequence slots of the llama.cpp baseline; 0 = our max_running")
    p.add_argument("--profile", action="store_true",
                   help="instead of the workload: decode step time at --profile-batch next to "
                   "the memory-bandwidth and GEMM-throughput bounds measured on this machine")
    p.add_argument("--profile-batch", type=int, default=1)
    p.add_argument("--profile-context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--profile-steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--profile-bandwidth-mb", type=int, default=1024,
                   help="size of the tensor read to measure memory bandwidth (keep it well "
                   "above the L3 cache)")
    p.add_argument("--output-json", type=Path, default=None)


# -- setup ------------------------------------------------------------------------------------


def _settings_defaults() -> dict[str, Any]:
    from trio_infer.settings import Settings

    fields = Settings.model_fields
    return {k: fields[k].default for k in ("page_size", "kv_cache_mb", "max_running", "max_batched_tokens")}


def supports_prefix_cache_flag() -> bool:
    from trio_infer.engine.engine import EngineConfig

    return "enable_prefix_cache" in {f.name for f in dataclasses.fields(EngineConfig)}


def engine_config(args: argparse.Namespace, workload_tokens: int, bytes_per_token: int,
                  prefix_cache: bool | None) -> Any:
    """EngineConfig from the flags, the server's defaults for what is not given."""
    from trio_infer.engine.engine import EngineConfig

    d = _settings_defaults()
    page_size = args.page_size or d["page_size"]
    max_running = args.max_running or d["max_running"]
    max_batched = args.max_batched_tokens or max(d["max_batched_tokens"], max_running)
    if args.kv_cache_mb:
        kv_bytes = args.kv_cache_mb * 2**20
    else:
        # Every request resident at once, each rounded up by a page: no preemption from the pool.
        need = (workload_tokens + args.num_prompts * page_size) * bytes_per_token
        kv_bytes = max(d["kv_cache_mb"] * 2**20, int(need * 1.05))
    kwargs: dict[str, Any] = dict(
        page_size=page_size,
        kv_cache_bytes=kv_bytes,
        max_running=max_running,
        max_batched_tokens=max_batched,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if prefix_cache is not None:
        if not supports_prefix_cache_flag():
            raise SystemExit(
                "error: this engine's EngineConfig has no 'enable_prefix_cache' option, so the "
                "prefix cache cannot be switched off (--no-prefix-cache / --baseline "
                "no-prefix-cache need it)"
            )
        kwargs["enable_prefix_cache"] = prefix_cache
    return EngineConfig(**kwargs)


def resolve_checkpoint(args: argparse.Namespace) -> Path:
    """A Hugging Face folder or a GGUF file (never a folder holding one: its file instead)."""
    from trio_infer.bench.checkpoints import ensure_shape_checkpoint
    from trio_infer.models.default_model import default_cache_dir, require_default_model
    from trio_infer.models.gguf_loader import GGUFError, find_gguf

    if getattr(args, "quantized", None):
        return quantized_checkpoint(args.quantized)
    if args.model:
        if args.model.lower() in DEFAULT_MODEL_ALIASES:
            try:
                return require_default_model(default_cache_dir())
            except FileNotFoundError as exc:
                raise SystemExit(f"error: {exc}") from None
        path = Path(args.model).expanduser()
        try:
            gguf_file = find_gguf(path)
        except GGUFError as exc:
            raise SystemExit(f"error: {exc}") from None
        if gguf_file is not None:
            return gguf_file
        if not (path / "config.json").is_file():
            raise SystemExit(
                f"error: {path} is neither a checkpoint folder (no config.json) nor a .gguf file"
            )
        return path
    return ensure_shape_checkpoint(args.shape or "small", args.cache_dir)


def quantized_checkpoint(spec: str) -> Path:
    """``--quantized MODEL:TYPE``: the file, made once (see :mod:`trio_infer.bench.quantized`)."""
    from trio_infer.bench import quantized

    model, _, file_type = spec.partition(":")
    if model not in (*quantized.SHAPES, "smollm2-135m") or file_type not in quantized.FILE_TYPES:
        raise SystemExit(
            f"error: --quantized {spec!r}: expected MODEL:TYPE with MODEL one of "
            f"{', '.join((*quantized.SHAPES, 'smollm2-135m'))} and TYPE one of "
            f"{', '.join(quantized.FILE_TYPES)}")
    if not quantized.available():
        raise SystemExit("error: --quantized needs llama-cpp-python's quantizer: "
                         ".venv/bin/pip install '.[bench-llamacpp]' (builds llama.cpp from source)")
    print(f"making (or reusing) {model} {file_type} with llama.cpp's quantizer ...", flush=True)
    if model == "smollm2-135m":
        return quantized.ensure_requantized(file_type)
    return quantized.ensure_shape(model, file_type)


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def model_config(path: Path) -> Any:
    """The transformers config of a checkpoint folder or GGUF file (from its metadata)."""
    if is_gguf(path):
        from trio_infer.models.gguf_loader import GGUFCheckpoint

        return GGUFCheckpoint.open(path).config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def special_token_ids(path: Path) -> set[int] | None:
    """Ids of the tokenizer's special and added tokens (control tokens, never ordinary text), or
    None for a checkpoint without a tokenizer."""
    from trio_infer.models.loader import load_tokenizer

    try:
        tok = load_tokenizer(path)
    except (OSError, ValueError):
        return None
    return set(tok.all_special_ids) | set(tok.added_tokens_decoder)


def token_range(vocab_size: int, special: set[int] | None) -> tuple[int, int]:
    """``(first, end)``: synthetic prompts draw ids uniformly from ``[first, end)``, the longest
    run of ids below ``vocab_size`` holding no special token (SmolLM2: 17..49151, after its 17
    control tokens; Qwen: 0..151642, before its special and padding ids; the synthetic shapes:
    3..vocab_size-1). Without a tokenizer: ``[3, vocab_size)``, as the workloads always did."""
    if special is None:
        return 3, vocab_size
    best = (0, 0)
    start = 0
    for i in sorted(s for s in special if 0 <= s < vocab_size) + [vocab_size]:
        if i - start > best[1] - best[0]:
            best = (start, i)
        start = i + 1
    if best[1] - best[0] < 1:
        raise SystemExit(f"error: no ordinary token id below {vocab_size}")
    return best


def set_threads(args: argparse.Namespace) -> int:
    from trio_infer.runtime.loading import configure_torch_threads
    from trio_infer.settings import Settings

    return configure_torch_threads(Settings(torch_threads=args.threads))


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def kv_bytes_per_token(info: Any) -> int:
    import torch

    elem = torch.empty((), dtype=info.dtype).element_size()
    return 2 * info.num_layers * info.num_kv_heads * info.head_dim * elem


# -- our engine -------------------------------------------------------------------------------


def _params(req: BenchRequest, ignore_eos: bool) -> Any:
    from trio_infer.wire import SamplingParams

    return SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=ignore_eos)


def warmup_request(workload: list[BenchRequest]) -> BenchRequest:
    """An untimed request of ordinary tokens: the workload's first 16 prompt ids, 4 new tokens."""
    return BenchRequest(workload[0].prompt_ids[:16], 4)


def run_engine(engine: Any, workload: list[BenchRequest], ignore_eos: bool) -> dict[str, Any]:
    """Submit everything at t=0, step to the end; count tokens, first-token and finish times."""
    warm = warmup_request(workload)
    engine.add_request(("warmup", 0), warm.prompt_ids, _params(warm, True))
    while engine.has_unfinished():
        engine.step()

    first: dict[int, float] = {}
    done: dict[int, float] = {}
    out_tokens = [0] * len(workload)
    steps = 0
    t0 = time.perf_counter()
    for i, req in enumerate(workload):
        engine.add_request(i, req.prompt_ids, _params(req, ignore_eos))
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        now = time.perf_counter() - t0
        for o in outs:
            first.setdefault(o.uid, now)
            out_tokens[o.uid] += len(o.token_ids)
            if o.finish_reason is not None:
                done[o.uid] = now
    elapsed = time.perf_counter() - t0
    return _result(workload, out_tokens, elapsed, [first[i] for i in range(len(workload))],
                   steps=steps)


def _result(workload: list[BenchRequest], out_tokens: list[int], elapsed: float,
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


def build_engine(path: Path, args: argparse.Namespace, workload: list[BenchRequest],
                 prefix_cache: bool | None) -> Any:
    from trio_infer.engine.engine import Engine
    from trio_infer.models.loader import load_model

    model = load_model(path, dtype=torch_dtype(args.dtype), device="cpu",
                       keep_blocks=False if args.no_gguf_blocks else None,
                       activations=args.activations)
    tokens = sum(r.prompt_len + r.output_len for r in workload)
    config = engine_config(args, tokens, kv_bytes_per_token(model.info), prefix_cache)
    return Engine(model, config, device="cpu")


# -- the subcommand ---------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    if args.shared_prefix_len < 0:
        raise SystemExit("error: --shared-prefix-len must be >= 0")
    want_no_cache = args.no_prefix_cache or "no-prefix-cache" in args.baseline
    if want_no_cache and not supports_prefix_cache_flag():
        raise SystemExit(
            "error: this engine's EngineConfig has no 'enable_prefix_cache' option, so the "
            "prefix cache cannot be switched off (--no-prefix-cache / --baseline no-prefix-cache)"
        )
    threads = set_threads(args)
    path = resolve_checkpoint(args)
    if "llama.cpp" in args.baseline:
        from trio_infer.bench import llamacpp

        if not is_gguf(path):
            raise SystemExit("error: --baseline llama.cpp needs a GGUF --model (it runs that file)")
        llamacpp.require()
    if args.profile:
        from trio_infer.bench.profile import run_profile

        return run_profile(path, args, threads)

    vocab = model_config(path).vocab_size
    first_id, end_id = token_range(vocab, special_token_ids(path))
    workload = make_workload(
        args.num_prompts, args.input_len, args.output_len, end_id,
        seed=args.seed, shared_prefix_len=args.shared_prefix_len, first_id=first_id,
    )
    prompt_tokens = sum(r.prompt_len for r in workload)
    wanted = sum(r.output_len for r in workload)
    print(
        f"workload: {len(workload)} prompts, input {args.input_len} (+{args.shared_prefix_len} "
        f"shared), output {args.output_len}, seed {args.seed}: {prompt_tokens:,} prompt tokens, "
        f"{wanted:,} output tokens wanted, token ids {first_id}..{end_id - 1} of {vocab}; model "
        f"{path}, {args.dtype}{', GGUF blocks dequantized' if args.no_gguf_blocks else ''}"
        f"{'' if args.activations == 'exact' else f', {args.activations} activations'}, {threads} torch threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}",
        flush=True,
    )

    results: dict[str, dict[str, Any]] = {}
    ours_cache = None
    if supports_prefix_cache_flag():
        ours_cache = not args.no_prefix_cache
    engine = build_engine(path, args, workload, ours_cache)
    config = dataclasses.asdict(engine.config)
    print(f"ours: running ({config}) ...", flush=True)
    load_before = _loadavg()
    results["ours"] = run_engine(engine, workload, args.ignore_eos)
    results["ours"]["loadavg_1m"] = [load_before, _loadavg()]
    _report_line("ours", results["ours"])
    del engine
    gc.collect()

    hf_model = None  # loaded once (untimed) for every hf-* baseline of this invocation
    for name in dict.fromkeys(args.baseline):  # each once, in the order given
        print(f"{name}: running ...", flush=True)
        if name == "no-prefix-cache":
            load_before = _loadavg()
            engine = build_engine(path, args, workload, False)
            results[name] = run_engine(engine, workload, args.ignore_eos)
            del engine
        elif name == "llama.cpp":
            from trio_infer.bench import llamacpp

            load_before = _loadavg()
            results[name] = llamacpp.run_workload(
                path, args.llamacpp_threads or threads, workload,
                args.llamacpp_slots or config["max_running"], config["max_batched_tokens"],
                args.ignore_eos,
            )
        else:
            from trio_infer.bench.baselines import load_hf, run_hf

            if hf_model is None:
                hf_model = load_hf(path, args.dtype)
            load_before = _loadavg()
            results[name] = run_hf(name, hf_model, args, workload)
        results[name]["loadavg_1m"] = [load_before, _loadavg()]
        gc.collect()
        _report_line(name, results[name])
    del hf_model
    gc.collect()

    ours = results["ours"]
    ratios = {n: ours["output_tok_s"] / r["output_tok_s"] for n, r in results.items() if n != "ours"}
    prefill_ratios = {
        n: ours["prefill_tok_s"] / r["prefill_tok_s"]
        for n, r in results.items()
        if n != "ours" and "prefill_tok_s" in r and "prefill_tok_s" in ours
    }
    print()
    rows = []
    for name, r in results.items():
        rows.append([
            name, r["requests"], r["output_tokens"], r["elapsed_s"], r["output_tok_s"],
            r["total_tok_s"], r.get("prefill_tok_s", math.nan),
            1.0 if name == "ours" else ratios[name],
        ])
    stats.print_table(
        ["system", "reqs", "out tokens", "time s", "out tok/s", "total tok/s", "prefill tok/s",
         "ours/this"],
        rows,
    )
    if args.output_json:
        stats.write_json(args.output_json, {
            "ours": ours,
            "baselines": {n: r for n, r in results.items() if n != "ours"},
            "ratios": ratios,
            "prefill_ratios": prefill_ratios,
            "config": {
                "model": str(path), "model_format": "gguf" if is_gguf(path) else "hf",
                "shape": None if args.model or args.quantized else (args.shape or "small"),
                "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                "token_ids": [first_id, end_id - 1], "vocab_size": vocab,
                "threads": threads, "num_prompts": args.num_prompts,
                "input_len": str(args.input_len), "output_len": str(args.output_len),
                "shared_prefix_len": args.shared_prefix_len, "ignore_eos": args.ignore_eos,
                "seed": args.seed, "baseline_batch": args.baseline_batch, "engine": config,
            },
            "environment": stats.environment(),
        })
        print(f"wrote {args.output_json}")
    return 0


def _loadavg() -> float:
    """The 1-minute load average: the machine may be shared, and every figure depends on it."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def _report_line(name: str, r: dict[str, Any]) -> None:
    load = r.get("loadavg_1m", [math.nan, math.nan])
    print(
        f"  {name}: {r['output_tokens']:,} output tokens in {r['elapsed_s']:.2f} s = "
        f"{r['output_tok_s']:.1f} tok/s (load average {load[0]:.2f} -> {load[1]:.2f})",
        file=sys.stdout,
        flush=True,
    )
