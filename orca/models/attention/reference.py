"""attention_backend ``reference``: the split Orca describes, one ``scaled_dot_product_attention`` call per
request and layer over that request's keys and values. The transformers-exact oracle of the tests.

A request's keys and values are a view of the pool when its blocks are consecutive, else one gather for
all such requests. An increment is one query row per head, no mask, its grouped query heads as rows of
their K/V head (no repeat); a prompt attends causally, a later chunk to every cached key and its own up
to itself. A quantized pool is dequantized as read. `auto` never picks it (orca/worker/resolution.py):
each request pays a call's fixed cost at every layer (batched.py batches the increments). It reads only
written slots, so the pool needs no zeroing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from orca.models.attention.base import (
    AttentionMetadata,
    PhaseTimer,
    dequantize_kv,
    leading_increments,
    token_slots,
)
from orca.models.device import upload


@dataclass(kw_only=True)
class ReferenceMetadata(AttentionMetadata):
    """Request i feeds `lengths[i]` new tokens after `context_lens[i]` cached ones; rows [0, num_increment)
    are increments. Request i's keys and values are pool slots `views[i] = (s0, s1)` when its blocks are
    consecutive (else None); the others' slots are concatenated in `gather_index`, split by `gather_sizes`,
    built from `gather_tables` on first read."""

    name = "reference"
    in_compiled_forward = True

    lengths: list[int]
    context_lens: list[int]
    num_increment: int
    views: list[tuple[int, int] | None]
    gather_tables: list[Sequence[int]]  # the block tables of the requests read by gathering
    gather_sizes: list[int]  # their tokens
    # A lone increment with consecutive blocks (a single stream's decode step): its view, read with no
    # per-request bookkeeping; None otherwise.
    lone_view: tuple[int, int] | None = None
    block_size: int = 0  # (the pool's: the gathers' slots)
    # Masks of requests of several new tokens after a cached prefix, by (request, window): built once per
    # iteration.
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

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
        if padding:
            raise ValueError("padding rows need the flex backend")
        return cls.per_request(lengths, context_lens, block_tables, block_size, kv_pool, timer,
                               leading_increments(lengths, context_lens), kv_scales=kv_scales)

    @classmethod
    def per_request(
        cls,
        lengths: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        kv_pool: torch.Tensor,
        timer: PhaseTimer | None,
        num_increment: int,
        elsewhere: int = 0,
        kv_scales: torch.Tensor | None = None,
        **fields: object,
    ) -> AttentionMetadata:
        """The slots, views and gathers of the iteration. Requests [0, elsewhere) are read by a subclass's
        own path (batched increments): no views, no gather. `fields`: the subclass's own."""
        slots: list[int] = []
        views: list[tuple[int, int] | None] = []
        gather_tables: list[Sequence[int]] = []
        gather_sizes: list[int] = []
        for i, (n, past, table) in enumerate(zip(lengths, context_lens, block_tables)):
            total = past + n
            slots.extend(token_slots(table, block_size, past, total))
            if i < elsewhere:
                views.append(None)
                continue
            used = -(-total // block_size)
            first = table[0]
            if table[used - 1] - first == used - 1 and all(table[j] == first + j for j in range(used)):
                views.append((first * block_size, first * block_size + total))
            else:
                views.append(None)
                gather_tables.append(table)
                gather_sizes.append(total)
        device = kv_pool.device
        lone = len(lengths) == 1 and not elsewhere and kv_scales is None and num_increment == 1
        return cls(
            lone_view=views[0] if lone else None,
            block_size=block_size,
            lengths=list(lengths),
            context_lens=list(context_lens),
            num_increment=num_increment,
            slot_mapping=upload(slots, torch.int64, device),
            views=views,
            gather_tables=gather_tables,
            gather_sizes=gather_sizes,
            kv_pool=kv_pool,
            kv_scales=kv_scales,
            timer=timer,
            **fields,
        )

    @functools.cached_property
    def gather_index(self) -> torch.Tensor | None:
        """(sum of gather_sizes,) int64: the pool slots of the gathered requests' tokens, in order; None when
        every request is read through its view (or elsewhere)."""
        if not self.gather_tables:
            return None
        slots = [s for table, total in zip(self.gather_tables, self.gather_sizes)
                 for s in token_slots(table, self.block_size, 0, total)]
        return upload(slots, torch.int64, self.kv_pool.device)

    def _mask(self, i: int, window: int | None, device: torch.device) -> torch.Tensor:
        """Request i's (n, past + n) mask: query j (position past + j) sees every cached key and the new
        keys up to its own (the last `window` of them with a sliding window)."""
        key = (i, window)
        if key not in self._masks:
            n, past = self.lengths[i], self.context_lens[i]
            mask = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past)
            if window is not None and past + n > window:
                mask = mask.triu(past - window + 1)
            self._masks[key] = mask
        return self._masks[key]

    def attend(
        self, q: torch.Tensor, pool: torch.Tensor, scale: float, window: int | None,
        scales: torch.Tensor | None = None, increments_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Per request, over this layer's `pool` (new ones written; dequantized with `scales`).
        `increments_out`: the increments' outputs when a subclass attended them (batched.py); None: here."""
        if self.lone_view is not None and increments_out is None:  # one query row per head, no mask
            start, end = self.lone_view
            if window is not None:  # the last `window` keys only
                start = max(start, end - window)
            kv = pool[:, :, start:end]  # (2, KVH, keys, D)
            out = F.scaled_dot_product_attention(q.view(1, pool.shape[1], -1, q.shape[2]), kv[0:1], kv[1:2],
                                                 scale=scale)
            return out.view(1, -1)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = pool.shape[1]
        group = num_heads // num_kv_heads  # query heads per K/V head (grouped-query attention)
        gathered = iter(())
        if self.gather_index is not None:
            kv_gathered = pool.index_select(2, self.gather_index)
            if scales is not None:
                kv_gathered = dequantize_kv(kv_gathered, scales.index_select(2, self.gather_index), q.dtype)
            # (one request's: no split, a lone decode stream's common case)
            gathered = iter((kv_gathered,) if len(self.gather_sizes) == 1 else kv_gathered.split(self.gather_sizes, 2))

        def keys_values(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            view = self.views[i]
            if view is None:
                kvi = next(gathered)  # (2, KVH, past + n, D)
            else:
                kvi = pool[:, :, view[0] : view[1]]
                if scales is not None:
                    kvi = dequantize_kv(kvi, scales[:, :, view[0] : view[1]], q.dtype)
            return kvi[0:1], kvi[1:2]  # (1, KVH, past + n, D) each

        n_inc = self.num_increment
        outputs: list[torch.Tensor]
        if increments_out is not None:
            outputs = increments_out
        else:
            outputs = []
            if n_inc:
                # Increment: the `group` query heads sharing a K/V head become its query rows (GQA, no
                # repeat); the 4-D (batch 1) form takes PyTorch's fused CPU kernel.
                q_inc = q[:n_inc].view(n_inc, num_kv_heads, group, head_dim)
                q_inc = (q_inc,) if n_inc == 1 else q_inc.split(1)  # n_inc x (1, KVH, G, D)
                for i in range(n_inc):
                    keys, values = keys_values(i)
                    if window is not None:  # the last `window` keys only
                        keys, values = keys[:, :, -window:], values[:, :, -window:]
                    outputs.append(F.scaled_dot_product_attention(q_inc[i], keys, values, scale=scale))
                out_inc = outputs[0] if n_inc == 1 else torch.cat(outputs)
                outputs = [out_inc.view(n_inc, num_heads * head_dim)]  # (n_inc, H*D)
            if n_inc == len(self.lengths):  # a decode iteration: every request an increment
                return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        start = sum(self.lengths[:n_inc])  # (the batched backend's leading requests may have several rows)
        for i in range(n_inc, len(self.lengths)):
            n, past = self.lengths[i], self.context_lens[i]
            qi = q[start : start + n].transpose(0, 1)[None]  # (1, H, n, D)
            keys, values = keys_values(i)
            if past == 0 and (window is None or n <= window):
                # A whole prompt (or its first chunk) attends causally to itself.
                oi = F.scaled_dot_product_attention(qi, keys, values, is_causal=True, scale=scale, enable_gqa=group > 1)
            else:
                mask = self._mask(i, window, q.device)
                oi = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, scale=scale, enable_gqa=group > 1)
            outputs.append(oi[0].transpose(0, 1).reshape(n, num_heads * head_dim))  # (n, H*D)
            start += n
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
