"""Selective batching's one exception: attention, over the paged K/V pool, each token seeing only the keys
and values of its own request (Orca §3). Every other op runs once on the flattened (T, hidden) tensor.

Per layer an iteration writes its new keys and values with one scatter, then the backend reads them its
own way; the slot arithmetic is done once per iteration. base.py holds the interface (AttentionMetadata,
selective_attention, get_backend); one module per EngineConfig.attention_backend: reference.py (a call
per request, the tests' oracle), batched.py (increments in padded groups), flex.py (one flex_attention
call per layer; CUDA graphs). What ``auto`` picks: orca/worker/resolution.py (docs/OPTIONS.md).
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
