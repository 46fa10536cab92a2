"""The batching worker: the engine in a process of its own, stepping back to back.

:class:`WorkerCore` is the worker's end of the protocol (:mod:`trio_infer.runtime.protocol`),
sans-IO: frames in (:meth:`~WorkerCore.receive_data`), a step's frame out
(:meth:`~WorkerCore.run_step`). It owns the per-uid credits and pauses a sequence in the engine
(``set_ready(False)``) when its credits run out, so it never emits an output without a credit.

:func:`serve` is the process's loop: a plain blocking loop, no event loop and no threads. It
applies every message the front end has sent, runs one step, sends that step's frame, and starts
again; when nothing can run (idle, or every sequence waits for credits) it blocks on the pipe.
Its cadence is the engine's, whatever the front end is doing. When the pipe closes (the front end
exited, crashed or was killed) it exits: a worker never outlives its front end. It ignores
SIGINT and SIGTERM: a Ctrl-C or a signal sent to the process group reaches the front end too,
which drains and then closes the pipe.

Run as ``python -m trio_infer.runtime.worker --fd N``: the front end (``runtime/transport.py``)
starts it with one end of a socket pair as fd N and sends the settings as the first frame.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
from typing import Sequence

from trio_infer.engine.engine import Engine, StepPlan
from trio_infer.runtime.protocol import (
    Abort,
    Add,
    Credit,
    Failed,
    Fatal,
    FrameDecoder,
    Hello,
    Output,
    Stats,
    Step,
    ToWorker,
    Uid,
    encode,
)

log = logging.getLogger(__name__)


class WorkerCore:
    """The engine behind the protocol. Messages are applied between steps only."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._credits: dict[Uid, int] = {}
        self._decoder = FrameDecoder(ToWorker)
        self._failed: list[Failed] = []
        self._sent_stats: Stats | None = None

    def hello(self) -> bytes:
        e = self.engine
        info = e.model.info
        return encode([Hello(info.name, info.vocab_size, e.max_model_len, e.pool.num_pages)])

    def receive_data(self, data: bytes) -> None:
        for message in self._decoder.feed(data):
            kind = type(message)
            if kind is Credit:
                left = self._credits.get(message.uid)
                if left is not None:  # else it ended: the credit is moot
                    if left == 0:
                        self.engine.set_ready(message.uid, True)
                    self._credits[message.uid] = left + message.n
            elif kind is Add:
                self._add(message)
            elif kind is Abort:
                self.engine.abort(message.uid)
                self._credits.pop(message.uid, None)

    def _add(self, message: Add) -> None:
        try:
            self.engine.add_request(message.uid, message.prompt_ids, message.params)
        except ValueError as exc:  # the front end validates first; this is a safety net
            self._failed.append(Failed(message.uid, f"the request was refused: {exc}"))
            return
        self._credits[message.uid] = message.credits

    def schedule(self) -> StepPlan | None:
        return self.engine.schedule()

    def run_step(self, plan: StepPlan) -> bytes:
        """Execute ``plan`` and commit it: the step's frame. A step that raises fails only the
        sequences it carried (their KV is suspect); the worker goes on."""
        try:
            result = self.engine.execute(plan)
        except Exception as exc:
            log.exception("an engine step failed; failing the requests it carried")
            return self.fail_step(plan, exc)
        return self.commit(plan, result)

    def commit(self, plan: StepPlan, result: object) -> bytes:
        credits = self._credits
        outputs = []
        for out in self.engine.commit(plan, result):  # type: ignore[arg-type]
            if out.finish_reason is None:
                left = credits[out.uid] - 1
                credits[out.uid] = left
                if left == 0:
                    self.engine.set_ready(out.uid, False)  # wait for the reader
            else:
                del credits[out.uid]
            outputs.append(
                Output(out.uid, out.token_ids, out.logprobs, out.finish_reason,
                       out.stop_token_id, out.num_prompt_tokens, out.num_output_tokens,
                       out.prompt_logprobs)
            )
        return self._frame(outputs)

    def fail_step(self, plan: StepPlan, exc: BaseException) -> bytes:
        for uid in self.engine.fail(plan):
            self._credits.pop(uid, None)
            self._failed.append(Failed(uid, f"the engine failed while generating: {exc}"))
        return self._frame([])

    def idle_frame(self) -> bytes:
        """What the front end has not heard yet while no step runs (refusals, the gauges after
        an abort freed pages), or b""."""
        if self._failed or self._stats() != self._sent_stats:
            return self._frame([])
        return b""

    def _stats(self) -> Stats:
        return Stats(**dataclasses.asdict(self.engine.statistics()))

    def _frame(self, outputs: list[Output]) -> bytes:
        stats = self._stats()
        failed, self._failed = self._failed, []
        self._sent_stats = stats
        return encode([Step(outputs, failed, stats)])

    @property
    def live_uids(self) -> list[Uid]:
        return list(self._credits)


# -- the process ----------------------------------------------------------------------------------

_CHUNK = 1 << 20


def _drain(sock: socket.socket, core: WorkerCore, block: bool) -> bool:
    """Apply what the front end sent (waiting for something first if ``block``). False on EOF."""
    flags = 0 if block else socket.MSG_DONTWAIT
    while True:
        try:
            data = sock.recv(_CHUNK, flags)
        except BlockingIOError:
            return True
        if not data:
            return False
        core.receive_data(data)
        flags = socket.MSG_DONTWAIT


def serve(sock: socket.socket, core: WorkerCore) -> None:
    """The worker's loop; returns when the front end closes the pipe."""
    sock.sendall(core.hello())
    while True:
        plan = core.schedule()
        if plan is None:
            frame = core.idle_frame()
            if frame:
                sock.sendall(frame)
            if not _drain(sock, core, block=True):
                return
            continue
        sock.sendall(core.run_step(plan))
        if not _drain(sock, core, block=False):
            return


def _read_settings(sock: socket.socket):  # type: ignore[no-untyped-def]
    from trio_infer.settings import Settings

    header = sock.recv(4, socket.MSG_WAITALL)
    size = int.from_bytes(header, "big") if len(header) == 4 else 0
    body = sock.recv(size, socket.MSG_WAITALL) if size else b""
    if not body:
        raise SystemExit(0)  # the front end went away before we started
    return Settings.model_validate_json(body)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_infer.runtime.worker")
    parser.add_argument("--fd", type=int, required=True, help="this end of the socket pair")
    args = parser.parse_args(argv)
    # The front end owns shutdown: it drains, then closes the pipe, which ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("TRIO_INFER_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s worker %(name)s: %(message)s",
    )
    sock = socket.socket(fileno=args.fd)
    settings = _read_settings(sock)
    try:
        from trio_infer.runtime.loading import build_engine

        engine = build_engine(settings)
    except Exception as exc:
        log.exception("the worker could not load the model")
        sock.sendall(encode([Fatal(f"could not load the model: {exc}")]))
        return 1
    try:
        serve(sock, WorkerCore(engine))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the front end is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
