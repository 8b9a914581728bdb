"""CUDA graphs for decode iterations: the model's forward pass replayed as one graph launch instead of
hundreds of kernel launches from Python.

Under the flex backend (its cuda_graphs trait) a decode iteration's shapes depend on its token count
only, so one graph per batch size serves every decode iteration of that size: its values are copied into
static buffers the graph reads (graph_buffers) and the graph is replayed. Sizes: 1, 2, 4, each multiple
of 8 below max_bs, and max_bs; padding rows write to a reserved block's slot, attend to nothing and are
never sampled. Captured at load, largest first, sharing one memory pool. When they are used: the
cuda_graphs rule in resolution.py. ``capture=False`` runs the same buffers eagerly, for the CPU tests.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from orca.core.plan import PlannedRequest
from orca.models.attention import AttentionMetadata, IterationLayout
from orca.worker.runners import Runner

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4)
SIZE_STEP = 8


def graph_sizes(max_bs: int) -> tuple[int, ...]:
    """The batch sizes captured: 1, 2, 4, each multiple of 8 below max_bs, and max_bs."""
    sizes = {s for s in SMALL_SIZES if s < max_bs} | set(range(SIZE_STEP, max_bs, SIZE_STEP)) | {max_bs}
    return tuple(sorted(sizes))


def graph_size_for(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `num_rows` rows (sizes ascending); None when none does."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) and num_rows > 0 else None


class DecodeGraphs:
    """The CUDA graphs runner (runners.py): static buffers for decode iterations of up to max(sizes) rows
    and, with `capture`, one graph per size over them. A decode iteration padded to a size has its inputs
    copied in and replays; any other runs through `eager`."""

    def __init__(self, model: nn.Module, attention: type[AttentionMetadata], kv_pool: torch.Tensor, block_size: int,
                 pad_slot: int, sizes: Sequence[int], capture: bool, max_blocks: int,
                 kv_scales: torch.Tensor | None = None, eager: Runner | None = None) -> None:
        self.model, self.kv_pool, self.sizes = model, kv_pool, tuple(sizes)
        self.eager = eager
        self.pad_slot = pad_slot
        device, rows = kv_pool.device, self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        # The attention backend's metadata of the largest size, all padding; every size reads its head.
        static = attention.graph_buffers(kv_pool, block_size, pad_slot, rows, max_blocks, kv_scales)
        self._metas = {n: static.head(n) for n in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # iterations run through this object (the GPU tests check graphs were used)
        if capture:
            self._capture()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _forward(self, n: int) -> torch.Tensor:
        return self.model(self.input_ids[:n], self.positions[:n], self._metas[n])

    @torch.inference_mode()
    def _capture(self) -> None:
        """One graph per size, largest first so the smaller ones reuse its memory pool; each size runs
        once before capture (building its masks, compiling what is not compiled yet)."""
        logger.info("capturing CUDA graphs for decode batches of %s requests ...", ", ".join(map(str, self.sizes)))
        t0 = time.perf_counter()
        pool = None
        for n in reversed(self.sizes):
            self._forward(n)
            torch.cuda.synchronize(self.kv_pool.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[n] = self._forward(n)
            pool = graph.pool()
            self._graphs[n] = graph
        torch.cuda.synchronize(self.kv_pool.device)
        logger.info("captured %d CUDA graphs in %.1f s", len(self._graphs), time.perf_counter() - t0)

    def padded_size(self, ordered: list[PlannedRequest]) -> int | None:
        """The size a decode iteration of these requests pads to; None when some request feeds more than
        one token (or none after a cached prefix), or runs an adapter (captured without adapter rows)."""
        if not all(len(pr.token_ids) == 1 and pr.start > 0 and pr.lora_slot < 0 for pr in ordered):
            return None
        return graph_size_for(len(ordered), self.sizes)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: IterationLayout) -> torch.Tensor:
        if layout.padded_to is None:
            return self.eager.forward(input_ids, positions, layout)
        if layout.padded_to > sum(layout.lengths):
            layout.pad_slot = self.pad_slot  # (its padding rows write there)
        return self.run(input_ids, positions, layout.metadata())

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The (n, E) hidden states of a decode iteration already padded to a captured size n (its
        metadata built with the padding rows: AttentionMetadata.build(..., padding=, pad_slot=))."""
        n = input_ids.shape[0]
        if n not in self._metas:
            raise ValueError(f"{n} rows is not one of the captured sizes {self.sizes}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self._metas[n].copy_(meta)
        self.replays += 1
        if n in self._graphs:
            self._graphs[n].replay()
            return self._outputs[n]
        return self._forward(n)
