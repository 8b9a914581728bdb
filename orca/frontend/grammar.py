"""The text side of structured outputs: a JSON schema, regex, choice or grammar checked and compiled by
xgrammar, and one request's matcher over the compiled grammar (GrammarConstraint)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from orca.structured_outputs_params import StructuredOutputs

UNSUPPORTED_SCHEMA_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas")
"""JSON Schema keywords the grammar engine would accept and not enforce (measured: a value they forbid
still parses): refused rather than promised. allOf with more than one subschema is refused for the same
reason."""

# Keywords whose value is a schema, a list of schemas, or a map of name -> schema (for the walk below).
_SCHEMA_VALUED = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedItems",
                  "unevaluatedProperties", "additionalItems", "not", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LOCATION = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def engine_message(exc: BaseException) -> str:
    """xgrammar's error without its timestamp and C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOCATION.sub("", text)


def check_json_schema(schema: Any, what: str = "structured_outputs.json") -> None:
    """ValueError unless `schema` is a valid JSON Schema that uses only what the grammar enforces."""
    import jsonschema

    if isinstance(schema, bool):
        if not schema:
            raise ValueError(f"{what} is false, which no output satisfies")
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"{what} is not a valid JSON Schema{f' at {where}' if where else ''}: "
                         f"{clip(exc.message)}") from None
    except (jsonschema.exceptions.UnknownType, RecursionError) as exc:
        raise ValueError(f"{what} is not a valid JSON Schema: {clip(str(exc))}") from None

    for path, node in _schemas(schema):
        for key in UNSUPPORTED_SCHEMA_KEYWORDS:
            if key in node:
                raise ValueError(f"{what}: the keyword {key!r} (at {path or '/'}) is not supported: structured "
                                 f"outputs cannot enforce it; supported: type, properties, required, items, "
                                 f"prefixItems, enum, const, anyOf, oneOf, $ref/$defs, string, number and array "
                                 f"bounds, pattern, format")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise ValueError(f"{what}: allOf with more than one subschema (at {path or '/'}) is not supported: "
                             f"merge them into one schema")


def _schemas(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, schema) for `node` and every subschema under it (the keywords whose value is a schema, a list
    of schemas or a map of name -> schema), depth first; what is not an object is skipped."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in (*_SCHEMA_VALUED, *_SCHEMA_LISTS):
        value = node.get(key)
        if isinstance(value, list):  # prefixItems, anyOf, ...; and the older drafts' items as a list
            for i, sub in enumerate(value):
                yield from _schemas(sub, f"{path}/{key}/{i}")
        else:
            yield from _schemas(value, f"{path}/{key}")
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _schemas(sub, f"{path}/{key}/{name}")


def clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


# xgrammar 0.2.8 spells a string with a length bound (minLength/maxLength) with this character class,
# which lets raw control characters (U+0000-U+001F, forbidden in JSON strings) through; its unbounded
# strings exclude them. Found by the tests' byte-fallback tokenizer: an output json.loads refused.
_LAX_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def json_schema_grammar(schema: str, any_whitespace: bool, strict: bool = True) -> str:
    """xgrammar's EBNF for a JSON schema (its length-bounded strings respelled: ``bounded_strings_as_patterns``),
    every string character class excluding control characters. strict (vLLM's default): properties and
    items the schema does not name are not generated."""
    import xgrammar

    respelled = json.dumps(bounded_strings_as_patterns(json.loads(schema)))
    text = str(xgrammar.Grammar.from_json_schema(respelled, any_whitespace=any_whitespace, strict_mode=strict))
    return text.replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR)


def bounded_strings_as_patterns(schema: Any) -> Any:
    """`schema`, changed in place (give it a copy) and returned: each string's minLength/maxLength (without
    a pattern or format of its own) spelled as the equivalent pattern: min to max characters other than ",
    \\ and the control characters (unescaped, as xgrammar's own bounded strings allow). xgrammar 0.2.8
    spells the bounds as a chain of one rule per character, whose masks it cannot precompute: many times
    slower per mask than the pattern (docs/BENCHMARKS.md, "Results: structured outputs"), and slow to
    compile for long bounds."""
    for _, node in _schemas(schema):
        bounded = "minLength" in node or "maxLength" in node
        if not bounded or node.get("type") != "string" or "pattern" in node or "format" in node:
            continue
        low, high = node.get("minLength", 0), node.get("maxLength")
        if isinstance(low, int) and (high is None or isinstance(high, int)):  # else: the meta-schema check's
            node.pop("minLength", None)
            node.pop("maxLength", None)
            node["pattern"] = rf'^[^"\\\x00-\x1f]{{{low},{"" if high is None else high}}}$'
    return schema


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""

    def literal(text: str) -> str:
        out = []
        for ch in text:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ch.isprintable():
                out.append(ch)
            else:
                out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


class GrammarConstraint:
    """One request's grammar state (orca/core/constraint.py's TokenConstraint), over a compiled grammar.
    Used by the engine core's thread alone."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32, reused

    def allowed_tokens(self) -> bytes:
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask.numpy().tobytes()

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


def compile_grammar(compiler: Any, so: StructuredOutputs) -> Any:
    """`so` compiled by an xgrammar GrammarCompiler (the meta-schema check first, for a JSON schema);
    ValueError naming the field when it is refused or does not compile."""
    if so.kind == "json":
        check_json_schema(json.loads(so.spec))
    try:
        if so.kind == "json":
            return compiler.compile_grammar(json_schema_grammar(so.spec, so.any_whitespace))
        if so.kind == "json_object":  # OpenAI's: a JSON object (xgrammar's builtin allows any value)
            return compiler.compile_grammar(json_schema_grammar('{"type":"object"}', so.any_whitespace, False))
        if so.kind == "regex":
            return compiler.compile_regex(so.spec)
        if so.kind == "choice":
            return compiler.compile_grammar(choice_grammar(so.choices))
        return compiler.compile_grammar(so.spec)
    except (RuntimeError, ValueError) as exc:
        what = {"json": "is a JSON schema the grammar engine cannot compile", "regex": "does not compile",
                "grammar": "is not a valid EBNF grammar (root ::= ...)",
                "choice": "cannot be compiled"}.get(so.kind, "cannot be compiled")
        raise ValueError(f"structured_outputs.{so.kind} {what}: {clip(engine_message(exc))}") from None
