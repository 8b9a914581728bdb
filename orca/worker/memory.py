"""The K/V pool's size and allocation: how many blocks a worker holds (n_slots, kv_cache_bytes, or on CUDA
what gpu_memory_utilization leaves after profiling the largest iteration), the pool's tensors (the
model's, and the draft's beside it), and the GPU memory an earlier engine left.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from orca.core.plan import PlannedRequest, SamplingSpec, StepPlan
from orca.worker.kv_cache import blocks_from_gpu_memory

if TYPE_CHECKING:
    from orca.worker.worker import Worker

logger = logging.getLogger(__package__)  # "orca.worker": the worker's lines, whichever module says them

PROFILE_TOKENS_WITHOUT_BUDGET = 8192


def determine_num_blocks(worker: Worker) -> int:
    """How many K/V blocks this worker can hold: n_slots or kv_cache_bytes when given; else on CUDA what
    gpu_memory_utilization leaves after a profiling pass at the largest iteration, on CPU the default
    kv_cache_bytes. A block holds the draft's keys and values too (bytes_per_block), minus its scratch."""
    cfg = worker.config
    if cfg.n_slots is not None:
        return cfg.n_slots // cfg.block_size
    if cfg.kv_cache_bytes is not None or worker.device.type != "cuda":
        return max(0, cfg.effective_kv_cache_bytes - _draft_scratch_bytes(worker)) // worker.bytes_per_block
    return profile_gpu_blocks(worker)


def _draft_scratch_bytes(worker: Worker) -> int:
    return 0 if worker.draft is None else worker.draft.scratch_bytes


def profile_plan(max_bs: int, block_size: int, max_len: int, num_tokens: int) -> tuple[StepPlan, int]:
    """The profiling iteration: `num_tokens` prompt tokens in sequences of max_len, and the blocks of the
    scratch pool it runs on."""
    blocks = -(-num_tokens // block_size) + max_bs
    lengths = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
    plan_requests, next_block = [], 0
    for i, n in enumerate(lengths):
        used = -(-n // block_size)
        plan_requests.append(PlannedRequest(
            f"profile-{i}", tuple([0] * n), 0, tuple(range(next_block, next_block + used)),
            SamplingSpec(1.0, 0, 1.0, 0), sample_step=0,
        ))
        next_block += used
    return StepPlan(-1, tuple(plan_requests)), blocks


def profile_gpu_blocks(worker: Worker) -> int:
    """The blocks gpu_memory_utilization leaves on this GPU after profiling the largest iteration on a
    scratch pool (released after)."""
    cfg = worker.config
    device = worker.device
    max_len = worker.max_len()
    # The largest iteration: the token budget; without one, max_bs whole prompts is no useful bound, so the
    # profile stops at PROFILE_TOKENS_WITHOUT_BUDGET (or one full-length prompt).
    unbounded = min(cfg.max_bs * max_len, max(max_len, PROFILE_TOKENS_WITHOUT_BUDGET))
    num_tokens = min(cfg.max_num_batched_tokens or unbounded, cfg.max_bs * max_len)
    torch.cuda.empty_cache()  # (what an earlier engine left was collected before the weights loaded)
    torch.cuda.reset_peak_memory_stats(device)
    plan, blocks = profile_plan(cfg.max_bs, cfg.block_size, max_len, num_tokens)
    allocate_pool(worker, blocks)
    result = worker.execute(plan)
    worker.forget_requests()
    if result.error:
        raise RuntimeError(f"the profiling iteration ({num_tokens} tokens) failed: {result.error}")
    torch.cuda.synchronize(device)
    scratch = _draft_scratch_bytes(worker)
    peak = torch.cuda.max_memory_allocated(device) - blocks * worker.bytes_per_block - scratch
    release_pool(worker)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Memory in use beyond this process's live tensors counts against the budget too: other processes, the
    # CUDA context, cached segments the allocator could not release.
    used_elsewhere = total - free - torch.cuda.memory_allocated(device)
    n = blocks_from_gpu_memory(total, max(0, used_elsewhere) + peak + scratch, cfg.gpu_memory_utilization,
                               worker.bytes_per_block)
    logger.info("K/V pool from GPU memory: %d blocks (profiled %d tokens, peak %.2f GiB)", n, num_tokens,
                peak / 2**30)
    return n


def allocate_pool(worker: Worker, num_blocks: int) -> None:
    """The worker's kv_pool (and a quantized pool's kv_scales) of num_blocks blocks, and the draft's pool
    over the same blocks; zeroed for a backend that weighs masked slots by 0 (flex; kv_cache.py)."""
    zeroed = worker.attention.zeroed_pool
    worker.kv_pool = worker.kv_layout.allocate(num_blocks, worker.device, zeroed=zeroed)
    worker.kv_scales = worker.kv_layout.allocate_scales(num_blocks, worker.device, zeroed=zeroed)
    if worker.draft is not None:
        worker.draft.allocate(num_blocks, zeroed)


def release_pool(worker: Worker) -> None:
    worker.kv_pool = worker.kv_scales = None
    if worker.draft is not None:
        worker.draft.release()


def release_cached_memory() -> None:
    """Frees what an earlier engine of this process left on the GPU: a dropped engine caught in a reference
    cycle (collected now), then the allocator's cached segments, which a new engine's weights could
    otherwise pin so that its own pool no longer fits."""
    gc.collect()
    torch.cuda.empty_cache()
