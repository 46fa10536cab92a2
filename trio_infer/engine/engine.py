"""The engine: a pure step function over the scheduler, the KV cache and the model.

One step is three calls, so a server can run the heavy middle one off its event loop::

    plan = engine.schedule()          # cheap, decides the batch, snapshots what the step reads
    result = engine.execute(plan)     # heavy: forward pass and sampling
    outputs = engine.commit(plan, result)

``add_request``, ``abort`` and ``set_ready`` may be called between any two of these calls, also
while ``execute`` runs in another thread: ``execute`` reads only the plan (a snapshot) and
writes only the KV pages the plan owns, and pages are only handed out again by ``schedule``.
A sequence aborted while its step was in flight is simply skipped by ``commit``.
``step()`` does all three, for offline use and tests.

Constrained sequences (``SamplingParams.grammar``) carry their grammar state (engine/grammar.py):
``execute`` starts computing their token masks in a thread before the forward pass and the
sampler applies them; ``commit`` advances each matcher by its token and ends the sequence when
the grammar is complete.

Speculative decoding (``config.speculative``, engine/speculative.py): a sequence that can
speculate gets a :class:`~trio_infer.engine.speculative.Proposer` (prompt lookup, or its state in
the draft model's KV cache: engine/draft.py); the scheduler asks it for a draft, the step
verifies the draft in the same forward, and ``commit`` appends the kept drafts and one more
token, stopping at the first that ends the sequence, all in one output. With a draft model,
``schedule`` reserves the draft's pages and snapshots what it has to read, and ``execute`` runs
the draft model's forwards before the target's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from trio_infer.engine.config import EngineConfig
from trio_infer.engine.draft import DraftModel, DraftWork, draft_work, fill_drafts
from trio_infer.engine.forward_batch import ForwardBatch
from trio_infer.engine.grammar import Grammars, TokenMasks
from trio_infer.engine.kv_cache import KVCache, PagePool, check_kv_dtype, resolve_kv_dtype
from trio_infer.engine.model_runner import ModelRunner, PromptRows
from trio_infer.engine.prefix_cache import PrefixCache
from trio_infer.engine.sampler import SampleResult
from trio_infer.engine.scheduler import Schedule, Scheduler
from trio_infer.engine.sequence import Sequence, Status
from trio_infer.engine.speculative import Drafts, Payoff, PromptLookup, Proposer
from trio_infer.models.base import CausalLM
from trio_infer.wire import EngineStatistics, RequestOutput, SamplingParams

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineStatistics", "RequestOutput", "StepPlan"]


@dataclass
class StepPlan:
    schedule: Schedule
    batch: ForwardBatch
    sampling: list[Sequence] = field(default_factory=list)  # plain sampling sequences, row order
    prompt_rows: PromptRows | None = None  # logits rows after the sampling ones
    drafts: Drafts | None = None  # the sequences that verify a draft this step
    draft_work: list[DraftWork] | None = None  # what the draft model guesses for them, if any


class Engine:
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig = EngineConfig(),
        device: str = "cpu",
        grammars: Grammars | None = None,
        draft_model: CausalLM | None = None,
    ) -> None:
        """``grammars`` compiles the grammars of constrained requests (it needs the tokenizer);
        without it, a request with a grammar is refused. ``draft_model``: the draft model of
        ``speculative="draft"`` (required then, refused otherwise), with the target's vocabulary."""
        info = model.info
        self.model = model
        self.config = config
        self.device = str(device)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, info.dtype, self.device)
        check_kv_dtype(model, kv_dtype)
        num_pages = config.num_pages or max(
            1,
            config.kv_cache_bytes
            // KVCache.bytes_per_page(
                info.num_layers, config.page_size, info.num_kv_heads, info.head_dim, kv_dtype
            ),
        )
        self.kv_cache = KVCache(
            info.num_layers,
            num_pages,
            config.page_size,
            info.num_kv_heads,
            info.head_dim,
            kv_dtype,
            self.device,
        )
        self.pool = PagePool(num_pages)
        # A sequence alone must always fit in the pool, so preemption can always make progress.
        self.max_model_len = min(info.max_model_len, num_pages * config.page_size)
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.prefix_cache = (
            PrefixCache(self.pool, config.page_size) if config.enable_prefix_cache else None
        )
        self.scheduler = Scheduler(
            self.pool,
            config.page_size,
            config.max_running,
            config.max_batched_tokens,
            self.prefix_cache,
            config.speculative_max_batch if config.speculative != "off" else 0,
        )
        self.runner = ModelRunner(model, self.kv_cache, self.device)
        self._draft = self._draft_model(draft_model, num_pages)
        self._seqs: dict[Hashable, Sequence] = {}
        self.grammars = grammars
        self._sample_steps = 0  # sequence-steps that sampled, since start
        self._sampled_tokens = 0  # the tokens they emitted
        self._spec_proposed = 0
        self._spec_accepted = 0
        self._payoff = (Payoff() if config.speculative != "off" and config.speculative_payoff
                        else None)

    def _draft_model(self, model: CausalLM | None, num_pages: int) -> DraftModel | None:
        """The draft model in its own KV cache: ``speculative_draft_kv_bytes`` of pages, or as
        many pages as the target's pool."""
        c = self.config
        if c.speculative != "draft":
            if model is not None:
                raise ValueError(f"a draft model was given, but speculative is {c.speculative!r}, "
                                 "not 'draft'")
            return None
        if model is None:
            raise ValueError("speculative='draft' needs a draft model (speculative_draft_model)")
        if model.info.vocab_size != self.model.info.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {model.info.vocab_size} ids, the model's "
                f"{self.model.info.vocab_size}: speculative_draft_model must share the tokenizer")
        if c.speculative_draft_kv_bytes:
            per_page = DraftModel.bytes_per_page(model, c.page_size, c.kv_cache_dtype, self.device)
            num_pages = max(1, c.speculative_draft_kv_bytes // per_page)
        return DraftModel(model, c.page_size, num_pages, c.kv_cache_dtype, self.device)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, uid: Hashable, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError for input the engine can never serve."""
        if uid in self._seqs:
            raise ValueError(f"request id {uid!r} is already in use")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.info.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len}"
            )
        matcher = None
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("this engine has no tokenizer for constrained decoding")
            matcher = self.grammars.matcher(params.grammar)  # ValueError if it does not compile
        generator = None
        if params.seed is not None:
            # numpy refuses a negative seed, which torch's manual_seed accepted (remapped to a
            # positive one): taken modulo 2**64 (the front end sends seeds in [0, 2**64) already).
            generator = np.random.default_rng(params.seed % 2**64)
        seq = Sequence(
            uid=uid,
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            params=params,
            max_len=self.max_model_len,
            generator=generator,
            matcher=matcher,
        )
        if params.prompt_logprobs is not None:
            seq.prompt_lps = [None]  # the first prompt token has no context
        if params.min_tokens:
            eos = () if params.ignore_eos else sorted(self.eos_token_ids)
            seq.min_tokens_block = tuple(dict.fromkeys([*eos, *params.stop_token_ids]))
        if self._speculates(params):
            seq.proposer = self._proposer()
        self._seqs[uid] = seq
        self.scheduler.add(seq)

    def _proposer(self) -> Proposer:
        c = self.config
        if self._draft is not None:
            return self._draft.proposer(c.speculative_tokens, c.speculative_min_acceptance)
        return PromptLookup(c.speculative_ngram, c.speculative_tokens,
                            c.speculative_min_acceptance, c.speculative_ngram_min)

    def _speculates(self, params: SamplingParams) -> bool:
        """Whether a request with ``params`` speculates: the server does, the request did not opt
        out, and nothing in its sampling reads the tokens before the one being sampled (a
        grammar, penalties, logit_bias, min_tokens, a thinking budget) or needs per-token
        logprobs; a seeded sampled request does not either, so that its tokens still depend
        only on its seed and its logits, not on when the off-switch lets its batch speculate."""
        p = params
        return (self.config.speculative != "off" and p.speculative and p.grammar is None
                and not p.adjusted and p.logprobs is None and not p.min_tokens
                and p.thinking_budget is None and (p.greedy or p.seed is None))

    def abort(self, uid: Hashable) -> bool:
        """Drop a request wherever it is, freeing its pages. False if it is unknown or done."""
        seq = self._seqs.get(uid)
        if seq is None:
            return False
        self._retire(seq, "abort")
        return True

    def take_admitted(self) -> list[Hashable]:
        """The uids scheduled for the first time since the last call (their queue time ended)."""
        return [seq.uid for seq in self.scheduler.take_admitted()]

    def set_ready(self, uid: Hashable, ready: bool) -> None:
        """Pause (False) or resume (True) a request whose reader is behind. Keeps its state."""
        seq = self._seqs.get(uid)
        if seq is not None:
            seq.ready = ready

    # -- stepping -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        if self._payoff is not None:
            self.scheduler.drafting = self._payoff.allows()
        schedule = self.scheduler.schedule()
        if schedule is None:
            return None
        batch, prompt_rows, drafts = self.runner.prepare(schedule)
        sampling = [it.seq for it in schedule.items if it.samples and not it.draft]
        work = None
        if self._draft is not None and drafts is not None:
            work = [draft_work(it.seq, len(it.draft)) for it in schedule.items if it.draft]
        return StepPlan(schedule, batch, sampling, prompt_rows, drafts, work)

    def execute(self, plan: StepPlan) -> SampleResult:
        # The masks of the constrained rows are computed in a thread while the model runs; the
        # sampler waits for them. The thread is joined before this returns, whatever happens.
        masks = TokenMasks.start(self.grammars, [seq.matcher for seq in plan.sampling])
        try:
            t0 = time.perf_counter()
            batch, drafts = plan.batch, plan.drafts
            if plan.draft_work:
                assert self._draft is not None and drafts is not None
                batch, drafts = fill_drafts(batch, drafts, self._draft.run(plan.draft_work))
            result = self.runner.run(batch, plan.sampling, plan.prompt_rows, masks, drafts)
            return dataclasses.replace(result, seconds=time.perf_counter() - t0)
        finally:
            if masks is not None:
                masks.join()  # the sampler waited already, unless the forward pass raised

    def commit(self, plan: StepPlan, result: SampleResult) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        row = 0
        lp_row = 0
        verified = iter(result.verified)
        for it in plan.schedule.items:
            seq = it.seq
            if it.draft:
                tokens = next(verified)
            elif it.samples:
                token, logprob = result.token_ids[row], result.logprobs[row]
                row += 1
            if it.lp_end > it.lp_start:
                lp_first, lp_row = lp_row, lp_row + it.lp_end - it.lp_start
            if seq.status is not Status.RUNNING:
                continue  # aborted while the step ran
            if it.draft:
                outputs.append(self._commit_verified(seq, it.start, it.draft, tokens))
                continue
            seq.num_computed = it.start + it.num_tokens
            self.scheduler.record_computed(seq)
            if it.lp_end > it.lp_start and seq.prompt_lps is not None:
                assert len(seq.prompt_lps) == it.lp_start + 1, "prompt logprob rows out of order"
                seq.prompt_lps.extend(result.prompt_logprobs[lp_first:lp_row])
                seq.lp_next = it.lp_end
            if not it.samples:
                if seq.num_computed == len(seq.token_ids):  # max_tokens == 0: prefilled, done
                    outputs.append(self._finish_unsampled(seq))
                continue
            seq.token_ids.append(token)
            if seq.matcher is not None and not seq.matcher.consume_token(token):
                # Not reachable with the mask applied; the grammar's stop ends the sequence.
                log.warning("grammar rejected token %d of %r: %s", token, seq.uid, seq.matcher.get_error())
            reason, stop_token = self._stop_reason(seq, token)
            if reason is not None:
                self._retire(seq, reason)
            self._sample_steps += 1
            self._sampled_tokens += 1
            prompt_lps = None
            if seq.prompt_lps is not None:  # the first output: hand them over
                prompt_lps, seq.prompt_lps = seq.prompt_lps, None
            outputs.append(
                RequestOutput(
                    uid=seq.uid,
                    token_ids=[token],
                    logprobs=[logprob] if logprob is not None else None,
                    finish_reason=reason,
                    stop_token_id=stop_token,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_tokens or 0,
                    num_output_tokens=seq.num_output_tokens,
                    prompt_logprobs=prompt_lps,
                )
            )
        if self._payoff is not None and all(it.decode_rows for it in plan.schedule.items):
            self._payoff.record(len(plan.schedule.items), result.seconds,
                                sum(len(o.token_ids) for o in outputs), plan.drafts is not None)
        return outputs

    def _commit_verified(
        self, seq: Sequence, start: int, draft: tuple[int, ...], tokens: list[int]
    ) -> RequestOutput:
        """A verify step's result: the kept drafts' keys and values count as computed (the
        rejected ones' are overwritten later), and the tokens are appended one by one up to the
        first that ends the sequence."""
        kept = len(tokens) - 1
        assert seq.proposer is not None
        seq.proposer.record(len(draft), kept)
        self._spec_proposed += len(draft)
        self._spec_accepted += kept
        reason = stop_token = None
        emitted: list[int] = []
        for token in tokens:
            seq.token_ids.append(token)
            emitted.append(token)
            reason, stop_token = self._stop_reason(seq, token)
            if reason is not None:
                break
        # Positions start .. start + kept hold the keys of the tokens there (the last sampled one
        # and the kept drafts); a stop before the end of them cuts the tokens, not the rule.
        seq.num_computed = min(start + 1 + kept, len(seq.token_ids) - 1)
        seq.proposer.keep(seq.num_computed)
        self.scheduler.record_computed(seq)
        if reason is not None:
            self._retire(seq, reason)
        self._sample_steps += 1
        self._sampled_tokens += len(emitted)
        return RequestOutput(
            uid=seq.uid,
            token_ids=emitted,
            logprobs=None,
            finish_reason=reason,
            stop_token_id=stop_token,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=seq.num_output_tokens,
            prompt_logprobs=None,
        )

    def _retire(self, seq: Sequence, reason: str) -> None:
        """The one way a sequence leaves the engine: its pages go back (scheduler), its grammar
        state is dropped, its finish reason set."""
        del self._seqs[seq.uid]
        self.scheduler.remove(seq)
        seq.finish_reason = reason
        seq.matcher = None

    def _finish_unsampled(self, seq: Sequence) -> RequestOutput:
        self._retire(seq, "length")
        prompt_lps, seq.prompt_lps = seq.prompt_lps, None
        return RequestOutput(
            uid=seq.uid,
            token_ids=[],
            logprobs=None,
            finish_reason="length",
            stop_token_id=None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=0,
            prompt_logprobs=prompt_lps,
        )

    def fail(self, plan: StepPlan) -> list[Hashable]:
        """A step raised: drop every request it carried (their KV is suspect). Returns their uids."""
        uids = [it.seq.uid for it in plan.schedule.items if it.seq.uid in self._seqs]
        for uid in uids:
            self.abort(uid)
        return uids

    def step(self) -> list[RequestOutput]:
        plan = self.schedule()
        if plan is None:
            return []
        return self.commit(plan, self.execute(plan))

    # -- introspection --------------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            pages_used=self.pool.num_used,
            pages_cached=self.num_cached_pages,
            pages_total=self.pool.num_pages,
            prefix_queries=self.scheduler.prefix_queries,
            prefix_hits=self.scheduler.prefix_hits,
            sample_steps=self._sample_steps,
            sampled_tokens=self._sampled_tokens,
            spec_proposed=self._spec_proposed,
            spec_accepted=self._spec_accepted,
            draft_pages_used=self._draft.pool.num_used if self._draft else 0,
            draft_pages_total=self._draft.pool.num_pages if self._draft else 0,
        )

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_matchers(self) -> int:
        """Sequences holding grammar state (0 when idle: every exit drops it)."""
        return sum(1 for seq in self._seqs.values() if seq.matcher is not None)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    @property
    def num_draft_pages(self) -> int:
        """Pages of the draft model's pool in use (speculative=draft): 0 when idle, as it keeps
        no prefix cache; 0 without a draft model."""
        return self._draft.pool.num_used if self._draft else 0

    @property
    def num_cached_pages(self) -> int:
        """Pages the prefix cache holds (some may also be in use by running requests)."""
        return self.prefix_cache.num_pages if self.prefix_cache else 0

    @property
    def num_request_pages(self) -> int:
        """Pages in use by requests and not merely kept by the prefix cache: 0 when idle."""
        cache_only = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return self.pool.num_used - cache_only

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop", token
        if seq.matcher is not None and seq.matcher.is_stopped():
            # The grammar is complete (it took EOS, or nothing can follow): ignore_eos or not.
            return "stop", token if token in self.eos_token_ids else None
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if len(seq.token_ids) >= seq.max_len:
            return "length", None
        return None, None
