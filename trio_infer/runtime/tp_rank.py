"""A follower rank of a tensor-parallel group: ``python -m trio_infer.runtime.tp_rank --rank R``.

Started by rank 0's worker (runtime/tp_group.py) or by ``serve --node-rank k`` on another node,
with the settings as one JSON line on stdin. It loads its slice of the model, joins the group
and runs :func:`~trio_infer.runtime.tp_group.follow` until the group ends. It exits when its
stdin closes (its parent exited: a rank never outlives its group), and with status 1 when a
collective fails (another rank died or hung), which ends its parent's group in turn.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Sequence

log = logging.getLogger("trio_infer.runtime.tp_rank")


def _exit_when_stdin_closes() -> None:
    def watch() -> None:
        while sys.stdin.buffer.read1(1 << 16):
            pass
        log.info("the parent closed the pipe; exiting")
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_infer.runtime.tp_rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s tp-rank-{args.rank} %(name)s: %(message)s",
    )
    # Its parent (the worker, or a node's serve) owns shutdown, as the worker's front end does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    _exit_when_stdin_closes()

    from trio_infer.settings import Settings

    settings = Settings.model_validate_json(line)
    import torch

    from trio_infer.runtime import tp_group
    from trio_infer.runtime.loading import load_shard, resolve_device

    layout = tp_group.Layout.of(settings)
    torch.set_num_threads(tp_group.rank_threads(settings, layout))
    device = tp_group.rank_device(resolve_device(settings), args.rank, layout)
    try:
        model = load_shard(settings, args.rank, layout.size, device)
        control = tp_group.join_group(args.rank, layout, device)
    except Exception:
        log.exception("tensor-parallel rank %d could not start", args.rank)
        logging.shutdown()
        os._exit(1)
    try:
        tp_group.follow(model, control, device)
    except Exception as exc:  # a collective failed: another rank exited (or hung)
        # Also how every group ends when rank 0 exits normally: rank 0 reports abnormal ends.
        log.info("the group ended (%s)", str(exc).splitlines()[0][:300])
        logging.shutdown()
        os._exit(1)  # not a normal exit: gloo's threads may still hold the failed group
    return 0


if __name__ == "__main__":
    sys.exit(main())
