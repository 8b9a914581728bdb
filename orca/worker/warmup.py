"""The load-time warm-up: what init_kv_pool does once the pool is allocated, and where the worker's
runner is chosen (runners.py): flex's kernels compiled where they compile at load, then CUDA graphs
captured (cuda_graphs.py), else CPU graphs compiled (cpu_graphs/), else the eager runner after a prompt
and an increment. Each runs hand-built iterations (warmup_plans.py) into blocks no request owns yet.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from orca.core.plan import StepPlan
from orca.worker.cpu_graphs import CPUGraphs
from orca.worker.cuda_graphs import DecodeGraphs, graph_sizes
from orca.worker.runners import EagerRunner
from orca.worker.warmup_plans import (
    PROMPT_AND_INCREMENT_SLOTS,
    VERIFICATION_ROWS,
    blocks_after,
    prompt_and_increment_plans,
    warm_up_plans,
)

if TYPE_CHECKING:
    from orca.worker.worker import Worker

logger = logging.getLogger(__package__)  # "orca.worker": the worker's lines, whichever module says them


def warm_up(worker: Worker, num_blocks: int) -> None:
    """Everything init_kv_pool does after allocating the pool of `num_blocks` blocks (and, with CUDA graphs,
    one more for padding rows): flex's kernels, then the runner."""
    eager = EagerRunner(worker.model, worker.par, worker.stages)
    worker.runner = eager
    if worker.attention.compiles_at_load(worker.device):
        warm_up_flex(worker)
    if worker.no_graphs_reason is None:
        # Captured on CUDA; elsewhere (only when a test lifts why_no_graphs' reasons) the same padded
        # iterations run eagerly on the static buffers.
        worker.runner = DecodeGraphs(
            worker.model, worker.attention, worker.kv_pool, worker.kv_layout.block_size,
            pad_slot=num_blocks * worker.kv_layout.block_size,
            sizes=graph_sizes(worker.config.max_bs), capture=worker.device.type == "cuda",
            max_blocks=-(-worker.max_len() // worker.kv_layout.block_size) + 1, kv_scales=worker.kv_scales,
            eager=eager,
        )
        return
    if worker.device.type == "cuda":
        logger.info("decode iterations run without CUDA graphs: %s", worker.no_graphs_reason)
    compile_forward(worker)
    if worker.runner is eager and worker.par.layout.world_size == 1 and not worker.attention.zeroed_pool \
            and worker.kv_pool.shape[3] >= PROMPT_AND_INCREMENT_SLOTS:
        # A prompt and an increment now, not in the first request: oneDNN's primitives, the allocator's
        # blocks and this thread's OpenMP team are made here.
        run_warm_up(worker, prompt_and_increment_plans(worker.kv_layout.block_size), "warming up the model")


def compile_forward(worker: Worker) -> None:
    """worker.runner: the CPU graphs, compiled by their warm-up iterations, unless no_compile_reason
    finds something against them or compiling fails (then the eager runner stays, and the reason says why)."""
    slots = worker.kv_pool.shape[3]
    if worker.no_compile_reason is None and slots < PROMPT_AND_INCREMENT_SLOTS:
        worker.no_compile_reason = (f"the K/V pool holds fewer than the {PROMPT_AND_INCREMENT_SLOTS} slots the "
                                    "warm-up uses")
    if worker.no_compile_reason is not None:
        logger.info("the forward pass runs eagerly: %s", worker.no_compile_reason)
        return
    eager = worker.runner
    try:
        verifies = (worker.config.speculative_method != "off"
                    and slots >= PROMPT_AND_INCREMENT_SLOTS + VERIFICATION_ROWS)
        runner = CPUGraphs(worker.model, None if worker.lora is None else worker.lora.batch, verifies)
        worker.runner = runner
        plans = runner.warm_up_plans(worker.kv_layout.block_size, worker.max_len(), slots, worker.lora is not None)
        runner.compile(lambda: run_warm_up(worker, plans, "compiling the forward pass"), worker.device)
    except Exception as exc:  # noqa: BLE001 - e.g. no C++ compiler: serve eagerly, say why
        worker.runner = eager
        worker.no_compile_reason = f"compiling failed ({str(exc).splitlines()[0][:300]})"
        logger.warning("the forward pass runs eagerly: %s", worker.no_compile_reason)


def warm_up_flex(worker: Worker) -> None:
    """Compiles the attention backend's kernels now rather than in a user's request (warm_up_plans of its
    warm_up_rows), into blocks no request owns; skipped when the pool is too small to hold them."""
    plans = warm_up_plans(worker.kv_layout.block_size, worker.max_len(), worker.attention.warm_up_rows)
    if not pool_holds(worker, plans):
        return
    logger.info("compiling flex attention kernels for %s (once, at load) ...", worker.device)
    t0 = time.perf_counter()
    run_warm_up(worker, plans, "warming up flex attention")
    logger.info("flex attention compiled in %.1f s", time.perf_counter() - t0)


def pool_holds(worker: Worker, plans: tuple[StepPlan, ...]) -> bool:
    """Whether the K/V pool has every block warm-up `plans` write (the highest included)."""
    return worker.kv_pool is not None and blocks_after(plans) * worker.kv_layout.block_size <= worker.kv_pool.shape[3]


def run_warm_up(worker: Worker, plans: tuple[StepPlan, ...], what: str) -> None:
    """Executes load-time iterations (blocks no request owns yet) and forgets their requests."""
    for plan in plans:
        result = worker.execute(plan)
        if result.error:
            raise RuntimeError(f"{what} failed: {result.error}")
    worker.forget_requests()
