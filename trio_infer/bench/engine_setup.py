"""What ``offline``, ``offline --profile``, ``constrained`` and the baselines share: the model
file or checkpoint a bench runs, our engine built as the server builds it, the workload's token
range, the result record of a run over a workload, and the machine's load.

It imports only bench modules that import none of the modules that import it (:mod:`workload`,
:mod:`checkpoints`, :mod:`quantized` and through it :mod:`llamacpp`), so every bench module
imports what it needs at module level with no cycle.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

from trio_infer.bench import quantized
from trio_infer.bench.checkpoints import ensure_shape_checkpoint
from trio_infer.bench.workload import BenchRequest, make_result, warmup_request

# --model names for the server's default model (SmolLM2-135M-Instruct, Q4_1 GGUF).
DEFAULT_MODEL_ALIASES = ("default", "smollm2", "smollm2-135m-instruct")
DTYPES = ("float32", "bfloat16", "float16")


# -- the model ------------------------------------------------------------------------------------


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
        speculative="off",  # the server's default is ngram; --speculative measures it apart
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
    """torch's thread count for the bench's torch models and baselines; :func:`bench_threads`."""
    from trio_infer.runtime.loading import configure_torch_threads
    from trio_infer.settings import Settings

    return configure_torch_threads(Settings(torch_threads=args.threads))


def bench_threads(args: argparse.Namespace) -> int:
    """The engine's thread count for ``--threads``, as a worker's (Settings.worker_threads): the
    CPU kernels' model takes it at load, a torch model reads torch's (:func:`set_threads`)."""
    from trio_infer.settings import Settings

    return Settings(torch_threads=args.threads).worker_threads()


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def kv_bytes_per_token(info: Any) -> int:
    from trio_infer.engine.kv_cache import ITEMSIZE

    return 2 * info.num_layers * info.num_kv_heads * info.head_dim * ITEMSIZE[info.dtype]


# -- our engine -------------------------------------------------------------------------------


def _params(req: BenchRequest, ignore_eos: bool) -> Any:
    from trio_infer.wire import SamplingParams

    return SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=ignore_eos)


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
    return make_result(workload, out_tokens, elapsed, [first[i] for i in range(len(workload))],
                   steps=steps, request_first_s=[first[i] for i in range(len(workload))],
                   request_done_s=[done.get(i, elapsed) for i in range(len(workload))])


def build_engine(path: Path, args: argparse.Namespace, workload: list[BenchRequest],
                 prefix_cache: bool | None) -> Any:
    from trio_infer.engine.engine import Engine
    from trio_infer.models.loader import load_model

    model = load_model(path, dtype=args.dtype, device="cpu",
                       keep_blocks=False if args.no_gguf_blocks else None,
                       activations=args.activations, threads=bench_threads(args))
    tokens = sum(r.prompt_len + r.output_len for r in workload)
    config = engine_config(args, tokens, kv_bytes_per_token(model.info), prefix_cache)
    return Engine(model, config, device="cpu")


def build_group_engine(path: Path, args: argparse.Namespace, workload: list[BenchRequest],
                       prefix_cache: bool | None, threads: int) -> Any:
    """Our engine over a ``--tensor-parallel`` group: this process is rank 0 (it starts the
    follower ranks, runtime/tp_group.py), each rank with its share of ``threads``. The group
    lives as long as this process."""
    from trio_infer.engine.engine import Engine
    from trio_infer.runtime import tp_group
    from trio_infer.runtime.loading import load_shard
    from trio_infer.settings import Settings

    settings = Settings(model=str(path), dtype=args.dtype, torch_threads=threads,
                        keep_gguf_blocks=not args.no_gguf_blocks, activations=args.activations,
                        tensor_parallel=args.tensor_parallel)
    layout = tp_group.Layout.of(settings)
    leader = tp_group.build_leader(
        settings, layout, lambda rank, size, device: load_shard(settings, rank, size, device),
        "cpu")
    tokens = sum(r.prompt_len + r.output_len for r in workload)
    config = engine_config(args, tokens, kv_bytes_per_token(leader.info), prefix_cache)
    engine = Engine(leader, config, device="cpu")
    cache = engine.kv_cache
    leader.announce_cache(cache.num_pages, cache.page_size, cache.k[0].dtype)
    return engine


def loadavg() -> float:
    """The 1-minute load average: the machine may be shared, and every figure depends on it."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan
