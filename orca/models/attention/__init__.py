"""Selective batching's one exception: attention, over the paged K/V pool, each token seeing only the keys and
values of its own request (Orca §3).

Every other op of an iteration runs once on the flattened [total tokens, hidden] tensor. Attention mixes
tokens of one request only, and requests differ in phase (initiation: a prompt or a chunk of it; increment:
one token) and in how many keys and values they already have, so it runs request by request against that
request's own keys and values, and the results are merged back into the flattened output.

Keys and values live in the worker's K/V pool (orca/worker/kv_cache.py). Per layer, an iteration writes all its
new keys and values with one scatter (``index_copy_`` at each token's slot), then each backend reads them
its own way. The slot arithmetic is done once per iteration (the backend's metadata builder), not once per
layer.

What the model layers and the worker see is base.py's interface (AttentionMetadata, selective_attention,
get_backend); one module per implementation (EngineConfig.attention_backend)
holds its metadata, its builder and its layer call:

- reference.py, ``reference``: one ``scaled_dot_product_attention`` call per request and layer (the
  transformers-exact oracle of the tests).
- batched.py, ``batched``: the reference for prompts and chunks, the increments of the iteration together
  as padded groups.
- flex.py, ``flex``: one ``flex_attention`` call per layer for every token of the iteration, straight from
  the pool (compiled on CUDA; CUDA graphs).

What ``auto`` picks: orca/worker/resolution.py (docs/OPTIONS.md, its generated table).
"""

# The backends register themselves (under their names) when their modules are imported here.
from orca.models.attention import batched, flex, reference  # noqa: F401
from orca.models.attention.base import (
    AttentionMetadata,
    IterationLayout,
    PhaseTimer,
    get_backend,
    selective_attention,
)

__all__ = [
    "AttentionMetadata", "IterationLayout", "PhaseTimer", "get_backend",
    "selective_attention",
]
