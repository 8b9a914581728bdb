"""What crosses the boundary between the driver (engine + scheduler) and the workers: plain, picklable
data. No Request objects either way, and no tensors in a plan but, once per adapter, the host copy of a LoRA
adapter newly registered (StepPlan.lora_added: read by the driver, so no worker reads adapter files).

A worker keeps, per request it has seen, its block table and its sampling options; a plan sends only what
changed since: the blocks a request gained, its sampling options the first time (after each admission),
and the ids whose state the worker must drop (finished, aborted, preempted) before it runs the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orca.models.lora import LoRAAdapter


@dataclass(frozen=True)
class SamplingSpec:
    """What a worker needs to draw a request's tokens (orca/worker/sampler.py)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int | None = None  # SamplingParams.logprobs: None = compute none for this request


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probabilities of one drawn token (fp32 log_softmax of the raw logits it was drawn from):
    its own and its rank (1 = the most likely), and the ``top_ids``/``top_logprobs`` of the n most likely
    tokens (n = SamplingSpec.logprobs), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class PlannedRequest:
    """One request's share of an iteration: feed ``token_ids`` at positions ``start``, ``start + 1``, ...
    ``sampling`` is set when the worker has no state for the request yet (its table starts empty);
    ``new_block_ids`` extend its block table (at admission, the table's first ``start // block_size`` blocks
    may be the prefix cache's, holding those positions' keys and values already); ``sample_step`` is the
    index of the output token to draw (None for a prompt chunk that does not reach the prompt's end);
    ``allowed_tokens``, with it, the packed bitmask of the tokens a structured output allows at each
    drawn position (one, or num_proposed + 1)
    (orca/core/constraint.py; None = every token). ``num_proposed`` (speculative decoding,
    orca/core/speculative.py): the last num_proposed of ``token_ids`` are proposed tokens, not yet
    drawn: the worker draws a token at each of the last num_proposed + 1 positions (output steps
    sample_step, sample_step + 1, ...) and answers the draws up to the first that differs from the
    proposal at its position, that one included. ``num_to_propose`` (speculative_method draft): after
    drawing, the worker drafts up to this many tokens to follow the request's last drawn one with its
    draft model (StepResult.proposals), never so many that the request's output would pass
    ``max_tokens`` with them and the token drawn after them. ``lora_slot``: the slot of the LoRA adapter
    the request runs with (orca/core/lora.py), -1 for the base model."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    new_block_ids: tuple[int, ...] = ()
    sampling: SamplingSpec | None = None
    sample_step: int | None = None
    allowed_tokens: tuple[bytes, ...] | None = None
    num_proposed: int = 0
    num_to_propose: int = 0
    max_tokens: int = 0
    lora_slot: int = -1


@dataclass(frozen=True)
class LoRALoad:
    """Put the adapter `lora_id` (named `name`, PEFT files in `path`) into slot `slot` before the plan's
    forward pass (orca/core/lora.py), from the worker's host copy (StepPlan.lora_added): a copy, no read."""

    slot: int
    lora_id: int
    name: str
    path: str


@dataclass(frozen=True)
class StepPlan:
    """One iteration. ``free_request_ids`` are dropped before the plan runs (their blocks may be reused
    by this very plan). ``return_logits`` asks for the float32 logits row of every sampled request.
    ``lora_loads`` are carried out before the forward pass (after the frees, the removals and the
    additions). ``lora_added``: (lora_id, adapter) of each adapter registered since the last plan, its
    host copy as the driver read it (orca/models/lora.py read_adapter), which every worker keeps until the
    adapter is removed; plans run in order on every worker, so it is there before any plan loads it."""

    batch_id: int
    requests: tuple[PlannedRequest, ...]
    free_request_ids: tuple[str, ...] = ()
    return_logits: bool = False
    profile: bool = False  # time the phases (costs a device sync per phase)
    lora_loads: tuple[LoRALoad, ...] = ()
    lora_removed: tuple[int, ...] = ()  # adapters no longer served: the workers drop their host copies
    lora_added: tuple[tuple[int, LoRAAdapter], ...] = ()


@dataclass
class StepResult:
    """A worker's answer to a plan: the tokens drawn for each request with a sample_step (one; with
    proposed tokens, the accepted ones and the token after them), or an error (the whole iteration failed).
    ``logprobs`` holds, for the requests whose SamplingSpec asks for them, the drawn tokens'
    log-probabilities, one per token of ``sampled``. ``logits`` rows are CPU tensors (plan.return_logits
    only: the row of the last token drawn); ``timings`` are seconds per phase when the plan asked for
    profiling. ``proposals``: the tokens the draft model drafted after ``sampled`` for the requests with a
    num_to_propose (speculative_method draft). ``lora_load_seconds``: how long each of the plan's
    lora_loads took (by lora_id; a copy from the worker's host copy)."""

    batch_id: int
    sampled: dict[str, list[int]] = field(default_factory=dict)
    error: str | None = None
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    logits: dict[str, object] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    proposals: dict[str, list[int]] = field(default_factory=dict)
    lora_load_seconds: dict[int, float] = field(default_factory=dict)
