"""The quart-trio application: ``hypercorn trio_infer.app:app --worker-class trio``.

``create_app(settings)`` builds an app; the module-level ``app`` is built from the environment
(``TRIO_INFER_*``). Building is cheap, and so is startup: ``before_serving`` only starts the load
(:func:`load_and_serve`) as a task of the app's nursery and returns, so the server listens at
once, however long the model takes (hypercorn fails a lifespan startup that takes longer than its
``startup_timeout``, 60 s by default).

Lifecycle of the worker inside the app:

* loading: ``open_engine`` (``open_data_parallel`` with ``--data-parallel N``: N workers,
  ``runtime/data_parallel.py``) starts the worker process at once, and it loads the model
  (reporting its progress) and says hello while this process loads the tokenizer in a thread;
  serving once both are done. Meanwhile ``/health`` answers 503
  (``loading``), ``/v1/status`` says how far the load got, and every API request gets 503 with
  ``Retry-After``. A load that fails is logged and raised out of the app's nursery as
  :class:`LoadFailed`, which stops the server: the process exits non-zero.
* the worker dies (crash, OOM kill, ``kill -9``): every live request ends at once with an error
  (error event or 503), ``/health`` and new requests answer 503, and the worker is restarted
  (bounded, logged); then the server serves again.
* shutdown: ``after_serving`` drains (new requests 503) and ends every live session with an error,
  then the app nursery's cancellation closes the pipe and reaps the worker (a worker still loading
  exits as soon as its pipe closes). :func:`drain` gives running requests a grace period first;
  ``python -m trio_infer serve`` calls it on SIGTERM/SIGINT.
"""

from __future__ import annotations

import gc
import logging
import sys
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.utils import LifespanFailureError
from quart_trio import QuartTrio

from trio_infer.api import direct, health
from trio_infer.api.errors import register_error_handlers
from trio_infer.api.last_send import shield_last_send
from trio_infer.api.response_store import open_store
from trio_infer.api.routes import register_routes
from trio_infer.api.state import ServerState, server_state
from trio_infer.metrics import Metrics
from trio_infer.runtime.client import open_engine
from trio_infer.runtime.data_parallel import open_data_parallel
from trio_infer.runtime.errors import EngineUnavailable
from trio_infer.runtime.in_process import in_process
from trio_infer.runtime.transport import WorkerProcess
from trio_infer.settings import Settings, Wiring
from trio_infer.wire import Loading

if TYPE_CHECKING:  # an engine object is only ever handed in (tests, embedding): never imported here
    from trio_infer.engine.engine import Engine

log = logging.getLogger(__name__)


class LoadFailed(LifespanFailureError):
    """The model could not be loaded (the message says why).

    A :class:`hypercorn.utils.LifespanFailureError` because that is the one exception hypercorn
    lets out of a running app's lifespan (any other is logged, and the server goes on serving
    503s for good): raised into the app's nursery, it stops the server, and the process exits
    non-zero, under bare ``hypercorn`` as under ``python -m trio_infer serve``."""

    def __init__(self, reason: str) -> None:
        super().__init__("startup", f"the model could not be loaded: {reason}")
        self.reason = reason


class App(QuartTrio):
    """quart-trio's app with ``/health`` (``api/health.py``) and the hot routes, chat and
    completions (``api/direct.py``), answered before quart's request machinery; those files
    say why."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        state: ServerState = self.extensions["trio_infer"]
        path = direct.route_path(scope)
        if path is not None:
            return await direct.serve(path, scope, receive, send, state)
        if health.is_plain_probe(scope, state.settings.max_header_bytes):
            return await health.answer(scope, send, state)
        if scope["type"] == "http":
            send = shield_last_send(send)  # (last_send.py says why)
        return await self.asgi_app(scope, receive, send)


def create_app(
    settings: Settings | None = None, *, loaded: "tuple[Engine, Any] | None" = None,
    wiring: Wiring = Wiring(), worker: WorkerProcess | None = None,
) -> App:
    """A new app serving ``settings`` (``wiring``: how a front end of ``serve --api-workers``
    reaches the shared worker).

    By default the model is loaded by a batching worker process, in the background once the
    server listens. A program that holds an engine and its tokenizer already passes them as
    ``loaded``: the engine then runs behind the same protocol in a task of this process, started
    before startup returns (tests under a mock clock rely on that). ``worker``: a batching worker
    process ``serve`` started for ``settings`` before it imported this module, which the load
    uses instead of starting one (whoever started it reaps it too: closing is idempotent).
    """
    settings = settings if settings is not None else Settings()
    app = App(__name__)
    app.config.update(
        RESPONSE_TIMEOUT=None,  # trap 1: streams may run for minutes
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        BODY_TIMEOUT=settings.body_timeout_s,  # a body trickled slower than this: 408
        # The engine is stopped by after_serving and the app nursery's cancellation; do not
        # wait 5 s for it at every shutdown (trap 10).
        BACKGROUND_TASK_SHUTDOWN_TIMEOUT=None,
    )
    state = ServerState(settings, Metrics(speculative=settings.speculative != "off"), wiring=wiring)
    state.store = open_store(settings, state.metrics.store_changed)
    app.extensions["trio_infer"] = state
    register_error_handlers(app)
    register_routes(app)

    @app.before_serving
    async def _start_engine() -> None:
        if loaded is None:
            app.nursery.start_soon(load_and_serve, app.nursery, state, worker)
        else:
            engine, tokenizer = loaded
            state.serve(await app.nursery.start(_run_engine, state, engine), tokenizer)

    @app.after_serving
    async def _stop_engine() -> None:
        # In-flight requests have drained or been cancelled by now; end whatever is left with an
        # explicit error rather than silence, then the app nursery's cancellation stops the worker.
        if state.engine is not None:
            state.engine.begin_drain()
            state.engine.abort_all(EngineUnavailable("the server is shutting down"))
        if state.store is not None:
            state.store.close()

    return app


async def load_and_serve(
    nursery: trio.Nursery, state: ServerState, worker: WorkerProcess | None = None
) -> None:
    """Start the batching worker in ``nursery`` and load the tokenizer meanwhile; serve once the
    worker has loaded the model and the tokenizer is here. ``state.loading`` says how far the
    load got. Raises :class:`LoadFailed` (after logging why) if either cannot be loaded.

    The two overlap: the worker's imports and model load take seconds of one process, the
    tokenizer (the file's hash for the cache key, the cached tokenizer)
    a fraction of a second of this one; one after the other, the start would take their sum."""
    settings = state.settings
    loaded: list[Any] = []

    async def load_tokenizer() -> None:
        from trio_infer.runtime.tokenizer import build_served_tokenizer

        # Abandoned on cancellation: a shutdown mid-load need not wait for a conversion.
        loaded.append(await trio.to_thread.run_sync(build_served_tokenizer, settings,
                                                    abandon_on_cancel=True))

    try:
        state.loading = Loading("worker")
        async with trio.open_nursery() as loads:
            loads.start_soon(load_tokenizer)
            engine = await nursery.start(_run_engine, state, None, worker)
            if not loaded:  # the worker was quicker
                state.loading = Loading("tokenizer")
    except Exception as exc:
        reason = _innermost(exc)
        log.error("the model could not be loaded: %s", reason)
        raise LoadFailed(reason) from exc
    state.serve(engine, loaded[0])
    settle_heap()


# The young generation's collection threshold once the model is served (CPython's default: 700).
YOUNG_GC_THRESHOLD = 20_000


def settle_heap() -> None:
    """Take everything loaded so far (the imports, the tokenizer: about 100k objects) out of the
    garbage collector's sight (``gc.freeze``).

    Why: CPython's full collection walks every tracked object, and this heap made it take 100-200
    ms on this machine, during which no stream is written and no probe answered; a burst of
    requests, whose objects survive the young collections, sets one off. Frozen objects are
    never collected (they are the server's for its lifetime anyway), and a full collection then
    walks only what the requests made. Called once, when the model is served by
    :func:`load_and_serve` (not for an engine handed in: a test process makes many apps, and
    must collect them). No ``gc.collect()`` first: it would add as much to the time to healthy,
    for the few cycles startup left behind.

    And the young generation's threshold goes from 700 to :data:`YOUNG_GC_THRESHOLD` tracked
    objects: every engine step's frame decodes a few hundred outputs (a struct, a tuple and a
    list each), so at 700 a young collection ran about once a frame and its survivors fed the
    older generations' collections: at 256 streams x 256 tokens, 352 young, 31 middle and 2
    full collections in one run, ~430 ms of the front end's CPU (about 8% of it; measured with
    ``gc.callbacks`` and ``time.thread_time``). At 20,000: 5 young collections and no other,
    ~50 ms. The older generations keep their thresholds, so cyclic garbage is still collected,
    only later; 20,000 young objects are a few MB at most."""
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


def _innermost(exc: BaseException) -> str:
    """The messages of the errors inside nested exception groups (trio's nurseries wrap them),
    each cause said once: the tokenizer's load and the worker's can fail together for the same
    reason (a missing model), the worker's message then wrapping the tokenizer's ("could not
    load the model: <it>"), so a message that contains another is dropped."""
    leaves: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if isinstance(e, BaseExceptionGroup):
            todo[:0] = list(e.exceptions)
        else:
            leaves.append(e)
    messages = list(dict.fromkeys(str(e) or type(e).__name__ for e in leaves))
    kept = [m for m in messages if not any(o != m and o in m for o in messages)]
    return "; ".join(kept)


async def _run_engine(
    state: ServerState, engine: Engine | None, worker: WorkerProcess | None = None, *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    def on_loading(loading: Loading | None) -> None:
        state.loading = loading

    settings = state.settings
    if settings.data_parallel > 1 and engine is None:
        # N worker processes behind this front end (never under a supervisor: Settings refuses
        # data_parallel with api_workers).
        opened = open_data_parallel(settings, state.metrics, on_loading=on_loading)
    else:
        opened = open_engine(settings, in_process(engine) if engine is not None else None,
                             state.metrics, on_loading=on_loading,
                             wiring=state.wiring, started=worker)
    async with opened as serving:
        task_status.started(serving)
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


def _only_load_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a :class:`LoadFailed`, alone or in exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return isinstance(exc, LoadFailed)


def _quiet_load_failures(previous: Any) -> Any:
    """A ``sys.excepthook`` for a process that serves :data:`app` (bare hypercorn): a load that
    failed leaves hypercorn's run as :class:`LoadFailed`, whose reason the app already logged in
    one line (the file, the tensor, what is supported), so the traceback is not printed again
    unless this package logs at debug level. Anything else goes to ``previous``."""

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if _only_load_failed(exc) and not log.isEnabledFor(logging.DEBUG):
            return
        previous(kind, exc, tb)

    return hook


app = create_app()
sys.excepthook = _quiet_load_failures(sys.excepthook)
