"""Pipeline stages: the activations one stage hands the next (orca/parallel.py says which layers each
stage holds). A later stage receives the previous stage's (T, hidden) output from the same tensor-parallel
rank; a stage sends its own on without waiting, going on with the next plan in flight.
"""

from __future__ import annotations

import torch

from orca.parallel import ParallelContext


class StageLink:
    """This rank's link to the ranks of the stages before and after it (same tensor-parallel rank)."""

    def __init__(self, par: ParallelContext, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.par = par
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._sends: list[tuple[object, torch.Tensor]] = []  # activations on their way to the next stage

    def receive(self, num_tokens: int) -> torch.Tensor:
        """The previous stage's (T, E) output for this plan, from the same tensor-parallel rank there."""
        import torch.distributed as dist

        hidden = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, src=self.par.layout.rank(self.par.stage - 1, self.par.tp_rank))
        return hidden

    def send(self, hidden: torch.Tensor) -> None:
        """Sends (T, E) to the next stage without waiting for it to receive: this stage goes on with the
        next plan in flight. The previous send is completed first (its buffer must outlive it)."""
        import torch.distributed as dist

        for handle, _ in self._sends:
            handle.wait()
        hidden = hidden.contiguous()
        handle = dist.isend(hidden, dst=self.par.layout.rank(self.par.stage + 1, self.par.tp_rank))
        self._sends = [(handle, hidden)]
