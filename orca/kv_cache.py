"""The K/V manager (Orca §3, §4.1): slot reservation and the per-request key/value storage.

Two halves, kept apart so the scheduler's decisions can be tested without tensors:

- ``KVSlotManager`` is pure bookkeeping. A slot is the memory for one token's key and value in every
  layer. A request reserves max_tokens = prompt + max new tokens slots the first time it is scheduled, so
  once admitted it can always run to completion (no deadlock, no out-of-memory half-way); the total
  reservation never exceeds n_slots.
- ``KVCache`` owns the tensors. Each admitted request gets one buffer sized from its own max_tokens (not
  the model's maximum length, FasterTransformer's mistake), allocated once at admission; appending a
  token's keys and values writes into it in place and never reallocates; the buffer is dropped the moment
  the request finishes or is aborted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orca.request import Request


class KVSlotManager:
    """Counts reserved slots against the budget n_slots. Never touches a tensor."""

    def __init__(self, n_slots: int) -> None:
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"n_slots must be an integer >= 1, got {n_slots!r}")
        self.n_slots = n_slots
        self.n_reserved = 0

    def can_reserve(self, request: Request) -> bool:
        return self.n_reserved + request.max_tokens <= self.n_slots

    def reserve(self, request: Request) -> None:
        if request.reserved:
            raise RuntimeError(f"request {request.request_id} already holds a reservation")
        if not self.can_reserve(request):
            raise RuntimeError(f"reserving {request.max_tokens} slots would exceed n_slots={self.n_slots}")
        self.n_reserved += request.max_tokens
        request.reserved = True

    def release(self, request: Request) -> None:
        if request.reserved:
            self.n_reserved -= request.max_tokens
            request.reserved = False


@dataclass(frozen=True)
class KVLayout:
    """Shape of one slot: what a token's keys and values occupy across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    def slots_for_budget(self, budget_bytes: int) -> int:
        """n_slots from a memory budget: how many tokens' keys and values fit in it."""
        return budget_bytes // self.bytes_per_slot


class KVCache:
    """Per-request K/V buffers of shape [num_layers, 2 (k, v), num_kv_heads, max_tokens, head_dim].

    Heads come before positions so that ``buffer[layer, 0, :, :n]`` is the [heads, n, head_dim] view
    attention consumes, without a copy.
    """

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def allocate(self, request: Request) -> None:
        lay = self.layout
        self._buffers[request.request_id] = torch.empty(
            (lay.num_layers, 2, lay.num_kv_heads, request.max_tokens, lay.head_dim),
            dtype=lay.dtype,
            device=self.device,
        )

    def free(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)

    def get(self, request_id: str) -> torch.Tensor:
        return self._buffers[request_id]

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def allocated_slots(self) -> int:
        return sum(b.shape[3] for b in self._buffers.values())
