"""attention_backend ``batched``: the reference for prompts and chunks, and the increments of the iteration
together: their keys and values gathered from the pool as whole blocks into padded groups of similar
lengths (IncrementBatch, one ``index_select`` per group and layer), then two batched matmuls and a masked
softmax per group (grouped-query attention as query rows of the shared K/V head, no repeat). An
increment's attention is a few thousand multiply-adds; as its own SDPA call it paid ~35 us of fixed cost
on this CPU, so batching 16-32 of them is 1.4-1.7x faster per layer (scripts/experiments/
attention_cpu.py), and the fastest measured on a CPU (docs/BENCHMARKS.md).

`auto` picks it on a CPU (the reference's per-request calls for prompts, one batch for the increments:
1.05-1.06x the reference's tokens/s offline here).

Limits: it batches an iteration's increments from BATCHED_MIN_INCREMENTS on; fewer run the reference's
per-request calls (the builder returns the reference's metadata), because the gather copies what it
reads, while the reference reads a request's consecutive blocks as a view of the pool with no copy. It
reads whole blocks: the slots past a row's length are masked and weigh 0, so they must hold finite
numbers, and the worker zeroes each block it hands to a request (reads_whole_blocks, KVLayout.zero_blocks).
A group's rows are padded to its longest row, so rows start a new group past BATCHED_GROUP_SLOTS slots of
padding. A quantized pool (kv_cache_dtype) is dequantized as it is gathered: each group's blocks and their
scales, then one multiply into the model's dtype (the zeroed blocks' values and scales both 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from orca.models.attention.base import AttentionMetadata, PhaseTimer, dequantize_kv, leading_increments
from orca.models.attention.reference import ReferenceMetadata
from orca.models.device import upload

# The batched backend batches an iteration's increments from this many on; fewer run the reference's
# per-request calls, which read a request's consecutive blocks as a view of the pool with no copy (a lone
# decode stream: 31.2 against 33.1 ms a SmolLM2 step at 1 row, 34.5 against 36.3 at 2; docs/BENCHMARKS.md).
BATCHED_MIN_INCREMENTS = 3
# Batched increments run in groups of rows (the worker orders increments by length): a new group starts
# where the next row's longer blocks would pad the group's rows by more than this many slots, about what a
# group's fixed cost (~60 us of calls here) buys in padded work.
BATCHED_GROUP_SLOTS = 384


@dataclass(kw_only=True)
class BatchedMetadata(ReferenceMetadata):
    """The reference's layout, and the increments (rows [0, num_increment), BATCHED_MIN_INCREMENTS or
    more) in groups of rows, which read their keys and values through them: their views are None and they
    are in no gather."""

    name = "batched"
    reads_whole_blocks = True

    increments: tuple[IncrementBatch, ...] = field()  # (required: the base's () is for the other backends)

    @classmethod
    def for_iteration(
        cls,
        lengths: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        kv_pool: torch.Tensor,
        timer: PhaseTimer | None = None,
        padding: int = 0,
        pad_slot: int = 0,
        kv_scales: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """BatchedMetadata from BATCHED_MIN_INCREMENTS increments on; below that the reference's metadata
        (its per-request calls)."""
        if padding:
            raise ValueError("padding rows need the flex backend")
        num_increment = leading_increments(lengths, context_lens)
        if num_increment < BATCHED_MIN_INCREMENTS:
            return ReferenceMetadata.per_request(lengths, context_lens, block_tables, block_size, kv_pool, timer,
                                                 num_increment, kv_scales=kv_scales)
        increments = IncrementBatch.groups(context_lens[:num_increment], block_tables[:num_increment], block_size,
                                           kv_pool.device)
        return cls.per_request(lengths, context_lens, block_tables, block_size, kv_pool, timer, num_increment,
                               elsewhere=num_increment, kv_scales=kv_scales, increments=increments)

    def attend(
        self, q: torch.Tensor, pool: torch.Tensor, scale: float, window: int | None,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The increments group by group, each at once (a group's rows q (n, H, D), one row per request ->
        (n, H * D)), then the other requests as the reference runs them."""
        _, num_heads, head_dim = q.shape
        num_kv_heads = pool.shape[1]
        group = num_heads // num_kv_heads
        outputs: list[torch.Tensor] = []
        for batch in self.increments:
            n = batch.rows
            blocks = pool.unflatten(2, (-1, batch.block_size))  # (2, KVH, pool blocks, block size, D)
            kv = blocks.index_select(2, batch.blocks).view(2, num_kv_heads * n, batch.width, head_dim)
            if scales is not None:
                kv_scales = scales.unflatten(2, (-1, batch.block_size)).index_select(2, batch.blocks)
                kv = dequantize_kv(kv, kv_scales.view(2, num_kv_heads * n, batch.width), q.dtype)
            # The `group` query heads sharing a K/V head are `group` query rows against it: a batch of KVH x n
            # (group, D) x (D, width) products, the scale and the mask added in the same call.
            qb = q[batch.first : batch.first + n].view(n, num_kv_heads, group, head_dim).transpose(0, 1)
            qb = qb.reshape(num_kv_heads * n, group, head_dim)
            mask = batch.mask(window, qb.dtype, num_kv_heads)  # (KVH x n, 1, width)
            scores = torch.baddbmm(mask, qb, kv[0].transpose(1, 2), alpha=scale)  # (KVH x n, group, width)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qb.dtype)  # float32, as SDPA's kernels
            out = torch.bmm(probs, kv[1])  # (KVH x n, group, D)
            outputs.append(out.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, num_heads * head_dim))
        return ReferenceMetadata.attend(self, q, pool, scale, window, scales, outputs)


@dataclass
class IncrementBatch:
    """A group of the batched backend's increments: rows [first, first + rows) of the iteration. Request r
    (one query row, `past_r` cached tokens) has past_r + 1 keys and values, laid out as row r of a padded
    (rows, width) batch of whole blocks, width = the group's longest row's blocks x block_size. `blocks`
    lists each row's blocks holding its keys, then padding: the row's first block again. Whole blocks copy
    in runs of block_size slots (1.7x faster than slot by slot here); the slots past a row's length (its
    last block's tail, its padding blocks) are masked and weigh 0, and hold finite numbers because the
    worker zeroes each block it hands to a request (KVLayout.zero_blocks). `mask(window)` is the additive
    mask that keeps each row's own keys (the last `window` of them), built once per window and dtype and
    shared by every layer."""

    first: int
    rows: int
    blocks: torch.Tensor  # (rows * blocks per row,) int64
    keys: torch.Tensor  # (rows, 1) int64: keys and values per row, past + 1
    block_size: int
    width: int  # blocks per row x block_size
    _masks: dict[tuple[int | None, torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def groups(cls, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int,
               device: torch.device) -> tuple[IncrementBatch, ...]:
        """The increments (rows in this order) in groups: a row starts a new group when its blocks would pad
        the current group's rows by more than BATCHED_GROUP_SLOTS slots. No increments: no group."""
        bounds, start, width = [], 0, 0
        for i, past in enumerate(context_lens):
            need = -(-(past + 1) // block_size)
            if need > width and (i - start) * (need - width) * block_size > BATCHED_GROUP_SLOTS:
                bounds.append((start, i))
                start = i
            width = need if i == start else max(width, need)
        if context_lens:
            bounds.append((start, len(context_lens)))
        return tuple(cls.build(a, context_lens[a:b], block_tables[a:b], block_size, device) for a, b in bounds)

    @classmethod
    def build(cls, first: int, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, device: torch.device) -> IncrementBatch:
        per_row = -(-(max(context_lens) + 1) // block_size)
        blocks: list[int] = []
        for past, table in zip(context_lens, block_tables):
            used = -(-(past + 1) // block_size)
            blocks.extend(table[:used])
            blocks.extend([table[0]] * (per_row - used))
        keys = upload([[p + 1] for p in context_lens], torch.int64, device)
        return cls(first, len(context_lens), upload(blocks, torch.int64, device), keys, block_size,
                   per_row * block_size)

    def mask(self, window: int | None, dtype: torch.dtype, num_kv_heads: int) -> torch.Tensor:
        """(KVH x requests, 1, width), K/V head major: 0 where a row keeps the slot, -inf elsewhere."""
        key = (window, dtype, num_kv_heads)
        if key not in self._masks:
            column = torch.arange(self.width, device=self.keys.device)[None]  # (1, width)
            keep = column < self.keys
            if window is not None:
                keep &= column >= self.keys - window
            zeros = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
            self._masks[key] = zeros.masked_fill(~keep, float("-inf")).repeat(num_kv_heads, 1)[:, None]
        return self._masks[key]

