"""K/V block accounting (paged K/V): pure bookkeeping, never a tensor.

The pool (orca/worker/kv_cache.py) is ``num_blocks`` blocks of ``block_size`` slots (``n_slots`` keeps Orca's
meaning); a request's block table maps token ``p`` to slot ``table[p // block_size] * block_size + p %
block_size``. Placement keeps tables consecutive while the pool has room, since the worker reads those as one
view (docs/BENCHMARKS.md, "Block placement: consecutive tables"): a request's first blocks go to the middle
of the largest free run that holds them twice over, later ones right after its last, else the lowest free
id; ``placement="lowest"`` is first fit, for tests. The prefix cache (SHA-256 hash chains, reference counts,
LRU eviction of unreferenced cached blocks): docs/design.md, "Prefix caching".
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

PLACEMENTS = ("contiguous", "lowest")


def root_hash(cache_salt: str | None, lora_id: int = 0) -> bytes:
    """The parent hash of a request's first block: the same for every request without a salt and without
    a LoRA adapter, and a different one per salt and per adapter (keys and values computed with an
    adapter are that adapter's: orca/core/lora.py)."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    if lora_id:
        salt += b"\x02" + lora_id.to_bytes(8, "little")
    return hashlib.sha256(b"orca-prefix-cache-v1" + salt).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: SHA-256 over its parent's hash (32 bytes) and its token ids (int64 each)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, placement: str = "contiguous", enable_caching: bool = False
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        self.placement = placement
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Free blocks as maximal runs [start, end], indexed both ways, with two lazy heaps (by length, by
        # start); stale entries are skipped when met, and the heaps rebuilt when mostly stale.
        self._num_free = num_blocks
        self._run_end: dict[int, int] = {}
        self._run_start: dict[int, int] = {}
        self._longest: list[tuple[int, int, int]] = []  # (-length, start, end)
        self._lowest: list[int] = []  # run starts
        self._tables: dict[str, list[int]] = {}
        self._add_run(0, num_blocks - 1)
        # The prefix cache: references per block, hash <-> block, unreferenced cached blocks (LRU first),
        # and per request how many leading blocks were offered to the cache.
        self.enable_caching = enable_caching
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._num_offered: dict[str, int] = {}
        self._shared_refs = 0  # references beyond a block's first, summed over the blocks

    @property
    def n_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take: free ones and cached ones nobody references."""
        return self._num_free + len(self._evictable)

    @property
    def num_allocated_blocks(self) -> int:
        """Blocks some request's table holds."""
        return self.num_blocks - self._num_free - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding reusable keys and values (referenced or not)."""
        return len(self._hash_of)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_shared_references(self) -> int:
        """References beyond the first, summed over the blocks: how many block-fulls of computed tokens the
        requests' tables count more than once."""
        return self._shared_refs

    def evictable(self) -> list[int]:
        """The cached blocks nobody references, least recently used first (for checks)."""
        return list(self._evictable)

    def refs(self, block: int) -> int:
        """The tables holding the block."""
        return self._refs[block]

    def block_hash(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

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

    def blocks_needed(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """More blocks the request must newly take to hold num_tokens tokens (0 when it holds enough),
        besides the `cached` blocks it would take by reference."""
        return max(0, self.blocks_for(num_tokens) - self.num_held(request_id) - len(cached))

    def can_grow(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        return self.blocks_needed(request_id, num_tokens, cached) <= self._takeable(cached)

    def _takeable(self, cached: Sequence[int]) -> int:
        """Blocks a request could newly take besides `cached`: cached blocks nobody references are counted
        free, and taking them by reference uses them up."""
        return self.num_free_blocks - sum(1 for b in cached if self._refs[b] == 0)

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a request's hash chain) that is cached."""
        found = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def grow(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Extends the request's table to hold num_tokens tokens, starting it (a request that holds no
        block) with the `cached` blocks (lookup's), taken by reference; returns the blocks added (maybe
        none), cached ones first. RuntimeError when the pool has too few free blocks: callers check
        can_grow first."""
        need = self.blocks_needed(request_id, num_tokens, cached)
        if not need and not cached and request_id in self._tables:  # most decode steps: room in its last block
            return []
        if need and need > self._takeable(cached):
            raise RuntimeError(f"{request_id} needs {need} more blocks, {self.num_free_blocks} are free")
        table = self._tables.setdefault(request_id, [])
        if cached:
            if table:
                raise RuntimeError(f"{request_id} holds blocks already: cached blocks start a table")
            for block in cached:
                if self._refs[block] == 0:
                    del self._evictable[block]
                else:
                    self._shared_refs += 1
                self._refs[block] += 1
            table.extend(cached)
            self._num_offered[request_id] = len(cached)  # (they are in the cache already)
        new = self._take(table, need)
        for block in new:
            self._refs[block] = 1
        table.extend(new)
        return [*cached, *new] if cached else new

    def _take(self, table: list[int], need: int) -> list[int]:
        """`need` unreferenced blocks for a table: placed in the free runs while they have blocks, then the
        least recently used cached blocks, evicted (in id order, so that a table stays consecutive where
        they are)."""
        from_runs = min(need, self._num_free)
        rest = need - from_runs
        new: list[int] = []
        if self.placement == "lowest":
            while len(new) < from_runs:
                new.append(self._take_first(self._lowest_start()))
        elif from_runs and not table:
            run = self._longest_run()
            if run is not None and run[1] - run[0] + 1 >= 2 * from_runs:  # room for it and as much again
                first = run[0] + (run[1] - run[0] + 1 - from_runs) // 2
                self._carve(run, first, from_runs)
                new = list(range(first, first + from_runs))
        while len(new) < from_runs:
            last = new[-1] if new else (table[-1] if table else None)
            # The block after an allocated one, when free, starts a run.
            after = last + 1 if last is not None and last + 1 in self._run_end else None
            new.append(self._take_first(after if after is not None else self._lowest_start()))
        if rest:
            evicted = []
            for _ in range(rest):
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
                evicted.append(block)
            new.extend(sorted(evicted))
        return new

    def cache_blocks(self, request_id: str, hashes: Sequence[bytes], num_full: int) -> None:
        """Offers the request's first `num_full` blocks, whose every slot holds computed keys and values,
        to the cache under `hashes` (its chain, at least num_full long). A block whose hash another block
        already holds stays out (its twin serves that prefix)."""
        table = self._tables.get(request_id)
        if not self.enable_caching or table is None:
            return
        for i in range(self._num_offered.get(request_id, 0), num_full):
            block, h = table[i], hashes[i]
            if block not in self._hash_of and h not in self._block_of:
                self._hash_of[block], self._block_of[h] = h, block
        self._num_offered[request_id] = max(num_full, self._num_offered.get(request_id, 0))

    def num_released_by(self, request_ids: Iterable[str]) -> int:
        """Blocks that would become takeable if these requests freed their tables."""
        counts = Counter(b for rid in request_ids for b in self._tables.get(rid, ()))
        return sum(1 for b, n in counts.items() if self._refs[b] == n)

    def free(self, request_id: str) -> int:
        """Drops the request's references to its blocks, last block first: a block nobody references any
        more stays cached (evictable) when the cache holds it, else goes back to the free runs. Returns the
        number of blocks that became takeable."""
        table = self._tables.pop(request_id, [])
        self._num_offered.pop(request_id, None)
        released = 0
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block]:
                self._shared_refs -= 1
                continue
            released += 1
            if block in self._hash_of:
                self._evictable[block] = None
                continue
            start, end = block, block
            if block - 1 in self._run_start:  # joins the run ending just before it
                start = self._run_start[block - 1]
                self._remove_run(start)
            if block + 1 in self._run_end:  # and the one starting just after it
                end = self._run_end[block + 1]
                self._remove_run(block + 1)
            self._add_run(start, end)
            self._num_free += 1
        return released

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
