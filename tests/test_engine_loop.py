"""The scheduler thread (orca.core.engine_loop.EngineLoop) that the Triton model drives: it never blocks the
caller, reports every output through its callback, and gives every request exactly one final output —
on completion, abort (how the Triton model passes on a client's cancellation), and shutdown. Its stats
callbacks feed the model's metrics: one per iteration that ran, and the engine's snapshot whenever it
changes, so the last one published always describes the engine as it is, idle included."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import pytest
from _fixtures import RequestOutputs, tiny_core, tiny_engine

from orca import QueueFullError, RequestOutput, SamplingParams
from orca.core.engine_loop import EngineLoop
from orca.core.outputs import EngineStats, IterationStats

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class Collector:
    def __init__(self) -> None:
        self.outputs: queue.Queue[RequestOutput] = queue.Queue()
        self.finals: dict[str, list[RequestOutput]] = {}
        self.lock = threading.Lock()

    def __call__(self, out: RequestOutput) -> None:
        if out.finished:
            with self.lock:
                self.finals.setdefault(out.request_id, []).append(out)
        self.outputs.put(out)

    def wait_final(self, request_id: str, timeout: float = 60) -> RequestOutput:
        while True:
            out = self.outputs.get(timeout=timeout)
            if out.request_id == request_id and out.finished:
                return out


class StatsRecorder:
    """Records both stats callbacks, checking that they run on the loop thread."""

    def __init__(self) -> None:
        self.iterations: list[IterationStats] = []
        self.snapshots: list[EngineStats] = []

    def on_iteration(self, stats: IterationStats) -> None:
        assert threading.current_thread().name == "orca-scheduler"
        self.iterations.append(stats)

    def on_stats(self, stats: EngineStats) -> None:
        assert threading.current_thread().name == "orca-scheduler"
        self.snapshots.append(stats)


def make_loop(recorder: StatsRecorder | None = None, **options: Any) -> tuple[EngineLoop, Collector]:
    collector = Collector()
    callbacks = {} if recorder is None else {"on_iteration": recorder.on_iteration, "on_stats": recorder.on_stats}
    loop = EngineLoop(lambda: tiny_core("gpt2", **options), on_output=RequestOutputs(collector), **callbacks)
    loop.start()
    return loop, collector


def is_idle(stats: EngineStats) -> bool:
    return (stats.running, stats.waiting, stats.kv_allocated_blocks, stats.kv_used_tokens) == (0, 0, 0, 0)


def test_outputs_stream_per_iteration_and_match_the_synchronous_engine() -> None:
    loop, col = make_loop()
    try:
        loop.submit("a", [1, 2, 3], GREEDY)
        final = col.wait_final("a")
        assert final.finish_reason == "length" and len(final.token_ids) == 8
        reference = tiny_engine("gpt2")
        reference.add_request("a", [1, 2, 3], GREEDY)
        while reference.has_unfinished():
            outs = reference.step()
        assert outs[-1].token_ids == final.token_ids
    finally:
        loop.shutdown()


def test_validation_errors_are_raised_in_the_callers_thread() -> None:
    loop, _ = make_loop()
    try:
        with pytest.raises(ValueError, match="prompt is empty"):
            loop.submit("x", [], GREEDY)
        with pytest.raises(ValueError, match="out of range"):
            loop.submit("x", [10_000], GREEDY)
    finally:
        loop.shutdown()


def test_abort_of_running_and_waiting_requests_finishes_once_and_frees_blocks() -> None:
    col = Collector()
    first_output, aborted = threading.Event(), threading.Event()

    def on_output(out: RequestOutput) -> None:
        col(out)
        if out.request_id == "running" and not first_output.is_set():
            first_output.set()
            assert aborted.wait(60)  # holds the loop thread: the aborts land before the next iteration

    loop = EngineLoop(lambda: tiny_core("gpt2", max_bs=1), on_output=RequestOutputs(on_output))
    loop.start()
    try:
        long = SamplingParams(max_tokens=120, ignore_eos=True)  # the tiny model's context is 128
        loop.submit("running", [1, 2], long)
        loop.submit("waiting", [3, 4], long)  # max_bs 1: waits behind "running"
        assert first_output.wait(60)
        assert loop.stats.running == 1 and loop.stats.waiting == 1 and loop.stats.kv_allocated_blocks >= 1
        loop.abort("waiting")
        loop.abort("running")
        aborted.set()
        assert col.wait_final("waiting").finish_reason == "cancelled"
        final = col.wait_final("running")
        assert final.finish_reason == "cancelled" and 0 < len(final.token_ids) < 120
        loop.abort("running")  # again, and an id never seen: both are no-ops
        loop.abort("never-submitted")
        loop.submit("after", [5], GREEDY)  # the loop serves on
        assert col.wait_final("after").finish_reason == "length"
    finally:
        loop.shutdown()
    assert all(len(v) == 1 for v in col.finals.values()), col.finals
    assert sorted(col.finals) == ["after", "running", "waiting"]
    assert is_idle(loop.core.stats()) and is_idle(loop.stats)


def test_on_iteration_runs_once_per_iteration_that_ran() -> None:
    rec = StatsRecorder()
    loop, col = make_loop(rec)
    try:
        loop.submit("a", [1, 2, 3], GREEDY)  # no token budget: the prompt and the 8 tokens take 8 iterations
        col.wait_final("a")
        assert [it.batch_size for it in rec.iterations] == [1] * 8
        assert rec.iterations[0].num_initiation == 1 and rec.iterations[0].num_tokens == 3
        loop.abort("unknown")  # wakes the loop for a step with nothing to run: no iteration to report
        loop.submit("b", [4], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        col.wait_final("b")
        assert len(rec.iterations) == 10
    finally:
        loop.shutdown()


def test_on_stats_publishes_each_change_and_the_idle_state_before_the_final_output() -> None:
    rec = StatsRecorder()
    loop, col = make_loop(rec, block_size=4)
    try:
        loop.submit("a", [1, 2, 3], GREEDY)
        col.wait_final("a")
        # Published before the final output was handed on: nothing else has to happen for it.
        assert is_idle(rec.snapshots[-1]) and rec.snapshots[-1] == loop.stats
        busy = [s for s in rec.snapshots if s.running]
        used = max(s.kv_used_tokens for s in busy)
        assert 3 <= used <= 3 + 8 and max(s.kv_allocated_blocks for s in busy) == -(-used // 4)
        assert all(s.kv_allocated_slots == 4 * s.kv_allocated_blocks for s in rec.snapshots)
        assert all(a != b for a, b in zip(rec.snapshots, rec.snapshots[1:]))  # changes only
        assert {s.n_slots for s in rec.snapshots} == {loop.core.n_slots}

        loop.submit("long", [1, 2], SamplingParams(max_tokens=120, ignore_eos=True))
        while col.outputs.get(timeout=60).request_id != "long":
            pass
        assert rec.snapshots[-1].running == 1
        loop.abort("long")
        col.wait_final("long")
        assert is_idle(rec.snapshots[-1])
    finally:
        loop.shutdown()


def test_preemptions_are_counted_in_the_stats() -> None:
    rec = StatsRecorder()
    # 8 blocks of 16 tokens: each request alone fits (2 + 100 tokens), any two at full length do not.
    loop, col = make_loop(rec, n_slots=128, kv_admission="on_demand")
    ids = [f"r{i}" for i in range(4)]
    try:
        for i, rid in enumerate(ids):
            loop.submit(rid, [i + 1, i + 2], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        finals = [col.wait_final(rid) for rid in ids]
    finally:
        loop.shutdown()
    assert [(f.finish_reason, len(f.token_ids)) for f in finals] == [("length", 100)] * 4
    preemptions = [s.preemptions for s in rec.snapshots]
    assert preemptions == sorted(preemptions) and preemptions[-1] > 0
    assert preemptions[-1] == loop.core.stats().preemptions
    assert all(s.kv_allocated_blocks <= 8 for s in rec.snapshots)
    assert is_idle(rec.snapshots[-1])


def test_a_failing_stats_callback_does_not_stop_the_loop() -> None:
    def broken(_: Any) -> None:
        raise RuntimeError("metrics are down")

    col = Collector()
    loop = EngineLoop(lambda: tiny_core("gpt2"), on_output=RequestOutputs(col), on_iteration=broken, on_stats=broken)
    loop.start()
    try:
        loop.submit("a", [1, 2, 3], GREEDY)
        assert col.wait_final("a").finish_reason == "length" and len(col.finals["a"][0].token_ids) == 8
    finally:
        loop.shutdown()


def test_shutdown_cancels_everything_in_flight_with_one_final_each() -> None:
    loop, col = make_loop(max_bs=2)
    ids = [f"r{i}" for i in range(6)]
    for rid in ids:  # two run, four wait
        loop.submit(rid, [1, 2, 3], SamplingParams(max_tokens=120, ignore_eos=True))
    loop.shutdown()
    assert sorted(col.finals) == ids
    assert all(len(v) == 1 for v in col.finals.values())
    assert {v[0].finish_reason for v in col.finals.values()} <= {"cancelled", "length"}
    with pytest.raises(QueueFullError, match="shutting down"):
        loop.submit("late", [1], GREEDY)


def test_waiting_queue_bound_refuses_at_once() -> None:
    col = Collector()
    # not started: nothing is admitted, everything waits
    loop = EngineLoop(lambda: tiny_core("gpt2", max_bs=1, max_queue=2), on_output=RequestOutputs(col))
    loop.submit("a", [1], GREEDY)
    loop.submit("b", [1], GREEDY)
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        loop.submit("c", [1], GREEDY)
    loop.start()
    assert col.wait_final("a").finish_reason == "length"
    assert col.wait_final("b").finish_reason == "length"
    loop.shutdown()


def test_a_request_handed_to_the_engine_counts_as_waiting_throughout() -> None:
    """The loop moves a submitted request from its own count into the engine's: at no moment between the
    two may the waiting count drop, or a submit on another thread slips past max_queue (seen in CI)."""
    col = Collector()
    loop = EngineLoop(lambda: tiny_core("gpt2", max_bs=1, max_queue=2), on_output=RequestOutputs(col))
    seen: list[int] = []
    add_request = loop.core.add_request

    def add_request_watched(*args: Any) -> None:  # on the loop thread, as the engine takes a request
        seen.append(loop.stats.waiting)
        add_request(*args)
        seen.append(loop.stats.waiting)

    loop.core.add_request = add_request_watched  # type: ignore[method-assign]
    loop.submit("a", [1], GREEDY)
    loop.submit("b", [1], GREEDY)
    loop.start()
    assert col.wait_final("a").finish_reason == "length"
    assert col.wait_final("b").finish_reason == "length"
    loop.shutdown()
    assert seen[:2] == [2, 2], seen  # "a" handed over: still two waiting before and after


@pytest.mark.parametrize("kind,words", [("hang", "hung"), ("crash", "scheduler thread died")])
def test_a_hung_iteration_or_a_dead_thread_fails_the_loop_loudly(kind: str, words: str) -> None:
    """An iteration that runs past worker_timeout (the watchdog) or a loop thread that dies: on_failure
    gets the reason once, `failed` says it, and submit refuses new requests with it."""
    import time

    from orca import EngineFailedError

    failures: queue.Queue[str] = queue.Queue()
    collector = Collector()
    loop = EngineLoop(lambda: tiny_core("gpt2", worker_timeout=1), on_output=RequestOutputs(collector),
                      on_failure=failures.put, fault=(3, kind))
    loop.start()
    start = time.monotonic()
    loop.submit("a", [1, 2, 3], GREEDY)
    reason = failures.get(timeout=30)
    assert words in reason and loop.failed == reason
    if kind == "hang":
        assert time.monotonic() - start >= 1  # not before worker_timeout
    with pytest.raises(EngineFailedError, match=words):
        loop.submit("b", [1, 2], GREEDY)
    assert failures.empty()  # once


# -- one thread for the engine's torch work -----------------------------------------------------------
def _native_threads() -> set[int]:
    """The process's threads as the OS sees them (Linux), the OpenMP teams' workers included."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _serve(loop: EngineLoop, collector: Collector, n: int) -> None:
    for i in range(n):
        loop.submit(f"t{i}", [1 + i, 2, 3, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True))
    for i in range(n):
        assert collector.wait_final(f"t{i}").finish_reason == "length"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_the_loop_builds_its_engine_on_its_own_thread_and_steps_it_there() -> None:
    """On a CPU every thread that runs torch's parallel ops gets an OpenMP team of its own, and two teams
    on two cores make every op slower (orca/worker _foreign_thread). The loop's thread loads and warms up
    the engine, so serving requests afterwards starts no thread in the process but the watchdog: no
    second team. The same engine stepped from a thread other than its loader's does start new threads
    (its team), which the worker counts and logs: what this test would see if the loop stepped an engine
    built elsewhere."""
    import torch

    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: no OpenMP team to see")
    collector = Collector()
    loop = EngineLoop(lambda: tiny_core("gpt2"), on_output=RequestOutputs(collector))
    try:
        worker = loop.core.executor.worker
        assert worker.load_thread == loop._thread.ident != threading.get_ident()
        before = _native_threads()
        loop.start()
        _serve(loop, collector, 6)
        new = _native_threads() - before
        python_threads = {t.native_id for t in threading.enumerate()}
        assert new - python_threads == set(), "stepping started threads the load did not: a second OpenMP team"
        assert worker.foreign_thread_iterations == 0
    finally:
        loop.shutdown()

    # The wrong way round, to show that the check above can fail: built on one thread, stepped on another
    # (each kept alive while its threads are counted: a team ends with its thread).
    built: dict[str, Any] = {}

    def step_all() -> None:
        engine = built["engine"]
        engine.add_request("x", [1, 2, 3, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()

    release = threading.Event()
    try:
        _on_live_thread(lambda: built.update(engine=tiny_engine("gpt2")), release)
        assert _on_live_thread(step_all, release), "stepping on another thread than the loader's started no team"
    finally:
        release.set()
    assert built["engine"].executor.worker.foreign_thread_iterations > 0


def _on_live_thread(fn: Any, release: threading.Event) -> set[int]:
    """Runs fn on a new thread that then waits for `release`; returns the native threads it started that
    are not Python threads (an OpenMP team's workers)."""
    done = threading.Event()

    def body() -> None:
        try:
            fn()
        finally:
            done.set()
        release.wait()

    before = _native_threads()
    threading.Thread(target=body, daemon=True).start()
    done.wait()
    return _native_threads() - before - {t.native_id for t in threading.enumerate()}


def test_a_build_that_fails_raises_on_the_callers_thread() -> None:
    def broken() -> Any:
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        EngineLoop(broken, on_output=lambda out: None)
