"""All configuration, from ``TRIO_INFER_*`` environment variables or CLI flags (same names).

Every knob has one default and one check. The engine's knobs (page size, KV cache, batch limits)
take their defaults from :class:`~trio_infer.engine.config.EngineConfig` and are checked by
building one (``Settings.engine_config``, the one place settings become an engine
configuration). How the processes of ``serve --api-workers`` find each other (a listening
socket, the worker's address) is no setting: see :class:`Wiring`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trio_infer.engine.config import DEFAULT as _ENGINE
from trio_infer.engine.config import EngineConfig, KVCacheDType, SpeculativeMethod


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRIO_INFER_", extra="forbid")

    # -- model --------------------------------------------------------------------------------
    model: str | None = Field(
        None,
        description="Model folder, .gguf file, hub id in the local Hugging Face cache, "
        "'trio-infer-tiny' (tiny random model built locally: instant steps, noise for text) or "
        "'fake'. Unset: SmolLM2-135M-Instruct (Q4_1 GGUF that `make venv` fetches into "
        "cache_dir/models).",
    )
    served_model_name: str | None = Field(
        None,
        description="Model id for the API. Unset: 'smollm2-135m-instruct' for the default model, "
        "else the folder name, hub id or GGUF file stem.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", description="'auto' (cuda if available), 'cpu' or 'cuda'.")
    fake_step_ms: float = Field(
        0.0,
        ge=0,
        description="Only with model 'fake': simulated compute per engine step, run in the "
        "worker thread like a real forward pass (benchmarks of the server layer). 0: instant.",
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "trio-infer",
        description="Where the default model is fetched (models/), the tiny model built, and the "
        "tokenizers converted from GGUF files kept (tokenizers/).",
    )

    # -- engine -------------------------------------------------------------------------------
    page_size: int = Field(_ENGINE.page_size, description="Tokens per KV page.")
    kv_cache_mb: int = Field(
        _ENGINE.kv_cache_bytes // 2**20, description="Memory budget for the KV page pool."
    )
    kv_cache_dtype: KVCacheDType = Field(
        _ENGINE.kv_cache_dtype,
        description="Dtype of the KV cache: 'auto' is float16 on the CPU (as llama.cpp; half "
        "the memory of float32, tolerance in docs/kernels.md) and the model's dtype on a GPU; "
        "'q8_0' and 'q4_0' (the CPU kernels' model only, heads of a multiple of 32) are "
        "llama.cpp's quantized caches: 8.5 and 4.5 bits a value, K and V alike (q4_0 is lossy "
        "on small models; tolerances in docs/kernels.md).",
    )
    max_running: int = Field(_ENGINE.max_running, description="Sequences decoded together at most.")
    max_batched_tokens: int = Field(
        _ENGINE.max_batched_tokens, description="Tokens per step (chunked prefill); at least "
        "max_running."
    )
    speculative: SpeculativeMethod = Field(
        _ENGINE.speculative,
        description="Speculative decoding: 'ngram' guesses a sequence's next tokens by prompt "
        "lookup (the tokens that followed the latest earlier occurrence of its last few tokens), "
        "'draft' with a smaller model (speculative_draft_model), and checks them in one forward; greedy output is unchanged, sampled output keeps its "
        "distribution (rejection sampling). A request opts out with \"speculative\": false. "
        "'off': one token per step. 'ngram' by default: its off-switches (wide batches, low "
        "acceptance, verify steps measured slower than plain ones) keep it from costing where "
        "it does not pay (docs/benchmarks.md).",
    )
    speculative_tokens: int = Field(
        _ENGINE.speculative_tokens, description="Speculative decoding: tokens guessed per step "
        "at most (k). With prompt lookup a match that agrees with the sequence for 6 tokens or "
        "more (a copy in progress) drafts all k; a shorter one's draft grows by one after a draft "
        "kept whole and shrinks by one after a cut one.",
    )
    speculative_ngram: int = Field(
        _ENGINE.speculative_ngram, description="Prompt lookup: the longest suffix matched (n); "
        "shorter ones down to speculative_ngram_min are tried when it does not occur.",
    )
    speculative_ngram_min: int = Field(
        _ENGINE.speculative_ngram_min, description="Prompt lookup: the shortest suffix matched "
        "(a one-token match guesses wrong far more often).",
    )
    speculative_max_batch: int = Field(
        _ENGINE.speculative_max_batch, description="Speculative decoding is skipped in a step "
        "with more running sequences than this (a wide batch already reads the weights once "
        "for many tokens).",
    )
    speculative_min_acceptance: float = Field(
        _ENGINE.speculative_min_acceptance, description="A sequence whose running share of "
        "accepted guesses falls below this stops guessing for a few steps.",
    )
    speculative_payoff: bool = Field(
        _ENGINE.speculative_payoff, description="Speculative decoding: measure whether steps "
        "that check guesses emit tokens faster than steps that do not, and stop guessing for "
        "64 steps whenever they are slower (then measure again).",
    )
    speculative_draft_model: str | None = Field(
        None, description="With speculative 'draft': the draft model (a .gguf file or a "
        "checkpoint folder) that guesses the next tokens, run in the batching worker with a KV "
        "cache of its own; it must have the model's vocabulary (refused at startup otherwise). "
        "Only with speculative 'draft'.",
    )
    speculative_draft_kv_mb: int = Field(
        _ENGINE.speculative_draft_kv_bytes // 2**20, description="With speculative 'draft': "
        "memory budget for the draft model's KV page pool; 0: as many pages as the model's "
        "pool (kv_cache_mb), each sized by the draft model.",
    )
    max_waiting: int = Field(
        256, ge=0, description="Sequences the worker has not scheduled yet before new requests "
        "get 429 (with Retry-After)."
    )
    max_waiting_tokens: int | None = Field(
        None, ge=1, description="Prompt tokens of the sequences not scheduled yet before new "
        "requests get 429 (with Retry-After); none by default. A request always gets into an "
        "empty queue."
    )
    max_queue_time_s: float | None = Field(
        None, gt=0, description="A request the worker has not started to prefill this long after "
        "it arrived is refused with 429 (with Retry-After); none by default."
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="Deadline of every request from its arrival (a request's "
        "'timeout' field or X-Request-Timeout header overrides it): then it is aborted, with 504 "
        "or an error event; none by default."
    )
    torch_threads: int = Field(
        0, ge=0, description="torch intra-op threads of the batching worker; 0 = every core. "
        "A narrow decode step (SmolLM2-135M below batch 6) runs on one thread or on all of them, "
        "whichever its measured step times say is faster now (models/step_threads.py). The fake "
        "model runs on one."
    )
    omp_wait_policy: Literal["brief", "passive", "active", "inherit"] = Field(
        "brief",
        description="OpenMP wait policy of the batching worker's threads at a barrier and between "
        "parallel regions (torch and the CPU kernels): 'brief' spins about 10 us, then sleeps "
        "(GOMP_SPINCOUNT=1000: a decode step's ops meet at a barrier hundreds of times a step); "
        "'passive' sleeps at once (a narrow decode step then tries one thread first: "
        "models/step_threads.py); 'active' spins (fastest on cores the worker has to itself, collapses when "
        "they are shared); 'inherit' keeps OMP_WAIT_POLICY and GOMP_SPINCOUNT.",
    )
    keep_gguf_blocks: bool = Field(
        True,
        description="GGUF weights in F16, BF16, Q4_0 to Q8_0, Q4_K, Q5_K or Q6_K stay in their "
        "blocks (4-16 bits a weight, read by the CPU kernels with fp32 math) where those kernels "
        "run (CPU, float32); false: dequantized to dtype at load, as Q2_K, Q3_K and IQ4 are.",
    )
    activations: Literal["exact", "int8"] = Field(
        "exact",
        description="With kept GGUF blocks, how the CPU kernels multiply activations with them: "
        "exact (fp32 math, the same as dequantized weights; the fastest at batch 1 since its "
        "16-row layout) or int8 (every product of every block format rounds them to int8 per 32 "
        "values, as llama.cpp does: the fastest from a few rows on, not exact). The tolerance is "
        "measured in docs/kernels.md.",
    )

    worker_max_restarts: int = Field(
        5, ge=0, description="Restarts of a batching worker that keeps dying before giving up "
        "(the count starts again once a worker stays up worker_restart_window_s).",
    )
    worker_restart_window_s: float = Field(60.0, gt=0)
    worker_restart_delay_s: float = Field(1.0, ge=0, description="Pause before a restart.")
    watchdog_stall_s: float | None = Field(
        10.0, gt=0, description="Forward-progress watchdog: with requests pending and no worker "
        "step for max(this, watchdog_step_factor x the slowest recent step), /health answers 503 "
        "(the worker is stalled) and new requests are refused or, with --data-parallel, sent to "
        "the other workers. None: no watchdog.",
    )
    watchdog_step_factor: float = Field(
        20.0, ge=1, description="The stall bound in slowest recent steps (see watchdog_stall_s).")
    watchdog_restart_s: float | None = Field(
        60.0, gt=0, description="A stalled worker with no step for max(this, 2 x the stall "
        "bound) is killed and restarted: its requests end with an error. None: never.",
    )

    # -- requests -----------------------------------------------------------------------------
    channel_capacity: int = Field(
        64, ge=1, description="Outputs buffered per request before its sequence pauses."
    )
    stall_timeout_s: float = Field(
        30.0, gt=0, description="A paused request whose reader does not catch up is aborted."
    )
    max_n: int = Field(8, ge=1, description="Largest accepted 'n'.")
    stream_interval: int = Field(
        1,
        ge=1,
        description="Streaming: send a choice's text once it has this many new tokens (its first "
        "token and its end at once); 1 = every engine step. Larger values cost less CPU per token.",
    )
    max_body_bytes: int = Field(4 * 2**20, ge=1024)
    api_key: str | None = None
    unknown_fields: Literal["reject", "warn"] = Field(
        "reject",
        description="A request field that neither OpenAI's API nor the vLLM extensions served "
        "here define: 'reject' answers 400 naming it (OpenAI's behaviour); 'warn' logs each "
        "field name once and ignores the field (vLLM's). Fields of OpenAI's API that this server "
        "does not implement are refused either way, unless they ask for nothing.",
    )
    reasoning: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Reasoning models: 'auto' splits <think>...</think> text out of the answer "
        "into reasoning_content when the chat template thinks (it writes <think> and the "
        "tokenizer has both tags as tokens: Qwen3 and kin); 'on' always; 'off' never (the "
        "thinking stays in the content).",
    )
    thinking_token_budget: int | None = Field(
        None, ge=0, description="Reasoning models whose think tags are tokens: the most tokens "
        "a request may think before the close tag is made its next token (a request's own "
        "'thinking_token_budget' overrides it). Unset: no limit.",
    )

    hosted_tools: Literal["refuse", "ignore"] = Field(
        "refuse",
        description="OpenAI's hosted tools on /v1/responses (web_search, file_search, "
        "computer_use, code_interpreter, image_generation, mcp), which run on OpenAI's side: "
        "'refuse' answers 400 naming the tool; 'ignore' drops them from the request, and their "
        "earlier calls from the input (logged).",
    )
    responses_store: str = Field(
        "memory",
        description="Where /v1/responses keeps the responses a client may retrieve, delete or "
        "continue with previous_response_id: 'memory' (this process; gone at exit), a file path "
        "(one SQLite file: survives a restart, shared by every front end of api_workers), or "
        "'off' (nothing is kept: 'store': true is refused). With api_workers > 1 and 'memory', the "
        "front ends share a SQLite file in a temporary folder, removed at exit.",
    )
    responses_store_max_count: int = Field(
        10_000, ge=1, description="The most responses the store keeps (least recently used "
        "evicted first).")
    responses_store_max_mb: float = Field(
        256.0, gt=0, description="The most JSON the store keeps, in MiB (least recently used "
        "evicted first).")
    responses_store_max_age_s: float = Field(
        30 * 86400.0, gt=0, description="A stored response older than this is gone (OpenAI keeps "
        "them 30 days).")

    # -- processes ----------------------------------------------------------------------------
    api_workers: int = Field(
        1, ge=1, description="Front-end processes sharing the listening socket, all served by one "
        "batching worker (serve only).",
    )
    data_parallel: int = Field(
        1, ge=1, description="Batching workers, each with its own engine, KV cache (kv_cache_mb "
        "each) and share of the threads, behind the front end; a request is routed by dp_routing "
        "and a worker that dies fails only its own requests (serve only; not with api_workers > 1).",
    )
    dp_routing: Literal["affinity", "round_robin"] = Field(
        "affinity", description="With data_parallel > 1, which worker serves a request: "
        "'affinity' (the worker that was sent the longest prefix of the prompt's full pages, else "
        "the least loaded; runtime/affinity.py) or 'round_robin' (the benchmark's baseline).",
    )

    tensor_parallel: int = Field(
        1, ge=1, description="Ranks of one batching worker under torch.distributed (gloo on the "
        "CPU, NCCL on CUDA): each holds a slice of every layer (its kv heads, intermediate rows, "
        "vocabulary rows) and its own heads' KV cache; rank 0 schedules and broadcasts each step. "
        "At most the model's kv heads; a rank that dies ends and restarts the whole group "
        "(runtime/tp_group.py). Not with data_parallel > 1 or api_workers > 1.",
    )
    dist_init_addr: str | None = Field(
        None, description="With tensor_parallel > 1: host:port of rank 0's TCP rendezvous (node "
        "0 listens there; the other nodes connect). Unset: a free loopback port (one node only).",
    )
    nnodes: int = Field(
        1, ge=1, description="With tensor_parallel > 1: the nodes the ranks are spread over "
        "(tensor_parallel / nnodes each; needs dist_init_addr when > 1).",
    )
    node_rank: int = Field(
        0, ge=0, description="This node's number (< nnodes): node 0 runs the server and rank 0; "
        "another runs only its follower ranks, started again whenever the group ends.",
    )

    # -- server -------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    # Connection limits (slowloris and the like): the timeouts close idle or trickling
    # connections; hypercorn has no cap on their number (README, "Connection limits").
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="A connection that has not sent a complete request line and "
        "headers within this long (since it opened, or since its last response ended) is closed: "
        "idle keep-alive connections and header slowloris alike (hypercorn's keep_alive_timeout; "
        "serve only). It never cuts a request being answered.",
    )
    max_header_bytes: int = Field(
        16 * 1024, ge=1024, description="Largest request line plus headers; a bigger one is "
        "refused (431) and its connection closed (hypercorn's h11_max_incomplete_size and "
        "h2_max_header_list_size; serve only).",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="The whole request body must arrive within this long, else 408 "
        "and the connection is closed (body slowloris; Quart's BODY_TIMEOUT).",
    )
    shutdown_grace_s: float = Field(
        5.0, ge=0, description="On SIGTERM, how long running requests may still finish."
    )

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        self.engine_config()  # the engine's knobs are checked where they are defined
        draft = self.speculative_draft_model
        if (self.speculative == "draft") != (draft is not None):
            raise ValueError("speculative_draft_model goes with speculative='draft', and "
                             "speculative='draft' needs speculative_draft_model")
        if draft is not None and not Path(draft).exists():
            raise ValueError(f"speculative_draft_model {draft!r}: no such file or folder")
        if self.data_parallel > 1 and self.api_workers > 1:
            # One shared worker serves every front end of api_workers; N of them would need the
            # supervisor to route, which it does not.
            raise ValueError("data_parallel > 1 cannot be combined with api_workers > 1: use one "
                             "or the other")
        self._check_tensor_parallel()
        return self

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel
        if tp > 1 and (self.data_parallel > 1 or self.api_workers > 1):
            raise ValueError("tensor_parallel > 1 cannot be combined with data_parallel > 1 or "
                             "api_workers > 1 (not built): use one or the other")
        if tp > 1 and self.speculative == "draft":
            raise ValueError("tensor_parallel > 1 cannot be combined with speculative 'draft' (not "
                             "built: the draft model would run whole on rank 0); 'ngram' works")
        if tp > 1 and self.model == "fake":
            raise ValueError("tensor_parallel > 1 needs a real model, not 'fake'")
        if self.nnodes > 1 and tp == 1:
            raise ValueError("nnodes > 1 needs tensor_parallel > 1")
        if tp % self.nnodes:
            raise ValueError(f"tensor_parallel {tp} is not a multiple of nnodes {self.nnodes}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (node 0's host:port)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not (host and sep and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"dist_init_addr {self.dist_init_addr!r}: expected host:port")

    def engine_config(self) -> EngineConfig:
        """The batching engine's configuration these settings ask for (raises ValueError if it
        is not one)."""
        return EngineConfig(
            page_size=self.page_size,
            kv_cache_bytes=self.kv_cache_mb * 2**20,
            max_running=self.max_running,
            max_batched_tokens=self.max_batched_tokens,
            kv_cache_dtype=self.kv_cache_dtype,
            speculative=self.speculative,
            speculative_tokens=self.speculative_tokens,
            speculative_ngram=self.speculative_ngram,
            speculative_ngram_min=self.speculative_ngram_min,
            speculative_max_batch=self.speculative_max_batch,
            speculative_min_acceptance=self.speculative_min_acceptance,
            speculative_payoff=self.speculative_payoff,
            speculative_draft_kv_bytes=self.speculative_draft_kv_mb * 2**20,
        )

    def worker_threads(self) -> int:
        """The batching worker's torch and kernel threads: ``torch_threads``, or with 0 every
        core. Narrow decode steps (a small model at a small batch) use one of them, leaving the
        rest to the event loop, whose share is a few percent of a core (docs/architecture.md).
        With ``data_parallel`` the workers share this many, and so do the ranks of one node
        with ``tensor_parallel``."""
        return self.torch_threads or (os.cpu_count() or 1)


@dataclass(frozen=True)
class Wiring:
    """How one front end of ``serve --api-workers`` is joined to the others: not a setting (a
    user never sets it), what the supervisor hands each front end it starts (as ``serve``'s
    hidden ``--listen-fd`` and ``--worker-address``). The default is a front end on its own:
    it binds ``host:port`` and starts its own batching worker.
    """

    # Serve on this inherited listening socket (the supervisor's) instead of binding host:port.
    listen_fd: int | None = None
    # Connect to the shared batching worker listening on this Unix socket instead of starting one.
    worker_address: str | None = None
    # How long to wait for that worker to listen (it may still be loading the model).
    worker_connect_timeout_s: float = 600.0

    @property
    def supervised(self) -> bool:
        return self.listen_fd is not None


# The spins of the 'brief' wait policy: libgomp's own estimate is about 100 spins a microsecond,
# so ~10 us before a waiting thread sleeps. At batch 1 on SmolLM2-135M Q4_1, two threads' decode
# step took 5.5-6.4 ms with 1,000 to 50,000 spins alike, 16.7 ms sleeping at once and 10.5 ms on
# one thread (bench offline --threads 2, Zen 3): a barrier is met within microseconds when both threads run,
# so a short spin catches it, and a thread whose partner was descheduled gives its core back soon.
BRIEF_SPIN_COUNT = 1000


def thread_shares(total: int, n: int) -> list[int]:
    """``total`` threads split over ``n`` workers (data-parallel workers, or the tensor-parallel
    ranks of one node) as evenly as possible, at least one each."""
    base, extra = divmod(total, n)
    return [max(1, base + (1 if i < extra else 0)) for i in range(n)]


def worker_environment(settings: Settings) -> dict[str, str]:
    """The environment of a batching worker process: ours, with the OpenMP wait policy the
    settings choose (read once, when an OpenMP library loads in the worker, so it cannot be set
    later). GOMP_SPINCOUNT, where set, overrides libgomp's OMP_WAIT_POLICY, so each policy
    sets or clears both."""
    env = dict(os.environ)
    policy = settings.omp_wait_policy
    if policy == "inherit":
        return env
    env.pop("GOMP_SPINCOUNT", None)
    env.pop("OMP_WAIT_POLICY", None)
    if policy == "brief":
        env["GOMP_SPINCOUNT"] = str(BRIEF_SPIN_COUNT)
    else:
        env["OMP_WAIT_POLICY"] = policy.upper()
    return env
