"""The scheduler thread (orca.engine_loop.EngineLoop) that the Triton model drives: it never blocks the
caller, reports every output through its callback, and gives every request exactly one final output —
on completion, abort, client cancellation, and shutdown."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest
from _fixtures import tiny_engine

from orca import QueueFullError, RequestOutput, SamplingParams
from orca.engine_loop import EngineLoop

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


def make_loop(**options: Any) -> tuple[EngineLoop, Collector]:
    collector = Collector()
    loop = EngineLoop(tiny_engine("gpt2", **options), on_output=collector)
    loop.start()
    return loop, collector


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


def test_abort_and_client_cancellation_finish_once_and_free_slots() -> None:
    cancelled: set[str] = set()
    col = Collector()
    engine = tiny_engine("gpt2")
    loop = EngineLoop(engine, on_output=col, poll_cancelled=lambda: list(cancelled))
    loop.start()
    try:
        long = SamplingParams(max_tokens=100, ignore_eos=True)
        loop.submit("aborted", [1, 2], long)
        loop.submit("client-gone", [3, 4], long)
        loop.abort("aborted")
        cancelled.add("client-gone")
        assert col.wait_final("aborted").finish_reason == "cancelled"
        assert col.wait_final("client-gone").finish_reason == "cancelled"
        cancelled.clear()
        loop.submit("after", [5], GREEDY)  # the loop serves on
        assert col.wait_final("after").finish_reason == "length"
    finally:
        loop.shutdown()
    assert all(len(v) == 1 for v in col.finals.values()), col.finals
    assert engine.slots.n_reserved == 0 and len(engine.runner.kv_cache) == 0


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
    engine = tiny_engine("gpt2", max_bs=1, max_queue=2)
    col = Collector()
    loop = EngineLoop(engine, on_output=col)  # not started: nothing is admitted, everything waits
    loop.submit("a", [1], GREEDY)
    loop.submit("b", [1], GREEDY)
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        loop.submit("c", [1], GREEDY)
    loop.start()
    assert col.wait_final("a").finish_reason == "length"
    assert col.wait_final("b").finish_reason == "length"
    loop.shutdown()
