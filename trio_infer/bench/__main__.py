"""``python -m trio_infer.bench {offline,serve,frontend,constrained,memory} ...``"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from trio_infer.bench import constrained, frontend, memory, offline, serve

    parser = argparse.ArgumentParser(
        prog="python -m trio_infer.bench",
        description="trio-infer benchmarks (see docs/benchmarks.md)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    offline.add_arguments(
        sub.add_parser("offline", help="the engine alone vs transformers baselines",
                       description=offline.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    )
    serve.add_arguments(
        sub.add_parser("serve", help="streaming load generator for an OpenAI-compatible server",
                       description=serve.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    )
    frontend.add_arguments(
        sub.add_parser("frontend", help="our HTTP stack alone, over a fake model",
                       description=frontend.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    )
    constrained.add_arguments(
        sub.add_parser("constrained", help="constrained decoding (json_schema) vs unconstrained",
                       description=constrained.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    )
    memory.add_arguments(
        sub.add_parser("memory", help="peak RSS of a worker vs llama.cpp on the same GGUF file",
                       description=memory.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "offline":
        from trio_infer.bench.offline import main as run
    elif args.command == "serve":
        from trio_infer.bench.serve import main as run
    elif args.command == "constrained":
        from trio_infer.bench.constrained import main as run
    elif args.command == "memory":
        from trio_infer.bench.memory import main as run
    else:
        from trio_infer.bench.frontend import main as run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
