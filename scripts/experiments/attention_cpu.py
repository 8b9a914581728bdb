"""Attention for a decode batch on the CPU: the reference's per-request calls against the batched
increments, per layer call (orca/models/attention/, `attention_backend`). Not a test, not a benchmark of
record: docs/BENCHMARKS.md quotes its output with the command and the time.

    .venv/bin/python scripts/experiments/attention_cpu.py

SmolLM2-135M's attention shape (9 query heads, 3 K/V heads, head size 64), float32, 2 threads, blocks of 16
tokens, a pool of 30 layers x 16,384 slots (as the engine's for SmolLM2: each layer's keys and values
come from memory, not from the cache the previous call left). For 1 to 32 increments with U(33, 190)
cached tokens each (the offline benchmark's spread), median microseconds of one layer's attention (this
iteration's keys and values written into the pool, then attention; what `selective_attention` runs;
timed over the 30 layers), with each request's blocks either consecutive (the reference reads them as a
view of the pool, no copy) or shuffled over the pool (it gathers them, as after many requests came and
went).
"""

from __future__ import annotations

import random

import torch
from compile_cpu import _median_ms  # this directory's timing helper (the script's own directory is on sys.path)

from orca.models.attention import AttentionMetadata, selective_attention

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
POOL_BLOCKS = 1024


def main() -> None:
    torch.set_num_threads(2)
    pool = torch.randn(LAYERS, 2, KV_HEADS, POOL_BLOCKS * BLOCK, DIM)
    print("increments | blocks | reference us | batched us | reference / batched")
    for n in (1, 2, 3, 4, 8, 16, 32):
        rng = random.Random(n)
        context = sorted(rng.randint(33, 190) for _ in range(n))  # the worker orders increments so
        for placement in ("consecutive", "shuffled"):
            blocks = list(range(POOL_BLOCKS))
            if placement == "shuffled":
                rng.shuffle(blocks)
            per = -(-(max(context) + 1) // BLOCK)
            tables = [blocks[i * per : (i + 1) * per] for i in range(n)]
            q, kv = torch.randn(n, HEADS, DIM), torch.randn(n, 2, KV_HEADS, DIM)
            us = {}
            with torch.inference_mode():
                for backend in ("reference", "batched"):
                    meta = AttentionMetadata.build([1] * n, context, tables, BLOCK, pool, backend=backend)
                    def step(m: AttentionMetadata = meta, q: torch.Tensor = q, kv: torch.Tensor = kv) -> None:
                        for layer in range(LAYERS):
                            selective_attention(q, kv, m, layer, DIM**-0.5)

                    us[backend] = _median_ms(step, reps=30) * 1e3 / LAYERS
            print(f"{n:10d} | {placement:11s} | {us['reference']:12.0f} | {us['batched']:10.0f} | "
                  f"{us['reference'] / us['batched']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
