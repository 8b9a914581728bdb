"""Grammar bombs and the compile pool's bounds (orca/frontend/structured_outputs.py, orca/sampling_params.py):
what no ordinary schema needs is refused when the request is parsed, naming the field and the allowed range;
what gets past the caps runs in a compile process with a deadline and a memory cap, which is killed and
replaced while the parent and the next compile go on; requests waiting for a grammar are bounded, and a
cancelled one frees its place. The process's misbehaviour comes from a fault hook (hang, exit, oom), never
from a compile that is hoped to be slow.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import xgrammar

from orca.core.errors import QueueFullError
from orca.frontend.structured_outputs import StructuredOutputCompiler
from orca.structured_outputs_params import (
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    MAX_REPETITION,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    StructuredOutputs,
)

ORDINARY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                             "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}}},
            "required": ["name", "tags"]}


def _parse(so: dict[str, Any]) -> StructuredOutputs:
    return StructuredOutputs.parse(so)


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# -- the caps, at parse time -------------------------------------------------------------------------
@pytest.mark.parametrize(("so", "message"), [
    ({"json": {"type": "string", "maxLength": 10**9}},
     r"structured_outputs.json: maxLength \(at /maxLength\) is 1000000000; from 0 to 100000 allowed"),
    ({"json": {"type": "array", "minItems": 200_000}}, r"minItems \(at /minItems\) is 200000; from 0 to 100000"),
    ({"json": {"type": "object", "properties": {"a": {"type": "object", "maxProperties": 10**6}}}},
     r"maxProperties \(at /properties/a/maxProperties\)"),
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(x{1000}){1000}$"}}}},
     r"the pattern at /properties/a/pattern repeats 1000000 times"),
    ({"json": {"type": "object", "patternProperties": {"^a{500000}$": {}}}}, "the pattern .* repeats 500000 times"),
    ({"regex": "(a{1000}){1000}"}, r"structured_outputs.regex repeats 1000000 times \(\{1000\} around a group"),
    ({"regex": "((ab{100}){100}){100}"}, "repeats 1000000 times"),
    ({"regex": "x{0,1000000000}"}, r"repeats 1000000000 times \(\{0,1000000000\}\); counts from 0 to 100000"),
    ({"grammar": 'root ::= ("a" [0-9]{1000}){1000}'}, "structured_outputs.grammar repeats 1000000 times"),
    ({"grammar": 'root ::= "a"{2000000}'}, "structured_outputs.grammar repeats 2000000 times"),
    ({"json": _nested(MAX_SCHEMA_DEPTH)}, f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels"),
    ({"json": {"enum": list(range(MAX_SCHEMA_NODES))}}, f"holds more than {MAX_SCHEMA_NODES} JSON values"),
    ({"regex": "a" * (MAX_REGEX_CHARS + 1)}, f"structured_outputs.regex is {MAX_REGEX_CHARS + 1} characters long; "
                                             f"at most {MAX_REGEX_CHARS} allowed"),
    ({"grammar": "root ::= " + " ".join(['"a"'] * (MAX_GRAMMAR_CHARS // 4 + 1))},
     f"at most {MAX_GRAMMAR_CHARS} allowed"),
])
def test_grammar_bombs_are_refused_at_parse_naming_the_field(so: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parse(so)


@pytest.mark.parametrize("so", [
    {"json": ORDINARY},
    {"json": {"type": "string", "maxLength": 65536}},  # tool schemas in the wild: llama.cpp #25746
    {"json": {"type": "array", "maxItems": MAX_REPETITION, "items": {"type": "string", "maxLength": 1000}}},
    {"json": {"enum": [{"maxLength": 10**9}]}},  # a value, not a keyword
    {"json": {"type": "object", "properties": {"maxLength": {"type": "integer"}}}},  # a property's name
    {"json": _nested(MAX_SCHEMA_DEPTH // 2 - 1)},
    {"regex": r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"},
    {"regex": r"(\d{3}-){2}\d{4}"},
    {"regex": r"[{99999999}]\{1000000\}"},  # braces in a class or escaped are no count
    {"regex": "(a{300}b){300}"},
    {"grammar": 'root ::= "x{99999999}" [a-z]{1,50} # y{1000000}\n'},
    {"grammar": 'root ::= expr\nexpr ::= term ("+" term){0,3}\nterm ::= [1-9] | "(" expr ")"'},
])
def test_ordinary_structured_outputs_pass_the_caps(so: dict[str, Any]) -> None:
    _parse(so)


# -- the compile process -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from orca.checkpoint import load_tokenizer, resolve_checkpoint

    return load_tokenizer(resolve_checkpoint(None))


FAULTS = {"b+": "hang", "c+": "exit", "d+": "oom"}


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Any:
    """One compile process with the fault hooks; a deadline long enough for any ordinary compile here."""
    c = StructuredOutputCompiler(tokenizer, 49152, {2}, deadline=5.0, memory_limit=512 << 20,
                                 fault=lambda so: FAULTS.get(so.spec))
    yield c
    c.shutdown()


def _compiles_and_constrains(c: StructuredOutputCompiler) -> None:
    compiled = c.compile(_parse({"json": ORDINARY, "disable_any_whitespace": True}))
    assert xgrammar.GrammarMatcher(compiled).accept_string('{"name": "ab", "tags": ["a"]}')
    assert not xgrammar.GrammarMatcher(compiled).accept_string('{"name": "abcdefghij", "tags": []}')


def test_ordinary_schemas_compile_in_the_process_and_constrain(compiler: Any) -> None:
    _compiles_and_constrains(compiler)
    assert compiler.cached(_parse({"json": ORDINARY, "disable_any_whitespace": True}))
    with pytest.raises(ValueError, match="the keyword 'not'"):  # the meta-schema check, in the process
        compiler.compile(_parse({"json": {"not": {"type": "string"}}}))
    with pytest.raises(ValueError, match="structured_outputs.regex does not compile"):
        compiler.compile(_parse({"regex": "([a-z]"}))


@pytest.mark.parametrize(("spec", "message"), [
    ("b+", "structured_outputs.regex took longer than 5 s to compile and was stopped: simplify it"),
    ("c+", r"structured_outputs.regex could not be compiled: the compile process exited \(3\)"),
    ("d+", "structured_outputs.regex needs more than 512 MiB of memory to compile: simplify it"),
])
def test_a_killed_or_dead_compile_leaves_the_pool_working(compiler: Any, spec: str, message: str) -> None:
    """A compile that hangs is killed at the deadline, one that crashes its process or allocates past the
    memory cap is answered: each with a clear error, and the next compile works in a fresh process; the
    parent's memory does not follow the child's."""
    before = _rss()
    with pytest.raises(ValueError, match=message):
        compiler.compile(_parse({"regex": spec}))
    assert not compiler.cached(_parse({"regex": spec}))
    compiled = compiler.compile(_parse({"regex": "[a-z]+@x"}))
    assert xgrammar.GrammarMatcher(compiled).accept_string("ab@x")
    assert compiler.pending() == 0
    assert _rss() - before < 128 << 20


def test_the_compile_queue_refuses_past_its_bound_and_cancelled_requests_free_it(tokenizer: Any) -> None:
    """A hung compile holds the one process; with it 4 requests (max_pending) wait, the 5th is refused at once
    with the waiting-queue message (orca-openai's 429); cancelling frees a place, by the ticket or by the
    request's own `cancelled` (asked when the queue is full, before refusing), also for a request whose
    grammar is compiling now; shutdown answers the rest."""
    c = StructuredOutputCompiler(tokenizer, 49152, {2}, deadline=600.0, max_pending=4,
                                 fault=lambda so: FAULTS.get(so.spec))
    answers: dict[str, str | None] = {}
    answered = {k: threading.Event() for k in ("hang", "one", "two", "three", "four", "five", "six")}

    def done(name: str) -> Any:
        return lambda constraint, error: (answers.__setitem__(name, error), answered[name].set())

    try:
        flag, hang_flag = threading.Event(), threading.Event()
        c.compile_async(_parse({"regex": "b+"}), done("hang"), cancelled=hang_flag.is_set)
        tickets = {name: c.compile_async(_parse({"regex": f"{name}[0-9]"}), done(name),
                                         cancelled=flag.is_set if name == "three" else None)
                   for name in ("one", "two", "three")}
        assert c.pending() == 4
        with pytest.raises(QueueFullError, match="the waiting queue is full for grammar compiles .*retry later"):
            c.compile_async(_parse({"regex": "four[0-9]"}), done("four"))
        assert tickets["one"].cancel() and not tickets["one"].cancel()
        assert answered["one"].is_set() and "cancelled while its grammar compiled" in answers["one"]
        c.compile_async(_parse({"regex": "four[0-9]"}), done("four"))
        with pytest.raises(QueueFullError):
            c.compile_async(_parse({"regex": "five[0-9]"}), done("five"))
        flag.set()  # "three" says it was cancelled
        c.compile_async(_parse({"regex": "five[0-9]"}), done("five"))
        assert answered["three"].wait(30) and "cancelled" in answers["three"]
        assert c.pending() == 4
        hang_flag.set()  # the request whose grammar compiles (hangs) now is cancelled: its place is free
        c.compile_async(_parse({"regex": "six[0-9]"}), done("six"))
        assert answered["hang"].wait(30) and "cancelled while its grammar compiled" in answers["hang"]
    finally:
        c.shutdown()
    for name in ("two", "four", "five", "six"):
        assert answered[name].wait(30), name
        assert answers[name] == "structured_outputs: the engine is shutting down", (name, answers[name])
    assert c.pending() == 0 and not any(c.cached(_parse({"regex": f"{n}[0-9]"})) for n in ("one", "two", "three"))


def test_requests_for_one_grammar_share_its_compile(compiler: Any) -> None:
    so = _parse({"json": {"type": "object", "properties": {"k": {"enum": [1, 2, 3]}}, "required": ["k"]}})
    seconds: list[float] = []
    got: list[tuple[Any, str | None]] = []
    three = threading.Event()
    compiler.on_compiled = seconds.append
    try:
        for _ in range(3):
            compiler.compile_async(so, lambda c, e: (got.append((c, e)), len(got) == 3 and three.set()))
        assert three.wait(60)
    finally:
        compiler.on_compiled = None
    assert all(e is None and c.allowed_tokens() for c, e in got)
    assert len(seconds) == 1 and compiler.pending() == 0


def test_shutdown_answers_the_waiting_requests(tokenizer: Any) -> None:
    c = StructuredOutputCompiler(tokenizer, 49152, {2}, deadline=60.0, fault=lambda so: FAULTS.get(so.spec))
    answers: list[str | None] = []
    done = threading.Event()
    c.compile_async(_parse({"regex": "b+"}), lambda _, e: (answers.append(e), done.set()))
    c.shutdown()
    assert done.wait(30) and answers == ["structured_outputs: the engine is shutting down"]
    with pytest.raises(QueueFullError, match="shutting down"):
        c.compile_async(_parse({"regex": "a+"}), lambda *_: None)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
