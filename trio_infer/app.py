"""The quart-trio application: ``hypercorn trio_infer.app:app --worker-class trio``.

``create_app(settings)`` builds an app; the module-level ``app`` is built from the environment
(``TRIO_INFER_*``). Building is cheap: at startup (``before_serving``) the app loads the tokenizer
(in a thread) and starts the batching worker, a child process that loads the model, through the
public library API (:func:`~trio_infer.runtime.client.open_engine`) in an ``app.nursery`` task.

Lifecycle of the worker inside the app:

* startup: tokenizer (thread) -> ``open_engine``: the worker process starts, loads the model and
  says hello -> serving. A model that fails to load fails the startup with its error.
* the worker dies (crash, OOM kill, ``kill -9``): every live request ends at once with an error
  (error event or 503), ``/health`` and new requests answer 503, and the worker is restarted
  (bounded, logged); then the server serves again.
* shutdown: ``after_serving`` drains (new requests 503) and ends every live session with an error,
  then the app nursery's cancellation closes the pipe and reaps the worker. :func:`drain` gives
  running requests a grace period first; ``python -m trio_infer serve`` calls it on SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from quart_trio import QuartTrio

from trio_infer.api.errors import register_error_handlers
from trio_infer.api.plans import ModelLimits
from trio_infer.api.render import TokenText
from trio_infer.api.routes import register_routes
from trio_infer.api.state import ServerState, server_state
from trio_infer.engine.engine import Engine
from trio_infer.metrics import Metrics
from trio_infer.runtime.client import open_engine
from trio_infer.runtime.errors import EngineUnavailable
from trio_infer.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, loaded: "tuple[Engine, Any] | None" = None) -> QuartTrio:
    """A new app serving ``settings``.

    By default the model is loaded by a batching worker process at startup. A program that holds
    an engine and its tokenizer already passes them as ``loaded``: the engine then runs behind the
    same protocol in a task of this process (tests under a mock clock rely on that).
    """
    settings = settings if settings is not None else Settings()
    app = QuartTrio(__name__)
    app.config.update(
        RESPONSE_TIMEOUT=None,  # trap 1: streams may run for minutes
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        BODY_TIMEOUT=settings.body_timeout_s,  # a body trickled slower than this: 408
        # The engine is stopped by after_serving and the app nursery's cancellation; do not
        # wait 5 s for it at every shutdown (trap 10).
        BACKGROUND_TASK_SHUTDOWN_TIMEOUT=None,
    )
    state = ServerState(settings, Metrics())
    app.extensions["trio_infer"] = state
    register_error_handlers(app)
    register_routes(app)

    @app.before_serving
    async def _start_engine() -> None:
        if loaded is not None:
            engine, tokenizer = loaded
        else:
            from trio_infer.runtime.loading import build_tokenizer

            engine, tokenizer = None, await trio.to_thread.run_sync(build_tokenizer, settings)
        state.tokenizer = tokenizer
        state.texts = TokenText(tokenizer)
        state.engine = await app.nursery.start(_run_engine, state, engine)
        info = state.engine.info
        state.limits = ModelLimits(
            name=settings.served_model_name or info.name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            max_n=settings.max_n,
            max_batch_sequences=settings.max_waiting,
        )
        log.info("serving %s (context %d tokens)", state.limits.name, state.limits.max_model_len)

    @app.after_serving
    async def _stop_engine() -> None:
        # In-flight requests have drained or been cancelled by now; end whatever is left with an
        # explicit error rather than silence, then the app nursery's cancellation stops the worker.
        if state.engine is not None:
            state.engine.begin_drain()
            state.engine.abort_all(EngineUnavailable("the server is shutting down"))

    return app


async def _run_engine(
    state: ServerState, engine: Engine | None, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    async with open_engine(state.settings, engine, state.metrics) as async_engine:
        task_status.started(async_engine)
        await trio.sleep_forever()


async def drain(app: QuartTrio, grace_s: float) -> None:
    """Graceful shutdown, first half: refuse new work (``/health`` and new requests get 503),
    let running requests finish for up to ``grace_s`` seconds, then end the rest with an error
    (streams get an error event and ``[DONE]``)."""
    engine = server_state(app).engine
    if engine is None:
        return
    engine.begin_drain()
    with trio.move_on_after(grace_s):
        await engine.wait_sessions_done()
    if engine.num_sessions:
        log.info("grace period over: ending %d request(s)", engine.num_sessions)
    engine.abort_all(EngineUnavailable("the server is shutting down"))


app = create_app()
