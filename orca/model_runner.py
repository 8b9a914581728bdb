"""Executes the scheduler's plan: one iteration of the model over a batch of requests.

Owns the device, the weights and the K/V storage. Turns the scheduled requests into flat tensors (every
token of every request in one [T] row vector) plus an explicit AttentionMetadata, runs the model once,
computes logits only for each request's last row, and samples one token per request.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
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
        """Flat input ids and positions (T,), attention metadata, and each request's last row (B,).
        `requests` must already be in execution order (see `execution_order`)."""
        input_ids: list[int] = []
        positions: list[int] = []
        lengths, context_lens = [], []
        for req in requests:
            new = req.next_input_ids()
            past = req.num_computed_tokens
            input_ids.extend(new)
            positions.extend(range(past, past + len(new)))
            lengths.append(len(new))
            context_lens.append(past)
        buffers = [self.kv_cache.get(r.request_id) for r in requests]
        meta = AttentionMetadata.build(lengths, context_lens, buffers)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)  # (T,)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)  # (T,)
        last_rows = torch.tensor(list(itertools.accumulate(lengths)), dtype=torch.int64, device=self.device) - 1
        return ids, pos, meta, last_rows

    @staticmethod
    def execution_order(requests: list[Request]) -> list[int]:
        """Increments first, then initiations (each group in the scheduler's order): the layout
        AttentionMetadata expects, which lets one-token requests share their merge."""
        inc = [i for i, r in enumerate(requests) if r.num_computed_tokens > 0]  # one new token each
        inc_set = set(inc)
        return inc + [i for i in range(len(requests)) if i not in inc_set]

    @torch.inference_mode()
    def execute(self, requests: list[Request]) -> list[int]:
        """Runs one iteration; returns the next token of each request, in order. Advances each request's
        num_computed_tokens (its K/V now holds this iteration's tokens)."""
        t0 = perf_counter()
        order = self.execution_order(requests)
        ordered = [requests[i] for i in order]
        ids, pos, meta, last_rows = self.prepare(ordered)
        st = SamplingTensors.from_requests(ordered, self.device)
        t1 = perf_counter()
        hidden = self.model(ids, pos, meta)  # (T, E)
        logits = self.model.compute_logits(hidden[last_rows])  # (B, V): no logits for prompt rows
        if self.profile:
            _sync(self.device)
        t2 = perf_counter()
        sampled = sample(logits, st).tolist()  # the one host sync of the iteration
        t3 = perf_counter()
        next_ids = [0] * len(requests)
        for j, i in enumerate(order):
            next_ids[i] = sampled[j]
            requests[i].num_computed_tokens += meta.lengths[j]
        if self.profile:
            self.last_timings = IterationTimings(prepare=t1 - t0, model=t2 - t1, sample=t3 - t2)
        return next_ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
