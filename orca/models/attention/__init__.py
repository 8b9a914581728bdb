"""Attention over the paged K/V pool (orca/models/attention/flex.py holds it until the next commit splits it
into one module per backend)."""

from orca.models.attention.flex import (
    BATCHED_GROUP_SLOTS,
    BATCHED_MIN_INCREMENTS,
    FLEX_KV_BLOCK,
    FLEX_Q_BLOCK,
    PADDING_ROW,
    AttentionMetadata,
    FlexLayout,
    IncrementBatch,
    PhaseTimer,
    iteration_scope,
    resolve_attention_backend,
    selective_attention,
)

__all__ = [
    "BATCHED_GROUP_SLOTS", "BATCHED_MIN_INCREMENTS", "FLEX_KV_BLOCK", "FLEX_Q_BLOCK", "PADDING_ROW",
    "AttentionMetadata", "FlexLayout", "IncrementBatch", "PhaseTimer", "iteration_scope",
    "resolve_attention_backend", "selective_attention",
]
