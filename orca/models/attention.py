"""Selective batching's one exception: attention, split per request (Orca §3), over the paged K/V pool.

Every other op of an iteration runs once on the flattened [total tokens, hidden] tensor. Attention mixes
tokens of one request only, and requests differ in phase (initiation: a prompt or a chunk of it; increment:
one token) and in how many keys and values they already have, so it runs request by request against that
request's own keys and values, and the results are merged back into the flattened output.

Keys and values live in the worker's K/V pool (orca/kv_cache.py). Per layer, an iteration writes all its
new keys and values with one scatter (``index_copy_`` at each token's slot), then reads each request's
keys and values: a view of the pool when the request's blocks are consecutive, else one gather for all
such requests together. The slot arithmetic is done once per iteration (AttentionMetadata.build), not
once per layer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from orca.device import upload


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
    None otherwise); the others' slots are concatenated in `gather_index`, split by `gather_sizes`.
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

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        kv_pool: torch.Tensor,
        timer: PhaseTimer | None = None,
    ) -> AttentionMetadata:
        """block_tables[i] covers request i's first context_lens[i] + lengths[i] tokens; increments come
        first (the worker orders the rows so)."""
        num_increment = 0
        while num_increment < len(lengths) and lengths[num_increment] == 1 and context_lens[num_increment] > 0:
            num_increment += 1
        slots: list[int] = []
        views: list[tuple[int, int] | None] = []
        gather: list[int] = []
        gather_sizes: list[int] = []
        for n, past, table in zip(lengths, context_lens, block_tables):
            total = past + n
            slots.extend(_slots(table, block_size, past, total))
            used = -(-total // block_size)
            first = table[0]
            if table[used - 1] - first == used - 1 and all(table[j] == first + j for j in range(used)):
                views.append((first * block_size, first * block_size + total))
            else:
                views.append(None)
                gather.extend(_slots(table, block_size, 0, total))
                gather_sizes.append(total)
        device = kv_pool.device
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
        )


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
    timer = meta.timer
    if timer is not None:
        timer.sync()
        t0 = time.perf_counter()
    out = _attention(q, kv, meta, layer, scale, window)
    if timer is not None:
        timer.sync()
        timer.add("attention", time.perf_counter() - t0)
    return out


def _attention(
    q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, layer: int, scale: float, window: int | None
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv.shape[2]
    group = num_heads // num_kv_heads  # query heads per K/V head (grouped-query attention)
    pool = meta.kv_pool[layer]  # (2, KVH, slots, D)
    # Write this iteration's keys and values into their slots: one scatter for every token of every request.
    pool.index_copy_(2, meta.slot_mapping, kv.permute(1, 2, 0, 3))
    gathered = iter(())
    if meta.gather_index is not None:
        gathered = iter(pool.index_select(2, meta.gather_index).split(meta.gather_sizes, dim=2))

    def keys_values(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        view = meta.views[i]
        kvi = pool[:, :, view[0] : view[1]] if view is not None else next(gathered)  # (2, KVH, past + n, D)
        return kvi[0:1], kvi[1:2]  # (1, KVH, past + n, D) each

    outputs: list[torch.Tensor] = []
    n_inc = meta.num_increment
    if n_inc:
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
