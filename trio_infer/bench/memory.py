"""Peak memory of a batching worker against llama.cpp, on the same GGUF file and context.

    python -m trio_infer.bench memory --quantized smollm2-1.7b:Q4_K_M --context 2048
    python -m trio_infer.bench memory --model default --context 2048 --baseline llama-server

Each side runs in a fresh process of its own, which loads the model, prefills one prompt of
128 tokens and decodes 16, then reports its peak resident memory (``VmHWM``, which counts the
pages of a memory-mapped file it touched, as llama.cpp's mmap load does).

- ``--baseline llama.cpp`` (the default): both sides as libraries. Ours is built exactly as the
  server's worker builds its engine (:func:`trio_infer.runtime.loading.build_engine`: model,
  tokenizer, grammar compiler), with a KV pool of ``--context`` tokens; llama.cpp
  (llama-cpp-python, the ``bench-llamacpp`` extra) gets ``n_ctx=--context`` and its defaults
  (fp16 KV, mmap). Ours also reports where its memory went: the interpreter with what the
  worker imports before it loads (no torch for a GGUF file the CPU kernels serve), the packed
  weights, other weights, the KV pool, and the rest.
- ``--baseline llama-server``: both sides as servers. Ours is ``python -m trio_infer serve``
  with a KV pool of ``--context`` tokens, and the figure is its batching worker's process (the
  front end's is printed beside it); llama-server (the binary ``bench
  llama-server`` builds) runs with one slot of ``-c --context`` and its defaults. Each gets the
  same prompt of token ids by HTTP, greedy, 16 tokens, EOS ignored.

Rounds alternate the two; the ratio is ours / llama.cpp per round, and its median is printed.
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
from trio_infer.bench.engine_setup import DEFAULT_MODEL_ALIASES, quantized_checkpoint

PROMPT_TOKENS = 128
DECODE_STEPS = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a .gguf file, or default (the default model's)")
    src.add_argument("--quantized", metavar="MODEL:TYPE",
                     help="a file made by llama.cpp's quantizer (see bench offline --quantized)")
    p.add_argument("--context", type=int, default=2048, help="KV cache tokens, both sides")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto", help="ours (auto: float16 on the CPU)")
    p.add_argument("--baseline", choices=("llama.cpp", "llama-server"), default="llama.cpp",
                   help="llama.cpp: both sides as libraries (ours: the worker's engine); "
                        "llama-server: both as servers (ours: the worker process)")


def peak_kib(pid: int | str = "self") -> dict[str, int]:
    """A process's peak and current resident memory, KiB (from /proc/<pid>/status)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def kv_cache_mb(path: str, context: int, kv_cache_dtype: str) -> int:
    """The KV pool, MiB, that holds ``context`` tokens of the model at ``path`` in pages of 16."""
    from trio_infer.engine.kv_cache import KVCache, resolve_kv_dtype
    from trio_infer.models.gguf_loader import GGUFCheckpoint

    config = GGUFCheckpoint.open(path).config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = resolve_kv_dtype(kv_cache_dtype, "float32", "cpu")
    per_page = KVCache.bytes_per_page(config.num_hidden_layers, 16, heads, head_dim, dtype)
    return math.ceil(math.ceil(context / 16) * per_page / 2**20)


def model_bytes(model: Any) -> dict[str, int]:
    """Bytes of the model's packed weights (each table once: a tied lm_head is the embedding's)
    and of its other tensors (parameters and buffers: norms, biases, the rotary table)."""
    if hasattr(model, "weight_bytes"):  # the CPU kernels' numpy model (models/cpu_llama.py)
        return model.weight_bytes()
    packed, seen = 0, set()
    for module in model.modules():
        weight = getattr(module, "packed", None)
        if weight is not None and id(weight.parts[0].data) not in seen:
            seen.add(id(weight.parts[0].data))
            packed += weight.nbytes
    dense = sum(t.numel() * t.element_size()
                for t in [*model.parameters(), *model.buffers()])
    return {"packed": packed, "dense": dense}


def run_ours(path: str, context: int, threads: int, kv_cache_dtype: str) -> dict[str, Any]:
    from trio_infer.wire import SamplingParams
    from trio_infer.runtime.loading import build_engine
    from trio_infer.settings import Settings

    imported = peak_kib()  # the interpreter with the worker's modules (torch only if loaded)

    kv_mb = kv_cache_mb(path, context, kv_cache_dtype)
    settings = Settings(model=path, torch_threads=threads, kv_cache_mb=kv_mb, page_size=16,
                        kv_cache_dtype=kv_cache_dtype)
    engine = build_engine(settings)
    loaded = peak_kib()
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    engine.add_request(0, list(range(100, 100 + PROMPT_TOKENS)), params)
    while engine.has_unfinished():
        engine.step()
    kv = sum(t.nbytes for t in [*engine.kv_cache.k, *engine.kv_cache.v])
    return {"kv_cache_mb": kv_mb, "python_kib": imported["VmRSS"],
            "torch_imported": "torch" in sys.modules,
            "loaded_kib": loaded["VmRSS"], "loaded_hwm_kib": loaded["VmHWM"],
            "kv_bytes": kv, **model_bytes(engine.model), **peak_kib()}


def run_llamacpp(path: str, context: int, threads: int) -> dict[str, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=context, n_threads=threads,
                          n_threads_batch=threads, n_batch=PROMPT_TOKENS, verbose=False)
    tokens = list(range(100, 100 + PROMPT_TOKENS))
    llm.eval(tokens)
    for _ in range(DECODE_STEPS):
        llm.eval([100])
    return peak_kib()


def worker_pid(server_pid: int) -> int | None:
    """Our batching worker's process in the tree of a ``trio_infer serve`` (the process started
    as ``-m trio_infer.runtime.worker``), or None before it has started."""
    from trio_infer.bench.procstat import process_tree

    for pid in process_tree(server_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"trio_infer.runtime.worker" in argv:
            return pid
    return None


def run_server(name: str, argv: list[str], path: str, workdir: Path) -> dict[str, Any]:
    """Start one server, send it the prompt, and read its processes' peak memory before
    stopping it: llama-server's own, or our worker's and our front end's."""
    import os

    import trio

    from trio_infer.bench.client import Endpoint, request
    from trio_infer.bench.servers import System, free_port, start_server, stop_server, wait_healthy

    port = free_port()
    log = workdir / f"memory-{name}-{port}.log"
    proc = start_server(System(name, argv, dict(os.environ), None), port, log)
    ep = Endpoint("127.0.0.1", port, "")
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    if name == "ours":
        route = "/v1/completions"
        body: dict[str, Any] = {"model": Path(path).stem, "prompt": prompt,
                                "max_tokens": DECODE_STEPS, "temperature": 0.0,
                                "ignore_eos": True}
    else:
        route = "/completion"
        body = {"prompt": prompt, "n_predict": DECODE_STEPS, "temperature": 0.0,
                "ignore_eos": True, "cache_prompt": False}

    async def serve_one() -> None:
        await wait_healthy(ep, proc, 600.0, log, name)
        status, raw = await request(ep, "POST", route, body)
        if status != 200:
            raise SystemExit(f"error: {name} answered {status}: {raw[:300]!r}")

    try:
        trio.run(serve_one)
        if name == "ours":
            worker = worker_pid(proc.pid)
            if worker is None:
                raise SystemExit(f"error: no batching worker under the server's process {proc.pid}")
            return {"worker": peak_kib(worker), "front_end": peak_kib(proc.pid)}
        return {"server": peak_kib(proc.pid)}
    finally:
        stop_server(proc)


def server_commands(path: str, context: int, threads: int,
                    kv_cache_dtype: str) -> dict[str, list[str]]:
    """Ours and llama-server on ``path``, each with one sequence of ``context`` tokens of KV."""
    from trio_infer.bench import llamaserver

    binary = llamaserver.require()
    ours = [sys.executable, "-m", "trio_infer", "serve", "--model", path,
            "--host", "127.0.0.1", "--port", "{port}", "--torch-threads", str(threads),
            "--page-size", "16", "--kv-cache-mb", str(kv_cache_mb(path, context, kv_cache_dtype)),
            "--kv-cache-dtype", kv_cache_dtype, "--served-model-name", Path(path).stem]
    theirs = llamaserver.command(binary, Path(path), "{port}", threads=threads, slots=1,
                                 ctx_per_slot=context)
    return {"ours": ours, "llama-server": theirs}


def main_servers(path: str, args: argparse.Namespace) -> int:
    import tempfile

    commands = server_commands(path, args.context, args.threads, args.kv_cache_dtype)
    for name, argv in commands.items():
        print(f"{name}: {' '.join(argv).replace(sys.executable, 'python')}", flush=True)
    ratios, ours_mb, theirs_mb = [], [], []
    with tempfile.TemporaryDirectory(prefix="trio-infer-memory-") as tmp:
        for r in range(args.rounds):
            order = ["ours", "llama-server"] if r % 2 == 0 else ["llama-server", "ours"]
            got = {name: run_server(name, commands[name], path, Path(tmp)) for name in order}
            worker, front = got["ours"]["worker"], got["ours"]["front_end"]
            ours_mb.append(worker["VmHWM"] / 1024)
            theirs_mb.append(got["llama-server"]["server"]["VmHWM"] / 1024)
            ratios.append(ours_mb[-1] / theirs_mb[-1])
            print(f"round {r + 1}: our worker peak {ours_mb[-1]:.0f} MiB (front end "
                  f"{front['VmHWM'] / 1024:.0f} MiB), llama-server peak {theirs_mb[-1]:.0f} MiB: "
                  f"{ratios[-1]:.2f}x (load average {_loadavg():.2f})", flush=True)
            for name, kib in (("our worker", worker), ("llama-server", got["llama-server"]["server"])):
                print(f"  {name} at the end: anonymous {kib['RssAnon'] / 1024:.0f} MiB, "
                      f"mapped files {kib['RssFile'] / 1024:.0f} MiB", flush=True)
    print(f"peak RSS, {Path(path).name}, context {args.context}: our worker "
          f"{statistics.median(ours_mb):.0f} MiB, llama-server {statistics.median(theirs_mb):.0f} "
          f"MiB, ours / llama-server {statistics.median(ratios):.2f}x")
    return 0


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _child(argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "trio_infer.bench.memory", *argv],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv[:1])} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> int:
    if args.quantized:
        path = str(quantized_checkpoint(args.quantized))
    elif args.model in DEFAULT_MODEL_ALIASES:
        from trio_infer.models.default_model import default_cache_dir, require_default_model

        path = str(require_default_model(default_cache_dir()))
    else:
        path = args.model
    if args.baseline == "llama-server":
        return main_servers(path, args)
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
        print(f"round {r + 1}: ours peak {ours_mb[-1]:.0f} MiB, llama.cpp peak "
              f"{theirs_mb[-1]:.0f} MiB: {ratios[-1]:.2f}x (load average {_loadavg():.2f})",
              flush=True)
        print("  ours: " + breakdown(ours), flush=True)
    print(f"peak RSS, {Path(path).name}, context {args.context}: ours "
          f"{statistics.median(ours_mb):.0f} MiB, llama.cpp {statistics.median(theirs_mb):.0f} "
          f"MiB, ours / llama.cpp {statistics.median(ratios):.2f}x")
    return 0


def breakdown(ours: dict[str, Any]) -> str:
    """Where our peak went, MiB: the interpreter with the worker's modules (torch is not one of
    them: a load that needs it imports it, and its ~220 MiB count in the rest of the load); the
    packed weights, the
    other tensors and the KV pool the load added; the load's own excess (allocator slack, any
    buffer it kept: the resident memory after the load less all the above); and the peak's
    excess over the load (the steps' activations and scratch, and the load's transients if
    they peaked above its end)."""
    mib = 2**20
    python_mb = ours["python_kib"] / 1024
    packed, dense, kv = ours["packed"] / mib, ours["dense"] / mib, ours["kv_bytes"] / mib
    loaded = ours["loaded_kib"] / 1024
    rest = loaded - python_mb - packed - dense - kv
    torch = "the load imported torch" if ours.get("torch_imported") else "no torch"
    return (f"python {python_mb:.0f} ({torch}), packed weights {packed:.1f}, other tensors "
            f"{dense:.1f}, KV pool {kv:.1f}, rest of the load {rest:.1f} (RSS after it "
            f"{loaded:.0f}, its peak {ours['loaded_hwm_kib'] / 1024:.0f}), steps "
            f"{ours['VmHWM'] / 1024 - loaded:.1f} MiB")


if __name__ == "__main__":  # one side, in a process of its own
    side, model, context, threads, *rest = sys.argv[1:]
    if side == "ours":
        result = run_ours(model, int(context), int(threads), rest[0])
    else:
        result = run_llamacpp(model, int(context), int(threads))
    print(json.dumps(result))
