"""The batched backend's attention for a verifying iteration on the CPU: short requests (speculating
requests verifying 4 proposed tokens) batched in groups (orca/tuning.py's VERIFYING_MAX_ROWS 8, as it is)
against one masked reference call each (1, as it was). Not a test, not a benchmark of record:
docs/BENCHMARKS.md quotes its output with the command and the time.

    PYTHONPATH=.:client .venv/bin/python scripts/experiments/short_requests.py

SmolLM2-135M's attention shape (9 query heads, 3 K/V heads, head size 64), 30 layers, blocks of 16, 2
threads; an iteration of 4 increments and 8 requests of 5 new tokens after 100-300 cached ones; the two
ways alternate in 3 rounds, medians of 7 iterations each (the metadata built outside the timing).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from orca import tuning
from orca.models.attention import AttentionMetadata

BLOCK, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 9, 3, 64, 30


def main() -> None:
    torch.set_num_threads(2)
    rng = random.Random(0)
    lengths = [1] * 4 + [5] * 8
    context = [rng.randint(100, 300) for _ in lengths]
    tables, next_block = [], 0
    for n, past in zip(lengths, context):
        used = -(-(n + past) // BLOCK)
        tables.append(list(range(next_block, next_block + used)))
        next_block += used
    for dtype in (torch.bfloat16, torch.float32):
        pool = torch.randn(LAYERS, 2, KV_HEADS, next_block * BLOCK, HEAD_DIM, dtype=dtype)
        q = torch.randn(sum(lengths), HEADS, HEAD_DIM, dtype=dtype)
        result: dict[str, list[float]] = {"per request": [], "grouped": []}
        for _ in range(3):
            for mode, most in (("per request", 1), ("grouped", tuning.VERIFYING_MAX_ROWS)):
                saved, tuning.VERIFYING_MAX_ROWS = tuning.VERIFYING_MAX_ROWS, most
                times = []
                for _ in range(7):
                    meta = AttentionMetadata.build(lengths, context, tables, BLOCK, pool, backend="batched")
                    start = time.perf_counter()
                    for layer in range(LAYERS):
                        meta.attend(q, pool[layer], 0.125, None)
                    times.append(time.perf_counter() - start)
                tuning.VERIFYING_MAX_ROWS = saved
                result[mode].append(statistics.median(times) * 1e3)
        ratios = ", ".join(f"{a / b:.2f}x" for a, b in zip(result["per request"], result["grouped"]))
        print(f"{str(dtype).removeprefix('torch.')}: per request "
              f"{', '.join(f'{t:.1f}' for t in result['per request'])} ms; grouped "
              f"{', '.join(f'{t:.1f}' for t in result['grouped'])} ms; per round {ratios}")


if __name__ == "__main__":
    main()
