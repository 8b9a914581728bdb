"""A request's structured output (vLLM's StructuredOutputsParams), validated in shape and bounded in size,
nesting and counts before any compile (orca/frontend/structured_outputs.py compiles it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from orca.validation import check_unicode, json_object, show_key, show_value

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
"""The largest count a structured output may give (minLength, maxItems..., a regex's or grammar's {n,m}, and
nested {n,m} multiplied): passes the maxLength 65536 of tool schemas in the wild, refuses counts no context
could fill (which take seconds to compile: docs/BENCHMARKS.md, "Results: structured outputs")."""
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
                             f"got {show_value(value)}")
        allowed = (*STRUCTURED_OUTPUT_KINDS, "disable_any_whitespace", "backend")
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"unknown {what} key(s) {', '.join(show_key(k) for k in unknown[:5])}; allowed: "
                             f"{', '.join(allowed)}")
        given = [k for k in STRUCTURED_OUTPUT_KINDS if value.get(k) not in (None, False)]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(f"{what} must give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {got}")
        backend = value.get("backend")
        if backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"{what}.backend must be \"xgrammar\" or \"auto\" (the one grammar engine served), "
                             f"got {show_value(backend)}")
        flag = value.get("disable_any_whitespace", False)
        if not isinstance(flag, bool):
            raise ValueError(f"{what}.disable_any_whitespace must be a boolean, got {show_value(flag)}")
        kind = given[0]
        raw = value[kind]
        name = f"{what}.{kind}"
        if kind == "json":
            schema = json_object(raw, name) if isinstance(raw, str) else raw
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{name} must be a JSON schema (an object, or its JSON text), "
                                 f"got {show_value(schema)}")
            # Compact, keys in the client's order: a grammar generates properties in the schema's order.
            spec = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        elif kind == "json_object":
            if raw is not True:
                raise ValueError(f"{name} must be true (any JSON object), got {show_value(raw)}")
            spec = ""
        elif kind == "choice":
            if not isinstance(raw, (list, tuple)) or not raw:
                raise ValueError(f"{name} must be a non-empty list of non-empty strings, got {show_value(raw)}")
            for i, c in enumerate(raw):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"{name}[{i}] must be a non-empty string, got {show_value(c)}")
                check_unicode(f"{name}[{i}]", c)
            spec = json.dumps(list(raw), ensure_ascii=False)
        else:  # regex, grammar
            if not isinstance(raw, str) or not raw.strip():
                raise ValueError(f"{name} must be a non-empty string, got {show_value(raw)}")
            check_unicode(name, raw)
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
