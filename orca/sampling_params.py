"""Per-request generation options, validated on construction.

The field names follow vLLM's SamplingParams and Triton's vllm_backend ``sampling_parameters`` keys, so a
Triton user can move a request between backends without renaming anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from orca.structured_outputs_params import StructuredOutputs
from orca.validation import (
    check_int,
    check_number,
    check_unicode,
    json_object,
    json_type,
    show_key,
    show_number,
    show_value,
)

DEFAULT_MAX_TOKENS = 16
"""vLLM's default: a request that names no max_tokens gets a short completion, never the whole context."""

MAX_INT64 = 2**63 - 1
"""The largest seed and top_k: both travel to the workers as int64 tensors."""
_SEED_RANGE = (0, MAX_INT64)
MAX_LOGPROBS = 20
MAX_N = 128  # sequences per request (n); OpenAI's API takes at most 128 choices too
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
    was drawn from (before temperature, top-k and top-p; after a structured-output constraint's mask).

    n (vLLM's and OpenAI's): how many sequences to generate for the prompt, in [1, MAX_N]. The engine core
    takes n = 1 only; a front end fans n > 1 out into n requests (orca/frontend/parallel_sampling.py), with
    seeds seed, seed + 1, ... when a seed is given.

    structured_outputs (vLLM's StructuredOutputsParams, vllm_backend's spelling): a StructuredOutputs, or
    its JSON object (or that object's JSON text), constraining the output to a JSON schema, any JSON, a
    regex, one of several strings or a grammar; None = unconstrained.

    speculate (orca's own): false opts this request out of speculative decoding (EngineConfig.
    speculative_method); it changes no token, only whether the request proposes any.

    lora_name (vllm_backend's sampling parameter): the LoRA adapter this request runs with, one of those
    the engine serves (EngineConfig.lora_modules, or added at run time); None = the base model. The engine
    refuses a name it does not serve.
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
    structured_outputs: StructuredOutputs | None = None
    n: int = 1
    speculate: bool = True
    lora_name: str | None = None

    def __post_init__(self) -> None:
        # Every message names the field, what is wrong and the allowed values or range.
        check_int("max_tokens", self.max_tokens, low=1, note="and prompt + max_tokens at most the context")
        check_number("temperature", self.temperature, ">= 0 (0 = greedy)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {show_number(self.temperature)}")
        check_int("top_k", self.top_k, low=0, high=MAX_INT64, note="0 = off")
        check_number("top_p", self.top_p, "in (0, 1] (1 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {show_number(self.top_p)} (1 = off)")
        if self.seed is not None:
            check_int("seed", self.seed, low=_SEED_RANGE[0], high=_SEED_RANGE[1], note="or null for a random one")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean (true or false), got {show_value(self.ignore_eos)}")
        if not isinstance(self.speculate, bool):
            raise ValueError(f"speculate must be a boolean (true or false), got {show_value(self.speculate)}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (0 = the sampled token's only) or null, "
                f"got {show_number(self.logprobs)}"
            )
        # Accept lists (JSON gives lists) but store tuples so the object stays hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {show_value(stop)}")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {show_value(s)}")
            check_unicode(f"stop[{i}]", s)
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {show_value(ids)}")
        for i, token_id in enumerate(ids):
            check_int(f"stop_token_ids[{i}]", token_id, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        check_int("n", self.n, low=1, high=MAX_N, note="sequences generated for the prompt")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name.strip()):
            raise ValueError(f"lora_name must be the name of a LoRA adapter the engine serves (a non-empty string) "
                             f"or null for the base model, got {show_value(self.lora_name)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            object.__setattr__(self, "structured_outputs", StructuredOutputs.parse(self.structured_outputs))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def check_keys(cls, keys: Any, what: str = "sampling parameter") -> None:
        """Keys that are neither a field here nor one of vLLM's SamplingParams (VLLM_FIELDS) are an error
        naming them and the allowed ones, never silently ignored."""
        unknown = sorted(set(keys) - set(cls.field_names()) - set(VLLM_FIELDS) - {"guided_decoding"})
        if unknown:
            shown = ", ".join(show_key(k) for k in unknown[:5])
            if len(unknown) > 5:
                shown += f" (and {len(unknown) - 5} more)"
            raise ValueError(f"unknown {what}(s) {shown}; allowed: {', '.join(cls.field_names())} (and vLLM's other "
                             f"SamplingParams fields at their defaults: {', '.join(UNSUPPORTED_VLLM_FIELDS)})")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Builds from a JSON-like dict with vLLM's SamplingParams keys, as triton-inference-server/
        vllm_backend reads its `sampling_parameters`: a string value of a scalar field is converted to the
        type vLLM declares for it ({"temperature": "0", "max_tokens": "5"}); null stop and stop_token_ids
        and top_k -1 mean off, as in vLLM; the vLLM fields orca does not implement (UNSUPPORTED_VLLM_FIELDS)
        are accepted at their defaults and otherwise refused by name. The constructor takes no strings."""
        if not isinstance(values, dict):
            raise ValueError(f"sampling parameters must be a JSON object, got {json_type(values)}")
        values = dict(values)
        if "guided_decoding" in values:  # vLLM's name before 0.11, which vllm_backend also passes on
            if "structured_outputs" in values:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            values["structured_outputs"] = values.pop("guided_decoding")
        cls.check_keys(values)
        own = cls.field_names()
        for key, value in values.items():
            kind = VLLM_SCALAR_TYPES.get(key, ORCA_SCALAR_TYPES.get(key))
            if isinstance(value, str) and kind is not None:
                # a string that does not convert stays one: the constructor refuses it stating the field's
                # range (a field orca lacks gets _from_string's error)
                values[key] = _from_string(key, value, kind, keep=key in own)
        for key in ("stop", "stop_token_ids"):
            if key in values and values[key] is None:
                del values[key]
        if values.get("top_k") == -1 and not isinstance(values["top_k"], bool):
            values["top_k"] = 0  # vLLM's other spelling of "off"
        for key in [k for k in values if k in UNSUPPORTED_VLLM_FIELDS]:
            _check_unsupported(key, values.pop(key))
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        return cls.from_dict(json_object(text, "sampling_parameters"))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d


VLLM_SAMPLING_PARAMS_COMMIT = "00388f6573ccfcffad607b8c9ecdf341a4669ceb"
"""The vllm-project/vllm commit whose vllm/sampling_params.py the tables below follow."""

VLLM_SCALAR_TYPES: dict[str, type] = {
    "n": int, "best_of": int, "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int, "ignore_eos": bool,
    "max_tokens": int, "min_tokens": int, "logprobs": int, "prompt_logprobs": int, "prompt_logprob_start": int,
    "flat_logprobs": bool, "detokenize": bool, "skip_special_tokens": bool, "spaces_between_special_tokens": bool,
    "include_stop_str_in_output": bool, "stream_interval": int, "skip_clone": bool,
    "output_text_buffer_length": int, "skip_reading_prefix_cache": bool, "thinking_token_budget": int,
    "routed_experts_prompt_start": int,
}
"""The scalar type vLLM's SamplingParams declares for each field (int | None as int): what a string value
converts to, as vllm_backend's TritonSamplingParams.from_dict converts one."""
ORCA_SCALAR_TYPES: dict[str, type] = {"speculate": bool}
"""The same for orca's own scalar fields."""

UNSUPPORTED_VLLM_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "orca returns every one of the n sequences it generates (vLLM V1 has no best_of either)"),
    "presence_penalty": ((0,), "orca's sampler applies no penalties"),
    "frequency_penalty": ((0,), "orca's sampler applies no penalties"),
    "repetition_penalty": ((1,), "orca's sampler applies no penalties"),
    "min_p": ((0,), "orca's sampler has no min-p filter (top_k and top_p are served)"),
    "min_tokens": ((0,), "orca does not hold EOS and stop tokens back"),
    "prompt_logprobs": ((None,), "orca computes no log-probabilities of prompt tokens"),
    "prompt_logprob_token_ids": ((None, []), "orca computes no log-probabilities of prompt tokens"),
    "prompt_logprob_start": ((None,), "orca computes no log-probabilities of prompt tokens"),
    "logprob_token_ids": ((None, []), "orca returns the drawn token's and the top logprobs tokens' only"),
    "flat_logprobs": ((False,), "the logprobs output has one format"),
    "detokenize": ((True,), "orca detokenizes whenever the model has a tokenizer"),
    "skip_special_tokens": ((True,), "orca's text always leaves special tokens out"),
    "spaces_between_special_tokens": ((True,), "orca's text always leaves special tokens out"),
    "include_stop_str_in_output": ((False,), "orca's text always leaves the stop string out"),
    "output_kind": ((None, 0, "CUMULATIVE"), "orca's responses are vllm_backend's: deltas when streaming, else "
                    "the whole text once"),
    "stream_interval": ((None, 1), "orca streams every token the iteration it is generated"),
    "skip_clone": ((False,), "it is vLLM-internal"),
    "output_text_buffer_length": ((0,), "it is vLLM-internal"),
    "logit_bias": ((None, {}), "orca's sampler has no logits processors"),
    "allowed_token_ids": ((None, []), "orca's sampler has no logits processors (structured_outputs can constrain "
                          "the output)"),
    "bad_words": ((None, []), "orca's sampler has no logits processors"),
    "extra_args": ((None, {}), "orca has no sampling plugins"),
    "skip_reading_prefix_cache": ((None, False), "orca's prefix cache is per model (send a cache_salt to keep "
                                  "requests apart)"),
    "thinking_token_budget": ((None, -1), "orca has no reasoning budget"),
    "repetition_detection": ((None,), "orca does not detect repetitions"),
    "routed_experts_prompt_start": ((0,), "orca serves no mixture-of-experts routing data"),
    "trace_decode_token_ids": ((None, []), "orca does not force decoded tokens"),
}
"""vLLM's SamplingParams fields orca does not implement: each is accepted at the values listed (its
default, or another spelling of it), which change nothing, and otherwise refused naming the field and why."""

VLLM_FIELDS = (*SamplingParams.field_names(), *UNSUPPORTED_VLLM_FIELDS)
"""Every key a sampling_parameters object may hold (guided_decoding, structured_outputs' older name, too)."""

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean (true or false)"}


def _from_string(key: str, value: str, kind: type, keep: bool) -> Any:
    """A string value converted to the field's vLLM type (vllm_backend's conversion; a boolean from "true",
    "false", "1" or "0", where vllm_backend's bool() makes every non-empty string true). One that does not
    convert is returned as is with `keep`, else refused."""
    text = value.strip()
    try:
        if kind is bool:
            return {"true": True, "false": False, "1": True, "0": False}[text.lower()]
        return kind(text)
    except (KeyError, ValueError):
        if keep:
            return value
        raise ValueError(f"{key} must be {_TYPE_NAMES[kind]}, got string {show_number(value)} (a string value is "
                         f"converted to the type vLLM declares for {key}, as vllm_backend does)") from None


def _check_unsupported(key: str, value: Any) -> None:
    allowed, why = UNSUPPORTED_VLLM_FIELDS[key]
    if any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
        return
    shown = " or ".join(json.dumps(a) for a in allowed)
    raise ValueError(f"{key} is not supported: {why}; it is accepted only as {shown} (vLLM's default), "
                     f"got {show_value(value)}")



__all__ = ["DEFAULT_MAX_TOKENS", "MAX_INT64", "MAX_LOGPROBS", "UNSUPPORTED_VLLM_FIELDS", "VLLM_FIELDS",
           "VLLM_SAMPLING_PARAMS_COMMIT", "VLLM_SCALAR_TYPES", "SamplingParams"]
