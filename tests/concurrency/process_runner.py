"""The scenarios through a real batching worker *process*, in real time.

``open_engine(Settings(model="fake", ...))`` starts ``python -m trio_infer.runtime.worker`` on a
socket pair; the worker builds its own :class:`~trio_infer.models.fake.FakeModel` from the
settings (its vocabulary is the fake tokenizer's, see ``runtime/loading.py``). Nothing of the
worker is visible here, so this variant has no :class:`~.runner.ProbeEngine`: its checks
(``process_invariants.py``) are those that need no engine internals: exact outputs from the fake
model's pure next-token function, each request ending once and as its client explains, the
per-uid bound on every read, the stall rule as far as the reader's own clock can tell, and the
front end (sessions, per-uid entries) and the worker's statistics back to idle after each
scenario.

Starting a worker costs seconds (it imports torch and loads the tokenizer), so one worker serves
all the scenarios of a batch, one after the other, and the front end's settings (credits, stall
timeout) are the batch's. The scenarios are drawn from a seeded ``random.Random`` once the worker
has said which vocabulary it serves: the same scenarios on every run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import trio

from trio_infer.metrics import Metrics
from trio_infer.runtime.client import AsyncEngine, open_engine
from trio_infer.runtime.router import RouterStatistics
from trio_infer.settings import Settings

from .runner import Probe, Record, SessionTap, run_client
from .scenario import Choice, Client, Request, continuation

# The front end's settings for a batch: few credits, so readers pause often; a short stall timeout
# (real seconds), so a stall costs little wall time.
CAPACITY = 2
STALL_S = 0.3
# A stalling client sleeps this long: far past the stall timeout, so it is stalled whatever the
# machine's load, unless its request fits in its credits.
STALL_DELAY_S = 4 * STALL_S
# A reader this slow is paused (out of credits) between its reads for most of this time, less than
# the stall timeout: it must not be stalled, but a stall at half the timeout would catch it.
SLOW_NEAR_S = 0.6 * STALL_S
# Real seconds a scenario may take before it counts as a deadlock.
SCENARIO_DEADLINE_S = 30.0
# Real seconds the worker gets to report idle statistics once every client of a scenario is done.
IDLE_WAIT_S = 5.0


@dataclass(frozen=True)
class ProcessScenario:
    label: str
    requests: tuple[Request, ...]


@dataclass
class ProcessRun:
    """One scenario's run on the shared worker."""

    scenario: ProcessScenario
    records: list[Record]
    tap: SessionTap
    ends_before: float  # requests_total before the scenario
    ends_after: float = 0.0
    front_idle: str | None = None  # the front end's state when the last client was done, if not idle
    stats_idle: bool = False  # the worker's statistics came back to idle
    stats: object = None
    wall_s: float = 0.0


@dataclass
class ProcessReport:
    settings: Settings
    vocab: int
    eos: int
    max_model_len: int
    runs: list[ProcessRun] = field(default_factory=list)
    healthy_at_end: bool = False
    startup_s: float = 0.0  # starting the worker process until its hello


def fake_eos(settings: Settings) -> int:
    """The EOS id the worker's fake model uses: the fake tokenizer's ``<|im_end|>`` (read with the
    ``tokenizers`` library, which is quick to import, from the files the worker built)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(settings.cache_dir) / "fake-tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    assert eos is not None
    return eos


KINDS = ("read_all", "slow", "leave", "cancel", "finish", "read_all")


def draw_scenarios(seed: int, count: int, vocab: int, eos: int) -> list[ProcessScenario]:
    """``count`` scenarios of 6-8 requests: every client kind in each; in every other one a
    stalling client and a reader slower than half the stall timeout (each costs a second or two of
    wall time): it must not be stalled, a stall timed too early would catch it)."""
    rng = random.Random(seed)
    out = []
    for s in range(count):
        kinds = list(KINDS) + (["stall", "slow_near"] if s % 2 else [])
        rng.shuffle(kinds)
        reqs = []
        for kind in kinds:
            prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(1, 40)))
            cont = continuation(prompt, 24, vocab, eos)
            choices = []
            # A stalling client's first choice outlasts its credits, so it is stalled.
            for c in range(rng.randint(1, 3) if kind != "slow_near" else 1):
                stop = tuple(rng.sample(cont[:12], rng.randint(0, 2))) if rng.random() < 0.3 else ()
                least = CAPACITY + 2 if kind in ("stall", "slow_near") and c == 0 else 1
                most = 3 * CAPACITY if kind == "slow_near" else 24
                if least > 1:
                    stop = ()
                choices.append(Choice(max_tokens=rng.randint(least, most), stop_token_ids=stop,
                                      ignore_eos=True if least > 1 else rng.random() < 0.7))
            client = {
                "read_all": Client("read_all"),
                "slow": Client("slow", delay=rng.choice([0.01, 0.02, 0.05])),
                "leave": Client("leave", k=rng.randint(1, 4)),
                "cancel": Client("cancel", k=rng.randint(0, 40),
                                 delay=rng.choice([0.0, 0.002, 0.005, 0.01])),
                "finish": Client("finish", k=rng.randint(1, 4), delay=rng.choice([0.0, 0.01])),
                "stall": Client("stall", delay=STALL_DELAY_S),
                "slow_near": Client("slow", delay=SLOW_NEAR_S),
            }[kind]
            reqs.append(Request(prompt, tuple(choices), arrival=rng.choice([0.0, 0.0, 0.01, 0.05]),
                                ticks=rng.randint(0, 20), client=client))
        out.append(ProcessScenario(f"scenario {s} (seed {seed})", tuple(reqs)))
    return out


def requests_ended(metrics: Metrics) -> float:
    return sum(metrics.requests_total.labels(finish_reason=r)._value.get()
               for r in ("stop", "length", "abort", "error"))


def _stats_idle(ae: AsyncEngine) -> bool:
    s = ae.stats
    return s is not None and s.running == 0 and s.waiting == 0 and s.pages_used == s.pages_cached


async def _run_one(ae: AsyncEngine, sc: ProcessScenario) -> ProcessRun:
    probe = Probe()
    tap = SessionTap(ae, probe)
    records = [Record(req) for req in sc.requests]
    run = ProcessRun(sc, records, tap, ends_before=requests_ended(ae.metrics))
    started = trio.current_time()
    try:
        with trio.fail_after(SCENARIO_DEADLINE_S):
            async with trio.open_nursery() as nursery:
                for index, (req, rec) in enumerate(zip(sc.requests, records)):
                    nursery.start_soon(run_client, tap, index, req, rec, nursery.start_soon)
    except trio.TooSlowError:
        waiting = [f"#{i} ({rec.request.client!r}, read {len(rec.reads)})"
                   for i, rec in enumerate(records) if rec.outcome is None]
        raise AssertionError(
            f"{sc.label}: Deadlock: still going after {SCENARIO_DEADLINE_S} s: clients still "
            f"waiting {waiting}; front end: {ae.num_sessions} sessions, live uids "
            f"{ae.live_uids()}, last stats {ae.stats}"
        ) from None
    finally:
        tap.detach()
    # The front end ends a session synchronously: nothing may be left of any request now.
    if ae.statistics() != RouterStatistics():
        run.front_idle = f"{ae.statistics()}, live uids {ae.live_uids()}"
    run.ends_after = requests_ended(ae.metrics)
    # The worker hears of the last aborts asynchronously; its statistics must come back to idle.
    with trio.move_on_after(IDLE_WAIT_S):
        while not _stats_idle(ae):
            await trio.sleep(0.01)
    run.stats_idle, run.stats = _stats_idle(ae), ae.stats
    run.wall_s = trio.current_time() - started
    return run


async def _main(seed: int, count: int, settings: Settings) -> ProcessReport:
    started = trio.current_time()
    async with open_engine(settings) as ae:
        assert ae.info is not None
        report = ProcessReport(settings, ae.info.vocab_size, fake_eos(settings), ae.max_model_len,
                               startup_s=trio.current_time() - started)
        for sc in draw_scenarios(seed, count, report.vocab, report.eos):
            report.runs.append(await _run_one(ae, sc))
        report.healthy_at_end = ae.healthy
    return report


def process_settings(**overrides) -> Settings:
    return Settings(**{
        "model": "fake", "page_size": 4, "kv_cache_mb": 1, "max_running": 4,
        "max_batched_tokens": 16, "channel_capacity": CAPACITY, "stall_timeout_s": STALL_S,
        "worker_max_restarts": 0, **overrides,
    })


def run_process_scenarios(seed: int = 0, count: int = 4, **overrides) -> ProcessReport:
    """``count`` scenarios, one after the other, on one real worker process."""
    return trio.run(_main, seed, count, process_settings(**overrides))
