"""Selective batching's one exception: attention, over the paged K/V pool, each token seeing only the keys and
values of its own request (Orca §3).

Every other op of an iteration runs once on the flattened [total tokens, hidden] tensor. Attention mixes
tokens of one request only, and requests differ in phase (initiation: a prompt or a chunk of it; increment:
one token) and in how many keys and values they already have, so it runs request by request against that
request's own keys and values, and the results are merged back into the flattened output.

Keys and values live in the worker's K/V pool (orca/kv_cache.py). Per layer, an iteration writes all its
new keys and values with one scatter (``index_copy_`` at each token's slot), then reads each request's
keys and values: a view of the pool when the request's blocks are consecutive, else one gather for all
such requests together. The slot arithmetic is done once per iteration (AttentionMetadata.build), not
once per layer.

Three implementations (EngineConfig.attention_backend):

- ``reference``: the split Orca describes, one ``scaled_dot_product_attention`` call per request and layer
  over that request's keys and values. The transformers-exact oracle of the tests.
- ``batched``: the reference for prompts and chunks, and the increments of the iteration together: their
  keys and values gathered from the pool as whole blocks into padded groups of similar lengths
  (IncrementBatch, one ``index_select`` per group and layer), then two batched matmuls and a masked
  softmax per group (grouped-query attention as query rows of the shared K/V head, no repeat). An
  increment's attention is a few thousand multiply-adds; as its own SDPA call it paid ~35 us of fixed cost
  on this CPU, so batching 16-32 of them is 1.4-1.7x faster per layer (scripts/experiments/
  attention_cpu.py), and the fastest measured on a CPU (docs/BENCHMARKS.md).
- ``flex``: one ``flex_attention`` call per layer for every token of the iteration (prompt chunks and
  increments together, grouped-query attention without repeating K/V), reading keys and values straight
  from the whole pool. A mask function keeps, for each query, the slots its own request owns up to its
  position (and within its sliding window); a block-sparse structure built from the block tables
  (FlexLayout) lets the fused kernel skip every block of the pool no query of a tile needs. On CUDA the call
  is compiled (Triton) with dynamic token counts; on a CPU it runs PyTorch's unfused flex implementation,
  which evaluates the mask over the whole pool: correct, for checking the fused path on a CPU, not fast.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from orca.config import ATTENTION_BACKENDS
from orca.device import upload

# The flex backend's tiles: FLEX_Q_BLOCK query rows (a tile of increments spans up to this many requests,
# whose blocks its kernel program reads) by at least FLEX_KV_BLOCK pool slots (a whole number of K/V blocks).
FLEX_Q_BLOCK = 16
FLEX_KV_BLOCK = 16
PADDING_ROW = -1  # a padding row's request and position in FlexLayout: it keeps no slot
# The batched backend batches an iteration's increments from this many on; fewer run the reference's
# per-request calls, which read a request's consecutive blocks as a view of the pool with no copy (a lone
# decode stream: 31.2 against 33.1 ms a SmolLM2 step at 1 row, 34.5 against 36.3 at 2; docs/BENCHMARKS.md).
BATCHED_MIN_INCREMENTS = 3
# Batched increments run in groups of rows (the worker orders increments by length): a new group starts
# where the next row's longer blocks would pad the group's rows by more than this many slots, about what a
# group's fixed cost (~60 us of calls here) buys in padded work.
BATCHED_GROUP_SLOTS = 384


def resolve_attention_backend(choice: str, device: torch.device) -> str:
    """EngineConfig.attention_backend to what runs: "reference", "batched" or "flex". auto = the fastest
    measured on the device: batched on a CPU (the reference's per-request calls for prompts, one batch for
    the increments: 1.05-1.06x the reference's tokens/s offline here; flex's paged mask does not compile for
    a CPU in torch 2.13); on CUDA, where nothing has been measured yet, reference until a GPU run shows
    another ahead (docs/design.md, the data plane)."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {choice!r}")
    if choice == "auto":
        return "batched" if device.type == "cpu" else "reference"
    return choice


@dataclass
class PhaseTimer:
    """Accumulates seconds per phase; syncs the device around each measured span (profiling only)."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


@dataclass
class AttentionMetadata:
    """The iteration's batch layout, passed explicitly to every layer (never a global).

    Requests are laid out increments first: rows [0, num_increment) are one token each, then each other
    request's rows follow. Request i feeds `lengths[i]` new tokens after `context_lens[i]` cached ones.
    `slot_mapping[t]` is the pool slot of token row t. Request i's keys and values (its `context_lens[i] +
    lengths[i]` tokens) are pool slots `views[i] = (s0, s1)` when its blocks are consecutive (views[i] is
    None otherwise); the others' slots are concatenated in `gather_index`, split by `gather_sizes`. When
    `increments` holds groups (the batched backend), the increments read their keys and values through
    them: their views are None and they are in no gather.
    """

    lengths: list[int]
    context_lens: list[int]
    num_increment: int
    slot_mapping: torch.Tensor  # (T,) int64
    views: list[tuple[int, int] | None]
    gather_index: torch.Tensor | None  # (sum of gathered lengths,) int64
    gather_sizes: list[int]
    kv_pool: torch.Tensor  # (layers, 2, KVH, slots, D)
    timer: PhaseTimer | None = None
    flex: FlexLayout | None = None  # the flex backend's layout; None runs the reference
    increments: tuple[IncrementBatch, ...] = ()  # the batched backend's increments, in groups of rows

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        kv_pool: torch.Tensor,
        timer: PhaseTimer | None = None,
        backend: str = "reference",
        padding: int = 0,
        pad_slot: int = 0,
    ) -> AttentionMetadata:
        """block_tables[i] covers request i's first context_lens[i] + lengths[i] tokens; increments come
        first (the worker orders the rows so). `backend`: "reference", "batched" or "flex" (resolved).
        `padding` rows follow the requests' (flex only: a decode iteration padded to a CUDA graph's size): each
        writes its keys and values to `pad_slot`, a slot no request owns, and attends to nothing (FlexLayout)."""
        if padding and backend != "flex":
            raise ValueError("padding rows need the flex backend")
        num_increment = 0
        while num_increment < len(lengths) and lengths[num_increment] == 1 and context_lens[num_increment] > 0:
            num_increment += 1
        slots: list[int] = []
        views: list[tuple[int, int] | None] = []
        gather: list[int] = []
        gather_sizes: list[int] = []
        # The increments that read their keys and values through IncrementBatch: all or none.
        batched = num_increment if backend == "batched" and num_increment >= BATCHED_MIN_INCREMENTS else 0
        for i, (n, past, table) in enumerate(zip(lengths, context_lens, block_tables)):
            total = past + n
            slots.extend(_slots(table, block_size, past, total))
            if backend == "flex":
                continue  # it reads the pool through FlexLayout, not through views and gathers
            if i < batched:
                views.append(None)  # (never read: the increments' keys and values come from IncrementBatch)
                continue
            used = -(-total // block_size)
            first = table[0]
            if table[used - 1] - first == used - 1 and all(table[j] == first + j for j in range(used)):
                views.append((first * block_size, first * block_size + total))
            else:
                views.append(None)
                gather.extend(_slots(table, block_size, 0, total))
                gather_sizes.append(total)
        slots.extend([pad_slot] * padding)
        device = kv_pool.device
        flex = None
        if backend == "flex":
            flex = FlexLayout.build(lengths, context_lens, block_tables, block_size, kv_pool.shape[3], device,
                                    padding)
        increments = IncrementBatch.groups(context_lens[:batched], block_tables[:batched], block_size, device)
        return cls(
            lengths=list(lengths),
            context_lens=list(context_lens),
            num_increment=num_increment,
            slot_mapping=upload(slots, torch.int64, device),
            views=views,
            gather_index=upload(gather, torch.int64, device) if gather else None,
            gather_sizes=gather_sizes,
            kv_pool=kv_pool,
            timer=timer,
            flex=flex,
            increments=increments,
        )


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


@dataclass
class FlexLayout:
    """What the flex backend needs of an iteration, built once and shared by every layer.

    Per token row: its request (`q_request`) and position (`q_position`). Per pool block: the request of
    this iteration that owns it (`block_owner`, -1 for the others) and the position of its first slot in
    that request (`block_start`). A query keeps slot s when block_owner[s // block_size] is its request
    and the slot's position block_start[...] + s % block_size is at most its own (and within its window):
    slots past a request's length, in its partly filled last block, are never kept. Padding rows (after
    the requests' rows) have request -1 and position -1: every slot's position is later, so they keep none
    and come out as zeros (flex's rule for a fully masked row).

    The block-sparse structure: the token rows in tiles of FLEX_Q_BLOCK, the pool's slots in tiles of
    `kv_block`; tile pair (i, j) is visited when a request with a row in query tile i owns a block in slot
    tile j. `kv_num_blocks` (1, 1, Q tiles) and `kv_indices` (1, 1, Q tiles, KV tiles): how many slot tiles
    each query tile visits and which, first."""

    q_request: torch.Tensor  # (T,) int32
    q_position: torch.Tensor  # (T,) int32
    block_owner: torch.Tensor  # (pool blocks,) int32
    block_start: torch.Tensor  # (pool blocks,) int32
    kv_num_blocks: torch.Tensor  # (1, 1, Q tiles) int32
    kv_indices: torch.Tensor  # (1, 1, Q tiles, KV tiles) int32
    block_size: int
    kv_block: int
    num_tokens: int
    num_slots: int
    _masks: dict[int | None, object] = field(default_factory=dict)

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
    ) -> FlexLayout:
        kv_block = -(-FLEX_KV_BLOCK // block_size) * block_size  # whole K/V blocks per slot tile
        num_tokens = sum(lengths) + padding
        q_request: list[int] = []
        q_position: list[int] = []
        owned: list[int] = []  # pool blocks in use by this iteration's requests, request by request
        owners: list[int] = []
        starts: list[int] = []
        tile_pairs: list[int] = []  # (request, query tile) pairs, flattened request * Q tiles + tile
        num_q_tiles = -(-num_tokens // FLEX_Q_BLOCK)
        row = 0
        for i, (n, past, table) in enumerate(zip(lengths, context_lens, block_tables)):
            q_request.extend([i] * n)
            q_position.extend(range(past, past + n))
            used = -(-(past + n) // block_size)
            owned.extend(table[:used])
            owners.extend([i] * used)
            starts.extend(range(0, used * block_size, block_size))
            first_tile, last_tile = row // FLEX_Q_BLOCK, (row + n - 1) // FLEX_Q_BLOCK
            tile_pairs.extend(i * num_q_tiles + t for t in range(first_tile, last_tile + 1))
            row += n
        q_request.extend([PADDING_ROW] * padding)
        q_position.extend([PADDING_ROW] * padding)
        num_blocks, num_kv_tiles = num_slots // block_size, -(-num_slots // kv_block)
        owned_t, owners_t = upload(owned, torch.int64, device), upload(owners, torch.int64, device)
        block_owner = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        block_owner[owned_t] = owners_t.to(torch.int32)
        block_start = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        block_start[owned_t] = upload(starts, torch.int32, device)
        # Which slot tiles each request reads, which query tiles each request has rows in; their product
        # is which slot tiles each query tile visits.
        num_requests = len(lengths)
        reads = torch.zeros(num_requests, num_kv_tiles, device=device)
        reads[owners_t, owned_t * block_size // kv_block] = 1.0
        rows = torch.zeros(num_requests * num_q_tiles, device=device)
        rows[upload(tile_pairs, torch.int64, device)] = 1.0
        visits = rows.view(num_requests, num_q_tiles).t() @ reads > 0  # (Q tiles, KV tiles)
        kv_num_blocks = visits.sum(-1, dtype=torch.int32)
        kv_indices = torch.argsort(visits.logical_not().to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return cls(
            q_request=upload(q_request, torch.int32, device),
            q_position=upload(q_position, torch.int32, device),
            block_owner=block_owner,
            block_start=block_start,
            kv_num_blocks=kv_num_blocks[None, None],
            kv_indices=kv_indices[None, None],
            block_size=block_size,
            kv_block=kv_block,
            num_tokens=num_tokens,
            num_slots=num_slots,
        )

    def head(self, num_tokens: int) -> FlexLayout:
        """The layout of this one's first `num_tokens` rows, sharing its tensors (views, so what is copied
        into this layout is what the head's masks read): one per CUDA graph size over one set of static
        buffers (orca/worker/cuda_graphs.py)."""
        q_tiles = -(-num_tokens // FLEX_Q_BLOCK)
        return FlexLayout(
            q_request=self.q_request[:num_tokens], q_position=self.q_position[:num_tokens],
            block_owner=self.block_owner, block_start=self.block_start,
            kv_num_blocks=self.kv_num_blocks[:, :, :q_tiles], kv_indices=self.kv_indices[:, :, :q_tiles],
            block_size=self.block_size, kv_block=self.kv_block, num_tokens=num_tokens, num_slots=self.num_slots,
        )

    def copy_(self, other: FlexLayout) -> None:
        """Takes `other`'s values (an iteration of the same token count over the same pool) into this
        layout's tensors, in place."""
        if (other.num_tokens, other.num_slots, other.block_size) != (self.num_tokens, self.num_slots, self.block_size):
            raise ValueError(f"a layout of {other.num_tokens} rows over {other.num_slots} slots does not fit one of "
                             f"{self.num_tokens} rows over {self.num_slots} slots")
        for name in ("q_request", "q_position", "block_owner", "block_start", "kv_num_blocks", "kv_indices"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)

    def mask_mod(self, window: int | None) -> Callable:
        """flex_attention's mask function: whether query row q keeps pool slot kv."""
        q_request, q_position, owner, start = self.q_request, self.q_position, self.block_owner, self.block_start
        block_size = self.block_size

        def keep(b, h, q, kv):  # noqa: ANN001, ANN202 - flex's signature (index tensors)
            block = kv // block_size
            position = start[block] + kv % block_size
            kept = (owner[block] == q_request[q]) & (position <= q_position[q])
            if window is not None:
                kept = kept & (q_position[q] - position < window)
            return kept

        return keep

    def block_mask(self, window: int | None = None):  # noqa: ANN201 - a BlockMask (imported lazily)
        """The BlockMask of this iteration (one per window size: the sliding layers' differs)."""
        if window not in self._masks:
            from torch.nn.attention.flex_attention import BlockMask

            self._masks[window] = BlockMask.from_kv_blocks(
                self.kv_num_blocks, self.kv_indices, BLOCK_SIZE=(FLEX_Q_BLOCK, self.kv_block),
                mask_mod=self.mask_mod(window), seq_lengths=(self.num_tokens, self.num_slots),
                compute_q_blocks=False,
            )
        return self._masks[window]


def _slots(table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Pool slots of token positions [start, end) for a request with this block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def selective_attention(
    q: torch.Tensor,  # (T, H, D): queries of all tokens of all requests
    kv: torch.Tensor,  # (T, 2, KVH, D): this iteration's new keys and values
    meta: AttentionMetadata,
    layer: int,
    scale: float,
    window: int | None = None,  # sliding window: a query sees its last `window` keys (itself included)
) -> torch.Tensor:  # (T, H * D)
    if torch.compiler.is_compiling():  # inside a compiled forward pass: one opaque op (see iteration_scope)
        return torch.ops.orca.selective_attention(q, kv, layer, scale, window)
    timer = meta.timer
    if timer is not None:
        timer.sync()
        t0 = time.perf_counter()
    # Write this iteration's keys and values into their slots: one scatter for every token of every request.
    pool = meta.kv_pool[layer]  # (2, KVH, slots, D)
    pool.index_copy_(2, meta.slot_mapping, kv.permute(1, 2, 0, 3))
    out = (_flex_attention if meta.flex is not None else _attention)(q, pool, meta, scale, window)
    if timer is not None:
        timer.sync()
        timer.add("attention", time.perf_counter() - t0)
    return out


def _attention(
    q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:
    """The reference: per request, over its keys and values in `pool` (this layer's, new ones written)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = pool.shape[1]
    group = num_heads // num_kv_heads  # query heads per K/V head (grouped-query attention)
    gathered = iter(())
    if meta.gather_index is not None:
        gathered = iter(pool.index_select(2, meta.gather_index).split(meta.gather_sizes, dim=2))

    def keys_values(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        view = meta.views[i]
        kvi = pool[:, :, view[0] : view[1]] if view is not None else next(gathered)  # (2, KVH, past + n, D)
        return kvi[0:1], kvi[1:2]  # (1, KVH, past + n, D) each

    outputs: list[torch.Tensor] = []
    n_inc = meta.num_increment
    if meta.increments:
        for batch in meta.increments:
            outputs.append(_batched_increments(q[batch.first : batch.first + batch.rows], pool, batch, scale, window))
    elif n_inc:
        # Increment: one query row per head and no mask. The `group` query heads sharing a K/V head become
        # `group` query rows of that head, so GQA needs no repeat of keys and values. The 4-D (batch 1)
        # form takes PyTorch's fused CPU kernel.
        q_inc = q[:n_inc].view(n_inc, num_kv_heads, group, head_dim).split(1)  # n_inc x (1, KVH, G, D)
        for i in range(n_inc):
            keys, values = keys_values(i)
            if window is not None:  # the last `window` keys only
                keys, values = keys[:, :, -window:], values[:, :, -window:]
            outputs.append(F.scaled_dot_product_attention(q_inc[i], keys, values, scale=scale))
        outputs = [torch.cat(outputs).view(n_inc, num_heads * head_dim)]  # (n_inc, H*D)
    start = n_inc
    for i in range(n_inc, len(meta.lengths)):
        n, past = meta.lengths[i], meta.context_lens[i]
        qi = q[start : start + n].transpose(0, 1)[None]  # (1, H, n, D)
        keys, values = keys_values(i)
        if window is not None and past + n > window:
            # Query j (position past + j) sees keys (past + j - window, past + j].
            mask = torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(past).triu(past - window + 1)
            oi = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        elif past == 0:
            # A whole prompt (or its first chunk) attends causally to itself.
            oi = F.scaled_dot_product_attention(qi, keys, values, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            # Several new tokens after a cached prefix (a later prompt chunk, or a recomputation): query j
            # sees every cached key and the new keys up to its own.
            mask = torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(diagonal=past)
            oi = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        outputs.append(oi[0].transpose(0, 1).reshape(n, num_heads * head_dim))  # (n, H*D)
        start += n
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _batched_increments(
    q: torch.Tensor, pool: torch.Tensor, batch: IncrementBatch, scale: float, window: int | None
) -> torch.Tensor:
    """Every increment at once (the batched backend): q (n, H, D), one row per request -> (n, H * D)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = pool.shape[1]
    group = num_heads // num_kv_heads
    blocks = pool.unflatten(2, (-1, batch.block_size))  # (2, KVH, pool blocks, block size, D)
    kv = blocks.index_select(2, batch.blocks).view(2, num_kv_heads * n, batch.width, head_dim)
    # The `group` query heads sharing a K/V head are `group` query rows against it: a batch of KVH x n
    # (group, D) x (D, width) products, the scale and the mask added in the same call.
    q = q.view(n, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads * n, group, head_dim)
    mask = batch.mask(window, q.dtype, num_kv_heads)  # (KVH x n, 1, width)
    scores = torch.baddbmm(mask, q, kv[0].transpose(1, 2), alpha=scale)  # (KVH x n, group, width)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # float32, as SDPA's kernels
    out = torch.bmm(probs, kv[1])  # (KVH x n, group, D)
    return out.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, num_heads * head_dim)


@functools.cache
def _flex_function(device_type: str) -> Callable:
    """flex_attention as it runs on this device: compiled on CUDA (Triton kernels; token counts dynamic, so
    one compilation serves every batch; the worker warms it up at load), PyTorch's unfused implementation
    elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=True)
    return flex_attention


def _flex_attention(
    q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:
    """One flex_attention call over the whole of `pool` (this layer's, new keys and values written)."""
    num_tokens, num_heads, head_dim = q.shape
    layout = meta.flex
    options = {"BLOCK_M": FLEX_Q_BLOCK, "BLOCK_N": FLEX_KV_BLOCK} if q.device.type == "cuda" else None
    with warnings.catch_warnings():  # the unfused CPU path warns that it is unfused, at every call
        warnings.simplefilter("ignore", UserWarning)
        out = _flex_function(q.device.type)(
            q.transpose(0, 1)[None], pool[0][None], pool[1][None], block_mask=layout.block_mask(window), scale=scale,
            enable_gqa=num_heads != pool.shape[1], kernel_options=options,
        )  # (1, H, T, D)
    return out[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)


# -- attention inside a compiled forward pass (orca/worker/compiled.py) ----------------------------------
# torch.compile turns the model's forward pass into one graph whatever the iteration's composition: every
# op but attention runs on the flat [T, hidden] batch and depends on T only. Attention depends on the
# iteration's layout (requests, lengths, blocks: Python lists the per-request split reads), so inside the
# graph it is one opaque op, orca::selective_attention, that takes only tensors and the layer's constants;
# the layout is the iteration's AttentionMetadata, which the worker puts in scope around the call (as
# vLLM's forward context does for its compiled graphs). The op runs the same selective_attention as the
# eager model, keys and values written into the pool included.
_scope = threading.local()


@contextlib.contextmanager
def iteration_scope(meta: AttentionMetadata) -> Iterator[None]:
    """The iteration whose layout orca::selective_attention reads, for the duration of a compiled call
    (on this thread)."""
    _scope.meta = meta
    try:
        yield
    finally:
        _scope.meta = None


def _attention_op(q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
    meta = getattr(_scope, "meta", None)
    if meta is None:
        raise RuntimeError("orca::selective_attention ran outside iteration_scope: it has no iteration layout")
    return selective_attention(q, kv, meta, layer, scale, window).contiguous()


def _attention_shape(q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # (T, H * D), as selective_attention returns


_OPS = torch.library.Library("orca", "FRAGMENT")
_OPS.define("selective_attention(Tensor q, Tensor kv, int layer, float scale, int? window) -> Tensor")
_OPS.impl("selective_attention", _attention_op, "CompositeExplicitAutograd")
torch.library.register_fake("orca::selective_attention", _attention_shape, lib=_OPS)
