"""Per-request generation options, validated on construction.

The field names follow vLLM's SamplingParams and Triton's vllm_backend ``sampling_parameters`` keys, so a
Triton user can move a request between backends without renaming anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

DEFAULT_MAX_TOKENS = 16
"""vLLM's default: a request that names no max_tokens gets a short completion, never the whole context."""

_SEED_RANGE = (0, 2**63 - 1)
MAX_LOGPROBS = 20
"""The most top alternatives a request may ask for per token (vLLM's default max_logprobs)."""
MIN_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily (as vLLM does): the limit of sampling as temperature -> 0,
without dividing by a number so small that the logits overflow."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below 1e-5) means greedy decoding (top_k/top_p are then ignored). top_k 0 and top_p 1
    disable those filters. seed makes a sampled request reproducible whatever else shares its batch. Generation stops at
    max_tokens ("length"), at the model's EOS unless ignore_eos, at any of stop_token_ids, or when the text
    contains one of the stop strings (those three give "stop").

    logprobs (as vLLM's): None = none; n in [0, 20] = for each new token its log-probability and rank plus
    the n most likely tokens' (0 = the sampled token's only), computed in fp32 from the raw logits the token
    was drawn from (before temperature, top-k and top-p).
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_int("top_k", self.top_k, low=0)
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=_SEED_RANGE[0], high=_SEED_RANGE[1])
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {type(self.ignore_eos).__name__}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (0 = the sampled token's only) or null, "
                f"got {self.logprobs!r}"
            )
        # Accept lists (JSON gives lists) but store tuples so the object stays hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError("stop_token_ids must be a list of integers >= 0")
        for i in ids:
            _check_int("stop_token_ids[]", i, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def check_keys(cls, keys: Any, what: str = "sampling parameter") -> None:
        """Unknown keys are an error naming them and the allowed ones, never silently ignored."""
        unknown = sorted(set(keys) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown {what}(s) {', '.join(unknown)}; allowed: {', '.join(cls.field_names())}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Builds from a JSON-like dict."""
        if not isinstance(values, dict):
            raise ValueError(f"sampling parameters must be a JSON object, got {type(values).__name__}")
        cls.check_keys(values)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        return cls.from_dict(json_object(text, "sampling_parameters"))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return d


def json_object(text: str, what: str) -> dict[str, Any]:
    """Parses a JSON object (an empty string is {}); ValueError saying what `what` got wrong."""
    try:
        values = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(values).__name__}")
    return values


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    # bool is an int subclass in Python; `max_tokens: true` is a type error, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")


__all__ = ["DEFAULT_MAX_TOKENS", "MAX_LOGPROBS", "SamplingParams"]
