"""K/V block accounting (paged K/V): pure bookkeeping, never a tensor.

The K/V pool (orca/kv_cache.py, on the worker) is preallocated once as ``num_blocks`` fixed-size blocks of
``block_size`` slots; a slot holds one token's keys and values in every layer, so ``n_slots`` =
``num_blocks x block_size`` keeps Orca's meaning. Each request owns a block table: the ids of its blocks in
order, token ``p`` living in slot ``table[p // block_size] * block_size + p % block_size``. Blocks are
handed out lowest id first (a heap), so a request that takes several blocks at once usually gets a run
of consecutive ones, which the worker reads as one view instead of a gather.
"""

from __future__ import annotations

import heapq


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest id first
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
        new = [heapq.heappop(self._free) for _ in range(need)]
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Returns every block of the request to the pool; the number freed."""
        table = self._tables.pop(request_id, [])
        for block in table:
            heapq.heappush(self._free, block)
        return len(table)
