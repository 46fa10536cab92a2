"""``--tensor-parallel N``: one batching worker made of N ranks under torch.distributed.

The worker process (runtime/worker.py) is rank 0. It starts the follower ranks of its node as
child processes (``python -m trio_infer.runtime.tp_rank``), loads its own slice of the model
(:class:`~trio_infer.models.parallel.ShardPlan`), joins them in a process group over a TCP
rendezvous, and wraps its model in :class:`GroupLeader`: every forward first broadcasts the
step's :class:`~trio_infer.engine.forward_batch.ForwardBatch` to the followers, then runs the
rank's slice, whose collectives meet the followers' (the same forward, fed the same batch). The
scheduler, the KV page table, sampling and everything the front end talks to stay on rank 0:
the front end sees one worker (one pipe, one hello), so its restart policy covers the group.

**Two groups.** The step broadcast waits as long as the server is idle, so it runs on a gloo
group with no practical timeout (:data:`IDLE_TIMEOUT`); the forward's collectives run on the
default group (gloo on the CPU, NCCL on CUDA) with :data:`COLLECTIVE_TIMEOUT`, so a rank that
hangs mid-step ends the group instead of hanging it.

**Failure.** A group lives and dies as one. A follower whose parent (rank 0) exits sees its
stdin close and exits; one on another node sees its collective fail and exits. Rank 0 exits with
status 1 when a follower it started exits (a thread waits on each) or a collective fails, so the
front end sees a worker death: the live requests end with the error a worker death gives, and
the front end starts a new worker, which starts a new group. Before the group is joined, a
follower that died is reported as the load's failure (the front end logs it).

**Nodes.** With ``nnodes`` > 1 node ``k`` runs ranks ``k * N / nnodes`` to ``(k + 1) * N /
nnodes - 1``; node 0's worker is rank 0, and ``serve --node-rank k`` on another node runs only
its follower ranks (:func:`serve_followers`), starting them again whenever the group ends.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.settings import Settings, thread_shares, worker_environment

log = logging.getLogger(__name__)

# The forward's collectives: a step of a model that fits a CPU is far shorter; a rank that has
# not answered by then is hung, and the group ends.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# The step broadcast: followers wait in it while the server is idle (a year: no practical bound).
IDLE_TIMEOUT = timedelta(days=365)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the ranks of a group are: how many, on how many nodes, and this node's."""

    size: int
    nnodes: int
    node_rank: int
    init_addr: str  # host:port of rank 0's rendezvous

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def local_ranks(self) -> range:
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    @classmethod
    def of(cls, settings: Settings) -> Layout:
        addr = settings.dist_init_addr or f"127.0.0.1:{_free_port()}"
        return cls(settings.tensor_parallel, settings.nnodes, settings.node_rank, addr)


def rank_threads(settings: Settings, layout: Layout) -> int:
    """A rank's torch and kernel threads: the node's worker threads split over its ranks."""
    return thread_shares(settings.worker_threads(), layout.per_node)[0]


def rank_device(device: str, rank: int, layout: Layout) -> str:
    """On CUDA each rank of a node takes its own GPU (``cuda:<local rank>``)."""
    return f"cuda:{rank % layout.per_node}" if device == "cuda" else device


def join_group(rank: int, layout: Layout, device: str) -> Any:
    """Join the process group (blocks until every rank has); returns the step-broadcast group."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=f"tcp://{layout.init_addr}", rank=rank,
                            world_size=layout.size, timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


class GroupLeader:
    """Rank 0's model: broadcasts each step's batch to the followers, then runs its slice.

    Implements :class:`~trio_infer.models.base.CausalLM`, so the engine does not know it leads
    a group. A collective that fails (a follower died or hung) ends this process: a group with a
    rank missing cannot serve, and the front end restarts the whole group."""

    def __init__(self, model: Any, control: Any, followers: Followers) -> None:
        self.model = model
        self.info = model.info
        self._control = control
        self._followers = followers

    def announce_cache(self, num_pages: int, page_size: int, dtype: str) -> None:
        """Tell the followers the KV pool's geometry (rank 0's engine sized it)."""
        self._broadcast(("kv", (num_pages, page_size, dtype)))

    def forward(self, batch: ForwardBatch, k_caches: list[Any], v_caches: list[Any]) -> Any:
        # The batch is host arrays (numpy): every rank's model moves it to its own device.
        self._broadcast(("step", batch))
        try:
            return self.model.forward(batch, k_caches, v_caches)  # enters inference mode itself
        except Exception as exc:
            # A failed collective, or any error that left this rank's collectives out of step
            # with the others': the group cannot go on (one worker fails only the step's
            # requests; a group restarts).
            _group_failed(exc)
            raise

    def _broadcast(self, message: tuple[str, Any]) -> None:
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([message], src=0, group=self._control)
        except Exception as exc:
            _group_failed(exc)


def _group_failed(exc: BaseException) -> None:
    log.critical("a tensor-parallel collective failed (%s): the group ends", exc)
    logging.shutdown()
    os._exit(1)


class Followers:
    """Follower rank processes this process started, each watched by a thread that calls
    ``on_exit(rank, status)`` when it exits."""

    def __init__(self, procs: dict[int, subprocess.Popen[bytes]],
                 on_exit: Callable[[int, int], None]) -> None:
        self._procs = procs
        self._on_exit = on_exit
        for rank, proc in procs.items():
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}",
                             daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self._on_exit(rank, proc.wait())

    def stop(self) -> None:
        """End every follower still running (closing its stdin is its signal) and reap it."""
        for proc in self._procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class LeaderWatch:
    """Rank 0's view of its followers: one that exits before the group is joined is the load's
    failure (:meth:`joining` raises); one that exits after ends rank 0 (:func:`_group_failed`),
    unless rank 0 itself is exiting (its followers then follow it out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._joining = False
        self._exiting = False
        self._dead: dict[int, int] = {}
        atexit.register(self._exit)

    def _exit(self) -> None:
        with self._lock:
            self._exiting = True

    def on_exit(self, rank: int, status: int) -> None:
        with self._lock:
            self._dead[rank] = status
            joining = self._joining and not self._exiting
        if joining:
            log.critical("tensor-parallel rank %d exited with status %d", rank, status)
            _group_failed(RuntimeError(f"rank {rank} exited"))

    def joining(self) -> None:
        """Raise if a follower has died; from now on a death ends this process."""
        with self._lock:
            self._joining = True
            dead = dict(self._dead)
        if dead:
            rank, status = next(iter(dead.items()))
            raise RuntimeError(f"tensor-parallel rank {rank} exited with status {status} while "
                               "loading (its log says why)")


def start_followers(settings: Settings, layout: Layout, ranks: range,
                    on_exit: Callable[[int, int], None]) -> Followers:
    """Start the follower ranks ``ranks`` of this node: each reads the settings from its stdin
    and exits when that pipe closes (when its parent exits)."""
    procs = {}
    payload = settings.model_copy(update={"dist_init_addr": layout.init_addr}).model_dump_json()
    for rank in ranks:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trio_infer.runtime.tp_rank", "--rank", str(rank),
             "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())],
            stdin=subprocess.PIPE, env=worker_environment(settings))
        assert proc.stdin is not None
        proc.stdin.write(payload.encode() + b"\n")
        proc.stdin.flush()  # kept open: its closing is the follower's signal to exit
        procs[rank] = proc
    return Followers(procs, on_exit)


def build_leader(settings: Settings, layout: Layout, load: Any, device: str) -> GroupLeader:
    """Rank 0: start this node's followers, load rank 0's slice (``load(rank, size, device)``),
    join the group. A model that cannot be split fails here, before the group is joined."""
    watch = LeaderWatch()
    followers = start_followers(settings, layout, range(1, layout.per_node), watch.on_exit)
    model = load(0, layout.size, rank_device(device, 0, layout))
    watch.joining()
    control = join_group(0, layout, rank_device(device, 0, layout))
    log.info("tensor-parallel group of %d ranks joined at %s", layout.size, layout.init_addr)
    return GroupLeader(model, control, followers)


def follow(model: Any, control: Any, device: str) -> None:
    """A follower's loop: receive each step's batch from rank 0 and run this rank's slice on it
    (its collectives meet the other ranks'). It never returns: it ends with its process (its
    parent exited) or raises when a collective fails."""
    import torch.distributed as dist

    from trio_infer.engine.kv_cache import KVCache

    info = model.info
    cache: KVCache | None = None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        kind, payload = box[0]
        if kind == "kv":
            num_pages, page_size, dtype = payload
            cache = KVCache(info.num_layers, num_pages, page_size, info.num_kv_heads,
                            info.head_dim, dtype, device)
        elif kind == "step":
            assert cache is not None, "a step before the KV cache"
            model.forward(payload, cache.k, cache.v)


def serve_followers(settings: Settings) -> int:
    """``serve --nnodes M --node-rank k`` (k > 0): this node's follower ranks, started again
    whenever the group ends (rank 0's worker restarts), until SIGINT/SIGTERM."""
    import signal

    if not settings.dist_init_addr:
        raise ValueError("a node other than node 0 needs dist_init_addr (node 0's host:port)")
    layout = Layout.of(settings)
    stopping = threading.Event()
    wake = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        stopping.set()
        wake.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping.is_set():
        log.info("node %d: starting ranks %s (rendezvous %s)", layout.node_rank,
                 list(layout.local_ranks), layout.init_addr)
        wake.clear()
        followers = start_followers(settings, layout, layout.local_ranks,
                                    lambda rank, status: wake.set())
        wake.wait()
        followers.stop()  # the group is gone when one rank is: end the node's others too
        if not stopping.is_set():
            log.warning("node %d: the group ended; starting its ranks again", layout.node_rank)
            stopping.wait(settings.worker_restart_delay_s)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
