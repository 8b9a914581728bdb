"""The engine (the driver): requests in, one iteration at a time, tokens out.

``LLMEngine`` is single-threaded and synchronous: ``add_request`` and ``abort_request`` change the request
pool, ``step`` runs one iteration and reports what happened to every request it touched:

    schedule (OrcaScheduler: which requests, how many tokens each, which K/V blocks)
      -> plan (plain data: StepPlan) -> submit to the executor's workers (up to n_workers in flight)
      -> collect the oldest StepResult -> complete (append tokens, stop rules, free K/V blocks, outputs)

The engine alone mutates Request objects; workers see plans. It knows nothing of tensors (the workers
own the device) and nothing of Triton. With ``EngineConfig.trace`` set it records the iteration timeline
(orca/timeline.py) through ``self.timeline``; off (None), each hook costs one ``is not None`` check.
The offline ``LLM`` drives it in a loop; ``EngineLoop`` (engine_loop.py) drives it from a background
thread for the Triton model.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from orca.block_manager import BlockManager
from orca.config import EngineConfig, ModelConfig
from orca.detokenizer import IncrementalDetokenizer
from orca.executor import Executor, InProcessExecutor, WorkerFailure
from orca.loader import load_tokenizer, read_model_config, resolve_checkpoint
from orca.plan import PlannedRequest, SamplingSpec, StepPlan, StepResult, TokenLogprobs
from orca.request import FinishReason, Logprob, Request
from orca.sampling_params import SamplingParams
from orca.scheduler import OrcaScheduler, ScheduledBatch
from orca.stopping import apply_stop_rules
from orca.timeline import TimelineRecorder

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (EngineConfig.max_queue): retry later."""


class EngineFailedError(RuntimeError):
    """The engine's workers failed (died, hung, or an iteration raised in a worker process): it serves no
    more requests. Its message says what happened."""


@dataclass
class RequestOutput:
    """What one iteration did to one request (or, when finished, the final state)."""

    request_id: str
    new_token_ids: list[int]  # generated in this iteration (empty on cancellation, error or a prompt chunk)
    token_ids: list[int]  # all generated so far
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None = None  # "length", "stop", "cancelled" or "error" once finished
    error: str | None = None
    text_delta: str | None = None  # new completion text (None when the model has no tokenizer)
    text: str | None = None  # the completion text so far
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    logits: Any = None  # the (V,) float32 row this iteration sampled from, when logits capture is on
    # SamplingParams.logprobs set (else None): for each of new_token_ids {token id: Logprob}, the drawn
    # token first, then the top n; logprobs for all of token_ids; cumulative_logprob is their sum so far
    new_logprobs: list[dict[int, Logprob]] | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class IterationStats:
    """What the last completed iteration did, for metrics and benchmarks."""

    batch_id: int = -1  # the plan's id (StepPlan.batch_id)
    batch_size: int = 0
    num_tokens: int = 0
    num_initiation: int = 0  # members feeding prompt tokens (a whole prompt, a chunk, or a recomputation)
    num_preempted: int = 0  # requests preempted by this iteration's selection
    duration: float = 0.0  # submit to collect
    kv_used_tokens: int = 0  # after the iteration, before finished requests free their blocks
    kv_allocated_blocks: int = 0  # same moment
    timings: dict[str, float] = field(default_factory=dict)  # per phase, when profiling is on


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state."""

    running: int = 0  # admitted requests (holding K/V blocks)
    waiting: int = 0  # requests not admitted (new or preempted)
    kv_total_blocks: int = 0
    kv_allocated_blocks: int = 0
    kv_used_tokens: int = 0  # tokens whose keys and values the pool holds
    block_size: int = 0
    preemptions: int = 0  # cumulative

    @property
    def n_slots(self) -> int:
        return self.kv_total_blocks * self.block_size

    @property
    def kv_allocated_slots(self) -> int:
        return self.kv_allocated_blocks * self.block_size


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None) -> None:
        """`executor` replaces the default worker(s) (it must serve this config's model): the in-process
        worker, or worker processes when tensor or pipeline parallelism is on (orca/distributed.py)."""
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
        self.tokenizer = load_tokenizer(self.checkpoint)
        if executor is None:
            pp = config.pipeline_parallel_size
            if config.batches_in_flight > pp:
                raise ValueError(
                    f"n_workers {config.batches_in_flight} exceeds pipeline_parallel_size {pp}: a batch in flight "
                    f"needs a pipeline stage of its own, so n_workers must be in [1, {pp}]"
                )
            if config.distributed:
                from orca.distributed import DistributedExecutor

                executor = DistributedExecutor(config)
            else:
                executor = InProcessExecutor(config)
        self.executor: Executor = executor
        n_workers = config.batches_in_flight
        if n_workers > self.executor.max_in_flight:
            self.executor.shutdown()
            raise ValueError(
                f"n_workers {n_workers} exceeds the {self.executor.max_in_flight} batches this executor "
                f"can keep in flight (one per pipeline stage)"
            )
        self.blocks = BlockManager(self.executor.num_blocks, config.block_size)
        self.scheduler = OrcaScheduler(
            config.max_bs, self.blocks, n_workers, config.kv_admission, config.max_num_batched_tokens
        )
        self.failed: str | None = None  # why the workers failed (EngineFailedError), once they have
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.last_iteration = IterationStats()
        self.profile = False  # time each iteration's phases (IterationStats.timings); costs device syncs
        self.capture_logits = False  # attach each sampled row's logits to RequestOutput.logits
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # cancellations decided between iterations
        self._in_flight: deque[tuple[ScheduledBatch, float]] = deque()
        self._worker_holds: set[str] = set()  # requests whose state the workers keep
        self._to_free: list[str] = []  # ... and must drop before the next plan
        # The iteration timeline (orca/timeline.py): None = off, and every hook below is skipped.
        self.timeline: TimelineRecorder | None = None
        if config.trace:
            self.timeline = TimelineRecorder(
                config.trace, config.trace_max_bytes, config.trace_backups,
                model=str(self.checkpoint), max_bs=config.max_bs, block_size=self.blocks.block_size,
                kv_total_blocks=self.blocks.num_blocks, kv_admission=config.kv_admission,
                max_num_batched_tokens=config.max_num_batched_tokens, n_workers=n_workers,
            )

    # -- requests --------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.blocks.n_slots

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def validate(self, prompt_token_ids: Any, params: SamplingParams) -> None:
        """Raises ValueError naming what is wrong with a request and the allowed range (EngineFailedError
        once the engine has failed). Reads only immutable configuration, so any thread may call it."""
        if self.failed is not None:
            raise EngineFailedError(f"the engine has failed and serves no more requests: {self.failed}")
        vocab = self.model_config.vocab_size
        if not isinstance(prompt_token_ids, (list, tuple)) or len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is out of range: ids must be integers in [0, {vocab - 1}]")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; the context holds {self.max_model_len}, so a prompt may have "
                f"at most {self.max_model_len - 1}"
            )
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens {params.max_tokens} is too large: prompt ({n} tokens) + max_tokens must be <= "
                f"{self.max_model_len}, so max_tokens must be in [1, {self.max_model_len - n}]"
            )
        if n >= self.n_slots:
            raise ValueError(
                f"the prompt has {n} tokens; the K/V cache holds {self.n_slots} slots, so a prompt may have at "
                f"most {self.n_slots - 1}"
            )
        if n + params.max_tokens > self.n_slots:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the K/V cache of "
                f"{self.n_slots} slots: max_tokens must be in [1, {self.n_slots - n}]"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none: use stop_token_ids")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        self.validate(prompt_token_ids, params)
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
        )
        if params.logprobs is not None:
            req.logprobs, req.cumulative_logprob = [], 0.0
        self.scheduler.add(req)
        if self.timeline is not None:
            self.timeline.arrival(req, time.monotonic())
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)

    def abort_request(self, request_id: str) -> bool:
        """Aborts a request; its final output ("cancelled") comes from the next step(). False if unknown."""
        if request_id not in self.scheduler:
            return False
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._finish(req, time.monotonic())
            self._pending.append(self._output(req, [], ""))
            if self.timeline is not None:
                self.timeline.finish(req, req.finish_time or 0.0)
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
        )

    # -- the iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one iteration. Returns an output for every request in it, and for requests cancelled
        since the last step. A failed iteration fails its own requests only."""
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
        return outputs

    def _fail(self, message: str) -> list[RequestOutput]:
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
            outputs.append(self._output(req, [], ""))
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
            planned.append(PlannedRequest(
                request_id=req.request_id,
                token_ids=tuple(req.token_ids(m.start, m.num_tokens)),
                start=m.start,
                new_block_ids=tuple(m.new_blocks),
                sampling=sampling,
                sample_step=len(req.output_token_ids) if m.sample else None,
            ))
        free, self._to_free = tuple(self._to_free), []
        return StepPlan(batch.batch_id, tuple(planned), free, self.capture_logits, self.profile)

    def _complete(self, batch: ScheduledBatch, result: StepResult, start: float) -> list[RequestOutput]:
        now = time.monotonic()
        deltas: list[tuple[list[int], str, Any]] = []
        for m in batch.members:
            req = m.request
            new: list[int] = []
            delta = ""
            if result.error is not None:
                req.finish_reason, req.error = FinishReason.ERROR, result.error
            elif m.sample:
                token = result.sampled[req.request_id]
                new = [token]
                req.output_token_ids.append(token)
                if req.logprobs is not None:
                    _append_logprobs(req, result.logprobs[req.request_id])
                if req.first_token_time is None:
                    req.first_token_time = now
                reason, delta = apply_stop_rules(
                    token, len(req.output_token_ids), req.params, self.eos_token_ids,
                    self._detokenizers.get(req.request_id),
                )
                if reason is not None:
                    req.finish_reason = reason
            deltas.append((new, delta, result.logits.get(req.request_id)))
        used_tokens = self.scheduler.kv_used_tokens
        used_tokens += sum(m.num_tokens for m in batch.members if m.request.admitted)
        allocated = self.blocks.num_allocated_blocks
        finished = self.scheduler.complete(batch)
        for req in finished:
            self._finish(req, now)
        if self.timeline is not None:
            self.timeline.completed(batch.batch_id, now, finished, allocated, used_tokens, result.error)
        outputs = []
        for m, (new, delta, logits) in zip(batch.members, deltas):
            out = self._output(m.request, new, delta)
            out.logits = logits
            outputs.append(out)
        self.last_iteration = IterationStats(
            batch_id=batch.batch_id,
            batch_size=len(batch.members),
            num_tokens=batch.num_tokens,
            num_initiation=sum(1 for m in batch.members if not m.increment),
            num_preempted=len(batch.preempted),
            duration=now - start,
            kv_used_tokens=used_tokens,
            kv_allocated_blocks=allocated,
            timings=dict(result.timings),
        )
        return outputs

    def _release_worker_state(self, request_id: str) -> None:
        if request_id in self._worker_holds:
            self._worker_holds.discard(request_id)
            self._to_free.append(request_id)

    def _finish(self, req: Request, now: float) -> None:
        self._release_worker_state(req.request_id)
        req.finish_time = now

    def _output(self, req: Request, new: list[int], delta: str) -> RequestOutput:
        detok = self._detokenizers.get(req.request_id)
        if req.finished:
            self._detokenizers.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new,
            token_ids=list(req.output_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            finished=req.finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            error=req.error,
            text_delta=None if detok is None else delta,
            text=None if detok is None else detok.text[: detok.emitted],
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            new_logprobs=None if req.logprobs is None else req.logprobs[len(req.logprobs) - len(new):],
            logprobs=None if req.logprobs is None else list(req.logprobs),
            cumulative_logprob=req.cumulative_logprob,
        )

    # -- text ------------------------------------------------------------------------------------
    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                f"this model ({self.checkpoint}) has no tokenizer: send input_ids instead of text"
            )
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._require_tokenizer().encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self._require_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: send text_input instead of messages")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self._require_tokenizer().decode(
            token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.timeline is not None:
            self.timeline.close()


def _append_logprobs(req: Request, t: TokenLogprobs) -> None:
    """Records a drawn token's log-probabilities (vLLM's layout: the drawn token, then the top n)."""
    entry = {t.token_id: Logprob(t.logprob, t.rank)}
    for rank, (token_id, logprob) in enumerate(zip(t.top_ids, t.top_logprobs), start=1):
        entry.setdefault(token_id, Logprob(logprob, rank))
    assert req.logprobs is not None and req.cumulative_logprob is not None
    req.logprobs.append(entry)
    req.cumulative_logprob += t.logprob
