"""The flex backend's view of an iteration (FlexLayout): each row's request and position, the requests' block
tables, and the block-sparse structure of which pool slot tiles each query tile visits; built on the host
with numpy, as wide as the iteration needs, never as the pool."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from orca.models.device import upload_arrays

# Flex tiles: FLEX_Q_BLOCK query rows by at least FLEX_KV_BLOCK pool slots (a whole number of K/V blocks).
FLEX_Q_BLOCK = 16
FLEX_KV_BLOCK = 16
PADDING_ROW = -1  # a padding row's request and position in FlexLayout: it keeps no slot


@dataclass
class FlexLayout:
    """What the flex backend needs of an iteration, built once and shared by every layer.

    Per token row: its request (`q_request`, an index into `tables`) and position (`q_position`). Per
    request: its block table (`tables`, -1 past its length). Per pool block: its index in the tables that
    hold it (`block_index`; shared prefix blocks have the same index in each). A query keeps slot s of
    block b when its request's table holds b at that index and the slot's position is at most its own
    (and within its window). Padding rows have request 0 and position -1: they keep nothing (zeros).

    Block-sparse structure: query tile i (FLEX_Q_BLOCK rows) visits slot tile j (`kv_block` slots) when a
    request with a row in i has a block in j not after its last row there. `kv_num_blocks` (1, 1, Q tiles)
    and `kv_indices` (1, 1, Q tiles, width) int32 are as wide as the iteration needs, never the pool; CUDA
    graphs' static buffers have fixed bounding widths and take narrower ones in copy_. A `paged` layout
    (FlexMetadata.attend's paged decode kernel) has the rows and tables only."""

    q_request: torch.Tensor  # (T,) int32
    q_position: torch.Tensor  # (T,) int32
    tables: torch.Tensor  # (requests, table width) int32, -1 past each request's blocks
    block_index: torch.Tensor | None  # (pool blocks,) int32; None when paged
    kv_num_blocks: torch.Tensor | None  # (1, 1, Q tiles) int32; None when paged
    kv_indices: torch.Tensor | None  # (1, 1, Q tiles, width) int32; None when paged
    block_size: int
    kv_block: int
    num_tokens: int
    num_slots: int
    _masks: dict[int | None, object] = field(default_factory=dict)

    @property
    def paged(self) -> bool:
        """A layout for the paged decode kernel: no block-sparse structure."""
        return self.kv_indices is None

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        num_slots: int,
        device: torch.device,
        padding: int = 0,
        paged: bool = False,
    ) -> FlexLayout:
        kv_block = _kv_block(block_size)
        num_tokens = sum(lengths) + padding
        num_q_tiles = -(-num_tokens // FLEX_Q_BLOCK)
        num_requests = len(lengths)
        n_arr = np.asarray(lengths, dtype=np.int64)
        past_arr = np.asarray(context_lens, dtype=np.int64)
        held = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_requests)
        used_arr = np.minimum(-(-(past_arr + n_arr) // block_size), held)
        # At least two requests, blocks and slot tiles wide: compiled flex specialises a size of 1. Filled
        # in one assignment, not a row at a time (docs/BENCHMARKS.md, "Results: the CUDA path on an H200,
        # third session (2026-11-27)").
        width = max(int(used_arr.max(initial=0)), 2)
        tables = np.full((max(num_requests, 2), width), -1, dtype=np.int32)
        tables[:num_requests][np.arange(width) < used_arr[:, None]] = np.fromiter(
            itertools.chain.from_iterable(itertools.islice(t, u) for t, u in zip(block_tables, used_arr.tolist())),
            dtype=np.int32, count=int(used_arr.sum()))
        q_request = np.zeros(num_tokens, dtype=np.int32)  # padding rows: request 0, position -1 (keep nothing)
        q_position = np.full(num_tokens, PADDING_ROW, dtype=np.int32)
        row0 = np.concatenate([[0], np.cumsum(n_arr)[:-1]]) if num_requests else np.zeros(0, dtype=np.int64)
        real = int(n_arr.sum())
        q_request[:real] = np.repeat(np.arange(num_requests, dtype=np.int32), n_arr)
        q_position[:real] = (np.arange(real) - np.repeat(row0, n_arr) + np.repeat(past_arr, n_arr)).astype(np.int32)
        if paged:
            q_request_t, q_position_t, tables_t = upload_arrays([q_request, q_position, tables], torch.int32, device)
            return cls(q_request=q_request_t, q_position=q_position_t, tables=tables_t, block_index=None,
                       kv_num_blocks=None, kv_indices=None, block_size=block_size, kv_block=kv_block,
                       num_tokens=num_tokens, num_slots=num_slots)
        # The requests' blocks, flattened: owner, index in its table, slot tile.
        owner = np.repeat(np.arange(num_requests), used_arr)
        index = np.arange(int(used_arr.sum())) - np.repeat(np.cumsum(used_arr) - used_arr, used_arr)
        blocks = tables[owner, index].astype(np.int64)
        # (query tile, slot tile) pairs: each block with every query tile whose last row of its request is
        # at or after the block's first position.
        first_tile, last_tile = row0 // FLEX_Q_BLOCK, (row0 + n_arr - 1) // FLEX_Q_BLOCK
        per_block = (last_tile - first_tile + 1)[owner]
        pair_block = np.repeat(np.arange(len(blocks)), per_block)
        pair_owner = owner[pair_block]
        tile = first_tile[pair_owner] + np.arange(len(pair_block)) - np.repeat(np.cumsum(per_block) - per_block,
                                                                               per_block)
        last_row = np.minimum(row0[pair_owner] + n_arr[pair_owner], (tile + 1) * FLEX_Q_BLOCK) - 1
        last_position = past_arr[pair_owner] + last_row - row0[pair_owner]
        keep = index[pair_block] * block_size <= last_position
        num_kv_tiles = -(-num_slots // kv_block)
        keys = np.unique(tile[keep] * num_kv_tiles + blocks[pair_block[keep]] * block_size // kv_block)
        key_tile, key_kv = keys // num_kv_tiles, keys % num_kv_tiles
        kv_num_blocks = np.bincount(key_tile, minlength=num_q_tiles).astype(np.int32)
        kv_indices = np.zeros((num_q_tiles, max(int(kv_num_blocks.max(initial=0)), 2)), dtype=np.int32)
        kv_indices[key_tile, np.arange(len(keys)) - (np.cumsum(kv_num_blocks) - kv_num_blocks)[key_tile]] = key_kv
        # Everything in one copy (upload_arrays); the pool-sized block index is made on the device from the
        # iteration's (block, index) pairs, so only they cross from the host.
        q_request_t, q_position_t, tables_t, pairs, kv_num_blocks_t, kv_indices_t = upload_arrays(
            [q_request, q_position, tables, np.stack([blocks, index]), kv_num_blocks, kv_indices], torch.int32, device)
        block_index = torch.zeros(num_slots // block_size, dtype=torch.int32, device=device)
        block_index[pairs[0]] = pairs[1]
        return cls(
            q_request=q_request_t, q_position=q_position_t, tables=_dynamic(tables_t, 0, 1), block_index=block_index,
            kv_num_blocks=kv_num_blocks_t[None, None], kv_indices=_dynamic(kv_indices_t[None, None], 3),
            block_size=block_size, kv_block=kv_block, num_tokens=num_tokens, num_slots=num_slots,
        )

    @classmethod
    def static(cls, rows: int, max_blocks: int, block_size: int, num_slots: int, device: torch.device,
               paged: bool = False) -> FlexLayout:
        """All-padding buffers for CUDA graphs' decode iterations of up to `rows` one-token requests of up
        to `max_blocks` blocks: tables (rows, max_blocks), and up to max_blocks slot tiles per request of a
        query tile (a request's blocks may be scattered anywhere in the pool)."""
        kv_block = _kv_block(block_size)
        q_request = torch.zeros(rows, dtype=torch.int32, device=device)
        q_position = torch.full((rows,), PADDING_ROW, dtype=torch.int32, device=device)
        tables = torch.full((max(rows, 2), max(max_blocks, 2)), -1, dtype=torch.int32, device=device)
        if paged:
            return cls(q_request=q_request, q_position=q_position, tables=tables, block_index=None, kv_num_blocks=None,
                       kv_indices=None, block_size=block_size, kv_block=kv_block, num_tokens=rows, num_slots=num_slots)
        num_q_tiles, num_kv_tiles = -(-rows // FLEX_Q_BLOCK), -(-num_slots // kv_block)
        width = max(min(num_kv_tiles, FLEX_Q_BLOCK * max_blocks), 2)
        # (1, 1, ...) views of 1-D and 2-D tensors, as build's are: compiled flex guards on a view's base
        return cls(
            q_request=q_request, q_position=q_position, tables=_dynamic(tables, 0, 1),
            block_index=torch.zeros(num_slots // block_size, dtype=torch.int32, device=device),
            kv_num_blocks=torch.zeros(num_q_tiles, dtype=torch.int32, device=device)[None, None],
            kv_indices=_dynamic(torch.zeros(num_q_tiles, width, dtype=torch.int32, device=device)[None, None], 3),
            block_size=block_size, kv_block=kv_block, num_tokens=rows, num_slots=num_slots,
        )

    def head(self, num_tokens: int) -> FlexLayout:
        """The layout of this one's first `num_tokens` rows, sharing its tensors (views): one per CUDA graph
        size over one set of static buffers (orca/worker/cuda_graphs.py). The tables stay whole."""
        if self.paged:
            return dataclasses.replace(self, q_request=self.q_request[:num_tokens],
                                       q_position=self.q_position[:num_tokens], num_tokens=num_tokens, _masks={})
        q_tiles = -(-num_tokens // FLEX_Q_BLOCK)
        width = self.kv_indices.shape[-1]
        # (Unpaged static layouts serve the tests' CPU runs only: on CUDA every captured size is paged.)
        # Views with a fresh layout's contiguous strides, as build's are.
        return FlexLayout(
            q_request=self.q_request[:num_tokens], q_position=self.q_position[:num_tokens], tables=self.tables,
            block_index=self.block_index,
            kv_num_blocks=self.kv_num_blocks.view(-1)[:q_tiles].view(1, 1, q_tiles),
            kv_indices=_dynamic(self.kv_indices.view(-1)[:q_tiles * width].view(1, 1, q_tiles, width), 3),
            block_size=self.block_size, kv_block=self.kv_block, num_tokens=num_tokens, num_slots=self.num_slots,
        )

    def copy_(self, other: FlexLayout) -> None:
        """Copies `other`'s values (same token count and pool, tables and tiles within this layout's
        widths) into this layout's tensors, in place."""
        if other.paged != self.paged:
            raise ValueError("a paged layout and a flex_attention one do not copy into each other")
        if (other.num_tokens, other.num_slots, other.block_size) != (self.num_tokens, self.num_slots, self.block_size):
            raise ValueError(f"a layout of {other.num_tokens} rows over {other.num_slots} slots does not fit one of "
                             f"{self.num_tokens} rows over {self.num_slots} slots")
        requests, width = other.tables.shape
        kv_width, kv_room = (0, 0) if self.paged else (other.kv_indices.shape[-1], self.kv_indices.shape[-1])
        if requests > self.tables.shape[0] or width > self.tables.shape[1] or kv_width > kv_room:
            raise ValueError(f"an iteration of {requests} requests of up to {width} blocks, visiting up to "
                             f"{kv_width} slot tiles per query tile, exceeds the static layout's "
                             f"{tuple(self.tables.shape)} tables and {kv_room} slot tiles")
        self.q_request.copy_(other.q_request, non_blocking=True)
        self.q_position.copy_(other.q_position, non_blocking=True)
        self.tables.fill_(-1)
        self.tables[:requests, :width].copy_(other.tables, non_blocking=True)
        if self.paged:
            return
        for name in ("block_index", "kv_num_blocks"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)
        self.kv_indices.zero_()
        self.kv_indices[..., :kv_width].copy_(other.kv_indices, non_blocking=True)

    def mask_mod(self, window: int | None) -> Callable:
        """flex_attention's mask function: whether query row q keeps pool slot kv."""
        q_request, q_position, tables, index = self.q_request, self.q_position, self.tables, self.block_index
        block_size = self.block_size

        def keep(b, h, q, kv):  # noqa: ANN001, ANN202 - flex's signature (index tensors)
            block = kv // block_size
            position = index[block] * block_size + kv % block_size
            kept = (tables[q_request[q], index[block]] == block) & (position <= q_position[q])
            if window is not None:
                kept = kept & (q_position[q] - position < window)
            return kept

        return keep

    def block_mask(self, window: int | None = None):  # noqa: ANN201 - a BlockMask (imported lazily)
        """The BlockMask of this iteration (one per window size: the sliding layers' differs)."""
        if self.paged:
            raise ValueError("a paged layout has no block-sparse structure (the paged decode kernel reads it)")
        if window not in self._masks:
            from torch.nn.attention.flex_attention import BlockMask

            self._masks[window] = BlockMask.from_kv_blocks(
                self.kv_num_blocks, self.kv_indices, BLOCK_SIZE=(FLEX_Q_BLOCK, self.kv_block),
                mask_mod=self.mask_mod(window), seq_lengths=(self.num_tokens, self.num_slots),
                compute_q_blocks=False,
            )
        return self._masks[window]


def compact_blocks(lengths: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                   block_size: int) -> tuple[list[int], list[list[int]]]:
    """The pool blocks an iteration reads, in order of first use and renumbered 0, 1, ... in the tables
    given back: the compact pool of dequantized blocks for flex_attention over a quantized pool. Padded with
    the first block (masked out) to whole slot tiles, at least two (compiled flex specialises one)."""
    index: dict[int, int] = {}
    tables = []
    for n, past, table in zip(lengths, context_lens, block_tables):
        tables.append([index.setdefault(b, len(index)) for b in table[:-(-(past + n) // block_size)]])
    used = list(index)
    per_tile = _kv_block(block_size) // block_size
    used += used[:1] * (max(2 * per_tile, -(-len(used) // per_tile) * per_tile) - len(used))
    return used, tables


def _kv_block(block_size: int) -> int:
    """A slot tile: whole K/V blocks, at least FLEX_KV_BLOCK slots."""
    return -(-FLEX_KV_BLOCK // block_size) * block_size


def _dynamic(tensor: torch.Tensor, *dims: int) -> torch.Tensor:
    """`tensor` with `dims` (each at least 2 long) marked dynamic for compiled flex: these widths change
    every iteration, and a size first seen as a constant would recompile at its first change."""
    import torch._dynamo

    torch._dynamo.mark_dynamic(tensor, dims)
    return tensor
