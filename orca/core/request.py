"""A request's state in the engine core. Only the core (engine and scheduler) reads or writes it: workers
see plain StepPlans (orca/core/plan.py), never a Request; the front end sees EngineCoreOutputs. Token ids only:
no text, no accumulated output beyond the ids the next plans need."""

from __future__ import annotations

import enum
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from orca.core.constraint import TokenConstraint
from orca.core.lora import LoRARequest
from orca.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # reached max_tokens
    STOP = "stop"  # EOS, a stop token id or a stop string
    CANCELLED = "cancelled"  # aborted by the client or by shutdown
    ERROR = "error"  # the iteration it was in raised


@dataclass(eq=False)
class Request:
    """One generation request from arrival to completion.

    ``arrival`` is a strictly increasing sequence number: the scheduler's FCFS order, immune to clock ties.
    ``seed`` is always set (drawn at arrival when the client gave none) so sampling is reproducible.

    Its life, in the scheduler's words: waiting (not admitted, holds no K/V block) -> admitted (holds K/V
    blocks; Orca's initiation while prompt tokens remain, increment after) -> finished. A preempted
    request goes back to waiting with its blocks freed and ``num_computed_tokens`` reset: it recomputes
    its prompt and the tokens it already generated when readmitted, and keeps its place in arrival order.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    seed: int
    arrival_time: float = 0.0
    admitted: bool = False  # holds K/V blocks
    running: bool = False  # in a plan in flight: never scheduled twice at once
    num_computed_tokens: int = 0  # tokens whose keys and values are in the K/V pool
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    aborted: bool = False  # abort arrived while the request was in flight; finish it when it returns
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    eos_token_ids: frozenset[int] = frozenset()  # end the request with "stop" unless params.ignore_eos
    cache_salt: str | None = None  # requests share cached K/V only with requests of the same salt
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission
    block_hashes: list[bytes] = field(default_factory=list)  # the hash chain of its full blocks, so far
    constraint: TokenConstraint | None = None  # a structured output's grammar state (orca/core/constraint.py)
    spec_token_ids: list[int] = field(default_factory=list)  # proposed for its next increment (speculative.py)
    spec_allowed: list[bytes] = field(default_factory=list)  # a structured output's bitmask at each of them
    proposer_state: Any = None  # the proposer's own per-request state (orca/core/speculative.py)
    lora: LoRARequest | None = None  # the LoRA adapter it runs with (orca/core/lora.py); None = the base model

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the K/V pool must hold once all are computed."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed before the next one can be sampled: the (rest of the) prompt in initiation,
        1 in increment (the token sampled last), prompt + output after a preemption."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_increment(self) -> bool:
        """Orca's increment phase: admitted, with only its last sampled token left to feed (a prompt's last
        token alone, its final chunk under a token budget, is still initiation)."""
        return self.admitted and bool(self.output_token_ids) and self.num_uncomputed_tokens == 1

    @property
    def max_num_tokens(self) -> int:
        """What the paper calls a request's max_tokens: the K/V slots it may ever need (prompt + the most
        new tokens, SamplingParams.max_tokens)."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self, start: int, count: int) -> list[int]:
        """Tokens [start, start + count) of prompt + output, in O(count)."""
        n_prompt = len(self.prompt_token_ids)
        end = start + count
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def stop_reason(self, token: int) -> FinishReason | None:
        """stop_reason() for `token`, just appended to output_token_ids."""
        return stop_reason(token, len(self.output_token_ids), self.params, self.eos_token_ids)


def stop_reason(
    token: int, num_generated: int, params: SamplingParams, eos_token_ids: Container[int]
) -> FinishReason | None:
    """The token-level stop rules, in one place, for `token`, the `num_generated`-th generated token: a stop
    token id, or EOS unless ignore_eos, gives "stop"; else reaching max_tokens gives "length". The core
    applies them to every sampled token; the request-level baseline (orca/frontend/request_level.py) afterwards, to
    cut each padded member back. Stop strings are text: the front end's (orca/frontend/output_processor.py)."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return FinishReason.STOP
    if num_generated >= params.max_tokens:
        return FinishReason.LENGTH
    return None
