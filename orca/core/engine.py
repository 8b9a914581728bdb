"""The engine core: token ids in, one iteration at a time, token ids out.

``EngineCore`` is single-threaded and synchronous: ``add_request`` and ``abort_request`` change the request
pool, ``step`` runs one iteration and reports each touched request's delta (``EngineCoreOutput``).

    schedule (OrcaScheduler: which requests, how many tokens each, which K/V blocks)
      -> plan (plain data: StepPlan) -> submit to the executor's workers (up to n_workers in flight)
      -> collect the oldest StepResult -> complete (append tokens, token-level stop rules, free K/V blocks)

It holds no tokenizer, tensors or Triton: text and each request's accumulated output are the front end's
(orca/frontend/output_processor.py), so an iteration's host cost grows with the batch, not with history.
``EngineConfig.trace`` records the iteration timeline (orca/core/timeline.py) through ``self.timeline``.
``LLMEngine`` (orca/frontend/llm_engine.py) wraps it for synchronous callers; ``EngineLoop``
(engine_loop.py) drives it from a background thread for the Triton model.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from typing import Any

from orca.checkpoint import ModelConfig, read_model_config, resolve_checkpoint
from orca.config import EngineConfig, parse_lora_modules
from orca.core.adapters import LoRAAdapters
from orca.core.block_manager import BlockManager
from orca.core.constraint import TokenConstraint
from orca.core.errors import EngineFailedError, QueueFullError, fatal_error
from orca.core.lora import LoRARequest, LoRASlots
from orca.core.outputs import EngineCoreOutput, EngineStats, IterationStats
from orca.core.plan import LoRALoad, PlannedRequest, SamplingSpec, StepPlan, StepResult
from orca.core.request import FinishReason, Request
from orca.core.request_checks import RequestChecks
from orca.core.scheduler import OrcaScheduler, ScheduledBatch, ScheduledRequest
from orca.core.speculative import check_draft_model, make_proposer
from orca.core.timeline import TimelineRecorder
from orca.executor import Executor, WorkerFailure, make_executor
from orca.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore(LoRAAdapters, RequestChecks):
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None) -> None:
        """`executor` replaces the default worker(s) (it must serve this config's model): the in-process
        worker, or worker processes when tensor or pipeline parallelism is on (orca/executor/distributed.py)."""
        config = config or EngineConfig()
        self.config = config
        self.checkpoint = resolve_checkpoint(config.model)
        self.model_config: ModelConfig = read_model_config(self.checkpoint)[0]
        mc = self.model_config
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context ({mc.max_position_embeddings})"
            )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if config.speculative_method == "draft":  # refused before any weight loads
            draft = resolve_checkpoint(config.speculative_model)
            check_draft_model(read_model_config(draft)[0], mc, self.max_model_len, draft)
        n_workers = config.effective_n_workers
        if executor is None:
            pp = config.pipeline_parallel_size
            if n_workers > pp:
                raise ValueError(
                    f"n_workers {n_workers} exceeds pipeline_parallel_size {pp}: a batch in flight "
                    f"needs a pipeline stage of its own, so n_workers must be in [1, {pp}]"
                )
            executor = make_executor(config)
        self.executor: Executor = executor
        if n_workers > self.executor.max_in_flight:
            self.executor.shutdown()
            raise ValueError(
                f"n_workers {n_workers} exceeds the {self.executor.max_in_flight} batches this executor "
                f"can keep in flight (one per pipeline stage)"
            )
        self.blocks = BlockManager(
            self.executor.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        # Multi-LoRA (orca/core/lora.py): the adapters served by name, and the workers' slots.
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None
        self.loras: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        self._lora_removed: list[int] = []  # ids whose host copies the workers may drop (next plan)
        self._lora_added: list[tuple[int, Any]] = []  # (id, adapter read) for the workers to keep (next plan)
        # (adapter, seconds) of each load, for metrics to drain; bounded where nothing does
        self.lora_load_seconds: deque[tuple[str, float]] = deque(maxlen=4096)
        self.scheduler = OrcaScheduler(
            config.max_bs, self.blocks, n_workers, config.kv_admission, config.max_num_batched_tokens,
            config.speculative_disable_by_batch_size, self.lora_slots,
        )
        self.failed: str | None = None  # why the workers failed (EngineFailedError), once they have
        self.consecutive_failures = 0  # iterations in a row whose worker raised (max_consecutive_failures)
        # The model's EOS ids: a request that names none (add_request's eos_token_ids) stops at these.
        self.eos_token_ids: frozenset[int] = frozenset(mc.eos_token_ids)
        self.last_iteration = IterationStats()
        self.profile = False  # time each iteration's phases (IterationStats.timings); costs device syncs
        self.capture_logits = False  # attach each sampled row's logits to EngineCoreOutput.logits (no speculation)
        # Speculative decoding (orca/core/speculative.py): None = off.
        self.proposer = make_proposer(config.speculative_method, config.num_speculative_tokens,
                                      config.prompt_lookup_min, config.prompt_lookup_max)
        self.spec_proposed_tokens = self.spec_accepted_tokens = self.spec_verifications = 0
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self._pending: list[EngineCoreOutput] = []  # cancellations decided between iterations
        self._in_flight: deque[tuple[ScheduledBatch, float]] = deque()
        self._worker_holds: set[str] = set()  # requests whose state the workers keep
        self._to_free: list[str] = []  # ... and must drop before the next plan
        # The iteration timeline (orca/core/timeline.py): None = off, and every hook below is skipped.
        self.timeline: TimelineRecorder | None = None
        if config.trace:
            self.timeline = TimelineRecorder(
                config.trace, config.trace_max_bytes, config.trace_backups,
                model=str(self.checkpoint), max_bs=config.max_bs, block_size=self.blocks.block_size,
                kv_total_blocks=self.blocks.num_blocks, kv_admission=config.kv_admission,
                max_num_batched_tokens=config.max_num_batched_tokens, n_workers=n_workers,
                prefix_caching=config.enable_prefix_caching,
            )

        try:  # the configured adapters, read and checked now, at load: no request waits for their files
            for name, path in parse_lora_modules(config.lora_modules).items():
                self.add_lora(name, path)
        except Exception:
            self.executor.shutdown()
            raise

    # -- requests --------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.blocks.n_slots

    @property
    def block_size(self) -> int:
        return self.blocks.block_size


    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        eos_token_ids: frozenset[int] | None = None,
        cache_salt: str | None = None,
        constraint: TokenConstraint | None = None,
    ) -> None:
        """Adds a request that validate() accepted. `eos_token_ids` are the ids that end it with "stop"
        (unless params.ignore_eos); None = the model's. With prefix caching on, requests share cached K/V
        only with requests of the same `cache_salt` (None: no salt). `constraint`: the compiled structured
        output (params.structured_outputs, compiled by the front end) that masks each token it draws.
        Raises ValueError for an id in use, QueueFullError when the waiting queue is full,
        EngineFailedError once the engine has failed."""
        if self.failed is not None:
            raise EngineFailedError(f"the engine has failed and serves no more requests: {self.failed}")
        if request_id in self.scheduler:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.scheduler.num_waiting >= self.config.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} requests): retry later")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival=next(self._arrivals),
            seed=seed,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids if eos_token_ids is None else eos_token_ids,
            cache_salt=cache_salt,
            constraint=constraint,
            lora=None if params.lora_name is None else self._lora(params.lora_name),
        )
        self.scheduler.add(req)
        if self.timeline is not None:
            self.timeline.arrival(req, time.monotonic())

    def abort_request(self, request_id: str) -> bool:
        """Aborts a request; its final output ("cancelled") comes from the next step(). False if unknown."""
        if request_id not in self.scheduler:
            return False
        req = self.scheduler.abort(request_id)
        if req is not None:
            now = time.monotonic()
            self._finish(req, now)
            self._pending.append(EngineCoreOutput(
                request_id, [], None, req.finish_reason, req.error, now, num_cached_tokens=req.num_cached_tokens
            ))
            if self.timeline is not None:
                self.timeline.finish(req, now)
        return True

    def request_ids(self) -> list[str]:
        """Unfinished requests, in arrival order."""
        return self.scheduler.request_ids()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            running=s.num_running,
            waiting=s.num_waiting,
            kv_total_blocks=self.blocks.num_blocks,
            kv_allocated_blocks=self.blocks.num_allocated_blocks,
            kv_used_tokens=s.kv_used_tokens,
            block_size=self.blocks.block_size,
            preemptions=s.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            prefix_cache_blocks=self.blocks.num_cached_blocks,
            spec_proposed_tokens=self.spec_proposed_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_verifications=self.spec_verifications,
            lora_resident=0 if self.lora_slots is None else len(self.lora_slots.resident),
            lora_active=0 if self.lora_slots is None else self.lora_slots.num_active,
            lora_loads=0 if self.lora_slots is None else self.lora_slots.num_loads,
        )

    # -- the iteration ---------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Runs one iteration. Returns an output for every request in it, and for requests cancelled
        since the last step. A failed iteration fails its own requests only, unless it is the
        max_consecutive_failures-th in a row or its error is fatal by kind (fatal_error): then the engine
        fails (`failed`), every request it holds ends with an error and later ones are refused."""
        outputs, self._pending = self._pending, []
        if self.failed is not None:
            return outputs
        try:
            while self.scheduler.can_schedule():
                batch = self.scheduler.schedule()
                if batch is None:
                    break
                for req in batch.preempted:
                    self._release_worker_state(req.request_id)
                plan = self._plan(batch)
                start = time.monotonic()
                if self.timeline is not None:
                    self.timeline.selected(batch, self.scheduler, self.blocks, start)
                self._in_flight.append((batch, start))
                self.executor.submit(plan)
            if not self._in_flight:
                return outputs
            result = self.executor.collect()
        except WorkerFailure as exc:
            return outputs + self._fail(str(exc))
        batch, start = self._in_flight.popleft()
        if result.batch_id != batch.batch_id:
            raise RuntimeError(f"the executor returned batch {result.batch_id}, expected {batch.batch_id}")
        outputs.extend(self._complete(batch, result, start))
        if result.error is None:
            self.consecutive_failures = 0
            return outputs
        self.consecutive_failures += 1
        limit = self.config.max_consecutive_failures
        if fatal_error(result.error):
            outputs += self._fail(f"a device error in iteration {batch.batch_id}: {result.error}")
        elif self.consecutive_failures >= limit:
            outputs += self._fail(f"{self.consecutive_failures} iterations in a row failed "
                                  f"(max_consecutive_failures {limit}); the last: {result.error}")
        return outputs

    def _fail(self, message: str) -> list[EngineCoreOutput]:
        """The workers are gone: every unfinished request ends with an error; later requests are refused."""
        logger.error("the engine failed: %s", message)
        self.failed = message
        self._in_flight.clear()
        now = time.monotonic()
        outputs = []
        if self.timeline is not None:
            self.timeline.dropped()
        for req in self.scheduler.drop_all():
            req.finish_reason, req.error = FinishReason.ERROR, f"the engine failed: {message}"
            self._finish(req, now)
            outputs.append(EngineCoreOutput(
                req.request_id, [], None, req.finish_reason, req.error, now, num_cached_tokens=req.num_cached_tokens
            ))
            if self.timeline is not None:
                self.timeline.finish(req, now)
        return outputs

    def _plan(self, batch: ScheduledBatch) -> StepPlan:
        planned = []
        for m in batch.members:
            req = m.request
            sampling = None
            if req.request_id not in self._worker_holds:
                p = req.params
                sampling = SamplingSpec(p.temperature, p.top_k, p.top_p, req.seed, p.logprobs)
                self._worker_holds.add(req.request_id)
            proposed = len(m.spec_token_ids)
            to_propose = self._num_to_propose(req, m)
            planned.append(PlannedRequest(
                request_id=req.request_id,
                token_ids=tuple(req.token_ids(m.start, m.num_tokens - proposed)) + tuple(m.spec_token_ids),
                start=m.start,
                new_block_ids=tuple(m.new_blocks),
                sampling=sampling,
                sample_step=len(req.output_token_ids) if m.sample else None,
                allowed_tokens=self._allowed_tokens(req, m) if m.sample and req.constraint is not None else None,
                num_proposed=proposed,
                num_to_propose=to_propose,
                max_tokens=req.params.max_tokens if to_propose else 0,
                lora_slot=-1 if req.lora is None else self.lora_slots.slot(req.lora.lora_id),  # type: ignore[union-attr]
            ))
        free, self._to_free = tuple(self._to_free), []
        loads = tuple(LoRALoad(slot, lora.lora_id, lora.name, lora.path) for slot, lora in batch.lora_loads)
        removed, self._lora_removed = tuple(self._lora_removed), []
        added, self._lora_added = tuple(self._lora_added), []
        return StepPlan(batch.batch_id, tuple(planned), free, self.capture_logits, self.profile, loads, removed,
                        added)

    def _complete(self, batch: ScheduledBatch, result: StepResult, start: float) -> list[EngineCoreOutput]:
        now = time.monotonic()
        outputs: list[EngineCoreOutput] = []
        proposed_total = accepted_total = 0
        for m in batch.members:
            req = m.request
            out = EngineCoreOutput(req.request_id, [], time=now, num_cached_tokens=req.num_cached_tokens)
            if result.error is not None:
                req.finish_reason, req.error = FinishReason.ERROR, result.error
            elif m.sample:
                drawn = result.sampled[req.request_id]
                if m.spec_token_ids:  # speculative decoding: the accepted proposals and the token after them
                    accepted = len(drawn) - 1
                    m.num_rejected = len(m.spec_token_ids) - accepted
                    proposed_total += len(m.spec_token_ids)
                    accepted_total += accepted
                    self.spec_verifications += 1
                    self.proposer.verified(req, len(m.spec_token_ids), accepted)  # type: ignore[union-attr]
                if req.first_token_time is None:
                    req.first_token_time = now
                for token in drawn:  # the stop rules, token by token: a stop inside the run ends it there
                    out.new_token_ids.append(token)
                    req.output_token_ids.append(token)
                    req.finish_reason = req.stop_reason(token)
                    if req.constraint is not None:
                        if not req.constraint.accept(token):  # the mask allowed it: a grammar engine's fault
                            req.finish_reason = FinishReason.ERROR
                            req.error = f"the structured output's grammar refused token {token}, which its mask allowed"
                        elif req.finish_reason is None and req.constraint.is_terminated():
                            req.finish_reason = FinishReason.STOP  # complete: nothing more may follow
                    if req.finish_reason is not None:
                        break
                if req.params.logprobs is not None:
                    out.new_logprobs = result.logprobs[req.request_id][:len(out.new_token_ids)]
                req.spec_token_ids = self._propose(req, result)
            if self.capture_logits:
                out.logits = result.logits.get(req.request_id)
            outputs.append(out)
        used_tokens = self.scheduler.kv_used_tokens
        used_tokens += sum(m.num_tokens - m.num_rejected for m in batch.members if m.request.admitted)
        allocated = self.blocks.num_allocated_blocks
        finished = self.scheduler.complete(batch)  # (an abort that arrived in flight finishes here too)
        for _slot, lora in batch.lora_loads:
            if result.error is not None:  # the slot's contents are unknown: reload it at its next use
                self.lora_slots.forget(lora.lora_id)  # type: ignore[union-attr]
            elif lora.lora_id in result.lora_load_seconds:
                self.lora_load_seconds.append((lora.name, result.lora_load_seconds[lora.lora_id]))
        for req in finished:
            self._finish(req, now)
        if self.timeline is not None:
            accepted = {m.request.request_id: len(m.spec_token_ids) - m.num_rejected
                        for m in batch.members if m.spec_token_ids}
            self.timeline.completed(batch.batch_id, now, finished, allocated, used_tokens, result.error, accepted)
        for m, out in zip(batch.members, outputs):
            out.finish_reason, out.error = m.request.finish_reason, m.request.error
        self.spec_proposed_tokens += proposed_total
        self.spec_accepted_tokens += accepted_total
        self.last_iteration = IterationStats(
            batch_id=batch.batch_id,
            batch_size=len(batch.members),
            num_tokens=batch.num_tokens,
            num_initiation=sum(1 for m in batch.members if not m.increment),
            num_preempted=len(batch.preempted),
            duration=now - start,
            kv_used_tokens=used_tokens,
            kv_allocated_blocks=allocated,
            num_proposed=proposed_total,
            num_accepted=accepted_total,
            timings=dict(result.timings),
        )
        return outputs

    def _num_to_propose(self, req: Request, m: ScheduledRequest) -> int:
        """speculative_method draft: how many tokens the worker drafts for a member after drawing its
        token(s) (an upper bound; _propose takes what the request's length allows). 0 for other methods,
        members that draw nothing, requests that opt out and while logits are captured."""
        if self.proposer is None or not m.sample or not req.params.speculate or self.capture_logits:
            return 0
        return self.proposer.num_to_propose(req, len(m.spec_token_ids))

    def _propose(self, req: Request, result: StepResult) -> list[int]:
        """The tokens the request proposes for its next increment (orca/core/speculative.py): none when
        speculation is off, finished, opted out (SamplingParams.speculate), or while logits are captured.
        The draft method takes what the worker drafted (result.proposals), n-gram looks them up. A
        structured output keeps the proposals its grammar allows, and the bitmask at each position."""
        req.spec_allowed = []
        if (self.proposer is None or req.finish_reason is not None or not req.params.speculate
                or self.capture_logits):
            return []
        proposed = self.proposer.propose(req, result.proposals.get(req.request_id, ()))
        if req.constraint is not None and proposed:
            proposed, req.spec_allowed = _allowed_prefix(req.constraint, proposed)
        return proposed

    @staticmethod
    def _allowed_tokens(req: Request, m: ScheduledRequest) -> tuple[bytes, ...]:
        """A constrained request's bitmasks for this iteration: one per drawn position."""
        if m.spec_token_ids:
            return tuple(req.spec_allowed[: len(m.spec_token_ids) + 1])
        return (req.constraint.allowed_tokens(),)  # type: ignore[union-attr]

    def _release_worker_state(self, request_id: str) -> None:
        if request_id in self._worker_holds:
            self._worker_holds.discard(request_id)
            self._to_free.append(request_id)

    def _finish(self, req: Request, now: float) -> None:
        self._release_worker_state(req.request_id)
        req.finish_time = now

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.timeline is not None:
            self.timeline.close()


def _allowed_prefix(constraint: TokenConstraint, proposed: list[int]) -> tuple[list[int], list[bytes]]:
    """The proposals a structured output's grammar allows in a row (up to the first it refuses, and none
    past one that completes it), and its bitmask at each drawn position: before the first proposal and
    after each kept one. Leaves the grammar's state as it found it."""
    masks = [constraint.allowed_tokens()]
    kept: list[int] = []
    for token in proposed:
        if not constraint.accept(token):
            break
        kept.append(token)
        if constraint.is_terminated():  # nothing may follow it: no draw after it either
            break
        masks.append(constraint.allowed_tokens())
    constraint.rollback(len(kept))
    return kept[: len(masks) - 1], masks
