"""Drives the engine core from a background thread: the scheduler thread of the Triton model.

The loop's thread builds the core and does all of its torch work, load to shutdown: on a CPU, stepping
from another thread gives the process a second OpenMP team (the worker's ``_foreign_thread``). Other
threads only enqueue (``submit``, ``abort``: token ids, never text); the loop applies commands between
iterations and hands each EngineCoreOutput to ``on_output``. It fails loudly (workers failed, a fatal
device error, a dead thread, an iteration past worker_timeout): ``failed`` says why, ``submit`` refuses,
``on_failure`` is called once. Threads: docs/design.md ("The serving path"); failures: "Failures and shutdown".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from orca.config import fault_spec
from orca.core.constraint import TokenConstraint
from orca.core.engine import EngineCore
from orca.core.errors import EngineFailedError, QueueFullError
from orca.core.outputs import EngineCoreOutput, EngineStats, IterationStats
from orca.core.request import FinishReason
from orca.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] | None
    cache_salt: str | None
    constraint: TokenConstraint | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """A call into the core made on the loop's thread between iterations (add_lora, remove_lora): its
    result, or what it raised, goes to `future`."""

    fn: Callable[[], Any]
    future: Future


_STOP = object()
_ABORT_ALL = object()


class EngineLoop:
    def __init__(
        self,
        build: Callable[[], EngineCore],
        on_output: Callable[[EngineCoreOutput], None],
        on_iteration: Callable[[IterationStats], None] | None = None,
        on_stats: Callable[[EngineStats], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
        fault: tuple[int, str] | None = None,
    ) -> None:
        """Starts the loop's thread, which calls ``build()``, and returns once it has (re-raising what it
        raised); requests submitted wait until ``start``. Callbacks run on the loop thread (keep them
        quick): on_output every output; on_iteration each iteration's stats, once; on_stats the `stats`
        snapshot whenever it changed, before that step's outputs; on_failure the reason, once (from the
        watchdog's thread for a hang: outputs may never come, the caller answers its requests).
        `fault` = (iteration, kind) injects a failure for the tests (fault_from_env)."""
        if fault is not None and fault[1] not in _FAULT_KINDS:
            raise ValueError(f"$ORCA_ENGINE_FAULT: unknown kind {fault[1]!r} ({', '.join(_FAULT_KINDS)})")
        self._on_output = on_output
        self._on_iteration = on_iteration
        self._on_stats = on_stats
        self._on_failure = on_failure
        self._failed: str | None = None
        self._fault = fault
        self._iterations = 0
        self._busy_since: float | None = None  # when the running step() began (the watchdog reads it)
        self._commands: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._queued_adds = 0
        self._published: EngineStats | None = None
        self._stopping = False
        self._built = threading.Event()
        self._go = threading.Event()  # start() (or shutdown()) lets the built engine's loop run
        self._build_error: BaseException | None = None
        self.core: EngineCore
        self._thread = threading.Thread(target=self._run, args=(build,), name="orca-scheduler", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        core = self.core
        self._stats = core.stats()
        # Worker processes have their own per-iteration deadline (orca/executor/distributed.py).
        self._watchdog = None if core.config.distributed else threading.Thread(
            target=self._watch, name="orca-watchdog", daemon=True
        )
        if fault is not None and fault[1] in _RAISE_KINDS and not hasattr(core.executor, "inject_fault"):
            self.shutdown()
            raise ValueError(f"$ORCA_ENGINE_FAULT kind {fault[1]} needs the in-process worker (no parallelism)")

    @property
    def failed(self) -> str | None:
        """Why the engine stopped serving, once it has."""
        return self._failed

    @property
    def stats(self) -> EngineStats:
        """The engine's snapshot after the last iteration (or command); `waiting` includes requests
        submitted but not yet handed to the engine."""
        with self._lock:
            return replace(self._stats, waiting=self._stats.waiting + self._queued_adds)

    def start(self) -> None:
        """Iterations begin (requests submitted before wait until now)."""
        self._go.set()
        if self._watchdog is not None:
            self._watchdog.start()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        eos_token_ids: frozenset[int] | None = None,
        cache_salt: str | None = None,
        constraint: TokenConstraint | None = None,
    ) -> None:
        """Validates (ValueError: the core's checks, here on the caller's thread and only here) and
        enqueues a request; QueueFullError when the waiting queue is full. Never waits for an iteration.
        `eos_token_ids`, `cache_salt`, `constraint`: EngineCore.add_request's."""
        if self._failed is not None:
            raise EngineFailedError(f"the engine has failed and serves no more requests: {self._failed}")
        self.core.validate(prompt_token_ids, params, cache_salt)
        with self._lock:
            if self._stopping:
                raise QueueFullError("the engine is shutting down")
            if self._stats.waiting + self._queued_adds >= self.core.config.max_queue:
                raise QueueFullError(
                    f"the waiting queue is full ({self.core.config.max_queue} requests): retry later"
                )
            self._queued_adds += 1
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(_Add(
            request_id, list(prompt_token_ids), params, arrival_time, eos_token_ids, cache_salt, constraint
        ))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # -- LoRA adapters (orca/core/lora.py), changed on the loop's thread between iterations -----------
    def add_lora(self, name: str, path: str, timeout: float | None = 120.0) -> Any:
        """Reads and checks the adapter's files here, on the caller's thread (EngineCore.read_lora: a slow
        disk holds up this call, never an iteration), then registers it with EngineCore.add_lora on the
        loop's thread, between iterations; waits for that and returns its LoRARequest, or raises what either
        raised (ValueError, LoRAError among them: the adapter is refused). A name already served is refused
        before any read."""
        self._check_running()
        self.core.check_new_lora(name, path)
        adapter = self.core.read_lora(name, path)
        return self._call_on_loop(lambda: self.core.add_lora(name, path, adapter), timeout)

    def remove_lora(self, name: str, timeout: float | None = 120.0) -> bool:
        """EngineCore.remove_lora on the loop's thread, between iterations: False if no adapter has that
        name. Requests already running with it run to their end."""
        return self._call_on_loop(lambda: self.core.remove_lora(name), timeout)

    def list_loras(self) -> list[Any]:
        """The adapters served now (a copy: any thread may call it)."""
        return list(self.core.loras.values())

    def _check_running(self) -> None:
        if self._failed is not None:
            raise EngineFailedError(f"the engine has failed and serves no more requests: {self._failed}")
        if not self._thread.is_alive():
            raise EngineFailedError("the engine has stopped")

    def _call_on_loop(self, fn: Callable[[], Any], timeout: float | None) -> Any:
        self._check_running()
        future: Future = Future()
        self._commands.put(_Call(fn, future))
        return future.result(timeout)

    def drain(self) -> None:
        """Refuses new requests from now on (QueueFullError, "shutting down"); those submitted go on."""
        with self._lock:
            self._stopping = True

    def abort_all(self) -> None:
        """Refuses new requests from now on (QueueFullError, "shutting down") and aborts every request
        submitted so far: each gets its 'cancelled' final output after the current iteration. The loop
        keeps running (the Triton model calls this when tritonserver's exit timeout is about to end)."""
        self.drain()
        self._commands.put(_ABORT_ALL)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops after the current iteration; every unfinished request gets a 'cancelled' output."""
        with self._lock:
            self._stopping = True
        self._commands.put(_STOP)
        self._go.set()  # a loop never started still answers what was submitted ("cancelled")
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the loop thread -------------------------------------------------------------------------
    def _run(self, build: Callable[[], EngineCore]) -> None:
        try:
            self.core = build()
        except BaseException as exc:  # noqa: BLE001 - __init__ re-raises it on the caller's thread
            self._build_error = exc
            return
        finally:
            self._built.set()
        self._go.wait()
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the thread dies: say so, never silently
            logger.exception("the scheduler thread died")
            self._fail(f"the scheduler thread died: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while True:
            idle = not self.core.has_unfinished()
            if not self._apply_commands(block=idle):
                break
            last = self.core.last_iteration
            self._iterations += 1
            self._busy_since = time.monotonic()
            if self._fault is not None and (self._iterations == self._fault[0] or (
                    self._fault[1] == "raise-always" and self._iterations > self._fault[0])):
                if self._fault[1] in _RAISE_KINDS:  # inside the worker's next iteration: it fails, the loop goes on
                    self.core.executor.inject_fault(
                        f"fault injected by $ORCA_ENGINE_FAULT in iteration {self._iterations}")
                else:
                    _inject(self._fault[1])  # a hang counts as the iteration's (the watchdog sees it)
            try:
                outputs = self.core.step()
            except Exception as exc:  # noqa: BLE001 - a scheduler bug must not silently kill the thread
                logger.exception("engine step failed outside the model; failing every request")
                outputs = self._fail_all(f"{type(exc).__name__}: {exc}")
            finally:
                self._busy_since = None
            if self._failed is not None:
                return  # the watchdog gave up on this iteration: its requests were answered already
            self._refresh_stats()
            # A step with nothing to run (only cancellations to report) leaves last_iteration as it was.
            if self.core.last_iteration is not last and self._on_iteration is not None:
                self._call(self._on_iteration, self.core.last_iteration)
            self._emit(outputs)
            if self.core.failed is not None:
                self._fail(self.core.failed)
        self._refuse_calls("the engine is shutting down")
        outputs = self._cancel_all()
        self._refresh_stats()
        self._emit(outputs)

    def _refuse_calls(self, reason: str) -> None:
        """Answers the calls (add_lora, remove_lora) still queued when the loop stops: they never run."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineFailedError(reason))

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._failed is not None:
                return
            self._failed = reason
        logger.error("the engine failed: %s", reason)
        if self._on_failure is not None:
            self._call(self._on_failure, reason)

    def _watch(self) -> None:
        """The watchdog: an iteration that runs longer than worker_timeout means a hung device."""
        limit = float(self.core.config.worker_timeout)
        while self._failed is None and not self._stopping:
            time.sleep(min(1.0, limit / 4))
            started = self._busy_since
            if started is not None and time.monotonic() - started > limit:
                self._fail(f"an iteration has run for more than worker_timeout ({limit:g} s): the device is hung")

    def _apply_commands(self, block: bool) -> bool:
        """Applies queued commands; returns False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                return False
            if cmd is _ABORT_ALL:
                self._abort_every_request()
                continue
            if isinstance(cmd, _Add):
                with self._lock:  # counted as waiting until the refresh below says what the core holds, so
                    self._queued_adds -= 1  # a submit on another thread never sees it in neither count
                    self._stats = replace(self._stats, waiting=self._stats.waiting + 1)
                try:  # (validated by submit)
                    self.core.add_request(
                        cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.arrival_time, cmd.eos_token_ids,
                        cmd.cache_salt, cmd.constraint,
                    )
                except (ValueError, QueueFullError, EngineFailedError) as exc:
                    self._emit([_failed(cmd.request_id, str(exc))])
                self._refresh_stats()
            elif isinstance(cmd, _Abort):
                self.core.abort_request(cmd.request_id)
            elif isinstance(cmd, _Call):
                if cmd.future.set_running_or_notify_cancel():
                    try:
                        cmd.future.set_result(cmd.fn())
                    except Exception as exc:  # noqa: BLE001 - the caller's to handle
                        cmd.future.set_exception(exc)
                self._refresh_stats()

    def _refresh_stats(self) -> None:
        stats = self.core.stats()
        with self._lock:
            self._stats = stats
            snapshot = replace(stats, waiting=stats.waiting + self._queued_adds)
        if self._on_stats is not None and snapshot != self._published:
            self._published = snapshot
            self._call(self._on_stats, snapshot)

    @staticmethod
    def _call(callback: Callable[[Any], None], arg: Any) -> None:
        try:
            callback(arg)
        except Exception:  # noqa: BLE001 - a metrics callback must not stop the loop
            logger.exception("%s failed", getattr(callback, "__name__", callback))

    def _emit(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            try:
                self._on_output(out)
            except Exception:  # noqa: BLE001 - one bad callback must not stop the loop
                logger.exception("on_output failed for request %s", out.request_id)

    def _abort_every_request(self) -> None:
        """Each unfinished request's 'cancelled' output comes from the engine's next step()."""
        for request_id in self.core.request_ids():
            self.core.abort_request(request_id)

    def _cancel_all(self) -> list[EngineCoreOutput]:
        self._abort_every_request()
        return self.core.step()

    def _fail_all(self, message: str) -> list[EngineCoreOutput]:
        outputs = self._cancel_all()
        for out in outputs:
            out.finish_reason, out.error = FinishReason.ERROR, message
        return outputs


_RAISE_KINDS = ("raise", "raise-always")
_FAULT_KINDS = ("hang", "crash", *_RAISE_KINDS)


def fault_from_env(model_name: str) -> tuple[int, str] | None:
    """Fault injection for the tests, only with $ORCA_ENABLE_FAULT_INJECTION=1 (orca.config.fault_spec):
    $ORCA_ENGINE_FAULT = "MODEL:ITERATION:KIND"[,...]; KIND hang or crash the loop at that iteration,
    raise fails that iteration in the worker, raise-always every one from it (a sticky device error)."""
    spec = fault_spec("ORCA_ENGINE_FAULT")
    for item in filter(None, spec.split(",")):
        name, iteration, kind = item.split(":")
        if name == model_name:
            return int(iteration), kind
    return None


class _InjectedCrash(BaseException):
    """Escapes every handler of the loop, as a bug in it would."""


def _inject(kind: str) -> None:
    """hang or crash (EngineLoop.__init__ refused other kinds; the loop hands raise to the worker)."""
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "crash":
        raise _InjectedCrash("fault injected by $ORCA_ENGINE_FAULT")


def _failed(request_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=message, time=time.monotonic())
