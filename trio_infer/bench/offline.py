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

``--speculative ngram`` measures speculative decoding instead (engine/speculative.py): our
engine with it against the same engine (same loaded model) without it, ``--rounds`` rounds
interleaved (the order alternates each round), on the random workload or ``--workload grounded``
(bench/grounded.py); ``--baseline llama-server-ngram`` adds llama.cpp's server with its own
n-gram speculation (``--spec-type ngram-simple``) on the same token ids, in the same rounds.
``--speculative draft --speculative-draft-model PATH`` does the same with a draft model
(engine/draft.py) loaded next to the model, each with the same threads, dtype and activations.

``--tensor-parallel N`` measures our engine over a group of N ranks (runtime/tp_group.py: this
process is rank 0 and starts the others, each with its share of ``--threads``) against one
engine with all ``--threads``, ``--rounds`` rounds interleaved (the order alternates); and
against the same one engine without its one-call C decode step (``one-worker-op-by-op``: the
path every rank of a group runs), which separates what the group costs from what that costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from trio_infer.bench import baselines, llamacpp, stats
from trio_infer.bench.engine_setup import (
    DEFAULT_MODEL_ALIASES,
    DTYPES,
    build_engine,
    build_group_engine,
    engine_config,
    is_gguf,
    kv_bytes_per_token,
    loadavg,
    model_config,
    resolve_checkpoint,
    run_engine,
    bench_threads,
    set_threads,
    special_token_ids,
    supports_prefix_cache_flag,
    token_range,
)
from trio_infer.bench.grounded import DEFAULT_KINDS, KINDS, make_grounded_workload
from trio_infer.bench.profile import run_profile
from trio_infer.bench.workload import make_workload, parse_range

BASELINES = ("hf-sequential", "hf-static", "no-prefix-cache", "llama.cpp", "llama-server-ngram")
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
    p.add_argument("--activations", choices=("exact", "int8"), default="exact",
                   help="how the CPU kernels multiply activations with GGUF blocks (int8: not "
                   "exact; see docs/kernels.md)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for every system; 0 = the server's default (every core)",
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
                     choices=("auto", "float32", "float16", "bfloat16", "q8_0", "q4_0"),
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
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative", choices=("off", "ngram", "draft"), default="off",
                      help="ngram: ours with prompt-lookup speculation against ours without, "
                      "interleaved rounds (see the module's docstring); draft: with the draft "
                      "model of --speculative-draft-model")
    spec.add_argument("--speculative-draft-model", type=Path, default=None,
                      help="--speculative draft: the draft model (a .gguf file or a checkpoint "
                      "folder with the model's vocabulary)")
    spec.add_argument("--workload", choices=("random", "grounded"), default="random",
                      help="grounded: rewrite / summarize a given passage, edit a given code "
                      "file (bench/grounded.py), through the model's chat template")
    spec.add_argument("--grounded-kinds", default=",".join(DEFAULT_KINDS),
                      help="--workload grounded: the kinds of prompt, comma-separated, of "
                      f"{', '.join(KINDS)} (default: %(default)s); measure one kind at a time "
                      "to see each kind's figure")
    spec.add_argument("--speculative-tokens", type=int, default=None,
                      help="k: tokens guessed per step (default: the server's)")
    spec.add_argument("--speculative-ngram", type=int, default=None,
                      help="prompt lookup's longest match, in tokens (default: the server's)")
    spec.add_argument("--speculative-ngram-min", type=int, default=None,
                      help="prompt lookup's shortest match, in tokens (default: the server's)")
    spec.add_argument("--speculative-max-batch", type=int, default=None,
                      help="the off-switch's batch size (default: the server's)")
    spec.add_argument("--no-speculative-payoff", action="store_true",
                      help="without the measured off-switch (speculative_payoff): drafting is "
                      "decided by the proposal rules alone")
    spec.add_argument("--verify-rows", type=int, default=0, metavar="N",
                      help="instead of a workload: the cost of one forward of 1..N one-token "
                      "rows of one sequence, as a verify step lays them out (context: "
                      "--input-len's low end, to a page), interleaved --rounds times, relative "
                      "to one row")
    spec.add_argument("--rounds", type=int, default=2,
                      help="interleaved rounds (--speculative, --tensor-parallel)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="ours over N ranks (each with its share of --threads) against one engine "
                   "with all of them, interleaved rounds (see the module's docstring)")


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
        if not is_gguf(path):
            raise SystemExit("error: --baseline llama.cpp needs a GGUF --model (it runs that file)")
        llamacpp.require()
    if args.profile:
        return run_profile(path, args, threads)
    if args.verify_rows:
        return run_verify_rows(path, args)

    vocab = model_config(path).vocab_size
    first_id, end_id = token_range(vocab, special_token_ids(path))
    if args.workload == "grounded":
        kinds = tuple(k for k in args.grounded_kinds.split(",") if k)
        if not kinds or not set(kinds) <= set(KINDS):
            raise SystemExit(f"error: --grounded-kinds takes some of {', '.join(KINDS)}")
        workload = make_grounded_workload(_tokenizer(path, args), args.num_prompts,
                                          args.output_len, seed=args.seed, kinds=kinds)
        print(f"grounded kinds: {', '.join(kinds)}", flush=True)
    else:
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

    if (args.speculative == "draft") != (args.speculative_draft_model is not None):
        raise SystemExit("error: --speculative draft goes with --speculative-draft-model PATH")
    if args.speculative != "off":
        return run_speculative(path, args, workload, threads)
    if args.tensor_parallel > 1:
        return run_tensor_parallel(path, args, workload, threads)

    results: dict[str, dict[str, Any]] = {}
    ours_cache = None
    if supports_prefix_cache_flag():
        ours_cache = not args.no_prefix_cache
    engine = build_engine(path, args, workload, ours_cache)
    config = dataclasses.asdict(engine.config)
    print(f"ours: running ({config}) ...", flush=True)
    load_before = loadavg()
    results["ours"] = run_engine(engine, workload, args.ignore_eos)
    results["ours"]["loadavg_1m"] = [load_before, loadavg()]
    _report_line("ours", results["ours"])
    del engine
    gc.collect()

    hf_model = None  # loaded once (untimed) for every hf-* baseline of this invocation
    for name in dict.fromkeys(args.baseline):  # each once, in the order given
        print(f"{name}: running ...", flush=True)
        if name == "no-prefix-cache":
            load_before = loadavg()
            engine = build_engine(path, args, workload, False)
            results[name] = run_engine(engine, workload, args.ignore_eos)
            del engine
        elif name == "llama-server-ngram":
            raise SystemExit("error: --baseline llama-server-ngram goes with --speculative")
        elif name == "llama.cpp":
            load_before = loadavg()
            results[name] = llamacpp.run_workload(
                path, args.llamacpp_threads or threads, workload,
                args.llamacpp_slots or config["max_running"], config["max_batched_tokens"],
                args.ignore_eos,
            )
        else:
            if hf_model is None:
                hf_model = baselines.load_hf(path, args.dtype)
            load_before = loadavg()
            results[name] = baselines.run_hf(name, hf_model, args, workload)
        results[name]["loadavg_1m"] = [load_before, loadavg()]
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


def _report_line(name: str, r: dict[str, Any]) -> None:
    load = r.get("loadavg_1m", [math.nan, math.nan])
    print(
        f"  {name}: {r['output_tokens']:,} output tokens in {r['elapsed_s']:.2f} s = "
        f"{r['output_tok_s']:.1f} tok/s (load average {load[0]:.2f} -> {load[1]:.2f})",
        file=sys.stdout,
        flush=True,
    )


# -- --tensor-parallel ------------------------------------------------------------------------


def run_tensor_parallel(path: Path, args: argparse.Namespace, workload: list, threads: int) -> int:
    """A group of ``--tensor-parallel`` ranks (``threads`` split over them) against one engine
    with all ``threads``, each once per round, the order alternating by round."""
    import torch

    from trio_infer.settings import thread_shares

    if args.baseline:
        raise SystemExit("error: --tensor-parallel compares against one engine; no --baseline")
    cache = not args.no_prefix_cache
    group = build_group_engine(path, args, workload, cache, threads)
    one = build_engine(path, args, workload, cache)
    name = f"tp{args.tensor_parallel}"
    share = thread_shares(threads, args.tensor_parallel)[0]
    runs: dict[str, list[dict[str, Any]]] = {name: [], "one-worker": [],
                                             "one-worker-op-by-op": []}
    engines = {name: (group, share), "one-worker": (one, threads),
               "one-worker-op-by-op": (one, threads)}
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for system in order:
            engine, n = engines[system]
            torch.set_num_threads(n)
            if hasattr(engine.model, "threads"):  # the CPU kernels' model: its own count
                engine.model.threads = n
            if engine is one:
                one.model.fused_decode = system == "one-worker"
            before = loadavg()
            result = run_engine(engine, workload, args.ignore_eos)
            result["loadavg_1m"] = [before, loadavg()]
            runs[system].append(result)
            _report_line(f"{system} (round {round_ + 1}, {n} threads a rank)", result)
    print()
    medians = {s: statistics.median(r["output_tok_s"] for r in rs) for s, rs in runs.items()}
    stats.print_table(
        ["system", "threads a rank", "out tok/s (median)", "rounds", "this/one-worker"],
        [[s, share if s == name else threads, medians[s], args.rounds,
          medians[s] / medians["one-worker"]] for s in runs],
    )
    if args.output_json:
        stats.write_json(args.output_json, {
            "runs": runs, "ratio": medians[name] / medians["one-worker"],
            "ratio_op_by_op": medians[name] / medians["one-worker-op-by-op"],
            "config": {"model": str(path), "tensor_parallel": args.tensor_parallel,
                       "threads": threads, "num_prompts": args.num_prompts,
                       "input_len": str(args.input_len), "output_len": str(args.output_len),
                       "seed": args.seed, "rounds": args.rounds},
            "environment": stats.environment(),
        })
        print(f"wrote {args.output_json}")
    return 0


# -- --speculative ----------------------------------------------------------------------------


def _tokenizer(path: Path, args: argparse.Namespace) -> Any:
    """The model's tokenizer, for the grounded workload's chat template."""
    from trio_infer.models.default_model import default_cache_dir
    from trio_infer.runtime.tokenizer import load_saved_tokenizer
    from trio_infer.runtime.tokenizer import load_gguf_tokenizer_cached

    if is_gguf(path):
        return load_gguf_tokenizer_cached(path, args.cache_dir or default_cache_dir())
    return load_saved_tokenizer(path)


def speculative_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the speculative run changes: the mode, and each option given."""
    out: dict[str, Any] = {"speculative": args.speculative}
    for name in ("speculative_tokens", "speculative_ngram", "speculative_ngram_min",
                 "speculative_max_batch"):
        if getattr(args, name):
            out[name] = getattr(args, name)
    if args.no_speculative_payoff:
        out["speculative_payoff"] = False
    return out


def run_speculative(path: Path, args: argparse.Namespace, workload: list, threads: int) -> int:
    """Ours with speculation against ours without (the same loaded model), and llama-server with
    its n-gram speculation if asked, each once per round, the order alternating by round."""
    from trio_infer.engine.engine import Engine
    from trio_infer.models.loader import load_model

    base = build_engine(path, args, workload, not args.no_prefix_cache)
    draft = None
    if args.speculative == "draft":
        draft = load_model(args.speculative_draft_model, dtype=args.dtype, device="cpu",
                           keep_blocks=False if args.no_gguf_blocks else None,
                           activations=args.activations, threads=bench_threads(args))
        if draft.info.vocab_size != base.model.info.vocab_size:
            raise SystemExit(f"error: the draft model has {draft.info.vocab_size} token ids, the "
                             f"model {base.model.info.vocab_size}")
        print(f"draft model: {args.speculative_draft_model}", flush=True)
    plain_config = dataclasses.replace(base.config, speculative="off")
    spec_config = dataclasses.replace(base.config, **speculative_overrides(args))
    model = base.model
    del base
    print(f"speculative: {dataclasses.asdict(spec_config)}", flush=True)
    server = (_LlamaServerNgram(path, args, threads, spec_config.speculative_tokens)
              if "llama-server-ngram" in args.baseline else None)
    runs: dict[str, list[dict[str, Any]]] = {"ours-speculative": [], "ours-plain": []}
    if server is not None:
        runs["llama-server-ngram"] = []
    try:
        if server is not None:
            server.start()
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                load_before = loadavg()
                if name == "llama-server-ngram":
                    assert server is not None
                    res = server.run(workload, args.ignore_eos)
                else:
                    speculating = name == "ours-speculative"
                    engine = Engine(model, spec_config if speculating else plain_config,
                                    device="cpu", draft_model=draft if speculating else None)
                    res = run_engine(engine, workload, args.ignore_eos)
                    if args.max_running == 1:
                        res["decode_tok_s"] = _decode_tok_s(res, workload)
                    st = engine.statistics()
                    res.update(spec_proposed=st.spec_proposed, spec_accepted=st.spec_accepted,
                               tokens_per_step=st.sampled_tokens / max(1, st.sample_steps))
                    del engine
                    gc.collect()
                res["loadavg_1m"] = [load_before, loadavg()]
                runs[name].append(res)
                extra = ""
                if "spec_proposed" in res and res["spec_proposed"]:
                    extra = (f", accepted {res['spec_accepted']}/{res['spec_proposed']} guesses, "
                             f"{res['tokens_per_step']:.2f} tokens/step")
                if "decode_tok_s" in res:
                    extra += f", decode {res['decode_tok_s']:.1f} tok/s"
                print(f"  round {r + 1} {name}: {res['output_tokens']:,} tokens in "
                      f"{res['elapsed_s']:.2f} s = {res['output_tok_s']:.1f} tok/s{extra} (load "
                      f"average {load_before:.2f} -> {res['loadavg_1m'][1]:.2f})", flush=True)
    finally:
        if server is not None:
            server.stop()

    median = {n: statistics.median(x["output_tok_s"] for x in rs) for n, rs in runs.items()}
    spec = runs["ours-speculative"]
    ratios = {n: statistics.median(a["output_tok_s"] / b["output_tok_s"] for a, b in zip(spec, rs))
              for n, rs in runs.items() if n != "ours-speculative"}
    print()
    stats.print_table(
        ["system", "rounds", "median out tok/s", "speculative/this (median of rounds)"],
        [[n, len(rs), median[n], 1.0 if n == "ours-speculative" else ratios[n]]
         for n, rs in runs.items()],
    )
    decode = None
    if "decode_tok_s" in spec[0]:
        decode = statistics.median(a["decode_tok_s"] / b["decode_tok_s"]
                                   for a, b in zip(spec, runs["ours-plain"]))
        print(f"decode only (batch 1: each request's tokens after its first, over the time from "
              f"its first to its last), speculative / plain, median of rounds: {decode:.2f}x")
    same = [a["output_tokens"] == b["output_tokens"] for a, b in zip(spec, runs["ours-plain"])]
    print(f"output tokens equal with and without speculation (greedy): {all(same)}")
    if args.output_json:
        stats.write_json(args.output_json, {
            "runs": runs, "median_output_tok_s": median, "ratios": ratios,
            "decode_ratio": decode,
            "config": {"model": str(path), "workload": args.workload, "threads": threads,
                       "grounded_kinds": args.grounded_kinds if args.workload == "grounded" else "",
                       "num_prompts": args.num_prompts, "input_len": str(args.input_len),
                       "output_len": str(args.output_len), "ignore_eos": args.ignore_eos,
                       "seed": args.seed, "rounds": args.rounds,
                       "draft_model": str(args.speculative_draft_model or ""),
                       "engine": dataclasses.asdict(spec_config)},
            "environment": stats.environment(),
        })
        print(f"wrote {args.output_json}")
    return 0


def run_verify_rows(path: Path, args: argparse.Namespace) -> int:
    """One forward of 1..N rows of one sequence laid out as a verify step (the last sampled
    token and N - 1 guesses, ``ModelRunner.prepare`` of a one-item schedule), after a prefill
    of about ``--input-len``'s low end tokens; the sizes interleaved (the order alternating) for
    ``--rounds`` rounds; the fastest and the median of each, relative to one row's."""
    import torch

    from trio_infer.engine.engine import Engine
    from trio_infer.engine.scheduler import Schedule, ScheduledSeq
    from trio_infer.models.loader import load_model
    from trio_infer.wire import SamplingParams

    model = load_model(path, dtype=args.dtype, device="cpu",
                       keep_blocks=False if args.no_gguf_blocks else None,
                       activations=args.activations, threads=bench_threads(args))
    n = args.verify_rows
    engine = Engine(model, engine_config(args, args.input_len.lo + 64, kv_bytes_per_token(model.info),
                                         False), device="cpu")
    page = engine.config.page_size
    if n >= page:
        raise SystemExit(f"error: --verify-rows must be below the page size ({page})")
    # One past a page boundary: the prefill's pages then hold the n rows after it too.
    context = args.input_len.lo // page * page + 1
    vocab = model.info.vocab_size
    engine.add_request(0, [(7 * i) % (vocab - 2) + 1 for i in range(context)],
                       SamplingParams(max_tokens=n + 2, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill
    seq = engine.scheduler.running[0]
    assert len(seq.pages) * page >= seq.num_computed + n
    batches = {}
    for rows in range(1, n + 1):
        item = ScheduledSeq(seq, seq.num_computed, rows, tuple(seq.pages), True,
                            draft=tuple(range(1, rows)))
        batches[rows] = engine.runner.prepare(Schedule([item], rows, []))[0]
    kv = engine.runner.kv_cache
    times: dict[int, list[float]] = {rows: [] for rows in batches}
    with torch.inference_mode():
        for r in range(args.rounds):
            for rows in (batches if r % 2 else reversed(batches)):
                t0 = time.perf_counter()
                model.forward(batches[rows], kv.k, kv.v)
                times[rows].append(time.perf_counter() - t0)
    fast, mid = min(times[1]), statistics.median(times[1])
    stats.print_table(["rows", "fastest ms", "x one row", "median ms", "x one row (median)"],
                      [[rows, 1e3 * min(t), min(t) / fast, 1e3 * statistics.median(t),
                        statistics.median(t) / mid] for rows, t in times.items()])
    print(f"context {context} tokens, {getattr(model, 'threads', torch.get_num_threads())} "
          f"threads, {args.activations} "
          f"activations, {args.rounds} rounds; load average {loadavg():.2f}")
    return 0


def _decode_tok_s(res: dict[str, Any], workload: list) -> float:
    """Output tokens after each request's first over the time from its first token to its last,
    summed over requests: at batch 1 (one request at a time) the decode phase alone, which is
    what speculation changes (the prompt's prefill is the same work with or without it)."""
    tokens = res["output_tokens"] - len(workload)
    seconds = sum(d - f for f, d in zip(res["request_first_s"], res["request_done_s"]))
    return tokens / seconds if seconds > 0 else float("nan")


class _LlamaServerNgram:
    """llama-server with ``--spec-type ngram-simple`` (drafts of at most our k) on the same GGUF
    file, fed the workload's token ids over its native ``/completion`` (greedy, ``n_predict`` =
    the request's output length, no prompt cache), ``max_running`` requests at a time on as many
    slots, after one untimed warm-up request."""

    def __init__(self, path: Path, args: argparse.Namespace, threads: int, k: int) -> None:
        from trio_infer.bench import llamaserver

        if not is_gguf(path):
            raise SystemExit("error: --baseline llama-server-ngram needs a GGUF --model")
        self.path = path
        self.threads = args.llamacpp_threads or threads
        self.slots = args.max_running or 1
        self.k = k  # its --spec-draft-n-max: our speculative_tokens
        self.binary = llamaserver.require()
        self.proc: Any = None
        self.port = 0

    def start(self) -> None:
        import trio

        from trio_infer.bench import llamaserver
        from trio_infer.bench.client import Endpoint
        from trio_infer.bench.servers import System, free_port, start_server, wait_healthy

        self.port = free_port()
        argv = llamaserver.command(self.binary, self.path, self.port, threads=self.threads,
                                   slots=self.slots, ctx_per_slot=4096,
                                   extra=["--spec-type", "ngram-simple",
                                          "--spec-draft-n-max", str(self.k)])
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-ngram-{self.port}.log"
        print(f"llama-server-ngram: {' '.join(argv)} (log {log})", flush=True)
        self.proc = start_server(System("llama-server-ngram", argv, dict(os.environ), None),
                                 self.port, log)
        trio.run(wait_healthy, Endpoint("127.0.0.1", self.port, ""), self.proc, 300.0, log,
                 "llama-server-ngram")

    def stop(self) -> None:
        from trio_infer.bench.servers import stop_server

        if self.proc is not None:
            stop_server(self.proc)

    def run(self, workload: list, ignore_eos: bool) -> dict[str, Any]:
        import json

        import trio

        from trio_infer.bench.client import Endpoint, request
        from trio_infer.bench.workload import make_result

        ep = Endpoint("127.0.0.1", self.port, "")
        out_tokens = [0] * len(workload)

        async def one(i: int, limiter: trio.CapacityLimiter) -> None:
            req = workload[i]
            body = {"prompt": req.prompt_ids, "n_predict": req.output_len, "temperature": 0.0,
                    "ignore_eos": ignore_eos, "cache_prompt": False}
            async with limiter:
                status, raw = await request(ep, "POST", "/completion", body)
            if status != 200:
                raise SystemExit(f"error: llama-server answered {status}: {raw[:300]!r}")
            out_tokens[i] = min(req.output_len, int(json.loads(raw)["tokens_predicted"]))

        async def main() -> float:
            await one(0, trio.CapacityLimiter(1))  # warm-up, untimed
            limiter = trio.CapacityLimiter(self.slots)
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(len(workload)):
                    nursery.start_soon(one, i, limiter)
            return time.perf_counter() - t0

        elapsed = trio.run(main)
        return make_result(workload, out_tokens, elapsed, None)
