"""The scheduler (Algorithm 1's select and the return of a batch) and the K/V slot bookkeeping, in pure
Python: Request objects built directly, no model, no tensors."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca.kv_cache import KVSlotManager
from orca.request import FinishReason, Phase, Request
from orca.sampling_params import SamplingParams
from orca.scheduler import OrcaScheduler, ScheduledBatch


def make_request(arrival: int, prompt_len: int, max_new: int) -> Request:
    return Request(
        request_id=f"r{arrival}",
        prompt_token_ids=[1] * prompt_len,
        params=SamplingParams(max_tokens=max_new),
        arrival=arrival,
        seed=0,
    )


def make_scheduler(n_slots: int, max_bs: int = 8, n_workers: int = 1) -> OrcaScheduler:
    return OrcaScheduler(max_bs, KVSlotManager(n_slots), n_workers)


def finish_iteration(sched: OrcaScheduler, batch: ScheduledBatch, finish: set[str] = frozenset()) -> list[Request]:
    """What the engine does when a batch returns: one new token per member, finish those asked to (or at
    max_tokens), then hand the batch back to the scheduler."""
    for req in batch.requests:
        req.output_token_ids.append(7)
        req.num_computed_tokens += len(req.prompt_token_ids) if req.num_computed_tokens == 0 else 1
        if req.request_id in finish:
            req.finish_reason = FinishReason.STOP
        elif len(req.output_token_ids) >= req.params.max_tokens:
            req.finish_reason = FinishReason.LENGTH
    return sched.complete(batch)


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


# -- select(): deterministic examples ---------------------------------------------------------------
def test_select_breaks_instead_of_letting_a_smaller_later_request_jump_the_queue() -> None:
    # n_slots 10: r0 needs 6 slots; r1 needs 6 (6 + 6 > 10: does not fit); r2 needs 3 and would fit
    # (6 + 3 <= 10), but it arrived after r1, so admitting it would starve r1. Algorithm 1 breaks.
    sched = make_scheduler(n_slots=10)
    r0, r1, r2 = make_request(0, 3, 3), make_request(1, 2, 4), make_request(2, 1, 2)
    for r in (r0, r1, r2):
        sched.add(r)
    batch = sched.schedule()
    assert batch is not None
    assert ids(batch.requests) == ["r0"] and ids(batch.admitted) == ["r0"]
    assert sched.slots.n_reserved == 6
    assert not r1.reserved and not r2.reserved
    assert (sched.num_running, sched.num_waiting) == (1, 2)

    # r0 keeps running alone (its reservation covers it), r1 and r2 keep waiting.
    assert finish_iteration(sched, batch) == []
    batch = sched.schedule()
    assert batch is not None and ids(batch.requests) == ["r0"] and batch.admitted == []

    # r0 finishes: its 6 slots return, and now r1 and r2 (6 + 3 = 9 <= 10) are both admitted, in order.
    assert finish_iteration(sched, batch, finish={"r0"}) == [r0]
    assert sched.slots.n_reserved == 0
    batch = sched.schedule()
    assert batch is not None
    assert ids(batch.requests) == ["r1", "r2"] and ids(batch.admitted) == ["r1", "r2"]
    assert sched.slots.n_reserved == 9


def test_select_mixes_increment_and_initiation_and_respects_max_bs() -> None:
    sched = make_scheduler(n_slots=100, max_bs=3)
    reqs = [make_request(i, 2 + i, 4) for i in range(5)]
    for r in reqs[:2]:
        sched.add(r)
    first = sched.schedule()
    assert first is not None and ids(first.requests) == ["r0", "r1"]
    finish_iteration(sched, first)
    assert all(r.phase is Phase.INCREMENT for r in reqs[:2])
    for r in reqs[2:]:
        sched.add(r)
    # r0, r1 are in increment, r2 joins in initiation; max_bs 3 leaves r3 and r4 waiting (unadmitted).
    second = sched.schedule()
    assert second is not None
    assert ids(second.requests) == ["r0", "r1", "r2"] and ids(second.admitted) == ["r2"]
    assert not reqs[3].reserved and not reqs[4].reserved
    finish_iteration(sched, second, finish={"r0"})
    third = sched.schedule()
    assert third is not None and ids(third.requests) == ["r1", "r2", "r3"] and ids(third.admitted) == ["r3"]


def test_schedule_returns_none_when_nothing_can_run() -> None:
    sched = make_scheduler(n_slots=5)
    assert sched.schedule() is None  # empty pool
    big = make_request(0, 3, 3)  # 6 slots > 5: never fits (the engine refuses such requests up front)
    sched.add(big)
    assert sched.schedule() is None
    assert sched.slots.n_reserved == 0 and not big.reserved


def test_requests_must_arrive_in_order_and_have_unique_ids() -> None:
    sched = make_scheduler(n_slots=50)
    sched.add(make_request(3, 1, 1))
    with pytest.raises(ValueError, match="arrival order"):
        sched.add(make_request(2, 1, 1))
    dup = make_request(4, 1, 1)
    dup.request_id = "r3"
    with pytest.raises(ValueError, match="already in use"):
        sched.add(dup)


@pytest.mark.parametrize(("max_bs", "n_workers"), [(0, 1), (True, 1), (2, 0), (2, 1.5)])
def test_scheduler_rejects_bad_options(max_bs: object, n_workers: object) -> None:
    with pytest.raises(ValueError, match="max_bs|n_workers"):
        OrcaScheduler(max_bs, KVSlotManager(10), n_workers)  # type: ignore[arg-type]


@pytest.mark.parametrize("n_slots", [0, -1, True, 2.0, None])
def test_slot_manager_rejects_bad_n_slots(n_slots: object) -> None:
    with pytest.raises(ValueError, match="n_slots"):
        KVSlotManager(n_slots)  # type: ignore[arg-type]


def test_slot_manager_reserves_max_tokens_and_releases_once() -> None:
    slots = KVSlotManager(10)
    a, b = make_request(0, 4, 3), make_request(1, 2, 2)
    slots.reserve(a)
    assert slots.n_reserved == 7 and a.reserved
    assert not slots.can_reserve(make_request(2, 2, 2))  # 7 + 4 > 10
    with pytest.raises(RuntimeError, match="already holds"):
        slots.reserve(a)
    with pytest.raises(RuntimeError, match="exceed"):
        slots.reserve(make_request(3, 3, 3))
    slots.release(a)
    slots.release(a)  # idempotent: a second release must not free someone else's slots
    slots.release(b)  # never reserved: nothing to free
    assert slots.n_reserved == 0


# -- abort in every state --------------------------------------------------------------------------
def test_abort_waiting_request() -> None:
    sched = make_scheduler(n_slots=10)
    r0, r1 = make_request(0, 4, 4), make_request(1, 4, 4)  # r1 waits: 8 + 8 > 10
    sched.add(r0)
    sched.add(r1)
    batch = sched.schedule()
    assert batch is not None and ids(batch.requests) == ["r0"]
    assert sched.abort("r1") is r1
    assert r1.finish_reason is FinishReason.CANCELLED and "r1" not in sched
    assert sched.slots.n_reserved == 8  # only r0's
    assert sched.abort("r1") is None  # unknown now


def test_abort_admitted_idle_request_frees_its_slots_at_once() -> None:
    sched = make_scheduler(n_slots=20)
    r0, r1 = make_request(0, 4, 4), make_request(1, 2, 2)
    sched.add(r0)
    sched.add(r1)
    batch = sched.schedule()
    assert batch is not None
    finish_iteration(sched, batch)
    assert r0.reserved and not r0.running and sched.slots.n_reserved == 12
    assert sched.abort("r0") is r0
    assert r0.finish_reason is FinishReason.CANCELLED and not r0.reserved
    assert sched.slots.n_reserved == 4
    batch = sched.schedule()
    assert batch is not None and ids(batch.requests) == ["r1"]


def test_abort_in_flight_request_leaves_when_its_batch_returns() -> None:
    sched = make_scheduler(n_slots=20)
    r0, r1 = make_request(0, 4, 4), make_request(1, 2, 8)
    sched.add(r0)
    sched.add(r1)
    batch = sched.schedule()
    assert batch is not None
    assert sched.abort("r0") is None  # in flight: only marked
    assert "r0" in sched and r0.reserved and sched.slots.n_reserved == 18
    finished = finish_iteration(sched, batch)
    assert finished == [r0] and r0.finish_reason is FinishReason.CANCELLED
    assert "r0" not in sched and sched.slots.n_reserved == 10


def test_abort_in_flight_request_that_finished_anyway_keeps_its_reason() -> None:
    sched = make_scheduler(n_slots=20)
    r0 = make_request(0, 4, 1)
    sched.add(r0)
    batch = sched.schedule()
    assert batch is not None
    sched.abort("r0")
    assert finish_iteration(sched, batch) == [r0]
    assert r0.finish_reason is FinishReason.LENGTH and sched.slots.n_reserved == 0


# -- n_workers > 1: several batches in flight ------------------------------------------------------
def test_two_workers_keep_two_disjoint_batches_in_flight() -> None:
    sched = make_scheduler(n_slots=100, max_bs=2, n_workers=2)
    reqs = [make_request(i, 3, 5) for i in range(5)]
    for r in reqs:
        sched.add(r)
    b0 = sched.schedule()
    b1 = sched.schedule()
    assert b0 is not None and b1 is not None
    assert ids(b0.requests) == ["r0", "r1"] and ids(b1.requests) == ["r2", "r3"]
    assert sched.num_in_flight == 2 and not sched.can_schedule()
    assert sched.schedule() is None  # n_workers batches in flight: wait for one to return
    with pytest.raises(RuntimeError, match="order"):
        sched.complete(b1)  # batches return in the order they were scheduled
    finish_iteration(sched, b0)
    # r0 and r1 are free again; they arrived first, so they go before r4 (which still waits).
    b2 = sched.schedule()
    assert b2 is not None and ids(b2.requests) == ["r0", "r1"]
    assert not set(ids(b2.requests)) & set(ids(b1.requests))
    assert not reqs[4].reserved


# -- properties ------------------------------------------------------------------------------------
@dataclass
class Harness:
    """Drives an OrcaScheduler the way the engine does and checks its invariants after every event."""

    n_slots: int
    max_bs: int
    n_workers: int
    sched: OrcaScheduler = field(init=False)
    requests: list[Request] = field(default_factory=list)  # every request ever added, in arrival order
    in_flight: deque[ScheduledBatch] = field(default_factory=deque)
    iterations: dict[str, int] = field(default_factory=dict)  # iterations each request was scheduled in

    def __post_init__(self) -> None:
        self.sched = make_scheduler(self.n_slots, self.max_bs, self.n_workers)

    def pool(self) -> list[Request]:
        return [r for r in self.requests if r.request_id in self.sched]

    def add(self, prompt_len: int, max_new: int) -> None:
        req = make_request(len(self.requests), prompt_len, max_new)
        self.requests.append(req)
        self.iterations[req.request_id] = 0
        self.sched.add(req)

    def schedule(self) -> None:
        busy = {r.request_id for b in self.in_flight for r in b.requests}
        waiting_before = [r for r in self.pool() if not r.reserved]
        batch = self.sched.schedule()
        if batch is None:
            return
        assert 1 <= len(batch.requests) <= self.max_bs
        assert len(set(ids(batch.requests))) == len(batch.requests)
        assert not busy & set(ids(batch.requests)), "a request in flight was scheduled again"
        assert all(r.running for r in batch.requests)
        # Admitted = exactly the members that were waiting, and they are the oldest waiting ones.
        assert ids(batch.admitted) == [r.request_id for r in batch.requests if r in waiting_before]
        assert ids(batch.admitted) == ids(waiting_before[: len(batch.admitted)])
        for req in batch.requests:
            self.iterations[req.request_id] += 1
        self.in_flight.append(batch)

    def complete(self, finish_flags: list[bool]) -> None:
        if not self.in_flight:
            return
        batch = self.in_flight.popleft()
        finish = {r.request_id for r, f in zip(batch.requests, finish_flags) if f}
        finished = finish_iteration(self.sched, batch, finish)
        assert ids(finished) == [r.request_id for r in batch.requests if r.finished]
        for req in batch.requests:
            assert not req.running and req.phase is Phase.INCREMENT
            assert (req.request_id in self.sched) != req.finished
            assert not req.finished or not req.reserved
            # Aborted while in flight: it leaves now, with its slots (as cancelled, unless it finished anyway).
            assert not req.aborted or req.finished

    def abort(self, pick: int) -> None:
        pool = self.pool()
        if not pool:
            return
        req = pool[pick % len(pool)]
        was_running, was_reserved, before = req.running, req.reserved, self.sched.slots.n_reserved
        result = self.sched.abort(req.request_id)
        if was_running:
            assert result is None and req.aborted and req.request_id in self.sched
            assert self.sched.slots.n_reserved == before
        else:
            assert result is req and req.finish_reason is FinishReason.CANCELLED
            assert req.request_id not in self.sched and not req.reserved
            assert self.sched.slots.n_reserved == before - (req.max_tokens if was_reserved else 0)

    def check(self) -> None:
        pool = self.pool()
        reserved = [r for r in pool if r.reserved]
        assert self.sched.slots.n_reserved == sum(r.max_tokens for r in reserved)
        assert self.sched.slots.n_reserved <= self.n_slots
        assert self.sched.num_in_flight == len(self.in_flight) <= self.n_workers
        # FCFS admission: admitted requests are always the oldest ones in the pool (break, not continue).
        assert reserved == pool[: len(reserved)], "a request was admitted while an earlier one waits"
        flying = [r.request_id for b in self.in_flight for r in b.requests]
        assert len(flying) == len(set(flying)), "a request is in two batches in flight"
        assert sorted(flying) == sorted(r.request_id for r in pool if r.running)
        # Iteration-level FCFS: an earlier request has run at least as many iterations as a later one.
        counts = [self.iterations[r.request_id] for r in pool]
        assert all(a >= b for a, b in zip(counts, counts[1:])), counts

    def drain(self) -> None:
        """Runs every remaining request to completion (each finishes at its max_tokens)."""
        budget = 10 * sum(r.params.max_tokens + 2 for r in self.requests) + 10
        for _ in range(budget):
            if not self.sched.has_unfinished() and not self.in_flight:
                break
            if self.sched.can_schedule():
                before = len(self.in_flight)
                self.schedule()
                if len(self.in_flight) == before:
                    # Nothing schedulable: wait for a batch to return. With nothing in flight either,
                    # the scheduler is stuck with requests left: a liveness bug.
                    assert self.in_flight, "requests are left but nothing can be scheduled"
                    self.complete([])
            else:
                self.complete([])
            self.check()
        else:
            raise AssertionError("requests did not complete")
        assert all(r.finished for r in self.requests)
        assert self.sched.slots.n_reserved == 0
        assert self.sched.num_running == 0 and self.sched.num_waiting == 0


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 12), st.integers(1, 12)),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("complete"), st.lists(st.booleans(), max_size=6)),
        st.tuples(st.just("abort"), st.integers(0, 63)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    n_slots=st.integers(24, 60),  # >= the largest max_tokens (24): every request can run alone
    max_bs=st.integers(1, 5),
    n_workers=st.integers(1, 3),
    ops=OPS,
)
def test_scheduler_invariants_under_random_events(n_slots: int, max_bs: int, n_workers: int, ops: list) -> None:
    h = Harness(n_slots, max_bs, n_workers)
    for op in ops:
        if op[0] == "add":
            h.add(op[1], op[2])
        elif op[0] == "schedule":
            h.schedule()
        elif op[0] == "complete":
            h.complete(op[1])
        else:
            h.abort(op[1])
        h.check()
    h.drain()
