"""The load-time warm-up's iterations: hand-built plans into blocks no request owns yet (a prompt and its
increment first, then each backend's warm_up_rows, a verification, a few-request decode step)."""

from __future__ import annotations

from collections.abc import Sequence

from orca.core.plan import PlannedRequest, SamplingSpec, StepPlan
from orca.models.attention import get_backend

PROMPT_AND_INCREMENT_SLOTS = 3  # what prompt_and_increment_plans' iterations write
VERIFICATION_ROWS = 2  # what verification_plan's iteration writes, after prompt_and_increment_plans'


def flex_warm_up_plans(block_size: int, max_len: int) -> tuple[StepPlan, ...]:
    """The iterations that compile every graph compiled flex attention needs (its warm_up_rows, and why:
    orca/models/attention/flex.py)."""
    return warm_up_plans(block_size, max_len, get_backend("flex").warm_up_rows)


def warm_up_plans(block_size: int, max_len: int, rows: Sequence[int]) -> tuple[StepPlan, ...]:
    """The iterations that compile an attention backend's kernels at load: a two-token prompt, its
    increment, then an iteration of each of `rows` token rows, as prompts of at most `max_len` tokens, in
    blocks taken in order from the first. Every layer runs (sliding-window layers compile their own mask)."""
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
    slots): the first two iterations of every warm-up."""
    spec = SamplingSpec(1.0, 0, 1.0, 0)
    prompt_blocks, all_blocks = -(-2 // block_size), -(-PROMPT_AND_INCREMENT_SLOTS // block_size)
    return (
        StepPlan(-1, (PlannedRequest("warm-up-a", (0, 0), 0, tuple(range(prompt_blocks)), spec, sample_step=0),)),
        StepPlan(-1, (PlannedRequest("warm-up-a", (0,), 2, tuple(range(prompt_blocks, all_blocks)), sample_step=1),)),
    )


def verification_plan(block_size: int) -> StepPlan:
    """After prompt_and_increment_plans' two, their request's next VERIFICATION_ROWS tokens (as a speculating
    stream verifies its proposals), its blocks still consecutive: what compiles the CPU graphs' lone
    verification."""
    before = PROMPT_AND_INCREMENT_SLOTS
    blocks = tuple(range(-(-before // block_size), -(-(before + VERIFICATION_ROWS) // block_size)))
    return StepPlan(-1, (PlannedRequest("warm-up-a", (0,) * VERIFICATION_ROWS, before, blocks),))


def few_warm_up_plans(block_size: int, first_block: int) -> tuple[StepPlan, StepPlan]:
    """Two two-token prompts, then a step of one token each, in blocks from `first_block` on: what compiles
    the CPU graphs' few step."""
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
