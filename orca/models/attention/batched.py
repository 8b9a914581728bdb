"""attention_backend ``batched``: the reference for prompts and chunks, and the iteration's increments
together: their keys and values gathered from the pool as whole blocks into padded groups of similar
lengths (IncrementBatch, one ``index_select`` per group and layer), then two batched matmuls and a masked
softmax per group (grouped-query attention as query rows of the shared K/V head, no repeat). Why: an
increment as its own SDPA call pays a call's fixed cost (docs/BENCHMARKS.md, "Results: the fast data
plane, fourth step: batched increments"). When `auto` picks it: orca/worker/resolution.py.

Short requests (up to VERIFYING_MAX_ROWS tokens after a cached prefix: speculation being verified) are
batched too, in groups of their own, query rows padded to the group's longest. Below
BATCHED_MIN_INCREMENTS the reference's per-request calls run (they read the pool as views, no copy).
Slots past a row's length are masked, so the worker zeroes blocks it hands out (reads_whole_blocks). A
quantized pool is dequantized as it is gathered. Thresholds: orca/tuning.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from orca import tuning
from orca.models.attention.base import AttentionMetadata, PhaseTimer, leading_increments, read_blocks
from orca.models.attention.reference import ReferenceMetadata
from orca.models.device import upload


@dataclass(kw_only=True)
class BatchedMetadata(ReferenceMetadata):
    """The reference's layout plus the increments (rows [0, num_increment), BATCHED_MIN_INCREMENTS or
    more) in groups, which read their keys and values through the groups (no views, no gather)."""

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
        """BatchedMetadata from BATCHED_MIN_INCREMENTS increments on; below that the reference's metadata."""
        if padding:
            raise ValueError("padding rows need the flex backend")
        num_batched = leading_increments(lengths, context_lens, tuning.VERIFYING_MAX_ROWS)
        if num_batched < tuning.BATCHED_MIN_INCREMENTS:
            return ReferenceMetadata.per_request(lengths, context_lens, block_tables, block_size, kv_pool, timer,
                                                 leading_increments(lengths, context_lens), kv_scales=kv_scales)
        increments = IncrementBatch.groups(lengths[:num_batched], context_lens[:num_batched],
                                           block_tables[:num_batched], block_size, kv_pool.device)
        return cls.per_request(lengths, context_lens, block_tables, block_size, kv_pool, timer, num_batched,
                               elsewhere=num_batched, kv_scales=kv_scales, increments=increments)

    def attend(
        self, q: torch.Tensor, pool: torch.Tensor, scale: float, window: int | None,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The increments group by group (q (n, H, D) -> (n, H * D)), then the other requests as the
        reference runs them."""
        _, num_heads, head_dim = q.shape
        num_kv_heads = pool.shape[1]
        group = num_heads // num_kv_heads
        outputs: list[torch.Tensor] = []
        for batch in self.increments:
            n, queries = batch.rows, batch.queries
            kv = read_blocks(pool, scales, batch.block_size, batch.blocks, q.dtype).view(
                2, num_kv_heads * n, batch.width, head_dim)
            # The `group` query heads sharing a K/V head are query rows against it: KVH x n batched
            # (queries x group, D) x (D, width) products, scale and mask in the same call.
            if batch.q_index is None:  # increments: one row each, consecutive
                qb = q[batch.first : batch.first + n]
            else:  # short requests: each one's rows, padded to `queries` (the padding rows' outputs dropped)
                qb = q.index_select(0, batch.q_index)
            qb = qb.view(n, queries, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4)
            qb = qb.reshape(num_kv_heads * n, queries * group, head_dim)
            mask = batch.mask(window, qb.dtype, num_kv_heads, group)  # (KVH x n, 1 or queries x group, width)
            scores = torch.baddbmm(mask, qb, kv[0].transpose(1, 2), alpha=scale)  # (KVH x n, Q x group, width)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qb.dtype)  # float32, as SDPA's kernels
            out = torch.bmm(probs, kv[1])  # (KVH x n, queries x group, D)
            out = out.view(num_kv_heads, n, queries, group, head_dim).permute(1, 2, 0, 3, 4)
            out = out.reshape(n * queries, num_heads * head_dim)
            outputs.append(out if batch.out_index is None else out.index_select(0, batch.out_index))
        return ReferenceMetadata.attend(self, q, pool, scale, window, scales, outputs)


@dataclass
class IncrementBatch:
    """A group of the batched backend's increments (or short requests): requests [first, first + rows).
    Request r's past_r + n_r keys and values are row r of a padded (rows, width) batch of whole blocks,
    width = the group's longest row's blocks x block_size; `blocks` lists each row's blocks, padded with
    its first block again. Slots past a row's length are masked (and finite: zeroed blocks).

    Increments have `queries` 1. Short requests: `queries` = the longest's new tokens, `q_index` picks each
    request's rows padded with its last, `out_index` picks the real rows back out. `keys[r, j]`: how many
    keys query j of request r sees (1 for a padding query). `mask(window)` is built once per window and
    dtype and shared by every layer."""

    first: int
    rows: int
    blocks: torch.Tensor  # (rows * blocks per row,) int64
    keys: torch.Tensor  # (rows, queries) int64
    block_size: int
    width: int  # blocks per row x block_size
    queries: int = 1
    q_index: torch.Tensor | None = None  # (rows * queries,) int64: short requests' rows, padded
    out_index: torch.Tensor | None = None  # (their tokens,) int64: the real rows of (rows * queries) outputs
    _masks: dict[tuple[int | None, torch.dtype, int, int], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def groups(cls, lengths: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
               block_size: int, device: torch.device) -> tuple[IncrementBatch, ...]:
        """The increments, then the short requests, in groups: a new group starts where the increments end
        and where a row would pad the group by more than BATCHED_GROUP_SLOTS slots. None: no group."""
        bounds, start, width, group_slots = [], 0, 0, tuning.BATCHED_GROUP_SLOTS
        for i, (n, past) in enumerate(zip(lengths, context_lens)):
            need = -(-(past + n) // block_size)
            if i > start and ((n > 1) != (lengths[start] > 1) or (
                    need > width and (i - start) * (need - width) * block_size > group_slots)):
                bounds.append((start, i))
                start = i
            width = need if i == start else max(width, need)
        if context_lens:
            bounds.append((start, len(context_lens)))
        row_of = [0]
        for n in lengths:
            row_of.append(row_of[-1] + n)
        return tuple(cls.build(a, row_of[a], lengths[a:b], context_lens[a:b], block_tables[a:b], block_size, device)
                     for a, b in bounds)

    @classmethod
    def build(cls, first: int, first_row: int, lengths: Sequence[int], context_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int, device: torch.device) -> IncrementBatch:
        per_row = -(-max(p + n for n, p in zip(lengths, context_lens)) // block_size)
        blocks: list[int] = []
        for n, past, table in zip(lengths, context_lens, block_tables):
            used = -(-(past + n) // block_size)
            blocks.extend(table[:used])
            blocks.extend([table[0]] * (per_row - used))
        queries = max(lengths)
        keys = [[past + j + 1 if j < n else 1 for j in range(queries)] for n, past in zip(lengths, context_lens)]
        q_index = out_index = None
        if queries > 1:
            rows, kept, row = [], [], first_row
            for i, n in enumerate(lengths):
                rows.extend(row + min(j, n - 1) for j in range(queries))
                kept.extend(i * queries + j for j in range(n))
                row += n
            q_index, out_index = upload(rows, torch.int64, device), upload(kept, torch.int64, device)
        return cls(first, len(lengths), upload(blocks, torch.int64, device), upload(keys, torch.int64, device),
                   block_size, per_row * block_size, queries, q_index, out_index)

    def mask(self, window: int | None, dtype: torch.dtype, num_kv_heads: int, group: int = 1) -> torch.Tensor:
        """Additive mask, K/V head major, 0 where a query keeps the slot, -inf elsewhere: (KVH x requests,
        1, width) for increments, (KVH x requests, queries x group, width) for short requests."""
        key = (window, dtype, num_kv_heads, group if self.queries > 1 else 1)
        if key not in self._masks:
            column = torch.arange(self.width, device=self.keys.device)  # (width,)
            keys = self.keys[:, :, None]  # (rows, queries, 1)
            keep = column < keys
            if window is not None:
                keep &= column >= keys - window
            zeros = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
            mask = zeros.masked_fill(~keep, float("-inf"))  # (rows, queries, width)
            if self.queries > 1:
                mask = mask[:, :, None].expand(-1, -1, group, -1).reshape(self.rows, self.queries * group, -1)
            self._masks[key] = mask.repeat(num_kv_heads, 1, 1)
        return self._masks[key]
