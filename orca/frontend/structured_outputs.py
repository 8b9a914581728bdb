"""Structured outputs: a request's JSON schema, regex, choice or grammar, compiled into a token constraint.

The front end owns the text side of a constraint, the engine core only its token side (orca/core/constraint.py):
``StructuredOutputCompiler`` compiles a request's ``SamplingParams.structured_outputs`` with the model's
tokenizer into a grammar (xgrammar, chosen by measurement over llguidance: docs/BENCHMARKS.md), and each
request gets a ``GrammarConstraint`` over it, which the core asks for the bitmask of allowed tokens every
time the request samples and advances with the token drawn.

Compiling never blocks an iteration: the Triton model compiles on this module's thread pool
(``compile_async``), and submits the request to the engine once its grammar is there; a request whose
grammar takes longer than ``timeout`` is refused with a clear error (the compile finishes in the
background and is cached). Compiled grammars are cached by their canonical text (StructuredOutputs.spec:
a JSON schema as compact JSON), so a schema seen before costs a dictionary lookup.

Bad input is refused here, before the request reaches the engine, with a ValueError naming the field: a
schema that is not a valid JSON Schema (jsonschema's meta-schema check), keywords the grammar engine would
silently ignore (``UNSUPPORTED_SCHEMA_KEYWORDS``), a regex or grammar that does not parse.

xgrammar is imported when the first constrained request arrives: an engine that serves none (or a host
without the package) pays nothing.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from orca.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 30.0
"""How long a request may wait for its grammar to compile before it is refused."""
CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""
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


def _engine_message(exc: BaseException) -> str:
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
                         f"{_clip(exc.message)}") from None
    except (jsonschema.exceptions.UnknownType, RecursionError) as exc:
        raise ValueError(f"{what} is not a valid JSON Schema: {_clip(str(exc))}") from None

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


def _clip(text: str, limit: int = 300) -> str:
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
    spells the bounds as a chain of one rule per character, whose masks it cannot precompute: measured on
    SmolLM2's vocabulary, 0.7 ms per token on average (up to 6 ms) against 0.017 ms as a pattern, and 1.8 s
    to compile maxLength 120."""
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


class StructuredOutputCompiler:
    """Compiles structured outputs for one model's tokenizer, with a cache and a background pool.

    `tokenizer` is the checkpoint's transformers tokenizer (None: every constrained request is refused),
    `vocab_size` the model's logits width (tokens past the tokenizer's are never allowed), `stop_token_ids`
    the ids that end a request (the grammar allows them once it is complete)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int] | set[int],
                 timeout: float = DEFAULT_COMPILE_TIMEOUT_S, threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout = timeout
        self._threads = threads
        self._lock = threading.Lock()
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built with the first grammar
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self.on_compiled: Callable[[float], None] | None = None  # seconds of each compile (not cache hits)

    # -- compiling -------------------------------------------------------------------------------
    def check(self, so: StructuredOutputs) -> None:
        """The checks that need no grammar engine (ValueError naming the field), on the caller's thread."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer, and this model has none")
        if so.kind == "json":
            check_json_schema(json.loads(so.spec))

    def compile(self, so: StructuredOutputs) -> Any:
        """The compiled grammar (cached); ValueError naming the field when it is refused or does not
        compile."""
        compiled = self._lookup(so)
        if compiled is None:
            self.check(so)
            compiled = self._compile(so)
        return compiled

    def _lookup(self, so: StructuredOutputs) -> Any:
        """The cached grammar (now the most recently used), or None."""
        with self._lock:
            if so not in self._cache:
                return None
            self._cache.move_to_end(so)
            return self._cache[so]

    def _compile(self, so: StructuredOutputs) -> Any:
        """Compiles a checked structured output and caches it; ValueError when it does not compile."""
        compiler = self._grammar_compiler()
        start = time.perf_counter()
        try:
            if so.kind == "json":
                compiled = compiler.compile_grammar(json_schema_grammar(so.spec, so.any_whitespace))
            elif so.kind == "json_object":  # OpenAI's: a JSON object (xgrammar's builtin allows any value)
                compiled = compiler.compile_grammar(json_schema_grammar('{"type":"object"}', so.any_whitespace, False))
            elif so.kind == "regex":
                compiled = compiler.compile_regex(so.spec)
            elif so.kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(so.choices))
            else:
                compiled = compiler.compile_grammar(so.spec)
        except (RuntimeError, ValueError) as exc:
            what = {"json": "is a JSON schema the grammar engine cannot compile", "regex": "does not compile",
                    "grammar": "is not a valid EBNF grammar (root ::= ...)",
                    "choice": "cannot be compiled"}.get(so.kind, "cannot be compiled")
            raise ValueError(f"structured_outputs.{so.kind} {what}: {_clip(_engine_message(exc))}") from None
        seconds = time.perf_counter() - start
        if self.on_compiled is not None:
            self.on_compiled(seconds)
        with self._lock:
            self._cache[so] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def constraint(self, so: StructuredOutputs) -> GrammarConstraint:
        """A fresh constraint for one request (compiling, or from the cache), synchronously."""
        return GrammarConstraint(self.compile(so), self.vocab_size)

    def cached(self, so: StructuredOutputs) -> bool:
        return self._lookup(so) is not None

    def compile_async(self, so: StructuredOutputs,
                      done: Callable[[GrammarConstraint | None, str | None], None]) -> None:
        """Calls ``done(constraint, None)`` once the grammar is compiled, or ``done(None, message)`` when it
        does not compile or takes longer than ``timeout`` (exactly once, on a pool or timer thread; at once
        on this thread when the grammar is cached). What ``check`` refuses raises its ValueError here, on
        the caller's thread, before anything is queued."""
        compiled = self._lookup(so)
        if compiled is not None:
            done(GrammarConstraint(compiled, self.vocab_size), None)
            return
        self.check(so)
        once = threading.Lock()
        answered = False

        def answer(constraint: GrammarConstraint | None, error: str | None) -> None:
            nonlocal answered
            with once:
                if answered:
                    return
                answered = True
            done(constraint, error)

        def run() -> None:
            try:
                answer(GrammarConstraint(self._compile(so), self.vocab_size), None)
            except ValueError as exc:
                answer(None, str(exc))
            except Exception as exc:  # noqa: BLE001 - the request gets the error, the server goes on
                logger.exception("compiling a structured output failed")
                answer(None, f"structured_outputs could not be compiled: {type(exc).__name__}: {exc}")

        timer = threading.Timer(self.timeout, answer, args=(None, (
            f"structured_outputs.{so.kind} took longer than {self.timeout:g} s to compile: simplify it "
            f"(the compile goes on in the background; the same constraint is served at once when done)")))
        timer.daemon = True
        future: Future[None] = self._executor().submit(run)
        future.add_done_callback(lambda _: timer.cancel())
        timer.start()

    def warm_up(self) -> None:
        """Builds the tokenizer's grammar tables in the background (about a second for a large vocabulary),
        so the first constrained request does not wait for them."""
        if self.tokenizer is not None:
            self._executor().submit(self._grammar_compiler)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="orca-grammar")
            return self._pool

    def _grammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is not None:
                return self._compiler
        try:
            import xgrammar
        except ImportError:
            raise ValueError("structured_outputs need the xgrammar package, which is not installed "
                             "(pip install -r requirements.txt)") from None
        info = xgrammar.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        compiler = xgrammar.GrammarCompiler(info, max_threads=self._threads)
        with self._lock:
            if self._compiler is None:
                self._compiler = compiler
            return self._compiler
