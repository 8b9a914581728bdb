"""The load-time warm-up: what init_kv_pool does once the pool is allocated, before any request.

In order: flex attention's kernels compiled where they compile at load (CUDA: warm_up_flex), the decode
iterations' CUDA graphs captured (DecodeGraphs, orca/worker/cuda_graphs.py), the forward pass compiled
(CompiledForward, orca/worker/compiled.py: compile_forward), else a prompt and an increment run eagerly.
Each runs hand-built iterations (the plans below) into blocks no request owns yet, and forgets their
requests (run_warm_up).

The plans: prompt_and_increment_plans (a two-token prompt and its increment, the first two of every
warm-up), warm_up_plans (then an iteration of each of a backend's warm_up_rows token rows; flex's:
flex_warm_up_plans), verification_plan (a speculating stream's verification of its proposals) and
few_warm_up_plans (a decode step of two requests).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from orca.core.plan import PlannedRequest, SamplingSpec, StepPlan
from orca.models.attention import get_backend
from orca.worker.compiled import CompiledForward
from orca.worker.cuda_graphs import DecodeGraphs, graph_sizes

if TYPE_CHECKING:
    from orca.worker.worker import Worker

logger = logging.getLogger(__package__)  # "orca.worker": the worker's lines, whichever module says them

PROMPT_AND_INCREMENT_SLOTS = 3  # what prompt_and_increment_plans' iterations write
VERIFICATION_ROWS = 2  # what verification_plan's iteration writes, after prompt_and_increment_plans'


# -- the orchestration ---------------------------------------------------------------------------------
def warm_up(worker: Worker, num_blocks: int) -> None:
    """Everything init_kv_pool does after allocating the pool of `num_blocks` blocks (and, with CUDA graphs,
    one more for padding rows): flex's kernels, the decode graphs, the compiled forward pass, else an eager
    prompt and increment."""
    if worker.attention.compiles_at_load(worker.device):
        warm_up_flex(worker)
    if worker.no_graphs_reason is None:
        # Captured on CUDA; elsewhere (only when a test lifts why_no_graphs' reasons) the same padded
        # iterations run eagerly on the static buffers.
        worker.decode_graphs = DecodeGraphs(
            worker.model, worker.attention, worker.kv_pool, worker.kv_layout.block_size,
            pad_slot=num_blocks * worker.kv_layout.block_size,
            sizes=graph_sizes(worker.config.max_bs), capture=worker.device.type == "cuda",
            max_blocks=-(-worker.max_len() // worker.kv_layout.block_size) + 1, kv_scales=worker.kv_scales,
        )
    elif worker.device.type == "cuda":
        logger.info("decode iterations run without CUDA graphs: %s", worker.no_graphs_reason)
    compile_forward(worker)
    if worker.compiled is None and worker.par.layout.world_size == 1 and not worker.attention.zeroed_pool \
            and worker.kv_pool.shape[3] >= PROMPT_AND_INCREMENT_SLOTS:
        # A prompt and an increment now, not in the first request: oneDNN's primitives, the allocator's
        # blocks and this thread's OpenMP team are made here (the compiled path's warm-up does the same;
        # flex has its own on CUDA, and its pool, zeroed_pool, stays as allocated: zeroed).
        run_warm_up(worker, prompt_and_increment_plans(worker.kv_layout.block_size), "warming up the model")


def compile_forward(worker: Worker) -> None:
    """worker.compiled: the compiled forward pass, compiled by its warm-up iterations, where
    worker.no_compile_reason finds nothing against it (else, or when compiling fails, that reason says
    why not, and the forward pass runs eagerly)."""
    block_size = worker.kv_layout.block_size
    if worker.no_compile_reason is None and worker.kv_pool.shape[3] < PROMPT_AND_INCREMENT_SLOTS:
        worker.no_compile_reason = (f"the K/V pool holds fewer than the {PROMPT_AND_INCREMENT_SLOTS} slots the "
                                    "warm-up uses")
    if worker.no_compile_reason is not None:
        logger.info("the forward pass runs eagerly: %s", worker.no_compile_reason)
        return
    try:
        verifies = (worker.config.speculative_method != "off"
                    and worker.kv_pool.shape[3] >= PROMPT_AND_INCREMENT_SLOTS + VERIFICATION_ROWS)
        worker.compiled = CompiledForward(worker.model, None if worker.lora is None else worker.lora.batch, verifies)
        # The prompt compiles the graph (the token count unbacked: any count); the increment compiles
        # LoneStep's; a speculating engine's verification of 2 tokens LoneStep's of several rows.
        plans = prompt_and_increment_plans(block_size)
        if worker.compiled.float_rows is not None:  # and the float copies' graph (FloatCopyRows)
            with_float = warm_up_plans(block_size, worker.max_len(), (worker.compiled.float_rows,))
            if pool_holds(worker, with_float):  # (else those iterations run eagerly)
                plans = with_float
        if verifies:  # (the prompt's request again: its blocks, and the next, stay consecutive)
            plans += (verification_plan(block_size),)
        if worker.lora is not None:  # the graph of adapter iterations too (slot 0, empty: no delta)
            plans += tuple(dataclasses.replace(plan, requests=tuple(
                dataclasses.replace(pr, request_id=f"{pr.request_id}-lora", lora_slot=0)
                for pr in plan.requests)) for plan in plans)
        if worker.compiled.few is not None:  # FewStep's graph: a decode step of two requests
            with_few = plans + few_warm_up_plans(block_size, blocks_after(plans))
            if pool_holds(worker, with_few):  # (else such steps run the op)
                plans = with_few
        worker.compiled.compile(lambda: run_warm_up(worker, plans, "compiling the forward pass"), worker.device)
    except Exception as exc:  # noqa: BLE001 - e.g. no C++ compiler: serve eagerly, say why
        worker.compiled = None
        worker.no_compile_reason = f"compiling failed ({str(exc).splitlines()[0][:300]})"
        logger.warning("the forward pass runs eagerly: %s", worker.no_compile_reason)


def warm_up_flex(worker: Worker) -> None:
    """Compiles the attention backend's kernels now rather than in a user's request (warm_up_plans with
    its warm_up_rows; flex's on CUDA, the one backend that compiles at load, hence the name). Writes only
    to blocks no request owns yet; skipped when the pool is too small to hold them."""
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


# -- the plans -----------------------------------------------------------------------------------------
def flex_warm_up_plans(block_size: int, max_len: int) -> tuple[StepPlan, ...]:
    """The iterations that compile every graph compiled flex attention needs (its warm_up_rows, and why:
    orca/models/attention/flex.py)."""
    return warm_up_plans(block_size, max_len, get_backend("flex").warm_up_rows)


def warm_up_plans(block_size: int, max_len: int, rows: Sequence[int]) -> tuple[StepPlan, ...]:
    """The iterations that compile an attention backend's kernels at load: a two-token prompt, its
    one-token increment, then an iteration of each of `rows` token rows (the backend's warm_up_rows), each
    as prompts of at most `max_len` tokens (the model's positions), in blocks taken in order from the
    first. Every layer runs (sliding-window layers compile their own mask)."""
    spec = SamplingSpec(1.0, 0, 1.0, 0)
    plans = list(prompt_and_increment_plans(block_size))
    next_block = -(-PROMPT_AND_INCREMENT_SLOTS // block_size)

    def blocks(before: int, after: int) -> tuple[int, ...]:
        nonlocal next_block
        n = -(-after // block_size) - -(-before // block_size)
        next_block += n
        return tuple(range(next_block - n, next_block))

    for k, num_rows in enumerate(rows):
        name = f"warm-up-{chr(ord('b') + k)}"  # (warm-up-a: the prompt and its increment)
        lengths = [max_len] * (num_rows // max_len) + ([num_rows % max_len] if num_rows % max_len else [])
        plans.append(StepPlan(-1, tuple(
            PlannedRequest(f"{name}-{i}", (0,) * n, 0, blocks(0, n), spec, sample_step=0) for i, n in enumerate(lengths)
        )))
    return tuple(plans)


def prompt_and_increment_plans(block_size: int) -> tuple[StepPlan, StepPlan]:
    """A two-token prompt and its one-token increment, in the pool's first blocks (PROMPT_AND_INCREMENT_SLOTS
    slots): the compiled forward pass's warm-up (orca/worker/compiled.py), and the first two iterations of
    an attention backend's (warm_up_plans)."""
    spec = SamplingSpec(1.0, 0, 1.0, 0)
    prompt_blocks, all_blocks = -(-2 // block_size), -(-PROMPT_AND_INCREMENT_SLOTS // block_size)
    return (
        StepPlan(-1, (PlannedRequest("warm-up-a", (0, 0), 0, tuple(range(prompt_blocks)), spec, sample_step=0),)),
        StepPlan(-1, (PlannedRequest("warm-up-a", (0,), 2, tuple(range(prompt_blocks, all_blocks)), sample_step=1),)),
    )


def verification_plan(block_size: int) -> StepPlan:
    """After prompt_and_increment_plans' two, their request's next VERIFICATION_ROWS tokens (as a speculating
    stream verifies its proposals), its blocks still consecutive: what compiles LoneStep's graph of
    several rows (orca/worker/compiled.py)."""
    before = PROMPT_AND_INCREMENT_SLOTS
    blocks = tuple(range(-(-before // block_size), -(-(before + VERIFICATION_ROWS) // block_size)))
    return StepPlan(-1, (PlannedRequest("warm-up-a", (0,) * VERIFICATION_ROWS, before, blocks),))


def few_warm_up_plans(block_size: int, first_block: int) -> tuple[StepPlan, StepPlan]:
    """Two two-token prompts, then a step of one token each, in blocks from `first_block` on: what compiles
    FewStep's graph (orca/worker/compiled.py)."""
    spec = SamplingSpec(1.0, 0, 1.0, 0)
    prompt_blocks, all_blocks = -(-2 // block_size), -(-3 // block_size)
    firsts = (first_block, first_block + all_blocks)
    names = ("warm-up-few-0", "warm-up-few-1")
    return (
        StepPlan(-1, tuple(PlannedRequest(name, (0, 0), 0, tuple(range(b, b + prompt_blocks)), spec, sample_step=0)
                           for name, b in zip(names, firsts))),
        StepPlan(-1, tuple(PlannedRequest(name, (0,), 2, tuple(range(b + prompt_blocks, b + all_blocks)),
                                          sample_step=1) for name, b in zip(names, firsts))),
    )


def blocks_after(plans: tuple[StepPlan, ...]) -> int:
    """The first block after every block warm-up `plans` write."""
    return 1 + max((b for plan in plans for pr in plan.requests for b in pr.new_block_ids), default=-1)
