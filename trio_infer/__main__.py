"""Command line: ``python -m trio_infer serve ...`` and ``python -m trio_infer generate ...``.

``serve`` runs hypercorn's trio worker in this process: it listens at once and loads the model in
the background (``/health`` says 503 ``loading`` meanwhile); a model that cannot be loaded ends it
with exit status 1 and the reason in the log. It owns SIGTERM/SIGINT, so shutdown is graceful in a
way the bare ``hypercorn`` command cannot offer: on the first signal ``/health`` and
new requests answer 503, running requests get ``--shutdown-grace-s`` seconds to finish, then the
rest end with an error event and ``[DONE]``, then hypercorn closes the connections and the process
exits 0. A second signal skips the grace period. ``serve --node-rank k`` (k > 0) on another node
of a ``--tensor-parallel`` group runs only that node's follower ranks (no HTTP server).

Every :class:`~trio_infer.settings.Settings` field is a flag (``--max-running 16``), and the
``TRIO_INFER_*`` environment variables still apply underneath the flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any, Sequence

from pydantic import ValidationError

from trio_infer.settings import Settings, Wiring

if TYPE_CHECKING:  # for annotations (trio is imported where it is used: spawn_own_worker says why)
    import socket
    import subprocess

log = logging.getLogger("trio_infer")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_settings_flags(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    group = parser.add_argument_group("settings (also TRIO_INFER_<NAME> environment variables)")
    for name, field in Settings.model_fields.items():
        if name in skip:
            continue
        default = field.default if field.default is not None else "unset"
        group.add_argument(
            _flag(name),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=f"{field.description or ''} (default: {default})".strip(),
        )


def _settings(args: argparse.Namespace, names: Sequence[str]) -> Settings:
    given = {n: getattr(args, n) for n in names if hasattr(args, n)}
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise SystemExit(f"error: invalid settings:\n{exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trio_infer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_settings_flags(serve)
    serve.add_argument("--log-level", default="info", help="logging level (default: info)")
    # Wiring, not settings: what the supervisor of --api-workers hands each front end it starts.
    serve.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--worker-address", default=None, help=argparse.SUPPRESS)

    gen = sub.add_parser("generate", help="complete one prompt offline (no HTTP, no chat template)")
    _add_settings_flags(gen, skip=("host", "port", "api_key", "shutdown_grace_s"))
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help='print {"text","token_ids","finish_reason"}')
    gen.add_argument("--log-level", default="warning",
                     help="logging level (default: warning; debug shows a failed load's traceback)")
    return parser


# -- serve ----------------------------------------------------------------------------------------


def spawn_own_worker(
    settings: Settings, wiring: Wiring
) -> "tuple[subprocess.Popen[bytes], socket.socket] | None":
    """The batching worker of a front end that has one of its own (not a front end of
    ``--api-workers``, nor ``--data-parallel``'s several), started now: ``_serve_main`` calls
    this before it imports trio, and ``serve`` before it imports the web stack, so the
    worker's imports (torch, about a second) and its load run on the other core meanwhile
    (docs/architecture.md, "Startup")."""
    if wiring.worker_address is not None or settings.data_parallel > 1:
        return None
    from trio_infer.runtime.spawn import spawn_worker

    return spawn_worker(settings)


async def serve(
    settings: Settings, wiring: Wiring = Wiring(),
    spawned: "tuple[subprocess.Popen[bytes], socket.socket] | None" = None, *,
    task_status: Any = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully (see the module docstring).
    ``wiring``: what a supervisor (``--api-workers``) hands one of its front ends; ``spawned``:
    the worker :func:`spawn_own_worker` started (else it is started here)."""
    import trio

    from trio_infer.runtime.transport import WorkerProcess

    if spawned is None:
        spawned = spawn_own_worker(settings, wiring)
    # The app takes the worker over and reaps it; one still open below was never used (the
    # server could not start), and is killed at once.
    worker = WorkerProcess(*spawned) if spawned is not None else None
    try:
        await _serve(settings, wiring, worker,
                     task_status=task_status or trio.TASK_STATUS_IGNORED)
    finally:
        if worker is not None:
            await worker.aclose(exit_wait_s=0)


async def _serve(
    settings: Settings, wiring: Wiring, worker: Any, *, task_status: Any
) -> None:
    import trio
    from hypercorn.trio import serve as hypercorn_serve

    from trio_infer.app import create_app, drain
    from trio_infer.server import hypercorn_config

    app = create_app(settings, wiring=wiring, worker=worker)
    config = hypercorn_config(settings, wiring)
    shutdown = trio.Event()
    grace = trio.CancelScope()

    async def drain_then_stop() -> None:
        with grace:
            await drain(app, settings.shutdown_grace_s)
        await drain(app, 0)  # if a second signal cut the grace period short
        shutdown.set()  # hypercorn stops accepting and closes the (now finished) connections

    async def watch_signals(*, task_status: Any) -> None:
        # A front end of `serve --api-workers` hears only its supervisor (SIGTERM): a Ctrl-C
        # reaches the whole process group, and the supervisor forwards it once.
        supervised = wiring.supervised
        if supervised:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        watched = (signal.SIGTERM,) if supervised else (signal.SIGTERM, signal.SIGINT)
        with trio.open_signal_receiver(*watched) as signals:
            task_status.started()
            draining = False
            async for signum in signals:
                name = signal.Signals(signum).name
                if not draining:
                    draining = True
                    log.info("%s: draining (grace %gs)", name, settings.shutdown_grace_s)
                    nursery.start_soon(drain_then_stop)
                else:
                    log.info("%s again: ending the running requests now", name)
                    grace.cancel()

    async def run_server(*, task_status: Any) -> None:
        await hypercorn_serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)
        nursery.cancel_scope.cancel()  # stop watching signals

    async with trio.open_nursery() as nursery:
        await nursery.start(watch_signals)
        binds = await nursery.start(run_server)
        log.info("listening on %s", ", ".join(binds))
        task_status.started(binds)
    log.info("stopped")


def _serve_main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = _settings(args, list(Settings.model_fields))
    if settings.node_rank > 0:  # another node of a tensor-parallel group: its ranks, no server
        from trio_infer.runtime.tp_group import serve_followers

        return serve_followers(settings)
    if settings.api_workers > 1:
        from trio_infer.supervisor import run

        return run(settings, str(args.log_level))
    wiring = Wiring(listen_fd=args.listen_fd, worker_address=args.worker_address)
    spawned = spawn_own_worker(settings, wiring)  # before trio's import: see its docstring
    import trio

    try:
        trio.run(serve, settings, wiring, spawned)
    except BaseExceptionGroup as group:
        from trio_infer.app import LoadFailed  # not before: serve() starts the worker first

        _, other = group.split(LoadFailed)
        if other is None:
            return 1  # the app logged why
        # What hypercorn's start raises when it cannot listen (the port is taken, the host is not
        # this machine's): one line, as llama-server and uvicorn say it, not a traceback.
        unbound, other = other.split(OSError)
        if other is not None:
            raise
        log.error("cannot listen on %s port %d: %s", settings.host, settings.port,
                  _innermost(unbound))
        return 1
    return 0


def _innermost(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


# -- generate -------------------------------------------------------------------------------------


async def generate(
    settings: Settings, prompt: str, max_tokens: int, temperature: float, seed: int | None
) -> dict[str, Any]:
    """One completion through the public library API (``open_engine``, the text stream)."""
    import trio

    from trio_infer.wire import SamplingParams
    from trio_infer.runtime.client import open_engine
    from trio_infer.runtime.tokenizer import build_served_tokenizer
    from trio_infer.runtime.text_stream import open_text_stream

    tokenizer = await trio.to_thread.run_sync(build_served_tokenizer, settings)
    prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    async with open_engine(settings) as engine:
        limit = engine.max_model_len
        if not prompt_ids or len(prompt_ids) + max_tokens > limit:
            raise SystemExit(
                f"error: the prompt ({len(prompt_ids)} tokens) plus --max-tokens {max_tokens} does "
                f"not fit the context ({limit} tokens)"
            )
        async with open_text_stream(engine, tokenizer, prompt_ids, [params]) as text:
            async for _ in text:
                pass
    choice = text.choices[0]
    return {"text": choice.text, "token_ids": choice.token_ids, "finish_reason": choice.finish_reason}


def _generate_main(args: argparse.Namespace) -> int:
    import trio

    from trio_infer.runtime.worker_link import WorkerStartError

    level = getattr(logging, str(args.log_level).upper(), logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = _settings(args, [n for n in Settings.model_fields])
    try:
        result = trio.run(generate, settings, args.prompt, args.max_tokens, args.temperature,
                          args.seed)
    except (Exception, BaseExceptionGroup) as exc:
        # A model that cannot be loaded is one line naming the file and why (the loaders'
        # messages say which tensor or key, and what is supported); a traceback only at debug.
        reason = _innermost(exc)
        if level <= logging.DEBUG or not isinstance(reason, (WorkerStartError, ValueError, OSError)):
            raise
        print(f"error: the model could not be loaded: {reason}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(result["text"])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve_main(args)
    return _generate_main(args)


if __name__ == "__main__":
    sys.exit(main())
