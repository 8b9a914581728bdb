"""K/V block accounting (paged K/V): pure bookkeeping, never a tensor.

The K/V pool (orca/worker/kv_cache.py, on the worker) is preallocated once as ``num_blocks`` fixed-size blocks of
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
        # The free blocks as maximal runs of consecutive ids, [start, end] inclusive, indexed both ways, with
        # two lazy heaps over them: by length (longest first, then lowest start) for placement and by
        # start for first fit. A heap entry is current while its run still exists; stale ones are skipped
        # when met, and the heaps are rebuilt when they have grown stale enough.
        self._num_free = num_blocks
        self._run_end: dict[int, int] = {}
        self._run_start: dict[int, int] = {}
        self._longest: list[tuple[int, int, int]] = []  # (-length, start, end)
        self._lowest: list[int] = []  # run starts
        self._tables: dict[str, list[int]] = {}
        self._add_run(0, num_blocks - 1)

    @property
    def n_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_allocated_blocks(self) -> int:
        return self.num_blocks - self._num_free

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
        return self.blocks_needed(request_id, num_tokens) <= self._num_free

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Extends the request's table to hold num_tokens tokens; returns the blocks added (maybe none).
        RuntimeError when the pool has too few free blocks: callers check can_grow first."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > self._num_free:
            raise RuntimeError(f"{request_id} needs {need} more blocks, {self._num_free} are free")
        table = self._tables.setdefault(request_id, [])
        new: list[int] = []
        if self.placement == "lowest":
            while len(new) < need:
                new.append(self._take_first(self._lowest_start()))
        elif need and not table:
            run = self._longest_run()
            if run is not None and run[1] - run[0] + 1 >= 2 * need:  # room for it and as much again
                first = run[0] + (run[1] - run[0] + 1 - need) // 2
                self._carve(run, first, need)
                new = list(range(first, first + need))
        while len(new) < need:
            last = new[-1] if new else (table[-1] if table else None)
            # The block after an allocated one, when free, starts a run.
            after = last + 1 if last is not None and last + 1 in self._run_end else None
            new.append(self._take_first(after if after is not None else self._lowest_start()))
        table.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Returns every block of the request to the pool; the number freed."""
        table = self._tables.pop(request_id, [])
        for block in table:
            start, end = block, block
            if block - 1 in self._run_start:  # joins the run ending just before it
                start = self._run_start[block - 1]
                self._remove_run(start)
            if block + 1 in self._run_end:  # and the one starting just after it
                end = self._run_end[block + 1]
                self._remove_run(block + 1)
            self._add_run(start, end)
            self._num_free += 1
        return len(table)

    # -- the free runs ----------------------------------------------------------------------------
    def _add_run(self, start: int, end: int) -> None:
        self._run_end[start], self._run_start[end] = end, start
        heapq.heappush(self._longest, (start - end - 1, start, end))
        heapq.heappush(self._lowest, start)
        if len(self._longest) > 4 * len(self._run_end) + 64:  # mostly stale: rebuild both
            self._longest = [(s - e - 1, s, e) for s, e in self._run_end.items()]
            heapq.heapify(self._longest)
            self._lowest = sorted(self._run_end)

    def _remove_run(self, start: int) -> None:
        del self._run_start[self._run_end.pop(start)]

    def _longest_run(self) -> tuple[int, int] | None:
        """The longest free run (the lowest of equals) as (start, end), or None when no block is free."""
        while self._longest:
            _, start, end = self._longest[0]
            if self._run_end.get(start) == end:
                return start, end
            heapq.heappop(self._longest)
        return None

    def _lowest_start(self) -> int:
        """The lowest free block (the start of the lowest run); some block must be free."""
        while self._lowest[0] not in self._run_end:
            heapq.heappop(self._lowest)
        return self._lowest[0]

    def _take_first(self, start: int) -> int:
        """Takes the first block of the free run starting at `start`; returns it."""
        end = self._run_end[start]
        self._remove_run(start)
        if start < end:
            self._add_run(start + 1, end)
        self._num_free -= 1
        return start

    def _carve(self, run: tuple[int, int], first: int, count: int) -> None:
        """Takes blocks [first, first + count) out of the free run `run`, leaving what is left either side."""
        start, end = run
        self._remove_run(start)
        if start < first:
            self._add_run(start, first - 1)
        if first + count <= end:
            self._add_run(first + count, end)
        self._num_free -= count
