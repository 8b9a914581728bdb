"""Executors hand StepPlans to workers and StepResults back, in order.

Up to n_workers plans are in flight (one per pipeline stage). The executor alone knows where workers run;
the driver imports no model code unless it makes an in-process worker (make_executor).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from orca.config import EngineConfig
from orca.core.plan import StepPlan, StepResult


class WorkerFailure(RuntimeError):
    """The workers cannot go on (one died, hung, or failed in a way that leaves the others stuck): the
    engine fails every request and stops serving."""


class Executor(Protocol):
    num_blocks: int  # K/V pool blocks every worker holds (the minimum over workers)
    max_in_flight: int  # plans it can hold at once (pipeline stages): the most n_workers can be

    def submit(self, plan: StepPlan) -> None: ...  # may raise WorkerFailure
    def collect(self) -> StepResult: ...  # the oldest submitted plan's result; may raise WorkerFailure
    def shutdown(self) -> None: ...


class InProcessExecutor:
    """One worker in the engine's own process: a submitted plan runs at once; collect returns results
    in submission order."""

    max_in_flight = 1

    def __init__(self, config: EngineConfig) -> None:
        from orca.worker import Worker  # the model code: loaded only where a worker runs in this process

        self.worker = Worker(config)
        self.num_blocks = self.worker.determine_num_blocks()
        if self.num_blocks < 1:
            layout = self.worker.kv_layout
            raise ValueError(
                f"the K/V pool holds no block of {layout.block_size} tokens ({self.worker.bytes_per_block} "
                f"bytes each{', with the draft model' if self.worker.draft_layout is not None else ''}): "
                "raise kv_cache_bytes or n_slots, or lower block_size"
                + (f"; on this GPU gpu_memory_utilization {config.gpu_memory_utilization} of its memory leaves "
                   "nothing after the weights, the profiled activations and what other processes hold (another "
                   "engine on the same GPU takes its own share)"
                   if self.worker.device.type == "cuda" and config.n_slots is None and config.kv_cache_bytes is None
                   else "")
            )
        self.worker.init_kv_pool(self.num_blocks)
        self._results: deque[StepResult] = deque()

    def submit(self, plan: StepPlan) -> None:
        self._results.append(self.worker.execute(plan))

    def inject_fault(self, message: str) -> None:
        """The failure tests: the worker raises `message` inside the next plan it executes."""
        self.worker.inject_fault(message)

    def collect(self) -> StepResult:
        return self._results.popleft()

    def shutdown(self) -> None:
        self._results.clear()


def make_executor(config: EngineConfig) -> Executor:
    """The executor `config` asks for: worker processes with tensor or pipeline parallelism, else one
    worker in this process."""
    if config.distributed:
        from orca.executor.distributed import DistributedExecutor

        return DistributedExecutor(config)
    return InProcessExecutor(config)
