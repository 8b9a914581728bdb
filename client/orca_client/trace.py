"""The Orca evaluation workload (Orca §6): synthetic requests, Poisson arrivals.

Prompt lengths ~ U(a, b) and maximum new tokens ~ U(c, d), both inclusive integers; end-of-sequence is
ignored, so every request generates exactly its maximum; requests arrive as a Poisson process of rate λ
(exponential gaps with mean 1/λ). Prompt token ids are uniform in [low, high): their values do not change
the cost of a request.

Deterministic: everything is drawn from ``random.Random(seed).random()``, whose sequence Python
guarantees across versions and platforms. The gaps are drawn at unit rate and divided by λ, so every rate
of a sweep sends the same requests in the same order with the same arrival pattern, only compressed or
stretched in time; and two models given the same spec get the identical request sequence.

Presets:
- ``paper``: the paper's U(32, 512) prompt tokens and U(1, 128) new tokens.
- ``default``: the paper's lengths divided by 4, U(8, 128) and U(1, 32), 48 requests per rate. The paper
  ran GPT-3 175B on 16 A100s; here SmolLM2-135M runs on 2 CPU cores, where orca_gpt sustains about
  3 requests/s even at quarter lengths (under 1 at the paper's). Quarter lengths keep the paper's shape
  (prompts four times the output, each spread over a 16x range, so request-level batching pays for the
  spread as in the paper) while a two-model sweep of seven rates takes about ten minutes.
- ``offline``: the offline benchmark's 32 requests, U(32, 128) and U(1, 64), all at time 0.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TraceSpec:
    """What to draw. Ranges are inclusive (a, b) pairs, except token_ids: [low, high)."""

    num_requests: int
    prompt_len: tuple[int, int]
    max_new_tokens: tuple[int, int]
    token_ids: tuple[int, int] = (100, 10_000)
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_requests, bool) or not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"num_requests must be an integer >= 1, got {self.num_requests!r}")
        for name in ("prompt_len", "max_new_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range a:b with 1 <= a <= b, got {low}:{high}")
        low, high = self.token_ids
        if not 0 <= low < high:
            raise ValueError(f"token_ids must be a range low:high with 0 <= low < high, got {low}:{high}")

    def with_options(self, **changes: object) -> TraceSpec:
        """A copy with the given fields changed (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS: dict[str, TraceSpec] = {
    "default": TraceSpec(num_requests=48, prompt_len=(8, 128), max_new_tokens=(1, 32)),
    "paper": TraceSpec(num_requests=48, prompt_len=(32, 512), max_new_tokens=(1, 128)),
    "offline": TraceSpec(num_requests=32, prompt_len=(32, 128), max_new_tokens=(1, 64)),
}


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival: float  # seconds after the trace starts
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int


def make_trace(spec: TraceSpec, rate: float | None) -> list[TraceRequest]:
    """The requests of `spec` arriving at `rate` requests per second (None: all at time 0)."""
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    rng = random.Random(spec.seed)
    requests = []
    clock = 0.0
    for index in range(spec.num_requests):
        # Always draw in this order, whatever the rate, so every rate gets the same requests.
        prompt_len = _uniform_int(rng, *spec.prompt_len)
        max_new_tokens = _uniform_int(rng, *spec.max_new_tokens)
        gap = -math.log(1.0 - rng.random())  # Exp(1): the unit-rate Poisson process
        prompt = tuple(_uniform_int(rng, spec.token_ids[0], spec.token_ids[1] - 1) for _ in range(prompt_len))
        if index > 0 and rate is not None:
            clock += gap / rate  # the first request opens the trace at time 0
        requests.append(TraceRequest(index, clock, prompt, max_new_tokens))
    return requests


def _uniform_int(rng: random.Random, low: int, high: int) -> int:
    """Uniform in [low, high] from rng.random() alone (randint's algorithm may change across versions)."""
    return low + min(int(rng.random() * (high - low + 1)), high - low)


def parse_range(text: str) -> tuple[int, int]:
    """'a:b' -> (a, b), for the command line."""
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"expected a range a:b of integers, got {text!r}") from None
    return low, high


__all__ = ["PRESETS", "TraceRequest", "TraceSpec", "make_trace", "parse_range"]
