"""Structured outputs: a request's JSON schema, regex, choice or grammar, compiled into a token constraint.

The front end owns a constraint's text side, the engine core its token side (orca/core/constraint.py).
``StructuredOutputCompiler`` compiles with the model's tokenizer (xgrammar: orca/frontend/grammar.py) in
compile processes (orca/frontend/compile_process.py), so a compile never blocks an iteration or the caller;
a compile past ``deadline`` is killed, waiting requests are bounded by ``max_pending`` (QueueFullError:
orca-openai answers 429), and a cancelled or timed-out request frees its place. Compiled grammars are cached
by their canonical text. xgrammar is imported with the first constrained request (or ``warm_up``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orca.core.errors import QueueFullError
from orca.frontend.compile_process import CompileProcess
from orca.frontend.grammar import GrammarConstraint
from orca.structured_outputs_params import StructuredOutputs

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
_SWEEP_S = 0.5  # how often an idle dispatcher asks the queued requests whether they were cancelled
CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""


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
        self._processes: list[CompileProcess] = []
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
            process = CompileProcess(self)
            thread = threading.Thread(target=self._dispatch, args=(process,), daemon=True,
                                      name=f"orca-grammar-{len(self._dispatchers)}")
            self._processes.append(process)
            self._dispatchers.append(thread)
            thread.start()

    def _dispatch(self, process: CompileProcess) -> None:
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

