"""The scheduler (Algorithm 1's select over a paged K/V block pool, and the return of a batch), in pure
Python: Request objects built directly, no model, no tensors.

Block size 1 where an example wants slot-exact arithmetic, larger blocks elsewhere. ``finish_iteration``
does what the engine's ``_complete`` does: a token for every member with ``sample``, the stop rule, then
``scheduler.complete(batch)``."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca.core.block_manager import BlockManager, hash_block, root_hash
from orca.core.request import FinishReason, Request
from orca.core.scheduler import OrcaScheduler, ScheduledBatch, ScheduledRequest
from orca.sampling_params import SamplingParams

TOKEN = 7


def make_request(
    arrival: int, prompt_len: int, max_new: int, split: int | None = None, family: int = 0,
    cache_salt: str | None = None,
) -> Request:
    """A prompt of ones; or, with `split`, ones up to there and then a pattern that depends on `family`
    (requests of one family share their whole prompt's prefix, of different ones the ones only)."""
    split = prompt_len if split is None else min(split, prompt_len)
    tail = [(family + i) % 3 + 1 for i in range(prompt_len - split)]
    return Request(
        request_id=f"r{arrival}",
        prompt_token_ids=[1] * split + tail,
        params=SamplingParams(max_tokens=max_new),
        arrival=arrival,
        seed=0,
        cache_salt=cache_salt,
    )


def make_scheduler(
    num_blocks: int,
    block_size: int = 1,
    max_bs: int = 8,
    n_workers: int = 1,
    kv_admission: str = "reserve",
    max_num_batched_tokens: int | None = None,
) -> OrcaScheduler:
    # First-fit block placement: the expectations below name block ids that follow from arithmetic alone
    # (the default placement is tested in tests/test_block_manager.py and by the model-based test here).
    blocks = BlockManager(num_blocks, block_size, placement="lowest")
    return OrcaScheduler(max_bs, blocks, n_workers, kv_admission, max_num_batched_tokens)


def finish_iteration(
    sched: OrcaScheduler, batch: ScheduledBatch, stop: Collection[str] = (), error: bool = False
) -> list[Request]:
    """The engine's _complete: a new token for every member that samples, "stop" for those asked to,
    "length" at max_tokens ("error" for every member when the iteration failed), then the scheduler."""
    for m in batch.members:
        req = m.request
        if error:
            req.finish_reason, req.error = FinishReason.ERROR, "boom"
        elif m.sample:
            req.output_token_ids.append(TOKEN)
            if req.request_id in stop:
                req.finish_reason = FinishReason.STOP
            elif len(req.output_token_ids) >= req.params.max_tokens:
                req.finish_reason = FinishReason.LENGTH
    return sched.complete(batch)


def schedule(sched: OrcaScheduler) -> ScheduledBatch:
    batch = sched.schedule()
    assert batch is not None
    return batch


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def shape(batch: ScheduledBatch) -> list[tuple[str, int, int, bool]]:
    """(id, start, num_tokens, sample) per member, in batch order."""
    return [(m.request.request_id, m.start, m.num_tokens, m.sample) for m in batch.members]


# -- select(): FCFS, max_bs, increments first ----------------------------------------------------------
def test_select_breaks_instead_of_letting_a_smaller_later_request_jump_the_queue() -> None:
    # reserve, 10 one-slot blocks: r0 takes 6 (3 + 3); r1 needs 6 (6 + 6 > 10: does not fit); r2 needs 3
    # and would fit (6 + 3 <= 10), but it arrived after r1, so admitting it would starve r1. Algorithm 1 breaks.
    sched = make_scheduler(num_blocks=10)
    r0, r1, r2 = make_request(0, 3, 3), make_request(1, 2, 4), make_request(2, 1, 2)
    for r in (r0, r1, r2):
        sched.add(r)
    batch = schedule(sched)
    assert ids(batch.requests) == ["r0"] and ids(batch.admitted) == ["r0"]
    assert sched.blocks.num_allocated_blocks == 6 and sched.blocks.owners() == {"r0": [0, 1, 2, 3, 4, 5]}
    assert not r1.admitted and not r2.admitted
    assert (sched.num_running, sched.num_waiting) == (1, 2)

    # r0 keeps running alone (its reservation covers it), r1 and r2 keep waiting.
    assert finish_iteration(sched, batch) == []
    batch = schedule(sched)
    assert shape(batch) == [("r0", 3, 1, True)] and batch.admitted == []

    # r0 finishes: its 6 blocks return, and now r1 and r2 (6 + 3 = 9 <= 10) are both admitted, in order.
    assert finish_iteration(sched, batch, stop={"r0"}) == [r0]
    assert sched.blocks.num_allocated_blocks == 0
    batch = schedule(sched)
    assert ids(batch.requests) == ["r1", "r2"] and ids(batch.admitted) == ["r1", "r2"]
    assert sched.blocks.owners() == {"r1": [0, 1, 2, 3, 4, 5], "r2": [6, 7, 8]}


def test_on_demand_admission_breaks_too() -> None:
    # on_demand, 3 blocks of 2 slots: r0's prompt takes 2 blocks; r1's prompt (3 tokens) needs 2, 1 is
    # free; r2's prompt (1 token) would fit in it but waits behind r1.
    sched = make_scheduler(num_blocks=3, block_size=2, kv_admission="on_demand")
    r0, r1, r2 = make_request(0, 4, 2), make_request(1, 3, 2), make_request(2, 1, 1)
    for r in (r0, r1, r2):
        sched.add(r)
    batch = schedule(sched)
    assert ids(batch.requests) == ["r0"] and sched.blocks.owners() == {"r0": [0, 1]}
    assert not r1.admitted and not r2.admitted and sched.blocks.num_free_blocks == 1


def test_select_puts_increments_first_then_initiation_and_respects_max_bs() -> None:
    sched = make_scheduler(num_blocks=40, block_size=4, max_bs=3)
    reqs = [make_request(i, 2 + i, 4) for i in range(5)]
    for r in reqs[:2]:
        sched.add(r)
    first = schedule(sched)
    assert shape(first) == [("r0", 0, 2, True), ("r1", 0, 3, True)]
    assert not any(m.increment for m in first.members)
    finish_iteration(sched, first)
    assert all(r.in_increment for r in reqs[:2])
    for r in reqs[2:]:
        sched.add(r)
    # r0, r1 are in increment, r2 joins in initiation; max_bs 3 leaves r3 and r4 waiting (unadmitted).
    second = schedule(sched)
    assert shape(second) == [("r0", 2, 1, True), ("r1", 3, 1, True), ("r2", 0, 4, True)]
    assert [m.increment for m in second.members] == [True, True, False]
    assert ids(second.admitted) == ["r2"]
    assert not reqs[3].admitted and not reqs[4].admitted
    finish_iteration(sched, second, stop={"r0"})
    third = schedule(sched)
    assert ids(third.requests) == ["r1", "r2", "r3"] and ids(third.admitted) == ["r3"]
    assert [m.increment for m in third.members] == [True, True, False]


def test_a_new_arrival_never_displaces_an_increment() -> None:
    # max_bs 2, both places taken by increments: r2's prompt waits for a place, unadmitted.
    sched = make_scheduler(num_blocks=40, max_bs=2)
    r0, r1, r2 = make_request(0, 2, 5), make_request(1, 2, 5), make_request(2, 2, 5)
    sched.add(r0)
    sched.add(r1)
    finish_iteration(sched, schedule(sched))
    sched.add(r2)
    batch = schedule(sched)
    assert ids(batch.requests) == ["r0", "r1"] and all(m.increment for m in batch.members)
    assert not r2.admitted


def test_schedule_returns_none_when_nothing_can_run() -> None:
    sched = make_scheduler(num_blocks=5)
    assert sched.schedule() is None  # empty pool
    big = make_request(0, 3, 3)  # 6 slots > 5: never fits (the engine refuses such requests up front)
    sched.add(big)
    assert sched.schedule() is None
    assert sched.blocks.num_allocated_blocks == 0 and not big.admitted and not big.running

    # on_demand: a prompt longer than the pool never fits either.
    sched = make_scheduler(num_blocks=2, block_size=2, kv_admission="on_demand")
    sched.add(make_request(0, 5, 1))
    assert sched.schedule() is None and sched.blocks.num_allocated_blocks == 0

    # Every request is in flight: nothing is left to select, even with a worker free.
    sched = make_scheduler(num_blocks=10, n_workers=2)
    sched.add(make_request(0, 2, 2))
    batch = schedule(sched)
    assert sched.can_schedule() and sched.schedule() is None
    assert sched.num_in_flight == 1 and batch.batch_id == 0


def test_requests_must_arrive_in_order_and_have_unique_ids() -> None:
    sched = make_scheduler(num_blocks=50)
    sched.add(make_request(3, 1, 1))
    with pytest.raises(ValueError, match="arrival order"):
        sched.add(make_request(2, 1, 1))
    with pytest.raises(ValueError, match="arrival order"):  # a tie is not an order
        sched.add(Request("r99", [1], SamplingParams(max_tokens=1), arrival=3, seed=0))
    dup = make_request(4, 1, 1)
    dup.request_id = "r3"
    with pytest.raises(ValueError, match="already in use"):
        sched.add(dup)
    assert sched.request_ids() == ["r3"]
    sched.add(make_request(5, 1, 1))
    assert sched.request_ids() == ["r3", "r5"] and "r5" in sched and "r4" not in sched


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_bs": 0}, "max_bs"),
        ({"max_bs": True}, "max_bs"),
        ({"max_bs": 2.0}, "max_bs"),
        ({"n_workers": 0}, "n_workers"),
        ({"n_workers": 1.5}, "n_workers"),
        ({"kv_admission": "lazy"}, "kv_admission"),
        ({"kv_admission": None}, "kv_admission"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": -3}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": True}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": 4.0}, "max_num_batched_tokens"),
    ],
)
def test_scheduler_rejects_bad_options(kwargs: dict, match: str) -> None:
    args = {"max_bs": 2, "n_workers": 1, "kv_admission": "reserve", "max_num_batched_tokens": None, **kwargs}
    with pytest.raises(ValueError, match=match):
        OrcaScheduler(args["max_bs"], BlockManager(10, 1), args["n_workers"], args["kv_admission"],
                      args["max_num_batched_tokens"])


# -- admission policies -------------------------------------------------------------------------------
def test_reserve_takes_blocks_for_max_tokens_at_admission() -> None:
    # block size 4: r0 = 5 prompt + 6 new = 11 tokens -> 3 blocks at once, none later.
    sched = make_scheduler(num_blocks=6, block_size=4)
    r0, r1 = make_request(0, 5, 6), make_request(1, 2, 9)  # r1: 11 tokens -> 3 blocks
    sched.add(r0)
    batch = schedule(sched)
    [m] = batch.members
    assert (m.new_blocks, m.start, m.num_tokens, m.sample, m.increment) == ([0, 1, 2], 0, 5, True, False)
    assert sched.kv_used_tokens == 0  # nothing computed until the batch returns
    finish_iteration(sched, batch)
    assert sched.kv_used_tokens == 5
    sched.add(r1)
    for step in range(4):  # r0's tokens 2 to 5
        batch = schedule(sched)
        assert batch.members[0].new_blocks == []  # r0's increments never take a block
        if step == 0:
            assert ids(batch.admitted) == ["r1"] and batch.members[1].new_blocks == [3, 4, 5]
        else:
            assert all(m.new_blocks == [] for m in batch.members)
        finish_iteration(sched, batch)
        assert sched.blocks.owners() == {"r0": [0, 1, 2], "r1": [3, 4, 5]}
    finish_iteration(sched, schedule(sched))  # r0's 6th token
    assert r0.finish_reason is FinishReason.LENGTH and sched.blocks.owners() == {"r1": [3, 4, 5]}
    assert sched.num_preemptions == 0


def test_reserve_never_preempts_a_later_request_waits_instead() -> None:
    # 6 one-slot blocks: r0 reserves 4, r1 needs 3 and waits (on_demand would admit it and preempt it).
    sched = make_scheduler(num_blocks=6)
    r0, r1 = make_request(0, 1, 3), make_request(1, 1, 2)
    sched.add(r0)
    sched.add(r1)
    while sched.has_unfinished():
        batch = schedule(sched)
        assert batch.preempted == []
        if r0.request_id in sched:
            assert ids(batch.requests) == ["r0"] and not r1.admitted
        finish_iteration(sched, batch)
    assert (r0.num_preemptions, r1.num_preemptions, sched.num_preemptions) == (0, 0, 0)
    assert r0.output_token_ids == [TOKEN] * 3 and r1.output_token_ids == [TOKEN] * 2


def test_on_demand_takes_blocks_as_tokens_are_scheduled() -> None:
    # block size 4, prompt 3: one block for the prompt; the increment feeding token 3 still fits in it,
    # the one feeding token 4 takes a second block.
    sched = make_scheduler(num_blocks=4, block_size=4, kv_admission="on_demand")
    r0, r1 = make_request(0, 3, 8), make_request(1, 2, 1)
    sched.add(r0)
    sched.add(r1)
    batch = schedule(sched)
    assert [m.new_blocks for m in batch.members] == [[0], [1]]
    finish_iteration(sched, batch)  # r1 finishes (max_tokens 1): block 1 returns
    assert sched.blocks.owners() == {"r0": [0]}
    batch = schedule(sched)
    assert shape(batch) == [("r0", 3, 1, True)] and batch.members[0].new_blocks == []
    finish_iteration(sched, batch)
    batch = schedule(sched)
    assert shape(batch) == [("r0", 4, 1, True)] and batch.members[0].new_blocks == [1]
    finish_iteration(sched, batch)
    assert sched.blocks.owners() == {"r0": [0, 1]} and sched.kv_used_tokens == 5
    assert sched.blocks.num_held("r0") == sched.blocks.blocks_for(r0.num_computed_tokens)


# -- chunked prefill (max_num_batched_tokens) ---------------------------------------------------------
def test_chunked_prefill_spreads_a_long_prompt_over_iterations() -> None:
    # Budget 4 tokens per iteration, block size 4, on_demand. r0 (prompt 2) and r1 (prompt 10) arrive
    # together: r0's prompt runs whole, r1's in chunks of what is left of the budget after r0's increment.
    sched = make_scheduler(num_blocks=10, block_size=4, kv_admission="on_demand", max_num_batched_tokens=4)
    r0, r1 = make_request(0, 2, 8), make_request(1, 10, 2)
    sched.add(r0)
    sched.add(r1)
    expected = [
        # (r0's member, r1's member, their new blocks)
        ([("r0", 0, 2, True), ("r1", 0, 2, False)], [[0], [1]]),
        ([("r0", 2, 1, True), ("r1", 2, 3, False)], [[], [2]]),
        ([("r0", 3, 1, True), ("r1", 5, 3, False)], [[], []]),
        ([("r0", 4, 1, True), ("r1", 8, 2, True)], [[3], [4]]),  # r1's last chunk samples its first token
    ]
    for i, (members, new_blocks) in enumerate(expected):
        batch = schedule(sched)
        assert shape(batch) == members, i
        assert [m.new_blocks for m in batch.members] == new_blocks, i
        assert batch.num_tokens <= 4
        assert [m.increment for m in batch.members] == [i > 0, False]
        assert ids(batch.admitted) == (["r0", "r1"] if i == 0 else [])
        finish_iteration(sched, batch)
        assert len(r1.output_token_ids) == (1 if i == 3 else 0)  # the first token comes after the last chunk
        assert r1.num_computed_tokens == members[1][1] + members[1][2]
    assert sched.blocks.owners() == {"r0": [0, 3], "r1": [1, 2, 4]}
    batch = schedule(sched)
    assert shape(batch) == [("r0", 5, 1, True), ("r1", 10, 1, True)]  # r1 is in increment now


def test_a_prompts_last_token_alone_is_initiation_not_increment() -> None:
    # Budget 4: a 5-token prompt runs as a 4-token chunk, then its last token alone, which feeds one token
    # after a computed prefix like an increment but is the prompt's: initiation, and it samples.
    sched = make_scheduler(num_blocks=4, block_size=4, kv_admission="on_demand", max_num_batched_tokens=4)
    r0 = make_request(0, 5, 2)
    sched.add(r0)
    batch = schedule(sched)
    assert shape(batch) == [("r0", 0, 4, False)]
    finish_iteration(sched, batch)
    assert not r0.in_increment
    batch = schedule(sched)
    assert shape(batch) == [("r0", 4, 1, True)] and [m.increment for m in batch.members] == [False]
    finish_iteration(sched, batch)
    assert r0.in_increment
    batch = schedule(sched)
    assert shape(batch) == [("r0", 5, 1, True)] and [m.increment for m in batch.members] == [True]


def test_chunked_prefill_under_reserve_reserves_at_the_first_chunk() -> None:
    sched = make_scheduler(num_blocks=8, block_size=2, max_num_batched_tokens=3)
    r0 = make_request(0, 7, 4)  # 11 tokens -> 6 blocks, all at admission
    sched.add(r0)
    chunks = []
    while not r0.output_token_ids:
        batch = schedule(sched)
        chunks.append(shape(batch)[0])
        assert batch.members[0].new_blocks == ([0, 1, 2, 3, 4, 5] if len(chunks) == 1 else [])
        finish_iteration(sched, batch)
    assert chunks == [("r0", 0, 3, False), ("r0", 3, 3, False), ("r0", 6, 1, True)]


def test_budget_caps_increments_too() -> None:
    sched = make_scheduler(num_blocks=40, max_num_batched_tokens=2)
    reqs = [make_request(i, 1, 5) for i in range(3)]
    for r in reqs:
        sched.add(r)
    batch = schedule(sched)
    assert shape(batch) == [("r0", 0, 1, True), ("r1", 0, 1, True)] and not reqs[2].admitted
    finish_iteration(sched, batch)
    batch = schedule(sched)  # two increments fill the budget: r2 still waits
    assert shape(batch) == [("r0", 1, 1, True), ("r1", 1, 1, True)] and not reqs[2].admitted


# -- preemption (on_demand) ---------------------------------------------------------------------------
def test_on_demand_preempts_the_latest_arrival_which_recomputes_ahead_of_later_arrivals() -> None:
    # 6 one-slot blocks. r0 (prompt 2), r1 (prompt 2), r2 (prompt 1) take 5 blocks for their prompts.
    sched = make_scheduler(num_blocks=6, kv_admission="on_demand")
    r0, r1, r2 = make_request(0, 2, 4), make_request(1, 2, 2), make_request(2, 1, 3)
    for r in (r0, r1, r2):
        sched.add(r)
    finish_iteration(sched, schedule(sched))
    assert sched.blocks.num_free_blocks == 1 and all(len(r.output_token_ids) == 1 for r in (r0, r1, r2))

    # Increments: r0 takes the free block; r1 needs one more and none is free, so r2 (the latest arrival,
    # not in flight, not in this batch) is preempted: its block is freed and it recomputes later.
    batch = schedule(sched)
    assert shape(batch) == [("r0", 2, 1, True), ("r1", 2, 1, True)]
    assert [m.new_blocks for m in batch.members] == [[5], [4]]
    assert ids(batch.preempted) == ["r2"] and batch.admitted == []
    assert not r2.admitted and r2.num_computed_tokens == 0 and sched.blocks.num_held("r2") == 0
    assert r2.num_preemptions == 1 and sched.num_preemptions == 1
    assert r2.output_token_ids == [TOKEN]  # what it generated is kept, and recomputed
    assert sched.request_ids() == ["r0", "r1", "r2"]  # it keeps its place in arrival order
    assert (sched.num_running, sched.num_waiting) == (2, 1)

    r3 = make_request(3, 1, 1)
    sched.add(r3)
    finish_iteration(sched, batch)  # r1 finishes (max_tokens 2): 3 blocks return
    assert sched.blocks.num_free_blocks == 3

    # r0's increment takes 1 block; r2 comes back before r3 (which arrived later), and recomputes its
    # prompt and its generated token in one chunk that samples its next token; r3 does not fit and waits.
    batch = schedule(sched)
    assert shape(batch) == [("r0", 3, 1, True), ("r2", 0, 2, True)]
    assert ids(batch.admitted) == ["r2"] and batch.preempted == []
    assert r2.token_ids(0, 2) == [1, TOKEN]
    assert not r3.admitted
    finish_iteration(sched, batch)
    assert r2.output_token_ids == [TOKEN, TOKEN] and r2.num_computed_tokens == 2


def test_an_earlier_request_is_never_preempted_for_a_later_one() -> None:
    # 6 one-slot blocks, budget 3, two workers. r0's 5-token prompt runs in chunks; r1 is admitted while
    # r0's first chunk is in flight. When both have returned the pool is full: r1 needs a block for its
    # increment, but r0 (idle, holding 3 blocks) arrived earlier, so r1 waits; then r0's next chunk
    # preempts r1.
    sched = make_scheduler(num_blocks=6, n_workers=2, kv_admission="on_demand", max_num_batched_tokens=3)
    r0, r1 = make_request(0, 5, 1), make_request(1, 3, 2)
    sched.add(r0)
    sched.add(r1)
    a = schedule(sched)
    assert shape(a) == [("r0", 0, 3, False)]
    b = schedule(sched)
    assert shape(b) == [("r1", 0, 3, True)] and sched.blocks.num_free_blocks == 0
    finish_iteration(sched, a)
    assert sched.schedule() is None  # r0's chunk needs 2 blocks; r1 is in flight, so it cannot have its
    finish_iteration(sched, b)
    assert r0.num_computed_tokens == 3 and r1.in_increment

    batch = schedule(sched)
    assert shape(batch) == [("r0", 3, 2, True)]  # r1's increment did not take r0's blocks ...
    assert ids(batch.preempted) == ["r1"]  # ... and r0 took r1's
    assert r0.num_preemptions == 0 and r1.num_preemptions == 1
    finish_iteration(sched, batch)  # r0 finishes
    batch = schedule(sched)  # r1 recomputes 3 prompt tokens + 1 generated: 3 now (the budget), 1 next
    assert shape(batch) == [("r1", 0, 3, False)] and ids(batch.admitted) == ["r1"]


# -- abort in every state -----------------------------------------------------------------------------
def test_abort_waiting_request() -> None:
    sched = make_scheduler(num_blocks=10)
    r0, r1 = make_request(0, 4, 4), make_request(1, 4, 4)  # r1 waits: 8 + 8 > 10
    sched.add(r0)
    sched.add(r1)
    batch = schedule(sched)
    assert ids(batch.requests) == ["r0"]
    assert sched.abort("r1") is r1
    assert r1.finish_reason is FinishReason.CANCELLED and "r1" not in sched
    assert sched.blocks.owners() == {"r0": list(range(8))}
    assert sched.abort("r1") is None  # unknown now


def test_abort_preempted_request() -> None:
    # 4 one-slot blocks: the two prompts fill the pool; r0's first increment preempts r1.
    sched = make_scheduler(num_blocks=4, kv_admission="on_demand")
    r0, r1 = make_request(0, 2, 2), make_request(1, 2, 2)
    sched.add(r0)
    sched.add(r1)
    finish_iteration(sched, schedule(sched))
    batch = schedule(sched)
    assert ids(batch.preempted) == ["r1"] and not r1.admitted
    assert sched.abort("r1") is r1 and r1.finish_reason is FinishReason.CANCELLED
    assert "r1" not in sched and sched.blocks.owners() == {"r0": [0, 1, 2]}
    assert finish_iteration(sched, batch) == [r0] and sched.blocks.num_free_blocks == 4


def test_abort_admitted_idle_request_frees_its_blocks_at_once() -> None:
    sched = make_scheduler(num_blocks=20, block_size=2)
    r0, r1 = make_request(0, 4, 4), make_request(1, 2, 2)
    sched.add(r0)
    sched.add(r1)
    finish_iteration(sched, schedule(sched))
    assert r0.admitted and not r0.running and sched.blocks.num_allocated_blocks == 6
    assert sched.abort("r0") is r0
    assert r0.finish_reason is FinishReason.CANCELLED and not r0.admitted
    assert sched.blocks.owners() == {"r1": [4, 5]}
    batch = schedule(sched)
    assert ids(batch.requests) == ["r1"]


@pytest.mark.parametrize("kv_admission", ["reserve", "on_demand"])
def test_abort_in_flight_request_leaves_when_its_batch_returns(kv_admission: str) -> None:
    sched = make_scheduler(num_blocks=20, kv_admission=kv_admission)
    r0, r1 = make_request(0, 4, 4), make_request(1, 2, 8)
    sched.add(r0)
    sched.add(r1)
    batch = schedule(sched)
    held = sched.blocks.num_allocated_blocks
    assert sched.abort("r0") is None  # in flight: only marked
    assert "r0" in sched and r0.aborted and r0.admitted and sched.blocks.num_allocated_blocks == held
    finished = finish_iteration(sched, batch)
    assert finished == [r0] and r0.finish_reason is FinishReason.CANCELLED
    assert "r0" not in sched and sched.blocks.num_held("r0") == 0
    assert sched.blocks.num_allocated_blocks == sched.blocks.num_held("r1") > 0


def test_abort_in_flight_request_that_finished_anyway_keeps_its_reason() -> None:
    sched = make_scheduler(num_blocks=20)
    r0 = make_request(0, 4, 1)
    sched.add(r0)
    batch = schedule(sched)
    sched.abort("r0")
    assert finish_iteration(sched, batch) == [r0]
    assert r0.finish_reason is FinishReason.LENGTH and sched.blocks.num_allocated_blocks == 0


def test_a_failed_iteration_finishes_its_members_and_frees_their_blocks() -> None:
    sched = make_scheduler(num_blocks=20, max_bs=1)
    r0, r1 = make_request(0, 3, 4), make_request(1, 3, 4)
    sched.add(r0)
    sched.add(r1)
    batch = schedule(sched)
    assert finish_iteration(sched, batch, error=True) == [r0]
    assert r0.finish_reason is FinishReason.ERROR and r0.output_token_ids == []
    assert sched.blocks.num_allocated_blocks == 0 and ids(schedule(sched).requests) == ["r1"]


# -- n_workers > 1: several batches in flight ----------------------------------------------------------
def test_two_workers_keep_two_disjoint_batches_in_flight() -> None:
    sched = make_scheduler(num_blocks=100, max_bs=2, n_workers=2)
    reqs = [make_request(i, 3, 5) for i in range(5)]
    for r in reqs:
        sched.add(r)
    b0 = schedule(sched)
    b1 = schedule(sched)
    assert ids(b0.requests) == ["r0", "r1"] and ids(b1.requests) == ["r2", "r3"]
    assert (b0.batch_id, b1.batch_id) == (0, 1)
    assert sched.num_in_flight == 2 and not sched.can_schedule()
    assert sched.schedule() is None  # n_workers batches in flight: wait for one to return
    with pytest.raises(RuntimeError, match="order"):
        sched.complete(b1)  # batches return in the order they were scheduled
    finish_iteration(sched, b0)
    # r0 and r1 are free again; they arrived first, so they go before r4 (which still waits).
    b2 = schedule(sched)
    assert ids(b2.requests) == ["r0", "r1"] and b2.batch_id == 2
    assert not set(ids(b2.requests)) & set(ids(b1.requests))
    assert not reqs[4].admitted


def three_workers_on_demand_chunked() -> tuple[OrcaScheduler, list[Request]]:
    # 9 one-slot blocks, budget 4, max_bs 2, three batches in flight.
    sched = make_scheduler(num_blocks=9, max_bs=2, n_workers=3, kv_admission="on_demand", max_num_batched_tokens=4)
    reqs = [make_request(0, 1, 2), make_request(1, 3, 2), make_request(2, 6, 1), make_request(3, 1, 6)]
    for r in reqs:
        sched.add(r)
    return sched, reqs


def test_admitted_prompt_work_goes_before_admissions() -> None:
    sched, (r0, r1, r2, r3) = three_workers_on_demand_chunked()
    a, b, c = schedule(sched), schedule(sched), schedule(sched)
    assert (shape(a), shape(b), shape(c)) == (
        [("r0", 0, 1, True), ("r1", 0, 3, True)], [("r2", 0, 4, False)], [("r3", 0, 1, True)]
    )
    assert sched.blocks.num_free_blocks == 0
    finish_iteration(sched, a)
    d = schedule(sched)  # r0's increment needs a block: r2 and r3 are in flight, so r1 is preempted
    assert shape(d) == [("r0", 1, 1, True)] and ids(d.preempted) == ["r1"] and sched.blocks.num_free_blocks == 2
    finish_iteration(sched, b)
    # r1 (waiting, first in arrival order) must recompute 4 tokens: 4 blocks, 2 are free, so it is not
    # admitted. r2, admitted and mid-prompt, still gets its last chunk: prompt work of requests that hold
    # blocks goes before admissions, so a waiting request that does not fit never holds it up.
    e = schedule(sched)
    assert shape(e) == [("r2", 4, 2, True)] and e.members[0].new_blocks == [2, 3]
    assert e.admitted == [] and e.preempted == [] and not r1.admitted


def test_a_waiting_request_that_does_not_fit_never_deadlocks_the_pool() -> None:
    # The engine's loop over the same requests. Had r2's last chunk waited behind r1 (as it did before
    # b261151), r3's increments would take the blocks r0 frees, r3 could not take r2's (r2 arrived
    # earlier), r1 would not fit, and with nothing in flight nothing could ever run again.
    sched, reqs = three_workers_on_demand_chunked()
    in_flight: deque[ScheduledBatch] = deque()
    for _ in range(100):  # step(): select while a worker is free, then collect the oldest batch
        while sched.can_schedule() and (batch := sched.schedule()) is not None:
            in_flight.append(batch)
        if not in_flight:
            break
        finish_iteration(sched, in_flight.popleft())
    stuck = [(r.request_id, r.admitted, r.num_computed_tokens, sched.blocks.num_held(r.request_id))
             for r in reqs if r.request_id in sched]
    assert not sched.has_unfinished(), f"nothing in flight and nothing schedulable: {stuck}"
    assert [len(r.output_token_ids) for r in reqs] == [2, 2, 1, 6]
    assert [r.num_preemptions for r in reqs] == [0, 1, 0, 0] and sched.blocks.num_free_blocks == 9


# -- properties -----------------------------------------------------------------------------------------
class Harness:
    """Drives an OrcaScheduler the way the engine does, with random arrivals, selections, returns (with
    random stops and failures) and aborts, and checks the scheduler's promises after every event."""

    def __init__(
        self, kv_admission: str, block_size: int, num_blocks: int, max_bs: int, n_workers: int, budget: int | None,
        caching: bool = False,
    ) -> None:
        self.policy = kv_admission
        self.max_bs, self.n_workers, self.budget = max_bs, n_workers, budget
        self.caching = caching
        self.blocks = BlockManager(num_blocks, block_size, enable_caching=caching)
        self.sched = OrcaScheduler(max_bs, self.blocks, n_workers, kv_admission, budget)
        self.requests: list[Request] = []  # every request ever added, in arrival order
        self.in_flight: deque[ScheduledBatch] = deque()
        # What the pool's slots hold, as far as the iterations wrote them: block -> slot -> the salt and
        # the tokens up to that position of the request that wrote it ("garbage" after a failed iteration).
        self.kv: dict[int, dict[int, object]] = {}
        self.prefixes: dict[bytes, tuple] = {}  # every hash chain entry seen -> (salt, its tokens)

    def pool(self) -> list[Request]:
        return [r for r in self.requests if r.request_id in self.sched]

    def member_of(self, req: Request) -> ScheduledRequest | None:
        for b in self.in_flight:
            for m in b.members:
                if m.request is req:
                    return m
        return None

    # -- events --------------------------------------------------------------------------------------
    def add(self, prompt_len: int, max_new: int, split: int | None = None, family: int = 0,
            salt: str | None = None) -> None:
        # The engine refuses a request whose prompt + max_tokens exceeds the pool; size it to fit.
        n_slots = self.blocks.n_slots
        prompt_len = min(prompt_len, n_slots - 1)
        max_new = min(max_new, n_slots - prompt_len)
        req = make_request(len(self.requests), prompt_len, max_new, split, family, salt)
        self.requests.append(req)
        self.sched.add(req)

    # -- the prefix cache, seen from outside -----------------------------------------------------------
    def chain(self, req: Request, num_blocks: int | None = None) -> list[bytes]:
        """The request's hash chain over its full blocks (the first num_blocks of them)."""
        size = self.blocks.block_size
        count = req.num_tokens // size if num_blocks is None else num_blocks
        out: list[bytes] = []
        for i in range(count):
            out.append(hash_block(out[-1] if out else root_hash(req.cache_salt), req.token_ids(i * size, size)))
        return out

    def cached(self) -> dict[bytes, int]:
        """hash -> block, for every block the cache holds."""
        found = {}
        for b in range(self.blocks.num_blocks):
            h = self.blocks.block_hash(b)
            if h is not None:
                assert h not in found, "two blocks under one hash"
                found[h] = b
        return found

    def cached_prefix(self, req: Request, cached: dict[bytes, int]) -> list[int]:
        """The blocks of req's longest cached prefix of full blocks, short of its last token."""
        blocks = []
        for h in self.chain(req, (req.num_tokens - 1) // self.blocks.block_size):
            if h not in cached:
                break
            blocks.append(cached[h])
        return blocks

    def holder_counts(self) -> Counter:
        return Counter(b for t in self.blocks.owners().values() for b in t)

    def fits(self, req: Request, budget: float) -> bool:
        """Whether the scheduler could select req as the first of its kind in an empty batch."""
        n = 1 if req.in_increment else int(min(req.num_uncomputed_tokens, budget))
        if not req.admitted:
            hits = self.cached_prefix(req, self.cached()) if self.caching else []
            start = len(hits) * self.blocks.block_size
            n = int(min(req.num_tokens - start, budget))
            target = req.max_num_tokens if self.policy == "reserve" else start + n
            takeable = self.blocks.num_free_blocks - sum(1 for b in hits if self.blocks.refs(b) == 0)
            return self.blocks.blocks_for(target) - len(hits) <= takeable
        need = self.blocks.blocks_needed(req.request_id, req.num_computed_tokens + n)
        reclaimable = 0
        if self.policy == "on_demand":
            victims = [r.request_id for r in self.pool() if r.admitted and not r.running and r.arrival > req.arrival]
            counts = Counter(b for rid in victims for b in self.blocks.table(rid))
            reclaimable = sum(1 for b, k in counts.items() if self.blocks.refs(b) == k)
        return need <= self.blocks.num_free_blocks + reclaimable

    def schedule(self) -> ScheduledBatch | None:
        pool = self.pool()
        busy = {r.request_id for b in self.in_flight for r in b.requests}
        was_admitted = {r.request_id for r in pool if r.admitted}
        waiting_before = [r for r in pool if not r.admitted]
        idle = [r for r in pool if not r.running]
        increment_before = {r.request_id for r in pool if r.in_increment}
        computed_before = {r.request_id: r.num_computed_tokens for r in pool}
        uncomputed_before = {r.request_id: r.num_uncomputed_tokens for r in pool}
        tables_before = self.blocks.owners()
        preemptions_before = {r.request_id: r.num_preemptions for r in pool}
        total_preemptions = self.sched.num_preemptions
        can = self.sched.can_schedule()
        cached_before = self.cached()
        evictable_before = self.blocks.evictable()

        batch = self.sched.schedule()
        if batch is None:
            assert self.blocks.owners() == tables_before and self.sched.num_preemptions == total_preemptions
            if can:  # nothing could run: the first candidate of each pass does not fit
                budget = self.budget if self.budget is not None else float("inf")
                first_inc = next((r for r in idle if r.in_increment), None)
                first_prompt = next((r for r in idle if r.admitted and not r.in_increment), None)
                first_waiting = next((r for r in idle if not r.admitted), None)
                for r in (first_inc, first_prompt if first_prompt is not None else first_waiting):
                    assert r is None or not self.fits(r, budget), f"{r.request_id} could run"
            return None
        assert can
        members = batch.members
        reqs = batch.requests
        assert 1 <= len(members) <= self.max_bs
        assert len(set(ids(reqs))) == len(reqs)
        assert not busy & set(ids(reqs)), "a request in flight was scheduled again"
        assert all(r.running and r.admitted for r in reqs)
        if self.budget is not None:
            assert batch.num_tokens <= self.budget
        # Increments first, then prompt work of admitted requests, then admissions; each in arrival order.
        kinds = [0 if m.increment else 1 if m.request.request_id in was_admitted else 2 for m in members]
        assert kinds == sorted(kinds)
        for kind in (0, 1, 2):
            arrivals = [m.request.arrival for m, k in zip(members, kinds) if k == kind]
            assert arrivals == sorted(arrivals)
        # Each member feeds its next tokens; prompt work takes what is left of the budget.
        left = self.budget if self.budget is not None else float("inf")
        cached_after = self.cached()
        for m in members:
            rid = m.request.request_id
            if rid in was_admitted or not self.caching:
                assert m.start == computed_before[rid]
            else:
                # Admitted from its longest cached prefix: what the cache held when the selection reached
                # it, between what it held after the selection (evictions) and before.
                size = self.blocks.block_size
                assert m.start % size == 0 and m.start == m.request.num_computed_tokens
                low = len(self.cached_prefix(m.request, cached_after)) * size
                high = len(self.cached_prefix(m.request, cached_before)) * size
                assert low <= m.start <= high, (rid, low, m.start, high)
                if cached_after.keys() == cached_before.keys():
                    assert m.start == high
                chain = self.chain(m.request, m.start // size)
                assert [self.blocks.block_hash(b) for b in m.new_blocks[: len(chain)]] == chain
            if m.increment:
                assert rid in increment_before and m.num_tokens == 1 and m.sample
            elif rid in was_admitted or not self.caching:
                assert m.num_tokens == min(uncomputed_before[rid], left)
            else:
                assert m.num_tokens == min(m.request.num_tokens - m.start, left)
            self.check_reads_and_writes(m)
            assert m.sample == (m.start + m.num_tokens == m.request.num_tokens)
            left -= m.num_tokens
            assert self.blocks.table(rid) == tables_before.get(rid, []) + m.new_blocks
            assert self.blocks.num_held(rid) >= self.blocks.blocks_for(m.start + m.num_tokens)
        # Admission: exactly the members that were waiting, and they are the oldest waiting ones (FCFS).
        assert ids(batch.admitted) == [r.request_id for r in reqs if r.request_id not in was_admitted]
        assert ids(batch.admitted) == ids(waiting_before[: len(batch.admitted)])
        # Preemption.
        assert self.sched.num_preemptions == total_preemptions + len(batch.preempted)
        # Eviction: only unreferenced cached blocks, least recently used first, and only when no block was
        # free otherwise.
        evicted = [b for h, b in cached_before.items() if h not in cached_after]
        if evicted:
            assert self.blocks.num_free_blocks == self.blocks.num_evictable_blocks, "evicted with free blocks left"
            released = {b for v in batch.preempted for b in tables_before.get(v.request_id, [])}
            held = self.holder_counts()
            for e in evicted:
                assert e in evictable_before or e in released, f"block {e} was referenced when evicted"
                if e in evictable_before:
                    for older in evictable_before[: evictable_before.index(e)]:
                        assert older in evicted or held[older], f"block {e} evicted before the older {older}"
        if self.policy == "reserve":
            assert batch.preempted == []
            # Reserve never runs short: an idle increment is left out only for max_bs or the budget.
            left_out = [r for r in idle if r.request_id in increment_before and r not in reqs]
            if left_out:
                assert len(members) == self.max_bs or batch.num_tokens == self.budget
        growers = [m.request.arrival for m in members if m.new_blocks]
        for v in batch.preempted:
            rid = v.request_id
            assert rid in was_admitted and v in idle and v not in reqs
            assert not v.admitted and v.num_computed_tokens == 0 and self.blocks.num_held(rid) == 0
            assert v.num_preemptions == preemptions_before[rid] + 1
            # Preempted for an earlier request that grew ...
            assert any(g < v.arrival for g in growers), "preempted for a later request"
            # ... latest arrival first: a later request keeps its blocks only if it is in a batch.
            for x in pool:
                if x.arrival > v.arrival and x.admitted and x.request_id in was_admitted:
                    assert x.request_id in busy or x in reqs, f"{rid} preempted before the later {x.request_id}"
        if batch.preempted and self.n_workers == 1:
            # With one batch at a time, every preempted request arrived after every request that grew.
            assert min(v.arrival for v in batch.preempted) > max(growers)
        if batch.admitted and batch.preempted:
            assert max(r.arrival for r in batch.admitted) < min(v.arrival for v in batch.preempted)
        # Requests outside the batch keep their blocks (unless preempted).
        for r in pool:
            if r not in reqs and r not in batch.preempted:
                assert self.blocks.table(r.request_id) == tables_before.get(r.request_id, [])
        self.in_flight.append(batch)
        return batch

    def complete(self, stop_flags: list[bool], error: bool = False) -> None:
        if not self.in_flight:
            return
        batch = self.in_flight.popleft()
        outputs_before = {r.request_id: len(r.output_token_ids) for r in batch.requests}
        stop = {m.request.request_id for m, f in zip(batch.members, stop_flags) if f and m.sample}
        size = self.blocks.block_size
        for m in batch.members:  # what the iteration wrote into the pool
            req, table = m.request, self.blocks.table(m.request.request_id)
            for p in range(m.start, m.start + m.num_tokens):
                written = "garbage" if error else (req.cache_salt, tuple(req.token_ids(0, p + 1)))
                self.kv.setdefault(table[p // size], {})[p % size] = written
        finished = finish_iteration(self.sched, batch, stop, error)
        assert ids(finished) == [r.request_id for r in batch.requests if r.finished]
        for m in batch.members:
            req = m.request
            assert not req.running
            assert len(req.output_token_ids) == outputs_before[req.request_id] + (m.sample and not error)
            assert len(req.output_token_ids) <= req.params.max_tokens
            assert (req.request_id in self.sched) != req.finished
            if req.finished:
                assert not req.admitted and self.blocks.num_held(req.request_id) == 0
            else:
                assert req.num_computed_tokens == m.start + m.num_tokens
                assert req.num_uncomputed_tokens >= 1
            # Aborted while in flight: it leaves now, with its blocks (cancelled, unless it finished anyway).
            assert not req.aborted or req.finished

    def abort(self, pick: int) -> None:
        pool = self.pool()
        if not pool:
            return
        req = pool[pick % len(pool)]
        was_running, held, free = req.running, self.blocks.num_held(req.request_id), self.blocks.num_free_blocks
        own = sum(1 for b in self.blocks.table(req.request_id) if self.blocks.refs(b) == 1)
        result = self.sched.abort(req.request_id)
        if was_running:
            assert result is None and req.aborted and req.request_id in self.sched
            assert self.blocks.num_free_blocks == free and self.blocks.num_held(req.request_id) == held
        else:
            assert result is req and req.finish_reason is FinishReason.CANCELLED
            assert req.request_id not in self.sched and not req.admitted
            assert self.blocks.num_free_blocks == free + own and self.blocks.num_held(req.request_id) == 0

    # -- invariants ----------------------------------------------------------------------------------
    def check_reads_and_writes(self, m: ScheduledRequest) -> None:
        """A scheduled member attends to keys and values of its own salt and tokens only, and writes only
        blocks that no other request holds and the cache does not hold."""
        req, table, size = m.request, self.blocks.table(m.request.request_id), self.blocks.block_size
        for p in range(m.start):
            slot = self.kv.get(table[p // size], {}).get(p % size)
            assert slot == (req.cache_salt, tuple(req.token_ids(0, p + 1))), f"{req.request_id} reads wrong K/V at {p}"
        for i in range(m.start // size, -(-(m.start + m.num_tokens) // size)):
            assert self.blocks.refs(table[i]) == 1, f"{req.request_id} writes the shared block {table[i]}"
            assert self.blocks.block_hash(table[i]) is None, f"{req.request_id} writes the cached block {table[i]}"

    def check_cache(self) -> None:
        """Every cached block holds the keys and values of the tokens its hash names; the evictable ones are
        cached and unreferenced."""
        for req in self.requests:
            chain = self.chain(req)
            for i, h in enumerate(chain):
                self.prefixes[h] = (req.cache_salt, tuple(req.token_ids(0, (i + 1) * self.blocks.block_size)))
        size = self.blocks.block_size
        for h, b in self.cached().items():
            salt, tokens = self.prefixes[h]
            for j in range(size):
                assert self.kv.get(b, {}).get(j) == (salt, tokens[: len(tokens) - size + j + 1]), f"block {b}"
        held = self.holder_counts()
        for b in self.blocks.evictable():
            assert self.blocks.block_hash(b) is not None and not held[b]

    def check(self) -> None:
        pool = self.pool()
        owners = self.blocks.owners()
        held = [b for t in owners.values() for b in t]
        counts = self.holder_counts()
        for t in owners.values():
            assert len(t) == len(set(t)), "a block is twice in one table"
        for b in range(self.blocks.num_blocks):
            assert self.blocks.refs(b) == counts.get(b, 0) >= 0
        if self.caching:  # shared blocks are cached ones
            assert all(self.blocks.block_hash(b) is not None for b, k in counts.items() if k > 1)
            self.check_cache()
        else:
            assert len(held) == len(set(held)), "a block is owned twice"
            assert self.blocks.num_cached_blocks == 0 and not self.blocks.evictable()
        assert all(0 <= b < self.blocks.num_blocks for b in held)
        assert self.blocks.num_allocated_blocks == len(counts) <= self.blocks.num_blocks
        assert self.blocks.num_free_blocks == self.blocks.num_blocks - len(counts)
        assert set(owners) == {r.request_id for r in pool if r.admitted}, "only admitted requests hold blocks"
        for r in pool:
            n = self.blocks.num_held(r.request_id)
            if not r.admitted:
                assert r.num_computed_tokens == 0 and not r.running
                continue
            assert n >= 1 and n >= self.blocks.blocks_for(r.num_computed_tokens)
            if self.policy == "reserve":
                assert n == self.blocks.blocks_for(r.max_num_tokens)
            else:  # on demand: exactly what the computed (or scheduled) tokens need
                m = self.member_of(r)
                assert n == self.blocks.blocks_for(r.num_computed_tokens if m is None else m.start + m.num_tokens)
        assert all(len(r.output_token_ids) < r.params.max_tokens for r in pool)
        assert self.sched.num_running == sum(r.admitted for r in pool)
        assert self.sched.num_waiting == sum(not r.admitted for r in pool)
        shared = sum(k - 1 for k in counts.values() if k > 1)  # (shared blocks are full and computed)
        used = sum(r.num_computed_tokens for r in pool if r.admitted) - shared * self.blocks.block_size
        assert self.sched.kv_used_tokens == used <= len(counts) * self.blocks.block_size
        assert self.sched.num_in_flight == len(self.in_flight) <= self.n_workers
        assert self.sched.can_schedule() == (len(self.in_flight) < self.n_workers)
        flying = [r.request_id for b in self.in_flight for r in b.requests]
        assert len(flying) == len(set(flying)), "a request is in two batches in flight"
        assert sorted(flying) == sorted(r.request_id for r in pool if r.running)
        assert self.sched.request_ids() == ids(pool)  # arrival order
        if self.policy == "reserve":
            # Admitted requests are always the oldest in the pool (break, not continue; no preemption).
            admitted = [r for r in pool if r.admitted]
            assert admitted == pool[: len(admitted)], "a request was admitted while an earlier one waits"
            assert all(r.num_preemptions == 0 for r in self.requests) and self.sched.num_preemptions == 0

    def drain(self) -> None:
        """Runs every remaining request to completion (each finishes at its max_tokens), as the engine's
        step() does: select while a worker is free, then collect the oldest batch."""
        limit = 20 * sum(r.max_num_tokens + 2 for r in self.requests) + 20
        for _ in range(limit):
            if not self.sched.has_unfinished() and not self.in_flight:
                break
            while self.sched.can_schedule() and self.schedule() is not None:
                self.check()
            if not self.in_flight:
                # Nothing schedulable and nothing to wait for, with requests left: a liveness bug.
                raise AssertionError(
                    "requests are left but nothing can be scheduled: "
                    + repr([(r.request_id, r.admitted, r.num_computed_tokens, r.num_tokens,
                             self.blocks.num_held(r.request_id)) for r in self.pool()])
                )
            self.complete([])
            self.check()
        else:
            raise AssertionError("requests did not complete")
        assert all(r.finished for r in self.requests)
        assert self.blocks.num_free_blocks == self.blocks.num_blocks and self.blocks.owners() == {}
        assert self.sched.num_running == 0 and self.sched.num_waiting == 0 and self.sched.kv_used_tokens == 0


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 16), st.integers(1, 12)),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("complete"), st.lists(st.booleans(), max_size=6), st.integers(0, 9)),
        st.tuples(st.just("abort"), st.integers(0, 63)),
    ),
    max_size=60,
)
SIZES = {
    "block_size": st.integers(1, 8),
    "num_blocks": st.integers(1, 12),
    "max_bs": st.integers(1, 5),
    "n_workers": st.integers(1, 3),
    "budget": st.one_of(st.none(), st.integers(1, 20)),
}


# With prefix caching: prompts that share prefixes (ones up to a split, then one of three patterns), under
# no salt or one of two.
OPS_CACHED = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 16), st.integers(1, 12), st.integers(0, 16), st.integers(0, 2),
                  st.sampled_from([None, None, "a", "b"])),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("complete"), st.lists(st.booleans(), max_size=6), st.integers(0, 9)),
        st.tuples(st.just("abort"), st.integers(0, 63)),
    ),
    max_size=60,
)


def run_events(
    kv_admission: str, block_size: int, num_blocks: int, max_bs: int, n_workers: int, budget: int | None, ops: list,
    caching: bool = False,
) -> Harness:
    num_blocks = max(num_blocks, -(-2 // block_size))  # room for the smallest request (1 + 1 tokens)
    h = Harness(kv_admission, block_size, num_blocks, max_bs, n_workers, budget, caching)
    for op in ops:
        if op[0] == "add":
            h.add(*op[1:])
        elif op[0] == "schedule":
            h.schedule()
        elif op[0] == "complete":
            h.complete(op[1], error=op[2] == 0)
        else:
            h.abort(op[1])
        h.check()
    h.drain()
    return h


@settings(max_examples=250, deadline=None)
@given(ops=OPS, **SIZES)
def test_reserve_invariants_under_random_events(
    block_size: int, num_blocks: int, max_bs: int, n_workers: int, budget: int | None, ops: list
) -> None:
    run_events("reserve", block_size, num_blocks, max_bs, n_workers, budget, ops)


@settings(max_examples=350, deadline=None)
@given(ops=OPS, **SIZES)
def test_on_demand_invariants_under_random_events(
    block_size: int, num_blocks: int, max_bs: int, n_workers: int, budget: int | None, ops: list
) -> None:
    run_events("on_demand", block_size, num_blocks, max_bs, n_workers, budget, ops)


@settings(max_examples=250, deadline=None)
@given(ops=OPS_CACHED, **SIZES)
def test_reserve_invariants_with_prefix_caching(
    block_size: int, num_blocks: int, max_bs: int, n_workers: int, budget: int | None, ops: list
) -> None:
    run_events("reserve", block_size, num_blocks, max_bs, n_workers, budget, ops, caching=True)


@settings(max_examples=350, deadline=None)
@given(ops=OPS_CACHED, **SIZES)
def test_on_demand_invariants_with_prefix_caching(
    block_size: int, num_blocks: int, max_bs: int, n_workers: int, budget: int | None, ops: list
) -> None:
    run_events("on_demand", block_size, num_blocks, max_bs, n_workers, budget, ops, caching=True)
