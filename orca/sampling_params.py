"""Per-request generation options, validated on construction.

The field names follow vLLM's SamplingParams and Triton's vllm_backend ``sampling_parameters`` keys, so a
Triton user can move a request between backends without renaming anything.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass, fields
from typing import Any

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
        _check_int("max_tokens", self.max_tokens, low=1, note="and prompt + max_tokens at most the context")
        _check_number("temperature", self.temperature, ">= 0 (0 = greedy)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {_num(self.temperature)}")
        _check_int("top_k", self.top_k, low=0, high=MAX_INT64, note="0 = off")
        _check_number("top_p", self.top_p, "in (0, 1] (1 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {_num(self.top_p)} (1 = off)")
        if self.seed is not None:
            _check_int("seed", self.seed, low=_SEED_RANGE[0], high=_SEED_RANGE[1], note="or null for a random one")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean (true or false), got {_show(self.ignore_eos)}")
        if not isinstance(self.speculate, bool):
            raise ValueError(f"speculate must be a boolean (true or false), got {_show(self.speculate)}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (0 = the sampled token's only) or null, "
                f"got {_num(self.logprobs)}"
            )
        # Accept lists (JSON gives lists) but store tuples so the object stays hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {_show(stop)}")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {_show(s)}")
            _check_unicode(f"stop[{i}]", s)
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {_show(ids)}")
        for i, token_id in enumerate(ids):
            _check_int(f"stop_token_ids[{i}]", token_id, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        _check_int("n", self.n, low=1, high=MAX_N, note="sequences generated for the prompt")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name.strip()):
            raise ValueError(f"lora_name must be the name of a LoRA adapter the engine serves (a non-empty string) "
                             f"or null for the base model, got {_show(self.lora_name)}")
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
            shown = ", ".join(_key(k) for k in unknown[:5])
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
        raise ValueError(f"{key} must be {_TYPE_NAMES[kind]}, got string {_num(value)} (a string value is converted "
                         f"to the type vLLM declares for {key}, as vllm_backend does)") from None


def _check_unsupported(key: str, value: Any) -> None:
    allowed, why = UNSUPPORTED_VLLM_FIELDS[key]
    if any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
        return
    shown = " or ".join(json.dumps(a) for a in allowed)
    raise ValueError(f"{key} is not supported: {why}; it is accepted only as {shown} (vLLM's default), "
                     f"got {_show(value)}")


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""What a structured output constrains to: a JSON schema, any JSON object, a regex, one of several strings,
or a context-free grammar (EBNF, llama.cpp's GBNF spelling: `root ::= ...`)."""
MAX_STRUCTURED_OUTPUT_CHARS = 200_000
"""The longest JSON schema (and all choices together) a request may give, in characters (OpenAI's structured
outputs allow 120,000 characters of property names, enum and const values in one schema)."""
MAX_REGEX_CHARS = 16_384
"""The longest regex a request may give, in characters."""
MAX_GRAMMAR_CHARS = 65_536
"""The longest EBNF grammar a request may give, in characters (a whole SQL or JSON grammar is 2-10k)."""
MAX_SCHEMA_NODES = 25_000
"""The most JSON values (objects, lists, strings, numbers...) a schema may hold: OpenAI's structured outputs
allow 5,000 properties, each a few values. Bounds the meta-schema check's work with the character cap."""
MAX_SCHEMA_DEPTH = 64
"""The deepest a schema's JSON may nest (OpenAI's structured outputs allow 10 levels of schemas, about 30 of
JSON)."""
MAX_REPETITION = 100_000
"""The largest count a structured output may give: minLength, maxLength, minItems, maxItems, minProperties,
maxProperties, a regex's or grammar's {n,m}, and the product of nested {n,m} in one regex. vLLM and xgrammar
bound none of them (xgrammar 0.2.8 compiles a count as a repeat, not unrolled: [a-z]{0,100000} costs what
{0,1000} does); llama.cpp refuses counts past 2,000 and now reads a larger maximum as unbounded, because
tool schemas in the wild give maxLength 65536 as "long". 100,000 passes those and refuses what no output within
a context window could fill (maxLength 1e9 takes seconds to compile: docs/BENCHMARKS.md, "Results: structured
outputs")."""
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_VALUE_KEYWORDS = ("enum", "const", "default", "examples")  # values, not schemas: a count there is data
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class StructuredOutputs:
    """One request's output constraint, validated in shape here (the front end compiles it and refuses
    what does not compile: orca/frontend/structured_outputs.py).

    kind is one of STRUCTURED_OUTPUT_KINDS; spec its text: the JSON schema as compact JSON (keys in the
    client's order, which is the order generated; equal texts share one compiled grammar), the regex, the
    grammar, or the choices as a JSON list;
    "" for json_object. any_whitespace: JSON may hold any whitespace between tokens (vLLM's default; its
    disable_any_whitespace turns it off, for compact JSON)."""

    kind: str
    spec: str
    any_whitespace: bool = True

    @classmethod
    def parse(cls, value: Any) -> StructuredOutputs:
        """From vLLM's StructuredOutputsParams as JSON: an object (or its JSON text) with exactly one of
        json, json_object, regex, choice, grammar, and optionally disable_any_whitespace."""
        what = "structured_outputs"
        if isinstance(value, str):
            value = json_object(value, what)
        if not isinstance(value, dict):
            raise ValueError(f"{what} must be a JSON object with one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                             f"got {_show(value)}")
        allowed = (*STRUCTURED_OUTPUT_KINDS, "disable_any_whitespace", "backend")
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"unknown {what} key(s) {', '.join(_key(k) for k in unknown[:5])}; allowed: "
                             f"{', '.join(allowed)}")
        given = [k for k in STRUCTURED_OUTPUT_KINDS if value.get(k) not in (None, False)]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(f"{what} must give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {got}")
        backend = value.get("backend")
        if backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"{what}.backend must be \"xgrammar\" or \"auto\" (the one grammar engine served), "
                             f"got {_show(backend)}")
        flag = value.get("disable_any_whitespace", False)
        if not isinstance(flag, bool):
            raise ValueError(f"{what}.disable_any_whitespace must be a boolean, got {_show(flag)}")
        kind = given[0]
        raw = value[kind]
        name = f"{what}.{kind}"
        if kind == "json":
            schema = json_object(raw, name) if isinstance(raw, str) else raw
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{name} must be a JSON schema (an object, or its JSON text), got {_show(schema)}")
            # Compact, keys in the client's order: a grammar generates properties in the schema's order.
            spec = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        elif kind == "json_object":
            if raw is not True:
                raise ValueError(f"{name} must be true (any JSON object), got {_show(raw)}")
            spec = ""
        elif kind == "choice":
            if not isinstance(raw, (list, tuple)) or not raw:
                raise ValueError(f"{name} must be a non-empty list of non-empty strings, got {_show(raw)}")
            for i, c in enumerate(raw):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"{name}[{i}] must be a non-empty string, got {_show(c)}")
                _check_unicode(f"{name}[{i}]", c)
            spec = json.dumps(list(raw), ensure_ascii=False)
        else:  # regex, grammar
            if not isinstance(raw, str) or not raw.strip():
                raise ValueError(f"{name} must be a non-empty string, got {_show(raw)}")
            _check_unicode(name, raw)
            spec = raw
        limit = {"regex": MAX_REGEX_CHARS, "grammar": MAX_GRAMMAR_CHARS}.get(kind, MAX_STRUCTURED_OUTPUT_CHARS)
        if len(spec) > limit:
            raise ValueError(f"{name} is {len(spec)} characters long; at most {limit} allowed")
        if kind == "json":
            check_schema_bounds(schema, name)
        elif kind in ("regex", "grammar"):
            check_repetitions(spec, name, grammar=kind == "grammar")
        return cls(kind, spec, any_whitespace=not flag)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec) if self.kind == "choice" else []

    def to_dict(self) -> dict[str, Any]:
        """vLLM's spelling, which parse() reads back."""
        value: Any = {"json": json.loads(self.spec) if self.kind == "json" else None, "json_object": True,
                      "regex": self.spec, "choice": self.choices, "grammar": self.spec}[self.kind]
        out: dict[str, Any] = {self.kind: value}
        if not self.any_whitespace:
            out["disable_any_whitespace"] = True
        return out


def check_schema_bounds(schema: Any, what: str) -> None:
    """ValueError unless a JSON schema is within MAX_SCHEMA_NODES values, MAX_SCHEMA_DEPTH levels and
    MAX_REPETITION for each count (its keywords and its patterns' {n,m}): one pass over the parsed JSON,
    stopping at the first bound crossed, so it costs at most what the character cap allows and runs before
    the meta-schema check or any compile."""
    nodes = 0
    stack: list[tuple[Any, str, int, bool]] = [(schema, "", 1, False)]  # (value, path, depth, is data)
    while stack:
        value, path, depth, data = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"{what} holds more than {MAX_SCHEMA_NODES} JSON values; at most {MAX_SCHEMA_NODES} "
                             f"allowed")
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels (at {_clipped(path, 80)}); at most "
                             f"{MAX_SCHEMA_DEPTH} allowed")
        if isinstance(value, dict):
            for key, sub in value.items():
                where = f"{path}/{key}"
                if not data:
                    if key in _COUNT_KEYWORDS and isinstance(sub, (int, float)) and not isinstance(sub, bool):
                        _check_count(sub, f"{what}: {key} (at {where})")
                    elif key == "pattern" and isinstance(sub, str):
                        check_repetitions(sub, f"{what}: the pattern at {where}")
                    elif key == "patternProperties" and isinstance(sub, dict):
                        for pattern in sub:
                            check_repetitions(pattern, f"{what}: the pattern {_clipped(pattern)} at {where}")
                stack.append((sub, where, depth + 1, data or key in _VALUE_KEYWORDS))
        elif isinstance(value, list):
            stack.extend((sub, f"{path}/{i}", depth + 1, data) for i, sub in enumerate(value))


def check_repetitions(text: str, what: str, grammar: bool = False) -> None:
    """ValueError when a regex's (or an EBNF grammar's) {n}, {n,} or {n,m} counts past MAX_REPETITION, alone
    or multiplied by the counts inside the group it repeats ("(a{1000}){1000}" asks for a million). Character
    classes, escapes and (in a grammar) quoted strings and comments hold no count; a grammar's rule
    references are not followed. One pass over the text."""
    i, n = 0, len(text)
    inside = [1]  # for each open group (the whole text first): the largest repetition within it so far
    closed = 0  # the largest repetition within the group that just closed, when a count may follow it
    while i < n:
        ch = text[i]
        after_group, closed = closed, 0
        if ch == "\\":
            i += 2
        elif ch == "[":  # a character class, to its closing ] (which may come first, or escaped)
            i += 2 if text[i + 1:i + 2] == "^" else 1
            i += 1 if text[i:i + 1] == "]" else 0
            while i < n and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif grammar and ch in "\"'":
            i += 1
            while i < n and text[i] != ch:
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif grammar and ch == "#":  # a comment, to the line's end
            while i < n and text[i] != "\n":
                i += 1
        elif ch == "(":
            inside.append(1)
            i += 1
        elif ch == ")" and len(inside) > 1:
            closed = inside.pop()
            inside[-1] = max(inside[-1], closed)
            i += 1
        elif ch == "{" and (m := _REPEAT.match(text, i)):
            count = max(int(m.group(1)), int(m.group(2) or 0))
            total = count * max(after_group, 1)
            if count > MAX_REPETITION:
                raise ValueError(f"{what} repeats {count} times ({_clipped(m.group(0))}); counts from 0 to "
                                 f"{MAX_REPETITION} are allowed")
            if total > MAX_REPETITION:
                raise ValueError(f"{what} repeats {total} times ({_clipped(m.group(0))} around a group that repeats "
                                 f"{after_group} times); at most {MAX_REPETITION} repetitions are allowed, nested "
                                 f"counts multiplied")
            inside[-1] = max(inside[-1], total)
            i = m.end()
        else:
            i += 1


def _check_count(value: float, what: str) -> None:
    if value > MAX_REPETITION:
        raise ValueError(f"{what} is {value}; from 0 to {MAX_REPETITION} allowed")


def _clipped(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def json_object(text: str, what: str) -> dict[str, Any]:
    """Parses a JSON object (an empty string is {}); ValueError saying what `what` got wrong."""
    values = json_value(text, what) if text.strip() else {}
    if not isinstance(values, dict):
        raise ValueError(f"{what} must be a JSON object, got {json_type(values)}")
    return values


def json_value(text: str, what: str) -> Any:
    """json.loads, whose every failure (bad syntax, nesting too deep, a number too long for Python) is a
    ValueError naming `what`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply to parse") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's bound on the digits of an int
            raise ValueError(
                f"{what} holds an integer of more than {sys.get_int_max_str_digits()} digits: no field allows one"
            ) from None
        raise ValueError(f"{what} could not be parsed: {exc}") from None


def _key(key: Any) -> str:
    """A key for an error message: as is when plainly printable, else quoted (an empty or blank key)."""
    if isinstance(key, str) and key and key.isprintable() and key.strip() == key:
        return _clip(key, 40)
    return _clip(repr(key), 40)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _num(value: Any) -> str:
    """A value for an error message, clipped (a client may send megabytes): an integer of more than 30
    digits as its digit count, anything else as its repr."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"{'a negative' if value < 0 else 'an'} integer of {len(str(abs(value)))} digits"
    if isinstance(value, str) and len(value) > 80:
        return f"{value[:80]!r}... ({len(value)} characters)"
    return _clip(repr(value))


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for error messages (clients send JSON, not Python)."""
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object"),
                       ((list, tuple), "array")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _show(value: Any) -> str:
    """A value of the wrong type for an error message: its JSON type and (clipped) value."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)  # null, true, false
    return f"{json_type(value)} {_num(value)}"


def _check_unicode(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode: {exc.reason} at character {exc.start}") from None


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None, note: str = "") -> None:
    """ValueError unless value is an int (not a bool) in [low, high]; the message names the range."""
    bounds = " and ".join(b for b in (
        f">= {low}" if low is not None else "", f"<= {high}" if high is not None else "") if b)
    note = f" ({note})" if note else ""
    # bool is an int subclass in Python; `max_tokens: true` is a type error, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer {bounds}{note}, got {_show(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {bounds}{note}, got {_num(value)}")


def _check_number(name: str, value: Any, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number {allowed}, got {_show(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number {allowed}, got {_num(value)}")


__all__ = ["DEFAULT_MAX_TOKENS", "MAX_INT64", "MAX_LOGPROBS", "MAX_STRUCTURED_OUTPUT_CHARS",
           "STRUCTURED_OUTPUT_KINDS", "UNSUPPORTED_VLLM_FIELDS", "VLLM_FIELDS", "VLLM_SAMPLING_PARAMS_COMMIT",
           "VLLM_SCALAR_TYPES", "SamplingParams", "StructuredOutputs", "json_object", "json_type", "json_value"]
