"""Peak memory of a batching worker against llama.cpp, on the same GGUF file and context.

    python -m trio_infer.bench memory --quantized smollm2-1.7b:Q4_K_M --context 2048

Each side runs in a fresh process of its own, which loads the model, prefills one prompt and
decodes a few tokens, then reports its peak resident memory (``VmHWM``, which counts the pages of
a memory-mapped file it touched, as llama.cpp's mmap load does). Ours is built exactly as the
server's worker builds its engine (:func:`trio_infer.runtime.loading.build_engine`: model,
tokenizer, grammar compiler), with a KV pool of ``--context`` tokens; llama.cpp (llama-cpp-python,
the ``bench-llamacpp`` extra) gets ``n_ctx=--context`` and its defaults (fp16 KV, mmap). Rounds
alternate the two; the ratio is ours / llama.cpp per round, and its median is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from trio_infer.bench import llamacpp
from trio_infer.bench.engine_setup import quantized_checkpoint

PROMPT_TOKENS = 128
DECODE_STEPS = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a .gguf file")
    src.add_argument("--quantized", metavar="MODEL:TYPE",
                     help="a file made by llama.cpp's quantizer (see bench offline --quantized)")
    p.add_argument("--context", type=int, default=2048, help="KV cache tokens, both sides")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto", help="ours (auto: float16 on the CPU)")


def peak_kib() -> dict[str, int]:
    """This process's peak and current resident memory, KiB (from /proc/self/status)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0])
    return out


def run_ours(path: str, context: int, threads: int, kv_cache_dtype: str) -> dict[str, Any]:
    import torch

    from trio_infer.engine.kv_cache import KVCache, resolve_kv_dtype
    from trio_infer.wire import SamplingParams
    from trio_infer.models.gguf_loader import GGUFCheckpoint
    from trio_infer.runtime.loading import build_engine
    from trio_infer.settings import Settings

    config = GGUFCheckpoint.open(path).config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = resolve_kv_dtype(kv_cache_dtype, torch.float32, "cpu")
    per_page = KVCache.bytes_per_page(config.num_hidden_layers, 16, heads, head_dim, dtype)
    kv_mb = math.ceil(math.ceil(context / 16) * per_page / 2**20)
    settings = Settings(model=path, torch_threads=threads, kv_cache_mb=kv_mb, page_size=16,
                        kv_cache_dtype=kv_cache_dtype)
    engine = build_engine(settings)
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    engine.add_request(0, list(range(100, 100 + PROMPT_TOKENS)), params)
    while engine.has_unfinished():
        engine.step()
    return {"kv_cache_mb": kv_mb, **peak_kib()}


def run_llamacpp(path: str, context: int, threads: int) -> dict[str, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=context, n_threads=threads,
                          n_threads_batch=threads, n_batch=PROMPT_TOKENS, verbose=False)
    tokens = list(range(100, 100 + PROMPT_TOKENS))
    llm.eval(tokens)
    for _ in range(DECODE_STEPS):
        llm.eval([100])
    return peak_kib()


def _child(argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "trio_infer.bench.memory", *argv],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv[:1])} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> int:
    if args.quantized:
        path = str(quantized_checkpoint(args.quantized))
    else:
        path = args.model
    if not llamacpp.available():
        raise SystemExit("error: the llama.cpp side needs llama-cpp-python (bench-llamacpp extra)")
    common = [path, str(args.context), str(args.threads)]
    ratios, ours_mb, theirs_mb = [], [], []
    for r in range(args.rounds):
        ours = _child(["ours", *common, args.kv_cache_dtype])
        theirs = _child(["llama.cpp", *common])
        ours_mb.append(ours["VmHWM"] / 1024)
        theirs_mb.append(theirs["VmHWM"] / 1024)
        ratios.append(ours_mb[-1] / theirs_mb[-1])
        print(f"round {r + 1}: ours peak {ours_mb[-1]:.0f} MB (KV pool {ours['kv_cache_mb']} MB), "
              f"llama.cpp peak {theirs_mb[-1]:.0f} MB: {ratios[-1]:.2f}x", flush=True)
    print(f"peak RSS, {Path(path).name}, context {args.context}: ours "
          f"{statistics.median(ours_mb):.0f} MB, llama.cpp {statistics.median(theirs_mb):.0f} MB, "
          f"ours / llama.cpp {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":  # one side, in a process of its own
    side, model, context, threads, *rest = sys.argv[1:]
    if side == "ours":
        result = run_ours(model, int(context), int(threads), rest[0])
    else:
        result = run_llamacpp(model, int(context), int(threads))
    print(json.dumps(result))
