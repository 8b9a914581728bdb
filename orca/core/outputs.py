"""What the engine core reports: each request's delta (EngineCoreOutput), the last iteration
(IterationStats) and a snapshot of its state (EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orca.core.plan import TokenLogprobs
from orca.core.request import FinishReason


@dataclass(slots=True)
class EngineCoreOutput:
    """What one iteration (or an abort, or a failure) did to one request: a delta, O(new tokens).

    ``new_token_ids`` were generated in this iteration (none for a prompt chunk, a cancellation or an
    error); ``new_logprobs`` has their TokenLogprobs when the request asked for logprobs (else None).
    ``finish_reason`` is set on the request's last output; ``time`` is when the iteration completed
    (time.monotonic()); ``logits`` the (V,) float32 row sampled from, when logits capture is on."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    time: float = 0.0
    logits: Any = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the request's first admission

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    num_proposed: int = 0  # speculative decoding: proposed tokens this iteration verified
    num_accepted: int = 0  # ... and of them, accepted
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
    prefix_cache_queries: int = 0  # cumulative: tokens of the requests looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # cumulative: ... and of them, tokens whose K/V the cache held
    prefix_cache_blocks: int = 0  # blocks holding reusable K/V now (referenced or not)
    spec_proposed_tokens: int = 0  # cumulative: speculative decoding's proposed tokens, verified
    spec_accepted_tokens: int = 0  # cumulative: ... and of them, accepted
    spec_verifications: int = 0  # cumulative: request-iterations that verified at least one proposal
    lora_resident: int = 0  # LoRA adapters in the workers' slots now
    lora_active: int = 0  # ... of them, used by admitted requests
    lora_loads: int = 0  # cumulative: adapters put into a slot

    @property
    def n_slots(self) -> int:
        return self.kv_total_blocks * self.block_size

    @property
    def kv_allocated_slots(self) -> int:
        return self.kv_allocated_blocks * self.block_size
