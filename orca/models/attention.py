"""Selective batching's one exception: attention, split per request (Orca §3).

Every other op of an iteration runs once on the flattened [total tokens, hidden] tensor. Attention mixes
tokens of one request only, and requests differ in phase (initiation: the whole prompt; increment: one
token) and in how many keys and values they already have, so it runs request by request against that
request's own K/V buffer, and the results are merged back into the flattened output.

Each request's per-layer views of its K/V buffer are built once per iteration (AttentionMetadata.build),
not once per layer: the split costs one fused attention call per request and layer, little more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """The iteration's batch layout, passed explicitly to every layer (never a global).

    Requests are laid out increments first: rows [0, num_increment) are one token each, then each
    initiating request's rows follow. Request i has `lengths[i]` new tokens and `context_lens[i]` tokens
    already cached. For layer l: `kv_dst[l][i]` is where request i's new keys and values go
    ([2, KVH, n, D]), and `keys[l][i]` / `values[l][i]` are all its keys and values including the new
    ones ([1, KVH, past + n, D]) — views into the request's buffer, so nothing is copied.
    """

    lengths: list[int]
    context_lens: list[int]
    num_increment: int
    kv_dst: list[tuple[torch.Tensor, ...]]
    keys: list[tuple[torch.Tensor, ...]]
    values: list[tuple[torch.Tensor, ...]]

    @classmethod
    def build(cls, lengths: list[int], context_lens: list[int], buffers: list[torch.Tensor]) -> AttentionMetadata:
        """buffers[i] is request i's K/V buffer [layers, 2, KVH, max_tokens, D]; increments come first."""
        num_increment = 0
        while num_increment < len(lengths) and lengths[num_increment] == 1 and context_lens[num_increment] > 0:
            num_increment += 1
        dst, keys, values = [], [], []
        for buf, n, past in zip(buffers, lengths, context_lens):
            dst.append(buf[:, :, :, past : past + n].unbind(0))  # per layer: (2, KVH, n, D)
            keys.append(buf[:, 0:1, :, : past + n].unbind(0))  # per layer: (1, KVH, past + n, D)
            values.append(buf[:, 1:2, :, : past + n].unbind(0))
        # Transpose [request][layer] -> [layer][request]: each layer takes its own row.
        return cls(lengths, context_lens, num_increment, list(zip(*dst)), list(zip(*keys)), list(zip(*values)))


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
    # Append this iteration's keys and values to every request's buffer in place: one split, one fused
    # copy; no reallocation and no copy of the keys and values already cached.
    torch._foreach_copy_(meta.kv_dst[layer], kv.permute(1, 2, 0, 3).split(meta.lengths, dim=2))
    keys, values = meta.keys[layer], meta.values[layer]
    outputs: list[torch.Tensor] = []
    n_inc = meta.num_increment
    if n_inc:
        # Increment: one query row per head and no mask. The `group` query heads sharing a K/V head become
        # `group` query rows of that head, so GQA needs no repeat of keys and values. The 4-D (batch 1)
        # form takes PyTorch's fused CPU kernel.
        q_inc = q[:n_inc].view(n_inc, num_kv_heads, group, head_dim).split(1)  # n_inc x (1, KVH, G, D)
        for i in range(n_inc):
            outputs.append(F.scaled_dot_product_attention(q_inc[i], keys[i], values[i], scale=scale))
        outputs = [torch.cat(outputs).view(n_inc, num_heads * head_dim)]  # (n_inc, H*D)
    start = n_inc
    for i in range(n_inc, len(meta.lengths)):
        n, past = meta.lengths[i], meta.context_lens[i]
        qi = q[start : start + n].transpose(0, 1)[None]  # (1, H, n, D)
        if past == 0:
            # Initiation: the prompt attends causally to itself.
            oi = F.scaled_dot_product_attention(qi, keys[i], values[i], is_causal=True, scale=scale,
                                                enable_gqa=group > 1)
        else:
            # Several new tokens after a cached prefix: query j sees every cached key and new keys <= j.
            mask = torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(diagonal=past)
            oi = F.scaled_dot_product_attention(qi, keys[i], values[i], attn_mask=mask, scale=scale,
                                                enable_gqa=group > 1)
        outputs.append(oi[0].transpose(0, 1).reshape(n, num_heads * head_dim))  # (n, H*D)
        start += n
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
