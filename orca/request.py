"""The per-request state the scheduler and the engine share."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from orca.sampling_params import SamplingParams


class Phase(enum.Enum):
    """Orca's request states (§4.2). RUNNING is a flag on top of these, since a request in flight is
    still in one of the two phases."""

    INITIATION = "initiation"  # not yet scheduled: its next iteration processes the whole prompt
    INCREMENT = "increment"  # its next iteration processes the one token it generated last


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
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    seed: int
    arrival_time: float = 0.0
    phase: Phase = Phase.INITIATION
    running: bool = False
    reserved: bool = False  # holds a K/V reservation of max_tokens slots
    num_computed_tokens: int = 0  # tokens whose keys and values are in the K/V cache
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    aborted: bool = False  # abort arrived while the request was in flight; finish it when it returns
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        """Orca's max_tokens: the K/V slots the request may ever need (prompt + maximum new tokens)."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_input_ids(self) -> list[int]:
        """Tokens the next iteration feeds: the whole prompt in initiation, the last new token after."""
        if self.num_computed_tokens == 0:
            return self.prompt_token_ids
        return self.output_token_ids[-1:]
