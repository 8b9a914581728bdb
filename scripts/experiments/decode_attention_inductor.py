"""One decode row's attention on the CPU, written as plain tensor ops and compiled by inductor, against the
SDPA call the reference backend makes for it: what a decode iteration's attention inside the compiled
forward pass could cost (today it is an opaque op, orca::selective_attention, that calls SDPA eagerly).
SmolLM2's heads (9 query heads, 3 K/V heads, head size 64), bfloat16, 2 threads; the keys and values of 30
layers, each layer's a view of a pool of 16,384 slots (as the reference reads a request whose blocks are
consecutive), the context length dynamic in the compiled function. Median microseconds per layer of 21
rounds, the three alternating. Not a test, not a benchmark of record: docs/BENCHMARKS.md and the issue
notes quote its output with the command and the host.

    PYTHONPATH=. .venv/bin/python scripts/experiments/decode_attention_inductor.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

KV_HEADS, GROUP, DIM, LAYERS, SLOTS, START = 3, 3, 64, 30, 16384, 800
SCALE = DIM**-0.5


def sdpa(q: torch.Tensor, pool: torch.Tensor, start: int, ctx: int) -> list[torch.Tensor]:
    """The reference backend's call for an increment: its group of query heads as rows of its K/V head."""
    return [F.scaled_dot_product_attention(q[layer : layer + 1], pool[layer, 0, :, start : start + ctx][None],
                                           pool[layer, 1, :, start : start + ctx][None], scale=SCALE)
            for layer in range(LAYERS)]


def products(q: torch.Tensor, pool: torch.Tensor, start: int, ctx: int) -> list[torch.Tensor]:
    """Scores and output as broadcast products and sums (float32), which inductor fuses into loops."""
    outs = []
    for layer in range(LAYERS):
        keys = pool[layer, 0, :, start : start + ctx].float()  # (KVH, ctx, D)
        values = pool[layer, 1, :, start : start + ctx].float()
        scores = (q[layer].float()[:, :, None, :] * keys[:, None]).sum(-1) * SCALE  # (KVH, G, ctx)
        probs = torch.softmax(scores, -1)
        outs.append((probs[:, :, :, None] * values[:, None]).sum(2).to(q.dtype))  # (KVH, G, D)
    return outs


def matmuls(q: torch.Tensor, pool: torch.Tensor, start: int, ctx: int) -> list[torch.Tensor]:
    """The same as two batched matmuls (float32)."""
    outs = []
    for layer in range(LAYERS):
        keys = pool[layer, 0, :, start : start + ctx].float()
        values = pool[layer, 1, :, start : start + ctx].float()
        probs = torch.softmax((q[layer].float() @ keys.transpose(1, 2)) * SCALE, -1)
        outs.append((probs @ values).to(q.dtype))
    return outs


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    pool = torch.randn(LAYERS, 2, KV_HEADS, SLOTS, DIM, dtype=torch.bfloat16)
    q = torch.randn(LAYERS, KV_HEADS, GROUP, DIM, dtype=torch.bfloat16)
    compiled_products = torch.compile(products, dynamic=True)
    compiled_matmuls = torch.compile(matmuls, dynamic=True)
    with torch.inference_mode():
        for ctx in (150, 151, 400):  # compile (dynamic in ctx after the second)
            compiled_products(q, pool, START, ctx)
            compiled_matmuls(q, pool, START, ctx)
        print("context | SDPA us/layer | compiled products | compiled matmuls | max difference")
        for ctx in (150, 400, 1000):
            fns: dict[str, Callable[[], list[torch.Tensor]]] = {
                "sdpa": lambda ctx=ctx: sdpa(q, pool, START, ctx),
                "products": lambda ctx=ctx: compiled_products(q, pool, START, ctx),
                "matmuls": lambda ctx=ctx: compiled_matmuls(q, pool, START, ctx),
            }
            want, got = fns["sdpa"](), fns["products"]()
            diff = max((w[0] - g).abs().max().item() for w, g in zip(want, got))
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(21):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn()
                    times[name].append((time.perf_counter() - t0) / 20 / LAYERS * 1e6)
            m = {k: statistics.median(v) for k, v in times.items()}
            print(f"{ctx} | {m['sdpa']:.1f} | {m['products']:.1f} | {m['matmuls']:.1f} | {diff:.4f}", flush=True)


if __name__ == "__main__":
    main()
