"""The engine: requests in, one iteration at a time, tokens out.

``LLMEngine`` is single-threaded and synchronous: ``add_request`` and ``abort_request`` change the request
pool, ``step`` runs exactly one iteration (Algorithm 1's select, run, return) and reports what happened to
every request it touched. The offline ``LLM`` drives it in a loop; ``EngineLoop`` (engine_loop.py) drives
it from a background thread for the Triton model.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from orca.config import EngineConfig, ModelConfig
from orca.detokenizer import IncrementalDetokenizer
from orca.kv_cache import KVSlotManager
from orca.loader import load_model, load_tokenizer, resolve_checkpoint
from orca.model_runner import ModelRunner
from orca.request import FinishReason, Request
from orca.sampling_params import SamplingParams
from orca.scheduler import OrcaScheduler

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (EngineConfig.max_queue): retry later."""


@dataclass
class RequestOutput:
    """What one iteration did to one request (or, when finished, the final state)."""

    request_id: str
    new_token_ids: list[int]  # generated in this iteration (empty on cancellation or error)
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


@dataclass
class IterationStats:
    """What the last iteration did, for metrics and benchmarks."""

    batch_size: int = 0
    num_tokens: int = 0
    num_initiation: int = 0
    duration: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        if config.n_workers != 1:
            raise ValueError("n_workers > 1 needs pipeline parallelism, which this engine does not have yet")
        self.config = config
        self.device = config.torch_device
        self.checkpoint = resolve_checkpoint(config.model)
        model, self.model_config = load_model(self.checkpoint, config.torch_dtype, self.device)
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.runner = ModelRunner(model, self.model_config, config.torch_dtype, self.device)
        mc: ModelConfig = self.model_config
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context ({mc.max_position_embeddings})"
            )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        n_slots = config.n_slots or self.runner.kv_layout.slots_for_budget(config.kv_cache_bytes)
        if n_slots < 1:
            raise ValueError(
                f"kv_cache_bytes {config.kv_cache_bytes} holds no slot "
                f"({self.runner.kv_layout.bytes_per_slot} bytes each)"
            )
        self.slots = KVSlotManager(n_slots)
        self.scheduler = OrcaScheduler(config.max_bs, self.slots, config.n_workers)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.last_iteration = IterationStats()
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # cancellations decided between iterations

    # -- requests --------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.slots.n_slots

    def validate(self, prompt_token_ids: Any, params: SamplingParams) -> None:
        """Raises ValueError naming what is wrong with a request and the allowed range. Reads only
        immutable configuration, so any thread may call it."""
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
        self.scheduler.add(req)
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
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- the iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one iteration. Returns an output for every request in it, and for requests cancelled
        since the last step. An exception in the model fails this iteration's requests only."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch is None:
            return outputs
        start = time.monotonic()
        try:
            self.runner.allocate(batch.admitted)
            next_ids: list[int] | None = self.runner.execute(batch.requests)
        except Exception as exc:  # noqa: BLE001 - one bad iteration must not stop the server
            logger.exception("iteration %d failed", batch.batch_id)
            next_ids = None
            for req in batch.requests:
                req.finish_reason, req.error = FinishReason.ERROR, f"{type(exc).__name__}: {exc}"
        now = time.monotonic()
        deltas: list[tuple[list[int], str]] = []
        for i, req in enumerate(batch.requests):
            new: list[int] = []
            delta = ""
            if next_ids is not None:
                token = next_ids[i]
                new = [token]
                req.output_token_ids.append(token)
                if req.first_token_time is None:
                    req.first_token_time = now
                delta = self._check_stop(req, token)
            deltas.append((new, delta))
        finished = self.scheduler.complete(batch)
        for req in finished:
            self._finish(req, now)
        outputs.extend(self._output(req, new, delta) for req, (new, delta) in zip(batch.requests, deltas))
        self.last_iteration = IterationStats(
            batch_size=len(batch.requests),
            num_tokens=sum(len(r.prompt_token_ids) if r in batch.admitted else 1 for r in batch.requests),
            num_initiation=len(batch.admitted),
            duration=now - start,
        )
        return outputs

    def _check_stop(self, req: Request, token: int) -> str:
        """Sets finish_reason when the request must stop; returns its new text."""
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            req.finish_reason = FinishReason.STOP
        elif len(req.output_token_ids) >= p.max_tokens:
            req.finish_reason = FinishReason.LENGTH
        detok = self._detokenizers.get(req.request_id)
        if detok is None:
            return ""
        delta = detok.add(token, final=req.finished)
        if detok.stopped:  # a stop string outranks max_tokens, even when the last allowed token completed it
            req.finish_reason = FinishReason.STOP
        return delta

    def _finish(self, req: Request, now: float) -> None:
        self.runner.free(req.request_id)
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
