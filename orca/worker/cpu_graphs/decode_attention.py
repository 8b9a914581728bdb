"""Attention inside a CPU graph's decode step (GraphStep): the request's cached keys and values read through
its block table, the step's own beside them, nothing written (the runner writes the step's keys and values
after the graph, one copy for every layer). Also the inputs such a step takes, built from the iteration's
layout only when the runner runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orca.models.attention.base import IterationLayout, token_slots
from orca.models.device import upload


@dataclass
class StepInputs:
    """A GraphStep's inputs after the pool: `tables` (its graph's table arguments) and the pool slots of
    the step's rows, where the runner writes the keys and values the graph returns."""

    tables: tuple[torch.Tensor, ...]
    slot_mapping: torch.Tensor


def lone_inputs(layout: IterationLayout) -> StepInputs:
    """One request's rows after its cached tokens: the blocks that hold them, in order."""
    (n,), (past,), (table,) = layout.lengths, layout.context_lens, layout.block_tables
    device, size = layout.kv_pool.device, layout.block_size
    return StepInputs((upload(table[: -(-past // size)], torch.int64, device),),
                      upload(token_slots(table, size, past, past + n), torch.int64, device))


def few_inputs(layout: IterationLayout) -> StepInputs:
    """A decode step of a few requests: each one's blocks of cached tokens (padded with its first block to
    the longest) and its cached tokens."""
    device, size = layout.kv_pool.device, layout.block_size
    cached = [table[: -(-past // size)] for table, past in zip(layout.block_tables, layout.context_lens)]
    width = max(map(len, cached))
    tables = upload([list(c) + [c[0]] * (width - len(c)) for c in cached], torch.int64, device)
    slots = [s for table, past in zip(layout.block_tables, layout.context_lens)
             for s in token_slots(table, size, past, past + 1)]
    return StepInputs((tables, upload(list(layout.context_lens), torch.int64, device)),
                      upload(slots, torch.int64, device))


class LoneDecode:
    """A single stream's step over its request's cached keys and values (an unquantized pool, no sliding
    window) in a graph of its own (GraphStep): attention inside the graph, no opaque op. One query row (a
    decode step) or a few (a speculating stream verifying its proposed tokens: row i sees the cached keys
    and the new ones up to its own).

    The graph reads the cached keys and values through the request's block table, wherever its blocks
    are (consecutive or not: a prefix from the cache, blocks placed after a preemption): the pool, as
    blocks, is one input, the table another (its length unbacked: one graph for any context), and the
    keys past the cached ones in the table's last block are masked by position. It writes nothing: each
    layer's new keys and values enter its attention beside the cached ones and are collected in
    `written`, which the caller writes into the pool after the graph (one copy for every layer).
    Read-only, the pool aliases nothing the graph mutates, so the graph neither copies it nor orders a
    write against a read.

    Attention as multiplies and sums that inductor fuses into its own loops (float32 scores, softmax
    weights and accumulation, as SDPA's CPU kernels): docs/BENCHMARKS.md, "Results: a single stream's
    step in a graph of its own" and "Results: a single stream through its block table"."""

    def __init__(self, blocks: torch.Tensor, table: torch.Tensor, past: torch.Tensor) -> None:
        self.blocks = blocks  # (layers, 2, KVH, pool blocks, block size, D): the pool
        self.table = table  # (n,) int64: the blocks holding the request's cached tokens, in order
        self.past = past  # () int64: its cached tokens (the first new row's position)
        self.written: list[torch.Tensor] = []  # each layer's new (T, 2, KVH, D), in layer order

    def write_and_attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float,
                         window: int | None) -> torch.Tensor:
        """q (T, H, D), kv (T, 2, KVH, D) -> (T, H * D): softmax(q k^T * scale) v over the cached keys and
        the new ones, new row i seeing new keys 0..i. (At one row, in a graph specialised to it, inductor
        folds the causal mask away: the one-row formula's numbers and time.)"""
        if window is not None:
            raise ValueError("LoneDecode has no sliding window (the worker runs such layers through the op)")
        self.written.append(kv)
        rows, num_heads, head_dim = q.shape
        num_kv_heads = kv.shape[2]
        cached = self.blocks[layer][:, :, self.table]  # (2, KVH, n, block size, D)
        keys, values = cached.unsqueeze(2).unbind(0)  # (KVH, 1, n, block size, D) each
        new_keys, new_values = kv.permute(1, 2, 0, 3).unsqueeze(2).unbind(0)  # (KVH, 1, T, D) each
        # The `group` query heads sharing a K/V head are rows of that head: (T, KVH, group, 1, D).
        qf = q.view(rows, num_kv_heads, num_heads // num_kv_heads, 1, head_dim).float()
        old = (qf.unsqueeze(-2) * keys).sum(-1) * scale  # (T, KVH, group, n, block size)
        # The last block's slots past the cached keys: never written, or stale (NaN in an uninitialised pool,
        # which a zero weight would not cancel): masked out of the scores and the values alike.
        num_blocks, block_size = keys.shape[2], keys.shape[3]
        beyond = torch.arange(num_blocks * block_size, device=q.device).view(num_blocks, block_size) >= self.past
        old = old.masked_fill(beyond, float("-inf"))
        values = values.masked_fill(beyond.unsqueeze(-1), 0)
        own = (qf * new_keys).sum(-1) * scale  # (T, KVH, group, T): row i sees new keys 0..i
        position = torch.arange(rows, device=q.device)
        later = (position[None, :] > position[:, None]).view(rows, 1, 1, rows)
        own = own.masked_fill(later, float("-inf"))
        top = torch.maximum(old.amax((-2, -1)).unsqueeze(-1), own.amax(-1, keepdim=True))  # (T, KVH, group, 1)
        old_w, own_w = torch.exp(old - top.unsqueeze(-1)), torch.exp(own - top)
        out = (old_w.unsqueeze(-1) * values).sum((-3, -2)) + (own_w.unsqueeze(-1) * new_values).sum(-2)
        out = out / (old_w.sum((-2, -1)).unsqueeze(-1) + own_w.sum(-1, keepdim=True))  # (T, KVH, group, D)
        return out.to(q.dtype).view(rows, num_heads * head_dim)


class FewDecode(LoneDecode):
    """A decode step of a few requests (2 to tuning.FEW_MAX_ROWS),
    one new token each, as LoneDecode runs one: attention inside the compiled graph, each row over its
    request's cached keys and values read through its block table, then its own new key. `tables` (n, width) holds each
    request's blocks of cached tokens, padded with its first block to the longest table; `past` (n,) its
    cached tokens: a row's slots at or past it (its last block's tail, its padding blocks) are masked out
    of the scores and the values alike (never written, stale or NaN there). Both lengths unbacked in the
    graph: one graph for any such step. The step's keys and values are collected in `written`.

    Why: at a few rows the opaque op's calls cost more than these loops (docs/BENCHMARKS.md, "Results:
    decode steps of a few requests in a graph of their own")."""

    def write_and_attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float,
                         window: int | None) -> torch.Tensor:
        """q (n, H, D), kv (n, 2, KVH, D), one row per request -> (n, H * D). (`table` is (n, width) here,
        `past` (n,).)"""
        if window is not None:
            raise ValueError("FewDecode has no sliding window (the worker runs such layers through the op)")
        self.written.append(kv)
        rows, num_heads, head_dim = q.shape
        num_kv_heads = kv.shape[2]
        cached = self.blocks[layer][:, :, self.table]  # (2, KVH, n, width, block size, D)
        keys, values = cached.unbind(0)  # (KVH, n, width, block size, D) each
        new_keys, new_values = kv.permute(1, 2, 0, 3).unbind(0)  # (KVH, n, D) each
        # The `group` query heads sharing a K/V head are rows of that head: (KVH, n, group, D).
        qf = q.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1).float()
        old = (qf[:, :, :, None, None, :] * keys[:, :, None]).sum(-1) * scale  # (KVH, n, group, width, block size)
        width, block_size = keys.shape[2], keys.shape[3]
        slot = torch.arange(width * block_size, device=q.device).view(1, width, block_size)
        beyond = slot >= self.past.view(-1, 1, 1)  # (n, width, block size)
        old = old.masked_fill(beyond[None, :, None], float("-inf"))
        values = values.masked_fill(beyond[None, :, :, :, None], 0)
        own = (qf * new_keys[:, :, None]).sum(-1) * scale  # (KVH, n, group)
        top = torch.maximum(old.amax((-2, -1)), own)
        old_w, own_w = torch.exp(old - top[..., None, None]), torch.exp(own - top)
        out = (old_w[..., None] * values[:, :, None]).sum((-3, -2)) + own_w[..., None] * new_values[:, :, None]
        out = out / (old_w.sum((-2, -1)) + own_w)[..., None]  # (KVH, n, group, D)
        return out.to(q.dtype).transpose(0, 1).reshape(rows, num_heads * head_dim)
