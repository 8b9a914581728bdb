"""K/V block accounting (paged K/V): pure bookkeeping, never a tensor.

The K/V pool (orca/kv_cache.py, on the worker) is preallocated once as ``num_blocks`` fixed-size blocks of
``block_size`` slots; a slot holds one token's keys and values in every layer, so ``n_slots`` =
``num_blocks x block_size`` keeps Orca's meaning. Each request owns a block table: the ids of its blocks in
order, token ``p`` living in slot ``table[p // block_size] * block_size + p % block_size``.

Placement keeps tables consecutive while the pool has room, because the worker reads a request whose
blocks are consecutive as one view of the pool, and must gather the others' keys and values in every
layer of every iteration (4% of an offline iteration on the CPU, when every growing request had been
packed against its neighbour). A request's first blocks go to the middle of the largest run of free
blocks, when that run holds them twice over: the request gets the room after it to grow into, and the
request before the run keeps the room before it. Each later block is the one right after the request's
last block when that one is free. Otherwise, and when the pool is too full for either, the lowest free
id (a heap). ``placement="lowest"`` hands out the lowest free id always (first fit): the scheduler's tests
use it to state their expectations in block ids that follow from arithmetic alone.
"""

from __future__ import annotations

import heapq

PLACEMENTS = ("contiguous", "lowest")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, placement: str = "contiguous") -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        self.placement = placement
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: set[int] = set(range(num_blocks))
        # Lowest id first. Lazy: a block taken by placement stays in the heap until popped (and skipped
        # then, being no longer free); a block freed twice over its life may be in it twice.
        self._lowest: list[int] = list(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def n_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_allocated_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def num_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def owners(self) -> dict[str, list[int]]:
        """Every block table (copies), for checks."""
        return {rid: list(t) for rid, t in self._tables.items()}

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """More blocks the request needs to hold num_tokens tokens (0 when it holds enough)."""
        return max(0, self.blocks_for(num_tokens) - self.num_held(request_id))

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= len(self._free)

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Extends the request's table to hold num_tokens tokens; returns the blocks added (maybe none).
        RuntimeError when the pool has too few free blocks: callers check can_grow first."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"{request_id} needs {need} more blocks, {len(self._free)} are free")
        table = self._tables.setdefault(request_id, [])
        new: list[int] = []
        if self.placement == "lowest":
            new = [self._pop_lowest() for _ in range(need)]
        elif need and not table:
            start = self._placement(need)
            if start is not None:
                new = list(range(start, start + need))
                self._free.difference_update(new)
        while len(new) < need:
            last = new[-1] if new else (table[-1] if table else None)
            if last is not None and last + 1 in self._free:
                self._free.remove(last + 1)
                new.append(last + 1)
            else:
                new.append(self._pop_lowest())
        table.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Returns every block of the request to the pool; the number freed."""
        table = self._tables.pop(request_id, [])
        for block in table:
            self._free.add(block)
            heapq.heappush(self._lowest, block)
        if len(self._lowest) > 2 * self.num_blocks:  # stale entries: rebuild from the free set
            self._lowest = sorted(self._free)
        return len(table)

    def _pop_lowest(self) -> int:
        while True:
            block = heapq.heappop(self._lowest)
            if block in self._free:
                self._free.remove(block)
                return block

    def _placement(self, need: int) -> int | None:
        """Where a request's first `need` blocks go: the middle of the largest run of free blocks (the
        lowest such run), if it holds at least 2 x need; else None."""
        best_start, best_len = 0, 0
        run_start, prev = -2, -2
        for block in sorted(self._free):
            if block != prev + 1:
                run_start = block
            prev = block
            if block - run_start + 1 > best_len:
                best_start, best_len = run_start, block - run_start + 1
        if best_len < 2 * need:
            return None
        return best_start + (best_len - need) // 2
