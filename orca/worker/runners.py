"""How an iteration's forward pass runs: one runner per execution mode, chosen at load (warmup.py):
EagerRunner (here), DecodeGraphs (cuda_graphs.py: padded decode iterations replayed), CPUGraphs
(cpu_graphs/: torch.compile graphs on a CPU). A runner takes flat token ids and positions and the
IterationLayout, and returns the hidden rows; `padded_size`: the rows a decode iteration is padded to.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from orca.core.plan import PlannedRequest
from orca.models.attention import IterationLayout
from orca.parallel import ParallelContext
from orca.worker.pipeline import StageLink


class Runner(Protocol):
    def padded_size(self, ordered: list[PlannedRequest]) -> int | None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: IterationLayout) -> torch.Tensor: ...


class EagerRunner:
    """The model's forward pass as its modules run it."""

    def __init__(self, model: nn.Module, par: ParallelContext, stages: StageLink) -> None:
        self.model, self.par, self.stages = model, par, stages

    def padded_size(self, ordered: list[PlannedRequest]) -> int | None:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: IterationLayout) -> torch.Tensor:
        received = None if self.par.is_first_stage else self.stages.receive(input_ids.shape[0])
        return self.model(input_ids, positions, layout.metadata(), hidden=received)  # (T, E)
