"""The K/V block bookkeeping (orca.core.block_manager.BlockManager), in pure Python: block tables, the free
heap (lowest id first), and the arithmetic the scheduler relies on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca.core.block_manager import BlockManager, hash_block, root_hash


@pytest.mark.parametrize("value", [0, -1, True, 2.0, None, "4"])
@pytest.mark.parametrize("name", ["num_blocks", "block_size"])
def test_rejects_bad_sizes(name: str, value: object) -> None:
    kwargs: dict[str, object] = {"num_blocks": 4, "block_size": 2, name: value}
    with pytest.raises(ValueError, match=name):
        BlockManager(**kwargs)  # type: ignore[arg-type]


def test_sizes_and_blocks_for() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.n_slots == 20
    assert (bm.num_free_blocks, bm.num_allocated_blocks) == (5, 0)
    assert [bm.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9, 20)] == [0, 1, 1, 1, 2, 2, 3, 5]
    assert BlockManager(3, 1).blocks_for(7) == 7


def test_grow_places_a_request_mid_run_and_grows_it_in_place_only_by_what_is_missing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.blocks_needed("a", 5) == 2 and bm.can_grow("a", 5)
    assert bm.grow("a", 5) == [3, 4]  # the middle of the free run 0..7
    assert bm.table("a") == [3, 4] and bm.num_held("a") == 2
    assert bm.grow("a", 8) == []  # 8 tokens still fit in 2 blocks
    assert bm.blocks_needed("a", 8) == 0 and bm.blocks_needed("a", 3) == 0  # never negative
    assert bm.grow("b", 1) == [1]  # runs 0..2 and 5..7: the lowest of the largest, its middle
    assert bm.grow("a", 9) == [5]  # right after a's last block
    assert bm.owners() == {"a": [3, 4, 5], "b": [1]}
    assert (bm.num_free_blocks, bm.num_allocated_blocks) == (4, 4)
    assert bm.table("nobody") == [] and bm.num_held("nobody") == 0


def test_a_full_pool_hands_out_the_lowest_free_ids() -> None:
    bm = BlockManager(num_blocks=4, block_size=1)
    assert bm.grow("a", 2) == [1, 2]
    assert bm.grow("b", 2) == [0, 3]  # no run holds 2 x 2: lowest first; 1 is taken, so a table may have gaps
    assert bm.num_free_blocks == 0


def test_lowest_placement_is_first_fit() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, placement="lowest")
    assert bm.grow("a", 5) == [0, 1] and bm.grow("b", 1) == [2] and bm.grow("a", 9) == [3]
    bm.free("b")
    assert bm.grow("c", 8) == [2, 4]
    with pytest.raises(ValueError, match="placement must be one of contiguous, lowest, got 'best'"):
        BlockManager(8, 4, placement="best")


def test_requests_growing_together_keep_consecutive_tables_while_the_pool_has_room() -> None:
    """The point of the placement: 32 prompts admitted at once, then every request grows a block at a time
    in turn (a decode batch); each table stays one run of blocks, read by the worker as one view."""
    bm = BlockManager(num_blocks=1456, block_size=16)
    for i in range(32):
        bm.grow(f"r{i}", 100 + i)
    for tokens in range(100, 300, 16):  # up to 20 blocks each: 640 of the 1,456
        for i in range(32):
            bm.grow(f"r{i}", tokens + i + 16)
    for table in bm.owners().values():
        assert table == list(range(table[0], table[0] + len(table)))


def test_grow_beyond_the_pool_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.grow("a", 3)  # 2 blocks
    assert not bm.can_grow("b", 3)  # 2 more blocks, 1 free
    assert bm.can_grow("b", 2)
    with pytest.raises(RuntimeError, match="needs 2 more blocks, 1 are free"):
        bm.grow("b", 3)
    assert bm.owners() == {"a": [0, 1]} and bm.num_free_blocks == 1


def test_free_returns_blocks_once_and_they_are_reused_lowest_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=1)
    assert bm.grow("a", 2) == [2, 3]  # mid-run
    assert bm.grow("b", 2) == [0, 1]  # no run holds 2 x 2: lowest first
    assert bm.grow("c", 1) == [4]  # the run 4..5
    assert bm.free("b") == 2
    assert bm.free("b") == 0  # idempotent: a second free must not return someone else's blocks
    assert bm.free("never") == 0
    assert bm.free("a") == 2
    assert bm.num_free_blocks == 5
    assert bm.grow("d", 3) == [0, 1, 2]  # 0..3 free: no run holds 2 x 3, so lowest first
    assert bm.grow("e", 2) == [3, 5]
    assert bm.owners() == {"c": [4], "d": [0, 1, 2], "e": [3, 5]}


def test_table_and_owners_are_copies() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.grow("a", 3)
    bm.table("a").append(99)
    bm.owners()["a"].append(99)
    bm.owners()["x"] = [3]
    assert bm.owners() == {"a": [1, 2]} and bm.num_held("a") == 2


def expected_new_blocks(free: list[int], table: list[int], want: int) -> list[int]:
    """The placement rule, written out plainly: a first allocation goes to the middle of the longest
    free run (the lowest on ties) when it holds 2 x want; a block follows the table's last when free;
    else the lowest free id."""
    added: list[int] = []
    if want and not table:
        runs: list[list[int]] = []
        for b in free:
            if runs and runs[-1][-1] == b - 1:
                runs[-1].append(b)
            else:
                runs.append([b])
        longest = max(runs, key=len, default=[])  # max keeps the first of equals
        if len(longest) >= 2 * want:
            start = longest[0] + (len(longest) - want) // 2
            added = list(range(start, start + want))
    while len(added) < want:
        last = (table + added)[-1] if table + added else None
        available = [b for b in free if b not in added]
        added.append(last + 1 if last is not None and last + 1 in available else min(available))
    return added


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 16),
    block_size=st.integers(1, 8),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("grow"), st.integers(0, 4), st.integers(0, 40)),
            st.tuples(st.just("free"), st.integers(0, 4)),
        ),
        max_size=40,
    ),
)
def test_block_manager_against_a_model(num_blocks: int, block_size: int, ops: list) -> None:
    bm = BlockManager(num_blocks, block_size)
    model: dict[str, list[int]] = {}  # request -> its table
    for op in ops:
        rid = f"r{op[1]}"
        free_before = sorted(set(range(num_blocks)) - {b for t in model.values() for b in t})
        if op[0] == "grow":
            tokens = op[2]
            want = max(0, -(-tokens // block_size) - len(model.get(rid, [])))
            assert bm.blocks_needed(rid, tokens) == want
            assert bm.can_grow(rid, tokens) == (want <= len(free_before))
            if want > len(free_before):
                with pytest.raises(RuntimeError):
                    bm.grow(rid, tokens)
            else:
                added = bm.grow(rid, tokens)
                assert added == expected_new_blocks(free_before, model.get(rid, []), want)
                if want or rid in model:
                    model.setdefault(rid, []).extend(added)
        else:
            assert bm.free(rid) == len(model.pop(rid, []))
        owners = {r: t for r, t in bm.owners().items() if t}  # (a grow of 0 blocks may leave an empty table)
        assert owners == {r: t for r, t in model.items() if t}
        held = [b for t in owners.values() for b in t]
        assert len(held) == len(set(held)), "a block is owned twice"
        assert all(0 <= b < num_blocks for b in held)
        assert bm.num_allocated_blocks == len(held) == num_blocks - bm.num_free_blocks
        for r, t in model.items():
            assert bm.table(r) == t and bm.num_held(r) == len(t)
    for r in list(model):
        bm.free(r)
    assert bm.num_free_blocks == num_blocks and not any(bm.owners().values())


# -- the prefix cache ---------------------------------------------------------------------------------
def test_block_hashes_chain_over_parent_tokens_and_salt() -> None:
    none, a = root_hash(None), root_hash("a")
    assert len(none) == 32 and none != a != root_hash("b") and root_hash("") not in (none, a)
    assert root_hash("a") == a  # deterministic
    h = hash_block(none, [1, 2, 3])
    assert h == hash_block(none, (1, 2, 3)) and len(h) == 32
    assert h != hash_block(a, [1, 2, 3]) and h != hash_block(none, [1, 2, 4]) and h != hash_block(none, [1, 2])
    assert hash_block(h, [4]) != hash_block(hash_block(none, [1, 2, 4]), [4])  # the parent counts
    assert hash_block(none, [1 << 40]) != hash_block(none, [0])  # ids are not truncated


def cached_pool(num_blocks: int = 8, block_size: int = 2) -> tuple[BlockManager, list[bytes]]:
    """A caching pool where request "a" holds 3 full blocks, all offered to the cache, under chain `hashes`."""
    bm = BlockManager(num_blocks, block_size, placement="lowest", enable_caching=True)
    hashes = [hash_block(root_hash(None), [1, 1])]
    for _ in range(2):
        hashes.append(hash_block(hashes[-1], [1, 1]))
    bm.grow("a", 6)
    bm.cache_blocks("a", hashes, 3)
    return bm, hashes


def test_lookup_finds_the_longest_cached_prefix_and_grow_takes_it_by_reference() -> None:
    bm, hashes = cached_pool()
    assert bm.num_cached_blocks == 3 and bm.lookup(hashes) == [0, 1, 2]
    assert bm.lookup(hashes[:2]) == [0, 1] and bm.lookup([b"x" * 32, *hashes]) == []
    assert bm.lookup([hashes[0], b"x" * 32, hashes[2]]) == [0]  # a prefix: stops at the first miss
    assert bm.blocks_needed("b", 8, [0, 1]) == 2
    assert bm.grow("b", 8, [0, 1]) == [0, 1, 3, 4]  # the cached ones first, then new ones
    assert [bm.refs(b) for b in range(5)] == [2, 2, 1, 1, 1]
    assert bm.num_allocated_blocks == 5 and bm.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="holds blocks already"):
        bm.grow("b", 10, [2])


def test_freed_cached_blocks_stay_cached_evictable_last_block_first() -> None:
    bm, hashes = cached_pool()
    bm.grow("b", 5, [0, 1])  # shares 0, 1; its own 3 (a partial block: never cached)
    assert bm.free("a") == 1  # only block 2 is unreferenced now
    assert bm.evictable() == [2] and bm.num_free_blocks == 5 and bm.num_allocated_blocks == 3
    assert bm.free("b") == 3
    # b's blocks released last first: 3 (uncached) to the free runs; then 1, 0 join the evictable ones.
    assert bm.evictable() == [2, 1, 0] and bm.num_cached_blocks == 3
    assert bm.num_free_blocks == 8 and bm.num_allocated_blocks == 0
    assert bm.lookup(hashes) == [0, 1, 2]  # still there for the next request


def test_a_cached_block_nobody_references_counts_free_but_taking_it_uses_it_up() -> None:
    bm, hashes = cached_pool(num_blocks=4, block_size=2)
    bm.free("a")  # blocks 0-2 evictable, 3 free
    assert bm.num_free_blocks == 4
    assert bm.can_grow("b", 8, [0, 1, 2])  # 3 cached + 1 new
    assert not bm.can_grow("b", 10, [0, 1, 2])  # 3 cached + 2 new: only 1 other block
    assert bm.can_grow("b", 8)  # without the cache: 4 new blocks, by evicting
    assert bm.grow("b", 8, [0, 1, 2]) == [0, 1, 2, 3] and bm.evictable() == []


def test_eviction_takes_the_least_recently_used_only_when_no_block_is_free() -> None:
    bm, hashes = cached_pool(num_blocks=6, block_size=2)
    bm.free("a")  # evictable [2, 1, 0]; free 3, 4, 5
    assert bm.grow("b", 6) == [3, 4, 5]  # free blocks first: the cache keeps all three
    assert bm.num_cached_blocks == 3
    assert bm.grow("c", 2) == [2]  # then the least recently used: the chain's tail
    assert bm.lookup(hashes) == [0, 1] and bm.evictable() == [1, 0]
    assert bm.grow("d", 4) == [0, 1]  # two evicted at once, in id order
    assert bm.num_cached_blocks == 0 and bm.lookup(hashes) == [] and bm.num_free_blocks == 0


def test_a_twin_block_stays_out_of_the_cache() -> None:
    bm, hashes = cached_pool()
    bm.grow("b", 4)  # computed the same two blocks again (admitted before a's were cached)
    bm.cache_blocks("b", hashes, 2)
    assert bm.lookup(hashes) == [0, 1, 2] and bm.block_hash(3) is None and bm.block_hash(4) is None
    bm.free("b")
    assert bm.evictable() == [] and bm.num_free_blocks == 5  # the twins went back to the free runs


def test_num_released_by_counts_shared_blocks_once_and_only_when_every_holder_goes() -> None:
    bm, hashes = cached_pool()
    bm.grow("b", 6, [0, 1])  # 0, 1 shared; 3 own
    assert bm.num_released_by(["b"]) == 1 and bm.num_released_by(["a"]) == 1
    assert bm.num_released_by(["a", "b"]) == 4


def test_without_caching_nothing_is_cached() -> None:
    bm = BlockManager(4, 2)
    bm.grow("a", 4)
    bm.cache_blocks("a", [b"x" * 32, b"y" * 32], 2)
    assert bm.num_cached_blocks == 0 and bm.lookup([b"x" * 32]) == []
    bm.free("a")
    assert bm.evictable() == [] and bm.num_free_blocks == 4
