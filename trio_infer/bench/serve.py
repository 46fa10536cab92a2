"""``serve``: a streaming load generator for any OpenAI-compatible server (ours or another).

Requests go to ``{base-url}/completions`` (``--endpoint chat``: ``{base-url}/chat/completions``
with the prompt as one user message) with ``stream: true``, ``max_tokens`` from ``--output-len``,
``temperature`` 0, ``stream_options.include_usage`` and (with ``--ignore-eos``) the ``ignore_eos``
extension that vLLM, SGLang and trio-infer accept. Prompts are random common English words, about
one token each with any byte-level BPE tokenizer. Output tokens are the server's own count
(``usage.completion_tokens``) when it sends a usage chunk, else the number of events that carried
text (exact for a server that sends one event per token); ``token_counts_from`` in the JSON says
how many requests were counted each way.

Arrivals are a Poisson process of ``--request-rate`` per second (``inf``: all at once), and at most
``--concurrency`` requests are in flight; TTFT counts from the moment a request is sent.

Figures, as ``vllm bench serve`` defines them: TTFT (send to first token event), ITL (gap between
consecutive token events of a request, pooled over requests; events that arrive in one socket read
have gap 0), TPOT ((e2e - TTFT) / (output tokens - 1) per request), e2e latency. Additionally the
inter-chunk gap: the gap between consecutive socket reads that delivered tokens (what a reader
sees as a stall, independent of how the server groups tokens into events).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import trio

from trio_infer.bench import stats
from trio_infer.bench.client import Endpoint, StreamResult, request, stream_sse
from trio_infer.bench.workload import make_text_workload, parse_range


def levels_spec(text: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32] (for argparse ``type=``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return values


def variant_spec(text: str) -> tuple[str, list[str]]:
    """``NAME='--flag value ...'``: ours with extra ``serve`` flags (for argparse ``type=``)."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or name in ("ours", "llama-server"):
        raise argparse.ArgumentTypeError(
            f"expected NAME='--flag value ...' (NAME not ours/llama-server), got {text!r}")
    return name, shlex.split(rest)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="server root including /v1 (http:// only)")
    p.add_argument("--model", default=None, help="model id; default: the first of /v1/models")
    p.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                   help="POST /completions with a prompt, or /chat/completions with one user "
                   "message (default: completions; chat with --baseline/--variant)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="default 64; with --baseline/--variant: --requests-per-slot x the "
                   "concurrency (at least 8) per level")
    p.add_argument("--concurrency", type=levels_spec, default=None, metavar="C[,C2,...]",
                   help="requests in flight at most (default: unlimited); with "
                   "--baseline/--variant, the levels to measure (default 1,8,32)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate per second (default inf: all at once)")
    p.add_argument("--input-len", type=parse_range, default=None, metavar="MIN:MAX",
                   help="prompt length in words (about one token each); default 32:512, with "
                   "--baseline/--variant 128")
    p.add_argument("--output-len", type=parse_range, default=None, metavar="MIN:MAX",
                   help="default 16:256, with --baseline/--variant 128")
    p.add_argument("--ignore-eos", action="store_true",
                   help="(always on with --baseline/--variant)")
    p.add_argument("--shared-prefix-len", type=int, default=0, metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--quiet", action="store_true", help="no table (with --output-json)")
    cmp = p.add_argument_group(
        "comparison (--baseline, --variant): start the servers here on one GGUF file, "
        "interleaved; see docs/benchmarks.md")
    cmp.add_argument("--baseline", choices=("llama-server",), default=None,
                     help="also measure llama.cpp's server (built once, cached)")
    cmp.add_argument("--variant", type=variant_spec, action="append", default=[],
                     metavar="NAME='FLAGS'",
                     help="also measure ours with these extra `serve` flags (repeatable)")
    cmp.add_argument("--model-file", default=None,
                     help="the GGUF file both serve (default: the default model's)")
    cmp.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    cmp.add_argument("--requests-per-slot", type=int, default=3)
    cmp.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                     help="extra argument for every `python -m trio_infer serve` (repeatable)")
    cmp.add_argument("--llama-threads", type=int, default=2, help="llama-server's -t and -tb")
    cmp.add_argument("--llama-server-arg", action="append", default=[], metavar="ARG",
                     help="extra argument for llama-server (repeatable)")
    cmp.add_argument("--ctx-per-slot", type=int, default=0,
                     help="llama-server's context per slot (-c = slots x this); 0: the prompt "
                     "and output lengths with slack for the chat template, rounded up to 256")
    cmp.add_argument("--startup-timeout", type=float, default=600.0)
    cmp.add_argument("--stop-timeout", type=float, default=15.0)
    cmp.add_argument("--log-dir", type=Path, default=None,
                     help="keep the servers' logs here (default: a temporary folder)")


def compare_mode(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "baseline", None) or getattr(args, "variant", None))


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on the mode (a plain load, or a comparison); once."""
    if getattr(args, "resolved", False):
        return args
    args.resolved = True
    cmp = compare_mode(args)
    if args.endpoint is None:
        args.endpoint = "chat" if cmp else "completions"
    if args.input_len is None:
        args.input_len = parse_range("128" if cmp else "32:512")
    if args.output_len is None:
        args.output_len = parse_range("128" if cmp else "16:256")
    if cmp:
        args.ignore_eos = True
        args.levels = args.concurrency or [1, 8, 32]
        if args.rounds < 1:
            raise SystemExit("error: --rounds must be >= 1")
    else:
        if args.concurrency and len(args.concurrency) > 1:
            raise SystemExit("error: several --concurrency levels need --baseline or --variant")
        args.concurrency = args.concurrency[0] if args.concurrency else None
        if args.num_prompts is None:
            args.num_prompts = 64
    return args


async def _first_model(ep: Any, api_key: str | None) -> str:
    status, body = await request(ep, "GET", "/models", api_key=api_key)
    if status != 200:
        raise SystemExit(f"error: GET /models answered {status}: {body[:200]!r}; pass --model")
    data = json.loads(body).get("data") or []
    if not data:
        raise SystemExit("error: /v1/models lists no model; pass --model")
    return data[0]["id"]


async def run_load(args: argparse.Namespace) -> dict[str, Any]:

    ep = Endpoint.parse(args.base_url)
    model = args.model or await _first_model(ep, args.api_key)
    workload = make_text_workload(args.num_prompts, args.input_len, args.output_len,
                                  seed=args.seed, shared_prefix_len=args.shared_prefix_len)
    limit = trio.Semaphore(args.concurrency or len(workload) or 1)
    arrivals = random.Random(args.seed + 1)
    results = [StreamResult() for _ in workload]
    chat = getattr(args, "endpoint", "completions") == "chat"
    path = "/chat/completions" if chat else "/completions"

    async def one(i: int, prompt: str, max_tokens: int) -> None:
        body: dict[str, Any] = {"model": model}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body.update({
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        })
        if args.ignore_eos:
            body["ignore_eos"] = True
        async with limit:
            with trio.move_on_after(args.timeout) as scope:
                await stream_sse(ep, path, body, args.api_key, results[i])
            if scope.cancelled_caught:
                results[i].ok = False
                results[i].error = f"timed out after {args.timeout:g} s"
                results[i].end = time.perf_counter()

    t_unix = time.time()
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i, (prompt, max_tokens) in enumerate(workload):
            if i and math.isfinite(args.request_rate):
                await trio.sleep(arrivals.expovariate(args.request_rate))
            nursery.start_soon(one, i, prompt, max_tokens)
    t1 = time.perf_counter()
    return summarize_results(results, t0, t1, t_unix, model, args)


def summarize_results(results: list[Any], t0: float, t1: float, t_unix: float, model: str,
                      args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown")[:120]
            errors[key] = errors.get(key, 0) + 1
    started = min((r.start for r in results if r.start), default=t0)
    duration = max(t1 - started, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls: list[float] = []
    gaps: list[float] = []
    tpots: list[float] = []
    for r in ok:
        ev = r.event_times
        itls.extend(b - a for a, b in zip(ev, ev[1:]))
        ch = r.chunk_times
        gaps.extend(b - a for a, b in zip(ch, ch[1:]))
        if r.output_tokens > 1 and r.ttft is not None:
            tpots.append((r.end - r.start - r.ttft) / (r.output_tokens - 1))
    return {
        "model": model,
        "base_url": args.base_url,
        "endpoint": getattr(args, "endpoint", "completions"),
        "num_prompts": len(results),
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_kinds": errors,
        "duration_s": duration,
        "t_start_unix": t_unix + (started - t0),
        "t_end_unix": t_unix + (t1 - t0),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        # How each successful request's output tokens were counted: the server's usage chunk, or
        # (none sent) its token-carrying events.
        "token_counts_from": {
            "usage": sum(1 for r in ok if r.completion_tokens is not None),
            "events": sum(1 for r in ok if r.completion_tokens is None),
        },
        "token_events": sum(len(r.event_times) for r in ok),
        "chunks": sum(len(r.chunk_times) for r in ok),  # socket reads that delivered tokens
        "http_chunks": sum(r.http_chunks for r in ok),  # HTTP chunks that delivered tokens
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_throughput": (prompt_tokens + out_tokens) / duration,
        "ttft_ms": stats.summarize(ttfts, 1e3),
        "tpot_ms": stats.summarize(tpots, 1e3),
        "itl_ms": stats.summarize(itls, 1e3),
        "chunk_gap_ms": stats.summarize(gaps, 1e3),
        "e2e_ms": stats.summarize([r.end - r.start for r in ok], 1e3),
    }


def print_report(res: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = [
        ("Model", res["model"]),
        ("Successful requests", res["completed"]),
        ("Failed requests", res["errors"]),
        ("Concurrency limit", res["concurrency"] or "none"),
        ("Request rate (req/s)", res["request_rate"]),
        ("Benchmark duration (s)", res["duration_s"]),
        ("Total input tokens", res["prompt_tokens"]),
        ("Total generated tokens", res["output_tokens"]),
        ("Request throughput (req/s)", res["request_throughput"]),
        ("Output token throughput (tok/s)", res["output_throughput"]),
        ("Total token throughput (tok/s)", res["total_throughput"]),
    ]
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                       ("chunk_gap_ms", "Inter-chunk gap"), ("e2e_ms", "E2E latency")):
        s = res[key]
        rows += [(f"Mean {title} (ms)", s["mean"]), (f"P50 {title} (ms)", s["p50"]),
                 (f"P90 {title} (ms)", s["p90"]), (f"P99 {title} (ms)", s["p99"])]
    stats.print_kv("Serving Benchmark Result", rows)
    for kind, n in res["error_kinds"].items():
        print(f"  {n} x {kind}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    resolve_defaults(args)
    if compare_mode(args):
        raise SystemExit("error: --baseline/--variant: run trio_infer.bench.versus.main(args)")
    if args.num_prompts < 1:
        raise SystemExit("error: --num-prompts must be >= 1")
    res = trio.run(run_load, args)
    res["environment"] = stats.environment()
    if not args.quiet:
        print_report(res)
    if args.output_json:
        stats.write_json(args.output_json, res)
        if not args.quiet:
            print(f"wrote {args.output_json}")
    return 0 if res["completed"] else 1
