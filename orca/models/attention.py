"""Selective batching's one exception: attention, split per request (Orca §3).

Every other op of an iteration runs once on the flattened [total tokens, hidden] tensor. Attention mixes
tokens of one request only, and requests differ in phase (initiation: the whole prompt; increment: one
token) and in how many keys and values they already have, so it runs request by request against that
request's own K/V buffer, and the results are written back into the flattened output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Explicit per-iteration batch layout, passed down to every layer (never a global).

    Request i owns rows starts[i]:ends[i] of the flattened tensors. context_lens[i] of its tokens
    already have keys and values in kv_buffers[i] ([layers, 2, kv_heads, max_tokens, head_dim]); this
    iteration appends the new ones right after them, in place.
    """

    starts: list[int]
    ends: list[int]
    context_lens: list[int]
    kv_buffers: list[torch.Tensor]

    @property
    def num_requests(self) -> int:
        return len(self.starts)


def selective_attention(
    q: torch.Tensor,  # (T, H, D): queries of all tokens of all requests
    kv: torch.Tensor,  # (T, 2, KVH, D): this iteration's new keys and values
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> torch.Tensor:  # (T, H * D)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv.shape[2]
    group = num_heads // num_kv_heads  # query heads per K/V head (grouped-query attention)
    out = torch.empty_like(q)  # (T, H, D)
    for i in range(meta.num_requests):
        start, end, past = meta.starts[i], meta.ends[i], meta.context_lens[i]
        n = end - start
        cache = meta.kv_buffers[i][layer]  # (2, KVH, max_tokens, D)
        # Append this iteration's keys and values in place: no reallocation, no copy of the old ones.
        cache[:, :, past : past + n].copy_(kv[start:end].permute(1, 2, 0, 3))  # (2, KVH, n, D)
        keys = cache[0, :, : past + n]  # (KVH, past + n, D): a view
        values = cache[1, :, : past + n]
        if n == 1:
            # Increment: one query row per head, no mask. The `group` query heads that share a K/V head
            # become `group` query rows of that head, so GQA needs no repeat of keys and values.
            qi = q[start].view(1, num_kv_heads, group, head_dim)  # (1, KVH, G, D)
            oi = F.scaled_dot_product_attention(qi, keys[None], values[None], scale=scale)  # (1, KVH, G, D)
            out[start] = oi.view(num_heads, head_dim)
            continue
        # A leading batch dim of 1: the 4-D form takes PyTorch's fused CPU kernel, the 3-D one does not.
        qi = q[start:end].transpose(0, 1)[None]  # (1, H, n, D)
        keys, values = keys[None], values[None]  # (1, KVH, past + n, D)
        if past == 0:
            # Initiation: the prompt attends causally to itself.
            oi = F.scaled_dot_product_attention(
                qi, keys, values, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            # Several new tokens after a cached prefix: query j sees every cached key and new keys <= j.
            mask = torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(diagonal=past)
            oi = F.scaled_dot_product_attention(
                qi, keys, values, attn_mask=mask, scale=scale, enable_gqa=group > 1
            )
        out[start:end] = oi[0].transpose(0, 1)  # (n, H, D)
    return out.view(num_tokens, num_heads * head_dim)
