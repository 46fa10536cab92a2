"""``python -m trio_infer.bench {offline,serve,overload,startup,frontend,burst,constrained,memory,dp,llama-server}``"""

from __future__ import annotations

import argparse
import sys

from trio_infer.bench import (
    burst,
    constrained,
    data_parallel,
    frontend,
    llamaserver,
    memory,
    offline,
    overload,
    serve,
    startup,
    versus,
)

COMMANDS = {
    "offline": (offline, "the engine alone vs transformers baselines"),
    "serve": (serve, "streaming load generator for an OpenAI-compatible server; with "
                     "--baseline llama-server, ours against llama.cpp's server end to end"),
    "overload": (overload, "a burst of 10x capacity against our server: 200 or 429 with "
                           "Retry-After, TTFT bound, priorities"),
    "startup": (startup, "seconds to the first /health answer and to healthy: serve, bare "
                         "hypercorn, llama-server"),
    "frontend": (frontend, "our HTTP stack alone, over a fake model"),
    "burst": (burst, "the same bursts to several servers at once: CPU a request and TTFT, "
                     "paired round by round"),
    "constrained": (constrained, "constrained decoding (json_schema) vs unconstrained"),
    "memory": (memory, "peak RSS of a worker vs llama.cpp on the same GGUF file"),
    "dp": (data_parallel, "--data-parallel N (affinity and round robin) vs one worker with the "
                          "same total threads, on shared prompt prefixes"),
    "llama-server": (llamaserver, "the cached llama-server binary (--build: build it once)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trio_infer.bench",
        description="trio-infer benchmarks (see docs/benchmarks.md)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(
            sub.add_parser(name, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve.resolve_defaults(args)
        if serve.compare_mode(args):
            return versus.main(args)
    return COMMANDS[args.command][0].main(args)


if __name__ == "__main__":
    sys.exit(main())
