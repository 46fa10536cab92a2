"""``dp``: ``--data-parallel N`` against one worker with the same total threads.

The workload is what prefix affinity is for: ``--prefixes`` shared prompt prefixes (a long
system prompt or document each), ``--per-prefix`` requests on each with a short suffix of their
own, in a seeded shuffled order, ``--concurrency`` at a time (so a prefix a request shares has
usually been computed by an earlier one: the prefix cache's case). Three configurations run it,
interleaved, ``--rounds`` times each, each round starting its workers afresh (a cold cache):

- ``one``: one batching worker with ``--threads`` threads;
- ``dp-affinity``: ``--data-parallel N`` workers with ``--threads / N`` each, prefix-affinity
  routing (``runtime/affinity.py``);
- ``dp-round-robin``: the same workers, round robin (the baseline without affinity).

They run through the front end's engine (``open_engine`` / ``open_data_parallel``: worker
processes, the protocol, sessions; no HTTP), greedy, every output ``--output-len`` tokens.

Printed per configuration (medians over the rounds): output tok/s (output tokens / wall time from
the first request to the last), the prefix-cache hit rate (prompt tokens served from the prefix
cache / prompt tokens looked up, summed over the workers: the engine's own counters), and the
ratios against ``one`` measured in the same run. The load average is printed with them: on a
shared machine every figure depends on it.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
from typing import Any

import trio

from trio_infer.bench.engine_setup import loadavg
from trio_infer.bench.stats import environment, print_kv, print_table, write_json
from trio_infer.metrics import Metrics
from trio_infer.settings import Settings
from trio_infer.wire import SamplingParams

CONFIGS = ("one", "dp-affinity", "dp-round-robin")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="as serve's --model (default: the default GGUF "
                   "model; 'fake' for a dry run)")
    p.add_argument("--data-parallel", type=int, default=2, help="workers of the dp runs (default 2)")
    p.add_argument("--threads", type=int, default=2,
                   help="total threads: one worker gets them all, each dp worker its share")
    p.add_argument("--prefixes", type=int, default=8, help="shared prompt prefixes (default 8)")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens per shared prefix")
    p.add_argument("--suffix-len", type=int, default=16, help="tokens of each request's own")
    p.add_argument("--per-prefix", type=int, default=6, help="requests per prefix")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures to this file")


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """The prompts, in the order they are sent: every request's prefix and its own suffix."""
    rng = random.Random(args.seed)
    lo, hi = vocab // 8, vocab - vocab // 8  # clear of the special tokens at either end
    prefixes = [[rng.randrange(lo, hi) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    prompts = [p + [rng.randrange(lo, hi) for _ in range(args.suffix_len)]
               for p in prefixes for _ in range(args.per_prefix)]
    rng.shuffle(prompts)
    return prompts


def config_settings(args: argparse.Namespace, config: str) -> Settings:
    common: dict[str, Any] = {"model": args.model, "torch_threads": args.threads}
    if args.model == "fake":
        common["torch_threads"] = 1
    if config == "one":
        return Settings(**common)
    routing = "affinity" if config == "dp-affinity" else "round_robin"
    return Settings(**common, data_parallel=args.data_parallel, dp_routing=routing)


async def run_config(settings: Settings, args: argparse.Namespace,
                     prompts: list[list[int]] | None) -> dict[str, Any]:
    from trio_infer.runtime.client import open_engine
    from trio_infer.runtime.data_parallel import open_data_parallel

    metrics = Metrics()
    group = (open_data_parallel(settings, metrics) if settings.data_parallel > 1
             else open_engine(settings, None, metrics))
    async with group as engine:
        assert engine.info is not None
        if prompts is None:
            prompts = workload(args, engine.info.vocab_size)
        params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)]
        limit = trio.Semaphore(args.concurrency)

        async def one(prompt: list[int]) -> None:
            async with limit, engine.generate(prompt, params) as stream:
                async for _ in stream:
                    pass

        before = metrics.snapshot()
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
                await trio.lowlevel.checkpoint()  # the order of arrival is the workload's
        elapsed = trio.current_time() - started
        after = metrics.snapshot()
    delta = lambda name: after[f"trio_infer_{name}_total"] - before[f"trio_infer_{name}_total"]  # noqa: E731
    queries = delta("prefix_cache_queries")
    return {
        "prompts": prompts,
        "output_tok_s": delta("generation_tokens") / elapsed,
        "hit_rate": delta("prefix_cache_hits") / queries if queries else 0.0,
        "elapsed_s": elapsed,
        "loadavg": loadavg(),
    }


async def run_all(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    prompts: list[list[int]] | None = None
    for r in range(args.rounds):
        for config in CONFIGS:
            res = await run_config(config_settings(args, config), args, prompts)
            prompts = res.pop("prompts")
            results[config].append(res)
            print(f"round {r + 1} {config}: {res['output_tok_s']:.1f} output tok/s, hit rate "
                  f"{res['hit_rate']:.3f}, load average {res['loadavg']:.2f}", flush=True)
    return results


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    results = trio.run(run_all, args)
    med = {c: {k: statistics.median(r[k] for r in rs) for k in ("output_tok_s", "hit_rate")}
           for c, rs in results.items()}
    base = med["one"]
    rows = []
    for config in CONFIGS:
        m = med[config]
        rows.append([config, m["output_tok_s"], m["output_tok_s"] / base["output_tok_s"],
                     m["hit_rate"], m["hit_rate"] / base["hit_rate"] if base["hit_rate"] else 0.0])
    print()
    print_kv("dp workload", [
        ("data parallel", args.data_parallel), ("total threads", args.threads),
        ("prefixes x requests", f"{args.prefixes} x {args.per_prefix}"),
        ("prefix / suffix / output", f"{args.prefix_len} / {args.suffix_len} / {args.output_len}"),
        ("concurrency", args.concurrency), ("rounds", args.rounds),
        ("load average (end)", loadavg()),
    ])
    print_table(["config", "output tok/s", "x one", "hit rate", "hit rate x one"], rows)
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results, "medians": med,
                               "environment": environment()})
    return 0
