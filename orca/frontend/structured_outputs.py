"""Structured outputs: a request's JSON schema, regex, choice or grammar, compiled into a token constraint.

The front end owns the text side of a constraint, the engine core only its token side (orca/core/constraint.py):
``StructuredOutputCompiler`` compiles a request's ``SamplingParams.structured_outputs`` with the model's
tokenizer into a grammar (xgrammar, chosen by measurement over llguidance: docs/BENCHMARKS.md), and each
request gets a ``GrammarConstraint`` over it, which the core asks for the bitmask of allowed tokens every
time the request samples and advances with the token drawn.

Compiling never blocks an iteration, nor the caller: grammars compile in a worker process (a fresh interpreter,
never a fork: the parent holds CUDA and threads; started as orca/executor/distributed.py starts its workers,
since Triton's stub is not a python; not multiprocessing's spawn, which runs the parent's __main__ again in the
child: a script without a main guard would build its LLM twice), which sends the compiled grammar back as
xgrammar's JSON (CompiledGrammar.serialize_json; a few ms each way). A compile that runs past ``deadline`` has
its process killed and replaced, and the request gets a clear error; the process's address space is capped
(``memory_limit`` past what its imports take: RLIMIT_AS), so a grammar that would eat the host's memory fails
there, not in Triton's stub. Requests waiting for a grammar (queued or compiling) are bounded by
``max_pending``: past it a request is refused at once (QueueFullError, "the waiting queue is full": orca-openai
answers 429); a request that is cancelled (``CompileTicket.cancel``, or its ``cancelled`` callable answering
True) or that waits past ``timeout`` frees its place, and a queued compile nobody waits for any more is dropped.
The Triton model submits a request to the engine once its grammar is there (``compile_async``). Compiled
grammars are cached in the parent by their canonical text (StructuredOutputs.spec: a JSON schema as compact
JSON), so a schema seen before costs a dictionary lookup.

Bad input is refused with a ValueError naming the field: sizes, nesting and counts when the request is parsed
(orca/sampling_params.py: MAX_SCHEMA_NODES, MAX_REPETITION...), cheap and bounded by the size cap; then, in
the worker process, a schema that is not a valid JSON Schema (jsonschema's meta-schema check), keywords the
grammar engine would silently ignore (``UNSUPPORTED_SCHEMA_KEYWORDS``), a regex or grammar that does not parse.

xgrammar is imported when the first constrained request arrives (or at ``warm_up``): an engine that serves
none (or a host without the package) pays nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from orca.core.engine import QueueFullError
from orca.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 30.0
"""How long a request may wait for its grammar (queued and compiling) before it is refused."""
DEFAULT_COMPILE_DEADLINE_S = 10.0
"""How long one compile may run before its process is killed: well past the slowest ordinary schema
measured (docs/BENCHMARKS.md, "Results: structured outputs")."""
DEFAULT_COMPILE_MEMORY = 2 << 30
"""The address space a compile process may add to what its imports took (RLIMIT_AS), in bytes."""
DEFAULT_MAX_PENDING = 64
"""Requests that may wait for a grammar (queued or compiling) before more are refused."""
START_TIMEOUT_S = 120.0
"""How long a compile process may take to start (it imports xgrammar, hence torch: seconds)."""
_SWEEP_S = 0.5  # how often an idle dispatcher asks the queued requests whether they were cancelled
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


@dataclass(eq=False)
class CompileTicket:
    """One request waiting for a grammar (compile_async's answer): ``cancel()`` frees its place in the compile
    queue and answers it (``done(None, message)``) unless it was answered already."""

    so: StructuredOutputs
    done: Callable[[GrammarConstraint | None, str | None], None]
    cancelled: Callable[[], bool] | None = None
    owner: StructuredOutputCompiler | None = None
    answered: bool = False
    timer: threading.Timer | None = None
    compiled: Any = None  # the grammar, once compiled (what a synchronous compile returns)

    def cancel(self) -> bool:
        """True when the request was still waiting (it is answered now with a cancellation error)."""
        if self.owner is None:
            return False
        return self.owner._withdraw(self, _cancelled(self.so))


@dataclass(eq=False)
class _Job:
    """One grammar to compile, and the requests waiting for it."""

    so: StructuredOutputs
    waiters: list[CompileTicket] = field(default_factory=list)
    fault: str | None = None


class StructuredOutputCompiler:
    """Compiles structured outputs for one model's tokenizer, with a cache and a pool of compile processes.

    `tokenizer` is the checkpoint's transformers tokenizer (None: every constrained request is refused),
    `vocab_size` the model's logits width (tokens past the tokenizer's are never allowed), `stop_token_ids`
    the ids that end a request (the grammar allows them once it is complete). `timeout`: how long a request
    may wait for its grammar; `deadline`: how long one compile may run (its process is then killed);
    `memory_limit`: bytes of address space a compile process may add past its imports; `max_pending`:
    requests that may wait for a grammar at once; `workers`: compile processes (`threads` each, xgrammar's).
    `fault` (tests only): a function of the StructuredOutputs giving "hang", "oom" or "exit" for the compile
    process to do instead of compiling (None: compile)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int] | set[int],
                 timeout: float = DEFAULT_COMPILE_TIMEOUT_S, threads: int = 1, *,
                 deadline: float = DEFAULT_COMPILE_DEADLINE_S, memory_limit: int = DEFAULT_COMPILE_MEMORY,
                 max_pending: int = DEFAULT_MAX_PENDING, workers: int = 1,
                 fault: Callable[[StructuredOutputs], str | None] | None = None) -> None:
        for name, value, low in (("deadline", deadline, 0.0), ("timeout", timeout, 0.0),
                                 ("memory_limit", memory_limit, 1), ("max_pending", max_pending, 1),
                                 ("workers", workers, 1), ("threads", threads, 1)):
            if value < low or (name != "timeout" and value <= 0):
                raise ValueError(f"StructuredOutputCompiler {name} must be positive, got {value}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout = timeout
        self.deadline = deadline
        self.memory_limit = memory_limit
        self.max_pending = max_pending
        self._threads = threads
        self._workers = workers
        self._fault = fault
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._info: Any = None  # xgrammar.TokenizerInfo, built with the first grammar
        self._info_json = ""  # its serialized form, which each compile process starts from
        self._info_lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._queue: OrderedDict[StructuredOutputs, _Job] = OrderedDict()  # waiting for a process
        self._running: dict[StructuredOutputs, _Job] = {}  # compiling now
        self._pending = 0  # requests waiting (queued or compiling), against max_pending
        self._dispatchers: list[threading.Thread] = []
        self._processes: list[_CompileProcess] = []
        self._stopped = False
        self.on_compiled: Callable[[float], None] | None = None  # seconds of each compile (not cache hits)

    # -- compiling -------------------------------------------------------------------------------
    def check(self, so: StructuredOutputs) -> None:
        """What is refused before anything is queued (ValueError naming the field), on the caller's thread:
        the size, nesting and count caps were checked when `so` was parsed (StructuredOutputs.parse); the
        meta-schema check runs in the compile process."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer, and this model has none")

    def compile(self, so: StructuredOutputs) -> Any:
        """The compiled grammar (cached), waiting for it; ValueError naming the field when it is refused or
        does not compile, QueueFullError when too many requests wait for a grammar."""
        compiled = self._lookup(so)
        if compiled is not None:
            return compiled
        self.check(so)
        done = threading.Event()
        errors: list[str | None] = []
        ticket = CompileTicket(so, lambda _, error: (errors.append(error), done.set()), owner=self)
        self._enqueue(ticket, with_timer=False)
        done.wait()
        if errors[0] is not None:
            raise ValueError(errors[0])
        return ticket.compiled

    def _lookup(self, so: StructuredOutputs) -> Any:
        """The cached grammar (now the most recently used), or None."""
        with self._lock:
            if so not in self._cache:
                return None
            self._cache.move_to_end(so)
            return self._cache[so]

    def constraint(self, so: StructuredOutputs) -> GrammarConstraint:
        """A fresh constraint for one request (compiling, or from the cache), synchronously."""
        return GrammarConstraint(self.compile(so), self.vocab_size)

    def cached(self, so: StructuredOutputs) -> bool:
        return self._lookup(so) is not None

    def pending(self) -> int:
        """Requests waiting for a grammar now (queued or compiling)."""
        with self._lock:
            return self._pending

    def compile_async(self, so: StructuredOutputs, done: Callable[[GrammarConstraint | None, str | None], None],
                      cancelled: Callable[[], bool] | None = None) -> CompileTicket:
        """Calls ``done(constraint, None)`` once the grammar is compiled, or ``done(None, message)`` when it
        does not compile, runs past the deadline, waits longer than ``timeout`` or the request is cancelled
        (exactly once, on a dispatcher or timer thread; at once on this thread when the grammar is cached).
        Raises on the caller's thread, before anything is queued: what ``check`` refuses (ValueError), and
        QueueFullError when ``max_pending`` requests wait already. `cancelled` (e.g. the response sender's
        is_cancelled) is asked while the request waits in the queue: True drops it. The ticket's cancel()
        does the same at once."""
        ticket = CompileTicket(so, done, cancelled, owner=self)
        compiled = self._lookup(so)
        if compiled is not None:
            ticket.answered = True
            done(GrammarConstraint(compiled, self.vocab_size), None)
            return ticket
        self.check(so)
        self._enqueue(ticket, with_timer=True)
        return ticket

    def _enqueue(self, ticket: CompileTicket, with_timer: bool) -> None:
        so = ticket.so
        with self._lock:
            if self._stopped:
                raise QueueFullError("the engine is shutting down")
            if self._pending >= self.max_pending:
                self._sweep_locked()
            if self._pending >= self.max_pending:
                raise QueueFullError(f"the waiting queue is full for grammar compiles ({self.max_pending} requests "
                                     f"wait for a structured output's grammar): retry later")
            job = self._running.get(so) or self._queue.get(so)
            if job is None:
                job = self._queue[so] = _Job(so, fault=self._fault(so) if self._fault is not None else None)
            job.waiters.append(ticket)
            self._pending += 1
            if with_timer:
                ticket.timer = threading.Timer(self.timeout, self._withdraw, args=(ticket, (
                    f"structured_outputs.{so.kind} took longer than {self.timeout:g} s to compile (waiting and "
                    f"compiling): simplify it or retry later")))
                ticket.timer.daemon = True
                ticket.timer.start()
            self._start_dispatchers_locked()
            self._wake.notify()

    def _withdraw(self, ticket: CompileTicket, message: str) -> bool:
        """Takes a waiting request out (cancelled or timed out) and answers it; a queued compile nobody waits
        for any more is dropped. False when it was answered already."""
        with self._lock:
            if not self._release_locked(ticket):
                return False
        self._answer(ticket, None, message)
        return True

    def _release_locked(self, ticket: CompileTicket) -> bool:
        """Marks a ticket answered and frees its place; False when it was answered already."""
        if ticket.answered:
            return False
        ticket.answered = True
        self._pending -= 1
        job = self._running.get(ticket.so) or self._queue.get(ticket.so)
        if job is not None and ticket in job.waiters:
            job.waiters.remove(ticket)
            if not job.waiters and self._queue.get(ticket.so) is job:
                del self._queue[ticket.so]
        return True

    def _sweep_locked(self) -> list[CompileTicket]:
        """Withdraws the waiting requests (queued, or waiting for a compile that runs on: it is cached) whose
        `cancelled` answers True; returns them, answered off the lock by a thread of their own."""
        jobs = (*self._queue.values(), *self._running.values())
        gone = [t for job in jobs for t in list(job.waiters) if t.cancelled is not None and _asks_true(t.cancelled)]
        for ticket in gone:
            self._release_locked(ticket)
        if gone:
            threading.Thread(target=lambda: [self._answer(t, None, _cancelled(t.so)) for t in gone],
                             name="orca-grammar-cancel", daemon=True).start()
        return gone

    def _answer(self, ticket: CompileTicket, constraint: GrammarConstraint | None, error: str | None) -> None:
        if ticket.timer is not None:
            ticket.timer.cancel()
        try:
            ticket.done(constraint, error)
        except Exception:  # noqa: BLE001 - one request's callback must not stop the dispatcher
            logger.exception("a structured output's callback failed")

    def _answer_all(self, tickets: list[CompileTicket], constraint: Any, error: str | None) -> None:
        for ticket in tickets:
            self._answer(ticket, constraint, error)

    # -- the dispatchers: one thread and one compile process each --------------------------------
    def _start_dispatchers_locked(self) -> None:
        while len(self._dispatchers) < self._workers:
            process = _CompileProcess(self)
            thread = threading.Thread(target=self._dispatch, args=(process,), daemon=True,
                                      name=f"orca-grammar-{len(self._dispatchers)}")
            self._processes.append(process)
            self._dispatchers.append(thread)
            thread.start()

    def _dispatch(self, process: _CompileProcess) -> None:
        """Starts `process`, then takes the oldest queued grammar, compiles it there and answers its requests;
        until shutdown. Only this thread starts `process` (which dies with the thread that started it)."""
        try:
            process.ensure_started()
        except Exception as exc:  # noqa: BLE001 - the first compile tries again and reports it
            logger.warning("the grammar compile process did not start: %s", exc)
        while True:
            with self._lock:
                while not self._stopped and not self._queue:
                    if not self._wake.wait(_SWEEP_S):
                        self._sweep_locked()
                if self._stopped:
                    return
                so, job = self._queue.popitem(last=False)
                self._running[so] = job
            compiled, error, seconds = None, None, 0.0
            try:
                compiled, error, seconds = process.compile(job)
            except Exception as exc:  # noqa: BLE001 - the requests get the error, the server goes on
                logger.exception("compiling a structured output failed")
                error = f"structured_outputs could not be compiled: {type(exc).__name__}: {exc}"
            with self._lock:
                self._running.pop(so, None)
                if compiled is not None:
                    self._cache[so] = compiled
                    while len(self._cache) > CACHE_SIZE:
                        self._cache.popitem(last=False)
                waiters = [t for t in list(job.waiters) if self._release_locked(t)]
                for ticket in waiters:
                    ticket.compiled = compiled
            if compiled is not None and self.on_compiled is not None:
                self.on_compiled(seconds)
            for ticket in waiters:
                self._answer(ticket, GrammarConstraint(compiled, self.vocab_size) if compiled is not None else None,
                             error)

    def warm_up(self) -> None:
        """Builds the tokenizer's grammar tables in the background. The compile process starts with the first
        grammar (within ``timeout``), not here: started here, every model instance of a Triton server would
        hold one (hundreds of MB each, mostly torch, which xgrammar imports) and import torch again at load,
        whether it serves structured outputs or not."""
        def build() -> None:
            try:
                self.tokenizer_info()
            except Exception as exc:  # noqa: BLE001 - the first constrained request reports it
                logger.warning("structured outputs' tokenizer tables were not built: %s", exc)

        if self.tokenizer is not None:
            threading.Thread(target=build, name="orca-grammar-warm-up", daemon=True).start()

    def shutdown(self) -> None:
        """Stops the compile processes; the requests still waiting are answered ("shutting down")."""
        with self._lock:
            self._stopped = True
            tickets = [t for job in (*self._queue.values(), *self._running.values()) for t in list(job.waiters)]
            tickets = [t for t in tickets if self._release_locked(t)]
            self._queue.clear()
            self._wake.notify_all()
            processes = list(self._processes)
        for process in processes:
            process.stop()
        self._answer_all(tickets, None, "structured_outputs: the engine is shutting down")

    def tokenizer_info(self) -> tuple[Any, str]:
        """xgrammar's TokenizerInfo for the model (built once: about a second for a large vocabulary), and
        its JSON for the compile processes."""
        with self._info_lock:
            if self._info is None:
                try:
                    import xgrammar
                except ImportError:
                    raise ValueError("structured_outputs need the xgrammar package, which is not installed "
                                     "(pip install -r requirements.txt)") from None
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._info_json = info.serialize_json()
                self._info = info
            return self._info, self._info_json


def _asks_true(cancelled: Callable[[], bool]) -> bool:
    try:
        return bool(cancelled())
    except Exception:  # noqa: BLE001 - a sender that cannot say is not cancelled
        return False


def _cancelled(so: StructuredOutputs) -> str:
    return f"structured_outputs: the request was cancelled while its grammar compiled (structured_outputs.{so.kind})"


class _CompileProcess:
    """One compile process (started on first use, replaced after a kill), driven by one dispatcher thread."""

    def __init__(self, owner: StructuredOutputCompiler) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._conn: Any = None
        self._stopped = False

    def ensure_started(self) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError("the grammar compiler is shut down")
            if self._process is not None and self._process.poll() is None:
                return
            _, info_json = self.owner.tokenizer_info()
            mine, theirs = socket.socketpair()
            # The parent's import path (Triton's stub adds the model's directory); its own session, so a
            # Ctrl-C to the terminal's process group reaches only Triton, which shuts the model down.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            command = [_python_executable(), "-c", _CHILD_MAIN, str(theirs.fileno()), str(self.owner.memory_limit)]
            try:
                process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                           start_new_session=True)
            finally:
                theirs.close()
            ours = Connection(mine.detach())
            ours.send((info_json, self.owner._threads))
            ready = ours.poll(START_TIMEOUT_S)
            try:
                message = ours.recv() if ready else None
            except (EOFError, OSError):
                message = None
            if message != ("ready",):
                process.kill()
                process.wait(10)
                ours.close()
                why = f"exit code {process.returncode}" if ready else f"not ready within {START_TIMEOUT_S:g} s"
                raise RuntimeError(f"the grammar compile process did not start ({why})")
            if self._stopped:  # shut down while it started
                process.kill()
                ours.close()
                raise RuntimeError("the grammar compiler is shut down")
            self._process, self._conn = process, ours
            logger.info("grammar compile process %d started", process.pid)

    def compile(self, job: _Job) -> tuple[Any, str | None, float]:
        """(compiled grammar, None, seconds) or (None, the request's error, 0): at most the deadline after
        the process takes the job; a process past it, or dead, is replaced on the next compile."""
        self.ensure_started()
        so, owner = job.so, self.owner
        try:
            self._conn.send((so, job.fault))
        except OSError:  # it died since the last compile
            code = self._kill()
            return None, f"structured_outputs.{so.kind} could not be compiled: the compile process exited ({code})", 0.0
        if not self._conn.poll(owner.deadline):
            self._kill()
            return None, (f"structured_outputs.{so.kind} took longer than {owner.deadline:g} s to compile and was "
                          f"stopped: simplify it"), 0.0
        try:
            status, value, seconds = self._conn.recv()
        except (EOFError, OSError):
            code = self._kill()
            return None, f"structured_outputs.{so.kind} could not be compiled: the compile process exited ({code})", 0.0
        if status == "memory":
            self._kill()  # its heap may be fragmented past use: a fresh one
            return None, (f"structured_outputs.{so.kind} needs more than {_gib(owner.memory_limit)} of memory to "
                          f"compile: simplify it"), 0.0
        if status == "error":
            return None, value, 0.0
        import xgrammar

        info, _ = owner.tokenizer_info()
        return xgrammar.CompiledGrammar.deserialize_json(value, info), None, seconds

    def _kill(self) -> int | None:
        with self._lock:
            process, conn = self._process, self._conn
            self._process = self._conn = None
        if process is None:
            return None
        process.kill()
        process.wait(10)
        conn.close()
        logger.warning("grammar compile process %d stopped (exit code %s)", process.pid, process.returncode)
        return process.returncode

    def stop(self) -> None:
        """Kills the process, without waiting for one being started (that one is killed once it is up)."""
        self._stopped = True
        if self._lock.acquire(blocking=False):
            self._lock.release()
            self._kill()


def _gib(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def _python_executable() -> str:
    from orca.executor.distributed import _python_executable as python

    return python()


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
        raise ValueError(f"structured_outputs.{so.kind} {what}: {_clip(_engine_message(exc))}") from None


_CHILD_MAIN = ("import sys; from orca.frontend.structured_outputs import compile_process_main; "
               "compile_process_main(int(sys.argv[1]), int(sys.argv[2]))")


def compile_process_main(fd: int, memory_limit: int) -> None:
    """The body of a compile process, over the socket `fd` to its parent: imports, builds the compiler from
    the parent's TokenizerInfo, caps its address space, then answers ("ok", grammar JSON, seconds),
    ("error", message, 0) or ("memory", "", 0) for each (StructuredOutputs, fault) it is sent, until the
    socket closes; it dies with the thread that started it (PR_SET_PDEATHSIG)."""
    _die_with_parent()
    conn = Connection(fd)
    import jsonschema  # noqa: F401 - imported before the address space is capped
    import xgrammar

    info_json, threads = conn.recv()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(info_json), max_threads=threads,
                                        cache_enabled=False)  # the parent caches
    del info_json
    _cap_address_space(memory_limit)
    conn.send(("ready",))
    while True:
        try:
            so, fault = conn.recv()
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        try:
            if fault == "hang":  # tests: a compile that never ends
                threading.Event().wait()
            elif fault == "exit":  # tests: a compile that crashes its process
                os._exit(3)
            elif fault == "oom":  # tests: a compile that allocates twice its cap (which, uncapped, would succeed)
                hog = bytearray(2 * memory_limit)
                del hog
            text = compile_grammar(compiler, so).serialize_json()
            conn.send(("ok", text, time.perf_counter() - start))
        except ValueError as exc:
            conn.send(("error", str(exc), 0.0))
        except MemoryError:
            conn.send(("memory", "", 0.0))
        except Exception as exc:  # noqa: BLE001 - the request gets the error, the process goes on
            conn.send(("error", f"structured_outputs could not be compiled: {type(exc).__name__}: "
                                f"{_clip(_engine_message(exc))}", 0.0))


def _die_with_parent() -> None:
    """Linux: SIGKILL when the parent's thread that started this process exits (a dispatcher, which lives
    until shutdown), so a hung compile never outlives a killed server."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def _cap_address_space(limit: int) -> None:
    """RLIMIT_AS at what the process maps now plus `limit` bytes (torch's import alone maps 0.7-3 GiB)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        print("[orca.grammar] cannot read the address space size: no memory limit", file=sys.stderr, flush=True)
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size + limit if hard == resource.RLIM_INFINITY else min(size + limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
