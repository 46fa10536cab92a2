"""The batching worker: the engine in a process of its own, stepping back to back.

:class:`WorkerCore` is the worker's end of the protocol (the messages of :mod:`trio_infer.wire`),
sans-IO: frames in (:meth:`~WorkerCore.receive_data`), a step's frames out
(:meth:`~WorkerCore.cycle`). The engine's outputs and statistics are wire structs already: they
go into the frame as the engine returned them. It owns the per-uid credits and pauses a sequence in the engine
(``set_ready(False)``) when its credits run out, so it never emits an output without a credit.

:func:`serve` is the process's loop: a plain blocking loop, no event loop and no threads (for one
front end, or for the ``--api-workers`` front ends that connect to a socket; :func:`serve_task` is
the same loop as a trio task, for an engine object held in-process). It
applies every message the front end has sent, runs one step, sends that step's frame, and starts
again; when nothing can run (idle, or every sequence waits for credits) it blocks on the pipe.
Its cadence is the engine's, whatever the front end is doing. When the pipe closes (the front end
exited, crashed or was killed) it exits: a worker never outlives its front end. It ignores
SIGINT and SIGTERM: a Ctrl-C or a signal sent to the process group reaches the front end too,
which drains and then closes the pipe. While it loads the model it reports its progress
(:class:`~trio_infer.wire.Loading`) and exits at once if the pipe closes (the front
end was stopped or died mid-load: nothing is lost, and a load can take minutes).

Run as ``python -m trio_infer.runtime.worker --fd N``: the front end (``runtime/transport.py``)
starts it with one end of a socket pair as fd N and sends :class:`~trio_infer.wire.Start` (the
settings and the log level) as the first frame. With ``--listen PATH --ports N`` (a supervisor
starts it) the pair is its control pipe, where it reports its load and its hello, and front ends
connect to PATH.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Sequence

from trio_infer.engine.engine import Engine, StepPlan
from trio_infer.wire import (
    Abort,
    Add,
    Credit,
    EngineStatistics,
    Failed,
    Fatal,
    FrameDecoder,
    Hello,
    Loading,
    ProtocolError,
    RequestOutput,
    Start,
    Step,
    ToWorker,
    Uid,
    encode,
)

if TYPE_CHECKING:  # a worker process never runs trio: its loop is plain blocking I/O
    import trio

log = logging.getLogger(__name__)

# Test-only: seconds the worker waits before it loads the model, to make a slow load out of a
# tiny model (tests of the front end's background load). Never set it in production.
TEST_LOAD_DELAY_ENV = "TRIO_INFER_TEST_LOAD_DELAY_S"
# Progress reports at most this often (the last tensor's is always sent).
_PROGRESS_INTERVAL_S = 0.1


class WorkerCore:
    """The engine behind the protocol. Messages are applied between steps only.

    One worker may serve several front ends (``serve --api-workers N``), each on a *port* (its
    own pipe) with its own frame decoder. The front end on port ``p`` of ``num_ports`` numbers its
    requests ``p + num_ports, p + 2 * num_ports, ...`` (its :class:`Hello` says so), so uids are
    unique across ports and reach the engine unchanged; the core remembers each uid's port to send
    its outputs there. The single-port methods (``receive_data``, ``run_step``, ``idle_frame``)
    are port 0 of a one-port worker.
    """

    def __init__(self, engine: Engine, num_ports: int = 1) -> None:
        self.engine = engine
        self.num_ports = num_ports
        self._credits: dict[Uid, int] = {}
        self._port_of: dict[Uid, int] = {}
        self._decoders = {p: FrameDecoder(ToWorker) for p in range(num_ports)}
        self._failed: dict[int, list[Failed]] = {}
        self._admitted: dict[int, list[Uid]] = {}  # first scheduled, not yet told, by port
        self._sent_stats: dict[int, EngineStatistics] = {}

    def hello(self, port: int = 0) -> bytes:
        from trio_infer_kernels import cpu

        e = self.engine
        info = e.model.info
        if e.device == "cpu":  # without trio_infer_kernels.ops, which imports torch
            kernels, problem = cpu.compute_path()
        else:
            from trio_infer_kernels.ops import compute_path

            kernels, problem = compute_path(e.device)
        kv_dtype = e.kv_cache.dtype if e.kv_cache.k else ""
        return encode([Hello(info.name, info.vocab_size, e.max_model_len, e.pool.num_pages,
                             port, self.num_ports, kernels, problem, kv_dtype)])

    def receive_data(self, data: bytes, port: int = 0) -> None:
        for message in self._decoders[port].feed(data):
            kind = type(message)
            if kind is Credit:
                left = self._credits.get(message.uid)
                if left is not None:  # else it ended: the credit is moot
                    if left == 0:
                        self.engine.set_ready(message.uid, True)
                    self._credits[message.uid] = left + message.n
            elif kind is Add:
                self._add(message, port)
            elif kind is Abort:
                self._end(message.uid)
            else:
                raise ProtocolError(f"{kind.__name__} after the worker started")

    def _add(self, message: Add, port: int) -> None:
        try:
            self.engine.add_request(message.uid, message.prompt_ids, message.params)
        except ValueError as exc:  # the front end validates first; this is a safety net
            self._failed.setdefault(port, []).append(
                Failed(message.uid, f"the request was refused: {exc}"))
            return
        self._credits[message.uid] = message.credits
        self._port_of[message.uid] = port

    def _end(self, uid: Uid) -> None:
        self.engine.abort(uid)
        self._credits.pop(uid, None)
        self._port_of.pop(uid, None)

    def drop_port(self, port: int) -> None:
        """The front end on ``port`` is gone: end its sequences, forget its state."""
        for uid in [u for u, p in self._port_of.items() if p == port]:
            self._end(uid)
        self._decoders[port] = FrameDecoder(ToWorker)
        self._failed.pop(port, None)
        self._admitted.pop(port, None)
        self._sent_stats.pop(port, None)

    def schedule(self) -> StepPlan | None:
        plan = self.engine.schedule()
        for uid in self.engine.take_admitted():  # their queue time ends: the next frame says so
            port = self._port_of.get(uid)
            if port is not None:
                self._admitted.setdefault(port, []).append(uid)
        return plan

    def run_step(self, plan: StepPlan) -> bytes:
        """Execute ``plan`` and commit it: the step's frame (one port)."""
        return self.step_frames(plan).get(0, b"")

    def step_frames(self, plan: StepPlan) -> dict[int, bytes]:
        """Execute ``plan`` and commit it: a frame for every port. A step that raises fails only
        the sequences it carried (their KV is suspect); the worker goes on."""
        try:
            result = self.engine.execute(plan)
        except Exception as exc:
            log.exception("an engine step failed; failing the requests it carried")
            for uid in self.engine.fail(plan):
                port = self._port_of.pop(uid, 0)
                self._credits.pop(uid, None)
                self._failed.setdefault(port, []).append(
                    Failed(uid, f"the engine failed while generating: {exc}"))
            return self._frames({})
        return self.commit(plan, result)

    def commit(self, plan: StepPlan, result: object) -> dict[int, bytes]:
        credits, port_of = self._credits, self._port_of
        outputs: dict[int, list[RequestOutput]] = {}
        for out in self.engine.commit(plan, result):  # type: ignore[arg-type]
            if out.finish_reason is None:
                left = credits[out.uid] - 1
                credits[out.uid] = left
                if left == 0:
                    self.engine.set_ready(out.uid, False)  # wait for the reader
                port = port_of[out.uid]
            else:
                del credits[out.uid]
                port = port_of.pop(out.uid)
            outputs.setdefault(port, []).append(out)  # the engine's own struct goes on the wire
        return self._frames(outputs)

    def idle_frame(self) -> bytes:
        return self.idle_frames().get(0, b"")

    def idle_frames(self) -> dict[int, bytes]:
        """What the front ends have not heard yet while no step runs (refusals, the gauges after
        an abort freed pages)."""
        stats = self._stats()
        frames = {}
        for port in self._decoders:
            if self._failed.get(port) or self._sent_stats.get(port) != stats:
                frames[port] = self._frame(port, [], stats)
        return frames

    def cycle(self) -> tuple[dict[int, bytes], bool]:
        """One turn of a worker's loop: a step if one can run, else what idle front ends have not
        heard yet. The frames by port, and whether a step ran (if not, the loop may block)."""
        plan = self.schedule()
        if plan is None:
            return self.idle_frames(), False
        return self.step_frames(plan), True

    def _stats(self) -> EngineStatistics:
        return self.engine.statistics()

    def _frames(self, outputs: dict[int, list[RequestOutput]]) -> dict[int, bytes]:
        stats = self._stats()
        return {port: self._frame(port, outputs.get(port, []), stats) for port in self._decoders}

    def _frame(self, port: int, outputs: list[RequestOutput], stats: EngineStatistics) -> bytes:
        failed = self._failed.pop(port, [])
        admitted = self._admitted.pop(port, [])
        self._sent_stats[port] = stats
        return encode([Step(outputs, failed, stats, admitted)])

    @property
    def live_uids(self) -> list[Uid]:
        return list(self._credits)


# -- the process ----------------------------------------------------------------------------------

_CHUNK = 1 << 20


def _drain(sock: socket.socket, core: WorkerCore, block: bool, port: int = 0) -> bool:
    """Apply what the front end sent (waiting for something first if ``block``). False on EOF.
    A read shorter than the buffer took everything there was: the loop's next ``select`` sees
    what came after, so the common turn (a frame of credits a step) costs one ``recv``, not a
    second one that finds nothing."""
    flags = 0 if block else socket.MSG_DONTWAIT
    while True:
        try:
            data = sock.recv(_CHUNK, flags)
        except BlockingIOError:
            return True
        if not data:
            return False
        core.receive_data(data, port)
        if len(data) < _CHUNK:
            return True
        flags = socket.MSG_DONTWAIT


def serve(core: WorkerCore, control: socket.socket, listener: socket.socket | None = None) -> None:
    """The worker process's loop; returns when ``control`` (the pipe of whoever spawned it)
    closes.

    Without ``listener`` the control pipe is the one front end's (port 0). With one (``serve
    --api-workers N``), up to ``core.num_ports`` front ends connect to it, each on a port of its
    own; a front end that leaves loses its sequences and the worker goes on. Each turn is
    :meth:`WorkerCore.cycle`; the loop blocks on its sockets only when no step could run."""
    selector = selectors.DefaultSelector()
    ports: dict[int, socket.socket] = {}
    if listener is None:
        ports[0] = control
        selector.register(control, selectors.EVENT_READ, 0)
    else:
        selector.register(control, selectors.EVENT_READ, "control")
        selector.register(listener, selectors.EVENT_READ, "listen")
    control.sendall(core.hello(0))  # to a supervisor: the model is loaded

    def drop(port: int) -> None:
        conn = ports.pop(port)
        selector.unregister(conn)
        conn.close()
        core.drop_port(port)
        log.info("front end on port %d left", port)

    def send(frames: dict[int, bytes]) -> None:
        for port, frame in frames.items():
            conn = ports.get(port)
            if conn is not None:
                try:
                    conn.sendall(frame)
                except OSError:
                    if conn is control:
                        raise
                    drop(port)

    while True:
        frames, stepped = core.cycle()
        send(frames)
        for key, _ in selector.select(0 if stepped else None):
            if key.data == "control":
                if not control.recv(_CHUNK):
                    return
            elif key.data == "listen":
                conn, _ = listener.accept()  # type: ignore[union-attr]
                free = [p for p in range(core.num_ports) if p not in ports]
                if not free:
                    log.error("a front end connected beyond the %d ports; refused", core.num_ports)
                    conn.close()
                    continue
                ports[free[0]] = conn
                selector.register(conn, selectors.EVENT_READ, free[0])
                conn.sendall(core.hello(free[0]))
                log.info("front end connected on port %d", free[0])
            elif key.data in ports:
                conn = ports[key.data]
                try:
                    alive = _drain(conn, core, block=False, port=key.data)
                except OSError:
                    alive = False
                if not alive:
                    if conn is control:
                        return
                    drop(key.data)


async def serve_task(
    core: WorkerCore,
    inbox: trio.MemoryReceiveChannel[bytes],
    outbox: trio.MemorySendChannel[bytes],
    in_thread: bool,
) -> None:
    """:func:`serve` for one front end, as a trio task over memory channels (an engine object
    this process holds: ``in_process.open_worker_task``). The step runs inline on the event loop
    (instant models: exact under a mock clock) or in a worker thread (``in_thread``)."""
    import trio

    with outbox:
        outbox.send_nowait(core.hello())
        while True:
            while True:
                try:
                    core.receive_data(inbox.receive_nowait())
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    return
            plan = core.schedule()
            if plan is None:
                frame = core.idle_frame()
                if frame:
                    outbox.send_nowait(frame)
                try:
                    core.receive_data(await inbox.receive())
                except trio.EndOfChannel:
                    return
                continue
            if in_thread:
                frame = await trio.to_thread.run_sync(core.run_step, plan)
            else:
                await trio.lowlevel.checkpoint()  # let requests run between steps
                frame = core.run_step(plan)
            outbox.send_nowait(frame)


def _read_start(sock: socket.socket) -> Start:
    """The first frame: :class:`Start`. Exits quietly if the pipe closes first (the front end
    went away before we started)."""
    header = sock.recv(4, socket.MSG_WAITALL)
    size = int.from_bytes(header, "big") if len(header) == 4 else 0
    body = sock.recv(size, socket.MSG_WAITALL) if size else b""
    if len(body) < size or not body:
        raise SystemExit(0)
    messages = FrameDecoder(ToWorker).feed(header + body)
    if len(messages) != 1 or type(messages[0]) is not Start:
        raise ProtocolError(f"the first frame must be one Start, not {messages!r:.200}")
    return messages[0]


def _exit_if_the_pipe_closes(sock: socket.socket, loaded: threading.Event) -> None:
    """Until ``loaded`` is set, exit as soon as the front end (or supervisor) closes the pipe.
    The main thread is busy in the loaders and reads nothing meanwhile (the front end sends
    nothing before the hello); this thread only peeks, so it takes nothing the serving loop
    reads."""

    def watch() -> None:
        try:
            data = sock.recv(1, socket.MSG_PEEK)
        except OSError:
            data = b""
        if not data and not loaded.is_set():
            log.info("the front end left while the model was loading; exiting")
            os._exit(0)

    threading.Thread(target=watch, name="pipe-watch", daemon=True).start()


class _ProgressSender:
    """Send :class:`Loading` reports down the pipe, at most every ``_PROGRESS_INTERVAL_S``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._last: tuple[str, float] | None = None

    def __call__(self, phase: str, done: int | None, total: int | None) -> None:
        now = time.monotonic()
        if (self._last is not None and self._last[0] == phase and done != total
                and now - self._last[1] < _PROGRESS_INTERVAL_S):
            return
        self._last = (phase, now)
        self._sock.sendall(encode([Loading(phase, done, total)]))


# Load errors whose message says all there is to say (a path that does not exist or cannot be
# read: ``models/paths.py`` names the model and what to do): logged as one line and sent as it is,
# so that the front end reports the same reason in the same words whichever of its tokenizer's
# load and this one finds it first (they race).
# Load errors whose message is the whole story: a model that is not there, and what the loaders
# raise for a file or a config they cannot serve (ValueError: GGUFError for a broken or
# unsupported GGUF file, ShardError, an unsupported setting), each naming the file, the tensor or
# key and what is supported. One line, from the front end; the traceback at debug level.
_SAYS_WHY = (FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError, ValueError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_infer.runtime.worker")
    parser.add_argument("--fd", type=int, required=True,
                        help="the front end's end of a socket pair; with --listen: the supervisor's")
    parser.add_argument("--listen", default=None, metavar="PATH",
                        help="serve the front ends that connect to this Unix socket (shared worker)")
    parser.add_argument("--ports", type=int, default=1, help="with --listen: how many front ends")
    args = parser.parse_args(argv)
    # The front end owns shutdown: it drains, then closes the pipe, which ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    start = _read_start(sock)
    logging.basicConfig(
        level=getattr(logging, start.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s worker %(name)s: %(message)s",
    )
    from trio_infer.settings import Settings

    settings = Settings.model_validate_json(start.settings)
    loaded = threading.Event()
    _exit_if_the_pipe_closes(sock, loaded)
    try:
        delay = float(os.environ.get(TEST_LOAD_DELAY_ENV) or 0)
        if delay:
            log.warning("%s=%g: waiting before the load (test-only)", TEST_LOAD_DELAY_ENV, delay)
            time.sleep(delay)
        from trio_infer.runtime.loading import build_engine

        engine = build_engine(settings, _ProgressSender(sock))
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the front end left mid-load
    except Exception as exc:
        if isinstance(exc, _SAYS_WHY):  # its message is the reason: the front end says it, once
            log.debug("the worker could not load the model", exc_info=True)
            reason = str(exc)
        else:  # anything else may be a bug: its traceback too
            log.exception("the worker could not load the model")
            reason = f"could not load the model: {exc}"
        sock.sendall(encode([Fatal(reason)]))
        return 1
    loaded.set()
    # What is loaded now (torch, the model's modules, the tokenizer) lives as long as the process:
    # frozen out of the collector's sight, a full collection between steps does not walk it.
    # No gc.collect() first: on the default model it found 39 objects and no memory, for 0.1 s
    # more before the worker is ready.
    gc.freeze()
    try:
        if args.listen is None:
            serve(WorkerCore(engine), sock)
        else:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if os.path.exists(args.listen):
                os.unlink(args.listen)  # a previous worker's
            listener.bind(args.listen)
            listener.listen(args.ports)
            serve(WorkerCore(engine, num_ports=args.ports), sock, listener)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the front end is gone
    finally:
        gc.unfreeze()  # collectable again at exit: extension modules check that they were freed
    return 0


if __name__ == "__main__":
    sys.exit(main())
