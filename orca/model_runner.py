"""Executes the scheduler's plan: one iteration of the model over a batch of requests.

Owns the device, the weights and the K/V storage. Turns the scheduled requests into flat tensors (every
token of every request in one [T] row vector) plus an explicit AttentionMetadata, runs the model once,
computes logits only for each request's last row, and samples one token per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

import torch
from torch import nn

from orca.config import ModelConfig
from orca.kv_cache import KVCache, KVLayout
from orca.models.attention import AttentionMetadata
from orca.request import Request
from orca.sampler import SamplingTensors, sample


@dataclass
class IterationTimings:
    """Where one iteration's time went (seconds). Filled only when profiling is on: measuring needs a
    device sync per phase, which the hot path otherwise avoids."""

    prepare: float = 0.0
    model: float = 0.0
    sample: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.kv_layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
        self.kv_cache = KVCache(self.kv_layout, device)
        self.profile = False
        self.last_timings = IterationTimings()

    def allocate(self, requests: list[Request]) -> None:
        for req in requests:
            self.kv_cache.allocate(req)

    def free(self, request_id: str) -> None:
        self.kv_cache.free(request_id)

    def prepare(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        input_ids: list[int] = []
        positions: list[int] = []
        starts, ends, context_lens = [], [], []
        for req in requests:
            new = req.next_input_ids()
            past = req.num_computed_tokens
            starts.append(len(input_ids))
            input_ids.extend(new)
            ends.append(len(input_ids))
            positions.extend(range(past, past + len(new)))
            context_lens.append(past)
        meta = AttentionMetadata(starts, ends, context_lens, [self.kv_cache.get(r.request_id) for r in requests])
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)  # (T,)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)  # (T,)
        last_rows = torch.tensor([e - 1 for e in ends], dtype=torch.int64, device=self.device)  # (B,)
        return ids, pos, meta, last_rows

    @torch.inference_mode()
    def execute(self, requests: list[Request]) -> list[int]:
        """Runs one iteration; returns the next token of each request, in order. Advances each request's
        num_computed_tokens (its K/V now holds this iteration's tokens)."""
        t0 = perf_counter()
        ids, pos, meta, last_rows = self.prepare(requests)
        st = SamplingTensors.from_requests(requests, self.device)
        t1 = perf_counter()
        hidden = self.model(ids, pos, meta)  # (T, E)
        logits = self.model.compute_logits(hidden[last_rows])  # (B, V): no logits for prompt rows
        if self.profile:
            _sync(self.device)
        t2 = perf_counter()
        next_ids = sample(logits, st).tolist()  # the one host sync of the iteration
        t3 = perf_counter()
        for i, req in enumerate(requests):
            req.num_computed_tokens += meta.ends[i] - meta.starts[i]
        if self.profile:
            self.last_timings = IterationTimings(prepare=t1 - t0, model=t2 - t1, sample=t3 - t2)
        return next_ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
